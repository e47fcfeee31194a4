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
mod load;
mod summary;
pub(crate) use agent::{Agent, OwnRuntime, named_runtime, write_pods_file};
use load::*;
use summary::{print_tables, summarize};

pub(super) const POD_UID: &str = "5e1f9a2c-bench-pod-0001";
const PEER_PORT: u16 = 9000;
/// Request and response size.
const MESSAGE: usize = 64;
/// One connect or exchange taking longer is an error, not a sample.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const SOCKET_TIMEOUT: Duration = Duration::from_secs(30);
/// Thread-name prefixes of the CPU groups, in [`CpuSample`] order.
const GROUPS: [&str; 3] = ["loadgen", "ztunnel", "echo"];

#[derive(Args)]
pub(super) struct RedirectArgs {
    #[command(flatten)]
    common: Common,
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
struct Conntrack {
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
struct Point {
    clients: usize,
    rate: RateSample,
    latency: LatencySample,
}

#[derive(Clone, Debug, Serialize)]
struct ModeRun {
    run: usize,
    mode: Mode,
    conntrack: Conntrack,
    points: Vec<Point>,
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
        "redirect: clients {:?}, {} s (+{} s warm-up) per test, {} runs of {}",
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
        print_tables(&summary, &in_group, &args, group);
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

async fn measure_mode(
    args: &RedirectArgs,
    agent_binary: &Path,
    work: &TempDir,
    cgroup: &CgroupGuard,
    mode: Mode,
    run: usize,
) -> Result<ModeRun> {
    let cluster = Cluster::create(1).context("creating the cluster")?;
    let pod = &cluster.pods[0];
    // Many short connections: the whole port range, and TIME_WAIT ports
    // reused (the pod's own namespace only).
    pod.ns.sysctl("net.ipv4.ip_local_port_range=10000 65000")?;
    pod.ns.sysctl("net.ipv4.tcp_tw_reuse=1")?;
    let target = SocketAddr::new(cluster.remote.addrs.v4.into(), PEER_PORT);
    let echo = start_echo(&cluster.remote.ns, target)?;
    let loadgen = LoadGen::new(&pod.ns, args.loadgen_threads)?;

    let pods_file = work.join("pods.json");
    let socket = work.join("ztunnel.sock");
    let mut redirected = None;
    if mode != Mode::Direct {
        let enrolled = if mode.captures() {
            vec![(POD_UID.to_owned(), pod.ns.path())]
        } else {
            Vec::new()
        };
        write_pods_file(&pods_file, &enrolled)?;
        let log = work.join(format!("agent-{}-{}.log", mode.name(), run));
        let agent = Agent::start(
            agent_binary,
            mode,
            &cluster.node,
            &pods_file,
            &socket,
            cgroup,
            &log,
        )
        .await?;
        let (zt_runtime, _) = named_runtime("ztunnel-rt", 2, None)?;
        let double = {
            let _enter = zt_runtime.enter();
            ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default())
        };
        let captures = mode.captures();
        double
            .wait_until(
                |s| {
                    s.ready
                        && (!captures
                            || s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running))
                },
                READY_TIMEOUT,
            )
            .await
            .map_err(|e| anyhow::anyhow!("ztunnel never got ready (or the pod): {e:?}"))?;
        let reader = match mode {
            Mode::EbpfTraced => {
                let log = work.join(format!("trace-{run}.log"));
                Some(agent.attach_trace_reader(&log).await?)
            }
            _ => None,
        };
        redirected = Some((agent, double, zt_runtime, reader));
    }
    let agent_pid = redirected.as_ref().map(|(agent, ..)| agent.pid());
    let take_proxied = || {
        redirected.as_ref().map_or((0, 0), |(_, double, ..)| {
            let taken = double.take_proxied();
            let ok = taken
                .iter()
                .filter(|c| c.outcome == ConnectionOutcome::Proxied)
                .count();
            (ok, taken.len() - ok)
        })
    };

    // Conntrack: a fixed number of sequential connections.
    let count = |ns: &NetnsGuard| ns.run(sys::conntrack_count).ok().flatten();
    let (pod_before, node_before) = (count(&pod.ns), count(&cluster.node));
    loadgen
        .sequential(target, args.conntrack_connections)
        .await
        .context("the conntrack connections")?;
    let (pod_after, node_after) = (count(&pod.ns), count(&cluster.node));
    let per = |before: Option<u64>, after: Option<u64>| {
        Some((after? as f64 - before.unwrap_or(0) as f64) / args.conntrack_connections as f64)
    };
    let conntrack = Conntrack {
        connections: args.conntrack_connections,
        pod_before,
        pod_after,
        node_before,
        node_after,
        pod_per_connection: per(pod_before, pod_after),
        node_per_connection: per(node_before, node_after),
    };
    let (proxied, _) = take_proxied();
    if mode.captures() {
        ensure!(
            proxied as u64 >= args.conntrack_connections,
            "only {proxied} of {} connections went through ztunnel",
            args.conntrack_connections
        );
    } else {
        ensure!(
            proxied == 0,
            "{proxied} of a bystander's connections went through ztunnel"
        );
    }

    let warmup = Duration::from_secs_f64(args.warmup_secs);
    let duration = Duration::from_secs_f64(args.duration_secs);
    let mut points = Vec::new();
    for &clients in &args.clients {
        let (connections, errors, per_second, cpu) = loadgen
            .rate(target, clients, warmup, duration, agent_pid)
            .await
            .with_context(|| format!("connection rate, {clients} clients"))?;
        let (proxied, proxy_failures) = take_proxied();
        let rate = RateSample {
            connections,
            errors,
            per_second,
            proxied,
            proxy_failures,
            cpu,
        };
        let (histogram, cpu) = loadgen
            .latency(target, clients, warmup, duration, agent_pid)
            .await
            .with_context(|| format!("latency, {clients} clients"))?;
        let (proxied, _) = take_proxied();
        let us = |ns: Option<u64>| ns.map_or(f64::NAN, |ns| ns as f64 / 1e3);
        let latency = LatencySample {
            requests: histogram.count(),
            per_second: histogram.count() as f64 / cpu.wall_s,
            p50_us: us(histogram.percentile_ns(50.0)),
            p99_us: us(histogram.percentile_ns(99.0)),
            mean_us: histogram.mean_ns().map_or(f64::NAN, |ns| ns / 1e3),
            max_us: us(histogram.max_ns()),
            proxied,
            cpu,
        };
        eprintln!(
            "redirect: run {} {:<8} {:>2} clients: {:>8.0} conn/s ({} errors, busiest {}), p50 {:>7.1} µs p99 {:>7.1} µs ({:.0} req/s, busiest {})",
            run + 1,
            mode.name(),
            clients,
            rate.per_second,
            rate.errors,
            rate.cpu.busiest().0,
            latency.p50_us,
            latency.p99_us,
            latency.per_second,
            latency.cpu.busiest().0,
        );
        points.push(Point {
            clients,
            rate,
            latency,
        });
    }

    if let Some((agent, double, zt_runtime, reader)) = redirected {
        if let Some(mut reader) = reader {
            reader.stop()?;
            let records = std::fs::read_to_string(reader.log_path())?
                .lines()
                .filter(|l| l.contains("\"verdict\""))
                .count();
            eprintln!(
                "redirect: run {} the trace reader printed {records} records",
                run + 1
            );
            ensure!(records > 0, "the trace reader printed no record");
        }
        // Unenrol (ztunnel gets the Del), stop, remove the pins.
        write_pods_file(&pods_file, &[])?;
        double
            .wait_until(|s| s.workloads.is_empty(), READY_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("the pod was not removed: {e:?}"))?;
        double.shutdown().await;
        agent.stop()?;
        drop(zt_runtime);
    }
    drop(loadgen);
    drop(echo);
    drop(cluster);
    Ok(ModeRun {
        run,
        mode,
        conntrack,
        points,
    })
}
