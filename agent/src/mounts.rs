//! The host filesystems ambpf needs: the cgroup v2 hierarchy, wherever it is
//! mounted (`/sys/fs/cgroup` on pure cgroup v2 hosts, `/sys/fs/cgroup/unified`
//! on hybrid ones, or a place of the administrator's choosing), and the
//! kernel's bpf filesystem.
//!
//! Standard library only: the testbed and xtask include this file with
//! `#[path]`, since neither depends on the agent.

use std::{
    fmt, io,
    path::{Path, PathBuf},
};

/// What the host lacks, each with how to get it.
#[derive(Debug)]
pub enum MountError {
    Unreadable(&'static str, io::Error),
    CgroupV1Only,
    NoCgroup,
    NoBpffs,
}

impl fmt::Display for MountError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreadable(path, e) => write!(f, "cannot read {path} ({e}): is /proc mounted?"),
            Self::CgroupV1Only => f.write_str(
                "this machine has cgroup v1 only and ambpf needs cgroup v2: boot with \
                 systemd.unified_cgroup_hierarchy=1, or mount it with `mkdir -p \
                 /sys/fs/cgroup/unified && mount -t cgroup2 none /sys/fs/cgroup/unified`",
            ),
            Self::NoCgroup => f.write_str(
                "no cgroup filesystem is mounted and ambpf needs cgroup v2: mount it with \
                 `mount -t cgroup2 none /sys/fs/cgroup`",
            ),
            Self::NoBpffs => f.write_str(
                "this kernel has no bpf filesystem (no `bpf` in /proc/filesystems): ambpf needs \
                 a Linux 5.15 or later kernel built with CONFIG_BPF_SYSCALL=y",
            ),
        }
    }
}

impl std::error::Error for MountError {}

impl From<MountError> for io::Error {
    fn from(e: MountError) -> Self {
        let kind = match e {
            MountError::Unreadable(_, ref e) => e.kind(),
            _ => io::ErrorKind::NotFound,
        };
        io::Error::new(kind, e)
    }
}

/// Where this process's mount namespace has the cgroup v2 hierarchy.
pub fn cgroup2_mount() -> Result<PathBuf, MountError> {
    const MOUNTINFO: &str = "/proc/self/mountinfo";
    let mountinfo =
        std::fs::read_to_string(MOUNTINFO).map_err(|e| MountError::Unreadable(MOUNTINFO, e))?;
    find_cgroup2(&mountinfo)
}

/// The cgroup2 mount point in `mountinfo` (proc(5)'s format). A mount of the
/// hierarchy's root is preferred to a bind mount of a cgroup below it, whose
/// paths would not match /proc/<pid>/cgroup's.
pub fn find_cgroup2(mountinfo: &str) -> Result<PathBuf, MountError> {
    let mut cgroup1 = false;
    let mut below_root = None;
    for (root, point, fstype) in mounts(mountinfo) {
        match fstype {
            "cgroup2" if root == "/" => return Ok(unescape(point)),
            "cgroup2" => {
                below_root.get_or_insert_with(|| unescape(point));
            }
            "cgroup" => cgroup1 = true,
            _ => {}
        }
    }
    below_root.ok_or(if cgroup1 {
        MountError::CgroupV1Only
    } else {
        MountError::NoCgroup
    })
}

/// The cgroup v2 hierarchy `given` names: `given` itself, or, where it is a
/// hybrid host's `/sys/fs/cgroup` (a tmpfs of v1 controllers), the cgroup2
/// root mounted below it (`unified`). The last mount at a point is the one
/// visible, as a hostPath bind mounted over the runtime's own.
pub fn cgroup2_at_or_below(given: &Path, mountinfo: &str) -> Option<PathBuf> {
    let mut found = None;
    for (root, point, fstype) in mounts(mountinfo) {
        let point = unescape(point);
        if point == given {
            // A later mount over `given` hides whatever was found below it.
            found = (fstype == "cgroup2").then(|| point.clone());
        } else if fstype == "cgroup2" && root == "/" && point.starts_with(given) {
            found = Some(point);
        }
    }
    found
}

/// Each mount of `mountinfo` (proc(5)'s format) as (root, mount point as
/// written, filesystem type); lines it cannot read are skipped.
fn mounts(mountinfo: &str) -> impl Iterator<Item = (&str, &str, &str)> {
    mountinfo.lines().filter_map(|line| {
        let mut fields = line.split(' ');
        let (root, point) = (fields.nth(3)?, fields.next()?);
        // Optional fields end at "-"; the filesystem type follows.
        let fstype = fields.skip_while(|f| *f != "-").nth(1)?;
        Some((root, point, fstype))
    })
}

/// Whether the kernel offers the bpf filesystem (tests and the demo mount
/// private ones; the agent pins below one).
pub fn check_bpffs_support() -> Result<(), MountError> {
    const FILESYSTEMS: &str = "/proc/filesystems";
    let list =
        std::fs::read_to_string(FILESYSTEMS).map_err(|e| MountError::Unreadable(FILESYSTEMS, e))?;
    if list
        .lines()
        .any(|l| l.split_whitespace().last() == Some("bpf"))
    {
        Ok(())
    } else {
        Err(MountError::NoBpffs)
    }
}

/// Mount points escape space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt as _;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal.and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok()) {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hybrid_hosts_cgroup_tmpfs_resolves_to_its_unified_hierarchy() {
        let hybrid = "\
30 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/cpu rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,cpu
";
        let given = Path::new("/sys/fs/cgroup");
        assert_eq!(
            cgroup2_at_or_below(given, hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        // Pure cgroup v2: the path itself.
        assert_eq!(cgroup2_at_or_below(given, PURE_V2), Some(given.to_owned()));
        // Only v1 controllers: nothing.
        let v1_only = "30 25 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n32 30 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(cgroup2_at_or_below(given, v1_only), None);
    }

    const PURE_V2: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:8 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
27 25 0:25 / /sys/fs/bpf rw,nosuid,nodev,noexec,relatime shared:9 - bpf bpf rw,mode=700
";

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime shared:5 - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:6 - cgroup2 cgroup2 rw
";

    const V1_ONLY: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
";

    #[test]
    fn finds_cgroup2_on_pure_v2_and_hybrid_hosts() {
        assert_eq!(
            find_cgroup2(PURE_V2).unwrap(),
            PathBuf::from("/sys/fs/cgroup")
        );
        assert_eq!(
            find_cgroup2(HYBRID).unwrap(),
            PathBuf::from("/sys/fs/cgroup/unified")
        );
    }

    #[test]
    fn says_what_is_missing() {
        assert!(matches!(
            find_cgroup2(V1_ONLY),
            Err(MountError::CgroupV1Only)
        ));
        assert!(matches!(find_cgroup2(""), Err(MountError::NoCgroup)));
        let message = MountError::CgroupV1Only.to_string();
        assert!(message.contains("cgroup v2") && message.contains("mount -t cgroup2"));
    }

    #[test]
    fn prefers_the_hierarchy_root_and_unescapes_the_mount_point() {
        let mountinfo = "\
50 22 0:24 /kubepods /host/pods rw - cgroup2 cgroup2 rw
51 22 0:24 / /mnt/my\\040cgroup rw - cgroup2 cgroup2 rw
";
        assert_eq!(
            find_cgroup2(mountinfo).unwrap(),
            PathBuf::from("/mnt/my cgroup")
        );
        assert_eq!(
            find_cgroup2(mountinfo.lines().next().unwrap()).unwrap(),
            PathBuf::from("/host/pods")
        );
    }

    #[test]
    fn skips_lines_it_cannot_read() {
        let mountinfo = format!("garbage\n1 2 3\n{HYBRID}");
        assert_eq!(
            find_cgroup2(&mountinfo).unwrap(),
            PathBuf::from("/sys/fs/cgroup/unified")
        );
    }
}
