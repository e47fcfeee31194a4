//! The eBPF mode's state: the pinned maps, each enrolled pod's namespace,
//! and the node's other namespaces.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use ambpf_common::{IpKey, PodConfig, maps};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use tracing::{info, warn};

use super::{CheckScope, Violation, ViolationKind, key_of};
use crate::{
    bpf::{PinLayout, inbound, pinned_steering_program},
    netns::Netns,
    redirect::{
        PodKey,
        claims::AddressClaims,
        ebpf::{EbpfRedirection, claimed, detach_steering, ip_addr},
        podnet, routing,
    },
};

/// The eBPF mode's pinned per-pod records.
#[derive(Clone, Debug, Default)]
pub struct PinnedPods {
    /// `ambpf_pods`.
    pub pods: Vec<PodConfig>,
    /// `ambpf_pod_ips`.
    pub addresses: Vec<(IpKey, PodConfig)>,
    /// Directories under `links/pods` of no enrolled pod's sk_lookup link:
    /// left by a removal cut short, or steering links an older agent pinned.
    pub stray_link_dirs: Vec<PathBuf>,
    /// The steering program the agent pinned (its id).
    pub steering_program: Option<u32>,
    /// The sk_lookup program the agent pinned (its id): `Some` on the
    /// sk_lookup inbound path ([`inbound`]).
    pub inbound_program: Option<u32>,
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
    let pods: Vec<PodConfig> = entries::<u64>(&pins.map(maps::PODS_BY_NETNS))?
        .into_iter()
        .map(|(_, pod)| pod)
        .collect();
    let inbound_program = inbound::pinned_program(pins);
    let linked = |dir: &Path| {
        inbound_program.is_some()
            && dir
                .file_name()
                .and_then(|n| n.to_str()?.parse::<u64>().ok())
                .is_some_and(|cookie| pods.iter().any(|pod| pod.netns_cookie == cookie))
    };
    let addresses = entries::<IpKey>(&pins.map(maps::PODS_BY_IP))?;
    let root = pins.pod_links_root();
    let stray_link_dirs = match std::fs::read_dir(&root) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.path())
            .filter(|dir| !linked(dir))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            return Err(ReadError {
                path: root,
                reason: e.to_string(),
            });
        }
    };
    Ok(PinnedPods {
        pods,
        addresses,
        stray_link_dirs,
        steering_program: pinned_steering_program(pins),
        inbound_program,
    })
}

/// The records' own consistency: every address entry is its owner's
/// ([`crate::redirect::claims`]), every owned address has its entry, and no
/// link is pinned for a pod that is not enrolled.
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
        let violation = match claims.owner(ip) {
            None => Violation::new(
                ViolationKind::AddressOrphan,
                format!("{address} points at netns cookie {holder}, and no enrolled pod claims it"),
            ),
            Some(owner) if owner != holder => Violation::new(
                ViolationKind::AddressWrongOwner,
                format!(
                    "{address} points at netns cookie {holder}; its owner is the pod with \
                     netns cookie {owner}"
                ),
            )
            .pod(pods[&owner]),
            Some(owner) if pods[&owner] != entry => Violation::new(
                ViolationKind::AddressWrongOwner,
                format!("{address} holds outdated settings of its pod (netns cookie {owner})"),
            )
            .pod(pods[&owner]),
            Some(_) => continue,
        };
        out.push(violation.address(address));
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
    for dir in &state.stray_link_dirs {
        out.push(
            Violation::new(
                ViolationKind::SteeringOrphan,
                format!("{} holds links of no enrolled pod", dir.display()),
            )
            .pin(dir),
        );
    }
    out
}

/// Finds the namespace of each pod: from `known` (handles the caller holds),
/// else among the host's namespaces by inode, confirmed by cookie (an inode
/// may have been reused by a new namespace). `None`: the namespace is gone.
pub fn locate_pods(pods: &[PodConfig], known: &[(PodKey, &Netns)]) -> HashMap<u64, Option<Netns>> {
    let known: HashMap<u64, &Netns> = known.iter().map(|(k, n)| (k.netns_cookie, *n)).collect();
    let host = podnet::HostNamespaces::default();
    let mut out = HashMap::new();
    for pod in pods {
        let cookie = pod.netns_cookie;
        let found = match known.get(&cookie) {
            Some(netns) => reopen(netns),
            None => host
                .find(PodKey {
                    netns_cookie: cookie,
                    netns_inode: pod.netns_inode,
                })
                .and_then(reopen),
        };
        out.insert(cookie, found);
    }
    out
}

fn reopen(netns: &Netns) -> Option<Netns> {
    use std::os::fd::AsRawFd as _;
    Netns::open(&format!("/proc/self/fd/{}", netns.file().as_raw_fd())).ok()
}

/// Inside one enrolled pod's namespace: the addresses it was enrolled with,
/// the reply routing, and (`inbound`: the pod's link pin and the agent's
/// sk_lookup program) the pod's link running that program in its
/// namespace.
pub fn check_pod_netns(
    pod: &PodConfig,
    inbound: Option<(&Path, u32)>,
    netns: &Netns,
) -> Vec<Violation> {
    let key = key_of(pod);
    let unreadable = |what: &str, e: &dyn std::error::Error| {
        Violation::new(
            ViolationKind::Unreadable,
            format!("{what} of the pod with {key}: {e}"),
        )
        .pod(pod)
    };
    let net = match podnet::inspect(netns) {
        Ok(net) => net,
        Err(e) => return vec![unreadable("reading the network", &e)],
    };
    let mut out = Vec::new();
    let enrolled: Vec<IpAddr> = claimed(pod).map(ip_addr).collect();
    out.extend(super::addresses_changed(key, &enrolled, &net, netns));
    if let Some((pin, program)) = inbound {
        let why = match inbound::link_info(pin) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Some("has no sk_lookup link".to_owned())
            }
            Err(e) => {
                out.push(unreadable("reading the sk_lookup link", &e));
                None
            }
            Ok((id, _)) if id != program => Some(format!(
                "has an sk_lookup link that runs program {id}, not the agent's {program}"
            )),
            Ok((_, inode)) if inode != Some(netns.inode() as u32) => Some(format!(
                "has an sk_lookup link attached to namespace inode {inode:?}, not its own"
            )),
            Ok(_) => None,
        };
        if let Some(why) = why {
            out.push(
                Violation::new(
                    ViolationKind::SteeringMissing,
                    format!("the pod with {key} {why}: its inbound connections are not captured"),
                )
                .pod(pod),
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
        Err(e) => out.push(unreadable("reading the reply routing", &e)),
    }
    out
}

/// The node's namespaces that are no enrolled pod's (`enrolled`, by
/// cookie) and hold a steering filter running the agent's program
/// (`steering_program`): filters left behind. Another agent's filters (its
/// own program) are not this one's to judge.
pub fn scan_orphan_steering(steering_program: u32, enrolled: &HashSet<u64>) -> Vec<Violation> {
    super::scan_stray_capture(None, enrolled, Some(steering_program))
        .into_iter()
        .filter(|v| v.kind == ViolationKind::SteeringOrphan)
        .collect()
}

/// The eBPF mode's whole check.
pub fn ebpf_state(
    pins: &PinLayout,
    known: &[(PodKey, &Netns)],
    scope: CheckScope,
) -> Vec<Violation> {
    let state = match read_pinned_pods(pins) {
        Ok(state) => state,
        Err(e) => return vec![Violation::new(ViolationKind::Unreadable, e.to_string())],
    };
    let mut out = check_records(&state);
    if scope == CheckScope::Records {
        return out;
    }
    let located = locate_pods(&state.pods, known);
    for pod in &state.pods {
        match &located[&pod.netns_cookie] {
            None => out.push(
                Violation::new(
                    ViolationKind::PodNetnsGone,
                    format!(
                        "the network namespace of the pod with {} is gone",
                        key_of(pod)
                    ),
                )
                .pod(pod),
            ),
            Some(netns) => {
                let link = inbound::link_pin(pins, pod.netns_cookie);
                let inbound = state.inbound_program.map(|id| (link.as_path(), id));
                out.extend(check_pod_netns(pod, inbound, netns));
            }
        }
    }
    // The node is the agent's own namespace's (the host's, in production).
    let enrolled: HashSet<u64> = state.pods.iter().map(|p| p.netns_cookie).collect();
    let host = Netns::open("/proc/self/ns/net");
    if let Err(e) = &host {
        out.push(Violation::new(
            ViolationKind::Unreadable,
            format!("opening the host namespace to find its pods: {e}"),
        ));
    }
    out.extend(super::scan_stray_capture(
        host.as_ref().ok(),
        &enrolled,
        state.steering_program,
    ));
    out
}

/// Repairs the eBPF mode's records in place; returns the pods to enrol
/// again (missing steering or routing, changed addresses).
pub fn repair_ebpf_state(
    redirection: &mut EbpfRedirection,
    violations: &[Violation],
) -> Vec<PodKey> {
    let mut addresses: Vec<IpAddr> = Vec::new();
    let mut again = Vec::new();
    for violation in violations {
        match violation.kind {
            ViolationKind::AddressOrphan
            | ViolationKind::AddressWrongOwner
            | ViolationKind::AddressMissing => addresses.extend(violation.address),
            ViolationKind::SteeringOrphan => repair_orphan_steering(violation),
            ViolationKind::CaptureOrphan => super::repair_stray_capture(violation),
            ViolationKind::PodNetnsGone => {
                let Some(pod) = violation.pod else { continue };
                match redirection.unenroll_pod(pod) {
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
            | ViolationKind::HostRulesMissing
            | ViolationKind::MixedCapture
            | ViolationKind::Unreadable => {}
        }
    }
    if !addresses.is_empty() {
        addresses.sort_unstable();
        addresses.dedup();
        match redirection.rewrite_address_entries(&addresses) {
            Ok(()) => info!(
                "repaired the entries of {addresses:?} in {}",
                maps::PODS_BY_IP
            ),
            Err(e) => warn!("repairing the entries of {addresses:?}: {e}"),
        }
    }
    again.sort_unstable();
    again.dedup();
    again
}

fn repair_orphan_steering(violation: &Violation) {
    if let Some(pin) = &violation.pin {
        match std::fs::remove_dir_all(pin) {
            Ok(()) => info!("repaired: removed {}", pin.display()),
            Err(e) => warn!("repairing {violation}: removing {}: {e}", pin.display()),
        }
    }
    if let Some(path) = &violation.netns {
        let removed = Netns::open(&path.to_string_lossy())
            .map_err(|e| e.to_string())
            .and_then(|netns| detach_steering(&netns, false).map_err(|e| e.to_string()));
        match removed {
            Ok(()) => info!("repaired: removed ambpf's steering from {}", path.display()),
            Err(e) => warn!("repairing {violation}: {e}"),
        }
    }
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
            ..Default::default()
        };
        assert_eq!(check_records(&state), []);
    }

    #[test]
    fn an_address_of_a_live_pod_without_its_entry_is_a_bypass() {
        // What removing a stale pod used to leave: the live pod's entry gone.
        let state = PinnedPods {
            pods: vec![pod(20, &[A])],
            ..Default::default()
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
        let stale_settings = pod(30, &[B]);
        let mut outdated = stale_settings;
        outdated.flags = 0;
        let state = PinnedPods {
            pods: vec![old, new, stale_settings],
            addresses: vec![
                (IpKey::v4(A), old),
                (IpKey::v4(B), outdated),
                (IpKey::v4([10, 9, 9, 9]), pod(99, &[[10, 9, 9, 9]])),
            ],
            ..Default::default()
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
    fn links_of_no_enrolled_pod_are_orphans() {
        let live = pod(20, &[A]);
        let state = PinnedPods {
            pods: vec![live],
            addresses: vec![(IpKey::v4(A), live)],
            stray_link_dirs: vec![PathBuf::from("/pins/links/pods/4026532001")],
            steering_program: Some(7),
            inbound_program: Some(8),
        };
        let found = check_records(&state);
        assert_eq!(kinds(&found), [ViolationKind::SteeringOrphan]);
        assert_eq!(
            found[0].pin.as_deref(),
            Some(Path::new("/pins/links/pods/4026532001"))
        );
    }
}
