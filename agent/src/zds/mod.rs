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

mod connection;
pub mod listener;
mod workload;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use log::{info, warn};
use tokio::sync::watch;
use tokio_seqpacket::UnixSeqpacketListener;

pub use listener::{DEFAULT_SOCKET, ListenError};
pub use workload::{NetnsSource, Workload, WorkloadSet};

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

/// Counters for metrics and tests.
#[derive(Debug, Default)]
pub struct ZdsStats {
    pub connections_accepted: AtomicU64,
    pub connections_active: AtomicU64,
    pub snapshots_acked: AtomicU64,
    pub adds_acked: AtomicU64,
    pub dels_acked: AtomicU64,
    pub keeps_sent: AtomicU64,
    pub nacks: AtomicU64,
    pub ack_timeouts: AtomicU64,
    pub peer_errors: AtomicU64,
    /// Pods that could not be sent at all (netns gone, message too large).
    pub send_failures: AtomicU64,
}

impl ZdsStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// State shared by the server, its connections and the pod sources.
struct Shared {
    config: ZdsConfig,
    desired: watch::Sender<WorkloadSet>,
    /// Id of the newest live connection (0: none). Only it receives Adds, as
    /// with Istio's node agent during a ztunnel rolling update; when it goes,
    /// the previous one takes over.
    newest: watch::Sender<u64>,
    live: Mutex<Vec<u64>>,
    /// Snapshots acked so far, for readiness.
    snapshots: watch::Sender<u64>,
    stats: ZdsStats,
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
                newest: watch::Sender::new(0),
                live: Mutex::new(Vec::new()),
                snapshots: watch::Sender::new(0),
                stats: ZdsStats::default(),
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
        self.shared.desired.send_if_modified(|set| {
            if set.get(&workload.uid) == Some(&workload) {
                return false;
            }
            Arc::make_mut(set).insert(workload.uid.clone(), workload);
            true
        });
    }

    pub fn remove(&self, uid: &str) {
        self.shared.desired.send_if_modified(|set| {
            if !set.contains_key(uid) {
                return false;
            }
            Arc::make_mut(set).remove(uid);
            true
        });
    }

    /// Replaces the whole set (a source's full resync).
    pub fn replace_all(&self, workloads: impl IntoIterator<Item = Workload>) {
        let next: BTreeMap<_, _> = workloads.into_iter().map(|w| (w.uid.clone(), w)).collect();
        self.shared.desired.send_if_modified(|set| {
            if **set == next {
                return false;
            }
            *set = Arc::new(next);
            true
        });
    }

    pub fn workloads(&self) -> WorkloadSet {
        self.shared.desired.borrow().clone()
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
            shared.register(id);
            tokio::spawn(async move {
                match connection::serve(id, &socket, &shared).await {
                    Ok(()) => info!("ZDS connection {id}: ztunnel disconnected"),
                    Err(e) => {
                        ZdsStats::bump(&shared.stats.peer_errors);
                        warn!("ZDS connection {id} closed: {e}");
                    }
                }
                shared.unregister(id);
            });
        }
    }
}

impl Shared {
    fn register(&self, id: u64) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.push(id);
        self.newest.send_replace(id);
        ZdsStats::bump(&self.stats.connections_accepted);
        self.stats
            .connections_active
            .store(live.len() as u64, Ordering::Relaxed);
        info!("ZDS connection {id} accepted ({} live)", live.len());
    }

    fn snapshot_acked(&self) {
        ZdsStats::bump(&self.stats.snapshots_acked);
        self.snapshots.send_modify(|n| *n += 1);
    }

    fn unregister(&self, id: u64) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|&other| other != id);
        let newest = live.last().copied().unwrap_or(0);
        self.newest
            .send_if_modified(|current| std::mem::replace(current, newest) != newest);
        self.stats
            .connections_active
            .store(live.len() as u64, Ordering::Relaxed);
    }
}
