//! The `redirect` suite of `ambpf-bench` (a module of that binary, included
//! with `#[path]`; not part of the library).
//!
//! Traffic from an enrolled pod (pod 1 of a testbed [`Cluster`]) to a peer
//! (an echo server in the cluster's `remote` namespace), in three modes
//! measured in the same run and interleaved (direct, iptables, ebpf, repeat):
//!
//! - `direct`: no agent, the pod not enrolled: the floor;
//! - `iptables`: the agent (`ambpf run --redirect-mode iptables`) writes
//!   Istio's in-pod rules; the ztunnel double proxies on 15001;
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
    /// Rounds of the three modes (direct, iptables, ebpf, repeat).
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Mode {
    Direct,
    Iptables,
    Ebpf,
    /// eBPF with a trace reader attached.
    #[serde(rename = "ebpf+trace")]
    EbpfTraced,
}

impl Mode {
    pub(super) fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Iptables => "iptables",
            Mode::Ebpf => "ebpf",
            Mode::EbpfTraced => "ebpf+trace",
        }
    }

    /// The agent's `--redirect-mode`.
    fn agent_mode(self) -> &'static str {
        match self {
            Mode::EbpfTraced => Mode::Ebpf.name(),
            other => other.name(),
        }
    }
}

// ---------------------------------------------------------------------------
// The agent, shared with the `enroll` suite

/// A pods file naming `pods` as (uid, netns path).
pub(super) fn write_pods_file(path: &Path, pods: &[(String, PathBuf)]) -> Result<()> {
    let pods: Vec<serde_json::Value> = pods
        .iter()
        .enumerate()
        .map(|(i, (uid, netns))| {
            serde_json::json!({
                "uid": uid,
                "name": format!("bench-{i:05}-7d4b9c8f6-x2k4p"),
                "namespace": "ambpf-bench",
                "serviceAccount": "bench-workload",
                "netns": netns,
            })
        })
        .collect();
    bench::write_json(path, &serde_json::json!({ "pods": pods }))
        .with_context(|| format!("writing {}", path.display()))
}

/// The agent in `mode` (iptables or ebpf) in the node's namespace, with a
/// private pin root, its socket programs on `cgroup`.
pub(super) struct Agent {
    pub(super) process: ProcessGuard,
    binary: PathBuf,
    pin_root: PathBuf,
    // Dropped after the process (field order): unmounted once it is gone.
    _bpffs: BpffsMount,
}

impl Agent {
    /// Starts the agent with a pods file and waits for its ZDS socket.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start(
        binary: &Path,
        mode: Mode,
        node: &NetnsGuard,
        pods_file: &Path,
        socket: &Path,
        cgroup: &CgroupGuard,
        log: &Path,
    ) -> Result<Self> {
        let source = [std::ffi::OsStr::new("--pods-file"), pods_file.as_os_str()];
        let mut agent = Self::spawn(binary, mode, node, &source, socket, cgroup.path(), log)?;
        wait_for_socket(&mut agent.process, socket, SOCKET_TIMEOUT).await?;
        Ok(agent)
    }

    /// Spawns `ambpf run` in the node's namespace with the pod-source
    /// arguments `source`, on a private bpffs; returns at once.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn(
        binary: &Path,
        mode: Mode,
        node: &NetnsGuard,
        source: &[&std::ffi::OsStr],
        socket: &Path,
        cgroup: &Path,
        log: &Path,
    ) -> Result<Self> {
        let bpffs = BpffsMount::create()?;
        let pin_root = bpffs.path().join("ambpf");
        let mut command = Command::new(binary);
        command
            .arg("--pin-root")
            .arg(&pin_root)
            .arg("run")
            .arg("--redirect-mode")
            .arg(mode.agent_mode())
            .args(source)
            .arg("--zds-socket")
            .arg(socket)
            .arg("--cgroup")
            .arg(cgroup)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        let node_ns = File::open(node.path())?;
        // SAFETY: setns is async-signal-safe, and `node_ns` outlives the spawn.
        unsafe {
            command.pre_exec(move || {
                nix::sched::setns(node_ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
        let process = ProcessGuard::spawn("the agent", command, log)?;
        Ok(Self {
            process,
            binary: binary.to_owned(),
            pin_root,
            _bpffs: bpffs,
        })
    }

    pub(super) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Attaches `ambpf trace --json` to the agent's pins, its records
    /// written to `log`; returns once it reads.
    async fn attach_trace_reader(&self, log: &Path) -> Result<ProcessGuard> {
        let mut command = Command::new(&self.binary);
        command
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["trace", "--json"]);
        let mut reader = ProcessGuard::spawn("the trace reader", command, log)?;
        let deadline = std::time::Instant::now() + READY_TIMEOUT;
        while !std::fs::read_to_string(log)?.contains("reading redirect decisions") {
            reader.check_running()?;
            ensure!(
                std::time::Instant::now() < deadline,
                "the trace reader never attached"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(reader)
    }

    /// Pods in `ambpf status --json` (eBPF mode).
    pub(super) fn status_pods(&self) -> Result<usize> {
        let out = Command::new(&self.binary)
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["status", "--json"])
            .output()?;
        ensure!(
            out.status.success(),
            "ambpf status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        status["pods"]
            .as_array()
            .map(Vec::len)
            .context("no `pods` array in `ambpf status --json`")
    }

    /// Stops the agent and removes its pins (detaching its programs). Only
    /// the eBPF mode's state: a full uninstall would sweep every namespace
    /// of the machine for iptables rules, and the bench's own go with its
    /// namespaces.
    pub(super) fn stop(mut self) -> Result<()> {
        self.process.stop()?;
        let out = Command::new(&self.binary)
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["uninstall", "--redirect-mode", "ebpf", "--keep-cni"])
            .output()?;
        ensure!(
            out.status.success(),
            "ambpf uninstall: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

/// A runtime that shuts down in the background when dropped (dropping a
/// plain one inside async code panics, e.g. on an error path).
pub(super) struct OwnRuntime(Option<Runtime>);

impl std::ops::Deref for OwnRuntime {
    type Target = Runtime;

    fn deref(&self) -> &Runtime {
        self.0.as_ref().expect("the runtime lives until dropped")
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// A multi-threaded runtime whose threads are named `name` and, with
/// `netns`, enter that network namespace as they start (so sockets they
/// create are that namespace's).
pub(super) fn named_runtime(
    name: &str,
    workers: usize,
    netns: Option<&Path>,
) -> Result<(OwnRuntime, Arc<AtomicBool>)> {
    let failed = Arc::new(AtomicBool::new(false));
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .worker_threads(workers)
        .thread_name(name)
        .enable_all();
    if let Some(netns) = netns {
        let netns = Arc::new(File::open(netns)?);
        let flag = failed.clone();
        builder.on_thread_start(move || {
            if nix::sched::setns(netns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                flag.store(true, Ordering::SeqCst);
            }
        });
    }
    Ok((OwnRuntime(Some(builder.build()?)), failed))
}

// ---------------------------------------------------------------------------
// CPU accounting

/// CPU in use over one test, in cores (1.0: one CPU busy the whole time).
#[derive(Clone, Debug, Serialize)]
struct CpuSample {
    wall_s: f64,
    loadgen: f64,
    ztunnel: f64,
    echo: f64,
    /// The agent process (not running in direct mode).
    agent: Option<f64>,
    /// This process's other threads (the bench's own runtime).
    bench_other: f64,
    /// The whole machine (`/proc/stat`: user, system, irq, softirq).
    machine_busy: f64,
    /// The machine's irq + softirq (mostly the network stack's receive
    /// side); it may also be counted in the threads above.
    machine_softirq: f64,
    machine_steal: f64,
}

impl CpuSample {
    /// The busiest of the measured processes.
    fn busiest(&self) -> (&'static str, f64) {
        let mut candidates = vec![
            ("loadgen", self.loadgen),
            ("ztunnel", self.ztunnel),
            ("echo", self.echo),
        ];
        if let Some(agent) = self.agent {
            candidates.push(("agent", agent));
        }
        candidates
            .into_iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or(("-", 0.0))
    }
}

struct Probe {
    at: Instant,
    threads: ThreadGroups,
    agent: Option<Duration>,
    machine: MachineCpu,
}

impl Probe {
    fn take(agent: Option<u32>) -> Result<Self> {
        Ok(Self {
            at: Instant::now(),
            threads: sys::thread_groups_on_cpu(std::process::id(), &GROUPS)?,
            agent: agent.map(bench::on_cpu).transpose()?,
            machine: MachineCpu::read()?,
        })
    }

    fn since(&self, earlier: &Probe) -> CpuSample {
        let wall = self.at.duration_since(earlier.at).as_secs_f64().max(1e-9);
        let cores = |d: Duration| d.as_secs_f64() / wall;
        let threads = self.threads.since(&earlier.threads);
        let machine = self.machine.since(&earlier.machine);
        CpuSample {
            wall_s: wall,
            loadgen: cores(threads.groups[0]),
            ztunnel: cores(threads.groups[1]),
            echo: cores(threads.groups[2]),
            agent: match (self.agent, earlier.agent) {
                (Some(now), Some(then)) => Some(cores(now.saturating_sub(then))),
                _ => None,
            },
            bench_other: cores(threads.other),
            machine_busy: cores(machine.busy),
            machine_softirq: cores(machine.irq),
            machine_steal: cores(machine.steal),
        }
    }
}

// ---------------------------------------------------------------------------
// Echo server and load generator

/// The echo server: one task per connection echoing into one buffer.
fn start_echo(remote: &NetnsGuard, addr: SocketAddr) -> Result<OwnRuntime> {
    let (runtime, failed) = named_runtime("echo-rt", 2, Some(&remote.path()))?;
    ensure!(!failed.load(Ordering::SeqCst), "echo threads: setns failed");
    let listener = remote.run(|| ambpf_testbed::storm::listen(addr))??;
    runtime.spawn(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
            eprintln!("redirect: echo server: cannot register the listener");
            return;
        };
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            let _ = conn.set_nodelay(true);
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if conn.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    Ok(runtime)
}

/// One new connection: connect, one request and its echo, close.
async fn one_connection(target: SocketAddr) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(target).await?;
    stream.set_nodelay(true)?;
    let request = [0x5au8; MESSAGE];
    let mut reply = [0u8; MESSAGE];
    stream.write_all(&request).await?;
    stream.read_exact(&mut reply).await?;
    Ok(())
}

#[derive(Clone, Debug, Serialize)]
struct RateSample {
    connections: u64,
    errors: u64,
    per_second: f64,
    /// Connections the ztunnel double recorded over the whole test (warm-up
    /// included): 0 in direct mode, all of them otherwise.
    proxied: usize,
    proxy_failures: usize,
    cpu: CpuSample,
}

#[derive(Clone, Debug, Serialize)]
struct LatencySample {
    requests: u64,
    per_second: f64,
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
    max_us: f64,
    proxied: usize,
    cpu: CpuSample,
}

const WARMUP: u8 = 0;
const RECORD: u8 = 1;
const STOP: u8 = 2;

struct LoadGen {
    runtime: OwnRuntime,
}

impl LoadGen {
    fn new(pod: &NetnsGuard, threads: usize) -> Result<Self> {
        let (runtime, failed) = named_runtime("loadgen-rt", threads, Some(&pod.path()))?;
        ensure!(
            !failed.load(Ordering::SeqCst),
            "load generator threads: setns failed"
        );
        Ok(Self { runtime })
    }

    /// `count` connections one after another.
    async fn sequential(&self, target: SocketAddr, count: u64) -> Result<()> {
        self.runtime
            .spawn(async move {
                for _ in 0..count {
                    tokio::time::timeout(IO_TIMEOUT, one_connection(target)).await??;
                }
                Ok::<_, anyhow::Error>(())
            })
            .await?
    }

    async fn rate(
        &self,
        target: SocketAddr,
        clients: usize,
        warmup: Duration,
        duration: Duration,
        agent: Option<u32>,
    ) -> Result<(u64, u64, f64, CpuSample)> {
        let done = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let (done, errors, stop) = (done.clone(), errors.clone(), stop.clone());
                self.runtime.spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match tokio::time::timeout(IO_TIMEOUT, one_connection(target)).await {
                            Ok(Ok(())) => {
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(warmup).await;
        let (first, before) = (done.load(Ordering::Relaxed), Probe::take(agent)?);
        let errors_before = errors.load(Ordering::Relaxed);
        tokio::time::sleep(duration).await;
        let (last, after) = (done.load(Ordering::Relaxed), Probe::take(agent)?);
        let errors_during = errors.load(Ordering::Relaxed) - errors_before;
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await?;
        }
        let cpu = after.since(&before);
        let connections = last - first;
        Ok((
            connections,
            errors_during,
            connections as f64 / cpu.wall_s,
            cpu,
        ))
    }

    async fn latency(
        &self,
        target: SocketAddr,
        clients: usize,
        warmup: Duration,
        duration: Duration,
        agent: Option<u32>,
    ) -> Result<(Histogram, CpuSample)> {
        let phase = Arc::new(AtomicU8::new(WARMUP));
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let phase = phase.clone();
                self.runtime.spawn(async move {
                    let mut histogram = Histogram::new();
                    let mut stream =
                        tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(target)).await??;
                    stream.set_nodelay(true)?;
                    let request = [0x5au8; MESSAGE];
                    let mut reply = [0u8; MESSAGE];
                    loop {
                        let now = phase.load(Ordering::Relaxed);
                        if now == STOP {
                            return Ok::<_, anyhow::Error>(histogram);
                        }
                        let started = Instant::now();
                        tokio::time::timeout(IO_TIMEOUT, async {
                            stream.write_all(&request).await?;
                            stream.read_exact(&mut reply).await
                        })
                        .await??;
                        if now == RECORD {
                            histogram.record(started.elapsed());
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(warmup).await;
        phase.store(RECORD, Ordering::Relaxed);
        let before = Probe::take(agent)?;
        tokio::time::sleep(duration).await;
        let after = Probe::take(agent)?;
        phase.store(STOP, Ordering::Relaxed);
        let mut merged = Histogram::new();
        for task in tasks {
            merged.merge(&task.await??);
        }
        Ok((merged, after.since(&before)))
    }
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
    let mut modes = vec![Mode::Direct, Mode::Iptables, Mode::Ebpf];
    if args.trace_reader {
        modes.push(Mode::EbpfTraced);
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
        for &mode in &modes {
            let result = measure_mode(&args, &agent, &work, &cgroup, mode, run)
                .await
                .with_context(|| format!("run {} mode {}", run + 1, mode.name()))?;
            runs.push(result);
        }
    }
    let summary = summarize(&runs, &args.clients, &modes);
    print_tables(&summary, &runs, &args);

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
        serde_json::json!({ "summary": summary, "runs": runs }),
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
        write_pods_file(&pods_file, &[(POD_UID.to_owned(), pod.ns.path())])?;
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
        double
            .wait_until(
                |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
                READY_TIMEOUT,
            )
            .await
            .map_err(|e| anyhow::anyhow!("ztunnel never got the pod: {e:?}"))?;
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
    if mode != Mode::Direct {
        ensure!(
            proxied as u64 >= args.conntrack_connections,
            "only {proxied} of {} connections went through ztunnel",
            args.conntrack_connections
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

// ---------------------------------------------------------------------------
// Summary

#[derive(Clone, Debug, Serialize)]
struct ModeSummary {
    clients: usize,
    mode: Mode,
    conn_per_s: Stats,
    rate_errors: u64,
    p50_us: Stats,
    p99_us: Stats,
    req_per_s: Stats,
    /// Medians over the runs, in cores.
    rate_cpu: CoresSummary,
    latency_cpu: CoresSummary,
}

#[derive(Clone, Debug, Serialize)]
struct CoresSummary {
    loadgen: f64,
    ztunnel: f64,
    echo: f64,
    agent: Option<f64>,
    machine_busy: f64,
    machine_softirq: f64,
    busiest: &'static str,
}

impl CoresSummary {
    fn of(samples: &[&CpuSample]) -> Self {
        let med = |f: &dyn Fn(&CpuSample) -> f64| {
            Stats::of(&samples.iter().map(|s| f(s)).collect::<Vec<_>>())
                .map_or(f64::NAN, |s| s.median)
        };
        let agent = samples
            .iter()
            .map(|s| s.agent)
            .collect::<Option<Vec<_>>>()
            .and_then(|a| Stats::of(&a))
            .map(|s| s.median);
        let sample = CpuSample {
            wall_s: 0.0,
            loadgen: med(&|s| s.loadgen),
            ztunnel: med(&|s| s.ztunnel),
            echo: med(&|s| s.echo),
            agent,
            bench_other: med(&|s| s.bench_other),
            machine_busy: med(&|s| s.machine_busy),
            machine_softirq: med(&|s| s.machine_softirq),
            machine_steal: med(&|s| s.machine_steal),
        };
        Self {
            loadgen: sample.loadgen,
            ztunnel: sample.ztunnel,
            echo: sample.echo,
            agent,
            machine_busy: sample.machine_busy,
            machine_softirq: sample.machine_softirq,
            busiest: sample.busiest().0,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
struct Ratios {
    clients: usize,
    conn_rate_ebpf_over_iptables: f64,
    conn_rate_ebpf_over_direct: f64,
    p50_ebpf_over_iptables: f64,
    p50_ebpf_over_direct: f64,
    p99_ebpf_over_iptables: f64,
    p99_ebpf_over_direct: f64,
    /// With a trace reader attached against without (NaN: not measured).
    conn_rate_traced_over_ebpf: f64,
    p50_traced_over_ebpf: f64,
    p99_traced_over_ebpf: f64,
}

#[derive(Clone, Debug, Serialize)]
struct ConntrackSummary {
    mode: Mode,
    pod_per_connection: Option<f64>,
    node_per_connection: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
struct Summary {
    modes: Vec<ModeSummary>,
    ratios: Vec<Ratios>,
    conntrack: Vec<ConntrackSummary>,
}

fn summarize(runs: &[ModeRun], clients: &[usize], measured: &[Mode]) -> Summary {
    let mut modes = Vec::new();
    let mut ratios = Vec::new();
    for &c in clients {
        let mut medians = std::collections::HashMap::new();
        for &mode in measured {
            let points: Vec<&Point> = runs
                .iter()
                .filter(|r| r.mode == mode)
                .flat_map(|r| r.points.iter().filter(|p| p.clients == c))
                .collect();
            let stats = |f: &dyn Fn(&Point) -> f64| {
                Stats::of(&points.iter().map(|p| f(p)).collect::<Vec<_>>())
            };
            let (Some(conn), Some(p50), Some(p99), Some(req)) = (
                stats(&|p| p.rate.per_second),
                stats(&|p| p.latency.p50_us),
                stats(&|p| p.latency.p99_us),
                stats(&|p| p.latency.per_second),
            ) else {
                continue;
            };
            medians.insert(mode.name(), (conn.median, p50.median, p99.median));
            modes.push(ModeSummary {
                clients: c,
                mode,
                conn_per_s: conn,
                rate_errors: points.iter().map(|p| p.rate.errors).sum(),
                p50_us: p50,
                p99_us: p99,
                req_per_s: req,
                rate_cpu: CoresSummary::of(&points.iter().map(|p| &p.rate.cpu).collect::<Vec<_>>()),
                latency_cpu: CoresSummary::of(
                    &points.iter().map(|p| &p.latency.cpu).collect::<Vec<_>>(),
                ),
            });
        }
        let get = |m: &str, i: usize| {
            medians.get(m).map(|t: &(f64, f64, f64)| match i {
                0 => t.0,
                1 => t.1,
                _ => t.2,
            })
        };
        ratios.push(Ratios {
            clients: c,
            conn_rate_ebpf_over_iptables: sys::ratio(get("ebpf", 0), get("iptables", 0)),
            conn_rate_ebpf_over_direct: sys::ratio(get("ebpf", 0), get("direct", 0)),
            p50_ebpf_over_iptables: sys::ratio(get("ebpf", 1), get("iptables", 1)),
            p50_ebpf_over_direct: sys::ratio(get("ebpf", 1), get("direct", 1)),
            p99_ebpf_over_iptables: sys::ratio(get("ebpf", 2), get("iptables", 2)),
            p99_ebpf_over_direct: sys::ratio(get("ebpf", 2), get("direct", 2)),
            conn_rate_traced_over_ebpf: sys::ratio(get("ebpf+trace", 0), get("ebpf", 0)),
            p50_traced_over_ebpf: sys::ratio(get("ebpf+trace", 1), get("ebpf", 1)),
            p99_traced_over_ebpf: sys::ratio(get("ebpf+trace", 2), get("ebpf", 2)),
        });
    }
    let conntrack = measured
        .iter()
        .map(|&mode| {
            let median = |f: &dyn Fn(&Conntrack) -> Option<f64>| {
                runs.iter()
                    .filter(|r| r.mode == mode)
                    .map(|r| f(&r.conntrack))
                    .collect::<Option<Vec<_>>>()
                    .and_then(|v| Stats::of(&v))
                    .map(|s| s.median)
            };
            ConntrackSummary {
                mode,
                pod_per_connection: median(&|c| c.pod_per_connection),
                node_per_connection: median(&|c| c.node_per_connection),
            }
        })
        .collect();
    Summary {
        modes,
        ratios,
        conntrack,
    }
}

fn print_tables(summary: &Summary, runs: &[ModeRun], args: &RedirectArgs) {
    let f0 = |v: f64| format!("{v:.0}");
    let f1 = |v: f64| format!("{v:.1}");
    let f2 = |v: f64| format!("{v:.2}");
    let x = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.2}x")
        }
    };
    println!();
    println!(
        "New connections per second (each: connect, {MESSAGE} B request/echo, close), median of {} runs of {} s; CPU in cores (medians)",
        args.runs, args.duration_secs
    );
    let mut table = Table::new([
        "clients", "mode", "conn/s", "min", "max", "errors", "loadgen", "ztunnel", "echo", "agent",
        "softirq", "machine", "busiest",
    ]);
    for m in &summary.modes {
        let cpu = &m.rate_cpu;
        table.row([
            m.clients.to_string(),
            m.mode.name().to_owned(),
            f0(m.conn_per_s.median),
            f0(m.conn_per_s.min),
            f0(m.conn_per_s.max),
            m.rate_errors.to_string(),
            f2(cpu.loadgen),
            f2(cpu.ztunnel),
            f2(cpu.echo),
            cpu.agent.map_or("-".to_owned(), f2),
            f2(cpu.machine_softirq),
            f2(cpu.machine_busy),
            cpu.busiest.to_owned(),
        ]);
    }
    print!("{table}");
    println!();
    println!(
        "Request latency on kept-alive connections ({MESSAGE} B ping-pong per client), µs, median of {} runs",
        args.runs
    );
    let mut table = Table::new([
        "clients", "mode", "p50", "p99", "p99 max", "req/s", "loadgen", "ztunnel", "echo",
        "softirq", "machine", "busiest",
    ]);
    for m in &summary.modes {
        let cpu = &m.latency_cpu;
        table.row([
            m.clients.to_string(),
            m.mode.name().to_owned(),
            f1(m.p50_us.median),
            f1(m.p99_us.median),
            f1(m.p99_us.max),
            f0(m.req_per_s.median),
            f2(cpu.loadgen),
            f2(cpu.ztunnel),
            f2(cpu.echo),
            f2(cpu.machine_softirq),
            f2(cpu.machine_busy),
            cpu.busiest.to_owned(),
        ]);
    }
    print!("{table}");
    println!();
    println!("Ratios of medians (conn/s: higher is better; latency: lower is better)");
    let mut table = Table::new([
        "clients",
        "conn/s ebpf/iptables",
        "conn/s ebpf/direct",
        "p50 ebpf/iptables",
        "p50 ebpf/direct",
        "p99 ebpf/iptables",
        "p99 ebpf/direct",
    ]);
    for r in &summary.ratios {
        table.row([
            r.clients.to_string(),
            x(r.conn_rate_ebpf_over_iptables),
            x(r.conn_rate_ebpf_over_direct),
            x(r.p50_ebpf_over_iptables),
            x(r.p50_ebpf_over_direct),
            x(r.p99_ebpf_over_iptables),
            x(r.p99_ebpf_over_direct),
        ]);
    }
    print!("{table}");
    if args.trace_reader {
        println!();
        println!("Cost of a trace reader: ebpf+trace / ebpf, ratios of medians");
        let mut table = Table::new(["clients", "conn/s", "p50", "p99"]);
        for r in &summary.ratios {
            table.row([
                r.clients.to_string(),
                x(r.conn_rate_traced_over_ebpf),
                x(r.p50_traced_over_ebpf),
                x(r.p99_traced_over_ebpf),
            ]);
        }
        print!("{table}");
    }
    println!();
    println!(
        "conntrack entries created per connection ({} sequential connections; nf_conntrack_count in the pod's and the node's namespace)",
        args.conntrack_connections
    );
    let mut table = Table::new(["mode", "pod", "node", "runs (pod/node after)"]);
    for c in &summary.conntrack {
        let after: Vec<String> = runs
            .iter()
            .filter(|r| r.mode == c.mode)
            .map(|r| {
                let n = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
                format!("{}/{}", n(r.conntrack.pod_after), n(r.conntrack.node_after))
            })
            .collect();
        table.row([
            c.mode.name().to_owned(),
            c.pod_per_connection.map_or("-".to_owned(), f2),
            c.node_per_connection.map_or("-".to_owned(), f2),
            after.join(" "),
        ]);
    }
    print!("{table}");
}
