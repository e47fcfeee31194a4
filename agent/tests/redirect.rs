//! Privileged: the eBPF redirection with real traffic between real network
//! namespaces, through the ztunnel double (its proxies run inside the pod
//! exactly where ztunnel's would).
//!
//! Topology (testbed `Cluster`): pod 1 is enrolled, pod 2 is its
//! non-enrolled neighbour, `remote` is an off-node client/server, and the node
//! namespace forwards between them; the node's own addresses are the "host".

use std::{
    io::{Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Mutex},
    time::Duration,
};

use ambpf::{
    bpf::{Dataplane, PinLayout},
    netns::Netns,
    zds::{NetnsSource, Workload, ZdsConfig, ZdsHandle},
};
use ambpf_common::NodeConfig;
use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    ztunnel::{ConnectionOutcome, ProxiedConnection, ZtunnelConfig, ZtunnelDouble},
};

/// Tests move this process between cgroups: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const PATIENCE: Duration = Duration::from_secs(10);
const APP_PORT: u16 = 8080;
const PEER_PORT: u16 = 9000;
const POD_UID: &str = "pod-1-uid";

/// Peers each server has seen, in accept order.
type Seen = Arc<Mutex<Vec<SocketAddr>>>;

/// An echo server in a namespace that records its peers.
struct EchoServer {
    seen: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl EchoServer {
    fn start(ns: &NetnsGuard, addr: SocketAddr) -> Self {
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

    fn last_peer(&self) -> Option<SocketAddr> {
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
fn echo_once(
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

/// An enrolled pod 1 with ztunnel serving it, a neighbour and a remote peer.
struct Fixture {
    ztunnel: ZtunnelDouble,
    dataplane: Dataplane,
    remote_v4: EchoServer,
    remote_v6: EchoServer,
    app: EchoServer,
    neighbour_app: EchoServer,
    _zds: tokio::task::JoinHandle<()>,
    _zds_dir: TempDir,
    cluster: Cluster,
    _bpffs: BpffsMount,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Fixture {
    fn pod(&self) -> &NetnsGuard {
        &self.cluster.pods[0].ns
    }

    fn pod_ip(&self, v6: bool) -> IpAddr {
        let addrs = self.cluster.pods[0].addrs;
        if v6 { addrs.v6.into() } else { addrs.v4.into() }
    }

    fn remote_ip(&self, v6: bool) -> IpAddr {
        let addrs = self.cluster.remote.addrs;
        if v6 { addrs.v6.into() } else { addrs.v4.into() }
    }

    fn proxied(&self) -> Vec<ProxiedConnection> {
        self.ztunnel.proxied()
    }

    async fn wait_proxied(&self, port: u16, original_dst: SocketAddr) -> ProxiedConnection {
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

async fn fixture(cgroup: &CgroupGuard) -> Fixture {
    let bpffs = BpffsMount::create().unwrap();
    let cluster = Cluster::create(2).unwrap();
    let mut dataplane = Dataplane::load(PinLayout::new(bpffs.path().join("ambpf"))).unwrap();
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

    let pod = &cluster.pods[0];
    dataplane
        .enroll_pod(&Netns::open(pod.ns.name()).unwrap(), true)
        .unwrap();

    let dir =
        std::env::temp_dir().join(format!("ambpf-redirect-{}", ambpf_testbed::unique_name("")));
    let socket = dir.join("ztunnel.sock");
    let zds = ZdsHandle::new(ZdsConfig {
        socket: socket.clone(),
        ..Default::default()
    });
    let listener = ambpf::zds::listener::bind(&socket).unwrap();
    let server = tokio::spawn(zds.clone().serve_on(listener));
    zds.upsert(Workload {
        uid: POD_UID.into(),
        name: "app-1".into(),
        namespace: "shop".into(),
        service_account: "app".into(),
        netns: NetnsSource::Path(pod.ns.path()),
    });
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default());
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
        ztunnel,
        dataplane,
        remote_v4,
        remote_v6,
        app,
        neighbour_app,
        _zds: server,
        _zds_dir: TempDir(dir),
        cluster,
        _bpffs: bpffs,
    }
}

/// Runs `test` with a fresh fixture, this process inside the test's cgroup.
macro_rules! with_fixture {
    (|$f:ident| $body:block) => {{
        let _serial = SERIAL.lock().await;
        let cgroup = CgroupGuard::create().unwrap();
        let _inside = cgroup.enter_process().unwrap();
        #[allow(unused_mut)]
        let mut $f = fixture(&cgroup).await;
        $body
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outbound_tcp_reaches_ztunnel_which_recovers_the_original_destination() {
    with_fixture!(|f| {
        for v6 in [false, true] {
            let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
            // The app sees the peer it asked for (getpeername).
            assert_eq!(echo_once(f.pod(), dst, None, None), dst);
            let conn = f.wait_proxied(15001, dst).await;
            assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{conn:?}");
            assert_eq!(conn.uid, POD_UID);
            // ztunnel's passthrough connection left from the pod's address.
            let server = if v6 { &f.remote_v6 } else { &f.remote_v4 };
            assert_eq!(server.last_peer().unwrap().ip(), f.pod_ip(v6));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inbound_tcp_reaches_ztunnel_and_the_app_sees_the_client_source() {
    with_fixture!(|f| {
        for v6 in [false, true] {
            let dst = SocketAddr::new(f.pod_ip(v6), APP_PORT);
            echo_once(&f.cluster.remote.ns, dst, None, None);
            let conn = f.wait_proxied(15006, dst).await;
            assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{conn:?}");
            assert_eq!(conn.client.ip(), f.remote_ip(v6));
            // ztunnel connected to the app with the client's address, and the
            // app's replies found their way back (the echo above completed).
            assert_eq!(f.app.last_peer().unwrap().ip(), f.remote_ip(v6));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hbone_port_goes_straight_to_ztunnel_and_probes_straight_to_the_app() {
    with_fixture!(|f| {
        let before = f.proxied().len();
        // Host (kubelet) traffic: from the node's own address, to the app.
        let node_ip: IpAddr = f.cluster.node_addresses()[2];
        echo_once(
            &f.cluster.node,
            SocketAddr::new(f.pod_ip(false), APP_PORT),
            None,
            None,
        );
        assert_eq!(f.app.last_peer().unwrap().ip(), node_ip);
        assert_eq!(f.proxied().len(), before, "a probe went through ztunnel");

        // HBONE: the CONNECT stand-in on 15008 tunnels to the app.
        let hbone = SocketAddr::new(f.pod_ip(false), 15008);
        let target = SocketAddr::new(f.pod_ip(false), APP_PORT);
        tokio::task::block_in_place(|| {
            f.cluster.remote.ns.run(|| {
                let mut s = TcpStream::connect_timeout(&hbone, PATIENCE).unwrap();
                s.set_read_timeout(Some(PATIENCE)).unwrap();
                write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").unwrap();
                let mut head = [0u8; 19];
                s.read_exact(&mut head).unwrap();
                assert_eq!(&head, b"HTTP/1.1 200 OK\r\n\r\n");
                s.write_all(b"ambpf").unwrap();
                let mut reply = [0u8; 5];
                s.read_exact(&mut reply).unwrap();
                assert_eq!(&reply, b"ambpf");
            })
        })
        .unwrap();
        let conn = f.wait_proxied(15008, target).await;
        assert_eq!(conn.client.ip(), f.remote_ip(false));
        assert!(
            !f.proxied()
                .iter()
                .any(|c| c.listener_port == 15006 && c.original_dst.port() == 15008),
            "HBONE traffic was captured by the inbound listener"
        );
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ztunnel_marked_loopback_own_address_and_neighbour_traffic_is_never_captured() {
    with_fixture!(|f| {
        let before = f.proxied().len();
        let remote = SocketAddr::new(f.remote_ip(false), PEER_PORT);
        // A socket carrying ztunnel's mark.
        echo_once(f.pod(), remote, None, Some(0x539));
        assert_eq!(f.remote_v4.last_peer().unwrap().ip(), f.pod_ip(false));
        // Loopback and the pod's own address.
        echo_once(
            f.pod(),
            SocketAddr::new([127, 0, 0, 1].into(), APP_PORT),
            None,
            None,
        );
        echo_once(
            f.pod(),
            SocketAddr::new(f.pod_ip(false), APP_PORT),
            None,
            None,
        );
        assert_eq!(f.app.last_peer().unwrap().ip(), f.pod_ip(false));
        // The non-enrolled neighbour, both ways.
        let neighbour = &f.cluster.pods[1];
        echo_once(&neighbour.ns, remote, None, None);
        assert_eq!(
            f.remote_v4.last_peer().unwrap().ip(),
            IpAddr::from(neighbour.addrs.v4)
        );
        echo_once(
            &f.cluster.remote.ns,
            SocketAddr::new(neighbour.addrs.v4.into(), APP_PORT),
            None,
            None,
        );
        assert_eq!(
            f.neighbour_app.last_peer().unwrap().ip(),
            f.remote_ip(false)
        );
        assert_eq!(f.proxied().len(), before, "{:#?}", &f.proxied()[before..]);
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unenrolling_keeps_open_connections_and_stops_capturing_new_ones() {
    with_fixture!(|f| {
        let remote = SocketAddr::new(f.remote_ip(false), PEER_PORT);
        let inbound = SocketAddr::new(f.pod_ip(false), APP_PORT);
        // Open one connection each way through ztunnel and keep them.
        let (mut out_conn, mut in_conn) = tokio::task::block_in_place(|| {
            let out_conn = f
                .pod()
                .run(|| TcpStream::connect_timeout(&remote, PATIENCE).unwrap())
                .unwrap();
            let in_conn = f
                .cluster
                .remote
                .ns
                .run(|| TcpStream::connect_timeout(&inbound, PATIENCE).unwrap())
                .unwrap();
            (out_conn, in_conn)
        });
        f.wait_proxied(15001, remote).await;
        f.wait_proxied(15006, inbound).await;

        let netns = Netns::open(f.pod().name()).unwrap();
        assert!(f.dataplane.unenroll_pod(netns.inode()).unwrap());
        assert!(
            f.dataplane.enrolled_pods().unwrap().is_empty(),
            "an entry was left behind"
        );

        tokio::task::block_in_place(|| {
            for conn in [&mut out_conn, &mut in_conn] {
                conn.set_read_timeout(Some(PATIENCE)).unwrap();
                conn.write_all(b"still").unwrap();
                let mut reply = [0u8; 5];
                conn.read_exact(&mut reply)
                    .expect("open connection broke on unenrol");
                assert_eq!(&reply, b"still");
            }
        });

        // New connections go direct now.
        let before = f.proxied().len();
        echo_once(f.pod(), remote, None, None);
        echo_once(&f.cluster.remote.ns, inbound, None, None);
        assert_eq!(f.app.last_peer().unwrap().ip(), f.remote_ip(false));
        assert_eq!(f.proxied().len(), before);

        // And enrolling again captures them again.
        f.dataplane.enroll_pod(&netns, true).unwrap();
        echo_once(f.pod(), remote, None, None);
        assert!(f.proxied().len() > before);
    })
}

fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}
