//! Privileged: a real container runtime drives ambpf. The testbed's
//! containerd node ([`Node`]: containerd 1.6 with its CRI plugin, the real
//! `bridge`/`host-local`/`loopback` CNI plugins, `ambpf-cni` chained in by
//! `ambpf cni-install`) creates pods the way kubelet does, the same pods are
//! in the test API server, and the real `ambpf run --pod-source kube` runs in
//! the node's network namespace with the ztunnel double connected. In every
//! redirection mode.

use std::{
    net::SocketAddr,
    os::{fd::AsFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use ambpf::bpf::{PinLayout, inspect};
use ambpf_testbed::{
    BpffsMount, CgroupGuard,
    apiserver::ApiServer,
    node::{Cri, Node, NodeConfig, PodSpec, RunningPod, namespace_object},
    unique_name,
    ztunnel::{ConnectionOutcome, ZdsEvent, ZtunnelConfig, ZtunnelDouble, ZtunnelState},
};
use serde_json::{Value, json};

const NODE_NAME: &str = "node-1";
/// The node's address on its pods' bridge (the first of `NodeConfig`'s subnet).
const NODE_BRIDGE_IP: &str = "10.88.0.1";
const PATIENCE: Duration = Duration::from_secs(20);

/// A TCP server in the node's namespace, the destination of the test apps'
/// first connection: records each peer, says hello and closes.
struct Upstream {
    port: u16,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    fn start(node: &Node) -> Self {
        let listener = node
            .netns
            .run(|| std::net::TcpListener::bind("0.0.0.0:0"))
            .unwrap()
            .unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let peers = Arc::new(Mutex::new(Vec::new()));
        let seen = peers.clone();
        let task = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt as _;
            while let Ok((mut conn, peer)) = listener.accept().await {
                seen.lock().unwrap().push(peer);
                let _ = conn.write_all(b"hello\n").await;
            }
        });
        Self { port, peers, task }
    }

    fn addr(&self) -> SocketAddr {
        format!("{NODE_BRIDGE_IP}:{}", self.port).parse().unwrap()
    }

    /// The app's command: connect to this server as its first instruction.
    fn client_command(&self) -> Vec<String> {
        ["/bin/busybox", "nc", NODE_BRIDGE_IP, &self.port.to_string()]
            .map(str::to_owned)
            .to_vec()
    }

    async fn wait_for_peer(&self, ip: &str) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while !self
            .peers
            .lock()
            .unwrap()
            .iter()
            .any(|p| p.ip().to_string() == ip)
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no connection from {ip}: {:?}",
                self.peers.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The agent, run as on a node (in the node's network namespace), its log
/// in a file; killed on drop.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The ztunnel double is this process, and a process is in one cgroup at a
/// time (see `Setup::ztunnel_cgroup`): one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A node with containerd, the API server, the agent's pins and the double.
/// Field order is drop order: the agent before its pins, the node last.
struct Setup {
    mode: &'static str,
    agent: Option<Agent>,
    ztunnel: ZtunnelDouble,
    api: ApiServer,
    upstream: Upstream,
    cri: Cri,
    dir: PathBuf,
    pins: PinLayout,
    _bpffs: BpffsMount,
    node: Node,
}

impl Setup {
    /// The node, the API server with the `mesh` (ambient) and `plain`
    /// namespaces, and the double waiting for the agent; no agent yet.
    async fn create(mode: &'static str) -> Self {
        let node = Node::start(NodeConfig::default()).unwrap();
        let cri = node.cri().await.unwrap();
        let bpffs = BpffsMount::create().unwrap();
        let pins = PinLayout::new(bpffs.path().join("ambpf"));
        let dir = std::env::temp_dir().join(format!("ambpf-node-test-{}", unique_name("")));
        std::fs::create_dir_all(&dir).unwrap();
        // The API server listens on the node namespace's loopback, where
        // the agent runs.
        let api = ApiServer::start_in(&node.netns.path()).await.unwrap();
        std::fs::write(dir.join("kubeconfig"), api.kubeconfig()).unwrap();
        api.apply("namespaces", namespace_object("mesh", true));
        api.apply("namespaces", namespace_object("plain", false));
        let ztunnel =
            ZtunnelDouble::connect_with_retry(dir.join("ztunnel.sock"), ZtunnelConfig::default());
        let upstream = Upstream::start(&node);
        Self {
            mode,
            agent: None,
            ztunnel,
            api,
            upstream,
            cri,
            dir,
            pins,
            _bpffs: bpffs,
            node,
        }
    }

    /// As ztunnel runs in a pod of the node, the double (this process) must
    /// run in a cgroup below the node's, where the agent's socket programs
    /// are attached, for its sockets' `SO_ORIGINAL_DST` to be answered.
    fn ztunnel_cgroup(&self) -> CgroupGuard {
        CgroupGuard::create_in(&self.node.cgroup_v2(), "ztunnel").unwrap()
    }

    fn cni_socket(&self) -> PathBuf {
        self.dir.join("pluginevent.sock")
    }

    /// Starts `ambpf run` and waits for its CNI endpoint.
    async fn start_agent(&mut self) {
        let log = self.dir.join("agent.log");
        let node_ns = std::fs::File::open(self.node.netns.path()).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_ambpf"));
        command
            .arg("--pin-root")
            .arg(self.pins.root())
            .args(["run", "--pod-source", "kube", "--node-name", NODE_NAME])
            .args(["--redirect-mode", self.mode])
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .arg("--cni-socket")
            .arg(self.cni_socket())
            .arg("--zds-socket")
            .arg(self.dir.join("ztunnel.sock"))
            .arg("--cgroup")
            .arg(self.node.cgroup_v2())
            .args(["--health-listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        // SAFETY: setns is async-signal-safe, and `node_ns` outlives the spawn.
        unsafe {
            command.pre_exec(move || {
                nix::sched::setns(node_ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
        let mut agent = Agent {
            child: command.spawn().unwrap(),
            log,
        };
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while std::os::unix::net::UnixStream::connect(self.cni_socket()).is_err() {
            if let Some(status) = agent.child.try_wait().unwrap() {
                panic!("the agent exited ({status}):\n{}", agent.log());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no CNI endpoint:\n{}",
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.agent = Some(agent);
    }

    /// Kills the agent (SIGKILL): pins, filters and rules stay.
    fn kill_agent(&mut self) {
        drop(self.agent.take());
    }

    fn agent_log(&self) -> String {
        self.agent.as_ref().map(Agent::log).unwrap_or_default()
    }

    /// `ambpf cni-install` once, chaining the plugin as on a node.
    fn cni_install(&self) {
        let out = self
            .node
            .cni_install(
                Path::new(env!("CARGO_BIN_EXE_ambpf")),
                Path::new(env!("CARGO_BIN_EXE_ambpf-cni")),
                &self.cni_socket(),
            )
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(chained(&self.node), ["bridge", "ambpf-cni"]);
    }

    /// `ambpf uninstall` on the node, as on a node whose agent is gone. It
    /// sweeps every namespace it can see, so it runs in a mount and PID
    /// namespace of its own that shows it no other test's.
    fn uninstall(&self) -> Output {
        Command::new("nsenter")
            .arg(format!("--net={}", self.node.netns.path().display()))
            .args(["unshare", "--mount", "--propagation", "private"])
            .args(["--pid", "--fork", "--mount-proc", "sh", "-c"])
            .arg(r#"mount -t tmpfs ambpf-test /run/netns && exec "$@""#)
            .arg("sh")
            .arg(env!("CARGO_BIN_EXE_ambpf"))
            .arg("--pin-root")
            .arg(self.pins.root())
            .args(["uninstall", "--redirect-mode", self.mode])
            .arg("--cni-conf-dir")
            .arg(self.node.cni_conf_dir())
            .arg("--cni-bin-dir")
            .arg(self.node.cni_bin_dir())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("NODE_NAME")
            .output()
            .unwrap()
    }

    /// Puts `pod` in the API server (not yet running), as the scheduler
    /// leaves it for kubelet.
    fn schedule(&self, pod: &PodSpec) {
        self.api.apply("pods", pod.object(NODE_NAME));
    }

    /// kubelet's status update once the sandbox has its IP.
    fn report_running(&self, pod: &PodSpec, ip: &str) {
        let mut object = pod.object(NODE_NAME);
        object["status"] = json!({
            "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }],
        });
        self.api.apply("pods", object);
    }

    /// Starts `pod` with its app connecting to the upstream at once.
    async fn start_connecting_pod(&self, pod: &PodSpec) -> RunningPod {
        let command = self.upstream.client_command();
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let running = self
            .cri
            .start_pod(pod, &command)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}\n{}", self.agent_log(), self.node.log()));
        self.report_running(pod, &running.ip);
        running
    }

    /// Waits until the double proxied a connection of `pod` to the upstream
    /// through its outbound listener.
    async fn wait_captured(&self, pod: &PodSpec) {
        let (uid, upstream) = (pod.uid.clone(), self.upstream.addr());
        self.ztunnel
            .wait_until(
                |s| {
                    s.proxied.iter().any(|c| {
                        c.uid == uid
                            && c.listener_port == 15001
                            && c.original_dst == upstream
                            && c.outcome == ConnectionOutcome::Proxied
                    })
                },
                PATIENCE,
            )
            .await
            .unwrap_or_else(|e| panic!("{} not captured: {e}\n{}", pod.uid, self.agent_log()));
    }

    fn enrolled_inodes(&self) -> Vec<u64> {
        let status = inspect::read_status(&self.pins).unwrap();
        status.pods.iter().map(|p| p.netns_inode).collect()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The plugin types of the node's conflist, in order.
fn chained(node: &Node) -> Vec<String> {
    let text = std::fs::read_to_string(node.conflist()).unwrap();
    let list: Value = serde_json::from_str(&text).unwrap();
    list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The inode of the one pod network namespace containerd holds.
fn only_pod_netns(node: &Node) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let entries: Vec<_> = std::fs::read_dir(node.netns_dir())
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    std::fs::metadata(entries[0].path()).unwrap().ino()
}

/// Whether the host-local IPAM store still reserves `ip`.
fn reserved(node: &Node, ip: &str) -> bool {
    node.ipam_dir().join(node.network_name()).join(ip).exists()
}

/// The members of an ipset in the node's namespace (iptables mode).
fn ipset_members(node: &Node, set: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", node.netns.name(), "ipset", "list", set])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The addresses in a probe set of the node's host table (nftables mode),
/// read with `nft -j`.
fn nft_probe_members(node: &Node, set: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            node.netns.name(),
            "nft",
            "-j",
            "list",
            "set",
        ])
        .args(["inet", "istio-ambient-nat", set])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut members = Vec::new();
    for object in listing["nftables"].as_array().unwrap() {
        for elem in object["set"]["elem"].as_array().into_iter().flatten() {
            // `{"elem": {"val": ..., "comment": ...}}` with a comment.
            let val = elem.get("elem").map_or(elem, |inner| &inner["val"]);
            members.push(val.as_str().unwrap().to_owned());
        }
    }
    members
}

async fn pods_from_the_runtime_are_captured_discovered_and_removed_cleanly(mode: &'static str) {
    if let Some(why) = ambpf_testbed::node::containers_cannot_start() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut setup = Setup::create(mode).await;
    let ztunnel_cgroup = setup.ztunnel_cgroup();
    let _in_node = ztunnel_cgroup.enter_process().unwrap();
    let ebpf = mode == "ebpf";

    // A pod that runs before ambpf is installed: the agent finds its
    // sandbox in /proc by the real cgroup path containerd gave it.
    let old = PodSpec::new("mesh", "old");
    setup.schedule(&old);
    let old_run = setup
        .cri
        .start_pod(&old, &["/bin/busybox", "sleep", "600"])
        .await
        .unwrap();
    setup.report_running(&old, &old_run.ip);
    let old_netns = only_pod_netns(&setup.node);
    setup.start_agent().await;
    setup.cni_install();
    let uid = old.uid.clone();
    setup
        .ztunnel
        .wait_until(
            |s| {
                s.workloads
                    .get(&uid)
                    .is_some_and(|w| w.netns_inode == old_netns)
            },
            PATIENCE,
        )
        .await
        .unwrap_or_else(|e| panic!("the running pod was not found: {e}\n{}", setup.agent_log()));
    if ebpf {
        assert_eq!(setup.enrolled_inodes(), [old_netns]);
    }

    // Its app restarts inside the same sandbox (a new container, attempt 1)
    // and connects at once: captured, and ztunnel is told of no change.
    setup
        .cri
        .remove_container(&old_run.container_id)
        .await
        .unwrap();
    let command = setup.upstream.client_command();
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    setup
        .cri
        .start_container(&old, &old_run.sandbox_id, "app", 1, &command)
        .await
        .unwrap();
    setup.wait_captured(&old).await;
    setup.upstream.wait_for_peer(&old_run.ip).await;
    let adds_and_dels = |uid: &str| {
        setup
            .ztunnel
            .events()
            .into_iter()
            .filter(|e| match e {
                ZdsEvent::Add { uid: u, .. } | ZdsEvent::Del { uid: u } => u == uid,
                _ => false,
            })
            .count()
    };
    assert_eq!(adds_and_dels(&old.uid), 1, "{:?}", setup.ztunnel.events());

    // A new ambient pod: its app's first connect already goes through
    // ztunnel (the sandbox's CNI ADD waited for the redirection).
    let web = PodSpec::new("mesh", "web");
    setup.schedule(&web);
    let web_run = setup.start_connecting_pod(&web).await;
    setup.wait_captured(&web).await;
    setup.upstream.wait_for_peer(&web_run.ip).await;
    if ebpf {
        assert_eq!(setup.enrolled_inodes().len(), 2);
    }

    // A pod that is not ambient starts and connects directly, untouched.
    let plain = PodSpec::new("plain", "app");
    setup.schedule(&plain);
    let plain_run = setup.start_connecting_pod(&plain).await;
    setup.upstream.wait_for_peer(&plain_run.ip).await;
    assert!(!setup.ztunnel.workloads().contains_key(&plain.uid));
    assert!(setup.ztunnel.proxied().iter().all(|c| c.uid != plain.uid));
    if ebpf {
        assert_eq!(setup.enrolled_inodes().len(), 2);
    }

    // Removed as kubelet removes a pod (StopPodSandbox: CNI DEL, then
    // RemovePodSandbox) and deleted from the API server: nothing of it is
    // left in the runtime, the IPAM store, the agent's state or ztunnel's.
    let web_netns_count = std::fs::read_dir(setup.node.netns_dir()).unwrap().count();
    setup.cri.remove_pod(&web_run.sandbox_id).await.unwrap();
    setup.api.delete("pods", "mesh", "web");
    let uid = web.uid.clone();
    setup
        .ztunnel
        .wait_until(|s| !s.workloads.contains_key(&uid), PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("web stayed with ztunnel: {e}\n{}", setup.agent_log()));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while ebpf && setup.enrolled_inodes() != [old_netns] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still enrolled: {:?}\n{}",
            setup.enrolled_inodes(),
            setup.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        std::fs::read_dir(setup.node.netns_dir()).unwrap().count(),
        web_netns_count - 1
    );
    assert!(!reserved(&setup.node, &web_run.ip));
    assert!(reserved(&setup.node, &old_run.ip));
    if mode == "iptables" {
        let members = ipset_members(&setup.node, "istio-inpod-probes-v4");
        assert!(!members.contains(&format!("{}\n", web_run.ip)), "{members}");
        assert!(members.contains(&old_run.ip), "{members}");
    }
    if mode == "nftables" {
        let members = nft_probe_members(&setup.node, "istio-inpod-probes-v4");
        assert!(!members.contains(&web_run.ip), "{members:?}");
        assert!(members.contains(&old_run.ip), "{members:?}");
    }
    if ebpf {
        // The pinned state agrees with the kernel (iptables mode pins nothing,
        // and `status` says so with an error).
        let status = Command::new(env!("CARGO_BIN_EXE_ambpf"))
            .arg("--pin-root")
            .arg(setup.pins.root())
            .args(["status", "--check"])
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}{}",
            String::from_utf8_lossy(&status.stdout),
            String::from_utf8_lossy(&status.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ebpf_pods_from_the_runtime_are_captured_discovered_and_removed_cleanly() {
    pods_from_the_runtime_are_captured_discovered_and_removed_cleanly("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_pods_from_the_runtime_are_captured_discovered_and_removed_cleanly() {
    pods_from_the_runtime_are_captured_discovered_and_removed_cleanly("iptables").await;
}

async fn without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains(
    mode: &'static str,
) {
    if let Some(why) = ambpf_testbed::node::containers_cannot_start() {
        eprintln!("skipped: {why}");
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut setup = Setup::create(mode).await;
    let ztunnel_cgroup = setup.ztunnel_cgroup();
    let _in_node = ztunnel_cgroup.enter_process().unwrap();
    setup.start_agent().await;
    setup.cni_install();

    // The agent is down: the sandbox's network setup fails with ambpf's
    // reason, and containerd keeps no half-made sandbox.
    setup.kill_agent();
    let web = PodSpec::new("mesh", "web");
    setup.schedule(&web);
    let error = setup.cri.run_sandbox(&web).await.unwrap_err();
    let message = error.message();
    assert!(
        message.contains("ambpf-cni") && message.contains("the ambpf agent is unreachable"),
        "{message}"
    );
    assert!(setup.cri.sandboxes().await.unwrap().is_empty());
    assert_eq!(
        std::fs::read_dir(setup.node.netns_dir()).unwrap().count(),
        0
    );

    // Back: kubelet's retry succeeds and the app is captured from its first
    // connect. ztunnel is reconnected first, as on a node where it runs: a
    // CNI ADD while no ztunnel is connected enrols the pod for a ztunnel
    // that is not there to proxy it yet.
    let sessions =
        |state: &ZtunnelState| state.connections.iter().filter(|c| c.snapshot_sent).count();
    let before = sessions(&setup.ztunnel.state());
    setup.start_agent().await;
    setup
        .ztunnel
        .wait_until(|state| sessions(state) > before, PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("ztunnel did not reconnect: {e}\n{}", setup.agent_log()));
    let web_run = setup.start_connecting_pod(&web).await;
    setup.wait_captured(&web).await;
    setup.upstream.wait_for_peer(&web_run.ip).await;

    // Uninstalled (the agent gone first, as `helm uninstall` leaves it):
    // the plugin is un-chained and its binary removed, and containerd
    // starts the next ambient pod, whose traffic is no longer captured.
    setup.kill_agent();
    let out = setup.uninstall();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(chained(&setup.node), ["bridge"]);
    assert!(!setup.node.cni_bin_dir().join("ambpf-cni").exists());
    let after = PodSpec::new("mesh", "after");
    setup.schedule(&after);
    let proxied_before = setup.ztunnel.proxied().len();
    let after_run = setup.start_connecting_pod(&after).await;
    setup.upstream.wait_for_peer(&after_run.ip).await;
    assert_eq!(setup.ztunnel.proxied().len(), proxied_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_pods_from_the_runtime_are_captured_discovered_and_removed_cleanly() {
    pods_from_the_runtime_are_captured_discovered_and_removed_cleanly("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ebpf_without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains() {
    without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains() {
    without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains("iptables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains() {
    without_the_agent_sandboxes_fail_with_its_reason_and_uninstall_unchains("nftables").await;
}
