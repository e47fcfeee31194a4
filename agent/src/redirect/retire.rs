//! Retiring what another of ambpf's modes left on the node, so that
//! changing `redirectMode` with `helm upgrade` switches every pod live.
//!
//! An upgrade is not an uninstall: the old agent stops with its capture in
//! place ([`crate::cni::shutdown`]), and the new one enrols every pod in its
//! own mode beside it. Both captures send a pod's connections to the same
//! ztunnel, so no connection goes uncaptured meanwhile (which of the two
//! gets it: [`super::check::mixed`]). Then the old mode's capture comes out
//! of each pod the new mode holds, and, once no pod has it any more, the
//! old mode's node-wide state: the host's probe SNAT rules and ipsets
//! (iptables), the host table (nftables), or the pinned programs and maps,
//! which detaches them (eBPF), and the old mode's records of its pods.
//!
//! What stays in a pod, on purpose, is what connections opened before the
//! switch need and what captures nothing: the policy routing, which every
//! mode shares; the reply path of the rule-writing modes (their mangle
//! connmark rules, which mark the app's replies to ztunnel on connections it
//! already proxies: without them those replies would be routed out towards
//! the client); and the nat hooks of the nftables mode (an empty table's
//! base chains), which keep translating connections already redirected.
//! They go with the pod, or with `ambpf uninstall`.
//!
//! Fail closed: a pod the new mode does not hold yet (its enrolment failed
//! or waits for its namespace) keeps the old capture, and is looked at again
//! after the next pass; a pod no source wants any more loses the old
//! capture whole, as an opt-out does; a pod whose namespace is gone is only
//! forgotten. The eBPF mode's programs serve every pod at once, so they go
//! only once no pinned pod waits.
//!
//! Only state ambpf recorded is retired: a mode's node-wide state goes only
//! where its records (or pins) show that ambpf's agent ran in that mode
//! here. Istio's own node agent writes the same host rules and ipsets; its
//! state is never touched.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use tracing::{info, warn};

use super::{
    PodKey, RedirectMode, ebpf, in_pod::records::PodRecords, iptables, nftables,
    podnet::HostNamespaces, routing,
};
use crate::{
    bpf::{PinLayout, inspect},
    netns::Netns,
};

/// What the new mode's agent says of a pod another mode left captured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Enrolled in the new mode: the old capture can go.
    Held,
    /// Wanted, but not (yet) enrolled in the new mode: the old capture
    /// stays.
    Pending,
    /// No source wants it in the mesh: the old capture goes whole.
    Unwanted,
}

/// The modes whose state an earlier agent left on the node, being retired.
#[derive(Debug)]
pub struct Retirement {
    own: RedirectMode,
    pins: PinLayout,
    /// The node's namespace (the agent's own), where the host state is.
    host: Netns,
    left: Vec<RedirectMode>,
    /// The eBPF mode's programs, once no pod is captured by them.
    ebpf_drain: Option<EbpfDrain>,
}

impl Retirement {
    /// The other modes than `own` that left state under `pins` (their
    /// records of their pods, or the eBPF mode's pinned maps); `None` when
    /// there is none.
    pub fn find(own: RedirectMode, pins: PinLayout, host: Netns) -> Option<Self> {
        let left: Vec<RedirectMode> = [
            RedirectMode::Ebpf,
            RedirectMode::Iptables,
            RedirectMode::Nftables,
        ]
        .into_iter()
        .filter(|&mode| mode != own && left_behind(mode, &pins))
        .collect();
        for mode in &left {
            info!(
                "the {} mode's capture is still on this node (redirectMode changed): it is \
                 retired pod by pod as the {} mode takes the pods over",
                mode.name(),
                own.name()
            );
        }
        (!left.is_empty()).then_some(Self {
            own,
            pins,
            host,
            left,
            ebpf_drain: None,
        })
    }

    /// The modes not retired yet.
    pub fn left(&self) -> &[RedirectMode] {
        &self.left
    }

    /// Retires what it can: `held` are the new mode's pods (by netns
    /// cookie), `fate` says what becomes of any other pod. Returns whether
    /// everything is retired.
    pub fn step(&mut self, held: &HashMap<u64, &Netns>, fate: &dyn Fn(PodKey) -> Fate) -> bool {
        let mut left = std::mem::take(&mut self.left);
        left.retain(|&mode| {
            let finished = match mode {
                RedirectMode::Ebpf => self.retire_ebpf(held, fate),
                RedirectMode::Iptables | RedirectMode::Nftables => {
                    self.retire_rules(mode, held, fate)
                }
            };
            if finished {
                info!(
                    "the {} mode is retired: no pod holds its capture and its node state is gone",
                    mode.name()
                );
            }
            !finished
        });
        self.left = left;
        self.left.is_empty()
    }

    /// The iptables or nftables mode: each recorded pod, then the host.
    fn retire_rules(
        &self,
        mode: RedirectMode,
        held: &HashMap<u64, &Netns>,
        fate: &dyn Fn(PodKey) -> Fate,
    ) -> bool {
        let dir = match mode {
            RedirectMode::Iptables => self.pins.iptables_pods_dir(),
            _ => self.pins.nftables_pods_dir(),
        };
        let Some(records) = PodRecords::existing(dir) else {
            return true;
        };
        let keys = match records.read() {
            Ok(keys) => keys,
            Err(e) => {
                warn!("reading the {} mode's records: {e}", mode.name());
                return false;
            }
        };
        let nft = match mode {
            RedirectMode::Nftables => match nftables::Nft::find(&self.host) {
                Ok(nft) => Some(nft),
                Err(e) => {
                    warn!("retiring the nftables mode: {}", crate::error_chain(&e));
                    return false;
                }
            },
            _ => None,
        };
        let others = HostNamespaces::default();
        let mut kept = 0;
        for key in keys {
            let Some((netns, fate)) = placed(key, held, &others, fate) else {
                info!(
                    "forgetting the {} mode's pod with {key}: its namespace is gone",
                    mode.name()
                );
                records.remove(key);
                continue;
            };
            let removed = match (fate, &nft) {
                (Fate::Pending, _) => {
                    kept += 1;
                    continue;
                }
                (Fate::Held, None) => iptables::remove_pod_capture(netns),
                (Fate::Held, Some(nft)) => nftables::remove_pod_capture(nft, netns).map(drop),
                (Fate::Unwanted, None) => iptables::remove_pod_rules(netns),
                (Fate::Unwanted, Some(nft)) => nftables::remove_pod_tables(nft, netns).map(drop),
            };
            match removed {
                Ok(()) => {
                    records.remove(key);
                    info!(
                        "removed the {} mode's capture from {} ({key}): {}",
                        mode.name(),
                        netns.path().display(),
                        match fate {
                            Fate::Held => format!("the {} mode holds it", self.own.name()),
                            _ => "it left the mesh".to_owned(),
                        }
                    );
                }
                Err(e) => {
                    kept += 1;
                    warn!(
                        "removing the {} mode's capture from {} ({key}), retried after the \
                         next pass: {}",
                        mode.name(),
                        netns.path().display(),
                        crate::error_chain(&e)
                    );
                }
            }
        }
        if kept > 0 {
            return false;
        }
        let host = match &nft {
            None => iptables::remove_host_rules(&self.host).map_err(|e| crate::error_chain(&e)),
            Some(nft) => {
                nftables::remove_host_table(nft, &self.host).map_err(|e| crate::error_chain(&e))
            }
        };
        if let Err(e) = host {
            warn!("removing the {} mode's host state: {e}", mode.name());
            return false;
        }
        if let Err(e) = records.remove_all() {
            warn!("removing the {} mode's records: {e}", mode.name());
            return false;
        }
        true
    }

    /// The eBPF mode: out of each pinned pod, its steering filter, its
    /// routing (all of it for a pod that left the mesh) and its entry in the
    /// programs' pod map; then, once the programs have drained
    /// ([`EbpfDrain`]), the pins, which detaches them from every pod at once.
    fn retire_ebpf(&mut self, held: &HashMap<u64, &Netns>, fate: &dyn Fn(PodKey) -> Fate) -> bool {
        // No agent may write the pins meanwhile: one still running there (an
        // overlapping rollout) is waited for by retrying later.
        let Some(_lock) = crate::bpf::pins::PinRootLock::try_acquire(&self.pins) else {
            info!("an eBPF-mode agent still holds the pins; retiring it after the next pass");
            return false;
        };
        let pods = match inspect::read_pods(&self.pins) {
            Ok(pods) => pods,
            Err(e) => {
                warn!(
                    "reading the eBPF mode's pinned pods: {}",
                    crate::error_chain(&e)
                );
                return false;
            }
        };
        let others = HostNamespaces::default();
        let mut work = Vec::new();
        for pod in &pods {
            let key = PodKey {
                netns_cookie: pod.netns_cookie,
                netns_inode: pod.netns_inode,
            };
            let Some((netns, fate)) = placed(key, held, &others, fate) else {
                // Its namespace is gone: nothing captures there any more.
                let _ = inspect::forget_pod(&self.pins, key.netns_cookie);
                continue;
            };
            match fate {
                Fate::Pending => {
                    info!(
                        "the eBPF mode's pod with {key} is not held by the {} mode yet: the eBPF \
                         programs stay for now",
                        self.own.name()
                    );
                    return false;
                }
                fate => work.push((key, netns, fate, pod.steering_qdisc_created)),
            }
        }
        let drain = self.ebpf_drain.get_or_insert_with(EbpfDrain::default);
        let mut failed = false;
        for (key, netns, fate, qdisc_created) in work {
            match stop_ebpf_capture(&self.pins, key, netns, fate, qdisc_created) {
                Ok(()) => {
                    info!(
                        "removed the eBPF mode's capture from {} ({key})",
                        netns.path().display()
                    );
                    if fate == Fate::Held {
                        drain.pods.push(key.netns_cookie);
                    }
                }
                Err(e) => {
                    failed = true;
                    warn!(
                        "removing the eBPF mode's capture from {} ({key}), retried after the \
                         next pass: {}",
                        netns.path().display(),
                        crate::error_chain(e.as_ref())
                    );
                }
            }
        }
        if failed || !drain.drained(held) {
            return false;
        }
        match remove_ebpf_pins(&self.pins) {
            Ok(()) => {
                self.ebpf_drain = None;
                true
            }
            Err(e) => {
                warn!("removing the eBPF mode's pins: {e}");
                false
            }
        }
    }

    /// How soon the retirement wants its next step, when sooner than the
    /// controller's retries: while the eBPF programs drain.
    pub fn next_step_within(&self) -> Option<Duration> {
        self.ebpf_drain
            .as_ref()
            .filter(|d| d.since.is_some())
            .map(|_| EBPF_DRAIN_POLL)
    }
}

/// How long the eBPF mode's programs outlive its capture, at least. A
/// connection they redirected to ztunnel's outbound listener is known to
/// conntrack (the new mode's rules track it) only as one to that listener:
/// ztunnel, which asks for its original destination just after accepting
/// it, must be answered by the programs.
const EBPF_DRAIN: Duration = Duration::from_secs(1);
/// ... and at most, while ztunnel leaves such connections unaccepted.
const EBPF_DRAIN_AT_MOST: Duration = Duration::from_secs(30);
/// How often a draining retirement looks again.
const EBPF_DRAIN_POLL: Duration = Duration::from_millis(200);

/// The eBPF programs' last duty once no pod is captured by them any more:
/// answering ztunnel for the connections they redirected.
#[derive(Debug, Default)]
struct EbpfDrain {
    /// When the last pod's capture stopped.
    since: Option<Instant>,
    /// The pods taken out of the programs' capture, which the new mode
    /// holds (by netns cookie).
    pods: Vec<u64>,
    /// Whether waiting on ztunnel was said.
    told: bool,
}

impl EbpfDrain {
    /// Whether the programs may go: [`EBPF_DRAIN`] since the capture
    /// stopped, and no connection waits in ztunnel's outbound listener of a
    /// pod (bounded by [`EBPF_DRAIN_AT_MOST`]).
    fn drained(&mut self, held: &HashMap<u64, &Netns>) -> bool {
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() < EBPF_DRAIN {
            return false;
        }
        let Some(netns) = self
            .pods
            .iter()
            .filter_map(|cookie| held.get(cookie))
            .find(|netns| awaits_ztunnel(netns))
        else {
            return true;
        };
        if since.elapsed() >= EBPF_DRAIN_AT_MOST {
            warn!(
                "ztunnel has not accepted connections redirected by the eBPF mode in {} for {} \
                 s: its programs go all the same, and ztunnel will not learn those \
                 connections' original destination",
                netns.path().display(),
                EBPF_DRAIN_AT_MOST.as_secs()
            );
            return true;
        }
        if !std::mem::replace(&mut self.told, true) {
            info!(
                "the eBPF mode's programs stay until ztunnel accepts the connections they \
                 redirected in {}",
                netns.path().display()
            );
        }
        false
    }
}

/// Whether ztunnel's outbound listener in `netns` has connections it has
/// not accepted yet (unknown counts as yes: the programs stay).
pub(crate) fn awaits_ztunnel(netns: &Netns) -> bool {
    let listeners =
        netns.run(|| crate::sock_diag::tcp_listeners(ambpf_common::ztunnel::OUTBOUND_PORT));
    match listeners {
        Ok(Ok(listeners)) => listeners.iter().any(|l| l.accept_queue > 0),
        Ok(Err(e)) => {
            warn!(
                "reading the sockets listening in {}: {e}",
                netns.path().display()
            );
            true
        }
        // The namespace is gone: nothing waits there.
        Err(_) => false,
    }
}

/// Takes the eBPF mode's capture out of one pod: its steering and routing,
/// then its entry in the programs' pod map (which stops their capture in
/// the pod).
fn stop_ebpf_capture(
    pins: &PinLayout,
    key: PodKey,
    netns: &Netns,
    fate: Fate,
    qdisc_created: bool,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    ebpf::detach_steering(netns, qdisc_created)?;
    match fate {
        Fate::Unwanted => routing::remove_reply_routing(netns)?,
        _ => routing::remove_fwmark_accept(netns)?,
    }
    inspect::forget_pod(pins, key.netns_cookie)?;
    Ok(())
}

/// The namespace of the pod `key` and what becomes of it: [`Fate::Held`]
/// when the new mode holds it, else as `fate` says; `None` when its
/// namespace is gone.
fn placed<'a>(
    key: PodKey,
    held: &HashMap<u64, &'a Netns>,
    others: &'a HostNamespaces,
    fate: &dyn Fn(PodKey) -> Fate,
) -> Option<(&'a Netns, Fate)> {
    match held.get(&key.netns_cookie) {
        Some(netns) => Some((*netns, Fate::Held)),
        None => Some((others.find(key)?, fate(key))),
    }
}

/// The netns cookies of the pods an earlier agent left enrolled in the
/// eBPF mode under `pins`: a rule-writing mode taking them over keeps their
/// open connections (`taking_over` of each mode).
pub fn ebpf_pods(pins: &PinLayout) -> Vec<u64> {
    if !left_behind(RedirectMode::Ebpf, pins) {
        return Vec::new();
    }
    match inspect::read_pods(pins) {
        Ok(pods) => pods.iter().map(|p| p.netns_cookie).collect(),
        Err(e) => {
            warn!(
                "reading the eBPF mode's pinned pods: {}",
                crate::error_chain(&e)
            );
            Vec::new()
        }
    }
}

/// Whether `mode` left state under `pins`.
fn left_behind(mode: RedirectMode, pins: &PinLayout) -> bool {
    match mode {
        RedirectMode::Ebpf => pins.maps_dir().is_dir(),
        RedirectMode::Iptables => pins.iptables_pods_dir().is_dir(),
        RedirectMode::Nftables => pins.nftables_pods_dir().is_dir(),
    }
}

/// Everything under the pin root but the rule-writing modes' records: the
/// programs, maps and links, whose removal detaches the programs.
fn remove_ebpf_pins(pins: &PinLayout) -> std::io::Result<()> {
    let records: Vec<std::path::PathBuf> = [pins.iptables_pods_dir(), pins.nftables_pods_dir()]
        .iter()
        .filter_map(|dir| dir.parent().map(ToOwned::to_owned))
        .collect();
    for entry in std::fs::read_dir(pins.root())? {
        let path = entry?.path();
        if records.contains(&path) {
            continue;
        }
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}
