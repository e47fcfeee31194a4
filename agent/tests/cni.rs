//! Privileged: the real `ambpf-cni` binary, run as a container runtime runs
//! it, against the agent's CNI endpoint served here by a real `Controller`
//! over the eBPF `Dataplane` and a testbed pod; against the real `ambpf run`
//! with the Kubernetes pod source on the test API server, which enrols only
//! ambient pods; and the installer on a temporary CNI configuration.

use std::{
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Arc,
    time::Duration,
};

use ambpf::{
    bpf::{Dataplane, PinLayout, inspect},
    cni::{
        self,
        install::{InstallConfig, install_once, keep_installed},
    },
    controller::Controller,
    netns::Netns,
    zds::ZdsConfig,
};
use ambpf_testbed::{
    BpffsMount, CgroupGuard,
    apiserver::ApiServer,
    cluster::Cluster,
    privileges::{CHART_AGENT_CAPABILITIES, exec_with_only},
    unique_name,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};
use serde_json::{Value, json};

mod common;
use common::Server;
mod plugin_runner;
use plugin_runner::*;

struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("ambpf-cni-{what}-{}", unique_name("")));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the plugin binary as the runtime would for `command`, for pod
/// shop/app-1.
fn plugin(command: &str, netns: &Path, uid: &str, socket: &Path, prev: &Value) -> Output {
    plugin_for(
        command,
        netns,
        &k8s_args("shop", "app-1", uid),
        socket,
        prev,
    )
}

async fn plugin_async(
    command: &'static str,
    netns: PathBuf,
    uid: &'static str,
    socket: PathBuf,
    prev: Value,
) -> Output {
    tokio::task::spawn_blocking(move || plugin(command, &netns, uid, &socket, &prev))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_returns_only_once_the_pod_is_enrolled_and_handed_to_ztunnel() {
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let cgroup = CgroupGuard::create().unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let mut dataplane = Dataplane::load(pins.clone()).unwrap();
    dataplane
        .serve_node(
            cgroup.path(),
            true,
            &cluster.node_addresses(),
            cluster.node_netns_cookie(),
        )
        .unwrap();

    let zds_server = Server::start(ZdsConfig::default());
    zds_server.record_ztunnel_processes(pins.clone());
    let zds = zds_server.handle.clone();
    // A ztunnel whose proxies take a while to start, as under load.
    let ztunnel = ZtunnelDouble::connect_with_retry(
        zds_server.socket(),
        ZtunnelConfig::default().proxy_start_delay(Duration::from_millis(300)),
    );
    let controller = Controller::new(
        Box::new(ambpf::redirect::EbpfRedirection::new(dataplane)),
        zds.clone(),
        true,
    );
    // The regular source knows no pods yet: the race the plugin closes.
    let (pods_tx, pods_rx) = tokio::sync::watch::channel(Arc::default());
    let (requests_tx, requests_rx) = tokio::sync::mpsc::channel(8);
    let controller = tokio::spawn(controller.run_with_requests(pods_rx, Some(requests_rx)));
    let socket = zds_server.dir().join("pluginevent.sock");
    let stats = Arc::new(cni::CniStats::default());
    let (_running, shutdown) = tokio::sync::watch::channel(false);
    let endpoint = cni::server::Endpoint {
        controller: requests_tx,
        zds: zds.clone(),
        selection: cni::selection::PodSelection::Every,
        stats: stats.clone(),
        shutdown,
        standby: Default::default(),
    };
    let server = tokio::spawn(cni::server::serve(
        cni::server::bind(&socket).unwrap(),
        endpoint,
    ));

    let inode = Netns::open(pod.ns.name()).unwrap().inode();
    assert!(inspect::read_status(&pins).unwrap().pods.is_empty());
    let prev = prev_result(&pod.addrs.v4.to_string());
    let output = plugin_async(
        "ADD",
        pod.ns.path(),
        "pod-1-uid",
        socket.clone(),
        prev.clone(),
    )
    .await;
    assert!(
        output.status.success(),
        "{:?} {}",
        output.status,
        String::from_utf8_lossy(&output.stdout)
    );
    assert_eq!(stdout_json(&output), prev);
    // Enrolled in the kernel, and held by ztunnel, when the plugin returns.
    let held = ztunnel.workloads();
    assert!(
        held.get("pod-1-uid")
            .is_some_and(|w| w.proxies_running && w.netns_inode == inode),
        "{held:?}"
    );
    let enrolled: Vec<u64> = inspect::read_status(&pins)
        .unwrap()
        .pods
        .iter()
        .map(|p| p.netns_inode)
        .collect();
    assert_eq!(enrolled, [inode]);
    let workloads = zds.workloads();
    let workload = workloads.get("pod-1-uid").expect("handed to ztunnel");
    assert_eq!(
        (workload.name.as_str(), workload.namespace.as_str()),
        ("app-1", "shop")
    );

    // A pod whose netns does not exist is refused with the reason.
    let output = plugin_async(
        "ADD",
        PathBuf::from("/run/netns/ambpf-no-such-pod"),
        "pod-2-uid",
        socket.clone(),
        prev.clone(),
    )
    .await;
    assert!(!output.status.success());
    let error = stdout_json(&output);
    assert_eq!(error["code"], 101, "{error}");
    assert!(
        error["details"].as_str().unwrap().contains("pod-2-uid"),
        "{error}"
    );
    assert!(!zds.workloads().contains_key("pod-2-uid"));
    let count = |c: &prometheus_client::metrics::counter::Counter| c.get();
    assert_eq!(
        [&stats.enrolled, &stats.skipped, &stats.refused].map(count),
        [1, 0, 1],
        "the endpoint's metrics"
    );

    // DEL and CHECK succeed without the agent, printing nothing.
    for command in ["DEL", "CHECK"] {
        let output = plugin_async(
            command,
            pod.ns.path(),
            "pod-1-uid",
            PathBuf::from("/nonexistent.sock"),
            prev.clone(),
        )
        .await;
        assert!(output.status.success(), "{command}");
        assert!(output.stdout.is_empty(), "{command}");
    }
    // The pod stays enrolled while no source reports it and its netns lives.
    assert!(zds.workloads().contains_key("pod-1-uid"));

    server.abort();
    zds_server.stop();
    drop(pods_tx);
    controller.await.unwrap();
}

#[test]
fn add_fails_the_pod_with_a_cni_error_when_no_agent_listens() {
    let dir = TempDir::new("noagent");
    let prev = prev_result("10.244.1.2");
    let output = plugin(
        "ADD",
        Path::new("/proc/self/ns/net"),
        "pod-uid",
        &dir.0.join("pluginevent.sock"),
        &prev,
    );
    assert_eq!(output.status.code(), Some(1));
    let error = stdout_json(&output);
    assert_eq!(error["cniVersion"], "1.0.0");
    assert_eq!(error["code"], 100, "{error}");
    assert!(
        error["msg"].as_str().unwrap().contains("unreachable"),
        "{error}"
    );
    assert!(
        error["details"].as_str().unwrap().contains("shop/app-1"),
        "{error}"
    );

    let version = Command::new(env!("CARGO_BIN_EXE_ambpf-cni"))
        .env("CNI_COMMAND", "VERSION")
        .output()
        .unwrap();
    assert!(version.status.success());
    let version = stdout_json(&version);
    assert!(
        version["supportedVersions"]
            .as_array()
            .unwrap()
            .contains(&json!("1.0.0")),
        "{version}"
    );
}

/// A child process (the agent, the installer) whose stderr goes to a log
/// file; killed on drop.
struct Logged {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Logged {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to 20 s until `ready(log)`; fails, with the log, if the
    /// process exits first or the time runs out.
    async fn wait_until(&mut self, waiting_for: &str, mut ready: impl FnMut(&str) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.log();
            if ready(&log) {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the {} exited ({status}):\n{log}", self.name);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} never {waiting_for}:\n{log}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the agent's CNI endpoint accepts connections.
    async fn wait_for_endpoint(&mut self, socket: &Path) {
        self.wait_until("served its CNI endpoint", |_| {
            UnixStream::connect(socket).is_ok()
        })
        .await;
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A namespace, labelled ambient or not.
fn namespace_object(name: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({ "istio.io/dataplane-mode": "ambient" })
    } else {
        json!({ "team": "x" })
    };
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name, "labels": labels } })
}

/// A pod of `node-1` as the API server has it when the runtime calls ADD.
fn pod_object(namespace: &str, name: &str, uid: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": namespace, "uid": uid, "labels": { "app": name } },
        "spec": { "nodeName": "node-1", "serviceAccountName": name, "containers": [{ "name": "app" }] },
        "status": { "phase": "Pending" }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_kube_source_only_ambient_pods_are_enrolled_and_no_answer_fails_the_add() {
    let cluster = Cluster::create(2).unwrap();
    let cgroup = CgroupGuard::create().unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let dir = TempDir::new("kube");
    let mut api = ApiServer::start_in(&cluster.node.path()).await.unwrap();
    api.apply("namespaces", namespace_object("mesh", true));
    api.apply("namespaces", namespace_object("plain", false));
    api.apply("namespaces", namespace_object("kube-system", true));
    api.apply("pods", pod_object("mesh", "app-1", "uid-app-1"));
    api.apply("pods", pod_object("plain", "app-2", "uid-app-2"));
    let kubeconfig = dir.0.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();

    // In the node's namespace, as its host, where the API server listens,
    // with only the capabilities the chart grants in eBPF mode.
    let socket = dir.0.join("pluginevent.sock");
    let log = dir.0.join("agent.log");
    let mut command = cluster.node.command(env!("CARGO_BIN_EXE_ambpf")).unwrap();
    exec_with_only(&mut command, CHART_AGENT_CAPABILITIES).unwrap();
    let child = command
        .arg("--pin-root")
        .arg(pins.root())
        .args(["run", "--pod-source", "kube", "--node-name", "node-1"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--cni-socket")
        .arg(&socket)
        .arg("--zds-socket")
        .arg(dir.0.join("ztunnel.sock"))
        .arg("--cgroup")
        .arg(cgroup.path())
        .args([
            "--health-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut agent = Logged {
        name: "agent",
        child,
        log,
    };
    agent.wait_for_endpoint(&socket).await;

    let enrolled = || -> Vec<u64> {
        inspect::read_status(&pins)
            .unwrap()
            .pods
            .iter()
            .map(|p| p.netns_inode)
            .collect()
    };
    let add = |netns: PathBuf, cni_args: String, prev: Value| {
        let socket = socket.clone();
        tokio::task::spawn_blocking(move || plugin_for("ADD", &netns, &cni_args, &socket, &prev))
    };
    let stderr = |output: &Output| String::from_utf8_lossy(&output.stderr).into_owned();
    let (ambient, other) = (&cluster.pods[0], &cluster.pods[1]);
    let prev = prev_result(&ambient.addrs.v4.to_string());
    let other_prev = prev_result(&other.addrs.v4.to_string());
    assert!(enrolled().is_empty());

    // An ambient pod (by its namespace) while no ztunnel is connected: the
    // ADD fails for the runtime to retry, nothing of the pod is left, and
    // the pod is marked `pending`, as Istio's node agent does.
    let output = add(
        ambient.ns.path(),
        k8s_args("mesh", "app-1", "uid-app-1"),
        prev.clone(),
    )
    .await
    .unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let error = stdout_json(&output);
    assert_eq!(error["code"], 11, "try again later: {error}");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("no ztunnel is connected"),
        "{error}"
    );
    assert!(enrolled().is_empty(), "nothing left behind");
    let pending = || {
        api.object("pods", "mesh", "app-1").unwrap()["metadata"]["annotations"]
            ["ambient.istio.io/redirection"]
            .as_str()
            .map(str::to_owned)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while pending().as_deref() != Some("pending") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not annotated pending: {:?}\n{}",
            pending(),
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // With ztunnel, the runtime's retry is enrolled, and held by ztunnel,
    // before ADD returns.
    let ztunnel = ZtunnelDouble::connect_with_retry(
        dir.0.join("ztunnel.sock"),
        ZtunnelConfig::default().proxy_start_delay(Duration::from_millis(300)),
    );
    ztunnel
        .wait_until(|s| s.ready, Duration::from_secs(10))
        .await
        .unwrap();
    let output = add(
        ambient.ns.path(),
        k8s_args("mesh", "app-1", "uid-app-1"),
        prev.clone(),
    )
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{}\n{}",
        stderr(&output),
        agent.log()
    );
    assert_eq!(stdout_json(&output), prev);
    let ambient_inode = Netns::open(ambient.ns.name()).unwrap().inode();
    assert_eq!(enrolled(), [ambient_inode]);
    assert!(ztunnel.workloads().contains_key("uid-app-1"));

    // Skipped, ADD succeeding with the previous result and the reason logged:
    // a pod whose namespace is not ambient, and a pod the API server does not
    // have (deleted meanwhile).
    for (cni_args, reason) in [
        (
            k8s_args("plain", "app-2", "uid-app-2"),
            "not ambient: neither the pod nor its namespace is labelled",
        ),
        (
            k8s_args("mesh", "deleted", "uid-deleted"),
            "not in the API server",
        ),
    ] {
        let output = add(other.ns.path(), cni_args.clone(), other_prev.clone())
            .await
            .unwrap();
        assert!(output.status.success(), "{cni_args}: {}", stderr(&output));
        assert_eq!(stdout_json(&output), other_prev, "{cni_args}");
        assert!(
            stderr(&output).contains(reason),
            "{cni_args}: {}",
            stderr(&output)
        );
    }
    assert_eq!(enrolled(), [ambient_inode], "nothing else enrolled");
    // The agent decides from its watch caches where they hold the pod, and
    // asks the API server about a pod they do not have.
    let asked = api.requests();
    let path = "/api/v1/namespaces/mesh/pods/deleted";
    assert!(asked.iter().any(|r| r.path == path), "no GET {path}");

    // A pod the caches do not have, and no answer from the API server: the
    // ADD fails, saying why, so the runtime retries rather than start an
    // app that may be ambient.
    let app_3 = || k8s_args("mesh", "app-3", "uid-app-3");
    api.deny("get", "pods");
    let output = add(other.ns.path(), app_3(), other_prev.clone())
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let error = stdout_json(&output);
    assert_eq!(error["code"], 11, "try again later: {error}");
    let details = error["details"].as_str().unwrap();
    assert!(
        details.contains("pod mesh/app-3 (uid-app-3) not enrolled")
            && details.contains("cannot tell whether the pod is ambient")
            && details.contains("RBAC denies the agent `get` on pods"),
        "{error}"
    );
    api.allow("get", "pods");
    api.shutdown().await;
    let output = add(other.ns.path(), app_3(), other_prev.clone())
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let error = stdout_json(&output);
    let details = error["details"].as_str().unwrap();
    assert!(
        details.contains("pod mesh/app-3 (uid-app-3) not enrolled")
            && details.contains("cannot tell whether the pod is ambient")
            && details.contains("cannot get pods from the API server"),
        "{error}"
    );
    // Pods of excluded namespaces need no answer: system pods still start.
    let output = add(
        other.ns.path(),
        k8s_args("kube-system", "coredns-0", "uid-coredns"),
        other_prev.clone(),
    )
    .await
    .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout_json(&output), other_prev);
    assert!(stderr(&output).contains("its namespace is excluded"));
    assert_eq!(enrolled(), [ambient_inode]);

    // The API server is back, with the pod: it is enrolled.
    api.restart().await.unwrap();
    api.apply("pods", pod_object("mesh", "app-3", "uid-app-3"));
    let output = add(other.ns.path(), app_3(), other_prev.clone())
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}\n{}",
        stderr(&output),
        agent.log()
    );
    let mut both = vec![ambient_inode, Netns::open(other.ns.name()).unwrap().inode()];
    both.sort_unstable();
    let mut now = enrolled();
    now.sort_unstable();
    assert_eq!(now, both);
    drop(agent);
}

fn conflist() -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [
            { "type": "ptp", "ipam": { "type": "host-local", "subnet": "10.244.1.0/24" } },
            { "type": "portmap", "capabilities": { "portMappings": true } }
        ]
    })
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn is_chained(conflist: &Path, binary: &Path) -> bool {
    ours(&read_json(conflist)).len() == 1 && binary.exists()
}

fn ours(list: &Value) -> Vec<Value> {
    list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] == cni::PLUGIN_TYPE)
        .cloned()
        .collect()
}

#[tokio::test]
async fn installer_chains_the_plugin_idempotently_and_repairs_it() {
    let dir = TempDir::new("install");
    let (conf_dir, bin_dir) = (dir.0.join("net.d"), dir.0.join("bin"));
    std::fs::create_dir_all(&conf_dir).unwrap();
    let list = conf_dir.join("10-ptp.conflist");
    std::fs::write(&list, conflist().to_string()).unwrap();
    std::fs::write(conf_dir.join("99-other.conflist"), conflist().to_string()).unwrap();
    let config = InstallConfig {
        conf_dir: conf_dir.clone(),
        bin_dir: bin_dir.clone(),
        plugin_binary: Some(PathBuf::from(env!("CARGO_BIN_EXE_ambpf-cni"))),
        agent_socket: PathBuf::from("/var/run/ambpf/pluginevent.sock"),
        agent_timeout_seconds: None,
    };

    let first = install_once(&config).unwrap();
    assert_eq!(first.conflist, list);
    assert!(first.conflist_changed && first.binary_changed);
    let installed = read_json(&list);
    assert_eq!(
        ours(&installed),
        [json!({ "type": "ambpf-cni", "agentSocket": "/var/run/ambpf/pluginevent.sock" })]
    );
    // The other plugins are kept, ours is chained last; other files untouched.
    assert_eq!(installed["plugins"][0]["type"], "ptp");
    assert_eq!(installed["plugins"][2]["type"], cni::PLUGIN_TYPE);
    assert!(ours(&read_json(&conf_dir.join("99-other.conflist"))).is_empty());
    assert_eq!(
        std::fs::read(bin_dir.join("ambpf-cni")).unwrap(),
        std::fs::read(env!("CARGO_BIN_EXE_ambpf-cni")).unwrap()
    );

    let again = install_once(&config).unwrap();
    assert!(!again.conflist_changed && !again.binary_changed);
    assert_eq!(read_json(&list), installed);

    // Something rewrites the conflist without us; the loop puts it back.
    let repair = tokio::spawn(keep_installed(config.clone(), Duration::from_millis(50)));
    std::fs::write(&list, conflist().to_string()).unwrap();
    std::fs::remove_file(bin_dir.join("ambpf-cni")).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while ours(&read_json(&list)).len() != 1 || !bin_dir.join("ambpf-cni").exists() {
        assert!(tokio::time::Instant::now() < deadline, "not repaired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    repair.abort();
    assert_eq!(read_json(&list), installed);
    // No temporary files left behind.
    let names: Vec<_> = std::fs::read_dir(&conf_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

// ---------------------------------------------------------------------------
// The installer's shutdown: an upgrade keeps the plugin, an uninstall removes
// it.

const SYSTEM_NAMESPACE: &str = "istio-system";
const INSTALLER_POD: &str = "ambpf-x7k2p";

/// The DaemonSet's pod the installer runs in, as the API server has it.
fn installer_pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": INSTALLER_POD,
            "namespace": SYSTEM_NAMESPACE,
            "labels": { "app.kubernetes.io/name": "ambpf" },
            "ownerReferences": [{
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "name": "ambpf",
                "uid": "5d1c0c4e-0000-4000-8000-0000000da3e7",
                "controller": true,
                "blockOwnerDeletion": true
            }]
        },
        "spec": {
            "nodeName": "node-1",
            "containers": [{ "name": "agent" }, { "name": "cni-installer" }]
        },
        "status": { "phase": "Running" }
    })
}

fn installer_daemonset() -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": "ambpf",
            "namespace": SYSTEM_NAMESPACE,
            "uid": "5d1c0c4e-0000-4000-8000-0000000da3e7"
        },
        "spec": {
            "selector": { "matchLabels": { "app.kubernetes.io/name": "ambpf" } },
            "template": {
                "metadata": { "labels": { "app.kubernetes.io/name": "ambpf" } },
                "spec": { "containers": [{ "name": "agent" }, { "name": "cni-installer" }] }
            }
        }
    })
}

/// `ambpf cni-install --watch` on a CNI configuration of its own, as the
/// chart runs it; its log goes to a file; killed on drop.
struct Installer {
    process: Logged,
    conflist: PathBuf,
    binary: PathBuf,
    _dir: TempDir,
}

impl Installer {
    /// Starts it, with the API server's kubeconfig if given (else without
    /// any Kubernetes configuration), and waits until the plugin is chained
    /// and the installer has said what it will do on shutdown (from then on
    /// it catches SIGTERM).
    async fn start(what: &str, api: Option<&ApiServer>) -> Self {
        let dir = TempDir::new(what);
        let (conf_dir, bin_dir) = (dir.0.join("net.d"), dir.0.join("bin"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        let conflist_path = conf_dir.join("10-ptp.conflist");
        std::fs::write(&conflist_path, conflist().to_string()).unwrap();
        let log = dir.0.join("installer.log");
        let mut command = Command::new(env!("CARGO_BIN_EXE_ambpf"));
        command
            .arg("cni-install")
            .arg("--conf-dir")
            .arg(&conf_dir)
            .arg("--bin-dir")
            .arg(&bin_dir)
            .arg("--plugin-binary")
            .arg(env!("CARGO_BIN_EXE_ambpf-cni"))
            .args(["--watch", "0.2"])
            .env("POD_NAME", INSTALLER_POD)
            .env("POD_NAMESPACE", SYSTEM_NAMESPACE)
            .env("RUST_LOG", "info")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(api) = api {
            let kubeconfig = dir.0.join("kubeconfig");
            std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
            command.arg("--kubeconfig").arg(kubeconfig);
        }
        let mut installer = Installer {
            process: Logged {
                name: "installer",
                child: command.spawn().unwrap(),
                log,
            },
            conflist: conflist_path,
            binary: bin_dir.join(cni::PLUGIN_TYPE),
            _dir: dir,
        };
        installer.wait_for_log("on shutdown ambpf-cni").await;
        let (conflist, binary) = (installer.conflist.clone(), installer.binary.clone());
        installer
            .process
            .wait_until("chained the plugin", |_| is_chained(&conflist, &binary))
            .await;
        installer
    }

    fn log(&self) -> String {
        self.process.log()
    }

    async fn wait_for_log(&mut self, text: &str) {
        self.process
            .wait_until(&format!("logged {text:?}"), |log| log.contains(text))
            .await;
    }

    /// Whether the plugin is in the conflist and its binary in place.
    fn chained(&self) -> bool {
        is_chained(&self.conflist, &self.binary)
    }

    /// SIGTERM, as the kubelet stops the container; its exit status.
    async fn stop(&mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.process.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.process.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "still running 20 s after SIGTERM:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops it and checks the plugin was left as it was.
    async fn stop_and_expect_chained(&mut self) -> String {
        let status = self.stop().await;
        let log = self.log();
        assert!(status.success(), "{status}:\n{log}");
        assert!(self.chained(), "ambpf-cni was removed:\n{log}");
        assert!(!log.contains("un-chained"), "{log}");
        log
    }

    /// Stops it and checks the plugin and its binary are gone, and the
    /// network's own plugins are as they were.
    async fn stop_and_expect_removed(&mut self) -> String {
        let status = self.stop().await;
        let log = self.log();
        assert!(status.success(), "{status}:\n{log}");
        assert_eq!(read_json(&self.conflist), conflist(), "{log}");
        assert!(!self.binary.exists(), "{log}");
        assert!(
            log.contains(&format!(
                "un-chained ambpf-cni from {}",
                self.conflist.display()
            )),
            "{log}"
        );
        log
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_shutdown_the_plugin_stays_while_its_daemonset_stays_or_cannot_be_read() {
    let mut api = ApiServer::start().await.unwrap();
    api.apply("pods", installer_pod());
    api.apply("daemonsets", installer_daemonset());

    // An upgrade or a restart: the DaemonSet is still there.
    let mut installer = Installer::start("upgrade", Some(&api)).await;
    installer
        .wait_for_log("DaemonSet istio-system/ambpf exists")
        .await;
    let log = installer.stop_and_expect_chained().await;
    assert!(
        log.contains(
            "DaemonSet ambpf is still there and not being deleted (an upgrade or a restart)"
        ),
        "{log}"
    );
    let asked = api.requests();
    for path in [
        "/api/v1/namespaces/istio-system/pods/ambpf-x7k2p",
        "/apis/apps/v1/namespaces/istio-system/daemonsets/ambpf",
    ] {
        assert!(asked.iter().any(|r| r.path == path), "no GET {path}");
    }

    // Without Kubernetes configuration nothing can be told: it stays, and
    // the log says how to remove it by hand.
    let mut installer = Installer::start("nokube", None).await;
    let log = installer.stop_and_expect_chained().await;
    assert!(
        log.contains("on shutdown ambpf-cni will stay chained: no Kubernetes configuration"),
        "{log}"
    );
    assert!(log.contains("ambpf uninstall --cni-conf-dir"), "{log}");

    // The API server stops answering while the DaemonSet is there: the
    // same (the watch saw it there, the read at shutdown fails).
    let mut installer = Installer::start("apidown", Some(&api)).await;
    installer
        .wait_for_log("DaemonSet istio-system/ambpf exists")
        .await;
    api.shutdown().await;
    let log = installer.stop_and_expect_chained().await;
    assert!(
        log.contains("stays chained") && log.contains("cannot read DaemonSet ambpf"),
        "{log}"
    );
    assert!(log.contains("ambpf uninstall --cni-conf-dir"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_shutdown_the_plugin_goes_with_its_daemonset() {
    let api = ApiServer::start().await.unwrap();
    api.apply("pods", installer_pod());

    // helm uninstall (background deletion): the DaemonSet is gone by the
    // time the kubelet stops its pods.
    api.apply("daemonsets", installer_daemonset());
    let mut installer = Installer::start("gone", Some(&api)).await;
    installer
        .wait_for_log("DaemonSet istio-system/ambpf exists")
        .await;
    api.delete("daemonsets", SYSTEM_NAMESPACE, "ambpf").unwrap();
    let log = installer.stop_and_expect_removed().await;
    assert!(log.contains("stopping: DaemonSet ambpf is gone"), "{log}");

    // Foreground deletion: it is still there, carrying a deletionTimestamp.
    api.apply("daemonsets", installer_daemonset());
    let mut installer = Installer::start("deleting", Some(&api)).await;
    installer
        .wait_for_log("DaemonSet istio-system/ambpf exists")
        .await;
    api.modify("daemonsets", SYSTEM_NAMESPACE, "ambpf", |ds| {
        ds["metadata"]["deletionTimestamp"] = json!("2026-12-02T10:00:00Z");
        ds["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
    })
    .unwrap();
    let log = installer.stop_and_expect_removed().await;
    assert!(
        log.contains("stopping: DaemonSet ambpf is being deleted"),
        "{log}"
    );

    // helm uninstall also removes the RBAC right after the DaemonSet, before
    // the pod stops: every read at shutdown is refused, and the deletion the
    // watch saw decides.
    api.apply("daemonsets", installer_daemonset());
    let mut installer = Installer::start("rbac", Some(&api)).await;
    installer
        .wait_for_log("DaemonSet istio-system/ambpf exists")
        .await;
    api.delete("daemonsets", SYSTEM_NAMESPACE, "ambpf").unwrap();
    installer
        .wait_for_log("DaemonSet istio-system/ambpf is deleted")
        .await;
    for verb in ["get", "list", "watch"] {
        api.deny(verb, "daemonsets");
        api.deny(verb, "pods");
    }
    let log = installer.stop_and_expect_removed().await;
    assert!(
        log.contains("the watch saw DaemonSet ambpf deleted")
            && log.contains("RBAC denies the agent `get` on daemonsets"),
        "{log}"
    );
}
