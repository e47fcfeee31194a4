//! The redirection end to end. Privileged: real namespaces, real iptables.

use std::process::Command;

use ambpf_testbed::{NetnsGuard, PodAndNode};

use super::{tools::find_binary, *};

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

        // Unenrol: capture and probe entries gone, the reply path stays.
        assert!(redirection.unenroll(enrolled.key()).unwrap());
        assert!(!redirection.unenroll(enrolled.key()).unwrap());
        assert!(redirection.enrolled().unwrap().is_empty());
        for family in Family::ALL {
            assert!(probe_set_members(&node, family).unwrap().is_empty());
            let saved = redirection.saved_rules(&pod, family).unwrap();
            assert_eq!(saved.tables_with_istio_chains(), ["mangle"]);
        }
        assert!(routing::reply_routing_status(&pod).unwrap().ipv4.rule);
        assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::Ambpf);

        // Full removal leaves the pod as it was.
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
