//! Privileged: the node's own addresses (exempted host traffic) are kept in
//! a pinned map that follows the node, and a node with more addresses than
//! the map holds still starts.

use std::net::{IpAddr, Ipv4Addr};

use ambpf::bpf::{Dataplane, PinLayout, inspect};
use ambpf_common::maps;
use ambpf_testbed::BpffsMount;

fn entries(pins: &PinLayout) -> u64 {
    let status = inspect::read_status(pins).unwrap();
    status
        .maps
        .iter()
        .find(|m| m.name == maps::HOST_ADDRS)
        .unwrap()
        .entries
}

#[test]
fn host_addresses_follow_the_node_and_overflow_degrades_instead_of_failing() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let mut dataplane = Dataplane::load(pins.clone()).unwrap();

    let many: Vec<IpAddr> = (0..maps::HOST_ADDRS_MAX + 1000)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))
        .collect();
    dataplane.set_host_addresses(&many).unwrap();
    assert_eq!(entries(&pins), u64::from(maps::HOST_ADDRS_MAX));

    // Addresses the node no longer has are dropped.
    let few: Vec<IpAddr> = vec![
        "10.0.0.1".parse().unwrap(),
        "fd00::1".parse().unwrap(),
        "10.0.0.1".parse().unwrap(),
    ];
    dataplane.set_host_addresses(&few).unwrap();
    assert_eq!(entries(&pins), 2);
}
