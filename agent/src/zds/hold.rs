//! Waiting until ztunnel holds one pod: the CNI ADD's last step.
//!
//! Istio's node agent answers a CNI ADD only once the newest ztunnel
//! connection has acked the pod's Add (`AddPodToMesh` waits for
//! `PodAdded`), and ztunnel acks only once the pod's proxy runs, so the
//! pod's first connection finds ztunnel's listeners bound. Each connection
//! records ztunnel's answer to every Add it sends ([`AddAnswer`]), with the
//! namespace it was for; [`ZdsHandle::wait_until_held`] waits for the answer
//! about the pod's current namespace.
//!
//! It fails, as Istio's does, when no ztunnel is connected, when ztunnel
//! NACKs the Add (or it cannot be sent), when the connection it was sent on
//! closes first (an ack timeout closes it too), when the pod leaves the
//! desired set meanwhile, or when the caller's bound passes.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use tokio::time::{Instant, sleep_until};

use super::{Shared, ZdsHandle};

/// ztunnel's latest answer to one pod's Add.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct AddAnswer {
    /// The namespace the Add carried (`None`: it could not be opened).
    pub netns_inode: Option<u64>,
    /// Orders answers: one recorded before a wait began is not about it.
    pub seq: u64,
    /// `Err`: ztunnel's NACK, or why the Add could not be sent.
    pub outcome: Result<(), String>,
}

/// The latest [`AddAnswer`] by UID, and the sequence number of the newest.
#[derive(Clone, Debug, Default)]
pub(super) struct AddAnswers {
    pub by_uid: Arc<BTreeMap<String, AddAnswer>>,
    pub seq: u64,
}

/// Why ztunnel does not hold a pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotHeld {
    #[error("no ztunnel is connected")]
    NoZtunnel,
    #[error("ztunnel refused the pod: {0}")]
    Nacked(String),
    #[error("the pod could not be sent to ztunnel: {0}")]
    NotSent(String),
    #[error("ztunnel connection {connection} closed before acking the pod ({why})")]
    Disconnected { connection: u64, why: String },
    #[error("ztunnel did not ack the pod within {0:?}")]
    Timeout(Duration),
    /// The pod left the desired set meanwhile (deleted, or opted out).
    #[error("the pod left the mesh before ztunnel acked it")]
    Removed,
}

/// Where a pod's wait for ztunnel begins: taken before the pod is handed
/// to ztunnel, so that what happens between then and the wait counts.
#[derive(Clone, Copy, Debug)]
pub struct HoldWait {
    /// Answers up to this one predate the pod's Add.
    began: u64,
    /// The connection its Add goes to: the newest then (none: no ztunnel).
    serving: Option<u64>,
}

impl ZdsHandle {
    /// Notes which connection will get the next Add, before the pod is put
    /// in the desired set ([`ZdsHandle::wait_until_held`] waits from here).
    pub fn hold_wait(&self) -> HoldWait {
        HoldWait {
            began: self.shared.answers.borrow().seq,
            serving: self.shared.live.borrow().last().copied(),
        }
    }

    /// Waits until ztunnel has acked the Add of pod `uid` with the namespace
    /// whose inode is `netns_inode`, at most `bound`. The pod must be in the
    /// desired set already (the connections send it from there). An Add
    /// acked earlier for the same namespace counts (a repeated CNI ADD); a
    /// refusal only if it came after `since`. A newer connection may take
    /// over and answer; the one serving at `since` closing first ends it.
    pub async fn wait_until_held(
        &self,
        since: HoldWait,
        uid: &str,
        netns_inode: u64,
        bound: Duration,
    ) -> Result<(), NotHeld> {
        let shared = &self.shared;
        let deadline = Instant::now() + bound;
        let mut answers = shared.answers.subscribe();
        let mut live = shared.live.subscribe();
        let mut desired = shared.desired.subscribe();
        let Some(serving) = since.serving else {
            return Err(NotHeld::NoZtunnel);
        };
        loop {
            if let Some(answer) = answers.borrow_and_update().by_uid.get(uid) {
                match &answer.outcome {
                    Ok(()) if answer.netns_inode == Some(netns_inode) => return Ok(()),
                    Err(why) if answer.seq > since.began => {
                        return Err(match answer.netns_inode {
                            Some(_) => NotHeld::Nacked(why.clone()),
                            None => NotHeld::NotSent(why.clone()),
                        });
                    }
                    _ => {}
                }
            }
            if !desired.borrow_and_update().contains_key(uid) {
                return Err(NotHeld::Removed);
            }
            if !live.borrow_and_update().contains(&serving) {
                return Err(NotHeld::Disconnected {
                    connection: serving,
                    why: shared.why_closed(serving),
                });
            }
            tokio::select! {
                changed = answers.changed() => if changed.is_err() { return Err(NotHeld::NoZtunnel) },
                changed = live.changed() => if changed.is_err() { return Err(NotHeld::NoZtunnel) },
                changed = desired.changed() => if changed.is_err() { return Err(NotHeld::NoZtunnel) },
                () = sleep_until(deadline) => return Err(NotHeld::Timeout(bound)),
            }
        }
    }
}

impl Shared {
    /// Records ztunnel's answer to `uid`'s Add of `netns_inode`, or why it
    /// could not be sent, for [`ZdsHandle::wait_until_held`].
    pub(super) fn record_answer(
        &self,
        uid: &str,
        netns_inode: Option<u64>,
        outcome: Result<(), String>,
    ) {
        self.answers.send_if_modified(|answers| {
            // Under the answers' lock, so a pod removed meanwhile is not
            // brought back (removal forgets after changing `desired`).
            if !self.desired.borrow().contains_key(uid) {
                return false;
            }
            answers.seq += 1;
            let answer = AddAnswer {
                netns_inode,
                seq: answers.seq,
                outcome,
            };
            Arc::make_mut(&mut answers.by_uid).insert(uid.to_owned(), answer);
            true
        });
    }

    /// Forgets the answers about pods that left the desired set.
    pub(super) fn forget_answers(&self) {
        self.answers.send_if_modified(|answers| {
            let desired = self.desired.borrow();
            if answers.by_uid.keys().all(|uid| desired.contains_key(uid)) {
                return false;
            }
            Arc::make_mut(&mut answers.by_uid).retain(|uid, _| desired.contains_key(uid));
            true
        });
    }
}
