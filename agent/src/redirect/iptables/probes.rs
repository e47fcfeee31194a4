//! The host's probe ipsets (`istio-inpod-probes-v4/-v6`), one member per
//! enrolled pod address, and who owns each member.
//!
//! A member makes the host SNAT its kubelet probes to 169.254.7.127, which
//! the pod's rules let through; without it the probes are captured. A node
//! recycles addresses, so a member is owned like every per-pod record
//! ([`crate::redirect::claims`]): by the newest enrolled pod that claims the
//! address, named in its comment (`netns cookie <cookie>`). Removing a pod
//! deletes only the members it owns, and hands an address another enrolled
//! pod still claims to that pod.

use std::net::IpAddr;

use tracing::{info, warn};

use super::{
    CHAIN_POSTROUTING, Family, IptablesError, IptablesRedirection, PodKey,
    ipset::{IpsetSocket, Member},
};
use crate::{
    netns::Netns,
    redirect::{
        AddressConflict, Violation, ViolationKind,
        claims::{Claim, Release},
        routing,
    },
};

const COMMENT_PREFIX: &str = "netns cookie ";

/// One member of a probe ipset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeMember {
    pub address: IpAddr,
    /// The pod its comment names (`None`: not one of ambpf's comments).
    pub netns_cookie: Option<u64>,
}

/// The members of `family`'s probe ipset in `host`, with their owners.
pub fn probe_set_entries(host: &Netns, family: Family) -> Result<Vec<ProbeMember>, IptablesError> {
    let mut socket = IpsetSocket::open(host)?;
    members_of(&mut socket, family)
}

fn members_of(socket: &mut IpsetSocket, family: Family) -> Result<Vec<ProbeMember>, IptablesError> {
    let members = socket.list(family.probe_ipset())?;
    Ok(members.into_iter().map(ProbeMember::from).collect())
}

impl From<Member> for ProbeMember {
    /// The owner is the pod ambpf's comment names; another comment (Istio's
    /// pod UID) or none names no pod of ambpf's.
    fn from(member: Member) -> Self {
        Self {
            address: member.address,
            netns_cookie: member
                .comment
                .as_deref()
                .and_then(|c| c.strip_prefix(COMMENT_PREFIX))
                .and_then(|c| c.parse().ok()),
        }
    }
}

impl IptablesRedirection {
    /// The members of `family`'s probe ipset, through the agent's socket.
    pub(super) fn probe_members(&self, family: Family) -> Result<Vec<ProbeMember>, IptablesError> {
        members_of(&mut self.ipset.borrow_mut(), family)
    }

    fn probe_set_add(&self, ip: IpAddr, cookie: u64) -> Result<(), IptablesError> {
        let family = Family::of(&ip);
        if self.tools.family(family).is_none() {
            return Ok(());
        }
        // Adding a member that is there rewrites its comment (its owner).
        let comment = format!("{COMMENT_PREFIX}{cookie}");
        let mut ipset = self.ipset.borrow_mut();
        Ok(ipset.add(family.probe_ipset(), ip, &comment)?)
    }

    pub(super) fn probe_set_del(&self, ip: IpAddr) -> Result<(), IptablesError> {
        let family = Family::of(&ip);
        if self.tools.family(family).is_none() {
            return Ok(());
        }
        Ok(self.ipset.borrow_mut().del(family.probe_ipset(), ip)?)
    }

    /// Claims `addresses` for the pod `cookie` and writes the members it
    /// owns; releases what it claimed before (`previous`) and no longer has.
    pub(super) fn claim_probe_addresses(
        &mut self,
        cookie: u64,
        addresses: &[IpAddr],
        previous: &[IpAddr],
    ) -> Result<Vec<AddressConflict>, IptablesError> {
        let dropped: Vec<IpAddr> = previous
            .iter()
            .filter(|ip| !addresses.contains(ip))
            .copied()
            .collect();
        self.release_probe_addresses(cookie, &dropped)?;
        let mut conflicts = Vec::new();
        for ip in addresses {
            let (other, won) = match self.claims.claim(*ip, cookie) {
                Claim::Owner { displaced } => {
                    self.probe_set_add(*ip, cookie)?;
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
        Ok(conflicts)
    }

    /// Drops the pod `cookie`'s claims on `addresses`: deletes the members
    /// it owns, or hands them to the pod that claims them next.
    pub(super) fn release_probe_addresses(
        &mut self,
        cookie: u64,
        addresses: &[IpAddr],
    ) -> Result<(), IptablesError> {
        for ip in addresses {
            match self.claims.release(*ip, cookie) {
                Release::NotOwner => {}
                Release::Delete => self.probe_set_del(*ip)?,
                Release::PassTo(next) => {
                    self.probe_set_add(*ip, next)?;
                    info!(
                        "probe ipset member {ip} passes back to the pod with netns cookie \
                         {next}, which still claims it"
                    );
                }
            }
        }
        Ok(())
    }

    /// Every member against the owners the agent knows.
    pub(super) fn check_probe_sets(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        let mut present = Vec::new();
        for family in self.tools.families.keys().copied() {
            let members = match self.probe_members(family) {
                Ok(members) => members,
                Err(e) => {
                    out.push(Violation::new(
                        ViolationKind::Unreadable,
                        format!("reading {}: {e}", family.probe_ipset()),
                    ));
                    continue;
                }
            };
            for member in members {
                present.push(member.address);
                let owner = self.claims.owner(&member.address);
                if owner.is_some() && owner == member.netns_cookie {
                    continue;
                }
                // A pod an earlier agent enrolled keeps its members until
                // it is enrolled again or removed.
                if owner.is_none() && member.netns_cookie.is_some_and(|c| self.is_adopted(c)) {
                    continue;
                }
                let named = member
                    .netns_cookie
                    .map_or("no pod".to_owned(), |c| format!("netns cookie {c}"));
                let detail = match owner {
                    None => format!(
                        "{} in {} names {named}, and no enrolled pod claims it",
                        member.address,
                        family.probe_ipset()
                    ),
                    Some(owner) => format!(
                        "{} in {} names {named}; its owner is the pod with netns cookie {owner}",
                        member.address,
                        family.probe_ipset()
                    ),
                };
                out.push(
                    Violation::new(ViolationKind::ProbeSetOrphan, detail).address(member.address),
                );
            }
        }
        for (address, owner) in self.claims.owners() {
            if present.contains(&address) || self.tools.family(Family::of(&address)).is_none() {
                continue;
            }
            let mut violation = Violation::new(
                ViolationKind::ProbeSetMissing,
                format!(
                    "{address} of the pod with netns cookie {owner} is not in {}: its kubelet \
                     probes are captured",
                    Family::of(&address).probe_ipset()
                ),
            )
            .address(address);
            violation.pod = self.pods.get(&owner).map(|e| e.key);
            out.push(violation);
        }
        out
    }

    /// The host's probe SNAT of each family: Istio's node agent, stopping,
    /// deletes it (its rules and ipsets have the same names).
    pub(super) fn check_host_rules(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        for family in self.tools.families.keys().copied() {
            match self.tools.save(&self.host, family) {
                Ok(saved) if saved.snats_probes(family) => {}
                Ok(_) => out.push(Violation::new(
                    ViolationKind::HostRulesMissing,
                    format!(
                        "the host's {family} probe SNAT ({CHAIN_POSTROUTING} and its jump from \
                         nat POSTROUTING) is missing in {}: every enrolled pod's kubelet probes \
                         are captured",
                        self.host.path().display()
                    ),
                )),
                Err(e) => out.push(Violation::new(
                    ViolationKind::Unreadable,
                    format!("reading the host's {family} rules: {e}"),
                )),
            }
        }
        out
    }

    /// Writes the host side again where it went missing, once for every
    /// family: the ipset, the rules, and every member the enrolled pods
    /// claim.
    pub(super) fn repair_host_rules(&self, violations: &[Violation]) {
        let missing: Vec<&Violation> = violations
            .iter()
            .filter(|v| v.kind == ViolationKind::HostRulesMissing)
            .collect();
        if missing.is_empty() {
            return;
        }
        let written = self.tools.families.keys().try_for_each(|family| {
            self.write_host_side(*family)?;
            self.claims
                .owners()
                .filter(|(ip, _)| Family::of(ip) == *family)
                .try_for_each(|(ip, owner)| self.probe_set_add(ip, owner))
        });
        for violation in missing {
            match &written {
                Ok(()) => info!("repaired: {violation}"),
                Err(e) => warn!("repairing {violation}: {e}"),
            }
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
            let repaired = match self.claims.owner(&ip) {
                Some(owner) => self.probe_set_add(ip, owner),
                None => self.probe_set_del(ip),
            };
            match repaired {
                Ok(()) => info!("repaired: {violation}"),
                Err(e) => warn!("repairing {violation}: {e}"),
            }
        }
    }

    /// Inside one enrolled pod: the addresses it was enrolled with (its
    /// probe ipset members), its capture rules and policy routing.
    pub(super) fn check_pod(&self, key: PodKey, netns: &Netns) -> Vec<Violation> {
        let mut out = Vec::new();
        let enrolled = self.pods.get(&key.netns_cookie).map(|e| &e.addresses);
        match (crate::redirect::podnet::inspect(netns), enrolled) {
            (Ok(net), Some(enrolled)) => {
                out.extend(crate::redirect::check::addresses_changed(
                    key, enrolled, &net, netns,
                ));
            }
            (Ok(_), None) => {}
            (Err(e), _) => out.push(
                Violation::new(
                    ViolationKind::Unreadable,
                    format!("reading the network of the pod with {key}: {e}"),
                )
                .for_pod(key),
            ),
        }
        for family in self.tools.families.keys().copied() {
            match self.tools.save(netns, family) {
                Ok(saved) if saved.captures() => {}
                Ok(_) => out.push(
                    Violation::new(
                        ViolationKind::RulesMissing,
                        format!("the pod with {key} lacks its {family} capture rules"),
                    )
                    .for_pod(key),
                ),
                Err(e) => out.push(
                    Violation::new(
                        ViolationKind::Unreadable,
                        format!("the pod with {key}: {e}"),
                    )
                    .for_pod(key),
                ),
            }
        }
        match routing::reply_routing_status(netns) {
            Ok(status) if status.policy_routing_installed() => {}
            Ok(status) => out.push(
                Violation::new(
                    ViolationKind::RoutingMissing,
                    format!("the pod with {key} lacks part of its policy routing: {status:?}"),
                )
                .for_pod(key),
            ),
            Err(e) => out.push(
                Violation::new(
                    ViolationKind::Unreadable,
                    format!("the pod with {key}: {e}"),
                )
                .for_pod(key),
            ),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_read_with_the_pod_their_comment_names() {
        let member = |address: &str, comment: Option<&str>| {
            ProbeMember::from(Member {
                address: address.parse().unwrap(),
                comment: comment.map(str::to_owned),
            })
        };
        let owner = |m: ProbeMember| m.netns_cookie;
        assert_eq!(
            owner(member("10.244.1.2", Some("netns cookie 4144"))),
            Some(4144)
        );
        assert_eq!(owner(member("10.244.1.3", Some("6f1c-uid"))), None);
        assert_eq!(owner(member("10.244.1.4", None)), None);
        assert_eq!(
            owner(member("fd00:a:1::2", Some("netns cookie 7"))),
            Some(7)
        );
    }
}
