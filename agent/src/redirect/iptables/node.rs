//! Node-wide operations: reading what is installed, recognising ambpf's pods,
//! and removing everything the iptables mode wrote on a node.

use std::{net::IpAddr, path::PathBuf};

use super::{
    CHAIN_OUTPUT, CHAIN_POSTROUTING, CHAIN_PREROUTING, Family, IptablesBackend, IptablesError,
    ipset::IpsetSocket,
    nat_table,
    rules::{RuleSet, SavedRules, host_rules, pod_rules},
    tools::{Tools, families_in_use},
};
use crate::{
    netns::Netns,
    redirect::{EnrollError, routing},
};

/// The members of a host probe ipset.
pub fn probe_set_members(host: &Netns, family: Family) -> Result<Vec<IpAddr>, IptablesError> {
    let members = IpsetSocket::open(host)?.list(family.probe_ipset())?;
    Ok(members.into_iter().map(|m| m.address).collect())
}

/// The rules of `netns` for `family` with `backend` (not `Auto`), as
/// `iptables-save` prints them.
pub fn saved_rules(
    netns: &Netns,
    backend: IptablesBackend,
    family: Family,
) -> Result<SavedRules, IptablesError> {
    let tools = Tools::find(backend)?;
    tools.save(netns, family)
}

/// Removes everything the iptables mode writes in a pod's namespace (capture
/// and reply-path chains of every table, in each backend present, and the
/// policy routing), idempotently.
pub fn remove_pod_rules(netns: &Netns) -> Result<(), EnrollError> {
    for tools in Tools::available() {
        for family in families_in_use() {
            let owned = pod_rules(family, true);
            tools.apply(netns, &owned, &RuleSet::empty(family))?;
        }
    }
    routing::remove_policy_routing(netns)?;
    Ok(())
}

/// Removes the capture of the iptables mode from a pod's namespace (its
/// nat and raw chains, in each backend present), idempotently, and leaves
/// what connections opened before carry on with: the mangle chains of the
/// reply path, the nat table's built-in chains (so NAT stays hooked for the
/// connections already redirected) and the policy routing, which every
/// mode shares. For another mode taking the pod over
/// ([`crate::redirect::retire`]).
pub fn remove_pod_capture(netns: &Netns) -> Result<(), EnrollError> {
    for tools in Tools::available() {
        for family in families_in_use() {
            let owned = pod_rules(family, true).capture_only();
            tools.apply(netns, &owned, &RuleSet::empty(family))?;
        }
    }
    Ok(())
}

/// Removes the host rules (in each backend present), the nft `nat` tables
/// ambpf created for them once empty ([`nat_table`]), and then the probe
/// ipsets, idempotently. Returns whether any of them was there.
pub fn remove_host_rules(host: &Netns) -> Result<bool, IptablesError> {
    let mut found = false;
    for tools in Tools::available() {
        for family in families_in_use() {
            let owned = host_rules(family);
            found |= tools
                .save(host, family)?
                .has_chain("nat", CHAIN_POSTROUTING);
            tools.apply(host, &owned, &RuleSet::empty(family))?;
            if tools.backend == IptablesBackend::Nft {
                found |= nat_table::remove_if_owned_and_empty(host, family)?;
            }
        }
    }
    let mut ipset = IpsetSocket::open(host)?;
    for family in families_in_use() {
        if ipset.exists(family.probe_ipset())? {
            ipset.destroy(family.probe_ipset())?;
            found = true;
        }
    }
    Ok(found)
}

/// What of Istio's in-pod chains a namespace holds ([`find_pod_rules`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodRulesFound {
    /// None of the in-pod chains, in any table, backend or family.
    None,
    /// ambpf's: only chains of its in-pod rule set ([`pod_rules`]), holding
    /// only rules that jump where its rules jump.
    Ambpf,
    /// `ISTIO_*` chains or rules ambpf does not write (an Istio sidecar's
    /// `ISTIO_INBOUND`, ...), each as `<backend> <family>: <table> <chain>...`.
    Foreign(Vec<String>),
}

/// Whether `netns` holds ambpf's in-pod rules, read with every backend
/// present, for both families: how `ambpf uninstall` recognises a pod the
/// iptables mode enrolled without the agent's memory of it. A namespace
/// counts as ambpf's when it has one of the chains ambpf writes in pods
/// (`ISTIO_PRERT`, `ISTIO_OUTPUT` in mangle, nat and raw) and every
/// `ISTIO_*` chain in it is one of those, holding only rules that jump where
/// ambpf's rules there jump. So an Istio sidecar's namespace
/// (`ISTIO_INBOUND`, `ISTIO_REDIRECT`, `RETURN` rules, ...) is foreign and
/// left alone. The host side's `ISTIO_POSTRT` (another node's, in a nested
/// setup) counts for neither, and stays. Istio's own ambient node agent
/// writes the very same in-pod rules, so its pods cannot be told apart; the
/// two do not share a node (they would share the host's ipsets and
/// `ISTIO_POSTRT`).
pub fn find_pod_rules(netns: &Netns) -> Result<PodRulesFound, IptablesError> {
    Ok(scan_pod_rules(netns)?.found)
}

/// The capture part of ambpf's in-pod rules in `netns` (its nat and raw
/// chains, which send traffic to ztunnel), each as `<backend> <family>:
/// <table> <chain>`: empty when there is none, or when the namespace's
/// Istio chains are not all ambpf's ([`find_pod_rules`]), which are not
/// ambpf's to judge. What a pod keeps after unenrolment (the mangle chains
/// of the reply path) captures nothing.
pub fn find_pod_capture(netns: &Netns) -> Result<Vec<String>, IptablesError> {
    let scan = scan_pod_rules(netns)?;
    Ok(match scan.found {
        PodRulesFound::Ambpf => scan.capture,
        PodRulesFound::None | PodRulesFound::Foreign(_) => Vec::new(),
    })
}

/// Istio's in-pod capture chains in `netns` (nat and raw `ISTIO_PRERT` and
/// `ISTIO_OUTPUT`), whoever wrote them: Istio's node agent and ambpf's
/// iptables mode write the same rules. Each as `<backend> <family>: <table>
/// <chain>`.
pub fn find_any_pod_capture(netns: &Netns) -> Result<Vec<String>, IptablesError> {
    Ok(scan_pod_rules(netns)?.capture)
}

struct PodRulesScan {
    found: PodRulesFound,
    capture: Vec<String>,
}

fn scan_pod_rules(netns: &Netns) -> Result<PodRulesScan, IptablesError> {
    let mut found = false;
    let mut foreign = Vec::new();
    let mut capture = Vec::new();
    for tools in Tools::available() {
        for family in tools.families.keys().copied() {
            let saved = tools.save(netns, family)?;
            let owned = pod_rules(family, true);
            if !saved.has_any_chain_of(&owned) {
                continue;
            }
            found = true;
            let backend = tools.backend;
            foreign.extend(
                saved
                    .foreign_istio_chains(&owned, &host_rules(family))
                    .into_iter()
                    .map(|what| format!("{backend} {family}: {what}")),
            );
            for table in ["nat", "raw"] {
                for chain in [CHAIN_PREROUTING, CHAIN_OUTPUT] {
                    if saved.has_chain(table, chain) {
                        capture.push(format!("{backend} {family}: {table} {chain}"));
                    }
                }
            }
        }
    }
    let found = match (found, foreign.is_empty()) {
        (false, _) => PodRulesFound::None,
        (true, true) => PodRulesFound::Ambpf,
        (true, false) => PodRulesFound::Foreign(foreign),
    };
    Ok(PodRulesScan { found, capture })
}

/// What [`uninstall_node`] did.
#[derive(Debug)]
pub struct NodeUninstall {
    /// Each pod namespace given, by path, and how removing its rules and
    /// policy routing went.
    pub pods: Vec<(PathBuf, Result<(), EnrollError>)>,
    /// The host rules and ipsets: removed (`Ok(true)`), none there
    /// (`Ok(false)`), or `None` when kept because a pod still has its rules.
    pub host: Option<Result<bool, IptablesError>>,
}

impl NodeUninstall {
    /// The first failure, if any.
    pub fn into_result(self) -> Result<(), EnrollError> {
        for (_, result) in self.pods {
            result?;
        }
        match self.host {
            Some(Err(e)) => Err(e.into()),
            _ => Ok(()),
        }
    }
}

/// Removes the iptables mode's state from a node: everything in each of
/// `pods` ([`remove_pod_rules`]; every pod is attempted), then, once they
/// are all clean, the host rules and ipsets from `host`
/// ([`remove_host_rules`]). The host side stays while a pod still has its
/// capture rules, because that pod's kubelet probes are told apart by the
/// host's SNAT; running this again finishes the job.
pub fn uninstall_node<'a>(
    host: &Netns,
    pods: impl IntoIterator<Item = &'a Netns>,
) -> NodeUninstall {
    let pods: Vec<_> = pods
        .into_iter()
        .map(|netns| (netns.path().to_owned(), remove_pod_rules(netns)))
        .collect();
    let host = pods
        .iter()
        .all(|(_, result)| result.is_ok())
        .then(|| remove_host_rules(host));
    NodeUninstall { pods, host }
}
