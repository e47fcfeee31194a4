//! Privileged: hosts that ship no iptables (RHEL 10). The real agent runs
//! where `nft` is the only firewall tool: in a mount namespace of its own,
//! every directory it looks in for binaries (/usr/sbin, /usr/bin, and /sbin,
//! /bin where they are not links to those) is an empty tmpfs, and its
//! `$PATH` is one directory holding a copy of `nft` alone; no iptables,
//! ip6tables, iptables-save/-restore (either backend) or ipset anywhere.
//!
//! - The eBPF and nftables modes start, enrol a pod, and its connections
//!   both ways go through the ztunnel double.
//! - The iptables mode refuses at start-up, naming the binary it lacks.
//! - With `nft` hidden too, the nftables mode refuses, naming `nft`.
//!
//! The host's files are never touched: the mounts live in the agent's mount
//! namespace and end with it.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};

mod common;
use common::agent::{
    AGENT_PATIENCE, Proc, TempDir, agent_command, nft_tables, serve_echo, wait_for,
};

const APP_PORT: u16 = 8080;
const REMOTE_PORT: u16 = 9000;
const POD_UID: &str = "no-iptables-pod";

/// Tests share the node's cgroup programs in eBPF mode: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Hides the binary directories, then execs the command after `$1` with
/// `$PATH` set to `$1`. Runs in a private mount namespace (`unshare
/// --mount`), so nothing of it reaches the host's mounts. `mount` is in
/// /usr/bin (or /bin), hidden last.
const HIDE: &str = r#"
set -eu
bin=$1
shift
for dir in /usr/local/sbin /usr/local/bin /usr/sbin /sbin /bin /usr/bin; do
    if [ -d "$dir" ] && [ ! -L "$dir" ]; then
        mount -t tmpfs ambpf-no-iptables "$dir"
    fi
done
PATH=$bin
export PATH
exec "$@"
"#;

/// The binaries a host without iptables lacks; none may be visible.
const IPTABLES_BINARIES: [&str; 9] = [
    "iptables",
    "ip6tables",
    "iptables-save",
    "iptables-restore",
    "iptables-nft-restore",
    "iptables-legacy-restore",
    "ip6tables-nft-restore",
    "ip6tables-legacy-restore",
    "ipset",
];

/// The host's `name` (`nft`, `unshare`), found as the agent finds binaries.
fn host_binary(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is installed"))
}

struct Node {
    cluster: Cluster,
    dir: TempDir,
    pins: PathBuf,
    cgroup: CgroupGuard,
    _bpffs: BpffsMount,
}

impl Node {
    fn create() -> Self {
        let bpffs = BpffsMount::create().unwrap();
        let dir = std::env::temp_dir().join(format!(
            "ambpf-no-iptables-{}",
            ambpf_testbed::unique_name("")
        ));
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let cluster = Cluster::create(1).unwrap();
        let pod = &cluster.pods[0];
        let pods = format!(
            r#"{{"pods": [{{"uid": "{POD_UID}", "name": "web-0", "namespace": "shop", "netns": "{}"}}]}}"#,
            pod.ns.path().display()
        );
        std::fs::write(dir.join("pods.json"), pods).unwrap();
        let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), REMOTE_PORT);
        serve_echo(&cluster.remote.ns, remote);
        serve_echo(&pod.ns, SocketAddr::new(pod.addrs.v4.into(), APP_PORT));
        Self {
            pins: bpffs.path().join("ambpf"),
            cluster,
            dir: TempDir(dir),
            cgroup: CgroupGuard::create().unwrap(),
            _bpffs: bpffs,
        }
    }

    fn remote(&self) -> SocketAddr {
        SocketAddr::new(self.cluster.remote.addrs.v4.into(), REMOTE_PORT)
    }

    fn app(&self) -> SocketAddr {
        SocketAddr::new(self.cluster.pods[0].addrs.v4.into(), APP_PORT)
    }

    fn socket(&self) -> PathBuf {
        self.dir.0.join("ztunnel.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("agent.log")).unwrap_or_default()
    }

    /// `ambpf run --redirect-mode <mode>` with the binaries hidden and
    /// `$PATH` holding `nft` (a copy of the host's) or nothing.
    fn spawn_agent(&self, mode: &str, with_nft: bool) -> Proc {
        let bin = self.dir.0.join("bin");
        if with_nft {
            std::fs::copy(host_binary("nft"), bin.join("nft")).unwrap();
        }
        let inner = agent_command(
            &self.cluster.node,
            &self.pins,
            &self.socket(),
            &self.dir.0.join("pods.json"),
            self.cgroup.path(),
            "127.0.0.1:0",
        );
        let mut cmd = self.cluster.node.command("unshare").unwrap();
        cmd.args([
            "--mount",
            "--propagation",
            "private",
            "/bin/sh",
            "-c",
            HIDE,
            "hide",
        ])
        .arg(&bin)
        .arg(inner.get_program())
        .args(inner.get_args())
        .args(["--redirect-mode", mode])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(self.dir.0.join("agent.log")).unwrap());
        Proc(cmd.spawn().unwrap())
    }

    /// What the agent `pid` sees of `binary` in the directories it searches.
    fn visible_to(pid: u32, binary: &str, bin: &Path) -> Vec<PathBuf> {
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let rel = bin.strip_prefix("/").unwrap().to_owned();
        [
            "usr/sbin",
            "usr/bin",
            "sbin",
            "bin",
            "usr/local/sbin",
            "usr/local/bin",
        ]
        .into_iter()
        .map(PathBuf::from)
        .chain([rel])
        .map(|dir| root.join(dir).join(binary))
        .filter(|p| p.exists())
        .collect()
    }
}

/// One request/response from `ns` to `to`.
fn echo_from(ns: &NetnsGuard, to: SocketAddr) {
    tokio::task::block_in_place(|| {
        ns.run(|| {
            let mut conn = TcpStream::connect_timeout(&to, Duration::from_secs(5)).unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            conn.write_all(b"ambpf").unwrap();
            let mut reply = [0u8; 5];
            conn.read_exact(&mut reply).unwrap();
            assert_eq!(&reply, b"ambpf");
        })
        .unwrap()
    })
}

/// The agent in `mode` on a host with `nft` alone enrols the pod, and its
/// connections both ways go through ztunnel.
async fn captures_without_iptables(mode: &str) {
    let _serial = SERIAL.lock().await;
    let node = Node::create();
    let _inside = node.cgroup.enter_process().unwrap();
    let agent = node.spawn_agent(mode, true);
    let ztunnel = ZtunnelDouble::connect_with_retry(node.socket(), ZtunnelConfig::default());
    ztunnel
        .wait_until(
            |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
            AGENT_PATIENCE,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
    // The agent saw no iptables binary, and saw its nft.
    let bin = node.dir.0.join("bin");
    for binary in IPTABLES_BINARIES {
        let seen = Node::visible_to(agent.0.id(), binary, &bin);
        assert_eq!(
            seen,
            Vec::<PathBuf>::new(),
            "{binary} is visible to the agent"
        );
    }
    assert_eq!(Node::visible_to(agent.0.id(), "nft", &bin).len(), 1);

    echo_from(&node.cluster.pods[0].ns, node.remote());
    echo_from(&node.cluster.remote.ns, node.app());
    let (remote, app) = (node.remote(), node.app());
    wait_for(
        || {
            let proxied = ztunnel.proxied();
            let through = |port, to| {
                proxied
                    .iter()
                    .any(|c| c.uid == POD_UID && c.listener_port == port && c.original_dst == to)
            };
            through(15001, remote) && through(15006, app)
        },
        "the pod's connections to go through ztunnel",
    )
    .await;
    if mode == "nftables" {
        let tables = nft_tables(&node.cluster.pods[0].ns.path());
        assert!(
            tables.iter().any(|t| t == "istio-ambient-nat"),
            "{tables:?}"
        );
    }
    drop(agent);
    ztunnel.shutdown().await;
}

/// The agent in `mode` exits before serving anything; what it logged.
async fn refused(node: &Node, mode: &str, with_nft: bool) -> String {
    let mut agent = node.spawn_agent(mode, with_nft);
    wait_for(
        || agent.0.try_wait().unwrap().is_some(),
        "the agent to refuse to start",
    )
    .await;
    let status = agent.0.wait().unwrap();
    let log = node.log();
    assert!(!status.success(), "{log}");
    assert!(!node.socket().exists(), "it served ZDS: {log}");
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ebpf_mode_captures_without_iptables() {
    captures_without_iptables("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_nftables_mode_captures_without_iptables() {
    captures_without_iptables("nftables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_iptables_mode_refuses_to_start_without_iptables() {
    let _serial = SERIAL.lock().await;
    let node = Node::create();
    let log = refused(&node, "iptables", true).await;
    assert!(
        log.contains("iptables-nft-restore not found in $PATH or /usr/sbin"),
        "{log}"
    );
    assert!(log.contains("(Debian package `iptables`)"), "{log}");
    // Nothing was written in the pod.
    assert_eq!(
        nft_tables(&node.cluster.pods[0].ns.path()),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_nftables_mode_refuses_to_start_without_nft() {
    let _serial = SERIAL.lock().await;
    let node = Node::create();
    let log = refused(&node, "nftables", false).await;
    assert!(
        log.contains("nft not found in $PATH or /usr/sbin, /sbin, /usr/bin, /bin"),
        "{log}"
    );
    assert!(log.contains("package `nftables`"), "{log}");
    // Nothing was written on the node.
    assert_eq!(nft_tables(&node.cluster.node.path()), Vec::<String>::new());
}
