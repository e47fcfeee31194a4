//! ambpf's benchmarks: `ambpf-bench <suite> --agent <ambpf binary> --out <json>`,
//! usually through `cargo xtask bench <suite>` (which builds everything first).
//!
//! Every suite measures the real agent binary and, in the same run, a minimal
//! baseline doing the same job, and reports the ratio: results are compared
//! across commits and machines as ratios, never as absolute pass/fail.
//!
//! Suites:
//! - `zds`: how long the agent takes to hand ztunnel a snapshot of N pods over
//!   ZDS, against a floor server that sends the same messages and nothing else.
//! - `redirect`: traffic from an enrolled pod through the ztunnel double,
//!   direct (the floor), iptables and eBPF in the same run: connection rate,
//!   latency, conntrack entries, CPU per process
//!   (`testbed/src/bench/suite_redirect.rs`);
//! - `enroll`: time for the agent to enrol and remove N pods, eBPF against
//!   iptables in the same run (`testbed/src/bench/suite_enroll.rs`);
//! - `control`: the Kubernetes control path: API event to redirection, to the
//!   annotation and to removal, pod by pod, and a start-up snapshot of N pods,
//!   eBPF against iptables (`testbed/src/bench/suite_control.rs`);
//! - `attach`: the kernel's cost of attaching the inbound steering program to
//!   N fresh pods, TCX link against clsact + cls_bpf, an sk_lookup netns link
//!   and TCX without a link (`testbed/src/bench/suite_attach.rs`);
//! - `storm`: more concurrent redirected connections than the
//!   original-destination maps hold: what became of each, eBPF against
//!   iptables (`testbed/src/bench/suite_storm.rs`);
//! - `podstart`: CRI RunPodSandbox latency on a containerd node with no
//!   ambpf, iptables and eBPF mode (`testbed/src/bench/suite_podstart.rs`).
//!
//! Further suites become variants of [`Suite`], each with its own arguments
//! and [`Common`] ones, using the helpers of `ambpf_testbed::bench`.
//!
//! Needs root: the agent loads BPF programs and the suites create network
//! namespaces, cgroups and bpffs mounts. Everything is removed on exit, on
//! errors and on Ctrl-C (SIGINT or SIGTERM).

use std::{
    collections::BTreeMap,
    fs::File,
    os::{
        fd::AsFd,
        unix::{fs::FileTypeExt, process::CommandExt as _},
    },
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    sync::Arc,
    time::{Duration, Instant},
};

use ambpf_proto::{
    Message as _, ZTUNNEL_READ_BUFFER,
    zds::{WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello},
};
use ambpf_testbed::{
    BpffsMount, CgroupGuard,
    bench::{self, Memory, ProcessGuard, Stats, SuiteRun, Table, TempDir, ms},
    cluster::{self, Cluster},
    ztunnel::{ZdsEvent, ZtunnelConfig, ZtunnelDouble, ZtunnelState},
};
use anyhow::{Context as _, Result, bail, ensure};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use tokio::sync::watch;
use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener, ancillary::AncillaryMessageWriter};

#[derive(Parser)]
#[command(
    name = "ambpf-bench",
    about = "ambpf's benchmarks: the real agent against a baseline measured in the same run"
)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Subcommand)]
enum Suite {
    /// Time for the agent to send ztunnel a full ZDS snapshot of N pods, against
    /// a minimal floor ZDS server sending the same messages.
    Zds(zds::ZdsArgs),
    /// Traffic from an enrolled pod through the ztunnel double to a peer:
    /// connection rate, latency, conntrack and CPU, for direct, iptables and
    /// eBPF redirection.
    Redirect(redirect::RedirectArgs),
    /// Time for the agent to enrol and remove N pods, iptables against eBPF.
    Enroll(enroll::EnrollArgs),
    /// The Kubernetes control path (kube source against a test API server):
    /// event to redirection, annotation and removal per pod, and a start-up
    /// snapshot of N pods, iptables against eBPF.
    Control(control::ControlArgs),
    /// Attaching the inbound steering program to N fresh pods: TCX link,
    /// clsact + cls_bpf, sk_lookup netns link, TCX without a link; per attach,
    /// replace and detach, side by side.
    Attach(attach::AttachArgs),
    /// A connection storm past the original-destination capacity: what
    /// became of each connection (reached, refused and counted, misrouted,
    /// hung), eBPF against iptables.
    Storm(storm::StormArgs),
    /// A pod's start as kubelet sees it: CRI RunPodSandbox on a containerd
    /// node with no ambpf, with ambpf in iptables mode and in eBPF mode.
    Podstart(podstart::PodstartArgs),
}

/// Arguments every suite takes.
#[derive(Args)]
struct Common {
    /// The ambpf agent binary.
    #[arg(long, default_value = "target/release/ambpf")]
    agent: PathBuf,
    /// Where to write the JSON result (nothing written without it).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("ambpf-bench: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tokio::select! {
            result = run(cli) => result,
            // Dropping the suite's future drops its guards: the agent is
            // stopped, namespaces, mounts and files removed.
            signal = termination() => Err(anyhow::anyhow!("interrupted by {signal}; cleaned up")),
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambpf-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.suite {
        Suite::Zds(args) => zds::run(args).await,
        Suite::Redirect(args) => redirect::run(args).await,
        Suite::Enroll(args) => enroll::run(args).await,
        Suite::Control(args) => control::run(args).await,
        Suite::Attach(args) => attach::run(args).await,
        Suite::Storm(args) => storm::run(args).await,
        Suite::Podstart(args) => podstart::run(args).await,
    }
}

/// Resolves on SIGINT or SIGTERM, with the signal's name.
async fn termination() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        // Without handlers the default action (exit) applies; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// Checks what every suite needs before creating anything.
fn preflight(common: &Common) -> Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "run as root: the agent loads BPF programs and the suite creates network namespaces and bpffs mounts"
    );
    ensure!(
        common.agent.is_file(),
        "no agent binary at {} (build it with `cargo build --release -p ambpf`, or use `cargo xtask bench`)",
        common.agent.display()
    );
    let limit = bench::raise_fd_limit().context("raising the open-file limit")?;
    ensure!(
        limit >= 4096,
        "the open-file limit is {limit}; the ztunnel double holds a netns fd per pod"
    );
    Ok(())
}

/// Where the agent serves `/metrics` (its default), in the node namespace.
const AGENT_METRICS: &str = "127.0.0.1:15014";

/// The agent's `/metrics` page, read from inside the node namespace.
fn agent_metrics(node: &ambpf_testbed::NetnsGuard) -> Result<String> {
    use std::io::{Read as _, Write as _};
    let body = node.run(|| -> std::io::Result<String> {
        let mut conn = std::net::TcpStream::connect(AGENT_METRICS)?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")?;
        let mut body = String::new();
        conn.read_to_string(&mut body)?;
        Ok(body)
    })??;
    Ok(body)
}

/// The series of the metric family `name` (`ambpf_..._total`) in a
/// `/metrics` page with one label `label`: label value -> sample.
fn labelled_series(metrics: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let prefix = format!("{name}{{{label}=\"");
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix(prefix.as_str()))
        .filter_map(|rest| {
            let (value_of_label, sample) = rest.split_once("\"} ")?;
            Some((value_of_label.to_owned(), sample.trim().parse().ok()?))
        })
        .collect()
}

/// Waits until `path` is a unix socket (the agent binds it under a temporary
/// name and renames it into place, so it exists only once it listens).
async fn wait_for_socket(agent: &mut ProcessGuard, path: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        agent.check_running()?;
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the agent did not create {} within {timeout:?}; the end of its log:\n{}",
                path.display(),
                agent.log_tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `condition` every millisecond until it holds; an error after
/// `timeout` (a hang, not a slow result: no benchmark asserts on time).
async fn poll_until(
    what: &str,
    timeout: Duration,
    mut condition: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !condition()? {
        if Instant::now() > deadline {
            bail!("{what}: not within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// A task aborted when dropped, so a suite that fails leaves nothing running.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[path = "../bench/suite_redirect.rs"]
mod redirect;

#[path = "../bench/suite_enroll.rs"]
mod enroll;

#[path = "../bench/suite_control.rs"]
mod control;

#[path = "../bench/suite_attach.rs"]
mod attach;

#[path = "../bench/suite_storm.rs"]
mod storm;

#[path = "../bench/suite_podstart.rs"]
mod podstart;

mod zds {
    //! The `zds` suite: ZDS snapshot time, agent against floor.
    //!
    //! For each N, the real agent runs with a pods file of N pods, a private
    //! bpffs pin root and its own ZDS socket. Each run connects a fresh
    //! ZDS-only ztunnel double and times connect → ready (SnapshotSent
    //! acked). The agent replays its full snapshot to every new connection,
    //! so repeated connections are repeated snapshots; between runs the double
    //! shuts down and the bench waits until the agent has closed that
    //! connection (its socket count is back to the idle one), so no run
    //! overlaps the previous one's teardown.
    //!
    //! The floor is an in-process ZDS server on the same kind of socket
    //! (AF_UNIX SOCK_SEQPACKET) that sends the same N Add messages, each with
    //! one netns fd opened once up front, then SnapshotSent, waiting for each
    //! ack: the protocol's own cost (encoding, sendmsg with SCM_RIGHTS, the
    //! double's receive, fstat and bookkeeping, the ack round trip) with no
    //! per-pod open and no state. Agent and floor runs alternate, so drift
    //! (frequency scaling, noisy neighbours) affects both alike.
    //!
    //! The floor runs on a thread with a tokio runtime of its own, as the
    //! agent is a separate process with its own runtime: every ack then wakes
    //! the server's event loop, as it wakes the agent's, and that round-trip
    //! wake-up is most of a snapshot's wall time. With `--floor-thread
    //! shared` the floor is a task on the bench's runtime beside the double,
    //! where a hand-off between the two tasks is often a wake-up within one
    //! worker: a floor below what any out-of-process server can reach (about
    //! half the own-thread floor's wall time on a 2-CPU VM), useful to see how
    //! much of a snapshot is scheduling rather than work.
    //!
    //! Besides wall time, each run records the server's CPU time (the agent's
    //! threads, or the floor's thread) from before the connection until the
    //! server has closed it, via schedstat (nanoseconds): the CPU ratio is
    //! the steadier measure of the agent's own per-pod work.
    //!
    //! Pods are spread over a pool of 16 pod network namespaces (a testbed
    //! [`Cluster`]: each pod namespace has an `eth0` with IPv4 and IPv6
    //! addresses, veth'd to a node namespace) rather than one namespace each:
    //! what ZDS costs is per message and per fd, and the agent still opens,
    //! sends and closes its own fd for every Add whichever namespace the path
    //! names, while creating and deleting 1000 namespaces would take longer
    //! than the benchmark and measure nothing of ZDS. The pods need real
    //! addresses because the agent enrols each pod in the eBPF redirection
    //! before handing it to ztunnel; it does so once, at start-up, before it
    //! listens, so enrolment is not part of any snapshot timed here (the
    //! start-up time is recorded, but with 16 namespaces it says little about
    //! enrolling N real pods: that is the `enroll` suite's job).
    //!
    //! As in the demo, the agent runs in the cluster's node namespace (its
    //! "host" addresses are the node's) with its socket programs attached to
    //! a throwaway cgroup, so the machine's own traffic is never touched; its
    //! pins live in a private bpffs.

    use super::*;

    /// Namespaces in the pool, whatever N is (see the module docs).
    const DEFAULT_NETNS_POOL: usize = 16;
    /// A hang, not a slow result.
    const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);
    const READY_TIMEOUT: Duration = Duration::from_secs(120);
    const DISCONNECT_TIMEOUT: Duration = Duration::from_secs(10);

    #[derive(Args)]
    pub(super) struct ZdsArgs {
        #[command(flatten)]
        common: Common,
        /// Pod counts to measure, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "100,1000")]
        pods: Vec<usize>,
        /// Measured snapshots per pod count (each for the agent and the floor).
        #[arg(long, default_value_t = 7)]
        runs: usize,
        /// Unmeasured snapshots first (caches, lazily allocated memory).
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        /// Network namespaces the pods are spread over.
        #[arg(long, default_value_t = DEFAULT_NETNS_POOL)]
        netns: usize,
        /// Where the floor server runs: on a thread and tokio runtime of its
        /// own (like a server in another process), or as a task on the bench's
        /// runtime, beside the double (cheaper hand-offs: a lower floor).
        #[arg(long, value_enum, default_value_t = FloorThread::Own)]
        floor_thread: FloorThread,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
    #[serde(rename_all = "snake_case")]
    pub(super) enum FloorThread {
        Own,
        Shared,
    }

    #[derive(Serialize)]
    struct Config {
        pods: Vec<usize>,
        runs: usize,
        warmup: usize,
        netns_pool: usize,
        floor_thread: FloorThread,
        agent: PathBuf,
    }

    /// One measured snapshot.
    struct Sample {
        /// Connect to ready.
        wall: Duration,
        /// CPU time of the server from just before the connection to after it
        /// closed (`None`: a floor on the double's runtime, not separable).
        server_cpu: Option<Duration>,
        /// CPU time of this process's other threads (the ztunnel double; and
        /// the floor when it shares the double's runtime) over the snapshot.
        double_cpu: Duration,
    }

    /// One server's results over the runs.
    #[derive(Serialize)]
    struct Timing {
        samples_ms: Vec<f64>,
        /// Connect to ready (SnapshotSent acked), per snapshot.
        snapshot_ms: Stats,
        per_pod_us: Stats,
        /// CPU time of the server per snapshot (schedstat, all its threads).
        server_cpu_ms: Option<Stats>,
        /// CPU time of the double per snapshot.
        double_cpu_ms: Stats,
    }

    impl Timing {
        fn new(samples: &[Sample], pods: usize) -> Result<Self> {
            let samples_ms: Vec<f64> = samples.iter().map(|s| ms(s.wall)).collect();
            let snapshot_ms = Stats::of(&samples_ms).context("no measured runs")?;
            let server_cpu: Option<Vec<f64>> =
                samples.iter().map(|s| s.server_cpu.map(ms)).collect();
            let double_cpu: Vec<f64> = samples.iter().map(|s| ms(s.double_cpu)).collect();
            Ok(Self {
                per_pod_us: snapshot_ms.scaled(1e3 / pods as f64),
                snapshot_ms,
                samples_ms,
                server_cpu_ms: server_cpu.as_deref().and_then(Stats::of),
                double_cpu_ms: Stats::of(&double_cpu).context("no measured runs")?,
            })
        }
    }

    #[derive(Serialize)]
    struct AgentResources {
        /// From spawning the agent to its ZDS socket appearing: loading the
        /// programs and enrolling the N pods (in 16 namespaces; see the
        /// module docs), before ztunnel can connect.
        startup_ms: f64,
        /// Agent CPU time over the wall time of its snapshots: 1.0 is one core
        /// kept busy.
        cores_while_serving: f64,
        /// Just after the socket appeared, before any connection.
        memory_idle: Memory,
        /// After the last run.
        memory_after: Memory,
        /// How the agent exited on SIGTERM.
        exit: String,
    }

    #[derive(Serialize)]
    struct PodsResult {
        pods: usize,
        agent: Timing,
        floor: Timing,
        /// Snapshot wall time, agent median / floor median.
        ratio_median: f64,
        /// Snapshot wall time, agent min / floor min (the least disturbed runs).
        ratio_min: f64,
        /// Server CPU per snapshot, agent median / floor median.
        cpu_ratio_median: Option<f64>,
        agent_resources: AgentResources,
    }

    /// A pod as written to the agent's pods file and sent by the floor.
    struct BenchPod {
        uid: String,
        name: String,
        namespace: String,
        service_account: String,
        netns: PathBuf,
    }

    impl BenchPod {
        fn info(&self) -> WorkloadInfo {
            WorkloadInfo {
                name: self.name.clone(),
                namespace: self.namespace.clone(),
                service_account: self.service_account.clone(),
            }
        }
    }

    /// N pods with Kubernetes-sized names (UUID uids), round-robin over the
    /// namespaces at `pool`.
    fn bench_pods(n: usize, pool: &[PathBuf]) -> Vec<BenchPod> {
        (0..n)
            .map(|i| BenchPod {
                uid: format!("{n:08x}-b0b0-4000-8000-{i:012x}"),
                name: format!("bench-{i:05}-7d4b9c8f6-x2k4p"),
                namespace: "ambpf-bench".to_owned(),
                service_account: "bench-workload".to_owned(),
                netns: pool[i % pool.len()].clone(),
            })
            .collect()
    }

    fn pods_file(pods: &[BenchPod]) -> serde_json::Value {
        let pods: Vec<serde_json::Value> = pods
            .iter()
            .map(|p| {
                serde_json::json!({
                    "uid": p.uid,
                    "name": p.name,
                    "namespace": p.namespace,
                    "serviceAccount": p.service_account,
                    "netns": p.netns,
                })
            })
            .collect();
        serde_json::json!({ "pods": pods })
    }

    pub(super) async fn run(args: ZdsArgs) -> Result<()> {
        preflight(&args.common)?;
        ensure!(!args.pods.is_empty(), "--pods: give at least one pod count");
        ensure!(
            args.pods.iter().all(|&n| n > 0),
            "--pods: counts must be positive"
        );
        ensure!(args.runs > 0, "--runs must be at least 1");
        ensure!(
            (1..=cluster::MAX_PODS).contains(&args.netns),
            "--netns: between 1 and {} (the testbed cluster's limit)",
            cluster::MAX_PODS
        );
        let suite = SuiteRun::start("zds");
        let agent = std::path::absolute(&args.common.agent)?;
        eprintln!(
            "zds: pods {:?}, {} runs (+{} warm-up) each, over {} network namespaces",
            args.pods, args.runs, args.warmup, args.netns
        );

        let work = TempDir::create("ambpf-bench-zds")?;
        let cluster = Cluster::create(args.netns as u16)
            .context("creating the pod namespaces (testbed cluster)")?;
        let cgroup = CgroupGuard::create().context("creating a throwaway cgroup")?;
        // The floor's one netns fd, re-sent with every Add.
        let floor_netns = Arc::new(File::open(cluster.pods[0].ns.path())?);

        let mut results = Vec::new();
        for &n in &args.pods {
            let result = measure(&args, &agent, &work, &cluster, &cgroup, &floor_netns, n)
                .await
                .with_context(|| format!("{n} pods"))?;
            results.push(result);
        }
        print_tables(&results, &args);

        suite.write_report(
            args.common.out.as_deref(),
            Config {
                pods: args.pods.clone(),
                runs: args.runs,
                warmup: args.warmup,
                netns_pool: args.netns,
                floor_thread: args.floor_thread,
                agent,
            },
            &results,
        )?;
        Ok(())
    }

    /// Agent and floor for one pod count.
    async fn measure(
        args: &ZdsArgs,
        agent_binary: &Path,
        work: &TempDir,
        cluster: &Cluster,
        cgroup: &CgroupGuard,
        floor_netns: &Arc<File>,
        n: usize,
    ) -> Result<PodsResult> {
        let paths: Vec<PathBuf> = cluster.pods.iter().map(|p| p.ns.path()).collect();
        let pods = Arc::new(bench_pods(n, &paths));
        let pods_path = work.join(format!("pods-{n}.json"));
        bench::write_json(&pods_path, &pods_file(&pods))?;

        // Declared before the agent, so dropped after it: the agent must be
        // gone before its pin root is unmounted.
        let bpffs = BpffsMount::create()?;
        let socket = work.join(format!("agent-{n}.sock"));
        let mut command = Command::new(agent_binary);
        command
            .arg("--pin-root")
            .arg(bpffs.path().join("ambpf"))
            .arg("run")
            .arg("--pods-file")
            .arg(&pods_path)
            .arg("--zds-socket")
            .arg(&socket)
            .arg("--cgroup")
            .arg(cgroup.path())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        let node_ns = File::open(cluster.node.path())?;
        // SAFETY: setns is async-signal-safe, and `node_ns` outlives the spawn.
        unsafe {
            command.pre_exec(move || {
                nix::sched::setns(node_ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
        let spawned = Instant::now();
        let mut agent =
            ProcessGuard::spawn("the agent", command, &work.join(format!("agent-{n}.log")))?;
        wait_for_socket(&mut agent, &socket, SOCKET_TIMEOUT).await?;
        let startup = spawned.elapsed();
        let pid = agent.pid();
        let memory_idle = bench::memory(pid)?;
        let idle_sockets = bench::socket_count(pid)?;

        let floor_socket = work.join(format!("floor-{n}.sock"));
        let floor = Floor::start(
            &floor_socket,
            pods.clone(),
            floor_netns.clone(),
            args.floor_thread,
        )?;

        let bench_pid = std::process::id();
        let mut agent_samples = Vec::new();
        let mut floor_samples = Vec::new();
        for i in 0..args.warmup + args.runs {
            // Agent: connect → ready, then until the agent has closed the
            // connection, so its CPU time covers the whole connection.
            let (server_before, double_before) = (bench::on_cpu(pid)?, bench::on_cpu(bench_pid)?);
            let wall = snapshot(&socket, n)
                .await
                .with_context(|| format!("agent run {}", i + 1))
                .map_err(|e| with_log(e, &agent))?;
            let double_cpu = bench::on_cpu(bench_pid)?.saturating_sub(double_before);
            // The agent has noticed the disconnect once the connection's
            // socket is closed (its task ends after unregistering it).
            poll_until(
                "the agent closing the previous connection",
                DISCONNECT_TIMEOUT,
                || {
                    agent.check_running()?;
                    Ok(bench::socket_count(pid)? <= idle_sockets)
                },
            )
            .await
            .map_err(|e| with_log(e, &agent))?;
            let agent_sample = Sample {
                wall,
                server_cpu: Some(bench::on_cpu(pid)?.saturating_sub(server_before)),
                double_cpu,
            };

            // Floor: the same, its end being the floor seeing the close.
            let (server_before, double_before) = (floor.on_cpu()?, bench::on_cpu(bench_pid)?);
            let wall = snapshot(&floor_socket, n)
                .await
                .with_context(|| format!("floor run {}", i + 1))?;
            let bench_cpu = bench::on_cpu(bench_pid)?.saturating_sub(double_before);
            floor.wait_served(i as u64 + 1).await?;
            let server_cpu = match (floor.on_cpu()?, server_before) {
                (Some(after), Some(before)) => Some(after.saturating_sub(before)),
                _ => None,
            };
            let floor_sample = Sample {
                wall,
                server_cpu,
                // The floor thread is part of this process.
                double_cpu: bench_cpu.saturating_sub(server_cpu.unwrap_or_default()),
            };

            let measured = i >= args.warmup;
            eprintln!(
                "zds: {n:>5} pods, {} {}/{}: agent {:8.2} ms (cpu {:6.2} ms), floor {:8.2} ms (cpu {} ms)",
                if measured { "run   " } else { "warmup" },
                if measured { i - args.warmup + 1 } else { i + 1 },
                if measured { args.runs } else { args.warmup },
                ms(agent_sample.wall),
                ms(agent_sample.server_cpu.unwrap_or_default()),
                ms(floor_sample.wall),
                floor_sample
                    .server_cpu
                    .map_or("-".to_owned(), |c| format!("{:6.2}", ms(c))),
            );
            if measured {
                agent_samples.push(agent_sample);
                floor_samples.push(floor_sample);
            }
        }
        let memory_after = bench::memory(pid)?;
        let exit = agent.stop()?;
        if let Some(out) = &args.common.out {
            keep_log(&agent, out, n);
        }
        drop(floor);
        drop(bpffs);

        let agent_wall: Duration = agent_samples.iter().map(|s| s.wall).sum();
        let agent_cpu: Duration = agent_samples.iter().filter_map(|s| s.server_cpu).sum();
        let agent = Timing::new(&agent_samples, n)?;
        let floor = Timing::new(&floor_samples, n)?;
        Ok(PodsResult {
            pods: n,
            ratio_median: agent.snapshot_ms.median / floor.snapshot_ms.median,
            ratio_min: agent.snapshot_ms.min / floor.snapshot_ms.min,
            cpu_ratio_median: match (&agent.server_cpu_ms, &floor.server_cpu_ms) {
                (Some(a), Some(f)) => Some(a.median / f.median),
                _ => None,
            },
            agent,
            floor,
            agent_resources: AgentResources {
                startup_ms: ms(startup),
                cores_while_serving: agent_cpu.as_secs_f64() / agent_wall.as_secs_f64().max(1e-9),
                memory_idle,
                memory_after,
                exit: exit.to_string(),
            },
        })
    }

    /// Copies the agent's log next to the JSON result (`zds-agent-<n>.log`),
    /// for the agent's own view (e.g. its "snapshot of N pods acked in" lines).
    fn keep_log(agent: &ProcessGuard, out: &Path, n: usize) {
        let stem = out.file_stem().unwrap_or_default().to_string_lossy();
        let kept = out.with_file_name(format!("{stem}-agent-{n}.log"));
        let copied = kept
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::copy(agent.log_path(), &kept));
        if let Err(e) = copied {
            eprintln!(
                "zds: cannot keep the agent's log at {}: {e}",
                kept.display()
            );
        }
    }

    fn with_log(e: anyhow::Error, agent: &ProcessGuard) -> anyhow::Error {
        e.context(format!(
            "the end of the agent's log ({}):\n{}",
            agent.log_path().display(),
            agent.log_tail(20)
        ))
    }

    /// One snapshot: a fresh ZDS-only double connects to `socket`; the time
    /// from connecting to ready (SnapshotSent acked). The double then shuts
    /// down (closing the connection and every netns fd it received).
    async fn snapshot(socket: &Path, n: usize) -> Result<Duration> {
        let started = Instant::now();
        let double = ZtunnelDouble::connect(socket, ZtunnelConfig::zds_only()).await?;
        let waited = double
            .wait_until(|s| s.ready || s.stopped.is_some(), READY_TIMEOUT)
            .await;
        let elapsed = started.elapsed();
        let state = double.state();
        double.shutdown().await;
        waited?;
        check_snapshot(&state, n)?;
        Ok(elapsed)
    }

    /// The snapshot was complete and clean: a timing of anything else would
    /// be meaningless.
    fn check_snapshot(state: &ZtunnelState, n: usize) -> Result<()> {
        let connection = state
            .current_connection()
            .context("the double never connected")?;
        let nacks: Vec<&ZdsEvent> = state
            .events
            .iter()
            .filter(|e| matches!(e, ZdsEvent::Nacked { .. } | ZdsEvent::ProtocolError { .. }))
            .collect();
        ensure!(
            state.ready
                && connection.snapshot_sent
                && connection.added.len() == n
                && connection.kept.is_empty()
                && state.workloads.len() == n
                && nacks.is_empty(),
            "incomplete snapshot: ready {}, SnapshotSent {}, {} Adds and {} Keeps for {n} pods, \
             {} workloads, stopped {:?}, NACKs {:?}",
            state.ready,
            connection.snapshot_sent,
            connection.added.len(),
            connection.kept.len(),
            state.workloads.len(),
            state.stopped,
            nacks.iter().take(3).collect::<Vec<_>>()
        );
        Ok(())
    }

    /// The floor ZDS server: one connection at a time; hello, N Adds with
    /// the same pre-opened netns fd, SnapshotSent, each acked; then waits for
    /// the peer to close.
    struct Floor {
        served: watch::Receiver<u64>,
        /// [`FloorThread::Own`]: stops the thread's runtime, then it is joined.
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        /// [`FloorThread::Own`]: the thread's id, for its CPU time.
        tid: Option<u32>,
        thread: Option<std::thread::JoinHandle<()>>,
        /// [`FloorThread::Shared`]: the task on the bench's runtime.
        _task: Option<AbortOnDrop>,
    }

    impl Drop for Floor {
        fn drop(&mut self) {
            if let Some(stop) = self.stop.take() {
                let _ = stop.send(());
            }
            if let Some(thread) = self.thread.take() {
                let _ = thread.join();
            }
        }
    }

    async fn floor_loop(
        mut listener: UnixSeqpacketListener,
        pods: Arc<Vec<BenchPod>>,
        netns: Arc<File>,
        tx: watch::Sender<u64>,
    ) {
        loop {
            let socket = match listener.accept().await {
                Ok(socket) => socket,
                Err(e) => {
                    eprintln!("zds floor: accept failed: {e}");
                    return;
                }
            };
            if let Err(e) = serve_floor(&socket, &pods, &netns).await {
                eprintln!("zds floor: {e:#}");
            }
            drop(socket);
            tx.send_modify(|n| *n += 1);
        }
    }

    impl Floor {
        fn start(
            path: &Path,
            pods: Arc<Vec<BenchPod>>,
            netns: Arc<File>,
            thread: FloorThread,
        ) -> Result<Self> {
            let (tx, served) = watch::channel(0u64);
            if thread == FloorThread::Shared {
                let listener = UnixSeqpacketListener::bind(path)
                    .with_context(|| format!("binding the floor socket {}", path.display()))?;
                let task = tokio::spawn(floor_loop(listener, pods, netns, tx));
                return Ok(Self {
                    served,
                    stop: None,
                    tid: None,
                    thread: None,
                    _task: Some(AbortOnDrop(task)),
                });
            }
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let (bound_tx, bound) = std::sync::mpsc::channel();
            let path = path.to_owned();
            let thread = std::thread::Builder::new()
                .name("zds-floor".to_owned())
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(e) => {
                            let _ = bound_tx.send(Err(e));
                            return;
                        }
                    };
                    runtime.block_on(async move {
                        let listener = match UnixSeqpacketListener::bind(&path) {
                            Ok(listener) => {
                                let tid = nix::unistd::gettid().as_raw() as u32;
                                let _ = bound_tx.send(Ok(tid));
                                listener
                            }
                            Err(e) => {
                                let _ = bound_tx.send(Err(e));
                                return;
                            }
                        };
                        tokio::select! {
                            () = floor_loop(listener, pods, netns, tx) => {}
                            _ = stopped => {}
                        }
                    });
                })?;
            let mut floor = Self {
                served,
                stop: Some(stop),
                tid: None,
                thread: Some(thread),
                _task: None,
            };
            // On error, dropping `floor` stops and joins the thread.
            let tid = bound
                .recv()
                .context("the floor thread died")?
                .context("binding the floor socket")?;
            floor.tid = Some(tid);
            Ok(floor)
        }

        /// CPU time of the floor's thread so far (`None` when it shares the
        /// double's runtime).
        fn on_cpu(&self) -> Result<Option<Duration>> {
            self.tid
                .map(|tid| bench::thread_on_cpu(std::process::id(), tid))
                .transpose()
                .context("reading the floor thread's CPU time")
        }

        /// Waits until `count` connections have been served and closed.
        async fn wait_served(&self, count: u64) -> Result<()> {
            let mut served = self.served.clone();
            tokio::time::timeout(DISCONNECT_TIMEOUT, served.wait_for(|&n| n >= count))
                .await
                .context("the floor did not see the double disconnect")?
                .context("the floor server stopped")?;
            Ok(())
        }
    }

    async fn serve_floor(socket: &UnixSeqpacket, pods: &[BenchPod], netns: &File) -> Result<()> {
        let mut buf = [0u8; ZTUNNEL_READ_BUFFER];
        let len = socket.recv(&mut buf).await?.bytes_read();
        let hello = ZdsHello::decode(&buf[..len]).context("undecodable hello")?;
        ensure!(hello == ZdsHello::v1(), "unexpected hello {hello:?}");
        let fds = [netns.as_fd()];
        for pod in pods {
            let request = WorkloadRequest::add(&pod.uid, pod.info()).encode_to_vec();
            let mut control = [0u8; 64];
            let mut ancillary = AncillaryMessageWriter::new(&mut control);
            ancillary
                .add_fds(&fds)
                .map_err(|_| anyhow::anyhow!("control buffer too small for one fd"))?;
            socket.send_with_ancillary(&request, &mut ancillary).await?;
            await_ack(socket, &mut buf, &pod.uid).await?;
        }
        socket
            .send(&WorkloadRequest::snapshot_sent().encode_to_vec())
            .await?;
        await_ack(socket, &mut buf, "SnapshotSent").await?;
        // Stay connected, as the agent does, until the double goes away.
        let info = socket.recv(&mut buf).await?;
        ensure!(
            info.bytes_read() == 0,
            "unsolicited {}-byte message",
            info.bytes_read()
        );
        Ok(())
    }

    async fn await_ack(socket: &UnixSeqpacket, buf: &mut [u8], what: &str) -> Result<()> {
        let len = socket.recv(buf).await?.bytes_read();
        ensure!(
            len > 0,
            "the double closed the connection awaiting the ack of {what}"
        );
        WorkloadResponse::decode(&buf[..len])
            .context("undecodable response")?
            .into_result()
            .map_err(|why| anyhow::anyhow!("{what} NACKed: {why}"))
    }

    fn print_tables(results: &[PodsResult], args: &ZdsArgs) {
        println!();
        println!(
            "ZDS snapshot, connect to ready ({} runs each, {} network namespaces, floor on {} thread)",
            args.runs,
            args.netns,
            match args.floor_thread {
                FloorThread::Own => "its own",
                FloorThread::Shared => "the double's",
            }
        );
        let mut timing = Table::new([
            "pods",
            "server",
            "median ms",
            "p90 ms",
            "min ms",
            "max ms",
            "µs/pod",
            "server cpu ms",
            "double cpu ms",
        ]);
        for r in results {
            for (who, t) in [("agent", &r.agent), ("floor", &r.floor)] {
                let s = &t.snapshot_ms;
                timing.row([
                    r.pods.to_string(),
                    who.to_owned(),
                    format!("{:.2}", s.median),
                    format!("{:.2}", s.p90),
                    format!("{:.2}", s.min),
                    format!("{:.2}", s.max),
                    format!("{:.1}", t.per_pod_us.median),
                    t.server_cpu_ms
                        .map_or("-".to_owned(), |c| format!("{:.2}", c.median)),
                    format!("{:.2}", t.double_cpu_ms.median),
                ]);
            }
        }
        print!("{timing}");
        println!("(cpu: median per snapshot; the double is the ztunnel double in this process)");
        println!();
        let mut agent = Table::new([
            "pods",
            "agent/floor",
            "min/min",
            "cpu agent/floor",
            "agent cores",
            "startup ms",
            "VmRSS MiB idle",
            "VmRSS MiB",
            "VmHWM MiB",
        ]);
        let mib = |kib: u64| format!("{:.1}", kib as f64 / 1024.0);
        for r in results {
            let a = &r.agent_resources;
            agent.row([
                r.pods.to_string(),
                format!("{:.2}x", r.ratio_median),
                format!("{:.2}x", r.ratio_min),
                r.cpu_ratio_median
                    .map_or("-".to_owned(), |c| format!("{c:.2}x")),
                format!("{:.2}", a.cores_while_serving),
                format!("{:.0}", a.startup_ms),
                mib(a.memory_idle.vm_rss_kib),
                mib(a.memory_after.vm_rss_kib),
                mib(a.memory_after.vm_hwm_kib),
            ]);
        }
        print!("{agent}");
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn bench_pods_fit_a_zds_message_and_spread_over_the_pool() {
            let pool: Vec<PathBuf> = (0..16).map(|i| format!("/run/netns/b{i}").into()).collect();
            let pods = bench_pods(1000, &pool);
            assert_eq!(pods.len(), 1000);
            assert!(pods.iter().all(|p| p.uid.len() == 36));
            let uids: std::collections::HashSet<&str> =
                pods.iter().map(|p| p.uid.as_str()).collect();
            assert_eq!(uids.len(), 1000);
            assert_eq!(pods[17].netns, pool[1]);
            let last = &pods[999];
            let len = WorkloadRequest::add(&last.uid, last.info()).encoded_len();
            assert!(len <= ambpf_proto::MAX_MESSAGE_LEN, "{len}");
            let file = pods_file(&pods[..1]);
            assert_eq!(file["pods"][0]["serviceAccount"], "bench-workload");
            assert_eq!(file["pods"][0]["netns"], "/run/netns/b0");
        }
    }
}
