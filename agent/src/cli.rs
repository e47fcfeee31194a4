//! The `ambpf` command line.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use log::info;

use crate::{
    bpf::{self, Dataplane, PinLayout, inspect},
    controller::{Controller, SourcePods},
    netns::Netns,
    observe,
    redirect::{
        PodRedirection, RedirectMode,
        iptables::{IptablesBackend, IptablesRedirection},
        podnet,
    },
    sources, zds,
};
use ambpf_common::NodeConfig;

#[derive(Debug, Parser)]
#[command(
    name = "ambpf",
    version,
    about = "eBPF traffic redirection for Istio ambient mode"
)]
pub struct Cli {
    /// bpffs directory under which every map and link is pinned.
    #[arg(long, global = true, env = "AMBPF_PIN_ROOT", default_value = bpf::DEFAULT_PIN_ROOT)]
    pub pin_root: PathBuf,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: load the programs, attach them, and serve until
    /// SIGINT/SIGTERM. Attachments stay pinned when it exits.
    Run(RunArgs),
    /// Attach the programs to an interface in a network namespace, pin, and exit.
    Attach(IfaceArgs),
    /// Detach the programs from an interface in a network namespace.
    Detach(IfaceArgs),
    /// Show the enrolled pods, pinned maps (with entry counts), links and
    /// counters, read from the pins alone: works while the agent runs or
    /// after it died.
    #[command(visible_alias = "inspect")]
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Check the pinned per-pod state instead: every address entry
        /// points at the enrolled pod that owns the address and whose
        /// namespace exists, every enrolled pod has its address entries,
        /// steering links and reply routing, and no link belongs to no pod.
        /// Prints each violation; exits non-zero if there is any.
        #[arg(long)]
        check: bool,
    },
    /// Remove everything ambpf made on this node: the `ambpf-cni` plugin from
    /// the CNI configuration (so pods start again), the eBPF pods' reply
    /// routing and every pin (detaching every program), ambpf's in-pod
    /// iptables rules in every network namespace and the host's probe rules
    /// and ipsets, and, with Kubernetes access, the redirection annotation
    /// on this node's pods. Safe to run again; fails if anything is left.
    Uninstall(UninstallArgs),
    /// Chain the `ambpf-cni` plugin into the node's CNI conflist and copy its
    /// binary into the CNI bin directory (idempotent); with --watch, keep
    /// re-applying it so a removed entry comes back, and on SIGTERM/SIGINT
    /// remove both if this pod's DaemonSet is gone or being deleted (an
    /// uninstall), else leave them for the next pod (an upgrade or restart).
    CniInstall(CniInstallArgs),
    /// Print the kernel programs' redirect decisions live, one line each:
    /// pod, direction, tuple, original destination, verdict (why a
    /// connection was or was not captured).
    Trace(crate::trace::TraceArgs),
}

#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// Remove only this redirection mode's state (default: both). `ebpf`
    /// leaves every iptables rule alone, for a node where Istio's own node
    /// agent writes the same in-pod rules.
    #[arg(long, value_enum)]
    pub redirect_mode: Option<RedirectMode>,

    /// This node's name: its pods lose the redirection annotation.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,

    /// The kubeconfig to remove the annotations with (default: the
    /// in-cluster service account; without either, they are left alone).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// The node's CNI configuration: `ambpf-cni` is un-chained from every
    /// *.conflist in it.
    #[arg(long, env = "AMBPF_CNI_CONF_DIR", default_value = crate::cni::install::DEFAULT_CONF_DIR)]
    pub cni_conf_dir: PathBuf,
    /// The runtime's CNI plugin directory: the `ambpf-cni` binary is removed.
    #[arg(long, env = "AMBPF_CNI_BIN_DIR", default_value = crate::cni::install::DEFAULT_BIN_DIR)]
    pub cni_bin_dir: PathBuf,
    /// Leave `ambpf-cni` chained (only this agent's state goes, e.g. a demo
    /// agent on a node where ambpf is also installed).
    #[arg(long)]
    pub keep_cni: bool,
}

impl UninstallArgs {
    /// Where the annotations go: as `run` chooses its kube source by
    /// default, with --kubeconfig or in a cluster.
    fn kube_target(&self) -> Option<crate::uninstall::KubeTarget> {
        sources::kube::configured(self.kubeconfig.as_deref()).then(|| {
            crate::uninstall::KubeTarget {
                kubeconfig: self.kubeconfig.clone(),
                node_name: self.node_name.clone().unwrap_or_default(),
            }
        })
    }
}

#[derive(Debug, Args)]
pub struct CniInstallArgs {
    /// The directory of the node's CNI configuration (the first *.conflist
    /// in it gets the entry).
    #[arg(long, env = "AMBPF_CNI_CONF_DIR", default_value = crate::cni::install::DEFAULT_CONF_DIR)]
    pub conf_dir: PathBuf,
    /// The runtime's CNI plugin directory.
    #[arg(long, env = "AMBPF_CNI_BIN_DIR", default_value = crate::cni::install::DEFAULT_BIN_DIR)]
    pub bin_dir: PathBuf,
    /// The plugin binary to copy (default: `ambpf-cni` next to this binary).
    #[arg(long)]
    pub plugin_binary: Option<PathBuf>,
    /// The agent's CNI endpoint, written into the plugin entry.
    #[arg(long, env = "AMBPF_CNI_SOCKET", default_value = crate::cni::DEFAULT_SOCKET)]
    pub agent_socket: PathBuf,
    /// Seconds the plugin waits for the agent (default: the plugin's 30).
    #[arg(long)]
    pub agent_timeout: Option<f64>,
    /// Keep running, re-applying every this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub watch: Option<f64>,
    /// The kubeconfig for finding this pod's DaemonSet (--watch; default: the
    /// in-cluster service account; without either the plugin stays chained
    /// on shutdown).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// This pod's name (the downward API's metadata.name), whose DaemonSet
    /// decides on shutdown whether the plugin stays.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// This pod's namespace (the downward API's metadata.namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
}

impl CniInstallArgs {
    /// Where the shutdown decision asks, or why it cannot: Kubernetes as
    /// `run` finds it (--kubeconfig or in a cluster), and this pod's name.
    fn owner_lookup(&self) -> Result<(Option<PathBuf>, crate::cni::shutdown::SelfPod), String> {
        if !sources::kube::configured(self.kubeconfig.as_deref()) {
            return Err(
                "no Kubernetes configuration (not in a cluster, no --kubeconfig) to find this \
                 pod's DaemonSet"
                    .into(),
            );
        }
        let given = |value: &Option<String>| value.clone().filter(|v| !v.is_empty());
        match (given(&self.pod_name), given(&self.pod_namespace)) {
            (Some(name), Some(namespace)) => Ok((
                self.kubeconfig.clone(),
                crate::cni::shutdown::SelfPod { namespace, name },
            )),
            _ => Err(
                "POD_NAME and POD_NAMESPACE are not both set (give --pod-name and \
                      --pod-namespace, in a DaemonSet from the downward API's metadata.name \
                      and metadata.namespace)"
                    .into(),
            ),
        }
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Interfaces to attach to at start-up, as NETNS:IFACE (NETNS is a name
    /// under /run/netns or a path such as /proc/<pid>/ns/net).
    #[arg(long = "attach", value_name = "NETNS:IFACE")]
    pub attach: Vec<String>,

    /// The ZDS socket ztunnel connects to (ztunnel's INPOD_UDS).
    #[arg(long, env = "AMBPF_ZDS_SOCKET", default_value = zds::DEFAULT_SOCKET)]
    pub zds_socket: PathBuf,

    /// Seconds to wait for each ztunnel Ack.
    #[arg(long, default_value_t = 5.0)]
    pub zds_ack_timeout: f64,

    /// Seconds between full checks of the per-pod state (inside every
    /// enrolled pod's namespace too); the records alone are checked after
    /// every reconcile pass. Violations are logged, repaired where possible
    /// and counted in `ambpf_state_violations_total`.
    #[arg(long, default_value_t = 60.0)]
    pub state_check_interval: f64,

    /// A JSON file of the pods to enrol, for running without Kubernetes
    /// (re-read when it changes).
    #[arg(long, value_name = "FILE")]
    pub pods_file: Option<PathBuf>,

    /// How pods' traffic reaches ztunnel.
    #[arg(long, value_enum, env = "AMBPF_REDIRECT_MODE", default_value = "ebpf")]
    pub redirect_mode: RedirectMode,

    /// The cgroup v2 directory whose sockets the eBPF socket programs see:
    /// the node's root cgroup (default: the cgroup2 mount).
    #[arg(long, env = "AMBPF_CGROUP")]
    pub cgroup: Option<PathBuf>,

    /// Where /healthz and /readyz are served.
    #[arg(long, env = "AMBPF_HEALTH_LISTEN", default_value = observe::DEFAULT_HEALTH_LISTEN)]
    pub health_listen: std::net::SocketAddr,

    /// Where Prometheus /metrics are served.
    #[arg(long, env = "AMBPF_METRICS_LISTEN", default_value = observe::DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: std::net::SocketAddr,

    /// Which iptables the iptables mode writes with (auto: what the host uses).
    #[arg(long, value_enum, default_value = "auto")]
    pub iptables_backend: IptablesBackend,

    /// Capture pods' DNS into ztunnel's DNS proxy (a pod can opt out).
    #[arg(long, env = "AMBPF_DNS_CAPTURE", default_value_t = true, action = clap::ArgAction::Set)]
    pub dns_capture: bool,

    /// Where the pods to enrol come from: `local` (--pods-file) or `kube`
    /// (the API server). Default: local with --pods-file, else kube when
    /// --kubeconfig is given or the agent runs in a cluster, else none.
    #[arg(long, value_enum, env = "AMBPF_POD_SOURCE")]
    pub pod_source: Option<PodSource>,

    /// This node's name: the kube source enrols the pods scheduled here.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,

    /// Namespaces whose pods never enrol (kube source), comma-separated.
    #[arg(
        long,
        env = "AMBPF_EXCLUDED_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub excluded_namespaces: Vec<String>,

    /// The kubeconfig of the kube source (default: the in-cluster service
    /// account, else KUBECONFIG or ~/.kube/config).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Serve the `ambpf-cni` plugin's endpoint on this unix socket (without
    /// a value: the default path): pods the plugin posts are enrolled at
    /// once, with the kube source only those that are ambient (read from the
    /// API server), else every one. Off unless given.
    #[arg(
        long,
        env = "AMBPF_CNI_SOCKET",
        num_args = 0..=1,
        default_missing_value = crate::cni::DEFAULT_SOCKET,
        value_name = "PATH"
    )]
    pub cni_socket: Option<PathBuf>,
}

/// Where `run` learns which pods are ambient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PodSource {
    /// A JSON file (--pods-file).
    Local,
    /// The Kubernetes API server.
    Kube,
}

impl RunArgs {
    /// The pod source to start, checked against the other options.
    fn pod_source(&self) -> Result<Option<PodSource>> {
        let kube = sources::kube::configured(self.kubeconfig.as_deref());
        let source = match (self.pod_source, &self.pods_file) {
            (Some(PodSource::Local), None) => anyhow::bail!("--pod-source local needs --pods-file"),
            (Some(PodSource::Kube), Some(_)) => {
                anyhow::bail!("--pods-file is for --pod-source local, not kube")
            }
            (Some(source), _) => Some(source),
            (None, Some(_)) => Some(PodSource::Local),
            (None, None) if kube => Some(PodSource::Kube),
            (None, None) => None,
        };
        if source == Some(PodSource::Kube) && self.node_name.as_deref().is_none_or(str::is_empty) {
            return Err(sources::kube::KubeSourceError::NoNodeName.into());
        }
        Ok(source)
    }
}

#[derive(Debug, Args)]
pub struct IfaceArgs {
    /// Network namespace: a name under /run/netns or a path.
    #[arg(long)]
    pub netns: String,
    /// Interface inside that namespace.
    #[arg(long)]
    pub iface: String,
}

pub fn execute(cli: Cli) -> Result<()> {
    let pins = PinLayout::new(&cli.pin_root);
    match cli.command {
        Command::Run(args) => run(pins, args),
        Command::Attach(args) => {
            let netns = Netns::open(&args.netns)?;
            let mut dataplane = Dataplane::load(pins)?;
            let attachment = dataplane.attach_iface_counters(&netns, &args.iface)?;
            println!("{}", serde_json::to_string_pretty(&attachment)?);
            Ok(())
        }
        Command::Detach(args) => {
            let netns = Netns::open(&args.netns)?;
            let removed = bpf::tc::detach_iface_counters(&pins, &netns, &args.iface)?;
            if removed.is_empty() {
                println!("nothing attached to {} in {}", args.iface, args.netns);
            }
            for pin in removed {
                println!("removed {}", pin.display());
            }
            Ok(())
        }
        Command::Status { json, check: true } => status_check(&pins, json),
        Command::Status { json, check: false } => {
            let status = inspect::read_status(&pins)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{status}");
            }
            Ok(())
        }
        Command::Uninstall(args) => {
            crate::uninstall::uninstall(&crate::uninstall::UninstallConfig {
                kube: args.kube_target(),
                pins,
                mode: args.redirect_mode,
                cni_conf_dir: args.cni_conf_dir,
                cni_bin_dir: args.cni_bin_dir,
                keep_cni: args.keep_cni,
            })
        }
        Command::CniInstall(args) => cni_install(args),
        Command::Trace(args) => crate::trace::run(&pins, args),
    }
}

fn cni_install(args: CniInstallArgs) -> Result<()> {
    use crate::cni::install::{InstallConfig, install_once, keep_installed};
    let owner = args.owner_lookup();
    let plugin_binary = match args.plugin_binary {
        Some(path) => path,
        None => std::env::current_exe()?
            .parent()
            .context("locating the ambpf-cni binary")?
            .join(crate::cni::PLUGIN_TYPE),
    };
    let config = InstallConfig {
        conf_dir: args.conf_dir,
        bin_dir: args.bin_dir,
        plugin_binary: Some(plugin_binary),
        agent_socket: args.agent_socket,
        agent_timeout_seconds: args.agent_timeout,
    };
    let done = install_once(&config)?;
    println!(
        "ambpf-cni chained in {} (conflist changed: {}, binary changed: {})",
        done.conflist.display(),
        done.conflist_changed,
        done.binary_changed
    );
    let Some(every) = args.watch else {
        return Ok(());
    };
    let every = std::time::Duration::try_from_secs_f64(every).context("--watch")?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            // Listening first: a signal from here on gets the decision below.
            let shutdown = shutdown_signal()?;
            let owner = match owner {
                Ok((kubeconfig, pod)) => match sources::kube::client(kubeconfig.as_deref()).await {
                    Ok(client) => Ok(crate::cni::shutdown::OwnerWatch::start(client, pod)),
                    Err(e) => Err(e.to_string()),
                },
                Err(why) => Err(why),
            };
            match &owner {
                Ok(_) => info!(
                    "on shutdown ambpf-cni stays chained if this pod's DaemonSet is still \
                     there, and is removed if it is gone or being deleted"
                ),
                Err(why) => log::warn!("on shutdown ambpf-cni will stay chained: {why}"),
            }
            tokio::select! {
                () = keep_installed(config.clone(), every) => {}
                () = shutdown => {}
            }
            let action = match owner {
                Ok(watch) => watch.decide(crate::cni::shutdown::LOOKUP_TIMEOUT).await,
                Err(why) => crate::cni::shutdown::ShutdownAction::Undecided { why },
            };
            on_shutdown(action, &config)
        })
}

/// Leaves the plugin chained or removes it, as `action` says.
fn on_shutdown(
    action: crate::cni::shutdown::ShutdownAction,
    config: &crate::cni::install::InstallConfig,
) -> Result<()> {
    use crate::cni::shutdown::ShutdownAction;
    let (conf_dir, bin_dir) = (config.conf_dir.display(), config.bin_dir.display());
    let by_hand = format!(
        "run `ambpf uninstall --cni-conf-dir {conf_dir} --cni-bin-dir \
         {bin_dir}` on the node (which also removes the rest of ambpf's node state), or delete \
         the plugin of type {plugin} from the *.conflist in {conf_dir} and {bin_dir}/{plugin}",
        plugin = crate::cni::PLUGIN_TYPE
    );
    match action {
        ShutdownAction::Keep { daemonset } => {
            info!(
                "stopping: DaemonSet {daemonset} is still there and not being deleted (an upgrade \
                 or a restart): ambpf-cni stays chained for its next pod"
            );
            Ok(())
        }
        ShutdownAction::Undecided { why } => {
            log::warn!(
                "stopping: ambpf-cni stays chained in {conf_dir}, since it cannot be told whether \
                 ambpf is being removed from this node: {why}. While no ambpf agent runs, new pods \
                 on this node fail to start. If ambpf is being removed, {by_hand}"
            );
            Ok(())
        }
        ShutdownAction::Remove { why } => {
            info!("stopping: {why}: ambpf is being uninstalled, removing ambpf-cni");
            let done = crate::cni::install::uninstall(&config.conf_dir, &config.bin_dir);
            for list in &done.unchained {
                info!("un-chained ambpf-cni from {}", list.display());
            }
            if let Some(binary) = &done.binary_removed {
                info!("removed {}", binary.display());
            }
            if done.errors.is_empty() {
                return Ok(());
            }
            for error in &done.errors {
                log::error!("removing ambpf-cni: {error}");
            }
            anyhow::bail!("ambpf-cni could not be removed completely: {by_hand}")
        }
    }
}

/// Parses `NETNS:IFACE`; the namespace may itself be a path, so split at the
/// last colon.
fn parse_attach(spec: &str) -> Result<(&str, &str)> {
    spec.rsplit_once(':')
        .filter(|(ns, iface)| !ns.is_empty() && !iface.is_empty())
        .with_context(|| format!("--attach {spec}: expected NETNS:IFACE"))
}

fn run(pins: PinLayout, args: RunArgs) -> Result<()> {
    // Validate every argument before touching the kernel.
    let pod_source = args.pod_source()?;
    raise_fd_limit();
    let targets = args
        .attach
        .iter()
        .map(|spec| {
            let (ns, iface) = parse_attach(spec)?;
            Ok((Netns::open(ns)?, iface.to_owned()))
        })
        .collect::<Result<Vec<_>>>()?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let zds_config = zds::ZdsConfig {
        socket: args.zds_socket,
        ack_timeout: std::time::Duration::try_from_secs_f64(args.zds_ack_timeout)
            .context("--zds-ack-timeout")?,
        ..Default::default()
    };
    let state_check_interval = std::time::Duration::try_from_secs_f64(args.state_check_interval)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--state-check-interval must be a positive number of seconds")?;
    let cgroup = match args.cgroup {
        Some(path) => path,
        None => default_cgroup()?,
    };
    let kernel_pins = (args.redirect_mode == RedirectMode::Ebpf).then(|| pins.clone());
    runtime.block_on(async move {
        // Endpoints first: a port already taken is a start-up error.
        let health = tokio::net::TcpListener::bind(args.health_listen)
            .await
            .with_context(|| format!("binding the health endpoint {}", args.health_listen))?;
        let metrics = tokio::net::TcpListener::bind(args.metrics_listen)
            .await
            .with_context(|| format!("binding the metrics endpoint {}", args.metrics_listen))?;
        let mut _pin_root_lock = None;
        let redirection: Box<dyn PodRedirection> = match args.redirect_mode {
            RedirectMode::Ebpf => {
                // One agent writes a pin root at a time (see PinRootLock).
                pins.prepare()?;
                _pin_root_lock = Some(bpf::pins::PinRootLock::acquire(&pins)?);
                let mut dataplane = Dataplane::load(pins)?;
                dataplane.forward_kernel_logs()?;
                for (netns, iface) in &targets {
                    dataplane.attach_iface_counters(netns, iface)?;
                }
                dataplane.attach_cgroup(&cgroup)?;
                dataplane.set_node_config(NodeConfig {
                    dns_capture: u32::from(args.dns_capture),
                    _pad: 0,
                })?;
                dataplane.set_host_addresses(&podnet::host_addresses()?)?;
                info!(
                    "eBPF redirection ready (pin root {}, cgroup {})",
                    pins_root(&dataplane),
                    cgroup.display()
                );
                Box::new(dataplane)
            }
            RedirectMode::Iptables => {
                // The host side (probe SNAT) lives in the agent's own namespace.
                let host = Netns::open("/proc/self/ns/net")?;
                let redirection = IptablesRedirection::new(host, args.iptables_backend)?;
                info!(
                    "iptables redirection ready ({:?} backend)",
                    redirection.backend()
                );
                Box::new(redirection)
            }
        };
        let zds = zds::ZdsHandle::new(zds_config);
        let (pods_tx, pods_rx) =
            tokio::sync::watch::channel(std::sync::Arc::new(SourcePods::default()));
        let (programmed_tx, programmed_rx) =
            tokio::sync::watch::channel(std::sync::Arc::new(Default::default()));
        let mut kube_source = None;
        // Without Kubernetes there is no one to ask which pods are ambient.
        let mut cni_selection = crate::cni::selection::PodSelection::Every;
        match (pod_source, args.pods_file) {
            (Some(PodSource::Local), Some(path)) => {
                sources::local::watch(path, pods_tx.clone())?;
            }
            (Some(PodSource::Kube), _) => {
                use sources::kube::{KubeSource, KubeSourceConfig};
                let client = sources::kube::client(args.kubeconfig.as_deref()).await?;
                let mut config = KubeSourceConfig::new(args.node_name.unwrap_or_default());
                config.excluded_namespaces = args
                    .excluded_namespaces
                    .into_iter()
                    .filter(|ns| !ns.is_empty())
                    .collect();
                // The CNI endpoint reads pods through the source's client.
                cni_selection = crate::cni::selection::PodSelection::Ambient(
                    crate::cni::selection::AmbientLookup::new(
                        client.clone(),
                        config.excluded_namespaces.clone(),
                    ),
                );
                info!(
                    "waiting for the pods of node {} from the API server",
                    config.node_name
                );
                let source = KubeSource::new(client, config)
                    .annotate_from(programmed_rx, zds.ztunnel_pods());
                kube_source = Some(source.start(pods_tx.clone()).await?);
            }
            _ => log::warn!("no pod source (give --pods-file, or run in a cluster): no pods enrol"),
        }
        // Program every current pod before ztunnel can connect, so that its
        // first snapshot is complete (and restarts reconcile pinned state).
        let mut controller = Controller::new(redirection, zds.clone(), args.dns_capture);
        controller.set_check_interval(state_check_interval);
        if kube_source.is_some() {
            controller.report_programmed(programmed_tx);
        }
        let first = controller.apply(&pods_rx.borrow().ambient);
        controller.check_state(crate::redirect::CheckScope::Records);
        let cni_stats = std::sync::Arc::new(crate::cni::CniStats::default());
        let cni_requests = match &args.cni_socket {
            Some(path) => {
                let listener = crate::cni::server::bind(path)?;
                let (tx, rx) = tokio::sync::mpsc::channel(64);
                tokio::spawn(crate::cni::server::serve(
                    listener,
                    tx,
                    cni_selection,
                    cni_stats.clone(),
                ));
                info!("CNI endpoint on {}", path.display());
                Some(rx)
            }
            None => None,
        };
        info!(
            "initial pods: {} enrolled, {} stale removed, {} failed",
            first.enrolled,
            first.removed,
            first.failed.len()
        );
        let registry = observe::registry(observe::AgentCollector {
            zds: zds.clone(),
            controller: controller.stats(),
            pins: kernel_pins,
            cni: args.cni_socket.is_some().then_some(cni_stats),
        });
        tokio::spawn(observe::serve_metrics(
            metrics,
            std::sync::Arc::new(registry),
        ));
        tokio::spawn(observe::serve_health(health, zds.clone()));
        tokio::spawn(controller.run_with_requests(pods_rx, cni_requests));
        let server = tokio::spawn(zds.clone().serve());
        info!("ambpf agent ready");
        tokio::select! {
            served = server => served??,
            signal = wait_for_shutdown() => signal?,
        }
        drop(pods_tx);
        info!("shutting down; pinned attachments stay in place");
        Ok(())
    })
}

/// Raises the soft limit on open files to the hard one, as Go's runtime does
/// for Istio's node agent: the agent holds each enrolled pod's namespace
/// open (twice: the controller and the redirection), so a node with a
/// thousand pods needs more than the common soft limit of 1,024.
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                log::warn!(
                    "cannot raise the open-file limit to {}: {}",
                    limit.rlim_max,
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// `ambpf status --check`: the eBPF mode's pinned state, checked from the
/// pins and the host's namespaces alone.
fn status_check(pins: &PinLayout, json: bool) -> Result<()> {
    let violations =
        crate::redirect::check::ebpf_state(pins, &[], crate::redirect::CheckScope::Full);
    if json {
        println!("{}", serde_json::to_string_pretty(&violations)?);
    } else if violations.is_empty() {
        println!("pinned state under {} is consistent", pins.root().display());
    } else {
        for violation in &violations {
            println!("{violation}");
        }
    }
    if !violations.is_empty() {
        anyhow::bail!(
            "{} violation(s) in the pinned state under {}",
            violations.len(),
            pins.root().display()
        );
    }
    Ok(())
}

fn pins_root(dataplane: &Dataplane) -> String {
    dataplane.pins().root().display().to_string()
}

/// The cgroup v2 mount: /sys/fs/cgroup on unified hosts, its `unified`
/// subdirectory on hybrid ones.
fn default_cgroup() -> Result<PathBuf> {
    const CGROUP2_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x6367_7270);
    for candidate in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        if nix::sys::statfs::statfs(candidate).is_ok_and(|fs| fs.filesystem_type() == CGROUP2_MAGIC)
        {
            return Ok(PathBuf::from(candidate));
        }
    }
    anyhow::bail!(
        "no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified; give --cgroup"
    )
}

async fn wait_for_shutdown() -> Result<()> {
    shutdown_signal()?.await;
    Ok(())
}

/// Catches SIGTERM and SIGINT from now on; the future ends at the first.
/// Needs a tokio runtime.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_spec_splits_at_the_last_colon() {
        assert_eq!(parse_attach("pod1:eth0").unwrap(), ("pod1", "eth0"));
        assert_eq!(
            parse_attach("/proc/42/ns/net:eth0").unwrap(),
            ("/proc/42/ns/net", "eth0")
        );
        assert!(parse_attach("pod1").is_err());
        assert!(parse_attach("pod1:").is_err());
        assert!(parse_attach(":eth0").is_err());
    }

    fn run_args(args: &[&str]) -> RunArgs {
        let mut argv = vec!["ambpf", "run"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(args) => args,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_pod_source_follows_the_options() {
        let local = run_args(&["--pods-file", "pods.json"]);
        assert_eq!(local.pod_source().unwrap(), Some(PodSource::Local));
        let kube = run_args(&["--kubeconfig", "kc", "--node-name", "node-1"]);
        assert_eq!(kube.pod_source().unwrap(), Some(PodSource::Kube));
        let explicit = run_args(&["--pod-source", "kube", "--node-name", "node-1"]);
        assert_eq!(explicit.pod_source().unwrap(), Some(PodSource::Kube));
        assert_eq!(explicit.excluded_namespaces, ["kube-system"]);
        let excluded = run_args(&["--excluded-namespaces", "kube-system,infra"]);
        assert_eq!(excluded.excluded_namespaces, ["kube-system", "infra"]);

        let err = run_args(&["--pod-source", "kube", "--node-name", ""])
            .pod_source()
            .unwrap_err();
        assert!(err.to_string().contains("NODE_NAME"), "{err}");
        let err = run_args(&["--pod-source", "local"])
            .pod_source()
            .unwrap_err();
        assert!(err.to_string().contains("--pods-file"), "{err}");
        let err = run_args(&[
            "--pod-source",
            "kube",
            "--node-name",
            "n",
            "--pods-file",
            "p",
        ])
        .pod_source()
        .unwrap_err();
        assert!(err.to_string().contains("--pods-file"), "{err}");
    }

    #[test]
    fn uninstall_reaches_kubernetes_only_when_configured() {
        let uninstall_args = |args: &[&str]| {
            let mut argv = vec!["ambpf", "uninstall"];
            argv.extend_from_slice(args);
            match Cli::try_parse_from(argv).unwrap().command {
                Command::Uninstall(args) => args,
                other => panic!("{other:?}"),
            }
        };
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
            assert!(uninstall_args(&[]).kube_target().is_none());
            assert!(
                uninstall_args(&["--node-name", "n"])
                    .kube_target()
                    .is_none()
            );
        }
        let target = uninstall_args(&["--kubeconfig", "kc", "--node-name", "n"])
            .kube_target()
            .unwrap();
        assert_eq!(target.node_name, "n");
        assert_eq!(
            target.kubeconfig.as_deref(),
            Some(std::path::Path::new("kc"))
        );
        let ebpf = uninstall_args(&["--redirect-mode", "ebpf"]);
        assert_eq!(ebpf.redirect_mode, Some(RedirectMode::Ebpf));
    }

    #[test]
    fn cni_install_finds_its_daemonset_only_with_kubernetes_and_its_pod_name() {
        let cni_args = |args: &[&str]| {
            let mut argv = vec!["ambpf", "cni-install", "--watch", "10"];
            argv.extend_from_slice(args);
            match Cli::try_parse_from(argv).unwrap().command {
                Command::CniInstall(args) => args,
                other => panic!("{other:?}"),
            }
        };
        let set_by_env = ["KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE"];
        if set_by_env.iter().any(|v| std::env::var_os(v).is_some()) {
            return;
        }
        let pod = [
            "--pod-name",
            "ambpf-x7k2p",
            "--pod-namespace",
            "istio-system",
        ];
        let why = cni_args(&pod).owner_lookup().unwrap_err();
        assert!(why.contains("no Kubernetes configuration"), "{why}");
        let why = cni_args(&["--kubeconfig", "kc", "--pod-name", "ambpf-x7k2p"])
            .owner_lookup()
            .unwrap_err();
        assert!(why.contains("POD_NAMESPACE"), "{why}");
        let mut with_kubeconfig = vec!["--kubeconfig", "kc"];
        with_kubeconfig.extend_from_slice(&pod);
        let (kubeconfig, pod) = cni_args(&with_kubeconfig).owner_lookup().unwrap();
        assert_eq!(kubeconfig.as_deref(), Some(std::path::Path::new("kc")));
        assert_eq!(pod.to_string(), "istio-system/ambpf-x7k2p");
    }

    #[test]
    fn uninstall_unchains_the_cni_plugin_from_the_same_directories() {
        if std::env::var_os("AMBPF_CNI_CONF_DIR").is_some()
            || std::env::var_os("AMBPF_CNI_BIN_DIR").is_some()
        {
            return;
        }
        let parse = |argv: &[&str]| match Cli::try_parse_from(argv).unwrap().command {
            Command::Uninstall(args) => (args.cni_conf_dir, args.cni_bin_dir),
            other => panic!("{other:?}"),
        };
        let (conf_dir, bin_dir) = parse(&["ambpf", "uninstall"]);
        assert_eq!(
            conf_dir,
            PathBuf::from(crate::cni::install::DEFAULT_CONF_DIR)
        );
        assert_eq!(bin_dir, PathBuf::from(crate::cni::install::DEFAULT_BIN_DIR));
        let given = [
            "--cni-conf-dir",
            "/host/net.d",
            "--cni-bin-dir",
            "/host/bin",
        ];
        let (conf_dir, bin_dir) = parse(&[&["ambpf", "uninstall"][..], &given[..]].concat());
        assert_eq!(
            (conf_dir, bin_dir),
            (PathBuf::from("/host/net.d"), PathBuf::from("/host/bin"))
        );
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
