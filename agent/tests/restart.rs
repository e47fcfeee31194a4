//! Privileged: the agent dies (SIGKILL) and comes back, as in a crash or an
//! upgrade, while connections are open through ztunnel.
//!
//! The real `ambpf` binary runs in the node namespace of a testbed `Cluster`
//! with a pods file; the ztunnel double reconnects on its own, as ztunnel
//! does. Checked: open connections survive the kill and the restart, new
//! connections stay redirected while no agent runs (the pinned state does the
//! work), the new agent adopts the pinned maps and links (same link ids, new
//! programs), ztunnel gets a full snapshot again, and removing the pod
//! afterwards leaves no map entry behind. `ambpf status --check` finds the
//! pinned state consistent throughout, names a link directory that belongs
//! to no pod, and the agent's own check removes it.
//!
//! The same in nftables mode, where the pod's tables and the host's probe
//! sets are the kernel's: open connections survive, new ones stay captured
//! while no agent runs, the new agent adopts the pod from its record without
//! duplicating a rule or a member, and once the pod leaves its connections
//! go direct and neither a member nor a record is left.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command},
    time::Duration,
};

use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    privileges::{CHART_AGENT_CAPABILITIES, exec_with_only},
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};
use serde_json::Value;

mod common;
use common::agent::{
    TempDir, agent_command, nft_json, nft_probe_members, serve_echo, status_check, wait_for,
};

const PATIENCE: Duration = Duration::from_secs(20);
const POD_UID: &str = "restart-pod-uid";

struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The agent in the node's namespace with the chart's capabilities only.
fn spawn_agent(node: &NetnsGuard, pins: &Path, socket: &Path, pods: &Path, cgroup: &Path) -> Agent {
    spawn_agent_in(node, pins, socket, pods, cgroup, "ebpf")
}

fn spawn_agent_in(
    node: &NetnsGuard,
    pins: &Path,
    socket: &Path,
    pods: &Path,
    cgroup: &Path,
    mode: &str,
) -> Agent {
    let mut cmd = agent_command(node, pins, socket, pods, cgroup, "127.0.0.1:0");
    cmd.args(["--redirect-mode", mode]);
    exec_with_only(&mut cmd, CHART_AGENT_CAPABILITIES).unwrap();
    let agent = Agent(cmd.spawn().unwrap());
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.0.id())).unwrap();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap());
    let chart = CHART_AGENT_CAPABILITIES
        .iter()
        .fold(0u64, |mask, cap| mask | 1 << cap);
    assert_eq!(effective, Some(chart), "the agent's effective capabilities");
    agent
}

fn status(pins: &Path) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pins)
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// (pin, link id, program id) of every pinned link.
fn links(status: &Value) -> Vec<(String, u64, u64)> {
    let mut out: Vec<_> = status["links"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["pin"].as_str().unwrap().to_owned(),
                l["link_id"].as_u64().unwrap(),
                l["program_id"].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn echo(conn: &mut TcpStream, what: &[u8]) {
    conn.write_all(what).unwrap();
    let mut reply = vec![0u8; what.len()];
    conn.read_exact(&mut reply).expect("connection broke");
    assert_eq!(reply, what);
}

fn connect(ns: &NetnsGuard, to: SocketAddr) -> TcpStream {
    let conn = ns
        .run(|| TcpStream::connect_timeout(&to, PATIENCE))
        .unwrap()
        .unwrap();
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_and_restarting_the_agent_disrupts_nothing_and_leaks_nothing() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let dir =
        std::env::temp_dir().join(format!("ambpf-restart-{}", ambpf_testbed::unique_name("")));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let (socket, pods_file) = (dir.join("ztunnel.sock"), dir.join("pods.json"));
    let pods_json = format!(
        r#"{{"pods": [{{"uid": "{POD_UID}", "name": "web-0", "namespace": "shop", "netns": "{}"}}]}}"#,
        pod.ns.path().display()
    );
    std::fs::write(&pods_file, &pods_json).unwrap();

    let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), 9000);
    let app = SocketAddr::new(pod.addrs.v4.into(), 8080);
    serve_echo(&cluster.remote.ns, remote);
    serve_echo(
        &pod.ns,
        SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), 8080),
    );

    let agent = spawn_agent(&cluster.node, &pins, &socket, &pods_file, cgroup.path());
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default());
    ztunnel
        .wait_until(
            |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
            PATIENCE,
        )
        .await
        .unwrap();

    // Open connections through ztunnel, both ways.
    let (mut outbound, mut inbound) = tokio::task::block_in_place(|| {
        let mut outbound = connect(&pod.ns, remote);
        let mut inbound = connect(&cluster.remote.ns, app);
        echo(&mut outbound, b"before");
        echo(&mut inbound, b"before");
        (outbound, inbound)
    });
    let proxied = ztunnel.proxied();
    assert!(
        proxied
            .iter()
            .any(|c| c.listener_port == 15001 && c.original_dst == remote),
        "{proxied:?}"
    );
    assert!(
        proxied
            .iter()
            .any(|c| c.listener_port == 15006 && c.original_dst == app),
        "{proxied:?}"
    );
    let before = status(&pins);

    // SIGKILL: no chance to clean up.
    drop(agent);
    tokio::task::block_in_place(|| {
        echo(&mut outbound, b"agent dead");
        echo(&mut inbound, b"agent dead");
        // New connections are still redirected: the pinned state needs no agent.
        let mut fresh = connect(&pod.ns, remote);
        echo(&mut fresh, b"fresh");
    });
    let outbound_proxied = |z: &ZtunnelDouble| {
        z.proxied()
            .iter()
            .filter(|c| c.listener_port == 15001)
            .count()
    };
    wait_for(
        || outbound_proxied(&ztunnel) >= 2,
        "the new connection to reach ztunnel",
    )
    .await;

    // The agent comes back: it adopts the pins and ztunnel gets a new snapshot.
    let _agent = spawn_agent(&cluster.node, &pins, &socket, &pods_file, cgroup.path());
    ztunnel
        .wait_until(
            |s| {
                s.connections.len() >= 2
                    && s.connections
                        .last()
                        .is_some_and(|c| c.snapshot_sent && c.added.iter().any(|u| u == POD_UID))
            },
            PATIENCE,
        )
        .await
        .unwrap();
    let after = status(&pins);
    let (consistent, said) = status_check(&pins);
    assert!(consistent, "{said}");
    assert!(said.contains("consistent"), "{said}");
    // The pod's sk_lookup link is the same, running the new agent's program.
    let steering = |status: &Value| {
        let link = &status["pods"][0]["inbound_link"];
        assert_eq!(link["in_pod_netns"], true, "{status}");
        link["program_id"].as_u64().unwrap()
    };
    assert_ne!(
        steering(&before),
        steering(&after),
        "the inbound program was not replaced"
    );
    tokio::task::block_in_place(|| {
        echo(&mut outbound, b"agent back");
        echo(&mut inbound, b"agent back");
    });
    assert_eq!(after["pods"].as_array().unwrap().len(), 1, "{after}");
    let (before_links, after_links) = (links(&before), links(&after));
    assert_eq!(before_links.len(), after_links.len());
    for ((pin, link, prog), (pin2, link2, prog2)) in before_links.iter().zip(&after_links) {
        assert_eq!(
            (pin, link),
            (pin2, link2),
            "link was recreated, not adopted"
        );
        assert_ne!(prog, prog2, "{pin}: program not replaced by the new agent");
    }

    // Closed connections leave no original-destination entry behind.
    drop((outbound, inbound));
    let entries = |name: &str| {
        let status = status(&pins);
        status["maps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .unwrap()["entries"]
            .as_u64()
            .unwrap()
    };
    wait_for(
        || entries("ambpf_orig_tpl") == 0 && entries("ambpf_orig_ck") == 0,
        "closed connections' entries to go",
    )
    .await;

    // Removing the pod leaves no entry behind.
    std::fs::write(&pods_file, r#"{"pods": []}"#).unwrap();
    wait_for(
        || status(&pins)["pods"].as_array().unwrap().is_empty(),
        "the pod to be removed",
    )
    .await;
    ztunnel
        .wait_until(|s| !s.workloads.contains_key(POD_UID), PATIENCE)
        .await
        .unwrap();
    let last = status(&pins);
    assert!(
        !last["links"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["pin"].as_str().unwrap().contains("links/pods")),
        "the pod's TC link is still pinned: {last}"
    );

    // A link directory of no pod is a violation `status --check` names; the
    // agent's check after its next pass removes it.
    let orphan = pins.join("links/pods/4026530000");
    std::fs::create_dir_all(&orphan).unwrap();
    let (consistent, said) = status_check(&pins);
    assert!(!consistent, "{said}");
    assert!(
        said.contains("steering_orphan") && said.contains("4026530000"),
        "{said}"
    );
    std::fs::write(&pods_file, r#"{"pods": [], "note": "a pass"}"#).unwrap();
    wait_for(|| !orphan.exists(), "the agent to repair the orphan").await;
    assert!(status_check(&pins).0);
    ztunnel.shutdown().await;
}

/// The rules of the pod's nftables tables (`nft -j`, without handles and
/// counters, which a rebuild renumbers and resets).
fn pod_rules(pod: &NetnsGuard) -> Vec<String> {
    let listing = nft_json(&pod.path(), &["list", "ruleset"]);
    let mut rules: Vec<String> = listing["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .map(|rule| {
            let mut rule = rule.clone();
            rule.as_object_mut().unwrap().remove("handle");
            if let Some(expr) = rule["expr"].as_array_mut() {
                expr.retain(|e| e.get("counter").is_none());
            }
            rule.to_string()
        })
        .collect();
    rules.sort();
    rules
}

/// The node's probe set members (both families) with their comments.
fn probe_members(node: &NetnsGuard) -> Vec<(String, Option<String>)> {
    let mut members: Vec<_> = ["istio-inpod-probes-v4", "istio-inpod-probes-v6"]
        .iter()
        .flat_map(|set| nft_probe_members(&node.path(), set))
        .collect();
    members.sort();
    members
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_and_restarting_the_nftables_agent_disrupts_nothing_and_leaks_nothing() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create().unwrap();
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let dir = std::env::temp_dir().join(format!(
        "ambpf-restart-nft-{}",
        ambpf_testbed::unique_name("")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let (socket, pods_file) = (dir.join("ztunnel.sock"), dir.join("pods.json"));
    let pods_json = format!(
        r#"{{"pods": [{{"uid": "{POD_UID}", "name": "web-0", "namespace": "shop", "netns": "{}"}}]}}"#,
        pod.ns.path().display()
    );
    std::fs::write(&pods_file, &pods_json).unwrap();
    let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), 9000);
    let app = SocketAddr::new(pod.addrs.v4.into(), 8080);
    serve_echo(&cluster.remote.ns, remote);
    serve_echo(&pod.ns, app);
    let spawn = || {
        spawn_agent_in(
            &cluster.node,
            &pins,
            &socket,
            &pods_file,
            cgroup.path(),
            "nftables",
        )
    };
    let outbound_proxied = |z: &ZtunnelDouble| {
        z.proxied()
            .iter()
            .filter(|c| c.listener_port == 15001 && c.original_dst == remote)
            .count()
    };

    let agent = spawn();
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default());
    ztunnel
        .wait_until(
            |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
            PATIENCE,
        )
        .await
        .unwrap();
    let (mut outbound, mut inbound) = tokio::task::block_in_place(|| {
        let mut outbound = connect(&pod.ns, remote);
        let mut inbound = connect(&cluster.remote.ns, app);
        echo(&mut outbound, b"before");
        echo(&mut inbound, b"before");
        (outbound, inbound)
    });
    wait_for(
        || {
            outbound_proxied(&ztunnel) == 1
                && ztunnel
                    .proxied()
                    .iter()
                    .any(|c| c.listener_port == 15006 && c.original_dst == app)
        },
        "both connections to go through ztunnel",
    )
    .await;
    let (rules, members) = (pod_rules(&pod.ns), probe_members(&cluster.node));
    assert!(!rules.is_empty());
    assert_eq!(members.len(), pod.ips().len(), "{members:?}");

    drop(agent);
    tokio::task::block_in_place(|| {
        echo(&mut outbound, b"agent dead");
        echo(&mut inbound, b"agent dead");
        let mut fresh = connect(&pod.ns, remote);
        echo(&mut fresh, b"fresh");
    });
    wait_for(
        || outbound_proxied(&ztunnel) == 2,
        "the new connection to reach ztunnel",
    )
    .await;

    let _agent = spawn();
    ztunnel
        .wait_until(
            |s| {
                s.connections.len() >= 2
                    && s.connections
                        .last()
                        .is_some_and(|c| c.snapshot_sent && c.added.iter().any(|u| u == POD_UID))
            },
            PATIENCE,
        )
        .await
        .unwrap();
    tokio::task::block_in_place(|| {
        echo(&mut outbound, b"agent back");
        echo(&mut inbound, b"agent back");
    });
    assert_eq!(
        pod_rules(&pod.ns),
        rules,
        "the pod's rules after the restart"
    );
    assert_eq!(probe_members(&cluster.node), members);
    let records = pins.join("nftables/pods");
    assert_eq!(std::fs::read_dir(&records).unwrap().count(), 1);

    // The pod leaves: its new connections go direct, and nothing of it is
    // left on the node.
    std::fs::write(&pods_file, r#"{"pods": []}"#).unwrap();
    ztunnel
        .wait_until(|s| !s.workloads.contains_key(POD_UID), PATIENCE)
        .await
        .unwrap();
    wait_for(
        || probe_members(&cluster.node).is_empty(),
        "the pod's probe set members to go",
    )
    .await;
    let before = outbound_proxied(&ztunnel);
    tokio::task::block_in_place(|| {
        let mut direct = connect(&pod.ns, remote);
        echo(&mut direct, b"direct");
    });
    assert_eq!(
        outbound_proxied(&ztunnel),
        before,
        "{:#?}",
        ztunnel.proxied()
    );
    assert_eq!(std::fs::read_dir(&records).unwrap().count(), 0);
    ztunnel.shutdown().await;
}
