//! Privileged: `ambpf status` as a user meets it, through the binary.
//!
//! A pin root that does not exist, is not on bpffs, or holds no ambpf state
//! is an error saying which; with state it names each pod (recorded at
//! enrolment, forgotten at removal) and warns when the pinned programs were
//! loaded from another build's BPF object.

use std::{path::Path, process::Command};

use ambpf::{
    bpf::{Dataplane, PinLayout, pod_names::PodIdentity},
    netns::Netns,
    redirect::{PodKey, PodRedirection},
};
use ambpf_testbed::{BpffsMount, cluster::Cluster};
use serde_json::Value;

fn status(pin_root: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pin_root)
        .arg("status")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn no_ambpf_state_is_an_error_that_says_why() {
    let bpffs = BpffsMount::create().unwrap();

    let missing = bpffs.path().join("nothing-here");
    let (ok, _, stderr) = status(&missing, &[]);
    assert!(!ok);
    assert!(stderr.contains("does not exist"), "{stderr}");

    let not_bpffs = std::env::temp_dir();
    let (ok, _, stderr) = status(&not_bpffs, &[]);
    assert!(!ok);
    assert!(stderr.contains("is not on a bpf filesystem"), "{stderr}");

    let empty = bpffs.path().join("ambpf");
    std::fs::create_dir(&empty).unwrap();
    for args in [&[][..], &["-o", "json"], &["--check"]] {
        let (ok, _, stderr) = status(&empty, args);
        assert!(!ok, "{args:?}");
        assert!(
            stderr.contains("holds no ambpf state"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn pods_are_named_and_another_builds_programs_are_flagged() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(1).unwrap();
    let netns = Netns::open(cluster.pods[0].ns.name()).unwrap();
    let mut dataplane = Dataplane::load(pins.clone()).unwrap();
    let enrolled = dataplane.enroll_pod(&netns, true).unwrap();
    let identity = PodIdentity {
        namespace: "shop".into(),
        name: "web-0".into(),
        uid: "0b7c-uid".into(),
    };
    dataplane
        .record_identity(enrolled.key(), &identity)
        .unwrap();

    let (ok, stdout, stderr) = status(pins.root(), &["-o", "json"]);
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["pods"][0]["pod"]["name"], "web-0", "{json}");
    assert_eq!(json["pods"][0]["pod"]["uid"], "0b7c-uid", "{json}");
    // Every map has an entry count; arrays count every slot.
    for map in json["maps"].as_array().unwrap() {
        assert!(map["entries"].is_u64(), "{map}");
    }
    assert_eq!(entries_of(&json, "ambpf_pods"), 1);
    assert_eq!(entries_of(&json, "ambpf_pod_names"), 1);
    assert_eq!(
        entries_of(&json, "ambpf_pod_ips"),
        enrolled.addresses.len() as u64
    );
    assert!(json["counters"].is_object(), "{json}");

    let (ok, text, _) = status(pins.root(), &[]);
    assert!(ok);
    assert!(text.contains("shop/web-0"), "{text}");
    let (ok, yaml, _) = status(pins.root(), &["-o", "yaml"]);
    assert!(ok);
    assert!(yaml.contains("name: web-0"), "{yaml}");

    // Programs loaded from another object: the record says so.
    let record = pins.root().join("object");
    for entry in std::fs::read_dir(&record).unwrap() {
        std::fs::remove_dir(entry.unwrap().path()).unwrap();
    }
    std::fs::create_dir(record.join("0".repeat(64))).unwrap();
    let (ok, text, stderr) = status(pins.root(), &[]);
    assert!(ok);
    let expected = format!(
        "warning: the pinned programs were loaded from BPF object sha256 {}",
        "0".repeat(64)
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(text.contains("programs: WARNING"), "{text}");

    // Removing the pod forgets its name.
    let key = PodKey {
        netns_cookie: enrolled.netns_cookie,
        netns_inode: netns.inode(),
    };
    assert!(dataplane.unenroll(key).unwrap());
    let (ok, stdout, _) = status(pins.root(), &["--json"]);
    assert!(ok);
    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["pods"].as_array().unwrap().len(), 0, "{json}");
    assert_eq!(entries_of(&json, "ambpf_pod_names"), 0, "{json}");
}

fn entries_of(json: &Value, name: &str) -> u64 {
    json["maps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .and_then(|m| m["entries"].as_u64())
        .unwrap()
}
