//! A low-level ZDS peer and a server harness for the ZDS tests.
//!
//! `Peer` is a deliberately minimal ZDS client so that each test controls
//! exactly what ztunnel says (acks, NACKs, garbage, silence, hang-ups).

#![allow(dead_code)] // each test binary uses a different subset

pub mod agent;

pub use std::{
    os::{fd::OwnedFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
    time::Duration,
};

pub use ambpf::zds::{NetnsSource, Workload, ZdsConfig, ZdsHandle, ZdsStats};
pub use ambpf_proto::{
    Message as _, ZTUNNEL_READ_BUFFER,
    zds::{self, workload_request::Payload},
};
pub use ambpf_testbed::NetnsGuard;
pub use tokio::time::timeout;
use tokio_seqpacket::{UnixSeqpacket, ancillary::OwnedAncillaryMessage};

/// Generous bound for anything the server must do promptly; the tests never
/// assert how fast, only that it happens.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// The agent's ZDS server on a socket in a temp dir of its own; the dir also
/// holds any other socket a test puts next to it (`dir`).
pub struct Server {
    pub handle: ZdsHandle,
    task: tokio::task::JoinHandle<()>,
    dir: agent::TempDir,
}

impl Server {
    /// Serves `config` with its socket replaced by this server's.
    pub fn start(config: ZdsConfig) -> Self {
        let dir = agent::TempDir(
            std::env::temp_dir().join(format!("ambpf-zds-test-{}", ambpf_testbed::unique_name(""))),
        );
        let socket = dir.0.join("ztunnel.sock");
        let handle = ZdsHandle::new(ZdsConfig {
            socket: socket.clone(),
            ..config
        });
        let listener = ambpf::zds::listener::bind(&socket).unwrap();
        let task = tokio::spawn(handle.clone().serve_on(listener));
        Self { handle, task, dir }
    }

    pub fn socket(&self) -> PathBuf {
        self.handle.config().socket.clone()
    }

    /// As the agent does in eBPF mode: the ZDS peers' processes recorded as
    /// ztunnel's under `pins`, before anything is sent to them.
    pub fn record_ztunnel_processes(&self, pins: ambpf::bpf::PinLayout) {
        let (recorder, _prune) = ambpf::bpf::ztunnel_procs::recorder(pins);
        self.handle.record_peers_with(recorder);
    }

    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    /// Stops accepting connections, keeping the dir, for a test that must
    /// stop the server before something else it drops.
    pub fn stop(&self) {
        self.task.abort();
    }

    pub fn stat<S: ambpf::zds::StatValue>(&self, counter: impl Fn(&ZdsStats) -> &S) -> u64 {
        ZdsStats::get(counter(self.handle.stats()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The dir goes after this, with the socket no task serves any more.
        self.task.abort();
    }
}

pub fn fast_config() -> ZdsConfig {
    ZdsConfig {
        ack_timeout: Duration::from_secs(5),
        retry_delay: Duration::from_millis(50),
        ..Default::default()
    }
}

/// A ZDS client that does only what the test tells it.
pub struct Peer {
    socket: UnixSeqpacket,
}

pub struct Request {
    pub payload: Payload,
    pub fds: Vec<OwnedFd>,
}

impl Request {
    pub fn uid(&self) -> &str {
        match &self.payload {
            Payload::Add(add) => &add.uid,
            Payload::Del(del) => &del.uid,
            Payload::Keep(keep) => &keep.uid,
            Payload::SnapshotSent(_) => "",
        }
    }

    pub fn kind(&self) -> &'static str {
        match &self.payload {
            Payload::Add(_) => "add",
            Payload::Del(_) => "del",
            Payload::Keep(_) => "keep",
            Payload::SnapshotSent(_) => "snapshot_sent",
        }
    }

    pub fn netns_inode(&self) -> u64 {
        assert_eq!(self.fds.len(), 1, "an Add carries exactly one fd");
        std::fs::File::from(self.fds[0].try_clone().unwrap())
            .metadata()
            .unwrap()
            .ino()
    }
}

impl Peer {
    pub async fn connect(path: &Path) -> Self {
        Self {
            socket: UnixSeqpacket::connect(path).await.unwrap(),
        }
    }

    pub async fn hello(path: &Path) -> Self {
        let peer = Self::connect(path).await;
        peer.send(&zds::ZdsHello::v1().encode_to_vec()).await;
        peer
    }

    pub async fn send(&self, bytes: &[u8]) {
        self.try_send(bytes).await.unwrap();
    }

    /// Sends one message; fails once the server has closed the connection.
    pub async fn try_send(&self, bytes: &[u8]) -> std::io::Result<usize> {
        self.socket.send(bytes).await
    }

    pub async fn ack(&self) {
        self.send(&zds::WorkloadResponse::ack("").encode_to_vec())
            .await;
    }

    pub async fn nack(&self, why: &str) {
        self.send(&zds::WorkloadResponse::ack(why).encode_to_vec())
            .await;
    }

    /// The next request, read as ztunnel reads it: into 1 KiB, no truncation.
    pub async fn recv(&self) -> Option<Request> {
        let mut buf = [0u8; ZTUNNEL_READ_BUFFER];
        let mut control = [0u8; 256];
        let (info, ancillary) = timeout(
            PATIENCE,
            self.socket.recv_with_ancillary(&mut buf, &mut control),
        )
        .await
        .expect("no request from the server")
        .unwrap();
        assert!(
            !info.truncated() && !info.ancillary_truncated(),
            "message exceeds ztunnel's buffer"
        );
        if info.bytes_read() == 0 {
            return None; // server closed the connection
        }
        let mut fds = Vec::new();
        for message in ancillary.into_messages() {
            if let OwnedAncillaryMessage::FileDescriptors(received) = message {
                fds.extend(received);
            }
        }
        let request = zds::WorkloadRequest::decode(&buf[..info.bytes_read()]).unwrap();
        Some(Request {
            payload: request.payload.expect("empty request"),
            fds,
        })
    }

    pub async fn recv_some(&self) -> Request {
        self.recv().await.expect("server closed the connection")
    }

    /// Acks everything up to and including SnapshotSent; returns the requests.
    pub async fn take_snapshot(&self) -> Vec<Request> {
        let mut requests = Vec::new();
        loop {
            let request = self.recv_some().await;
            self.ack().await;
            if matches!(request.payload, Payload::SnapshotSent(_)) {
                return requests;
            }
            requests.push(request);
        }
    }

    /// True if the server sends nothing for a while (used only to check that
    /// a request went to another connection).
    pub async fn stays_quiet(&self) -> bool {
        let mut buf = [0u8; ZTUNNEL_READ_BUFFER];
        timeout(Duration::from_millis(300), self.socket.recv(&mut buf))
            .await
            .is_err()
    }
}

pub fn pod(uid: &str, netns: &NetnsGuard) -> Workload {
    Workload {
        uid: uid.to_owned(),
        name: format!("pod-{uid}"),
        namespace: "shop".to_owned(),
        service_account: "web".to_owned(),
        netns: NetnsSource::Path(netns.path()),
        netns_inode: None,
    }
}

pub fn inode(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

/// The agent's own log lines, in the test's output (shown when it fails).
pub fn init_logging() {
    let filter = ambpf::logging::filter(None).unwrap();
    ambpf::logging::init_with_writer(
        ambpf::logging::LogFormat::Text,
        filter,
        tracing_subscriber::fmt::TestWriter::new,
    );
}
