//! `ambpf-cluster`: the real Kubernetes node (`ambpf_testbed::kube`), usually
//! through `cargo xtask cluster <command>`.

use std::path::PathBuf;

use ambpf_testbed::kube::{self, Components, Layout, UpOptions};
use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ambpf-cluster", about = "A real Kubernetes node in a box")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build Kubernetes and etcd from the Go module proxy, unless cached.
    Build,
    /// Start the node (or finish starting it) and wait until it is Ready.
    Up {
        /// ambpf's image archive (`cargo xtask image`).
        #[arg(long, requires = "ambpf_reference")]
        ambpf_image: Option<PathBuf>,
        /// The reference the chart gives ambpf's image.
        #[arg(long)]
        ambpf_reference: Option<String>,
        /// Where `ztunnel-double` and `ztunnel-proxies` are (default: beside
        /// this program).
        #[arg(long)]
        ztunnel_binaries: Option<PathBuf>,
    },
    /// Stop everything and give the host back as it was.
    Down,
    /// Each daemon's state and the node's.
    Status,
    /// The end-to-end suite against a node that is up.
    E2e {
        /// ambpf's chart.
        #[arg(long, default_value = "charts/ambpf")]
        chart: PathBuf,
        /// Where to write the results.
        #[arg(long, default_value = "target/cluster/e2e.json")]
        out: PathBuf,
        /// The reference ambpf's image was imported as.
        #[arg(long, default_value = "ghcr.io/ambpf/ambpf:0.1.0")]
        ambpf_reference: String,
        /// Only these modes (repeatable; default: ebpf, iptables, nftables).
        #[arg(long = "mode")]
        modes: Vec<String>,
        /// Only scenarios whose name contains one of these (repeatable).
        #[arg(long = "scenario")]
        scenarios: Vec<String>,
    },
    /// The cluster benchmarks against a node that is up: pod start,
    /// enrolling a namespace and the agent's cost, for ambpf's agent and
    /// Istio's own (1.29.2), with no agent as the baseline.
    Bench {
        /// ambpf's chart.
        #[arg(long, default_value = "charts/ambpf")]
        chart: PathBuf,
        /// Where to write the results.
        #[arg(long, default_value = "target/cluster/bench.json")]
        out: PathBuf,
        /// The reference ambpf's image was imported as.
        #[arg(long, default_value = "ghcr.io/ambpf/ambpf:0.1.0")]
        ambpf_reference: String,
        /// Measured runs (one warm-up run comes first, reported apart).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Pods started per agent and run.
        #[arg(long, default_value_t = 50)]
        pods: usize,
        /// One more pod every so many milliseconds, so each starts on a
        /// quiet node (what an agent adds to a pod); 0 starts them at once.
        #[arg(long, default_value_t = 1000)]
        pod_pace_ms: u64,
        /// Pods of the namespace enrolled at once (and held for the
        /// agent's memory and idle CPU).
        #[arg(long, default_value_t = 100)]
        namespace_pods: usize,
        /// The agents, comma-separated: istio-iptables, istio-nftables,
        /// ambpf-ebpf, ambpf-iptables, ambpf-nftables, none.
        #[arg(long, value_delimiter = ',', value_parser = parse_agent,
              default_value = "istio-iptables,istio-nftables,ambpf-ebpf,ambpf-iptables,none")]
        agents: Vec<kube::e2e::Agent>,
        /// The idle window for the agent's CPU, in seconds.
        #[arg(long, default_value_t = 30)]
        idle_secs: u64,
        /// Give the pods an exec readiness probe (`true`, every second).
        #[arg(long)]
        readiness_probe: bool,
    },
    /// kubectl as cluster admin, inside the node.
    Kubectl {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let layout = Layout::default();
    let components = Components::from_env();
    match Cli::parse().command {
        Cmd::Build => components.build(),
        Cmd::Up {
            ambpf_image,
            ambpf_reference,
            ztunnel_binaries,
        } => {
            let beside_me = std::env::current_exe()?
                .parent()
                .map(PathBuf::from)
                .unwrap_or_default();
            kube::up(
                &layout,
                &components,
                &UpOptions {
                    ambpf_image: ambpf_image.zip(ambpf_reference),
                    ztunnel_binaries: ztunnel_binaries.unwrap_or(beside_me),
                },
            )
        }
        Cmd::Down => kube::down(&layout),
        Cmd::Status => kube::status(&layout, &components),
        Cmd::E2e {
            chart,
            out,
            ambpf_reference,
            modes,
            scenarios,
        } => {
            kube::e2e::check_chart(&chart)?;
            let cluster = kube::e2e::Cluster {
                layout,
                components,
                helm: std::env::var_os("HELM").map_or_else(|| PathBuf::from("helm"), PathBuf::from),
                ambpf_image: ambpf_reference,
            };
            let modes = if modes.is_empty() {
                kube::e2e::MODES.map(str::to_owned).to_vec()
            } else {
                modes
            };
            kube::e2e::run(
                &cluster,
                &kube::e2e::Options {
                    chart,
                    out,
                    modes,
                    scenarios,
                },
            )
        }
        Cmd::Bench {
            chart,
            out,
            ambpf_reference,
            runs,
            pods,
            pod_pace_ms,
            namespace_pods,
            agents,
            idle_secs,
            readiness_probe,
        } => {
            let cluster = kube::e2e::Cluster {
                layout,
                components,
                helm: std::env::var_os("HELM").map_or_else(|| PathBuf::from("helm"), PathBuf::from),
                ambpf_image: ambpf_reference,
            };
            kube::bench::run(
                &cluster,
                &kube::bench::Options {
                    chart,
                    out,
                    agents,
                    runs,
                    pods,
                    pod_pace_ms,
                    namespace_pods,
                    idle_secs,
                    readiness_probe,
                    command_line: std::env::args().collect::<Vec<_>>().join(" "),
                },
            )
        }
        Cmd::Kubectl { args } => {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            print!("{}", kube::kubectl(&layout, &components, &args)?);
            Ok(())
        }
    }
}

fn parse_agent(name: &str) -> Result<kube::e2e::Agent> {
    name.parse()
}
