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
//! it, and kept until the source decides: it reports the pod as ambient
//! (the source's entry takes over), or as a pod it knows and does not
//! enrol (the pod is removed), or the pod's netns is gone.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use log::{info, warn};
use tokio::sync::{mpsc, oneshot, watch};

use std::sync::atomic::Ordering;

use crate::{
    netns::Netns,
    observe::ControllerStats,
    redirect::{CheckScope, EnrollOptions, EnrolledPod, PodKey, PodRedirection, Violation},
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
    programmed: Option<watch::Sender<Arc<BTreeSet<String>>>>,
    reported: bool,
    /// Pods the CNI plugin posted that the source does not report yet, by
    /// uid: they are desired too until the source reports them, knows them
    /// as not ambient, no longer has them, or their netns is gone.
    explicit: BTreeMap<String, CniPod>,
    /// How often the full state check runs ([`Controller::check_state`]).
    check_interval: Duration,
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
}

/// A pod the CNI plugin posted, kept until the source decides.
#[derive(Debug)]
struct CniPod {
    pod: PodSpec,
    /// The source has listed it as waiting for its netns: once it lists it
    /// nowhere, the pod object is gone.
    source_knew: bool,
}

/// A pod the CNI plugin asks to enrol now, and where to say whether its
/// redirection is in place and ztunnel has it (`Err`: why not).
#[derive(Debug)]
pub struct EnrollRequest {
    pub pod: PodSpec,
    pub reply: oneshot::Sender<Result<(), String>>,
}

/// How the CNI endpoint reaches the controller.
pub type EnrollRequests = mpsc::Receiver<EnrollRequest>;

/// The UIDs of the pods whose redirection is in place and that were handed
/// to ztunnel, as of the controller's latest pass.
pub type ProgrammedPods = watch::Receiver<Arc<BTreeSet<String>>>;

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
            check_interval: DEFAULT_CHECK_INTERVAL,
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
    pub fn report_programmed(&mut self, to: watch::Sender<Arc<BTreeSet<String>>>) {
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

    /// Brings the redirection and ztunnel in line with `pods`.
    pub fn apply(&mut self, pods: &[PodSpec]) -> PassReport {
        let mut report = PassReport::default();
        let mut ready = Vec::new();
        // The pods that stay: by cookie once enrolled; by inode those that
        // failed this pass (their cookie unread), so that a pinned entry of
        // theirs from an earlier agent is kept for the retry.
        let mut wanted_cookies = HashSet::new();
        let mut failed_inodes = HashSet::new();
        for pod in pods {
            let uid = &pod.workload.uid;
            let options = EnrollOptions {
                dns_capture: pod.dns_capture.unwrap_or(true) && self.node_dns_capture,
            };
            let netns = match Netns::open(&pod.workload.netns.path().to_string_lossy()) {
                Ok(netns) => netns,
                Err(e) => {
                    // A `/proc/<pid>` path can die with its process (a
                    // container restart) while the namespace lives on: an
                    // enrolled pod keeps its redirection and its place in
                    // ztunnel until a pass can open its namespace again.
                    // Taking them away here would leave it enrolled in this
                    // table, so never enrolled again.
                    if let Some(current) = self.enrolled.get(uid) {
                        info!(
                            "pod {} ({uid}): cannot open {} ({e}); keeping its redirection",
                            current.name,
                            pod.workload.netns.path().display()
                        );
                        wanted_cookies.insert(current.key.netns_cookie);
                        ready.push(current.workload.clone());
                    } else {
                        report.failed.insert(uid.clone(), e.to_string());
                    }
                    continue;
                }
            };
            if let Some(current) = self.enrolled.get_mut(uid)
                && current.netns.inode() == netns.inode()
                && current.options == options
            {
                wanted_cookies.insert(current.key.netns_cookie);
                current.workload = pod.workload.clone();
                ready.push(pod.workload.clone());
                continue;
            }
            // A pod whose netns changed (sandbox recreated) leaves the old one.
            if let Some(old) = self.enrolled.get(uid)
                && old.netns.inode() != netns.inode()
                && let Err(e) = self.redirection.unenroll(old.key)
            {
                warn!("pod {uid}: removing its previous netns: {e}");
            }
            match self.redirection.enroll(&netns, options) {
                Ok(done) => {
                    self.stats.record_enrol_steps(&done.steps);
                    let name = format!("{}/{}", pod.workload.namespace, pod.workload.name);
                    self.report_conflicts(&name, uid, &done);
                    let identity = crate::bpf::pod_names::PodIdentity {
                        namespace: pod.workload.namespace.clone(),
                        name: pod.workload.name.clone(),
                        uid: uid.clone(),
                    };
                    if let Err(e) = self.redirection.record_identity(done.key(), &identity) {
                        warn!("pod {name} ({uid}): {e}; `ambpf status` shows it unnamed");
                    }
                    wanted_cookies.insert(done.netns_cookie);
                    self.enrolled.insert(
                        uid.clone(),
                        Enrolled {
                            netns,
                            key: done.key(),
                            options,
                            name,
                            workload: pod.workload.clone(),
                        },
                    );
                    report.enrolled += 1;
                    ready.push(pod.workload.clone());
                }
                Err(e) => {
                    warn!(
                        "pod {}/{} ({uid}) not enrolled: {e}",
                        pod.workload.namespace, pod.workload.name
                    );
                    failed_inodes.insert(netns.inode());
                    report.failed.insert(uid.clone(), e.to_string());
                }
            }
        }

        // Gone pods: ours, and any left enrolled by an earlier agent. Each
        // removal takes only what its pod still owns, so the order against
        // the enrolments above does not matter.
        let wanted_uids: HashSet<&str> = pods.iter().map(|p| p.workload.uid.as_str()).collect();
        let gone: Vec<String> = self
            .enrolled
            .keys()
            .filter(|uid| !wanted_uids.contains(uid.as_str()))
            .cloned()
            .collect();
        let mut stale: Vec<PodKey> = gone.iter().map(|uid| self.enrolled[uid].key).collect();
        match self.redirection.enrolled() {
            Ok(keys) => stale.extend(keys.into_iter().filter(|key| {
                !wanted_cookies.contains(&key.netns_cookie)
                    && !failed_inodes.contains(&key.netns_inode)
            })),
            Err(e) => warn!("listing enrolled pods: {e}"),
        }
        stale.sort_unstable();
        stale.dedup();
        for key in stale {
            match self.redirection.unenroll(key) {
                Ok(true) => report.removed += 1,
                Ok(false) => {}
                Err(e) => warn!("removing the pod with {key}: {e}"),
            }
        }
        for uid in gone {
            self.enrolled.remove(&uid);
        }

        if let Some(programmed) = &self.programmed {
            let uids: BTreeSet<String> = ready.iter().map(|w| w.uid.clone()).collect();
            let first = !std::mem::replace(&mut self.reported, true);
            programmed.send_if_modified(|current| {
                let changed = first || **current != uids;
                if changed {
                    *current = Arc::new(uids);
                }
                changed
            });
        }
        // ztunnel gets exactly the pods whose redirection is in place.
        self.zds.replace_all(ready);
        let stats = &self.stats;
        stats
            .pods_enrolled
            .store(self.enrolled.len() as u64, Ordering::Relaxed);
        stats
            .enroll_failures
            .fetch_add(report.failed.len() as u64, Ordering::Relaxed);
        stats
            .pods_removed
            .fetch_add(report.removed as u64, Ordering::Relaxed);
        *stats.pod_names.lock().unwrap_or_else(|e| e.into_inner()) = self
            .enrolled
            .values()
            .filter_map(|e| {
                let (namespace, name) = e.name.split_once('/')?;
                Some((e.key.netns_cookie, (namespace.to_owned(), name.to_owned())))
            })
            .collect();
        report
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
            self.stats.address_conflicts.fetch_add(1, Ordering::Relaxed);
            warn!(
                "address {} is claimed by two live pods: {winner} owns it (the newer pod), \
                 {loser} loses it until it is gone",
                conflict.address
            );
        }
    }

    /// Checks the redirection's state ([`crate::redirect::check`]), counts
    /// and logs every violation, repairs what can be repaired in place, and
    /// forgets the pods that must be enrolled again (the next pass does).
    /// Returns the violations found.
    pub fn check_state(&mut self, scope: CheckScope) -> Vec<Violation> {
        let known: Vec<(PodKey, &Netns)> =
            self.enrolled.values().map(|e| (e.key, &e.netns)).collect();
        let violations = self.redirection.check(&known, scope);
        if violations.is_empty() {
            return violations;
        }
        for violation in &violations {
            warn!("state check: {violation}");
            self.stats.state_violations[violation.kind.index()].fetch_add(1, Ordering::Relaxed);
        }
        let again = self.redirection.repair(&violations);
        self.enrolled.retain(|uid, e| {
            let forget = again.contains(&e.key);
            if forget {
                info!("pod {} ({uid}): enrolling it again to repair it", e.name);
            }
            !forget
        });
        violations
    }

    /// Applies every update from `pods`, and retries failed pods every
    /// [`RETRY_INTERVAL`], until the sender is gone.
    pub async fn run(self, pods: watch::Receiver<Arc<SourcePods>>) {
        self.run_with_requests(pods, None).await
    }

    /// The desired pods: the source's ambient pods, plus the CNI-posted pods
    /// it does not report yet (forgotten once it does, once it knows them as
    /// not ambient, or once their netns is gone: the sandbox was deleted).
    fn desired(&mut self, source: &SourcePods) -> Vec<PodSpec> {
        let reported: HashSet<&str> = source
            .ambient
            .iter()
            .map(|p| p.workload.uid.as_str())
            .collect();
        self.explicit.retain(|uid, cni| {
            let pod = &cni.pod;
            if reported.contains(uid.as_str()) {
                return false;
            }
            // As Istio's node agent: a pod opted out after its CNI add (or
            // found terminal) leaves the mesh as soon as the source sees it.
            if let Some(why) = source.not_ambient.get(uid) {
                info!(
                    "pod {}/{} ({uid}): the pod source knows it as not ambient ({why}); \
                     removing the pod the CNI plugin enrolled",
                    pod.workload.namespace, pod.workload.name
                );
                return false;
            }
            // As Istio's node agent: a deleted pod leaves the mesh when the
            // source sees the delete, whether its sandbox is gone yet or not.
            if source.waiting.contains(uid) {
                cni.source_knew = true;
            } else if cni.source_knew {
                info!(
                    "pod {}/{} ({uid}): deleted from the pod source; removing the pod \
                     the CNI plugin enrolled",
                    pod.workload.namespace, pod.workload.name
                );
                return false;
            }
            let alive = Netns::open(&pod.workload.netns.path().to_string_lossy()).is_ok();
            if !alive {
                info!("pod {uid}: its netns is gone; forgetting the CNI add");
            }
            alive
        });
        let mut pods = source.ambient.clone();
        pods.extend(self.explicit.values().map(|cni| cni.pod.clone()));
        pods
    }

    /// Enrols the pods of CNI requests now, on top of `source`, and answers
    /// each: `Ok` once its redirection is in place and ztunnel's desired set
    /// has it. A pod that fails is not kept (the runtime tears the sandbox
    /// down and retries with a new one), nor is one the source knows as not
    /// ambient (refused, with why).
    pub fn apply_requests(&mut self, source: &SourcePods, requests: Vec<EnrollRequest>) {
        let mut requests = requests;
        requests.retain_mut(|request| {
            let netns = request.pod.workload.netns.path();
            match Netns::open(&netns.to_string_lossy()) {
                Ok(_) => {
                    let cni = CniPod {
                        pod: request.pod.clone(),
                        source_knew: false,
                    };
                    self.explicit.insert(request.pod.workload.uid.clone(), cni);
                    true
                }
                Err(e) => {
                    let reply = std::mem::replace(&mut request.reply, oneshot::channel().0);
                    let _ = reply.send(Err(e.to_string()));
                    false
                }
            }
        });
        let desired = self.desired(source);
        let report = self.apply(&desired);
        let mut refused = false;
        for request in requests {
            let uid = &request.pod.workload.uid;
            let result = match report.failed.get(uid) {
                Some(why) => Err(why.clone()),
                None if self.enrolled.contains_key(uid) => Ok(()),
                // The runtime retries the ADD, which reads the pod afresh.
                None => Err(match source.not_ambient.get(uid) {
                    Some(why) => format!("the pod source knows it as not ambient ({why})"),
                    None => "not enrolled".to_owned(),
                }),
            };
            if let Err(why) = &result {
                warn!("CNI add of pod {uid} refused: {why}");
                refused |= self.explicit.remove(uid).is_some();
            }
            let _ = request.reply.send(result);
        }
        if refused {
            // Drop what the failed pods may have left in ztunnel's set.
            let desired = self.desired(source);
            self.apply(&desired);
        }
    }

    /// [`Controller::run`], also serving CNI enrol requests as they come.
    pub async fn run_with_requests(
        mut self,
        mut pods: watch::Receiver<Arc<SourcePods>>,
        mut requests: Option<EnrollRequests>,
    ) {
        let mut full_check = tokio::time::interval(self.check_interval);
        full_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        full_check.reset();
        let mut scope = CheckScope::Records;
        loop {
            let source = pods.borrow_and_update().clone();
            let current = self.desired(&source);
            let report = self.apply(&current);
            if report.enrolled > 0 || report.removed > 0 || !report.failed.is_empty() {
                info!(
                    "pods: {} desired, {} enrolled, {} removed, {} failed",
                    current.len(),
                    report.enrolled,
                    report.removed,
                    report.failed.len()
                );
            }
            // A repair that forgot pods has the next pass enrol them again.
            let enrolled_before = self.enrolled.len();
            self.check_state(std::mem::replace(&mut scope, CheckScope::Records));
            let repass = self.enrolled.len() < enrolled_before;
            loop {
                // CNI-added pods are re-checked (is their netns gone?) until
                // the source takes them over; one may have come in this loop.
                let retry = !report.failed.is_empty() || !self.explicit.is_empty();
                tokio::select! {
                    changed = pods.changed() => if changed.is_err() { return },
                    () = std::future::ready(()), if repass => {}
                    _ = full_check.tick() => scope = CheckScope::Full,
                    () = tokio::time::sleep(RETRY_INTERVAL), if retry => {}
                    request = async { requests.as_mut()?.recv().await }, if requests.is_some() => {
                        let Some(first) = request else {
                            requests = None;
                            continue;
                        };
                        let mut batch = vec![first];
                        while let Some(more) = requests.as_mut().and_then(|r| r.try_recv().ok()) {
                            batch.push(more);
                        }
                        let source = pods.borrow().clone();
                        self.apply_requests(&source, batch);
                        self.check_state(CheckScope::Records);
                        continue;
                    }
                }
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use ambpf_testbed::NetnsGuard;

    use super::*;
    use crate::{
        redirect::{EnrollError, RedirectMode},
        zds::{NetnsSource, ZdsConfig},
    };

    /// Records what the controller asked of the redirection; the decision
    /// logic is under test here, the real modes in tests/redirect.rs. Pods
    /// are keyed by netns inode, which stands in for the cookie.
    #[derive(Default)]
    struct Recorder {
        log: Arc<Mutex<Vec<String>>>,
        enrolled: HashSet<u64>,
        refuse: HashSet<u64>,
    }

    fn key(inode: u64) -> PodKey {
        PodKey {
            netns_cookie: inode,
            netns_inode: inode,
        }
    }

    impl PodRedirection for Recorder {
        fn mode(&self) -> RedirectMode {
            RedirectMode::Ebpf
        }

        fn enroll(
            &mut self,
            netns: &Netns,
            options: EnrollOptions,
        ) -> Result<EnrolledPod, EnrollError> {
            self.log.lock().unwrap().push(format!(
                "enroll {} dns={}",
                netns.inode(),
                options.dns_capture
            ));
            if self.refuse.contains(&netns.inode()) {
                return Err(EnrollError::NoAddress {
                    netns: netns.path().to_owned(),
                });
            }
            self.enrolled.insert(netns.inode());
            Ok(EnrolledPod {
                netns: netns.path().to_owned(),
                netns_inode: netns.inode(),
                netns_cookie: netns.inode(),
                addresses: vec![],
                interfaces: vec![],
                dns_capture: options.dns_capture,
                conflicts: vec![],
                steps: Default::default(),
            })
        }

        fn unenroll(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
            self.log
                .lock()
                .unwrap()
                .push(format!("unenroll {}", pod.netns_inode));
            Ok(self.enrolled.remove(&pod.netns_cookie))
        }

        fn enrolled(&mut self) -> Result<Vec<PodKey>, EnrollError> {
            Ok(self.enrolled.iter().copied().map(key).collect())
        }

        fn check(&mut self, _pods: &[(PodKey, &Netns)], _scope: CheckScope) -> Vec<Violation> {
            Vec::new()
        }

        fn repair(&mut self, _violations: &[Violation]) -> Vec<PodKey> {
            Vec::new()
        }
    }

    fn spec(uid: &str, ns: &NetnsGuard, dns: Option<bool>) -> PodSpec {
        PodSpec {
            workload: Workload {
                uid: uid.into(),
                name: uid.into(),
                namespace: "shop".into(),
                service_account: "default".into(),
                netns: NetnsSource::Path(ns.path()),
            },
            dns_capture: dns,
        }
    }

    fn inode(ns: &NetnsGuard) -> u64 {
        Netns::open(ns.name()).unwrap().inode()
    }

    fn controller(recorder: Recorder, node_dns: bool) -> (Controller, ZdsHandle) {
        let zds = ZdsHandle::new(ZdsConfig::default());
        (
            Controller::new(Box::new(recorder), zds.clone(), node_dns),
            zds,
        )
    }

    #[test]
    fn pods_are_enrolled_once_then_handed_to_ztunnel_and_removed_when_gone() {
        let (a, b) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let recorder = Recorder::default();
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);

        let report = ctl.apply(&[spec("a", &a, None), spec("b", &b, Some(false))]);
        assert_eq!((report.enrolled, report.removed), (2, 0));
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a", "b"]);
        // A second pass with nothing new does nothing.
        assert_eq!(
            ctl.apply(&[spec("a", &a, None), spec("b", &b, Some(false))]),
            PassReport::default()
        );

        let report = ctl.apply(&[spec("b", &b, Some(false))]);
        assert_eq!((report.enrolled, report.removed), (0, 1));
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["b"]);
        assert_eq!(
            *log.lock().unwrap(),
            [
                format!("enroll {} dns=true", inode(&a)),
                format!("enroll {} dns=false", inode(&b)),
                format!("unenroll {}", inode(&a)),
            ]
        );
    }

    #[test]
    fn a_pod_whose_netns_path_dies_with_its_process_stays_enrolled_and_with_ztunnel() {
        let a = NetnsGuard::create("ctl").unwrap();
        let recorder = Recorder::default();
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);
        ctl.apply(&[spec("a", &a, None)]);
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

        // The source names the namespace by a process that has just exited
        // (a container restart); the namespace itself lives on.
        let mut gone = spec("a", &a, None);
        gone.workload.netns = NetnsSource::Path("/proc/0/ns/net".into());
        let report = ctl.apply(&[gone]);
        assert_eq!(report, PassReport::default());
        assert_eq!(zds.workloads()["a"].netns, NetnsSource::Path(a.path()));

        // The next pass names the new process: nothing to redo.
        assert_eq!(ctl.apply(&[spec("a", &a, None)]), PassReport::default());
        assert_eq!(
            *log.lock().unwrap(),
            [format!("enroll {} dns=true", inode(&a))],
            "the pod was never removed"
        );
    }

    #[test]
    fn node_dns_setting_overrides_pods_and_a_change_re_enrols() {
        let a = NetnsGuard::create("ctl").unwrap();
        let recorder = Recorder::default();
        let log = recorder.log.clone();
        let (mut ctl, _zds) = controller(recorder, false);
        ctl.apply(&[spec("a", &a, Some(true))]);
        ctl.node_dns_capture = true;
        ctl.apply(&[spec("a", &a, Some(true))]);
        assert_eq!(
            *log.lock().unwrap(),
            [
                format!("enroll {} dns=false", inode(&a)),
                format!("enroll {} dns=true", inode(&a))
            ]
        );
    }

    #[test]
    fn a_pod_that_cannot_be_enrolled_is_kept_from_ztunnel_and_the_rest_proceed() {
        let (a, b) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let mut recorder = Recorder::default();
        recorder.refuse.insert(inode(&a));
        let (mut ctl, zds) = controller(recorder, true);
        let mut missing = spec("gone", &a, None);
        missing.workload.netns = NetnsSource::Path("/run/netns/ambpf-no-such-pod".into());

        let report = ctl.apply(&[spec("a", &a, None), spec("b", &b, None), missing]);
        assert_eq!(report.enrolled, 1);
        assert_eq!(report.failed.keys().collect::<Vec<_>>(), ["a", "gone"]);
        assert!(
            report.failed["gone"].contains("does not exist"),
            "{:?}",
            report.failed
        );
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn pods_left_enrolled_by_an_earlier_agent_are_reconciled_not_recreated() {
        let (kept, stale) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let mut recorder = Recorder::default();
        recorder.enrolled.extend([inode(&kept), inode(&stale)]);
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);

        let report = ctl.apply(&[spec("kept", &kept, None)]);
        assert_eq!(report.removed, 1);
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["kept"]);
        let log = log.lock().unwrap();
        assert!(
            log.contains(&format!("unenroll {}", inode(&stale))),
            "{log:?}"
        );
        assert!(
            !log.iter()
                .any(|l| l == &format!("unenroll {}", inode(&kept))),
            "{log:?}"
        );
    }

    #[test]
    fn programmed_pods_are_reported_after_each_pass_that_changes_them() {
        let (a, b) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let mut recorder = Recorder::default();
        recorder.refuse.insert(inode(&b));
        let (mut ctl, _zds) = controller(recorder, true);
        let (tx, mut rx) = watch::channel(Arc::new(BTreeSet::new()));
        ctl.report_programmed(tx);

        // The first pass reports even an empty set.
        ctl.apply(&[]);
        assert!(rx.has_changed().unwrap());
        assert!(rx.borrow_and_update().is_empty());

        // Only pods that were enrolled and handed to ztunnel count.
        ctl.apply(&[spec("a", &a, None), spec("b", &b, None)]);
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().iter().collect::<Vec<_>>(), ["a"]);
        ctl.apply(&[spec("a", &a, None), spec("b", &b, None)]);
        assert!(!rx.has_changed().unwrap());

        ctl.apply(&[]);
        assert!(rx.borrow_and_update().is_empty());
    }

    fn ambient(pods: Vec<PodSpec>) -> SourcePods {
        SourcePods {
            ambient: pods,
            ..Default::default()
        }
    }

    /// A source that knows `uids` as not ambient (with a reason each).
    fn knows_not_ambient(pods: Vec<PodSpec>, uids: &[&str]) -> SourcePods {
        SourcePods {
            ambient: pods,
            not_ambient: uids
                .iter()
                .map(|uid| ((*uid).to_owned(), "labelled dataplane-mode=none".to_owned()))
                .collect(),
            ..Default::default()
        }
    }

    fn request(pod: PodSpec) -> (EnrollRequest, oneshot::Receiver<Result<(), String>>) {
        let (reply, answer) = oneshot::channel();
        (EnrollRequest { pod, reply }, answer)
    }

    #[test]
    fn a_cni_add_is_enrolled_at_once_and_kept_until_the_source_reports_it() {
        let (a, b) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let mut recorder = Recorder::default();
        recorder.refuse.insert(inode(&b));
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);

        let (req_a, mut ans_a) = request(spec("a", &a, None));
        let (req_b, mut ans_b) = request(spec("b", &b, None));
        let mut missing = spec("gone", &a, None);
        missing.workload.netns = NetnsSource::Path("/run/netns/ambpf-no-such-pod".into());
        let (req_gone, mut ans_gone) = request(missing);
        ctl.apply_requests(&SourcePods::default(), vec![req_a, req_b, req_gone]);
        assert_eq!(ans_a.try_recv().unwrap(), Ok(()));
        assert!(ans_b.try_recv().unwrap().is_err());
        assert!(
            ans_gone
                .try_recv()
                .unwrap()
                .unwrap_err()
                .contains("does not exist")
        );
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

        // A source pass that does not know "a" yet keeps it.
        let pods = ctl.desired(&SourcePods::default());
        ctl.apply(&pods);
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);
        // Once the source reports it, the source decides.
        let pods = ctl.desired(&ambient(vec![spec("a", &a, None)]));
        assert!(ctl.explicit.is_empty());
        ctl.apply(&pods);
        let pods = ctl.desired(&SourcePods::default());
        ctl.apply(&pods);
        assert!(zds.workloads().is_empty());
        assert_eq!(
            log.lock()
                .unwrap()
                .iter()
                .filter(|l| l.starts_with("enroll"))
                .count(),
            2,
            "a once, b refused: {:?}",
            log.lock().unwrap()
        );
    }

    fn enrolled_by_cni(ctl: &mut Controller, pods: Vec<PodSpec>) {
        let (requests, answers): (Vec<_>, Vec<_>) = pods.into_iter().map(request).unzip();
        ctl.apply_requests(&SourcePods::default(), requests);
        for mut answer in answers {
            assert_eq!(answer.try_recv().unwrap(), Ok(()));
        }
    }

    #[test]
    fn a_cni_pod_the_source_knows_as_not_ambient_is_removed() {
        let (opted_out, other) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let recorder = Recorder::default();
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);
        enrolled_by_cni(
            &mut ctl,
            vec![
                spec("opted-out", &opted_out, None),
                spec("other", &other, None),
            ],
        );
        assert_eq!(
            zds.workloads().keys().collect::<Vec<_>>(),
            ["opted-out", "other"]
        );

        // The source now knows "opted-out" and does not enrol it; "other"
        // it has not seen.
        let source = knows_not_ambient(vec![], &["opted-out"]);
        let pods = ctl.desired(&source);
        let report = ctl.apply(&pods);
        assert_eq!(report.removed, 1);
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["other"]);
        assert_eq!(ctl.explicit.keys().collect::<Vec<_>>(), ["other"]);
        assert_eq!(
            log.lock().unwrap().last(),
            Some(&format!("unenroll {}", inode(&opted_out)))
        );
        // Later passes do not bring it back.
        let pods = ctl.desired(&source);
        assert_eq!(ctl.apply(&pods), PassReport::default());
        assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["other"]);
    }

    #[test]
    fn a_cni_pod_the_source_has_not_seen_or_has_no_netns_for_is_kept() {
        let (unseen, pending, known) = (
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
            NetnsGuard::create("ctl").unwrap(),
        );
        let recorder = Recorder::default();
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);
        enrolled_by_cni(
            &mut ctl,
            vec![
                spec("unseen", &unseen, None),
                spec("pending", &pending, None),
            ],
        );

        // "unseen" is not on the source's lists; "pending" is ambient and
        // waiting for its netns to be found. The source knows other pods,
        // ambient and not.
        let mut source = knows_not_ambient(vec![spec("known", &known, None)], &["someone-else"]);
        source.waiting.insert("pending".to_owned());
        for _ in 0..2 {
            let pods = ctl.desired(&source);
            let report = ctl.apply(&pods);
            assert_eq!(report.removed, 0);
            assert_eq!(
                zds.workloads().keys().collect::<Vec<_>>(),
                ["known", "pending", "unseen"]
            );
        }
        assert_eq!(
            ctl.explicit.keys().collect::<Vec<_>>(),
            ["pending", "unseen"]
        );
        assert!(
            !log.lock()
                .unwrap()
                .iter()
                .any(|l| l.starts_with("unenroll")),
            "{:?}",
            log.lock().unwrap()
        );

        // "pending" is deleted (its sandbox may still be there): it leaves
        // at once; "unseen", which the source never knew, stays.
        source.waiting.clear();
        let pods = ctl.desired(&source);
        assert_eq!(ctl.apply(&pods).removed, 1);
        assert_eq!(
            zds.workloads().keys().collect::<Vec<_>>(),
            ["known", "unseen"]
        );
        assert_eq!(ctl.explicit.keys().collect::<Vec<_>>(), ["unseen"]);
        assert_eq!(
            log.lock().unwrap().last(),
            Some(&format!("unenroll {}", inode(&pending)))
        );
    }

    #[test]
    fn a_cni_add_of_a_pod_the_source_knows_as_not_ambient_is_refused_with_why() {
        let a = NetnsGuard::create("ctl").unwrap();
        let recorder = Recorder::default();
        let log = recorder.log.clone();
        let (mut ctl, zds) = controller(recorder, true);
        let (req, mut answer) = request(spec("a", &a, None));
        ctl.apply_requests(&knows_not_ambient(vec![], &["a"]), vec![req]);
        let why = answer.try_recv().unwrap().unwrap_err();
        assert!(
            why.contains("not ambient (labelled dataplane-mode=none)"),
            "{why}"
        );
        assert!(zds.workloads().is_empty());
        assert!(ctl.explicit.is_empty());
        assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
    }
}
