//! What the agent may have installed inside a network namespace, read with
//! the tools an operator would use (`bpftool`, `tc`, `ip`, `iptables-save`):
//! ambpf's sk_lookup link into the namespace (its inbound capture), an
//! earlier agent's steering filter (priority 1, handle 0xa3bf), the
//! reply-routing rule
//! (`fwmark 0x111/0xfff lookup 100`) and table 100's route, for IPv4 and
//! IPv6, and Istio's `ISTIO_*` iptables chains.

use std::process::Command;

use anyhow::{Context as _, Result};

/// The handle of ambpf's steering filter, as `tc` prints it.
const STEERING_HANDLE: &str = "0xa3bf";
const REPLY_TABLE: &str = "100";

/// Each piece installed in namespace `ns` (a name under /run/netns),
/// looking for filters on `ifaces`, named; empty when there is none.
pub fn installed(ns: &str, ifaces: &[&str], iptables: bool) -> Result<Vec<String>> {
    let mut found = Vec::new();
    if sk_lookup_linked(ns)? {
        found.push("sk_lookup link".to_owned());
    }
    for iface in ifaces {
        let filters = run("tc", &["-n", ns, "filter", "show", "dev", iface, "ingress"])?;
        if filters.contains(STEERING_HANDLE) {
            found.push(format!("steering filter on {iface}"));
        }
    }
    for family in ["-4", "-6"] {
        let rules = run("ip", &["-n", ns, family, "rule", "show"])?;
        for line in rules.lines() {
            if line.contains(&format!("lookup {REPLY_TABLE}")) {
                found.push(format!("rule `{}`", line.trim()));
            }
        }
        let routes = run(
            "ip",
            &["-n", ns, family, "route", "show", "table", REPLY_TABLE],
        )?;
        for line in routes.lines().filter(|l| !l.trim().is_empty()) {
            found.push(format!("route `{}` in table {REPLY_TABLE}", line.trim()));
        }
    }
    if iptables {
        for tool in ["iptables-save", "ip6tables-save"] {
            let saved = run("ip", &["netns", "exec", ns, tool])?;
            let chains = saved.lines().filter(|l| l.starts_with(":ISTIO")).count();
            if chains > 0 {
                found.push(format!("{chains} ISTIO chains ({tool})"));
            }
        }
    }
    Ok(found)
}

/// What a redirected pod must have: the filter on eth0 (eBPF mode) and both
/// families' rule and route; what is missing, named.
pub fn missing_for_redirected(found: &[String], ebpf: bool) -> Vec<&'static str> {
    let mut missing = Vec::new();
    let has = |what: &str| found.iter().any(|f| f.contains(what));
    if ebpf && !has("sk_lookup link") {
        missing.push("the sk_lookup link");
    }
    if !has("ISTIO") && !ebpf {
        missing.push("the ISTIO iptables chains");
    }
    let rules = found.iter().filter(|f| f.starts_with("rule")).count();
    let routes = found.iter().filter(|f| f.starts_with("route")).count();
    if rules < 2 {
        missing.push("the reply-routing rules (IPv4 and IPv6)");
    }
    if routes < 2 {
        missing.push("the table-100 routes (IPv4 and IPv6)");
    }
    missing
}

/// Only the reply routing (rules and table-100 routes): what the agent
/// leaves, by design, in a pod that stops being ambient while it lives.
pub fn only_reply_routing(found: &[String]) -> bool {
    found
        .iter()
        .all(|f| f.starts_with("rule") || f.starts_with("route"))
}

/// Whether an sk_lookup link runs in namespace `ns`.
fn sk_lookup_linked(ns: &str) -> Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(inode) = std::fs::metadata(format!("/run/netns/{ns}")).map(|m| m.ino()) else {
        return Ok(false);
    };
    Ok(crate::sk_lookup_linked(inode)?)
}

fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    // A namespace deleted meanwhile, or a tool missing: nothing to read.
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redirected_pod_needs_every_piece() {
        let all: Vec<String> = [
            "sk_lookup link",
            "rule `32764: from all fwmark 0x111/0xfff lookup 100`",
            "rule `32764: from all fwmark 0x111/0xfff lookup 100`",
            "route `local default dev lo scope host` in table 100",
            "route `local default dev lo metric 1024` in table 100",
        ]
        .map(str::to_owned)
        .into();
        assert!(missing_for_redirected(&all, true).is_empty());
        assert_eq!(
            missing_for_redirected(&all[1..], true),
            ["the sk_lookup link"]
        );
        assert_eq!(missing_for_redirected(&all[..4], true).len(), 1);
        assert_eq!(missing_for_redirected(&all, false).len(), 1);
        assert!(!only_reply_routing(&all));
        assert!(only_reply_routing(&all[1..]));
    }
}
