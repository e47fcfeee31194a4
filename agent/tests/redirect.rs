//! Privileged: both redirection modes with real traffic between real network
//! namespaces, through the ztunnel double (its proxies run inside the pod
//! exactly where ztunnel's would).
//!
//! Topology (testbed `Cluster`): pod 1 is enrolled, pod 2 is its
//! non-enrolled neighbour, `remote` is an off-node client/server, and the node
//! namespace forwards between them; the node's own addresses are the "host".
//!
//! Every behaviour runs once per mode: `<behaviour>::ebpf` (the `Dataplane`,
//! its cgroup programs attached to a test cgroup this process enters) and
//! `<behaviour>::iptables` (`IptablesRedirection`, Istio's in-pod rules, with
//! the node namespace as the host and the backend detected there).

use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    sync::Arc,
    time::Duration,
};

use ambpf::{
    bpf::{Dataplane, PinLayout},
    netns::Netns,
    redirect::{
        CheckScope, RedirectMode, ViolationKind,
        iptables::{self, Family},
        nftables, routing,
    },
};
use ambpf_common::{IpKey, PodConfig, maps};
use ambpf_testbed::{
    CgroupGuard, NetnsGuard,
    privileges::{CAP_NET_ADMIN, CAP_NET_RAW, Privileges, drop_thread_privileges},
    ztunnel::{
        ConnectionOutcome, DEFAULT_DNS_ANSWER_V4, DnsTransport, ZtunnelConfig, ZtunnelDouble, dns,
    },
};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

in_all_modes!(
    outbound_tcp_reaches_ztunnel_which_recovers_the_original_destination,
    |f| {
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
    }
);

in_all_modes!(
    an_app_that_closes_before_a_busy_ztunnel_asks_still_has_its_destination_answered,
    |f| {
        // A busy ztunnel: it asks a connection's original destination only
        // a while after accepting it. Conntrack keeps the entry while
        // ztunnel's side lives; the eBPF mode's record must live as long.
        let config = ZtunnelConfig::default().original_dst_delay(Duration::from_millis(300));
        let busy = ZtunnelDouble::connect_with_retry(f.zds.socket(), config);
        drop(std::mem::replace(&mut f.ztunnel, busy));
        f.ztunnel
            .wait_until(
                |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
                PATIENCE,
            )
            .await
            .unwrap();
        for v6 in [false, true] {
            let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
            // The app sends its request and closes at once, long before
            // ztunnel asks.
            tokio::task::block_in_place(|| {
                f.pod()
                    .run(|| {
                        let mut conn = TcpStream::connect_timeout(&dst, PATIENCE).unwrap();
                        conn.write_all(b"ambpf").unwrap();
                    })
                    .unwrap()
            });
            f.ztunnel
                .wait_until(
                    |s| s.proxied.iter().any(|c| c.listener_port == 15001),
                    PATIENCE,
                )
                .await
                .unwrap();
            let conn = f.ztunnel.take_proxied().remove(0);
            assert_eq!(conn.original_dst, dst, "{conn:?}");
            assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{conn:?}");
        }
    }
);

in_all_modes!(
    outbound_capture_keeps_the_pods_address_as_istios_redirect_does,
    |f| {
        let cases = [
            (false, AppBind::None, false),
            (true, AppBind::None, false),
            (false, AppBind::None, true),
            (false, AppBind::PodAddress, false),
            (true, AppBind::PodAddress, false),
            (false, AppBind::PodAddress, true),
            (false, AppBind::PortOnly, false),
            (true, AppBind::PortOnly, false),
            (false, AppBind::Wildcard, false),
            (false, AppBind::Wildcard, true),
        ];
        for (v6, bind, dual_stack) in cases {
            let case = format!(
                "{:?} ipv6={v6} bind={bind:?} dual-stack={dual_stack}",
                f.mode
            );
            let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
            let (local, peer) = outbound_as_app(&f, dst, bind, dual_stack);
            // The app sees its pod address and the peer it asked for.
            assert_eq!(local.ip(), f.pod_ip(v6), "{case}: getsockname");
            assert_eq!(peer, dst, "{case}: getpeername");
            // ztunnel accepted the connection from that very address and
            // port, and learns the original destination.
            f.ztunnel
                .wait_until(
                    |s| {
                        s.proxied
                            .iter()
                            .any(|c| c.listener_port == 15001 && c.client == local)
                    },
                    PATIENCE,
                )
                .await
                .unwrap_or_else(|_| panic!("{case}: no connection from {local} on 15001"));
            let conn = f
                .proxied()
                .into_iter()
                .find(|c| c.listener_port == 15001 && c.client == local)
                .unwrap();
            assert_eq!(conn.original_dst, dst, "{case}: SO_ORIGINAL_DST");
            assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{case}");
        }
        // Traffic to ztunnel's own ports is never captured again: the
        // double's passthrough connections (mark 0x539) reached the remote
        // from the pod's address, not through 15001 once more.
        let server = &f.remote_v4;
        assert_eq!(server.last_peer().unwrap().ip(), f.pod_ip(false));
    }
);

in_all_modes!(
    inbound_tcp_reaches_ztunnel_and_the_app_sees_the_client_source,
    |f| {
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
    }
);

in_all_modes!(
    hbone_port_goes_straight_to_ztunnel_and_probes_straight_to_the_app,
    |f| {
        // Host (kubelet) traffic: from the node's own address, to the app,
        // uncaptured. The eBPF mode leaves its source alone, so the app sees
        // the node's address. The iptables and nftables modes do what Istio
        // does: the host SNATs traffic from host processes to ambient pods to
        // 169.254.7.127, which the in-pod rules let through.
        assert_eq!(f.probe_from_node(false, "IPv4"), f.probe_source_v4());
        if f.mode != RedirectMode::Ebpf {
            // And Istio's IPv6 equivalent.
            let snat_v6: IpAddr = iptables::PROBE_SNAT_V6.into();
            assert_eq!(f.probe_from_node(true, "IPv6"), snat_v6);
        }

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
    }
);

in_all_modes!(
    with_no_ztunnel_listening_an_inbound_connection_is_refused_at_once_and_never_reaches_the_app,
    |f| {
        // Through ztunnel first: the paths (and IPv6 neighbours) are up.
        for v6 in [false, true] {
            let dst = SocketAddr::new(f.pod_ip(v6), APP_PORT);
            echo_once(&f.cluster.remote.ns, dst, None, None);
            f.wait_proxied(15006, dst).await;
        }
        f.stop_ztunnel_proxies().await;
        let app_peers = f.app.seen.lock().unwrap().len();
        for v6 in [false, true] {
            let dst = SocketAddr::new(f.pod_ip(v6), APP_PORT);
            // Under Istio's rules the SYN is REDIRECTed to the closed 15006
            // and the kernel answers with an RST; eBPF mode answers the same
            // way from its steering program. A dropped SYN would only be
            // retried after a second.
            let started = std::time::Instant::now();
            let result = tokio::task::block_in_place(|| {
                f.cluster
                    .remote
                    .ns
                    .run(|| TcpStream::connect_timeout(&dst, PATIENCE))
                    .unwrap()
            });
            let elapsed = started.elapsed();
            let error = result.err().unwrap_or_else(|| panic!("{dst}: connected"));
            assert_eq!(
                error.kind(),
                std::io::ErrorKind::ConnectionRefused,
                "{dst}: {error}"
            );
            assert!(
                elapsed < Duration::from_millis(900),
                "{dst}: refused after {elapsed:?}"
            );
        }
        assert_eq!(
            f.app.seen.lock().unwrap().len(),
            app_peers,
            "the app was reached"
        );
        // HBONE and probes are not captured: unaffected, the app still
        // answers the node.
        echo_once(
            &f.cluster.node,
            SocketAddr::new(f.pod_ip(false), APP_PORT),
            None,
            None,
        );
    }
);

in_all_modes!(
    ztunnel_marked_loopback_own_address_and_neighbour_traffic_is_never_captured,
    |f| {
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
    }
);

/// One connection from the pod to `to` on a thread with only `privileges`,
/// whose socket first tries to take ztunnel's mark 0x539; whether it could.
/// What `nft args...` prints in `ns` (nftables mode).
fn nft_listing(ns: &NetnsGuard, args: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "nft"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "nft {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn echo_trying_ztunnels_mark(f: &Fixture, to: SocketAddr, privileges: Privileges) -> bool {
    tokio::task::block_in_place(|| {
        f.pod()
            .run(|| {
                drop_thread_privileges(privileges).unwrap();
                let socket =
                    socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                        .unwrap();
                let marked = match socket.set_mark(0x539) {
                    Ok(()) => true,
                    Err(e) if e.raw_os_error() == Some(libc::EPERM) => false,
                    Err(e) => panic!("SO_MARK as {privileges:?}: {e}"),
                };
                socket.set_read_timeout(Some(PATIENCE)).unwrap();
                socket.connect_timeout(&to.into(), PATIENCE).unwrap();
                let mut stream: TcpStream = socket.into();
                stream.write_all(b"ambpf").unwrap();
                let mut reply = [0u8; 5];
                stream.read_exact(&mut reply).unwrap();
                marked
            })
            .unwrap()
    })
}

/// Linux 5.17 lets CAP_NET_RAW set SO_MARK, as CAP_NET_ADMIN always could.
fn net_raw_may_mark() -> bool {
    let release = nix::sys::utsname::uname().unwrap();
    let mut numbers = release
        .release()
        .to_string_lossy()
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok())
        .collect::<Vec<_>>()
        .into_iter();
    (numbers.next().unwrap(), numbers.next().unwrap()) >= (5, 17)
}

in_all_modes!(
    an_unprivileged_app_cannot_take_ztunnels_mark_and_a_net_admin_one_can,
    |f| {
        let remote = SocketAddr::new(f.remote_ip(false), PEER_PORT);
        let before = f.proxied().len();
        // CAP_NET_ADMIN marks its socket and leaves uncaptured, as under
        // Istio's rules (they exempt the mark too); so does CAP_NET_RAW on
        // Linux 5.17 and later, which container runtimes grant by default.
        assert!(echo_trying_ztunnels_mark(
            &f,
            remote,
            Privileges::Only(&[CAP_NET_ADMIN])
        ));
        let raw_marked = echo_trying_ztunnels_mark(&f, remote, Privileges::Only(&[CAP_NET_RAW]));
        assert_eq!(raw_marked, net_raw_may_mark());
        assert_eq!(f.proxied().len(), before + usize::from(!raw_marked));
        // An app without either cannot take the mark, and is captured.
        assert!(!echo_trying_ztunnels_mark(&f, remote, Privileges::Nobody));
        f.wait_proxied(15001, remote).await;
        assert_eq!(f.proxied().len(), before + 1 + usize::from(!raw_marked));
    }
);

in_all_modes!(
    ztunnels_mark_in_a_process_of_the_apps_own_is_captured_in_ebpf_mode,
    |f| {
        // A process of its own in the pod (root: CAP_NET_ADMIN and NET_RAW),
        // not ztunnel's, marks its socket 0x539 and connects out. Istio's
        // rules exempt the mark whoever set it; the eBPF mode exempts it only
        // on ztunnel's process, the ZDS peer.
        let remote = SocketAddr::new(f.remote_ip(false), PEER_PORT);
        let before = f.proxied().len();
        let script = format!(
            "import socket\n\
             s = socket.socket()\n\
             s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 0x539)\n\
             s.settimeout(10)\n\
             s.connect(('{}', {}))\n\
             s.sendall(b'ambpf')\n\
             assert s.recv(5) == b'ambpf'\n",
            remote.ip(),
            remote.port()
        );
        let out = tokio::task::block_in_place(|| {
            std::process::Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    f.pod().name(),
                    "/usr/bin/python3",
                    "-c",
                    &script,
                ])
                .output()
                .unwrap()
        });
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Where the kernel lets connect() programs ask for the process.
        let by_process = ambpf::bpf::features::ZTUNNEL_PROCESS_IN_SOCK_ADDR
            .check()
            .is_ok();
        if f.mode == RedirectMode::Ebpf && by_process {
            f.wait_proxied(15001, remote).await;
            assert_eq!(f.proxied().len(), before + 1);
        } else {
            // Istio's own exposure: the marked socket leaves uncaptured.
            assert_eq!(f.proxied().len(), before);
        }
    }
);

/// A TCP SYN from `from:40999` to `to`, as a raw socket sends it (the kernel
/// adds the IP header; the checksum covers either family's pseudo-header).
fn raw_syn(from: IpAddr, to: SocketAddr) -> [u8; 20] {
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&40999u16.to_be_bytes());
    tcp[2..4].copy_from_slice(&to.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&1u32.to_be_bytes());
    tcp[12] = 5 << 4; // header length: 5 words
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    let octets = |ip: IpAddr| match ip {
        IpAddr::V4(ip) => ip.octets().to_vec(),
        IpAddr::V6(ip) => ip.octets().to_vec(),
    };
    // The pseudo-header's protocol and TCP length are the same words in
    // both families.
    let mut sum: u32 = 6 + 20;
    for pair in octets(from)
        .chunks(2)
        .chain(octets(to.ip()).chunks(2))
        .chain(tcp.chunks(2))
    {
        sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    tcp[16..18].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    tcp
}

fn raw_tcp_socket(v6: bool) -> std::io::Result<socket2::Socket> {
    let domain = if v6 {
        socket2::Domain::IPV6
    } else {
        socket2::Domain::IPV4
    };
    socket2::Socket::new(domain, socket2::Type::RAW, Some(socket2::Protocol::TCP))
}

/// Whether `ns` receives a TCP SYN from `from` to port `port` within a
/// second and a half after `send` runs (seen by a raw socket there, before
/// any TCP processing).
fn syn_arrives(ns: &NetnsGuard, from: IpAddr, port: u16, send: impl FnOnce() + Send) -> bool {
    let v6 = from.is_ipv6();
    let sniffer = ns.run(|| raw_tcp_socket(v6)).unwrap().unwrap();
    sniffer
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    send();
    let deadline = std::time::Instant::now() + Duration::from_millis(1500);
    let mut packet = [std::mem::MaybeUninit::<u8>::uninit(); 1500];
    while std::time::Instant::now() < deadline {
        let Ok((n, sender)) = sniffer.recv_from(&mut packet) else {
            continue;
        };
        // SAFETY: recv_from initialized the first n bytes.
        let packet: Vec<u8> = packet[..n]
            .iter()
            .map(|b| unsafe { b.assume_init() })
            .collect();
        // An IPv4 raw socket reads the IP header too; an IPv6 one only
        // the TCP segment, its source in the sender's address.
        let (source, tcp) = if v6 {
            (sender.as_socket().map(|a| a.ip()), &packet[..])
        } else {
            let ihl = usize::from(packet[0] & 0x0f) * 4;
            let source = IpAddr::from([packet[12], packet[13], packet[14], packet[15]]);
            (Some(source), packet.get(ihl..).unwrap_or_default())
        };
        if tcp.len() < 14 {
            continue;
        }
        let dst_port = u16::from_be_bytes([tcp[2], tcp[3]]);
        if source == Some(from) && dst_port == port && tcp[13] & 0x02 != 0 {
            return true;
        }
    }
    false
}

in_all_modes!(
    a_raw_socket_syn_from_the_pod_does_not_leave_it_uncaptured,
    |f| {
        // CAP_NET_RAW, which container runtimes grant by default, opens a
        // raw socket. Istio's nat rules see every packet the pod sends, a
        // raw socket's included, and send its SYN to ztunnel; ambpf's
        // outbound capture is a socket hook (connect), which a raw socket
        // never calls, so its raw-socket guard drops the SYN at egress.
        // Whether the SYN arrived, and what the sender's send_to said.
        let raw_syn_from = |ns: &NetnsGuard, from: IpAddr, to: SocketAddr| {
            tokio::task::block_in_place(|| {
                let mut sent = None;
                let arrived = syn_arrives(&f.cluster.remote.ns, from, to.port(), || {
                    sent = ns
                        .run(|| {
                            drop_thread_privileges(Privileges::Only(&[CAP_NET_RAW])).unwrap();
                            let raw = raw_tcp_socket(from.is_ipv6()).unwrap();
                            // An IPv6 raw socket reads the address's port
                            // as a protocol number: 0 means the socket's own.
                            let dst = SocketAddr::new(to.ip(), 0);
                            raw.send_to(&raw_syn(from, to), &dst.into())
                                .map(drop)
                                .map_err(|e| e.raw_os_error())
                        })
                        .ok();
                });
                (arrived, sent.expect("the sender ran"))
            })
        };
        let dropped = || {
            f.bpffs.as_ref().map(|bpffs| {
                let pins = PinLayout::new(bpffs.path().join("ambpf"));
                let counters = ambpf::bpf::inspect::read_counters(&pins).unwrap();
                counters
                    .iter()
                    .find(|(name, _)| *name == "raw_tcp_dropped")
                    .unwrap()
                    .1
            })
        };
        let neighbour = &f.cluster.pods[1];
        for (family, v6) in [false, true].into_iter().enumerate() {
            let to = SocketAddr::new(f.remote_ip(v6), 9123);
            // The non-enrolled neighbour's raw SYN arrives in either mode.
            let neighbour_ip = if v6 {
                IpAddr::V6(neighbour.addrs.v6)
            } else {
                IpAddr::V4(neighbour.addrs.v4)
            };
            assert_eq!(
                raw_syn_from(&neighbour.ns, neighbour_ip, to),
                (true, Ok(())),
                "the neighbour's raw SYN (IPv6: {v6})"
            );
            assert_eq!(dropped(), f.bpffs.as_ref().map(|_| family as u64));
            let (arrived, sent) = raw_syn_from(f.pod(), f.pod_ip(v6), to);
            assert!(!arrived, "the raw SYN left the pod uncaptured (IPv6: {v6})");
            match f.mode {
                // nat OUTPUT sends it to ztunnel's 15001.
                RedirectMode::Iptables | RedirectMode::Nftables => assert_eq!(sent, Ok(())),
                // The egress drop is the sender's EPERM, and counted.
                RedirectMode::Ebpf => {
                    assert_eq!(sent, Err(Some(libc::EPERM)), "IPv6: {v6}");
                    assert_eq!(dropped(), Some(family as u64 + 1));
                }
            }
            // The pod's ordinary connections are untouched by the guard.
            let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
            assert_eq!(echo_once(f.pod(), dst, None, None), dst);
        }
    }
);

in_all_modes!(unenrolling_stops_capturing_new_connections, |f| {
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

    let netns = f.pod_netns();
    let [pod] = f.redirection.enrolled().unwrap()[..] else {
        panic!("one pod is enrolled");
    };
    assert_eq!(pod.netns_inode, netns.inode());
    assert!(f.redirection.unenroll(pod).unwrap());
    assert!(
        f.redirection.enrolled().unwrap().is_empty(),
        "an entry was left behind"
    );
    if f.mode == RedirectMode::Iptables {
        // As Istio's `DeleteInpodRules`: every chain of every table, the
        // policy routing and the probe ipset entries go.
        let node = Netns::open(f.cluster.node.name()).unwrap();
        for family in Family::ALL {
            assert!(
                f.pod_rules(family).tables_with_istio_chains().is_empty(),
                "{family}"
            );
            assert!(
                iptables::probe_set_members(&node, family)
                    .unwrap()
                    .is_empty(),
                "{family}"
            );
        }
    }
    if f.mode == RedirectMode::Nftables {
        // The same: the three tables and the probe set members go.
        let pod = &f.cluster.pods[0].ns;
        assert_eq!(nft_listing(pod, &["list", "tables"]), "");
        let sets = nft_listing(&f.cluster.node, &["list", "sets"]);
        assert!(!sets.contains("elements"), "{sets}");
    }
    if f.mode != RedirectMode::Ebpf {
        assert!(!routing::reply_routing_status(&netns).unwrap().ipv4.rule);
    }

    let survived = tokio::task::block_in_place(|| {
        [&mut out_conn, &mut in_conn].map(|conn| {
            conn.set_read_timeout(Some(PATIENCE)).unwrap();
            let mut reply = [0u8; 5];
            conn.write_all(b"still")
                .and_then(|()| conn.read_exact(&mut reply))
                .map(|()| reply)
        })
    });
    match f.mode {
        // The eBPF mode keeps its reply routing: both stay open.
        RedirectMode::Ebpf => {
            for reply in survived {
                assert_eq!(&reply.expect("open connection broke on unenrol"), b"still");
            }
        }
        // The baselines do what Istio's `DeleteInpodRules` does: the
        // NAT and the reply path of ztunnel's connections go with the
        // rules, and both connections are reset (docs/parity.md).
        RedirectMode::Iptables | RedirectMode::Nftables => {
            for reply in survived {
                let e = reply.expect_err("a connection ztunnel proxied outlived the opt-out");
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
            }
        }
    }

    // New connections go direct now.
    let before = f.proxied().len();
    echo_once(f.pod(), remote, None, None);
    echo_once(&f.cluster.remote.ns, inbound, None, None);
    assert_eq!(f.app.last_peer().unwrap().ip(), f.remote_ip(false));
    assert_eq!(f.proxied().len(), before);

    // And enrolling again captures them again.
    f.redirection.enroll(&netns, ENROLL).unwrap();
    echo_once(f.pod(), remote, None, None);
    assert!(f.proxied().len() > before);
});

in_all_modes!(
    dns_to_any_resolver_is_answered_by_ztunnels_dns_proxy_as_if_by_that_resolver,
    |f| {
        // Nothing serves DNS at the remote's address: only the capture can
        // answer there.
        let resolver = SocketAddr::new(f.remote_ip(false), 53);
        let (udp_from, udp_answer, tcp_peer, tcp_answer) = dns_from_pod(&f, resolver);
        // The app sees its answers come from the resolver it asked.
        assert_eq!(udp_from, resolver);
        assert_eq!(tcp_peer, resolver);
        let answer: IpAddr = DEFAULT_DNS_ANSWER_V4.into();
        assert_eq!(udp_answer.header.id, 0x0a17);
        assert_eq!(udp_answer.addresses(), [answer]);
        assert_eq!(tcp_answer.header.id, 0x7c90);
        assert_eq!(tcp_answer.addresses(), [answer]);

        // ztunnel's DNS proxy in pod 1 answered both.
        let queries = f.ztunnel.dns_queries();
        for (transport, name) in [
            (DnsTransport::Udp, "udp.ambpf.test"),
            (DnsTransport::Tcp, "tcp.ambpf.test"),
        ] {
            let query = queries
                .iter()
                .find(|q| q.transport == transport && q.name == name)
                .unwrap_or_else(|| panic!("no {transport:?} query for {name}: {queries:#?}"));
            assert_eq!(query.uid, POD_UID);
            assert_eq!(query.qtype, dns::TYPE_A);
            assert_eq!(query.server.port(), 15053, "{query:?}");
        }
        // TCP DNS went to the DNS proxy, not through the outbound listener.
        assert!(
            !f.proxied().iter().any(|c| c.original_dst == resolver),
            "{:#?}",
            f.proxied()
        );
    }
);

in_all_modes!(
    a_lost_address_record_is_found_by_the_state_check_and_repaired,
    |f| {
        let netns = f.pod_netns();
        let [pod] = f.redirection.enrolled().unwrap()[..] else {
            panic!("one pod is enrolled");
        };
        let known = [(pod, &netns)];
        assert_eq!(f.redirection.check(&known, CheckScope::Full), []);

        // Lose the pod's IPv4 record, as removing a stale pod with the same
        // address used to: in eBPF mode inbound connections then bypass
        // ztunnel, in iptables mode kubelet probes are captured.
        let v4 = f.pod_ip(false);
        let expected = match f.mode {
            RedirectMode::Ebpf => {
                let pins = PinLayout::new(f.bpffs.as_ref().unwrap().path().join("ambpf"));
                let data = MapData::from_pin(pins.map(maps::PODS_BY_IP)).unwrap();
                let mut by_ip: BpfHashMap<_, IpKey, PodConfig> =
                    BpfHashMap::try_from(Map::HashMap(data)).unwrap();
                by_ip.remove(&ambpf::redirect::ebpf::ip_key(v4)).unwrap();
                ViolationKind::AddressMissing
            }
            RedirectMode::Iptables => {
                let node = f.cluster.node.name();
                let deleted = std::process::Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        node,
                        "ipset",
                        "del",
                        iptables::PROBE_IPSET_V4,
                    ])
                    .arg(v4.to_string())
                    .status()
                    .unwrap();
                assert!(deleted.success());
                ViolationKind::ProbeSetMissing
            }
            RedirectMode::Nftables => {
                let element = format!(
                    "delete element inet {} {} {{ {v4} }}",
                    nftables::NAT_TABLE,
                    nftables::PROBE_SET_V4
                );
                nft_listing(&f.cluster.node, &[&element]);
                ViolationKind::ProbeSetMissing
            }
        };
        let found = f.redirection.check(&known, CheckScope::Records);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!(
            (found[0].kind, found[0].address, found[0].pod),
            (expected, Some(v4), Some(pod))
        );

        assert_eq!(f.redirection.repair(&found), []);
        assert_eq!(f.redirection.check(&known, CheckScope::Full), []);
        // Captured again: inbound through ztunnel, probes straight through.
        let before = f.proxied().len();
        let dst = SocketAddr::new(v4, APP_PORT);
        echo_once(&f.cluster.remote.ns, dst, None, None);
        f.wait_proxied(15006, dst).await;
        if f.mode != RedirectMode::Ebpf {
            let probed = f.proxied().len();
            echo_once(&f.cluster.node, dst, None, None);
            assert_eq!(
                f.app.last_peer().unwrap().ip(),
                IpAddr::from(iptables::PROBE_SNAT_V4)
            );
            assert_eq!(f.proxied().len(), probed, "a probe went through ztunnel");
        }
        assert!(f.proxied().len() > before);
    }
);

/// Istio's node agent, stopping, deletes the host's probe SNAT, whose names
/// the rule modes share (its `DeleteHostRules`, then its probe set): the
/// state check finds it missing and writes it again, members and all.
async fn host_rules_deleted_as_istios_agent_stops(mode: RedirectMode) {
    with_fixture!(mode, |f| {
        let netns = f.pod_netns();
        let [pod] = f.redirection.enrolled().unwrap()[..] else {
            panic!("one pod is enrolled");
        };
        let known = [(pod, &netns)];
        assert_eq!(f.redirection.check(&known, CheckScope::Full), []);
        let node = f.cluster.node.name();
        let in_node = |command: &str| {
            let args: Vec<&str> = command.split_whitespace().collect();
            std::process::Command::new("ip")
                .args(["netns", "exec", node])
                .args(&args)
                .output()
                .unwrap()
                .status
                .success()
        };
        match mode {
            RedirectMode::Iptables => {
                // Whichever backend the mode chose; the other finds nothing.
                for tool in [
                    "iptables-legacy",
                    "iptables-nft",
                    "ip6tables-legacy",
                    "ip6tables-nft",
                ] {
                    in_node(&format!("{tool} -t nat -D POSTROUTING -j ISTIO_POSTRT"));
                    in_node(&format!("{tool} -t nat -F ISTIO_POSTRT"));
                    in_node(&format!("{tool} -t nat -X ISTIO_POSTRT"));
                }
                for set in [iptables::PROBE_IPSET_V4, iptables::PROBE_IPSET_V6] {
                    in_node(&format!("ipset destroy {set}"));
                }
            }
            _ => {
                let table = nftables::NAT_TABLE;
                assert!(in_node(&format!("nft flush table inet {table}")));
                assert!(in_node(&format!("nft delete table inet {table}")));
            }
        }
        let found = f.redirection.check(&known, CheckScope::Full);
        assert!(
            found
                .iter()
                .any(|v| v.kind == ViolationKind::HostRulesMissing),
            "{found:#?}"
        );
        assert_eq!(f.redirection.repair(&found), []);
        assert_eq!(f.redirection.check(&known, CheckScope::Full), []);
        // The kubelet's probes go straight to the app again.
        let dst = SocketAddr::new(f.pod_ip(false), APP_PORT);
        let proxied = f.proxied().len();
        echo_once(&f.cluster.node, dst, None, None);
        assert_eq!(
            f.app.last_peer().unwrap().ip(),
            IpAddr::from(iptables::PROBE_SNAT_V4)
        );
        assert_eq!(f.proxied().len(), proxied, "a probe went through ztunnel");
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn host_rules_deleted_as_istios_agent_stops_are_written_again_iptables() {
    host_rules_deleted_as_istios_agent_stops(RedirectMode::Iptables).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn host_rules_deleted_as_istios_agent_stops_are_written_again_nftables() {
    host_rules_deleted_as_istios_agent_stops(RedirectMode::Nftables).await
}

/// A new agent replacing the steering program while inbound connections
/// keep coming: every one of them reaches ztunnel, none the app directly,
/// none is refused or dropped (the filter's program is swapped in place).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upgrading_the_steering_program_under_inbound_load_loses_no_connection() {
    with_fixture!(RedirectMode::Ebpf, |f| {
        let pins = PinLayout::new(f.bpffs.as_ref().unwrap().path().join("ambpf"));
        let netns = f.pod_netns();
        let app = SocketAddr::new(f.pod_ip(false), APP_PORT);
        let before = f
            .proxied()
            .iter()
            .filter(|c| c.listener_port == 15006)
            .count();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let client = {
            let (stop, remote) = (stop.clone(), f.cluster.remote.ns.path());
            std::thread::spawn(move || {
                let remote = Netns::open(&remote.to_string_lossy()).unwrap();
                remote
                    .run(|| {
                        let (mut made, mut failed) = (0usize, Vec::new());
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            made += 1;
                            let echoed = TcpStream::connect_timeout(&app, Duration::from_secs(2))
                                .and_then(|mut conn| {
                                    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
                                    conn.write_all(b"ambpf")?;
                                    let mut reply = [0u8; 5];
                                    conn.read_exact(&mut reply)
                                });
                            if let Err(e) = echoed {
                                failed.push(e.to_string());
                            }
                        }
                        (made, failed)
                    })
                    .unwrap()
            })
        };
        let mut programs = Vec::new();
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            // What a restarted or upgraded agent does: load, then enrol the
            // pod again, which replaces the program of its filter.
            let mut upgraded =
                ambpf::redirect::EbpfRedirection::new(Dataplane::load(pins.clone()).unwrap());
            let enrolled = upgraded.enroll_pod(&netns, true).unwrap();
            assert_eq!(enrolled.netns_inode, netns.inode());
            programs.push(ambpf::bpf::pinned_steering_program(&pins).unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (made, failed) = tokio::task::block_in_place(|| client.join().unwrap());
        assert!(
            failed.is_empty(),
            "{} of {made} connections failed: {failed:?}",
            failed.len()
        );
        assert!(made > 20, "only {made} connections were made");
        programs.dedup();
        assert_eq!(programs.len(), 5, "each upgrade pins a new program");
        // Every connection went through ztunnel's inbound listener.
        f.ztunnel
            .wait_until(
                |s| {
                    s.proxied
                        .iter()
                        .filter(|c| c.listener_port == 15006)
                        .count()
                        >= before + made
                },
                PATIENCE,
            )
            .await
            .unwrap_or_else(|_| panic!("not all {made} connections reached ztunnel"));
        // And none reached the app any other way.
        let inbound = f
            .proxied()
            .iter()
            .filter(|c| c.listener_port == 15006)
            .count();
        assert_eq!(f.app.seen.lock().unwrap().len(), inbound);
        // The pod's filter runs the last agent's program.
        let [pod] = f.redirection.enrolled().unwrap()[..] else {
            panic!("one pod is enrolled");
        };
        assert_eq!(f.redirection.check(&[(pod, &netns)], CheckScope::Full), []);
    })
}
