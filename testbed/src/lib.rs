//! Throwaway kernel objects for ambpf's privileged tests, demo and benchmarks.
//!
//! Every object gets a name unique to this process and call, and is removed
//! when its guard drops, so a failing (panicking) test cleans up too. Nothing
//! here touches objects it did not create: traffic stays between a test's own
//! namespaces.
//!
//! Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's `ip`.
//!
//! [`ztunnel`] is a ztunnel test double: the ZDS client and in-pod proxies the
//! agent hands pods to.

use std::{
    ffi::OsStr,
    fs::{self, File},
    io,
    os::{fd::AsFd, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
};

use nix::{
    mount::{MntFlags, MsFlags, mount, umount2},
    sched::{CloneFlags, setns},
};

pub mod apiserver;
pub mod bench;
pub mod cluster;
pub mod foreign_programs;
pub mod kube;
/// The host's cgroup v2 and bpffs, shared with the agent (which owns it).
#[path = "../../agent/src/mounts.rs"]
pub mod mounts;
#[cfg(feature = "node")]
pub mod node;
pub mod oci;
pub mod privileges;
pub mod soak;
pub mod storm;
pub mod ztunnel;

/// Where iproute2 keeps named network namespaces.
const NETNS_DIR: &str = "/run/netns";

/// Where the cgroup v2 hierarchy is mounted (see [`mounts::cgroup2_mount`]);
/// an error says what the machine lacks and how to get it.
pub fn cgroup2_root() -> io::Result<PathBuf> {
    Ok(mounts::cgroup2_mount()?)
}

/// Runs `command` with `input` on its stdin and collects its output, as a
/// container runtime runs a CNI plugin or a test feeds `iptables-restore`.
/// The input is written whole before the output is read: for small inputs.
pub fn output_with_stdin(command: &mut Command, input: &[u8]) -> io::Result<Output> {
    use std::io::Write as _;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().expect("stdin was piped");
    let written = stdin.write_all(input);
    drop(stdin); // EOF
    let output = child.wait_with_output()?;
    written.map(|()| output)
}

/// A name no other live testbed object has: `<prefix><pid><sequence>`, short
/// enough for an interface name (15 bytes) when `prefix` has at most 4 bytes.
/// Whether an sk_lookup link runs in the network namespace of inode
/// `netns_inode` (`bpftool link show` names each netns link's namespace by
/// inode): ambpf's inbound capture of a pod, as an operator would look.
pub fn sk_lookup_linked(netns_inode: u64) -> io::Result<bool> {
    let out = Command::new("bpftool")
        .args(["-j", "link", "show"])
        .output()?;
    let links: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| io::Error::other(format!("bpftool link show: {e}")))?;
    Ok(links.as_array().into_iter().flatten().any(|link| {
        link["attach_type"] == "sk_lookup" && link["netns_ino"].as_u64() == Some(netns_inode)
    }))
}

pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:x}x{n:x}", std::process::id())
}

/// Runs `ip` with `args`, failing with its stderr.
pub fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip").args(args).output().map_err(ip_missing)?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// Names a missing `ip` and its package rather than "No such file".
fn ip_missing(e: io::Error) -> io::Error {
    if e.kind() != io::ErrorKind::NotFound {
        return e;
    }
    io::Error::new(
        e.kind(),
        "iproute2's `ip` is not installed: install the iproute2 package",
    )
}

/// Runs `ip -batch -` (inside `netns` if given) with one command per line,
/// failing with its stderr: one process for many requests, which is what
/// makes a thousand-pod cluster quick to build.
pub fn ip_batch(netns: Option<&str>, lines: &[String]) -> io::Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let mut cmd = Command::new("ip");
    if let Some(netns) = netns {
        cmd.args(["-n", netns]);
    }
    cmd.args(["-batch", "-"]);
    let out = output_with_stdin(&mut cmd, lines.join("\n").as_bytes()).map_err(ip_missing)?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "ip -batch ({} commands{}, the first `{}`): {}",
        lines.len(),
        netns.map(|n| format!(" in {n}")).unwrap_or_default(),
        lines[0],
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// A named network namespace (`/run/netns/<name>`), deleted on drop.
#[derive(Debug)]
pub struct NetnsGuard {
    name: String,
}

impl NetnsGuard {
    /// Creates `ambpf-<role>-<unique>` with its loopback up.
    pub fn create(role: &str) -> io::Result<Self> {
        let ns = Self::create_bare(role)?;
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Creates the namespace and nothing else. Unlike `ip -n`, which enters
    /// a new mount namespace for each command, this allocates no namespace
    /// besides the one it returns (see `cluster::Cluster::recycle_pod_reusing_inode`).
    pub(crate) fn create_bare(role: &str) -> io::Result<Self> {
        let name = format!("ambpf-{role}-{}", unique_name(""));
        ip(&["netns", "add", &name])?;
        Ok(Self { name })
    }

    /// `count` namespaces `ambpf-<role>-<unique>` made by one `ip` process,
    /// loopback down (as [`NetnsGuard::create_bare`] makes them).
    pub fn create_many(role: &str, count: usize) -> io::Result<Vec<Self>> {
        let names: Vec<String> = (0..count)
            .map(|_| format!("ambpf-{role}-{}", unique_name("")))
            .collect();
        let lines: Vec<String> = names.iter().map(|n| format!("netns add {n}")).collect();
        let made = ip_batch(None, &lines);
        // Guard whatever was made, so a failure part way cleans up too.
        let guards: Vec<Self> = names
            .into_iter()
            .filter(|name| Path::new(NETNS_DIR).join(name).exists())
            .map(|name| Self { name })
            .collect();
        made.map(|()| guards)
    }

    /// Deletes `namespaces` with one `ip` process (dropping each would run
    /// one per namespace); any it could not delete are dropped one by one.
    pub fn delete_many(namespaces: Vec<Self>) {
        let lines: Vec<String> = namespaces
            .iter()
            .map(|ns| format!("netns del {}", ns.name))
            .collect();
        if let Err(e) = ip_batch(None, &lines) {
            eprintln!("testbed: deleting {} namespaces at once: {e}", lines.len());
        }
        for mut ns in namespaces {
            if !ns.path().exists() {
                // Deleted: disarm the guard.
                ns.name.clear();
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// The namespace's nsfs inode number. The kernel hands a freed number
    /// out again, so it names this namespace only while it lives.
    pub fn inode(&self) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt as _;
        Ok(fs::metadata(self.path())?.ino())
    }

    /// The index of interface `iface` in this namespace.
    pub fn ifindex(&self, iface: &str) -> io::Result<u32> {
        self.run(|| nix::net::if_::if_nametoindex(iface))?
            .map_err(|e| io::Error::other(format!("interface {iface} in {}: {e}", self.name)))
    }

    /// Runs `f` on a thread inside this namespace; sockets it creates stay in
    /// the namespace.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> io::Result<T> {
        let file = File::open(self.path())?;
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
                    Ok(f())
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// The namespace's cookie (`SO_NETNS_COOKIE` of a socket made in it).
    pub fn cookie(&self) -> io::Result<u64> {
        self.run(|| {
            use std::os::fd::AsRawFd as _;
            const SO_NETNS_COOKIE: i32 = 71;
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
            let mut cookie: u64 = 0;
            let mut len = std::mem::size_of::<u64>() as nix::libc::socklen_t;
            // SAFETY: `cookie` and `len` are valid for writes; `len` holds
            // the size of `cookie`.
            let rc = unsafe {
                nix::libc::getsockopt(
                    socket.as_raw_fd(),
                    nix::libc::SOL_SOCKET,
                    SO_NETNS_COOKIE,
                    (&raw mut cookie).cast(),
                    &raw mut len,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(cookie)
        })?
    }

    /// A command for `program` that runs in this namespace (entered between
    /// fork and exec), as an agent runs in its node's.
    pub fn command(&self, program: impl AsRef<OsStr>) -> io::Result<Command> {
        let file = File::open(self.path())?;
        let mut command = Command::new(program);
        // SAFETY: setns is async-signal-safe; the closure owns the fd.
        unsafe {
            command.pre_exec(move || {
                setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)
            });
        }
        Ok(command)
    }

    /// Runs `ip -n <ns> args...`.
    pub fn ip(&self, args: &[&str]) -> io::Result<()> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        ip(&full)
    }

    /// Sets `key=value` (dotted, as for `sysctl`) inside this namespace.
    pub fn sysctl(&self, setting: &str) -> io::Result<()> {
        let (key, value) = setting
            .split_once('=')
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, setting.to_owned()))?;
        let path = Path::new("/proc/sys").join(key.replace('.', "/"));
        // /proc/sys/net resolves against the opening thread's namespace.
        self.run(|| fs::write(&path, value))?.map_err(|e| {
            io::Error::new(e.kind(), format!("sysctl {setting} in {}: {e}", self.name))
        })
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        if self.name.is_empty() {
            return; // deleted by `delete_many`
        }
        // Deleting the namespace also removes every interface inside it.
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("testbed: cannot delete netns {}: {e}", self.name);
        }
    }
}

/// Addresses of one end of a [`Link`].
#[derive(Clone, Copy, Debug)]
pub struct Addrs {
    pub v4: std::net::Ipv4Addr,
    pub v6: std::net::Ipv6Addr,
}

/// A veth pair joining two namespaces, dual-stack. It lives as long as the
/// namespaces do.
#[derive(Debug)]
pub struct Link {
    pub a_iface: String,
    pub b_iface: String,
}

impl Link {
    /// Creates `a_iface` in `a` and `b_iface` in `b` with `/24` and `/64`
    /// addresses (no duplicate address detection, so IPv6 is usable at once).
    pub fn veth(
        a: &NetnsGuard,
        a_iface: &str,
        a_addrs: Addrs,
        b: &NetnsGuard,
        b_iface: &str,
        b_addrs: Addrs,
    ) -> io::Result<Self> {
        Self::create(a, a_iface, a_addrs, b, b_iface, b_addrs)
    }

    fn create(
        a: &NetnsGuard,
        a_iface: &str,
        a_addrs: Addrs,
        b: &NetnsGuard,
        b_iface: &str,
        b_addrs: Addrs,
    ) -> io::Result<Self> {
        // Made inside the two namespaces, never in the host's: the pair is
        // created in `a` with its peer already in `b`.
        a.ip(&[
            "link",
            "add",
            a_iface,
            "type",
            "veth",
            "peer",
            "name",
            b_iface,
            "netns",
            b.name(),
        ])?;
        let setup = || -> io::Result<()> {
            for (ns, iface, addrs) in [(a, a_iface, a_addrs), (b, b_iface, b_addrs)] {
                ns.ip(&["addr", "add", &format!("{}/24", addrs.v4), "dev", iface])?;
                ns.ip(&[
                    "addr",
                    "add",
                    &format!("{}/64", addrs.v6),
                    "dev",
                    iface,
                    "nodad",
                ])?;
                // Nor for the link-local address made at link up: while it is
                // tentative (about 2 s) neighbour discovery for the traffic
                // this interface forwards is held up.
                ns.sysctl(&format!("net.ipv6.conf.{iface}.accept_dad=0"))?;
                ns.ip(&["link", "set", iface, "up"])?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            // Deleting one end deletes its peer.
            let _ = a.ip(&["link", "del", a_iface]);
            return Err(e);
        }
        Ok(Self {
            a_iface: a_iface.to_owned(),
            b_iface: b_iface.to_owned(),
        })
    }
}

/// A pod and the node it runs on, as two namespaces joined by a veth:
/// `eth0` in the pod, `veth-pod` on the node side.
#[derive(Debug)]
pub struct PodAndNode {
    // Field order is drop order: the pod goes first.
    pub pod: NetnsGuard,
    pub node: NetnsGuard,
    pub link: Link,
}

impl PodAndNode {
    pub const POD: Addrs = Addrs {
        v4: std::net::Ipv4Addr::new(10, 244, 0, 2),
        v6: std::net::Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 2),
    };
    pub const NODE: Addrs = Addrs {
        v4: std::net::Ipv4Addr::new(10, 244, 0, 1),
        v6: std::net::Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 1),
    };

    pub fn create() -> io::Result<Self> {
        let pod = NetnsGuard::create("pod")?;
        let node = NetnsGuard::create("node")?;
        let link = Link::veth(&pod, "eth0", Self::POD, &node, "veth-pod", Self::NODE)?;
        Ok(Self { pod, node, link })
    }
}

/// A private bpffs mount in a fresh directory, unmounted and removed on drop.
/// Pins made under it vanish with it, whatever a test left behind.
#[derive(Debug)]
pub struct BpffsMount {
    path: PathBuf,
}

impl BpffsMount {
    pub fn create() -> io::Result<Self> {
        let path = std::env::temp_dir().join(format!("ambpf-bpffs-{}", unique_name("")));
        fs::create_dir(&path)?;
        if let Err(e) = mount(
            Some("bpf"),
            &path,
            Some("bpf"),
            MsFlags::empty(),
            None::<&str>,
        ) {
            let _ = fs::remove_dir(&path);
            return Err(io::Error::other(format!(
                "mounting bpffs at {}: {e}",
                path.display()
            )));
        }
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpffsMount {
    fn drop(&mut self) {
        if let Err(e) = umount2(&self.path, MntFlags::MNT_DETACH) {
            eprintln!("testbed: cannot unmount {}: {e}", self.path.display());
        }
        let _ = fs::remove_dir(&self.path);
    }
}

/// A cgroup v2 directory, removed on drop (its processes moved to the parent).
#[derive(Debug)]
pub struct CgroupGuard {
    path: PathBuf,
}

impl CgroupGuard {
    pub fn create() -> io::Result<Self> {
        Self::create_in(&cgroup2_root()?, "ambpf-test")
    }

    /// Creates `<parent>/<prefix>-<unique>`.
    pub fn create_in(parent: &Path, prefix: &str) -> io::Result<Self> {
        let path = parent.join(format!("{prefix}-{}", unique_name("")));
        fs::create_dir(&path).map_err(|e| {
            io::Error::new(e.kind(), format!("creating cgroup {}: {e}", path.display()))
        })?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves a process into this cgroup.
    pub fn add_process(&self, pid: u32) -> io::Result<()> {
        fs::write(self.path.join("cgroup.procs"), pid.to_string())
    }
}

/// This whole process, moved into a [`CgroupGuard`]'s cgroup until dropped.
/// Sockets created meanwhile belong to that cgroup, so cgroup BPF programs
/// attached there see them. A process is in one cgroup at a time: callers
/// serialize tests that use this.
#[derive(Debug)]
pub struct ProcessInCgroup<'a> {
    cgroup: &'a CgroupGuard,
    original: PathBuf,
}

impl CgroupGuard {
    pub fn enter_process(&self) -> io::Result<ProcessInCgroup<'_>> {
        // cgroup v2 line of /proc/self/cgroup: "0::/path".
        let own = fs::read_to_string("/proc/self/cgroup")?;
        let relative = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or_else(|| io::Error::other("process has no cgroup v2 membership"))?;
        let original = cgroup2_root()?.join(relative.trim_start_matches('/'));
        self.add_process(std::process::id())?;
        Ok(ProcessInCgroup {
            cgroup: self,
            original,
        })
    }
}

impl Drop for ProcessInCgroup<'_> {
    fn drop(&mut self) {
        if let Err(e) = fs::write(
            self.original.join("cgroup.procs"),
            std::process::id().to_string(),
        ) {
            eprintln!(
                "testbed: cannot move back to {} from {}: {e}",
                self.original.display(),
                self.cgroup.path.display()
            );
        }
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        // A guard's path always has its parent: the cgroup it was made in.
        let parent = self.path.parent().unwrap_or(&self.path);
        if let Ok(procs) = fs::read_to_string(self.path.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = fs::write(parent.join("cgroup.procs"), pid);
            }
        }
        if let Err(e) = fs::remove_dir(&self.path) {
            eprintln!("testbed: cannot remove cgroup {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_differ_and_fit_an_interface_name() {
        let a = unique_name("va");
        let b = unique_name("va");
        assert_ne!(a, b);
        assert!(a.len() <= 15, "{a}");
    }

    #[test]
    fn namespaces_and_mounts_are_removed_on_drop() {
        let (ns_path, mount_path, cg_path) = {
            let pn = PodAndNode::create().unwrap();
            let bpffs = BpffsMount::create().unwrap();
            let cg = CgroupGuard::create().unwrap();
            // The veth really joins the two namespaces.
            let pod_sees = pn
                .pod
                .run(|| nix::net::if_::if_nametoindex("eth0"))
                .unwrap();
            assert!(pod_sees.is_ok());
            (pn.pod.path(), bpffs.path().to_owned(), cg.path().to_owned())
        };
        assert!(!ns_path.exists(), "{} left behind", ns_path.display());
        assert!(!mount_path.exists(), "{} left behind", mount_path.display());
        assert!(!cg_path.exists(), "{} left behind", cg_path.display());
    }

    #[test]
    fn cleanup_happens_when_a_test_panics() {
        let paths = std::sync::Mutex::new(None);
        let result = std::panic::catch_unwind(|| {
            let ns = NetnsGuard::create("panic").unwrap();
            let bpffs = BpffsMount::create().unwrap();
            *paths.lock().unwrap() = Some((ns.path(), bpffs.path().to_owned()));
            panic!("test failure");
        });
        assert!(result.is_err());
        let (ns, bpffs) = paths.into_inner().unwrap().unwrap();
        assert!(!ns.exists());
        assert!(!bpffs.exists());
    }
}
