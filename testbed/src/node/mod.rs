//! A Kubernetes node in a box: containerd (Debian's package) with its CRI
//! plugin, the real CNI plugins (`bridge`, `host-local`, `loopback`) and a
//! locally built image, so that tests create pods the way kubelet does and
//! the chained `ambpf-cni` is called by a real runtime.
//!
//! Nothing is shared with the host's own containerd or network:
//!
//! - containerd runs as a child process in its own network namespace (the
//!   node's: the `bridge` plugin's bridge, routes and sysctls land there);
//!   it stays in the host's mount namespace, so the pods' network namespaces,
//!   bind-mounted under its private state directory, are paths the agent can
//!   open, as on a node;
//! - its root, state, sockets, runc root, CNI configuration, plugins and IPAM
//!   store are in one private directory;
//! - it and everything it starts live in a private cgroup (`ambpf-node-*`),
//!   which is also the parent of the pods' kubelet-style cgroups
//!   (`<node cgroup>/kubepods/besteffort/pod<uid>`).
//!
//! On drop every process of that cgroup is killed (`cgroup.kill`), the mounts
//! under the private directory are detached, the shims' sockets (which
//! containerd 1.6 always puts in `/run/containerd/s/`) and the CNI result
//! cache entries of the node's sandboxes (libcni always keeps them in
//! `/var/lib/cni/results/`, containerd 1.6 has no setting for it, and a pod
//! killed with the node gets no DEL to remove them) removed, and the
//! directory, cgroups and namespace deleted. The network's name is unique to
//! the node for that reason.
//!
//! Two settings make containerd work on these machines: `restrict_oom_score_adj`
//! (the sandbox's `oom_score_adj` of -998 needs CAP_SYS_RESOURCE, which this
//! machine's root lacks: runc fails with "can't get final child's PID from
//! pipe") and the cgroupfs driver (no systemd; runc puts each container in
//! the same path in the cgroup v1 controllers and in cgroup v2).

pub mod cri;
pub mod image;

use std::{
    fs, io,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use nix::mount::{MntFlags, umount2};
use serde_json::json;

use crate::{NetnsGuard, cgroup2_root, unique_name};
pub use cri::{Cri, PodSpec, RunningPod, namespace_object};

/// Where Debian's `containernetworking-plugins` installs the plugins.
pub const CNI_PLUGIN_DIR: &str = "/usr/lib/cni";
/// The plugins the node's network uses.
const CNI_PLUGINS: [&str; 3] = ["bridge", "host-local", "loopback"];
/// The CRI plugin's containerd namespace.
const K8S_NAMESPACE: &str = "k8s.io";
/// Where containerd 1.6's shims put their sockets, whatever its state dir.
const SHIM_SOCKET_DIR: &str = "/run/containerd/s";
/// Where libcni caches each attachment's result, whatever the runtime's
/// directories: `results/<network>-<sandbox id>-<ifname>`.
const CNI_CACHE_DIR: &str = "/var/lib/cni";
/// The network containerd's CRI plugin adds for every sandbox's loopback.
const CRI_LOOPBACK_NETWORK: &str = "cni-loopback";
/// Where a hybrid host has its cgroup v1 hierarchies (runc creates the pods'
/// cgroups in each).
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The cgroup v2 controllers runc writes for every container: `cpu` (the
/// CRI plugin gives each sandbox CPU shares) and `pids` (podman's default
/// pids limit).
const CONTAINER_CONTROLLERS: [&str; 2] = ["cpu", "pids"];

/// Why no container can start on this machine, if none can: cgroup v2 is the
/// only hierarchy mounted (so runc drives it) but it does not offer the
/// controllers runc writes. Every pure cgroup v2 node offers them; a hybrid
/// host's v2 hierarchy seen alone from a mount namespace (a container that
/// remounted `/sys/fs/cgroup` as cgroup v2, as `cargo xtask fresh` does on a
/// hybrid host) does not, because the host binds them to cgroup v1. Tests
/// that start containers skip themselves with this reason.
pub fn containers_cannot_start() -> Option<String> {
    let root = cgroup2_root().ok()?;
    // Elsewhere (hybrid: `/sys/fs/cgroup/unified`) the v1 hierarchies are
    // mounted too and runc drives them.
    if root != Path::new(CGROUP_ROOT) {
        return None;
    }
    let offered = fs::read_to_string(root.join("cgroup.controllers")).ok()?;
    let missing: Vec<&str> = CONTAINER_CONTROLLERS
        .into_iter()
        .filter(|c| !offered.split_whitespace().any(|o| o == *c))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "cgroup v2 alone is mounted at {} and offers [{}], without {}: runc cannot start \
             containers (a hybrid host binds those controllers to cgroup v1)",
            root.display(),
            offered.trim(),
            missing.join(", ")
        )
    })
}

/// How the node is set up.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The pods' subnet (host-local IPAM), private to the node's namespace.
    pub pod_subnet: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            pod_subnet: "10.88.0.0/24".to_owned(),
        }
    }
}

/// A running containerd node (see the module documentation).
#[derive(Debug)]
pub struct Node {
    containerd: Option<Child>,
    dir: PathBuf,
    /// The node's cgroup, relative to each hierarchy's root.
    cgroup: String,
    /// Where the cgroup v2 hierarchy is mounted.
    cgroup2_root: PathBuf,
    /// Whether `/run/containerd/s` (and which parents) existed before.
    shim_dirs_existed: Vec<(PathBuf, bool)>,
    /// Whether `/var/lib/cni/results` (and which parents) existed before.
    cache_dirs_existed: Vec<(PathBuf, bool)>,
    pub netns: NetnsGuard,
}

impl Node {
    /// Starts containerd and imports the image. Blocks until the CRI
    /// service answers (at most 30 s).
    pub fn start(config: NodeConfig) -> io::Result<Self> {
        for tool in ["containerd", "ctr", "runc"] {
            which(tool)?;
        }
        let unique = unique_name("");
        let cgroup = format!("ambpf-node-{unique}");
        let existed = |dirs: [PathBuf; 2]| {
            dirs.map(|dir| {
                let existed = dir.exists();
                (dir, existed)
            })
            .into()
        };
        let shim_dirs_existed = existed(["/run/containerd".into(), SHIM_SOCKET_DIR.into()]);
        let cache = Path::new(CNI_CACHE_DIR);
        let cache_dirs_existed = existed([cache.to_owned(), cache.join("results")]);
        let cgroup2_root = cgroup2_root()?;
        let netns = NetnsGuard::create("node")?;
        let mut node = Self {
            containerd: None,
            dir: std::env::temp_dir().join(format!("ambpf-node-{unique}")),
            cgroup,
            cgroup2_root,
            shim_dirs_existed,
            cache_dirs_existed,
            netns,
        };
        fs::create_dir(node.cgroup_v2())?;
        node.write_config(&config)?;
        node.spawn_containerd()?;
        node.wait_for_cri()?;
        let archive = image::build(&node.dir.join("image"))?;
        node.ctr(&["images", "import"], &archive)?;
        Ok(node)
    }

    /// The CRI (and containerd) socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The CNI configuration directory (`conf_dir`), where `ambpf cni-install`
    /// chains its plugin.
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("net.d")
    }

    /// The CNI plugin directory (`bin_dir`).
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.dir.join("bin")
    }

    /// The node's conflist.
    pub fn conflist(&self) -> PathBuf {
        self.cni_conf_dir().join("10-node.conflist")
    }

    /// The node's cgroup v2 directory: every pod's cgroup is below it.
    pub fn cgroup_v2(&self) -> PathBuf {
        self.cgroup2_root.join(&self.cgroup)
    }

    /// Where the pods' network namespaces are bind-mounted.
    pub fn netns_dir(&self) -> PathBuf {
        self.dir.join("state/io.containerd.grpc.v1.cri/netns")
    }

    /// The host-local IPAM store.
    pub fn ipam_dir(&self) -> PathBuf {
        self.dir.join("ipam")
    }

    /// Runs `ambpf cni-install` once on this node, as the chart's installer
    /// does: `plugin` copied to the bin dir and chained into the conflist,
    /// pointing at `agent_socket`.
    pub fn cni_install(
        &self,
        ambpf: &Path,
        plugin: &Path,
        agent_socket: &Path,
    ) -> io::Result<std::process::Output> {
        Command::new(ambpf)
            .arg("cni-install")
            .arg("--conf-dir")
            .arg(self.cni_conf_dir())
            .arg("--bin-dir")
            .arg(self.cni_bin_dir())
            .arg("--plugin-binary")
            .arg(plugin)
            .arg("--agent-socket")
            .arg(agent_socket)
            .output()
    }

    /// The CNI network's name (the conflist's `name`), unique to this node:
    /// host-local keeps its reservations in `<ipam dir>/<name>/`.
    pub fn network_name(&self) -> &str {
        &self.cgroup
    }

    /// containerd's log.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// A CRI client, as kubelet connects.
    pub async fn cri(&self) -> io::Result<Cri> {
        Cri::connect(
            self.socket(),
            format!("/{}", self.cgroup),
            self.dir.join("logs"),
        )
        .await
        .map_err(|e| io::Error::other(format!("CRI connect to {}: {e}", self.socket().display())))
    }

    fn write_config(&self, config: &NodeConfig) -> io::Result<()> {
        let dir = &self.dir;
        for sub in ["root", "state", "net.d", "bin", "runc", "logs", "opt"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        for plugin in CNI_PLUGINS {
            let from = Path::new(CNI_PLUGIN_DIR).join(plugin);
            fs::copy(&from, dir.join("bin").join(plugin)).map_err(|e| {
                io::Error::other(format!(
                    "{}: {e} (install Debian's containernetworking-plugins)",
                    from.display()
                ))
            })?;
        }
        let d = dir.display();
        let containerd = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = {disabled}
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{image}"
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{d}/bin"
    conf_dir = "{d}/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{d}/runc"
        SystemdCgroup = false
"#,
            image = image::IMAGE,
            disabled = crate::kube::daemons::CONTAINERD_DISABLED_PLUGINS,
        );
        fs::write(dir.join("config.toml"), containerd)?;
        // A node's network: pods on a bridge, addresses from host-local.
        let conflist = json!({
            "cniVersion": "1.0.0",
            "name": self.network_name(),
            "plugins": [{
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": config.pod_subnet }]],
                    "dataDir": self.ipam_dir(),
                },
            }],
        });
        fs::write(self.conflist(), serde_json::to_string_pretty(&conflist)?)
    }

    fn spawn_containerd(&mut self) -> io::Result<()> {
        let log = fs::File::create(self.dir.join("containerd.log"))?;
        // The shell moves itself into the node's cgroup, then becomes
        // containerd inside the node's network namespace; the shims and
        // containers it starts inherit both.
        let child = Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$1/cgroup.procs" && exec nsenter --net="$2" containerd --config "$3""#)
            .arg("sh")
            .arg(self.cgroup_v2())
            .arg(self.netns.path())
            .arg(self.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.containerd = Some(child);
        Ok(())
    }

    fn wait_for_cri(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.log().contains("containerd successfully booted") && self.socket().exists() {
                return Ok(());
            }
            if let Some(child) = &mut self.containerd
                && let Some(status) = child.try_wait()?
            {
                return Err(io::Error::other(format!(
                    "containerd exited ({status}):\n{}",
                    self.log()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "containerd did not start in 30 s:\n{}",
                    self.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `ctr <args> <path>` against this containerd.
    fn ctr(&self, args: &[&str], path: &Path) -> io::Result<()> {
        image::run(
            Command::new("ctr")
                .arg("--address")
                .arg(self.socket())
                .args(["--namespace", K8S_NAMESPACE])
                .args(args)
                .arg(path),
        )
    }

    /// Kills containerd, its shims and every container at once.
    fn kill_everything(&mut self) {
        let cgroup = self.cgroup_v2();
        if let Err(e) = fs::write(cgroup.join("cgroup.kill"), "1") {
            eprintln!("testbed: cannot kill {}: {e}", cgroup.display());
        }
        if let Some(mut child) = self.containerd.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while cgroup.exists() && populated(&cgroup) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The shims' sockets: containerd 1.6 names each
    /// `/run/containerd/s/<sha256 of "<containerd socket>/<namespace>/<task id>">`.
    fn shim_sockets(&self) -> Vec<PathBuf> {
        let tasks = self
            .dir
            .join("state/io.containerd.runtime.v2.task")
            .join(K8S_NAMESPACE);
        let Ok(entries) = fs::read_dir(tasks) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|task| {
                let key = format!(
                    "{}/{K8S_NAMESPACE}/{}",
                    self.socket().display(),
                    task.file_name().to_string_lossy()
                );
                let out = crate::output_with_stdin(&mut Command::new("sha256sum"), key.as_bytes())
                    .ok()?;
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                Some(Path::new(SHIM_SOCKET_DIR).join(text.split_whitespace().next()?))
            })
            .collect()
    }
}

impl Node {
    /// libcni's cached results of this node's sandboxes: its own network's
    /// and the CRI plugin's loopback network's (shared by every containerd,
    /// so told apart by the sandbox IDs this node knows).
    fn cni_cache_entries(&self) -> Vec<PathBuf> {
        let sandboxes: Vec<String> =
            fs::read_dir(self.dir.join("root/io.containerd.grpc.v1.cri/sandboxes"))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
        let ours = format!("{}-", self.network_name());
        let Ok(entries) = fs::read_dir(Path::new(CNI_CACHE_DIR).join("results")) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                name.starts_with(&ours)
                    || sandboxes
                        .iter()
                        .any(|id| name == format!("{CRI_LOOPBACK_NETWORK}-{id}-lo"))
            })
            .map(|entry| entry.path())
            .collect()
    }
}

/// Whether a cgroup v2 directory or one below it holds a process.
fn populated(cgroup: &Path) -> bool {
    fs::read_to_string(cgroup.join("cgroup.events"))
        .map(|events| events.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

/// Removes `dir` and the cgroups below it, deepest first.
fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&entry.path());
            }
        }
    }
    if dir.exists()
        && let Err(e) = fs::remove_dir(dir)
    {
        eprintln!("testbed: cannot remove cgroup {}: {e}", dir.display());
    }
}

/// Every mount point at or below `dir`, deepest first.
fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|point| point.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    points.dedup();
    points
}

fn which(tool: &str) -> io::Result<()> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .any(|dir| dir.join(tool).is_file());
    if found {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{tool} not found: install Debian's containerd and runc"
        )))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let shim_sockets = self.shim_sockets();
        let cni_cache_entries = self.cni_cache_entries();
        self.kill_everything();
        for point in mounts_below(&self.dir) {
            if let Err(e) = umount2(&point, MntFlags::MNT_DETACH) {
                eprintln!("testbed: cannot unmount {}: {e}", point.display());
            }
        }
        for socket in shim_sockets {
            let _ = fs::remove_file(socket);
        }
        for entry in cni_cache_entries {
            if let Err(e) = fs::remove_file(&entry) {
                eprintln!("testbed: cannot remove {}: {e}", entry.display());
            }
        }
        // Deepest first: the shim directory, then /run/containerd; the
        // results directory, then /var/lib/cni.
        for (dir, existed) in self
            .shim_dirs_existed
            .iter()
            .chain(&self.cache_dirs_existed)
            .rev()
        {
            if !existed {
                let _ = fs::remove_dir(dir);
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("testbed: cannot remove {}: {e}", self.dir.display());
        }
        remove_cgroup_tree(&self.cgroup_v2());
        // On a pure cgroup v2 host CGROUP_ROOT is the v2 hierarchy: no v1 ones.
        let v1 = (self.cgroup2_root != Path::new(CGROUP_ROOT)).then(|| fs::read_dir(CGROUP_ROOT));
        if let Some(Ok(hierarchies)) = v1 {
            for hierarchy in hierarchies.flatten() {
                let dir = hierarchy.path().join(&self.cgroup);
                if hierarchy.path() != self.cgroup2_root && dir.exists() {
                    remove_cgroup_tree(&dir);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
