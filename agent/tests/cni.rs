//! Privileged: the real `ambpf-cni` binary, run as a container runtime runs
//! it, against the agent's CNI endpoint served here by a real `Controller`
//! over the eBPF `Dataplane` and a testbed pod; and the installer on a
//! temporary CNI configuration.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
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
    zds::{ZdsConfig, ZdsHandle},
};
use ambpf_common::NodeConfig;
use ambpf_testbed::{BpffsMount, CgroupGuard, cluster::Cluster, unique_name};
use serde_json::{Value, json};

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

/// The previous plugin's result, as a bridge/ptp plugin would report it.
fn prev_result(ip: &str) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [{ "name": "eth0", "sandbox": "/var/run/netns/x" }],
        "ips": [{ "address": format!("{ip}/24"), "gateway": "10.244.1.1", "interface": 0 }],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dns": {}
    })
}

/// Runs the plugin binary as the runtime would for `command`.
fn plugin(command: &str, netns: &Path, uid: &str, socket: &Path, prev: &Value) -> Output {
    let config = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": cni::PLUGIN_TYPE,
        "agentSocket": socket,
        "agentTimeoutSeconds": 10,
        "prevResult": prev,
    });
    let mut child = Command::new(env!("CARGO_BIN_EXE_ambpf-cni"))
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", "c0ffee")
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .env(
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=app-1;K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID={uid}"
            ),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(config.to_string().as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
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

fn stdout_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {:?}, stderr {:?}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_returns_only_once_the_pod_is_enrolled_and_handed_to_ztunnel() {
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let cgroup = CgroupGuard::create().unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let mut dataplane = Dataplane::load(pins.clone()).unwrap();
    dataplane.attach_cgroup(cgroup.path()).unwrap();
    dataplane
        .set_node_config(NodeConfig {
            dns_capture: 1,
            _pad: 0,
        })
        .unwrap();
    dataplane
        .set_host_addresses(&cluster.node_addresses())
        .unwrap();

    let dir = TempDir::new("agent");
    let zds = ZdsHandle::new(ZdsConfig {
        socket: dir.0.join("ztunnel.sock"),
        ..Default::default()
    });
    let controller = Controller::new(Box::new(dataplane), zds.clone(), true);
    // The regular source knows no pods yet: the race the plugin closes.
    let (pods_tx, pods_rx) = tokio::sync::watch::channel(Arc::new(Vec::new()));
    let (requests_tx, requests_rx) = tokio::sync::mpsc::channel(8);
    let controller = tokio::spawn(controller.run_with_requests(pods_rx, Some(requests_rx)));
    let socket = dir.0.join("pluginevent.sock");
    let server = tokio::spawn(cni::server::serve(
        cni::server::bind(&socket).unwrap(),
        requests_tx,
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
    // Enrolled in the kernel and in ztunnel's set when the plugin returns.
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
