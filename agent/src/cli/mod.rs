//! The `ambpf` command line: its arguments and the dispatch to each
//! subcommand. The agent itself is in [`run`], the CNI installer's loop in
//! [`cni_install`].

mod cni_install;
mod run;
mod uninstall_release;

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};

use crate::{
    bpf::{self, Dataplane, PinLayout, inspect},
    netns::Netns,
    observe,
    redirect::{RedirectMode, iptables::IptablesBackend},
    sources, zds,
};

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

    /// Log line format: `text`, or `json` (one object per line).
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub log_format: crate::logging::LogFormat,

    /// Log filter in RUST_LOG syntax, e.g. `info,ambpf::zds=debug` (default:
    /// RUST_LOG, else `info`).
    #[arg(long, global = true, value_name = "FILTER", value_parser = crate::logging::check_filter)]
    pub log_level: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (the node's DaemonSet runs this).
    ///
    /// Loads the programs, attaches them, enrols the pods its source
    /// reports and serves ZDS until SIGINT/SIGTERM. Attachments stay pinned
    /// when it exits.
    Run(RunArgs),
    /// Attach the interface counters to an interface, pin, and exit.
    Attach(IfaceArgs),
    /// Detach the interface counters from an interface.
    Detach(IfaceArgs),
    /// Show enrolled pods, maps, links and counters from the pins.
    ///
    /// Reads the pins alone: works while the agent runs or after it died.
    /// Fails, saying which, when the pin root does not exist, is not on
    /// bpffs or holds no ambpf state; warns when the pinned programs are
    /// not this binary's build.
    #[command(visible_alias = "inspect")]
    Status {
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value = "text")]
        output: crate::status::Output,
        /// The same as `-o json`.
        #[arg(long, conflicts_with = "output")]
        json: bool,
        /// Check the pinned per-pod state instead: every address entry
        /// points at the enrolled pod that owns the address and whose
        /// namespace exists, every enrolled pod has its address entries,
        /// steering links and reply routing, and no link belongs to no pod.
        /// Prints each violation; exits non-zero if there is any. Lists
        /// other owners' programs on ambpf's cgroup hooks and the pods'
        /// interfaces in run order, and warns (without failing) where one
        /// runs before ambpf's redirection or after its answer to the app.
        #[arg(long)]
        check: bool,
    },
    /// Remove everything ambpf made on this node.
    ///
    /// The `ambpf-cni` plugin from the CNI configuration (so pods start
    /// again), the eBPF pods' reply routing and every pin (detaching every
    /// program), ambpf's in-pod iptables rules in every network namespace
    /// and the host's probe rules and ipsets, and, with Kubernetes access,
    /// the redirection annotation on this node's pods. Safe to run again;
    /// fails if anything is left.
    Uninstall(UninstallArgs),
    /// Chain the `ambpf-cni` plugin into the node's CNI configuration.
    ///
    /// Chains it into the first conflist and copies its binary into the CNI
    /// bin directory (idempotent); with --watch, keeps re-applying it so a
    /// removed entry comes back, and on SIGTERM/SIGINT removes both if this
    /// pod's DaemonSet is gone or being deleted (an uninstall), else leaves
    /// them for the next pod (an upgrade or restart).
    CniInstall(CniInstallArgs),
    /// Print the version, git commit and BPF object digest of this build.
    Version {
        /// Output format (`text` or `json`).
        #[arg(short = 'o', long, value_enum, default_value = "text")]
        output: crate::status::Output,
    },
    /// Print the kernel programs' redirect decisions live.
    ///
    /// One line each: pod, direction, tuple, original destination, verdict
    /// (why a connection was or was not captured).
    Trace(crate::trace::TraceArgs),
    /// Delete the agents' DaemonSet and wait until every agent has
    /// uninstalled (the chart's pre-delete hook: the agents' credentials
    /// stay valid until they are done).
    UninstallRelease(uninstall_release::UninstallReleaseArgs),
}

#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// Remove only this redirection mode's state (default: every mode's).
    /// `ebpf` leaves every iptables rule and nftables table alone, for a
    /// node where Istio's own node agent writes the same in-pod rules.
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

    #[command(flatten)]
    pub capacities: bpf::capacity::CapacityArgs,

    /// How the eBPF mode hands steered SYNs to ztunnel's listener: `tc`
    /// (`bpf_sk_assign` from TC, 6.5+), `sk-lookup` (a per-pod sk_lookup
    /// program), or `auto` (tc where the kernel takes SO_REUSEPORT
    /// listeners there). For diagnosis and tests.
    #[arg(long, value_enum, env = bpf::InboundAssign::ENV, default_value = "auto", hide = true)]
    pub inbound_assign: bpf::InboundAssign,

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

    /// The node's CNI configuration, read only: while Istio's plugin is
    /// chained there, its node agent is installed, and the agent stands by
    /// even while that agent restarts (see "Migrating a node").
    #[arg(long, env = "AMBPF_CNI_CONF_DIR", value_name = "DIR")]
    pub cni_conf_dir: Option<PathBuf>,

    /// This pod's name and namespace (the downward API's metadata.name and
    /// metadata.namespace): at shutdown, its DaemonSet gone or being deleted
    /// means ambpf is being uninstalled, and the agent removes its state
    /// from the node as `ambpf uninstall` does; otherwise (an upgrade, a
    /// restart) the state stays for the next agent.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
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
        Command::Run(args) => run::run(pins, args),
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
        Command::Status {
            output,
            json,
            check,
        } => {
            let output = if json {
                crate::status::Output::Json
            } else {
                output
            };
            if check {
                inspect::check_pin_root(&pins)?;
                status_check(&pins, output == crate::status::Output::Json)
            } else {
                crate::status::print(&pins, output)
            }
        }
        Command::Version { output } => {
            let info = crate::build_info::current();
            match output {
                crate::status::Output::Json => println!("{}", serde_json::to_string_pretty(info)?),
                crate::status::Output::Yaml => print!("{}", serde_yaml_ng::to_string(info)?),
                _ => print!("{info}"),
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
        Command::CniInstall(args) => cni_install::cni_install(args),
        Command::Trace(args) => crate::trace::run(&pins, args),
        Command::UninstallRelease(args) => uninstall_release::uninstall_release(args),
    }
}

/// Parses `NETNS:IFACE`; the namespace may itself be a path, so split at the
/// last colon.
fn parse_attach(spec: &str) -> Result<(&str, &str)> {
    spec.rsplit_once(':')
        .filter(|(ns, iface)| !ns.is_empty() && !iface.is_empty())
        .with_context(|| format!("--attach {spec}: expected NETNS:IFACE"))
}

/// `ambpf status --check`: the eBPF mode's pinned state, checked from the
/// pins and the host's namespaces alone.
fn status_check(pins: &PinLayout, json: bool) -> Result<()> {
    // The pods' namespaces are found once (a scan of every process's), for
    // both checks.
    let located = crate::redirect::check::mixed::locate_pinned(pins);
    let pods: Vec<_> = located.iter().map(|(key, netns)| (*key, netns)).collect();
    let mut violations =
        crate::redirect::check::ebpf_state(pins, &pods, crate::redirect::CheckScope::Full);
    // Istio's rules beside the eBPF capture (a migration left halfway, or
    // Istio's node agent still running): read only here, on demand.
    violations.extend(crate::redirect::check::mixed::scan_pinned(pins, &pods));
    // Other owners' programs warn, as a foreign build does in `status`;
    // only violations fail the check.
    let programs = crate::redirect::check::foreign::scan(pins);
    if json {
        let report = serde_json::json!({
            "violations": violations,
            "other_programs": programs,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        if violations.is_empty() {
            println!("pinned state under {} is consistent", pins.root().display());
        }
        for violation in &violations {
            println!("{violation}");
        }
        print!("{}", bpf::foreign::render(&programs));
        for warning in &programs.warnings {
            eprintln!("warning: {warning}");
        }
        for what in &programs.unreadable {
            eprintln!("warning: could not list the programs on {what}");
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
