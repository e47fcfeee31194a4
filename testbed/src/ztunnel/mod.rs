//! A ztunnel test double: the ZDS client and the in-pod proxies of Istio's
//! ztunnel (in-pod mode), strict enough to test the agent's ZDS server against
//! and fast enough to benchmark redirection through.
//!
//! The ZDS client behaves as ztunnel's does (see `ZTUNNEL_CONTRACT.md`):
//!
//! - it connects to the agent's AF_UNIX SOCK_SEQPACKET socket and sends
//!   `ZdsHello{V1}`, then answers every request with one `WorkloadResponse`;
//! - each request is read into a 1024-byte buffer with room for exactly one
//!   file descriptor; a truncated message or control data, more than one fd, an
//!   Add without an fd, an fd on any other message, or undecodable bytes get a
//!   NACK `failure to read message : ...` and the connection is dropped;
//! - an Add without `workload_info`, a Keep after SnapshotSent or a second
//!   SnapshotSent get a NACK and stop the client for good (no reconnect);
//! - an Add whose proxies fail to start (or whose uid the test listed with
//!   [`ZtunnelConfig::nack`]) gets `failure to start proxy : ...`; the pod is
//!   kept pending, retried every [`ZtunnelConfig::pending_retry_interval`],
//!   and the double is not ready while any pod is pending;
//! - an Add for a uid it has is idempotent when the netns is the same (by
//!   device and inode) and replaces the pod's proxies when it differs;
//! - a Del after SnapshotSent stops the pod and closes its netns fd; before
//!   SnapshotSent it only forgets that this connection sent the pod, and the
//!   snapshot reconciliation drains it (as ztunnel does);
//! - on SnapshotSent it drains every pod this connection did not Add or Keep,
//!   then is ready.
//!
//! With [`ZtunnelDouble::connect_with_retry`] it reconnects with ztunnel's
//! backoff (10 ms doubling to 15 s) and keeps pods' proxies running across
//! reconnects. Everything it does is observable through [`ZtunnelState`].
//!
//! In-pod proxies (unless [`ZtunnelConfig::start_proxies`] is off) listen in
//! the pod's netns on `[::]:15001` (outbound), `[::]:15006` (inbound
//! plaintext) and `[::]:15008` (a plain-text stand-in for HBONE: an HTTP/1.1
//! `CONNECT <ip:port>` instead of mTLS + HTTP/2 CONNECT), dual-stack, with
//! IP_TRANSPARENT, SO_REUSEPORT and SO_MARK 0x539. They recover the original
//! destination (SO_ORIGINAL_DST, else the local address), refuse calls to
//! ztunnel itself, and pass everything through as plain TCP from sockets
//! created in the pod's netns with the same mark; inbound (15006) keeps the
//! client's address (IP_TRANSPARENT + IP_FREEBIND). Every accepted connection
//! is recorded as a [`ProxiedConnection`]. With
//! [`ZtunnelConfig::proxy_process`] they run in a `ztunnel-proxies` child
//! process of their own, which reports its records back (`proxy_host.rs`).
//!
//! Each pod also gets ztunnel's DNS proxy: `127.0.0.1:15053` and
//! `[::1]:15053` (the latter only if the netns has IPv6 loopback), UDP and
//! TCP (2-byte length prefix, several queries per connection), SO_MARK 0x539
//! and SO_REUSEPORT. It answers queries itself, with no upstream: A with
//! [`ZtunnelConfig::dns_answer_v4`], AAAA with
//! [`ZtunnelConfig::dns_answer_v6`] (class IN, TTL 30), anything else with
//! NOERROR and no answer; id, opcode, RD and the question are copied, QR and
//! RA set. A query whose header reads but whose question does not gets
//! FORMERR, a non-QUERY opcode NOTIMP; shorter messages and responses are
//! dropped. Every answered query is recorded as a [`DnsQuery`]; the [`dns`]
//! module has what a test needs to ask and read the answer.
//!
//! Needs root (setns, IP_TRANSPARENT, SO_MARK) when proxies are started, and a
//! tokio runtime (multi-threaded in tests, so blocking test code cannot stall
//! it).

mod client;
pub mod dns;
mod dns_server;
mod proxy;
mod proxy_host;
mod sockets;
mod wire;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_seqpacket::UnixSeqpacket;

use dns_server::DnsAnswers;
pub use proxy_host::serve_proxy_process;

/// Where ztunnel looks for the node agent's ZDS socket by default (`INPOD_UDS`).
pub const DEFAULT_SOCKET_PATH: &str = "/var/run/ztunnel/ztunnel.sock";
/// Outbound capture listener in each pod.
pub const OUTBOUND_PORT: u16 = 15001;
/// Inbound plaintext capture listener in each pod.
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// Inbound HBONE listener in each pod (a plain CONNECT stand-in here).
pub const HBONE_PORT: u16 = 15008;
/// ztunnel's DNS proxy in each pod, on `127.0.0.1` and `[::1]`, UDP and TCP.
pub const DNS_PORT: u16 = 15053;
/// What the double answers to A queries unless configured otherwise.
pub const DEFAULT_DNS_ANSWER_V4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 53);
/// What the double answers to AAAA queries unless configured otherwise.
pub const DEFAULT_DNS_ANSWER_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x53);
/// The mark on every socket ztunnel creates in a pod; redirection must never
/// capture traffic carrying it.
pub const ZTUNNEL_MARK: u32 = 0x539;
/// How ztunnel's NACK starts when a pod's proxies cannot be started.
pub const PROXY_START_FAILURE: &str = "failure to start proxy";
/// How ztunnel's NACK starts when a request cannot be read.
pub const READ_FAILURE: &str = "failure to read message";
/// How ztunnel's NACK starts when a request breaks the protocol.
pub const PROCESS_FAILURE: &str = "failure to process message";

/// How the double behaves, misbehaviour for tests included.
#[derive(Clone, Debug)]
pub struct ZtunnelConfig {
    /// Start in-pod proxies for Added pods. Off, the double only speaks ZDS
    /// (fast, for tests with hundreds of pods; no root needed).
    pub start_proxies: bool,
    /// Pods whose proxies "fail to start": their Add gets ztunnel's
    /// `failure to start proxy` NACK. Changeable later with
    /// [`ZtunnelDouble::set_nack`].
    pub nack_uids: HashSet<String>,
    /// Wait this long before handling each request (a slow ztunnel).
    pub ack_delay: Duration,
    /// Wait this long after accepting a connection on 15001/15006 before
    /// asking its original destination (a busy ztunnel: connections opened
    /// meanwhile wait in the accept queue, their records in the maps).
    pub original_dst_delay: Duration,
    /// How often pods whose proxies failed to start are retried (ztunnel: 5 s).
    pub pending_retry_interval: Duration,
    /// The DNS proxy's answer to every A query.
    pub dns_answer_v4: Ipv4Addr,
    /// The DNS proxy's answer to every AAAA query.
    pub dns_answer_v6: Ipv6Addr,
    /// Run the in-pod proxies in a child process of this `ztunnel-proxies`
    /// binary, whose descriptors are its own, as ztunnel's are (see
    /// `proxy_host.rs`); `None`: in this process.
    pub proxy_process: Option<PathBuf>,
}

impl Default for ZtunnelConfig {
    fn default() -> Self {
        Self {
            start_proxies: true,
            nack_uids: HashSet::new(),
            ack_delay: Duration::ZERO,
            original_dst_delay: Duration::ZERO,
            pending_retry_interval: Duration::from_secs(5),
            dns_answer_v4: DEFAULT_DNS_ANSWER_V4,
            dns_answer_v6: DEFAULT_DNS_ANSWER_V6,
            proxy_process: None,
        }
    }
}

impl ZtunnelConfig {
    /// ZDS only: no proxies, no root needed.
    pub fn zds_only() -> Self {
        Self {
            start_proxies: false,
            ..Self::default()
        }
    }

    /// NACKs the Add of `uid` with `failure to start proxy`.
    pub fn nack(mut self, uid: impl Into<String>) -> Self {
        self.nack_uids.insert(uid.into());
        self
    }

    pub fn ack_delay(mut self, delay: Duration) -> Self {
        self.ack_delay = delay;
        self
    }

    pub fn original_dst_delay(mut self, delay: Duration) -> Self {
        self.original_dst_delay = delay;
        self
    }

    pub fn pending_retry_interval(mut self, interval: Duration) -> Self {
        self.pending_retry_interval = interval;
        self
    }

    /// Answers A queries with `address`.
    pub fn dns_answer_v4(mut self, address: Ipv4Addr) -> Self {
        self.dns_answer_v4 = address;
        self
    }

    /// Answers AAAA queries with `address`.
    pub fn dns_answer_v6(mut self, address: Ipv6Addr) -> Self {
        self.dns_answer_v6 = address;
        self
    }

    /// Runs the in-pod proxies in a child process of `binary`
    /// (`ztunnel-proxies`).
    pub fn proxy_process(mut self, binary: impl Into<PathBuf>) -> Self {
        self.proxy_process = Some(binary.into());
        self
    }
}

/// What the double saw and did on the ZDS socket, in order.
///
/// Request events (`Add`, `Keep`, `Del`, `SnapshotSent`) are recorded for
/// requests that were ACKed, before the ACK is sent; any other response is a
/// `Nacked` with the exact text sent. A `ProtocolError` follows the `Nacked`
/// of the request that stopped the client for good.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ZdsEvent {
    /// Connection number `connection` (from 1) is up and the hello was sent.
    Connected {
        connection: u32,
    },
    Add {
        uid: String,
        name: String,
        namespace: String,
        service_account: String,
        netns_inode: u64,
    },
    Keep {
        uid: String,
    },
    Del {
        uid: String,
    },
    SnapshotSent,
    /// A NACK; `uid` when the request could be decoded.
    Nacked {
        uid: Option<String>,
        reason: String,
    },
    ProtocolError {
        reason: String,
    },
    Disconnected {
        connection: u32,
        reason: String,
    },
}

/// A pod whose Add was ACKed and not yet undone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Workload {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// Inode of the netns fd received with the Add (`ls -Li /proc/<pid>/ns/net`).
    pub netns_inode: u64,
    /// The pod's listeners are up (false in ZDS-only mode).
    pub proxies_running: bool,
}

/// One ZDS connection: which pods it sent, as the snapshot reconciliation sees
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ZdsConnection {
    /// From 1, in connection order.
    pub id: u32,
    /// Uids of every Add received on this connection (ACKed or not), in order.
    pub added: Vec<String>,
    /// Uids of every Keep ACKed on this connection, in order.
    pub kept: Vec<String>,
    pub snapshot_sent: bool,
    /// Why the connection ended, once it has.
    pub ended: Option<String>,
}

/// What became of a connection accepted by an in-pod listener.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionOutcome {
    /// Connected upstream; bytes are (or were) copied both ways.
    Proxied,
    /// A call to ztunnel itself (outbound to a loopback address or to the
    /// listener itself on 15001/15006/15008; inbound to any of those ports),
    /// closed without connecting upstream.
    RefusedSelfCall,
    /// The upstream connection failed.
    UpstreamFailed(String),
    /// 15008 only: not a well-formed `CONNECT <ip:port> HTTP/1.1` request.
    BadConnectRequest(String),
}

/// A connection accepted by a pod's listener, recorded once its fate is
/// decided (for `Proxied`: once upstream is connected, before any byte is
/// copied).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxiedConnection {
    pub uid: String,
    /// 15001, 15006 or 15008.
    pub listener_port: u16,
    /// The peer of the accepted socket (IPv4-mapped addresses unmapped).
    pub client: SocketAddr,
    /// The accepted socket's own address (IPv4-mapped addresses unmapped).
    pub local: SocketAddr,
    /// What `SO_ORIGINAL_DST` (IPv4, then IPv6) answered on the accepted
    /// socket, `None` if it failed (no NAT and no ambpf answer); never asked
    /// on 15008.
    pub so_original_dst: Option<SocketAddr>,
    /// SO_ORIGINAL_DST, else the accepted socket's local address; for 15008
    /// the CONNECT target (or the local address if the request was
    /// unreadable).
    pub original_dst: SocketAddr,
    /// 15001 only: the `Forwarded` header ztunnel's HBONE CONNECT for this
    /// connection carries, built as ztunnel builds it, from the accepted
    /// socket's peer (`for=10.0.0.1`, `for="[fd00::1]"`).
    pub forwarded: Option<String>,
    pub outcome: ConnectionOutcome,
}

/// How a DNS query reached the DNS proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsTransport {
    Udp,
    Tcp,
}

/// A DNS query the double answered (NOERROR, with or without an answer),
/// recorded before the answer is sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsQuery {
    pub uid: String,
    pub transport: DnsTransport,
    /// The querier as the DNS socket sees it (IPv4-mapped addresses
    /// unmapped): after a redirection, the app's socket address as rewritten
    /// on the way (a loopback or the pod's address, and the app's port).
    pub client: SocketAddr,
    /// The DNS socket that got it: `127.0.0.1:15053` or `[::1]:15053`.
    pub server: SocketAddr,
    /// The first question's name, without the final dot (`.` for the root),
    /// unusual bytes escaped (`\.`, `\DDD`).
    pub name: String,
    pub qtype: u16,
    /// The address answered: for A and AAAA of class IN or ANY.
    pub answer: Option<IpAddr>,
}

/// Everything observable about the double. Read it with
/// [`ZtunnelDouble::inspect`], [`ZtunnelDouble::state`] or in a
/// [`ZtunnelDouble::wait_until`] predicate.
#[derive(Clone, Debug, Default)]
pub struct ZtunnelState {
    pub events: Vec<ZdsEvent>,
    /// Pods by uid.
    pub workloads: BTreeMap<String, Workload>,
    /// Uids whose proxies failed to start, retried periodically.
    pub pending: BTreeSet<String>,
    /// Every connection so far, oldest first.
    pub connections: Vec<ZdsConnection>,
    pub connected: bool,
    /// SnapshotSent received on the current connection and nothing pending
    /// (ztunnel's `/healthz/ready`).
    pub ready: bool,
    /// Why the ZDS client stopped for good (protocol error, or the single
    /// connection of [`ZtunnelDouble::connect`] ended). Pods keep running.
    pub stopped: Option<String>,
    pub proxied: Vec<ProxiedConnection>,
    /// Every DNS query answered, in order.
    pub dns_queries: Vec<DnsQuery>,
    /// DNS messages not answered normally: dropped (shorter than a header,
    /// or a response) or answered FORMERR or NOTIMP.
    pub dns_rejected: u64,
}

impl ZtunnelState {
    /// The connection in progress or the last one.
    pub fn current_connection(&self) -> Option<&ZdsConnection> {
        self.connections.last()
    }

    /// Events since the last `Connected` (all of them if never connected).
    pub fn current_connection_events(&self) -> &[ZdsEvent] {
        let start = self
            .events
            .iter()
            .rposition(|e| matches!(e, ZdsEvent::Connected { .. }))
            .unwrap_or(0);
        &self.events[start..]
    }

    fn connection_mut(&mut self) -> Option<&mut ZdsConnection> {
        self.connections.last_mut()
    }
}

/// A predicate did not hold in time; carries the state for the failure message.
#[derive(Debug)]
pub struct WaitTimeout {
    pub waited: Duration,
    pub state: Box<ZtunnelState>,
}

impl fmt::Display for WaitTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "condition not met within {:?}; ztunnel double state: {:#?}",
            self.waited, self.state
        )
    }
}

impl std::error::Error for WaitTimeout {}

/// State shared by the client task, the proxies and the handle.
struct Shared {
    state: Mutex<ZtunnelState>,
    /// Bumped after every change, so waiters wake without polling.
    changes: watch::Sender<u64>,
    nack_uids: Mutex<HashSet<String>>,
    /// [`ZtunnelConfig::original_dst_delay`].
    original_dst_delay: Duration,
}

impl Shared {
    fn new(nack_uids: HashSet<String>, original_dst_delay: Duration) -> Self {
        Self {
            state: Mutex::default(),
            changes: watch::Sender::new(0),
            nack_uids: Mutex::new(nack_uids),
            original_dst_delay,
        }
    }

    fn lock(&self) -> MutexGuard<'_, ZtunnelState> {
        // A panicking test thread must not hide the state from the others.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update<R>(&self, change: impl FnOnce(&mut ZtunnelState) -> R) -> R {
        let result = change(&mut self.lock());
        self.changes
            .send_modify(|version| *version = version.wrapping_add(1));
        result
    }

    fn record(&self, event: ZdsEvent) {
        self.update(|state| state.events.push(event));
    }

    fn record_connection(&self, connection: ProxiedConnection) {
        self.update(|state| state.proxied.push(connection));
    }

    fn record_dns(&self, query: DnsQuery) {
        self.update(|state| state.dns_queries.push(query));
    }

    fn record_dns_rejected(&self) {
        self.update(|state| state.dns_rejected += 1);
    }

    fn should_fail(&self, uid: &str) -> bool {
        self.nack_uids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(uid)
    }
}

enum Command {
    Disconnect,
    Shutdown,
}

/// A running ztunnel double. Dropping it stops the client and every pod's
/// proxies (asynchronously); [`ZtunnelDouble::shutdown`] waits for that.
pub struct ZtunnelDouble {
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl ZtunnelDouble {
    /// Connects once to `socket_path` (failing if nobody listens) and serves
    /// that connection; when it ends the client stops, pods keep running.
    pub async fn connect(
        socket_path: impl AsRef<Path>,
        config: ZtunnelConfig,
    ) -> std::io::Result<Self> {
        let path = socket_path.as_ref().to_owned();
        let socket = UnixSeqpacket::connect(&path).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("connecting to ZDS socket {}: {e}", path.display()),
            )
        })?;
        Ok(Self::spawn(path, Some(socket), false, config))
    }

    /// Connects to `socket_path` in the background like ztunnel: retrying with
    /// backoff while nobody listens, reconnecting whenever the connection ends
    /// (except after a protocol error), pods' proxies running throughout.
    pub fn connect_with_retry(socket_path: impl AsRef<Path>, config: ZtunnelConfig) -> Self {
        Self::spawn(socket_path.as_ref().to_owned(), None, true, config)
    }

    fn spawn(
        path: PathBuf,
        first: Option<UnixSeqpacket>,
        reconnect: bool,
        config: ZtunnelConfig,
    ) -> Self {
        let shared = Arc::new(Shared::new(
            config.nack_uids.clone(),
            config.original_dst_delay,
        ));
        let (commands, command_rx) = mpsc::unbounded_channel();
        let client = client::Client::new(shared.clone(), &config);
        let task = tokio::spawn(client.run(path, first, reconnect, command_rx));
        Self {
            shared,
            commands,
            task: Some(task),
        }
    }

    /// One pod's in-pod proxies and nothing else (no ZDS client), in the pod
    /// namespace `netns`: what one more ztunnel process serving the same pod
    /// would add. Its listeners join the pod's others through SO_REUSEPORT,
    /// so the kernel spreads new connections over every process serving the
    /// pod; a benchmark uses that to spread a storm's descriptors over
    /// processes, each of which RLIMIT_NOFILE caps. Recorded connections are
    /// read as from any double; [`ZtunnelDouble::disconnect`] does nothing.
    pub async fn serve_pod(
        uid: &str,
        netns: std::os::fd::BorrowedFd<'_>,
        config: ZtunnelConfig,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::new(
            config.nack_uids.clone(),
            config.original_dst_delay,
        ));
        let answers = DnsAnswers::of(&config);
        let proxies = proxy::PodProxies::start(uid, netns, shared.clone(), answers).await?;
        let (commands, mut command_rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            // Serve until shut down (or the handle is gone).
            while let Some(Command::Disconnect) = command_rx.recv().await {}
            proxies.stop().await;
        });
        Ok(Self {
            shared,
            commands,
            task: Some(task),
        })
    }

    /// Runs `f` on the current state, under its lock: keep it short.
    pub fn inspect<R>(&self, f: impl FnOnce(&ZtunnelState) -> R) -> R {
        f(&self.shared.lock())
    }

    /// A copy of the whole state.
    pub fn state(&self) -> ZtunnelState {
        self.inspect(ZtunnelState::clone)
    }

    pub fn events(&self) -> Vec<ZdsEvent> {
        self.inspect(|s| s.events.clone())
    }

    pub fn workloads(&self) -> BTreeMap<String, Workload> {
        self.inspect(|s| s.workloads.clone())
    }

    pub fn is_ready(&self) -> bool {
        self.inspect(|s| s.ready)
    }

    pub fn is_connected(&self) -> bool {
        self.inspect(|s| s.connected)
    }

    /// Why the client stopped for good, if it has.
    pub fn stopped(&self) -> Option<String> {
        self.inspect(|s| s.stopped.clone())
    }

    pub fn proxied(&self) -> Vec<ProxiedConnection> {
        self.inspect(|s| s.proxied.clone())
    }

    /// Removes and returns the recorded connections (long runs keep memory flat).
    pub fn take_proxied(&self) -> Vec<ProxiedConnection> {
        self.shared.update(|s| std::mem::take(&mut s.proxied))
    }

    pub fn dns_queries(&self) -> Vec<DnsQuery> {
        self.inspect(|s| s.dns_queries.clone())
    }

    /// Removes and returns the recorded DNS queries (long runs keep memory
    /// flat).
    pub fn take_dns_queries(&self) -> Vec<DnsQuery> {
        self.shared.update(|s| std::mem::take(&mut s.dns_queries))
    }

    /// Starts or stops NACKing the Add of `uid`. Takes effect for the next
    /// Add or pending retry.
    pub fn set_nack(&self, uid: &str, nack: bool) {
        let mut uids = self
            .shared
            .nack_uids
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if nack {
            uids.insert(uid.to_owned());
        } else {
            uids.remove(uid);
        }
    }

    /// A receiver that changes after every state change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// Waits until `predicate` holds on the state, re-checking after each
    /// change.
    pub async fn wait_until(
        &self,
        mut predicate: impl FnMut(&ZtunnelState) -> bool,
        timeout: Duration,
    ) -> Result<(), WaitTimeout> {
        let mut changes = self.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Mark the version seen before checking, so a change made after
            // the check wakes the wait below.
            changes.borrow_and_update();
            if predicate(&self.shared.lock()) {
                return Ok(());
            }
            // The sender lives in `self.shared`, so `changed` cannot fail.
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(WaitTimeout {
                    waited: timeout,
                    state: Box::new(self.state()),
                });
            }
        }
    }

    /// Closes the current ZDS connection, as if it broke. With
    /// [`connect_with_retry`](Self::connect_with_retry) ztunnel reconnects at
    /// once; with [`connect`](Self::connect) the client stops.
    pub fn disconnect(&self) {
        let _ = self.commands.send(Command::Disconnect);
    }

    /// Stops the client and every pod's proxies, and waits until listeners
    /// and netns fds are closed.
    pub async fn shutdown(mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

impl Drop for ZtunnelDouble {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
