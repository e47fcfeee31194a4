//! A pod's sk_lookup link, on the sk_lookup inbound path
//! ([`crate::bpf::inbound`]): attached at enrolment, removed with the pod.

use std::os::fd::AsFd as _;

use ambpf_common::{maps, programs};
use aya::maps::MapData;

use super::{EnrollError, map_err};
use crate::{bpf::Dataplane, netns::Netns};

impl Dataplane {
    /// On the sk_lookup path, attaches (or updates) the pod's sk_lookup
    /// link; nothing on the TC path.
    pub(super) fn attach_inbound_link(
        &mut self,
        netns: &Netns,
        cookie: u64,
    ) -> Result<(), EnrollError> {
        use crate::bpf::{InboundPath, inbound};
        if self.inbound() != InboundPath::SkLookup {
            return Ok(());
        }
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

    /// Removes the pod's sk_lookup link and forgets its listener (on either
    /// path: an agent on the other path may have left them).
    pub(super) fn remove_inbound_link(&mut self, cookie: u64) -> Result<(), EnrollError> {
        crate::bpf::inbound::remove_link(self.pins(), cookie).map_err(|cause| {
            EnrollError::Unlink {
                dir: self.pins().pod_links_dir(cookie),
                cause,
            }
        })?;
        let mut listeners: aya::maps::SockHash<&mut MapData, u64> =
            aya::maps::SockHash::try_from(self.map_mut(maps::INBOUND_LISTENERS))
                .map_err(map_err(maps::INBOUND_LISTENERS))?;
        match listeners.remove(&cookie) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            // A hash map answers a missing key with ENOENT.
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(e) => Err(map_err(maps::INBOUND_LISTENERS)(e)),
        }
    }
}
