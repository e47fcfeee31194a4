//! Privileged: ambpf beside another eBPF dataplane on the same node.
//!
//! The real `ambpf` agent runs in a testbed `Cluster`'s node namespace with
//! the ztunnel double, its socket programs on the test's own cgroup, next
//! to the testbed's doubles of another owner's programs
//! (`ambpf_testbed::foreign_programs`):
//!
//! - a strict socket load balancer in the same cgroup hooks, turning the
//!   service address `VIP` into the backend (the remote's echo server) at
//!   connect and back at getpeername, attached before the agent starts and
//!   after it: either way ztunnel gets the service address as the original
//!   destination and the app sees it as its peer (ambpf's connect runs
//!   first where the kernel orders cgroup programs, and its getpeername
//!   last). Attached to a cgroup below ambpf's, the balancer runs first
//!   whatever the order, ztunnel gets the backend, and `status --check`
//!   says so;
//! - tc programs of another owner on the pod's `eth0` (a `clsact` filter
//!   each way, a TCX ingress program): capture works, and enrolment,
//!   an agent restart, the pod's removal and `status --check` leave each
//!   attached with the same program;
//! - a host-side program on the node's uplink that delivers the remote's
//!   packets into the pod with `bpf_redirect_peer`: ambpf's steering
//!   filter still sees the SYN, and ztunnel's 15006 gets the connection.

use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    os::fd::AsFd,
    path::PathBuf,
    process::Command,
    time::Duration,
};

use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    foreign_programs::{self, Service, SocketLb},
    ztunnel::{ConnectionOutcome, ZtunnelConfig, ZtunnelDouble, dns},
};
use serde_json::Value;

mod common;
use common::agent::{Proc, TempDir, agent_command, serve_echo, status_check, wait_for};

const PATIENCE: Duration = Duration::from_secs(20);
/// How long the agent may take to serve ZDS and enrol the pod: a kernel
/// under software emulation (`cargo xtask kernels`) takes 20 s and more.
const AGENT_START: Duration = Duration::from_secs(90);
const POD_UID: &str = "coexistence-pod-uid";
const BACKEND_PORT: u16 = 9000;
const APP_PORT: u16 = 8080;

/// The process moves between cgroups: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The service addresses the balancer translates.
fn vip(v6: bool) -> SocketAddr {
    if v6 {
        "[fd00:96::10]:80".parse().unwrap()
    } else {
        "10.96.0.10:80".parse().unwrap()
    }
}

/// The cluster's DNS service address, as kube-dns's.
const DNS_VIP: &str = "10.96.0.10:53";

/// The app asks the DNS service over UDP: where its answer came from
/// (recvfrom), after ztunnel's DNS proxy answered.
async fn dns_answer_from(world: &World, ztunnel: &ZtunnelDouble) -> SocketAddr {
    let resolver: SocketAddr = DNS_VIP.parse().unwrap();
    let from = tokio::task::block_in_place(|| {
        world
            .pod()
            .ns
            .run(|| {
                let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
                udp.set_read_timeout(Some(PATIENCE)).unwrap();
                let query = dns::encode_query(0x5e1, "svc.ambpf.test", dns::TYPE_A).unwrap();
                udp.send_to(&query, resolver).unwrap();
                let mut buffer = [0u8; 512];
                let (len, from) = udp
                    .recv_from(&mut buffer)
                    .unwrap_or_else(|e| panic!("UDP answer from {resolver}: {e}"));
                assert_eq!(
                    dns::Response::parse(&buffer[..len]).unwrap().header.id,
                    0x5e1
                );
                from
            })
            .unwrap()
    });
    assert!(
        ztunnel
            .dns_queries()
            .iter()
            .any(|q| q.name == "svc.ambpf.test"),
        "ztunnel's DNS proxy did not answer"
    );
    from
}

/// One node with one pod, the remote's echo servers as the backends, and
/// the pod's app, before any agent runs.
struct World {
    // Drop order: the cluster (and its namespaces) before the pins' mount.
    cluster: Cluster,
    cgroup: CgroupGuard,
    bpffs: BpffsMount,
    dir: TempDir,
}

impl World {
    fn create() -> Self {
        let bpffs = BpffsMount::create().unwrap();
        let cgroup = CgroupGuard::create().unwrap();
        let cluster = Cluster::create(1).unwrap();
        let dir = std::env::temp_dir().join(format!(
            "ambpf-coexistence-{}",
            ambpf_testbed::unique_name("")
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let world = Self {
            cluster,
            cgroup,
            bpffs,
            dir: TempDir(dir),
        };
        world.set_pods(true);
        for backend in [world.backend(false), world.backend(true)] {
            serve_echo(&world.cluster.remote.ns, backend);
        }
        serve_echo(
            &world.pod().ns,
            SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), APP_PORT),
        );
        world
    }

    fn pod(&self) -> &ambpf_testbed::cluster::Pod {
        &self.cluster.pods[0]
    }

    fn pins(&self) -> PathBuf {
        self.bpffs.path().join("ambpf")
    }

    fn socket(&self) -> PathBuf {
        self.dir.0.join("ztunnel.sock")
    }

    fn pods_file(&self) -> PathBuf {
        self.dir.0.join("pods.json")
    }

    /// The pods file with the pod in it, or empty.
    fn set_pods(&self, with_pod: bool) {
        let pods = if with_pod {
            format!(
                r#"{{"pods": [{{"uid": "{POD_UID}", "name": "web-0", "namespace": "shop", "netns": "{}"}}]}}"#,
                self.pod().ns.path().display()
            )
        } else {
            r#"{"pods": []}"#.to_owned()
        };
        std::fs::write(self.pods_file(), pods).unwrap();
    }

    fn backend(&self, v6: bool) -> SocketAddr {
        let ip: IpAddr = if v6 {
            self.cluster.remote.addrs.v6.into()
        } else {
            self.cluster.remote.addrs.v4.into()
        };
        SocketAddr::new(ip, BACKEND_PORT)
    }

    fn app(&self) -> SocketAddr {
        SocketAddr::new(self.pod().addrs.v4.into(), APP_PORT)
    }

    /// Where the balancer sends the DNS service's queries: nothing serves
    /// there, so only ztunnel's DNS proxy can answer.
    fn dns_backend(&self) -> SocketAddr {
        SocketAddr::new(self.cluster.remote.addrs.v4.into(), 53)
    }

    /// The balancer of the service addresses (`VIP` to the echo servers,
    /// and the DNS service to [`Self::dns_backend`]).
    fn socket_lb(&self) -> SocketLb {
        let service = |vip, backend| Service { vip, backend };
        SocketLb::load(&[
            service(vip(false), self.backend(false)),
            service(vip(true), self.backend(true)),
            service(DNS_VIP.parse().unwrap(), self.dns_backend()),
        ])
        .unwrap()
    }

    /// Waits until ztunnel's 15006 has accepted a connection to the app
    /// with the app's address as original destination.
    async fn inbound_proxied(&self, ztunnel: &ZtunnelDouble) {
        ztunnel
            .wait_until(
                |s| {
                    s.proxied
                        .iter()
                        .any(|c| c.listener_port == 15006 && c.original_dst == self.app())
                },
                PATIENCE,
            )
            .await
            .unwrap();
    }

    /// The agent, and the ztunnel double once the pod's proxies run.
    async fn start_agent(&self, ztunnel: Option<ZtunnelDouble>) -> (Proc, ZtunnelDouble) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.agent_log_path())
            .unwrap();
        let mut cmd = agent_command(
            &self.cluster.node,
            &self.pins(),
            &self.socket(),
            &self.pods_file(),
            self.cgroup.path(),
            "127.0.0.1:0",
        );
        cmd.args(["--state-check-interval", "1"]).stderr(log);
        let agent = Proc(cmd.spawn().unwrap());
        let ztunnel = ztunnel.unwrap_or_else(|| {
            ZtunnelDouble::connect_with_retry(self.socket(), ZtunnelConfig::default())
        });
        ztunnel
            .wait_until(
                |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
                AGENT_START,
            )
            .await
            .unwrap();
        (agent, ztunnel)
    }

    fn agent_log_path(&self) -> PathBuf {
        self.dir.0.join("agent.log")
    }

    /// What the agents of this world logged.
    fn agent_log(&self) -> String {
        std::fs::read_to_string(self.agent_log_path()).unwrap_or_default()
    }

    /// `ambpf status --check -o json`: whether it passed, and its report.
    fn check(&self) -> (bool, Value, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_ambpf"))
            .arg("--pin-root")
            .arg(self.pins())
            .args(["status", "--check", "-o", "json"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let report = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}{stderr}", String::from_utf8_lossy(&out.stdout)));
        (out.status.success(), report, stderr)
    }

    /// `ambpf status --check` as text: whether it passed, stdout and stderr.
    fn check_text(&self) -> (bool, String) {
        status_check(&self.pins())
    }
}

fn connect(ns: &NetnsGuard, to: SocketAddr) -> TcpStream {
    let conn = ns
        .run(|| TcpStream::connect_timeout(&to, PATIENCE))
        .unwrap()
        .unwrap_or_else(|e| panic!("connecting to {to}: {e}"));
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    conn
}

fn echo(conn: &mut TcpStream, what: &[u8]) {
    conn.write_all(what).unwrap();
    let mut reply = vec![0u8; what.len()];
    conn.read_exact(&mut reply).expect("connection broke");
    assert_eq!(reply, what);
}

/// The app in the pod connects to the service address (both families):
/// for each, the peer the app is told (getpeername) and the original
/// destination ztunnel got on 15001.
async fn through_the_service(
    world: &World,
    ztunnel: &ZtunnelDouble,
) -> Vec<(SocketAddr, SocketAddr)> {
    let mut out = Vec::new();
    for v6 in [false, true] {
        ztunnel.take_proxied();
        let peer = tokio::task::block_in_place(|| {
            let mut conn = connect(&world.pod().ns, vip(v6));
            echo(&mut conn, b"through the service");
            conn.peer_addr().unwrap()
        });
        ztunnel
            .wait_until(
                |s| s.proxied.iter().any(|c| c.listener_port == 15001),
                PATIENCE,
            )
            .await
            .unwrap();
        let conn = ztunnel
            .take_proxied()
            .into_iter()
            .find(|c| c.listener_port == 15001)
            .unwrap();
        assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{conn:?}");
        out.push((peer, conn.original_dst));
    }
    out
}

/// The programs `status --check` lists on the cgroup hook `hook`, in run
/// order, as (name, owner).
fn cgroup_hook(report: &Value, hook: &str) -> Vec<(String, String)> {
    listed(
        report["other_programs"]["cgroup_hooks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["hook"] == hook)
            .unwrap_or_else(|| panic!("no {hook} in {report}"))["effective"]
            .as_array()
            .unwrap(),
    )
}

/// (name, owner) of each program of a hook `status --check` lists.
fn listed(programs: &[Value]) -> Vec<(String, String)> {
    programs
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["owner"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn warnings(report: &Value) -> Vec<String> {
    report["other_programs"]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["detail"].as_str().unwrap().to_owned())
        .collect()
}

/// Both orders of attachment in ambpf's cgroup leave ztunnel the service
/// address and the app its peer, and `status --check` shows ambpf's
/// connect first and its getpeername last, with nothing to warn about.
async fn the_service_address_survives(lb_first: bool) {
    let _serial = SERIAL.lock().await;
    let world = World::create();
    let _inside = world.cgroup.enter_process().unwrap();
    let mut lb = world.socket_lb();
    if lb_first {
        lb.attach(world.cgroup.path()).unwrap();
    }
    let (agent, ztunnel) = world.start_agent(None).await;
    if !lb_first {
        lb.attach(world.cgroup.path()).unwrap();
    }
    let ordered = foreign_programs::cgroup_ordering_supported(world.cgroup.path()).unwrap();
    let through = through_the_service(&world, &ztunnel).await;
    let (passed, report, stderr) = world.check();
    assert!(passed, "{report} {stderr}");
    if lb_first && !ordered {
        // A kernel that cannot order cgroup programs runs the balancer
        // first: ztunnel gets the backend, and status --check says why.
        for (v6, (_, original_dst)) in [false, true].into_iter().zip(through) {
            assert_eq!(
                original_dst,
                world.backend(v6),
                "ztunnel's original destination"
            );
        }
        let said = warnings(&report);
        assert!(
            said.iter()
                .any(|w| w.contains("lb_connect4") && w.contains("runs before ambpf's")),
            "{said:?}"
        );
        ztunnel.shutdown().await;
        return;
    }
    for (v6, (peer, original_dst)) in [false, true].into_iter().zip(through) {
        assert_eq!(original_dst, vip(v6), "ztunnel's original destination");
        assert_eq!(peer, vip(v6), "the app's peer");
    }
    // A new agent swaps its programs inside its pinned links, which keep
    // their places.
    drop(agent);
    let (_agent, ztunnel) = world.start_agent(Some(ztunnel)).await;
    for (v6, (peer, original_dst)) in [false, true]
        .into_iter()
        .zip(through_the_service(&world, &ztunnel).await)
    {
        assert_eq!(original_dst, vip(v6), "after a restart");
        assert_eq!(peer, vip(v6), "the app's peer after a restart");
    }
    // DNS to the service address is captured before the balancer's
    // sendmsg, and the answer comes from the address the app asked.
    assert_eq!(
        dns_answer_from(&world, &ztunnel).await,
        DNS_VIP.parse().unwrap()
    );
    let (_, report, _) = world.check();
    let connect = cgroup_hook(&report, "cgroup_inet4_connect");
    let names: Vec<&str> = connect.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["ambpf_connect4", "lb_connect4"], "{report}");
    assert_eq!(connect[0].1, "ambpf");
    assert_eq!(connect[1].1, "other");
    let getpeername = cgroup_hook(&report, "cgroup_inet6_getpeername");
    let last = getpeername.last().unwrap();
    if lb_first {
        assert_eq!(last.1, "ambpf", "{report}");
        assert_eq!(warnings(&report), Vec::<String>::new(), "{report}");
    } else {
        // Attached after the agent, the balancer's reverse translation
        // runs after ambpf's answer: harmless here (it sees the service
        // address), but named.
        assert_eq!(last.0, "lb_getpeername6", "{report}");
        let mut hooks: Vec<&str> = report["other_programs"]["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["hook"].as_str().unwrap())
            .collect();
        hooks.sort_unstable();
        assert_eq!(
            hooks,
            [
                "cgroup_inet4_getpeername",
                "cgroup_inet6_getpeername",
                "cgroup_udp4_recvmsg",
                "cgroup_udp6_recvmsg"
            ],
            "{report}"
        );
        assert!(
            warnings(&report)
                .iter()
                .all(|w| w.contains("runs after ambpf's")),
            "{report}"
        );
    }
    ztunnel.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_socket_lb_attached_before_the_agent_leaves_ztunnel_the_service_address() {
    the_service_address_survives(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_socket_lb_attached_after_the_agent_leaves_ztunnel_the_service_address() {
    the_service_address_survives(false).await;
}

/// A balancer on a cgroup below ambpf's runs before ambpf's connect for the
/// sockets there, whatever the order of attachment: ztunnel gets the
/// backend. `status --check` names the program and the cgroup, and still
/// passes (a warning, not a violation of ambpf's state); the agent's log
/// says the same at its next full check.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_socket_lb_below_the_agents_cgroup_runs_first_and_is_named() {
    let _serial = SERIAL.lock().await;
    let world = World::create();
    let below = CgroupGuard::create_in(world.cgroup.path(), "lb").unwrap();
    let _inside = below.enter_process().unwrap();
    let (_agent, ztunnel) = world.start_agent(None).await;
    let mut lb = world.socket_lb();
    lb.attach(below.path()).unwrap();
    for (v6, (peer, original_dst)) in [false, true]
        .into_iter()
        .zip(through_the_service(&world, &ztunnel).await)
    {
        assert_eq!(
            original_dst,
            world.backend(v6),
            "ztunnel's original destination"
        );
        // The balancer's getpeername runs first too, and sees ambpf's
        // address of ztunnel; ambpf then answers what it recorded.
        assert_eq!(peer, world.backend(v6), "the app's peer");
    }
    // The balancer's sendmsg runs first as well: the answer comes from
    // the backend it chose.
    assert_eq!(dns_answer_from(&world, &ztunnel).await, world.dns_backend());
    let (passed, report, stderr) = world.check();
    assert!(passed, "warnings fail the check: {report} {stderr}");
    let said = warnings(&report);
    let lb_ids = lb.program_ids().unwrap();
    for name in ["lb_connect4", "lb_connect6", "lb_sendmsg4", "lb_sendmsg6"] {
        let id = lb_ids.iter().find(|(n, _)| *n == name).unwrap().1;
        assert!(
            said.iter()
                .any(|w| w.contains(&format!("program {id} {name}"))
                    && w.contains(&below.path().display().to_string())
                    && w.contains("runs before ambpf's")),
            "{name}: {said:?}"
        );
    }
    let (passed, text) = world.check_text();
    assert!(passed, "{text}");
    assert!(
        text.contains("warning: cgroup_inet4_connect: program") && text.contains("below, first"),
        "{text}"
    );
    // The balancer came after the agent: its next full state check says so.
    let connect4 = lb_ids.iter().find(|(n, _)| *n == "lb_connect4").unwrap().1;
    let logged =
        format!("other eBPF programs: cgroup_inet4_connect: program {connect4} lb_connect4");
    wait_for(
        || world.agent_log().contains(&logged),
        "the agent to log the balancer below its cgroup",
    )
    .await;
    ztunnel.shutdown().await;
}

/// Another owner's programs on the pod's `eth0`, as `bpftool net show`
/// lists `clsact` filters and the kernel TCX programs: (kind, name,
/// program id), ambpf's filter left out (ambpf attaches no TCX program
/// to a pod's interface).
fn foreign_on_eth0(pod: &NetnsGuard) -> Vec<(String, String, u64)> {
    let out = pod
        .command("bpftool")
        .unwrap()
        .args(["-j", "net", "show", "dev", "eth0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut found = Vec::new();
    // bpftool of this vintage lists no TCX programs: those come from the
    // kernel's own query.
    let eth0 = pod.ifindex("eth0").unwrap();
    let tcx = pod
        .run(|| foreign_programs::attached_programs(eth0, foreign_programs::TCX_INGRESS))
        .unwrap()
        .unwrap();
    for id in tcx {
        found.push(("tcx/ingress".to_owned(), String::new(), u64::from(id)));
    }
    for section in ["tc"] {
        for p in listing[0][section].as_array().into_iter().flatten() {
            // tc names a pinned program `<name>:[*fsobj]`.
            let name = p["name"].as_str().unwrap_or("");
            let name = name.split(':').next().unwrap_or(name).to_owned();
            if name.starts_with("ambpf_") {
                continue;
            }
            found.push((
                p["kind"].as_str().unwrap().to_owned(),
                name,
                p["prog_id"]
                    .as_u64()
                    .or(p["id"].as_u64())
                    .unwrap_or_else(|| panic!("{p}")),
            ));
        }
    }
    found.sort();
    found
}

/// Another owner's `clsact` filters (ingress and egress, at priority 10)
/// and TCX ingress program on the pod's `eth0`, which pass every packet on:
/// capture works beside them, and enrolment, `status --check`, an agent
/// restart and the pod's removal leave each with the same program.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn other_owners_tc_programs_on_the_pod_are_kept_and_capture_holds() {
    let _serial = SERIAL.lock().await;
    let world = World::create();
    let _inside = world.cgroup.enter_process().unwrap();
    let pod = &world.pod().ns;
    if !foreign_programs::tcx_supported(pod, "eth0").unwrap() {
        eprintln!(
            "skipped: this kernel has no TCX links (Linux 6.6), which the test's other owner uses"
        );
        return;
    }
    let _others = foreign_programs::PassOnPrograms::attach(
        pod,
        "eth0",
        &world.bpffs.path().join("foreign_pass"),
    )
    .unwrap();
    let before = foreign_on_eth0(pod);
    assert_eq!(before.len(), 3, "{before:?}");

    let captured = async |ztunnel: &ZtunnelDouble| {
        ztunnel.take_proxied();
        tokio::task::block_in_place(|| {
            let mut conn = connect(&world.cluster.remote.ns, world.app());
            echo(&mut conn, b"inbound");
        });
        world.inbound_proxied(ztunnel).await;
    };
    let (agent, ztunnel) = world.start_agent(None).await;
    captured(&ztunnel).await;
    assert_eq!(foreign_on_eth0(pod), before, "after enrolment");

    let (passed, report, stderr) = world.check();
    assert!(passed, "{report} {stderr}");
    let hooks = report["other_programs"]["interfaces"].as_array().unwrap();
    let on = |hook: &str| -> Vec<(String, String)> {
        listed(
            hooks
                .iter()
                .find(|h| h["iface"] == "eth0" && h["hook"] == hook)
                .unwrap_or_else(|| panic!("no {hook} in {report}"))["programs"]
                .as_array()
                .unwrap(),
        )
    };
    let pair = |name: &str, owner: &str| (name.to_owned(), owner.to_owned());
    // Nothing of ambpf's on the pod's interface: its capture is the pod's
    // socket lookup.
    assert_eq!(on("tc_ingress"), [pair("foreign_pass", "other")]);
    assert_eq!(on("tc_egress"), [pair("foreign_pass", "other")]);
    assert_eq!(on("tcx_ingress"), [pair("foreign_tcx", "other")]);
    // The TCX program runs before the pod's socket lookup, which capture
    // meets all the same: nothing to warn about.
    let said = warnings(&report);
    assert!(said.is_empty(), "{said:?}");

    // An agent restart replaces ambpf's programs, not the others'.
    drop(agent);
    let (agent, ztunnel) = world.start_agent(Some(ztunnel)).await;
    captured(&ztunnel).await;
    assert_eq!(foreign_on_eth0(pod), before, "after a restart");

    // The pod's removal leaves the others' programs.
    world.set_pods(false);
    ztunnel
        .wait_until(|s| !s.workloads.contains_key(POD_UID), PATIENCE)
        .await
        .unwrap();
    assert_eq!(foreign_on_eth0(pod), before, "after the pod's removal");
    drop(agent);
    ztunnel.shutdown().await;
}

/// The `bpf_redirect_peer` path: a program on the node's uplink
/// (`vremote`'s ingress) hands the remote's packets to the pod straight
/// into its namespace, past the node's routing and `vpod1`'s transmit
/// path. The pod's ingress hook still runs for them (the kernel runs the
/// peer's ingress in another round), so ambpf's steering filter sees the
/// SYN and ztunnel's 15006 gets the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn packets_redirected_into_the_pod_with_redirect_peer_are_still_captured() {
    let _serial = SERIAL.lock().await;
    let world = World::create();
    let _inside = world.cgroup.enter_process().unwrap();
    let node = &world.cluster.node;
    let pod = &world.pod().ns;
    if !foreign_programs::tcx_supported(node, "vremote").unwrap() {
        eprintln!(
            "skipped: this kernel has no TCX links (Linux 6.6), which the test's host routing program attaches with"
        );
        return;
    }
    let link: Value = serde_json::from_slice(
        &pod.command("ip")
            .unwrap()
            .args(["-j", "link", "show", "eth0"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let mac: Vec<u8> = link[0]["address"]
        .as_str()
        .unwrap()
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    let host_side = node.ifindex("vpod1").unwrap();
    let program = foreign_programs::redirect_peer_program(
        world.pod().addrs.v4,
        mac.try_into().unwrap(),
        host_side,
    )
    .unwrap();
    let uplink = node.ifindex("vremote").unwrap();
    let _link = node
        .run(|| {
            foreign_programs::link_create(program.as_fd(), uplink, foreign_programs::TCX_INGRESS)
        })
        .unwrap()
        .unwrap();
    let (_agent, ztunnel) = world.start_agent(None).await;

    let transmitted = || -> u64 {
        let out = node
            .command("ip")
            .unwrap()
            .args(["-j", "-s", "link", "show", "vpod1"])
            .output()
            .unwrap();
        let stats: Value = serde_json::from_slice(&out.stdout).unwrap();
        stats[0]["stats64"]["tx"]["packets"].as_u64().unwrap()
    };
    const ROUND_TRIPS: u64 = 20;
    let sent_before = transmitted();
    tokio::task::block_in_place(|| {
        let mut conn = connect(&world.cluster.remote.ns, world.app());
        for _ in 0..ROUND_TRIPS {
            echo(&mut conn, b"redirected into the pod");
        }
    });
    let through_vpod = transmitted() - sent_before;
    // Through the node's routing, every segment would have left by vpod1.
    assert!(
        through_vpod < ROUND_TRIPS / 2,
        "{through_vpod} packets went through vpod1: the program did not redirect"
    );
    world.inbound_proxied(&ztunnel).await;
    ztunnel.shutdown().await;
}
