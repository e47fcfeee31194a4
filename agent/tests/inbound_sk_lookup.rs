//! Privileged: the eBPF mode's sk_lookup inbound path, forced on a kernel
//! that could take the TC one, so that every kernel runs it (kernels before
//! 6.5 take it on their own: `cargo xtask kernels` runs the redirect suite
//! there). The redirect and parity suites run on this path too with
//! `AMBPF_INBOUND_ASSIGN=sk-lookup`; these tests cover what is its own: the
//! pod's pinned sk_lookup link, its check and repair, and its removal.

use std::{net::SocketAddr, path::PathBuf};

use ambpf::{
    bpf::{InboundAssign, InboundPath, PinLayout, inbound, inspect},
    redirect::{CheckScope, PodKey, RedirectMode, ViolationKind},
};
use ambpf_common::maps;
use ambpf_testbed::{CgroupGuard, ztunnel::ConnectionOutcome};
use aya::maps::{Map, MapData, SockHash};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

/// The fixture in eBPF mode on the sk_lookup path, with this process in a
/// cgroup of its own meanwhile.
macro_rules! on_sk_lookup {
    (|$f:ident| $body:block) => {{
        let _serial = crate::modes::SERIAL.lock().await;
        let cgroup = CgroupGuard::create().unwrap();
        let _inside = cgroup.enter_process().unwrap();
        #[allow(unused_mut)]
        let mut $f = fixture_with(RedirectMode::Ebpf, Some(&cgroup), InboundAssign::SkLookup).await;
        $body
    }};
}

fn pins(f: &Fixture) -> PinLayout {
    PinLayout::new(f.bpffs.as_ref().unwrap().path().join("ambpf"))
}

fn the_pod(f: &mut Fixture) -> PodKey {
    let [pod] = f.redirection.enrolled().unwrap()[..] else {
        panic!("one pod is enrolled");
    };
    pod
}

/// The pod's sk_lookup link pin.
fn link(f: &mut Fixture) -> PathBuf {
    let cookie = the_pod(f).netns_cookie;
    inbound::link_pin(&pins(f), cookie)
}

/// The netns cookies whose listener the steering program recorded.
fn listeners(f: &Fixture) -> Vec<u64> {
    let data = MapData::from_pin(pins(f).map(maps::INBOUND_LISTENERS)).unwrap();
    let map: SockHash<_, u64> = SockHash::try_from(Map::SockHash(data)).unwrap();
    map.keys().collect::<Result<_, _>>().unwrap()
}

/// Connects from the remote to the app on both families and checks that
/// ztunnel's inbound listener took each, as TPROXY would have handed it.
async fn inbound_reaches_ztunnel(f: &Fixture) {
    for v6 in [false, true] {
        let dst = SocketAddr::new(f.pod_ip(v6), APP_PORT);
        echo_once(&f.cluster.remote.ns, dst, None, None);
        let conn = f.wait_proxied(15006, dst).await;
        assert_eq!(conn.outcome, ConnectionOutcome::Proxied, "{conn:?}");
        assert_eq!(conn.client.ip(), f.remote_ip(v6));
        assert_eq!(f.app.last_peer().unwrap().ip(), f.remote_ip(v6));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_pod_gets_a_link_into_its_namespace_and_inbound_reaches_ztunnel() {
    on_sk_lookup!(|f| {
        let pins = pins(&f);
        assert_eq!(inbound::pinned_path(&pins), InboundPath::SkLookup);
        assert_eq!(
            inspect::read_status(&pins).unwrap().inbound,
            InboundPath::SkLookup
        );
        let pod = the_pod(&mut f);
        let (program, netns_inode) = inbound::link_info(&link(&mut f)).unwrap();
        assert_eq!(Some(program), inbound::pinned_program(&pins));
        assert_eq!(netns_inode, Some(pod.netns_inode as u32));
        // ztunnel's listener, filed when ztunnel listened in the pod.
        assert_eq!(listeners(&f), [pod.netns_cookie]);

        inbound_reaches_ztunnel(&f).await;
        let netns = f.pod_netns();
        assert_eq!(f.redirection.check(&[(pod, &netns)], CheckScope::Full), []);

        // Removal takes the link; connections go straight to the app again.
        // ztunnel's listener stays filed while ztunnel holds it open (the
        // kernel drops it from the map when it closes).
        assert!(f.redirection.unenroll(pod).unwrap());
        assert!(!pins.pod_links_dir(pod.netns_cookie).exists());
        assert_eq!(listeners(&f), [pod.netns_cookie]);
        let proxied = f.proxied().len();
        let dst = SocketAddr::new(f.pod_ip(false), APP_PORT);
        echo_once(&f.cluster.remote.ns, dst, None, None);
        assert_eq!(f.app.last_peer().unwrap().ip(), f.remote_ip(false));
        assert_eq!(f.proxied().len(), proxied, "captured after removal");
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_link_is_found_by_the_state_check_and_restored_by_enrolling_again() {
    on_sk_lookup!(|f| {
        let pod = the_pod(&mut f);
        let netns = f.pod_netns();
        let known = [(pod, &netns)];
        // Unpinning the link detaches it: inbound connections would reach
        // the app.
        std::fs::remove_file(link(&mut f)).unwrap();
        let found = f.redirection.check(&known, CheckScope::Full);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!(found[0].kind, ViolationKind::SteeringMissing);
        assert!(found[0].detail.contains("no sk_lookup link"), "{found:#?}");
        assert_eq!(f.redirection.repair(&found), [pod]);

        // What the agent does with the pods a repair returns.
        f.redirection.enroll(&netns, ENROLL).unwrap();
        assert_eq!(f.redirection.check(&known, CheckScope::Full), []);
        inbound_reaches_ztunnel(&f).await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_link_left_for_a_pod_no_longer_enrolled_is_an_orphan_and_removed() {
    on_sk_lookup!(|f| {
        let pins = pins(&f);
        let pod = the_pod(&mut f);
        let netns = f.pod_netns();
        // A second link, pinned as for a pod that is gone.
        let stray = inbound::link_pin(&pins, pod.netns_cookie + 1_000_000);
        let program =
            ambpf::bpf::sys::obj_get(&pins.program(ambpf_common::programs::INBOUND_LOOKUP))
                .unwrap();
        use std::os::fd::AsFd as _;
        inbound::attach_link(&stray, program.as_fd(), netns.file().as_fd(), netns.inode()).unwrap();
        let found = f.redirection.check(&[(pod, &netns)], CheckScope::Records);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!(found[0].kind, ViolationKind::SteeringOrphan);
        assert_eq!(found[0].pin.as_deref(), stray.parent());
        assert_eq!(f.redirection.repair(&found), []);
        assert!(!stray.parent().unwrap().exists());
        assert_eq!(f.redirection.check(&[(pod, &netns)], CheckScope::Full), []);
        inbound_reaches_ztunnel(&f).await;
    })
}
