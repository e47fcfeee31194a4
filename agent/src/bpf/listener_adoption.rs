//! ztunnel's inbound listeners that were listening before the programs
//! were: filed by the agent itself.
//!
//! `sock_ops` files ztunnel's 15006 listener of a pod when ztunnel calls
//! `listen()` ([`super::inbound`]). A pod ztunnel already serves when the
//! eBPF mode first enrols it (a node switched from the iptables or nftables
//! mode, or from Istio's node agent) had its listener opened before any
//! program ran, and ztunnel keeps it across the switch (an Add for a pod it
//! runs, with the same namespace, changes nothing). Without it filed, every
//! inbound connection to the pod would be refused. So at a pod's first
//! enrolment, the listening sockets on 15006 in its namespace are found
//! (over sock_diag, from inside: [`crate::sock_diag`]), their holder among
//! the host's processes (`/proc/<pid>/fd`), and a descriptor of each taken
//! with `pidfd_getfd` (Linux 5.6; CAP_SYS_PTRACE, which the agent has to
//! open pods' namespaces). One that carries ztunnel's mark is filed, as
//! `sock_ops` would file it: the assignment picks within its SO_REUSEPORT
//! group, so one listener of the group is enough.

use std::{
    collections::HashMap,
    io,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use ambpf_common::{maps, ztunnel};
use aya::maps::SockHash;

/// The inodes of the TCP sockets listening on `port` in the calling
/// thread's network namespace, both families.
pub fn listening_inodes(port: u16) -> io::Result<Vec<u64>> {
    Ok(crate::sock_diag::tcp_listeners(port)?
        .into_iter()
        .map(|l| l.inode)
        .collect())
}

/// Why a pod's listener could not be filed.
#[derive(Debug, thiserror::Error)]
pub enum AdoptionError {
    #[error("reading the sockets listening in the pod: {0}")]
    Read(#[from] io::Error),
    #[error("no process holds the listening socket (inode {inode}) on {port}")]
    NoHolder { inode: u64, port: u16 },
    #[error("taking descriptor {fd} of process {pid} (pidfd_getfd): {cause}")]
    Take { pid: i32, fd: i32, cause: io::Error },
    #[error("recording process {pid}, which holds ztunnel's listener, as ztunnel's: {cause}")]
    Record { pid: i32, cause: io::Error },
    #[error("filing ztunnel's listener in {}: {cause}", maps::INBOUND_LISTENERS)]
    File { cause: aya::maps::MapError },
}

/// Where each socket is held, by inode: a process and its descriptor,
/// found by one scan of every process's descriptors, done again when a
/// socket is not found, at most once a [`RESCAN_AFTER`] (a switched node's
/// first pass enrols every pod in a row, each with its listener).
#[derive(Debug, Default)]
pub struct SocketHolders {
    by_inode: HashMap<u64, (i32, i32)>,
    scanned: Option<Instant>,
}

const RESCAN_AFTER: Duration = Duration::from_secs(1);

impl SocketHolders {
    fn find(&mut self, inode: u64, fresh: bool) -> Option<(i32, i32)> {
        let stale = self.scanned.is_none_or(|at| at.elapsed() >= RESCAN_AFTER);
        if fresh || (stale && !self.by_inode.contains_key(&inode)) {
            self.scan();
        }
        self.by_inode.get(&inode).copied()
    }

    fn scan(&mut self) {
        self.by_inode.clear();
        self.scanned = Some(Instant::now());
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return;
        };
        for process in procs.flatten() {
            let Some(pid) = process.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let Ok(fds) = std::fs::read_dir(process.path().join("fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                let Some(number) = fd.file_name().to_str().and_then(|n| n.parse().ok()) else {
                    continue;
                };
                let Ok(target) = std::fs::read_link(fd.path()) else {
                    continue;
                };
                let inode = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
                    .and_then(|t| t.parse().ok());
                if let Some(inode) = inode {
                    self.by_inode.entry(inode).or_insert((pid, number));
                }
            }
        }
    }

    /// A descriptor of the socket `inode`, and the process it was taken
    /// from; `Ok(None)` when no process holds it any more.
    fn take(&mut self, inode: u64) -> Result<Option<(i32, OwnedFd)>, AdoptionError> {
        for fresh in [false, true] {
            let Some((pid, fd)) = self.find(inode, fresh) else {
                return Ok(None);
            };
            match take_fd(pid, fd) {
                // The descriptor may have been closed and its number reused
                // since the scan: only the socket itself will do.
                Ok(taken) if inode_of(&taken) == Some(inode) => return Ok(Some((pid, taken))),
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBADF) => {}
                Err(cause) => return Err(AdoptionError::Take { pid, fd, cause }),
            }
        }
        Ok(None)
    }
}

fn take_fd(pid: i32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls; each returned descriptor is owned from here.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let taken = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if taken < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(taken as i32))
    }
}

fn inode_of(fd: &OwnedFd) -> Option<u64> {
    nix::sys::stat::fstat(fd.as_fd()).ok().map(|s| s.st_ino)
}

/// The inode of the network namespace process `pid` lives in.
fn netns_of(pid: i32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .ok()
        .map(|m| m.ino())
}

fn mark_of(fd: &OwnedFd) -> Option<u32> {
    nix::sys::socket::getsockopt(fd, nix::sys::socket::sockopt::Mark).ok()
}

impl super::Dataplane {
    /// Files ztunnel's listener of the pod whose netns cookie is `cookie`
    /// and namespace inode `netns_inode`, among the sockets listening on its
    /// inbound port there (`inodes`, from [`listening_inodes`] run in the
    /// pod): the first that carries ztunnel's mark and is held by a process
    /// living outside the pod's namespace (a process of the pod that set the
    /// mark, which CAP_NET_RAW allows, is not ztunnel; only a process the
    /// node trusts can open a socket in another pod's namespace). Its
    /// holder is recorded as ztunnel's process ([`super::ztunnel_procs`]), as
    /// ztunnel's ZDS connection would record it: until ztunnel reconnects to
    /// this agent, its own marked sockets in the pods must not be taken for
    /// an app's. Returns whether one was filed.
    pub fn adopt_inbound_listener(
        &mut self,
        cookie: u64,
        netns_inode: u64,
        inodes: &[u64],
        holders: &mut SocketHolders,
    ) -> Result<bool, AdoptionError> {
        for &inode in inodes {
            let Some((pid, socket)) = holders.take(inode)? else {
                return Err(AdoptionError::NoHolder {
                    inode,
                    port: ztunnel::INBOUND_PORT,
                });
            };
            let outside = netns_of(pid).is_some_and(|own| own != netns_inode);
            if mark_of(&socket) != Some(ztunnel::MARK) || !outside {
                continue;
            }
            if let Err(cause) = super::ztunnel_procs::update(self.pins(), &[pid as u32]) {
                return Err(AdoptionError::Record { pid, cause });
            }
            let mut listeners: SockHash<_, u64> =
                SockHash::try_from(self.map_mut(maps::INBOUND_LISTENERS))
                    .map_err(|cause| AdoptionError::File { cause })?;
            listeners
                .insert(cookie, socket.as_raw_fd(), 0)
                .map_err(|cause| AdoptionError::File { cause })?;
            return Ok(true);
        }
        Ok(false)
    }
}
