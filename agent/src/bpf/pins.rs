//! Where ambpf keeps its pinned objects on bpffs.
//!
//! ```text
//! <root>/                       default /sys/fs/bpf/ambpf
//!   maps/<map name>             every map the programs share with the agent
//!   links/tc/<netns inode>/<ifindex>-<ingress|egress>    interface counters
//!   links/cgroup/<cgroup inode>/<program>                socket programs
//!   progs/ambpf_pod_in                                   the steering program pods' tc filters run
//!   iptables/pods/<netns cookie>-<netns inode>           iptables mode: its enrolled pods
//! ```
//! Links are pinned so attachments survive the agent (restarts, upgrades);
//! removing a link's pin while no process holds it detaches the program.
//! bpffs refuses names containing '.', and interface names may contain one
//! (VLANs), so links are named by ifindex, unique within their namespace.

use std::{
    io,
    path::{Path, PathBuf},
};

use ambpf_common::Direction;

/// The bpffs mount point most distributions use.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/ambpf";

#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error(
        "{path} is not on a bpf filesystem (found {found}); mount one, e.g. `mount -t bpf bpf {mount}`"
    )]
    NotBpffs {
        path: PathBuf,
        found: String,
        mount: String,
    },
    #[error("cannot use pin directory {path}: {cause}")]
    Io { path: PathBuf, cause: io::Error },
    #[error(
        "{path} is the root of a mounted filesystem; pin into a directory of ambpf's own below \
         it (e.g. {path}/ambpf), which `ambpf uninstall` can remove whole"
    )]
    MountRoot { path: PathBuf },
}

#[derive(Clone, Debug)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn maps_dir(&self) -> PathBuf {
        self.root.join("maps")
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    /// Programs pinned so that other processes can tell the agent's own:
    /// the steering program, which runs in pods' tc filters.
    pub fn program(&self, name: &str) -> PathBuf {
        self.root.join("progs").join(name)
    }

    pub fn tc_links_dir(&self) -> PathBuf {
        self.root.join("links/tc")
    }

    pub fn tc_netns_dir(&self, netns_inode: u64) -> PathBuf {
        self.tc_links_dir().join(netns_inode.to_string())
    }

    pub fn tc_link(&self, netns_inode: u64, ifindex: u32, direction: Direction) -> PathBuf {
        self.tc_netns_dir(netns_inode)
            .join(tc_link_name(ifindex, direction))
    }

    /// Where every enrolled pod's links are, one directory each.
    pub fn pod_links_root(&self) -> PathBuf {
        self.root.join("links/pods")
    }

    /// Links of one enrolled pod (its inbound steering), by netns cookie:
    /// unlike an nsfs inode number, a cookie is never reused, so a new pod
    /// never finds a dead pod's links in its directory.
    pub fn pod_links_dir(&self, netns_cookie: u64) -> PathBuf {
        self.pod_links_root().join(netns_cookie.to_string())
    }

    /// Where the iptables mode records its enrolled pods, one empty
    /// directory each.
    pub fn iptables_pods_dir(&self) -> PathBuf {
        self.root.join("iptables/pods")
    }

    /// The nftables mode's pod records, as [`Self::iptables_pods_dir`].
    pub fn nftables_pods_dir(&self) -> PathBuf {
        self.root.join("nftables/pods")
    }

    /// Checks that the root lies on bpffs, below its mount point (the root
    /// is ambpf's alone), and creates the directory tree.
    pub fn prepare(&self) -> Result<(), PinError> {
        check_bpffs(&self.root)?;
        if is_mount_root(&self.root) {
            return Err(PinError::MountRoot {
                path: self.root.clone(),
            });
        }
        for dir in [
            self.maps_dir(),
            self.tc_links_dir(),
            self.root.join("progs"),
        ] {
            std::fs::create_dir_all(&dir).map_err(|source| PinError::Io {
                path: dir,
                cause: source,
            })?;
        }
        Ok(())
    }
}

/// An exclusive lock on a pin root, held by the agent for as long as it
/// runs: the agent is the only writer of the pinned maps and compares
/// entries before deleting them, which is race-free only while no second
/// agent writes the same maps. A second agent started on the same pin root
/// (an overlapping rolling update) waits until the first exits; the lock
/// goes with the process, however it ends.
#[derive(Debug)]
pub struct PinRootLock {
    _locked: nix::fcntl::Flock<std::fs::File>,
}

impl PinRootLock {
    /// Takes the lock on `pins`' root if no one holds it; `None` when
    /// another agent does, or the root cannot be opened.
    pub fn try_acquire(pins: &PinLayout) -> Option<Self> {
        use nix::fcntl::{Flock, FlockArg};
        let dir = std::fs::File::open(&pins.root).ok()?;
        Flock::lock(dir, FlockArg::LockExclusiveNonblock)
            .ok()
            .map(|locked| Self { _locked: locked })
    }

    /// Takes the lock on `pins`' root (created by [`PinLayout::prepare`]),
    /// waiting for another holder, which is named in the log meanwhile.
    pub fn acquire(pins: &PinLayout) -> Result<Self, PinError> {
        use nix::fcntl::{Flock, FlockArg};
        let io_err = |source| PinError::Io {
            path: pins.root.clone(),
            cause: source,
        };
        let dir = std::fs::File::open(&pins.root).map_err(io_err)?;
        let dir = match Flock::lock(dir, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((dir, nix::errno::Errno::EWOULDBLOCK)) => {
                tracing::warn!(
                    "another ambpf agent is using {}; waiting for it to exit",
                    pins.root.display()
                );
                Flock::lock(dir, FlockArg::LockExclusive)
                    .map_err(|(_, errno)| io_err(errno.into()))?
            }
            Err((_, errno)) => return Err(io_err(errno.into())),
        };
        Ok(Self { _locked: dir })
    }
}

/// A TC link's pin file name.
pub fn tc_link_name(ifindex: u32, direction: Direction) -> String {
    format!("{ifindex}-{}", direction.as_str())
}

/// Parses a link pin's file name back into ifindex and direction.
pub fn parse_tc_link_name(name: &str) -> Option<(u32, Direction)> {
    let (ifindex, direction) = name.split_once('-')?;
    let direction = match direction {
        "ingress" => Direction::Ingress,
        "egress" => Direction::Egress,
        _ => return None,
    };
    Some((ifindex.parse().ok()?, direction))
}

/// Whether `path` exists and is where a filesystem is mounted (a different
/// device from its parent's, or `/`).
pub fn is_mount_root(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(canonical) = path.canonicalize() else {
        return false;
    };
    let Some(parent) = canonical.parent() else {
        return true;
    };
    match (std::fs::metadata(&canonical), std::fs::metadata(parent)) {
        (Ok(this), Ok(parent)) => this.dev() != parent.dev(),
        _ => false,
    }
}

/// Checks that `path`, or the nearest ancestor that exists, is on bpffs.
pub fn check_bpffs(path: &Path) -> Result<(), PinError> {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or_else(|| Path::new("/"));
    let fs = nix::sys::statfs::statfs(existing).map_err(|e| PinError::Io {
        path: existing.to_owned(),
        cause: e.into(),
    })?;
    if fs.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC {
        return Ok(());
    }
    Err(PinError::NotBpffs {
        path: path.to_owned(),
        found: format!(
            "filesystem magic {:#x} at {}",
            fs.filesystem_type().0,
            existing.display()
        ),
        mount: existing.display().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_roots_are_told_from_directories_below_them() {
        assert!(is_mount_root(Path::new("/")));
        assert!(is_mount_root(Path::new("/proc")));
        assert!(!is_mount_root(Path::new("/proc/self")));
        assert!(!is_mount_root(Path::new("/no/such/dir")));
    }

    #[test]
    fn a_pin_root_at_a_mount_point_is_refused() {
        // Privileged: a fresh bpffs, whose root must not be the pin root.
        let bpffs = ambpf_testbed::BpffsMount::create().unwrap();
        let at_root = PinLayout::new(bpffs.path());
        assert!(matches!(at_root.prepare(), Err(PinError::MountRoot { .. })));
        let below = PinLayout::new(bpffs.path().join("ambpf"));
        below.prepare().unwrap();
        assert!(below.maps_dir().is_dir());
    }

    #[test]
    fn a_second_holder_of_the_pin_root_waits_for_the_first() {
        let bpffs = ambpf_testbed::BpffsMount::create().unwrap();
        let pins = PinLayout::new(bpffs.path().join("ambpf"));
        pins.prepare().unwrap();
        let first = PinRootLock::acquire(&pins).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let second = {
            let pins = pins.clone();
            std::thread::spawn(move || {
                let lock = PinRootLock::acquire(&pins).unwrap();
                tx.send(()).unwrap();
                lock
            })
        };
        let wait = std::time::Duration::from_millis(300);
        assert!(
            rx.recv_timeout(wait).is_err(),
            "the second took a held lock"
        );
        drop(first);
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the second gets the lock once the first is gone");
        drop(second.join().unwrap());
    }

    #[test]
    fn layout_names_every_pin_under_the_root() {
        let pins = PinLayout::new("/sys/fs/bpf/ambpf");
        assert_eq!(
            pins.map("ambpf_if_stats"),
            Path::new("/sys/fs/bpf/ambpf/maps/ambpf_if_stats")
        );
        assert_eq!(
            pins.tc_link(4026532000, 2, Direction::Egress),
            Path::new("/sys/fs/bpf/ambpf/links/tc/4026532000/2-egress")
        );
    }

    #[test]
    fn link_names_round_trip() {
        let pins = PinLayout::new("/b");
        for direction in [Direction::Ingress, Direction::Egress] {
            let pin = pins.tc_link(1, 17, direction);
            let name = pin.file_name().unwrap().to_str().unwrap();
            assert!(!name.contains('.'), "bpffs refuses dots: {name}");
            assert_eq!(parse_tc_link_name(name), Some((17, direction)));
        }
        assert_eq!(parse_tc_link_name("17-sideways"), None);
        assert_eq!(parse_tc_link_name("eth0-ingress"), None);
    }

    #[test]
    fn a_non_bpffs_directory_is_refused_with_the_mount_hint() {
        let dir = std::env::temp_dir().join("ambpf-not-bpffs");
        let err = check_bpffs(&dir.join("pins")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("is not on a bpf filesystem"), "{msg}");
        assert!(msg.contains("mount -t bpf bpf"), "{msg}");
    }
}
