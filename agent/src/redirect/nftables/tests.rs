//! The nftables redirection end to end. Privileged: real namespaces, real
//! `nft`.

use std::{path::PathBuf, process::Command};

use ambpf_testbed::{NetnsGuard, PodAndNode};

use super::*;
use crate::redirect::in_pod::tools::PROCESSES_STARTED;

fn open(guard: &NetnsGuard) -> Netns {
    Netns::open(guard.path().to_str().unwrap()).unwrap()
}

fn dns(dns_capture: bool) -> EnrollOptions {
    EnrollOptions { dns_capture }
}

/// `nft list ruleset` of `ns`, without counters' values (`-s`).
fn ruleset(ns: &NetnsGuard) -> String {
    let out = ns
        .run(|| {
            Command::new("nft")
                .args(["-s", "list", "ruleset"])
                .output()
                .unwrap()
        })
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn nft_in(ns: &NetnsGuard, script: &str) {
    ns.run(|| {
        let mut child = Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "{script}");
    })
    .unwrap();
}

/// Processes started on this thread by `f`.
fn processes_started(f: impl FnOnce()) -> u64 {
    let before = PROCESSES_STARTED.with(|n| n.get());
    f();
    PROCESSES_STARTED.with(|n| n.get()) - before
}

#[test]
fn enrol_reenrol_unenrol_and_uninstall() {
    let pn = PodAndNode::create().unwrap();
    let (pod, node) = (open(&pn.pod), open(&pn.node));
    let mut redirection = NftablesRedirection::new(open(&pn.node)).unwrap();
    let host = ruleset(&pn.node);
    assert!(
        host.contains(&format!("comment \"{OWNED_COMMENT}\"")),
        "{host}"
    );
    assert!(
        host.contains(
            "meta l4proto tcp meta skuid >= 0 ip daddr @istio-inpod-probes-v4 counter snat ip to 169.254.7.127"
        ),
        "{host}"
    );

    let enrolled = redirection.enroll(&pod, dns(true)).unwrap();
    let key = enrolled.key();
    let listed = ruleset(&pn.pod);
    for (table, lines) in [
        (
            NAT_TABLE,
            &[
                "type nat hook prerouting priority dstnat; policy accept;",
                "type nat hook output priority -100; policy accept;",
                "meta l4proto tcp ip saddr 169.254.7.127 counter accept",
                "ip daddr != 127.0.0.1 tcp dport != 15008 meta mark & 0x00000fff != 0x00000539 counter redirect to :15006",
                "ip6 daddr != ::1 tcp dport != 15008 meta mark & 0x00000fff != 0x00000539 counter redirect to :15006",
                "oifname != \"lo\" meta mark & 0x00000fff != 0x00000539 udp dport 53 counter redirect to :15053",
                "meta l4proto tcp meta mark & 0x00000fff == 0x00000111 counter accept",
                "meta l4proto tcp ip daddr != 127.0.0.1 meta mark & 0x00000fff != 0x00000539 counter redirect to :15001",
            ][..],
        ),
        (
            MANGLE_TABLE,
            &[
                "type route hook output priority mangle; policy accept;",
                // `& 0xfffff000 | 0x111`, as nft folds it: the same bits.
                "meta mark & 0x00000fff == 0x00000539 counter ct mark set ct mark & 0xfffff111 | 0x00000111",
                "ct mark & 0x00000fff == 0x00000111 counter meta mark set ct mark",
            ][..],
        ),
        (
            RAW_TABLE,
            &[
                "type filter hook prerouting priority raw; policy accept;",
                "udp dport 53 meta mark & 0x00000fff == 0x00000539 counter ct zone set 1",
                "udp sport 53 meta mark & 0x00000fff != 0x00000539 counter ct zone set 1",
            ][..],
        ),
    ] {
        assert!(
            listed.contains(&format!("table inet {table} {{")),
            "{listed}"
        );
        for line in lines {
            assert!(listed.contains(line), "{table}: {line}\n{listed}");
        }
    }
    let members = probe_set_entries(redirection.nft(), &node).unwrap();
    assert_eq!(
        members,
        [
            (IpAddr::V4(PodAndNode::POD.v4), Some(key.netns_cookie)),
            (IpAddr::V6(PodAndNode::POD.v6), Some(key.netns_cookie)),
        ]
    );
    assert!(
        routing::reply_routing_status(&pod)
            .unwrap()
            .policy_routing_installed()
    );
    assert_eq!(redirection.check(&[(key, &pod)], CheckScope::Full), []);

    // Again, without DNS capture: the raw table goes, the rest is rebuilt.
    redirection.enroll(&pod, dns(false)).unwrap();
    let again = ruleset(&pn.pod);
    assert!(
        !again.contains(RAW_TABLE) && !again.contains("15053"),
        "{again}"
    );
    redirection.enroll(&pod, dns(true)).unwrap();
    assert_eq!(ruleset(&pn.pod), listed, "rebuilt, not duplicated");

    // Opt-out, as Istio's `DeleteInpodRules`: the three tables, the
    // policy routing and the members go.
    assert!(redirection.unenroll(key).unwrap());
    assert_eq!(ruleset(&pn.pod), "");
    assert!(
        !routing::reply_routing_status(&pod)
            .unwrap()
            .policy_routing_installed()
    );
    assert!(
        probe_set_entries(redirection.nft(), &node)
            .unwrap()
            .is_empty()
    );
    assert!(redirection.enrolled().unwrap().is_empty());

    // Without DNS capture (no raw table), the opt-out names only the
    // tables the pod has, and leaves nothing.
    let key = redirection.enroll(&pod, dns(false)).unwrap().key();
    assert!(redirection.unenroll(key).unwrap());
    assert_eq!(ruleset(&pn.pod), "");

    // Enrolled again, then uninstalled.
    redirection.enroll(&pod, dns(true)).unwrap();
    redirection.uninstall().unwrap();
    assert_eq!(ruleset(&pn.pod), "");
    assert_eq!(ruleset(&pn.node), "");
    assert!(
        !routing::reply_routing_status(&pod)
            .unwrap()
            .policy_routing_installed()
    );
}

#[test]
fn a_pod_costs_one_transaction_in_its_namespace() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    let mut redirection = NftablesRedirection::new(open(&pn.node)).unwrap();
    // As Istio's node agent: the pod's one `nft -f -`, and one on the host
    // per address for its members (the test pod has an IPv4 and an IPv6
    // address).
    let addresses = 2;
    let mut key = None;
    let add = processes_started(|| key = Some(redirection.enroll(&pod, dns(true)).unwrap().key()));
    assert_eq!(add, 1 + addresses);
    // Again with the same addresses: the pod's transaction alone.
    let again = processes_started(|| drop(redirection.enroll(&pod, dns(true)).unwrap()));
    assert_eq!(again, 1);
    // Opt-out: the host's members, then Istio's one transaction deleting
    // the pod's tables (the policy routing over netlink).
    let remove = processes_started(|| assert!(redirection.unenroll(key.unwrap()).unwrap()));
    assert_eq!(remove, addresses + 1);
    // Deleted: the members only; the namespace keeps its tables.
    let key = redirection.enroll(&pod, dns(true)).unwrap().key();
    let forget = processes_started(|| assert!(redirection.forget_deleted(key).unwrap()));
    assert_eq!(forget, addresses);
    assert!(
        probe_set_entries(redirection.nft(), &open(&pn.node))
            .unwrap()
            .is_empty()
    );
    assert!(ruleset(&pn.pod).contains(NAT_TABLE));
    assert!(redirection.enrolled().unwrap().is_empty());
    redirection.uninstall().unwrap();
}

#[test]
fn a_pod_with_another_tools_table_is_refused_and_left_untouched() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    // What Istio's own node agent writes: the same name, no ambpf comment.
    nft_in(
        &pn.pod,
        "add table inet istio-ambient-mangle\n\
         add chain inet istio-ambient-mangle output { type route hook output priority -150 ; }\n\
         add rule inet istio-ambient-mangle output counter\n",
    );
    // And its policy routing (`fwmark 0x111/0xfff lookup 100`, the same as
    // ambpf's): another owner's, which a refusal must leave.
    routing::install_policy_routing(&pod).unwrap();
    let before = ruleset(&pn.pod);
    let mut redirection = NftablesRedirection::new(open(&pn.node)).unwrap();
    let err = redirection.enroll(&pod, dns(true)).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, EnrollError::Nftables(NftablesError::ForeignTables { ref tables, .. }) if tables == &[MANGLE_TABLE]),
        "{text}"
    );
    assert!(
        text.contains("istio-ambient-mangle") && text.contains(pn.pod.name()),
        "{text}"
    );
    assert_eq!(ruleset(&pn.pod), before, "untouched");
    assert!(
        probe_set_entries(redirection.nft(), &open(&pn.node))
            .unwrap()
            .is_empty()
    );
    assert!(
        routing::reply_routing_status(&pod)
            .unwrap()
            .policy_routing_installed(),
        "the other owner's policy routing was removed"
    );
    assert!(redirection.enrolled().unwrap().is_empty());
    redirection.uninstall().unwrap();
    assert_eq!(ruleset(&pn.pod), before, "uninstall leaves another's table");
}

/// Taking a node over from Istio's node agent, whose tables (its names,
/// no ambpf comment) are left in its pods: they are replaced by ambpf's in
/// one transaction, and the pod is enrolled.
#[test]
fn istio_agent_tables_are_replaced_when_taking_over() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    nft_in(
        &pn.pod,
        "add table inet istio-ambient-nat\n\
         add chain inet istio-ambient-nat prerouting { type nat hook prerouting priority dstnat ; }\n\
         add rule inet istio-ambient-nat prerouting counter\n",
    );
    // And its host table, which its uninstall normally removes.
    nft_in(&pn.node, "add table inet istio-ambient-nat\n");
    let mut redirection = NftablesRedirection::taking_over_istio(open(&pn.node)).unwrap();
    redirection.enroll(&pod, dns(true)).unwrap();
    let (ours, foreign) = find_pod_tables(redirection.nft(), &pod).unwrap();
    assert!(foreign.is_empty(), "{foreign:?}");
    assert!(ours.contains(&NAT_TABLE), "{ours:?}");
    assert!(
        !find_pod_capture(redirection.nft(), &pod)
            .unwrap()
            .is_empty(),
        "ambpf's capture in place"
    );
    redirection.uninstall().unwrap();
}

#[test]
fn a_host_with_another_tools_probe_table_is_refused() {
    let node = NetnsGuard::create("node").unwrap();
    nft_in(&node, "add table inet istio-ambient-nat\n");
    let before = ruleset(&node);
    let err = NftablesRedirection::new(open(&node)).unwrap_err();
    assert!(matches!(err, NftablesError::ForeignTables { .. }), "{err}");
    assert_eq!(ruleset(&node), before);
}

/// A script standing in for `nft`: `body` is sh, with the real nft as
/// `$REAL`.
fn fake_nft(dir: &std::path::Path, body: &str) -> PathBuf {
    let real = crate::redirect::in_pod::tools::find_binary("nft").unwrap();
    let path = dir.join("nft");
    // Written by a child process, never opened for writing here: a fork by
    // another test thread while this process held the file open would keep
    // it open for writing, and exec'ing it would fail with ETXTBSY.
    let script = format!("#!/bin/sh\nREAL={}\n{body}\n", real.display());
    let mut writer = Command::new("sh")
        .args(["-c", "cat > \"$1\" && chmod 755 \"$1\"", "sh"])
        .arg(&path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = writer.stdin.take().unwrap();
        stdin.write_all(script.as_bytes()).unwrap();
    }
    assert!(
        writer.wait().unwrap().success(),
        "writing {}",
        path.display()
    );
    path
}

#[test]
fn an_old_nft_or_one_without_json_is_refused_before_anything_is_written() {
    let dir = tempfile_dir();
    let node = NetnsGuard::create("node").unwrap();
    let old = fake_nft(
        dir.path(),
        "[ \"$1\" = --version ] && { echo 'nftables v0.9.8 (E.D.S.)'; exit 0; }\nexec $REAL \"$@\"",
    );
    let err = Nft::at(old, &open(&node)).unwrap_err();
    assert!(matches!(err, NftablesError::TooOld { .. }), "{err}");
    assert!(err.to_string().contains("nftables 0.9.8") && err.to_string().contains("1.0.1"));

    let no_json = fake_nft(
        dir.path(),
        "for a in \"$@\"; do [ \"$a\" = -j ] && { echo 'Error: JSON support not compiled-in' >&2; exit 1; }; done\nexec $REAL \"$@\"",
    );
    let err = Nft::at(no_json, &open(&node)).unwrap_err();
    assert!(matches!(err, NftablesError::NoJson { .. }), "{err}");
    assert!(
        err.to_string().contains("JSON support not compiled-in"),
        "{err}"
    );
    assert_eq!(ruleset(&node), "", "nothing written");
    assert!(
        NftablesError::Missing
            .to_string()
            .starts_with("nft not found in $PATH")
    );
}

struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> TempDir {
    let dir = std::env::temp_dir().join(format!("ambpf-nft-{}", ambpf_testbed::unique_name("")));
    std::fs::create_dir(&dir).unwrap();
    TempDir(dir)
}
