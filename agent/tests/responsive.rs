//! Privileged: the agent stays responsive while a long pass runs. The
//! controller enrols 1,000 pods in iptables mode (namespaces entered,
//! `iptables-restore` run for each: tens of seconds) on a thread of its
//! own, so `/healthz` answers, and a ztunnel that connects meanwhile gets
//! its snapshot (the Add of a pod enrolled before), each within 100 ms.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use ambpf_testbed::{
    CgroupGuard,
    cluster::Cluster,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};

mod common;
use common::agent::{AGENT_PATIENCE, Proc, TempDir};

const PODS: u16 = 1000;
/// What each answer may take while the pass runs.
const PROMPT: Duration = Duration::from_millis(100);
/// Where the agent serves `/healthz`, in the node's namespace (the test's own).
const HEALTH: &str = "127.0.0.1:18000";

fn pods_file(cluster: &Cluster, count: usize) -> String {
    let entries: Vec<String> = cluster.pods[..count]
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            format!(
                r#"{{"uid": "uid-{i}", "name": "app-{i}", "namespace": "shop", "netns": "{}"}}"#,
                pod.ns.path().display()
            )
        })
        .collect();
    format!(r#"{{"pods": [{}]}}"#, entries.join(", "))
}

/// One `GET /healthz` from the node's namespace: its status line and time.
fn healthz(cluster: &Cluster) -> (String, Duration) {
    let started = Instant::now();
    let addr: SocketAddr = HEALTH.parse().unwrap();
    let response = cluster
        .node
        .run(|| -> std::io::Result<String> {
            let mut conn = TcpStream::connect_timeout(&addr, AGENT_PATIENCE)?;
            conn.set_read_timeout(Some(AGENT_PATIENCE))?;
            conn.write_all(b"GET /healthz HTTP/1.1\r\nhost: ambpf\r\nconnection: close\r\n\r\n")?;
            let mut response = String::new();
            conn.read_to_string(&mut response)?;
            Ok(response)
        })
        .unwrap()
        .unwrap_or_else(|e| format!("no answer: {e}"));
    let status = response.lines().next().unwrap_or_default().to_owned();
    (status, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_and_zds_answer_promptly_while_1000_pods_are_enrolled_in_iptables_mode() {
    let cluster = Cluster::create(PODS).unwrap();
    let cgroup = CgroupGuard::create().unwrap();
    let dir = std::env::temp_dir().join(format!(
        "ambpf-responsive-{}",
        ambpf_testbed::unique_name("")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let _dir = TempDir(dir.clone());
    let (socket, pods, log) = (
        dir.join("ztunnel.sock"),
        dir.join("pods.json"),
        dir.join("agent.log"),
    );
    // One pod to start with, held by ztunnel.
    std::fs::write(&pods, pods_file(&cluster, 1)).unwrap();
    let mut agent = cluster.node.command(env!("CARGO_BIN_EXE_ambpf")).unwrap();
    agent
        .arg("--pin-root")
        .arg(dir.join("pins"))
        .args(["run", "--redirect-mode", "iptables", "--pods-file"])
        .arg(&pods)
        .arg("--zds-socket")
        .arg(&socket)
        .arg("--cgroup")
        .arg(cgroup.path())
        .args(["--health-listen", HEALTH, "--metrics-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let _agent = Proc(agent.spawn().unwrap());
    let first = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only());
    first
        .wait_until(
            |s| s.ready && s.workloads.contains_key("uid-0"),
            AGENT_PATIENCE,
        )
        .await
        .unwrap();

    // Now the rest: one pass enrols 999 pods.
    std::fs::write(&pods, pods_file(&cluster, PODS as usize)).unwrap();
    let agent_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // The source logs each read of the file; the pass follows at once.
    let read_all = format!("{}: {PODS} pods", pods.display());
    let deadline = Instant::now() + AGENT_PATIENCE;
    while !agent_log().contains(&read_all) {
        assert!(
            Instant::now() < deadline,
            "the pods file was not read again:\n{}",
            agent_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut slow = Vec::new();
    for _ in 0..20 {
        let (status, took) = tokio::task::block_in_place(|| healthz(&cluster));
        assert!(status.contains(" 200 "), "/healthz: {status}");
        if took > PROMPT {
            slow.push(took);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A ztunnel that connects meanwhile (a rolling update) is given the
    // pods held so far at once, without waiting for the pass.
    let connected = Instant::now();
    let second = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only());
    second
        .wait_until(|s| s.workloads.contains_key("uid-0"), AGENT_PATIENCE)
        .await
        .unwrap();
    let snapshot_in = connected.elapsed();
    // All of that happened while the pass was still running: ztunnel gets
    // the new pods only once it ends.
    let held = second.workloads().len();
    assert!(
        held < PODS as usize,
        "the pass ended before the measurements ({held} pods held); enrol more pods"
    );
    assert!(
        slow.is_empty(),
        "/healthz answers slower than {PROMPT:?}: {slow:?}"
    );
    assert!(
        snapshot_in <= PROMPT,
        "a new ztunnel got pod uid-0 {snapshot_in:?} after connecting"
    );
}
