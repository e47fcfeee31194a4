//! Network namespaces: opening them by name or path, and running code inside.

use std::{
    fs::File,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use nix::sched::{CloneFlags, setns};

/// Where `ip netns add` (and the CNI runtimes) bind-mount named namespaces.
pub const NAMED_NETNS_DIR: &str = "/run/netns";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {path} does not exist")]
    NotFound { path: PathBuf },
    #[error("cannot open network namespace {path}: {cause}")]
    Open {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path} is not a network namespace")]
    NotANetns { path: PathBuf },
    #[error("cannot enter network namespace {path}: {cause}")]
    Enter { path: PathBuf, cause: nix::Error },
}

/// An open handle on a network namespace. Holding it keeps the namespace alive.
#[derive(Debug)]
pub struct Netns {
    file: File,
    path: PathBuf,
    inode: u64,
}

impl Netns {
    /// Opens `spec`: a path (`/proc/<pid>/ns/net`, `/run/netns/<name>`, ...) or
    /// the bare name of a namespace under [`NAMED_NETNS_DIR`].
    pub fn open(spec: &str) -> Result<Self, NetnsError> {
        let path = if spec.contains('/') {
            PathBuf::from(spec)
        } else {
            Path::new(NAMED_NETNS_DIR).join(spec)
        };
        let file = File::open(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => NetnsError::NotFound { path: path.clone() },
            _ => NetnsError::Open {
                path: path.clone(),
                cause: source,
            },
        })?;
        let meta = file.metadata().map_err(|source| NetnsError::Open {
            path: path.clone(),
            cause: source,
        })?;
        // A name under /run/netns whose bind mount is gone is an empty regular
        // file on tmpfs; a live namespace is an nsfs inode.
        if !is_nsfs(&file) {
            return Err(NetnsError::NotANetns { path });
        }
        Ok(Self {
            file,
            path,
            inode: meta.ino(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The namespace's inode number on nsfs: its identity on this host, the
    /// same value `ls -Li /proc/<pid>/ns/net` prints.
    pub fn inode(&self) -> u64 {
        self.inode
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Runs `f` on a short-lived thread that has entered this namespace.
    /// Network namespaces are per thread, so nothing else in the process
    /// changes namespace, and sockets or links created by `f` stay bound to
    /// this one after the thread ends.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| {
                        NetnsError::Enter {
                            path: self.path.clone(),
                            cause: source,
                        }
                    })?;
                    Ok(f())
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

/// Where named namespaces are bind-mounted: iproute2's directory, and
/// `/var/run/netns` (the same directory on hosts where `/var/run` links to
/// `/run`, a second one where it does not; CRI-O and containerd use it).
const NAMED_NETNS_DIRS: [&str; 2] = [NAMED_NETNS_DIR, "/var/run/netns"];

/// Paths that may name a network namespace: the named ones (sorted, per
/// directory), then `/proc/<pid>/ns/net` of every process.
fn candidate_paths() -> impl Iterator<Item = PathBuf> {
    let named = NAMED_NETNS_DIRS.into_iter().flat_map(|dir| {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        paths.sort();
        paths
    });
    let processes = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path().join("ns/net"));
    named.chain(processes)
}

/// Every network namespace on this host that has a name or a process, once
/// each (by inode): the named ones first (/run/netns, /var/run/netns), opened
/// by their name, then those only processes hold (/proc/<pid>/ns/net). It
/// sees what this process's mount and PID namespaces show, so it is complete
/// when run as the agent runs (host PID, /run/netns mounted). A namespace
/// that goes away meanwhile is left out.
pub fn all() -> Vec<Netns> {
    // Many processes share a namespace: a stat tells a repeat (by device and
    // inode) without opening it.
    let mut seen = std::collections::HashSet::new();
    candidate_paths()
        .filter(|path| std::fs::metadata(path).is_ok_and(|m| seen.insert((m.dev(), m.ino()))))
        .filter_map(|path| Netns::open(&path.to_string_lossy()).ok())
        .collect()
}

fn is_nsfs(file: &File) -> bool {
    // NSFS_MAGIC from linux/magic.h (nix does not name it).
    const NSFS_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x6e73_6673);
    nix::sys::statfs::fstatfs(file).is_ok_and(|fs| fs.filesystem_type() == NSFS_MAGIC)
}

/// `SO_NETNS_COOKIE` from `asm-generic/socket.h` (Linux 5.14): the 64-bit
/// cookie of the network namespace a socket belongs to. It is the value the
/// kernel programs read with `bpf_get_netns_cookie`, unique for the life of
/// the host (never reused, unlike an nsfs inode number).
pub const SO_NETNS_COOKIE: libc::c_int = 71;

/// The cookie of the network namespace `socket` belongs to (the namespace of
/// the thread that created it, wherever the descriptor has travelled since).
/// Fails with `ENOPROTOOPT` before Linux 5.14.
pub fn socket_netns_cookie(socket: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u64> {
    let mut cookie: u64 = 0;
    use std::os::fd::AsRawFd as _;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes and `len` holds the
    // size of `cookie`; the kernel writes at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != size_of::<u64>() {
        return Err(std::io::Error::other(format!(
            "SO_NETNS_COOKIE returned {len} bytes, expected 8"
        )));
    }
    Ok(cookie)
}

/// Where the agent writes a `net.*` sysctl of the namespace its thread is
/// in: `/proc/sys/net` shows the namespace of the thread that opens a file
/// there. A container's own `/proc/sys` is read-only (runc mounts it so), so
/// the chart mounts the host's `/proc/sys/net` writable at
/// [`HOST_PROC_SYS_NET`], as Cilium's does; elsewhere (a process on the
/// node, the tests) `/proc/sys/net` is used.
pub fn net_sysctl_path(below_net: &str) -> std::path::PathBuf {
    let host = std::path::Path::new(HOST_PROC_SYS_NET);
    let base = if host.is_dir() {
        host
    } else {
        std::path::Path::new("/proc/sys/net")
    };
    base.join(below_net)
}

/// The chart's mount of the host's `/proc/sys/net`.
pub const HOST_PROC_SYS_NET: &str = "/host/proc/sys/net";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_says_its_cause_once_down_the_chain() {
        // Below a regular file: ENOTDIR, an open error with its cause.
        let err = Netns::open("/proc/self/status/net").unwrap_err();
        assert!(matches!(err, NetnsError::Open { .. }), "{err}");
        let printed = format!("{:#}", anyhow::Error::new(err).context("enrolling a pod"));
        assert_eq!(printed.matches("Not a directory").count(), 1, "{printed}");
    }

    #[test]
    fn missing_namespace_is_named_in_the_error() {
        let err = Netns::open("ambpf-no-such-netns").unwrap_err();
        assert!(matches!(err, NetnsError::NotFound { .. }));
        assert_eq!(
            err.to_string(),
            "network namespace /run/netns/ambpf-no-such-netns does not exist"
        );
    }

    #[test]
    fn regular_file_is_not_a_namespace() {
        let err = Netns::open("/proc/self/status").unwrap_err();
        assert!(matches!(err, NetnsError::NotANetns { .. }), "{err}");
    }

    #[test]
    fn every_namespace_is_listed_once_with_its_name() {
        let named = ambpf_testbed::NetnsGuard::create("all").unwrap();
        let all = all();
        let inodes: std::collections::HashSet<u64> = all.iter().map(Netns::inode).collect();
        assert_eq!(inodes.len(), all.len(), "a namespace listed twice");
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        assert!(inodes.contains(&own));
        let found = all
            .iter()
            .find(|ns| ns.inode() == std::fs::metadata(named.path()).unwrap().ino())
            .expect("the named namespace");
        assert_eq!(found.path(), named.path());
    }

    #[test]
    fn own_namespace_opens_and_runs_code() {
        let ns = Netns::open("/proc/self/ns/net").unwrap();
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        assert_eq!(ns.inode(), own);
        assert_eq!(ns.run(|| 40 + 2).unwrap(), 42);
    }
}
