//! Privileged: a CNI ADD answers only once ztunnel holds the pod, as Istio's
//! node agent's does, in every redirection mode. The real `ambpf-cni`
//! binary posts each pod to the agent's endpoint, served here by a real
//! `Controller` on its own thread over the mode's redirection, and the
//! ztunnel double is unkind: each pod's proxy starts only after a delay,
//! one at a time, as real ztunnel's do under load; or it NACKs; or no
//! ztunnel is connected; or a peer closes before acking.

use std::{
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::Output,
    sync::Arc,
    time::{Duration, Instant},
};

use ambpf::{
    cni::{self, server::Endpoint},
    controller::{Controller, SourcePods},
    redirect::RedirectMode,
    zds::{ZdsConfig, ZdsHandle},
};
use ambpf_proto::{Message as _, zds};
use ambpf_testbed::{
    BpffsMount, CgroupGuard,
    cluster::Cluster,
    ztunnel::{ConnectionOutcome, ZtunnelConfig, ZtunnelDouble},
};
use serde_json::Value;

mod common;
use common::Server;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use modes::SERIAL;
use pod_fixture::{EchoServer, PATIENCE, PEER_PORT, node_redirection};
mod plugin_runner;
use plugin_runner::*;

/// How long the double takes to start each pod's proxy.
const PROXY_START: Duration = Duration::from_millis(300);

/// A node whose agent serves the CNI endpoint and ZDS, with no ztunnel yet.
struct CniNode {
    cluster: Cluster,
    cni_socket: PathBuf,
    remote: EchoServer,
    /// Dropped first: the controller's thread ends with it.
    pods: Option<tokio::sync::watch::Sender<Arc<SourcePods>>>,
    /// The agent shutting down, as `ambpf run` tells its CNI endpoint.
    shutdown: tokio::sync::watch::Sender<bool>,
    cni_server: Option<tokio::task::JoinHandle<()>>,
    controller: Option<std::thread::JoinHandle<()>>,
    /// Its dir holds the CNI socket too: dropped after the CNI server.
    zds: Server,
    _bpffs: Option<BpffsMount>,
}

impl CniNode {
    fn start(mode: RedirectMode, pods: u16, cgroup: Option<&CgroupGuard>) -> Self {
        Self::start_with(mode, pods, cgroup, ZdsConfig::default().ack_timeout)
    }

    /// [`CniNode::start`], waiting `ack_timeout` for each of ztunnel's Acks.
    fn start_with(
        mode: RedirectMode,
        pods: u16,
        cgroup: Option<&CgroupGuard>,
        ack_timeout: Duration,
    ) -> Self {
        let cluster = Cluster::create(pods).unwrap();
        let (redirection, bpffs, _) = node_redirection(mode, &cluster, cgroup);
        let zds = Server::start(ZdsConfig {
            ack_timeout,
            ..Default::default()
        });
        if let Some(bpffs) = &bpffs {
            zds.record_ztunnel_processes(ambpf::bpf::PinLayout::new(bpffs.path().join("ambpf")));
        }

        let (pods_tx, pods_rx) = tokio::sync::watch::channel(Arc::default());
        let (requests_tx, requests_rx) = tokio::sync::mpsc::channel(64);
        let controller = Controller::new(redirection, zds.handle.clone(), true)
            .spawn(pods_rx, Some(requests_rx))
            .unwrap();
        let cni_socket = zds.dir().join("pluginevent.sock");
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        let endpoint = Endpoint {
            controller: requests_tx,
            zds: zds.handle.clone(),
            selection: cni::selection::PodSelection::Every,
            stats: Arc::default(),
            shutdown: shutdown_rx,
            standby: Default::default(),
        };
        let cni_server = tokio::spawn(cni::server::serve(
            cni::server::bind(&cni_socket).unwrap(),
            endpoint,
        ));
        let remote = &cluster.remote;
        let remote = EchoServer::start(
            &remote.ns,
            SocketAddr::new(remote.addrs.v4.into(), PEER_PORT),
        );
        Self {
            cluster,
            zds,
            cni_socket,
            remote,
            pods: Some(pods_tx),
            shutdown,
            cni_server: Some(cni_server),
            controller: Some(controller),
            _bpffs: bpffs,
        }
    }

    fn uid(i: usize) -> String {
        format!("pod-{i}-uid")
    }

    /// The plugin's ADD of pod `i`, as a runtime runs it, on a thread.
    fn add(&self, i: usize) -> tokio::task::JoinHandle<Output> {
        let pod = &self.cluster.pods[i];
        let (netns, socket) = (pod.ns.path(), self.cni_socket.clone());
        let args = k8s_args("shop", &format!("app-{i}"), &Self::uid(i));
        let prev = prev_result(&pod.addrs.v4.to_string());
        tokio::task::spawn_blocking(move || plugin_for("ADD", &netns, &args, &socket, &prev))
    }

    /// The remote echo server's address.
    fn remote(&self) -> SocketAddr {
        SocketAddr::new(self.cluster.remote.addrs.v4.into(), PEER_PORT)
    }

    /// Connects from pod `i` to the remote; the outcome of `connect()`.
    fn connect_from(&self, i: usize) -> std::io::Result<TcpStream> {
        let to = self.remote();
        self.cluster.pods[i]
            .ns
            .run(|| TcpStream::connect_timeout(&to, PATIENCE))
            .unwrap()
    }

    /// Whether pod `i`'s new connections go direct: they reach the remote
    /// from the pod's own address while no ztunnel proxy listens in it, so
    /// nothing of its capture is left (a captured one would be refused).
    fn goes_direct(&self, i: usize) -> bool {
        let before = self.remote.seen.lock().unwrap().len();
        if tokio::task::block_in_place(|| self.connect_from(i)).is_err() {
            return false;
        }
        // The server records its peer once its task has accepted.
        let deadline = Instant::now() + PATIENCE;
        while self.remote.seen.lock().unwrap().len() == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let seen = self.remote.seen.lock().unwrap();
        seen.get(before)
            .is_some_and(|peer| peer.ip() == std::net::IpAddr::from(self.cluster.pods[i].addrs.v4))
    }
}

impl Drop for CniNode {
    fn drop(&mut self) {
        self.zds.stop();
        if let Some(task) = &self.cni_server {
            task.abort();
        }
        drop(self.pods.take());
        if let Some(controller) = self.controller.take() {
            let _ = controller.join();
        }
    }
}

/// The CNI error a failed plugin run printed: (code, msg and details).
fn cni_error(output: &Output) -> (u64, String) {
    assert!(!output.status.success(), "the ADD succeeded");
    let error: Value = stdout_json(output);
    let code = error["code"].as_u64().unwrap();
    (code, format!("{}: {}", error["msg"], error["details"]))
}

in_all_modes!(
    apps_connecting_the_instant_add_returns_find_ztunnel_listening,
    |mode, cgroup| {
        const PODS: usize = 50;
        let node = Arc::new(CniNode::start(mode, PODS as u16, cgroup));
        let config = ZtunnelConfig::default().proxy_start_delay(PROXY_START);
        let ztunnel = ZtunnelDouble::connect_with_retry(node.zds.socket(), config);
        ztunnel.wait_until(|s| s.ready, PATIENCE).await.unwrap();

        // Every pod starts at once, as on a node filling up; each app
        // connects at its first instruction after ADD returns.
        let started = Instant::now();
        let runs: Vec<_> = (0..PODS)
            .map(|i| {
                let node = node.clone();
                tokio::task::spawn_blocking(move || {
                    let pod = &node.cluster.pods[i];
                    let args = k8s_args("shop", &format!("app-{i}"), &CniNode::uid(i));
                    let prev = prev_result(&pod.addrs.v4.to_string());
                    let added = plugin_for("ADD", &pod.ns.path(), &args, &node.cni_socket, &prev);
                    let first = node.connect_from(i);
                    (added, first.map(drop))
                })
            })
            .collect();
        let mut refused = Vec::new();
        for (i, run) in runs.into_iter().enumerate() {
            let (added, first) = run.await.unwrap();
            assert!(
                added.status.success(),
                "pod {i}: {}",
                String::from_utf8_lossy(&added.stdout)
            );
            if let Err(e) = first {
                refused.push(format!("pod {i}: {e}"));
            }
        }
        assert!(refused.is_empty(), "first connections failed: {refused:?}");
        // Each ADD waited for its pod's proxy: together, at least the
        // double's start-up times one after another.
        assert!(started.elapsed() >= PROXY_START * PODS as u32);
        // And every first connection went through ztunnel.
        ztunnel
            .wait_until(
                |s| {
                    s.proxied
                        .iter()
                        .filter(|c| {
                            c.listener_port == 15001 && c.outcome == ConnectionOutcome::Proxied
                        })
                        .count()
                        >= PODS
                },
                PATIENCE,
            )
            .await
            .unwrap();
    }
);

in_all_modes!(
    with_no_ztunnel_an_add_fails_for_retry_and_leaves_nothing_until_ztunnel_connects,
    |mode, cgroup| {
        let node = CniNode::start(mode, 1, cgroup);
        let failed = node.add(0).await.unwrap();
        let (code, text) = cni_error(&failed);
        assert_eq!(code, 11, "try again later: {text}");
        assert!(text.contains("no ztunnel is connected"), "{text}");
        assert!(node.zds.handle.workloads().is_empty());
        assert!(node.goes_direct(0), "the failed pod keeps no capture");

        let ztunnel = ZtunnelDouble::connect_with_retry(
            node.zds.socket(),
            ZtunnelConfig::default().proxy_start_delay(PROXY_START),
        );
        ztunnel.wait_until(|s| s.ready, PATIENCE).await.unwrap();
        let retried = node.add(0).await.unwrap();
        assert!(
            retried.status.success(),
            "{}",
            String::from_utf8_lossy(&retried.stdout)
        );
        assert!(ztunnel.workloads().contains_key(&CniNode::uid(0)));
        tokio::task::block_in_place(|| node.connect_from(0)).unwrap();
    }
);

in_all_modes!(a_nack_fails_the_add_and_leaves_nothing, |mode, cgroup| {
    let node = CniNode::start(mode, 1, cgroup);
    let config = ZtunnelConfig::default().nack(CniNode::uid(0));
    let ztunnel = ZtunnelDouble::connect_with_retry(node.zds.socket(), config);
    ztunnel.wait_until(|s| s.ready, PATIENCE).await.unwrap();
    let failed = node.add(0).await.unwrap();
    let (code, text) = cni_error(&failed);
    assert_eq!(code, 11, "{text}");
    assert!(text.contains("ztunnel refused the pod"), "{text}");
    assert!(text.contains("failure to start proxy"), "{text}");
    assert!(node.zds.handle.workloads().is_empty());
    assert!(node.goes_direct(0), "the failed pod keeps no capture");
});

/// A misbehaving ztunnel: says hello, acks until the first Add, and then
/// neither acks nor reads. Returns once that Add has arrived, with the
/// connection, which closes when dropped.
async fn peer_that_stops_at_the_first_add(
    socket: &std::path::Path,
) -> tokio_seqpacket::UnixSeqpacket {
    let peer = tokio_seqpacket::UnixSeqpacket::connect(socket)
        .await
        .unwrap();
    peer.send(&zds::ZdsHello::v1().encode_to_vec())
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    loop {
        let len = peer.recv(&mut buf).await.unwrap().bytes_read();
        let request = zds::WorkloadRequest::decode(&buf[..len]).unwrap();
        if matches!(
            request.payload,
            Some(zds::workload_request::Payload::Add(_))
        ) {
            return peer;
        }
        let ack = zds::WorkloadResponse::ack(String::new()).encode_to_vec();
        peer.send(&ack).await.unwrap();
    }
}

/// An eBPF-mode node whose pod 0's ADD is under way, its Add sent to a
/// ztunnel that neither acks nor closes (the agent waits 60 s for an Ack,
/// longer than the plugin): the node, the ADD, and that ztunnel.
async fn add_left_unacked(
    cgroup: &CgroupGuard,
) -> (
    CniNode,
    tokio::task::JoinHandle<Output>,
    tokio_seqpacket::UnixSeqpacket,
) {
    let patient = Duration::from_secs(60);
    let node = CniNode::start_with(RedirectMode::Ebpf, 1, Some(cgroup), patient);
    let socket = node.zds.socket();
    let peer = tokio::spawn(async move { peer_that_stops_at_the_first_add(&socket).await });
    snapshot_taken(&node.zds.handle).await;
    let add = node.add(0);
    let peer = peer.await.unwrap();
    (node, add, peer)
}

/// Waits until some ztunnel connection has acked its snapshot.
async fn snapshot_taken(zds: &ZdsHandle) {
    tokio::time::timeout(PATIENCE, zds.snapshot_acked())
        .await
        .expect("no snapshot acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ztunnel_closing_between_the_add_and_its_ack_fails_the_add() {
    let _serial = SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let node = CniNode::start(RedirectMode::Ebpf, 1, Some(&cgroup));
    let socket = node.zds.socket();
    let peer = tokio::spawn(async move { peer_that_stops_at_the_first_add(&socket).await });
    snapshot_taken(&node.zds.handle).await;
    let started = Instant::now();
    let add = node.add(0);
    // ztunnel goes away with the Add unacked.
    drop(peer.await.unwrap());
    let failed = add.await.unwrap();
    let (code, text) = cni_error(&failed);
    assert_eq!(code, 11, "{text}");
    assert!(text.contains("closed before acking"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered at once"
    );
    assert!(node.zds.handle.workloads().is_empty());
    assert!(node.goes_direct(0), "the failed pod keeps no capture");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_adds_for_one_sandbox_both_answer_once_ztunnel_holds_it() {
    let _serial = SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let node = CniNode::start(RedirectMode::Ebpf, 1, Some(&cgroup));
    let config = ZtunnelConfig::default().proxy_start_delay(PROXY_START);
    let ztunnel = ZtunnelDouble::connect_with_retry(node.zds.socket(), config);
    ztunnel.wait_until(|s| s.ready, PATIENCE).await.unwrap();
    let (first, second) = (node.add(0), node.add(0));
    for output in [first.await.unwrap(), second.await.unwrap()] {
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stdout)
        );
    }
    let adds = ztunnel
        .events()
        .into_iter()
        .filter(|e| matches!(e, ambpf_testbed::ztunnel::ZdsEvent::Add { .. }))
        .count();
    assert_eq!(adds, 1, "one sandbox, one Add");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_add_whose_sandbox_is_deleted_while_it_waits_fails_without_hanging() {
    let _serial = SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let started = Instant::now();
    let (mut node, add, _peer) = add_left_unacked(&cgroup).await;
    // The runtime tears the sandbox down meanwhile.
    node.cluster.recycle_pod(0).unwrap();
    let failed = add.await.unwrap();
    let (code, text) = cni_error(&failed);
    assert_eq!(code, 11, "{text}");
    assert!(text.contains("left the mesh"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "answered before the plugin's timeout"
    );
    assert!(node.zds.handle.workloads().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_add_waiting_for_ztunnel_when_the_agent_shuts_down_is_answered_and_cleaned_up() {
    let _serial = SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let (mut node, add, _peer) = add_left_unacked(&cgroup).await;
    // The Add is out, unacked; the agent stops, as `ambpf run` does on
    // SIGTERM: the endpoint answers what is in flight, then returns.
    let stopping = Instant::now();
    node.shutdown.send_replace(true);
    tokio::time::timeout(PATIENCE, node.cni_server.take().unwrap())
        .await
        .expect("the endpoint drains")
        .unwrap();
    let failed = add.await.unwrap();
    let (code, text) = cni_error(&failed);
    assert_eq!(code, 11, "{text}");
    assert!(text.contains("shutting down"), "{text}");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "answered at once"
    );
    assert!(node.zds.handle.workloads().is_empty());
    assert!(node.goes_direct(0), "the abandoned pod keeps no capture");
}
