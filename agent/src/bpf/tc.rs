//! TC programs attached through TCX to interfaces inside network namespaces.

use std::{fs, io, path::PathBuf};

use ambpf_common::{Direction, programs};
use aya::programs::{
    LinkOrder, ProgramError, TcAttachType,
    links::{FdLink, LinkError, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
};
use tracing::info;

use super::{Dataplane, PinLayout};
use crate::netns::{Netns, NetnsError};

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    Kernel(#[from] super::features::FeatureError),
    #[error("interface {iface} not found in network namespace {netns}")]
    NoSuchInterface { iface: String, netns: PathBuf },
    #[error("attaching {program} to {iface} ({direction}) in {netns}: {cause}")]
    Attach {
        program: &'static str,
        iface: String,
        direction: &'static str,
        netns: PathBuf,
        cause: Box<ProgramError>,
    },
    #[error("using the link of {program} pinned at {pin}: {cause}")]
    Link {
        program: &'static str,
        pin: PathBuf,
        cause: LinkError,
    },
    #[error("pinning the link of {program} at {pin}: {reason}")]
    Pin {
        program: &'static str,
        pin: PathBuf,
        reason: String,
    },
}

/// One program attached to one side of an interface, with its link's pin.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TcLink {
    pub direction: &'static str,
    pub program: &'static str,
    pub pin: PathBuf,
    /// True when an existing pinned link was kept and only its program replaced.
    pub replaced: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TcAttachment {
    pub netns: PathBuf,
    pub netns_inode: u64,
    pub iface: String,
    pub ifindex: u32,
    pub links: Vec<TcLink>,
}

/// A TC program and the side of an interface it runs on.
pub type TcHook = (Direction, TcAttachType, &'static str);

/// The interface counters: both directions.
pub const COUNTER_HOOKS: [TcHook; 2] = [
    (
        Direction::Ingress,
        TcAttachType::Ingress,
        programs::IFACE_COUNT_INGRESS,
    ),
    (
        Direction::Egress,
        TcAttachType::Egress,
        programs::IFACE_COUNT_EGRESS,
    ),
];

impl Dataplane {
    /// Attaches the interface counters to both directions of `iface` inside
    /// `netns` and pins the links. Where a pinned link already exists (left by
    /// an earlier agent) its program is replaced atomically, so traffic never
    /// passes unobserved. Either both directions end up attached and pinned,
    /// or neither new link survives.
    pub fn attach_iface_counters(
        &mut self,
        netns: &Netns,
        iface: &str,
    ) -> Result<TcAttachment, AttachError> {
        super::features::tcx_supported()?;
        let links_dir = self.pins.tc_netns_dir(netns.inode());
        self.attach_tc(netns, iface, &COUNTER_HOOKS, &links_dir)
    }

    /// Attaches `hooks` to `iface` in `netns`, pinning each link in
    /// `links_dir` as `<ifindex>-<direction>`; see `attach_iface_counters`.
    pub(crate) fn attach_tc(
        &mut self,
        netns: &Netns,
        iface: &str,
        hooks: &[TcHook],
        links_dir: &std::path::Path,
    ) -> Result<TcAttachment, AttachError> {
        let ifindex = ifindex_in(netns, iface)?;
        // New links stay unpinned (owned by this process, detached on drop)
        // until every direction is attached.
        let mut fresh: Vec<(FdLink, PathBuf, &'static str)> = Vec::new();
        let mut links = Vec::new();
        for &(direction, attach_type, program) in hooks {
            let pin = links_dir.join(super::pins::tc_link_name(ifindex, direction));
            let attach_err = |source| AttachError::Attach {
                program,
                iface: iface.to_owned(),
                direction: direction.as_str(),
                netns: netns.path().to_owned(),
                cause: Box::new(source),
            };
            let link_err = |source| AttachError::Link {
                program,
                pin: pin.clone(),
                cause: source,
            };
            forget_defunct_link(&pin, ifindex);
            let classifier = self.classifier(program);
            let replaced = match PinnedLink::from_pin(&pin) {
                Ok(pinned) => {
                    let link =
                        SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(link_err)?;
                    let id = classifier.attach_to_link(link).map_err(attach_err)?;
                    // The pin keeps the link; this process's handle can go.
                    drop(classifier.take_link(id).map_err(attach_err)?);
                    true
                }
                Err(_) => {
                    let id = netns
                        .run(|| {
                            classifier.attach_with_options(
                                iface,
                                attach_type,
                                TcAttachOptions::TcxOrder(LinkOrder::default()),
                            )
                        })?
                        .map_err(attach_err)?;
                    let link = classifier.take_link(id).map_err(attach_err)?;
                    let link = FdLink::try_from(link).map_err(link_err)?;
                    fresh.push((link, pin.clone(), program));
                    false
                }
            };
            links.push(TcLink {
                direction: direction.as_str(),
                program,
                pin,
                replaced,
            });
        }
        pin_all(fresh)?;
        let names: Vec<_> = hooks.iter().map(|(_, _, program)| *program).collect();
        info!(
            "attached {} to {iface} (ifindex {ifindex}) in {}",
            names.join(", "),
            netns.path().display()
        );
        Ok(TcAttachment {
            netns: netns.path().to_owned(),
            netns_inode: netns.inode(),
            iface: iface.to_owned(),
            ifindex,
            links,
        })
    }
}

/// Removes the pin at `pin` if its link no longer runs on interface
/// `ifindex` (the interface was deleted, and the index now names a new
/// one): such a link cannot be updated, and the new interface needs a link
/// of its own.
fn forget_defunct_link(pin: &std::path::Path, ifindex: u32) {
    use std::os::fd::AsFd;
    let Ok(link) = super::sys::obj_get(pin) else {
        return;
    };
    if let Ok(attached) = super::sys::tcx_link_ifindex(link.as_fd())
        && attached != Some(ifindex)
    {
        info!(
            "replacing the defunct link pinned at {} (its interface is gone)",
            pin.display()
        );
        let _ = fs::remove_file(pin);
    }
}

fn ifindex_in(netns: &Netns, iface: &str) -> Result<u32, AttachError> {
    netns
        .run(|| nix::net::if_::if_nametoindex(iface))?
        .map_err(|_| AttachError::NoSuchInterface {
            iface: iface.to_owned(),
            netns: netns.path().to_owned(),
        })
}

/// Pins every link, or on any failure removes the pins already made so the
/// links are dropped (and detached) together.
fn pin_all(links: Vec<(FdLink, PathBuf, &'static str)>) -> Result<(), AttachError> {
    let mut made: Vec<PathBuf> = Vec::new();
    let mut failure = None;
    for (link, pin, program) in links {
        if failure.is_some() {
            continue; // dropped unpinned: detached
        }
        let result = pin
            .parent()
            .map_or(Ok(()), fs::create_dir_all)
            .map_err(|e| e.to_string())
            .and_then(|()| link.pin(&pin).map(drop).map_err(|e| crate::error_chain(&e)));
        match result {
            Ok(()) => made.push(pin),
            Err(reason) => {
                failure = Some(AttachError::Pin {
                    program,
                    pin,
                    reason,
                })
            }
        }
    }
    match failure {
        None => Ok(()),
        Some(err) => {
            for pin in made {
                let _ = fs::remove_file(pin);
            }
            Err(err)
        }
    }
}

/// Detaches what [`Dataplane::attach_iface_counters`] attached, by removing
/// the link pins (no process holds those links otherwise). Returns the pins
/// removed; none is not an error, so detaching is idempotent.
pub fn detach_iface_counters(
    pins: &PinLayout,
    netns: &Netns,
    iface: &str,
) -> Result<Vec<PathBuf>, AttachError> {
    let ifindex = ifindex_in(netns, iface)?;
    let netns_inode = netns.inode();
    let mut removed = Vec::new();
    for (direction, _, _) in COUNTER_HOOKS {
        let pin = pins.tc_link(netns_inode, ifindex, direction);
        match fs::remove_file(&pin) {
            Ok(()) => removed.push(pin),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(AttachError::Pin {
                    program: "-",
                    pin,
                    reason: format!("cannot remove: {e}"),
                });
            }
        }
    }
    // Drop the namespace's directory once its last link is gone.
    let dir = pins.tc_netns_dir(netns_inode);
    if fs::read_dir(&dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false)
    {
        let _ = fs::remove_dir(&dir);
    }
    Ok(removed)
}
