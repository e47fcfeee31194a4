//! Who owns an address that more than one pod claims.
//!
//! A node's IPAM recycles pod addresses, and Kubernetes gives no ordering
//! across pods: a new pod's CNI ADD can arrive before the informer delivers
//! the deletion of the pod that had its address, and an agent that restarts
//! finds pods pinned by its predecessor whose addresses now belong to pods
//! created meanwhile. Every per-address record (the `ambpf_pod_ips` entries,
//! the iptables mode's probe ipset members) therefore has one owner, chosen
//! by a rule that needs no memory of the order events came in:
//!
//! **the claimant with the highest netns cookie owns the address.** Cookies
//! are handed out by one counter that only grows within a boot and are never
//! reused, so that is the pod whose network namespace was created last: the
//! newer pod. A restarted agent, `ambpf status --check` and the agent that
//! wrote the records all reach the same answer from the pods alone.
//!
//! A pod that is removed releases only the addresses it owns; an address
//! another live pod still claims passes to that pod instead of being deleted.

use std::{
    collections::{BTreeSet, HashMap},
    hash::Hash,
};

/// What claiming an address did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The claimant owns the address; `displaced` is the owner it took it
    /// from (an older pod that still claims it).
    Owner { displaced: Option<u64> },
    /// A newer pod owns the address and keeps it.
    Outranked { owner: u64 },
}

/// What releasing a pod's claim on an address leaves to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// The pod did not own the address (or never claimed it): its record
    /// belongs to another pod and must stay.
    NotOwner,
    /// The pod owned it and nobody else claims it: delete the record.
    Delete,
    /// The pod owned it and this (older) pod still claims it: the record
    /// passes to it.
    PassTo(u64),
}

/// Every claim on every address, by netns cookie.
#[derive(Clone, Debug)]
pub struct AddressClaims<A> {
    by_address: HashMap<A, BTreeSet<u64>>,
}

impl<A> Default for AddressClaims<A> {
    fn default() -> Self {
        Self {
            by_address: HashMap::new(),
        }
    }
}

impl<A: Copy + Eq + Hash> AddressClaims<A> {
    /// The claims of `pods`: (netns cookie, its addresses).
    pub fn from_pods<I: IntoIterator<Item = A>>(pods: impl IntoIterator<Item = (u64, I)>) -> Self {
        let mut claims = Self::default();
        for (cookie, addresses) in pods {
            for address in addresses {
                claims.claim(address, cookie);
            }
        }
        claims
    }

    /// Records that the pod with `cookie` claims `address`. Idempotent.
    pub fn claim(&mut self, address: A, cookie: u64) -> Claim {
        let claimants = self.by_address.entry(address).or_default();
        let before = claimants.last().copied();
        claimants.insert(cookie);
        match before {
            Some(owner) if owner > cookie => Claim::Outranked { owner },
            Some(owner) if owner != cookie => Claim::Owner {
                displaced: Some(owner),
            },
            _ => Claim::Owner { displaced: None },
        }
    }

    /// Drops the claim of the pod with `cookie` on `address`.
    pub fn release(&mut self, address: A, cookie: u64) -> Release {
        let Some(claimants) = self.by_address.get_mut(&address) else {
            return Release::NotOwner;
        };
        let owned = claimants.last() == Some(&cookie);
        claimants.remove(&cookie);
        let next = claimants.last().copied();
        if claimants.is_empty() {
            self.by_address.remove(&address);
        }
        match (owned, next) {
            (false, _) => Release::NotOwner,
            (true, None) => Release::Delete,
            (true, Some(next)) => Release::PassTo(next),
        }
    }

    /// The owner of `address`, if any pod claims it.
    pub fn owner(&self, address: &A) -> Option<u64> {
        self.by_address.get(address)?.last().copied()
    }

    /// Every claimed address with its owner.
    pub fn owners(&self) -> impl Iterator<Item = (A, u64)> + '_ {
        self.by_address
            .iter()
            .filter_map(|(address, claimants)| Some((*address, *claimants.last()?)))
    }

    /// The other pods that claim `address` besides `cookie`.
    pub fn rivals(&self, address: &A, cookie: u64) -> impl Iterator<Item = u64> + '_ {
        self.by_address
            .get(address)
            .into_iter()
            .flatten()
            .copied()
            .filter(move |c| *c != cookie)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u8 = 1;
    const B: u8 = 2;

    #[test]
    fn the_newer_pod_owns_a_shared_address_whatever_order_the_claims_came_in() {
        let mut claims = AddressClaims::default();
        assert_eq!(claims.claim(A, 10), Claim::Owner { displaced: None });
        assert_eq!(
            claims.claim(A, 20),
            Claim::Owner {
                displaced: Some(10)
            }
        );
        assert_eq!(claims.owner(&A), Some(20));

        let mut reversed = AddressClaims::default();
        reversed.claim(A, 20);
        assert_eq!(reversed.claim(A, 10), Claim::Outranked { owner: 20 });
        assert_eq!(reversed.owner(&A), Some(20));
    }

    #[test]
    fn claiming_again_changes_nothing() {
        let mut claims = AddressClaims::default();
        claims.claim(A, 10);
        claims.claim(A, 20);
        assert_eq!(claims.claim(A, 20), Claim::Owner { displaced: None });
        assert_eq!(claims.claim(A, 10), Claim::Outranked { owner: 20 });
        assert_eq!(claims.rivals(&A, 20).collect::<Vec<_>>(), [10]);
    }

    #[test]
    fn a_stale_pod_removed_after_the_live_one_claimed_its_address_deletes_nothing() {
        // Agent restart: the live pod (newer) is enrolled, then the stale
        // pinned pod that had its address is removed.
        let mut claims = AddressClaims::from_pods([(10u64, vec![A, B]), (20, vec![A])]);
        assert_eq!(claims.release(A, 10), Release::NotOwner);
        assert_eq!(claims.release(B, 10), Release::Delete);
        assert_eq!(claims.owner(&A), Some(20));
        assert_eq!(claims.owner(&B), None);
    }

    #[test]
    fn removing_the_newer_pod_first_hands_the_address_back_to_the_older() {
        let mut claims = AddressClaims::from_pods([(10u64, [A]), (20, [A])]);
        assert_eq!(claims.release(A, 20), Release::PassTo(10));
        assert_eq!(claims.owner(&A), Some(10));
        assert_eq!(claims.release(A, 10), Release::Delete);
        assert_eq!(claims.owners().count(), 0);
    }

    #[test]
    fn releasing_what_was_never_claimed_is_not_ownership() {
        let mut claims = AddressClaims::from_pods([(10u64, [A])]);
        assert_eq!(claims.release(B, 10), Release::NotOwner);
        assert_eq!(claims.release(A, 99), Release::NotOwner);
        assert_eq!(claims.owner(&A), Some(10));
    }
}
