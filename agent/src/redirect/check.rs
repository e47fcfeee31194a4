//! Is the per-pod state consistent? `ambpf status --check`, and the check
//! the agent runs after every reconcile pass and periodically.
//!
//! A wrong record fails silently: an address entry that no longer points at
//! its pod lets inbound connections reach the app directly, bypassing
//! ztunnel, with nothing else saying so. The check compares every record
//! with the pods it belongs to and names each [`Violation`]; the agent
//! repairs what it can, logs it, and counts every violation by kind
//! (`ambpf_state_violations_total`), so a bypass becomes an alert.
//!
//! Two scopes: [`CheckScope::Records`] reads only the pinned maps and link
//! directories (cheap, after every pass); [`CheckScope::Full`] also looks
//! inside each enrolled pod's namespace: that it still exists, and its
//! interfaces, addresses, steering links and reply routing.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    net::IpAddr,
    os::fd::AsFd,
    path::{Path, PathBuf},
};

use ambpf_common::{Direction, IpKey, PodConfig, maps};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use log::{info, warn};
use serde::Serialize;

use super::{
    PodKey,
    claims::AddressClaims,
    ebpf::{claimed, ip_addr},
    podnet, routing,
};
use crate::{
    bpf::{Dataplane, PinLayout, pins, sys},
    netns::Netns,
};

/// How far a check looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckScope {
    /// The records only: maps and pins.
    Records,
    /// The records, and inside every enrolled pod's namespace.
    Full,
}

/// What is wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// An address entry that no enrolled pod claims.
    AddressOrphan,
    /// An address entry that holds a pod other than the address's owner,
    /// or stale settings of its owner.
    AddressWrongOwner,
    /// An address an enrolled pod owns without its entry: inbound
    /// connections to it bypass ztunnel.
    AddressMissing,
    /// An enrolled pod whose namespace has other addresses than it was
    /// enrolled with.
    PodAddressesChanged,
    /// An enrolled pod whose network namespace no longer exists.
    PodNetnsGone,
    /// An enrolled pod's interface without its inbound steering.
    SteeringMissing,
    /// A steering link or link directory that belongs to no enrolled pod
    /// or no interface.
    SteeringOrphan,
    /// An enrolled pod without its reply routing (rule, route or sysctl).
    RoutingMissing,
    /// An enrolled pod without its in-pod rules (iptables mode).
    RulesMissing,
    /// A probe ipset member that no enrolled pod owns, or that names
    /// another pod than the owner (iptables mode).
    ProbeSetOrphan,
    /// An address an enrolled pod owns missing from the probe ipset: its
    /// kubelet probes are captured (iptables mode).
    ProbeSetMissing,
    /// State that could not be read.
    Unreadable,
}

impl ViolationKind {
    pub const ALL: [ViolationKind; 12] = [
        ViolationKind::AddressOrphan,
        ViolationKind::AddressWrongOwner,
        ViolationKind::AddressMissing,
        ViolationKind::PodAddressesChanged,
        ViolationKind::PodNetnsGone,
        ViolationKind::SteeringMissing,
        ViolationKind::SteeringOrphan,
        ViolationKind::RoutingMissing,
        ViolationKind::RulesMissing,
        ViolationKind::ProbeSetOrphan,
        ViolationKind::ProbeSetMissing,
        ViolationKind::Unreadable,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ViolationKind::AddressOrphan => "address_orphan",
            ViolationKind::AddressWrongOwner => "address_wrong_owner",
            ViolationKind::AddressMissing => "address_missing",
            ViolationKind::PodAddressesChanged => "pod_addresses_changed",
            ViolationKind::PodNetnsGone => "pod_netns_gone",
            ViolationKind::SteeringMissing => "steering_missing",
            ViolationKind::SteeringOrphan => "steering_orphan",
            ViolationKind::RoutingMissing => "routing_missing",
            ViolationKind::RulesMissing => "rules_missing",
            ViolationKind::ProbeSetOrphan => "probe_set_orphan",
            ViolationKind::ProbeSetMissing => "probe_set_missing",
            ViolationKind::Unreadable => "unreadable",
        }
    }

    pub fn index(self) -> usize {
        Self::ALL
            .iter()
            .position(|k| *k == self)
            .expect("every kind is in ALL")
    }
}

/// One inconsistency, with what it concerns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub kind: ViolationKind,
    /// The enrolled pod concerned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodKey>,
    /// The address concerned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    /// The pin concerned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin: Option<PathBuf>,
    pub detail: String,
}

impl Violation {
    pub(crate) fn new(kind: ViolationKind, detail: String) -> Self {
        Self {
            kind,
            pod: None,
            address: None,
            pin: None,
            detail,
        }
    }

    fn pod(self, pod: &PodConfig) -> Self {
        self.for_pod(key_of(pod))
    }

    pub(crate) fn for_pod(mut self, pod: PodKey) -> Self {
        self.pod = Some(pod);
        self
    }

    pub(crate) fn address(mut self, address: IpAddr) -> Self {
        self.address = Some(address);
        self
    }

    fn pin(mut self, pin: &Path) -> Self {
        self.pin = Some(pin.to_owned());
        self
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.detail)
    }
}

pub(crate) fn key_of(pod: &PodConfig) -> PodKey {
    PodKey {
        netns_cookie: pod.netns_cookie,
        netns_inode: pod.netns_inode,
    }
}

/// The eBPF mode's pinned per-pod records.
#[derive(Clone, Debug, Default)]
pub struct PinnedPods {
    /// `ambpf_pods`.
    pub pods: Vec<PodConfig>,
    /// `ambpf_pod_ips`.
    pub addresses: Vec<(IpKey, PodConfig)>,
    /// `links/pods/*`.
    pub link_dirs: Vec<LinkDir>,
}

/// One directory under `links/pods`.
#[derive(Clone, Debug)]
pub struct LinkDir {
    pub path: PathBuf,
    /// The netns cookie it is named by (`None`: not a pod's directory).
    pub cookie: Option<u64>,
    pub links: Vec<LinkPin>,
}

/// One pinned steering link.
#[derive(Clone, Debug)]
pub struct LinkPin {
    pub path: PathBuf,
    /// The interface its name says (`None`: not a steering link's name).
    pub ifindex: Option<u32>,
    /// The interface the kernel says it runs on (`None`: defunct, its
    /// interface is gone).
    pub attached_to: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
#[error("reading {path}: {reason}")]
pub struct ReadError {
    path: PathBuf,
    reason: String,
}

/// Reads the pinned per-pod records under `pins`.
pub fn read_pinned_pods(pins: &PinLayout) -> Result<PinnedPods, ReadError> {
    fn entries<K: aya::Pod>(path: &Path) -> Result<Vec<(K, PodConfig)>, ReadError> {
        let err = |reason: String| ReadError {
            path: path.to_owned(),
            reason,
        };
        if !path.exists() {
            return Ok(Vec::new());
        }
        let data = MapData::from_pin(path).map_err(|e| err(e.to_string()))?;
        let map: BpfHashMap<_, K, PodConfig> =
            BpfHashMap::try_from(Map::HashMap(data)).map_err(|e| err(e.to_string()))?;
        map.iter()
            .collect::<Result<_, _>>()
            .map_err(|e| err(e.to_string()))
    }
    let pods = entries::<u64>(&pins.map(maps::PODS_BY_NETNS))?
        .into_iter()
        .map(|(_, pod)| pod)
        .collect();
    let addresses = entries::<IpKey>(&pins.map(maps::PODS_BY_IP))?;
    let mut link_dirs = Vec::new();
    for dir in sorted_dir(&pins.pod_links_root())? {
        let cookie = dir.file_name().and_then(|n| n.to_str()?.parse().ok());
        let links = sorted_dir(&dir)?
            .into_iter()
            .map(|path| {
                let ifindex = path
                    .file_name()
                    .and_then(|n| pins::parse_tc_link_name(n.to_str()?))
                    .filter(|(_, direction)| *direction == Direction::Ingress)
                    .map(|(ifindex, _)| ifindex);
                let attached_to = sys::obj_get(&path)
                    .and_then(|link| sys::tcx_link_ifindex(link.as_fd()))
                    .ok()
                    .flatten();
                LinkPin {
                    path,
                    ifindex,
                    attached_to,
                }
            })
            .collect();
        link_dirs.push(LinkDir {
            path: dir,
            cookie,
            links,
        });
    }
    Ok(PinnedPods {
        pods,
        addresses,
        link_dirs,
    })
}

fn sorted_dir(dir: &Path) -> Result<Vec<PathBuf>, ReadError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(ReadError {
                path: dir.to_owned(),
                reason: e.to_string(),
            });
        }
    };
    let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    paths.sort();
    Ok(paths)
}

/// The records' own consistency: every address entry is its owner's
/// ([`super::claims`]), every owned address has its entry, every pod has
/// its steering links and every link directory a pod.
pub fn check_records(state: &PinnedPods) -> Vec<Violation> {
    let mut out = Vec::new();
    let pods: HashMap<u64, &PodConfig> = state
        .pods
        .iter()
        .map(|pod| (pod.netns_cookie, pod))
        .collect();
    let claims = AddressClaims::from_pods(
        state
            .pods
            .iter()
            .map(|pod| (pod.netns_cookie, claimed(pod))),
    );
    let mut with_entry = HashSet::new();
    for (ip, entry) in &state.addresses {
        with_entry.insert(*ip);
        let address = ip_addr(*ip);
        let holder = entry.netns_cookie;
        match claims.owner(ip) {
            None => out.push(
                Violation::new(
                    ViolationKind::AddressOrphan,
                    format!(
                        "{address} points at netns cookie {holder}, and no enrolled pod \
                         claims it"
                    ),
                )
                .address(address),
            ),
            Some(owner) if owner != holder => out.push(
                Violation::new(
                    ViolationKind::AddressWrongOwner,
                    format!(
                        "{address} points at netns cookie {holder}; its owner is the pod \
                         with netns cookie {owner}"
                    ),
                )
                .pod(pods[&owner])
                .address(address),
            ),
            Some(owner) if pods[&owner] != entry => out.push(
                Violation::new(
                    ViolationKind::AddressWrongOwner,
                    format!("{address} holds outdated settings of its pod (netns cookie {owner})"),
                )
                .pod(pods[&owner])
                .address(address),
            ),
            Some(_) => {}
        }
    }
    for (ip, owner) in claims.owners() {
        if !with_entry.contains(&ip) {
            let address = ip_addr(ip);
            out.push(
                Violation::new(
                    ViolationKind::AddressMissing,
                    format!(
                        "{address} of the pod with netns cookie {owner} has no entry in {}: \
                         inbound connections to it bypass ztunnel",
                        maps::PODS_BY_IP
                    ),
                )
                .pod(pods[&owner])
                .address(address),
            );
        }
    }
    let dirs: HashMap<u64, &LinkDir> = state
        .link_dirs
        .iter()
        .filter_map(|dir| Some((dir.cookie?, dir)))
        .collect();
    for dir in &state.link_dirs {
        if dir.cookie.is_none_or(|cookie| !pods.contains_key(&cookie)) {
            out.push(
                Violation::new(
                    ViolationKind::SteeringOrphan,
                    format!("{} belongs to no enrolled pod", dir.path.display()),
                )
                .pin(&dir.path),
            );
        }
    }
    for pod in &state.pods {
        let links = dirs.get(&pod.netns_cookie).map_or(0, |dir| dir.links.len());
        if links == 0 {
            out.push(
                Violation::new(
                    ViolationKind::SteeringMissing,
                    format!(
                        "the pod with {} has no steering link pinned",
                        key_of(pod)
                    ),
                )
                .pod(pod),
            );
        }
    }
    out
}

/// Finds the namespace of each pod: from `known` (handles the caller holds),
/// else among the host's namespaces by inode, confirmed by cookie (an inode
/// may have been reused by a new namespace). `None`: the namespace is gone.
pub fn locate_pods(pods: &[PodConfig], known: &[(PodKey, &Netns)]) -> HashMap<u64, Option<Netns>> {
    let known: HashMap<u64, &Netns> = known.iter().map(|(k, n)| (k.netns_cookie, *n)).collect();
    let mut host: Option<HashMap<u64, Netns>> = None;
    let mut out = HashMap::new();
    for pod in pods {
        let cookie = pod.netns_cookie;
        let found = match known.get(&cookie) {
            Some(netns) => reopen(netns),
            None => {
                let by_inode = host.get_or_insert_with(|| {
                    crate::netns::all()
                        .into_iter()
                        .map(|ns| (ns.inode(), ns))
                        .collect()
                });
                by_inode
                    .get(&pod.netns_inode)
                    .filter(|ns| podnet::netns_cookie(ns).ok() == Some(cookie))
                    .and_then(reopen)
            }
        };
        out.insert(cookie, found);
    }
    out
}

fn reopen(netns: &Netns) -> Option<Netns> {
    Netns::open(&format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(netns.file())))
        .ok()
}

/// Inside one enrolled pod's namespace: its addresses, a live steering link
/// on each interface and none on others, and the reply routing.
pub fn check_pod_netns(pod: &PodConfig, dir: Option<&LinkDir>, netns: &Netns) -> Vec<Violation> {
    let key = key_of(pod);
    let unreadable = |what: &str, e: &dyn std::error::Error| {
        vec![Violation::new(ViolationKind::Unreadable, format!("{what} of the pod with {key}: {e}")).pod(pod)]
    };
    let net = match podnet::inspect(netns) {
        Ok(net) => net,
        Err(e) => return unreadable("reading the network", &e),
    };
    let mut out = Vec::new();
    let mut now: Vec<IpKey> = match super::pod_addresses(&net, netns) {
        Ok(addresses) => addresses.into_iter().map(super::ebpf::ip_key).collect(),
        Err(_) => Vec::new(),
    };
    let mut enrolled: Vec<IpKey> = claimed(pod).collect();
    now.sort_unstable_by_key(|k| k.addr);
    enrolled.sort_unstable_by_key(|k| k.addr);
    if now != enrolled {
        let show = |keys: &[IpKey]| {
            keys.iter()
                .map(|k| ip_addr(*k).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push(
            Violation::new(
                ViolationKind::PodAddressesChanged,
                format!(
                    "the pod with {key} was enrolled with [{}] and now has [{}]",
                    show(&enrolled),
                    show(&now)
                ),
            )
            .pod(pod),
        );
    }
    let links: &[LinkPin] = dir.map_or(&[], |d| &d.links);
    for iface in &net.interfaces {
        let steered = links
            .iter()
            .any(|l| l.ifindex == Some(iface.index) && l.attached_to == Some(iface.index));
        if !steered {
            out.push(
                Violation::new(
                    ViolationKind::SteeringMissing,
                    format!(
                        "{} (ifindex {}) of the pod with {key} has no live steering link",
                        iface.name, iface.index
                    ),
                )
                .pod(pod),
            );
        }
    }
    for link in links {
        let live = link.ifindex.is_some_and(|ifindex| {
            link.attached_to == Some(ifindex) && net.interfaces.iter().any(|i| i.index == ifindex)
        });
        if !live {
            out.push(
                Violation::new(
                    ViolationKind::SteeringOrphan,
                    format!(
                        "{} steers no interface of the pod with {key}",
                        link.path.display()
                    ),
                )
                .pod(pod)
                .pin(&link.path),
            );
        }
    }
    match routing::reply_routing_status(netns) {
        Ok(status) if status.is_installed() => {}
        Ok(status) => out.push(
            Violation::new(
                ViolationKind::RoutingMissing,
                format!("the pod with {key} lacks part of its reply routing: {status:?}"),
            )
            .pod(pod),
        ),
        Err(e) => out.extend(unreadable("reading the reply routing", &e)),
    }
    out
}

/// The eBPF mode's whole check.
pub fn ebpf_state(pins: &PinLayout, known: &[(PodKey, &Netns)], scope: CheckScope) -> Vec<Violation> {
    let state = match read_pinned_pods(pins) {
        Ok(state) => state,
        Err(e) => return vec![Violation::new(ViolationKind::Unreadable, e.to_string())],
    };
    let mut out = check_records(&state);
    if scope == CheckScope::Records {
        return out;
    }
    let dirs: HashMap<u64, &LinkDir> = state
        .link_dirs
        .iter()
        .filter_map(|dir| Some((dir.cookie?, dir)))
        .collect();
    let located = locate_pods(&state.pods, known);
    for pod in &state.pods {
        match &located[&pod.netns_cookie] {
            None => out.push(
                Violation::new(
                    ViolationKind::PodNetnsGone,
                    format!("the network namespace of the pod with {} is gone", key_of(pod)),
                )
                .pod(pod),
            ),
            Some(netns) => out.extend(check_pod_netns(
                pod,
                dirs.get(&pod.netns_cookie).copied(),
                netns,
            )),
        }
    }
    out
}

/// Repairs the eBPF mode's records in place; returns the pods to enrol
/// again (missing steering or routing, changed addresses).
pub fn repair_ebpf_state(dataplane: &mut Dataplane, violations: &[Violation]) -> Vec<PodKey> {
    let mut addresses = Vec::new();
    let mut again = Vec::new();
    for violation in violations {
        match violation.kind {
            ViolationKind::AddressOrphan
            | ViolationKind::AddressWrongOwner
            | ViolationKind::AddressMissing => addresses.extend(violation.address),
            ViolationKind::SteeringOrphan => {
                let Some(pin) = &violation.pin else { continue };
                let removed = if pin.is_dir() {
                    std::fs::remove_dir_all(pin)
                } else {
                    std::fs::remove_file(pin)
                };
                match removed {
                    Ok(()) => info!("repaired: removed {}", pin.display()),
                    Err(e) => warn!("repairing {violation}: removing {}: {e}", pin.display()),
                }
            }
            ViolationKind::PodNetnsGone => {
                let Some(pod) = violation.pod else { continue };
                match dataplane.unenroll_pod(pod) {
                    Ok(_) => info!("repaired: removed the pod with {pod} (its namespace is gone)"),
                    Err(e) => warn!("repairing {violation}: {e}"),
                }
            }
            ViolationKind::SteeringMissing
            | ViolationKind::RoutingMissing
            | ViolationKind::RulesMissing
            | ViolationKind::PodAddressesChanged => again.extend(violation.pod),
            ViolationKind::ProbeSetOrphan
            | ViolationKind::ProbeSetMissing
            | ViolationKind::Unreadable => {}
        }
    }
    if !addresses.is_empty() {
        addresses.sort_unstable();
        addresses.dedup();
        match dataplane.rewrite_address_entries(&addresses) {
            Ok(()) => info!("repaired the entries of {addresses:?} in {}", maps::PODS_BY_IP),
            Err(e) => warn!("repairing the entries of {addresses:?}: {e}"),
        }
    }
    again.sort_unstable();
    again.dedup();
    again
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(cookie: u64, ips: &[[u8; 4]]) -> PodConfig {
        let mut pod = PodConfig {
            netns_cookie: cookie,
            netns_inode: 4_026_532_000 + cookie,
            flags: 1,
            ..Default::default()
        };
        for (slot, ip) in pod.ips.iter_mut().zip(ips) {
            *slot = IpKey::v4(*ip);
        }
        pod
    }

    fn dir(cookie: u64) -> LinkDir {
        LinkDir {
            path: PathBuf::from(format!("/pins/links/pods/{cookie}")),
            cookie: Some(cookie),
            links: vec![LinkPin {
                path: PathBuf::from(format!("/pins/links/pods/{cookie}/2-ingress")),
                ifindex: Some(2),
                attached_to: Some(2),
            }],
        }
    }

    const A: [u8; 4] = [10, 244, 1, 2];
    const B: [u8; 4] = [10, 244, 1, 3];

    fn kinds(violations: &[Violation]) -> Vec<ViolationKind> {
        violations.iter().map(|v| v.kind).collect()
    }

    #[test]
    fn consistent_records_have_no_violation() {
        let (old, new) = (pod(10, &[A, B]), pod(20, &[A]));
        let state = PinnedPods {
            pods: vec![old, new],
            addresses: vec![(IpKey::v4(A), new), (IpKey::v4(B), old)],
            link_dirs: vec![dir(10), dir(20)],
        };
        assert_eq!(check_records(&state), []);
    }

    #[test]
    fn an_address_of_a_live_pod_without_its_entry_is_a_bypass() {
        // What removing a stale pod used to leave: the live pod's entry gone.
        let live = pod(20, &[A]);
        let state = PinnedPods {
            pods: vec![live],
            addresses: vec![],
            link_dirs: vec![dir(20)],
        };
        let found = check_records(&state);
        assert_eq!(kinds(&found), [ViolationKind::AddressMissing]);
        assert_eq!(found[0].pod.unwrap().netns_cookie, 20);
        assert_eq!(found[0].address, Some(IpAddr::from(A)));
        assert!(found[0].detail.contains("bypass ztunnel"), "{}", found[0]);
    }

    #[test]
    fn entries_of_no_pod_of_the_older_pod_or_with_stale_settings_are_named() {
        let (old, new) = (pod(10, &[A]), pod(20, &[A]));
        let mut stale_settings = pod(30, &[B]);
        let state = PinnedPods {
            pods: vec![old, new, stale_settings],
            addresses: vec![
                (IpKey::v4(A), old),
                (IpKey::v4(B), {
                    stale_settings.flags = 0;
                    stale_settings
                }),
                (IpKey::v4([10, 9, 9, 9]), pod(99, &[[10, 9, 9, 9]])),
            ],
            link_dirs: vec![dir(10), dir(20), dir(30)],
        };
        let mut found = kinds(&check_records(&state));
        found.sort();
        assert_eq!(
            found,
            [
                ViolationKind::AddressOrphan,
                ViolationKind::AddressWrongOwner,
                ViolationKind::AddressWrongOwner
            ]
        );
    }

    #[test]
    fn link_directories_and_pods_must_match() {
        let live = pod(20, &[A]);
        let foreign = LinkDir {
            path: PathBuf::from("/pins/links/pods/4026532001"),
            cookie: Some(4_026_532_001),
            links: vec![],
        };
        let state = PinnedPods {
            pods: vec![live],
            addresses: vec![(IpKey::v4(A), live)],
            link_dirs: vec![foreign],
        };
        let found = check_records(&state);
        assert_eq!(
            kinds(&found),
            [ViolationKind::SteeringOrphan, ViolationKind::SteeringMissing]
        );
        assert_eq!(
            found[0].pin.as_deref(),
            Some(Path::new("/pins/links/pods/4026532001"))
        );
    }

    #[test]
    fn every_kind_has_a_distinct_metric_label() {
        let labels: HashSet<&str> = ViolationKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(labels.len(), ViolationKind::ALL.len());
        for (i, kind) in ViolationKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }
}
