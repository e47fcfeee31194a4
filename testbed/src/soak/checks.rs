//! Check rounds: what the agent has in the kernel, in pods' namespaces, in
//! the node's, in the API server and in its own fd table, against what the
//! pods must have. A leftover counts when two rounds in a row see it
//! ([`super::invariants::Leaks`]); at the end, after every pod is deleted,
//! nothing of any pod may be left.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde_json::Value;

use super::{Mode, Soak, events::label, netstate};

/// In-namespace reads per round (each is a handful of `ip`/`tc` runs); the
/// final rounds read every pod.
const NETNS_SAMPLE: usize = 6;
/// A pod held this long must show everything it needs.
const GRACE: Duration = Duration::from_secs(1);
/// The annotator patches at once and retries every 5 s (the kube source's
/// resync) when the API server did not take it.
const ANNOTATION_GRACE: Duration = Duration::from_secs(12);

impl Soak<'_> {
    /// One round; `full` reads every pod's namespace and runs `ambpf status
    /// --check` (used where nothing is in flight).
    pub(super) async fn check_round(&mut self, full: bool) -> Result<()> {
        let now = Instant::now();
        let mut suspects = HashSet::new();
        let (held, accounted, accounted_uids, gone_at) = {
            let t = self.tracker();
            (
                t.held_since(),
                t.accounted_inodes(),
                t.accounted_uids(),
                t.gone_at.clone(),
            )
        };
        let settled = |since: &Instant| now.duration_since(*since) > GRACE;

        // ztunnel holds only pods that may be held.
        for uid in self
            .double()
            .inspect(|s| s.workloads.keys().cloned().collect::<Vec<_>>())
        {
            if !accounted_uids.contains(&uid) {
                suspects.insert(format!(
                    "ztunnel|ztunnel holds pod {uid}, which is not ambient or is deleted"
                ));
            }
        }
        *self
            .checks
            .entry("ztunnel holds only ambient pods")
            .or_default() += 1;

        // The pinned maps: every enrolled netns belongs to a pod that may be
        // enrolled; every held pod is enrolled.
        if self.cfg.mode == Mode::Ebpf {
            let status = self.agent.status()?;
            let enrolled: HashSet<u64> = status["pods"]
                .as_array()
                .map(|pods| {
                    pods.iter()
                        .filter_map(|p| p["netns_inode"].as_u64())
                        .collect()
                })
                .unwrap_or_default();
            for inode in &enrolled {
                if !accounted.contains(inode) {
                    suspects.insert(format!(
                        "map entry|{} entry for netns {inode}, of no ambient pod: {}",
                        common_maps_pods(),
                        pod_of(&status, *inode)
                    ));
                }
            }
            for (inode, since) in &held {
                if settled(since) && !enrolled.contains(inode) {
                    let uid = self
                        .world
                        .slots
                        .iter()
                        .filter_map(|s| s.pod.as_ref())
                        .find(|p| p.netns_inode == *inode)
                        .map(|p| p.uid.clone())
                        .unwrap_or_default();
                    suspects.insert(format!(
                        "redirect|netns {inode} is held by ztunnel but has no {} entry; ztunnel's events for it: {}",
                        common_maps_pods(),
                        ztunnel_history(&self.double(), &uid)
                    ));
                }
            }
            // Per-pod link directories (by netns cookie) only for enrolled
            // pods; no per-interface TCX links.
            let cookies: HashSet<u64> = status["pods"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["netns_cookie"].as_u64())
                .collect();
            let pod_links = self.agent.pin_root.join("links/pods");
            for entry in std::fs::read_dir(&pod_links)
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.parse().is_ok_and(|c: u64| !cookies.contains(&c)) {
                    suspects.insert(format!(
                        "pinned link|{} belongs to no enrolled pod",
                        entry.path().display()
                    ));
                }
            }
            if !status["tc_links"].as_array().is_none_or(Vec::is_empty) {
                suspects.insert(format!(
                    "pinned link|TCX links pinned: {}",
                    status["tc_links"]
                ));
            }
            *self.checks.entry("pinned maps and links").or_default() += 1;
            if full {
                let pods = maps_entries(&status, "ambpf_pods");
                let ips = maps_entries(&status, "ambpf_pod_ips");
                if pods != Some(enrolled.len() as u64) || ips != Some(2 * enrolled.len() as u64) {
                    self.violation(
                        "map entry",
                        format!(
                            "{} enrolled pods, but ambpf_pods has {pods:?} entries and ambpf_pod_ips {ips:?} (2 addresses a pod)",
                            enrolled.len()
                        ),
                    );
                }
                if let Some(report) = self.agent.status_check()? {
                    self.violation("pinned state", format!("ambpf status --check: {report}"));
                }
                *self.checks.entry("ambpf status --check").or_default() += 1;
            }
        }

        // The agent's fds: netns fds only of pods that may be enrolled.
        let node_inode = self.world.cluster.node.inode().unwrap_or(0);
        for inode in self.agent.netns_fds() {
            if inode != node_inode && !accounted.contains(&inode) {
                suspects.insert(format!(
                    "fd|the agent holds an fd on netns {inode}, of no ambient pod"
                ));
            }
        }
        *self.checks.entry("agent netns fds").or_default() += 1;

        // Annotations: `enabled` on held pods, none on pods that are not
        // ambient.
        let want_annotation: Vec<(String, bool, Option<String>)> = self
            .world
            .slots
            .iter()
            .filter_map(|s| s.pod.as_ref())
            .filter(|p| p.listed)
            .filter_map(|p| {
                let lbl = label(p.namespace, &p.name);
                let now_annotated = self.world.annotation(p.namespace, &p.name);
                if held
                    .get(&p.netns_inode)
                    .is_some_and(|since| now.duration_since(*since) > ANNOTATION_GRACE)
                {
                    Some((lbl, true, now_annotated))
                } else if !self.world.is_ambient(p)
                    && !accounted.contains(&p.netns_inode)
                    && gone_at
                        .get(&p.uid)
                        .is_none_or(|at| now.duration_since(*at) > ANNOTATION_GRACE)
                {
                    Some((lbl, false, now_annotated))
                } else {
                    None
                }
            })
            .collect();
        if !self.api_down {
            for (lbl, want, now_annotated) in want_annotation {
                match (want, now_annotated.as_deref()) {
                    (true, Some("enabled")) | (false, None) => {}
                    (true, other) => {
                        suspects.insert(format!(
                            "annotation|{lbl} is held by ztunnel but annotated {other:?}"
                        ));
                    }
                    (false, Some(other)) => {
                        suspects.insert(format!(
                            "annotation|{lbl} is not ambient but still annotated {other:?}"
                        ));
                    }
                }
            }
            *self.checks.entry("annotations").or_default() += 1;
        }

        // Inside namespaces: a sample of pods (all of them when `full`),
        // free slots, and the node.
        let iptables = self.cfg.mode == Mode::Iptables;
        let mut slots: Vec<usize> = (0..self.world.slots.len()).collect();
        if !full {
            for i in 0..slots.len() {
                let j = i + self.rng.below(slots.len() - i);
                slots.swap(i, j);
            }
            slots.truncate(NETNS_SAMPLE);
        }
        for slot in slots {
            let ns = self.world.cluster.pods[slot].ns.name().to_owned();
            let pod = self.world.slots[slot].pod.as_ref();
            let inode = self.world.cluster.pods[slot].ns.inode().unwrap_or(0);
            let what = pod.map_or_else(
                || format!("free slot {slot}"),
                |p| label(p.namespace, &p.name),
            );
            let found = netstate::installed(&ns, &["eth0"], iptables)?;
            let must_have = pod.is_some() && held.get(&inode).is_some_and(settled);
            let must_be_clean =
                pod.is_none_or(|p| !self.world.is_ambient(p)) && !accounted.contains(&inode);
            if must_have {
                let missing = netstate::missing_for_redirected(&found, !iptables);
                if !missing.is_empty() {
                    suspects.insert(format!(
                        "redirect|{what} is held by ztunnel but lacks {}",
                        missing.join(", ")
                    ));
                }
            } else if must_be_clean
                && !found.is_empty()
                // By design a pod that left the mesh alive keeps its reply
                // routing (it matches only connections ztunnel made).
                && !(pod.is_some_and(|p| p.ever_ambient) && netstate::only_reply_routing(&found))
            {
                suspects.insert(format!(
                    "installed in a pod that is not ambient|{what}: {}",
                    found.join("; ")
                ));
            }
            *self.checks.entry("pod namespace state").or_default() += 1;
        }
        let node = self.world.cluster.node.name().to_owned();
        let vpods: Vec<String> = (0..self
            .world
            .slots
            .len()
            .min(if full { usize::MAX } else { 2 }))
            .map(|i| format!("vpod{}", i + 1))
            .collect();
        let mut ifaces: Vec<&str> = vpods.iter().map(String::as_str).collect();
        ifaces.push("vremote");
        // The iptables mode, as Istio's, adds a host-probe SNAT chain to the
        // node's own rules by design; in eBPF mode the node has no ISTIO chain.
        let found = netstate::installed(&node, &ifaces, !iptables)?;
        if !found.is_empty() {
            suspects.insert(format!(
                "installed in the node's namespace|{}",
                found.join("; ")
            ));
        }
        *self.checks.entry("node namespace state").or_default() += 1;

        for confirmed in self.leaks.round(suspects) {
            let (kind, detail) = confirmed.split_once('|').unwrap_or(("leak", &confirmed));
            let kind = leak_kind(kind);
            self.violation(kind, detail.to_owned());
        }
        Ok(())
    }

    /// After every pod is deleted: nothing of any pod is left.
    pub(super) fn check_empty(&mut self) {
        let held = self.double().inspect(|s| s.workloads.len());
        if held > 0 {
            self.violation(
                "leak at the end",
                format!("ztunnel still holds {held} pods"),
            );
        }
        if self.cfg.mode == Mode::Ebpf {
            match self.agent.status() {
                Ok(status) => {
                    for map in ["ambpf_pods", "ambpf_pod_ips", "ambpf_pod_cnt"] {
                        if let Some(n) = maps_entries(&status, map).filter(|&n| n > 0) {
                            self.violation(
                                "leak at the end",
                                format!("{map} has {n} entries with no pod left"),
                            );
                        }
                    }
                }
                Err(e) => self.violation("leak at the end", format!("ambpf status: {e:#}")),
            }
        }
        let fds = self.agent.netns_fds();
        let node_inode = self.world.cluster.node.inode().unwrap_or(0);
        let pod_fds = fds.iter().filter(|&&i| i != node_inode).count();
        if pod_fds > 0 {
            self.violation(
                "leak at the end",
                format!("the agent holds {pod_fds} pod netns fds with no pod left"),
            );
        }
        for slot in &self.world.slots {
            if let Some(pod) = &slot.pod {
                self.violation("leak at the end", format!("pod {} still there", pod.uid));
            }
        }
        *self.checks.entry("nothing left at the end").or_default() += 1;
    }
}

fn leak_kind(kind: &str) -> &'static str {
    match kind {
        "ztunnel" => "ztunnel holds a pod it must not",
        "map entry" => "map entry outlives its pod",
        "redirect" => "held but not redirected",
        "pinned link" => "pinned link outlives its pod",
        "fd" => "fd outlives its pod",
        "annotation" => "annotation",
        "installed in a pod that is not ambient" => "installed in a pod that is not ambient",
        "installed in the node's namespace" => "installed in the node's namespace",
        _ => "leak",
    }
}

fn common_maps_pods() -> &'static str {
    ambpf_common::maps::PODS_BY_NETNS
}

/// Entries of the pinned map `name` in `ambpf status --json`.
fn maps_entries(status: &Value, name: &str) -> Option<u64> {
    status["maps"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == name)?["entries"]
        .as_u64()
}

/// The pod `ambpf status` recorded for netns `inode`.
fn pod_of(status: &Value, inode: u64) -> String {
    status["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["netns_inode"] == inode)
        .map_or_else(|| "?".to_owned(), |p| p["pod"].to_string())
}

/// The double's last events about pod `uid` (and connection changes among
/// them), for a violation's details.
pub(super) fn ztunnel_history(double: &crate::ztunnel::ZtunnelDouble, uid: &str) -> String {
    use crate::ztunnel::ZdsEvent;
    double.inspect(|s| {
        let mut about: Vec<String> = Vec::new();
        let mut since_connected = String::new();
        for e in &s.events {
            match e {
                ZdsEvent::Add {
                    uid: u,
                    netns_inode,
                    ..
                } if u == uid => about.push(format!("Add(netns {netns_inode}){since_connected}")),
                ZdsEvent::Keep { uid: u } if u == uid => {
                    about.push(format!("Keep{since_connected}"))
                }
                ZdsEvent::Del { uid: u } if u == uid => about.push(format!("Del{since_connected}")),
                ZdsEvent::Nacked {
                    uid: Some(u),
                    reason,
                } if u == uid => about.push(format!("NACK {reason}{since_connected}")),
                ZdsEvent::Connected { connection } => {
                    since_connected = format!(" on connection {connection}")
                }
                _ => {}
            }
        }
        let start = about.len().saturating_sub(6);
        format!(
            "[{}]; held now: {}; {} connections",
            about[start..].join(", "),
            s.workloads.contains_key(uid),
            s.connections.len()
        )
    })
}
