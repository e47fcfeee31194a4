//! The node's daemons: their configuration files, command lines, and how
//! they are started (detached, in the node's namespaces and cgroup) and
//! stopped. Each one's PID is kept in `<state>/pids/<name>` and its log in
//! `<state>/log/<name>.log`.

use std::{
    fs,
    os::fd::AsRawFd as _,
    os::unix::process::CommandExt as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result};

use super::{Layout, components::Components, pki};

/// The daemons in start order.
pub const DAEMONS: [&str; 7] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-proxy",
];

/// The cgroup driver kubelet and runc use: systemd's where systemd is PID 1
/// (as on users' nodes), the cgroupfs driver elsewhere.
pub fn cgroup_driver() -> &'static str {
    if std::path::Path::new("/run/systemd/system").is_dir() {
        "systemd"
    } else {
        "cgroupfs"
    }
}

/// Whether the host runs cgroup v1 controllers (a hybrid or legacy layout):
/// kubelet 1.35+ then needs `failCgroupV1: false`.
pub fn cgroup_v1_in_use() -> bool {
    // On a pure cgroup v2 host /sys/fs/cgroup is itself cgroup2.
    !fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some("/sys/fs/cgroup") && l.contains(" - cgroup2 "))
}

/// The command line of one daemon, with its configuration files written.
pub fn command_line(layout: &Layout, components: &Components, name: &str) -> Result<Vec<String>> {
    let pki = layout.pki();
    let p = |f: &str| pki.join(f).display().to_string();
    let state = |f: &str| layout.state.join(f).display().to_string();
    let api = format!("https://{}:6443", super::NODE_IP);
    let args = match name {
        "etcd" => vec![
            components.etcd().display().to_string(),
            "--name=ambpf-node".into(),
            format!("--data-dir={}", state("etcd")),
            "--listen-client-urls=https://127.0.0.1:2379".into(),
            "--advertise-client-urls=https://127.0.0.1:2379".into(),
            "--listen-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-advertise-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-cluster=ambpf-node=http://127.0.0.1:2380".into(),
            "--listen-metrics-urls=http://127.0.0.1:2381".into(),
            format!("--cert-file={}", p("etcd-server.crt")),
            format!("--key-file={}", p("etcd-server.key")),
            format!("--trusted-ca-file={}", p("ca.crt")),
            "--client-cert-auth=true".into(),
        ],
        "kube-apiserver" => vec![
            components.kube("kube-apiserver").display().to_string(),
            format!("--advertise-address={}", super::NODE_IP),
            "--secure-port=6443".into(),
            "--etcd-servers=https://127.0.0.1:2379".into(),
            format!("--etcd-cafile={}", p("ca.crt")),
            format!("--etcd-certfile={}", p("apiserver-etcd-client.crt")),
            format!("--etcd-keyfile={}", p("apiserver-etcd-client.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!(
                "--kubelet-client-certificate={}",
                p("apiserver-kubelet-client.crt")
            ),
            format!("--kubelet-client-key={}", p("apiserver-kubelet-client.key")),
            format!("--service-cluster-ip-range={}", super::SERVICE_CIDR),
            "--service-node-port-range=30000-32767".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--allow-privileged=true".into(),
            // The node's name resolves nowhere: reach kubelets by address.
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            "--profiling=false".into(),
        ],
        "kube-controller-manager" => {
            let kc = pki::kubeconfig(layout, "controller-manager", &api)?;
            let kc = kc.display();
            vec![
                components
                    .kube("kube-controller-manager")
                    .display()
                    .to_string(),
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=true".into(),
                format!("--service-account-private-key-file={}", p("sa.key")),
                format!("--root-ca-file={}", p("ca.crt")),
                format!("--cluster-signing-cert-file={}", p("ca.crt")),
                format!("--cluster-signing-key-file={}", p("ca.key")),
                format!("--service-cluster-ip-range={}", super::SERVICE_CIDR),
            ]
        }
        "kube-scheduler" => {
            let kc = pki::kubeconfig(layout, "scheduler", &api)?;
            let kc = kc.display();
            vec![
                components.kube("kube-scheduler").display().to_string(),
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                "--leader-elect=false".into(),
            ]
        }
        "containerd" => {
            let config = state("containerd.toml");
            fs::write(&config, containerd_config(layout))?;
            vec!["containerd".into(), "--config".into(), config]
        }
        "kubelet" => {
            let kc = pki::kubeconfig(layout, "kubelet", &api)?;
            let config = state("kubelet.yaml");
            fs::write(&config, kubelet_config(layout))?;
            vec![
                components.kube("kubelet").display().to_string(),
                format!("--config={config}"),
                format!("--kubeconfig={}", kc.display()),
                format!("--hostname-override={}", super::NODE_NAME),
                format!("--node-ip={}", super::NODE_IP),
                "--v=1".into(),
            ]
        }
        "kube-proxy" => {
            let kc = pki::kubeconfig(layout, "kube-proxy", &api)?;
            let config = state("kube-proxy.yaml");
            fs::write(&config, kube_proxy_config(&kc))?;
            vec![
                components.kube("kube-proxy").display().to_string(),
                format!("--config={config}"),
            ]
        }
        other => anyhow::bail!("no daemon {other}"),
    };
    Ok(args)
}

/// The containerd plugins neither node needs (snapshotters this host lacks,
/// tracing), as containerd's configuration lists them; the testbed's
/// containerd node uses the same list.
pub(crate) const CONTAINERD_DISABLED_PLUGINS: &str = r#"["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]"#;

fn containerd_config(layout: &Layout) -> String {
    let systemd = cgroup_driver() == "systemd";
    format!(
        r#"version = 2
root = "{root}"
state = "/run/containerd"
disabled_plugins = {disabled}
[grpc]
  address = "{socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = {systemd}
"#,
        root = layout.state.join("containerd").display(),
        disabled = CONTAINERD_DISABLED_PLUGINS,
        socket = super::CONTAINERD_SOCKET,
        pause = super::images::PAUSE,
    )
}

fn kubelet_config(layout: &Layout) -> String {
    let ca = layout.pki().join("ca.crt");
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: {driver}
cgroupRoot: /{pods}
failCgroupV1: {fail_v1}
failSwapOn: false
containerRuntimeEndpoint: unix://{socket}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: Webhook}}
clusterDomain: cluster.local
clusterDNS: [{dns}]
resolvConf: /etc/resolv.conf
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
maxPods: 250
# The suites read the ztunnel double's whole log, and `kubectl logs` reads only
# a container's newest file: one file holds a whole run (the default rotates at 10Mi).
containerLogMaxSize: 500Mi
serializeImagePulls: false
# Images come only from local imports: never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
"#,
        driver = cgroup_driver(),
        pods = super::PODS_CGROUP,
        fail_v1 = !cgroup_v1_in_use(),
        ca = ca.display(),
        dns = super::DNS_SERVICE_IP,
        socket = super::CONTAINERD_SOCKET,
    )
}

fn kube_proxy_config(kubeconfig: &std::path::Path) -> String {
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {{kubeconfig: {kc}}}
hostnameOverride: {node}
clusterCIDR: {pods}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# The conntrack table is the host's: leave its size and timeouts alone.
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
        kc = kubeconfig.display(),
        node = super::NODE_NAME,
        pods = super::POD_CIDR,
    )
}

/// Starts one daemon detached, in the node's mount and network namespaces
/// and its cgroup; returns its PID.
pub fn start(layout: &Layout, components: &Components, name: &str) -> Result<u32> {
    let argv = command_line(layout, components, name)?;
    fs::create_dir_all(layout.state.join("log"))?;
    fs::create_dir_all(layout.state.join("pids"))?;
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(layout.log(name))?;
    let procs = fs::OpenOptions::new()
        .write(true)
        .open(layout.daemons_cgroup()?.join("cgroup.procs"))
        .context("opening the daemons' cgroup")?;
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--mount={}", layout.mount_ns.display()))
        .arg(format!("--net=/run/netns/{}", layout.node_netns))
        .arg("--")
        .args(&argv)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let procs_fd = procs.as_raw_fd();
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            // "0" moves the writer: the child, before it becomes the daemon.
            nix::unistd::write(std::os::fd::BorrowedFd::borrow_raw(procs_fd), b"0")
                .map_err(std::io::Error::from)?;
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let pid = child.id();
    fs::write(layout.pid_file(name), pid.to_string())?;
    // Detached: its exit is reaped by init once `up` returns.
    std::mem::forget(child);
    Ok(pid)
}

/// The daemon's PID if it is still running.
pub fn running(layout: &Layout, name: &str) -> Option<u32> {
    let pid: u32 = fs::read_to_string(layout.pid_file(name))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // A zombie (state Z) is not running.
    let state = stat.rsplit_once(')')?.1.split_whitespace().next()?;
    (state != "Z").then_some(pid)
}

/// The last lines of a daemon's log.
pub fn log_tail(layout: &Layout, name: &str, lines: usize) -> String {
    let text = fs::read_to_string(layout.log(name)).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl Layout {
    pub fn log(&self, name: &str) -> PathBuf {
        self.state.join("log").join(format!("{name}.log"))
    }

    fn pid_file(&self, name: &str) -> PathBuf {
        self.state.join("pids").join(name)
    }
}

/// Stops a daemon: SIGTERM, then SIGKILL after `grace`; waits until it is
/// gone.
pub fn stop(layout: &Layout, name: &str, grace: std::time::Duration) -> Result<()> {
    use nix::sys::signal::{Signal, kill};
    let Some(pid) = running(layout, name) else {
        return Ok(());
    };
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    let _ = kill(pid, Signal::SIGTERM);
    let deadline = std::time::Instant::now() + grace;
    while running(layout, name).is_some() {
        if std::time::Instant::now() > deadline {
            let _ = kill(pid, Signal::SIGKILL);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}
