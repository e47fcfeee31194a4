//! Rule fidelity: a pod enrolled by Istio's own node agent and one enrolled
//! by ambpf in the same backend (iptables mode against Istio's iptables
//! backend, nftables mode against its native nftables backend) must show
//! the same in-pod rules, host probe rules and policy routing, read back
//! with the kernel's tools ([`rule_dump`]). Every difference fails the
//! scenario unless it is one of [`EXPLAINED`], each of which
//! docs/parity.md ("Against Istio's own node agent") gives the reason for.
//!
//! It runs as a scenario rather than a phase of its own because it needs
//! what a scenario has (ambpf installed in the mode, the ztunnel double)
//! and must leave the same for the next: it reads ambpf's pod first, then
//! swaps ambpf's release for Istio's chart, reads Istio's pod, swaps back
//! and checks the node holds nothing of Istio's. It runs on an install of
//! its own after every mode's other scenarios (`scenarios::ISOLATED`), so
//! no other ambient pod is on the node for Istio's agent to enrol and leave
//! its rules in, and nothing the swap leaves can touch another scenario.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};

use super::client::{Cluster, Release};
use super::eventually;
use super::node_state::NodeState;
use super::rule_dump::{
    Difference, PodIdentity, Section, Side, differences, node_is_clean, node_sections,
    pod_sections, sandbox_pid,
};

/// A difference between Istio's agent and ambpf that has a reason (given in
/// docs/parity.md, "Against Istio's own node agent"): a line, without its
/// indentation, that only one side has.
pub struct Explained {
    pub mode: &'static str,
    pub section: &'static str,
    pub side: Side,
    pub line: &'static str,
}

const fn only_ambpf(mode: &'static str, section: &'static str, line: &'static str) -> Explained {
    Explained {
        mode,
        section,
        side: Side::Ambpf,
        line,
    }
}

const fn only_istio(mode: &'static str, section: &'static str, line: &'static str) -> Explained {
    Explained {
        mode,
        section,
        side: Side::Istio,
        line,
    }
}

const POD_NFT: &str = "pod nft list ruleset";
const NODE_NFT: &str = "node nft list ruleset";
const PROBE_IPSET: &str = "node ipset istio-inpod-probes-v4";

/// Every difference ambpf keeps, by mode; docs/parity.md says why.
pub const EXPLAINED: &[Explained] = &[
    // ambpf's tables say whose they are.
    only_ambpf(
        "nftables",
        POD_NFT,
        r#"comment "ambpf: Istio ambient redirection""#,
    ),
    only_ambpf(
        "nftables",
        NODE_NFT,
        r#"comment "ambpf: Istio ambient redirection""#,
    ),
    // A probe set member names its owner by netns cookie, not pod UID.
    only_istio(
        "nftables",
        NODE_NFT,
        r#"comment "UUID of the pods that are part of ambient mesh""#,
    ),
    only_ambpf("nftables", NODE_NFT, r#"comment "ambient pods' addresses""#),
    only_istio(
        "nftables",
        NODE_NFT,
        r#"elements = { <pod-ip> comment "<pod-uid>" }"#,
    ),
    only_ambpf(
        "nftables",
        NODE_NFT,
        r#"elements = { <pod-ip> comment "netns cookie <cookie>" }"#,
    ),
    only_istio("iptables", PROBE_IPSET, r#"<pod-ip> comment "<pod-uid>""#),
    only_ambpf(
        "iptables",
        PROBE_IPSET,
        r#"<pod-ip> comment "netns cookie <cookie>""#,
    ),
    // Probes told apart by a local socket, not by kubelet's UID.
    only_istio(
        "nftables",
        NODE_NFT,
        "meta l4proto tcp meta skuid 0 ip daddr @istio-inpod-probes-v4 counter snat ip to 169.254.7.127",
    ),
    only_ambpf(
        "nftables",
        NODE_NFT,
        "meta l4proto tcp meta skuid >= 0 ip daddr @istio-inpod-probes-v4 counter snat ip to 169.254.7.127",
    ),
    only_istio(
        "nftables",
        NODE_NFT,
        "meta l4proto tcp meta skuid 0 ip6 daddr @istio-inpod-probes-v6 counter snat ip6 to fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
    ),
    only_ambpf(
        "nftables",
        NODE_NFT,
        "meta l4proto tcp meta skuid >= 0 ip6 daddr @istio-inpod-probes-v6 counter snat ip6 to fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
    ),
];

/// Istio's values that set what ambpf decides alone: ambpf writes IPv6
/// rules, in the pod and on the node, whenever the kernel has IPv6 (as
/// Istio's default `ambient.ipv6=true` does); the node's own values
/// (`istio_cni_helm_values`) turn Istio's off because the node has no IPv6
/// network.
const ISTIO_AS_AMBPF: &[(&str, &str)] = &[("ambient.ipv6", "true")];

/// The modes with an Istio backend to compare against.
pub fn compared_mode(mode: &str) -> bool {
    matches!(mode, "iptables" | "nftables")
}

/// The scenario: ambpf's dump, Istio's dump, the differences.
pub fn rule_fidelity(cluster: &Cluster, release: &Release) -> Result<String> {
    let namespace = format!("e2e-{}-fidelity", release.mode);
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n  labels: \
         {{istio.io/dataplane-mode: ambient}}\n"
    ))?;
    let ambpf = enrol_and_read(cluster, &namespace, "ambpf")?;
    cluster.helm_uninstall()?;
    let istio = with_istio_agent(cluster, release.mode == "nftables", || {
        enrol_and_read(cluster, &namespace, "istio")
    });
    // ambpf goes back whatever Istio's agent did, for the scenarios after.
    let reinstalled = cluster.helm_install(&release.chart, &release.mode);
    cluster.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    let (istio, left) = istio?;
    reinstalled.context("reinstalling ambpf after Istio's agent")?;

    let found = differences(&istio, &ambpf)?;
    let explained: Vec<&Explained> = EXPLAINED
        .iter()
        .filter(|e| e.mode == release.mode)
        .collect();
    let unexplained: Vec<String> = found
        .iter()
        .filter(|d| !explained.iter().any(|e| matches(e, d)))
        .map(ToString::to_string)
        .collect();
    // An explanation no difference needs is stale: the list must stay the
    // differences there are.
    let stale: Vec<String> = explained
        .iter()
        .filter(|e| !found.iter().any(|d| matches(e, d)))
        .map(|e| format!("[{}] {:?}: {}", e.section, e.side, e.line))
        .collect();
    ensure!(
        unexplained.is_empty() && stale.is_empty() && left.is_empty(),
        "{} unexplained difference(s) from Istio's agent:\n{}\n{} explained but not seen:\n{}\n\
         Istio's agent left on the node:\n{}",
        unexplained.len(),
        unexplained.join("\n"),
        stale.len(),
        stale.join("\n"),
        left.join("\n")
    );
    Ok(format!(
        "{} sections the same as Istio's agent's but for {} explained line(s)",
        ambpf.len(),
        found.len()
    ))
}

fn matches(explained: &Explained, difference: &Difference) -> bool {
    explained.section == difference.section
        && explained.side == difference.side
        && explained.line == difference.line.trim_start()
}

/// Istio's agent installed (`nftables` picks its backend) while `read`
/// runs, then uninstalled; with what `read` returned, what its uninstall
/// left on the node: the CNI configuration or plugins unlike before its
/// install, or an Istio chain, table or set.
fn with_istio_agent(
    cluster: &Cluster,
    nftables: bool,
    read: impl FnOnce() -> Result<Vec<Section>>,
) -> Result<(Vec<Section>, Vec<String>)> {
    let before = NodeState::read(cluster)?;
    cluster.install_istio_cni_with(nftables, ISTIO_AS_AMBPF)?;
    let sections = read();
    cluster.uninstall_istio_cni()?;
    let sections = sections.map_err(|e| e.context(cluster.istio_cni_diagnostics()))?;
    restore_reserialised_cni_config(cluster, &before)?;
    let after = NodeState::read(cluster)?;
    let mut left = before.diff(&after);
    let nobody = PodIdentity {
        ip: String::new(),
        uid: String::new(),
    };
    left.extend(node_is_clean(&node_sections(cluster, &nobody)?));
    Ok((sections, left))
}

/// Istio's agent takes itself out of the conflist by writing the JSON
/// back re-serialised (keys sorted, a final newline): the same
/// configuration in other bytes. Where a file holds the same JSON as
/// before, its bytes are put back, so that the suite's byte-for-byte check
/// of the node after ambpf's uninstall still compares with what the node
/// had; a file with other content is left for the check to report.
fn restore_reserialised_cni_config(cluster: &Cluster, before: &NodeState) -> Result<()> {
    let after = NodeState::read(cluster)?;
    for (file, was) in &before.cni_config {
        let now = after.cni_config.iter().find(|(f, _)| f == file);
        let Some((_, now)) = now else { continue };
        let parse = |text: &str| serde_json::from_str::<serde_json::Value>(text).ok();
        let same_json = parse(was).is_some() && parse(was) == parse(now);
        if now != was && same_json {
            let path = format!("/etc/cni/net.d/{file}");
            let mut tee = crate::kube::in_node(&cluster.layout, "tee");
            tee.arg(&path).stdout(std::process::Stdio::null());
            let out = crate::output_with_stdin(&mut tee, was.as_bytes())?;
            ensure!(out.status.success(), "restoring {path}: {out:?}");
        }
    }
    Ok(())
}

/// A fresh ambient pod, enrolled by the installed agent (`agent` names it
/// in messages), read from inside and from the node, then deleted; the
/// pod is gone when this returns, so the agent has let go of it.
fn enrol_and_read(cluster: &Cluster, namespace: &str, agent: &str) -> Result<Vec<Section>> {
    let name = format!("fidelity-{agent}");
    cluster.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: {app}
    imagePullPolicy: Never
    command: ["sleep", "3600"]
"#,
        app = crate::kube::images::APP,
    ))?;
    let read = || -> Result<Vec<Section>> {
        // `pending` is Istio's partial enrolment (rules written, ztunnel's
        // answer not yet in), which it retries: only `enabled` is done.
        // Istio's agent annotates from inside the CNI ADD, before kubelet
        // has reported the pod's address, so the wait is for both.
        let identity = eventually(
            &format!("{namespace}/{name} enrolled by {agent}, with its address"),
            Duration::from_secs(60),
            || {
                let pod = cluster.get_json(&["pod", "-n", namespace, &name])?;
                let enabled = pod["metadata"]["annotations"][super::scenarios::REDIRECTION]
                    .as_str()
                    .is_some_and(|state| state == "enabled");
                let field =
                    |value: &serde_json::Value| value.as_str().unwrap_or_default().to_owned();
                let identity = PodIdentity {
                    ip: field(&pod["status"]["podIP"]),
                    uid: field(&pod["metadata"]["uid"]),
                };
                Ok((enabled && !identity.ip.is_empty()).then_some(identity))
            },
        )?;
        let pid = sandbox_pid(cluster, &identity.uid)?;
        let mut sections = pod_sections(cluster, pid, &identity)?;
        sections.extend(node_sections(cluster, &identity)?);
        ensure_captured(&sections, agent)?;
        Ok(sections)
    };
    let sections = read();
    cluster.kubectl(&[
        "delete",
        "pod",
        "-n",
        namespace,
        &name,
        "--wait=true",
        "--timeout=60s",
    ])?;
    sections
}

/// Fails unless the dump holds the capture itself (the redirects to
/// ztunnel's outbound and inbound ports) and a probe rule on the node: two
/// agents that both wrote nothing would otherwise compare equal.
fn ensure_captured(sections: &[Section], agent: &str) -> Result<()> {
    let has = |prefix: &str, needle: &str| {
        sections
            .iter()
            .filter(|s| s.name.starts_with(prefix))
            .any(|s| s.lines.iter().any(|l| l.contains(needle)))
    };
    for (prefix, needle, what) in [
        ("pod ", "15001", "an outbound redirect to 15001 in the pod"),
        ("pod ", "15006", "an inbound redirect to 15006 in the pod"),
        ("pod ip -4 rule", "lookup 100", "the pod's policy rule"),
        ("node ", "169.254.7.127", "the node's probe SNAT"),
        (
            "node ",
            "<pod-ip>",
            "the pod's address in the node's probe set",
        ),
    ] {
        ensure!(has(prefix, needle), "{agent}'s dump has no {what}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(name: &str, lines: &[&str]) -> Section {
        Section {
            name: name.to_owned(),
            lines: lines.iter().map(|l| (*l).to_owned()).collect(),
        }
    }

    #[test]
    fn a_dump_without_capture_is_refused() {
        let mut dump = vec![
            section(
                "pod iptables-legacy-save ",
                &[
                    "-A ISTIO_OUTPUT -j REDIRECT --to-ports 15001",
                    "--to-ports 15006",
                ],
            ),
            section(
                "pod ip -4 rule",
                &["32764: from all fwmark 0x111/0xfff lookup 100"],
            ),
            section(
                "node ipset istio-inpod-probes-v4",
                &["<pod-ip> comment \"<pod-uid>\""],
            ),
        ];
        assert!(ensure_captured(&dump, "x").is_err(), "no SNAT rule");
        dump.push(section(
            "node iptables-legacy-save",
            &["nat: -A ISTIO_POSTRT -j SNAT --to-source 169.254.7.127"],
        ));
        ensure_captured(&dump, "x").unwrap();
        dump[0].lines.clear();
        assert!(ensure_captured(&dump, "x").is_err(), "no redirect");
    }

    #[test]
    fn every_explanation_names_a_compared_mode_and_a_section() {
        for e in EXPLAINED {
            assert!(compared_mode(e.mode), "{}", e.mode);
            assert!(e.section.starts_with("pod ") || e.section.starts_with("node "));
        }
    }
}
