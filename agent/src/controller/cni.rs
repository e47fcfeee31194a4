//! Pods the CNI plugin posts, before the pod source knows them.
//!
//! Such a pod is enrolled at once and kept until the source decides: it
//! reports the pod as ambient (the source's entry takes over), or as a pod
//! it knows and does not enrol (the pod is removed), or the pod's netns is
//! gone. If ztunnel then does not take the pod, the CNI endpoint abandons it
//! ([`AbandonRequest`]) and its redirection goes again, so a failed ADD
//! leaves nothing behind; the runtime retries with a new sandbox.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use super::{Controller, Pass, PassReport, PodSpec, SourcePods};
use crate::{cni::AddError, netns::Netns, zds::Workload};

/// A pod the CNI plugin posted, kept until the source decides.
#[derive(Debug)]
pub(super) struct CniPod {
    pub pod: PodSpec,
    /// The namespace it was posted with (a new sandbox is a new one).
    pub netns_inode: u64,
    /// The source has listed it as waiting for its netns: once it lists it
    /// nowhere, the pod object is gone.
    pub source_knew: bool,
}

/// A pod whose CNI ADD failed because ztunnel did not take it.
#[derive(Debug)]
pub(super) struct HeldBack {
    since: Instant,
    /// As [`CniPod::source_knew`].
    source_knew: bool,
}

/// How long a held-back pod is reported without the source knowing it
/// (without a Kubernetes source nobody reads the report).
const HELD_BACK_UNKNOWN: Duration = Duration::from_secs(600);

/// The pod's redirection is in place and ztunnel's desired set has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CniEnrolled {
    /// The namespace enrolled, whose Add ztunnel must ack.
    pub netns_inode: u64,
}

/// A pod the CNI plugin asks to enrol now, and where to say whether its
/// redirection is in place and ztunnel's desired set has it.
#[derive(Debug)]
pub struct EnrollRequest {
    pub pod: PodSpec,
    pub reply: oneshot::Sender<Result<CniEnrolled, AddError>>,
}

/// A CNI-enrolled pod whose ADD failed afterwards (ztunnel did not take
/// it): its redirection is removed, unless the source wants the pod, and
/// `reply` is answered once that is done.
#[derive(Debug)]
pub struct AbandonRequest {
    pub uid: String,
    /// The namespace enrolled; `None` abandons whichever it was (the ADD
    /// timed out before the answer said).
    pub netns_inode: Option<u64>,
    pub reply: oneshot::Sender<()>,
}

/// What the CNI endpoint asks of the controller.
#[derive(Debug)]
pub enum CniRequest {
    Enroll(EnrollRequest),
    Abandon(AbandonRequest),
}

impl From<EnrollRequest> for CniRequest {
    fn from(request: EnrollRequest) -> Self {
        CniRequest::Enroll(request)
    }
}

/// How the CNI endpoint reaches the controller.
pub type CniRequests = mpsc::Receiver<CniRequest>;

impl Controller {
    /// The desired pods: the source's ambient pods, plus the CNI-posted pods
    /// it does not report yet (forgotten once it does, once it knows them as
    /// not ambient, or once their netns is gone: the sandbox was deleted).
    pub(super) fn desired(&mut self, source: &SourcePods) -> Vec<PodSpec> {
        self.source_settled = source.waiting.is_empty();
        let reported: HashMap<&str, &crate::zds::NetnsSource> = source
            .ambient
            .iter()
            .map(|p| (p.workload.uid.as_str(), &p.workload.netns))
            .collect();
        self.explicit.retain(|uid, cni| {
            let pod = &cni.pod;
            if let Some(netns) = reported.get(uid.as_str()) {
                // The namespace a CNI ADD posts is the pod's: the source's
                // record replaces it only once it names the same namespace
                // (a re-created sandbox is reported with its old one for a
                // while).
                let caught_up = netns
                    .open()
                    .is_ok_and(|(_, inode)| inode == cni.netns_inode);
                if caught_up {
                    return false;
                }
                return Netns::open(&pod.workload.netns.path().to_string_lossy()).is_ok();
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
        self.forget_held_back(source, &reported);
        let explicit = &self.explicit;
        self.deleted = self
            .enrolled
            .keys()
            .filter(|uid| {
                source.absent_means_deleted
                    && !reported.contains_key(uid.as_str())
                    && !explicit.contains_key(*uid)
                    && !source.not_ambient.contains_key(*uid)
                    && !source.waiting.contains(*uid)
                    && !source.unreadable.contains(*uid)
            })
            .cloned()
            .collect();
        let mut pods: Vec<PodSpec> = source
            .ambient
            .iter()
            .filter(|p| !explicit.contains_key(&p.workload.uid))
            .cloned()
            .collect();
        pods.extend(self.explicit.values().map(|cni| cni.pod.clone()));
        // A pod the source knows but cannot resolve this moment keeps the
        // capture it has, and ztunnel its proxy: never one without the other.
        for uid in &source.waiting {
            // Not a pod whose CNI ADD failed: the runtime tears its sandbox
            // down, and its capture goes.
            let Some(enrolled) = self
                .enrolled
                .get(uid)
                .filter(|_| !self.held_back.contains_key(uid))
            else {
                continue;
            };
            if !pods.iter().any(|p| p.workload.uid == *uid) {
                pods.push(PodSpec {
                    workload: Workload {
                        netns_inode: None,
                        ..enrolled.workload.clone()
                    },
                    dns_capture: Some(enrolled.options.dns_capture),
                });
            }
        }
        pods
    }

    /// Stops reporting held-back pods once they are wanted again (the
    /// source reports them, or a CNI add), the source knows them as not
    /// ambient or has dropped them, or nobody has known them for long.
    fn forget_held_back<V>(&mut self, source: &SourcePods, reported: &HashMap<&str, V>) {
        let explicit = &self.explicit;
        self.held_back.retain(|uid, held| {
            if reported.contains_key(uid.as_str())
                || explicit.contains_key(uid)
                || source.not_ambient.contains_key(uid)
            {
                return false;
            }
            if source.waiting.contains(uid) {
                held.source_knew = true;
                return true;
            }
            !held.source_knew && held.since.elapsed() < HELD_BACK_UNKNOWN
        });
    }

    /// [`Controller::apply`] for the `posted` pods of `pods` only: each is
    /// enrolled or kept as a full pass would, and ztunnel's set and the
    /// programmed report change for them alone. Every other pod stays as the
    /// latest pass left it.
    fn apply_posted(&mut self, pods: &[PodSpec], posted: &BTreeSet<&str>) -> PassReport {
        let mut pass = Pass::default();
        for pod in pods
            .iter()
            .filter(|p| posted.contains(p.workload.uid.as_str()))
        {
            self.program(pod, &mut pass);
        }
        for uid in posted {
            if !pass.report.failed.contains_key(*uid) {
                self.failures_logged.remove(*uid);
            }
        }
        let mut programmed = self
            .programmed
            .as_ref()
            .map(|sender| sender.borrow().programmed.clone())
            .unwrap_or_default();
        programmed.retain(|uid| !posted.contains(uid.as_str()));
        programmed.extend(pass.ready.iter().map(|w| w.uid.clone()));
        self.send_programmed(programmed);
        self.share_netns_cookies();
        for uid in posted {
            match pass.ready.iter().find(|w| w.uid == *uid) {
                Some(ready) => self.zds.upsert(self.as_handed_to_ztunnel(ready)),
                None => self.zds.remove(uid),
            }
        }
        self.record_pass(&pass.report);
        pass.report
    }

    /// Serves a batch of CNI requests on top of `source`. Abandoned pods go
    /// first. The pods to enrol are enrolled now, and each is answered `Ok`
    /// once its redirection is in place and ztunnel's desired set has it. A
    /// pod that fails is not kept (the runtime tears the sandbox down and
    /// retries with a new one), nor is one the source knows as not ambient
    /// (refused, with why).
    pub fn apply_requests(&mut self, source: &SourcePods, requests: Vec<CniRequest>) {
        let mut enrols = Vec::new();
        let mut abandoned = Vec::new();
        for request in requests {
            match request {
                CniRequest::Enroll(request) => enrols.push(request),
                CniRequest::Abandon(request) => {
                    let ours = self.explicit.get(&request.uid).is_some_and(|cni| {
                        request
                            .netns_inode
                            .is_none_or(|inode| inode == cni.netns_inode)
                    });
                    if ours {
                        info!(
                            "pod {}: its CNI add failed; removing its redirection",
                            request.uid
                        );
                        self.explicit.remove(&request.uid);
                        let held = HeldBack {
                            since: Instant::now(),
                            source_knew: false,
                        };
                        self.held_back.insert(request.uid.clone(), held);
                    }
                    abandoned.push(request);
                }
            }
        }
        enrols.retain_mut(|request| {
            let netns = request.pod.workload.netns.path();
            match Netns::open(&netns.to_string_lossy()) {
                Ok(opened) => {
                    let cni = CniPod {
                        pod: request.pod.clone(),
                        netns_inode: opened.inode(),
                        source_knew: false,
                    };
                    self.explicit.insert(request.pod.workload.uid.clone(), cni);
                    true
                }
                Err(e) => {
                    let reply = std::mem::replace(&mut request.reply, oneshot::channel().0);
                    let _ = reply.send(Err(AddError::NetnsUnusable(e.to_string())));
                    false
                }
            }
        });
        let desired = self.desired(source);
        // An ADD costs its own pod's enrolment, not a pass over every pod of
        // the node: unless something else must change with it (an abandoned
        // pod, or a posted one the source does not want), only the posted
        // pods are programmed, and the rest wait for the next full pass.
        let posted: BTreeSet<&str> = enrols.iter().map(|r| r.pod.workload.uid.as_str()).collect();
        let wanted: HashSet<&str> = desired.iter().map(|p| p.workload.uid.as_str()).collect();
        let report = if abandoned.is_empty() && posted.iter().all(|uid| wanted.contains(uid)) {
            self.apply_posted(&desired, &posted)
        } else {
            self.apply(&desired)
        };
        let mut refused = false;
        for request in enrols {
            let uid = &request.pod.workload.uid;
            let result = match report.failed.get(uid) {
                Some(why) => Err(AddError::Enrol(why.clone())),
                None => match self.enrolled.get(uid) {
                    Some(enrolled) => Ok(CniEnrolled {
                        netns_inode: enrolled.netns.inode(),
                    }),
                    // The runtime retries the ADD, which reads the pod afresh.
                    None => Err(AddError::NotAmbient(
                        source
                            .not_ambient
                            .get(uid)
                            .cloned()
                            .unwrap_or_else(|| "not enrolled".to_owned()),
                    )),
                },
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
        // Answered once the pass that removed them is done.
        for request in abandoned {
            let _ = request.reply.send(());
        }
    }
}
