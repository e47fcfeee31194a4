use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    process::Command,
    time::Duration,
};

use ambpf_testbed::{NetnsGuard, PodAndNode};
use socket2::{Domain, SockRef, Socket, Type};

use super::*;

fn open(guard: &NetnsGuard) -> Netns {
    Netns::open(guard.path().to_str().unwrap()).unwrap()
}

/// The reply rules and table-100 routes in `ns`, read with a dump of our
/// own, per family: (rules, routes).
fn dump_reply_routing(ns: &NetnsGuard, family: IpFamily) -> (usize, Vec<RouteMessage>) {
    ns.run(|| {
        let mut rtnl = Rtnl::open().unwrap();
        let mut query = RuleMessage::default();
        query.header.family = family.address_family();
        let rules = rtnl
            .dump(RouteNetlinkMessage::GetRule(query))
            .unwrap()
            .into_iter()
            .filter(|msg| matches!(msg, RouteNetlinkMessage::NewRule(rule) if rule.attributes.contains(&RuleAttribute::FwMark(REPLY_MARK))))
            .count();
        let mut query = RouteMessage::default();
        query.header.address_family = family.address_family();
        let routes = rtnl
            .dump(RouteNetlinkMessage::GetRoute(query))
            .unwrap()
            .into_iter()
            .filter_map(|msg| match msg {
                RouteNetlinkMessage::NewRoute(route)
                    if route.attributes.contains(&RouteAttribute::Table(REPLY_ROUTE_TABLE)) =>
                {
                    Some(route)
                }
                _ => None,
            })
            .collect();
        (rules, routes)
    })
    .unwrap()
}

/// A `net.*` sysctl of `ns`, `below_net` as `TCP_FWMARK_ACCEPT` names it.
fn sysctl(ns: &NetnsGuard, below_net: &str) -> String {
    ns.run(|| {
        fs::read_to_string(Path::new("/proc/sys/net").join(below_net))
            .unwrap()
            .trim()
            .to_owned()
    })
    .unwrap()
}

/// `ip -n <ns> <args>` output: a second opinion on what netlink says.
fn ip_show(ns: &NetnsGuard, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["-n", ns.name()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "ip {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn install_is_idempotent_and_visible_in_the_kernel_tables() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    assert!(!reply_routing_installed(&pod).unwrap());

    install_reply_routing(&pod).unwrap();
    install_reply_routing(&pod).unwrap();
    assert!(reply_routing_installed(&pod).unwrap());
    let status = reply_routing_status(&pod).unwrap();
    assert_eq!(
        status.ipv6,
        Some(FamilyStatus {
            rule: true,
            route: true
        })
    );

    for family in [IpFamily::V4, IpFamily::V6] {
        let (rules, routes) = dump_reply_routing(&pn.pod, family);
        assert_eq!(rules, 1, "{family}: one rule after two installs");
        assert_eq!(routes.len(), 1, "{family}: {routes:?}");
        let route = &routes[0];
        assert_eq!(route.header.kind, RouteType::Local);
        assert_eq!(route.header.destination_prefix_length, 0);
        assert!(
            route.attributes.contains(&RouteAttribute::Oif(1)),
            "{route:?}"
        );
    }
    for v in ["-4", "-6"] {
        let rules = ip_show(&pn.pod, &[v, "rule", "show"]);
        assert!(
            rules.contains("32764:\tfrom all fwmark 0x111/0xfff lookup 100"),
            "{rules}"
        );
        let routes = ip_show(&pn.pod, &[v, "route", "show", "table", "100"]);
        // Istio's route, as `ip route` prints it: no `proto` (boot).
        let istios = match v {
            "-4" => "local default dev lo scope host",
            _ => "local default dev lo metric 1024 pref medium",
        };
        let routes: Vec<&str> = routes.lines().map(str::trim_end).collect();
        assert_eq!(routes, [istios]);
    }
    assert_eq!(sysctl(&pn.pod, TCP_FWMARK_ACCEPT), "1");
    // Per namespace: the node next door is untouched.
    assert_eq!(sysctl(&pn.node, TCP_FWMARK_ACCEPT), "0");
    assert!(!reply_routing_installed(&open(&pn.node)).unwrap());
}

#[test]
fn remove_is_idempotent_and_leaves_nothing() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    // Removing what was never installed is fine.
    remove_reply_routing(&pod).unwrap();

    install_reply_routing(&pod).unwrap();
    // A copy the kernel tells apart (another protocol, as another tool
    // would leave) goes too.
    pn.pod
        .ip(&[
            "rule",
            "add",
            "fwmark",
            "0x111/0xfff",
            "lookup",
            "100",
            "pref",
            "32764",
            "protocol",
            "static",
        ])
        .unwrap();
    assert_eq!(dump_reply_routing(&pn.pod, IpFamily::V4).0, 2);

    remove_reply_routing(&pod).unwrap();
    remove_reply_routing(&pod).unwrap();
    for family in [IpFamily::V4, IpFamily::V6] {
        let (rules, routes) = dump_reply_routing(&pn.pod, family);
        assert_eq!(rules, 0, "{family}");
        assert!(routes.is_empty(), "{family}: {routes:?}");
    }
    assert_eq!(sysctl(&pn.pod, TCP_FWMARK_ACCEPT), "0");
    let status = reply_routing_status(&pod).unwrap();
    let none = FamilyStatus {
        rule: false,
        route: false,
    };
    assert_eq!(
        status,
        ReplyRoutingStatus {
            ipv4: none,
            ipv6: Some(none),
            tcp_fwmark_accept: false
        }
    );
}

#[test]
fn policy_routing_alone_leaves_the_sysctl_alone() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    install_policy_routing(&pod).unwrap();
    install_policy_routing(&pod).unwrap();
    let status = reply_routing_status(&pod).unwrap();
    let both = FamilyStatus {
        rule: true,
        route: true,
    };
    assert_eq!(status.ipv4, both);
    assert_eq!(status.ipv6, Some(both));
    assert!(!status.tcp_fwmark_accept);
    for family in [IpFamily::V4, IpFamily::V6] {
        let (rules, routes) = dump_reply_routing(&pn.pod, family);
        assert_eq!((rules, routes.len()), (1, 1), "{family}");
    }

    // Removing it does not touch a sysctl someone else set.
    pn.pod.sysctl("net.ipv4.tcp_fwmark_accept=1").unwrap();
    remove_policy_routing(&pod).unwrap();
    remove_policy_routing(&pod).unwrap();
    for family in [IpFamily::V4, IpFamily::V6] {
        let (rules, routes) = dump_reply_routing(&pn.pod, family);
        assert_eq!((rules, routes.len()), (0, 0), "{family}");
    }
    assert_eq!(sysctl(&pn.pod, TCP_FWMARK_ACCEPT), "1");
}

#[test]
fn install_replaces_a_stale_default_route_in_table_100() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    pn.pod
        .ip(&["route", "add", "default", "dev", "eth0", "table", "100"])
        .unwrap();
    install_reply_routing(&pod).unwrap();
    assert!(reply_routing_installed(&pod).unwrap());
    let (_, routes) = dump_reply_routing(&pn.pod, IpFamily::V4);
    assert_eq!(routes.len(), 1, "{routes:?}");
    assert_eq!(routes[0].header.kind, RouteType::Local);
}

#[test]
fn namespace_with_only_loopback_works() {
    let ns = NetnsGuard::create("lo").unwrap();
    let netns = open(&ns);
    install_reply_routing(&netns).unwrap();
    assert!(reply_routing_installed(&netns).unwrap());
    remove_reply_routing(&netns).unwrap();
    assert!(!reply_routing_installed(&netns).unwrap());
    assert_eq!(dump_reply_routing(&ns, IpFamily::V6).0, 0);
}

#[test]
fn a_loopback_still_down_is_brought_up_first() {
    let ns = NetnsGuard::create("lodown").unwrap();
    ip_show(&ns, &["link", "set", "lo", "down"]);
    assert!(!ip_show(&ns, &["link", "show", "lo"]).contains(",UP"));
    let netns = open(&ns);
    install_reply_routing(&netns).unwrap();
    assert!(ip_show(&ns, &["link", "show", "lo"]).contains(",UP"));
    let status = reply_routing_status(&netns).unwrap();
    assert!(status.is_installed(), "{status:?}");
    assert!(status.ipv6.is_some(), "IPv6 skipped: {status:?}");
    assert_eq!(dump_reply_routing(&ns, IpFamily::V6).1.len(), 1);
    remove_reply_routing(&netns).unwrap();
}

#[test]
fn ipv6_disabled_is_skipped() {
    let ns = NetnsGuard::create("no6").unwrap();
    ns.run(|| fs::write("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1").unwrap())
        .unwrap();
    let netns = open(&ns);
    install_reply_routing(&netns).unwrap();
    let status = reply_routing_status(&netns).unwrap();
    assert_eq!(status.ipv6, None);
    assert_eq!(
        status.ipv4,
        FamilyStatus {
            rule: true,
            route: true
        }
    );
    assert!(status.is_installed());
    let (rules, routes) = dump_reply_routing(&ns, IpFamily::V6);
    assert_eq!((rules, routes.len()), (0, 0));
    remove_reply_routing(&netns).unwrap();
    assert_eq!(dump_reply_routing(&ns, IpFamily::V4).0, 0);
}

#[test]
fn ipv6_disabled_on_the_loopback_alone_is_skipped() {
    let ns = NetnsGuard::create("lo6").unwrap();
    let netns = open(&ns);
    // Installed with IPv6 first, then IPv6 disabled on `lo` only: the
    // status no longer reads IPv6, and removal still takes its rule.
    install_reply_routing(&netns).unwrap();
    ns.run(|| fs::write("/proc/sys/net/ipv6/conf/lo/disable_ipv6", "1").unwrap())
        .unwrap();
    let status = reply_routing_status(&netns).unwrap();
    assert_eq!(status.ipv6, None, "{status:?}");
    assert!(status.is_installed(), "{status:?}");
    install_reply_routing(&netns).unwrap();
    remove_reply_routing(&netns).unwrap();
    assert_eq!(dump_reply_routing(&ns, IpFamily::V6).0, 0);
    assert_eq!(dump_reply_routing(&ns, IpFamily::V4).0, 0);
}

#[test]
fn errors_say_what_failed_and_where() {
    let err = RoutingError::Netlink {
        what: format!("adding {}", rule_text(IpFamily::V4)),
        netns: "/run/netns/x".into(),
        cause: NetlinkError::Kernel {
            errno: nix::errno::Errno::EPERM,
            detail: None,
        },
    };
    assert_eq!(
        err.to_string(),
        "adding IPv4 policy rule priority 32764 fwmark 0x111/0xfff lookup 100 \
         in /run/netns/x: Operation not permitted"
    );
}

#[test]
fn kernel_refusals_carry_the_extended_ack_text() {
    // The IPv6 route on a loopback with IPv6 disabled, sent regardless.
    let ns = NetnsGuard::create("eack").unwrap();
    let err = ns
        .run(|| {
            fs::write("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1").unwrap();
            let mut rtnl = Rtnl::open().unwrap();
            let route = reply_route(IpFamily::V6, 1, false);
            rtnl.create(RouteNetlinkMessage::NewRoute(route), NLM_F_CREATE)
                .unwrap_err()
        })
        .unwrap();
    let NetlinkError::Kernel { detail, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(
        detail.as_deref(),
        Some("IPv6 is disabled on nexthop device"),
        "{err}"
    );
}

/// Addresses no interface in the pod holds, reached only by routing.
const ELSEWHERE_V4: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const ELSEWHERE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 1);
const WAIT: Duration = Duration::from_millis(500);

fn transparent_socket(addr: IpAddr, ty: Type) -> Socket {
    let socket = Socket::new(Domain::for_address(SocketAddr::new(addr, 0)), ty, None).unwrap();
    match addr {
        IpAddr::V4(_) => socket.set_ip_transparent_v4(true).unwrap(),
        IpAddr::V6(_) => socket.set_ip_transparent_v6(true).unwrap(),
    }
    socket
}

/// A pod with a default route to the node, so a reply that is not
/// delivered locally has somewhere else to go (and is lost there).
fn pod_with_default_routes() -> PodAndNode {
    let pn = PodAndNode::create().unwrap();
    let (v4, v6) = (
        PodAndNode::NODE.v4.to_string(),
        PodAndNode::NODE.v6.to_string(),
    );
    pn.pod.ip(&["route", "add", "default", "via", &v4]).unwrap();
    pn.pod
        .ip(&["-6", "route", "add", "default", "via", &v6])
        .unwrap();
    pn
}

/// Sends one datagram from a socket with `mark` to `elsewhere:port`,
/// where a transparent socket in the pod listens; says whether it arrived.
fn marked_datagram_arrives(pn: &PodAndNode, elsewhere: IpAddr, mark: u32) -> bool {
    pn.pod
        .run(|| {
            let listener = transparent_socket(elsewhere, Type::DGRAM);
            listener
                .bind(&SocketAddr::new(elsewhere, 0).into())
                .unwrap();
            listener.set_read_timeout(Some(WAIT)).unwrap();
            let to = listener.local_addr().unwrap();
            let sender = Socket::new(
                Domain::for_address(to.as_socket().unwrap()),
                Type::DGRAM,
                None,
            )
            .unwrap();
            sender.set_mark(mark).unwrap();
            sender.send_to(b"reply", &to).unwrap();
            let mut buf = [std::mem::MaybeUninit::new(0u8); 16];
            match listener.recv(&mut buf) {
                Ok(n) => n == 5,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
                Err(e) => panic!("{e}"),
            }
        })
        .unwrap()
}

#[test]
fn marked_packets_to_foreign_addresses_are_delivered_in_the_pod() {
    let pn = pod_with_default_routes();
    let pod = open(&pn.pod);
    for elsewhere in [IpAddr::V4(ELSEWHERE_V4), IpAddr::V6(ELSEWHERE_V6)] {
        assert!(
            !marked_datagram_arrives(&pn, elsewhere, REPLY_MARK),
            "{elsewhere} before"
        );
    }
    install_reply_routing(&pod).unwrap();
    for elsewhere in [IpAddr::V4(ELSEWHERE_V4), IpAddr::V6(ELSEWHERE_V6)] {
        assert!(
            marked_datagram_arrives(&pn, elsewhere, REPLY_MARK),
            "{elsewhere}"
        );
        // Only the reply mark (under its mask) is diverted.
        assert!(
            marked_datagram_arrives(&pn, elsewhere, 0xf111),
            "{elsewhere} 0xf111"
        );
        assert!(
            !marked_datagram_arrives(&pn, elsewhere, 0),
            "{elsewhere} unmarked"
        );
        assert!(
            !marked_datagram_arrives(&pn, elsewhere, 0x539),
            "{elsewhere} 0x539"
        );
    }
    remove_reply_routing(&pod).unwrap();
    for elsewhere in [IpAddr::V4(ELSEWHERE_V4), IpAddr::V6(ELSEWHERE_V6)] {
        assert!(
            !marked_datagram_arrives(&pn, elsewhere, REPLY_MARK),
            "{elsewhere} after"
        );
    }
}

/// ztunnel's inbound hop in miniature: a transparent client socket bound
/// to a foreign (client) address connects, with `mark`, to an app
/// listening on the pod's address. The SYN is local either way; the
/// SYN-ACK and the data replies are addressed to the foreign address.
/// Returns the accepted socket's mark when a request and its reply made
/// it through, `None` when the handshake did not complete.
fn spoofed_connection(pn: &PodAndNode, client: IpAddr, app: IpAddr, mark: u32) -> Option<u32> {
    pn.pod
        .run(|| {
            let listener = TcpListener::bind(SocketAddr::new(app, 0)).unwrap();
            let socket = transparent_socket(client, Type::STREAM);
            socket.set_mark(mark).unwrap();
            socket.bind(&SocketAddr::new(client, 0).into()).unwrap();
            let to = listener.local_addr().unwrap().into();
            if let Err(e) = socket.connect_timeout(&to, WAIT) {
                assert!(
                    matches!(
                        e.kind(),
                        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                    ),
                    "{e}"
                );
                return None;
            }
            let (mut accepted, peer) = listener.accept().unwrap();
            assert_eq!(peer.ip(), client);
            let mut stream = std::net::TcpStream::from(socket);
            stream.set_read_timeout(Some(WAIT)).unwrap();
            stream.write_all(b"ping").unwrap();
            let mut buf = [0; 4];
            accepted.read_exact(&mut buf).unwrap();
            accepted.write_all(b"pong").unwrap();
            stream.read_exact(&mut buf).unwrap();
            assert_eq!(&buf, b"pong");
            Some(SockRef::from(&accepted).mark().unwrap())
        })
        .unwrap()
}

#[test]
fn replies_of_a_marked_connection_reach_the_transparent_client() {
    let pn = pod_with_default_routes();
    let pod = open(&pn.pod);
    let pairs = [
        (IpAddr::V4(ELSEWHERE_V4), IpAddr::V4(PodAndNode::POD.v4)),
        (IpAddr::V6(ELSEWHERE_V6), IpAddr::V6(PodAndNode::POD.v6)),
    ];
    for (client, app) in pairs {
        assert_eq!(
            spoofed_connection(&pn, client, app, REPLY_MARK),
            None,
            "{client} before"
        );
    }
    install_reply_routing(&pod).unwrap();
    for (client, app) in pairs {
        // The accepted socket took the SYN's mark: every reply carries it.
        assert_eq!(
            spoofed_connection(&pn, client, app, REPLY_MARK),
            Some(REPLY_MARK),
            "{client}"
        );
        assert_eq!(
            spoofed_connection(&pn, client, app, 0),
            None,
            "{client} unmarked"
        );
    }
    // Rule and route alone are not enough: without tcp_fwmark_accept the
    // SYN-ACK leaves unmarked and goes out to the node.
    pn.pod
        .run(|| fs::write(Path::new("/proc/sys/net").join(TCP_FWMARK_ACCEPT), "0").unwrap())
        .unwrap();
    for (client, app) in pairs {
        assert_eq!(
            spoofed_connection(&pn, client, app, REPLY_MARK),
            None,
            "{client} sysctl 0"
        );
    }
    remove_reply_routing(&pod).unwrap();
    for (client, app) in pairs {
        assert_eq!(
            spoofed_connection(&pn, client, app, REPLY_MARK),
            None,
            "{client} after"
        );
    }
}
