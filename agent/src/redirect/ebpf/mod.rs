//! Enrolling a pod in the eBPF redirection.
//!
//! The programs are loaded and attached once per node; a pod is enrolled by:
//! 1. the reply routing in its netns (`routing`: fwmark 0x111 -> local table,
//!    tcp_fwmark_accept), which ztunnel's inbound connections need;
//! 2. its sk_lookup link ([`crate::bpf::inbound`]): inbound capture, one netns link
//!    and nothing on its interfaces, so any interface kind serves;
//! 3. two map writes, by netns cookie (socket programs) and by address
//!    (the sk_lookup program, [`addresses`]), after which new connections
//!    are redirected.
//!
//! Removing a pod deletes its map entries first (new connections stop being
//! redirected at once) and then its link. The reply routing stays while the
//! pod lives: it matches only connections ztunnel made to the app, so
//! connections open at removal keep working.
//!
//! Everything is owned by the pod's netns cookie, which is never reused: the
//! pods map is keyed by it and every address entry holds it; the pod's link
//! is pinned under it. An address two enrolled pods claim belongs to the
//! newer ([`super::claims`]); removing a pod deletes only the entries that
//! still hold its cookie. Pods an earlier agent enrolled may carry its tc
//! steering filters: they are removed when the pod is enrolled again or
//! removed.
//!
//! [`EbpfRedirection`] is the mode: the loaded programs and maps
//! ([`Dataplane`]) and what it keeps of the pods it enrolled
//! ([`registry`]).

mod addresses;
mod registry;

use std::{net::IpAddr, path::PathBuf, time::Instant};

use ambpf_common::{IpKey, PodConfig, maps, pod_flags, ztunnel};
use aya::maps::{HashMap, MapData};
use tracing::{info, warn};

pub use self::addresses::{AddressConflict, claimed};
use self::registry::PodRegistry;
pub use super::steering::detach_steering;
use super::{CheckScope, PodKey, Violation, podnet, routing, rtnl::NetlinkError};
pub use crate::bpf::keys::{ip_addr, ip_key};
use crate::{
    bpf::{
        Dataplane, MapWriteError, PinLayout,
        listener_adoption::{SocketHolders, listening_inodes},
        tc::AttachError,
    },
    netns::{Netns, NetnsError},
};

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
    #[error(transparent)]
    Nftables(#[from] super::nftables::NftablesError),
    #[error("pod in {netns} has no IPv4 or IPv6 address to redirect")]
    NoAddress { netns: PathBuf },
    #[error(
        "cannot enrol the pod in {netns}: map {map} is full ({capacity} entries, set by \
         {flag}); raise {flag} (chart value maps.maxPods) and restart the agent after \
         `ambpf uninstall`, or run fewer pods on this node"
    )]
    MapFull {
        netns: PathBuf,
        map: &'static str,
        capacity: u32,
        flag: &'static str,
    },
    #[error(
        "pod in {netns} has {count} {family} addresses ({}): ambpf redirects a pod by one \
         address of each family, as Kubernetes gives a pod, and would let connections to the \
         others bypass ztunnel; not enrolled",
        addresses.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
        count = addresses.len()
    )]
    TooManyAddresses {
        netns: PathBuf,
        family: &'static str,
        addresses: Vec<std::net::IpAddr>,
    },
    #[error("updating map {map}: {cause}")]
    Map {
        map: &'static str,
        cause: aya::maps::MapError,
    },
    #[error("removing links under {dir}: {cause}")]
    Unlink { dir: PathBuf, cause: std::io::Error },
    #[error("inbound steering on {iface} in {netns}: {cause}")]
    Steering {
        iface: String,
        netns: PathBuf,
        cause: NetlinkError,
    },
    #[error("the sk_lookup link of the pod in {netns}: {cause}")]
    InboundLink {
        netns: PathBuf,
        cause: std::io::Error,
    },
    #[error("ztunnel's inbound listener of the pod in {netns}: {cause}")]
    InboundListener {
        netns: PathBuf,
        cause: crate::bpf::listener_adoption::AdoptionError,
    },
    #[error("entering the open connections of the pod in {netns} in conntrack: {cause}")]
    Conntrack {
        netns: PathBuf,
        cause: std::io::Error,
    },
    #[error("recording the pod's name: {0}")]
    PodNames(#[from] crate::bpf::inspect::InspectError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
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
    /// Addresses another enrolled pod claims too ([`super::claims`]).
    pub conflicts: Vec<AddressConflict>,
    /// Where the enrolment's time went.
    #[serde(skip)]
    pub steps: super::EnrolSteps,
}

impl EnrolledPod {
    pub fn key(&self) -> PodKey {
        PodKey {
            netns_cookie: self.netns_cookie,
            netns_inode: self.netns_inode,
        }
    }
}

impl From<MapWriteError> for EnrollError {
    fn from(e: MapWriteError) -> Self {
        Self::Map {
            map: e.map,
            cause: e.cause,
        }
    }
}

fn pods_by_netns(
    dataplane: &mut Dataplane,
) -> Result<HashMap<&mut MapData, u64, PodConfig>, EnrollError> {
    HashMap::try_from(dataplane.map_mut(maps::PODS_BY_NETNS)).map_err(map_err(maps::PODS_BY_NETNS))
}

fn pods_by_ip(
    dataplane: &mut Dataplane,
) -> Result<HashMap<&mut MapData, IpKey, PodConfig>, EnrollError> {
    HashMap::try_from(dataplane.map_mut(maps::PODS_BY_IP)).map_err(map_err(maps::PODS_BY_IP))
}

/// Every enrolled pod, as pinned.
fn pinned_pods(dataplane: &mut Dataplane) -> Result<Vec<PodConfig>, EnrollError> {
    Ok(pods_by_netns(dataplane)?
        .iter()
        .filter_map(Result::ok)
        .map(|(_, pod)| pod)
        .collect())
}

/// The eBPF redirection: the programs and maps loaded once per node, and the
/// pods this process enrolled.
pub struct EbpfRedirection {
    dataplane: Dataplane,
    pods: PodRegistry,
    /// Where the host's sockets are held, for ztunnel's listeners opened
    /// before the programs ran ([`crate::bpf::listener_adoption`]).
    socket_holders: SocketHolders,
}

impl EbpfRedirection {
    /// Redirects pods through `dataplane`'s programs (loaded, and serving
    /// the node: [`Dataplane::serve_node`]).
    pub fn new(dataplane: Dataplane) -> Self {
        Self {
            dataplane,
            pods: PodRegistry::default(),
            socket_holders: SocketHolders::default(),
        }
    }

    pub fn dataplane(&self) -> &Dataplane {
        &self.dataplane
    }

    pub fn dataplane_mut(&mut self) -> &mut Dataplane {
        &mut self.dataplane
    }

    pub fn pins(&self) -> &PinLayout {
        self.dataplane.pins()
    }

    /// Enrols the pod whose network namespace is `netns`. Idempotent: a
    /// pod enrolled again gets its settings and addresses refreshed, and
    /// releases the addresses it no longer has.
    pub fn enroll_pod(
        &mut self,
        netns: &Netns,
        dns_capture: bool,
    ) -> Result<EnrolledPod, EnrollError> {
        // One visit to the pod's namespace: what it holds and its reply
        // routing.
        let path = netns.path();
        let visit = Instant::now();
        let (net, listeners, mut steps) = netns.run(|| -> Result<_, EnrollError> {
            let mut steps = super::EnrolSteps::default();
            // One netlink socket for the whole visit.
            let (mut rtnl, net) = steps.time("inspect", || -> Result<_, EnrollError> {
                let mut rtnl = podnet::open_rtnl(path)?;
                let net = podnet::inspect_with(&mut rtnl, path)?;
                Ok((rtnl, net))
            })?;
            // Addresses first: a pod without any gets nothing installed.
            super::pod_addresses(&net, netns)?;
            steps.time("routing", || {
                routing::install_reply_routing_with(&mut rtnl, path)
            })?;
            // ztunnel's listener, when it already serves the pod.
            let listeners = listening_inodes(ztunnel::INBOUND_PORT).map_err(|cause| {
                EnrollError::InboundListener {
                    netns: path.to_owned(),
                    cause: cause.into(),
                }
            })?;
            Ok((net, listeners, steps))
        })??;
        // Entering the namespace (a thread and setns) is what the steps leave.
        steps.rest("enter netns", visit.elapsed());
        let maps_started = Instant::now();
        let cookie = net.netns_cookie;
        // The rest of the enrolment's lines carry the cookie.
        tracing::Span::current().record("netns_cookie", cookie);
        let mut config = PodConfig {
            netns_cookie: cookie,
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

        let previous = pods_by_netns(&mut self.dataplane)?.get(&cookie, 0).ok();
        self.pods.hold(cookie, keep(netns)?);
        // ztunnel already serves a pod that has a listener on its inbound
        // port before this agent ever linked it: the pod is captured by
        // another mode or by Istio's node agent. Its listener, which
        // sock_ops never saw, is filed first, and its link comes last, once
        // its addresses are written: a lookup in between would find neither
        // and be refused, while the old capture still serves it.
        let first_link = previous.is_none_or(|p| p.flags & pod_flags::INBOUND_LINK == 0);
        let served = first_link && !listeners.is_empty();
        let linking = Instant::now();
        if served {
            if let Err(e) = self.adopt_listener(netns, cookie, &listeners) {
                return Err(self.undo_new_pod(cookie, previous.is_none(), e));
            }
        } else if let Err(e) = self.link_in_place_of(netns, cookie, previous.as_ref()) {
            // Before its addresses are written: from then on every inbound
            // connection to the pod is ztunnel's or refused, never the app's.
            return Err(self.undo_new_pod(cookie, previous.is_none(), e));
        }
        let mut linked = linking.elapsed();
        config.flags |= pod_flags::INBOUND_LINK;
        // Taken over from Istio's REDIRECT rules: see the flag; it stays for
        // the pod's life.
        let kept = previous.map_or(0, |p| p.flags & pod_flags::OUTBOUND_VIA_POD_ADDRESS);
        if served || kept != 0 {
            config.flags |= pod_flags::OUTBOUND_VIA_POD_ADDRESS;
        }
        // Its counters first, so its first redirected connection is counted;
        // a new pod that does not fit leaves nothing behind.
        if let Err((map, e)) = self.dataplane.add_pod_counters(cookie) {
            let e = self.map_full_or(netns, map, e);
            return Err(self.undo_new_pod(cookie, previous.is_none(), e));
        }

        // From here on, new connections of the pod are redirected.
        let inserted = pods_by_netns(&mut self.dataplane)?.insert(cookie, config, 0);
        if let Err(e) = inserted {
            let e = self.map_full_or(netns, maps::PODS_BY_NETNS, e);
            return Err(self.undo_new_pod(cookie, previous.is_none(), e));
        }
        let conflicts = match self.claim_addresses(&config, previous.as_ref()) {
            Ok(conflicts) => conflicts,
            Err(e) => {
                self.pods.forget_claims();
                return Err(e);
            }
        };
        if served {
            let linking = Instant::now();
            if let Err(e) = self.link_in_place_of(netns, cookie, previous.as_ref()) {
                // Nothing half-done: the old capture still serves the pod.
                let key = PodKey {
                    netns_cookie: cookie,
                    netns_inode: netns.inode(),
                };
                if let Err(undo) = self.unenroll_pod(key) {
                    warn!(
                        "undoing the enrolment of {}: {undo}",
                        netns.path().display()
                    );
                }
                return Err(e);
            }
            linked += linking.elapsed();
        }
        steps.0.push(("link", linked));
        steps
            .0
            .push(("maps", maps_started.elapsed().saturating_sub(linked)));
        info!(
            "enrolled pod in {} (cookie {cookie}, {addresses:?}, dns capture {dns_capture})",
            netns.path().display(),
        );
        Ok(EnrolledPod {
            netns: netns.path().to_owned(),
            netns_inode: netns.inode(),
            netns_cookie: cookie,
            addresses,
            interfaces: net.interfaces.iter().map(|i| i.name.clone()).collect(),
            dns_capture,
            conflicts,
            steps,
        })
    }

    /// Files ztunnel's listener of the pod, opened before any program ran
    /// ([`crate::bpf::listener_adoption`]).
    fn adopt_listener(
        &mut self,
        netns: &Netns,
        cookie: u64,
        listeners: &[u64],
    ) -> Result<(), EnrollError> {
        let adopted = self.dataplane.adopt_inbound_listener(
            cookie,
            netns.inode(),
            listeners,
            &mut self.socket_holders,
        );
        match adopted {
            Ok(true) => info!(
                "filed ztunnel's inbound listener of the pod in {}, open before the programs \
                 were",
                netns.path().display()
            ),
            Ok(false) => {}
            Err(cause) => {
                return Err(EnrollError::InboundListener {
                    netns: netns.path().to_owned(),
                    cause,
                });
            }
        }
        Ok(())
    }

    /// The pod's sk_lookup link; a pod an earlier agent enrolled with tc
    /// filters that parsed SYNs loses them, the link capturing in their
    /// place.
    fn link_in_place_of(
        &mut self,
        netns: &Netns,
        cookie: u64,
        previous: Option<&PodConfig>,
    ) -> Result<(), EnrollError> {
        self.attach_inbound_link(netns, cookie)?;
        if let Some(previous) = previous.filter(|p| p.flags & pod_flags::INBOUND_LINK == 0) {
            let qdisc_created = previous.flags & pod_flags::STEERING_QDISC_CREATED != 0;
            detach_steering(netns, qdisc_created)?;
        }
        Ok(())
    }

    /// `e` as [`EnrollError::MapFull`] when the kernel refused a new entry
    /// because `map` is full (E2BIG).
    fn map_full_or(&self, netns: &Netns, map: &'static str, e: aya::maps::MapError) -> EnrollError {
        let full = matches!(&e, aya::maps::MapError::SyscallError(s)
            if s.io_error.raw_os_error() == Some(libc::E2BIG));
        match self.dataplane.capacities().of(map) {
            Some((capacity, flag)) if full => EnrollError::MapFull {
                netns: netns.path().to_owned(),
                map,
                capacity,
                flag,
            },
            _ => map_err(map)(e),
        }
    }

    /// Takes back what enrolling a pod that was not enrolled before
    /// installed (its counters and sk_lookup link; the reply routing matches
    /// only ztunnel's connections and stays, as at removal), and returns `e`.
    fn undo_new_pod(&mut self, cookie: u64, new: bool, e: EnrollError) -> EnrollError {
        if !new {
            return e;
        }
        self.pods.release(cookie);
        if let Err((map, undo)) = self.dataplane.remove_pod_counters(cookie) {
            warn!("removing the counters of a pod that was not enrolled from {map}: {undo}");
        }
        if let Err(undo) = self.remove_inbound_link(cookie) {
            warn!("removing the sk_lookup link of a pod that was not enrolled: {undo}");
        }
        e
    }

    /// Removes the pod `pod`; works after its namespace is gone. Deletes
    /// only what the pod still owns. Returns whether it was enrolled.
    pub fn unenroll_pod(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        let cookie = pod.netns_cookie;
        let found = pods_by_netns(&mut self.dataplane)?.get(&cookie, 0).ok();
        if let Some(config) = found {
            for ip in claimed(&config) {
                let release = self.claims()?.release(ip, cookie);
                if let Err(e) = self.apply_release(ip, cookie, release) {
                    self.pods.forget_claims();
                    return Err(e);
                }
            }
            match pods_by_netns(&mut self.dataplane)?.remove(&cookie) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err(maps::PODS_BY_NETNS)(e)),
            }
        }
        self.dataplane
            .remove_pod_counters(cookie)
            .map_err(|(map, e)| map_err(map)(e))?;
        // New connections go direct from here. Only a pod an earlier agent
        // enrolled has a steering filter to remove (it goes with the
        // namespace if that is gone already); nothing of this agent's is in
        // the pod's namespace but its reply routing, which stays.
        let held = self.pods.release(cookie);
        if let Some(config) = found.filter(|c| c.flags & pod_flags::INBOUND_LINK == 0) {
            let netns = held.or_else(|| {
                super::check::locate_pods(&[config], &[])
                    .remove(&cookie)
                    .flatten()
            });
            if let Some(netns) = netns {
                let qdisc_created = config.flags & pod_flags::STEERING_QDISC_CREATED != 0;
                detach_steering(&netns, qdisc_created)?;
            }
        }
        self.remove_inbound_link(cookie)?;
        if let Err(e) = crate::bpf::pod_names::remove(self.pins(), cookie) {
            // A stale name is harmless: cookies are never reused.
            tracing::warn!("pod with {pod}: forgetting its name: {e}");
        }
        if found.is_some() {
            info!("removed pod with {pod}");
        }
        Ok(found.is_some())
    }

    /// Every enrolled pod, as pinned.
    pub fn pinned_pods(&mut self) -> Result<Vec<PodConfig>, EnrollError> {
        pinned_pods(&mut self.dataplane)
    }

    /// Attaches (or updates) the pod's sk_lookup link.
    fn attach_inbound_link(&mut self, netns: &Netns, cookie: u64) -> Result<(), EnrollError> {
        self.dataplane
            .attach_inbound_link(netns, cookie)
            .map_err(|cause| EnrollError::InboundLink {
                netns: netns.path().to_owned(),
                cause,
            })
    }

    /// Removes the pod's sk_lookup link. ztunnel's listener stays filed
    /// while it is open (the kernel drops it from the map when it closes):
    /// a pod enrolled again meanwhile is served by the same listener, which
    /// ztunnel does not open anew.
    fn remove_inbound_link(&mut self, cookie: u64) -> Result<(), EnrollError> {
        crate::bpf::inbound::remove_link(self.pins(), cookie).map_err(|cause| EnrollError::Unlink {
            dir: self.pins().pod_links_dir(cookie),
            cause,
        })
    }
}

/// A handle of our own on `netns` (the caller's may close), held while its
/// pod is enrolled ([`PodRegistry`]).
fn keep(netns: &Netns) -> Result<Netns, NetnsError> {
    use std::os::fd::AsRawFd as _;
    Netns::open(&format!("/proc/self/fd/{}", netns.file().as_raw_fd()))
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> EnrollError {
    move |source| EnrollError::Map { map, cause: source }
}

impl super::PodRedirection for EbpfRedirection {
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

    fn unenroll(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        self.unenroll_pod(pod)
    }

    fn record_identity(
        &mut self,
        pod: PodKey,
        identity: &crate::bpf::pod_names::PodIdentity,
    ) -> Result<(), EnrollError> {
        Ok(crate::bpf::pod_names::record(
            self.pins(),
            pod.netns_cookie,
            identity,
        )?)
    }

    fn enrolled(&mut self) -> Result<Vec<PodKey>, EnrollError> {
        Ok(self
            .pinned_pods()?
            .iter()
            .map(|pod| PodKey {
                netns_cookie: pod.netns_cookie,
                netns_inode: pod.netns_inode,
            })
            .collect())
    }

    fn check(&mut self, pods: &[(PodKey, &Netns)], scope: CheckScope) -> Vec<Violation> {
        if scope == CheckScope::Full {
            super::check::foreign::log_warnings(self.pins());
        }
        super::check::ebpf_state(self.pins(), pods, scope)
    }

    fn repair(&mut self, violations: &[Violation]) -> Vec<PodKey> {
        super::check::repair_ebpf_state(self, violations)
    }
}
