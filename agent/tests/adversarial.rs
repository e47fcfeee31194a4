//! Privileged: the adversarial suite, differential against Istio's rules.
//!
//! Each hostile or unusual connection attempt is sent to an enrolled pod in
//! every mode: the eBPF mode, and Istio's in-pod rules (iptables and
//! nftables modes) in the same namespaces. ztunnel is away (it speaks ZDS
//! but runs no proxies), so a captured attempt is refused (an RST, as for
//! REDIRECT to a closed 15006) and a SYN-ACK means the app itself took the
//! connection: a bypass of ztunnel. Every attempt must have the same outcome
//! in every mode, and none may be a SYN-ACK from the enrolled pod.
//!
//! The attempts are built by `testbed/scripts/syn_probe.py` (scapy): they
//! come from the off-node client, and the L2 ones (802.1Q, QinQ, link-local)
//! from the node, the pod's L2 neighbour. Controls prove the prober sees
//! what it must: the same shapes to the neighbour pod, which is not
//! enrolled, are answered by its app with a SYN-ACK in every mode.
//!
//! Beside them, real connections: NodePort traffic the node DNATs and
//! MASQUERADEs (as kube-proxy for `externalTrafficPolicy: Cluster`), from
//! outside the node and from another pod; and a SYN-cookie handshake
//! (`tcp_syncookies=2`) that must reach ztunnel.

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::{IpAddr, SocketAddr, TcpStream},
    process::{Command, Stdio},
    time::Duration,
};

use ambpf::redirect::RedirectMode;
use ambpf_testbed::{CgroupGuard, NetnsGuard};
use serde_json::{Value, json};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

const PROBER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testbed/scripts/syn_probe.py"
);
/// Debian's python3, which has python3-scapy (not whichever is first on PATH).
const PYTHON: &str = "/usr/bin/python3";
const NODE_PORT: u16 = 30080;
const MODES: [RedirectMode; 3] = [
    RedirectMode::Ebpf,
    RedirectMode::Iptables,
    RedirectMode::Nftables,
];

/// Probe id to outcome (see the prober's doc).
type Outcomes = BTreeMap<String, String>;

/// Runs the prober in `ns` with `spec`; its outcomes.
fn probe(ns: &NetnsGuard, spec: &Value) -> Outcomes {
    tokio::task::block_in_place(|| {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns.name(), PYTHON, PROBER])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running the prober (python3-scapy)");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(spec.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "prober failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    })
}

/// Hand-picked shapes to `dst` (an address of the target pod) from `src`,
/// each id prefixed with `tag`; sports from `first_sport` on.
fn shapes(tag: &str, src: IpAddr, dst: IpAddr, first_sport: u16) -> Vec<Value> {
    let mut out = Vec::new();
    let mut add = |name: &str, extra: Value| {
        let mut probe = json!({
            "id": format!("{tag} {name}"),
            "sport": first_sport + out.len() as u16,
            "src": src.to_string(),
            "dst": dst.to_string(),
            "dport": APP_PORT,
        });
        for (k, v) in extra.as_object().unwrap() {
            probe[k] = v.clone();
        }
        out.push(probe);
    };
    add("plain SYN", json!({"shape": "plain"}));
    add("SYN with data", json!({"shape": "plain", "payload": 100}));
    add("SYN+FIN", json!({"shape": "plain", "flags": "SF"}));
    add("SYN+ECE+CWR", json!({"shape": "plain", "flags": "SEC"}));
    add(
        "SYN, every option",
        json!({"shape": "plain", "options": ["mss", "wscale", "sack", "ts", "nop"]}),
    );
    add("SYN to 15001", json!({"shape": "plain", "dport": 15001}));
    add("SYN to 15006", json!({"shape": "plain", "dport": 15006}));
    if dst.is_ipv4() {
        add("tiny first fragment", json!({"shape": "frag-tiny"}));
        add("fragments out of order", json!({"shape": "frag-reverse"}));
        add(
            "16-byte fragments",
            json!({"shape": "frag-sized", "fragsize": 16}),
        );
        add(
            "overlapping fragments rewriting the port to 15008",
            json!({"shape": "frag-overlap", "overlap_dport": 15008}),
        );
        add("IP options", json!({"shape": "plain", "ip_options": true}));
    } else {
        add("atomic Fragment header", json!({"shape": "frag-atomic"}));
        add("8-byte fragments", json!({"shape": "frag6-small"}));
        add(
            "8-byte fragments out of order",
            json!({"shape": "frag6-small", "reverse": true}),
        );
        add(
            "4 extension headers",
            json!({"shape": "ext-chain", "chain": ["hbh", "dst", "rt", "dst"]}),
        );
        add(
            "8 destination-options headers",
            json!({"shape": "ext-chain", "chain": ["dst", "dst", "dst", "dst", "dst", "dst", "dst", "dst"]}),
        );
    }
    add("SCTP INIT", json!({"shape": "sctp"}));
    out
}

/// Shapes an L2 neighbour (the node, on pod `i`'s link) sends to it.
fn l2_shapes(f: &Fixture, i: usize, first_sport: u16) -> Value {
    let (device, node_mac, pod_mac, pod_ll, node_ll) = f.cluster.pod_link(i).unwrap();
    let pod = &f.cluster.pods[i];
    let gw_v4 = f.cluster.node_addresses()[2 + 2 * i];
    let mut probes = Vec::new();
    let mut add = |name: &str, src: IpAddr, dst: IpAddr, shape: &str, vlan: u16| {
        probes.push(json!({
            "id": format!("pod {} from its L2 neighbour: {name}", i + 1),
            "sport": first_sport + probes.len() as u16,
            "src": src.to_string(),
            "dst": dst.to_string(),
            "dport": APP_PORT,
            "shape": shape,
            "vlan": vlan,
        }));
    };
    add("untagged frame", gw_v4, pod.addrs.v4.into(), "l2-plain", 0);
    add(
        "802.1Q frame, VLAN 0",
        gw_v4,
        pod.addrs.v4.into(),
        "l2-vlan",
        0,
    );
    add(
        "802.1Q frame, VLAN 7",
        gw_v4,
        pod.addrs.v4.into(),
        "l2-vlan",
        7,
    );
    add("QinQ frame", gw_v4, pod.addrs.v4.into(), "l2-qinq", 7);
    add(
        "to its IPv6 link-local address",
        node_ll.into(),
        pod_ll.into(),
        "l2-plain",
        0,
    );
    json!({
        "iface": device,
        "src_mac": node_mac,
        "dst_mac": pod_mac,
        "probes": probes,
    })
}

/// A TCP connection from `ns` to `to`: whether it was established
/// ("connected"), refused ("refused"), or neither in time ("timeout").
fn connect(ns: &NetnsGuard, to: SocketAddr) -> &'static str {
    tokio::task::block_in_place(|| {
        ns.run(
            || match TcpStream::connect_timeout(&to, Duration::from_secs(3)) {
                Ok(_) => "connected",
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => "refused",
                Err(_) => "timeout",
            },
        )
        .unwrap()
    })
}

/// The node DNATs `NODE_PORT` on each of its addresses to pod 1's app and
/// masquerades it, as kube-proxy does for a NodePort Service with
/// `externalTrafficPolicy: Cluster`.
fn node_port_to_pod_1(f: &Fixture) {
    let pod = &f.cluster.pods[0];
    for (tool, addr) in [
        ("iptables", IpAddr::from(pod.addrs.v4)),
        ("ip6tables", IpAddr::from(pod.addrs.v6)),
    ] {
        let to = match addr {
            IpAddr::V4(a) => format!("{a}:{APP_PORT}"),
            IpAddr::V6(a) => format!("[{a}]:{APP_PORT}"),
        };
        let port = NODE_PORT.to_string();
        let app = APP_PORT.to_string();
        let addr = addr.to_string();
        for rule in [
            vec![
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-p",
                "tcp",
                "--dport",
                &port,
            ],
            vec!["-t", "nat", "-A", "POSTROUTING", "-p", "tcp", "-d", &addr],
        ] {
            let mut args = vec!["netns", "exec", f.cluster.node.name(), tool];
            args.extend(rule.iter().copied());
            if rule.contains(&"PREROUTING") {
                args.extend(["-j", "DNAT", "--to-destination", &to]);
            } else {
                args.extend(["--dport", &app, "-j", "MASQUERADE"]);
            }
            let status = Command::new("ip").args(&args).status().unwrap();
            assert!(status.success(), "ip {args:?}");
        }
    }
}

/// What the hand-picked attempts, the NodePort connections and a SYN-cookie
/// handshake give in `mode`.
async fn observe(mode: RedirectMode) -> Outcomes {
    with_fixture!(mode, |f| {
        let mut out = Outcomes::new();
        // A SYN cookie's ACK finds its listener by lookup, as a SYN does.
        f.pod().sysctl("net.ipv4.tcp_syncookies=2").unwrap();
        let app = SocketAddr::new(f.pod_ip(false), APP_PORT);
        let before = f.proxied().len();
        let cookie = connect(&f.cluster.remote.ns, app);
        let proxied = f
            .ztunnel
            .wait_until(|s| s.proxied.len() > before, PATIENCE)
            .await;
        out.insert(
            "SYN-cookie handshake".into(),
            format!("{cookie}, proxied by ztunnel: {}", proxied.is_ok()),
        );
        f.pod().sysctl("net.ipv4.tcp_syncookies=1").unwrap();

        f.stop_ztunnel_proxies().await;
        let remote = &f.cluster.remote;
        let mut probes = Vec::new();
        let mut sport = 20000;
        for (i, tag) in [(0, "pod 1"), (1, "pod 2 (not enrolled)")] {
            for v6 in [false, true] {
                let pod = &f.cluster.pods[i];
                let (src, dst): (IpAddr, IpAddr) = if v6 {
                    (remote.addrs.v6.into(), pod.addrs.v6.into())
                } else {
                    (remote.addrs.v4.into(), pod.addrs.v4.into())
                };
                let family = if v6 { "IPv6" } else { "IPv4" };
                let batch = shapes(&format!("{tag} {family}"), src, dst, sport);
                sport += batch.len() as u16;
                probes.extend(batch);
            }
        }
        out.extend(probe(
            &remote.ns,
            &json!({"iface": "eth0", "probes": probes}),
        ));
        for i in [0, 1] {
            out.extend(probe(
                &f.cluster.node,
                &l2_shapes(&f, i, 30000 + 100 * i as u16),
            ));
        }

        node_port_to_pod_1(&f);
        let node_v4 = f.cluster.node_addresses()[0];
        let node_v6 = f.cluster.node_addresses()[1];
        for (name, ns, to) in [
            ("NodePort from off the node, IPv4", &remote.ns, node_v4),
            ("NodePort from off the node, IPv6", &remote.ns, node_v6),
            ("NodePort from pod 2, IPv4", &f.cluster.pods[1].ns, node_v4),
        ] {
            out.insert(
                name.into(),
                connect(ns, SocketAddr::new(to, NODE_PORT)).into(),
            );
        }
        out
    })
}

/// Outcomes that prove the suite can see a bypass and a capture: the
/// neighbour pod's app answers, the enrolled pod's capture refuses.
const CONTROLS: &[(&str, &str)] = &[
    ("pod 2 (not enrolled) IPv4 plain SYN", "syn-ack"),
    ("pod 2 (not enrolled) IPv4 tiny first fragment", "syn-ack"),
    ("pod 2 (not enrolled) IPv6 plain SYN", "syn-ack"),
    ("pod 2 (not enrolled) IPv6 8-byte fragments", "syn-ack"),
    ("pod 2 from its L2 neighbour: untagged frame", "syn-ack"),
    ("pod 1 IPv4 plain SYN", "rst"),
    ("pod 1 IPv6 plain SYN", "rst"),
    (
        "SYN-cookie handshake",
        "connected, proxied by ztunnel: true",
    ),
    ("NodePort from off the node, IPv4", "refused"),
];

/// Outcomes that differ from the iptables mode's on purpose, with ztunnel
/// away: `(probe id, the eBPF mode's outcome)`. A SYN+FIN is one segment
/// TCP discards in a listener: conntrack calls it invalid, so Istio's nat
/// rule never redirects it and the app's listener discards it (nothing
/// comes back); the eBPF mode's lookup assigns it to ztunnel's listener,
/// which discards it too, and with no listener refuses it (an RST). No
/// connection either way.
const EBPF_DIFFERENCES: &[(&str, &str)] =
    &[("pod 1 IPv4 SYN+FIN", "rst"), ("pod 1 IPv6 SYN+FIN", "rst")];

/// Whether an outcome is a connection the enrolled pod's app took by itself.
fn is_bypass(id: &str, outcome: &str) -> bool {
    let to_pod_1 = id.starts_with("pod 1") || id.starts_with("NodePort");
    to_pod_1 && (outcome == "syn-ack" || outcome == "connected")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_shapes_and_masqueraded_node_traffic_are_captured_in_every_mode_alike() {
    let mut observed: Vec<(RedirectMode, Outcomes)> = Vec::new();
    for mode in MODES {
        observed.push((mode, observe(mode).await));
    }
    let reference = observed
        .iter()
        .find(|(m, _)| *m == RedirectMode::Iptables)
        .map(|(_, o)| o.clone())
        .unwrap();
    let reference = &reference;
    let mut failures = Vec::new();
    for (mode, outcomes) in &observed {
        for (id, outcome) in outcomes {
            if is_bypass(id, outcome) {
                failures.push(format!(
                    "{mode:?}: {id}: {outcome}: the app took it without ztunnel"
                ));
            }
            let differs_on_purpose = *mode == RedirectMode::Ebpf
                && EBPF_DIFFERENCES.contains(&(id.as_str(), outcome.as_str()));
            if reference.get(id) != Some(outcome) && !differs_on_purpose {
                failures.push(format!(
                    "{mode:?}: {id}: {outcome}, where Istio's rules (iptables mode) give {:?}",
                    reference.get(id)
                ));
            }
        }
        for (id, expected) in CONTROLS {
            if outcomes.get(*id).map(String::as_str) != Some(expected) {
                failures.push(format!(
                    "{mode:?}: control {id}: {:?}, expected {expected}",
                    outcomes.get(*id)
                ));
            }
        }
    }
    for (id, outcome) in reference {
        eprintln!("{id}: {outcome}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The port of pod 1's second app, whose listener advertises
/// [`MARKED_APP_MSS`]: a SYN-ACK with it is the app's, any other ztunnel's.
const MARKED_APP_PORT: u16 = 8081;
const MARKED_APP_MSS: u32 = 1111;

/// A listener in `ns` on `[::]:port` that advertises `mss`, accepting
/// nothing (the prober never completes a handshake).
fn marked_listener(ns: &NetnsGuard, port: u16, mss: u32) -> std::net::TcpListener {
    ns.run(|| {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None).unwrap();
        socket.set_only_v6(false).unwrap();
        socket.set_reuse_address(true).unwrap();
        socket.set_tcp_mss(mss).unwrap();
        let any: SocketAddr = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), port);
        socket.bind(&any.into()).unwrap();
        socket.listen(4096).unwrap();
        socket.into()
    })
    .unwrap()
}

/// Random mutations of SYNs (flags, options, payloads, TTLs, IPv4 options
/// and fragmentation, IPv6 extension-header chains and fragments) to pod 1,
/// `AMBPF_ADVERSARIAL_CASES` of them (2,000 by default) from the seed
/// `AMBPF_ADVERSARIAL_SEED` (random by default, printed), with ztunnel
/// serving the pod: the same outcome in every mode, and never a SYN-ACK from
/// the app's own listener (told apart by the MSS it advertises). ICMP
/// errors (TTL expiry on the node, rate-limited by the kernel) count as no
/// answer.
///
/// One difference is on purpose: a segment that opens nothing (no SYN, or a
/// SYN with FIN; no ACK) to a port with no listener. Istio's conntrack leaves it
/// un-NATed and the kernel refuses it (an RST); the eBPF mode's lookup
/// hands it to ztunnel's listener, which drops it (nothing). Neither gives
/// a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_syn_mutations_have_the_same_outcome_as_under_istios_rules() {
    let count: u32 = std::env::var("AMBPF_ADVERSARIAL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("AMBPF_ADVERSARIAL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        });
    eprintln!("AMBPF_ADVERSARIAL_SEED={seed} AMBPF_ADVERSARIAL_CASES={count}");
    let mut observed: Vec<(RedirectMode, Outcomes)> = Vec::new();
    for mode in MODES {
        let outcomes = with_fixture!(mode, |f| {
            let _app = marked_listener(f.pod(), MARKED_APP_PORT, MARKED_APP_MSS);
            // The control: the app's SYN-ACK is recognised, from pod 2.
            let _neighbour =
                marked_listener(&f.cluster.pods[1].ns, MARKED_APP_PORT, MARKED_APP_MSS);
            let remote = f.cluster.remote.addrs;
            let pod = f.cluster.pods[0].addrs;
            let neighbour = f.cluster.pods[1].addrs;
            let control = probe(
                &f.cluster.remote.ns,
                &json!({
                    "iface": "eth0",
                    "app_mss": MARKED_APP_MSS,
                    "probes": [
                        {"id": "to pod 2", "sport": 9000, "src": remote.v4.to_string(),
                         "dst": neighbour.v4.to_string(), "dport": MARKED_APP_PORT, "shape": "plain"},
                        {"id": "to pod 1", "sport": 9001, "src": remote.v4.to_string(),
                         "dst": pod.v4.to_string(), "dport": MARKED_APP_PORT, "shape": "plain"},
                    ],
                }),
            );
            assert_eq!(control["to pod 2"], "syn-ack from the app", "{mode:?}");
            assert_eq!(
                control["to pod 1"], "syn-ack",
                "{mode:?}: ztunnel's SYN-ACK"
            );
            let ports = [MARKED_APP_PORT, 15001, 15006, 15008, 15053, 1];
            probe(
                &f.cluster.remote.ns,
                &json!({
                    "iface": "eth0",
                    "wait_secs": 3,
                    "app_mss": MARKED_APP_MSS,
                    "random": {
                        "seed": seed,
                        "count": count,
                        "first_sport": 10000,
                        "v4": {"src": remote.v4.to_string(), "dst": pod.v4.to_string(), "ports": ports},
                        "v6": {"src": remote.v6.to_string(), "dst": pod.v6.to_string(), "ports": ports},
                    },
                }),
            )
        });
        let outcomes = outcomes
            .into_iter()
            .map(|(id, o)| (id, if o == "icmp" { "none".to_owned() } else { o }))
            .collect();
        observed.push((mode, outcomes));
    }
    let reference = observed
        .iter()
        .find(|(m, _)| *m == RedirectMode::Iptables)
        .map(|(_, o)| o.clone())
        .unwrap();
    assert_eq!(reference.len(), count as usize);
    // The prober saw answers: many SYNs reach ztunnel.
    let answered = reference.values().filter(|o| *o == "syn-ack").count();
    assert!(
        answered > count as usize / 10,
        "only {answered} SYN-ACKs in {count}"
    );
    let mut failures = Vec::new();
    for (mode, outcomes) in &observed {
        for (id, outcome) in outcomes {
            if outcome == "syn-ack from the app" {
                failures.push(format!("{mode:?}: {id}: the app took it without ztunnel"));
            }
            let flags = id.rsplit(' ').next().unwrap_or_default();
            // What a listener discards: neither a SYN (without FIN) nor an
            // ACK nor an RST.
            let syn = flags.contains('S') && !flags.contains('F');
            let opens_nothing = !syn && !flags.contains(['A', 'R']);
            let differs_on_purpose = *mode == RedirectMode::Ebpf
                && opens_nothing
                && outcome == "none"
                && reference.get(id).map(String::as_str) == Some("rst");
            if reference.get(id) != Some(outcome) && !differs_on_purpose {
                failures.push(format!(
                    "{mode:?}: {id}: {outcome}, iptables mode {:?}",
                    reference.get(id)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "seed {seed}: {} differences in {count} cases:\n{}",
        failures.len(),
        failures
            .iter()
            .take(50)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
