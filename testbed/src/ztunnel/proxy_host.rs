//! Where a double's in-pod proxies run: in the double's own process, or in a
//! child process (`ztunnel-proxies`) that the ZDS client drives.
//!
//! ztunnel's proxies live in ztunnel's process, with its own descriptor
//! limit. A test harness that runs the agent's pods, their connections and
//! two ztunnels (a takeover) in one process needs about 17 descriptors per
//! ambient pod and 7 more per pod during a takeover, so at a thousand pods
//! it meets RLIMIT_NOFILE, which ztunnel never would. With
//! [`ZtunnelConfig::proxy_process`] each double gets a child of its own: the
//! ZDS client, the pods' state and the netns fds stay in the double; the
//! listeners, DNS sockets, per-pod threads and proxied
//! connections move to the child, which reports every record back.
//!
//! The child speaks JSON lines over stdin and stdout. It opens a pod's netns
//! through `/proc/<double's pid>/fd/<n>` (the double keeps that fd open for
//! the pod's life), which needs no descriptor passing.
//!
//! [`ZtunnelConfig::proxy_process`]: super::ZtunnelConfig::proxy_process

use std::{
    collections::HashMap,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    process::{Child, Command},
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

use super::{
    DnsQuery, ProxiedConnection, Shared, ZtunnelConfig, dns_server::DnsAnswers, proxy::PodProxies,
};

/// From the double to its proxy process.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum HostRequest {
    /// Start `uid`'s proxies in the netns at `netns` (a `/proc/.../fd/...`
    /// path into the double's descriptors).
    Start {
        id: u64,
        uid: String,
        netns: PathBuf,
    },
    /// Stop `uid`'s proxies, closing their connections.
    Stop { id: u64, uid: String },
}

/// From the proxy process to the double.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum HostReply {
    /// The answer to request `id`: `error` if it failed.
    Done {
        id: u64,
        error: Option<String>,
    },
    Proxied(ProxiedConnection),
    Dns(DnsQuery),
    DnsRejected {
        count: u64,
    },
}

/// Requests sent and not answered yet, by id.
type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<(), String>>>>>;

/// A pod's running proxies, wherever they run.
pub(super) enum RunningProxies {
    Here(PodProxies),
    Child(ChildProxies),
}

impl RunningProxies {
    /// Closes the listeners (aborting their connections) and waits for it.
    pub(super) async fn stop(self) {
        match self {
            Self::Here(proxies) => proxies.stop().await,
            Self::Child(proxies) => proxies.stop().await,
        }
    }
}

/// One pod's proxies in the child; dropping it stops them there (without
/// waiting).
pub(super) struct ChildProxies {
    uid: String,
    host: Arc<ProxyProcess>,
    stopped: bool,
}

impl ChildProxies {
    async fn stop(mut self) {
        self.stopped = true;
        // A dead process has stopped them already.
        if let Ok(done) = self.send_stop() {
            let _ = done.await;
        }
    }

    fn send_stop(&self) -> Result<oneshot::Receiver<Result<(), String>>, String> {
        self.host.request(|id| HostRequest::Stop {
            id,
            uid: self.uid.clone(),
        })
    }
}

impl Drop for ChildProxies {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.send_stop();
        }
    }
}

/// A running `ztunnel-proxies` child. Dropping the last handle kills it.
pub(super) struct ProxyProcess {
    requests: mpsc::UnboundedSender<String>,
    waiting: Waiters,
    next_id: AtomicU64,
    /// Set once its stdout has closed (it exited).
    exited: Arc<AtomicBool>,
    _child: Child,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl ProxyProcess {
    /// Starts `binary` with the double's DNS answers and its delay before
    /// asking an original destination (`shared`'s); its records go into
    /// `shared`.
    pub(super) fn spawn(
        binary: &Path,
        answers: DnsAnswers,
        shared: Arc<Shared>,
    ) -> io::Result<Arc<Self>> {
        let mut child = Command::new(binary);
        child
            .arg("--dns-answer-v4")
            .arg(answers.v4.to_string())
            .arg("--dns-answer-v6")
            .arg(answers.v6.to_string())
            .arg("--original-dst-delay-ms")
            .arg(shared.original_dst_delay.as_millis().to_string());
        if let Some(upstream) = answers.upstream {
            child.arg("--dns-upstream").arg(upstream.to_string());
        }
        let mut child = child
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("starting {}: {e}", binary.display())))?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(io::Error::other("the proxy process has no stdin or stdout"));
        };
        let (requests, mut request_rx) = mpsc::unbounded_channel::<String>();
        let writer = tokio::spawn(async move {
            while let Some(line) = request_rx.recv().await {
                if stdin.write_all(line.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
        let waiting: Waiters = Arc::default();
        let exited = Arc::new(AtomicBool::new(false));
        let reader = tokio::spawn(read_replies(
            stdout,
            shared,
            waiting.clone(),
            exited.clone(),
        ));
        Ok(Arc::new(Self {
            requests,
            waiting,
            next_id: AtomicU64::new(1),
            exited,
            _child: child,
            tasks: [writer, reader],
        }))
    }

    /// Starts `uid`'s proxies in the child, in `netns` (which must stay open
    /// while they run).
    pub(super) async fn start(
        self: &Arc<Self>,
        uid: &str,
        netns: BorrowedFd<'_>,
    ) -> Result<ChildProxies, String> {
        let path = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            netns.as_raw_fd()
        ));
        let done = self.request(|id| HostRequest::Start {
            id,
            uid: uid.to_owned(),
            netns: path,
        })?;
        done.await
            .map_err(|_| "the proxy process exited".to_owned())??;
        Ok(ChildProxies {
            uid: uid.to_owned(),
            host: self.clone(),
            stopped: false,
        })
    }

    /// Whether it still runs (a double replaces a dead one on the next
    /// start; the pods it served have lost their proxies, as with a crashed
    /// ztunnel).
    pub(super) fn is_running(&self) -> bool {
        !self.exited.load(Ordering::Relaxed)
    }

    /// Sends a request; its reply arrives on the receiver.
    fn request(
        &self,
        request: impl FnOnce(u64) -> HostRequest,
    ) -> Result<oneshot::Receiver<Result<(), String>>, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut line = serde_json::to_string(&request(id)).map_err(|e| e.to_string())?;
        line.push('\n');
        let (reply, done) = oneshot::channel();
        lock(&self.waiting).insert(id, reply);
        if self.requests.send(line).is_err() {
            lock(&self.waiting).remove(&id);
            return Err("the proxy process exited".to_owned());
        }
        Ok(done)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Hands each reply to its waiter and each record to the double's state;
/// at the end (the child exited) every waiter learns it by its sender being
/// dropped.
async fn read_replies(
    stdout: tokio::process::ChildStdout,
    shared: Arc<Shared>,
    waiting: Waiters,
    exited: Arc<AtomicBool>,
) {
    let mut lines = BufReader::new(stdout).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<HostReply>(&line) {
            Ok(HostReply::Done { id, error }) => {
                if let Some(waiter) = lock(&waiting).remove(&id) {
                    let _ = waiter.send(error.map_or(Ok(()), Err));
                }
            }
            Ok(HostReply::Proxied(connection)) => shared.record_connection(connection),
            Ok(HostReply::Dns(query)) => shared.record_dns(query),
            Ok(HostReply::DnsRejected { count }) => {
                shared.update(|state| state.dns_rejected += count);
            }
            Err(e) => {
                eprintln!("ztunnel double: unreadable line from its proxy process: {e}: {line}")
            }
        }
    }
    exited.store(true, Ordering::Relaxed);
    lock(&waiting).clear();
}

/// The child's side (`ztunnel-proxies`): serves requests from stdin until
/// it closes, then stops every pod's proxies.
pub async fn serve_proxy_process(config: ZtunnelConfig) -> io::Result<()> {
    let shared = Arc::new(Shared::new(Default::default(), config.original_dst_delay));
    let answers = DnsAnswers::of(&config);
    let (replies, mut reply_rx) = mpsc::unbounded_channel::<HostReply>();
    let writer = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        while let Some(reply) = reply_rx.recv().await {
            let Ok(mut line) = serde_json::to_string(&reply) else {
                continue;
            };
            line.push('\n');
            if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
                return;
            }
        }
    });
    let forwarder = tokio::spawn(forward_records(shared.clone(), replies.clone()));
    let mut pods: HashMap<String, PodProxies> = HashMap::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let request: HostRequest = serde_json::from_str(&line)
            .map_err(|e| io::Error::other(format!("unreadable request `{line}`: {e}")))?;
        let (id, result) = match request {
            HostRequest::Start { id, uid, netns } => {
                if let Some(old) = pods.remove(&uid) {
                    old.stop().await;
                }
                let started = match open_netns(&netns) {
                    Ok(fd) => PodProxies::start(&uid, fd.as_fd(), shared.clone(), answers)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e),
                };
                (id, started.map(|proxies| drop(pods.insert(uid, proxies))))
            }
            HostRequest::Stop { id, uid } => {
                if let Some(proxies) = pods.remove(&uid) {
                    proxies.stop().await;
                }
                (id, Ok(()))
            }
        };
        let _ = replies.send(HostReply::Done {
            id,
            error: result.err(),
        });
    }
    for (_, proxies) in pods.drain() {
        proxies.stop().await;
    }
    forwarder.abort();
    drop(replies);
    let _ = writer.await;
    Ok(())
}

/// Opens the double's netns fd through /proc.
fn open_netns(path: &Path) -> Result<OwnedFd, String> {
    std::fs::File::open(path)
        .map(OwnedFd::from)
        .map_err(|e| format!("opening the pod's netns {}: {e}", path.display()))
}

/// Sends every record the proxies make to the double, as they are made.
async fn forward_records(shared: Arc<Shared>, replies: mpsc::UnboundedSender<HostReply>) {
    let mut changes = shared.changes.subscribe();
    let mut rejected_sent = 0;
    loop {
        let (proxied, queries, rejected) = {
            let mut state = shared.lock();
            (
                std::mem::take(&mut state.proxied),
                std::mem::take(&mut state.dns_queries),
                state.dns_rejected,
            )
        };
        let sent = proxied
            .into_iter()
            .map(HostReply::Proxied)
            .chain(queries.into_iter().map(HostReply::Dns))
            .chain((rejected > rejected_sent).then(|| HostReply::DnsRejected {
                count: rejected - rejected_sent,
            }))
            .all(|reply| replies.send(reply).is_ok());
        rejected_sent = rejected;
        if !sent || changes.changed().await.is_err() {
            return;
        }
    }
}
