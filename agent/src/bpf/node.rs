//! The node-wide maps: settings, the node's network namespace (whose
//! connections to pods are exempt from capture) and its addresses.

use std::{net::IpAddr, path::Path};

use ambpf_common::{IpKey, NodeConfig, maps};
use aya::maps::{Array, HashMap};
use tracing::warn;

use super::{Dataplane, cgroup::CgroupError, keys::ip_key};

/// A map the agent could not write.
#[derive(Debug, thiserror::Error)]
#[error("updating map {map}: {cause}")]
pub struct MapWriteError {
    pub map: &'static str,
    pub cause: aya::maps::MapError,
}

/// Why [`Dataplane::serve_node`] failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeSetupError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Map(#[from] MapWriteError),
}

impl Dataplane {
    /// Serves the node once the programs are loaded: the socket programs
    /// attached to the pods' cgroup, the node's DNS capture setting, the
    /// node's network namespace (`node_netns_cookie`: the connections it
    /// opens to pods, kubelet's probes, reach the apps uncaptured) and its
    /// addresses.
    pub fn serve_node(
        &mut self,
        cgroup: &Path,
        dns_capture: bool,
        host_addresses: &[IpAddr],
        node_netns_cookie: u64,
    ) -> Result<(), NodeSetupError> {
        // Before the socket programs run: the node's connections are filed
        // from their first one.
        self.set_node_netns(node_netns_cookie)?;
        self.attach_cgroup(cgroup)?;
        self.set_node_config(NodeConfig {
            dns_capture: u32::from(dns_capture),
            _pad: 0,
        })?;
        self.set_host_addresses(host_addresses)?;
        Ok(())
    }

    /// The node's network namespace, by cookie.
    pub fn set_node_netns(&mut self, cookie: u64) -> Result<(), MapWriteError> {
        let map_err = |cause| MapWriteError {
            map: maps::NODE_NETNS,
            cause,
        };
        let mut array: Array<_, u64> =
            Array::try_from(self.map_mut(maps::NODE_NETNS)).map_err(map_err)?;
        array.set(0, cookie, 0).map_err(map_err)
    }

    /// Node-wide settings.
    pub fn set_node_config(&mut self, config: NodeConfig) -> Result<(), MapWriteError> {
        let map_err = |cause| MapWriteError {
            map: maps::NODE_CONFIG,
            cause,
        };
        let mut array: Array<_, NodeConfig> =
            Array::try_from(self.map_mut(maps::NODE_CONFIG)).map_err(map_err)?;
        array.set(0, config, 0).map_err(map_err)
    }

    /// Replaces the node's own addresses: traffic from them reaches apps
    /// directly (kubelet probes).
    pub fn set_host_addresses(&mut self, addresses: &[IpAddr]) -> Result<(), MapWriteError> {
        let map_err = |cause| MapWriteError {
            map: maps::HOST_ADDRS,
            cause,
        };
        let capacity = self.capacities().host_addresses as usize;
        let mut map: HashMap<_, IpKey, u8> =
            HashMap::try_from(self.map_mut(maps::HOST_ADDRS)).map_err(map_err)?;
        let mut wanted: Vec<IpKey> = addresses.iter().map(|ip| ip_key(*ip)).collect();
        wanted.sort_unstable_by_key(|k| k.addr);
        wanted.dedup();
        // A node with more addresses than the map holds still starts: the
        // rest are not exempted (their traffic goes through ztunnel), and
        // the operator is told.
        if wanted.len() > capacity {
            warn!(
                "the node has {} addresses; only {capacity} fit {} (--max-host-addresses) and \
                 exempt host traffic: traffic from the others to pods goes through ztunnel",
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
}
