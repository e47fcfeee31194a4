//! Privileged, each in every mode: capture that no enrolled pod owns is
//! removed, with real traffic through the `ambpf` agent in a testbed node.
//!
//! - Pods leave the mesh while the agent is down, each way a pod can: it is
//!   deleted (its namespace gone, its addresses handed to a new pod), it
//!   opts out (no longer listed, its namespace alive), or its namespace is
//!   unlabelled (with the pods file as the source, every pod of that
//!   namespace is no longer listed). The restarted agent removes what was
//!   theirs: their connections go direct, not to ztunnel, which no longer
//!   serves them; the pod that stays is still captured.
//! - The full state check finds capture in a namespace of the node no pod
//!   is enrolled in (an agent that stopped without a record of it) and
//!   removes it: that namespace's connections, refused before, go direct.

use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    time::Duration,
};

use ambpf::{
    netns::Netns,
    redirect::{
        EnrollOptions, PodRedirection, RedirectMode,
        iptables::{self, Family, IptablesBackend, IptablesRedirection, PodRulesFound},
        nftables::{self, NftablesRedirection},
        podnet, routing, steering,
    },
};
use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};

mod common;
#[macro_use]
mod modes;
use common::agent::{
    AGENT_PATIENCE, Proc, TempDir, agent_command, nft_probe_members, nft_tables, serve_echo,
    wait_for,
};

const APP_PORT: u16 = 8080;
const REMOTE_PORT: u16 = 9000;

/// A node with pods and an agent in one mode.
struct Node {
    mode: RedirectMode,
    cluster: Cluster,
    dir: TempDir,
    pins: PathBuf,
    cgroup: CgroupGuard,
    _bpffs: BpffsMount,
}

impl Node {
    fn create(mode: RedirectMode, pods: u16) -> Self {
        let bpffs = BpffsMount::create().unwrap();
        let pins = bpffs.path().join("ambpf");
        let dir = std::env::temp_dir().join(format!(
            "ambpf-restart-cleanup-{}",
            ambpf_testbed::unique_name("")
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let cluster = Cluster::create(pods).unwrap();
        let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), REMOTE_PORT);
        serve_echo(&cluster.remote.ns, remote);
        for pod in &cluster.pods {
            serve_echo(&pod.ns, SocketAddr::new(pod.addrs.v4.into(), APP_PORT));
        }
        Self {
            mode,
            cluster,
            dir: TempDir(dir),
            pins,
            cgroup: CgroupGuard::create().unwrap(),
            _bpffs: bpffs,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.0.join("ztunnel.sock")
    }

    fn pods_file(&self) -> PathBuf {
        self.dir.0.join("pods.json")
    }

    fn log(&self) -> PathBuf {
        self.dir.0.join("agent.log")
    }

    /// Lists `(uid, namespace, pod index)` in the pods file.
    fn list(&self, pods: &[(&str, &str, usize)]) {
        let entries: Vec<String> = pods
            .iter()
            .map(|(uid, namespace, i)| {
                format!(
                    r#"{{"uid": "{uid}", "name": "{uid}", "namespace": "{namespace}", "netns": "{}"}}"#,
                    self.cluster.pods[*i].ns.path().display()
                )
            })
            .collect();
        std::fs::write(
            self.pods_file(),
            format!(r#"{{"pods": [{}]}}"#, entries.join(", ")),
        )
        .unwrap();
    }

    fn spawn_agent(&self, extra: &[&str]) -> Proc {
        let mode = match self.mode {
            RedirectMode::Ebpf => "ebpf",
            RedirectMode::Iptables => "iptables",
            RedirectMode::Nftables => "nftables",
        };
        let mut cmd = agent_command(
            &self.cluster.node,
            &self.pins,
            &self.socket(),
            &self.pods_file(),
            self.cgroup.path(),
            "127.0.0.1:0",
        );
        cmd.args(["--redirect-mode", mode]).args(extra);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .unwrap();
        cmd.stderr(log);
        Proc(cmd.spawn().unwrap())
    }

    fn agent_log(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    fn remote(&self) -> SocketAddr {
        SocketAddr::new(self.cluster.remote.addrs.v4.into(), REMOTE_PORT)
    }

    fn app(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.cluster.pods[i].addrs.v4.into(), APP_PORT)
    }

    fn netns(&self, i: usize) -> Netns {
        Netns::open(&self.cluster.pods[i].ns.path().to_string_lossy()).unwrap()
    }
}

/// One request/response from inside `ns` to `to`; returns the connection's
/// own address. Fails when the connection is refused or broken.
fn echo_from(ns: &NetnsGuard, to: SocketAddr) -> std::io::Result<IpAddr> {
    tokio::task::block_in_place(|| {
        ns.run(|| {
            let mut conn = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
            conn.set_read_timeout(Some(Duration::from_secs(5)))?;
            conn.write_all(b"ambpf")?;
            let mut reply = [0u8; 5];
            conn.read_exact(&mut reply)?;
            assert_eq!(&reply, b"ambpf");
            Ok(conn.local_addr()?.ip())
        })
        .unwrap()
    })
}

/// Connections ztunnel has proxied on `port`.
fn proxied(ztunnel: &ZtunnelDouble, port: u16) -> usize {
    ztunnel
        .proxied()
        .iter()
        .filter(|c| c.listener_port == port)
        .count()
}

/// What of ambpf's capture the pod `i` holds: Istio's chains (every backend
/// and family), Istio's nftables tables, an sk_lookup link into its
/// namespace or an earlier agent's steering filter, and in the
/// iptables and nftables modes the policy routing, which the restarted
/// agent removes with the rules.
fn capture_left(node: &Node, i: usize) -> Vec<String> {
    let netns = node.netns(i);
    let mut left = Vec::new();
    match iptables::find_pod_rules(&netns).unwrap() {
        PodRulesFound::None => {}
        found => left.push(format!("iptables rules: {found:?}")),
    }
    let tables: Vec<String> = nft_tables(&node.cluster.pods[i].ns.path())
        .into_iter()
        .filter(|t| nftables::POD_TABLES.contains(&t.as_str()))
        .collect();
    if !tables.is_empty() {
        left.push(format!("nftables tables: {tables:?}"));
    }
    let filters = netns
        .run(|| {
            let mut rtnl = podnet::open_rtnl(Path::new("pod")).unwrap();
            podnet::interfaces(&mut rtnl)
                .unwrap()
                .into_iter()
                .filter_map(|iface| steering::find(&mut rtnl, iface.index).unwrap())
                .collect::<Vec<_>>()
        })
        .unwrap();
    if !filters.is_empty() {
        left.push(format!("steering: {filters:?}"));
    }
    if ambpf_testbed::sk_lookup_linked(netns.inode()).unwrap() {
        left.push("sk_lookup link".to_owned());
    }
    if node.mode != RedirectMode::Ebpf {
        let status = routing::reply_routing_status(&netns).unwrap();
        if status.ipv4.rule || status.ipv4.route {
            left.push(format!("policy routing: {status:?}"));
        }
    }
    left
}

/// Connections from and to pod `i` go direct: they succeed and ztunnel
/// proxies none of them.
fn goes_direct(node: &Node, ztunnel: &ZtunnelDouble, i: usize) {
    let (out, inbound) = (proxied(ztunnel, 15001), proxied(ztunnel, 15006));
    let pod = &node.cluster.pods[i];
    let local = echo_from(&pod.ns, node.remote())
        .unwrap_or_else(|e| panic!("pod {i} to the remote: {e}\n{}", node.agent_log()));
    assert_eq!(local, IpAddr::from(pod.addrs.v4));
    echo_from(&node.cluster.remote.ns, node.app(i))
        .unwrap_or_else(|e| panic!("the remote to pod {i}: {e}"));
    assert_eq!(
        (proxied(ztunnel, 15001), proxied(ztunnel, 15006)),
        (out, inbound),
        "pod {i}'s connections went to ztunnel: {:#?}",
        ztunnel.proxied()
    );
}

/// A new connection from pod `i` reaches ztunnel's outbound listener.
async fn goes_to_ztunnel(node: &Node, ztunnel: &ZtunnelDouble, uid: &str, i: usize) {
    let count = |z: &ZtunnelDouble| {
        z.proxied()
            .iter()
            .filter(|c| c.listener_port == 15001 && c.uid == uid)
            .count()
    };
    let before = count(ztunnel);
    echo_from(&node.cluster.pods[i].ns, node.remote()).unwrap();
    wait_for(
        || count(ztunnel) > before,
        &format!("pod {i}'s connection to reach ztunnel"),
    )
    .await;
}

async fn serving(ztunnel: &ZtunnelDouble, uids: &[&str]) {
    let mut wanted: Vec<String> = uids.iter().map(|u| (*u).to_owned()).collect();
    wanted.sort();
    ztunnel
        .wait_until(
            |s| {
                s.connections.last().is_some_and(|c| c.snapshot_sent)
                    && s.workloads.keys().cloned().collect::<Vec<_>>() == wanted
                    && s.workloads.values().all(|w| w.proxies_running)
            },
            AGENT_PATIENCE,
        )
        .await
        .unwrap();
}

async fn pods_that_left_while_the_agent_was_down_lose_their_capture(mode: RedirectMode) {
    let mut node = Node::create(mode, 4);
    let _inside = node.cgroup.enter_process().unwrap();
    // Pod 3 is the only pod of its namespace, which is unlabelled.
    let all = [
        ("stays", "shop", 0),
        ("deleted", "shop", 1),
        ("opted-out", "shop", 2),
        ("unlabelled", "legacy", 3),
    ];
    node.list(&all);
    let agent = node.spawn_agent(&[]);
    let ztunnel = ZtunnelDouble::connect_with_retry(node.socket(), ZtunnelConfig::default());
    serving(&ztunnel, &["deleted", "opted-out", "stays", "unlabelled"]).await;
    for (uid, _, i) in all {
        goes_to_ztunnel(&node, &ztunnel, uid, i).await;
        assert!(!capture_left(&node, i).is_empty(), "pod {i} is captured");
    }

    // The agent stops; meanwhile three pods leave the mesh.
    drop(agent);
    node.cluster.recycle_pod(1).unwrap();
    serve_echo(&node.cluster.pods[1].ns, node.app(1));
    node.list(&[("stays", "shop", 0)]);

    let _agent = node.spawn_agent(&[]);
    serving(&ztunnel, &["stays"]).await;
    wait_for(
        || [1, 2, 3].iter().all(|i| capture_left(&node, *i).is_empty()),
        "the pods that left to lose their capture",
    )
    .await;
    for i in [1, 2, 3] {
        goes_direct(&node, &ztunnel, i);
    }
    goes_to_ztunnel(&node, &ztunnel, "stays", 0).await;
    assert!(!capture_left(&node, 0).is_empty());

    // Nothing of theirs is left on the node either.
    let kept: Vec<IpAddr> = node.cluster.pods[0].ips().to_vec();
    match mode {
        RedirectMode::Nftables => {
            let host = node.cluster.node.path();
            for set in [nftables::PROBE_SET_V4, nftables::PROBE_SET_V6] {
                for (member, owner) in nft_probe_members(&host, set) {
                    let ip: IpAddr = member.parse().unwrap();
                    assert!(kept.contains(&ip), "{member} ({owner:?}) in {set}");
                }
            }
            let records = std::fs::read_dir(node.pins.join("nftables/pods"))
                .unwrap()
                .count();
            assert_eq!(records, 1, "only the pod that stays is recorded");
        }
        RedirectMode::Iptables => {
            let host = Netns::open(&node.cluster.node.path().to_string_lossy()).unwrap();
            for family in Family::ALL {
                for member in iptables::probe_set_entries(&host, family).unwrap() {
                    assert!(kept.contains(&member.address), "{member:?}");
                }
            }
            let records = std::fs::read_dir(node.pins.join("iptables/pods"))
                .unwrap()
                .count();
            assert_eq!(records, 1, "only the pod that stays is recorded");
        }
        RedirectMode::Ebpf => {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_ambpf"))
                .arg("--pin-root")
                .arg(&node.pins)
                .args(["status", "--json"])
                .output()
                .unwrap();
            let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(status["pods"].as_array().unwrap().len(), 1, "{status}");
        }
    }
    ztunnel.shutdown().await;
}

async fn the_full_check_removes_capture_no_enrolled_pod_owns(mode: RedirectMode) {
    let node = Node::create(mode, 2);
    let _inside = node.cgroup.enter_process().unwrap();
    node.list(&[("enrolled", "shop", 0)]);
    // Pod 1 holds Istio's rules of an agent that kept no record of it (an
    // older one, or the node switched modes): iptables rules, or in
    // nftables mode that mode's tables.
    {
        let host = Netns::open(&node.cluster.node.path().to_string_lossy()).unwrap();
        let mut earlier: Box<dyn PodRedirection> = match mode {
            RedirectMode::Nftables => Box::new(NftablesRedirection::new(host).unwrap()),
            _ => Box::new(IptablesRedirection::new(host, IptablesBackend::Auto).unwrap()),
        };
        let options = EnrollOptions { dns_capture: true };
        earlier.enroll(&node.netns(1), options).unwrap();
    }
    // Its connections are captured for a ztunnel that does not serve it.
    let refused = echo_from(&node.cluster.pods[1].ns, node.remote()).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);

    let _agent = node.spawn_agent(&["--state-check-interval", "1"]);
    let ztunnel = ZtunnelDouble::connect_with_retry(node.socket(), ZtunnelConfig::default());
    serving(&ztunnel, &["enrolled"]).await;
    wait_for(
        || capture_left(&node, 1).is_empty(),
        "the full check to remove pod 1's capture",
    )
    .await;
    goes_direct(&node, &ztunnel, 1);
    goes_to_ztunnel(&node, &ztunnel, "enrolled", 0).await;
    let log = node.agent_log();
    let named = log.lines().any(|l| {
        l.contains("capture_orphan")
            && l.contains(&node.cluster.pods[1].ns.path().display().to_string())
    });
    assert!(named, "{log}");
    ztunnel.shutdown().await;
}

in_all_modes!(pods_that_left_while_the_agent_was_down_lose_their_capture);
in_all_modes!(the_full_check_removes_capture_no_enrolled_pod_owns);
