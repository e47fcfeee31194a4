//! The socket programs, attached once to the cgroup that holds the pods
//! (the node's root cgroup in production), each through a pinned bpf_link.
//!
//! Re-attaching where a link is pinned swaps the program inside the link
//! (BPF_LINK_UPDATE), so an upgraded agent replaces its programs without a
//! moment in which sockets escape redirection.

use std::{
    fs::{self, File},
    io,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use ambpf_common::programs;
use aya::programs::Program;
use tracing::{info, warn};

use super::{
    Dataplane, PinLayout,
    sys::{self, CgroupHook},
};

/// Each socket program and the hook it attaches to.
pub const HOOKS: &[(&str, CgroupHook)] = &[
    (programs::CONNECT4, CgroupHook::Inet4Connect),
    (programs::CONNECT6, CgroupHook::Inet6Connect),
    (programs::SENDMSG4, CgroupHook::Udp4Sendmsg),
    (programs::SENDMSG6, CgroupHook::Udp6Sendmsg),
    (programs::RECVMSG4, CgroupHook::Udp4Recvmsg),
    (programs::RECVMSG6, CgroupHook::Udp6Recvmsg),
    (programs::GETPEERNAME4, CgroupHook::Inet4Getpeername),
    (programs::GETPEERNAME6, CgroupHook::Inet6Getpeername),
    (programs::GETSOCKOPT, CgroupHook::Getsockopt),
    (programs::SOCK_OPS, CgroupHook::SockOps),
];

/// The raw-socket guard's programs and hooks, attached with [`HOOKS`] where
/// the kernel could load them.
pub const RAW_GUARD_HOOKS: &[(&str, CgroupHook)] = &[
    (programs::RAW_SOCK_CREATE, CgroupHook::InetSockCreate),
    (programs::RAW_EGRESS, CgroupHook::InetEgress),
];

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroup {path}: {cause} (ambpf needs a cgroup v2 directory)")]
    Open { path: PathBuf, cause: io::Error },
    #[error("{path} is not a cgroup v2 directory")]
    NotCgroup2 { path: PathBuf },
    #[error("attaching {program} to cgroup {path}: {cause}")]
    Attach {
        program: &'static str,
        path: PathBuf,
        cause: io::Error,
    },
    #[error("pinning the link of {program} at {pin}: {cause}")]
    Pin {
        program: &'static str,
        pin: PathBuf,
        cause: io::Error,
    },
}

impl PinLayout {
    pub fn cgroup_links_dir(&self, cgroup_inode: u64) -> PathBuf {
        self.root()
            .join("links/cgroup")
            .join(cgroup_inode.to_string())
    }
}

/// `CGROUP2_SUPER_MAGIC` from linux/magic.h.
const CGROUP2_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x6367_7270);

impl Dataplane {
    /// Attaches every socket program to `cgroup`. Idempotent: programs in
    /// pinned links are replaced atomically, missing links are created.
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<(), CgroupError> {
        let open_err = |source| CgroupError::Open {
            path: cgroup.to_owned(),
            cause: source,
        };
        let dir = File::open(cgroup).map_err(open_err)?;
        let is_cgroup2 =
            nix::sys::statfs::fstatfs(&dir).is_ok_and(|fs| fs.filesystem_type() == CGROUP2_MAGIC);
        if !is_cgroup2 {
            return Err(CgroupError::NotCgroup2 {
                path: cgroup.to_owned(),
            });
        }
        let inode = dir.metadata().map_err(open_err)?.ino();
        let links_dir = self.pins().cgroup_links_dir(inode);
        fs::create_dir_all(&links_dir).map_err(|source| CgroupError::Pin {
            program: "-",
            pin: links_dir.clone(),
            cause: source,
        })?;

        let guard: &[_] = if self.raw_guard() {
            RAW_GUARD_HOOKS
        } else {
            &[]
        };
        // Whether this kernel put the links created here ahead of the
        // hooks' other programs (unknown until one is created).
        let mut ordered = None;
        for &(program, hook) in HOOKS.iter().chain(guard) {
            let pin = links_dir.join(program);
            let attach_err = |source| CgroupError::Attach {
                program,
                path: cgroup.to_owned(),
                cause: source,
            };
            let prog_fd = program_fd(self.program_mut(program)).map_err(attach_err)?;
            match sys::obj_get(&pin) {
                Ok(link) => sys::link_update(link.as_fd(), prog_fd.as_fd()).map_err(attach_err)?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let link = if hook.answers_the_app() {
                        // Appended: after what others attached before.
                        sys::cgroup_link_create(prog_fd.as_fd(), dir.as_fd(), hook)
                    } else {
                        create_link_first(prog_fd.as_fd(), dir.as_fd(), hook, &mut ordered)
                    }
                    .map_err(attach_err)?;
                    // Once pinned, the link outlives this process; the fd can go.
                    sys::obj_pin(&link, &pin).map_err(|source| CgroupError::Pin {
                        program,
                        pin: pin.clone(),
                        cause: source,
                    })?;
                }
                Err(source) => {
                    return Err(CgroupError::Pin {
                        program,
                        pin,
                        cause: source,
                    });
                }
            }
        }
        info!(
            "socket programs attached to cgroup {}{}",
            cgroup.display(),
            if guard.is_empty() {
                " (without the raw-socket guard)"
            } else {
                ", with the raw-socket guard"
            }
        );
        if ordered == Some(false) {
            warn!(
                "this kernel cannot order cgroup programs (Linux 6.17 on can): ambpf's socket \
                 programs run after those attached to cgroup {} before them",
                cgroup.display()
            );
        }
        super::foreign::log_cgroup_warnings(cgroup, &links_dir);
        Ok(())
    }
}

/// Creates a cgroup link that runs ahead of the hook's other programs, so
/// that a socket load balancer attached earlier (Cilium's, Calico's) sees
/// the connection after ambpf has recorded its original destination; on a
/// kernel without ordered cgroup attachment, one that runs after them.
/// `ordered` remembers which, so that the flag is tried once.
fn create_link_first(
    program: std::os::fd::BorrowedFd<'_>,
    cgroup: std::os::fd::BorrowedFd<'_>,
    hook: CgroupHook,
    ordered: &mut Option<bool>,
) -> io::Result<std::os::fd::OwnedFd> {
    if *ordered != Some(false) {
        match sys::cgroup_link_create_first(program, cgroup, hook) {
            Ok(link) => {
                *ordered = Some(true);
                return Ok(link);
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => *ordered = Some(false),
            Err(e) => return Err(e),
        }
    }
    sys::cgroup_link_create(program, cgroup, hook)
}

/// Detaches the socket programs from the cgroup with inode `cgroup_inode` by
/// removing their link pins. Returns how many were removed.
pub fn detach_cgroup(pins: &PinLayout, cgroup_inode: u64) -> io::Result<usize> {
    let dir = pins.cgroup_links_dir(cgroup_inode);
    let mut removed = 0;
    for &(program, _) in HOOKS.iter().chain(RAW_GUARD_HOOKS) {
        match fs::remove_file(dir.join(program)) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    let _ = fs::remove_dir(&dir);
    Ok(removed)
}

fn program_fd(program: &Program) -> io::Result<std::os::fd::OwnedFd> {
    let fd = match program {
        Program::CgroupSockAddr(p) => p.fd(),
        Program::CgroupSockopt(p) => p.fd(),
        Program::SockOps(p) => p.fd(),
        Program::CgroupSkb(p) => p.fd(),
        Program::CgroupSock(p) => p.fd(),
        _ => return Err(io::Error::other("not a cgroup socket program")),
    }
    .map_err(|e| io::Error::other(e.to_string()))?;
    fd.as_fd().try_clone_to_owned()
}
