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
//! and SO_REUSEPORT. Given an upstream ([`ZtunnelConfig::dns_upstream`]),
//! it forwards every query there as ztunnel forwards what its registry lacks
//! (`dns_upstream.rs`) and relays the answer, or SERVFAIL. Without one it
//! answers queries itself: A with
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
mod dns_upstream;
mod proxy;
mod proxy_host;
mod reconnect;
mod sockets;
mod state;
mod wire;

use std::{
    collections::{BTreeMap, HashSet},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::sync::{mpsc, watch};
use tokio_seqpacket::UnixSeqpacket;

use dns_server::DnsAnswers;
pub use dns_server::serve_resolver_udp;
pub use proxy_host::serve_proxy_process;
pub use state::{
    ConnectionOutcome, DnsQuery, DnsTransport, ProxiedConnection, WaitTimeout, Workload,
    ZdsConnection, ZdsEvent, ZtunnelState,
};

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
    /// How long a new pod's proxy takes to start: its listeners are bound,
    /// and its Add acked, only this long after the Add arrives (ztunnel acks
    /// once the proxy is built, which takes longer under load). Adds are
    /// handled one at a time, as ztunnel's are, so a burst queues.
    pub proxy_start_delay: Duration,
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
    /// Where the DNS proxy forwards queries (ztunnel: the resolvers of its
    /// own `/etc/resolv.conf`); `None`: it answers them itself.
    pub dns_upstream: Option<SocketAddr>,
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
            proxy_start_delay: Duration::ZERO,
            original_dst_delay: Duration::ZERO,
            pending_retry_interval: Duration::from_secs(5),
            dns_answer_v4: DEFAULT_DNS_ANSWER_V4,
            dns_answer_v6: DEFAULT_DNS_ANSWER_V6,
            dns_upstream: None,
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

    pub fn proxy_start_delay(mut self, delay: Duration) -> Self {
        self.proxy_start_delay = delay;
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

    /// Forwards DNS queries to `upstream` and relays its answers.
    pub fn dns_upstream(mut self, upstream: SocketAddr) -> Self {
        self.dns_upstream = Some(upstream);
        self
    }

    /// Runs the in-pod proxies in a child process of `binary`
    /// (`ztunnel-proxies`).
    pub fn proxy_process(mut self, binary: impl Into<PathBuf>) -> Self {
        self.proxy_process = Some(binary.into());
        self
    }
}

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
        // Taking is reading: it must not wake subscribers (the double's
        // printer, which takes on every change, would spin).
        std::mem::take(&mut self.shared.lock().proxied)
    }

    pub fn dns_queries(&self) -> Vec<DnsQuery> {
        self.inspect(|s| s.dns_queries.clone())
    }

    /// Removes and returns the recorded DNS queries (long runs keep memory
    /// flat).
    pub fn take_dns_queries(&self) -> Vec<DnsQuery> {
        std::mem::take(&mut self.shared.lock().dns_queries)
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
