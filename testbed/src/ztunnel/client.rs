//! The ZDS client: connection handling and the pod state machine of
//! ztunnel's `WorkloadProxyManager` / `WorkloadProxyManagerState`.

use std::{
    collections::{HashMap, HashSet},
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use ambpf_proto::{
    Message,
    zds::{WorkloadInfo, WorkloadResponse, ZdsHello},
};
use tokio::sync::mpsc;
use tokio_seqpacket::UnixSeqpacket;

use super::{
    Command, PROCESS_FAILURE, PROXY_START_FAILURE, READ_FAILURE, Shared, Workload, ZdsConnection,
    ZdsEvent, ZtunnelConfig,
    dns_server::DnsAnswers,
    proxy::PodProxies,
    proxy_host::{ProxyProcess, RunningProxies},
    reconnect::{BACKOFF_INITIAL, connect_with_backoff, next_backoff, sleep_unless_shutdown},
    wire::{self, ControlBuffer, READ_BUFFER_LEN, ReceiveError, Request},
};

/// A network namespace received from the agent, identified as ztunnel does.
struct Netns {
    fd: OwnedFd,
    /// (st_dev, st_ino) of the fd.
    id: (u64, u64),
}

impl Netns {
    fn new(fd: OwnedFd) -> Result<Self, String> {
        let stat = nix::sys::stat::fstat(&fd).map_err(|e| format!("fstat of the netns fd: {e}"))?;
        Ok(Self {
            fd,
            id: (stat.st_dev, stat.st_ino),
        })
    }

    fn inode(&self) -> u64 {
        self.id.1
    }
}

struct Pod {
    netns: Netns,
    proxies: Option<RunningProxies>,
}

/// A pod whose proxies failed to start, kept (fd included) for retries.
struct PendingPod {
    info: WorkloadInfo,
    netns: Netns,
}

/// How one connection ended.
enum ConnectionEnd {
    /// The server closed it or it broke; ztunnel reconnects.
    Closed(String),
    /// The hello could not be sent; ztunnel backs off, then reconnects.
    AnnounceFailed(String),
    /// The test asked for it.
    Disconnected,
    /// ztunnel stops its ZDS client for good.
    ProtocolError(String),
    Shutdown,
}

/// The response to one request.
enum Reaction {
    Ack(ZdsEvent),
    /// A NACK; the connection stays up.
    Nack {
        uid: Option<String>,
        reason: String,
    },
    /// A NACK for a request that could not be read, then ztunnel drops the
    /// connection (and reconnects).
    NackAndDisconnect {
        uid: Option<String>,
        reason: String,
    },
    /// A NACK, then the client stops for good.
    ProtocolError {
        uid: Option<String>,
        reason: String,
    },
}

pub(super) struct Client {
    shared: Arc<Shared>,
    start_proxies: bool,
    ack_delay: Duration,
    proxy_start_delay: Duration,
    pending_retry_interval: Duration,
    dns_answers: DnsAnswers,
    /// [`ZtunnelConfig::proxy_process`].
    proxy_process: Option<PathBuf>,
    /// That child, started before each connection to ZDS.
    proxy_host: Option<Arc<ProxyProcess>>,
    pods: HashMap<String, Pod>,
    pending: HashMap<String, PendingPod>,
    /// SnapshotSent received on this connection.
    snapshot_received: bool,
    /// Uids this connection Added or Kept before SnapshotSent.
    snapshot_uids: HashSet<String>,
    connection: u32,
}

impl Client {
    pub(super) fn new(shared: Arc<Shared>, config: &ZtunnelConfig) -> Self {
        Self {
            shared,
            start_proxies: config.start_proxies,
            ack_delay: config.ack_delay,
            proxy_start_delay: config.proxy_start_delay,
            pending_retry_interval: config.pending_retry_interval,
            dns_answers: DnsAnswers::of(config),
            proxy_process: config.proxy_process.clone(),
            proxy_host: None,
            pods: HashMap::new(),
            pending: HashMap::new(),
            snapshot_received: false,
            snapshot_uids: HashSet::new(),
            connection: 0,
        }
    }

    /// Serves `first` (or connects to `path`), then reconnects while
    /// `reconnect` allows. Once the client has stopped, pods keep running
    /// until shutdown.
    pub(super) async fn run(
        mut self,
        path: PathBuf,
        mut first: Option<UnixSeqpacket>,
        reconnect: bool,
        mut commands: mpsc::UnboundedReceiver<Command>,
    ) {
        let mut backoff = BACKOFF_INITIAL;
        let shutdown = loop {
            // ztunnel's sockets are made by the process that speaks ZDS; the
            // agent records that process and its children when it connects,
            // so the proxies' child is running by then.
            self.ensure_proxy_host();
            let socket = match first.take() {
                Some(socket) => socket,
                None => match connect_with_backoff(&path, &mut backoff, &mut commands).await {
                    Some(socket) => socket,
                    None => break true,
                },
            };
            let stop_reason = match self.serve_connection(socket, &mut commands).await {
                ConnectionEnd::Shutdown => break true,
                ConnectionEnd::ProtocolError(reason) => format!("protocol error: {reason}"),
                ConnectionEnd::Closed(reason) if !reconnect => {
                    format!("connection ended: {reason}")
                }
                ConnectionEnd::AnnounceFailed(reason) if !reconnect => {
                    format!("connection ended: {reason}")
                }
                ConnectionEnd::Disconnected if !reconnect => "disconnected by the test".to_owned(),
                ConnectionEnd::AnnounceFailed(_) => {
                    if !sleep_unless_shutdown(next_backoff(&mut backoff), &mut commands).await {
                        break true;
                    }
                    continue;
                }
                ConnectionEnd::Closed(_) | ConnectionEnd::Disconnected => {
                    backoff = BACKOFF_INITIAL;
                    continue;
                }
            };
            self.shared.update(|s| s.stopped = Some(stop_reason));
            break false;
        };
        if !shutdown {
            while let Some(command) = commands.recv().await {
                if matches!(command, Command::Shutdown) {
                    break;
                }
            }
        }
        self.stop_all_pods().await;
    }

    async fn serve_connection(
        &mut self,
        socket: UnixSeqpacket,
        commands: &mut mpsc::UnboundedReceiver<Command>,
    ) -> ConnectionEnd {
        if let Err(e) = socket.send(&ZdsHello::v1().encode_to_vec()).await {
            return ConnectionEnd::AnnounceFailed(format!("cannot send hello: {e}"));
        }
        self.begin_connection();
        let mut buffer = [0u8; READ_BUFFER_LEN];
        let mut control = ControlBuffer::new();
        let mut response = Vec::with_capacity(READ_BUFFER_LEN);
        let retry = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(retry);
        let mut retry_armed = false;
        let end = loop {
            let received = tokio::select! {
                biased;
                command = commands.recv() => match command {
                    Some(Command::Disconnect) => break ConnectionEnd::Disconnected,
                    Some(Command::Shutdown) | None => break ConnectionEnd::Shutdown,
                },
                () = &mut retry, if retry_armed => {
                    retry_armed = self.retry_pending().await;
                    if retry_armed {
                        retry.as_mut().reset(tokio::time::Instant::now() + self.pending_retry_interval);
                    }
                    continue;
                }
                received = wire::receive(&socket, &mut buffer, &mut control) => received,
            };
            let reaction = match received {
                Ok(request) => {
                    if !self.ack_delay.is_zero() {
                        tokio::time::sleep(self.ack_delay).await;
                    }
                    self.handle(request).await
                }
                Err(ReceiveError::Closed) => {
                    break ConnectionEnd::Closed("closed by the server".to_owned());
                }
                Err(ReceiveError::Io(e)) => {
                    break ConnectionEnd::Closed(format!("receive failed: {e}"));
                }
                Err(ReceiveError::Unreadable { uid, reason }) => Reaction::NackAndDisconnect {
                    uid,
                    reason: format!("{READ_FAILURE} : {reason}"),
                },
            };
            let (error, then) = self.record(reaction);
            if !retry_armed && !self.pending.is_empty() {
                retry_armed = true;
                retry
                    .as_mut()
                    .reset(tokio::time::Instant::now() + self.pending_retry_interval);
            }
            self.publish_readiness();
            response.clear();
            WorkloadResponse::ack(error)
                .encode(&mut response)
                .expect("a Vec grows to fit any message");
            if let Err(e) = socket.send(&response).await {
                break ConnectionEnd::Closed(format!("cannot send response: {e}"));
            }
            if let Some(end) = then {
                break end;
            }
        };
        self.end_connection(&end);
        end
    }

    /// Records the reaction's events; returns the response's error text
    /// (empty for an ACK) and how the connection ends once it is sent.
    fn record(&self, reaction: Reaction) -> (String, Option<ConnectionEnd>) {
        match reaction {
            Reaction::Ack(event) => {
                self.shared.record(event);
                (String::new(), None)
            }
            Reaction::Nack { uid, reason } => {
                self.shared.record(ZdsEvent::Nacked {
                    uid,
                    reason: reason.clone(),
                });
                (reason, None)
            }
            Reaction::NackAndDisconnect { uid, reason } => {
                self.shared.record(ZdsEvent::Nacked {
                    uid,
                    reason: reason.clone(),
                });
                let end = ConnectionEnd::Closed(format!("NACKed an unreadable request ({reason})"));
                (reason, Some(end))
            }
            Reaction::ProtocolError { uid, reason } => {
                let text = format!("{PROCESS_FAILURE} : protocol error: {reason}");
                self.shared.record(ZdsEvent::Nacked {
                    uid,
                    reason: text.clone(),
                });
                self.shared.record(ZdsEvent::ProtocolError {
                    reason: reason.clone(),
                });
                (text, Some(ConnectionEnd::ProtocolError(reason)))
            }
        }
    }

    /// A new connection starts a new snapshot, as ztunnel's `reset_snapshot`.
    fn begin_connection(&mut self) {
        self.connection += 1;
        self.snapshot_received = false;
        self.snapshot_uids.clear();
        // Pending pods (and their netns fds) are forgotten: the agent's new
        // snapshot sends them again.
        self.pending.clear();
        let id = self.connection;
        self.shared.update(|s| {
            s.connections.push(ZdsConnection {
                id,
                ..ZdsConnection::default()
            });
            s.events.push(ZdsEvent::Connected { connection: id });
            s.connected = true;
            s.ready = false;
            s.pending.clear();
        });
    }

    fn end_connection(&mut self, end: &ConnectionEnd) {
        let reason = match end {
            ConnectionEnd::Closed(reason)
            | ConnectionEnd::AnnounceFailed(reason)
            | ConnectionEnd::ProtocolError(reason) => reason.clone(),
            ConnectionEnd::Disconnected => "disconnected by the test".to_owned(),
            ConnectionEnd::Shutdown => "shutdown".to_owned(),
        };
        let id = self.connection;
        self.shared.update(|s| {
            s.connected = false;
            s.ready = false;
            if let Some(connection) = s.connection_mut() {
                connection.ended = Some(reason.clone());
            }
            s.events.push(ZdsEvent::Disconnected {
                connection: id,
                reason,
            });
        });
    }

    async fn handle(&mut self, request: Request) -> Reaction {
        match request {
            Request::Add { uid, info, netns } => self.handle_add(uid, info, netns).await,
            Request::Keep { uid } => {
                if self.snapshot_received {
                    return Reaction::ProtocolError {
                        uid: Some(uid),
                        reason: "pod keep received after snapshot".to_owned(),
                    };
                }
                self.snapshot_uids.insert(uid.clone());
                self.shared.update(|s| {
                    if let Some(connection) = s.connection_mut() {
                        connection.kept.push(uid.clone());
                    }
                });
                Reaction::Ack(ZdsEvent::Keep { uid })
            }
            Request::Del { uid } => {
                self.forget_pending(&uid);
                if self.snapshot_received {
                    self.remove_pod(&uid).await;
                } else {
                    // Before the snapshot ends only the bookkeeping changes;
                    // the reconciliation drains the pod unless re-added.
                    self.snapshot_uids.remove(&uid);
                }
                Reaction::Ack(ZdsEvent::Del { uid })
            }
            Request::SnapshotSent => {
                if self.snapshot_received {
                    return Reaction::ProtocolError {
                        uid: None,
                        reason: "pod snapshot received already".to_owned(),
                    };
                }
                self.reconcile().await;
                self.snapshot_received = true;
                self.shared.update(|s| {
                    if let Some(connection) = s.connection_mut() {
                        connection.snapshot_sent = true;
                    }
                });
                Reaction::Ack(ZdsEvent::SnapshotSent)
            }
        }
    }

    async fn handle_add(
        &mut self,
        uid: String,
        info: Option<WorkloadInfo>,
        netns: OwnedFd,
    ) -> Reaction {
        self.shared.update(|s| {
            if let Some(connection) = s.connection_mut() {
                connection.added.push(uid.clone());
            }
        });
        let Some(info) = info else {
            return Reaction::ProtocolError {
                uid: Some(uid),
                reason: "workload_info is required but not present".to_owned(),
            };
        };
        if !self.snapshot_received {
            self.snapshot_uids.insert(uid.clone());
        }
        let netns = match Netns::new(netns) {
            Ok(netns) => netns,
            Err(reason) => {
                return Reaction::Nack {
                    uid: Some(uid),
                    reason: format!("{PROXY_START_FAILURE} : {reason}"),
                };
            }
        };
        let event = ZdsEvent::Add {
            uid: uid.clone(),
            name: info.name.clone(),
            namespace: info.namespace.clone(),
            service_account: info.service_account.clone(),
            netns_inode: netns.inode(),
        };
        match self.add_workload(&uid, info, netns).await {
            Ok(()) => Reaction::Ack(event),
            Err(reason) => Reaction::Nack {
                uid: Some(uid),
                reason: format!("{PROXY_START_FAILURE} : {reason}"),
            },
        }
    }

    /// Starts the pod's proxies, replacing those of another netns; on failure
    /// the pod becomes pending.
    async fn add_workload(
        &mut self,
        uid: &str,
        info: WorkloadInfo,
        netns: Netns,
    ) -> Result<(), String> {
        if let Some(existing) = self.pods.get(uid) {
            if existing.netns.id == netns.id {
                // Idempotent: the duplicate fd closes here.
                return Ok(());
            }
            // A new sandbox (netns) for the same pod: drain the old proxies.
            self.remove_pod(uid).await;
        }
        match self.start_proxies(uid, &netns).await {
            Ok(proxies) => {
                self.pending.remove(uid);
                let workload = Workload {
                    name: info.name,
                    namespace: info.namespace,
                    service_account: info.service_account,
                    netns_inode: netns.inode(),
                    proxies_running: proxies.is_some(),
                };
                self.pods.insert(uid.to_owned(), Pod { netns, proxies });
                self.shared.update(|s| {
                    s.pending.remove(uid);
                    s.workloads.insert(uid.to_owned(), workload);
                });
                Ok(())
            }
            Err(reason) => {
                self.pending
                    .insert(uid.to_owned(), PendingPod { info, netns });
                self.shared.update(|s| s.pending.insert(uid.to_owned()));
                Err(reason)
            }
        }
    }

    /// The proxies' child process, started if configured and not running;
    /// `None` without one (or if it cannot start: `start_proxies` says why).
    fn ensure_proxy_host(&mut self) -> Option<Arc<ProxyProcess>> {
        let binary = self.proxy_process.as_ref()?;
        match &self.proxy_host {
            Some(host) if host.is_running() => Some(host.clone()),
            _ => {
                let host =
                    ProxyProcess::spawn(binary, self.dns_answers, self.shared.clone()).ok()?;
                Some(self.proxy_host.insert(host).clone())
            }
        }
    }

    async fn start_proxies(
        &mut self,
        uid: &str,
        netns: &Netns,
    ) -> Result<Option<RunningProxies>, String> {
        if !self.proxy_start_delay.is_zero() {
            tokio::time::sleep(self.proxy_start_delay).await;
        }
        if self.shared.should_fail(uid) {
            return Err(format!("the test configured uid {uid} to fail"));
        }
        if !self.start_proxies {
            return Ok(None);
        }
        if let Some(binary) = self.proxy_process.clone() {
            let host = match self.ensure_proxy_host() {
                Some(host) => host,
                None => ProxyProcess::spawn(&binary, self.dns_answers, self.shared.clone())
                    .map_err(|e| e.to_string())?,
            };
            return host
                .start(uid, netns.fd.as_fd())
                .await
                .map(|proxies| Some(RunningProxies::Child(proxies)));
        }
        PodProxies::start(uid, netns.fd.as_fd(), self.shared.clone(), self.dns_answers)
            .await
            .map(|proxies| Some(RunningProxies::Here(proxies)))
            .map_err(|e| e.to_string())
    }

    /// Retries pending pods; true while some remain pending.
    async fn retry_pending(&mut self) -> bool {
        for (uid, pod) in std::mem::take(&mut self.pending) {
            let _ = self.add_workload(&uid, pod.info, pod.netns).await;
        }
        self.publish_readiness();
        !self.pending.is_empty()
    }

    fn forget_pending(&mut self, uid: &str) {
        if self.pending.remove(uid).is_some() {
            self.shared.update(|s| s.pending.remove(uid));
        }
    }

    /// Drains every pod this connection did not Add or Keep.
    async fn reconcile(&mut self) {
        let stale: Vec<String> = self
            .pods
            .keys()
            .filter(|uid| !self.snapshot_uids.contains(*uid))
            .cloned()
            .collect();
        for uid in stale {
            self.remove_pod(&uid).await;
        }
        self.snapshot_uids.clear();
    }

    /// Stops the pod's proxies (listeners closed on return), then closes its
    /// netns fd.
    async fn remove_pod(&mut self, uid: &str) {
        let Some(pod) = self.pods.remove(uid) else {
            return;
        };
        if let Some(proxies) = pod.proxies {
            proxies.stop().await;
        }
        drop(pod.netns);
        self.shared.update(|s| s.workloads.remove(uid));
    }

    async fn stop_all_pods(&mut self) {
        let uids: Vec<String> = self.pods.keys().cloned().collect();
        for uid in uids {
            self.remove_pod(&uid).await;
        }
        self.pending.clear();
        self.shared.update(|s| {
            s.pending.clear();
            s.ready = false;
            s.stopped.get_or_insert_with(|| "shutdown".to_owned());
        });
    }

    fn publish_readiness(&self) {
        let ready = self.snapshot_received && self.pending.is_empty();
        self.shared.update(|s| s.ready = ready);
    }
}
