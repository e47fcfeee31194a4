//! The ZDS server against real SOCK_SEQPACKET peers with real netns fds:
//! snapshot, live updates, reconnect, takeover, NACKs, timeouts, garbage.

mod common;

use ambpf::zds::ZtunnelStatus;
use common::*;

#[tokio::test]
async fn snapshot_sends_every_pod_with_its_own_netns_then_snapshot_sent() {
    let server = Server::start(fast_config());
    let namespaces: Vec<_> = (0..3).map(|_| NetnsGuard::create("zds").unwrap()).collect();
    for (i, ns) in namespaces.iter().enumerate() {
        server.handle.upsert(pod(&format!("uid-{i}"), ns));
    }

    let peer = Peer::hello(&server.socket()).await;
    let snapshot = peer.take_snapshot().await;
    let got: Vec<_> = snapshot
        .iter()
        .map(|r| (r.kind(), r.uid().to_owned(), r.netns_inode()))
        .collect();
    let want: Vec<_> = namespaces
        .iter()
        .enumerate()
        .map(|(i, ns)| ("add", format!("uid-{i}"), inode(&ns.path())))
        .collect();
    assert_eq!(got, want);
    let Payload::Add(add) = &snapshot[0].payload else {
        unreachable!()
    };
    let info = add.workload_info.as_ref().unwrap();
    assert_eq!(
        (
            info.name.as_str(),
            info.namespace.as_str(),
            info.service_account.as_str()
        ),
        ("pod-uid-0", "shop", "web")
    );

    timeout(PATIENCE, server.handle.snapshot_acked())
        .await
        .unwrap();
    assert_eq!(server.stat(|s| &s.adds_acked), 3);
}

#[tokio::test]
async fn live_adds_and_dels_follow_the_snapshot_and_replay_on_reconnect() {
    let server = Server::start(fast_config());
    let a = NetnsGuard::create("zds").unwrap();
    let b = NetnsGuard::create("zds").unwrap();
    server.handle.upsert(pod("a", &a));

    let peer = Peer::hello(&server.socket()).await;
    assert_eq!(peer.take_snapshot().await.len(), 1);

    server.handle.upsert(pod("b", &b));
    let add = peer.recv_some().await;
    assert_eq!(
        (add.kind(), add.uid(), add.netns_inode()),
        ("add", "b", inode(&b.path()))
    );
    peer.ack().await;

    server.handle.remove("a");
    let del = peer.recv_some().await;
    assert_eq!((del.kind(), del.uid()), ("del", "a"));
    assert!(del.fds.is_empty(), "only Add carries an fd");
    peer.ack().await;

    // ztunnel restarts: the new connection gets the whole current set.
    drop(peer);
    let peer = Peer::hello(&server.socket()).await;
    let replay: Vec<_> = peer
        .take_snapshot()
        .await
        .iter()
        .map(|r| (r.kind(), r.uid().to_owned()))
        .collect();
    assert_eq!(replay, [("add", "b".to_owned())]);
}

#[tokio::test]
async fn a_new_path_to_the_same_netns_sends_nothing_and_a_new_netns_replaces() {
    let server = Server::start(fast_config());
    let a = NetnsGuard::create("zds").unwrap();
    let b = NetnsGuard::create("zds").unwrap();
    server.handle.upsert(pod("p", &a));
    let peer = Peer::hello(&server.socket()).await;
    assert_eq!(peer.take_snapshot().await.len(), 1);

    // The CNI announced `/run/netns/...`; the pod source later finds the same
    // namespace through a process of the pod.
    let mut process = std::process::Command::new("ip")
        .args(["netns", "exec", a.name(), "sleep", "30"])
        .spawn()
        .unwrap();
    let by_process = std::path::PathBuf::from(format!("/proc/{}/ns/net", process.id()));
    let deadline = std::time::Instant::now() + PATIENCE;
    while inode(&by_process) != inode(&a.path()) {
        assert!(
            std::time::Instant::now() < deadline,
            "sleep never entered the netns"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let mut moved = pod("p", &a);
    moved.netns = NetnsSource::Path(by_process);
    server.handle.upsert(moved);
    let quiet = peer.stays_quiet().await;
    process.kill().unwrap();
    process.wait().unwrap();
    assert!(quiet, "ztunnel got a second Add for the same namespace");

    // A recreated sandbox is a new namespace: ztunnel must replace the proxy.
    server.handle.upsert(pod("p", &b));
    let add = peer.recv_some().await;
    assert_eq!(
        (add.kind(), add.uid(), add.netns_inode()),
        ("add", "p", inode(&b.path()))
    );
    peer.ack().await;
}

/// A sandbox re-created at the same path is another namespace: once the
/// controller says which namespace it enrolled (`netns_inode`), ztunnel gets
/// a fresh Add with the new one; while the path names a namespace other than
/// the enrolled one, nothing is sent.
#[tokio::test]
async fn a_sandbox_recreated_at_the_same_path_gets_a_fresh_add_of_the_enrolled_namespace() {
    let server = Server::start(fast_config());
    let a = NetnsGuard::create("zds").unwrap();
    let first = inode(&a.path());
    let enrolled = |netns_inode| Workload {
        netns_inode: Some(netns_inode),
        ..pod("p", &a)
    };
    server.handle.upsert(enrolled(first));
    let peer = Peer::hello(&server.socket()).await;
    assert_eq!(peer.take_snapshot().await.len(), 1);

    // The runtime re-creates the sandbox's namespace at the same path (the
    // old one kept open, so its inode is not handed out again).
    let _old = std::fs::File::open(a.path()).unwrap();
    let ip = |args: &[&str]| {
        let status = std::process::Command::new("ip")
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "ip {args:?}");
    };
    ip(&["netns", "del", a.name()]);
    ip(&["netns", "add", a.name()]);
    let second = inode(&a.path());
    assert_ne!(first, second);

    // The pod source still names the path with the old namespace enrolled:
    // the new namespace is never sent without its redirection.
    server.handle.upsert(Workload {
        name: "renamed-to-change-the-set".to_owned(),
        ..enrolled(first)
    });
    assert!(peer.stays_quiet().await, "sent a namespace not enrolled");

    // Enrolled: ztunnel replaces the pod's proxy with one in the new one.
    server.handle.upsert(enrolled(second));
    let add = peer.recv_some().await;
    assert_eq!(
        (add.kind(), add.uid(), add.netns_inode()),
        ("add", "p", second)
    );
    peer.ack().await;
}

#[tokio::test]
async fn a_newer_ztunnel_takes_over_and_the_older_one_resumes_when_it_leaves() {
    let server = Server::start(fast_config());
    let a = NetnsGuard::create("zds").unwrap();
    let b = NetnsGuard::create("zds").unwrap();
    server.handle.upsert(pod("a", &a));

    let old = Peer::hello(&server.socket()).await;
    old.take_snapshot().await;
    let new = Peer::hello(&server.socket()).await;
    assert_eq!(new.take_snapshot().await.len(), 1);

    // Adds go to the newest connection only.
    server.handle.upsert(pod("b", &b));
    let add = new.recv_some().await;
    assert_eq!((add.kind(), add.uid()), ("add", "b"));
    new.ack().await;
    assert!(
        old.stays_quiet().await,
        "the older ztunnel must not get Adds"
    );

    // Deletes reach every ztunnel that has the pod.
    server.handle.remove("a");
    for peer in [&new, &old] {
        let del = peer.recv_some().await;
        assert_eq!((del.kind(), del.uid()), ("del", "a"));
        peer.ack().await;
    }

    // The newest leaves (rolling update aborted): the older one takes over
    // and is brought up to date.
    drop(new);
    let add = old.recv_some().await;
    assert_eq!(
        (add.kind(), add.uid(), add.netns_inode()),
        ("add", "b", inode(&b.path()))
    );
    old.ack().await;
}

/// What the server publishes about ztunnel's side of pod `uid`.
fn ztunnel_status(server: &Server, uid: &str) -> Option<ZtunnelStatus> {
    server.handle.ztunnel_pods().borrow().get(uid).copied()
}

async fn wait_for_status(server: &Server, uid: &str, status: ZtunnelStatus) {
    let mut pods = server.handle.ztunnel_pods();
    timeout(
        PATIENCE,
        pods.wait_for(|pods| pods.get(uid) == Some(&status)),
    )
    .await
    .unwrap_or_else(|_| panic!("{uid} never {status:?}: {:?}", ztunnel_status(server, uid)))
    .unwrap();
}

#[tokio::test]
async fn a_nack_is_counted_and_the_pod_retried() {
    let server = Server::start(fast_config());
    let a = NetnsGuard::create("zds").unwrap();
    server.handle.upsert(pod("a", &a));
    assert_eq!(ztunnel_status(&server, "a"), Some(ZtunnelStatus::Unserved));

    let peer = Peer::hello(&server.socket()).await;
    let first = peer.recv_some().await;
    assert_eq!((first.kind(), first.uid()), ("add", "a"));
    peer.nack("failure to start proxy: test").await;
    let snapshot_sent = peer.recv_some().await;
    assert_eq!(snapshot_sent.kind(), "snapshot_sent");
    assert_eq!(ztunnel_status(&server, "a"), Some(ZtunnelStatus::Refused));
    peer.ack().await;
    assert_eq!(server.stat(|s| &s.nacks), 1);

    let retry = peer.recv_some().await;
    assert_eq!(
        (retry.kind(), retry.uid(), retry.netns_inode()),
        ("add", "a", inode(&a.path()))
    );
    peer.ack().await;
    timeout(PATIENCE, async {
        while server.stat(|s| &s.adds_acked) < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    wait_for_status(&server, "a", ZtunnelStatus::Acked).await;

    // ztunnel going away does not undo its Ack: it keeps its proxies.
    drop(peer);
    timeout(PATIENCE, async {
        while server.stat(|s| &s.connections_active) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(ztunnel_status(&server, "a"), Some(ZtunnelStatus::Acked));
    // A pod that leaves is forgotten.
    server.handle.remove("a");
    assert_eq!(ztunnel_status(&server, "a"), None);
}

#[tokio::test]
async fn a_silent_peer_times_out_and_the_next_connection_gets_everything() {
    let server = Server::start(ZdsConfig {
        ack_timeout: Duration::from_millis(200),
        ..fast_config()
    });
    let a = NetnsGuard::create("zds").unwrap();
    server.handle.upsert(pod("a", &a));

    let silent = Peer::hello(&server.socket()).await;
    let add = silent.recv_some().await;
    assert_eq!(add.kind(), "add");
    // No ack: the server gives up on this connection.
    assert!(
        silent.recv().await.is_none(),
        "server should close a connection that stops acking"
    );
    assert_eq!(server.stat(|s| &s.ack_timeouts), 1);

    let peer = Peer::hello(&server.socket()).await;
    assert_eq!(peer.take_snapshot().await.len(), 1);
}

#[tokio::test]
async fn garbage_or_a_hang_up_mid_snapshot_loses_no_pod() {
    let server = Server::start(fast_config());
    let namespaces: Vec<_> = (0..3).map(|_| NetnsGuard::create("zds").unwrap()).collect();
    for (i, ns) in namespaces.iter().enumerate() {
        server.handle.upsert(pod(&format!("p{i}"), ns));
    }

    // Garbage instead of an ack.
    let rude = Peer::hello(&server.socket()).await;
    rude.recv_some().await;
    rude.send(&[0xff, 0xff, 0xff]).await;
    assert!(rude.recv().await.is_none());

    // Garbage instead of a hello.
    let rude = Peer::connect(&server.socket()).await;
    rude.send(b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(rude.recv().await.is_none());

    // A hang-up after one ack.
    let quitter = Peer::hello(&server.socket()).await;
    quitter.recv_some().await;
    quitter.ack().await;
    quitter.recv_some().await;
    drop(quitter);

    // The server kept serving and kept every pod.
    let peer = Peer::hello(&server.socket()).await;
    let uids: Vec<_> = peer
        .take_snapshot()
        .await
        .iter()
        .map(|r| r.uid().to_owned())
        .collect();
    assert_eq!(uids, ["p0", "p1", "p2"]);
    assert!(server.stat(|s| &s.peer_errors) >= 2);
}

#[tokio::test]
async fn a_pod_whose_netns_is_gone_is_kept_not_dropped() {
    let server = Server::start(fast_config());
    let a = NetnsGuard::create("zds").unwrap();
    server.handle.upsert(pod("live", &a));
    server.handle.upsert(Workload {
        netns: NetnsSource::Path("/run/netns/ambpf-vanished-netns".into()),
        netns_inode: None,
        ..pod("vanished", &a)
    });

    let peer = Peer::hello(&server.socket()).await;
    let snapshot: Vec<_> = peer
        .take_snapshot()
        .await
        .iter()
        .map(|r| (r.kind(), r.uid().to_owned(), r.fds.len()))
        .collect();
    assert_eq!(
        snapshot,
        [
            ("add", "live".to_owned(), 1),
            ("keep", "vanished".to_owned(), 0)
        ]
    );
    // ztunnel could not be given the vanished pod: refused, not acked.
    assert_eq!(ztunnel_status(&server, "live"), Some(ZtunnelStatus::Acked));
    wait_for_status(&server, "vanished", ZtunnelStatus::Refused).await;

    // ztunnel kept the pod: when it goes, ztunnel is told, or it would keep
    // its proxy (and the netns) until its next snapshot.
    server.handle.remove("vanished");
    let del = peer.recv_some().await;
    assert_eq!((del.kind(), del.uid()), ("del", "vanished"));
    peer.ack().await;
    assert!(peer.stays_quiet().await, "one Del, nothing else");
}

#[tokio::test]
async fn a_wrong_hello_version_closes_the_connection() {
    let server = Server::start(fast_config());
    let peer = Peer::connect(&server.socket()).await;
    peer.send(
        &zds::ZdsHello {
            version: zds::Version::NotUsed as i32,
        }
        .encode_to_vec(),
    )
    .await;
    assert!(peer.recv().await.is_none());
}
