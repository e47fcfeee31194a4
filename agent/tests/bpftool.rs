//! Privileged: the pinned maps carry BTF, so `bpftool map dump pinned …`
//! prints an enrolled pod's entry with named fields, as platform teams read it.

use std::{path::Path, process::Command};

use ambpf::{
    bpf::{Dataplane, PinLayout},
    netns::Netns,
    redirect::{EbpfRedirection, ebpf::ip_key},
};
use ambpf_common::maps;
use ambpf_testbed::{BpffsMount, cluster::Cluster};
use serde_json::Value;

fn bpftool(args: &[&str], pin: &Path) -> Value {
    let out = Command::new("bpftool")
        .arg("--json")
        .args(args)
        .arg(pin)
        .output()
        .expect("bpftool must be installed (apt install bpftool)");
    assert!(
        out.status.success(),
        "bpftool {args:?} {}: {}",
        pin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bpftool_prints_pinned_map_entries_with_named_fields() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let netns = Netns::open(pod.ns.name()).unwrap();
    let mut dataplane = EbpfRedirection::new(Dataplane::load(pins.clone()).unwrap());
    let enrolled = dataplane.enroll_pod(&netns, true).unwrap();

    // Every pinned map with a key and value was created with BTF for them
    // (a ring buffer has neither: its records are read by `ambpf trace`; a
    // sockhash's values are socket references, the sk-lookup path's
    // listeners, with no fields to name).
    for name in maps::PINNED {
        let show = bpftool(&["map", "show", "pinned"], &pins.map(name));
        if show["type"] == "ringbuf" || show["type"] == "sockhash" {
            continue;
        }
        assert!(
            show["btf_id"].as_u64().is_some_and(|id| id > 0),
            "{name} has no BTF: {show}"
        );
    }

    // The pod's entry, keyed by netns cookie, reads as a PodConfig.
    let dump = bpftool(&["map", "dump", "pinned"], &pins.map(maps::PODS_BY_NETNS));
    let entries = dump.as_array().unwrap();
    assert_eq!(entries.len(), 1, "{dump}");
    let formatted = &entries[0]["formatted"];
    assert_eq!(formatted["key"], enrolled.netns_cookie, "{dump}");
    let value = &formatted["value"];
    assert_eq!(value["netns_cookie"], enrolled.netns_cookie, "{dump}");
    assert_eq!(value["netns_inode"], netns.inode(), "{dump}");
    // DNS capture, and inbound capture by its netns link (no qdisc).
    assert_eq!(
        value["flags"],
        ambpf_common::pod_flags::DNS_CAPTURE | ambpf_common::pod_flags::INBOUND_LINK,
        "{dump}"
    );
    let first_ip: Vec<u64> = value["ips"][0]["addr"]
        .as_array()
        .unwrap_or_else(|| panic!("ips[0].addr is not an array: {dump}"))
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    let expected: Vec<u64> = ip_key(enrolled.addresses[0])
        .addr
        .iter()
        .map(|&b| u64::from(b))
        .collect();
    assert_eq!(first_ip, expected, "{dump}");

    // The same, keyed by address, in the plain-text form people read.
    let text = Command::new("bpftool")
        .args(["map", "dump", "pinned"])
        .arg(pins.map(maps::PODS_BY_IP))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    for field in ["\"addr\"", "\"netns_cookie\"", "\"netns_inode\"", "\"ips\""] {
        assert!(text.contains(field), "{field} missing from:\n{text}");
    }
}
