//! One ztunnel connection: hello, the snapshot, then live updates.
//!
//! The connection keeps what it has told ztunnel (`sent`) and reconciles it
//! against the desired pods whenever they change, it becomes the newest
//! connection, or a NACKed pod is due for retry. So a burst of changes is
//! coalesced, a takeover (the newest connection dropping) brings the older
//! one up to date, and nothing depends on a change being seen exactly once.
//!
//! Every Add's outcome is recorded in the shared ztunnel statuses (acked,
//! or refused by a NACK or because it could not be sent).
//!
//! Failures and what they cost:
//! - a NACK: logged and counted; the pod is retried with backoff;
//! - a pod whose netns cannot be opened: sent as Keep during the snapshot (so
//!   ztunnel keeps its proxy, as Istio does; it gets a Del when it goes, like
//!   a pod Added), retried later otherwise;
//! - no Ack in time, undecodable bytes, unsolicited messages, or the peer
//!   going away: the connection is closed; ztunnel reconnects and gets the
//!   full snapshot again. The desired pods are never touched.

use std::{
    collections::{HashMap, HashSet},
    os::fd::AsFd,
    time::Duration,
};

use ambpf_proto::{MAX_MESSAGE_LEN, Message as _, ZTUNNEL_READ_BUFFER, zds};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_seqpacket::{UnixSeqpacket, ancillary::AncillaryMessageWriter};
use tracing::{Instrument as _, debug, info, warn};

use super::{NetnsSource, Shared, Workload, WorkloadSet, ZdsStats};

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("no hello within {0:?}")]
    HelloTimeout(Duration),
    #[error("unsupported ZDS version {0} in hello")]
    UnsupportedVersion(i32),
    #[error("no ack for {request} within {after:?}")]
    AckTimeout { request: String, after: Duration },
    #[error("undecodable {what} from ztunnel: {cause}")]
    Garbage {
        what: &'static str,
        cause: ambpf_proto::prost::DecodeError,
    },
    #[error("ztunnel sent a {0}-byte message while no request was pending")]
    Unsolicited(usize),
    #[error("ztunnel sent an oversized or truncated message")]
    Truncated,
    #[error("ztunnel closed the connection {0}")]
    ClosedDuring(&'static str),
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
}

/// What this connection has told ztunnel about one pod: which namespace,
/// by the path it was opened through and by inode (its identity: the CNI's
/// `/run/netns/...` and a process's `/proc/<pid>/ns/net` may name the same).
struct Sent {
    netns: NetnsSource,
    inode: u64,
}

impl Sent {
    /// Whether `workload`'s namespace is the one already sent: by the inode
    /// the agent enrolled when it says (a sandbox re-created at the same path
    /// is another namespace), else by path. A new path is opened once to
    /// compare inodes, and remembered when it names the same one, so ztunnel
    /// gets no second Add for a pod whose path changed.
    fn is(&mut self, workload: &Workload) -> bool {
        let netns = &workload.netns;
        if let Some(inode) = workload.netns_inode {
            if inode == self.inode {
                self.netns = netns.clone();
            }
            return inode == self.inode;
        }
        if self.netns == *netns {
            return true;
        }
        match netns.open() {
            Ok((_, inode)) if inode == self.inode => {
                self.netns = netns.clone();
                true
            }
            _ => false,
        }
    }
}

/// A pod whose last Add failed, and when to try again.
struct Retry {
    at: Instant,
    delay: Duration,
}

struct Connection<'a> {
    id: u64,
    socket: &'a UnixSeqpacket,
    shared: &'a Shared,
    sent: HashMap<String, Sent>,
    /// Pods sent as Keep (ztunnel keeps what it had), not yet Added: they
    /// get a Del when they go, as sent ones do.
    kept: HashSet<String>,
    retries: HashMap<String, Retry>,
}

pub(super) async fn serve(
    id: u64,
    socket: &UnixSeqpacket,
    shared: &Shared,
) -> Result<(), ConnError> {
    let mut conn = Connection {
        id,
        socket,
        shared,
        sent: HashMap::new(),
        kept: HashSet::new(),
        retries: HashMap::new(),
    };
    match conn.run().await {
        // The peer going away while idle is the normal end of a connection.
        Err(ConnError::ClosedDuring("while idle")) => Ok(()),
        other => other,
    }
}

enum Outcome {
    Acked,
    Nacked(String),
}

impl Connection<'_> {
    async fn run(&mut self) -> Result<(), ConnError> {
        self.hello().await?;
        let mut desired = self.shared.desired.subscribe();
        let mut newest = self.shared.newest.subscribe();
        let snapshot = desired.borrow_and_update().clone();
        newest.borrow_and_update();
        self.snapshot(&snapshot).await?;

        loop {
            let snapshot = desired.borrow_and_update().clone();
            let is_newest = *newest.borrow_and_update() == self.id;
            self.reconcile(&snapshot, is_newest).await?;

            let next_retry = self.retries.values().map(|r| r.at).min();
            let mut idle = [0u8; ZTUNNEL_READ_BUFFER];
            tokio::select! {
                changed = desired.changed() => if changed.is_err() { return Ok(()) },
                changed = newest.changed() => if changed.is_err() { return Ok(()) },
                () = sleep_until(next_retry.unwrap_or_else(far_future)), if next_retry.is_some() => {}
                read = self.socket.recv(&mut idle) => {
                    let info = read?;
                    if info.bytes_read() == 0 {
                        return Err(ConnError::ClosedDuring("while idle"));
                    }
                    return Err(ConnError::Unsolicited(info.bytes_read()));
                }
            }
        }
    }

    async fn hello(&mut self) -> Result<(), ConnError> {
        let after = self.shared.config.hello_timeout;
        let mut buf = [0u8; ZTUNNEL_READ_BUFFER];
        let len = timeout(after, self.recv(&mut buf, "before hello"))
            .await
            .map_err(|_| ConnError::HelloTimeout(after))??;
        let hello = zds::ZdsHello::decode(&buf[..len]).map_err(|source| ConnError::Garbage {
            what: "hello",
            cause: source,
        })?;
        if hello.version != zds::Version::V1 as i32 {
            return Err(ConnError::UnsupportedVersion(hello.version));
        }
        debug!("ZDS connection {}: hello (V1)", self.id);
        Ok(())
    }

    /// One Add (or Keep) per pod, each acked, then SnapshotSent.
    async fn snapshot(&mut self, snapshot: &WorkloadSet) -> Result<(), ConnError> {
        let started = std::time::Instant::now();
        for workload in snapshot.values() {
            // A namespace not enrolled is kept as ztunnel has it, as one that
            // cannot be opened is.
            let opened = self.open_for_add(workload).and_then(|opened| {
                opened
                    .ok_or_else(|| std::io::Error::other("its path names a namespace not enrolled"))
            });
            match opened {
                Ok((netns, inode)) => self.add(workload, netns, inode).await?,
                Err(e) => {
                    self.pod_span(workload).in_scope(|| {
                        warn!(
                            "ZDS: cannot open the netns of pod {}/{} ({e}); sending Keep so ztunnel keeps its proxy",
                            workload.namespace, workload.name
                        )
                    });
                    ZdsStats::bump(&self.shared.stats.keeps_sent);
                    match self
                        .request(&zds::WorkloadRequest::keep(&workload.uid), None)
                        .await?
                    {
                        Outcome::Acked => {
                            self.kept.insert(workload.uid.clone());
                        }
                        Outcome::Nacked(why) => {
                            self.nacked(workload, &why);
                            self.shared.ztunnel_answered(&workload.uid, None, Err(why));
                        }
                    }
                    // Not "sent" with a netns: once it can be opened, Add it.
                    self.schedule_retry(&workload.uid);
                }
            }
        }
        if let Outcome::Nacked(why) = self
            .request(&zds::WorkloadRequest::snapshot_sent(), None)
            .await?
        {
            ZdsStats::bump(&self.shared.stats.nacks);
            warn!("ZDS connection {}: SnapshotSent NACKed: {why}", self.id);
        }
        self.shared.snapshot_acked();
        info!(
            "ZDS connection {}: snapshot of {} pods acked in {:?}",
            self.id,
            snapshot.len(),
            started.elapsed()
        );
        Ok(())
    }

    /// Brings ztunnel in line with `desired`: Dels for pods gone (every
    /// connection), Adds for pods new or moved (the newest connection only).
    async fn reconcile(&mut self, desired: &WorkloadSet, is_newest: bool) -> Result<(), ConnError> {
        let gone: HashSet<String> = self
            .sent
            .keys()
            .chain(&self.kept)
            .filter(|uid| !desired.contains_key(*uid))
            .cloned()
            .collect();
        for uid in gone {
            let span =
                tracing::info_span!("zds_del", uid = %uid, netns_cookie = tracing::field::Empty);
            if let Some(cookie) = self.shared.netns_cookie(&uid) {
                span.record("netns_cookie", cookie);
            }
            let outcome = self
                .request(&zds::WorkloadRequest::del(&uid), None)
                .instrument(span.clone())
                .await?;
            match outcome {
                Outcome::Acked => ZdsStats::bump(&self.shared.stats.dels_acked),
                Outcome::Nacked(why) => {
                    ZdsStats::bump(&self.shared.stats.nacks);
                    span.in_scope(|| {
                        warn!("ZDS connection {}: Del of {uid} NACKed: {why}", self.id)
                    });
                }
            }
            self.sent.remove(&uid);
            self.kept.remove(&uid);
        }
        self.retries.retain(|uid, _| desired.contains_key(uid));
        if !is_newest {
            return Ok(());
        }
        let now = Instant::now();
        for workload in desired.values() {
            let current = self
                .sent
                .get_mut(&workload.uid)
                .is_some_and(|sent| sent.is(workload));
            let waiting = self.retries.get(&workload.uid).is_some_and(|r| r.at > now);
            if current || waiting {
                continue;
            }
            match self.open_for_add(workload) {
                Ok(Some((netns, inode))) => self.add(workload, netns, inode).await?,
                Ok(None) => {}
                Err(e) => {
                    ZdsStats::bump(&self.shared.stats.send_failures);
                    self.pod_span(workload).in_scope(|| {
                        warn!(
                            "ZDS: cannot open the netns of pod {}/{}: {e}",
                            workload.namespace, workload.name
                        )
                    });
                    self.shared.not_sent(&workload.uid, e.to_string());
                    self.schedule_retry(&workload.uid);
                }
            }
        }
        Ok(())
    }

    /// The span of a request about `workload`.
    fn pod_span(&self, workload: &Workload) -> tracing::Span {
        let cookie = self.shared.netns_cookie(&workload.uid);
        let span = crate::pod_span!("zds_add", workload.namespace, workload.name, workload.uid);
        if let Some(cookie) = cookie {
            span.record("netns_cookie", cookie);
        }
        span
    }

    /// Opens the pod's namespace for an Add. `None` (recorded as not sent,
    /// and retried) when its path names another namespace than the one
    /// enrolled, a sandbox re-created meanwhile: ztunnel is never sent a
    /// namespace the redirection is not in place for; the controller enrols
    /// the new one, and its Add follows.
    fn open_for_add(
        &mut self,
        workload: &Workload,
    ) -> std::io::Result<Option<(std::fs::File, u64)>> {
        let (netns, inode) = workload.netns.open()?;
        match workload.netns_inode {
            Some(enrolled) if enrolled != inode => {
                let why = format!(
                    "{} is namespace {inode}, not the one enrolled ({enrolled})",
                    workload.netns.path().display()
                );
                self.shared.not_sent(&workload.uid, why);
                self.schedule_retry(&workload.uid);
                Ok(None)
            }
            _ => Ok(Some((netns, inode))),
        }
    }

    /// Sends an Add with the pod's netns fd and records the result.
    async fn add(
        &mut self,
        workload: &Workload,
        netns: std::fs::File,
        inode: u64,
    ) -> Result<(), ConnError> {
        let span = self.pod_span(workload);
        self.add_in_span(workload, netns, inode)
            .instrument(span)
            .await
    }

    async fn add_in_span(
        &mut self,
        workload: &Workload,
        netns: std::fs::File,
        inode: u64,
    ) -> Result<(), ConnError> {
        let request = zds::WorkloadRequest::add(&workload.uid, workload.info());
        if request.encoded_len() > MAX_MESSAGE_LEN {
            ZdsStats::bump(&self.shared.stats.send_failures);
            warn!(
                "ZDS: pod {}/{} does not fit a {MAX_MESSAGE_LEN}-byte ZDS message; not sent",
                workload.namespace, workload.name
            );
            self.shared.not_sent(
                &workload.uid,
                format!("it does not fit a {MAX_MESSAGE_LEN}-byte ZDS message"),
            );
            return Ok(());
        }
        let outcome = self.request(&request, Some(&netns)).await?;
        // `netns` is dropped (closed) here: ztunnel holds its own copy now.
        drop(netns);
        match outcome {
            Outcome::Acked => {
                ZdsStats::bump(&self.shared.stats.adds_acked);
                self.retries.remove(&workload.uid);
                self.kept.remove(&workload.uid);
                self.sent.insert(
                    workload.uid.clone(),
                    Sent {
                        netns: workload.netns.clone(),
                        inode,
                    },
                );
                self.shared
                    .ztunnel_answered(&workload.uid, Some(inode), Ok(()));
            }
            Outcome::Nacked(why) => {
                self.nacked(workload, &why);
                self.shared
                    .ztunnel_answered(&workload.uid, Some(inode), Err(why));
                self.schedule_retry(&workload.uid);
            }
        }
        Ok(())
    }

    fn nacked(&self, workload: &Workload, why: &str) {
        ZdsStats::bump(&self.shared.stats.nacks);
        warn!(
            "ZDS connection {}: ztunnel NACKed pod {}/{} ({}): {why}",
            self.id, workload.namespace, workload.name, workload.uid
        );
    }

    fn schedule_retry(&mut self, uid: &str) {
        let config = &self.shared.config;
        let delay = match self.retries.get(uid) {
            Some(previous) => (previous.delay * 2).min(config.max_retry_delay),
            None => config.retry_delay,
        };
        self.retries.insert(
            uid.to_owned(),
            Retry {
                at: Instant::now() + delay,
                delay,
            },
        );
    }

    /// Sends one request (with at most one fd) and waits for its Ack.
    async fn request(
        &mut self,
        request: &zds::WorkloadRequest,
        fd: Option<&std::fs::File>,
    ) -> Result<Outcome, ConnError> {
        let bytes = request.encode_to_vec();
        match fd {
            Some(fd) => {
                let mut control = [0u8; 64];
                let fds = [fd.as_fd()];
                let mut ancillary = AncillaryMessageWriter::new(&mut control);
                ancillary
                    .add_fds(&fds)
                    .map_err(|_| std::io::Error::other("control buffer too small for one fd"))?;
                self.socket
                    .send_with_ancillary(&bytes, &mut ancillary)
                    .await?;
            }
            None => {
                self.socket.send(&bytes).await?;
            }
        }
        let sent = std::time::Instant::now();
        let after = self.shared.config.ack_timeout;
        let mut buf = [0u8; ZTUNNEL_READ_BUFFER];
        let len = match timeout(after, self.recv(&mut buf, "awaiting an ack")).await {
            Ok(read) => read?,
            Err(_) => {
                ZdsStats::bump(&self.shared.stats.ack_timeouts);
                return Err(ConnError::AckTimeout {
                    request: describe(request),
                    after,
                });
            }
        };
        crate::metrics::histograms().observe_zds_ack(message_name(request), sent.elapsed());
        let response =
            zds::WorkloadResponse::decode(&buf[..len]).map_err(|source| ConnError::Garbage {
                what: "response",
                cause: source,
            })?;
        Ok(match response.into_result() {
            Ok(()) => Outcome::Acked,
            Err(why) => Outcome::Nacked(why),
        })
    }

    /// Receives one message; a zero-length read is the peer closing.
    async fn recv(&self, buf: &mut [u8], during: &'static str) -> Result<usize, ConnError> {
        let info = self.socket.recv(buf).await?;
        if info.truncated() {
            return Err(ConnError::Truncated);
        }
        if info.bytes_read() == 0 {
            return Err(ConnError::ClosedDuring(during));
        }
        Ok(info.bytes_read())
    }
}

/// The `message` label of a request's ack time.
fn message_name(request: &zds::WorkloadRequest) -> &'static str {
    use zds::workload_request::Payload;
    match &request.payload {
        Some(Payload::Add(_)) => "add",
        Some(Payload::Del(_)) => "del",
        Some(Payload::Keep(_)) => "keep",
        Some(Payload::SnapshotSent(_)) => "snapshot_sent",
        None => "empty",
    }
}

fn describe(request: &zds::WorkloadRequest) -> String {
    use zds::workload_request::Payload;
    match &request.payload {
        Some(Payload::Add(add)) => format!("Add {}", add.uid),
        Some(Payload::Del(del)) => format!("Del {}", del.uid),
        Some(Payload::Keep(keep)) => format!("Keep {}", keep.uid),
        Some(Payload::SnapshotSent(_)) => "SnapshotSent".to_owned(),
        None => "an empty request".to_owned(),
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}
