//! Privileged: a live change of redirection mode, as `helm upgrade --set
//! redirectMode=...` makes it. The old mode's agent goes with its capture
//! in place, the new one enrols the pod beside it, ztunnel reconnects, and
//! the new agent's retirement ([`ambpf::redirect::retire`]) takes the old
//! capture out once the new one holds the pod, then the old mode's node
//! state. Throughout, for every pair of modes: connections opened before
//! keep working in both directions, every new connection is proxied by
//! ztunnel, kubelet's probes from the node are not, and afterwards nothing
//! of the old mode captures anything.

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use ambpf::{
    bpf::{Capacities, Dataplane, InboundAssign, PinLayout, inspect},
    netns::Netns,
    redirect::{
        EbpfRedirection, PodRedirection, RedirectMode,
        iptables::{self, IptablesBackend, IptablesRedirection},
        nftables::{self, NftablesRedirection},
        retire::{self, Fate, Retirement},
    },
};
use ambpf_testbed::{BpffsMount, CgroupGuard, cluster::Cluster, ztunnel::ZtunnelConfig};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

/// How long after accepting a connection ztunnel asks for its original
/// destination.
const ORIGINAL_DST_DELAY: Duration = Duration::from_millis(300);

/// The node's redirection in `mode`, its state under `pins` as the agent
/// keeps it (the eBPF mode's pins; the other modes' records of their pods).
fn redirection_at(
    mode: RedirectMode,
    cluster: &Cluster,
    cgroup: &CgroupGuard,
    pins: &PinLayout,
) -> (Box<dyn PodRedirection>, Option<IptablesBackend>) {
    let host = || Netns::open(cluster.node.name()).unwrap();
    match mode {
        RedirectMode::Ebpf => {
            let inbound = InboundAssign::from_env().unwrap();
            let mut dataplane =
                Dataplane::load_inbound(pins.clone(), Capacities::default(), inbound).unwrap();
            dataplane
                .serve_node(
                    cgroup.path(),
                    true,
                    &cluster.node_addresses(),
                    cluster.node_netns_cookie(),
                )
                .unwrap();
            (Box::new(EbpfRedirection::new(dataplane)), None)
        }
        RedirectMode::Iptables => {
            let redirection = IptablesRedirection::new(host(), IptablesBackend::Auto)
                .unwrap()
                .with_records(pins.iptables_pods_dir())
                .taking_over(retire::ebpf_pods(pins));
            let backend = redirection.backend();
            (Box::new(redirection), Some(backend))
        }
        RedirectMode::Nftables => (
            Box::new(
                NftablesRedirection::new(host())
                    .unwrap()
                    .with_records(pins.nftables_pods_dir())
                    .taking_over(retire::ebpf_pods(pins)),
            ),
            None,
        ),
    }
}

/// A connection held open across the switch, echoing what it is sent.
struct Held {
    what: &'static str,
    stream: TcpStream,
}

impl Held {
    fn open(what: &'static str, ns: &ambpf_testbed::NetnsGuard, to: SocketAddr) -> Self {
        let mut held = Self::begin(what, ns, to);
        held.expect_echo("opened");
        held
    }

    /// Connects and sends, without waiting for the echo.
    fn begin(what: &'static str, ns: &ambpf_testbed::NetnsGuard, to: SocketAddr) -> Self {
        let stream = tokio::task::block_in_place(|| {
            ns.run(|| TcpStream::connect_timeout(&to, PATIENCE))
                .unwrap()
                .unwrap_or_else(|e| panic!("{what}: connect {to}: {e}"))
        });
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut held = Self { what, stream };
        held.send("opened");
        held
    }

    fn exchange(&mut self, when: &str) {
        self.send(when);
        self.expect_echo(when);
    }

    fn send(&mut self, when: &str) {
        let what = self.what;
        self.stream
            .write_all(b"ambpf")
            .unwrap_or_else(|e| panic!("{what}, {when}: {e}"));
    }

    fn expect_echo(&mut self, when: &str) {
        let what = self.what;
        tokio::task::block_in_place(|| {
            let mut reply = [0u8; 5];
            self.stream
                .read_exact(&mut reply)
                .unwrap_or_else(|e| panic!("{what}, {when}: {e}"));
            assert_eq!(&reply, b"ambpf", "{what}, {when}");
        });
    }
}

/// A new connection from the app out to the remote, and one from the remote
/// in to the app, each proxied by ztunnel; a connection from the node to
/// the app (a probe) is not.
async fn new_connections_are_captured(f: &Fixture, when: &str) {
    eprintln!("checking new connections {when}");
    let before = f.proxied().len();
    let remote = SocketAddr::new(f.remote_ip(false), PEER_PORT);
    outbound_as_app(f, remote, AppBind::None, false);
    let app = SocketAddr::new(f.pod_ip(false), APP_PORT);
    echo_once(&f.cluster.remote.ns, app, None, None);
    let proxied = |port: u16, dst: SocketAddr| {
        move |s: &ambpf_testbed::ztunnel::ZtunnelState| {
            s.proxied[before..]
                .iter()
                .any(|c| c.listener_port == port && c.original_dst == dst)
        }
    };
    for (port, dst) in [(15001, remote), (15006, app)] {
        f.ztunnel
            .wait_until(proxied(port, dst), PATIENCE)
            .await
            .unwrap_or_else(|e| panic!("{when}: no connection to {dst} through {port}: {e}"));
    }
    f.probe_from_node(false, when);
}

/// What of `mode` captures in the pod, or serves it on the node.
fn capture_left(mode: RedirectMode, pod: &Netns, node: &Netns, pins: &PinLayout) -> Vec<String> {
    match mode {
        RedirectMode::Iptables => {
            let mut left = iptables::find_any_pod_capture(pod).unwrap();
            let postrouting = iptables::probe_set_members(node, iptables::Family::V4);
            if postrouting.is_ok() {
                left.push("the host's probe ipset".to_owned());
            }
            left
        }
        RedirectMode::Nftables => {
            let nft = nftables::Nft::find(node).unwrap();
            let mut left = nftables::find_any_pod_capture(&nft, pod).unwrap().ours;
            if nft
                .inet_tables(node)
                .unwrap()
                .iter()
                .any(|t| t == nftables::NAT_TABLE)
            {
                left.push("the host's table".to_owned());
            }
            left
        }
        RedirectMode::Ebpf => {
            let mut left: Vec<String> = inspect::read_pods(pins)
                .unwrap()
                .iter()
                .map(|p| format!("pinned pod {}", p.netns_cookie))
                .collect();
            if pins.maps_dir().exists() {
                left.push("the pinned maps".to_owned());
            }
            if ambpf::bpf::inbound::link_pin(pins, cookie_of(pod)).exists() {
                left.push("the pod's sk_lookup link".to_owned());
            }
            left
        }
    }
}

fn cookie_of(pod: &Netns) -> u64 {
    ambpf::redirect::podnet::netns_cookie(pod).unwrap()
}

async fn switch(from: RedirectMode, to: RedirectMode) {
    common::init_logging();
    let _serial = crate::modes::SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(2).unwrap();
    let (old, backend) = redirection_at(from, &cluster, &cgroup, &pins);
    // A busy ztunnel, which asks for a connection's original destination
    // a while after accepting it.
    let ztunnel = ZtunnelConfig::default().original_dst_delay(ORIGINAL_DST_DELAY);
    let mut f = fixture_on(cluster, (old, Some(bpffs), backend), ztunnel).await;
    let pod = f.pod_netns();
    let node = Netns::open(f.cluster.node.name()).unwrap();
    new_connections_are_captured(&f, "before the switch").await;
    let mut outbound = Held::open(
        "the app's connection out",
        f.pod(),
        SocketAddr::new(f.remote_ip(false), PEER_PORT),
    );
    let mut inbound = Held::open(
        "a connection in to the app",
        &f.cluster.remote.ns,
        SocketAddr::new(f.pod_ip(false), APP_PORT),
    );

    // The old agent stops as in an upgrade (its capture stays), the new one
    // enrols the pod beside it and ztunnel reconnects to it.
    let (new, _) = redirection_at(to, &f.cluster, &cgroup, &pins);
    drop(std::mem::replace(&mut f.redirection, new));
    // The agent enrols every pod before ztunnel can connect to it: until
    // then, ztunnel is the old agent's peer only.
    let enrolled = f.redirection.enroll(&pod, ENROLL).unwrap();
    assert!(
        !capture_left(from, &pod, &node, &pins).is_empty(),
        "the old capture is in place until the new mode holds the pod"
    );
    new_connections_are_captured(&f, "with both captures, before ztunnel reconnects").await;
    outbound.exchange("with both captures");
    inbound.exchange("with both captures");
    f.zds.record_ztunnel_processes(pins.clone());
    f.ztunnel.disconnect();
    f.ztunnel
        .wait_until(|s| s.ready && s.current_connection().is_some(), PATIENCE)
        .await
        .unwrap();
    new_connections_are_captured(&f, "with both captures, ztunnel reconnected").await;

    let mut retirement = Retirement::find(
        to,
        pins.clone(),
        Netns::open(node.path().to_str().unwrap()).unwrap(),
    )
    .expect("the old mode's state is found");
    assert_eq!(retirement.left(), [from]);
    // A pod the new mode does not hold keeps the old capture.
    assert!(!retirement.step(&HashMap::new(), &|_| Fate::Pending));
    assert!(!capture_left(from, &pod, &node, &pins).is_empty());
    // A connection the old mode redirected just before it goes, whose
    // original destination ztunnel asks for only after.
    let mut late = Held::begin(
        "a connection out redirected as the old capture goes",
        f.pod(),
        SocketAddr::new(f.remote_ip(false), PEER_PORT),
    );
    let held = HashMap::from([(enrolled.key().netns_cookie, &pod)]);
    let retiring = Instant::now();
    let mut interrupted = false;
    while !retirement.step(&held, &|_| Fate::Pending) {
        assert!(
            retiring.elapsed() < PATIENCE,
            "{from:?} not retired after {PATIENCE:?}"
        );
        if from == RedirectMode::Ebpf {
            // Only the eBPF programs know where that connection was going.
            assert!(pins.maps_dir().is_dir(), "the eBPF programs drain first");
        }
        if !std::mem::replace(&mut interrupted, true) {
            // The agent killed halfway: the next one finds what is left.
            retirement = Retirement::find(
                to,
                pins.clone(),
                Netns::open(node.path().to_str().unwrap()).unwrap(),
            )
            .expect("a retirement interrupted halfway is found again");
            assert_eq!(retirement.left(), [from]);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    late.expect_echo("once the old capture is gone");
    assert_eq!(
        capture_left(from, &pod, &node, &pins),
        Vec::<String>::new(),
        "{from:?} left after the switch to {to:?}"
    );
    assert!(
        !capture_left(to, &pod, &node, &pins).is_empty(),
        "the new mode's capture stays"
    );
    assert!(
        Retirement::find(to, pins.clone(), node).is_none(),
        "nothing of the old mode is left to retire"
    );
    new_connections_are_captured(&f, "after the switch").await;
    outbound.exchange("after the switch");
    inbound.exchange("after the switch");
}

macro_rules! switches {
    ($($name:ident: $from:ident -> $to:ident,)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            switch(RedirectMode::$from, RedirectMode::$to).await
        }
    )*};
}

switches! {
    iptables_to_ebpf: Iptables -> Ebpf,
    nftables_to_ebpf: Nftables -> Ebpf,
    ebpf_to_iptables: Ebpf -> Iptables,
    ebpf_to_nftables: Ebpf -> Nftables,
    iptables_to_nftables: Iptables -> Nftables,
    nftables_to_iptables: Nftables -> Iptables,
}
