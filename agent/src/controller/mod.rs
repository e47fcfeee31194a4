//! Programs the pods a source wants: redirection first, then ztunnel.
//!
//! For each pod the sources report, the controller enrols its network
//! namespace in the redirection and then hands it to ztunnel over ZDS, in
//! the order Istio's node agent uses (rules before the Add, so ztunnel never
//! serves a pod whose traffic would bypass it). Pods that go away are
//! unenrolled first (new connections go direct at once) and then deleted
//! from ztunnel. Pods enrolled by an earlier agent (pinned state) that no
//! source reports any more are removed on the first pass: on restart state
//! is reconciled, not recreated.
//!
//! A pod that cannot be enrolled (its netns not ready yet, a netlink error)
//! is reported, left out of ztunnel, and retried on the next pass; the other
//! pods proceed.
//!
//! A pod the CNI plugin posts is enrolled at once, before the source knows
//! it, and kept until the source decides ([`cni`]).
//!
//! The controller's passes enter namespaces, and in iptables mode run
//! `iptables-restore`: [`Controller::spawn`] runs them on a thread of their
//! own, so that ZDS, the CNI endpoint, the watches and `/healthz` never wait
//! behind a pass.

mod cni;

pub use cni::{AbandonRequest, CniEnrolled, CniRequest, CniRequests, EnrollRequest};

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use tokio::sync::watch;
use tracing::{info, warn};

use crate::{
    netns::Netns,
    observe::ControllerStats,
    redirect::{EnrollOptions, EnrolledPod, PodKey, PodRedirection},
    zds::{Workload, ZdsHandle},
};

/// A pod as a source describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSpec {
    pub workload: Workload,
    /// The pod's own DNS capture choice; `None` follows the node.
    pub dns_capture: Option<bool>,
}

/// What a pod source knows of this node's pods, published as a whole.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourcePods {
    /// The ambient pods, with their network namespaces: the pods to enrol.
    pub ambient: Vec<PodSpec>,
    /// uid -> why: pods the source knows on this node and judged not
    /// ambient. A pod in no list (not seen yet) is not the source's to remove.
    pub not_ambient: BTreeMap<String, String>,
    /// Ambient pods the source knows on this node whose network namespace
    /// it has not found yet (a CNI-added pod before its status has an IP).
    /// Listed so that their deletion is an update: a CNI-added pod the
    /// source knew and no longer knows was deleted.
    pub waiting: BTreeSet<String>,
    /// Pods the source has on this node but cannot read (a malformed
    /// object): not deleted, so removed as pods that left the mesh are.
    pub unreadable: BTreeSet<String>,
    /// Whether a pod in none of the lists was deleted (the Kubernetes
    /// source, which lists every pod of the node it knows), rather than
    /// possibly opted out (a pods file lists only the pods to enrol).
    pub absent_means_deleted: bool,
    /// Istio's node agent's pods on this node, not being deleted, as
    /// `namespace/name`: while there is one, the eBPF mode readies its pods
    /// for the rules that agent writes ([`crate::redirect::istio_agent`]).
    pub istio_node_agents: BTreeSet<String>,
    /// Istio's node agent's pods on this node being deleted: their agent
    /// may still be running its shutdown, which deletes its host rules,
    /// whose names the rule modes share. A takeover waits for them to go.
    pub istio_node_agents_stopping: BTreeSet<String>,
}

/// One pass's work in progress.
#[derive(Default)]
struct Pass {
    report: PassReport,
    /// The pods handed to ztunnel: their redirection is in place.
    ready: Vec<Workload>,
    /// The pods that stay: by cookie once enrolled; by inode those that
    /// failed this pass (their cookie unread).
    wanted_cookies: HashSet<u64>,
    failed_inodes: HashSet<u64>,
}

/// What one pass achieved.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    pub enrolled: usize,
    pub removed: usize,
    /// Pods that could not be enrolled this pass, with why.
    pub failed: BTreeMap<String, String>,
}

pub struct Controller {
    redirection: Box<dyn PodRedirection>,
    zds: ZdsHandle,
    node_dns_capture: bool,
    /// Pods enrolled by this controller, by uid.
    enrolled: HashMap<String, Enrolled>,
    stats: Arc<ControllerStats>,
    /// Where the programmed pods are reported, and whether a pass has been.
    programmed: Option<watch::Sender<Arc<PodsReport>>>,
    reported: bool,
    /// Pods the CNI plugin posted that the source does not report yet, by
    /// uid: they are desired too until the source reports them, knows them
    /// as not ambient, no longer has them, or their netns is gone.
    explicit: BTreeMap<String, cni::CniPod>,
    /// Pods whose CNI ADD failed because ztunnel did not take them, by uid
    /// ([`PodsReport::held_back`]).
    held_back: BTreeMap<String, cni::HeldBack>,
    /// Enrolled pods the source says were deleted, as of the latest
    /// [`Controller::desired`]: removed as Istio removes a deleted pod,
    /// leaving its namespace, which dies with it, alone.
    deleted: HashSet<String>,
    /// How often the full state check runs ([`Controller::check_state`]).
    check_interval: Duration,
    /// The failure last logged for each pod that fails to enrol, by uid: a
    /// warning names the pod and its reason once per change, not every pass.
    failures_logged: HashMap<String, String>,
    /// Another mode's capture an earlier agent left, taken out of each pod
    /// this one holds ([`retire`]).
    retiring: Option<crate::redirect::retire::Retirement>,
    /// Istio's node agent's capture, taken out of each pod this agent holds
    /// after it took the node over ([`retire`]).
    retiring_istio: Option<crate::redirect::istio_agent::IstioRetirement>,
    /// The eBPF mode's pods readied for Istio's node agent's rules while
    /// one of its pods is on the node ([`retire`]).
    istio_arrival: crate::redirect::istio_agent::IstioArrival,
    /// Whether the source's latest list had every ambient pod's namespace
    /// ([`SourcePods::waiting`] empty): only then is a pod it does not list
    /// known not to be wanted.
    source_settled: bool,
}

/// A pod this controller enrolled.
#[derive(Debug)]
struct Enrolled {
    /// A handle on its network namespace, held while it is enrolled: a
    /// namespace kept open cannot be freed, so its inode number is not
    /// handed to a new namespace meanwhile, and a namespace opened by path
    /// with this inode is this one.
    netns: Netns,
    key: PodKey,
    options: EnrollOptions,
    /// `namespace/name`, for reports.
    name: String,
    /// What ztunnel was last given for it.
    workload: Workload,
    /// The path its CNI ADD named for this namespace, if one enrolled it.
    runtime_path: Option<std::path::PathBuf>,
}

/// The UIDs of the pods whose redirection is in place and that were handed
/// to ztunnel, as of the controller's latest pass.
pub type ProgrammedPods = watch::Receiver<Arc<PodsReport>>;

/// What the controller's latest pass made of the pods, by UID.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodsReport {
    /// Redirection in place, handed to ztunnel.
    pub programmed: BTreeSet<String>,
    /// Not programmed: the CNI ADD failed because ztunnel did not take the
    /// pod, and the runtime is to retry (Istio's node agent marks such a
    /// pod `pending`). Until the pod is programmed, or the source drops it.
    pub held_back: BTreeSet<String>,
    /// Where the container runtime put the namespace of each programmed pod
    /// a CNI ADD enrolled: the pod source takes it rather than scanning the
    /// node's processes for the pod.
    pub runtime_netns: BTreeMap<String, RuntimeNetns>,
}

/// A pod's network namespace as its CNI ADD named it (`CNI_NETNS`: a path
/// the runtime removes with the sandbox), and the namespace enrolled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeNetns {
    pub path: std::path::PathBuf,
    pub inode: u64,
}

/// How often failed pods are retried without a new event.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// How often the whole state is checked by default.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(60);

impl Controller {
    pub fn new(
        redirection: Box<dyn PodRedirection>,
        zds: ZdsHandle,
        node_dns_capture: bool,
    ) -> Self {
        Self {
            redirection,
            zds,
            node_dns_capture,
            enrolled: HashMap::new(),
            stats: Arc::default(),
            programmed: None,
            reported: false,
            explicit: BTreeMap::new(),
            held_back: BTreeMap::new(),
            deleted: HashSet::new(),
            check_interval: DEFAULT_CHECK_INTERVAL,
            failures_logged: HashMap::new(),
            retiring: None,
            retiring_istio: None,
            istio_arrival: Default::default(),
            source_settled: false,
        }
    }

    /// How often [`Controller::run`] checks the whole state, inside every
    /// pod too (the records alone are checked after every pass).
    pub fn set_check_interval(&mut self, every: Duration) {
        self.check_interval = every;
    }

    /// Reports, after each pass, the UIDs of the pods that are programmed
    /// (redirection in place, handed to ztunnel): the first pass always marks
    /// the channel changed, later passes only when the set changes. A source
    /// uses it to record enrolment on its pods.
    pub fn report_programmed(&mut self, to: watch::Sender<Arc<PodsReport>>) {
        self.programmed = Some(to);
        self.reported = false;
    }

    /// Counters for metrics, updated after every pass.
    pub fn stats(&self) -> Arc<ControllerStats> {
        self.stats.clone()
    }

    pub fn redirection_mut(&mut self) -> &mut dyn PodRedirection {
        self.redirection.as_mut()
    }

    /// Brings the redirection and ztunnel in line with `pods`: each is
    /// enrolled (or kept), the rest removed, then ztunnel's desired set and
    /// the programmed report follow.
    pub fn apply(&mut self, pods: &[PodSpec]) -> PassReport {
        let mut pass = Pass::default();
        for pod in pods {
            self.program(pod, &mut pass);
        }
        pass.report.removed = self.remove_unwanted(pods, &pass);
        // A pod enrolled, or no longer wanted, is warned about afresh.
        self.failures_logged
            .retain(|uid, _| pass.report.failed.contains_key(uid));
        self.publish(&pass.ready);
        self.record_pass(&pass.report);
        self.retire_step(&pass);
        pass.report
    }

    /// Enrols one pod, or keeps it as it is, recording the outcome in `pass`.
    fn program(&mut self, pod: &PodSpec, pass: &mut Pass) {
        let uid = &pod.workload.uid;
        let span = crate::pod_span!("enrol", pod.workload.namespace, pod.workload.name, uid);
        let _entered = span.enter();
        let options = EnrollOptions {
            dns_capture: pod.dns_capture.unwrap_or(true) && self.node_dns_capture,
        };
        let netns = match Netns::open(&pod.workload.netns.path().to_string_lossy()) {
            Ok(netns) => netns,
            Err(e) => {
                // A `/proc/<pid>` path can die with its process (a container
                // restart) while the namespace lives on: an enrolled pod
                // keeps its redirection and its place in ztunnel until a
                // pass can open its namespace again. Taking them away here
                // would leave it enrolled in this table, so never enrolled
                // again.
                if let Some(current) = self.enrolled.get(uid) {
                    span.record("netns_cookie", current.key.netns_cookie);
                    info!(
                        "pod {} ({uid}): cannot open {} ({e}); keeping its redirection",
                        current.name,
                        pod.workload.netns.path().display()
                    );
                    pass.wanted_cookies.insert(current.key.netns_cookie);
                    pass.ready.push(current.workload.clone());
                } else {
                    pass.report.failed.insert(uid.clone(), e.to_string());
                }
                return;
            }
        };
        // The path a CNI ADD named for this very namespace.
        let runtime_path = self
            .explicit
            .get(uid)
            .filter(|cni| cni.netns_inode == netns.inode())
            .map(|cni| cni.pod.workload.netns.path().to_path_buf());
        if let Some(current) = self.enrolled.get_mut(uid)
            && current.netns.inode() == netns.inode()
            && current.options == options
        {
            span.record("netns_cookie", current.key.netns_cookie);
            crate::metrics::histograms().pod_handled(uid, false);
            pass.wanted_cookies.insert(current.key.netns_cookie);
            current.workload = pod.workload.clone();
            current.runtime_path = runtime_path.or(current.runtime_path.take());
            pass.ready.push(pod.workload.clone());
            return;
        }
        // A pod whose netns changed (sandbox recreated) leaves the old one.
        if let Some(old) = self.enrolled.get(uid)
            && old.netns.inode() != netns.inode()
            && let Err(e) = self.redirection.unenroll(old.key)
        {
            warn!("pod {uid}: removing its previous netns: {e}");
        }
        let name = format!("{}/{}", pod.workload.namespace, pod.workload.name);
        match self.redirection.enroll(&netns, options) {
            Ok(done) => {
                span.record("netns_cookie", done.netns_cookie);
                self.stats
                    .record_enrol_steps(self.redirection.mode(), &done.steps);
                self.report_conflicts(&name, uid, &done);
                let identity = crate::bpf::pod_names::PodIdentity {
                    namespace: pod.workload.namespace.clone(),
                    name: pod.workload.name.clone(),
                    uid: uid.clone(),
                };
                if let Err(e) = self.redirection.record_identity(done.key(), &identity) {
                    warn!("pod {name} ({uid}): {e}; `ambpf status` shows it unnamed");
                }
                pass.wanted_cookies.insert(done.netns_cookie);
                let enrolled = Enrolled {
                    netns,
                    key: done.key(),
                    options,
                    name,
                    workload: pod.workload.clone(),
                    runtime_path,
                };
                self.enrolled.insert(uid.clone(), enrolled);
                // Per pod, so that the gauge climbs through a long pass.
                self.stats
                    .set_enrolled(self.redirection.mode(), self.enrolled.len());
                crate::metrics::histograms().pod_handled(uid, true);
                pass.report.enrolled += 1;
                pass.ready.push(pod.workload.clone());
            }
            Err(e) => {
                pass.failed_inodes.insert(netns.inode());
                pass.report.failed.insert(uid.clone(), e.to_string());
                // A failed enrolment again of the same namespace (new
                // options) keeps the redirection it had, and so ztunnel
                // keeps its proxy: never the capture without the proxy.
                if let Some(current) = self.enrolled.get(uid)
                    && current.netns.inode() == netns.inode()
                {
                    warn!(
                        "pod {name} ({uid}) not enrolled again: {e}; it keeps its previous \
                         redirection and its place in ztunnel"
                    );
                    pass.wanted_cookies.insert(current.key.netns_cookie);
                    pass.ready.push(current.workload.clone());
                } else {
                    let reason = e.to_string();
                    if self.failures_logged.get(uid) == Some(&reason) {
                        tracing::debug!("pod {name} ({uid}) still not enrolled: {reason}");
                    } else {
                        warn!("pod {name} ({uid}) not enrolled: {reason}");
                        self.failures_logged.insert(uid.clone(), reason);
                    }
                }
            }
        }
    }

    /// Removes the pods no longer wanted: ours that `pods` lacks, and any
    /// left enrolled by an earlier agent. Each removal takes only what its
    /// pod still owns, so the order against the enrolments does not matter.
    fn remove_unwanted(&mut self, pods: &[PodSpec], pass: &Pass) -> usize {
        let wanted_uids: HashSet<&str> = pods.iter().map(|p| p.workload.uid.as_str()).collect();
        let gone: Vec<String> = self
            .enrolled
            .keys()
            .filter(|uid| !wanted_uids.contains(uid.as_str()))
            .cloned()
            .collect();
        // Deleted pods: only their node-wide state goes (their namespace dies
        // with them); the rest leave the mesh, their capture removed.
        let mut removed = 0;
        let mut forgotten = HashSet::new();
        for uid in gone.iter().filter(|uid| self.deleted.contains(*uid)) {
            let key = self.enrolled[uid].key;
            let span = self.remove_span(uid, key);
            let _entered = span.enter();
            forgotten.insert(key);
            match self.redirection.forget_deleted(key) {
                Ok(true) => removed += 1,
                Ok(false) => {}
                Err(e) => warn!("removing the deleted pod {uid} ({key}): {e}"),
            }
        }
        let mut stale: Vec<PodKey> = gone
            .iter()
            .map(|uid| self.enrolled[uid].key)
            .filter(|key| !forgotten.contains(key))
            .collect();
        match self.redirection.enrolled() {
            // A pod that failed this pass (its cookie unread) is matched by
            // inode, so that a pinned entry of its from an earlier agent is
            // kept for the retry.
            Ok(keys) => stale.extend(keys.into_iter().filter(|key| {
                !pass.wanted_cookies.contains(&key.netns_cookie)
                    && !pass.failed_inodes.contains(&key.netns_inode)
                    && !forgotten.contains(key)
            })),
            Err(e) => warn!("listing enrolled pods: {e}"),
        }
        stale.sort_unstable();
        stale.dedup();
        for key in stale {
            let span = match self.enrolled.iter().find(|(_, e)| e.key == key) {
                Some((uid, _)) => self.remove_span(uid, key),
                None => tracing::info_span!("remove", netns_cookie = key.netns_cookie),
            };
            let _entered = span.enter();
            match self.redirection.unenroll(key) {
                Ok(true) => removed += 1,
                Ok(false) => {}
                Err(e) => warn!("removing the pod with {key}: {e}"),
            }
        }
        self.stats.pods_removed.inc_by(removed as u64);
        for uid in gone {
            self.enrolled.remove(&uid);
        }
        removed
    }

    /// The span of a removal of one of this agent's pods.
    fn remove_span(&self, uid: &str, key: PodKey) -> tracing::Span {
        let name = &self.enrolled[uid].name;
        let (namespace, name) = name.split_once('/').unwrap_or(("", name));
        crate::pod_span!("remove", namespace, name, uid, key.netns_cookie)
    }

    /// Reports the programmed pods and gives ztunnel exactly the pods whose
    /// redirection is in place.
    fn publish(&mut self, ready: &[Workload]) {
        self.send_programmed(ready.iter().map(|w| w.uid.clone()).collect());
        self.share_netns_cookies();
        // The namespace each pod was enrolled with is its identity towards
        // ztunnel: a sandbox re-created at the same path gets a fresh Add.
        self.zds
            .replace_all(ready.iter().map(|w| self.as_handed_to_ztunnel(w)));
    }

    /// `workload` as ztunnel is given it: with the namespace it was enrolled with.
    fn as_handed_to_ztunnel(&self, workload: &Workload) -> Workload {
        Workload {
            netns_inode: self.enrolled.get(&workload.uid).map(|e| e.netns.inode()),
            ..workload.clone()
        }
    }

    /// Reports `programmed` (and the held-back pods) to the source, if it
    /// listens: always after the first pass, then on a change.
    fn send_programmed(&mut self, programmed: BTreeSet<String>) {
        if let Some(sender) = &self.programmed {
            let runtime_netns = self
                .enrolled
                .iter()
                .filter(|(uid, _)| programmed.contains(*uid))
                .filter_map(|(uid, e)| {
                    let path = e.runtime_path.clone()?;
                    Some((
                        uid.clone(),
                        RuntimeNetns {
                            path,
                            inode: e.netns.inode(),
                        },
                    ))
                })
                .collect();
            let report = PodsReport {
                programmed,
                held_back: self.held_back.keys().cloned().collect(),
                runtime_netns,
            };
            let first = !std::mem::replace(&mut self.reported, true);
            sender.send_if_modified(|current| {
                let changed = first || **current != report;
                if changed {
                    *current = Arc::new(report);
                }
                changed
            });
        }
    }

    /// Tells the ZDS server each enrolled pod's netns cookie, for its logs.
    fn share_netns_cookies(&self) {
        self.zds.set_netns_cookies(
            self.enrolled
                .iter()
                .map(|(uid, e)| (uid.clone(), e.key.netns_cookie))
                .collect(),
        );
    }

    /// Updates the metrics after a pass.
    fn record_pass(&mut self, report: &PassReport) {
        let stats = &self.stats;
        stats.set_enrolled(self.redirection.mode(), self.enrolled.len());
        stats.enroll_failures.inc_by(report.failed.len() as u64);
        *stats.pod_names.lock().unwrap_or_else(|e| e.into_inner()) = self
            .enrolled
            .values()
            .filter_map(|e| {
                let (namespace, name) = e.name.split_once('/')?;
                Some((e.key.netns_cookie, (namespace.to_owned(), name.to_owned())))
            })
            .collect();
    }

    /// Says which pods share an address with the pod just enrolled, and
    /// which of them owns it now (the newer, see [`crate::redirect::claims`]).
    fn report_conflicts(&self, name: &str, uid: &str, done: &EnrolledPod) {
        for conflict in &done.conflicts {
            let other = self
                .enrolled
                .iter()
                .find(|(_, e)| e.key.netns_cookie == conflict.other_netns_cookie);
            let (winner, loser) = match other {
                Some((other_uid, other)) => {
                    let this = format!("{name} ({uid})");
                    let that = format!("{} ({other_uid})", other.name);
                    if conflict.won {
                        (this, that)
                    } else {
                        (that, this)
                    }
                }
                None => {
                    // A pod no source reports (left pinned by an earlier
                    // agent, or not removed yet): not a live conflict.
                    info!(
                        "address {}: pod {name} ({uid}) takes it over from the pod with netns \
                         cookie {}, which no source reports",
                        conflict.address, conflict.other_netns_cookie
                    );
                    continue;
                }
            };
            self.stats.address_conflicts.inc();
            warn!(
                "address {} is claimed by two live pods: {winner} owns it (the newer pod), \
                 {loser} loses it until it is gone",
                conflict.address
            );
        }
    }
}

mod event_loop;
mod retire;
#[cfg(test)]
mod tests;
