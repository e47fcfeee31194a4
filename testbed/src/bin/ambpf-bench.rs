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
//!
//! Later suites (`redirect`: traffic through the redirection against
//! iptables; `enroll`: time from a pod appearing to its traffic being
//! captured; `control`: the control-plane cost of churn) become further
//! variants of [`Suite`], each with its own arguments and [`Common`] ones,
//! using the helpers of `ambpf_testbed::bench`.
//!
//! Needs root: the agent loads BPF programs and the suites create network
//! namespaces and bpffs mounts. Everything is removed on exit, on errors and
//! on Ctrl-C.

use std::{
    fs::File,
    os::{fd::AsFd, unix::fs::FileTypeExt},
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
    BpffsMount, NetnsGuard,
    bench::{self, Machine, Memory, ProcessGuard, Report, Stats, Table, TempDir, cpu_time, ms},
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
    //! Pods are spread over a pool of 16 throwaway network namespaces rather
    //! than one namespace each: what ZDS costs is per message and per fd, and
    //! the agent still opens, sends and closes its own fd for every Add
    //! whichever namespace the path names, while creating and deleting 1000
    //! namespaces would take longer than the benchmark and measure nothing of
    //! ZDS. (Should the agent come to do per-namespace work on enrolment,
    //! that belongs to the `enroll` suite, with a namespace per pod.)

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
    }

    #[derive(Serialize)]
    struct Config {
        pods: Vec<usize>,
        runs: usize,
        warmup: usize,
        netns_pool: usize,
        agent: PathBuf,
    }

    /// One side's timings: snapshot wall time (connect → ready) per run.
    #[derive(Serialize)]
    struct Timing {
        samples_ms: Vec<f64>,
        snapshot_ms: Stats,
        per_pod_us: Stats,
        /// CPU time of this bench process (the ztunnel double, plus the floor
        /// server for the floor) per snapshot. Per-run deltas of clock-tick
        /// counters: approximate for short snapshots.
        bench_cpu_ms_per_snapshot: f64,
    }

    impl Timing {
        fn new(samples: &[Duration], pods: usize, bench_cpu: Duration) -> Result<Self> {
            let samples_ms: Vec<f64> = samples.iter().copied().map(ms).collect();
            let snapshot_ms = Stats::of(&samples_ms).context("no measured runs")?;
            Ok(Self {
                per_pod_us: snapshot_ms.scaled(1e3 / pods as f64),
                snapshot_ms,
                samples_ms,
                bench_cpu_ms_per_snapshot: ms(bench_cpu) / samples.len() as f64,
            })
        }
    }

    #[derive(Serialize)]
    struct AgentResources {
        /// Agent CPU time per snapshot, over the whole measured span (the agent
        /// idles during the floor's runs).
        cpu_ms_per_snapshot: f64,
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
        /// agent median / floor median.
        ratio_median: f64,
        /// agent min / floor min (the least disturbed runs).
        ratio_min: f64,
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
        ensure!(args.netns > 0, "--netns must be at least 1");
        let started_unix = bench::unix_now();
        let started = Instant::now();
        let machine = Machine::collect();
        let agent = std::path::absolute(&args.common.agent)?;
        eprintln!("zds: {machine}");
        eprintln!(
            "zds: pods {:?}, {} runs (+{} warm-up) each, over {} network namespaces",
            args.pods, args.runs, args.warmup, args.netns
        );

        let work = TempDir::create("ambpf-bench-zds")?;
        let pool = (0..args.netns)
            .map(|_| NetnsGuard::create("bench"))
            .collect::<std::io::Result<Vec<_>>>()
            .context("creating the network namespace pool")?;
        // The floor's one netns fd, re-sent with every Add.
        let floor_netns = Arc::new(File::open(pool[0].path())?);

        let mut results = Vec::new();
        for &n in &args.pods {
            let result = measure(&args, &agent, &work, &pool, &floor_netns, n)
                .await
                .with_context(|| format!("{n} pods"))?;
            results.push(result);
        }
        print_tables(&results, &args);

        if let Some(out) = &args.common.out {
            let report = Report {
                suite: "zds".to_owned(),
                started_unix,
                duration_s: started.elapsed().as_secs_f64(),
                machine,
                config: Config {
                    pods: args.pods.clone(),
                    runs: args.runs,
                    warmup: args.warmup,
                    netns_pool: args.netns,
                    agent,
                },
                results: &results,
            };
            bench::write_json(out, &report)
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {}", out.display());
        }
        Ok(())
    }

    /// Agent and floor for one pod count.
    async fn measure(
        args: &ZdsArgs,
        agent_binary: &Path,
        work: &TempDir,
        pool: &[NetnsGuard],
        floor_netns: &Arc<File>,
        n: usize,
    ) -> Result<PodsResult> {
        let paths: Vec<PathBuf> = pool.iter().map(NetnsGuard::path).collect();
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
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        let mut agent =
            ProcessGuard::spawn("the agent", command, &work.join(format!("agent-{n}.log")))?;
        wait_for_socket(&mut agent, &socket, SOCKET_TIMEOUT).await?;
        let pid = agent.pid();
        let memory_idle = bench::memory(pid)?;
        let idle_sockets = bench::socket_count(pid)?;

        let floor_socket = work.join(format!("floor-{n}.sock"));
        let floor = Floor::start(&floor_socket, pods.clone(), floor_netns.clone())?;

        let mut agent_samples = Vec::new();
        let mut floor_samples = Vec::new();
        let mut agent_bench_cpu = Duration::ZERO;
        let mut floor_bench_cpu = Duration::ZERO;
        let mut agent_cpu_start = None;
        for i in 0..args.warmup + args.runs {
            let measured = i >= args.warmup;
            if measured && agent_cpu_start.is_none() {
                agent_cpu_start = Some(cpu_time(pid)?);
            }

            let self_before = cpu_time(std::process::id())?;
            let agent_time = snapshot(&socket, n)
                .await
                .with_context(|| format!("agent run {}", i + 1))
                .map_err(|e| with_log(e, &agent))?;
            let self_agent = cpu_time(std::process::id())?.since(&self_before);
            // The agent noticed the disconnect once the connection's socket
            // is closed (its task ends after unregistering the connection).
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

            let self_before = cpu_time(std::process::id())?;
            let floor_time = snapshot(&floor_socket, n)
                .await
                .with_context(|| format!("floor run {}", i + 1))?;
            let self_floor = cpu_time(std::process::id())?.since(&self_before);
            floor.wait_served(i as u64 + 1).await?;

            eprintln!(
                "zds: {n:>5} pods, {} {}/{}: agent {:8.2} ms, floor {:8.2} ms",
                if measured { "run   " } else { "warmup" },
                if measured { i - args.warmup + 1 } else { i + 1 },
                if measured { args.runs } else { args.warmup },
                ms(agent_time),
                ms(floor_time)
            );
            if measured {
                agent_samples.push(agent_time);
                floor_samples.push(floor_time);
                agent_bench_cpu += self_agent.total();
                floor_bench_cpu += self_floor.total();
            }
        }
        let agent_cpu = cpu_time(pid)?.since(&agent_cpu_start.unwrap_or_default());
        let memory_after = bench::memory(pid)?;
        let exit = agent.stop()?;
        drop(floor);
        drop(bpffs);

        let agent_wall: Duration = agent_samples.iter().sum();
        let agent = Timing::new(&agent_samples, n, agent_bench_cpu)?;
        let floor = Timing::new(&floor_samples, n, floor_bench_cpu)?;
        Ok(PodsResult {
            pods: n,
            ratio_median: agent.snapshot_ms.median / floor.snapshot_ms.median,
            ratio_min: agent.snapshot_ms.min / floor.snapshot_ms.min,
            agent,
            floor,
            agent_resources: AgentResources {
                cpu_ms_per_snapshot: ms(agent_cpu.total()) / args.runs as f64,
                cores_while_serving: agent_cpu.total().as_secs_f64()
                    / agent_wall.as_secs_f64().max(1e-9),
                memory_idle,
                memory_after,
                exit: exit.to_string(),
            },
        })
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

    /// The floor ZDS server: one connection at a time; hello, N Adds with the
    /// same pre-opened netns fd, SnapshotSent, each acked; then waits for the
    /// peer to close.
    struct Floor {
        served: watch::Receiver<u64>,
        _task: AbortOnDrop,
    }

    impl Floor {
        fn start(path: &Path, pods: Arc<Vec<BenchPod>>, netns: Arc<File>) -> Result<Self> {
            let mut listener = UnixSeqpacketListener::bind(path)
                .with_context(|| format!("binding the floor socket {}", path.display()))?;
            let (tx, served) = watch::channel(0u64);
            let task = tokio::spawn(async move {
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
            });
            Ok(Self {
                served,
                _task: AbortOnDrop(task),
            })
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
            "ZDS snapshot, connect to ready ({} runs each, {} network namespaces)",
            args.runs, args.netns
        );
        let mut timing = Table::new([
            "pods",
            "server",
            "median ms",
            "p90 ms",
            "min ms",
            "max ms",
            "µs/pod",
            "bench cpu ms",
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
                    format!("{:.1}", t.bench_cpu_ms_per_snapshot),
                ]);
            }
        }
        print!("{timing}");
        println!();
        let mut agent = Table::new([
            "pods",
            "agent/floor",
            "min/min",
            "agent cpu ms",
            "agent cores",
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
                format!("{:.1}", a.cpu_ms_per_snapshot),
                format!("{:.2}", a.cores_while_serving),
                mib(a.memory_idle.vm_rss_kib),
                mib(a.memory_after.vm_rss_kib),
                mib(a.memory_after.vm_hwm_kib),
            ]);
        }
        print!("{agent}");
        println!(
            "(cpu ms: per snapshot; bench cpu is this process: the double, plus the floor server on floor rows)"
        );
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
