//! Privileged: every redirection mode on pods whose `eth0` is each kind of
//! link CNI plugins make: veth, netkit (L3 and L2, Cilium 1.16 on), ipvlan
//! (L2 and L3) and macvlan (bridge), the last three as Multus makes
//! secondary interfaces: a child of a node device, the node talking to the
//! pod through a child of its own (testbed `cluster::PodLinkKind`).
//!
//! For each kind and mode, with the ztunnel double serving the pod:
//! outbound TCP reaches ztunnel's 15001 with the original destination,
//! inbound TCP reaches its 15006 with the original destination as the local
//! address, a probe from the node's address reaches the app uncaptured, DNS
//! is answered by ztunnel's DNS proxy, and in eBPF mode the state check
//! finds a removed sk_lookup link and the repair puts it back.
//!
//! Nothing of the eBPF mode hangs on a pod's interfaces, so a pod with an
//! interface whose frames carry no Ethernet header (a tun device, an ipip
//! tunnel), which the TC steering of earlier agents refused, is enrolled and
//! captured like any other.
//!
//! A kind this kernel cannot make (no netkit, no ipvlan) is skipped, with
//! the kernel's answer printed: found by trying to make it.

use std::net::{IpAddr, SocketAddr};

use ambpf::{
    bpf::{InboundAssign, PinLayout},
    redirect::{CheckScope, RedirectMode, ViolationKind, link_kind, rtnl::Rtnl},
};
use ambpf_testbed::{
    CgroupGuard, NetnsGuard,
    cluster::{Cluster, PodLinkKind},
    ztunnel::{ConnectionOutcome, DEFAULT_DNS_ANSWER_V4, DnsTransport},
};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

/// `<kind>::{ebpf, iptables, nftables}`: [`capture_on`] for one kind.
macro_rules! for_every_mode {
    ($name:ident, $kind:expr) => {
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn ebpf() {
                capture_on($kind, RedirectMode::Ebpf).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn iptables() {
                capture_on($kind, RedirectMode::Iptables).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn nftables() {
                capture_on($kind, RedirectMode::Nftables).await
            }
        }
    };
}

for_every_mode!(veth, PodLinkKind::Veth);
for_every_mode!(netkit_l3, PodLinkKind::NetkitL3);
for_every_mode!(netkit_l2, PodLinkKind::NetkitL2);
for_every_mode!(ipvlan_l2, PodLinkKind::IpvlanL2);
for_every_mode!(ipvlan_l3, PodLinkKind::IpvlanL3);
for_every_mode!(macvlan, PodLinkKind::Macvlan);

async fn capture_on(kind: PodLinkKind, mode: RedirectMode) {
    let _serial = modes::SERIAL.lock().await;
    let cluster = match Cluster::create_with_first_pod(2, kind) {
        Err(e) if e.kind() == std::io::ErrorKind::Unsupported => {
            eprintln!("skipped: {kind} in {mode:?} mode: {e}");
            return;
        }
        made => made.unwrap_or_else(|e| panic!("a pod with a {kind} eth0: {e}")),
    };
    let cgroup = (mode == RedirectMode::Ebpf).then(|| CgroupGuard::create().unwrap());
    let _inside = cgroup.as_ref().map(|c| c.enter_process().unwrap());
    let f = fixture_in(
        cluster,
        mode,
        cgroup.as_ref(),
        InboundAssign::from_env().unwrap(),
    )
    .await;
    let case = format!("{kind} in {mode:?} mode");
    interface_named(&f, kind, &case);
    outbound(&f, &case).await;
    inbound(&f, &case).await;
    // From the node's own address on the pod's link (the gateway), straight
    // to the app.
    assert_eq!(
        f.probe_from_node(false, &case),
        f.probe_source_v4(),
        "{case}"
    );
    dns_capture(&f, &case);
    if mode == RedirectMode::Ebpf {
        inbound_link_repaired(f, &case).await;
    }
}

/// The agent names the pod's `eth0` by its kind and mode, and finds that
/// its frames carry an Ethernet header (what the eBPF mode's steering reads).
fn interface_named(f: &Fixture, kind: PodLinkKind, case: &str) {
    let ifindex = f.pod().ifindex("eth0").unwrap();
    let found = f
        .pod()
        .run(|| link_kind::of(&mut Rtnl::open().unwrap(), ifindex).unwrap())
        .unwrap();
    let expected = match kind {
        PodLinkKind::Veth => "veth",
        PodLinkKind::NetkitL3 => "netkit (mode l3)",
        PodLinkKind::NetkitL2 => "netkit (mode l2)",
        PodLinkKind::IpvlanL2 => "ipvlan (mode l2)",
        PodLinkKind::IpvlanL3 => "ipvlan (mode l3)",
        PodLinkKind::Macvlan => "macvlan (mode bridge)",
    };
    assert_eq!(found.to_string(), expected, "{case}");
    eprintln!("{case}: eth0 is {found}, link type {:?}", found.link_layer);
}

async fn outbound(f: &Fixture, case: &str) {
    for v6 in [false, true] {
        let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
        assert_eq!(echo_once(f.pod(), dst, None, None), dst, "{case}");
        let conn = f.wait_proxied(15001, dst).await;
        assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{case}: {conn:?}");
        let server = if v6 { &f.remote_v6 } else { &f.remote_v4 };
        assert_eq!(
            server.last_peer().unwrap().ip(),
            f.pod_ip(v6),
            "{case}: ztunnel's connection left from the pod's address"
        );
    }
}

async fn inbound(f: &Fixture, case: &str) {
    for v6 in [false, true] {
        let dst = SocketAddr::new(f.pod_ip(v6), APP_PORT);
        echo_once(&f.cluster.remote.ns, dst, None, None);
        // The SYN reached 15006 with the original destination as its
        // local address.
        let conn = f.wait_proxied(15006, dst).await;
        assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{case}: {conn:?}");
        assert_eq!(conn.client.ip(), f.remote_ip(v6), "{case}");
        assert_eq!(f.app.last_peer().unwrap().ip(), f.remote_ip(v6), "{case}");
    }
}

/// A query over UDP and one over TCP to a resolver nobody serves, answered
/// by ztunnel's DNS proxy in the pod.
fn dns_capture(f: &Fixture, case: &str) {
    let resolver = SocketAddr::new(f.remote_ip(false), 53);
    let (udp_from, udp_answer, tcp_peer, tcp_answer) = dns_from_pod(f, resolver);
    assert_eq!((udp_from, tcp_peer), (resolver, resolver), "{case}");
    let answer: IpAddr = DEFAULT_DNS_ANSWER_V4.into();
    assert_eq!(udp_answer.addresses(), [answer], "{case}");
    assert_eq!(tcp_answer.addresses(), [answer], "{case}");
    let queries = f.ztunnel.dns_queries();
    for transport in [DnsTransport::Udp, DnsTransport::Tcp] {
        let query = queries
            .iter()
            .find(|q| q.transport == transport)
            .unwrap_or_else(|| panic!("{case}: no {transport:?} query: {queries:#?}"));
        assert_eq!(query.uid, POD_UID, "{case}");
        assert_eq!(query.server.port(), 15053, "{case}: {query:?}");
    }
}

/// The pod's sk_lookup link unpinned (detached): the check finds it, the
/// repair re-enrols the pod, and inbound is captured again.
async fn inbound_link_repaired(mut f: Fixture, case: &str) {
    let netns = f.pod_netns();
    let [pod] = f.redirection.enrolled().unwrap()[..] else {
        panic!("{case}: one pod is enrolled");
    };
    let known = [(pod, &netns)];
    assert_eq!(f.redirection.check(&known, CheckScope::Full), [], "{case}");
    let pins = PinLayout::new(f.bpffs.as_ref().unwrap().path().join("ambpf"));
    std::fs::remove_dir_all(pins.pod_links_dir(pod.netns_cookie)).unwrap();
    let found = f.redirection.check(&known, CheckScope::Full);
    assert_eq!(found.len(), 1, "{case}: {found:#?}");
    assert_eq!(found[0].kind, ViolationKind::SteeringMissing, "{case}");
    assert!(
        found[0].to_string().contains("no sk_lookup link"),
        "{case}: {}",
        found[0]
    );
    for again in f.redirection.repair(&found) {
        assert_eq!(again, pod, "{case}");
        f.redirection.enroll(&netns, ENROLL).unwrap();
    }
    assert_eq!(f.redirection.check(&known, CheckScope::Full), [], "{case}");
    let dst = SocketAddr::new(f.pod_ip(false), APP_PORT);
    f.ztunnel.take_proxied();
    echo_once(&f.cluster.remote.ns, dst, None, None);
    f.wait_proxied(15006, dst).await;
}

/// A pod with an interface whose frames carry no Ethernet header (a tun
/// device or an ipip tunnel here), up, is enrolled, passes the state check
/// and is captured: inbound capture does not read frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_with_an_interface_without_ethernet_headers_is_enrolled_and_captured() {
    let _serial = modes::SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let mut f = fixture(RedirectMode::Ebpf, Some(&cgroup)).await;
    let netns = f.pod_netns();
    let Some((iface, kind)) = interface_without_ethernet_headers(f.pod()) else {
        eprintln!("skipped: this kernel makes neither a tun device nor an ipip tunnel");
        return;
    };
    eprintln!("{iface} ({kind}) up in the pod");
    // Enrolled again with it (as after an agent restart): no refusal.
    f.redirection
        .enroll(&netns, ENROLL)
        .unwrap_or_else(|e| panic!("with {iface} ({kind}): {e}"));
    let [pod] = f.redirection.enrolled().unwrap()[..] else {
        panic!("one pod is enrolled");
    };
    assert_eq!(f.redirection.check(&[(pod, &netns)], CheckScope::Full), []);
    let dst = SocketAddr::new(f.pod_ip(false), APP_PORT);
    f.ztunnel.take_proxied();
    echo_once(&f.cluster.remote.ns, dst, None, None);
    f.wait_proxied(15006, dst).await;
}

/// A tun device in `ns`, or where the kernel has no /dev/net/tun, an ipip
/// tunnel; loading the ipip module adds its fallback `tunl0`, down, to
/// every namespace (which must keep no pod out: the other tests), so an
/// ipip device is one or the other. Up, as a device in use is. Returns its
/// name and kind, or `None` where the kernel makes neither.
fn interface_without_ethernet_headers(ns: &NetnsGuard) -> Option<(&'static str, &'static str)> {
    let (_, iface, kind) = [
        ("tuntap add dev tun0 mode tun", "tun0", "tun"),
        ("link add ipip0 type ipip", "ipip0", "ipip"),
        ("link show tunl0", "tunl0", "ipip"),
    ]
    .into_iter()
    .find(|(command, _, _)| try_in(ns, "ip", command).is_ok())?;
    ip(ns, &format!("link set {iface} up"));
    Some((iface, kind))
}

fn ip(ns: &NetnsGuard, args: &str) -> String {
    run_in(ns, "ip", args)
}

fn run_in(ns: &NetnsGuard, program: &str, args: &str) -> String {
    try_in(ns, program, args).unwrap_or_else(|e| panic!("{e}"))
}

/// `program args` inside `ns`: its output, or its error output.
fn try_in(ns: &NetnsGuard, program: &str, args: &str) -> Result<String, String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), program])
        .args(args.split_whitespace())
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(format!(
            "{program} {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
