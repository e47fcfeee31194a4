//! Privileged: the OCI image runs the agent as the chart runs it.
//!
//! The image is built with `cargo xtask image`'s recipe (`xtask/src/image.rs`)
//! from this build's binaries, loaded into podman and run privileged with
//! the host's PID namespace and the mounts the chart gives the agent (bpffs,
//! the cgroup v2 root, /run/netns, the ZDS socket's directory). Its network
//! namespace is the node namespace of a testbed `Cluster` (a DaemonSet pod
//! with host networking shares its node's), so nothing touches the host's.
//! Checked: the pod is enrolled and its traffic reaches the ztunnel double,
//! `ambpf status` inside the container names the pod and finds the pinned
//! programs its own, and the image's `nft` lists the node's tables.

#[path = "../../xtask/src/image.rs"]
#[allow(dead_code)]
mod image;

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard, cgroup2_root,
    cluster::Cluster,
    unique_name,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};
use serde_json::Value;

const POD_UID: &str = "7d1e0c52-image-pod-1";
const PATIENCE: Duration = Duration::from_secs(30);

/// podman with a configuration of the test's own: without resource limits
/// for containers (podman's default nproc/nofile limits exceed what this
/// sandboxed host lets runc set).
struct Podman {
    conf: PathBuf,
}

impl Podman {
    fn new(dir: &Path) -> Self {
        let conf = dir.join("containers.conf");
        std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n").unwrap();
        Self { conf }
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = Command::new("podman")
            .args(args)
            .env("CONTAINERS_CONF", &self.conf)
            .output()
            .expect("podman must be installed (apt install podman)");
        eprintln!(
            "--- podman {}: {}\n{}{}",
            args.first().unwrap_or(&""),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "podman {args:?} failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// The container and the image, removed however the test ends.
struct Loaded<'a> {
    podman: &'a Podman,
    reference: String,
    container: String,
}

impl Drop for Loaded<'_> {
    fn drop(&mut self) {
        self.podman.run(&["logs", &self.container]);
        self.podman
            .run(&["rm", "--force", "--time", "5", &self.container]);
        self.podman.run(&["rmi", "--force", &self.reference]);
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn echo_server(ns: &NetnsGuard, addr: SocketAddr) {
    let listener = ns.run(|| TcpListener::bind(addr)).unwrap().unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 64];
            if let Ok(n) = conn.read(&mut buf) {
                let _ = conn.write_all(&buf[..n]);
            }
        }
    });
}

fn exchange(ns: &NetnsGuard, to: SocketAddr) {
    ns.run(|| {
        let mut conn = TcpStream::connect_timeout(&to, PATIENCE).unwrap();
        conn.set_read_timeout(Some(PATIENCE)).unwrap();
        conn.write_all(b"through the image").unwrap();
        let mut buf = [0u8; 64];
        let n = conn.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"through the image");
    })
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_the_agent_and_its_status_names_the_pod() {
    if let Some(why) = ambpf_testbed::node::containers_cannot_start() {
        eprintln!("skipped: {why}");
        return;
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_ambpf"));
    // target/<profile>/ambpf: the Debian tree is cached in target/image.
    let target = bin.parent().and_then(Path::parent).unwrap();
    let built = image::build(&image::ImageSpec {
        binaries: &[
            bin.to_owned(),
            PathBuf::from(env!("CARGO_BIN_EXE_ambpf-cni")),
        ],
        reference: format!("localhost/ambpf-test:{}", unique_name("t")),
        work: target.join("image"),
        version: env!("CARGO_PKG_VERSION").into(),
    })
    .unwrap();
    let work = TempDir(std::env::temp_dir().join(format!("ambpf-image-{}", unique_name(""))));
    std::fs::create_dir_all(&work.0).unwrap();
    let podman = Podman::new(&work.0);
    let loaded = Loaded {
        podman: &podman,
        reference: built.reference.clone(),
        container: format!("ambpf-test-{}", unique_name("")),
    };
    let archive = built.archive.to_str().unwrap();
    assert!(
        podman
            .ok(&["load", "--input", archive])
            .contains(&built.reference)
    );
    // Only the archive's own: each run builds a fresh one.
    let _ = std::fs::remove_file(&built.archive);
    let _ = std::fs::remove_dir_all(&built.layout);

    let bpffs = BpffsMount::create().unwrap();
    let pin_root = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let socket = work.0.join("ztunnel.sock");
    let pods_file = work.0.join("pods.json");
    std::fs::write(
        &pods_file,
        serde_json::json!({ "pods": [{
            "uid": POD_UID, "name": "web-0", "namespace": "shop",
            "netns": pod.ns.path(),
        }]})
        .to_string(),
    )
    .unwrap();

    let same = |path: &Path| format!("{0}:{0}", path.display());
    let (pin_root_arg, work_dir) = (pin_root.to_str().unwrap(), same(&work.0));
    podman.ok(&[
        "run",
        "--detach",
        "--name",
        &loaded.container,
        "--privileged",
        "--network",
        &format!("ns:{}", cluster.node.path().display()),
        "--pid",
        "host",
        "--env",
        "RUST_LOG=info",
        "--volume",
        &same(bpffs.path()),
        "--volume",
        &same(&cgroup2_root().unwrap()),
        "--volume",
        "/run/netns:/run/netns",
        "--volume",
        &work_dir,
        &loaded.reference,
        "--pin-root",
        pin_root_arg,
        "run",
        "--pods-file",
        pods_file.to_str().unwrap(),
        "--zds-socket",
        socket.to_str().unwrap(),
        "--cgroup",
        cgroup.path().to_str().unwrap(),
        "--health-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);

    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default());
    let deadline = Instant::now() + PATIENCE;
    while !ztunnel
        .inspect(|s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running))
    {
        assert!(
            Instant::now() < deadline,
            "ztunnel did not get the pod from the container"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The pod's connection out is redirected into ztunnel's 15001.
    let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), 9000);
    echo_server(&cluster.remote.ns, remote);
    exchange(&pod.ns, remote);
    let proxied = ztunnel.proxied();
    assert!(
        proxied
            .iter()
            .any(|c| c.listener_port == 15001 && c.original_dst == remote && c.uid == POD_UID),
        "{proxied:?}"
    );

    // `ambpf status` inside the container, from the pins.
    let status = podman.ok(&[
        "exec",
        &loaded.container,
        "ambpf",
        "--pin-root",
        pin_root_arg,
        "status",
        "-o",
        "json",
    ]);
    let status: Value = serde_json::from_str(&status).unwrap();
    let pods = status["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 1, "{status}");
    assert_eq!(
        pods[0]["pod"],
        serde_json::json!({ "namespace": "shop", "name": "web-0", "uid": POD_UID }),
        "{status}"
    );
    assert_eq!(pods[0]["netns_inode"], pod.ns.inode().unwrap(), "{status}");
    assert!(status["build"]["warning"].is_null(), "{status}");
    assert!(
        status["counters"]["outbound_redirected"].as_u64() >= Some(1),
        "{status}"
    );

    // `nft` runs (with its libraries) and reads the node's tables: what the
    // iptables mode marks and later removes a `nat` table it creates with.
    let tables = podman.ok(&["exec", &loaded.container, "nft", "list", "tables"]);
    let node_tables = cluster
        .node
        .command("nft")
        .unwrap()
        .args(["list", "tables"])
        .output();
    if let Some(out) = node_tables.ok().filter(|o| o.status.success()) {
        assert_eq!(
            tables,
            String::from_utf8_lossy(&out.stdout),
            "the node's tables"
        );
    }

    // The version it reports is this build's (the image's binary is a
    // stripped copy: the same embedded object).
    let version: Value = serde_json::from_str(&podman.ok(&[
        "exec",
        &loaded.container,
        "ambpf",
        "version",
        "-o",
        "json",
    ]))
    .unwrap();
    assert_eq!(
        version["bpf_object_sha256"],
        ambpf::build_info::current().bpf_object_sha256,
        "{version}"
    );
    ztunnel.shutdown().await;
    drop(loaded);
}
