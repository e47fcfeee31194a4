//! The `redirect` suite of `ambpf-bench` (a module of that binary; not part of the
//! library).
//!
//! Traffic from an enrolled pod (pod 1 of a testbed [`Cluster`]) to a peer
//! (an echo server in the cluster's `remote` namespace), in up to four modes
//! measured in the same run, in a rotated order each round:
//!
//! - `direct`: no agent, the pod not enrolled: the floor;
//! - `iptables`: the agent (`ambpf run --redirect-mode iptables`) writes
//!   Istio's in-pod iptables rules; the ztunnel double proxies on 15001;
//! - `nftables`: the agent writes Istio 1.28's native nftables rules;
//! - `ebpf`: the agent's eBPF redirection; the same double.
//!
//! Each mode of each run gets a fresh cluster (so no conntrack entries,
//! TIME_WAIT sockets or rules of one mode are left for the next), a fresh
//! echo server and, in the two redirected modes, a fresh agent and ztunnel
//! double. The agent runs in the cluster's node namespace with its socket
//! programs on a throwaway cgroup that this whole process has entered, as in
//! the demo; the pod is unenrolled (pods file emptied, ztunnel gets the Del)
//! and the eBPF pins removed (`ambpf uninstall`) before the next mode.
//!
//! Three tokio runtimes in this process, each with named threads so their
//! CPU time can be told apart (schedstat per thread):
//! - `loadgen-rt`: the load generator; its threads enter the pod's netns at
//!   start, so its sockets are the pod's and the redirection applies;
//! - `ztunnel-rt`: the ztunnel double (plus its per-pod socket thread,
//!   `ztunnel-pod-ns`);
//! - `echo-rt`: the echo server, its threads in the remote netns.
//!
//! Per client count: new-connection rate (each client: connect, one 64-byte
//! request/response, close) and request latency on kept-alive connections
//! (each client: one connection, 64-byte ping-pong), recorded in a fixed
//! histogram per client (no allocation per request). Before the load,
//! `nf_conntrack_count` in the pod and node namespaces around a fixed number
//! of sequential connections.

use std::{
    fs::File,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering},
    },
};

use ambpf_testbed::{
    NetnsGuard,
    bench::{
        histogram::Histogram,
        sys::{self, MachineCpu, ThreadGroups},
    },
    ztunnel::ConnectionOutcome,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    runtime::Runtime,
};

use super::*;

mod agent;
mod dns;
mod load;
mod measure;
mod summary;
pub(crate) use agent::{Agent, OwnRuntime, Served, named_runtime, write_pods_file};
use load::*;
pub(crate) use measure::{Traffic, conntrack_around, measure_mode, taken_by};
pub(crate) use summary::{Tables, print_tables, summarize};

pub(crate) const POD_UID: &str = "5e1f9a2c-bench-pod-0001";
pub(crate) const PEER_PORT: u16 = 9000;
/// Request and response size.
const MESSAGE: usize = 64;
/// One connect or exchange taking longer is an error, not a sample.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(30);
const SOCKET_TIMEOUT: Duration = Duration::from_secs(30);
/// Thread-name prefixes of the CPU groups, in [`CpuSample`] order.
const GROUPS: [&str; 3] = ["loadgen", "ztunnel", "echo"];

#[derive(Args)]
pub(super) struct RedirectArgs {
    #[command(flatten)]
    common: Common,
    /// The pod's traffic measured: `outbound` (its app connects to a peer
    /// off the node: ztunnel's 15001), `inbound` (a client off the node
    /// connects to its app: ztunnel's 15006), `dns` (its app asks a resolver
    /// off the node over UDP: ztunnel's DNS proxy on 15053).
    #[arg(long, value_enum, default_value = "outbound")]
    direction: Direction,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    clients: Vec<usize>,
    /// Measured seconds per test (after the warm-up).
    #[arg(long, default_value_t = 3.0)]
    duration_secs: f64,
    /// Unmeasured seconds at the start of each test.
    #[arg(long, default_value_t = 0.5)]
    warmup_secs: f64,
    /// The redirecting modes measured beside `direct`, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = ALL_COMPARED)]
    modes: Vec<Compared>,
    /// Rounds of the modes, each in a rotated order.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Sequential connections for the conntrack count.
    #[arg(long, default_value_t = 200)]
    conntrack_connections: u64,
    /// Worker threads of the load generator's runtime.
    #[arg(long, default_value_t = 2)]
    loadgen_threads: usize,
    /// Also measure the eBPF mode with an `ambpf trace --json` reader
    /// attached (mode `ebpf+trace`): the cost of emitting trace records.
    #[arg(long)]
    trace_reader: bool,
    /// Also measure a pod that is not enrolled with the agent running in
    /// each mode (`iptables bystander`, `ebpf bystander`) against no agent
    /// (`direct`): what ambpf costs traffic it does not capture.
    #[arg(long)]
    bystanders: bool,
}

/// Which of the pod's traffic the suite measures (`--direction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Direction {
    /// The pod's app connects to the echo server in `remote`.
    Outbound,
    /// A client in `remote` connects to the echo server in the pod.
    Inbound,
    /// The pod's app sends UDP queries to a resolver in `remote`.
    Dns,
}

impl Direction {
    /// What the rate counts.
    pub(crate) fn unit(self) -> &'static str {
        match self {
            Direction::Outbound | Direction::Inbound => "conn",
            Direction::Dns => "queries",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Mode {
    Direct,
    Iptables,
    /// Istio 1.28's native nftables rules (`--redirect-mode nftables`).
    Nftables,
    Ebpf,
    /// eBPF with a trace reader attached.
    #[serde(rename = "ebpf+trace")]
    EbpfTraced,
    /// The agent in iptables mode, the pod not enrolled: its traffic is a
    /// bystander's (`--bystanders`).
    #[serde(rename = "iptables bystander")]
    IptablesBystander,
    /// The agent in nftables mode, the pod not enrolled (`--bystanders`).
    #[serde(rename = "nftables bystander")]
    NftablesBystander,
    /// The agent in eBPF mode, the pod not enrolled: its connects still pass
    /// the agent's cgroup programs, which let it go (`--bystanders`).
    #[serde(rename = "ebpf bystander")]
    EbpfBystander,
}

impl Mode {
    pub(super) fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::Ebpf => "ebpf",
            Mode::EbpfTraced => "ebpf+trace",
            Mode::IptablesBystander => "iptables bystander",
            Mode::NftablesBystander => "nftables bystander",
            Mode::EbpfBystander => "ebpf bystander",
        }
    }

    /// The agent's `--redirect-mode`.
    fn agent_mode(self) -> &'static str {
        match self {
            Mode::EbpfTraced | Mode::EbpfBystander => Mode::Ebpf.name(),
            Mode::IptablesBystander => Mode::Iptables.name(),
            Mode::NftablesBystander => Mode::Nftables.name(),
            other => other.name(),
        }
    }

    /// Whether the pod is enrolled (its connections go through ztunnel).
    fn captures(self) -> bool {
        matches!(
            self,
            Mode::Iptables | Mode::Nftables | Mode::Ebpf | Mode::EbpfTraced
        )
    }
}

/// A redirecting mode a suite compares (`--modes`): eBPF mode and the agent
/// writing each of Istio's two backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Compared {
    Iptables,
    Nftables,
    Ebpf,
}

/// `--modes`' default: all three.
pub(super) const ALL_COMPARED: &str = "iptables,nftables,ebpf";

impl From<Compared> for Mode {
    fn from(mode: Compared) -> Self {
        match mode {
            Compared::Iptables => Mode::Iptables,
            Compared::Nftables => Mode::Nftables,
            Compared::Ebpf => Mode::Ebpf,
        }
    }
}

/// `--modes` as [`Mode`]s, each once, in the order given.
pub(super) fn compared_modes(modes: &[Compared]) -> Result<Vec<Mode>> {
    let mut out: Vec<Mode> = Vec::new();
    for &mode in modes {
        if !out.contains(&mode.into()) {
            out.push(mode.into());
        }
    }
    ensure!(
        !out.is_empty(),
        "--modes: at least one of iptables, nftables, ebpf"
    );
    Ok(out)
}

/// The order of `modes` in run `run`: a balanced rotation
/// ([`bench::balanced_order`]), so each mode goes first, and right after each
/// other mode, equally often.
pub(super) fn rotated(modes: &[Mode], run: usize) -> Vec<Mode> {
    bench::balanced_order(modes.len(), run)
        .into_iter()
        .map(|i| modes[i])
        .collect()
}

// ---------------------------------------------------------------------------
// The suite

#[derive(Serialize)]
struct Config {
    direction: Direction,
    clients: Vec<usize>,
    duration_s: f64,
    warmup_s: f64,
    runs: usize,
    message_bytes: usize,
    conntrack_connections: u64,
    loadgen_threads: usize,
    agent: PathBuf,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Conntrack {
    connections: u64,
    /// nf_conntrack_count before and after, `None` without conntrack.
    pod_before: Option<u64>,
    pod_after: Option<u64>,
    node_before: Option<u64>,
    node_after: Option<u64>,
    pod_per_connection: Option<f64>,
    node_per_connection: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Point {
    clients: usize,
    rate: RateSample,
    latency: LatencySample,
}

impl Point {
    /// Connections (or queries) made in the rate test's measured time.
    pub(crate) fn connections(&self) -> u64 {
        self.rate.connections
    }

    pub(crate) fn per_second(&self) -> f64 {
        self.rate.per_second
    }

    pub(crate) fn p50_us(&self) -> f64 {
        self.latency.p50_us
    }

    pub(crate) fn p99_us(&self) -> f64 {
        self.latency.p99_us
    }
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct ModeRun {
    pub(crate) run: usize,
    pub(crate) mode: Mode,
    pub(crate) conntrack: Conntrack,
    pub(crate) points: Vec<Point>,
}

pub(super) async fn run(args: RedirectArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(
        !args.clients.is_empty() && args.clients.iter().all(|&c| c > 0),
        "--clients: positive counts"
    );
    ensure!(
        args.duration_secs > 0.0 && args.warmup_secs >= 0.0,
        "--duration-secs must be positive"
    );
    let suite = SuiteRun::start("redirect");
    let agent = std::path::absolute(&args.common.agent)?;
    let compared = compared_modes(&args.modes)?;
    let mut modes = vec![Mode::Direct];
    modes.extend(&compared);
    if args.trace_reader && compared.contains(&Mode::Ebpf) {
        modes.push(Mode::EbpfTraced);
    }
    if args.bystanders {
        modes.extend(compared.iter().map(|mode| match mode {
            Mode::Iptables => Mode::IptablesBystander,
            Mode::Nftables => Mode::NftablesBystander,
            _ => Mode::EbpfBystander,
        }));
    }
    let names: Vec<&str> = modes.iter().map(|m| m.name()).collect();
    eprintln!(
        "redirect: {:?}, clients {:?}, {} s (+{} s warm-up) per test, {} runs of {}",
        args.direction,
        args.clients,
        args.duration_secs,
        args.warmup_secs,
        args.runs,
        names.join(", ")
    );
    if sys::conntrack_count().is_none() {
        eprintln!(
            "redirect: nf_conntrack is not loaded; the iptables mode loads it, the counts before are missing"
        );
    }
    let work = TempDir::create("ambpf-bench-redirect")?;
    let cgroup = CgroupGuard::create().context("creating a throwaway cgroup")?;
    let _inside = cgroup.enter_process()?;

    let mut runs = Vec::new();
    for run in 0..args.runs {
        // Each mode goes first, and right after each other mode, equally
        // often; on a fresh cluster each time.
        let order = rotated(&modes, run);
        let names: Vec<&str> = order.iter().map(|m| m.name()).collect();
        eprintln!(
            "redirect: run {} of {}: {}",
            run + 1,
            args.runs,
            names.join(", ")
        );
        for &mode in &order {
            let result = measure_mode(&args, &agent, &work, &cgroup, mode, run)
                .await
                .with_context(|| format!("run {} mode {}", run + 1, mode.name()))?;
            runs.push(result);
        }
    }
    // The first run, which meets cold caches and binaries, apart.
    let mut summaries = serde_json::Map::new();
    for (group, member) in bench::RUN_GROUPS {
        let in_group: Vec<ModeRun> = runs
            .iter()
            .filter(|r| member(r.run, args.runs))
            .cloned()
            .collect();
        if in_group.is_empty() {
            continue;
        }
        let summary = summarize(&in_group, &args.clients, &modes);
        print_tables(&summary, &in_group, &args.tables(), group);
        let key = if group == "steady" {
            "summary"
        } else {
            "summary_first"
        };
        summaries.insert(key.to_owned(), serde_json::to_value(&summary)?);
    }
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            direction: args.direction,
            clients: args.clients.clone(),
            duration_s: args.duration_secs,
            warmup_s: args.warmup_secs,
            runs: args.runs,
            message_bytes: MESSAGE,
            conntrack_connections: args.conntrack_connections,
            loadgen_threads: args.loadgen_threads,
            agent,
        },
        serde_json::json!({
            "summary": summaries.remove("summary"),
            "summary_first": summaries.remove("summary_first"),
            "runs": runs,
        }),
    )?;
    Ok(())
}
