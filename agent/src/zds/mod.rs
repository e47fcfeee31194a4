//! The ZDS server: hands each ambient pod's network namespace to ztunnel.
//!
//! ztunnel connects to the agent's unix socket (SOCK_SEQPACKET), says hello,
//! and receives one `AddWorkload` per pod with the pod's netns fd, then
//! `SnapshotSent`; afterwards Adds and Dels as pods come and go. Every request
//! waits for ztunnel's Ack. See `connection` for the per-connection protocol
//! and its failure handling.
//!
//! The desired pods live in one [`ZdsHandle`]; connections reconcile against
//! it, so any change reaches every connection, and a connection that drops
//! mid-way loses nothing: the next one gets the full snapshot again.
//!
//! What ztunnel made of each desired pod is published too
//! ([`ZdsHandle::ztunnel_pods`], a [`ZtunnelStatus`] per pod), so that the
//! pod can be marked `enabled` or `pending` as Istio's node agent does.

mod connection;
mod hold;
pub mod listener;
pub mod peer;
mod workload;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    path::PathBuf,
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::Duration,
};

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use tokio::sync::watch;
use tokio_seqpacket::UnixSeqpacketListener;
use tracing::{info, warn};

pub use hold::{HoldWait, NotHeld};
pub use listener::{DEFAULT_SOCKET, ListenError};
pub use workload::{NetnsSource, Workload, WorkloadSet};

/// What ztunnel has made of one desired pod, as far as the agent knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZtunnelStatus {
    /// A ztunnel connection acked the pod's Add: ztunnel runs its proxy.
    /// Kept while ztunnel reconnects (it keeps its proxies while the agent
    /// is away, and the new connection's snapshot re-Adds the pod) until an
    /// Add is NACKed or the pod leaves the desired set.
    Acked,
    /// ztunnel NACKed the pod's latest Add, or the agent could not send it
    /// (its netns cannot be opened, the message does not fit). Retried.
    Refused,
    /// Never acked, and no ztunnel is connected to take it.
    Unserved,
}

/// The desired pods' [`ZtunnelStatus`] by UID. A desired pod that is absent
/// is on its way: its Add is being sent or awaits its Ack.
pub type ZtunnelPodSet = Arc<BTreeMap<String, ZtunnelStatus>>;

/// A subscription to [`ZtunnelPodSet`] updates.
pub type ZtunnelPods = watch::Receiver<ZtunnelPodSet>;

#[derive(Clone, Debug)]
pub struct ZdsConfig {
    pub socket: PathBuf,
    /// How long to wait for each Ack (Istio's node agent: 5 s).
    pub ack_timeout: Duration,
    /// How long a new connection may take to say hello.
    pub hello_timeout: Duration,
    /// First delay before re-sending an Add that ztunnel NACKed; doubles up
    /// to [`ZdsConfig::max_retry_delay`].
    pub retry_delay: Duration,
    pub max_retry_delay: Duration,
}

impl Default for ZdsConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            ack_timeout: Duration::from_secs(5),
            hello_timeout: Duration::from_secs(5),
            retry_delay: Duration::from_millis(500),
            max_retry_delay: Duration::from_secs(30),
        }
    }
}

/// Counters for metrics and tests: registered as they are
/// ([`ZdsStats::register`]).
#[derive(Debug, Default)]
pub struct ZdsStats {
    pub connections_accepted: Counter,
    pub connections_active: Gauge<u64, AtomicU64>,
    pub snapshots_acked: Counter,
    pub adds_acked: Counter,
    pub dels_acked: Counter,
    pub keeps_sent: Counter,
    pub nacks: Counter,
    pub ack_timeouts: Counter,
    pub peer_errors: Counter,
    /// Pods that could not be sent at all (netns gone, message too large).
    pub send_failures: Counter,
}

/// A counter or gauge of [`ZdsStats`], read as a number.
pub trait StatValue {
    fn value(&self) -> u64;
}

impl StatValue for Counter {
    fn value(&self) -> u64 {
        self.get()
    }
}

impl StatValue for Gauge<u64, AtomicU64> {
    fn value(&self) -> u64 {
        self.get()
    }
}

impl ZdsStats {
    pub fn get(stat: &impl StatValue) -> u64 {
        stat.value()
    }

    fn bump(counter: &Counter) {
        counter.inc();
    }

    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "zds_connections_active",
            "ztunnel connections open now",
            self.connections_active.clone(),
        );
        for (name, help, counter) in [
            (
                "zds_connections",
                "ztunnel connections accepted",
                &self.connections_accepted,
            ),
            (
                "zds_snapshots_acked",
                "Full snapshots ztunnel acked",
                &self.snapshots_acked,
            ),
            (
                "zds_adds_acked",
                "AddWorkload requests acked",
                &self.adds_acked,
            ),
            (
                "zds_dels_acked",
                "DelWorkload requests acked",
                &self.dels_acked,
            ),
            ("zds_nacks", "Requests ztunnel refused (NACK)", &self.nacks),
            (
                "zds_ack_timeouts",
                "Requests ztunnel did not answer in time",
                &self.ack_timeouts,
            ),
            (
                "zds_peer_errors",
                "ztunnel connections closed on an error",
                &self.peer_errors,
            ),
            (
                "zds_send_failures",
                "Pods that could not be sent to ztunnel",
                &self.send_failures,
            ),
        ] {
            registry.register(name, help, counter.clone());
        }
    }
}

/// State shared by the server, its connections and the pod sources.
struct Shared {
    config: ZdsConfig,
    desired: watch::Sender<WorkloadSet>,
    /// What ztunnel made of the desired pods. Lock order: this, then
    /// `desired` or `live`.
    ztunnel: watch::Sender<ZtunnelPodSet>,
    /// ztunnel's latest answer to each desired pod's Add (see [`hold`]).
    /// Lock order: this, then `desired`.
    answers: watch::Sender<hold::AddAnswers>,
    /// Id of the newest live connection (0: none). Only it receives Adds, as
    /// with Istio's node agent during a ztunnel rolling update; when it goes,
    /// the previous one takes over.
    newest: watch::Sender<u64>,
    /// The live connections' ids, oldest first.
    live: watch::Sender<Vec<u64>>,
    /// The process behind each live connection (its PID in the agent's PID
    /// namespace, from the socket's peer credentials), by connection id:
    /// ztunnel's process, whose marked sockets the eBPF mode exempts.
    peer_pids: Mutex<BTreeMap<u64, u32>>,
    /// Told the live connections' PIDs whenever they change, before the new
    /// connection is sent anything (see [`ZdsHandle::record_peers_with`]).
    peer_recorder: Mutex<Option<PeerRecorder>>,
    /// Why the most recent connections closed, newest last (for errors).
    closed: Mutex<VecDeque<(u64, String)>>,
    /// Snapshots acked so far, for readiness.
    snapshots: watch::Sender<u64>,
    stats: ZdsStats,
    /// The desired pods' netns cookies by UID, as the redirection read
    /// them: the `netns_cookie` of ZDS log lines.
    netns_cookies: Mutex<HashMap<String, u64>>,
}

/// The handle pod sources use to say which pods ztunnel should have.
#[derive(Clone)]
pub struct ZdsHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ZdsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZdsHandle")
            .field("socket", &self.shared.config.socket)
            .field("pods", &self.shared.desired.borrow().len())
            .finish()
    }
}

impl ZdsHandle {
    pub fn new(config: ZdsConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                config,
                desired: watch::Sender::new(Arc::new(BTreeMap::new())),
                ztunnel: watch::Sender::new(Arc::new(BTreeMap::new())),
                answers: watch::Sender::new(hold::AddAnswers::default()),
                newest: watch::Sender::new(0),
                live: watch::Sender::new(Vec::new()),
                peer_pids: Mutex::new(BTreeMap::new()),
                peer_recorder: Mutex::new(None),
                closed: Mutex::new(VecDeque::new()),
                snapshots: watch::Sender::new(0),
                stats: ZdsStats::default(),
                netns_cookies: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn config(&self) -> &ZdsConfig {
        &self.shared.config
    }

    pub fn stats(&self) -> &ZdsStats {
        &self.shared.stats
    }

    /// Adds a pod, or updates it (a new netns makes ztunnel replace its proxy).
    pub fn upsert(&self, workload: Workload) {
        self.change_desired(|set| {
            if set.get(&workload.uid) == Some(&workload) {
                return false;
            }
            Arc::make_mut(set).insert(workload.uid.clone(), workload);
            true
        });
    }

    pub fn remove(&self, uid: &str) {
        self.change_desired(|set| {
            if !set.contains_key(uid) {
                return false;
            }
            Arc::make_mut(set).remove(uid);
            true
        });
    }

    /// Records the pods' netns cookies (by UID), for log lines.
    pub fn set_netns_cookies(&self, cookies: HashMap<String, u64>) {
        *self
            .shared
            .netns_cookies
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = cookies;
    }

    /// Replaces the whole set (a source's full resync).
    pub fn replace_all(&self, workloads: impl IntoIterator<Item = Workload>) {
        let next: BTreeMap<_, _> = workloads.into_iter().map(|w| (w.uid.clone(), w)).collect();
        self.change_desired(|set| {
            if **set == next {
                return false;
            }
            *set = Arc::new(next);
            true
        });
    }

    /// Applies `change` to the desired set (it says whether it changed
    /// anything); on a change, connections are woken and the ztunnel
    /// statuses follow.
    fn change_desired(&self, change: impl FnOnce(&mut WorkloadSet) -> bool) {
        if self.shared.desired.send_if_modified(change) {
            self.shared.settle_ztunnel_pods();
            self.shared.forget_answers();
        }
    }

    pub fn workloads(&self) -> WorkloadSet {
        self.shared.desired.borrow().clone()
    }

    /// What ztunnel made of each desired pod, updated as it answers; see
    /// [`ZtunnelStatus`].
    pub fn ztunnel_pods(&self) -> ZtunnelPods {
        self.shared.ztunnel.subscribe()
    }

    /// Has `recorder` told the PIDs of the live ZDS connections (in the
    /// agent's PID namespace; a peer whose PID the kernel could not give is
    /// absent) each time they change: a new connection's before it is sent
    /// anything, since ztunnel makes a pod's sockets as soon as it has the
    /// pod, and they must be known as ztunnel's from the first.
    pub fn record_peers_with(&self, recorder: PeerRecorder) {
        recorder(&[]);
        *self
            .shared
            .peer_recorder
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(recorder);
    }

    /// Waits until some ztunnel has acked a full snapshot (readiness).
    pub async fn snapshot_acked(&self) {
        let mut snapshots = self.shared.snapshots.subscribe();
        // The sender lives in `shared`, which `self` keeps alive.
        let _ = snapshots.wait_for(|&n| n > 0).await;
    }

    /// Binds the socket and serves connections until the task is dropped.
    pub async fn serve(self) -> Result<(), ListenError> {
        let listener = listener::bind(&self.shared.config.socket)?;
        info!(
            "ZDS server listening on {}",
            self.shared.config.socket.display()
        );
        self.serve_on(listener).await;
        Ok(())
    }

    /// Serves connections accepted on `listener`.
    pub async fn serve_on(self, mut listener: UnixSeqpacketListener) {
        let mut next_id = 1u64;
        loop {
            let socket = match listener.accept().await {
                Ok(socket) => socket,
                Err(e) => {
                    warn!("ZDS accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let id = next_id;
            next_id += 1;
            let shared = self.shared.clone();
            // Before anything is sent: ztunnel makes pods' sockets only once
            // it has them, and they must be known as its own from the first.
            match socket.peer_cred().map(|cred| cred.pid()) {
                Ok(Some(pid)) if pid > 0 => shared.peer_changed(|pids| {
                    pids.insert(id, pid as u32);
                }),
                Ok(_) => warn!(
                    "ZDS connection {id}: the peer's PID is not visible from the agent's PID \
                     namespace (run the agent with hostPID): its marked sockets will be captured"
                ),
                Err(e) => warn!("ZDS connection {id}: reading the peer's credentials: {e}"),
            }
            shared.register(id);
            tokio::spawn(async move {
                let why = match connection::serve(id, &socket, &shared).await {
                    Ok(()) => {
                        info!("ZDS connection {id}: ztunnel disconnected");
                        "ztunnel disconnected".to_owned()
                    }
                    Err(e) => {
                        ZdsStats::bump(&shared.stats.peer_errors);
                        warn!("ZDS connection {id} closed: {e}");
                        e.to_string()
                    }
                };
                shared.unregister(id, why);
            });
        }
    }
}

/// What [`ZdsHandle::record_peers_with`] calls with the peers' PIDs.
pub type PeerRecorder = Arc<dyn Fn(&[u32]) + Send + Sync>;

impl Shared {
    /// Changes the peers' PIDs with `change` and tells the recorder.
    fn peer_changed(&self, change: impl FnOnce(&mut BTreeMap<u64, u32>)) {
        let mut pids = self.peer_pids.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut pids);
        let now: Vec<u32> = pids.values().copied().collect();
        drop(pids);
        let recorder = self
            .peer_recorder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(recorder) = recorder {
            recorder(&now);
        }
    }

    fn netns_cookie(&self, uid: &str) -> Option<u64> {
        self.netns_cookies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .copied()
    }

    fn register(&self, id: u64) {
        let mut count = 0;
        self.live.send_modify(|live| {
            live.push(id);
            count = live.len();
        });
        self.newest.send_replace(id);
        ZdsStats::bump(&self.stats.connections_accepted);
        self.stats.connections_active.set(count as u64);
        info!("ZDS connection {id} accepted ({count} live)");
    }

    fn snapshot_acked(&self) {
        ZdsStats::bump(&self.stats.snapshots_acked);
        self.snapshots.send_modify(|n| *n += 1);
    }

    fn unregister(&self, id: u64, why: String) {
        self.peer_changed(|pids| {
            pids.remove(&id);
        });
        {
            let mut closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
            if closed.len() == 16 {
                closed.pop_front();
            }
            closed.push_back((id, why));
        }
        let (mut newest, mut count) = (0, 0);
        self.live.send_modify(|live| {
            live.retain(|&other| other != id);
            newest = live.last().copied().unwrap_or(0);
            count = live.len();
        });
        self.newest
            .send_if_modified(|current| std::mem::replace(current, newest) != newest);
        self.stats.connections_active.set(count as u64);
        self.settle_ztunnel_pods();
    }

    /// Why connection `id` closed, if it is among the recent ones.
    fn why_closed(&self, id: u64) -> String {
        let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        closed
            .iter()
            .rev()
            .find(|(closed, _)| *closed == id)
            .map_or_else(|| "closed".to_owned(), |(_, why)| why.clone())
    }

    /// Brings the ztunnel statuses in line with the desired set: pods that
    /// left are forgotten; with no ztunnel connected, pods on their way
    /// become [`ZtunnelStatus::Unserved`] (acked pods stay acked).
    fn settle_ztunnel_pods(&self) {
        self.ztunnel.send_if_modified(|pods| {
            let desired = self.desired.borrow();
            let unserved = self.live.borrow().is_empty();
            let stale = pods.keys().any(|uid| !desired.contains_key(uid));
            let waiting = unserved && desired.keys().any(|uid| !pods.contains_key(uid));
            if !stale && !waiting {
                return false;
            }
            let pods = Arc::make_mut(pods);
            pods.retain(|uid, _| desired.contains_key(uid));
            if unserved {
                for uid in desired.keys() {
                    pods.entry(uid.clone()).or_insert(ZtunnelStatus::Unserved);
                }
            }
            true
        });
    }

    /// Records ztunnel's answer to a pod's Add of `netns_inode` (an Ack, or
    /// a NACK with its text), if the pod is still desired.
    fn ztunnel_answered(&self, uid: &str, netns_inode: Option<u64>, answer: Result<(), String>) {
        let status = match answer {
            Ok(()) => ZtunnelStatus::Acked,
            Err(_) => ZtunnelStatus::Refused,
        };
        self.set_ztunnel_status(uid, |_| status);
        self.record_answer(uid, netns_inode, answer);
    }

    /// Records that a pod's Add could not be sent, and why. ztunnel still
    /// runs a proxy it acked earlier, so an acked pod stays acked.
    fn not_sent(&self, uid: &str, why: String) {
        self.set_ztunnel_status(uid, |previous| match previous {
            Some(ZtunnelStatus::Acked) => ZtunnelStatus::Acked,
            _ => ZtunnelStatus::Refused,
        });
        self.record_answer(uid, None, Err(why));
    }

    fn set_ztunnel_status(
        &self,
        uid: &str,
        next: impl FnOnce(Option<ZtunnelStatus>) -> ZtunnelStatus,
    ) {
        self.ztunnel.send_if_modified(|pods| {
            // Under the status lock, so a pod removed meanwhile is not
            // brought back (removal settles after changing `desired`).
            if !self.desired.borrow().contains_key(uid) {
                return false;
            }
            let previous = pods.get(uid).copied();
            let status = next(previous);
            if previous == Some(status) {
                return false;
            }
            Arc::make_mut(pods).insert(uid.to_owned(), status);
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(uid: &str) -> Workload {
        Workload {
            uid: uid.into(),
            name: uid.into(),
            namespace: "shop".into(),
            service_account: "default".into(),
            netns: NetnsSource::Path(format!("/run/netns/{uid}").into()),
            netns_inode: None,
        }
    }

    fn statuses(zds: &ZdsHandle) -> Vec<(String, ZtunnelStatus)> {
        zds.ztunnel_pods()
            .borrow()
            .iter()
            .map(|(uid, status)| (uid.clone(), *status))
            .collect()
    }

    fn status(uid: &str, status: ZtunnelStatus) -> (String, ZtunnelStatus) {
        (uid.to_owned(), status)
    }

    #[test]
    fn pods_desired_while_no_ztunnel_is_connected_are_unserved() {
        let zds = ZdsHandle::new(ZdsConfig::default());
        zds.replace_all([workload("a"), workload("b")]);
        assert_eq!(
            statuses(&zds),
            [
                status("a", ZtunnelStatus::Unserved),
                status("b", ZtunnelStatus::Unserved)
            ]
        );
        zds.remove("a");
        zds.upsert(workload("c"));
        assert_eq!(
            statuses(&zds),
            [
                status("b", ZtunnelStatus::Unserved),
                status("c", ZtunnelStatus::Unserved)
            ]
        );
    }

    #[test]
    fn answers_are_kept_across_a_reconnect_until_ztunnel_says_otherwise() {
        let zds = ZdsHandle::new(ZdsConfig::default());
        let shared = &zds.shared;
        shared.register(1);
        zds.replace_all([workload("a"), workload("b"), workload("c")]);
        // With a ztunnel connected, new pods are on their way.
        assert!(statuses(&zds).is_empty());
        shared.ztunnel_answered("a", Some(1), Ok(()));
        shared.ztunnel_answered("b", Some(2), Err("no".into()));
        assert_eq!(
            statuses(&zds),
            [
                status("a", ZtunnelStatus::Acked),
                status("b", ZtunnelStatus::Refused)
            ]
        );

        // ztunnel goes away: the acked pod stays acked, the one on its way
        // is unserved, the refused one stays refused.
        shared.unregister(1, "gone".into());
        assert_eq!(
            statuses(&zds),
            [
                status("a", ZtunnelStatus::Acked),
                status("b", ZtunnelStatus::Refused),
                status("c", ZtunnelStatus::Unserved)
            ]
        );

        // The next connection's answers decide; an Add that cannot be sent
        // does not undo an earlier Ack.
        shared.register(2);
        shared.not_sent("a", "gone".into());
        shared.ztunnel_answered("b", Some(2), Ok(()));
        shared.not_sent("c", "gone".into());
        assert_eq!(
            statuses(&zds),
            [
                status("a", ZtunnelStatus::Acked),
                status("b", ZtunnelStatus::Acked),
                status("c", ZtunnelStatus::Refused)
            ]
        );
        shared.ztunnel_answered("a", Some(1), Err("no".into()));
        assert_eq!(statuses(&zds)[0], status("a", ZtunnelStatus::Refused));

        // A pod that left is forgotten, and a late answer does not bring it
        // back.
        zds.remove("b");
        shared.ztunnel_answered("b", Some(2), Ok(()));
        assert_eq!(
            statuses(&zds),
            [
                status("a", ZtunnelStatus::Refused),
                status("c", ZtunnelStatus::Refused)
            ]
        );
    }
}
