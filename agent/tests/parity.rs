//! Privileged: the mode-parity suite. One table of cases runs against the
//! `iptables` mode (Istio's in-pod rules), the `nftables` mode (Istio's
//! nftables tables) and the `ebpf` mode, each case
//! observing what the app and ztunnel (the double, which records what
//! ztunnel reads) see, with addresses named by role (`pod.v4`, `remote.v6`,
//! ...) and ephemeral ports as `ephemeral`, so that the two modes' values
//! compare. Every observation must equal the case's expected value in every
//! mode, except those listed in [`DIFFERENCES`], where each mode must show
//! its own documented value; the table of docs/parity.md ("Where the modes
//! differ") lists the same differences with their reasons.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use ambpf::redirect::{RedirectMode, iptables};
use ambpf_testbed::{
    CgroupGuard, NetnsGuard,
    ztunnel::{DEFAULT_DNS_ANSWER_V4, DEFAULT_DNS_ANSWER_V6, ProxiedConnection, dns},
};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

/// Observation name to value.
type Observed = BTreeMap<&'static str, String>;

struct Case {
    name: &'static str,
    run: fn(&Fixture) -> Observed,
    /// Istio's behaviour: what both modes must observe, unless listed in
    /// [`DIFFERENCES`].
    expected: &'static [(&'static str, &'static str)],
}

/// An observation that differs between the modes on purpose.
struct Difference {
    case: &'static str,
    observation: &'static str,
    iptables: &'static str,
    ebpf: &'static str,
}

/// Every intended difference (docs/parity.md's table gives the reasons).
const DIFFERENCES: &[Difference] = &[
    Difference {
        case: "outbound, app bound to a port only",
        observation: "ztunnel.local",
        iptables: "127.0.0.1:15001",
        ebpf: "pod.v4:15001",
    },
    Difference {
        case: "outbound, app bound to 0.0.0.0",
        observation: "ztunnel.local",
        iptables: "127.0.0.1:15001",
        ebpf: "pod.v4:15001",
    },
    Difference {
        case: "inbound IPv4",
        observation: "ztunnel.local",
        iptables: "pod.v4:15006",
        ebpf: "pod.v4:8080",
    },
    Difference {
        case: "inbound IPv4",
        observation: "ztunnel.so_original_dst",
        iptables: "pod.v4:8080",
        ebpf: "none",
    },
    Difference {
        case: "inbound IPv6",
        observation: "ztunnel.local",
        iptables: "pod.v6:15006",
        ebpf: "pod.v6:8080",
    },
    Difference {
        case: "inbound IPv6",
        observation: "ztunnel.so_original_dst",
        iptables: "pod.v6:8080",
        ebpf: "none",
    },
    Difference {
        case: "kubelet probe",
        observation: "app.peer",
        iptables: "169.254.7.127",
        ebpf: "node.v4",
    },
    Difference {
        case: "DNS, connected UDP from a socket bound to a port",
        observation: "ztunnel.dns_client",
        iptables: "pod.v4",
        ebpf: "127.0.0.1",
    },
    Difference {
        case: "to ztunnel's 15001 on loopback",
        observation: "ztunnel.so_original_dst",
        iptables: "127.0.0.1:15001",
        ebpf: "none",
    },
    Difference {
        case: "to ztunnel's 15001 on the pod's address",
        observation: "ztunnel.so_original_dst",
        iptables: "pod.v4:15001",
        ebpf: "none",
    },
];

/// What ztunnel's accepted outbound socket shows, for an app connection.
const OUTBOUND_V4: &[(&str, &str)] = &[
    ("app.local", "pod.v4:ephemeral"),
    ("app.peer", "remote.v4:9000"),
    ("ztunnel.peer_is_the_apps_socket", "true"),
    ("ztunnel.local", "127.0.0.1:15001"),
    ("ztunnel.so_original_dst", "remote.v4:9000"),
    ("ztunnel.original_dst", "remote.v4:9000"),
    ("ztunnel.forwarded", "for=pod.v4"),
    ("ztunnel.outcome", "Proxied"),
    ("server.peer", "pod.v4"),
];

const OUTBOUND_V6: &[(&str, &str)] = &[
    ("app.local", "pod.v6:ephemeral"),
    ("app.peer", "remote.v6:9000"),
    ("ztunnel.peer_is_the_apps_socket", "true"),
    ("ztunnel.local", "::1:15001"),
    ("ztunnel.so_original_dst", "remote.v6:9000"),
    ("ztunnel.original_dst", "remote.v6:9000"),
    ("ztunnel.forwarded", "for=\"[pod.v6]\""),
    ("ztunnel.outcome", "Proxied"),
    ("server.peer", "pod.v6"),
];

const INBOUND_V4: &[(&str, &str)] = &[
    ("client.peer", "pod.v4:8080"),
    ("ztunnel.peer", "remote.v4:ephemeral"),
    ("ztunnel.peer_is_the_clients_socket", "true"),
    ("ztunnel.local", "pod.v4:15006"),
    ("ztunnel.so_original_dst", "pod.v4:8080"),
    ("ztunnel.original_dst", "pod.v4:8080"),
    ("ztunnel.outcome", "Proxied"),
    ("app.peer", "remote.v4"),
];

const INBOUND_V6: &[(&str, &str)] = &[
    ("client.peer", "pod.v6:8080"),
    ("ztunnel.peer", "remote.v6:ephemeral"),
    ("ztunnel.peer_is_the_clients_socket", "true"),
    ("ztunnel.local", "pod.v6:15006"),
    ("ztunnel.so_original_dst", "pod.v6:8080"),
    ("ztunnel.original_dst", "pod.v6:8080"),
    ("ztunnel.outcome", "Proxied"),
    ("app.peer", "remote.v6"),
];

const NOT_PROXIED: (&str, &str) = ("ztunnel.connections", "0");

const CASES: &[Case] = &[
    Case {
        name: "outbound IPv4",
        run: |f| outbound(f, false, AppBind::None, false),
        expected: OUTBOUND_V4,
    },
    Case {
        name: "outbound IPv6",
        run: |f| outbound(f, true, AppBind::None, false),
        expected: OUTBOUND_V6,
    },
    Case {
        name: "outbound IPv4 from a dual-stack socket (v4-mapped)",
        run: |f| outbound(f, false, AppBind::None, true),
        expected: OUTBOUND_V4,
    },
    Case {
        name: "outbound, app bound to its pod address",
        run: |f| outbound(f, false, AppBind::PodAddress, false),
        expected: OUTBOUND_V4,
    },
    Case {
        name: "outbound, app bound to 0.0.0.0",
        run: |f| outbound(f, false, AppBind::Wildcard, false),
        expected: OUTBOUND_V4,
    },
    Case {
        name: "outbound, app bound to a port only",
        run: |f| outbound(f, false, AppBind::PortOnly, false),
        expected: OUTBOUND_V4,
    },
    Case {
        name: "inbound IPv4",
        run: |f| inbound(f, false),
        expected: INBOUND_V4,
    },
    Case {
        name: "inbound IPv6",
        run: |f| inbound(f, true),
        expected: INBOUND_V6,
    },
    Case {
        name: "HBONE to 15008",
        run: hbone,
        expected: &[
            ("ztunnel.listener", "15008"),
            ("ztunnel.peer", "remote.v4:ephemeral"),
            ("ztunnel.local", "pod.v4:15008"),
            ("ztunnel.original_dst", "pod.v4:8080"),
            // The double's HBONE stand-in connects from the pod's address.
            ("app.peer", "pod.v4"),
        ],
    },
    Case {
        name: "kubelet probe",
        run: probe,
        expected: &[("app.peer", "node.v4"), NOT_PROXIED],
    },
    Case {
        name: "DNS, connected UDP",
        run: |f| dns_udp(f, DnsSocket::Connected, false),
        expected: &[
            ("app.answer", "true"),
            ("app.answer_from", "remote.v4:53"),
            ("ztunnel.dns_client", "pod.v4"),
            ("ztunnel.dns_server", "127.0.0.1:15053"),
        ],
    },
    Case {
        name: "DNS, connected UDP from a socket bound to a port",
        run: |f| dns_udp(f, DnsSocket::BoundThenConnected, false),
        expected: &[
            ("app.answer", "true"),
            ("app.answer_from", "remote.v4:53"),
            ("ztunnel.dns_client", "pod.v4"),
            ("ztunnel.dns_server", "127.0.0.1:15053"),
        ],
    },
    Case {
        name: "DNS, unconnected UDP",
        run: |f| dns_udp(f, DnsSocket::Unconnected, false),
        expected: &[
            ("app.answer", "true"),
            ("app.answer_from", "remote.v4:53"),
            ("ztunnel.dns_client", "pod.v4"),
            ("ztunnel.dns_server", "127.0.0.1:15053"),
        ],
    },
    Case {
        name: "DNS, unconnected UDP over IPv6",
        run: |f| dns_udp(f, DnsSocket::Unconnected, true),
        expected: &[
            ("app.answer", "true"),
            ("app.answer_from", "remote.v6:53"),
            ("ztunnel.dns_client", "pod.v6"),
            ("ztunnel.dns_server", "::1:15053"),
        ],
    },
    Case {
        name: "DNS, connected UDP over IPv6",
        run: |f| dns_udp(f, DnsSocket::Connected, true),
        expected: &[
            ("app.answer", "true"),
            ("app.answer_from", "remote.v6:53"),
            ("ztunnel.dns_client", "pod.v6"),
            ("ztunnel.dns_server", "::1:15053"),
        ],
    },
    Case {
        name: "DNS, TCP",
        run: dns_tcp,
        expected: &[
            ("app.answer", "true"),
            ("app.local", "pod.v4:ephemeral"),
            ("app.peer", "remote.v4:53"),
            ("ztunnel.dns_client", "pod.v4"),
            ("ztunnel.dns_server", "127.0.0.1:15053"),
            NOT_PROXIED,
        ],
    },
    Case {
        name: "DNS, one unconnected UDP socket asking two resolvers at once",
        run: dns_two_resolvers,
        expected: &[("app.answers_from_a_resolver_asked", "2")],
    },
    Case {
        name: "UDP, not DNS",
        run: udp_not_dns,
        expected: &[
            ("app.reply_from", "remote.v4:9001"),
            ("server.peer", "pod.v4"),
            ("ztunnel.dns_queries", "0"),
        ],
    },
    Case {
        name: "ICMP echo",
        run: icmp_echo,
        expected: &[("app.reply_from", "remote.v4")],
    },
    Case {
        name: "to loopback",
        run: |f| local_call(f, IpAddr::V4(Ipv4Addr::LOCALHOST)),
        expected: &[
            ("app.local", "127.0.0.1:ephemeral"),
            ("app.peer", "127.0.0.1:8080"),
            ("server.peer", "127.0.0.1"),
            NOT_PROXIED,
        ],
    },
    Case {
        name: "to the pod's own address",
        run: |f| local_call(f, f.pod_ip(false)),
        expected: &[
            ("app.local", "pod.v4:ephemeral"),
            ("app.peer", "pod.v4:8080"),
            ("server.peer", "pod.v4"),
            NOT_PROXIED,
        ],
    },
    Case {
        name: "to another pod on the node",
        run: to_neighbour,
        expected: &[
            ("app.local", "pod.v4:ephemeral"),
            ("app.peer", "neighbour.v4:8080"),
            ("ztunnel.listener", "15001"),
            ("ztunnel.original_dst", "neighbour.v4:8080"),
            ("server.peer", "pod.v4"),
        ],
    },
    Case {
        name: "to ztunnel's 15001 on loopback",
        run: |f| to_ztunnel(f, IpAddr::V4(Ipv4Addr::LOCALHOST)),
        expected: &[
            ("ztunnel.listener", "15001"),
            ("ztunnel.original_dst", "127.0.0.1:15001"),
            ("ztunnel.so_original_dst", "127.0.0.1:15001"),
            ("ztunnel.outcome", "RefusedSelfCall"),
        ],
    },
    Case {
        name: "to ztunnel's 15001 on the pod's address",
        run: |f| to_ztunnel(f, f.pod_ip(false)),
        expected: &[
            ("ztunnel.listener", "15001"),
            ("ztunnel.original_dst", "pod.v4:15001"),
            ("ztunnel.so_original_dst", "pod.v4:15001"),
            ("ztunnel.outcome", "RefusedSelfCall"),
        ],
    },
];

/// Names an address by its role in the cluster.
fn ip_name(f: &Fixture, ip: IpAddr) -> String {
    let ip = unmap(ip);
    let family = if ip.is_ipv4() { "v4" } else { "v6" };
    let roles = [
        ("pod", f.cluster.pods[0].addrs),
        ("neighbour", f.cluster.pods[1].addrs),
        ("remote", f.cluster.remote.addrs),
    ];
    for (role, addrs) in roles {
        if ip == IpAddr::from(addrs.v4) || ip == IpAddr::from(addrs.v6) {
            return format!("{role}.{family}");
        }
    }
    if f.cluster.node_addresses().contains(&ip) {
        return format!("node.{family}");
    }
    ip.to_string()
}

/// Ports the cases use keep their number; the kernel's picks do not.
fn addr_name(f: &Fixture, addr: SocketAddr) -> String {
    const KNOWN: [u16; 8] = [53, 8080, 9000, 9001, 15001, 15006, 15008, 15053];
    let port = if KNOWN.contains(&addr.port()) {
        addr.port().to_string()
    } else {
        "ephemeral".to_owned()
    };
    format!("{}:{port}", ip_name(f, addr.ip()))
}

fn unmapped(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(unmap(addr.ip()), addr.port())
}

/// Waits (blocking, inside the runtime) until the double recorded a
/// connection `pick` accepts.
fn wait_connection(
    f: &Fixture,
    pick: impl Fn(&ProxiedConnection) -> bool + Copy,
) -> ProxiedConnection {
    tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current()
            .block_on(
                f.ztunnel
                    .wait_until(|s| s.proxied.iter().any(pick), PATIENCE),
            )
            .unwrap_or_else(|e| panic!("no such connection: {:#?}", e.state.proxied));
    });
    f.proxied().into_iter().find(|c| pick(c)).unwrap()
}

fn connections(f: &Fixture) -> usize {
    f.proxied().len()
}

fn outbound(f: &Fixture, v6: bool, bind: AppBind, dual_stack: bool) -> Observed {
    let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
    let (local, peer) = outbound_as_app(f, dst, bind, dual_stack);
    let conn = wait_connection(f, |c| c.listener_port == 15001 && c.client == local);
    let server = if v6 { &f.remote_v6 } else { &f.remote_v4 };
    Observed::from([
        ("app.local", addr_name(f, local)),
        ("app.peer", addr_name(f, peer)),
        (
            "ztunnel.peer_is_the_apps_socket",
            (conn.client == local).to_string(),
        ),
        ("ztunnel.local", addr_name(f, conn.local)),
        (
            "ztunnel.so_original_dst",
            conn.so_original_dst
                .map_or("none".into(), |a| addr_name(f, a)),
        ),
        ("ztunnel.original_dst", addr_name(f, conn.original_dst)),
        ("ztunnel.forwarded", forwarded_name(f, &conn)),
        ("ztunnel.outcome", format!("{:?}", conn.outcome)),
        ("server.peer", ip_name(f, server.last_peer().unwrap().ip())),
    ])
}

/// The `Forwarded` header with its address named.
fn forwarded_name(f: &Fixture, conn: &ProxiedConnection) -> String {
    let header = conn.forwarded.clone().unwrap_or_else(|| "none".into());
    let ip = unmap(conn.client.ip());
    header.replace(&ip.to_string(), &ip_name(f, ip))
}

fn inbound(f: &Fixture, v6: bool) -> Observed {
    let dst = SocketAddr::new(f.pod_ip(v6), APP_PORT);
    let (local, peer) = tokio::task::block_in_place(|| {
        f.cluster
            .remote
            .ns
            .run(|| {
                let mut s = TcpStream::connect_timeout(&dst, PATIENCE).unwrap();
                s.set_read_timeout(Some(PATIENCE)).unwrap();
                s.write_all(b"ambpf").unwrap();
                let mut reply = [0u8; 5];
                s.read_exact(&mut reply).unwrap();
                (s.local_addr().unwrap(), s.peer_addr().unwrap())
            })
            .unwrap()
    });
    let conn = wait_connection(f, |c| c.listener_port == 15006 && c.client == local);
    Observed::from([
        ("client.peer", addr_name(f, peer)),
        ("ztunnel.peer", addr_name(f, conn.client)),
        (
            "ztunnel.peer_is_the_clients_socket",
            (conn.client == local).to_string(),
        ),
        ("ztunnel.local", addr_name(f, conn.local)),
        (
            "ztunnel.so_original_dst",
            conn.so_original_dst
                .map_or("none".into(), |a| addr_name(f, a)),
        ),
        ("ztunnel.original_dst", addr_name(f, conn.original_dst)),
        ("ztunnel.outcome", format!("{:?}", conn.outcome)),
        ("app.peer", ip_name(f, f.app.last_peer().unwrap().ip())),
    ])
}

fn hbone(f: &Fixture) -> Observed {
    let hbone = SocketAddr::new(f.pod_ip(false), 15008);
    let target = SocketAddr::new(f.pod_ip(false), APP_PORT);
    let local = tokio::task::block_in_place(|| {
        f.cluster
            .remote
            .ns
            .run(|| {
                let mut s = TcpStream::connect_timeout(&hbone, PATIENCE).unwrap();
                s.set_read_timeout(Some(PATIENCE)).unwrap();
                write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").unwrap();
                let mut head = [0u8; 19];
                s.read_exact(&mut head).unwrap();
                s.write_all(b"ambpf").unwrap();
                let mut reply = [0u8; 5];
                s.read_exact(&mut reply).unwrap();
                s.local_addr().unwrap()
            })
            .unwrap()
    });
    let conn = wait_connection(f, |c| c.client == local);
    Observed::from([
        ("ztunnel.listener", conn.listener_port.to_string()),
        ("ztunnel.peer", addr_name(f, conn.client)),
        ("ztunnel.local", addr_name(f, conn.local)),
        ("ztunnel.original_dst", addr_name(f, conn.original_dst)),
        ("app.peer", ip_name(f, f.app.last_peer().unwrap().ip())),
    ])
}

fn probe(f: &Fixture) -> Observed {
    let before = connections(f);
    let dst = SocketAddr::new(f.pod_ip(false), APP_PORT);
    echo_once(&f.cluster.node, dst, None, None);
    Observed::from([
        ("app.peer", ip_name(f, f.app.last_peer().unwrap().ip())),
        ("ztunnel.connections", (connections(f) - before).to_string()),
    ])
}

/// Runs `query` in pod 1, then names the DNS proxy's record of `name`.
fn dns_seen(f: &Fixture, name: &str, observed: &mut Observed) {
    let queries = f.ztunnel.dns_queries();
    let query = queries
        .iter()
        .find(|q| q.name == name)
        .unwrap_or_else(|| panic!("no query for {name}: {queries:#?}"));
    observed.insert("ztunnel.dns_client", ip_name(f, query.client.ip()));
    observed.insert("ztunnel.dns_server", addr_name(f, query.server));
}

/// How an app's resolver sets up its UDP socket.
#[derive(Clone, Copy, Debug)]
enum DnsSocket {
    /// `connect()` on a fresh socket, then `send()` (glibc, Go).
    Connected,
    /// `bind()` to a port (any address), then `connect()` (Rust's
    /// `UdpSocket`).
    BoundThenConnected,
    /// `bind()`, then `sendto()` / `recvfrom()` (musl).
    Unconnected,
}

fn dns_udp(f: &Fixture, how: DnsSocket, v6: bool) -> Observed {
    let resolver = SocketAddr::new(f.remote_ip(v6), 53);
    let family = if v6 { "v6" } else { "v4" };
    let name = format!("{how:?}.{family}.udp.ambpf.test").to_lowercase();
    let any = if v6 { "[::]:0" } else { "0.0.0.0:0" };
    let (answered, from) = tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let qtype = if v6 { dns::TYPE_AAAA } else { dns::TYPE_A };
                let query = dns::encode_query(0x1d57, &name, qtype).unwrap();
                let mut buffer = [0u8; 512];
                let (len, from) = match how {
                    DnsSocket::Connected => {
                        let domain = socket2::Domain::for_address(resolver);
                        let socket =
                            socket2::Socket::new(domain, socket2::Type::DGRAM, None).unwrap();
                        socket.connect(&resolver.into()).unwrap();
                        let udp: UdpSocket = socket.into();
                        udp.set_read_timeout(Some(PATIENCE)).unwrap();
                        udp.send(&query).unwrap();
                        (udp.recv(&mut buffer).unwrap(), udp.peer_addr().unwrap())
                    }
                    DnsSocket::BoundThenConnected => {
                        let udp = UdpSocket::bind(any).unwrap();
                        udp.set_read_timeout(Some(PATIENCE)).unwrap();
                        udp.connect(resolver).unwrap();
                        udp.send(&query).unwrap();
                        (udp.recv(&mut buffer).unwrap(), udp.peer_addr().unwrap())
                    }
                    DnsSocket::Unconnected => {
                        let udp = UdpSocket::bind(any).unwrap();
                        udp.set_read_timeout(Some(PATIENCE)).unwrap();
                        udp.send_to(&query, resolver).unwrap();
                        udp.recv_from(&mut buffer).unwrap()
                    }
                };
                let answer = dns::Response::parse(&buffer[..len]).unwrap();
                let qtype_answer: IpAddr = if v6 {
                    DEFAULT_DNS_ANSWER_V6.into()
                } else {
                    DEFAULT_DNS_ANSWER_V4.into()
                };
                let answered = answer.header.id == 0x1d57 && answer.addresses() == [qtype_answer];
                (answered, from)
            })
            .unwrap()
    });
    let mut observed = Observed::from([
        ("app.answer", answered.to_string()),
        ("app.answer_from", addr_name(f, from)),
    ]);
    dns_seen(f, &name, &mut observed);
    observed
}

fn dns_tcp(f: &Fixture) -> Observed {
    let before = connections(f);
    let resolver = SocketAddr::new(f.remote_ip(false), 53);
    let name = "tcp.parity.ambpf.test";
    let (answered, local, peer) = tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let mut tcp = TcpStream::connect_timeout(&resolver, PATIENCE).unwrap();
                tcp.set_read_timeout(Some(PATIENCE)).unwrap();
                let query = dns::encode_query(0x7c91, name, dns::TYPE_A).unwrap();
                let mut framed = u16::try_from(query.len()).unwrap().to_be_bytes().to_vec();
                framed.extend_from_slice(&query);
                tcp.write_all(&framed).unwrap();
                let mut len = [0u8; 2];
                tcp.read_exact(&mut len).unwrap();
                let mut body = vec![0u8; usize::from(u16::from_be_bytes(len))];
                tcp.read_exact(&mut body).unwrap();
                let answer = dns::Response::parse(&body).unwrap();
                (
                    answer.header.id == 0x7c91,
                    tcp.local_addr().unwrap(),
                    tcp.peer_addr().unwrap(),
                )
            })
            .unwrap()
    });
    let mut observed = Observed::from([
        ("app.answer", answered.to_string()),
        ("app.local", addr_name(f, local)),
        ("app.peer", addr_name(f, peer)),
        ("ztunnel.connections", (connections(f) - before).to_string()),
    ]);
    dns_seen(f, name, &mut observed);
    observed
}

/// musl's resolver: one unconnected socket sends the query to every
/// resolver at once and takes an answer only from an address it asked.
fn dns_two_resolvers(f: &Fixture) -> Observed {
    let resolvers = [
        SocketAddr::new(f.remote_ip(false), 53),
        SocketAddr::new(f.cluster.pods[1].addrs.v4.into(), 53),
    ];
    let accepted = tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
                udp.set_read_timeout(Some(PATIENCE)).unwrap();
                let query = dns::encode_query(0x5a5a, "musl.ambpf.test", dns::TYPE_A).unwrap();
                for resolver in resolvers {
                    udp.send_to(&query, resolver).unwrap();
                }
                let mut accepted = 0;
                let mut buffer = [0u8; 512];
                for _ in resolvers {
                    let Ok((len, from)) = udp.recv_from(&mut buffer) else {
                        break;
                    };
                    let ours = dns::Response::parse(&buffer[..len])
                        .is_ok_and(|answer| answer.header.id == 0x5a5a);
                    if ours && resolvers.contains(&unmapped(from)) {
                        accepted += 1;
                    }
                }
                accepted
            })
            .unwrap()
    });
    Observed::from([("app.answers_from_a_resolver_asked", accepted.to_string())])
}

/// A UDP echo server at `addr` in `ns` that answers one datagram; its
/// sender's address.
fn udp_echo_once(ns: &NetnsGuard, addr: SocketAddr) -> std::thread::JoinHandle<SocketAddr> {
    let socket = ns.run(|| UdpSocket::bind(addr)).unwrap().unwrap();
    socket.set_read_timeout(Some(PATIENCE)).unwrap();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 64];
        let (len, peer) = socket.recv_from(&mut buffer).unwrap();
        socket.send_to(&buffer[..len], peer).unwrap();
        peer
    })
}

fn udp_not_dns(f: &Fixture) -> Observed {
    let queries = f.ztunnel.dns_queries().len();
    let server_addr = SocketAddr::new(f.remote_ip(false), 9001);
    let server = udp_echo_once(&f.cluster.remote.ns, server_addr);
    let from = tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
                udp.set_read_timeout(Some(PATIENCE)).unwrap();
                udp.send_to(b"ambpf", server_addr).unwrap();
                let mut buffer = [0u8; 64];
                udp.recv_from(&mut buffer).unwrap().1
            })
            .unwrap()
    });
    let peer = server.join().unwrap();
    Observed::from([
        ("app.reply_from", addr_name(f, from)),
        ("server.peer", ip_name(f, peer.ip())),
        (
            "ztunnel.dns_queries",
            (f.ztunnel.dns_queries().len() - queries).to_string(),
        ),
    ])
}

/// An ICMP echo request from pod 1 to the remote over a raw socket; who
/// answered.
fn icmp_echo(f: &Fixture) -> Observed {
    let IpAddr::V4(remote) = f.remote_ip(false) else {
        unreachable!()
    };
    let from = tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let raw = socket2::Socket::new(
                    socket2::Domain::IPV4,
                    socket2::Type::RAW,
                    Some(socket2::Protocol::ICMPV4),
                )
                .unwrap();
                raw.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                let mut request = [8u8, 0, 0, 0, 0x0a, 0xbf, 0, 1];
                let sum = !request
                    .chunks(2)
                    .map(|p| u32::from(u16::from_be_bytes([p[0], p[1]])))
                    .sum::<u32>() as u16;
                request[2..4].copy_from_slice(&sum.to_be_bytes());
                let to = SocketAddr::new(remote.into(), 0);
                raw.send_to(&request, &to.into()).unwrap();
                let deadline = std::time::Instant::now() + PATIENCE;
                let mut packet = [std::mem::MaybeUninit::<u8>::uninit(); 1500];
                while std::time::Instant::now() < deadline {
                    let Ok((n, from)) = raw.recv_from(&mut packet) else {
                        continue;
                    };
                    // SAFETY: recv_from initialized the first n bytes.
                    let bytes: Vec<u8> = packet[..n]
                        .iter()
                        .map(|b| unsafe { b.assume_init() })
                        .collect();
                    let ihl = usize::from(bytes[0] & 0x0f) * 4;
                    // An echo reply with our identifier.
                    if n >= ihl + 8 && bytes[ihl] == 0 && bytes[ihl + 4..ihl + 6] == [0x0a, 0xbf] {
                        return from.as_socket().map(|a| a.ip());
                    }
                }
                None
            })
            .unwrap()
    });
    Observed::from([(
        "app.reply_from",
        from.map_or("none".into(), |ip| ip_name(f, ip)),
    )])
}

/// From pod 1 to its own app at `ip`.
fn local_call(f: &Fixture, ip: IpAddr) -> Observed {
    let before = connections(f);
    let (local, peer) = outbound_as_app(f, SocketAddr::new(ip, APP_PORT), AppBind::None, false);
    Observed::from([
        ("app.local", addr_name(f, local)),
        ("app.peer", addr_name(f, peer)),
        ("server.peer", ip_name(f, f.app.last_peer().unwrap().ip())),
        ("ztunnel.connections", (connections(f) - before).to_string()),
    ])
}

fn to_neighbour(f: &Fixture) -> Observed {
    let dst = SocketAddr::new(f.cluster.pods[1].addrs.v4.into(), APP_PORT);
    let (local, peer) = outbound_as_app(f, dst, AppBind::None, false);
    let conn = wait_connection(f, |c| c.client == local);
    Observed::from([
        ("app.local", addr_name(f, local)),
        ("app.peer", addr_name(f, peer)),
        ("ztunnel.listener", conn.listener_port.to_string()),
        ("ztunnel.original_dst", addr_name(f, conn.original_dst)),
        (
            "server.peer",
            ip_name(f, f.neighbour_app.last_peer().unwrap().ip()),
        ),
    ])
}

/// The self-call guard: an app in the pod calling ztunnel's outbound
/// listener at `ip` directly is refused, never proxied to ztunnel itself.
fn to_ztunnel(f: &Fixture, ip: IpAddr) -> Observed {
    let dst = SocketAddr::new(ip, 15001);
    let local = tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                let mut s = TcpStream::connect_timeout(&dst, PATIENCE).unwrap();
                s.set_read_timeout(Some(PATIENCE)).unwrap();
                // ztunnel closes it.
                let _ = s.read(&mut [0u8; 1]);
                s.local_addr().unwrap()
            })
            .unwrap()
    });
    let conn = wait_connection(f, |c| c.client == local);
    Observed::from([
        ("ztunnel.listener", conn.listener_port.to_string()),
        ("ztunnel.original_dst", addr_name(f, conn.original_dst)),
        (
            "ztunnel.so_original_dst",
            conn.so_original_dst
                .map_or("none".into(), |a| addr_name(f, a)),
        ),
        ("ztunnel.outcome", format!("{:?}", conn.outcome)),
    ])
}

/// Every case in `mode`, on one fixture.
async fn observe(mode: RedirectMode) -> Vec<Observed> {
    with_fixture!(mode, |f| {
        CASES.iter().map(|case| (case.run)(&f)).collect()
    })
}

fn expected_in(mode: RedirectMode, case: &Case) -> BTreeMap<&'static str, String> {
    let mut expected: BTreeMap<_, _> = case
        .expected
        .iter()
        .map(|(k, v)| (*k, (*v).to_owned()))
        .collect();
    for d in DIFFERENCES.iter().filter(|d| d.case == case.name) {
        let value = match mode {
            // The nftables mode writes the iptables mode's rules.
            RedirectMode::Iptables | RedirectMode::Nftables => d.iptables,
            RedirectMode::Ebpf => d.ebpf,
        };
        let slot = expected
            .get_mut(d.observation)
            .unwrap_or_else(|| panic!("{}: no observation {}", d.case, d.observation));
        *slot = value.to_owned();
    }
    expected
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_mode_gives_ztunnel_and_the_apps_the_same_observations() {
    // Every listed difference names a case of the table.
    for d in DIFFERENCES {
        assert!(
            CASES.iter().any(|c| c.name == d.case),
            "difference for unknown case {}",
            d.case
        );
    }
    let iptables = observe(RedirectMode::Iptables).await;
    let nftables = observe(RedirectMode::Nftables).await;
    let ebpf = observe(RedirectMode::Ebpf).await;
    let mut mismatches = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        for (mode, observed) in [
            (RedirectMode::Iptables, &iptables[i]),
            (RedirectMode::Nftables, &nftables[i]),
            (RedirectMode::Ebpf, &ebpf[i]),
        ] {
            let expected = expected_in(mode, case);
            if *observed != expected {
                mismatches.push(format!(
                    "{} ({mode:?}):\n  expected {expected:?}\n  observed {observed:?}",
                    case.name
                ));
            }
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    // The probe SNAT address of the iptables mode is Istio's.
    assert_eq!(
        DIFFERENCES
            .iter()
            .find(|d| d.case == "kubelet probe")
            .map(|d| d.iptables),
        Some(iptables::PROBE_SNAT_V4.to_string().as_str())
    );
}
