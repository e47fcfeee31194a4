//! Privileged: `ambpf status` as a user meets it, through the binary.
//!
//! A pin root that does not exist, is not on bpffs, or holds no ambpf state
//! is an error saying which; with state it names each pod (recorded at
//! enrolment, forgotten at removal) and warns when the pinned programs were
//! loaded from another build's BPF object. With real traffic, each open
//! redirected connection shows under its pod as the app and ztunnel see it,
//! and goes when it closes.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpStream},
    path::Path,
    process::Command,
};

use ambpf::{
    bpf::{Dataplane, PinLayout, pod_names::PodIdentity},
    netns::Netns,
    redirect::{EbpfRedirection, PodKey, PodRedirection, RedirectMode},
};
use ambpf_testbed::{BpffsMount, CgroupGuard, cluster::Cluster};
use serde_json::{Value, json};

mod common;
#[macro_use]
mod modes;
#[macro_use]
mod pod_fixture;
use pod_fixture::*;

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
    let mut dataplane = EbpfRedirection::new(Dataplane::load(pins.clone()).unwrap());
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

/// Runs `program args` inside the namespace `ns` with `input` on stdin;
/// panics with its output unless it succeeds.
fn run_in(ns: &str, program: &str, args: &[&str], input: &str) {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", ns, program]).args(args);
    let out = ambpf_testbed::output_with_stdin(&mut command, input.as_bytes()).unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Istio's in-pod rules written beside the eBPF capture (as Istio's node
/// agent leaves a pod it enrolled): `status --check` fails naming the pod,
/// the other rules and which capture gets its connections, for Istio's
/// iptables rules and for nftables tables of Istio's names that are not
/// ambpf's; with them gone it passes again.
#[test]
fn other_capture_beside_the_ebpf_capture_is_named() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(1).unwrap();
    let ns = cluster.pods[0].ns.name();
    let netns = Netns::open(ns).unwrap();
    let mut dataplane = EbpfRedirection::new(Dataplane::load(pins.clone()).unwrap());
    let enrolled = dataplane.enroll_pod(&netns, true).unwrap();
    let key = enrolled.key();
    let identity = PodIdentity {
        namespace: "shop".into(),
        name: "web-0".into(),
        uid: "0b7c-uid".into(),
    };
    dataplane.record_identity(key, &identity).unwrap();
    let (ok, text, stderr) = status(pins.root(), &["--check"]);
    assert!(ok, "{text}{stderr}");

    // Istio's own in-pod rule set, as Istio's node agent restores it.
    let rules = ambpf::redirect::iptables::render_fresh(&ambpf::redirect::iptables::pod_rules(
        ambpf::redirect::iptables::Family::V4,
        true,
    ));
    run_in(ns, "iptables-restore", &["--noflush"], &rules);
    let (ok, text, _) = status(pins.root(), &["--check"]);
    assert!(!ok, "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("mixed_capture:"))
        .unwrap_or_else(|| panic!("no mixed_capture in:\n{text}"));
    assert!(line.contains(&format!("pod shop/web-0 ({key})")), "{line}");
    assert!(line.contains("Istio's in-pod iptables rules"), "{line}");
    assert!(line.contains("nat ISTIO_PRERT"), "{line}");
    assert!(line.contains("raw ISTIO_OUTPUT"), "{line}");
    assert!(
        line.contains("ambpf's eBPF capture gets its connections first"),
        "{line}"
    );
    let (_, json, _) = status(pins.root(), &["--check", "-o", "json"]);
    let json: Value = serde_json::from_str(&json).unwrap();
    let mixed: Vec<&Value> = json["violations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["kind"] == "mixed_capture")
        .collect();
    assert_eq!(mixed.len(), 1, "{json}");
    assert_eq!(mixed[0]["pod"]["netns_cookie"], key.netns_cookie, "{json}");

    for table in ["nat", "mangle", "raw"] {
        run_in(ns, "iptables", &["-t", table, "-F"], "");
        run_in(ns, "iptables", &["-t", table, "-X"], "");
    }
    // A table of Istio's names without ambpf's comment: another agent's.
    run_in(
        ns,
        "nft",
        &["-f", "-"],
        "table inet istio-ambient-nat {\n chain prerouting {\n  type nat hook prerouting \
         priority dstnat; policy accept;\n  tcp dport 8080 redirect to :15006\n }\n}\n",
    );
    let (ok, text, _) = status(pins.root(), &["--check"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("another agent's nftables tables of Istio's names")
            && text.contains("inet istio-ambient-nat"),
        "{text}"
    );
    run_in(
        ns,
        "nft",
        &["delete", "table", "inet", "istio-ambient-nat"],
        "",
    );
    let (ok, text, stderr) = status(pins.root(), &["--check"]);
    assert!(ok, "{text}{stderr}");
    assert!(dataplane.unenroll(key).unwrap());
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

/// The open redirected connections `status -o json` shows under the one
/// enrolled pod.
fn redirected(pin_root: &Path) -> Vec<Value> {
    let (ok, stdout, stderr) = tokio::task::block_in_place(|| status(pin_root, &["-o", "json"]));
    assert!(ok, "{stderr}");
    let json: Value = serde_json::from_str(&stdout).unwrap();
    json["pods"][0]["redirected"]
        .as_array()
        .unwrap_or_else(|| panic!("no redirected list: {json}"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn open_redirected_connections_show_as_the_app_and_ztunnel_see_them() {
    with_fixture!(RedirectMode::Ebpf, |f| {
        let pin_root = f.bpffs.as_ref().unwrap().path().join("ambpf");
        assert_eq!(redirected(&pin_root), Vec::<Value>::new());
        for v6 in [false, true] {
            let dst = SocketAddr::new(f.remote_ip(v6), PEER_PORT);
            // An open connection from the app, after one exchange.
            let stream = tokio::task::block_in_place(|| {
                f.pod()
                    .run(|| {
                        let mut stream = TcpStream::connect_timeout(&dst, PATIENCE).unwrap();
                        stream.set_read_timeout(Some(PATIENCE)).unwrap();
                        stream.write_all(b"ambpf").unwrap();
                        stream.read_exact(&mut [0u8; 5]).unwrap();
                        stream
                    })
                    .unwrap()
            });
            let app = stream.local_addr().unwrap();
            assert_eq!(stream.peer_addr().unwrap(), dst, "the app's getpeername");
            let conn = f.wait_proxied(15001, dst).await;
            assert_eq!(conn.client, app, "the peer ztunnel's socket sees");
            assert_eq!(conn.so_original_dst, Some(dst));

            // What status shows is what each side saw.
            let shown = json!({
                "app": app.to_string(),
                "ztunnel": conn.local.to_string(),
                "original_destination": dst.to_string(),
            });
            let listed = redirected(&pin_root);
            assert!(listed.contains(&shown), "{shown} not in {listed:?}");
            let (ok, text, _) = tokio::task::block_in_place(|| status(&pin_root, &[]));
            assert!(ok);
            let row = format!(
                "redirected: app {app} -> {dst} | ztunnel accepted it on {} from {app}, \
                 SO_ORIGINAL_DST {dst}",
                conn.local
            );
            assert!(text.contains(&row), "{row} not in\n{text}");

            // Closed, it goes.
            stream.shutdown(Shutdown::Both).unwrap();
            drop(stream);
            let deadline = std::time::Instant::now() + PATIENCE;
            while redirected(&pin_root).contains(&shown) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{shown} still listed after the connection closed"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    })
}
