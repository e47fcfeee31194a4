//! The eBPF mode's address entries (`ambpf_pod_ips`): which enrolled pod
//! each address's entry belongs to ([`crate::redirect::claims`]), written
//! and released as pods come and go, and the address keys the maps use.

use std::net::IpAddr;

use ambpf_common::{IpKey, PodConfig, maps};
use tracing::info;

use super::{EbpfRedirection, EnrollError, map_err, pinned_pods, pods_by_ip, pods_by_netns};
use crate::{
    bpf::keys::{ip_addr, ip_key},
    redirect::claims::{AddressClaims, Claim, Release},
};

/// An address the enrolled pod shares with another enrolled pod.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AddressConflict {
    pub address: IpAddr,
    /// The other pod.
    pub other_netns_cookie: u64,
    /// Whether the enrolled pod owns the address now (it is the newer).
    pub won: bool,
}

impl EbpfRedirection {
    /// Writes the address entries `pod` owns ([`claims`]), after releasing
    /// those of `previous` (its earlier enrolment) it no longer has.
    pub(super) fn claim_addresses(
        &mut self,
        pod: &PodConfig,
        previous: Option<&PodConfig>,
    ) -> Result<Vec<AddressConflict>, EnrollError> {
        let cookie = pod.netns_cookie;
        let ips: Vec<IpKey> = claimed(pod).collect();
        if let Some(previous) = previous {
            for old in claimed(previous).filter(|ip| !ips.contains(ip)) {
                let release = self.claims()?.release(old, cookie);
                self.apply_release(old, cookie, release)?;
            }
        }
        let mut conflicts = Vec::new();
        for ip in ips {
            let claim = self.claims()?.claim(ip, cookie);
            let (other, won) = match claim {
                Claim::Owner { displaced } => {
                    pods_by_ip(&mut self.dataplane)?
                        .insert(ip, *pod, 0)
                        .map_err(map_err(maps::PODS_BY_IP))?;
                    match displaced {
                        Some(other) => (other, true),
                        None => continue,
                    }
                }
                Claim::Outranked { owner } => (owner, false),
            };
            conflicts.push(AddressConflict {
                address: ip_addr(ip),
                other_netns_cookie: other,
                won,
            });
        }
        Ok(conflicts)
    }

    /// The address claims, read from the pinned pods map when not known.
    pub(super) fn claims(&mut self) -> Result<&mut AddressClaims<IpKey>, EnrollError> {
        let dataplane = &mut self.dataplane;
        self.pods.claims(|| pinned_pods(dataplane))
    }

    /// Carries out what releasing `cookie`'s claim on `ip` left to do.
    ///
    /// The kernel has no compare-and-delete for hash maps (and
    /// `BPF_MAP_LOOKUP_AND_DELETE_ELEM` would leave the owner without its
    /// entry for a moment), so the entry is compared and then deleted. No
    /// write can come between the two: the agent is the maps' only writer,
    /// it writes from one task, one pod at a time, and a second agent on the
    /// same pin root waits for the first to exit ([`crate::bpf::pins::PinRootLock`]).
    pub(super) fn apply_release(
        &mut self,
        ip: IpKey,
        cookie: u64,
        release: Release,
    ) -> Result<(), EnrollError> {
        match release {
            Release::NotOwner => Ok(()),
            Release::Delete => {
                let mut by_ip = pods_by_ip(&mut self.dataplane)?;
                match by_ip.get(&ip, 0) {
                    Ok(entry) if entry.netns_cookie == cookie => match by_ip.remove(&ip) {
                        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                        Err(e) => Err(map_err(maps::PODS_BY_IP)(e)),
                    },
                    // Another pod's entry, or none: not this pod's to delete.
                    _ => Ok(()),
                }
            }
            Release::PassTo(next) => {
                let Ok(owner) = pods_by_netns(&mut self.dataplane)?.get(&next, 0) else {
                    // The claims were behind the map: read them again.
                    self.pods.forget_claims();
                    return Ok(());
                };
                pods_by_ip(&mut self.dataplane)?
                    .insert(ip, owner, 0)
                    .map_err(map_err(maps::PODS_BY_IP))?;
                info!(
                    "address {} passes back to the pod with netns cookie {next}, which still \
                     claims it",
                    ip_addr(ip)
                );
                Ok(())
            }
        }
    }

    /// Writes the entry of every address in `addresses` as its owner's, or
    /// deletes it when no pod claims it (repairs of [`super::check`]).
    pub fn rewrite_address_entries(&mut self, addresses: &[IpAddr]) -> Result<(), EnrollError> {
        // Re-read the claims: whatever made the entries wrong may have left
        // them behind too.
        self.pods.forget_claims();
        let pods: std::collections::HashMap<u64, PodConfig> = self
            .pinned_pods()?
            .into_iter()
            .map(|pod| (pod.netns_cookie, pod))
            .collect();
        for ip in addresses.iter().map(|ip| ip_key(*ip)) {
            let owner = self
                .claims()?
                .owner(&ip)
                .and_then(|c| pods.get(&c).copied());
            let mut by_ip = pods_by_ip(&mut self.dataplane)?;
            let result = match owner {
                Some(owner) => by_ip.insert(ip, owner, 0),
                None => match by_ip.remove(&ip) {
                    Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                    other => other,
                },
            };
            result.map_err(map_err(maps::PODS_BY_IP))?;
        }
        Ok(())
    }
}

/// The addresses a pod's entry claims (its non-empty slots).
pub fn claimed(pod: &PodConfig) -> impl Iterator<Item = IpKey> + '_ {
    pod.ips.iter().copied().filter(|ip| *ip != IpKey::default())
}
