//! A pod's sk_lookup link ([`crate::bpf::inbound`]): attached at enrolment,
//! removed with the pod.

use std::os::fd::AsFd as _;

use ambpf_common::programs;

use super::EnrollError;
use crate::{bpf::Dataplane, netns::Netns};

impl Dataplane {
    /// Attaches (or updates) the pod's sk_lookup link.
    pub(super) fn attach_inbound_link(
        &mut self,
        netns: &Netns,
        cookie: u64,
    ) -> Result<(), EnrollError> {
        use crate::bpf::inbound;
        let link_err = |cause| EnrollError::InboundLink {
            netns: netns.path().to_owned(),
            cause,
        };
        let pin = inbound::link_pin(self.pins(), cookie);
        let program: &mut aya::programs::SkLookup = self
            .program_mut(programs::INBOUND_LOOKUP)
            .try_into()
            .map_err(|e| link_err(std::io::Error::other(e)))?;
        let program = program
            .fd()
            .map_err(|e| link_err(std::io::Error::other(e)))?;
        inbound::attach_link(&pin, program.as_fd(), netns.file().as_fd(), netns.inode())
            .map_err(link_err)
    }

    /// Removes the pod's sk_lookup link. ztunnel's listener stays filed
    /// while it is open (the kernel drops it from the map when it closes):
    /// a pod enrolled again meanwhile is served by the same listener, which
    /// ztunnel does not open anew.
    pub(super) fn remove_inbound_link(&mut self, cookie: u64) -> Result<(), EnrollError> {
        crate::bpf::inbound::remove_link(self.pins(), cookie).map_err(|cause| EnrollError::Unlink {
            dir: self.pins().pod_links_dir(cookie),
            cause,
        })
    }
}
