//! Enrolling a pod in the eBPF redirection.
//!
//! The programs are loaded and attached once per node; a pod is enrolled by:
//! 1. the reply routing in its netns (`routing`: fwmark 0x111 -> local table,
//!    tcp_fwmark_accept), which ztunnel's inbound connections need;
//! 2. the inbound-steering TC program attached to each of its interfaces, as
//!    a direct-action `cls_bpf` filter ([`super::steering`]), and on the
//!    sk_lookup inbound path its sk_lookup link ([`crate::bpf::inbound`]);
//! 3. two map writes, by netns cookie (socket programs) and by address
//!    (packet programs), after which new connections are redirected.
//!
//! Removing a pod deletes its map entries first (new connections stop being
//! redirected at once) and then its steering filters. The reply routing
//! stays while the pod lives: it matches only connections ztunnel made to
//! the app, so connections open at removal keep working.
//!
//! Everything is owned by the pod's netns cookie, which is never reused: the
//! pods map is keyed by it and every address entry holds it; the pod's
//! steering filters live in its own namespace. An address two enrolled pods
//! claim belongs to the newer ([`super::claims`]); removing a pod deletes
//! only the entries that still hold its cookie.

use std::{net::IpAddr, os::fd::AsFd as _, path::PathBuf, time::Instant};

use ambpf_common::{IpKey, PodConfig, maps, pod_flags, programs};
use aya::maps::{HashMap, MapData};
use tracing::{info, warn};

use super::{
    CheckScope, PodKey, Violation,
    claims::{AddressClaims, Claim, Release},
    link_kind, podnet, routing,
    rtnl::{NetlinkError, Rtnl},
    steering,
};
use crate::{
    bpf::{Dataplane, tc::AttachError},
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
    #[error("cannot enrol the pod in {netns}: its interface {iface} is {kind}, and {reason}")]
    UnsteerableInterface {
        iface: String,
        netns: PathBuf,
        kind: String,
        reason: String,
    },
    #[error("the steering program: {0}")]
    SteeringProgram(String),
    #[error("the sk_lookup link of the pod in {netns}: {cause}")]
    InboundLink {
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

/// An address the enrolled pod shares with another enrolled pod.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AddressConflict {
    pub address: IpAddr,
    /// The other pod.
    pub other_netns_cookie: u64,
    /// Whether the enrolled pod owns the address now (it is the newer).
    pub won: bool,
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
            cause: source,
        })
    }

    fn pods_by_ip(&mut self) -> Result<HashMap<&mut MapData, IpKey, PodConfig>, EnrollError> {
        HashMap::try_from(self.map_mut(maps::PODS_BY_IP)).map_err(|source| EnrollError::Map {
            map: maps::PODS_BY_IP,
            cause: source,
        })
    }

    /// Enrols the pod whose network namespace is `netns`. Idempotent: a
    /// pod enrolled again gets its settings and addresses refreshed, and
    /// releases the addresses it no longer has.
    pub fn enroll_pod(
        &mut self,
        netns: &Netns,
        dns_capture: bool,
    ) -> Result<EnrolledPod, EnrollError> {
        // One visit to the pod's namespace: what it holds, its reply
        // routing and its steering filters.
        let program = self.steering_program()?;
        let path = netns.path();
        let visit = Instant::now();
        let (net, qdisc_created, mut steps) = netns.run(|| -> Result<_, EnrollError> {
            let mut steps = super::EnrolSteps::default();
            // One netlink socket for the whole visit.
            let (mut rtnl, net) = steps.time("inspect", || -> Result<_, EnrollError> {
                let mut rtnl = podnet::open_rtnl(path)?;
                let net = podnet::inspect_with(&mut rtnl, path)?;
                Ok((rtnl, net))
            })?;
            // Addresses first: a pod without any gets nothing installed.
            super::pod_addresses(&net, netns)?;
            link_kind::refuse_unsteerable(&mut rtnl, path, &net.interfaces)?;
            steps.time("routing", || {
                routing::install_reply_routing_with(&mut rtnl, path)
            })?;
            let qdisc_created = steps.time("steering", || {
                attach_steering_with(&mut rtnl, path, &net.interfaces, program.as_fd())
            })?;
            Ok((net, qdisc_created, steps))
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

        let previous = self.pods_by_netns()?.get(&cookie, 0).ok();
        if qdisc_created
            || previous.is_some_and(|p| p.flags & pod_flags::STEERING_QDISC_CREATED != 0)
        {
            config.flags |= pod_flags::STEERING_QDISC_CREATED;
        }
        self.held.insert(cookie, keep(netns)?);
        // Before its addresses are written: the steering program hands the
        // pod's SYNs to this link from then on.
        if let Err(e) = self.attach_inbound_link(netns, cookie) {
            return Err(self.undo_new_pod(netns, cookie, previous.is_none(), qdisc_created, e));
        }
        // Its counters first, so its first redirected connection is counted;
        // a new pod that does not fit leaves nothing behind.
        if let Err(e) = self.add_pod_counters(cookie) {
            let e = self.map_full_or(netns, maps::POD_COUNTERS, e);
            return Err(self.undo_new_pod(netns, cookie, previous.is_none(), qdisc_created, e));
        }

        // From here on, new connections of the pod are redirected.
        let inserted = self.pods_by_netns()?.insert(cookie, config, 0);
        if let Err(e) = inserted {
            let e = self.map_full_or(netns, maps::PODS_BY_NETNS, e);
            return Err(self.undo_new_pod(netns, cookie, previous.is_none(), qdisc_created, e));
        }
        let conflicts = match self.claim_addresses(&config, previous.as_ref()) {
            Ok(conflicts) => conflicts,
            Err(e) => {
                self.address_claims = None;
                return Err(e);
            }
        };
        steps.0.push(("maps", maps_started.elapsed()));
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

    /// `e` as [`EnrollError::MapFull`] when the kernel refused a new entry
    /// because `map` is full (E2BIG).
    fn map_full_or(&self, netns: &Netns, map: &'static str, e: aya::maps::MapError) -> EnrollError {
        let full = matches!(&e, aya::maps::MapError::SyscallError(s)
            if s.io_error.raw_os_error() == Some(libc::E2BIG));
        match self.capacities().of(map) {
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
    /// installed (its counters and steering; the reply routing matches only
    /// ztunnel's connections and stays, as at removal), and returns `e`.
    fn undo_new_pod(
        &mut self,
        netns: &Netns,
        cookie: u64,
        new: bool,
        qdisc_created: bool,
        e: EnrollError,
    ) -> EnrollError {
        if !new {
            return e;
        }
        self.held.remove(&cookie);
        if let Err(undo) = self.remove_pod_counters(cookie) {
            warn!("removing the counters of a pod that was not enrolled: {undo}");
        }
        if let Err(undo) = detach_steering(netns, qdisc_created) {
            warn!("removing the steering of a pod that was not enrolled: {undo}");
        }
        if let Err(undo) = self.remove_inbound_link(cookie) {
            warn!("removing the sk_lookup link of a pod that was not enrolled: {undo}");
        }
        e
    }

    /// On the sk_lookup path, attaches (or updates) the pod's sk_lookup
    /// link; nothing on the TC path.
    fn attach_inbound_link(&mut self, netns: &Netns, cookie: u64) -> Result<(), EnrollError> {
        use crate::bpf::{InboundPath, inbound};
        if self.inbound() != InboundPath::SkLookup {
            return Ok(());
        }
        let link_err = |cause| EnrollError::InboundLink {
            netns: netns.path().to_owned(),
            cause,
        };
        let pin = inbound::link_pin(self.pins(), cookie);
        let program: &mut aya::programs::SkLookup = self
            .program_mut(programs::INBOUND_LOOKUP)
            .try_into()
            .map_err(|e| link_err(std::io::Error::other(e)))?;
        let program = program
            .fd()
            .map_err(|e| link_err(std::io::Error::other(e)))?;
        inbound::attach_link(&pin, program.as_fd(), netns.file().as_fd(), netns.inode())
            .map_err(link_err)
    }

    /// Removes the pod's sk_lookup link and forgets its listener (on either
    /// path: an agent on the other path may have left them).
    fn remove_inbound_link(&mut self, cookie: u64) -> Result<(), EnrollError> {
        crate::bpf::inbound::remove_link(self.pins(), cookie).map_err(|cause| {
            EnrollError::Unlink {
                dir: self.pins().pod_links_dir(cookie),
                cause,
            }
        })?;
        let mut listeners: aya::maps::SockHash<&mut MapData, u64> =
            aya::maps::SockHash::try_from(self.map_mut(maps::INBOUND_LISTENERS))
                .map_err(map_err(maps::INBOUND_LISTENERS))?;
        match listeners.remove(&cookie) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            // A hash map answers a missing key with ENOENT.
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(e) => Err(map_err(maps::INBOUND_LISTENERS)(e)),
        }
    }

    /// Writes the address entries `pod` owns ([`claims`]), after releasing
    /// those of `previous` (its earlier enrolment) it no longer has.
    fn claim_addresses(
        &mut self,
        pod: &PodConfig,
        previous: Option<&PodConfig>,
    ) -> Result<Vec<AddressConflict>, EnrollError> {
        let cookie = pod.netns_cookie;
        let ips: Vec<IpKey> = claimed(pod).collect();
        if let Some(previous) = previous {
            for old in claimed(previous).filter(|ip| !ips.contains(ip)) {
                let release = self.claims()?.release(old, cookie);
                self.apply_release(old, cookie, release)?;
            }
        }
        let mut conflicts = Vec::new();
        for ip in ips {
            let claim = self.claims()?.claim(ip, cookie);
            let (other, won) = match claim {
                Claim::Owner { displaced } => {
                    self.pods_by_ip()?
                        .insert(ip, *pod, 0)
                        .map_err(map_err(maps::PODS_BY_IP))?;
                    match displaced {
                        Some(other) => (other, true),
                        None => continue,
                    }
                }
                Claim::Outranked { owner } => (owner, false),
            };
            conflicts.push(AddressConflict {
                address: ip_addr(ip),
                other_netns_cookie: other,
                won,
            });
        }
        Ok(conflicts)
    }

    /// The address claims, read from the pinned pods map when not known.
    fn claims(&mut self) -> Result<&mut AddressClaims<IpKey>, EnrollError> {
        if self.address_claims.is_none() {
            let pods = self.pinned_pods()?;
            self.address_claims = Some(AddressClaims::from_pods(
                pods.iter().map(|pod| (pod.netns_cookie, claimed(pod))),
            ));
        }
        Ok(self.address_claims.get_or_insert_default())
    }

    /// Carries out what releasing `cookie`'s claim on `ip` left to do.
    ///
    /// The kernel has no compare-and-delete for hash maps (and
    /// `BPF_MAP_LOOKUP_AND_DELETE_ELEM` would leave the owner without its
    /// entry for a moment), so the entry is compared and then deleted. No
    /// write can come between the two: the agent is the maps' only writer,
    /// it writes from one task, one pod at a time, and a second agent on the
    /// same pin root waits for the first to exit ([`crate::bpf::pins::PinRootLock`]).
    fn apply_release(
        &mut self,
        ip: IpKey,
        cookie: u64,
        release: Release,
    ) -> Result<(), EnrollError> {
        match release {
            Release::NotOwner => Ok(()),
            Release::Delete => {
                let mut by_ip = self.pods_by_ip()?;
                match by_ip.get(&ip, 0) {
                    Ok(entry) if entry.netns_cookie == cookie => match by_ip.remove(&ip) {
                        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                        Err(e) => Err(map_err(maps::PODS_BY_IP)(e)),
                    },
                    // Another pod's entry, or none: not this pod's to delete.
                    _ => Ok(()),
                }
            }
            Release::PassTo(next) => {
                let Ok(owner) = self.pods_by_netns()?.get(&next, 0) else {
                    // The claims were behind the map: read them again.
                    self.address_claims = None;
                    return Ok(());
                };
                self.pods_by_ip()?
                    .insert(ip, owner, 0)
                    .map_err(map_err(maps::PODS_BY_IP))?;
                info!(
                    "address {} passes back to the pod with netns cookie {next}, which still \
                     claims it",
                    ip_addr(ip)
                );
                Ok(())
            }
        }
    }

    /// Removes the pod `pod`; works after its namespace is gone. Deletes
    /// only what the pod still owns. Returns whether it was enrolled.
    pub fn unenroll_pod(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        let cookie = pod.netns_cookie;
        let found = self.pods_by_netns()?.get(&cookie, 0).ok();
        if let Some(config) = found {
            for ip in claimed(&config) {
                let release = self.claims()?.release(ip, cookie);
                if let Err(e) = self.apply_release(ip, cookie, release) {
                    self.address_claims = None;
                    return Err(e);
                }
            }
            match self.pods_by_netns()?.remove(&cookie) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err(maps::PODS_BY_NETNS)(e)),
            }
        }
        self.remove_pod_counters(cookie)
            .map_err(map_err(maps::POD_COUNTERS))?;
        // New connections go direct from here; the steering filter goes
        // with the namespace if that is gone already.
        let netns = match self.held.remove(&cookie) {
            Some(netns) => Some(netns),
            None => found.and_then(|config| {
                super::check::locate_pods(&[config], &[])
                    .remove(&cookie)
                    .flatten()
            }),
        };
        if let Some(netns) = netns {
            let qdisc_created =
                found.is_some_and(|c| c.flags & pod_flags::STEERING_QDISC_CREATED != 0);
            detach_steering(&netns, qdisc_created)?;
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

    /// The steering program's fd (a copy the enrolment can carry into the
    /// pod's namespace).
    fn steering_program(&mut self) -> Result<std::os::fd::OwnedFd, EnrollError> {
        use std::os::fd::AsFd as _;
        let program_err = |e: &dyn std::fmt::Display| EnrollError::SteeringProgram(e.to_string());
        let fd = self
            .classifier(programs::POD_INGRESS)
            .fd()
            .map_err(|e| program_err(&e))?;
        fd.as_fd().try_clone_to_owned().map_err(|e| program_err(&e))
    }

    /// Every enrolled pod, as pinned.
    pub fn pinned_pods(&mut self) -> Result<Vec<PodConfig>, EnrollError> {
        Ok(self
            .pods_by_netns()?
            .iter()
            .filter_map(Result::ok)
            .map(|(_, pod)| pod)
            .collect())
    }

    /// Writes the entry of every address in `addresses` as its owner's, or
    /// deletes it when no pod claims it (repairs of [`super::check`]).
    pub fn rewrite_address_entries(&mut self, addresses: &[IpAddr]) -> Result<(), EnrollError> {
        // Re-read the claims: whatever made the entries wrong may have left
        // them behind too.
        self.address_claims = None;
        let pods: std::collections::HashMap<u64, PodConfig> = self
            .pinned_pods()?
            .into_iter()
            .map(|pod| (pod.netns_cookie, pod))
            .collect();
        for ip in addresses.iter().map(|ip| ip_key(*ip)) {
            let owner = self
                .claims()?
                .owner(&ip)
                .and_then(|c| pods.get(&c).copied());
            let mut by_ip = self.pods_by_ip()?;
            let result = match owner {
                Some(owner) => by_ip.insert(ip, owner, 0),
                None => match by_ip.remove(&ip) {
                    Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                    other => other,
                },
            };
            result.map_err(map_err(maps::PODS_BY_IP))?;
        }
        Ok(())
    }
}

/// The addresses a pod's entry claims (its non-empty slots).
pub fn claimed(pod: &PodConfig) -> impl Iterator<Item = IpKey> + '_ {
    pod.ips.iter().copied().filter(|ip| *ip != IpKey::default())
}

/// Attaches `program` as the steering filter of every interface in
/// `interfaces` (or replaces its program where it is attached), through
/// `rtnl`, a socket in their namespace (`netns` in errors): all of them, or,
/// on an error, none that this call attached. Returns whether a `clsact`
/// qdisc had to be created.
fn attach_steering_with(
    rtnl: &mut Rtnl,
    netns: &std::path::Path,
    interfaces: &[podnet::Interface],
    program: std::os::fd::BorrowedFd<'_>,
) -> Result<bool, EnrollError> {
    let netlink_err = |iface: &podnet::Interface| {
        let iface = iface.name.clone();
        move |source| EnrollError::Steering {
            iface,
            netns: netns.to_owned(),
            cause: source,
        }
    };
    let mut done: Vec<(u32, steering::Attached)> = Vec::new();
    for iface in interfaces {
        match steering::attach(rtnl, iface.index, program, programs::POD_INGRESS) {
            Ok(attached) => done.push((iface.index, attached)),
            Err(e) => {
                for (ifindex, attached) in done.iter().filter(|(_, a)| !a.replaced) {
                    let _ = steering::detach(rtnl, *ifindex, attached.qdisc_created);
                }
                return Err(netlink_err(iface)(e));
            }
        }
    }
    Ok(done.iter().any(|(_, a)| a.qdisc_created))
}

/// Removes ambpf's steering filter from every interface in `netns`.
pub fn detach_steering(netns: &Netns, qdisc_created: bool) -> Result<(), EnrollError> {
    let path = netns.path();
    netns.run(|| {
        let steering_err = |iface: String| {
            move |source| EnrollError::Steering {
                iface,
                netns: path.to_owned(),
                cause: source,
            }
        };
        let mut rtnl = Rtnl::open().map_err(steering_err("-".into()))?;
        let interfaces = podnet::interfaces(&mut rtnl).map_err(steering_err("-".into()))?;
        for iface in interfaces {
            steering::detach(&mut rtnl, iface.index, qdisc_created)
                .map_err(steering_err(iface.name))?;
        }
        Ok(())
    })?
}

/// A handle of our own on `netns` (the caller's may close), held while its
/// pod is enrolled: its steering is removed through it, and a namespace kept
/// open is never freed, so its inode is not reused meanwhile.
fn keep(netns: &Netns) -> Result<Netns, NetnsError> {
    use std::os::fd::AsRawFd as _;
    Netns::open(&format!("/proc/self/fd/{}", netns.file().as_raw_fd()))
}

/// An address key back as an address.
pub fn ip_addr(key: IpKey) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from(key.addr);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> EnrollError {
    move |source| EnrollError::Map { map, cause: source }
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
            crate::bpf::foreign::log_warnings(self.pins());
        }
        super::check::ebpf_state(self.pins(), pods, scope)
    }

    fn repair(&mut self, violations: &[Violation]) -> Vec<PodKey> {
        super::check::repair_ebpf_state(self, violations)
    }
}
