//! A real Kubernetes node in a box: etcd, the API server, the
//! controller-manager and the scheduler, a kubelet on containerd and
//! kube-proxy in iptables mode, all built from their published sources
//! ([`components`]), with Debian's `bridge` and `host-local` as the primary
//! CNI. `cargo xtask cluster up|down|status` drives it; the end-to-end
//! suite and the cluster benchmarks run on it.
//!
//! The node lives in namespaces of its own ([`host`]), so the host's network
//! namespace, its `/etc/cni`, `/run` and `/sys/fs/bpf` are never written:
//! hostNetwork pods (ambpf's agent, the ztunnel double) are in the node's
//! network namespace, and their hostPaths are the node's directories. An
//! "outside" namespace on the node's link stands for off-node clients.
//!
//! The daemons outlive `up`: each is started detached in the node's
//! namespaces and cgroup ([`daemons`]) and found again by its PID file, so
//! `down` works from any shell, even after a failed `up`.

pub mod bench;
pub mod components;
pub mod coredns;
pub mod daemons;
pub mod e2e;
pub mod host;
pub mod images;
pub mod istio;
pub mod manifest;
pub mod pki;

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

pub use components::Components;

/// The node's name (kubelet's `--hostname-override`).
pub const NODE_NAME: &str = "ambpf-node";
/// The node's address, on its link to the outside.
pub const NODE_IP: &str = "10.200.0.2";
pub const NODE_CIDR: &str = "10.200.0.2/24";
/// An off-node client's address.
pub const OUTSIDE_IP: &str = "10.200.0.1";
pub const OUTSIDE_CIDR: &str = "10.200.0.1/24";
/// The pods' subnet (host-local on the `cni0` bridge). A /16, so that one
/// node's life never reuses an address: the bridge plugin gives a pod a new
/// MAC but leaves the node's neighbour entry for a reused address with the
/// old one, and the node's packets to the new pod then vanish for about
/// 10 s, until the entry is probed and fails (containernetworking/plugins
/// #858): a plain pod's kubelet probes time out and it is restarted, with or
/// without any agent.
pub const POD_CIDR: &str = "10.244.0.0/16";
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
pub const API_SERVICE_IP: &str = "10.96.0.1";
pub const DNS_SERVICE_IP: &str = "10.96.0.10";
/// kubelet's cgroup root (the pods' cgroups are below it).
pub const PODS_CGROUP: &str = "ambpf-cluster-pods";
/// The daemons' cgroup.
pub const DAEMONS_CGROUP: &str = "ambpf-cluster";
/// containerd's socket, inside the node's mount namespace.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";

/// Where the node keeps everything.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Certificates, configuration, data, logs and PID files.
    pub state: PathBuf,
    /// The node's mount namespace, bind-mounted here.
    pub mount_ns: PathBuf,
    pub node_netns: String,
    pub outside_netns: String,
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            state: PathBuf::from("/var/lib/ambpf-cluster"),
            mount_ns: PathBuf::from("/run/ambpf-cluster/mnt"),
            node_netns: "ambpf-cluster-node".into(),
            outside_netns: "ambpf-cluster-outside".into(),
        }
    }
}

impl Layout {
    pub fn pki(&self) -> PathBuf {
        self.state.join("pki")
    }

    /// The cluster-admin kubeconfig (`kubectl --kubeconfig`).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.state.join("etc/admin.kubeconfig")
    }

    pub fn daemons_cgroup(&self) -> Result<PathBuf> {
        Ok(crate::cgroup2_root()?.join(DAEMONS_CGROUP))
    }
}

/// What `up` brings in beside the node's own images.
#[derive(Debug, Default)]
pub struct UpOptions {
    /// ambpf's image archive (`cargo xtask image`) and its reference.
    pub ambpf_image: Option<(PathBuf, String)>,
    /// Where `ztunnel-double` and `ztunnel-proxies` are built.
    pub ztunnel_binaries: PathBuf,
}

/// Brings the node up, or finishes bringing it up; returns once the node
/// is Ready and the cluster's DNS answers. On failure the node is left for
/// `status` and `down`.
pub fn up(layout: &Layout, components: &Components, options: &UpOptions) -> Result<()> {
    let missing = components.missing();
    if !missing.is_empty() {
        bail!(
            "not built: {}; run `cargo xtask cluster build`",
            missing
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let started = Instant::now();
    fs::create_dir_all(&layout.state)?;
    host::save_sysctls(layout)?;
    host::create_network(layout)?;
    // kube-proxy relies on bridged pod traffic passing iptables (per
    // namespace since Linux 5.3).
    run_checked(Command::new("ip").args([
        "netns",
        "exec",
        &layout.node_netns,
        "sysctl",
        "-qw",
        "net.bridge.bridge-nf-call-iptables=1",
    ]))?;
    host::create_cgroup(DAEMONS_CGROUP)?;
    host::create_cgroup(PODS_CGROUP)?;
    host::create_mount_namespace(layout)?;
    pki::create(layout)?;
    pki::kubeconfig(layout, "admin", &format!("https://{NODE_IP}:6443"))?;
    write_node_files(layout)?;
    for name in ["etcd", "kube-apiserver"] {
        ensure_running(layout, components, name)?;
    }
    wait_for(layout, "kube-apiserver", Duration::from_secs(90), || {
        kubectl(layout, components, &["get", "--raw", "/readyz"]).is_ok()
    })?;
    for name in ["kube-controller-manager", "kube-scheduler", "containerd"] {
        ensure_running(layout, components, name)?;
    }
    wait_for(layout, "containerd", Duration::from_secs(30), || {
        ctr(layout)
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
    })?;
    let ambpf = options
        .ambpf_image
        .as_ref()
        .map(|(a, r)| (a.as_path(), r.as_str()));
    images::import_all(
        layout,
        ambpf,
        &options.ztunnel_binaries,
        &istio::istio_dir(components.cache()).join("bin"),
    )?;
    for name in ["kubelet", "kube-proxy"] {
        ensure_running(layout, components, name)?;
    }
    wait_for(layout, "kubelet", Duration::from_secs(120), || {
        kubectl(
            layout,
            components,
            &[
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ],
        )
        .is_ok_and(|s| s.trim() == "True")
    })?;
    println!(
        "node {NODE_NAME} Ready in {:.1} s (Kubernetes {}, etcd {}, cgroup driver {})",
        started.elapsed().as_secs_f64(),
        components::KUBERNETES,
        components::ETCD,
        daemons::cgroup_driver()
    );
    coredns::deploy(layout, components)?;
    Ok(())
}

/// Stops every daemon and pod and gives back everything `up` took.
pub fn down(layout: &Layout) -> Result<()> {
    // Pods' processes are in kubelet's cgroup root, the daemons in theirs.
    host::remove_cgroup(DAEMONS_CGROUP)?;
    host::remove_cgroup(PODS_CGROUP)?;
    // The mount namespace's mounts (overlays of containers, tmpfs volumes)
    // go with it once no process holds it.
    host::delete_mount_namespace(layout);
    host::delete_network(layout);
    host::restore_sysctls(layout)?;
    if layout.state.exists() {
        fs::remove_dir_all(&layout.state)
            .with_context(|| format!("removing {}", layout.state.display()))?;
    }
    Ok(())
}

/// Prints each daemon's state and the node's; fails if the node is not Ready.
pub fn status(layout: &Layout, components: &Components) -> Result<()> {
    let mut all = true;
    for name in daemons::DAEMONS {
        match daemons::running(layout, name) {
            Some(pid) => println!("{name:<24} running (pid {pid})"),
            None => {
                all = false;
                println!("{name:<24} not running");
            }
        }
    }
    match kubectl(layout, components, &["get", "nodes", "-o", "wide"]) {
        Ok(nodes) => print!("{nodes}"),
        Err(e) => {
            all = false;
            println!("API server: {e}");
        }
    }
    if !all {
        bail!("the node is not fully up");
    }
    Ok(())
}

fn ensure_running(layout: &Layout, components: &Components, name: &str) -> Result<()> {
    if daemons::running(layout, name).is_none() {
        daemons::start(layout, components, name)?;
    }
    Ok(())
}

/// Waits for `ready`, failing early if the daemon exits.
fn wait_for(
    layout: &Layout,
    name: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return Ok(());
        }
        if daemons::running(layout, name).is_none() {
            bail!(
                "{name} exited; its log ({}) ends:\n{}",
                layout.log(name).display(),
                daemons::log_tail(layout, name, 30)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{name} not ready after {} s; its log ({}) ends:\n{}",
                timeout.as_secs(),
                layout.log(name).display(),
                daemons::log_tail(layout, name, 30)
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The node's resolver configuration and its primary CNI network.
fn write_node_files(layout: &Layout) -> Result<()> {
    // Pods use the cluster's DNS; the node itself resolves nothing else.
    fs::write(
        layout.state.join("resolv.conf"),
        format!("nameserver {DNS_SERVICE_IP}\n"),
    )?;
    let net_d = layout.state.join("cni/net.d");
    let conflist = net_d.join("10-bridge.conflist");
    if !conflist.exists() {
        let network = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "ambpf-cluster",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": true,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{ "subnet": POD_CIDR }]],
                        "routes": [{ "dst": "0.0.0.0/0" }],
                    },
                },
                { "type": "portmap", "capabilities": { "portMappings": true } },
            ],
        });
        fs::write(&conflist, serde_json::to_string_pretty(&network)?)?;
    }
    let bin = layout.state.join("cni/bin");
    for plugin in ["bridge", "host-local", "loopback", "portmap"] {
        let from = Path::new("/usr/lib/cni").join(plugin);
        let to = bin.join(plugin);
        if !to.exists() {
            fs::copy(&from, &to).with_context(|| {
                format!(
                    "{}: install Debian's containernetworking-plugins",
                    from.display()
                )
            })?;
        }
    }
    Ok(())
}

/// A command run in the node's mount and network namespaces.
pub fn in_node(layout: &Layout, program: &str) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--mount={}", layout.mount_ns.display()))
        .arg(format!("--net=/run/netns/{}", layout.node_netns))
        .arg("--")
        .arg(program);
    cmd
}

/// `ctr` against the node's containerd, in the CRI plugin's namespace.
pub fn ctr(layout: &Layout) -> Command {
    let mut cmd = in_node(layout, "ctr");
    cmd.args(["--address", CONTAINERD_SOCKET, "--namespace", "k8s.io"]);
    cmd
}

/// kubectl as cluster admin, from inside the node; its stdout.
pub fn kubectl(layout: &Layout, components: &Components, args: &[&str]) -> Result<String> {
    let mut cmd = in_node(layout, &components.kube("kubectl").display().to_string());
    cmd.arg(format!(
        "--kubeconfig={}",
        layout.admin_kubeconfig().display()
    ))
    .args(args);
    checked_stdout(&mut cmd, "kubectl", args)
}

/// Runs `cmd`; its stdout, or an error naming `program args` with its stderr.
pub fn checked_stdout(cmd: &mut Command, program: &str, args: &[&str]) -> Result<String> {
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl apply -f -` with `yaml`, as cluster admin.
pub fn kubectl_apply(layout: &Layout, components: &Components, yaml: &str) -> Result<()> {
    let mut cmd = in_node(layout, &components.kube("kubectl").display().to_string());
    cmd.arg(format!(
        "--kubeconfig={}",
        layout.admin_kubeconfig().display()
    ))
    .args(["apply", "-f", "-"]);
    let out = crate::output_with_stdin(&mut cmd, yaml.as_bytes())?;
    if !out.status.success() {
        bail!(
            "kubectl apply: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub(crate) fn run_checked(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
