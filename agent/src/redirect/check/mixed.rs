//! Another agent's capture beside ambpf's in an enrolled pod: Istio's
//! in-pod rules (written by Istio's node agent, or by ambpf in another
//! mode) in a namespace ambpf captures too. Istio's node agent and ambpf
//! each believe they own such a pod, and the kernel decides which of them
//! gets each connection, so it is reported ([`ViolationKind::MixedCapture`])
//! with the capture that wins, and never repaired here: the other rules may
//! be another running agent's.
//!
//! Which capture wins follows from where each runs:
//! - ambpf's eBPF capture runs first: its connect hooks send an outbound
//!   connection to ztunnel's loopback listener before a packet exists
//!   (Istio's rules skip loopback), and its steering filter hands an
//!   inbound SYN to ztunnel at tc ingress, before netfilter;
//! - two netfilter rule sets (iptables and nftables) both sit in the nat
//!   hooks at the same priority: the first the kernel runs redirects the
//!   connection and the other finds it already translated.
//!
//! Reading a namespace's rules takes a process per backend and family, so
//! the eBPF mode looks only when asked (`ambpf status --check`); the
//! iptables and nftables modes, whose full check already reads each pod's
//! rules, look in every full check.

use tracing::debug;

use super::{Violation, ViolationKind};
use crate::{
    netns::Netns,
    redirect::{PodKey, RedirectMode, iptables, nftables},
};

/// A [`ViolationKind::MixedCapture`] for each of `pods` (enrolled in `own`
/// mode) that holds another capture than `own`'s; `nft` reads nftables
/// tables (`None`: no `nft` on the node, so none can have been written with
/// it here).
pub fn scan_mixed_capture(
    own: RedirectMode,
    pods: &[(PodKey, &Netns)],
    nft: Option<&nftables::Nft>,
) -> Vec<Violation> {
    scan_named(own, pods, nft, &|key| format!("the pod with {key}"))
}

/// [`scan_mixed_capture`], naming each pod with `name_of`.
fn scan_named(
    own: RedirectMode,
    pods: &[(PodKey, &Netns)],
    nft: Option<&nftables::Nft>,
    name_of: &dyn Fn(PodKey) -> String,
) -> Vec<Violation> {
    let mut out = Vec::new();
    for (key, netns) in pods {
        let name = name_of(*key);
        match other_capture(own, netns, nft) {
            Ok(others) if others.is_empty() => {}
            Ok(others) => out.push(
                Violation::new(
                    ViolationKind::MixedCapture,
                    format!(
                        "{name} also holds {}; {}",
                        others.join(" and "),
                        winner(own)
                    ),
                )
                .for_pod(*key),
            ),
            Err(e) => out.push(
                Violation::new(
                    ViolationKind::Unreadable,
                    format!("reading the rules of {name}: {e}"),
                )
                .for_pod(*key),
            ),
        }
    }
    out
}

/// The `nft` to read tables with in `host`, if the node has a usable one.
pub fn node_nft(host: &Netns) -> Option<nftables::Nft> {
    nftables::Nft::find(host)
        .inspect_err(|e| debug!("not reading nftables tables: {e}"))
        .ok()
}

/// [`node_nft`] in the agent's own namespace (it runs in the node's,
/// hostNetwork); `None` when that cannot be opened either.
pub fn own_node_nft() -> Option<nftables::Nft> {
    Netns::open("/proc/self/ns/net")
        .inspect_err(|e| debug!("not reading nftables tables: {e}"))
        .ok()
        .and_then(|host| node_nft(&host))
}

/// Each capture in `netns` that is not `own` mode's, described.
fn other_capture(
    own: RedirectMode,
    netns: &Netns,
    nft: Option<&nftables::Nft>,
) -> Result<Vec<String>, String> {
    let mut others = Vec::new();
    if own != RedirectMode::Iptables {
        let chains = iptables::find_any_pod_capture(netns).map_err(|e| e.to_string())?;
        if !chains.is_empty() {
            others.push(format!(
                "Istio's in-pod iptables rules ({}; Istio's node agent and ambpf's iptables \
                 mode write the same)",
                chains.join(", ")
            ));
        }
    }
    if let Some(nft) = nft {
        let tables = nftables::find_any_pod_capture(nft, netns).map_err(|e| e.to_string())?;
        if own != RedirectMode::Nftables && !tables.ours.is_empty() {
            others.push(format!(
                "ambpf's nftables mode's tables ({})",
                tables.ours.join(", ")
            ));
        }
        if !tables.foreign.is_empty() {
            others.push(format!(
                "another agent's nftables tables of Istio's names, without ambpf's comment \
                 (Istio's node agent's: {})",
                tables.foreign.join(", ")
            ));
        }
    }
    Ok(others)
}

/// Which capture gets the pod's connections, beside another.
fn winner(own: RedirectMode) -> &'static str {
    match own {
        RedirectMode::Ebpf => {
            "ambpf's eBPF capture gets its connections first (connect hooks before any \
             packet, the steering filter before netfilter), and the other rules find them \
             already sent to ztunnel"
        }
        RedirectMode::Iptables | RedirectMode::Nftables => {
            "both are netfilter nat rules at the same hook: whichever the kernel runs first \
             redirects each connection"
        }
    }
}

/// The eBPF mode's pods pinned under `pins` whose namespaces are found, for
/// `ambpf status --check` to check once located: none when the pins cannot
/// be read (the records check says why), and a pod whose namespace is gone
/// is the records check's to report.
pub fn locate_pinned(pins: &crate::bpf::PinLayout) -> Vec<(PodKey, Netns)> {
    let Ok(pinned) = super::read_pinned_pods(pins) else {
        return Vec::new();
    };
    let mut located = super::locate_pods(&pinned.pods, &[]);
    pinned
        .pods
        .iter()
        .filter_map(|pod| Some((super::key_of(pod), located.remove(&pod.netns_cookie)??)))
        .collect()
}

/// [`scan_mixed_capture`] for the eBPF mode's `pods` pinned under `pins`
/// ([`locate_pinned`]), named as the agent recorded them.
pub fn scan_pinned(pins: &crate::bpf::PinLayout, pods: &[(PodKey, &Netns)]) -> Vec<Violation> {
    let nft = Netns::open("/proc/self/ns/net")
        .ok()
        .and_then(|h| node_nft(&h));
    // Pods are named as Kubernetes knows them where the agent recorded it.
    let names = crate::bpf::pod_names::read_all(pins).unwrap_or_default();
    let name_of = |key: PodKey| match names.get(&key.netns_cookie) {
        Some(pod) => format!("pod {}/{} ({key})", pod.namespace, pod.name),
        None => format!("the pod with {key}"),
    };
    scan_named(RedirectMode::Ebpf, pods, nft.as_ref(), &name_of)
}
