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

use log::{info, warn};

use super::{Family, IptablesError, IptablesRedirection, PodKey, tools::run_in};
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
    let ipset = super::tools::ipset_binary()?;
    let saved = run_in(host, &ipset, &["save", family.probe_ipset()], None)?;
    Ok(parse_save(&saved))
}

/// Reads `ipset save` output: `add <set> <address> [comment "<text>"]`.
fn parse_save(saved: &str) -> Vec<ProbeMember> {
    saved
        .lines()
        .filter_map(|line| {
            let mut words = line.splitn(4, ' ');
            if words.next()? != "add" {
                return None;
            }
            let _set = words.next()?;
            let address = words.next()?.parse().ok()?;
            let netns_cookie = words
                .next()
                .and_then(|rest| rest.strip_prefix("comment \""))
                .and_then(|c| c.strip_suffix('"'))
                .and_then(|c| c.strip_prefix(COMMENT_PREFIX))
                .and_then(|c| c.parse().ok());
            Some(ProbeMember {
                address,
                netns_cookie,
            })
        })
        .collect()
}

impl IptablesRedirection {
    fn probe_set_add(&self, ip: IpAddr, cookie: u64) -> Result<(), IptablesError> {
        let family = Family::of(&ip);
        if self.tools.family(family).is_none() {
            return Ok(());
        }
        // `-exist` also rewrites the comment of a member that is there.
        let (ip, comment) = (ip.to_string(), format!("{COMMENT_PREFIX}{cookie}"));
        self.ipset_run(&[
            "add",
            "-exist",
            family.probe_ipset(),
            &ip,
            "comment",
            &comment,
        ])
    }

    fn probe_set_del(&self, ip: IpAddr) -> Result<(), IptablesError> {
        let family = Family::of(&ip);
        if self.tools.family(family).is_none() {
            return Ok(());
        }
        self.ipset_run(&["del", "-exist", family.probe_ipset(), &ip.to_string()])
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
            let members = match probe_set_entries(&self.host, family) {
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
        let saved = "create istio-inpod-probes-v4 hash:ip family inet hashsize 1024 maxelem \
                     65536 comment bucketsize 12 initval 0xb56d82b1\n\
                     add istio-inpod-probes-v4 10.244.1.2 comment \"netns cookie 4144\"\n\
                     add istio-inpod-probes-v4 10.244.1.3 comment \"6f1c-uid\"\n\
                     add istio-inpod-probes-v4 10.244.1.4\n";
        assert_eq!(
            parse_save(saved),
            [
                ProbeMember {
                    address: "10.244.1.2".parse().unwrap(),
                    netns_cookie: Some(4144)
                },
                ProbeMember {
                    address: "10.244.1.3".parse().unwrap(),
                    netns_cookie: None
                },
                ProbeMember {
                    address: "10.244.1.4".parse().unwrap(),
                    netns_cookie: None
                },
            ]
        );
        let v6 = "add istio-inpod-probes-v6 fd00:a:1::2 comment \"netns cookie 7\"";
        assert_eq!(
            parse_save(v6)[0].address,
            "fd00:a:1::2".parse::<IpAddr>().unwrap()
        );
    }
}
