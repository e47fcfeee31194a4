//! The redirection end to end. Privileged: real namespaces, real iptables.

use std::process::Command;

use ambpf_testbed::{NetnsGuard, PodAndNode};

use super::*;
use crate::redirect::in_pod::tools::{find_binary, run_in};

pub(super) fn open(guard: &NetnsGuard) -> Netns {
    Netns::open(guard.path().to_str().unwrap()).unwrap()
}

fn dns(dns_capture: bool) -> EnrollOptions {
    EnrollOptions { dns_capture }
}

/// Every line of every table of `ns`, for both backends and families.
fn everything(ns: &Netns) -> Vec<String> {
    let mut out = Vec::new();
    for backend in [IptablesBackend::Nft, IptablesBackend::Legacy] {
        for family in Family::ALL {
            let save = run_in(
                ns,
                &find_binary(&backend.binary(family, "save")).unwrap(),
                &[],
                None,
            )
            .unwrap();
            // Without the built-in chains' packet counters.
            out.extend(
                save.lines()
                    .filter(|l| !l.starts_with('#'))
                    .map(|l| match l.split_once(" [") {
                        Some((chain, _)) if l.starts_with(':') => chain.to_owned(),
                        _ => l.to_owned(),
                    })
                    .map(|l| format!("{backend} {family}: {l}")),
            );
        }
    }
    out
}

fn istio_lines(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| l.contains("ISTIO_")).collect()
}

#[test]
fn enrol_reenrol_unenrol_and_remove_with_each_backend() {
    for backend in [IptablesBackend::Nft, IptablesBackend::Legacy] {
        let pn = PodAndNode::create().unwrap();
        let (pod, node) = (open(&pn.pod), open(&pn.node));
        let mut redirection = IptablesRedirection::new(open(&pn.node), backend).unwrap();
        assert_eq!(redirection.backend(), backend);

        // Host: the SNAT chain, jumped to first, in this backend only.
        for family in Family::ALL {
            let saved = redirection.saved_rules(&node, family).unwrap();
            let postrt = saved.chain_rules("nat", CHAIN_POSTROUTING);
            assert_eq!(postrt.len(), 1, "{backend} {family}: {postrt:?}");
            assert!(
                postrt[0].contains(family.probe_ipset())
                    && postrt[0].contains(&family.probe_snat().to_string()),
                "{postrt:?}"
            );
        }

        let enrolled = redirection.enroll(&pod, dns(true)).unwrap();
        assert_eq!(enrolled.netns_inode, pod.inode());
        assert_eq!(
            enrolled.addresses,
            vec![
                IpAddr::V4(PodAndNode::POD.v4),
                IpAddr::V6(PodAndNode::POD.v6)
            ]
        );
        assert_eq!(enrolled.interfaces, ["eth0"]);
        assert_eq!(redirection.enrolled().unwrap(), [enrolled.key()]);
        assert_eq!(
            probe_set_members(&node, Family::V4).unwrap(),
            [IpAddr::V4(PodAndNode::POD.v4)]
        );
        // Each member names the pod that owns it.
        assert_eq!(
            probe_set_entries(&node, Family::V4).unwrap()[0].netns_cookie,
            Some(enrolled.netns_cookie)
        );
        assert!(
            redirection
                .check(&[(enrolled.key(), &pod)], CheckScope::Full)
                .is_empty()
        );
        assert_eq!(
            probe_set_members(&node, Family::V6).unwrap(),
            [IpAddr::V6(PodAndNode::POD.v6)]
        );
        let status = routing::reply_routing_status(&pod).unwrap();
        assert!(status.ipv4.rule && status.ipv4.route, "{status:?}");
        assert!(status.ipv6.is_some_and(|s| s.rule && s.route), "{status:?}");
        assert!(!status.tcp_fwmark_accept, "iptables mode sets no sysctl");

        for family in Family::ALL {
            let saved = redirection.saved_rules(&pod, family).unwrap();
            assert_eq!(saved.tables_with_istio_chains(), ["mangle", "nat", "raw"]);
            let count = |table, chain| saved.chain_rules(table, chain).len();
            assert_eq!(count("nat", CHAIN_OUTPUT), 6, "{backend} {family}");
            assert_eq!(count("nat", CHAIN_PREROUTING), 2);
            assert_eq!(count("mangle", CHAIN_OUTPUT), 1);
            assert_eq!(count("raw", CHAIN_PREROUTING), 1);
        }
        let first = everything(&pod);
        assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::Ambpf);
        assert_eq!(find_pod_rules(&node).unwrap(), PodRulesFound::None);

        // Again: nothing changes.
        redirection.enroll(&pod, dns(true)).unwrap();
        assert_eq!(everything(&pod), first, "{backend}: enrolling twice");

        // Without DNS capture: the DNS rules and the raw table go.
        redirection.enroll(&pod, dns(false)).unwrap();
        for family in Family::ALL {
            let saved = redirection.saved_rules(&pod, family).unwrap();
            assert_eq!(saved.tables_with_istio_chains(), ["mangle", "nat"]);
            assert_eq!(saved.chain_rules("nat", CHAIN_OUTPUT).len(), 4);
        }
        redirection.enroll(&pod, dns(true)).unwrap();
        assert_eq!(everything(&pod), first, "{backend}: DNS capture back on");

        // Opt-out, as Istio's `DeleteInpodRules`: every chain of every
        // table, the policy routing and the probe entries go.
        assert!(redirection.unenroll(enrolled.key()).unwrap());
        assert!(!redirection.unenroll(enrolled.key()).unwrap());
        assert!(redirection.enrolled().unwrap().is_empty());
        for family in Family::ALL {
            assert!(probe_set_members(&node, family).unwrap().is_empty());
            let saved = redirection.saved_rules(&pod, family).unwrap();
            assert!(saved.tables_with_istio_chains().is_empty(), "{family}");
        }
        let status = routing::reply_routing_status(&pod).unwrap();
        assert!(!status.ipv4.rule && !status.ipv4.route, "{status:?}");
        assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::None);

        // Without DNS capture (no raw chains: Istio's raw commands fail
        // and are ignored), the opt-out leaves nothing either.
        let enrolled = redirection.enroll(&pod, dns(false)).unwrap();
        assert!(redirection.unenroll(enrolled.key()).unwrap());
        assert!(istio_lines(&everything(&pod)).is_empty());

        // Full removal leaves the pod as it was.
        redirection.enroll(&pod, dns(true)).unwrap();
        remove_pod_rules(&pod).unwrap();
        remove_pod_rules(&pod).unwrap();
        assert!(
            istio_lines(&everything(&pod)).is_empty(),
            "{:#?}",
            everything(&pod)
        );
        let status = routing::reply_routing_status(&pod).unwrap();
        assert!(!status.ipv4.rule && !status.ipv4.route, "{status:?}");
        assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::None);

        // Uninstall cleans the host, pods enrolled at the time included.
        redirection.enroll(&pod, dns(true)).unwrap();
        redirection.uninstall().unwrap();
        assert!(istio_lines(&everything(&pod)).is_empty());
        assert!(
            istio_lines(&everything(&node)).is_empty(),
            "{:#?}",
            everything(&node)
        );
        let sets = node.run(|| {
            Command::new("ipset")
                .args(["list", "-name"])
                .output()
                .unwrap()
        });
        assert!(sets.unwrap().stdout.is_empty());
        // Nothing left to remove.
        assert!(!remove_host_rules(&node).unwrap());
    }
}

#[test]
fn a_pod_without_addresses_is_refused() {
    let host = NetnsGuard::create("host").unwrap();
    let empty = NetnsGuard::create("lo").unwrap();
    let mut redirection = IptablesRedirection::new(open(&host), IptablesBackend::Nft).unwrap();
    let err = redirection.enroll(&open(&empty), dns(true)).unwrap_err();
    assert!(matches!(err, EnrollError::NoAddress { .. }), "{err}");
    assert!(redirection.enrolled().unwrap().is_empty());
    assert!(istio_lines(&everything(&open(&empty))).is_empty());
}

fn records_dir() -> (std::path::PathBuf, impl Drop) {
    struct Remove(std::path::PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let root = std::env::temp_dir().join(format!(
        "ambpf-iptables-records-{}",
        ambpf_testbed::unique_name("")
    ));
    (root.join("iptables/pods"), Remove(root))
}

fn recorded(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// An agent stops with three pods; meanwhile one pod is deleted and one
/// leaves the mesh. The next agent lists all three as enrolled; removing the
/// two that left takes everything of theirs, the third keeps its rules.
#[test]
fn a_new_agent_removes_the_pods_that_left_while_none_ran() {
    use ambpf_testbed::cluster::Cluster;
    let mut cluster = Cluster::create(3).unwrap();
    let (dir, _remove) = records_dir();
    let pods: Vec<Netns> = cluster.pods.iter().map(|p| open(&p.ns)).collect();
    let keys: Vec<PodKey> = {
        let mut first = IptablesRedirection::new(open(&cluster.node), IptablesBackend::Auto)
            .unwrap()
            .with_records(dir.clone());
        let keys = pods
            .iter()
            .map(|pod| first.enroll(pod, dns(true)).unwrap().key())
            .collect();
        // The agent stops without removing anything.
        keys
    };
    assert_eq!(recorded(&dir).len(), 3);
    let (kept, opted_out, deleted) = (keys[0], keys[1], keys[2]);
    drop(pods);
    // Pod 2 is deleted; its addresses go to a new pod in a new namespace.
    cluster.recycle_pod(2).unwrap();
    // A malformed record is dropped, not fatal.
    std::fs::create_dir(dir.join("not-a-record")).unwrap();

    let mut second = IptablesRedirection::new(open(&cluster.node), IptablesBackend::Auto)
        .unwrap()
        .with_records(dir.clone());
    let mut listed = second.enrolled().unwrap();
    listed.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(listed, expected);
    // The pod still wanted is enrolled again; the adopted members are no
    // violation meanwhile.
    let node = open(&cluster.node);
    let (pod0, pod1) = (open(&cluster.pods[0].ns), open(&cluster.pods[1].ns));
    assert_eq!(second.enroll(&pod0, dns(true)).unwrap().key(), kept);
    assert_eq!(second.check(&[], CheckScope::Records), []);
    assert!(second.unenroll(opted_out).unwrap());
    assert!(second.unenroll(deleted).unwrap());
    assert!(!second.unenroll(deleted).unwrap());
    assert_eq!(second.enrolled().unwrap(), [kept]);
    assert_eq!(
        recorded(&dir),
        [format!("{}-{}", kept.netns_cookie, kept.netns_inode)]
    );

    // The pod that opted out keeps nothing: no rule, route or probe member.
    assert!(istio_lines(&everything(&pod1)).is_empty());
    let status = routing::reply_routing_status(&pod1).unwrap();
    assert!(!status.ipv4.rule && !status.ipv4.route, "{status:?}");
    for family in Family::ALL {
        let members = probe_set_entries(&node, family).unwrap();
        assert_eq!(members.len(), 1, "{family}: {members:?}");
        assert_eq!(members[0].netns_cookie, Some(kept.netns_cookie));
    }
    // The pod that stays keeps its capture.
    for family in Family::ALL {
        assert!(second.saved_rules(&pod0, family).unwrap().captures());
    }
    let pod0_key = (kept, &pod0);
    assert_eq!(second.check(&[pod0_key], CheckScope::Full), []);
    second.uninstall().unwrap();
    assert!(!dir.exists());
}

/// Capture in a namespace of the node no pod is enrolled in (an agent that
/// stopped without a record of it) is a violation the repair removes; an
/// opted-out pod (nothing left) and a sidecar's chains are not.
#[test]
fn the_full_check_removes_capture_no_enrolled_pod_owns() {
    use ambpf_testbed::cluster::Cluster;
    let cluster = Cluster::create(4).unwrap();
    let [stray, unenrolled, enrolled, sidecar] = [0, 1, 2, 3].map(|i| open(&cluster.pods[i].ns));
    // An Istio sidecar's chains, beside a policy rule like ambpf's.
    let restore = find_binary("iptables-nft-restore").unwrap();
    let sidecar_rules = "*nat\n:ISTIO_INBOUND - [0:0]\n:ISTIO_OUTPUT - [0:0]\n\
                         -A PREROUTING -p tcp -j ISTIO_INBOUND\n-A OUTPUT -p tcp -j ISTIO_OUTPUT\n\
                         -A ISTIO_INBOUND -p tcp -j REDIRECT --to-ports 15006\n\
                         -A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN\nCOMMIT\n";
    run_in(&sidecar, &restore, &["--noflush"], Some(sidecar_rules)).unwrap();
    routing::install_policy_routing(&sidecar).unwrap();
    {
        let mut earlier =
            IptablesRedirection::new(open(&cluster.node), IptablesBackend::Auto).unwrap();
        earlier.enroll(&stray, dns(true)).unwrap();
        let key = earlier.enroll(&unenrolled, dns(false)).unwrap().key();
        earlier.unenroll(key).unwrap();
    }
    let mut agent = IptablesRedirection::new(open(&cluster.node), IptablesBackend::Auto).unwrap();
    let key = agent.enroll(&enrolled, dns(true)).unwrap().key();
    let found = agent.check(&[(key, &enrolled)], CheckScope::Full);
    let mut kinds: Vec<ViolationKind> = found.iter().map(|v| v.kind).collect();
    kinds.sort();
    // The earlier agent's probe members of the stray pod are orphans too.
    assert_eq!(
        kinds,
        [
            ViolationKind::CaptureOrphan,
            ViolationKind::ProbeSetOrphan,
            ViolationKind::ProbeSetOrphan
        ],
        "{found:#?}"
    );
    let violation = found
        .iter()
        .find(|v| v.kind == ViolationKind::CaptureOrphan)
        .unwrap();
    assert_eq!(violation.netns.as_deref(), Some(stray.path()));
    for what in [
        stray.path().display().to_string(),
        "nat ISTIO_OUTPUT".to_owned(),
        "raw ISTIO_PRERT".to_owned(),
        "IPv4 rule".to_owned(),
    ] {
        assert!(violation.detail.contains(&what), "{what}: {violation}");
    }
    assert_eq!(agent.repair(&found), []);
    assert!(istio_lines(&everything(&stray)).is_empty());
    assert!(!routing::reply_routing_status(&stray).unwrap().ipv4.rule);
    for family in Family::ALL {
        let members = probe_set_entries(&open(&cluster.node), family).unwrap();
        assert_eq!(members.len(), 1, "{family}: {members:?}");
    }
    // The opted-out pod has nothing left; the enrolled pod keeps its capture.
    assert!(istio_lines(&everything(&unenrolled)).is_empty());
    assert!(!istio_lines(&everything(&sidecar)).is_empty());
    assert!(agent.saved_rules(&enrolled, Family::V4).unwrap().captures());
    assert_eq!(agent.check(&[(key, &enrolled)], CheckScope::Full), []);
    agent.uninstall().unwrap();
}

/// Processes started on this thread by `f`.
fn processes_started(f: impl FnOnce()) -> u64 {
    let before = crate::redirect::in_pod::tools::PROCESSES_STARTED.with(|n| n.get());
    f();
    crate::redirect::in_pod::tools::PROCESSES_STARTED.with(|n| n.get()) - before
}

#[test]
fn a_pod_costs_the_processes_istios_node_agent_runs_for_it() {
    let pn = PodAndNode::create().unwrap();
    let pod = open(&pn.pod);
    let mut redirection = IptablesRedirection::new(open(&pn.node), IptablesBackend::Auto).unwrap();
    let families = redirection.tools.families.len() as u64;
    // Add: per family, `iptables-save` and one `iptables-restore
    // --noflush`; the probe ipset and the policy routing over netlink.
    let mut key = None;
    let add = processes_started(|| key = Some(redirection.enroll(&pod, dns(true)).unwrap().key()));
    assert_eq!(add, 2 * families);
    // Leaving the mesh: Istio's `DeleteInpodRules`, per family 18
    // `iptables` commands (six jumps deleted, then both chains flushed and
    // deleted in mangle, nat and raw); the policy routing and the probe
    // ipset over netlink.
    let remove = processes_started(|| {
        assert!(redirection.unenroll(key.unwrap()).unwrap());
    });
    assert_eq!(remove, 18 * families);

    // Deleted: none. The probe ipset member goes, the namespace's rules
    // stay (they die with it), as with Istio.
    let key = redirection.enroll(&pod, dns(true)).unwrap().key();
    let node = open(&pn.node);
    assert!(!probe_set_entries(&node, Family::V4).unwrap().is_empty());
    let forget = processes_started(|| assert!(redirection.forget_deleted(key).unwrap()));
    assert_eq!(forget, 0);
    assert!(probe_set_entries(&node, Family::V4).unwrap().is_empty());
    assert!(
        !istio_lines(&everything(&pod)).is_empty(),
        "rules left in place"
    );
    assert!(redirection.enrolled().unwrap().is_empty());
}
