//! What the eBPF mode keeps in memory of the pods it enrolled: a handle on
//! each one's namespace, and every enrolled pod's claim on its addresses.

use std::collections::HashMap;

use ambpf_common::{IpKey, PodConfig};

use super::{EnrollError, addresses::claimed};
use crate::{netns::Netns, redirect::claims::AddressClaims};

#[derive(Debug, Default)]
pub(super) struct PodRegistry {
    /// The namespaces of the pods this process enrolled, by netns cookie:
    /// a namespace kept open is never freed, so its inode is not reused
    /// while the pod is enrolled, and an earlier agent's steering is
    /// removed through it.
    held: HashMap<u64, Netns>,
    /// Every enrolled pod's claim on its addresses, read from the pinned
    /// pods map when first needed and kept in step by enrolment and removal
    /// (the agent is the maps' only writer); `None` after anything that may
    /// have left it behind the map, so it is read again.
    claims: Option<AddressClaims<IpKey>>,
}

impl PodRegistry {
    /// Holds `netns`, the namespace of the pod `cookie`.
    pub(super) fn hold(&mut self, cookie: u64, netns: Netns) {
        self.held.insert(cookie, netns);
    }

    /// Lets go of the pod `cookie`'s namespace, returning the handle held.
    pub(super) fn release(&mut self, cookie: u64) -> Option<Netns> {
        self.held.remove(&cookie)
    }

    /// The address claims; `pinned` reads the enrolled pods when they are
    /// not known.
    pub(super) fn claims(
        &mut self,
        pinned: impl FnOnce() -> Result<Vec<PodConfig>, EnrollError>,
    ) -> Result<&mut AddressClaims<IpKey>, EnrollError> {
        if self.claims.is_none() {
            let pods = pinned()?;
            self.claims = Some(AddressClaims::from_pods(
                pods.iter().map(|pod| (pod.netns_cookie, claimed(pod))),
            ));
        }
        Ok(self.claims.get_or_insert_default())
    }

    /// Forgets the claims, which may be behind the map: read again when next
    /// needed.
    pub(super) fn forget_claims(&mut self) {
        self.claims = None;
    }
}
