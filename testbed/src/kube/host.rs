//! What the node takes from the host, and gives back on `down`:
//!
//! - two network namespaces: the node's (every daemon, kube-proxy's rules,
//!   the pods' bridge, hostNetwork pods) and an "outside" one standing for
//!   the rest of the network (off-node clients), joined by a veth;
//! - a mount namespace, persisted as a bind mount of its nsfs file, in
//!   which the node's paths (`/etc/cni/net.d`, `/opt/cni/bin`,
//!   `/var/lib/kubelet`, `/run`, `/sys/fs/bpf`, ...) are the node's own
//!   directories or fresh mounts, so that the chart's hostPaths are the
//!   defaults users have and the host's own files are never written;
//! - cgroups: one for the daemons and kubelet's cgroup root for the pods,
//!   in every mounted hierarchy;
//! - the host-wide sysctls kubelet sets on start (`vm.overcommit_memory`,
//!   `kernel.panic`, ...), restored as they were.
//!
//! Every step is recorded in the state directory before it is taken, so
//! that `down` undoes exactly what `up` did, even after a failed `up`.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::{Layout, run_checked};

/// The host-wide sysctls kubelet's container manager sets when
/// `protectKernelDefaults` is off (`setupKernelTunables`).
pub const KUBELET_SYSCTLS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// The node's directories that replace host paths inside its mount
/// namespace: `(path on the node, directory under the state dir)`.
pub const NODE_PATHS: [(&str, &str); 9] = [
    ("/etc/cni/net.d", "cni/net.d"),
    ("/opt/cni/bin", "cni/bin"),
    ("/var/lib/cni", "cni/cache"),
    ("/var/lib/kubelet", "kubelet"),
    ("/var/lib/containerd", "containerd"),
    ("/var/log/pods", "log/pods"),
    ("/var/log/containers", "log/containers"),
    ("/etc/kubernetes", "etc"),
    ("/etc/resolv.conf", "resolv.conf"),
];

/// Saves the sysctls kubelet will change; `restore_sysctls` puts them back.
pub fn save_sysctls(layout: &Layout) -> Result<()> {
    let file = layout.state.join("host-sysctls.json");
    if file.exists() {
        // An earlier `up` saved them before kubelet ever ran: keep those.
        return Ok(());
    }
    let mut saved = serde_json::Map::new();
    for name in KUBELET_SYSCTLS {
        if let Ok(value) = fs::read_to_string(Path::new("/proc/sys").join(name)) {
            saved.insert(name.to_owned(), value.trim().into());
        }
    }
    fs::write(file, serde_json::to_vec_pretty(&saved)?)?;
    Ok(())
}

pub fn restore_sysctls(layout: &Layout) -> Result<()> {
    let file = layout.state.join("host-sysctls.json");
    let Ok(text) = fs::read(&file) else {
        return Ok(());
    };
    let saved: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text)?;
    for (name, value) in saved {
        let path = Path::new("/proc/sys").join(&name);
        let value = value.as_str().unwrap_or_default();
        if fs::read_to_string(&path)
            .map(|v| v.trim() != value)
            .unwrap_or(false)
        {
            fs::write(&path, value).with_context(|| format!("restoring {name}"))?;
        }
    }
    fs::remove_file(file)?;
    Ok(())
}

/// The node's and the outside's network namespaces and the link between them.
pub fn create_network(layout: &Layout) -> Result<()> {
    let (node, outside) = (&layout.node_netns, &layout.outside_netns);
    for ns in [node, outside] {
        if !Path::new("/run/netns").join(ns).exists() {
            run_checked(Command::new("ip").args(["netns", "add", ns]))?;
        }
    }
    let batch = format!("link add eth0 netns {node} type veth peer name eth0 netns {outside}\n");
    let link_exists = Command::new("ip")
        .args(["-n", node, "link", "show", "eth0"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !link_exists {
        let mut cmd = Command::new("ip");
        cmd.args(["-batch", "-"]);
        crate::output_with_stdin(&mut cmd, batch.as_bytes())
            .context("creating the node's link")
            .and_then(|o| {
                if o.status.success() {
                    Ok(())
                } else {
                    bail!("ip link add: {}", String::from_utf8_lossy(&o.stderr).trim())
                }
            })?;
        for (ns, addr) in [(node, super::NODE_CIDR), (outside, super::OUTSIDE_CIDR)] {
            run_checked(Command::new("ip").args(["-n", ns, "addr", "add", addr, "dev", "eth0"]))?;
            run_checked(Command::new("ip").args(["-n", ns, "link", "set", "eth0", "up"]))?;
            run_checked(Command::new("ip").args(["-n", ns, "link", "set", "lo", "up"]))?;
        }
        run_checked(Command::new("ip").args([
            "-n",
            node,
            "route",
            "add",
            "default",
            "via",
            super::OUTSIDE_IP,
        ]))?;
        // Off-node clients reach Services' external side through the node.
        run_checked(Command::new("ip").args([
            "-n",
            outside,
            "route",
            "add",
            super::POD_CIDR,
            "via",
            super::NODE_IP,
        ]))?;
    }
    // A node forwards between its pods and the world.
    run_checked(Command::new("ip").args([
        "netns",
        "exec",
        node,
        "sysctl",
        "-qw",
        "net.ipv4.ip_forward=1",
    ]))?;
    Ok(())
}

pub fn delete_network(layout: &Layout) {
    for ns in [&layout.node_netns, &layout.outside_netns] {
        if Path::new("/run/netns").join(ns).exists() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// The node's mount namespace: created once, persisted at `layout.mount_ns`.
pub fn create_mount_namespace(layout: &Layout) -> Result<()> {
    let dir = layout
        .mount_ns
        .parent()
        .expect("mount ns file has a parent");
    fs::create_dir_all(dir)?;
    if !is_mount_point(dir)? {
        // The nsfs bind mount must sit on a private mount, as `ip netns`
        // does for /run/netns.
        run_checked(Command::new("mount").arg("--bind").arg(dir).arg(dir))?;
        run_checked(Command::new("mount").arg("--make-private").arg(dir))?;
    }
    if is_mount_point(&layout.mount_ns)? {
        return Ok(());
    }
    fs::write(&layout.mount_ns, b"")?;
    run_checked(
        Command::new("unshare")
            .arg(format!("--mount={}", layout.mount_ns.display()))
            .args(["--propagation", "private", "true"]),
    )?;
    // Inside: mounts are shared among the node's own mounts (kubelet checks
    // that for mount propagation) but never with the host's.
    let mut script = String::from("set -eu\nmount --make-rshared /\n");
    // Istio's node agent stats /proc/1/ns/net (through a hostPath of
    // /proc) to know the node's own namespace. Where root may not inspect
    // PID 1 (these machines: it holds a capability root lacks), the node
    // shows its own network namespace there instead, which is what that
    // check means on this node.
    script.push_str(&format!(
        "if ! stat -L /proc/1/ns/net >/dev/null 2>&1; then\n\
         mount -t tmpfs -o mode=555 node-pid1-ns /proc/1/ns\n\
         touch /proc/1/ns/net\n\
         mount --bind /run/netns/{node} /proc/1/ns/net\n\
         fi\n",
        node = layout.node_netns
    ));
    script.push_str("mount -t tmpfs -o mode=755 node-run /run\nmkdir -p /run/netns /run/lock\n");
    script.push_str("mount -t bpf bpffs /sys/fs/bpf\n");
    for (node_path, state_sub) in NODE_PATHS {
        let source = layout.state.join(state_sub);
        script.push_str(&format!(
            "mount --bind '{}' '{node_path}'\n",
            source.display()
        ));
    }
    for (node_path, state_sub) in NODE_PATHS {
        let source = layout.state.join(state_sub);
        if node_path.ends_with(".conf") {
            if !source.exists() {
                fs::write(&source, b"")?;
            }
        } else {
            fs::create_dir_all(&source)?;
        }
        ensure_mount_target(layout, Path::new(node_path), node_path.ends_with(".conf"))?;
    }
    run_checked(
        Command::new("nsenter")
            .arg(format!("--mount={}", layout.mount_ns.display()))
            .args(["sh", "-c", &script]),
    )
}

pub fn delete_mount_namespace(layout: &Layout) {
    if is_mount_point(&layout.mount_ns).unwrap_or(false) {
        let _ = Command::new("umount").arg(&layout.mount_ns).status();
    }
    let dir = layout
        .mount_ns
        .parent()
        .expect("mount ns file has a parent");
    let _ = fs::remove_file(&layout.mount_ns);
    if is_mount_point(dir).unwrap_or(false) {
        let _ = Command::new("umount").arg(dir).status();
    }
    let _ = fs::remove_dir(dir);
    // Mount targets the node needed that the host did not have.
    if let Ok(list) = fs::read_to_string(layout.state.join("created-mount-targets")) {
        for path in list.lines().rev() {
            let path = Path::new(path);
            let _ = if path.is_dir() {
                fs::remove_dir(path)
            } else {
                fs::remove_file(path)
            };
        }
    }
}

/// A bind mount needs its target on the host's filesystem; one the host
/// lacks is created, recorded, and removed by `down`.
fn ensure_mount_target(layout: &Layout, target: &Path, is_file: bool) -> Result<()> {
    if target.exists() {
        return Ok(());
    }
    let mut created = Vec::new();
    let mut dir = target.parent();
    while let Some(d) = dir {
        if d.exists() {
            break;
        }
        created.push(d.to_owned());
        dir = d.parent();
    }
    created.reverse();
    for d in &created {
        fs::create_dir(d)?;
    }
    if is_file {
        fs::write(target, b"")?;
    } else {
        fs::create_dir(target)?;
    }
    created.push(target.to_owned());
    let record = layout.state.join("created-mount-targets");
    let mut list = fs::read_to_string(&record).unwrap_or_default();
    for c in created {
        list.push_str(&format!("{}\n", c.display()));
    }
    fs::write(record, list)?;
    Ok(())
}

pub fn is_mount_point(path: &Path) -> Result<bool> {
    let wanted = match path.canonicalize() {
        Ok(p) => p,
        Err(_) => return Ok(false),
    };
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| Path::new(&unescape_mount_path(m)) == wanted))
}

fn unescape_mount_path(p: &str) -> String {
    p.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\134", "\\")
}

/// Every mounted cgroup hierarchy's root (v1 controllers and cgroup2).
pub fn cgroup_mounts() -> Result<Vec<PathBuf>> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    let mut roots = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fstype = right.split(' ').next().unwrap_or_default();
        if fstype != "cgroup" && fstype != "cgroup2" {
            continue;
        }
        // Only a hierarchy mounted at its root (field 4 is "/").
        let fields: Vec<&str> = left.split(' ').collect();
        if fields.get(3) != Some(&"/") {
            continue;
        }
        if let Some(point) = fields.get(4) {
            let point = PathBuf::from(unescape_mount_path(point));
            if !roots.contains(&point) {
                roots.push(point);
            }
        }
    }
    Ok(roots)
}

/// Kills every process in `name` (in every hierarchy) and removes its tree.
pub fn remove_cgroup(name: &str) -> Result<()> {
    let roots = cgroup_mounts()?;
    for _ in 0..50 {
        let mut left = false;
        for root in &roots {
            let dir = root.join(name);
            if !dir.exists() {
                continue;
            }
            left = true;
            let kill = dir.join("cgroup.kill");
            if kill.exists() {
                let _ = fs::write(&kill, b"1");
            } else {
                kill_procs_below(&dir);
            }
            remove_tree(&dir);
        }
        if !left {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    bail!("cgroup {name} still has processes after 5 s")
}

fn kill_procs_below(dir: &Path) {
    if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|p| p.parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                kill_procs_below(&e.path());
            }
        }
    }
}

/// cgroups are removed with rmdir, children first.
fn remove_tree(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_tree(&e.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

/// Creates `name` in every hierarchy (kubelet's cgroupfs driver wants its
/// root to exist in each).
pub fn create_cgroup(name: &str) -> Result<()> {
    for root in cgroup_mounts()? {
        let dir = root.join(name);
        if !dir.exists() {
            fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
    }
    Ok(())
}
