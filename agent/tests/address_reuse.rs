//! Privileged: a pod's addresses recycled to a new pod, as a node's IPAM
//! does, changed under a live pod, or more than a pod's entry holds, in every
//! redirection mode (`<scenario>::ebpf`, `<scenario>::iptables` and
//! `<scenario>::nftables`, set up as in tests/redirect.rs), with real
//! namespaces (testbed `Cluster`), a real ZDS server and the ztunnel double.
//!
//! Addresses and nsfs inode numbers are reused; netns cookies are not, so
//! every per-pod record belongs to its pod's cookie (eBPF: the `ambpf_pods`
//! and `ambpf_pod_ips` entries and the pod's link directory; iptables: the
//! probe ipset members; nftables: the probe set members). In each scenario pod X is enrolled, then its
//! addresses go to a new pod Y (`Cluster::recycle_pod*`):
//!
//! - `stale_pod_at_agent_start`: the agent (and ztunnel) go away without
//!   uninstalling, so X's pins, rules and ipset members stay; X is deleted
//!   and Y created; a new agent whose source reports only Y runs its first
//!   pass, which enrols Y and removes X.
//! - `netns_inode_reused_at_agent_start`: the same, and Y's namespace gets
//!   X's inode number: Y enrols on the first pass without a failure.
//! - `cni_add_before_the_old_pods_delete`: X's network is torn down (its
//!   namespace lives on) and Y's CNI add arrives while the source still
//!   reports X; then the source drops X. While both claim the addresses the
//!   newer pod, Y, owns them, and the conflict is counted.
//! - `cni_add_after_the_old_pods_delete`: the source drops X before Y's CNI
//!   add.
//! - `kube_new_pod_before_old_pods_delete`,
//!   `kube_old_pods_delete_before_new_pod`: the Kubernetes source against
//!   the test API server, with a running controller; Y (same pod IPs) is
//!   created before X is deleted (a conflict, counted) or after.
//!
//! Then Y is checked end to end, in IPv4 and IPv6: a connection from the
//! remote client to Y's app goes through ztunnel's inbound listener (15006)
//! with the right original destination and reaches the app; one from Y to
//! the remote goes through the outbound listener (15001); in the iptables
//! and nftables modes a probe from the node reaches the app as 169.254.7.127 (or its IPv6
//! equivalent), not through ztunnel. Nothing of X is left: no `ambpf_pods`
//! entry of X's cookie, every `ambpf_pod_ips` entry of the addresses holds
//! Y's, no pod link directory but Y's; the probe (ipset or nftables set)
//! member of each address names Y's cookie. And the agent's state checks never found
//! anything to repair.
//!
//! Two more scenarios check the same of a pod whose addresses are not what
//! it was enrolled with: `pod_addresses_changed_while_enrolled` (the state
//! check finds the change and the pod is enrolled again at its new
//! addresses, the old ones no longer its) and
//! `a_pod_with_two_addresses_of_a_family_is_refused` (an error naming its
//! addresses, the node's other pod enrolled).

mod common;
use common::{Server, agent::nft_probe_members};
#[macro_use]
mod modes;

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use ambpf::{
    bpf::{Dataplane, PinLayout, inspect},
    controller::{
        CniRequest, Controller, DEFAULT_CHECK_INTERVAL, EnrollRequest, PodSpec, ProgrammedPods,
        SourcePods,
    },
    netns::Netns,
    observe::ControllerStats,
    redirect::{
        CheckScope, PodRedirection, RedirectMode, ViolationKind,
        ebpf::ip_key,
        iptables::{self, Family, IptablesBackend, IptablesRedirection},
        nftables::{NftablesRedirection, PROBE_SET_V4, PROBE_SET_V6},
        podnet::netns_cookie,
    },
    sources::kube::{KubeSource, KubeSourceConfig, PodQuery, rules::DATAPLANE_MODE_LABEL},
    zds::{NetnsSource, Workload, ZdsConfig},
};
use ambpf_common::{IpKey, PodConfig, maps};
use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    apiserver::ApiServer,
    cluster::Cluster,
    ztunnel::{ConnectionOutcome, ZtunnelConfig, ZtunnelDouble},
};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use serde_json::json;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
};

const PATIENCE: Duration = Duration::from_secs(10);
const APP_PORT: u16 = 8080;
const PEER_PORT: u16 = 9000;
const X: &str = "uid-app-x";
const Y: &str = "uid-app-y";

/// A task that stops when this is dropped.
struct Task(JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An echo server in a namespace that records its peers.
struct EchoServer {
    seen: Arc<Mutex<Vec<SocketAddr>>>,
    _task: Task,
}

impl EchoServer {
    fn start(ns: &NetnsGuard, addr: SocketAddr) -> Self {
        let listener = ns.run(|| TcpListener::bind(addr)).unwrap().unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let seen = Arc::<Mutex<Vec<SocketAddr>>>::default();
        let record = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, peer)) = listener.accept().await {
                record.lock().unwrap().push(peer);
                tokio::spawn(async move {
                    let (mut r, mut w) = conn.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        Self {
            seen,
            _task: Task(task),
        }
    }

    /// The last peer's address (IPv4 unmapped from a dual-stack listener).
    fn last_peer(&self) -> IpAddr {
        let peer = self.seen.lock().unwrap().last().expect("a connection").ip();
        match peer {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
            v4 => v4,
        }
    }
}

/// One request/response through a new connection made inside `ns`.
fn echo_once(ns: &NetnsGuard, to: SocketAddr) {
    tokio::task::block_in_place(|| {
        ns.run(|| {
            let mut stream = TcpStream::connect_timeout(&to, PATIENCE)
                .unwrap_or_else(|e| panic!("connect {to}: {e}"));
            stream.set_read_timeout(Some(PATIENCE)).unwrap();
            stream.write_all(b"ambpf").unwrap();
            let mut reply = [0u8; 5];
            stream
                .read_exact(&mut reply)
                .unwrap_or_else(|e| panic!("echo from {to}: {e}"));
            assert_eq!(&reply, b"ambpf");
            stream.shutdown(Shutdown::Both).unwrap();
        })
        .unwrap()
    })
}

/// A node (`Cluster` pod 0 is X, then Y) and where its agents keep state;
/// the remote runs echo servers.
struct Node {
    mode: RedirectMode,
    /// eBPF mode: the cgroup this process is in, for the socket programs.
    cgroup: Option<PathBuf>,
    remote_servers: Vec<EchoServer>,
    cluster: Cluster,
    /// eBPF mode: the pins, shared by the node's successive agents.
    bpffs: Option<BpffsMount>,
}

/// What an agent serves ztunnel with, and the ztunnel double it serves.
struct Agent {
    zds: Server,
    ztunnel: ZtunnelDouble,
}

impl Agent {
    /// The agent goes away, and ztunnel with it (closing X's namespace).
    async fn stop(self) {
        drop(self.zds);
        self.ztunnel.shutdown().await;
    }
}

impl Node {
    fn with_pods(mode: RedirectMode, cgroup: Option<PathBuf>, pods: u16) -> Self {
        let cluster = Cluster::create(pods).unwrap();
        let remote = &cluster.remote;
        let remote_servers = remote
            .ips()
            .iter()
            .map(|ip| EchoServer::start(&remote.ns, SocketAddr::new(*ip, PEER_PORT)))
            .collect();
        let bpffs = (mode == RedirectMode::Ebpf).then(|| BpffsMount::create().unwrap());
        Self {
            mode,
            cgroup,
            remote_servers,
            cluster,
            bpffs,
        }
    }

    fn pod(&self) -> &NetnsGuard {
        &self.cluster.pods[0].ns
    }

    fn pins(&self) -> PinLayout {
        PinLayout::new(self.bpffs.as_ref().expect("eBPF mode").path().join("ambpf"))
    }

    fn host(&self) -> Netns {
        Netns::open(self.cluster.node.name()).unwrap()
    }

    /// The current pod 0 as a source reports it.
    fn spec(&self, uid: &str) -> PodSpec {
        self.spec_of(0, uid)
    }

    /// Pod `i` as a source reports it.
    fn spec_of(&self, i: usize, uid: &str) -> PodSpec {
        PodSpec {
            workload: Workload {
                uid: uid.into(),
                name: uid.trim_start_matches("uid-").into(),
                namespace: "shop".into(),
                service_account: "app".into(),
                netns: NetnsSource::Path(self.cluster.pods[i].ns.path()),
                netns_inode: None,
            },
            dns_capture: None,
        }
    }

    /// The node's probe set members (nftables mode), each with the netns
    /// cookie its comment names.
    fn nft_probe_members(&self) -> Vec<(IpAddr, Option<u64>)> {
        let host = self.cluster.node.path();
        [PROBE_SET_V4, PROBE_SET_V6]
            .iter()
            .flat_map(|set| nft_probe_members(&host, set))
            .map(|(ip, comment)| {
                let owner = comment.and_then(|c| c.strip_prefix("netns cookie ")?.parse().ok());
                (ip.parse().unwrap(), owner)
            })
            .collect()
    }

    fn cookie(&self) -> u64 {
        self.cookie_of(0)
    }

    fn cookie_of(&self, i: usize) -> u64 {
        netns_cookie(&Netns::open(self.cluster.pods[i].ns.name()).unwrap()).unwrap()
    }

    /// A new agent's redirection, on the state earlier agents left.
    fn redirection(&self) -> Box<dyn PodRedirection> {
        match self.mode {
            RedirectMode::Nftables => Box::new(NftablesRedirection::new(self.host()).unwrap()),
            RedirectMode::Ebpf => {
                let mut dataplane = Dataplane::load(self.pins()).unwrap();
                let cgroup = self.cgroup.as_ref().unwrap();
                dataplane
                    .serve_node(
                        cgroup,
                        true,
                        &self.cluster.node_addresses(),
                        self.cluster.node_netns_cookie(),
                    )
                    .unwrap();
                Box::new(ambpf::redirect::EbpfRedirection::new(dataplane))
            }
            RedirectMode::Iptables => {
                Box::new(IptablesRedirection::new(self.host(), IptablesBackend::Auto).unwrap())
            }
        }
    }

    /// A new agent's ZDS server, with a new ztunnel double connected.
    async fn agent(&self) -> Agent {
        let zds = Server::start(ZdsConfig::default());
        if self.mode == RedirectMode::Ebpf {
            // The maps exist before ztunnel connects, as in the agent.
            drop(Dataplane::load(self.pins()).unwrap());
            zds.record_ztunnel_processes(self.pins());
        }
        let ztunnel = ZtunnelDouble::connect_with_retry(zds.socket(), ZtunnelConfig::default());
        ztunnel.wait_until(|s| s.ready, PATIENCE).await.unwrap();
        Agent { zds, ztunnel }
    }

    /// A controller of a new agent, enrolling into `redirection()`.
    fn controller(&self, agent: &Agent) -> Controller {
        Controller::new(self.redirection(), agent.zds.handle.clone(), true)
    }

    /// Runs a controller on `pods` (and CNI requests, if given), as `ambpf
    /// run` does; returns the programmed pods it reports, its stats and its
    /// task.
    fn run(
        &self,
        agent: &Agent,
        pods: watch::Receiver<Arc<SourcePods>>,
        requests: Option<mpsc::Receiver<CniRequest>>,
    ) -> (ProgrammedPods, Arc<ControllerStats>, Task) {
        self.run_checking_every(agent, pods, requests, DEFAULT_CHECK_INTERVAL)
    }

    /// [`Node::run`] with the full state check every `check`.
    fn run_checking_every(
        &self,
        agent: &Agent,
        pods: watch::Receiver<Arc<SourcePods>>,
        requests: Option<mpsc::Receiver<CniRequest>>,
        check: Duration,
    ) -> (ProgrammedPods, Arc<ControllerStats>, Task) {
        let mut controller = self.controller(agent);
        controller.set_check_interval(check);
        let (tx, programmed) = watch::channel(Arc::default());
        controller.report_programmed(tx);
        let stats = controller.stats();
        let task = Task(tokio::spawn(controller.run_with_requests(pods, requests)));
        (programmed, stats, task)
    }

    /// Y, the current pod 0, is captured both ways in both families, and
    /// nothing of the pod with netns cookie `x` is left.
    async fn assert_only_y(&self, agent: &Agent, x: u64) {
        let y = self.cookie();
        assert_ne!(x, y);
        let inode = self.pod().inode().unwrap();
        agent
            .ztunnel
            .wait_until(
                |s| {
                    !s.workloads.contains_key(X)
                        && s.workloads
                            .get(Y)
                            .is_some_and(|w| w.proxies_running && w.netns_inode == inode)
                },
                PATIENCE,
            )
            .await
            .unwrap();
        self.assert_captured(agent, 0, Y).await;
        let ips = self.cluster.pods[0].ips();
        match self.mode {
            RedirectMode::Nftables => {
                let members = self.nft_probe_members();
                for ip in ips {
                    let owners: Vec<_> = members
                        .iter()
                        .filter(|(m, _)| *m == ip)
                        .map(|(_, owner)| *owner)
                        .collect();
                    assert_eq!(owners, [Some(y)], "probe set member {ip} (X is {x})");
                }
            }
            RedirectMode::Ebpf => {
                let pins = self.pins();
                let pods: Vec<u64> = inspect::read_pods(&pins)
                    .unwrap()
                    .iter()
                    .map(|p| p.netns_cookie)
                    .collect();
                assert_eq!(pods, [y], "ambpf_pods (X is {x})");
                let data = MapData::from_pin(pins.map(maps::PODS_BY_IP)).unwrap();
                let by_ip: BpfHashMap<_, IpKey, PodConfig> =
                    BpfHashMap::try_from(Map::HashMap(data)).unwrap();
                for ip in ips {
                    let entry = by_ip.get(&ip_key(ip), 0);
                    let owner = entry.map(|pod| pod.netns_cookie);
                    assert_eq!(
                        owner.ok(),
                        Some(y),
                        "ambpf_pod_ips entry of {ip} (X is {x})"
                    );
                }
                // Inbound capture is Y's link alone, in Y's namespace,
                // running the agent's program; no other link is pinned.
                let program = ambpf::bpf::inbound::pinned_program(&pins).unwrap();
                let [pod] = &inspect::read_status(&pins).unwrap().pods[..] else {
                    panic!("one pod is enrolled");
                };
                let link = pod.inbound_link.as_ref().expect("Y's link is pinned");
                assert!(link.in_pod_netns && link.program_id == program, "{link:?}");
                let linked: Vec<_> = std::fs::read_dir(pins.pod_links_root())
                    .unwrap()
                    .map(|e| e.unwrap().file_name())
                    .collect();
                assert_eq!(
                    linked,
                    [std::ffi::OsString::from(y.to_string())],
                    "X is {x}"
                );
            }
            RedirectMode::Iptables => {
                let host = self.host();
                for ip in ips {
                    let family = if ip.is_ipv4() { Family::V4 } else { Family::V6 };
                    let members = iptables::probe_set_entries(&host, family).unwrap();
                    let owners: Vec<_> = members
                        .iter()
                        .filter(|m| m.address == ip)
                        .map(|m| m.netns_cookie)
                        .collect();
                    assert_eq!(owners, [Some(y)], "probe ipset member {ip} (X is {x})");
                }
            }
        }
    }

    /// The pod `i`, known to ztunnel as `uid`, is captured both ways in
    /// both families (and its probes are not, in the iptables and nftables
    /// modes).
    async fn assert_captured(&self, agent: &Agent, i: usize, uid: &str) {
        let inode = self.cluster.pods[i].ns.inode().unwrap();
        agent
            .ztunnel
            .wait_until(
                |s| {
                    s.workloads
                        .get(uid)
                        .is_some_and(|w| w.proxies_running && w.netns_inode == inode)
                },
                PATIENCE,
            )
            .await
            .unwrap();
        let ips = self.cluster.pods[i].ips();
        let app = EchoServer::start(
            &self.cluster.pods[i].ns,
            SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), APP_PORT),
        );
        let remote = &self.cluster.remote;
        for ((ip, remote_ip), remote_server) in
            ips.into_iter().zip(remote.ips()).zip(&self.remote_servers)
        {
            let inbound = SocketAddr::new(ip, APP_PORT);
            echo_once(&remote.ns, inbound);
            wait_proxied(agent, uid, 15006, inbound).await;
            assert_eq!(app.last_peer(), remote_ip, "inbound to {inbound}");

            let outbound = SocketAddr::new(remote_ip, PEER_PORT);
            echo_once(&self.cluster.pods[i].ns, outbound);
            wait_proxied(agent, uid, 15001, outbound).await;
            assert_eq!(remote_server.last_peer(), ip, "outbound to {outbound}");

            if self.mode != RedirectMode::Ebpf {
                // A kubelet probe: SNATed on the node, straight to the app.
                let before = agent.ztunnel.proxied().len();
                echo_once(&self.cluster.node, inbound);
                let captured = &agent.ztunnel.proxied()[before..];
                assert!(captured.is_empty(), "a probe was captured: {captured:?}");
                let snat = if ip.is_ipv4() { Family::V4 } else { Family::V6 }.probe_snat();
                assert_eq!(app.last_peer(), snat, "probe to {inbound}");
            }
        }
    }

    /// What differs from the redirection holding `ips` as the pod
    /// `cookie`'s and no other address of it, and none of `not_its` as
    /// anyone's (eBPF: the pod's entry and the `ambpf_pod_ips` entries;
    /// iptables and nftables: the probe set members); `None` if nothing
    /// does.
    fn addresses_problem(&self, cookie: u64, ips: &[IpAddr], not_its: &[IpAddr]) -> Option<String> {
        let mut expected = ips.to_vec();
        expected.sort_unstable();
        match self.mode {
            RedirectMode::Nftables => {
                let members = self.nft_probe_members();
                let mut its: Vec<IpAddr> = members
                    .iter()
                    .filter(|(_, owner)| *owner == Some(cookie))
                    .map(|(ip, _)| *ip)
                    .collect();
                its.sort_unstable();
                if its != expected {
                    return Some(format!("its probe set members are {its:?}"));
                }
                if let Some(ip) = not_its
                    .iter()
                    .find(|ip| members.iter().any(|(m, _)| m == *ip))
                {
                    return Some(format!("{ip} is still a probe set member: {members:?}"));
                }
            }
            RedirectMode::Ebpf => {
                let pins = self.pins();
                let pods = inspect::read_pods(&pins).unwrap();
                let Some(pod) = pods.iter().find(|p| p.netns_cookie == cookie) else {
                    return Some(format!("the pod with cookie {cookie} is not enrolled"));
                };
                let mut enrolled = pod.addresses.clone();
                enrolled.sort_unstable();
                if enrolled != expected {
                    return Some(format!("its entry in ambpf_pods holds {enrolled:?}"));
                }
                let data = MapData::from_pin(pins.map(maps::PODS_BY_IP)).unwrap();
                let by_ip: BpfHashMap<_, IpKey, PodConfig> =
                    BpfHashMap::try_from(Map::HashMap(data)).unwrap();
                for ip in ips {
                    let owner = by_ip.get(&ip_key(*ip), 0).map(|pod| pod.netns_cookie);
                    if owner.as_ref().ok() != Some(&cookie) {
                        return Some(format!("the ambpf_pod_ips entry of {ip}: {owner:?}"));
                    }
                }
                for ip in not_its {
                    if let Ok(entry) = by_ip.get(&ip_key(*ip), 0) {
                        return Some(format!("{ip} still has an entry: {entry:?}"));
                    }
                }
            }
            RedirectMode::Iptables => {
                let host = self.host();
                let mut members = Vec::new();
                for family in [Family::V4, Family::V6] {
                    members.extend(iptables::probe_set_entries(&host, family).unwrap());
                }
                let mut its: Vec<IpAddr> = members
                    .iter()
                    .filter(|m| m.netns_cookie == Some(cookie))
                    .map(|m| m.address)
                    .collect();
                its.sort_unstable();
                if its != expected {
                    return Some(format!("its probe ipset members are {its:?}"));
                }
                if let Some(ip) = not_its
                    .iter()
                    .find(|ip| members.iter().any(|m| m.address == **ip))
                {
                    return Some(format!("{ip} is still a probe ipset member: {members:?}"));
                }
            }
        }
        None
    }

    fn assert_addresses(&self, cookie: u64, ips: &[IpAddr], not_its: &[IpAddr]) {
        if let Some(problem) = self.addresses_problem(cookie, ips, not_its) {
            panic!("the pod with cookie {cookie} should have {ips:?}: {problem}");
        }
    }
}

/// Waits until ztunnel proxied `uid`'s connection to `original_dst` on `port`.
async fn wait_proxied(agent: &Agent, uid: &str, port: u16, original_dst: SocketAddr) {
    let found = |c: &ambpf_testbed::ztunnel::ProxiedConnection| {
        c.listener_port == port && c.original_dst == original_dst && c.uid == uid
    };
    agent
        .ztunnel
        .wait_until(|s| s.proxied.iter().any(found), PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("nothing proxied on {port} to {original_dst}: {e:?}"));
    let conn = agent.ztunnel.proxied().into_iter().find(found).unwrap();
    assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{conn:?}");
}

/// The controller counted `conflicts` address conflicts and no state
/// violation: its state checks found nothing to repair.
fn assert_stats(stats: &ControllerStats, conflicts: u64) {
    assert_eq!(
        stats.address_conflicts.get(),
        conflicts,
        "address conflicts (one per recycled address while both pods live)"
    );
    let violations: Vec<u64> = ViolationKind::ALL
        .iter()
        .map(|kind| stats.violations(*kind))
        .collect();
    assert!(
        violations.iter().all(|v| *v == 0),
        "state violations: {violations:?}"
    );
}

/// Waits until the controller reports exactly `uids` programmed.
async fn wait_programmed(programmed: &mut ProgrammedPods, uids: &[&str]) {
    let reached = tokio::time::timeout(
        PATIENCE,
        programmed.wait_for(|p| {
            p.programmed
                .iter()
                .map(String::as_str)
                .eq(uids.iter().copied())
        }),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    assert!(
        reached,
        "programmed {:?}, not {uids:?}",
        programmed.borrow().programmed
    );
}

/// The ambient pods of a source.
fn source(pods: Vec<PodSpec>) -> Arc<SourcePods> {
    Arc::new(SourcePods {
        ambient: pods,
        ..Default::default()
    })
}

async fn cni_add(requests: &mpsc::Sender<CniRequest>, pod: PodSpec) {
    let (reply, answer) = oneshot::channel();
    let request = EnrollRequest { pod, reply };
    requests.send(request.into()).await.unwrap();
    answer.await.unwrap().expect("CNI add");
}

/// `stale_pod_at_agent_start` and `netns_inode_reused_at_agent_start`.
async fn agent_restart(mut node: Node, reuse_inode: bool) {
    let agent = node.agent().await;
    let mut controller = node.controller(&agent);
    assert_eq!(controller.apply(&[node.spec(X)]).enrolled, 1);
    let (x, x_inode) = (node.cookie(), node.pod().inode().unwrap());
    drop(controller);
    agent.stop().await;

    if reuse_inode {
        node.cluster.recycle_pod_reusing_inode(0, PATIENCE).unwrap();
        assert_eq!(node.pod().inode().unwrap(), x_inode);
    } else {
        node.cluster.recycle_pod(0).unwrap();
    }

    let agent = node.agent().await;
    let mut controller = node.controller(&agent);
    let report = controller.apply(&[node.spec(Y)]);
    assert_eq!((report.enrolled, &report.failed), (1, &Default::default()));
    node.assert_only_y(&agent, x).await;
    assert_eq!(controller.check_state(CheckScope::Full), []);
    assert_stats(&controller.stats(), 0);
}

/// `cni_add_before_the_old_pods_delete` and `cni_add_after_the_old_pods_delete`.
async fn cni_pod(mut node: Node, add_first: bool) {
    let agent = node.agent().await;
    let (pods_tx, pods) = watch::channel(source(vec![node.spec(X)]));
    let (requests, requests_rx) = mpsc::channel(1);
    let (mut programmed, stats, _controller) = node.run(&agent, pods, Some(requests_rx));
    wait_programmed(&mut programmed, &[X]).await;
    let x = node.cookie();

    let old = node.cluster.recycle_pod_keeping_old(0).unwrap();
    if add_first {
        cni_add(&requests, node.spec(Y)).await;
        wait_programmed(&mut programmed, &[X, Y]).await;
        pods_tx.send_replace(source(vec![]));
    } else {
        pods_tx.send_replace(source(vec![]));
        wait_programmed(&mut programmed, &[]).await;
        cni_add(&requests, node.spec(Y)).await;
    }
    wait_programmed(&mut programmed, &[Y]).await;
    drop(old);
    node.assert_only_y(&agent, x).await;
    assert_stats(&stats, if add_first { 2 } else { 0 });
}

/// `kube_new_pod_before_old_pods_delete` and `kube_old_pods_delete_before_new_pod`.
async fn kube_pods(mut node: Node, new_first: bool) {
    let server = ApiServer::start().await.unwrap();
    server.apply(
        "namespaces",
        json!({ "apiVersion": "v1", "kind": "Namespace",
                "metadata": { "name": "shop", "labels": { DATAPLANE_MODE_LABEL: "ambient" } } }),
    );
    let ips = node.cluster.pods[0].ips();
    let pod = |uid: &str| {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": uid.trim_start_matches("uid-"), "namespace": "shop", "uid": uid },
            "spec": { "nodeName": "node-1", "serviceAccountName": "app", "containers": [{ "name": "app" }] },
            "status": { "phase": "Running", "podIP": ips[0].to_string(),
                        "podIPs": [{ "ip": ips[0].to_string() }, { "ip": ips[1].to_string() }] }
        })
    };
    // Netns discovery is not under test: each pod's namespace by its UID.
    let netns: Arc<Mutex<HashMap<String, PathBuf>>> = Arc::default();
    netns.lock().unwrap().insert(X.into(), node.pod().path());
    let resolve = netns.clone();
    let resolver = move |pod: &PodQuery| {
        let known = resolve.lock().unwrap().get(&pod.uid).cloned();
        known
            .map(NetnsSource::Path)
            .ok_or_else(|| format!("no netns for {}", pod.uid))
    };
    server.apply("pods", pod(X));

    let agent = node.agent().await;
    let client = kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
    let mut config = KubeSourceConfig::new("node-1");
    config.resync = Duration::from_millis(200);
    config.max_backoff = Duration::from_millis(300);
    let (pods_tx, pods) = watch::channel(Arc::default());
    let _source = tokio::time::timeout(
        PATIENCE,
        KubeSource::new(client, config)
            .with_resolver(resolver)
            .start(pods_tx),
    )
    .await
    .expect("the source synced in time")
    .unwrap();
    let (mut programmed, stats, _controller) = node.run(&agent, pods, None);
    wait_programmed(&mut programmed, &[X]).await;
    let x = node.cookie();

    let old = node.cluster.recycle_pod_keeping_old(0).unwrap();
    netns.lock().unwrap().insert(Y.into(), node.pod().path());
    if new_first {
        server.apply("pods", pod(Y));
        wait_programmed(&mut programmed, &[X, Y]).await;
        server.delete("pods", "shop", "app-x");
    } else {
        server.delete("pods", "shop", "app-x");
        wait_programmed(&mut programmed, &[]).await;
        server.apply("pods", pod(Y));
    }
    wait_programmed(&mut programmed, &[Y]).await;
    drop(old);
    node.assert_only_y(&agent, x).await;
    assert_stats(&stats, if new_first { 2 } else { 0 });
}

/// `pod_addresses_changed_while_enrolled`: the pod's network moves it to
/// other addresses under its live namespace. The full state check finds it
/// (`pod_addresses_changed`) and the pod is enrolled again: the redirection
/// follows to the new addresses, and the old ones are no longer its.
async fn address_change(mut node: Node, _: ()) {
    let agent = node.agent().await;
    let (_pods_tx, pods) = watch::channel(source(vec![node.spec(X)]));
    let every = Duration::from_millis(200);
    let (mut programmed, stats, _controller) = node.run_checking_every(&agent, pods, None, every);
    wait_programmed(&mut programmed, &[X]).await;
    let cookie = node.cookie();
    let old = node.cluster.pods[0].ips();
    node.assert_addresses(cookie, &old, &[]);

    node.cluster.readdress_pod(0).unwrap();
    let new = node.cluster.pods[0].ips();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while let Some(problem) = node.addresses_problem(cookie, &new, &old) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the redirection did not follow the pod to {new:?}: {problem}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(stats.violations(ViolationKind::PodAddressesChanged) >= 1);
    node.assert_captured(&agent, 0, X).await;
}

/// `a_pod_with_two_addresses_of_a_family_is_refused`: a pod's entry holds
/// one address of each family, so a pod with a second IPv4 address is
/// refused with an error naming its addresses (connections to the one left
/// out would bypass ztunnel), while the node's other pod is enrolled; once
/// the extra address is gone, the next pass enrols it. A pod that gains one
/// while enrolled fails closed.
async fn too_many_addresses(node: Node, _: ()) {
    let agent = node.agent().await;
    let mut controller = node.controller(&agent);
    let [a, b, c, _] = node.cluster.pods[0].addrs.v4.octets();
    let extra = IpAddr::from([a, b, c, 200]);
    let extra_cidr = format!("{extra}/24");
    node.pod()
        .ip(&["addr", "add", &extra_cidr, "dev", "eth0"])
        .unwrap();
    let specs = [node.spec_of(0, X), node.spec_of(1, Y)];

    let report = controller.apply(&specs);
    assert_eq!(report.enrolled, 1, "{report:?}");
    assert_eq!(report.failed.keys().collect::<Vec<_>>(), [X], "{report:?}");
    let why = &report.failed[X];
    let pod_v4 = node.cluster.pods[0].addrs.v4.to_string();
    for part in [
        node.pod().path().display().to_string(),
        format!("2 IPv4 addresses ({pod_v4}, {extra})"),
        "one address of each family".to_owned(),
    ] {
        assert!(why.contains(&part), "{part:?} not in: {why}");
    }
    let x_ips = node.cluster.pods[0].ips();
    let mut not_x = x_ips.to_vec();
    not_x.push(extra);
    node.assert_addresses(node.cookie_of(1), &node.cluster.pods[1].ips(), &not_x);
    assert!(!agent.ztunnel.inspect(|s| s.workloads.contains_key(X)));
    node.assert_captured(&agent, 1, Y).await;

    node.pod()
        .ip(&["addr", "del", &extra_cidr, "dev", "eth0"])
        .unwrap();
    let report = controller.apply(&specs);
    assert_eq!((report.enrolled, report.failed.len()), (1, 0), "{report:?}");
    node.assert_addresses(node.cookie_of(0), &x_ips, &[extra]);
    node.assert_captured(&agent, 0, X).await;

    // Gaining one while enrolled: the full check names it, and enrolling
    // again fails the same way. The pod fails closed: ztunnel no longer
    // serves it and its redirection stays, so its address is refused rather
    // than reached without ztunnel.
    node.pod()
        .ip(&["addr", "add", &extra_cidr, "dev", "eth0"])
        .unwrap();
    let found = controller.check_state(CheckScope::Full);
    assert!(
        found
            .iter()
            .any(|v| v.kind == ViolationKind::PodAddressesChanged
                && v.detail.contains(&format!("({pod_v4}, {extra})"))),
        "{found:?}"
    );
    let report = controller.apply(&specs);
    assert_eq!(report.failed.keys().collect::<Vec<_>>(), [X], "{report:?}");
    agent
        .ztunnel
        .wait_until(|s| !s.workloads.contains_key(X), PATIENCE)
        .await
        .unwrap();
    let _app = EchoServer::start(
        node.pod(),
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), APP_PORT),
    );
    let to = SocketAddr::new(x_ips[0], APP_PORT);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let refused = tokio::task::block_in_place(|| {
            node.cluster
                .remote
                .ns
                .run(|| TcpStream::connect_timeout(&to, PATIENCE))
                .unwrap()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
        });
        if refused {
            break;
        }
        // Until ztunnel has closed the pod's listeners, it still proxies.
        assert!(
            tokio::time::Instant::now() < deadline,
            "{to} is still reached"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fresh node of `pods` pods in `mode`, its programs on `cgroup` (eBPF mode).
fn node(mode: RedirectMode, cgroup: Option<&CgroupGuard>, pods: u16) -> Node {
    Node::with_pods(mode, cgroup.map(|c| c.path().to_owned()), pods)
}

in_all_modes!(stale_pod_at_agent_start, |mode, cgroup| {
    agent_restart(node(mode, cgroup, 1), false).await
});
in_all_modes!(netns_inode_reused_at_agent_start, |mode, cgroup| {
    agent_restart(node(mode, cgroup, 1), true).await
});
in_all_modes!(cni_add_before_the_old_pods_delete, |mode, cgroup| {
    cni_pod(node(mode, cgroup, 1), true).await
});
in_all_modes!(cni_add_after_the_old_pods_delete, |mode, cgroup| {
    cni_pod(node(mode, cgroup, 1), false).await
});
in_all_modes!(kube_new_pod_before_old_pods_delete, |mode, cgroup| {
    kube_pods(node(mode, cgroup, 1), true).await
});
in_all_modes!(kube_old_pods_delete_before_new_pod, |mode, cgroup| {
    kube_pods(node(mode, cgroup, 1), false).await
});
in_all_modes!(pod_addresses_changed_while_enrolled, |mode, cgroup| {
    address_change(node(mode, cgroup, 1), ()).await
});
in_all_modes!(
    a_pod_with_two_addresses_of_a_family_is_refused,
    |mode, cgroup| { too_many_addresses(node(mode, cgroup, 2), ()).await }
);
