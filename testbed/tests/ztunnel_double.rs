//! The ztunnel double driven by a minimal ZDS server, as the agent's tests
//! will drive it. Privileged: creates network namespaces, veths and iptables
//! rules inside them (run as root). Every wait has a generous deadline and no
//! assertion is about timing.

use std::{
    collections::BTreeSet,
    fs::{self, File},
    io::{self, BufRead as _, BufReader},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::{
        fd::{AsFd, BorrowedFd, RawFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use ambpf_proto::{
    Message,
    zds::{
        AddWorkload, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello,
        workload_request::Payload,
    },
};
use ambpf_testbed::{
    NetnsGuard, PodAndNode, unique_name,
    ztunnel::{
        ConnectionOutcome, DEFAULT_DNS_ANSWER_V4, DEFAULT_DNS_ANSWER_V6, DNS_PORT, DnsQuery,
        DnsTransport, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, PROCESS_FAILURE,
        PROXY_START_FAILURE, READ_FAILURE, ZTUNNEL_MARK, ZdsEvent, ZtunnelConfig, ZtunnelDouble,
        ZtunnelState, dns,
    },
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpSocket, TcpStream, UdpSocket},
    sync::mpsc,
};
use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener, ancillary::AncillaryMessageWriter};

/// Deadline for anything the test waits for; never reached when things work.
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------
// A minimal ZDS server: the agent's side of the socket.

/// A listening ZDS socket in a fresh directory, removed on drop.
struct ZdsServer {
    dir: PathBuf,
    listener: UnixSeqpacketListener,
}

impl ZdsServer {
    fn bind() -> Self {
        let dir = std::env::temp_dir().join(format!("ambpf-zds-{}", unique_name("")));
        fs::create_dir(&dir).unwrap();
        let listener = UnixSeqpacketListener::bind(dir.join("ztunnel.sock")).unwrap();
        Self { dir, listener }
    }

    fn path(&self) -> PathBuf {
        self.dir.join("ztunnel.sock")
    }

    /// Accepts ztunnel's next connection and checks that its first message
    /// is `ZdsHello{V1}`.
    async fn accept(&mut self) -> ZdsPeer {
        let socket = tokio::time::timeout(WAIT, self.listener.accept())
            .await
            .expect("ztunnel did not connect")
            .unwrap();
        let mut buffer = [0u8; 1024];
        let info = tokio::time::timeout(WAIT, socket.recv(&mut buffer))
            .await
            .expect("ztunnel sent no hello")
            .unwrap();
        let hello = &buffer[..info.bytes_read()];
        assert_eq!(
            hello,
            ZdsHello::v1().encode_to_vec(),
            "the first message is the hello"
        );
        ZdsPeer { socket }
    }
}

impl Drop for ZdsServer {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// One accepted ztunnel connection.
struct ZdsPeer {
    socket: UnixSeqpacket,
}

impl ZdsPeer {
    async fn send_raw(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        let mut control = [0u8; 128];
        let mut ancillary = AncillaryMessageWriter::new(&mut control);
        if !fds.is_empty() {
            assert!(
                ancillary.add_fds(fds.iter().copied()).is_ok(),
                "control buffer too small"
            );
        }
        self.socket
            .send_with_ancillary(bytes, &mut ancillary)
            .await
            .unwrap();
    }

    /// The next response: `Ok` for an ACK, `Err(text)` for a NACK.
    async fn response(&self) -> Result<(), String> {
        let mut buffer = [0u8; 1024];
        let info = tokio::time::timeout(WAIT, self.socket.recv(&mut buffer))
            .await
            .expect("ztunnel did not respond")
            .unwrap();
        assert!(
            info.bytes_read() > 0,
            "ztunnel closed the connection instead of responding"
        );
        WorkloadResponse::decode(&buffer[..info.bytes_read()])
            .unwrap()
            .into_result()
    }

    async fn request(&self, request: &WorkloadRequest, netns: Option<&File>) -> Result<(), String> {
        let fds: Vec<BorrowedFd<'_>> = netns.iter().map(|f| f.as_fd()).collect();
        self.send_raw(&request.encode_to_vec(), &fds).await;
        self.response().await
    }

    async fn add(&self, uid: &str, netns: &File) -> Result<(), String> {
        self.request(&WorkloadRequest::add(uid, workload_info(uid)), Some(netns))
            .await
    }

    async fn keep(&self, uid: &str) -> Result<(), String> {
        self.request(&WorkloadRequest::keep(uid), None).await
    }

    async fn del(&self, uid: &str) -> Result<(), String> {
        self.request(&WorkloadRequest::del(uid), None).await
    }

    async fn snapshot_sent(&self) -> Result<(), String> {
        self.request(&WorkloadRequest::snapshot_sent(), None).await
    }

    /// ztunnel closes the connection: the next read is end-of-file.
    async fn expect_closed(&self) {
        let mut buffer = [0u8; 1024];
        let info = tokio::time::timeout(WAIT, self.socket.recv(&mut buffer))
            .await
            .expect("ztunnel kept the connection open")
            .unwrap();
        assert_eq!(info.bytes_read(), 0, "expected end-of-file, got a message");
    }
}

fn workload_info(uid: &str) -> WorkloadInfo {
    WorkloadInfo {
        name: format!("pod-{uid}"),
        namespace: "default".to_owned(),
        service_account: "default".to_owned(),
    }
}

/// A throwaway pod netns and an open fd on it, as the agent would hold.
fn netns(role: &str) -> (NetnsGuard, File, u64) {
    let ns = NetnsGuard::create(role).unwrap();
    let file = File::open(ns.path()).unwrap();
    let inode = file.metadata().unwrap().ino();
    (ns, file, inode)
}

/// How many of this process's fds are open on `path` (a netns bind mount).
fn open_fds_on(path: &Path) -> usize {
    fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target == path)
        .count()
}

fn is_nack_starting_with(result: &Result<(), String>, prefix: &str) -> bool {
    matches!(result, Err(text) if text.starts_with(prefix))
}

async fn wait(double: &ZtunnelDouble, what: impl FnMut(&ZtunnelState) -> bool) {
    if let Err(timeout) = double.wait_until(what, WAIT).await {
        panic!("{timeout}");
    }
}

// ---------------------------------------------------------------------------
// ZDS

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_comes_first_and_the_double_waits_for_requests() {
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect(server.path(), ZtunnelConfig::zds_only())
        .await
        .unwrap();
    let _peer = server.accept().await;
    wait(&double, |s| s.connected).await;
    assert_eq!(double.events(), [ZdsEvent::Connected { connection: 1 }]);
    assert!(!double.is_ready(), "ready only after SnapshotSent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_with_a_netns_fd_is_acked_and_records_the_namespace_inode() {
    let (_ns, file, inode) = netns("zds");
    let mut server = ZdsServer::bind();
    let config = ZtunnelConfig::zds_only().ack_delay(Duration::from_millis(1));
    let double = ZtunnelDouble::connect(server.path(), config).await.unwrap();
    let peer = server.accept().await;

    assert_eq!(peer.add("uid-1", &file).await, Ok(()));
    let workload = double.workloads().remove("uid-1").expect("uid-1 is known");
    assert_eq!(workload.netns_inode, inode);
    assert_eq!(workload.name, "pod-uid-1");
    assert!(!workload.proxies_running, "ZDS-only mode starts no proxies");
    assert!(!double.is_ready());

    assert_eq!(peer.snapshot_sent().await, Ok(()));
    assert!(double.is_ready());
    assert_eq!(
        double.events(),
        [
            ZdsEvent::Connected { connection: 1 },
            ZdsEvent::Add {
                uid: "uid-1".to_owned(),
                name: "pod-uid-1".to_owned(),
                namespace: "default".to_owned(),
                service_account: "default".to_owned(),
                netns_inode: inode,
            },
            ZdsEvent::SnapshotSent,
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_requests_are_nacked_and_ztunnel_reconnects() {
    let (ns, file, _) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect_with_retry(server.path(), ZtunnelConfig::zds_only());
    let info = workload_info("u");

    // An Add without its netns fd.
    let peer = server.accept().await;
    let result = peer
        .request(&WorkloadRequest::add("u", info.clone()), None)
        .await;
    assert!(is_nack_starting_with(&result, READ_FAILURE), "{result:?}");
    peer.expect_closed().await;

    // An fd on a message other than Add.
    let peer = server.accept().await;
    let result = peer.request(&WorkloadRequest::del("u"), Some(&file)).await;
    assert!(is_nack_starting_with(&result, READ_FAILURE), "{result:?}");
    peer.expect_closed().await;

    // Bytes that are no WorkloadRequest.
    let peer = server.accept().await;
    peer.send_raw(&[0xff, 0xff, 0xff], &[]).await;
    let result = peer.response().await;
    assert!(is_nack_starting_with(&result, READ_FAILURE), "{result:?}");
    peer.expect_closed().await;

    // A message longer than ztunnel's 1024-byte buffer.
    let peer = server.accept().await;
    let too_long = WorkloadRequest::add(&"x".repeat(1100), info.clone());
    let result = peer.request(&too_long, Some(&file)).await;
    assert!(is_nack_starting_with(&result, READ_FAILURE), "{result:?}");
    peer.expect_closed().await;

    // Two fds: the control data does not fit ztunnel's buffer.
    let peer = server.accept().await;
    let add = WorkloadRequest::add("u", info).encode_to_vec();
    peer.send_raw(&add, &[file.as_fd(), file.as_fd()]).await;
    let result = peer.response().await;
    assert!(is_nack_starting_with(&result, READ_FAILURE), "{result:?}");
    peer.expect_closed().await;

    // After all that, a well-formed Add works.
    let peer = server.accept().await;
    assert_eq!(peer.add("u", &file).await, Ok(()));
    let state = double.state();
    assert_eq!(state.connections.len(), 6);
    assert!(state.stopped.is_none());
    let nacks = state
        .events
        .iter()
        .filter(
            |e| matches!(e, ZdsEvent::Nacked { reason, .. } if reason.starts_with(READ_FAILURE)),
        )
        .count();
    assert_eq!(nacks, 5);
    // Only this test's own fd is left open: the rejected ones were closed and
    // the accepted one is held by the double.
    assert_eq!(open_fds_on(&ns.path()), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_without_workload_info_is_a_protocol_error_that_stops_the_client() {
    let (_ns, file, _) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect_with_retry(server.path(), ZtunnelConfig::zds_only());
    let peer = server.accept().await;
    assert_eq!(peer.add("kept-running", &file).await, Ok(()));

    let no_info = WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: "u".to_owned(),
            workload_info: None,
        })),
    };
    let result = peer.request(&no_info, Some(&file)).await;
    assert!(
        is_nack_starting_with(&result, PROCESS_FAILURE),
        "{result:?}"
    );
    peer.expect_closed().await;

    wait(&double, |s| s.stopped.is_some()).await;
    let state = double.state();
    assert!(
        state.stopped.as_deref().unwrap().contains("workload_info"),
        "{:?}",
        state.stopped
    );
    assert!(
        state
            .events
            .iter()
            .any(|e| matches!(e, ZdsEvent::ProtocolError { .. })),
        "{:?}",
        state.events
    );
    // Stopped for good: no second connection, and pods are left alone.
    assert_eq!(state.connections.len(), 1);
    assert!(state.workloads.contains_key("kept-running"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_after_snapshot_and_a_second_snapshot_are_protocol_errors() {
    for second in [WorkloadRequest::keep("u"), WorkloadRequest::snapshot_sent()] {
        let mut server = ZdsServer::bind();
        let double = ZtunnelDouble::connect_with_retry(server.path(), ZtunnelConfig::zds_only());
        let peer = server.accept().await;
        assert_eq!(peer.snapshot_sent().await, Ok(()));
        let result = peer.request(&second, None).await;
        assert!(
            is_nack_starting_with(&result, PROCESS_FAILURE),
            "{result:?}"
        );
        peer.expect_closed().await;
        wait(&double, |s| s.stopped.is_some()).await;
        assert_eq!(double.state().connections.len(), 1);
        assert!(!double.is_ready());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_listed_uid_fails_to_start_and_is_retried_until_it_starts() {
    let (_ns, file, inode) = netns("zds");
    let mut server = ZdsServer::bind();
    let config = ZtunnelConfig::zds_only()
        .nack("bad")
        .pending_retry_interval(Duration::from_millis(20));
    let double = ZtunnelDouble::connect(server.path(), config).await.unwrap();
    let peer = server.accept().await;

    let result = peer.add("bad", &file).await;
    assert!(
        is_nack_starting_with(&result, PROXY_START_FAILURE),
        "{result:?}"
    );
    // A proxy failure keeps the connection.
    assert_eq!(peer.add("good", &file).await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    let state = double.state();
    assert!(!state.ready, "not ready while a pod is pending");
    assert_eq!(state.pending, BTreeSet::from(["bad".to_owned()]));
    assert!(!state.workloads.contains_key("bad"));

    double.set_nack("bad", false);
    wait(&double, |s| s.ready && s.workloads.contains_key("bad")).await;
    assert_eq!(double.workloads()["bad"].netns_inode, inode);
    assert!(double.state().pending.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_on_a_new_connection_drains_pods_not_sent_again() {
    let (ns_a, file_a, inode_a) = netns("zds");
    let (ns_b, file_b, _) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect_with_retry(server.path(), ZtunnelConfig::zds_only());

    let peer = server.accept().await;
    assert_eq!(peer.add("a", &file_a).await, Ok(()));
    assert_eq!(peer.add("b", &file_b).await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    assert!(double.is_ready());

    // The agent restarts: ztunnel reconnects, pods still there, not ready.
    drop(peer);
    let peer = server.accept().await;
    wait(&double, |s| s.connections.len() == 2 && s.connected).await;
    assert!(!double.is_ready());
    assert_eq!(double.workloads().len(), 2);

    assert_eq!(peer.add("a", &file_a).await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    let state = double.state();
    assert!(state.ready);
    assert_eq!(state.workloads.keys().collect::<Vec<_>>(), ["a"]);
    assert_eq!(state.workloads["a"].netns_inode, inode_a);
    assert_eq!(state.connections[1].added, ["a"]);
    assert!(state.connections[1].snapshot_sent);
    // b's fd is closed, a's kept once (the re-Add's duplicate was closed).
    assert_eq!(open_fds_on(&ns_b.path()), 1);
    assert_eq!(open_fds_on(&ns_a.path()), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_preserves_a_pod_across_a_reconnect() {
    let (_ns, file, inode) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect_with_retry(server.path(), ZtunnelConfig::zds_only());

    let peer = server.accept().await;
    assert_eq!(peer.add("a", &file).await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));

    double.disconnect();
    peer.expect_closed().await;
    let peer = server.accept().await;
    assert_eq!(peer.keep("a").await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));

    let state = double.state();
    assert!(state.ready);
    assert_eq!(state.workloads["a"].netns_inode, inode);
    assert_eq!(state.connections[1].kept, ["a"]);
    assert!(state.connections[1].added.is_empty());
    assert_eq!(
        state.current_connection_events(),
        [
            ZdsEvent::Connected { connection: 2 },
            ZdsEvent::Keep {
                uid: "a".to_owned()
            },
            ZdsEvent::SnapshotSent,
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn del_before_the_snapshot_ends_leaves_the_drain_to_the_snapshot() {
    let (_ns, file, _) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect_with_retry(server.path(), ZtunnelConfig::zds_only());
    let peer = server.accept().await;
    assert_eq!(peer.add("a", &file).await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    drop(peer);

    let peer = server.accept().await;
    assert_eq!(peer.add("a", &file).await, Ok(()));
    assert_eq!(peer.del("a").await, Ok(()));
    assert!(
        double.workloads().contains_key("a"),
        "ztunnel only drains at SnapshotSent"
    );
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    assert!(double.workloads().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn del_closes_the_netns_fd_so_many_adds_and_dels_leak_nothing() {
    let (ns, file, _) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect(server.path(), ZtunnelConfig::zds_only())
        .await
        .unwrap();
    let peer = server.accept().await;
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    let before = open_fds_on(&ns.path());
    assert_eq!(before, 1, "the test's own fd");

    const PODS: usize = 300;
    for i in 0..PODS {
        assert_eq!(peer.add(&format!("pod-{i}"), &file).await, Ok(()));
    }
    assert_eq!(double.workloads().len(), PODS);
    assert_eq!(open_fds_on(&ns.path()), before + PODS, "one fd per pod");
    for i in 0..PODS {
        assert_eq!(peer.del(&format!("pod-{i}")).await, Ok(()));
    }
    assert!(double.workloads().is_empty());
    assert_eq!(open_fds_on(&ns.path()), before);

    // The same pod over and over, re-Added on the same netns in between.
    for _ in 0..100 {
        assert_eq!(peer.add("again", &file).await, Ok(()));
        assert_eq!(peer.add("again", &file).await, Ok(()));
        assert_eq!(peer.del("again").await, Ok(()));
    }
    assert_eq!(open_fds_on(&ns.path()), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_is_idempotent_on_the_same_netns_and_replaces_on_a_new_one() {
    let (ns_a, file_a, inode_a) = netns("zds");
    let (ns_b, file_b, inode_b) = netns("zds");
    let mut server = ZdsServer::bind();
    let double = ZtunnelDouble::connect(server.path(), ZtunnelConfig::zds_only())
        .await
        .unwrap();
    let peer = server.accept().await;

    assert_eq!(peer.add("p", &file_a).await, Ok(()));
    assert_eq!(peer.add("p", &file_a).await, Ok(()));
    assert_eq!(double.workloads()["p"].netns_inode, inode_a);
    assert_eq!(open_fds_on(&ns_a.path()), 2);

    // A new sandbox for the same pod.
    assert_eq!(peer.add("p", &file_b).await, Ok(()));
    assert_eq!(double.workloads()["p"].netns_inode, inode_b);
    assert_eq!(open_fds_on(&ns_a.path()), 1);
    assert_eq!(open_fds_on(&ns_b.path()), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_events_as_json_lines_and_exits_cleanly_on_sigterm() {
    let (_ns, file, inode) = netns("zds");
    let mut server = ZdsServer::bind();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ztunnel-double"))
        .arg("--socket")
        .arg(server.path())
        .args(["--no-proxies", "--nack", "bad"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines_tx, mut lines) = mpsc::unbounded_channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut next_line = async || -> serde_json::Value {
        let line = tokio::time::timeout(WAIT, lines.recv())
            .await
            .expect("no output")
            .expect("output ended");
        serde_json::from_str(&line).unwrap()
    };

    let peer = server.accept().await;
    assert_eq!(peer.add("good", &file).await, Ok(()));
    let result = peer.add("bad", &file).await;
    assert!(
        is_nack_starting_with(&result, PROXY_START_FAILURE),
        "{result:?}"
    );

    assert_eq!(
        next_line().await,
        serde_json::json!({"event": "connected", "connection": 1})
    );
    let add = next_line().await;
    assert_eq!(add["event"], "add");
    assert_eq!(add["uid"], "good");
    assert_eq!(add["netns_inode"], inode);
    let nack = next_line().await;
    assert_eq!(nack["event"], "nacked");
    assert_eq!(nack["uid"], "bad");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
    reader.join().unwrap();
}

// ---------------------------------------------------------------------------
// In-pod proxies

/// A non-blocking TCP socket created inside `ns`, connected on tokio.
async fn connect_from(ns: &NetnsGuard, target: SocketAddr) -> io::Result<TcpStream> {
    let socket = ns.run(move || -> io::Result<std::net::TcpStream> {
        let domain = socket2::Domain::for_address(target);
        let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
        socket.set_nonblocking(true)?;
        Ok(socket.into())
    })??;
    TcpSocket::from_std_stream(socket).connect(target).await
}

/// A TCP echo server listening inside `ns` on `[::]:port` (dual-stack);
/// reports each client's address.
fn echo_server_in(ns: &NetnsGuard, port: u16) -> mpsc::UnboundedReceiver<SocketAddr> {
    let listener = ns
        .run(move || {
            let listener = std::net::TcpListener::bind(("::", port))?;
            listener.set_nonblocking(true)?;
            Ok::<_, io::Error>(listener)
        })
        .unwrap()
        .unwrap();
    let listener = TcpListener::from_std(listener).unwrap();
    let (peers_tx, peers) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, peer)) = listener.accept().await {
            let _ = peers_tx.send(SocketAddr::new(peer.ip().to_canonical(), peer.port()));
            tokio::spawn(async move {
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    peers
}

/// Sends `message`, half-closes, and returns everything read back.
async fn exchange(stream: &mut TcpStream, message: &[u8]) -> Vec<u8> {
    stream.write_all(message).await.unwrap();
    stream.shutdown().await.unwrap();
    let mut received = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut received))
        .await
        .expect("no end-of-file")
        .unwrap();
    received
}

/// Reads until the peer closes (or resets) the connection.
async fn expect_closed_by_peer(stream: &mut TcpStream) {
    let mut buffer = [0u8; 64];
    let read = tokio::time::timeout(WAIT, stream.read(&mut buffer))
        .await
        .expect("the double kept the connection open");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
}

/// Runs `command args...` inside `ns` (iptables, ip6tables).
fn run_in(ns: &NetnsGuard, command: &str, args: &[&str]) {
    let output = Command::new("ip")
        .args(["netns", "exec", ns.name(), command])
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{command} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A pod handed to a double with proxies on; returns the double, the server
/// connection (keep it, or ztunnel sees the agent go away) and the pod uid.
async fn pod_with_proxies(
    pn: &PodAndNode,
    server: &mut ZdsServer,
) -> (ZtunnelDouble, ZdsPeer, String) {
    pod_with_config(&pn.pod, server, ZtunnelConfig::default()).await
}

/// [`pod_with_proxies`] for any pod netns and configuration.
async fn pod_with_config(
    pod: &NetnsGuard,
    server: &mut ZdsServer,
    config: ZtunnelConfig,
) -> (ZtunnelDouble, ZdsPeer, String) {
    let double = ZtunnelDouble::connect(server.path(), config).await.unwrap();
    let peer = server.accept().await;
    let uid = format!("uid-{}", pod.name());
    let file = File::open(pod.path()).unwrap();
    assert_eq!(peer.add(&uid, &file).await, Ok(()));
    assert_eq!(peer.snapshot_sent().await, Ok(()));
    assert!(double.workloads()[&uid].proxies_running);
    (double, peer, uid)
}

fn pod_v4(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(PodAndNode::POD.v4), port)
}

fn pod_v6(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(PodAndNode::POD.v6), port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_connections_to_the_capture_listeners_are_refused_as_self_calls() {
    let pn = PodAndNode::create().unwrap();
    let mut server = ZdsServer::bind();
    let (double, peer, uid) = pod_with_proxies(&pn, &mut server).await;

    // Without redirection there is no SO_ORIGINAL_DST: the original
    // destination is the listener's own address, which ztunnel refuses.
    let mut inbound = connect_from(&pn.node, pod_v4(INBOUND_PLAINTEXT_PORT))
        .await
        .unwrap();
    let inbound_client = inbound.local_addr().unwrap();
    expect_closed_by_peer(&mut inbound).await;
    let mut outbound = connect_from(&pn.node, pod_v6(OUTBOUND_PORT)).await.unwrap();
    let outbound_client = outbound.local_addr().unwrap();
    expect_closed_by_peer(&mut outbound).await;
    let loopback: SocketAddr = ([127, 0, 0, 1], OUTBOUND_PORT).into();
    let mut from_pod = connect_from(&pn.pod, loopback).await.unwrap();
    expect_closed_by_peer(&mut from_pod).await;

    wait(&double, |s| s.proxied.len() == 3).await;
    let proxied = double.proxied();
    let find = |port: u16, dst: SocketAddr| {
        proxied
            .iter()
            .find(|c| c.listener_port == port && c.original_dst == dst)
            .unwrap_or_else(|| panic!("no record for {dst} on {port}: {proxied:?}"))
    };
    let record = find(INBOUND_PLAINTEXT_PORT, pod_v4(INBOUND_PLAINTEXT_PORT));
    assert_eq!(record.uid, uid);
    assert_eq!(record.client, inbound_client);
    assert_eq!(record.outcome, ConnectionOutcome::RefusedSelfCall);
    let record = find(OUTBOUND_PORT, pod_v6(OUTBOUND_PORT));
    assert_eq!(record.client, outbound_client);
    assert_eq!(record.outcome, ConnectionOutcome::RefusedSelfCall);
    let record = find(OUTBOUND_PORT, loopback);
    assert_eq!(record.outcome, ConnectionOutcome::RefusedSelfCall);

    // Del stops the proxies: the listeners are closed once it is acked.
    assert_eq!(peer.del(&uid).await, Ok(()));
    for port in [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT] {
        wait_tcp_refused(&pn.node, pod_v4(port)).await;
    }
}

/// Waits until connections from `ns` to `target` are refused. The double
/// closes a listener before it acks the Del, but a concurrent fork (any test
/// running `ip`) holds a copy of this process's fds until it execs, which can
/// keep the socket open for a moment longer: so "closed" is waited for.
async fn wait_tcp_refused(ns: &NetnsGuard, target: SocketAddr) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match connect_from(ns, target).await {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "tcp {target} still open: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbone_stand_in_tunnels_connect_to_an_app_in_the_pod() {
    const APP_PORT: u16 = 8080;
    let pn = PodAndNode::create().unwrap();
    let mut app_peers = echo_server_in(&pn.pod, APP_PORT);
    let mut server = ZdsServer::bind();
    let (double, _peer, uid) = pod_with_proxies(&pn, &mut server).await;

    let mut tunnel = connect_from(&pn.node, pod_v4(HBONE_PORT)).await.unwrap();
    let client = tunnel.local_addr().unwrap();
    // Bytes right behind the request head must reach the app too.
    let request = format!(
        "CONNECT {} HTTP/1.1\r\nHost: {0}\r\n\r\nearly ",
        pod_v4(APP_PORT)
    );
    tunnel.write_all(request.as_bytes()).await.unwrap();
    let mut status = [0u8; 19];
    tunnel.read_exact(&mut status).await.unwrap();
    assert_eq!(&status, b"HTTP/1.1 200 OK\r\n\r\n");
    assert_eq!(exchange(&mut tunnel, b"ping").await, b"early ping");

    let app_saw = tokio::time::timeout(WAIT, app_peers.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        app_saw.ip(),
        IpAddr::V4(PodAndNode::POD.v4),
        "from the pod's own address"
    );
    let record = double.proxied().into_iter().next().unwrap();
    assert_eq!(record.uid, uid);
    assert_eq!(record.listener_port, HBONE_PORT);
    assert_eq!(record.client, client);
    assert_eq!(record.original_dst, pod_v4(APP_PORT));
    assert_eq!(record.outcome, ConnectionOutcome::Proxied);

    // A CONNECT to ztunnel's own port, and a request that is no CONNECT.
    for (request, refusal) in [
        (
            format!(
                "CONNECT {} HTTP/1.1\r\n\r\n",
                pod_v6(INBOUND_PLAINTEXT_PORT)
            ),
            "self call",
        ),
        ("GET / HTTP/1.1\r\n\r\n".to_owned(), "bad request"),
    ] {
        let mut tunnel = connect_from(&pn.node, pod_v6(HBONE_PORT)).await.unwrap();
        tunnel.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        tunnel.read_to_end(&mut response).await.unwrap();
        assert!(
            response.starts_with(b"HTTP/1.1 400 "),
            "{refusal}: {:?}",
            String::from_utf8_lossy(&response)
        );
    }
    wait(&double, |s| s.proxied.len() == 3).await;
    let outcomes: Vec<_> = double.proxied().into_iter().map(|c| c.outcome).collect();
    assert_eq!(outcomes[1], ConnectionOutcome::RefusedSelfCall);
    assert!(
        matches!(outcomes[2], ConnectionOutcome::BadConnectRequest(_)),
        "{outcomes:?}"
    );
}

/// Outbound capture as Istio's in-pod iptables rules do it (nat REDIRECT to
/// 15001 of unmarked TCP): the double recovers the destination with
/// SO_ORIGINAL_DST (IPv4 and IPv6) and connects there with mark 0x539, which
/// the rule lets through (without the mark it would loop).
/// Istio's outbound capture in `pod`: nat REDIRECT to 15001 of all TCP but
/// to loopback and ztunnel's own (marked) sockets.
fn redirect_outbound_with_iptables(pod: &NetnsGuard) {
    for (iptables, loopback) in [("iptables", "127.0.0.1/32"), ("ip6tables", "::1/128")] {
        run_in(
            pod,
            iptables,
            &[
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-p",
                "tcp",
                "!",
                "-d",
                loopback,
                "-m",
                "mark",
                "!",
                "--mark",
                "0x539/0xfff",
                "-j",
                "REDIRECT",
                "--to-ports",
                "15001",
            ],
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbound_redirected_by_iptables_reaches_the_original_destination() {
    const SERVER_PORT: u16 = 9000;
    let pn = PodAndNode::create().unwrap();
    redirect_outbound_with_iptables(&pn.pod);
    let mut server_peers = echo_server_in(&pn.node, SERVER_PORT);
    let mut server = ZdsServer::bind();
    let (double, _peer, uid) = pod_with_proxies(&pn, &mut server).await;

    for destination in [
        SocketAddr::new(IpAddr::V4(PodAndNode::NODE.v4), SERVER_PORT),
        SocketAddr::new(IpAddr::V6(PodAndNode::NODE.v6), SERVER_PORT),
    ] {
        let mut app = connect_from(&pn.pod, destination).await.unwrap();
        let client = app.local_addr().unwrap();
        assert_eq!(
            exchange(&mut app, b"hello").await,
            b"hello",
            "to {destination}"
        );
        let server_saw = tokio::time::timeout(WAIT, server_peers.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            server_saw.ip(),
            client.ip(),
            "outbound leaves from the pod's address"
        );
        let record = double
            .proxied()
            .into_iter()
            .find(|c| c.client == client)
            .expect("the connection went through the double");
        assert_eq!(record.uid, uid);
        assert_eq!(record.listener_port, OUTBOUND_PORT);
        assert_eq!(record.original_dst, destination);
        assert_eq!(record.outcome, ConnectionOutcome::Proxied);
    }
}

/// Inbound capture as Istio's in-pod rules do it: nat REDIRECT to 15006, and
/// the connmark 0x111 policy route that brings the app's replies back to the
/// double's transparent socket. The app sees the client's own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_redirected_by_iptables_keeps_the_client_address() {
    const APP_PORT: u16 = 8080;
    let pn = PodAndNode::create().unwrap();
    for rule in [
        &[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-i",
            "eth0",
            "-p",
            "tcp",
            "-m",
            "mark",
            "!",
            "--mark",
            "0x539/0xfff",
            "-j",
            "REDIRECT",
            "--to-ports",
            "15006",
        ][..],
        &[
            "-t",
            "mangle",
            "-A",
            "PREROUTING",
            "-m",
            "mark",
            "--mark",
            "0x539/0xfff",
            "-j",
            "CONNMARK",
            "--set-xmark",
            "0x111/0xfff",
        ],
        &[
            "-t",
            "mangle",
            "-A",
            "OUTPUT",
            "-m",
            "connmark",
            "--mark",
            "0x111/0xfff",
            "-j",
            "CONNMARK",
            "--restore-mark",
            "--nfmask",
            "0xffffffff",
            "--ctmask",
            "0xffffffff",
        ],
    ] {
        run_in(&pn.pod, "iptables", rule);
    }
    pn.pod
        .ip(&[
            "rule",
            "add",
            "fwmark",
            "0x111/0xfff",
            "pref",
            "32764",
            "lookup",
            "100",
        ])
        .unwrap();
    pn.pod
        .ip(&[
            "route",
            "add",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            "100",
        ])
        .unwrap();
    let mut app_peers = echo_server_in(&pn.pod, APP_PORT);
    let mut server = ZdsServer::bind();
    let (double, _peer, uid) = pod_with_proxies(&pn, &mut server).await;

    let mut client = connect_from(&pn.node, pod_v4(APP_PORT)).await.unwrap();
    let client_address = client.local_addr().unwrap();
    assert_eq!(exchange(&mut client, b"hello").await, b"hello");
    let app_saw = tokio::time::timeout(WAIT, app_peers.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        app_saw.ip(),
        client_address.ip(),
        "the client's address is kept"
    );
    let record = double.proxied().into_iter().next().unwrap();
    assert_eq!(record.uid, uid);
    assert_eq!(record.listener_port, INBOUND_PLAINTEXT_PORT);
    assert_eq!(record.client, client_address);
    assert_eq!(record.original_dst, pod_v4(APP_PORT));
    assert_eq!(record.outcome, ConnectionOutcome::Proxied);
}

// ---------------------------------------------------------------------------
// DNS proxy

const DNS_V4: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), DNS_PORT);
const DNS_V6: SocketAddr = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), DNS_PORT);
/// A cluster DNS service, as an app's resolv.conf names it.
const RESOLVER_V4: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 53);
const RESOLVER_V6: SocketAddr = SocketAddr::new(
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0xa)),
    53,
);
const SVC: &str = "svc.ns.svc.cluster.local";

/// A UDP socket created inside `ns`, bound to `local`, on tokio.
fn udp_socket_in(ns: &NetnsGuard, local: SocketAddr) -> UdpSocket {
    let socket = ns
        .run(move || -> io::Result<std::net::UdpSocket> {
            let socket = std::net::UdpSocket::bind(local)?;
            socket.set_nonblocking(true)?;
            Ok(socket)
        })
        .unwrap()
        .unwrap();
    UdpSocket::from_std(socket).unwrap()
}

/// How long a stub resolver waits before sending a query again.
const DNS_RETRANSMIT: Duration = Duration::from_secs(1);

/// Asks `target` as a stub resolver does: sends `query`, resending it each
/// [`DNS_RETRANSMIT`] (a datagram can be lost on a loaded machine, and tests
/// share the CPUs with whatever else runs), until a response with the
/// query's id arrives. Returns the response and where it came from. A resent
/// query is answered (and recorded) again: records are compared deduplicated.
async fn ask_udp(socket: &UdpSocket, target: SocketAddr, query: &[u8]) -> (Vec<u8>, SocketAddr) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut buffer = [0u8; 1024];
    loop {
        socket.send_to(query, target).await.unwrap();
        let resend = tokio::time::Instant::now() + DNS_RETRANSMIT;
        while let Ok(received) =
            tokio::time::timeout_at(resend, socket.recv_from(&mut buffer)).await
        {
            let (len, from) = received.unwrap();
            // A late answer to an earlier query on this socket is skipped.
            if buffer.get(..2) == query.get(..2) {
                return (buffer[..len].to_vec(), from);
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no DNS answer to {target}"
        );
    }
}

/// The recorded DNS queries, a resent query's repeats removed.
fn dns_queries_deduplicated(double: &ZtunnelDouble) -> Vec<DnsQuery> {
    let mut queries = double.dns_queries();
    queries.dedup();
    queries
}

async fn write_tcp_dns(stream: &mut TcpStream, message: &[u8]) {
    let len = u16::try_from(message.len()).unwrap();
    stream.write_all(&len.to_be_bytes()).await.unwrap();
    stream.write_all(message).await.unwrap();
}

async fn read_tcp_dns(stream: &mut TcpStream) -> dns::Response {
    let mut prefix = [0u8; 2];
    tokio::time::timeout(WAIT, stream.read_exact(&mut prefix))
        .await
        .expect("no DNS answer")
        .unwrap();
    let mut message = vec![0u8; usize::from(u16::from_be_bytes(prefix))];
    stream.read_exact(&mut message).await.unwrap();
    dns::Response::parse(&message).unwrap()
}

/// Checks a NOERROR response to `id`/`name`/`qtype` with exactly `answer`.
fn assert_answer(
    response: &dns::Response,
    id: u16,
    name: &str,
    qtype: u16,
    answer: Option<IpAddr>,
) {
    assert_eq!(response.header.id, id);
    assert_eq!(response.rcode(), dns::RCODE_NOERROR);
    assert_ne!(response.header.flags & dns::FLAG_RA, 0, "RA is set");
    assert_eq!(
        response.questions,
        [dns::QuestionEntry {
            name: name.to_owned(),
            qtype,
            qclass: dns::CLASS_IN,
        }]
    );
    assert_eq!(response.addresses(), Vec::from_iter(answer));
    for record in &response.answers {
        assert_eq!((record.name.as_str(), record.ttl), (name, dns::ANSWER_TTL));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_over_udp_on_both_loopbacks_gets_the_configured_answers_and_is_recorded() {
    let v4 = Ipv4Addr::new(10, 1, 2, 3);
    let v6: Ipv6Addr = "fd00:1::2:3".parse().unwrap();
    let pn = PodAndNode::create().unwrap();
    let mut server = ZdsServer::bind();
    let config = ZtunnelConfig::default().dns_answer_v4(v4).dns_answer_v6(v6);
    let (double, _peer, uid) = pod_with_config(&pn.pod, &mut server, config).await;

    let cases = [
        (DNS_V4, 0x4242, dns::TYPE_A, Some(IpAddr::V4(v4))),
        (DNS_V6, 0x4243, dns::TYPE_AAAA, Some(IpAddr::V6(v6))),
        // Over IPv4 for an AAAA, over IPv6 for something else.
        (DNS_V4, 0x4244, dns::TYPE_AAAA, Some(IpAddr::V6(v6))),
        (DNS_V6, 0x4245, 16, None),
    ];
    for (target, id, qtype, answer) in cases {
        let local = SocketAddr::new(target.ip(), 0);
        let app = udp_socket_in(&pn.pod, local);
        let client = app.local_addr().unwrap();
        let query = dns::encode_query(id, SVC, qtype).unwrap();
        let (response, from) = ask_udp(&app, target, &query).await;
        assert_eq!(from, target, "answered from the socket asked");
        let response = dns::Response::parse(&response).unwrap();
        assert_answer(&response, id, SVC, qtype, answer);

        // Recorded before the answer was sent.
        let recorded = double.dns_queries().pop().unwrap();
        assert_eq!(
            recorded,
            DnsQuery {
                uid: uid.clone(),
                transport: DnsTransport::Udp,
                client,
                server: target,
                name: SVC.to_owned(),
                qtype,
                answer,
            }
        );
    }
    assert_eq!(dns_queries_deduplicated(&double).len(), cases.len());
    assert_eq!(double.state().dns_rejected, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_over_tcp_answers_several_queries_per_connection() {
    let pn = PodAndNode::create().unwrap();
    let mut server = ZdsServer::bind();
    let (double, _peer, uid) = pod_with_proxies(&pn, &mut server).await;

    for target in [DNS_V4, DNS_V6] {
        let mut app = connect_from(&pn.pod, target).await.unwrap();
        let client = app.local_addr().unwrap();
        // Two queries written back to back, then a third after the answers.
        let a = dns::encode_query(1, SVC, dns::TYPE_A).unwrap();
        let aaaa = dns::encode_query(2, "other.example", dns::TYPE_AAAA).unwrap();
        let mut both = Vec::new();
        for query in [&a, &aaaa] {
            both.extend_from_slice(&u16::try_from(query.len()).unwrap().to_be_bytes());
            both.extend_from_slice(query);
        }
        app.write_all(&both).await.unwrap();
        let first = read_tcp_dns(&mut app).await;
        assert_answer(
            &first,
            1,
            SVC,
            dns::TYPE_A,
            Some(DEFAULT_DNS_ANSWER_V4.into()),
        );
        let second = read_tcp_dns(&mut app).await;
        let v6 = Some(DEFAULT_DNS_ANSWER_V6.into());
        assert_answer(&second, 2, "other.example", dns::TYPE_AAAA, v6);
        write_tcp_dns(&mut app, &dns::encode_query(3, ".", dns::TYPE_A).unwrap()).await;
        let third = read_tcp_dns(&mut app).await;
        assert_answer(
            &third,
            3,
            ".",
            dns::TYPE_A,
            Some(DEFAULT_DNS_ANSWER_V4.into()),
        );

        let recorded: Vec<_> = double
            .dns_queries()
            .into_iter()
            .filter(|q| q.client == client)
            .map(|q| (q.uid, q.transport, q.server, q.name, q.qtype))
            .collect();
        let expected = |name: &str, qtype| {
            (
                uid.clone(),
                DnsTransport::Tcp,
                target,
                name.to_owned(),
                qtype,
            )
        };
        assert_eq!(
            recorded,
            [
                expected(SVC, dns::TYPE_A),
                expected("other.example", dns::TYPE_AAAA),
                expected(".", dns::TYPE_A),
            ]
        );
        // The client closing ends the connection cleanly.
        app.shutdown().await.unwrap();
        expect_closed_by_peer(&mut app).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_dns_gets_formerr_or_is_dropped_and_the_proxy_keeps_answering() {
    let pn = PodAndNode::create().unwrap();
    let mut server = ZdsServer::bind();
    let (double, _peer, _uid) = pod_with_proxies(&pn, &mut server).await;
    // A header, then a question whose name is a compression pointer.
    let compressed = b"\x77\x01\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01";
    let truncated = &dns::encode_query(0x7702, SVC, dns::TYPE_A).unwrap()[..20];

    // UDP: no header at all is dropped; a bad question gets FORMERR.
    let app = udp_socket_in(&pn.pod, SocketAddr::new(DNS_V4.ip(), 0));
    app.send_to(b"\x01\x02\x03", DNS_V4).await.unwrap();
    for (message, id) in [(&compressed[..], 0x7701), (truncated, 0x7702)] {
        let (response, _) = ask_udp(&app, DNS_V4, message).await;
        let response = dns::Response::parse(&response).unwrap();
        assert_eq!(response.header.id, id);
        assert_eq!(response.rcode(), dns::RCODE_FORMERR);
        assert!(response.questions.is_empty() && response.answers.is_empty());
    }
    let (response, _) = ask_udp(
        &app,
        DNS_V4,
        &dns::encode_query(5, SVC, dns::TYPE_A).unwrap(),
    )
    .await;
    let answer = Some(DEFAULT_DNS_ANSWER_V4.into());
    assert_answer(
        &dns::Response::parse(&response).unwrap(),
        5,
        SVC,
        dns::TYPE_A,
        answer,
    );

    // TCP: FORMERR keeps the connection; a message without a header ends it.
    let mut app = connect_from(&pn.pod, DNS_V6).await.unwrap();
    write_tcp_dns(&mut app, compressed).await;
    let response = read_tcp_dns(&mut app).await;
    assert_eq!(
        (response.header.id, response.rcode()),
        (0x7701, dns::RCODE_FORMERR)
    );
    write_tcp_dns(
        &mut app,
        &dns::encode_query(6, SVC, dns::TYPE_AAAA).unwrap(),
    )
    .await;
    let answer = Some(DEFAULT_DNS_ANSWER_V6.into());
    assert_answer(
        &read_tcp_dns(&mut app).await,
        6,
        SVC,
        dns::TYPE_AAAA,
        answer,
    );
    write_tcp_dns(&mut app, b"\x00\x07").await;
    expect_closed_by_peer(&mut app).await;

    // Dropped: 3 bytes over UDP, 2 over TCP; FORMERR: 3 (more if a UDP
    // query had to be resent).
    wait(&double, |s| s.dns_rejected >= 5).await;
    let queries = dns_queries_deduplicated(&double);
    assert_eq!(
        queries.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(),
        [SVC, SVC]
    );
}

/// Inodes of every TCP and UDP socket in `ns`, whoever holds them (the
/// netns's `/proc/net` tables; TIME_WAIT entries have none).
fn socket_inodes_in(ns: &NetnsGuard) -> BTreeSet<u64> {
    ns.run(|| {
        let mut inodes = BTreeSet::new();
        for table in ["tcp", "tcp6", "udp", "udp6"] {
            // thread-self: /proc/self/net would show the main thread's netns.
            let path = format!("/proc/thread-self/net/{table}");
            for line in fs::read_to_string(path).unwrap().lines().skip(1) {
                let inode = line.split_whitespace().nth(9).unwrap();
                inodes.insert(inode.parse::<u64>().unwrap());
            }
        }
        inodes.remove(&0);
        inodes
    })
    .unwrap()
}

/// This process's sockets among `inodes`, as getsockopt reads them back:
/// (local address, "tcp"/"udp", SO_MARK). Only those sockets are touched
/// (duplicated for a moment), so other tests' sockets close when they close.
fn own_sockets(inodes: &BTreeSet<u64>) -> BTreeSet<(SocketAddr, &'static str, u32)> {
    let mut found = BTreeSet::new();
    for entry in fs::read_dir("/proc/self/fd").unwrap() {
        let entry = entry.unwrap();
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        let inode = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok());
        let fd = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok());
        let (Some(inode), Some(fd)) = (inode, fd) else {
            continue;
        };
        if !inodes.contains(&inode) {
            continue;
        }
        // SAFETY: only duplicated, never closed; should the number have been
        // closed and reused meanwhile, the inode check below skips it.
        let Ok(dup) = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned() else {
            continue;
        };
        if nix::sys::stat::fstat(&dup).map(|st| st.st_ino) != Ok(inode) {
            continue;
        }
        let socket = socket2::Socket::from(dup);
        let local = socket.local_addr().unwrap().as_socket().unwrap();
        let kind = match socket.r#type().unwrap() {
            socket2::Type::STREAM => "tcp",
            socket2::Type::DGRAM => "udp",
            other => panic!("unexpected socket type {other:?}"),
        };
        found.insert((local, kind, socket.mark().unwrap()));
    }
    found
}

/// The double's own sockets in the pod, read back from the kernel: the
/// three capture listeners and the four DNS sockets, all marked 0x539, and
/// nothing else in the pod's netns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_socket_the_double_opens_in_the_pod_carries_the_ztunnel_mark() {
    let pn = PodAndNode::create().unwrap();
    assert!(socket_inodes_in(&pn.pod).is_empty());
    let mut server = ZdsServer::bind();
    let (double, peer, uid) = pod_with_proxies(&pn, &mut server).await;

    let any = |port| SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
    let expected = BTreeSet::from([
        (any(OUTBOUND_PORT), "tcp", ZTUNNEL_MARK),
        (any(INBOUND_PLAINTEXT_PORT), "tcp", ZTUNNEL_MARK),
        (any(HBONE_PORT), "tcp", ZTUNNEL_MARK),
        (DNS_V4, "tcp", ZTUNNEL_MARK),
        (DNS_V4, "udp", ZTUNNEL_MARK),
        (DNS_V6, "tcp", ZTUNNEL_MARK),
        (DNS_V6, "udp", ZTUNNEL_MARK),
    ]);
    let inodes = socket_inodes_in(&pn.pod);
    assert_eq!(inodes.len(), expected.len(), "only the double's sockets");
    assert_eq!(own_sockets(&inodes), expected);

    assert_eq!(peer.del(&uid).await, Ok(()));
    assert!(double.workloads().is_empty());
    // Closed before the ack, but see `wait_tcp_refused` on concurrent forks.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !socket_inodes_in(&pn.pod).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sockets left after Del"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_ports_are_closed_once_the_pod_is_deleted() {
    let pn = PodAndNode::create().unwrap();
    let mut server = ZdsServer::bind();
    let (double, peer, uid) = pod_with_proxies(&pn, &mut server).await;
    let query = dns::encode_query(9, SVC, dns::TYPE_A).unwrap();
    let mut apps = Vec::new();
    for target in [DNS_V4, DNS_V6] {
        let app = udp_socket_in(&pn.pod, SocketAddr::new(target.ip(), 0));
        app.connect(target).await.unwrap();
        let (response, _) = ask_udp(&app, target, &query).await;
        assert_eq!(dns::Response::parse(&response).unwrap().header.id, 9);
        apps.push(app);
    }
    assert_eq!(dns_queries_deduplicated(&double).len(), 2);

    assert_eq!(peer.del(&uid).await, Ok(()));
    for (app, target) in apps.into_iter().zip([DNS_V4, DNS_V6]) {
        wait_udp_refused(app, &query).await;
        wait_tcp_refused(&pn.pod, target).await;
    }
    assert_eq!(
        dns_queries_deduplicated(&double).len(),
        2,
        "nothing answered after Del"
    );
}

/// Waits until `query` sent on `app` (connected) gets ECONNREFUSED: the ICMP
/// port unreachable of a closed port (see [`wait_tcp_refused`] on why it is
/// waited for). An answer fails at once.
async fn wait_udp_refused(app: UdpSocket, query: &[u8]) {
    let target = app.peer_addr().unwrap();
    // tokio does not wake a receive for a socket error alone (EPOLLERR is no
    // read readiness): receive in blocking mode.
    let app = app.into_std().unwrap();
    app.set_nonblocking(false).unwrap();
    app.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let query = query.to_vec();
    let deadline = std::time::Instant::now() + WAIT;
    let outcome = tokio::task::spawn_blocking(move || {
        loop {
            let received = app.send(&query).and_then(|_| app.recv(&mut [0u8; 512]));
            match received {
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) && std::time::Instant::now() < deadline => {}
                other => return Err(format!("{other:?}")),
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(outcome, Ok(()), "udp {target} not closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_on_ipv6_is_skipped_in_a_pod_without_ipv6_loopback() {
    let pod = NetnsGuard::create("pod").unwrap();
    pod.ip(&["addr", "del", "::1/128", "dev", "lo"]).unwrap();
    let mut server = ZdsServer::bind();
    let (double, _peer, uid) = pod_with_config(&pod, &mut server, ZtunnelConfig::default()).await;

    let app = udp_socket_in(&pod, SocketAddr::new(DNS_V4.ip(), 0));
    let (response, _) = ask_udp(
        &app,
        DNS_V4,
        &dns::encode_query(1, SVC, dns::TYPE_AAAA).unwrap(),
    )
    .await;
    let answer = Some(DEFAULT_DNS_ANSWER_V6.into());
    assert_answer(
        &dns::Response::parse(&response).unwrap(),
        1,
        SVC,
        dns::TYPE_AAAA,
        answer,
    );
    assert_eq!(double.dns_queries()[0].uid, uid);
}

/// DNS capture as Istio's in-pod rules do it (nat REDIRECT of unmarked port
/// 53 to 15053): the app asks the cluster resolver and gets the double's
/// answer from the resolver's address. The eBPF redirection must give apps
/// the same view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_dns_redirected_by_iptables_is_answered_as_if_by_the_resolver() {
    let pn = PodAndNode::create().unwrap();
    // Routes to the (non-existent) resolver, as a pod has.
    pn.pod
        .ip(&[
            "route",
            "add",
            "default",
            "via",
            &PodAndNode::NODE.v4.to_string(),
        ])
        .unwrap();
    pn.pod
        .ip(&[
            "-6",
            "route",
            "add",
            "default",
            "via",
            &PodAndNode::NODE.v6.to_string(),
        ])
        .unwrap();
    for iptables in ["iptables", "ip6tables"] {
        for protocol in ["udp", "tcp"] {
            run_in(
                &pn.pod,
                iptables,
                &[
                    "-t",
                    "nat",
                    "-A",
                    "OUTPUT",
                    "-p",
                    protocol,
                    "--dport",
                    "53",
                    "-m",
                    "mark",
                    "!",
                    "--mark",
                    "0x539/0xfff",
                    "-j",
                    "REDIRECT",
                    "--to-ports",
                    "15053",
                ],
            );
        }
    }
    let mut server = ZdsServer::bind();
    let (double, _peer, uid) = pod_with_proxies(&pn, &mut server).await;

    for (resolver, pod_ip, qtype, answer) in [
        (
            RESOLVER_V4,
            IpAddr::V4(PodAndNode::POD.v4),
            dns::TYPE_A,
            IpAddr::from(DEFAULT_DNS_ANSWER_V4),
        ),
        (
            RESOLVER_V6,
            IpAddr::V6(PodAndNode::POD.v6),
            dns::TYPE_AAAA,
            IpAddr::from(DEFAULT_DNS_ANSWER_V6),
        ),
    ] {
        // UDP, unconnected, as glibc and musl ask.
        let app = udp_socket_in(&pn.pod, SocketAddr::new(pod_ip, 0));
        let client = app.local_addr().unwrap();
        let query = dns::encode_query(0x5353, SVC, qtype).unwrap();
        let (response, from) = ask_udp(&app, resolver, &query).await;
        assert_eq!(
            from, resolver,
            "the answer appears to come from the resolver asked"
        );
        assert_answer(
            &dns::Response::parse(&response).unwrap(),
            0x5353,
            SVC,
            qtype,
            Some(answer),
        );
        let recorded = double.dns_queries().pop().unwrap();
        assert_eq!(
            (recorded.uid.as_str(), recorded.client),
            (uid.as_str(), client)
        );
        assert_eq!(recorded.transport, DnsTransport::Udp);
        let loopback = if resolver.is_ipv4() { DNS_V4 } else { DNS_V6 };
        assert_eq!(recorded.server, loopback);

        // TCP, as resolvers retry a truncated answer.
        let mut app = connect_from(&pn.pod, resolver).await.unwrap();
        assert_eq!(app.peer_addr().unwrap(), resolver);
        write_tcp_dns(&mut app, &query).await;
        assert_answer(
            &read_tcp_dns(&mut app).await,
            0x5353,
            SVC,
            qtype,
            Some(answer),
        );
        let recorded = double.dns_queries().pop().unwrap();
        assert_eq!(recorded.transport, DnsTransport::Tcp);
        assert_eq!(recorded.client, app.local_addr().unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_answers_dns_as_configured_and_prints_each_query() {
    let pn = PodAndNode::create().unwrap();
    let mut server = ZdsServer::bind();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ztunnel-double"))
        .arg("--socket")
        .arg(server.path())
        .args([
            "--dns-answer-v4",
            "10.9.9.9",
            "--dns-answer-v6",
            "fd00:9::9",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (lines_tx, mut lines) = mpsc::unbounded_channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let peer = server.accept().await;
    let uid = "dns-pod";
    assert_eq!(
        peer.add(uid, &File::open(pn.pod.path()).unwrap()).await,
        Ok(())
    );

    let app = udp_socket_in(&pn.pod, SocketAddr::new(DNS_V6.ip(), 0));
    let client = app.local_addr().unwrap();
    for (id, qtype, answer) in [
        (1, dns::TYPE_A, "10.9.9.9"),
        (2, dns::TYPE_AAAA, "fd00:9::9"),
    ] {
        let query = dns::encode_query(id, SVC, qtype).unwrap();
        let (response, _) = ask_udp(&app, DNS_V6, &query).await;
        let answer: IpAddr = answer.parse().unwrap();
        assert_answer(
            &dns::Response::parse(&response).unwrap(),
            id,
            SVC,
            qtype,
            Some(answer),
        );
    }
    // Up to the AAAA's line (a resent query would be printed again).
    let mut printed = Vec::new();
    while printed
        .last()
        .is_none_or(|l: &serde_json::Value| l["qtype"] != 28)
    {
        let line = tokio::time::timeout(WAIT, lines.recv())
            .await
            .expect("no output")
            .expect("output ended");
        let line: serde_json::Value = serde_json::from_str(&line).unwrap();
        if line["event"] == "dns_query" {
            printed.push(line);
        }
    }
    assert_eq!(
        printed[0],
        serde_json::json!({
            "event": "dns_query",
            "uid": uid,
            "transport": "udp",
            "client": client.to_string(),
            "server": DNS_V6.to_string(),
            "name": SVC,
            "qtype": 1,
            "answer": "10.9.9.9",
        })
    );
    assert_eq!(printed.last().unwrap()["answer"], "fd00:9::9");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
    reader.join().unwrap();
}

/// With `proxy_process`, the proxies run in a `ztunnel-proxies` child: the
/// pod's listeners are not this process's, traffic and DNS go through them
/// and their records come back, and a Del closes them there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_in_a_process_of_their_own_proxy_report_and_stop() {
    const SERVER_PORT: u16 = 9000;
    let pn = PodAndNode::create().unwrap();
    redirect_outbound_with_iptables(&pn.pod);
    let mut server_peers = echo_server_in(&pn.node, SERVER_PORT);
    let mut server = ZdsServer::bind();
    let config = ZtunnelConfig::default().proxy_process(env!("CARGO_BIN_EXE_ztunnel-proxies"));
    let (double, peer, uid) = pod_with_config(&pn.pod, &mut server, config).await;

    let ours = own_sockets(&socket_inodes_in(&pn.pod));
    assert!(
        !ours
            .iter()
            .any(|(local, _, _)| local.port() == OUTBOUND_PORT),
        "the listeners are the child's, not this process's: {ours:?}"
    );

    let destination = SocketAddr::new(IpAddr::V4(PodAndNode::NODE.v4), SERVER_PORT);
    let mut app = connect_from(&pn.pod, destination).await.unwrap();
    let client = app.local_addr().unwrap();
    assert_eq!(exchange(&mut app, b"hello").await, b"hello");
    tokio::time::timeout(WAIT, server_peers.recv())
        .await
        .unwrap();
    wait(&double, |s| s.proxied.iter().any(|c| c.client == client)).await;
    let record = double
        .proxied()
        .into_iter()
        .find(|c| c.client == client)
        .unwrap();
    assert_eq!(record.uid, uid);
    assert_eq!(record.listener_port, OUTBOUND_PORT);
    assert_eq!(record.original_dst, destination);
    assert_eq!(record.outcome, ConnectionOutcome::Proxied);

    let app_dns = udp_socket_in(&pn.pod, SocketAddr::new(DNS_V4.ip(), 0));
    let query = dns::encode_query(0x4242, SVC, dns::TYPE_A).unwrap();
    let (response, _) = ask_udp(&app_dns, DNS_V4, &query).await;
    let response = dns::Response::parse(&response).unwrap();
    assert_answer(
        &response,
        0x4242,
        SVC,
        dns::TYPE_A,
        Some(IpAddr::V4(DEFAULT_DNS_ANSWER_V4)),
    );
    wait(&double, |s| s.dns_queries.iter().any(|q| q.uid == uid)).await;

    assert_eq!(peer.del(&uid).await, Ok(()));
    expect_closed_by_peer(&mut app).await;
    wait_tcp_refused(
        &pn.pod,
        SocketAddr::new(IpAddr::V4(PodAndNode::POD.v4), OUTBOUND_PORT),
    )
    .await;
    assert!(double.workloads().is_empty());
}
