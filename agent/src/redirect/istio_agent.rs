//! Istio's node agent's capture in a pod ambpf takes over: found, and
//! removed once ambpf's own capture is in place.
//!
//! Istio's agent leaves its in-pod rules in every pod when it stops, even
//! when it is uninstalled (its shutdown removes only its host rules, probe
//! ipset and CNI plugin). So a node moving from it to ambpf keeps every pod
//! captured by those rules until ambpf holds the pod; then they go, as
//! another mode of ambpf's goes after a `helm upgrade`
//! ([`super::retire`]): the nat and raw capture, while the mangle reply
//! path and the policy routing, which every mode shares and connections
//! opened before still need, stay.
//!
//! Istio's iptables rules and ambpf's iptables mode's are the same rules,
//! so in the iptables mode they are ambpf's from its first enrolment and
//! only Istio's nftables tables are another's. Istio's nftables tables have
//! the names of ambpf's nftables mode's without its comment.

use super::{EnrollError, RedirectMode, iptables, nftables};
use crate::netns::Netns;

/// Istio's node agent's capture found in a pod's namespace, each part
/// described for the logs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IstioCapture {
    /// Its in-pod iptables chains that capture (`<backend> <family>:
    /// <table> <chain>`).
    pub iptables: Vec<String>,
    /// Its nftables tables that capture (`inet <table>`).
    pub nftables: Vec<String>,
}

impl IstioCapture {
    pub fn is_empty(&self) -> bool {
        self.iptables.is_empty() && self.nftables.is_empty()
    }
}

impl std::fmt::Display for IstioCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<&str> = self
            .iptables
            .iter()
            .chain(&self.nftables)
            .map(String::as_str)
            .collect();
        f.write_str(&parts.join(", "))
    }
}

/// Istio's capture in `netns` that is not `own` mode's (`None`: ambpf holds
/// nothing there, so every Istio rule is another agent's). `nft` reads
/// nftables tables (`None`: the node has no usable `nft`, so none were
/// written with it).
pub fn find(
    netns: &Netns,
    nft: Option<&nftables::Nft>,
    own: Option<RedirectMode>,
) -> Result<IstioCapture, String> {
    let mut found = IstioCapture::default();
    if own != Some(RedirectMode::Iptables) {
        found.iptables = iptables::find_any_pod_capture(netns).map_err(|e| e.to_string())?;
    }
    if let Some(nft) = nft {
        let tables = nftables::find_any_pod_capture(nft, netns).map_err(|e| e.to_string())?;
        found.nftables = tables.foreign;
        if own.is_none() {
            found.nftables.extend(tables.ours);
        }
    }
    Ok(found)
}

/// Removes `found` ([`find`]) from `netns`: the capture only, idempotently.
pub fn remove_capture(
    netns: &Netns,
    nft: Option<&nftables::Nft>,
    found: &IstioCapture,
) -> Result<(), EnrollError> {
    if !found.iptables.is_empty() {
        iptables::remove_pod_capture(netns)?;
    }
    if let (false, Some(nft)) = (found.nftables.is_empty(), nft) {
        nftables::remove_foreign_pod_capture(nft, netns)?;
    }
    Ok(())
}

/// Taking Istio's node agent's pods over: after each pass, Istio's capture
/// comes out of each pod ambpf holds, looked at once each; the pods ambpf
/// does not hold yet keep it.
///
/// Started when ambpf took the socket over from another ZDS server, or
/// started on a node where it had no state (installed after Istio's agent
/// was removed): the pods' rules are read only then, a process per backend
/// and family per pod. A marker directory under the pin root says it is
/// under way until it ends, so that an agent killed halfway carries on
/// after its restart ([`IstioRetirement::under_way`]).
#[derive(Debug)]
pub struct IstioRetirement {
    own: RedirectMode,
    marker: std::path::PathBuf,
    nft: Option<nftables::Nft>,
    /// The held pods looked at (by netns cookie).
    looked: std::collections::HashSet<u64>,
    removed: usize,
}

impl IstioRetirement {
    /// The marker of a retirement under way under `pin_root`.
    pub fn marker(pin_root: &std::path::Path) -> std::path::PathBuf {
        pin_root.join("retiring-istio-agent")
    }

    /// Whether an earlier agent left a retirement unfinished.
    pub fn under_way(pin_root: &std::path::Path) -> bool {
        Self::marker(pin_root).is_dir()
    }

    /// Marks a retirement under way under `pin_root`: done as soon as the
    /// takeover is decided, before anything of it is written, so that an
    /// agent killed at any point after carries it on.
    pub fn mark_under_way(pin_root: &std::path::Path) {
        let marker = Self::marker(pin_root);
        if let Err(e) = std::fs::create_dir_all(&marker) {
            tracing::warn!(
                "marking the retirement of Istio's capture as under way ({}): {e}; an agent \
                 restarted before it ends will not carry it on",
                marker.display()
            );
        }
    }

    /// `host`: the node's namespace, where `nft` is found. The caller has
    /// marked it under way ([`Self::mark_under_way`]) as it decided on it.
    pub fn new(own: RedirectMode, host: &Netns, pin_root: &std::path::Path) -> Self {
        tracing::info!(
            "looking for Istio's node agent's capture in the pods: it is removed from each pod \
             once the {} mode holds it",
            own.name()
        );
        Self {
            own,
            marker: Self::marker(pin_root),
            nft: super::check::mixed::node_nft(host),
            looked: Default::default(),
            removed: 0,
        }
    }

    /// One step: `held` are ambpf's pods (by netns cookie); `waiting`, that
    /// a pod ambpf wants is not held yet. Returns whether every pod is free
    /// of Istio's capture.
    pub fn step(&mut self, held: &std::collections::HashMap<u64, &Netns>, waiting: bool) -> bool {
        let mut unfinished = waiting;
        for (&cookie, netns) in held {
            if self.looked.contains(&cookie) {
                continue;
            }
            let removed = find(netns, self.nft.as_ref(), Some(self.own)).and_then(|found| {
                if found.is_empty() {
                    return Ok(None);
                }
                remove_capture(netns, self.nft.as_ref(), &found)
                    .map(|()| Some(found))
                    .map_err(|e| crate::error_chain(&e))
            });
            match removed {
                Ok(None) => {}
                Ok(Some(found)) => {
                    self.removed += 1;
                    tracing::info!(
                        "removed Istio's node agent's capture from {} ({found}): the {} mode \
                         holds it",
                        netns.path().display(),
                        self.own.name()
                    );
                }
                Err(e) => {
                    unfinished = true;
                    tracing::warn!(
                        "removing Istio's node agent's capture from {}, retried after the next \
                         pass: {e}",
                        netns.path().display()
                    );
                    continue;
                }
            }
            self.looked.insert(cookie);
        }
        if unfinished {
            return false;
        }
        if let Err(e) = std::fs::remove_dir(&self.marker)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("removing {}: {e}", self.marker.display());
        }
        tracing::info!(
            "Istio's node agent's capture is retired: every pod the {} mode holds is free of it \
             ({} had it)",
            self.own.name(),
            self.removed
        );
        true
    }
}

/// How long an uninstall waits for Istio's node agent to capture the pods
/// the eBPF mode holds before it removes its own capture all the same.
/// Within the DaemonSet's grace period (30 s), with the rest of the
/// uninstall; Istio's agent wrote its rules at its start-up, normally long
/// before.
pub const HANDOVER_AT_MOST: std::time::Duration = std::time::Duration::from_secs(15);

/// How long the programs outlive their capture at a hand-over, at least.
const HANDOVER_DRAIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Handing the eBPF mode's pods under `pins` to Istio's node agent, which
/// is installed on the node as ambpf is uninstalled: waits until each pod
/// holds Istio's capture (its agent writes its rules into every ambient pod
/// at its start-up, `reconcileIptablesOnStartup`), at most `at_most`, so
/// that the uninstall that follows never leaves a pod uncaptured in
/// between. Returns the pods still without it, named, which lose ambpf's
/// capture all the same (warned).
pub fn await_istio_capture(
    pins: &crate::bpf::PinLayout,
    at_most: std::time::Duration,
) -> Vec<String> {
    let pods = match crate::bpf::inspect::read_pods(pins) {
        Ok(pods) => pods,
        Err(e) => {
            tracing::warn!("reading the eBPF mode's pods to hand over: {e}");
            return Vec::new();
        }
    };
    let host_ns = super::podnet::HostNamespaces::default();
    let nft = super::check::mixed::own_node_nft();
    let deadline = std::time::Instant::now() + at_most;
    let mut waiting: Vec<_> = pods
        .iter()
        .filter_map(|pod| {
            let key = super::PodKey {
                netns_cookie: pod.netns_cookie,
                netns_inode: pod.netns_inode,
            };
            let name = pod.pod.as_ref().map_or_else(
                || format!("the pod with {key}"),
                |p| format!("pod {}/{}", p.namespace, p.name),
            );
            host_ns.find(key).map(|netns| (name, netns))
        })
        .collect();
    tracing::info!(
        "handing {} pods over to Istio's node agent: ambpf's capture goes from them once \
         Istio's is in place",
        waiting.len()
    );
    loop {
        waiting.retain(|(_, netns)| {
            let captured =
                find(netns, nft.as_ref(), Some(RedirectMode::Ebpf)).is_ok_and(|c| !c.is_empty());
            // Istio's nat hooks keep conntrack on from now on.
            if let (true, Some(nft)) = (captured, &nft)
                && let Err(e) = remove_conntrack_table(nft, netns)
            {
                tracing::warn!(
                    "removing {CONNTRACK_TABLE} from {}: {e}",
                    netns.path().display()
                );
            }
            !captured
        });
        if waiting.is_empty() || std::time::Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let left: Vec<String> = waiting.iter().map(|(name, _)| name.clone()).collect();
    // The programs answer ztunnel for the connections they redirected (their
    // original destination) until it has accepted them: their capture stops
    // first, and the uninstall removes them a moment later, as a change of
    // mode does ([`super::retire`]).
    for pod in &pods {
        if let Err(e) = crate::bpf::inspect::forget_pod(pins, pod.netns_cookie) {
            tracing::warn!(
                "stopping the capture of the pod with cookie {}: {e}",
                pod.netns_cookie
            );
        }
    }
    std::thread::sleep(HANDOVER_DRAIN);
    let drain_deadline = std::time::Instant::now() + HANDOVER_DRAIN * 5;
    while std::time::Instant::now() < drain_deadline
        && pods.iter().any(|pod| {
            let key = super::PodKey {
                netns_cookie: pod.netns_cookie,
                netns_inode: pod.netns_inode,
            };
            host_ns.find(key).is_some_and(super::retire::awaits_ztunnel)
        })
    {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    if !left.is_empty() {
        tracing::warn!(
            "Istio's node agent has not captured {} within {} s: ambpf's capture goes from \
             them all the same, and they are uncaptured until it does",
            left.join(", "),
            at_most.as_secs()
        );
    }
    left
}

/// The table that keeps conntrack on in an eBPF-mode pod once Istio's node
/// agent is coming: an empty nat hook, which translates nothing.
pub const CONNTRACK_TABLE: &str = "ambpf-conntrack";

/// Readying the eBPF mode's pods for the rules Istio's node agent writes
/// into every ambient pod as it starts on the node (a move to it).
///
/// The eBPF mode leaves no netfilter rule in a pod, so nothing tracks its
/// connections. Once Istio's nat rules are written, conntrack picks an open
/// connection up at its next packet as a new one and Istio's REDIRECT
/// applies to it: ztunnel's connections to the app and the app's to
/// ztunnel would be sent to 15001 or 15006, where no socket has their
/// tuple, and reset. So as soon as the pod source shows an agent pod of
/// Istio's on the node (seconds before its agent writes anything: its
/// image starts, its informers sync), each pod gets an empty nat hook,
/// which turns conntrack on there with no translation, and its established
/// TCP connections are entered in conntrack without a NAT binding
/// ([`super::in_pod::conntrack`]); nat never touches them afterwards. New
/// connections are captured as before. The table goes with ambpf's
/// uninstall ([`await_istio_capture`]) or with the pod.
#[derive(Debug, Default)]
pub struct IstioArrival {
    nft: Option<nftables::Nft>,
    /// The pods readied (by netns cookie).
    readied: std::collections::HashSet<u64>,
    /// Istio's agent pods last seen.
    agents: std::collections::BTreeSet<String>,
}

impl IstioArrival {
    /// One step, after a pass: `agents` are Istio's node agent's pods on the
    /// node; `pods`, the eBPF mode's (by netns cookie).
    pub fn step<'a>(
        &mut self,
        agents: &std::collections::BTreeSet<String>,
        pods: impl Iterator<Item = (u64, &'a Netns)>,
    ) {
        if *agents != self.agents {
            if !agents.is_empty() {
                tracing::info!(
                    "Istio's node agent is on the node ({}): readying every pod for its rules \
                     (conntrack turned on, open connections entered)",
                    agents.iter().cloned().collect::<Vec<_>>().join(", ")
                );
            }
            self.agents = agents.clone();
        }
        if agents.is_empty() {
            return;
        }
        if self.nft.is_none() {
            self.nft = super::check::mixed::own_node_nft();
        }
        let Some(nft) = &self.nft else {
            tracing::warn!(
                "Istio's node agent is on the node, but no usable nft: the pods' open \
                 connections may be reset when it writes its rules"
            );
            return;
        };
        for (cookie, netns) in pods {
            if self.readied.contains(&cookie) {
                continue;
            }
            match ready_for_rules(nft, netns) {
                Ok(entered) => {
                    tracing::debug!(
                        "readied {} for Istio's rules: {entered} open connections entered in \
                         conntrack",
                        netns.path().display()
                    );
                    self.readied.insert(cookie);
                }
                Err(e) => tracing::warn!(
                    "readying {} for Istio's node agent's rules (retried after the next \
                     pass): {e}",
                    netns.path().display()
                ),
            }
        }
    }
}

/// Turns conntrack on in `netns` with an empty nat hook, then enters its
/// established connections; returns how many.
fn ready_for_rules(nft: &nftables::Nft, netns: &Netns) -> Result<usize, String> {
    nft.apply(
        netns,
        &format!(
            "add table inet {CONNTRACK_TABLE} {{ comment \"ambpf: conntrack on for another \
             agent's rules\" ; }}\n\
             add chain inet {CONNTRACK_TABLE} prerouting {{ type nat hook prerouting priority \
             dstnat + 10 ; }}\n\
             add chain inet {CONNTRACK_TABLE} output {{ type nat hook output priority -90 ; }}\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    super::in_pod::conntrack::track_established(netns).map_err(|e| e.to_string())
}

/// Removes [`CONNTRACK_TABLE`] from `netns`, if there.
pub fn remove_conntrack_table(nft: &nftables::Nft, netns: &Netns) -> Result<(), String> {
    nft.apply(
        netns,
        &format!("add table inet {CONNTRACK_TABLE}\ndelete table inet {CONNTRACK_TABLE}\n"),
    )
    .map_err(|e| e.to_string())
}

/// The nftables mode's hand-over to Istio's node agent: where Istio's agent
/// runs its iptables backend, its rules are in each pod beside the nftables
/// mode's tables, which go (its policy routing, the same as Istio's, stays),
/// and so does the host table once no pod keeps the mode's tables. Where it
/// runs its nftables backend, the tables are the same ones, rewritten by
/// Istio's agent at its start, and stay. Pods are found by the mode's
/// records under `pins`.
pub fn hand_over_nftables(pins: &crate::bpf::PinLayout) {
    let host = match Netns::open("/proc/self/ns/net") {
        Ok(host) => host,
        Err(e) => {
            tracing::warn!("handing the nftables mode's pods over: {e}");
            return;
        }
    };
    let Some(nft) = super::check::mixed::node_nft(&host) else {
        return;
    };
    let Some(records) = super::in_pod::records::PodRecords::existing(pins.nftables_pods_dir())
    else {
        return;
    };
    let keys = records.read().unwrap_or_default();
    let host_ns = super::podnet::HostNamespaces::default();
    let mut kept = 0;
    for key in keys {
        let Some(netns) = host_ns.find(key) else {
            continue;
        };
        let istio_iptables = iptables::find_any_pod_capture(netns).unwrap_or_default();
        let ours = nftables::find_pod_tables(&nft, netns)
            .map(|(ours, _)| ours)
            .unwrap_or_default();
        if ours.is_empty() {
            continue;
        }
        if istio_iptables.is_empty() {
            kept += 1;
            continue;
        }
        match nft.apply(netns, &nftables::delete_tables(&ours)) {
            Ok(()) => tracing::info!(
                "removed the nftables mode's tables from {}: Istio's iptables rules capture it",
                netns.path().display()
            ),
            Err(e) => {
                kept += 1;
                tracing::warn!(
                    "removing the nftables mode's tables from {}: {e}",
                    netns.path().display()
                );
            }
        }
    }
    if kept == 0
        && let Err(e) = nftables::remove_host_table(&nft, &host)
    {
        tracing::warn!("removing the nftables mode's host table: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marked as soon as the takeover is decided, the retirement stays
    /// under way (for a restarted agent to carry on) until no pod the mode
    /// wants is left to look at.
    #[test]
    fn a_retirement_is_under_way_from_its_mark_until_it_ends() {
        let root = std::env::temp_dir().join(format!("ambpf-retire-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        assert!(!IstioRetirement::under_way(&root));
        IstioRetirement::mark_under_way(&root);
        assert!(IstioRetirement::under_way(&root));
        let host = Netns::open("/proc/self/ns/net").unwrap();
        let mut retirement = IstioRetirement::new(RedirectMode::Ebpf, &host, &root);
        assert!(
            !retirement.step(&Default::default(), true),
            "a pod not held yet"
        );
        assert!(IstioRetirement::under_way(&root));
        assert!(retirement.step(&Default::default(), false));
        assert!(!IstioRetirement::under_way(&root));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
