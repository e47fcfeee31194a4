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
//! Two scopes: [`CheckScope::Records`] reads only the pinned maps and pins
//! (cheap, after every pass); [`CheckScope::Full`] also looks inside each
//! enrolled pod's namespace (that it still exists, its addresses, steering
//! filters and reply routing) and through the node's other namespaces for
//! capture that belongs to no enrolled pod, in every mode ([`stray`]). The
//! eBPF mode's checks are in [`ebpf`]; the iptables mode's in
//! `iptables/probes.rs`.

mod ebpf;
pub mod foreign;
mod foreign_iface;
pub mod mixed;
mod stray;

use std::{
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
};

use ambpf_common::PodConfig;
use serde::Serialize;

pub use self::ebpf::{
    PinnedPods, check_pod_netns, check_records, ebpf_state, locate_pods, read_pinned_pods,
    repair_ebpf_state, scan_orphan_steering,
};
pub use self::stray::{
    repair_stray_capture, repair_stray_tables, scan_stray_capture, scan_stray_tables,
};
use super::PodKey;

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
    /// An enrolled pod's interface without ambpf's steering filter, or with
    /// one that runs another program than the agent's; on the sk_lookup
    /// inbound path, a pod without its sk_lookup link running the agent's.
    SteeringMissing,
    /// ambpf's steering filter in a namespace that is no enrolled pod's, or
    /// pinned links of no enrolled pod.
    SteeringOrphan,
    /// An enrolled pod without its reply routing (rule, route or sysctl).
    RoutingMissing,
    /// ambpf's in-pod capture rules (Istio's `ISTIO_*` nat and raw chains,
    /// or the nftables mode's tables) with its policy routing in a namespace
    /// of the node that is no enrolled pod's: its connections go to a
    /// ztunnel that does not serve it.
    CaptureOrphan,
    /// An enrolled pod without its in-pod rules (iptables mode).
    RulesMissing,
    /// A probe ipset member that no enrolled pod owns, or that names
    /// another pod than the owner (iptables mode).
    ProbeSetOrphan,
    /// An address an enrolled pod owns missing from the probe ipset: its
    /// kubelet probes are captured (iptables mode).
    ProbeSetMissing,
    /// The host's probe SNAT (the iptables mode's `ISTIO_POSTRT` rule and
    /// its jump, or the nftables mode's host table) missing, as Istio's
    /// node agent leaves the node when it stops: every enrolled pod's
    /// kubelet probes are captured.
    HostRulesMissing,
    /// An enrolled pod whose namespace also holds another capture: Istio's
    /// in-pod rules (its node agent's, or ambpf's other mode's) beside
    /// ambpf's ([`mixed`]).
    MixedCapture,
    /// State that could not be read.
    Unreadable,
}

impl ViolationKind {
    pub const ALL: [ViolationKind; 15] = [
        ViolationKind::AddressOrphan,
        ViolationKind::AddressWrongOwner,
        ViolationKind::AddressMissing,
        ViolationKind::PodAddressesChanged,
        ViolationKind::PodNetnsGone,
        ViolationKind::SteeringMissing,
        ViolationKind::SteeringOrphan,
        ViolationKind::RoutingMissing,
        ViolationKind::CaptureOrphan,
        ViolationKind::RulesMissing,
        ViolationKind::ProbeSetOrphan,
        ViolationKind::ProbeSetMissing,
        ViolationKind::HostRulesMissing,
        ViolationKind::MixedCapture,
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
            ViolationKind::CaptureOrphan => "capture_orphan",
            ViolationKind::RulesMissing => "rules_missing",
            ViolationKind::ProbeSetOrphan => "probe_set_orphan",
            ViolationKind::ProbeSetMissing => "probe_set_missing",
            ViolationKind::HostRulesMissing => "host_rules_missing",
            ViolationKind::MixedCapture => "mixed_capture",
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
    /// The network namespace concerned, when it is no enrolled pod's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    pub detail: String,
}

impl Violation {
    pub(crate) fn new(kind: ViolationKind, detail: String) -> Self {
        Self {
            kind,
            pod: None,
            address: None,
            pin: None,
            netns: None,
            detail,
        }
    }

    pub(crate) fn pod(self, pod: &PodConfig) -> Self {
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

    pub(crate) fn pin(mut self, pin: &Path) -> Self {
        self.pin = Some(pin.to_owned());
        self
    }

    pub(crate) fn in_netns(mut self, netns: &Path) -> Self {
        self.netns = Some(netns.to_owned());
        self
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.detail)
    }
}

/// A [`ViolationKind::PodAddressesChanged`] when the pod `key`'s namespace
/// (`net`, read from `netns`) no longer has the addresses it was enrolled
/// with, `enrolled`, or has addresses it cannot be enrolled with (none, or
/// more than one of a family): enrolling it again follows the change, or
/// says why it cannot. Both modes check this.
pub(crate) fn addresses_changed(
    key: PodKey,
    enrolled: &[IpAddr],
    net: &super::podnet::PodNetwork,
    netns: &crate::netns::Netns,
) -> Option<Violation> {
    let (mut now, why) = match super::pod_addresses(net, netns) {
        Ok(addresses) => (addresses, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let mut enrolled = enrolled.to_vec();
    now.sort_unstable();
    enrolled.sort_unstable();
    if now == enrolled && why.is_none() {
        return None;
    }
    let show = |ips: &[IpAddr]| {
        ips.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let now = match why {
        Some(e) => e.to_string(),
        None => format!("now has [{}]", show(&now)),
    };
    Some(
        Violation::new(
            ViolationKind::PodAddressesChanged,
            format!(
                "the pod with {key} was enrolled with [{}]; {now}",
                show(&enrolled)
            ),
        )
        .for_pod(key),
    )
}

/// The pods that a netfilter mode (iptables, nftables) repairs by enrolling
/// them again: their rules or reply routing are missing, or their addresses
/// changed. Each once, in order.
pub(crate) fn pods_to_enrol_again(violations: &[Violation]) -> Vec<PodKey> {
    let mut again: Vec<PodKey> = violations
        .iter()
        .filter(|v| {
            matches!(
                v.kind,
                ViolationKind::RulesMissing
                    | ViolationKind::RoutingMissing
                    | ViolationKind::PodAddressesChanged
            )
        })
        .filter_map(|v| v.pod)
        .collect();
    again.sort_unstable();
    again.dedup();
    again
}

pub(crate) fn key_of(pod: &PodConfig) -> PodKey {
    PodKey {
        netns_cookie: pod.netns_cookie,
        netns_inode: pod.netns_inode,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn every_kind_has_a_distinct_metric_label() {
        let labels: HashSet<&str> = ViolationKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(labels.len(), ViolationKind::ALL.len());
        for (i, kind) in ViolationKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }
}
