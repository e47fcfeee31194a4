//! The `ambpf` command line.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use log::info;

use crate::{
    bpf::{self, Dataplane, PinLayout, inspect},
    controller::Controller,
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
    /// Show the pinned maps, links and counters.
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove every pin under the pin root, detaching everything ambpf attached.
    Uninstall,
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
        Command::Status { json } => {
            let status = inspect::read_status(&pins)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{status}");
            }
            Ok(())
        }
        Command::Uninstall => {
            let root = pins.root();
            match std::fs::remove_dir_all(root) {
                Ok(()) => println!("removed {}", root.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    println!("nothing pinned under {}", root.display())
                }
                Err(e) => return Err(e).with_context(|| format!("removing {}", root.display())),
            }
            Ok(())
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
        let redirection: Box<dyn PodRedirection> = match args.redirect_mode {
            RedirectMode::Ebpf => {
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
        let (pods_tx, pods_rx) = tokio::sync::watch::channel(std::sync::Arc::new(Vec::new()));
        if let Some(path) = args.pods_file {
            sources::local::watch(path, pods_tx.clone())?;
        }
        // Program every current pod before ztunnel can connect, so that its
        // first snapshot is complete (and restarts reconcile pinned state).
        let mut controller = Controller::new(redirection, zds.clone(), args.dns_capture);
        let first = controller.apply(&pods_rx.borrow());
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
        });
        tokio::spawn(observe::serve_metrics(
            metrics,
            std::sync::Arc::new(registry),
        ));
        tokio::spawn(observe::serve_health(health, zds.clone()));
        tokio::spawn(controller.run(pods_rx));
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
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
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

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
