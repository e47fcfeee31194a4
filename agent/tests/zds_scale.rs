//! 500 pods in one snapshot, then churn, with the process's fd count flat.
//! A test binary of its own: counting /proc/self/fd needs no other test
//! running in the same process.

mod common;

use common::*;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[tokio::test]
async fn five_hundred_pods_in_one_snapshot_without_leaking_fds() {
    let server = Server::start(fast_config());
    // Pods share a few namespaces: what is measured is the protocol, and
    // every Add still opens, sends and closes its own fd.
    let namespaces: Vec<_> = (0..4).map(|_| NetnsGuard::create("zds").unwrap()).collect();
    let before = open_fds();
    for i in 0..500 {
        server
            .handle
            .upsert(pod(&format!("pod-{i:04}"), &namespaces[i % 4]));
    }
    let peer = Peer::hello(&server.socket()).await;
    let snapshot = peer.take_snapshot().await;
    assert_eq!(snapshot.len(), 500);
    for (i, request) in snapshot.iter().enumerate() {
        assert_eq!(
            (request.kind(), request.uid()),
            ("add", format!("pod-{i:04}").as_str())
        );
        assert_eq!(request.netns_inode(), inode(&namespaces[i % 4].path()));
    }
    drop(snapshot); // the peer's copies of the fds

    // Churn: many more adds and dels.
    for round in 0..5 {
        for i in 0..50 {
            server.handle.remove(&format!("pod-{i:04}"));
        }
        for _ in 0..50 {
            let del = peer.recv_some().await;
            assert_eq!(del.kind(), "del", "round {round}");
            peer.ack().await;
        }
        for i in 0..50 {
            server
                .handle
                .upsert(pod(&format!("pod-{i:04}"), &namespaces[(i + round) % 4]));
        }
        for _ in 0..50 {
            let add = peer.recv_some().await;
            assert_eq!(add.kind(), "add", "round {round}");
            peer.ack().await;
        }
    }
    // The peer socket and the server's are the only new fds.
    let after = open_fds();
    assert!(after <= before + 4, "fds grew from {before} to {after}");
}
