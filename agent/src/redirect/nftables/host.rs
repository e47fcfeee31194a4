//! The host side: the probe sets' members and who owns each, and removing
//! the mode's state from a node (its pods' tables, then the host table).

use std::net::IpAddr;

use tracing::{info, warn};

use super::{
    NAT_TABLE, NftablesError, NftablesRedirection, POD_TABLES,
    rules::{add_elements, delete_elements, delete_tables, host_script, set_of},
    tool::Nft,
};
use crate::{
    netns::Netns,
    redirect::{
        AddressConflict, EnrollError, Violation, ViolationKind,
        claims::{Claim, Release},
        routing,
    },
};

const COMMENT_PREFIX: &str = "netns cookie ";

fn owner_comment(cookie: u64) -> String {
    format!("{COMMENT_PREFIX}{cookie}")
}

/// The pod a member's comment names (`None`: not ambpf's comment).
fn named_pod(comment: Option<&str>) -> Option<u64> {
    comment?.strip_prefix(COMMENT_PREFIX)?.parse().ok()
}

/// Every member of the probe sets of `host`, with the pod it names.
pub fn probe_set_entries(
    nft: &Nft,
    host: &Netns,
) -> Result<Vec<(IpAddr, Option<u64>)>, NftablesError> {
    let mut out = Vec::new();
    for set in super::probe_sets() {
        for (ip, comment) in nft.set_elements(host, NAT_TABLE, set)? {
            out.push((ip, named_pod(comment.as_deref())));
        }
    }
    Ok(out)
}

impl NftablesRedirection {
    /// Claims `addresses` for the pod `cookie`, releases what it claimed
    /// before (`previous`) and no longer has, and writes the members that
    /// change, one host transaction per address as Istio's node agent does
    /// (its host set takes each address in its own knftables transaction);
    /// none when nothing changes.
    pub(super) fn claim_probe_addresses(
        &mut self,
        cookie: u64,
        addresses: &[IpAddr],
        previous: &[IpAddr],
    ) -> Result<Vec<AddressConflict>, NftablesError> {
        let dropped: Vec<IpAddr> = previous
            .iter()
            .filter(|ip| !addresses.contains(ip))
            .copied()
            .collect();
        let mut scripts = self.release_scripts(cookie, &dropped);
        let mut conflicts = Vec::new();
        let mut added = Vec::new();
        for ip in addresses {
            let (other, won) = match self.claims.claim(*ip, cookie) {
                Claim::Owner { displaced } => {
                    if !previous.contains(ip) || displaced.is_some() {
                        added.push((*ip, owner_comment(cookie)));
                    }
                    match displaced {
                        Some(other) => (other, true),
                        None => continue,
                    }
                }
                Claim::Outranked { owner } => (owner, false),
            };
            conflicts.push(AddressConflict {
                address: *ip,
                other_netns_cookie: other,
                won,
            });
        }
        scripts.extend(
            self.in_use(added)
                .iter()
                .map(|member| add_elements(std::slice::from_ref(member))),
        );
        self.apply_host_each(&scripts)?;
        Ok(conflicts)
    }

    /// Drops the pod `cookie`'s claims on `addresses`, one transaction per
    /// address that changes.
    pub(super) fn release_probe_addresses(
        &mut self,
        cookie: u64,
        addresses: &[IpAddr],
    ) -> Result<(), NftablesError> {
        let scripts = self.release_scripts(cookie, addresses);
        self.apply_host_each(&scripts)
    }

    /// The members to delete, or to hand to the pod that claims them next:
    /// one script per address.
    fn release_scripts(&mut self, cookie: u64, addresses: &[IpAddr]) -> Vec<String> {
        let (mut gone, mut passed) = (Vec::new(), Vec::new());
        for ip in addresses {
            match self.claims.release(*ip, cookie) {
                Release::NotOwner => {}
                Release::Delete => gone.push(*ip),
                Release::PassTo(next) => {
                    info!("probe set member {ip} passes back to the pod with netns cookie {next}");
                    passed.push((*ip, owner_comment(next)));
                }
            }
        }
        let gone: Vec<IpAddr> = gone
            .into_iter()
            .filter(|ip| self.family_in_use(ip))
            .collect();
        let deletes = gone
            .iter()
            .map(|ip| delete_elements(std::slice::from_ref(ip)));
        let passes = self.in_use(passed);
        let passes = passes
            .iter()
            .map(|member| add_elements(std::slice::from_ref(member)));
        deletes.chain(passes).collect()
    }

    fn family_in_use(&self, ip: &IpAddr) -> bool {
        ip.is_ipv4() || self.ipv6
    }

    fn in_use(&self, elements: Vec<(IpAddr, String)>) -> Vec<(IpAddr, String)> {
        elements
            .into_iter()
            .filter(|(ip, _)| self.family_in_use(ip))
            .collect()
    }

    fn apply_host(&self, script: &str) -> Result<(), NftablesError> {
        if script.is_empty() {
            return Ok(());
        }
        self.nft.apply(&self.host, script)
    }

    /// Each script in its own transaction; stops at the first that fails.
    fn apply_host_each(&self, scripts: &[String]) -> Result<(), NftablesError> {
        scripts
            .iter()
            .try_for_each(|script| self.apply_host(script))
    }

    /// Removes the members that name the pod `cookie` (an earlier agent's)
    /// unless an enrolled pod has claimed the address since.
    pub(super) fn release_members_naming(&self, cookie: u64) -> Result<(), NftablesError> {
        let ips: Vec<IpAddr> = probe_set_entries(&self.nft, &self.host)?
            .into_iter()
            .filter(|(ip, named)| *named == Some(cookie) && self.claims.owner(ip).is_none())
            .map(|(ip, _)| ip)
            .collect();
        self.apply_host(&delete_elements(&ips))
    }

    /// Every member against the owners the agent knows.
    pub(super) fn check_probe_sets(&self) -> Vec<Violation> {
        let entries = match probe_set_entries(&self.nft, &self.host) {
            Ok(entries) => entries,
            Err(e) => {
                // Most likely the table is gone: said so, and repaired.
                let detail = format!("reading the probe sets: {e}");
                let missing = self.check_host_table();
                return vec![missing.unwrap_or(Violation::new(ViolationKind::Unreadable, detail))];
            }
        };
        let mut out = Vec::new();
        for (ip, named) in &entries {
            let owner = self.claims.owner(ip);
            if owner.is_some() && owner == *named {
                continue;
            }
            if owner.is_none() && named.is_some_and(|c| self.adopted.contains_key(&c)) {
                continue;
            }
            let detail = format!(
                "{ip} in {} names {}; its owner is {}",
                set_of(ip),
                named.map_or("no pod".into(), |c| format!("netns cookie {c}")),
                owner.map_or("no enrolled pod".into(), |c| format!("netns cookie {c}")),
            );
            out.push(Violation::new(ViolationKind::ProbeSetOrphan, detail).address(*ip));
        }
        for (ip, owner) in self.claims.owners() {
            if entries.iter().any(|(e, _)| *e == ip) || !self.family_in_use(&ip) {
                continue;
            }
            let mut violation = Violation::new(
                ViolationKind::ProbeSetMissing,
                format!(
                    "{ip} of the pod with netns cookie {owner} is not in {}: its kubelet probes \
                     are captured",
                    set_of(&ip)
                ),
            )
            .address(ip);
            violation.pod = self.pods.get(&owner).map(|e| e.key);
            out.push(violation);
        }
        out
    }

    /// The host table: there, ambpf's, with its SNAT rules. Istio's node
    /// agent, stopping, flushes and deletes it (the same name); another's
    /// table there is another agent's, and left to it.
    pub(super) fn check_host_table(&self) -> Option<Violation> {
        let intact = || -> Result<bool, NftablesError> {
            let host = &self.host;
            if !self.nft.inet_tables(host)?.iter().any(|t| t == NAT_TABLE) {
                return Ok(false);
            }
            Ok(!self.nft.owns(host, NAT_TABLE)? || self.nft.has_rules(host, NAT_TABLE)?)
        };
        match intact() {
            Ok(true) => None,
            Ok(false) => Some(Violation::new(
                ViolationKind::HostRulesMissing,
                format!(
                    "the host table inet {NAT_TABLE} (the kubelet probes' SNAT) is missing or \
                     empty in {}: every enrolled pod's kubelet probes are captured",
                    self.host.path().display()
                ),
            )),
            Err(e) => Some(Violation::new(
                ViolationKind::Unreadable,
                format!("reading the host table inet {NAT_TABLE}: {e}"),
            )),
        }
    }

    /// Writes the host table again, with every member the enrolled pods
    /// claim, in one transaction.
    pub(super) fn repair_host_table(&self, violations: &[Violation]) {
        let Some(violation) = violations
            .iter()
            .find(|v| v.kind == ViolationKind::HostRulesMissing)
        else {
            return;
        };
        let members = self.in_use(
            self.claims
                .owners()
                .map(|(ip, owner)| (ip, owner_comment(owner)))
                .collect(),
        );
        let script = host_script(self.ipv6) + &add_elements(&members);
        match self.apply_host(&script) {
            Ok(()) => info!("repaired: {violation}"),
            Err(e) => warn!("repairing {violation}: {e}"),
        }
    }

    /// Writes each violating member as its owner's, or deletes it.
    pub(super) fn repair_probe_sets(&self, violations: &[Violation]) {
        for violation in violations {
            if !matches!(
                violation.kind,
                ViolationKind::ProbeSetOrphan | ViolationKind::ProbeSetMissing
            ) {
                continue;
            }
            let Some(ip) = violation.address else {
                continue;
            };
            let script = match self.claims.owner(&ip) {
                Some(owner) => add_elements(&[(ip, owner_comment(owner))]),
                None => delete_elements(&[ip]),
            };
            match self.apply_host(&script) {
                Ok(()) => info!("repaired: {violation}"),
                Err(e) => warn!("repairing {violation}: {e}"),
            }
        }
    }
}

/// Which of the in-pod table names `netns` holds, split into ambpf's and
/// another's (no ambpf comment).
pub fn find_pod_tables(
    nft: &Nft,
    netns: &Netns,
) -> Result<(Vec<&'static str>, Vec<&'static str>), NftablesError> {
    let present = nft.inet_tables(netns)?;
    let (mut ours, mut foreign) = (Vec::new(), Vec::new());
    for name in POD_TABLES {
        if present.iter().any(|t| t == name) {
            if nft.owns(netns, name)? {
                ours.push(name);
            } else {
                foreign.push(name);
            }
        }
    }
    Ok((ours, foreign))
}

/// ambpf's tables in `netns` that capture: the raw table, and the nat
/// table when it holds rules (an opt-out leaves its base chains empty, so
/// that NAT stays hooked for the connections it redirected).
pub fn find_pod_capture(nft: &Nft, netns: &Netns) -> Result<Vec<String>, NftablesError> {
    Ok(find_any_pod_capture(nft, netns)?.ours)
}

/// The in-pod tables of `netns` that capture ([`find_pod_capture`]), ambpf's
/// and another's (Istio's node agent's), each as `inet <table>`.
pub fn find_any_pod_capture(nft: &Nft, netns: &Netns) -> Result<PodCapture, NftablesError> {
    let (ours, foreign) = find_pod_tables(nft, netns)?;
    let capturing = |tables: Vec<&'static str>| -> Result<Vec<String>, NftablesError> {
        let mut capture = Vec::new();
        for table in tables {
            let captures = match table {
                super::NAT_TABLE => nft.has_rules(netns, table)?,
                super::RAW_TABLE => true,
                _ => false,
            };
            if captures {
                capture.push(format!("inet {table}"));
            }
        }
        Ok(capture)
    };
    Ok(PodCapture {
        ours: capturing(ours)?,
        foreign: capturing(foreign)?,
    })
}

/// [`find_any_pod_capture`]'s answer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PodCapture {
    /// ambpf's tables (with its comment).
    pub ours: Vec<String>,
    /// Tables of the same names without ambpf's comment.
    pub foreign: Vec<String>,
}

/// Removes ambpf's tables from `netns` (others' stay) and its policy
/// routing, in one transaction; returns the tables it removed.
pub fn remove_pod_tables(nft: &Nft, netns: &Netns) -> Result<Vec<&'static str>, EnrollError> {
    let (ours, _) = find_pod_tables(nft, netns)?;
    if !ours.is_empty() {
        nft.apply(netns, &delete_tables(&ours))?;
        routing::remove_policy_routing(netns)?;
    }
    Ok(ours)
}

/// Removes the capture of ambpf's tables from `netns` in one transaction,
/// idempotently: the nat table's rules (its base chains stay, so NAT stays
/// hooked for the connections already redirected) and the raw table. The
/// mangle table (the reply path of connections ztunnel already proxies)
/// and the policy routing, which every mode shares, stay. Returns the
/// tables it changed. For another mode taking the pod over
/// ([`crate::redirect::retire`]).
pub fn remove_pod_capture(nft: &Nft, netns: &Netns) -> Result<Vec<&'static str>, EnrollError> {
    let (ours, _) = find_pod_tables(nft, netns)?;
    remove_capture_of(nft, netns, &ours)
}

/// As [`remove_pod_capture`], for the tables of Istio's names without
/// ambpf's comment: Istio's node agent's, once ambpf has taken its pod over
/// ([`crate::redirect::istio_agent`]).
pub fn remove_foreign_pod_capture(
    nft: &Nft,
    netns: &Netns,
) -> Result<Vec<&'static str>, EnrollError> {
    let (_, foreign) = find_pod_tables(nft, netns)?;
    remove_capture_of(nft, netns, &foreign)
}

fn remove_capture_of(
    nft: &Nft,
    netns: &Netns,
    tables: &[&'static str],
) -> Result<Vec<&'static str>, EnrollError> {
    let mut script = String::new();
    let mut changed = Vec::new();
    if tables.contains(&NAT_TABLE) && nft.has_rules(netns, NAT_TABLE)? {
        script.push_str(&format!("flush table inet {NAT_TABLE}\n"));
        changed.push(NAT_TABLE);
    }
    if tables.contains(&super::RAW_TABLE) {
        script.push_str(&delete_tables(&[super::RAW_TABLE]));
        changed.push(super::RAW_TABLE);
    }
    if !script.is_empty() {
        nft.apply(netns, &script)?;
    }
    Ok(changed)
}

/// Removes the host table if it is another's (Istio's node agent's, left
/// when it stopped: its uninstall normally removes it); returns whether it
/// did. For a takeover from that agent, before ambpf writes its own.
pub fn remove_foreign_host_table(nft: &Nft, host: &Netns) -> Result<bool, NftablesError> {
    let present = nft.inet_tables(host)?;
    if !present.iter().any(|t| t == NAT_TABLE) || nft.owns(host, NAT_TABLE)? {
        return Ok(false);
    }
    nft.apply(host, &delete_tables(&[NAT_TABLE]))?;
    Ok(true)
}

/// Removes the host table if it is ambpf's; returns whether it did.
pub fn remove_host_table(nft: &Nft, host: &Netns) -> Result<bool, NftablesError> {
    let present = nft.inet_tables(host)?;
    if !present.iter().any(|t| t == NAT_TABLE) || !nft.owns(host, NAT_TABLE)? {
        return Ok(false);
    }
    nft.apply(host, &delete_tables(&[NAT_TABLE]))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_name_their_pod_in_their_comment() {
        assert_eq!(named_pod(Some(&owner_comment(4144))), Some(4144));
        assert_eq!(named_pod(Some("6f1c-uid")), None);
        assert_eq!(named_pod(None), None);
    }
}
