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
//! per-pod open and no state. Agent and floor runs alternate, each going
//! first every other run, so drift
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

mod floor;
use floor::Floor;

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
        let server_cpu: Option<Vec<f64>> = samples.iter().map(|s| s.server_cpu.map(ms)).collect();
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
        let agent_run = async |agent: &mut ProcessGuard| -> Result<Sample> {
            let (server_before, double_before) = (bench::on_cpu(pid)?, bench::on_cpu(bench_pid)?);
            let wall = snapshot(&socket, n)
                .await
                .with_context(|| format!("agent run {}", i + 1))
                .map_err(|e| with_log(e, agent))?;
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
            .map_err(|e| with_log(e, agent))?;
            Ok(Sample {
                wall,
                server_cpu: Some(bench::on_cpu(pid)?.saturating_sub(server_before)),
                double_cpu,
            })
        };
        // Floor: the same, its end being the floor seeing the close.
        let floor_run = async |served: u64| -> Result<Sample> {
            let (server_before, double_before) = (floor.on_cpu()?, bench::on_cpu(bench_pid)?);
            let wall = snapshot(&floor_socket, n)
                .await
                .with_context(|| format!("floor run {}", i + 1))?;
            let bench_cpu = bench::on_cpu(bench_pid)?.saturating_sub(double_before);
            floor.wait_served(served).await?;
            let server_cpu = match (floor.on_cpu()?, server_before) {
                (Some(after), Some(before)) => Some(after.saturating_sub(before)),
                _ => None,
            };
            Ok(Sample {
                wall,
                server_cpu,
                // The floor thread is part of this process.
                double_cpu: bench_cpu.saturating_sub(server_cpu.unwrap_or_default()),
            })
        };
        // Agent and floor alternate going first, so neither always meets
        // the state the other left.
        let served = i as u64 + 1;
        let (agent_sample, floor_sample) = if i % 2 == 0 {
            let agent_sample = agent_run(&mut agent).await?;
            (agent_sample, floor_run(served).await?)
        } else {
            let floor_sample = floor_run(served).await?;
            (agent_run(&mut agent).await?, floor_sample)
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
        let uids: std::collections::HashSet<&str> = pods.iter().map(|p| p.uid.as_str()).collect();
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
