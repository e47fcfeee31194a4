//! The fixture of the privileged redirection tests (`redirect.rs`,
//! `parity.rs`): a testbed cluster whose pod 1 is enrolled in one
//! redirection mode, served by the ztunnel double over the agent's ZDS
//! server, with echo servers in the pod, its neighbour and the remote.
//! A test binary that includes it also declares `mod common;` (the ZDS
//! server fixture).

#![allow(dead_code, unused_macros)] // each test binary uses a different subset

use std::{
    io::{Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{Arc, Mutex},
    time::Duration,
};

use ambpf::{
    bpf::{Capacities, Dataplane, InboundAssign, PinLayout},
    netns::Netns,
    redirect::{
        EnrollOptions, PodRedirection, RedirectMode,
        iptables::{self, Family, IptablesBackend, IptablesRedirection},
        nftables::NftablesRedirection,
    },
    zds::{NetnsSource, Workload, ZdsConfig},
};
use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    ztunnel::{ProxiedConnection, ZtunnelConfig, ZtunnelDouble, dns},
};

pub const PATIENCE: Duration = Duration::from_secs(10);
pub const APP_PORT: u16 = 8080;
pub const PEER_PORT: u16 = 9000;
pub const POD_UID: &str = "pod-1-uid";

/// Peers each server has seen, in accept order.
pub type Seen = Arc<Mutex<Vec<SocketAddr>>>;

/// An echo server in a namespace that records its peers.
pub struct EchoServer {
    pub seen: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl EchoServer {
    pub fn start(ns: &NetnsGuard, addr: SocketAddr) -> Self {
        let listener = ns.run(|| TcpListener::bind(addr)).unwrap().unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let seen: Seen = Arc::default();
        let record = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut conn, peer)) = listener.accept().await else {
                    return;
                };
                // A dual-stack listener reports IPv4 peers as ::ffff:a.b.c.d.
                record
                    .lock()
                    .unwrap()
                    .push(SocketAddr::new(unmap(peer.ip()), peer.port()));
                tokio::spawn(async move {
                    let (mut r, mut w) = conn.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        Self { seen, task }
    }

    pub fn last_peer(&self) -> Option<SocketAddr> {
        self.seen.lock().unwrap().last().copied()
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One request/response through a new connection made inside `ns`, with the
/// socket options `prepare` sets; returns the socket's view of its peer.
pub fn echo_once(
    ns: &NetnsGuard,
    to: SocketAddr,
    from: Option<IpAddr>,
    mark: Option<u32>,
) -> SocketAddr {
    tokio::task::block_in_place(|| {
        ns.run(|| {
            let domain = if to.is_ipv4() {
                socket2::Domain::IPV4
            } else {
                socket2::Domain::IPV6
            };
            let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None).unwrap();
            if let Some(mark) = mark {
                socket.set_mark(mark).unwrap();
            }
            if let Some(ip) = from {
                socket.bind(&SocketAddr::new(ip, 0).into()).unwrap();
            }
            socket.set_read_timeout(Some(PATIENCE)).unwrap();
            socket
                .connect_timeout(&to.into(), PATIENCE)
                .unwrap_or_else(|e| panic!("connect {to}: {e}"));
            let mut stream: TcpStream = socket.into();
            stream.write_all(b"ambpf").unwrap();
            let mut reply = [0u8; 5];
            stream
                .read_exact(&mut reply)
                .unwrap_or_else(|e| panic!("echo from {to}: {e}"));
            assert_eq!(&reply, b"ambpf");
            let peer = stream.peer_addr().unwrap();
            stream.shutdown(Shutdown::Both).unwrap();
            peer
        })
        .unwrap()
    })
}

pub const ENROLL: EnrollOptions = EnrollOptions { dns_capture: true };

/// An enrolled pod 1 with ztunnel serving it, a neighbour and a remote peer.
pub struct Fixture {
    pub mode: RedirectMode,
    pub ztunnel: ZtunnelDouble,
    pub redirection: Box<dyn PodRedirection>,
    /// iptables mode: the backend in use.
    pub iptables_backend: Option<IptablesBackend>,
    pub remote_v4: EchoServer,
    pub remote_v6: EchoServer,
    pub app: EchoServer,
    pub neighbour_app: EchoServer,
    /// The agent's ZDS server; its socket is for another ztunnel.
    pub zds: crate::common::Server,
    pub cluster: Cluster,
    /// eBPF mode: where the programs are pinned.
    pub bpffs: Option<BpffsMount>,
}

impl Fixture {
    pub fn pod(&self) -> &NetnsGuard {
        &self.cluster.pods[0].ns
    }

    pub fn pod_ip(&self, v6: bool) -> IpAddr {
        let addrs = self.cluster.pods[0].addrs;
        if v6 { addrs.v6.into() } else { addrs.v4.into() }
    }

    pub fn remote_ip(&self, v6: bool) -> IpAddr {
        let addrs = self.cluster.remote.addrs;
        if v6 { addrs.v6.into() } else { addrs.v4.into() }
    }

    pub fn proxied(&self) -> Vec<ProxiedConnection> {
        self.ztunnel.proxied()
    }

    /// Where a probe from the node comes from, as the app sees it (IPv4):
    /// the node's own address in the eBPF mode, which leaves its source
    /// alone; Istio's probe SNAT address in the iptables and nftables modes,
    /// whose host rule rewrites traffic from host processes to ambient pods.
    pub fn probe_source_v4(&self) -> IpAddr {
        match self.mode {
            RedirectMode::Ebpf => self.cluster.node_addresses()[2],
            RedirectMode::Iptables | RedirectMode::Nftables => iptables::PROBE_SNAT_V4.into(),
        }
    }

    /// A connection from the node's own address straight to the app on the
    /// pod's address of the family, as kubelet's probes come: the peer the
    /// app saw, after checking that ztunnel proxied nothing.
    pub fn probe_from_node(&self, v6: bool, case: &str) -> IpAddr {
        let before = self.proxied().len();
        echo_once(
            &self.cluster.node,
            SocketAddr::new(self.pod_ip(v6), APP_PORT),
            None,
            None,
        );
        assert_eq!(
            self.proxied().len(),
            before,
            "{case}: a probe went through ztunnel"
        );
        self.app.last_peer().unwrap().ip()
    }

    pub fn pod_netns(&self) -> Netns {
        Netns::open(self.pod().name()).unwrap()
    }

    /// iptables mode: pod 1's rules for `family`, as iptables-save prints them.
    pub fn pod_rules(&self, family: Family) -> iptables::SavedRules {
        let backend = self.iptables_backend.expect("iptables mode");
        iptables::saved_rules(&self.pod_netns(), backend, family).unwrap()
    }

    /// Replaces ztunnel with one that speaks ZDS but runs no proxies, and
    /// waits until pod 1 has no listener on 15006 any more (a connection
    /// from inside the pod to its own address is never captured).
    pub async fn stop_ztunnel_proxies(&mut self) {
        let zds_only =
            ZtunnelDouble::connect_with_retry(self.zds.socket(), ZtunnelConfig::zds_only());
        drop(std::mem::replace(&mut self.ztunnel, zds_only));
        let deadline = std::time::Instant::now() + PATIENCE;
        for v6 in [false, true] {
            let inbound = SocketAddr::new(self.pod_ip(v6), 15006);
            loop {
                let refused = tokio::task::block_in_place(|| {
                    self.pod()
                        .run(|| TcpStream::connect_timeout(&inbound, PATIENCE))
                        .unwrap()
                        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
                });
                if refused {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{inbound} still listens"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    pub async fn wait_proxied(&self, port: u16, original_dst: SocketAddr) -> ProxiedConnection {
        self.ztunnel
            .wait_until(
                |s| {
                    s.proxied
                        .iter()
                        .any(|c| c.listener_port == port && c.original_dst == original_dst)
                },
                PATIENCE,
            )
            .await
            .unwrap();
        self.proxied()
            .into_iter()
            .find(|c| c.listener_port == port && c.original_dst == original_dst)
            .unwrap()
    }
}

/// A node's redirection in `mode`: the eBPF `Dataplane` serving `cgroup`
/// (pinned in a bpffs of its own), or Istio's rules with the cluster's node
/// namespace as the host.
pub fn node_redirection(
    mode: RedirectMode,
    cluster: &Cluster,
    cgroup: Option<&CgroupGuard>,
) -> (
    Box<dyn PodRedirection>,
    Option<BpffsMount>,
    Option<IptablesBackend>,
) {
    let inbound = InboundAssign::from_env().unwrap();
    node_redirection_with(mode, cluster, cgroup, inbound)
}

/// [`node_redirection`] on the eBPF mode's inbound path `inbound`.
pub fn node_redirection_with(
    mode: RedirectMode,
    cluster: &Cluster,
    cgroup: Option<&CgroupGuard>,
    inbound: InboundAssign,
) -> (
    Box<dyn PodRedirection>,
    Option<BpffsMount>,
    Option<IptablesBackend>,
) {
    match mode {
        RedirectMode::Ebpf => {
            let bpffs = BpffsMount::create().unwrap();
            let pins = PinLayout::new(bpffs.path().join("ambpf"));
            let mut dataplane =
                Dataplane::load_inbound(pins, Capacities::default(), inbound).unwrap();
            let cgroup = cgroup.expect("eBPF mode needs a cgroup").path();
            dataplane
                .serve_node(
                    cgroup,
                    true,
                    &cluster.node_addresses(),
                    cluster.node_netns_cookie(),
                )
                .unwrap();
            (
                Box::new(ambpf::redirect::EbpfRedirection::new(dataplane)),
                Some(bpffs),
                None,
            )
        }
        RedirectMode::Iptables => {
            // The node namespace is the host: the probe SNAT goes there.
            let host = Netns::open(cluster.node.name()).unwrap();
            let redirection = IptablesRedirection::new(host, IptablesBackend::Auto).unwrap();
            let backend = redirection.backend();
            (Box::new(redirection), None, Some(backend))
        }
        RedirectMode::Nftables => {
            let host = Netns::open(cluster.node.name()).unwrap();
            let redirection = NftablesRedirection::new(host).unwrap();
            (Box::new(redirection), None, None)
        }
    }
}

/// `cgroup`: the cgroup this process is in, for the eBPF mode's programs.
/// The eBPF mode takes the inbound path `AMBPF_INBOUND_ASSIGN` names.
pub async fn fixture(mode: RedirectMode, cgroup: Option<&CgroupGuard>) -> Fixture {
    fixture_with(mode, cgroup, InboundAssign::from_env().unwrap()).await
}

/// [`fixture`] on the eBPF mode's inbound path `inbound`.
pub async fn fixture_with(
    mode: RedirectMode,
    cgroup: Option<&CgroupGuard>,
    inbound: InboundAssign,
) -> Fixture {
    fixture_in(Cluster::create(2).unwrap(), mode, cgroup, inbound).await
}

/// [`fixture_with`] on `cluster`, a node with at least two pods.
pub async fn fixture_in(
    cluster: Cluster,
    mode: RedirectMode,
    cgroup: Option<&CgroupGuard>,
    inbound: InboundAssign,
) -> Fixture {
    let node = node_redirection_with(mode, &cluster, cgroup, inbound);
    fixture_on(cluster, node, ZtunnelConfig::default()).await
}

/// The fixture on `cluster` with the node's redirection `node` (as
/// [`node_redirection`] returns it; its bpffs, when given, is where the ZDS
/// server records ztunnel's processes).
pub async fn fixture_on(
    cluster: Cluster,
    (mut redirection, bpffs, iptables_backend): (
        Box<dyn PodRedirection>,
        Option<BpffsMount>,
        Option<IptablesBackend>,
    ),
    ztunnel: ZtunnelConfig,
) -> Fixture {
    let mode = redirection.mode();

    let pod = &cluster.pods[0];
    redirection
        .enroll(&Netns::open(pod.ns.name()).unwrap(), ENROLL)
        .unwrap();

    let zds = crate::common::Server::start(ZdsConfig::default());
    if let Some(bpffs) = &bpffs {
        zds.record_ztunnel_processes(PinLayout::new(bpffs.path().join("ambpf")));
    }
    let socket = zds.socket();
    zds.handle.upsert(Workload {
        uid: POD_UID.into(),
        name: "app-1".into(),
        namespace: "shop".into(),
        service_account: "app".into(),
        netns: NetnsSource::Path(pod.ns.path()),
        netns_inode: None,
    });
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ztunnel);
    ztunnel
        .wait_until(
            |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
            PATIENCE,
        )
        .await
        .unwrap();

    let any = |ip: IpAddr, port| SocketAddr::new(ip, port);
    let remote = &cluster.remote;
    let remote_v4 = EchoServer::start(&remote.ns, any(remote.addrs.v4.into(), PEER_PORT));
    let remote_v6 = EchoServer::start(&remote.ns, any(remote.addrs.v6.into(), PEER_PORT));
    let unspecified: IpAddr = std::net::Ipv6Addr::UNSPECIFIED.into();
    let app = EchoServer::start(&pod.ns, any(unspecified, APP_PORT));
    let neighbour_app = EchoServer::start(&cluster.pods[1].ns, any(unspecified, APP_PORT));
    Fixture {
        mode,
        ztunnel,
        redirection,
        iptables_backend,
        remote_v4,
        remote_v6,
        app,
        neighbour_app,
        zds,
        cluster,
        bpffs,
    }
}

/// Runs `test` with a fresh fixture in `mode`; in eBPF mode this process is
/// inside the test's cgroup meanwhile.
macro_rules! with_fixture {
    ($mode:expr, |$f:ident| $body:block) => {{
        let mode: RedirectMode = $mode;
        let _serial = crate::modes::SERIAL.lock().await;
        let cgroup = (mode == RedirectMode::Ebpf).then(|| CgroupGuard::create().unwrap());
        let _inside = cgroup.as_ref().map(|c| c.enter_process().unwrap());
        #[allow(unused_mut)]
        let mut $f = fixture(mode, cgroup.as_ref()).await;
        $body
    }};
}

/// How the app prepares its socket before `connect()`.
#[derive(Clone, Copy, Debug)]
pub enum AppBind {
    None,
    /// To its pod address, port 0.
    PodAddress,
    /// To the wildcard address with a port of its own.
    PortOnly,
    /// To the wildcard address, port 0.
    Wildcard,
}

/// One request/response from the pod to `to` over a socket prepared as
/// `bind` says (`dual_stack`: an IPv6 socket reaching an IPv4 peer through
/// its v4-mapped address); returns the socket's own address and its peer,
/// as the app sees them (v4-mapped addresses unmapped).
pub fn outbound_as_app(
    f: &Fixture,
    to: SocketAddr,
    bind: AppBind,
    dual_stack: bool,
) -> (SocketAddr, SocketAddr) {
    let pod_ip = f.pod_ip(to.is_ipv6());
    tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let (domain, to) = match (dual_stack, to) {
                    (true, SocketAddr::V4(v4)) => (
                        socket2::Domain::IPV6,
                        SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port()),
                    ),
                    (_, to) if to.is_ipv6() => (socket2::Domain::IPV6, to),
                    (_, to) => (socket2::Domain::IPV4, to),
                };
                let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None).unwrap();
                if domain == socket2::Domain::IPV6 {
                    socket.set_only_v6(false).unwrap();
                }
                let wildcard: IpAddr = if domain == socket2::Domain::IPV6 {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                };
                let local = match bind {
                    AppBind::None => None,
                    AppBind::PodAddress if dual_stack => match pod_ip {
                        IpAddr::V4(v4) => Some(SocketAddr::new(v4.to_ipv6_mapped().into(), 0)),
                        v6 => Some(SocketAddr::new(v6, 0)),
                    },
                    AppBind::PodAddress => Some(SocketAddr::new(pod_ip, 0)),
                    // A port per family: the first connection's TIME_WAIT
                    // holds its port.
                    AppBind::PortOnly => Some(SocketAddr::new(
                        wildcard,
                        if to.is_ipv6() { 40124 } else { 40123 },
                    )),
                    AppBind::Wildcard => Some(SocketAddr::new(wildcard, 0)),
                };
                if let Some(local) = local {
                    socket.bind(&local.into()).unwrap();
                }
                socket.set_read_timeout(Some(PATIENCE)).unwrap();
                socket
                    .connect_timeout(&to.into(), PATIENCE)
                    .unwrap_or_else(|e| panic!("connect {to}: {e}"));
                let mut stream: TcpStream = socket.into();
                stream.write_all(b"ambpf").unwrap();
                let mut reply = [0u8; 5];
                stream.read_exact(&mut reply).unwrap();
                let unmapped = |a: SocketAddr| SocketAddr::new(unmap(a.ip()), a.port());
                (
                    unmapped(stream.local_addr().unwrap()),
                    unmapped(stream.peer_addr().unwrap()),
                )
            })
            .unwrap()
    })
}

pub fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// One DNS query for an A record from pod 1 to `resolver` over UDP
/// (unconnected: send_to and recv_from, as a stub resolver does), id 0x0a17
/// for `udp.ambpf.test`, and one over TCP (a 2-byte length before each
/// message), id 0x7c90 for `tcp.ambpf.test`. Returns where the UDP answer
/// came from, the UDP answer, the TCP socket's peer and the TCP answer.
pub fn dns_from_pod(
    f: &Fixture,
    resolver: SocketAddr,
) -> (SocketAddr, dns::Response, SocketAddr, dns::Response) {
    tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
                udp.set_read_timeout(Some(PATIENCE)).unwrap();
                let query = dns::encode_query(0x0a17, "udp.ambpf.test", dns::TYPE_A).unwrap();
                udp.send_to(&query, resolver).unwrap();
                let mut buffer = [0u8; 512];
                let (len, from) = udp
                    .recv_from(&mut buffer)
                    .unwrap_or_else(|e| panic!("UDP answer from {resolver}: {e}"));
                let udp_answer = dns::Response::parse(&buffer[..len]).unwrap();

                let mut tcp = TcpStream::connect_timeout(&resolver, PATIENCE)
                    .unwrap_or_else(|e| panic!("TCP to {resolver}: {e}"));
                tcp.set_read_timeout(Some(PATIENCE)).unwrap();
                let query = dns::encode_query(0x7c90, "tcp.ambpf.test", dns::TYPE_A).unwrap();
                let mut framed = u16::try_from(query.len()).unwrap().to_be_bytes().to_vec();
                framed.extend_from_slice(&query);
                tcp.write_all(&framed).unwrap();
                let mut len = [0u8; 2];
                tcp.read_exact(&mut len)
                    .unwrap_or_else(|e| panic!("TCP answer from {resolver}: {e}"));
                let mut body = vec![0u8; usize::from(u16::from_be_bytes(len))];
                tcp.read_exact(&mut body).unwrap();
                let tcp_answer = dns::Response::parse(&body).unwrap();
                (from, udp_answer, tcp.peer_addr().unwrap(), tcp_answer)
            })
            .unwrap()
    })
}
