//! Enrolling a pod in the eBPF redirection.
//!
//! The programs are loaded and attached once per node; a pod is enrolled by:
//! 1. the reply routing in its netns (`routing`: fwmark 0x111 -> local table,
//!    tcp_fwmark_accept), which ztunnel's inbound connections need;
//! 2. the inbound-steering TC program attached to each of its interfaces;
//! 3. two map writes, by netns cookie (socket programs) and by address
//!    (packet programs), after which new connections are redirected.
//!
//! Removing a pod deletes its map entries first (new connections stop being
//! redirected at once) and then its TC links. The reply routing stays while
//! the pod lives: it matches only connections ztunnel made to the app, so
//! connections open at removal keep working.

use std::{net::IpAddr, path::PathBuf};

use ambpf_common::{Direction, IpKey, NodeConfig, PodConfig, maps, pod_flags, programs};
use aya::{
    maps::{Array, HashMap, MapData},
    programs::TcAttachType,
};
use log::{info, warn};

use super::{podnet, routing};
use crate::{
    bpf::{
        Dataplane,
        tc::{AttachError, TcHook},
    },
    netns::Netns,
};

/// Inbound steering runs on ingress only.
const POD_HOOKS: [TcHook; 1] = [(
    Direction::Ingress,
    TcAttachType::Ingress,
    programs::POD_INGRESS,
)];

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error(transparent)]
    PodNet(#[from] podnet::PodNetError),
    #[error(transparent)]
    Routing(#[from] routing::RoutingError),
    #[error(transparent)]
    Attach(#[from] AttachError),
    #[error(transparent)]
    Iptables(#[from] super::iptables::IptablesError),
    #[error("pod in {netns} has no IPv4 or IPv6 address to redirect")]
    NoAddress { netns: PathBuf },
    #[error("updating map {map}: {source}")]
    Map {
        map: &'static str,
        source: aya::maps::MapError,
    },
    #[error("removing links under {dir}: {source}")]
    Unlink {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// What enrolment found and programmed for one pod.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EnrolledPod {
    pub netns: PathBuf,
    pub netns_inode: u64,
    pub netns_cookie: u64,
    pub addresses: Vec<IpAddr>,
    pub interfaces: Vec<String>,
    pub dns_capture: bool,
}

pub fn ip_key(ip: IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(v4) => IpKey::v4(v4.octets()),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpKey::v4(v4.octets()),
            None => IpKey::v6(v6.octets()),
        },
    }
}

impl Dataplane {
    fn pods_by_netns(&mut self) -> Result<HashMap<&mut MapData, u64, PodConfig>, EnrollError> {
        HashMap::try_from(self.map_mut(maps::PODS_BY_NETNS)).map_err(|source| EnrollError::Map {
            map: maps::PODS_BY_NETNS,
            source,
        })
    }

    fn pods_by_ip(&mut self) -> Result<HashMap<&mut MapData, IpKey, PodConfig>, EnrollError> {
        HashMap::try_from(self.map_mut(maps::PODS_BY_IP)).map_err(|source| EnrollError::Map {
            map: maps::PODS_BY_IP,
            source,
        })
    }

    /// Node-wide settings.
    pub fn set_node_config(&mut self, config: NodeConfig) -> Result<(), EnrollError> {
        let map_err = |source| EnrollError::Map {
            map: maps::NODE_CONFIG,
            source,
        };
        let mut array: Array<_, NodeConfig> =
            Array::try_from(self.map_mut(maps::NODE_CONFIG)).map_err(map_err)?;
        array.set(0, config, 0).map_err(map_err)
    }

    /// Replaces the node's own addresses: traffic from them reaches apps
    /// directly (kubelet probes).
    pub fn set_host_addresses(&mut self, addresses: &[IpAddr]) -> Result<(), EnrollError> {
        let map_err = |source| EnrollError::Map {
            map: maps::HOST_ADDRS,
            source,
        };
        let mut map: HashMap<_, IpKey, u8> =
            HashMap::try_from(self.map_mut(maps::HOST_ADDRS)).map_err(map_err)?;
        let mut wanted: Vec<IpKey> = addresses.iter().map(|ip| ip_key(*ip)).collect();
        wanted.sort_unstable_by_key(|k| k.addr);
        wanted.dedup();
        // A node with more addresses than the map holds still starts: the
        // rest are not exempted (their traffic goes through ztunnel), and
        // the operator is told.
        let capacity = maps::HOST_ADDRS_MAX as usize;
        if wanted.len() > capacity {
            warn!(
                "the node has {} addresses; only {capacity} fit {} and exempt host traffic",
                wanted.len(),
                maps::HOST_ADDRS
            );
            wanted.truncate(capacity);
        }
        let keep: std::collections::HashSet<IpKey> = wanted.iter().copied().collect();
        let stale: Vec<IpKey> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !keep.contains(k))
            .collect();
        for key in stale {
            map.remove(&key).map_err(map_err)?;
        }
        for key in wanted {
            map.insert(key, 1, 0).map_err(map_err)?;
        }
        Ok(())
    }

    /// Enrols the pod whose network namespace is `netns`. Idempotent.
    pub fn enroll_pod(
        &mut self,
        netns: &Netns,
        dns_capture: bool,
    ) -> Result<EnrolledPod, EnrollError> {
        let net = podnet::inspect(netns)?;
        let mut config = PodConfig {
            netns_cookie: net.netns_cookie,
            netns_inode: netns.inode(),
            flags: if dns_capture {
                pod_flags::DNS_CAPTURE
            } else {
                0
            },
            ..Default::default()
        };
        let addresses = super::pod_addresses(&net, netns)?;
        for (slot, ip) in config.ips.iter_mut().zip(&addresses) {
            *slot = ip_key(*ip);
        }

        routing::install_reply_routing(netns)?;
        let links_dir = self.pins().pod_links_dir(netns.inode());
        for iface in &net.interfaces {
            if let Err(e) = self.attach_tc(netns, &iface.name, &POD_HOOKS, &links_dir) {
                let _ = std::fs::remove_dir_all(&links_dir);
                return Err(e.into());
            }
        }
        // From here on, new connections of the pod are redirected.
        let map_err = |map| move |source| EnrollError::Map { map, source };
        self.pods_by_netns()?
            .insert(net.netns_cookie, config, 0)
            .map_err(map_err(maps::PODS_BY_NETNS))?;
        let mut by_ip = self.pods_by_ip()?;
        for ip in &addresses {
            by_ip
                .insert(ip_key(*ip), config, 0)
                .map_err(map_err(maps::PODS_BY_IP))?;
        }
        info!(
            "enrolled pod in {} (cookie {}, {:?}, dns capture {dns_capture})",
            netns.path().display(),
            net.netns_cookie,
            addresses
        );
        Ok(EnrolledPod {
            netns: netns.path().to_owned(),
            netns_inode: netns.inode(),
            netns_cookie: net.netns_cookie,
            addresses,
            interfaces: net.interfaces.iter().map(|i| i.name.clone()).collect(),
            dns_capture,
        })
    }

    /// Removes the pod with netns inode `netns_inode`; works after its
    /// namespace is gone. Returns whether it was enrolled.
    pub fn unenroll_pod(&mut self, netns_inode: u64) -> Result<bool, EnrollError> {
        let map_err = |map| move |source| EnrollError::Map { map, source };
        let found = self
            .pods_by_netns()?
            .iter()
            .filter_map(Result::ok)
            .find(|(_, pod)| pod.netns_inode == netns_inode);
        if let Some((cookie, pod)) = found {
            let mut by_ip = self.pods_by_ip()?;
            for ip in pod.ips.iter().filter(|ip| **ip != IpKey::default()) {
                match by_ip.remove(ip) {
                    Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                    Err(e) => return Err(map_err(maps::PODS_BY_IP)(e)),
                }
            }
            self.pods_by_netns()?
                .remove(&cookie)
                .map_err(map_err(maps::PODS_BY_NETNS))?;
        }
        let links_dir = self.pins().pod_links_dir(netns_inode);
        let had_links = links_dir.exists();
        match std::fs::remove_dir_all(&links_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(EnrollError::Unlink {
                    dir: links_dir,
                    source,
                });
            }
        }
        if found.is_some() {
            info!("removed pod with netns inode {netns_inode}");
        }
        Ok(found.is_some() || had_links)
    }

    /// Every enrolled pod, by netns cookie.
    pub fn enrolled_pods(&mut self) -> Result<Vec<PodConfig>, EnrollError> {
        Ok(self
            .pods_by_netns()?
            .iter()
            .filter_map(Result::ok)
            .map(|(_, pod)| pod)
            .collect())
    }
}

impl super::PodRedirection for Dataplane {
    fn mode(&self) -> super::RedirectMode {
        super::RedirectMode::Ebpf
    }

    fn enroll(
        &mut self,
        netns: &Netns,
        options: super::EnrollOptions,
    ) -> Result<EnrolledPod, EnrollError> {
        self.enroll_pod(netns, options.dns_capture)
    }

    fn unenroll(&mut self, netns_inode: u64) -> Result<bool, EnrollError> {
        self.unenroll_pod(netns_inode)
    }

    fn enrolled(&mut self) -> Result<Vec<u64>, EnrollError> {
        Ok(self
            .enrolled_pods()?
            .iter()
            .map(|pod| pod.netns_inode)
            .collect())
    }
}
