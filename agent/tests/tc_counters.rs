//! Privileged: the interface counters loaded into the kernel, attached through
//! TCX inside a throwaway pod namespace, counting real packets on a real veth.

use std::{
    net::{SocketAddr, UdpSocket},
    process::{Command, Output},
    time::Duration,
};

use ambpf::{
    bpf::{Dataplane, PinLayout, inspect},
    netns::Netns,
};
use ambpf_testbed::{BpffsMount, PodAndNode};
use aya::programs::{SchedClassifier, TcAttachType};

const PAYLOAD: usize = 200;

/// Sends `count` UDP datagrams from the pod to the node and checks the node
/// received them all.
fn pod_to_node_udp(pn: &PodAndNode, count: usize) {
    let node_addr = SocketAddr::from((PodAndNode::NODE.v4, 0));
    let receiver = pn.node.run(|| UdpSocket::bind(node_addr)).unwrap().unwrap();
    receiver
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let target = receiver.local_addr().unwrap();
    pn.pod
        .run(|| {
            let sender = UdpSocket::bind(SocketAddr::from((PodAndNode::POD.v4, 0))).unwrap();
            for _ in 0..count {
                sender.send_to(&[7u8; PAYLOAD], target).unwrap();
            }
        })
        .unwrap();
    let mut buf = [0u8; 2 * PAYLOAD];
    for _ in 0..count {
        let (n, _) = receiver.recv_from(&mut buf).expect("datagram lost");
        assert_eq!(n, PAYLOAD);
    }
}

fn pod_eth0_ifindex(pn: &PodAndNode) -> u32 {
    pn.pod
        .run(|| nix::net::if_::if_nametoindex("eth0"))
        .unwrap()
        .unwrap()
}

fn egress_packets(pins: &PinLayout, ifindex: u32) -> u64 {
    inspect::read_iface_stats(pins)
        .unwrap()
        .iter()
        .find(|s| s.ifindex == ifindex && s.direction == "egress")
        .map_or(0, |s| s.packets)
}

/// Names of the TCX programs attached to the pod's eth0, per direction.
/// Waits until eth0 runs no tcx program. Removing a link's last pin drops
/// its last reference only once the pin's inode is freed, after an RCU
/// grace period, and the kernel then releases the link from a workqueue
/// (`bpf_free_inode`, `bpf_link_put`): on a busy machine the detach shows a
/// moment after `ambpf detach` returns.
fn tcx_programs_gone(pn: &PodAndNode) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let programs = tcx_programs(pn);
        if programs == (vec![], vec![]) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still attached 5 s after the detach: {programs:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn tcx_programs(pn: &PodAndNode) -> (Vec<String>, Vec<String>) {
    let names = |attach_type| {
        pn.pod
            .run(|| SchedClassifier::query_tcx("eth0", attach_type))
            .unwrap()
            .unwrap()
            .1
            .iter()
            .map(|p| p.name_as_str().unwrap_or("?").to_owned())
            .collect::<Vec<_>>()
    };
    (names(TcAttachType::Ingress), names(TcAttachType::Egress))
}

fn ambpf(pins: &PinLayout, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pins.root())
        .args(args)
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn counts_packets_on_a_veth_in_a_pod_namespace() {
    let bpffs = BpffsMount::create().unwrap();
    let pn = PodAndNode::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let ifindex = pod_eth0_ifindex(&pn);

    let mut dataplane = Dataplane::load(pins.clone()).unwrap();
    let attachment = dataplane
        .attach_iface_counters(&Netns::open(pn.pod.name()).unwrap(), "eth0")
        .unwrap();
    assert_eq!(attachment.ifindex, ifindex);
    assert!(attachment.links.iter().all(|l| !l.replaced));
    assert_eq!(
        tcx_programs(&pn),
        (vec!["ambpf_cnt_in".into()], vec!["ambpf_cnt_out".into()])
    );

    pod_to_node_udp(&pn, 25);

    let stats = inspect::read_iface_stats(&pins).unwrap();
    let egress = stats
        .iter()
        .find(|s| s.ifindex == ifindex && s.direction == "egress")
        .expect("no egress counter for the pod's eth0");
    // 25 datagrams plus at most a few ARP/ND packets.
    assert!((25..=35).contains(&egress.packets), "{egress:?}");
    assert!(egress.bytes >= 25 * (PAYLOAD as u64 + 28), "{egress:?}");
    // The node's ARP reply (and nothing else) came in.
    let ingress = stats
        .iter()
        .find(|s| s.ifindex == ifindex && s.direction == "ingress");
    assert!(ingress.is_some_and(|s| s.packets < 10), "{ingress:?}");

    let links = inspect::read_tc_links(&pins).unwrap();
    let mut progs: Vec<_> = links
        .iter()
        .map(|l| (l.direction, l.program_name.as_str()))
        .collect();
    progs.sort();
    assert_eq!(
        progs,
        [("egress", "ambpf_cnt_out"), ("ingress", "ambpf_cnt_in")]
    );
}

#[test]
fn attachments_outlive_the_cli_and_detach_cleanly() {
    let bpffs = BpffsMount::create().unwrap();
    let pn = PodAndNode::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let ifindex = pod_eth0_ifindex(&pn);

    let out = ambpf(
        &pins,
        &["attach", "--netns", pn.pod.name(), "--iface", "eth0"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // The attaching process is gone; the pinned links keep the programs.
    pod_to_node_udp(&pn, 10);
    let counted = egress_packets(&pins, ifindex);
    assert!(counted >= 10, "{counted}");

    let status = ambpf(&pins, &["status", "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["tc_links"].as_array().unwrap().len(), 2);
    assert_eq!(status["maps"][0]["name"], "ambpf_if_stats");

    // Attaching again replaces the programs inside the same links.
    let before = inspect::read_tc_links(&pins).unwrap();
    let out = ambpf(
        &pins,
        &["attach", "--netns", pn.pod.name(), "--iface", "eth0"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let after = inspect::read_tc_links(&pins).unwrap();
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(
            b.link_id, a.link_id,
            "link was recreated instead of updated"
        );
        assert_ne!(b.program_id, a.program_id, "program was not replaced");
    }
    assert_eq!(
        tcx_programs(&pn),
        (vec!["ambpf_cnt_in".into()], vec!["ambpf_cnt_out".into()])
    );

    let out = ambpf(
        &pins,
        &["detach", "--netns", pn.pod.name(), "--iface", "eth0"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    tcx_programs_gone(&pn);
    assert!(inspect::read_tc_links(&pins).unwrap().is_empty());
    pod_to_node_udp(&pn, 10);
    let still = egress_packets(&pins, ifindex);
    assert!(
        still < counted + 10,
        "detached program still counts: {still} vs {counted}"
    );

    // Uninstall leaves nothing pinned.
    let out = ambpf(&pins, &["uninstall"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!pins.root().exists());
}

#[test]
fn missing_namespace_interface_or_bpffs_is_a_clear_error_and_attaches_nothing() {
    let bpffs = BpffsMount::create().unwrap();
    let pn = PodAndNode::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));

    let out = ambpf(
        &pins,
        &["attach", "--netns", "ambpf-no-such-ns", "--iface", "eth0"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("network namespace /run/netns/ambpf-no-such-ns does not exist"),
        "{}",
        stderr(&out)
    );

    let out = ambpf(
        &pins,
        &["attach", "--netns", pn.pod.name(), "--iface", "eth9"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!(
            "interface eth9 not found in network namespace /run/netns/{}",
            pn.pod.name()
        )),
        "{}",
        stderr(&out)
    );

    let not_bpffs = PinLayout::new(std::env::temp_dir().join("ambpf-not-bpffs"));
    let out = ambpf(
        &not_bpffs,
        &["attach", "--netns", pn.pod.name(), "--iface", "eth0"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not on a bpf filesystem"),
        "{}",
        stderr(&out)
    );

    let out = ambpf(&pins, &["run", "--attach", "no-colon"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("expected NETNS:IFACE"),
        "{}",
        stderr(&out)
    );

    // None of those left anything attached or pinned.
    tcx_programs_gone(&pn);
    assert!(inspect::read_tc_links(&pins).unwrap().is_empty());
}
