//! The `control` suite of `ambpf-bench` (a module of that binary, included
//! with `#[path]`; not part of the library).
//!
//! The control path with the Kubernetes pod source: the real agent
//! (`ambpf run --pod-source kube`) against the testbed's list/watch API
//! server ([`ApiServer`], plain HTTP on the node namespace's 127.0.0.1,
//! reached through a kubeconfig file), in the iptables and the eBPF mode,
//! interleaved; the iptables mode measured in the same run is the baseline.
//!
//! Every pod is a network namespace of a testbed [`Cluster`] with a
//! long-lived `sleep` in it, in a cgroup named as the kubelet's systemd
//! driver names a pod's (`kubepods-besteffort-pod<uid_>.slice`), so the
//! agent's real discovery (a `/proc` scan for the pod UID, then a check that
//! the namespace holds `status.podIP`) finds it. The pod objects carry their
//! IPs from the start (in a real cluster the event that enrols a pod is the
//! status update that gives it an IP, once its sandbox runs).
//!
//! 1. Churn: with the agent running and the (ZDS-only) ztunnel double
//!    connected, pods are created one at a time; from the object applied to
//!    (a) the double receiving the pod's Add (the end-to-end signal: its
//!    redirection is programmed first) and (b) the
//!    `ambient.istio.io/redirection: enabled` patch reaching the API server.
//!    Then deleted one at a time: from the delete to the double's Del.
//! 2. Snapshot: N pods in the API server before the agent starts; from the
//!    agent's spawn to its ZDS socket (the initial set programmed: the agent
//!    serves ztunnel only after that), to the double holding every pod, and to
//!    every pod annotated; the agent's CPU and memory.
//!
//! The source re-evaluates every pod on each event, and otherwise every 5 s
//! (`KubeSourceConfig::new`'s resync, not a flag); the annotator retries on
//! the same period. Events trigger work at once, so the resync bounds none of
//! these numbers unless something failed.
//!
//! Every measurement gets a fresh node, pods and API server (no mode meets a
//! namespace another measurement enrolled), the order of the modes
//! alternates from run to run, and the snapshot's first run is reported
//! apart. Churn latencies are pooled over the runs.

use std::{ffi::OsStr, io::Write as _, net::IpAddr, process::Child};

use ambpf_testbed::{apiserver::ApiServer, bench::sys, cluster};
use serde_json::{Value, json};

use super::{
    redirect::{Agent, Mode, OwnRuntime, named_runtime},
    *,
};

/// A hang, not a slow result.
const TIMEOUT: Duration = Duration::from_secs(120);
const NODE: &str = "bench-node";
/// Pods are spread over this many ambient namespaces.
const NAMESPACES: usize = 8;
/// The kube source's resync period (`KubeSourceConfig::new`; not a flag).
const KUBE_RESYNC_S: f64 = 5.0;
const ANNOTATION: &str = "ambient.istio.io/redirection";

#[derive(Args)]
pub(super) struct ControlArgs {
    #[command(flatten)]
    common: Common,
    /// Pods created, then deleted, one at a time per mode.
    #[arg(long, default_value_t = 50)]
    churn: usize,
    /// Pods in the API server before the agent starts (at most 2559).
    #[arg(long, default_value_t = 125)]
    snapshot: usize,
    /// Measurements per mode (churn and snapshot each).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

#[derive(Serialize)]
struct Config {
    churn: usize,
    snapshot: usize,
    runs: usize,
    agent: PathBuf,
    kube_resync_s: f64,
}

/// One mode's churn: per-pod latencies in ms.
#[derive(Clone, Debug, Serialize)]
struct Churn {
    mode: Mode,
    run: usize,
    /// Applied → the double's Add.
    add_ms: Vec<f64>,
    /// Applied → the annotation patch at the API server.
    annotate_ms: Vec<f64>,
    /// Deleted → the double's Del.
    del_ms: Vec<f64>,
    /// The agent's CPU over the creations and over the deletions.
    create_cpu_ms: f64,
    delete_cpu_ms: f64,
    memory_after: Memory,
    /// `ambpf status --json` listed every pod after the creations (eBPF).
    status_pods: Option<usize>,
}

#[derive(Clone, Debug, Serialize)]
struct Snapshot {
    mode: Mode,
    run: usize,
    pods: usize,
    /// Spawn → the ZDS socket (every pod programmed).
    programmed_ms: f64,
    /// Spawn → the double holds every pod (ready).
    ztunnel_ms: f64,
    /// Spawn → every pod's annotation patch received.
    annotated_ms: f64,
    /// The agent's CPU from spawn to done (all threads, clock ticks).
    agent_cpu_ms: f64,
    memory: Memory,
}

#[derive(Clone, Debug, Serialize)]
struct ChurnSummary {
    mode: Mode,
    add_ms: Stats,
    annotate_ms: Stats,
    del_ms: Stats,
    create_cpu_ms_per_pod: f64,
    delete_cpu_ms_per_pod: f64,
    vm_hwm_kib: u64,
}

#[derive(Clone, Debug, Serialize)]
struct SnapshotSummary {
    mode: Mode,
    /// `steady` or `first` (see [`summarize_snapshots`]).
    runs: &'static str,
    pods: usize,
    programmed_ms: Stats,
    ztunnel_ms: Stats,
    annotated_ms: Stats,
    agent_cpu_ms: Stats,
    vm_rss_kib: u64,
    vm_hwm_kib: u64,
}

pub(super) async fn run(args: ControlArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(
        (1..=cluster::MAX_PODS).contains(&args.churn)
            && (1..=cluster::MAX_PODS).contains(&args.snapshot),
        "--churn and --snapshot: between 1 and {} pods (the testbed cluster's limit)",
        cluster::MAX_PODS
    );
    let suite = SuiteRun::start("control");
    let agent = std::path::absolute(&args.common.agent)?;
    let work = TempDir::create("ambpf-bench-control")?;
    let cgroup = CgroupGuard::create().context("creating the agent's cgroup")?;
    eprintln!(
        "control: churn {} pods, snapshot {} pods, {} runs of each mode (order alternating), a fresh node, pods and API server for every measurement",
        args.churn, args.snapshot, args.runs
    );

    let mut churns = Vec::new();
    let mut snapshots = Vec::new();
    for run in 0..args.runs {
        for mode in bench::alternated([Mode::Iptables, Mode::Ebpf], run) {
            let world = World::create(args.churn).await?;
            let env = world.env(&agent, &work, &cgroup);
            let mut churn = churn(&env, &world.pods, mode, run)
                .await
                .with_context(|| format!("churn run {}, {}", run + 1, mode.name()))?;
            churn.run = run;
            eprintln!(
                "control: churn run {} {:<8} add p50 {:.1} ms, annotate p50 {:.1} ms, del p50 {:.1} ms",
                run + 1,
                mode.name(),
                Stats::of(&churn.add_ms).map_or(f64::NAN, |s| s.median),
                Stats::of(&churn.annotate_ms).map_or(f64::NAN, |s| s.median),
                Stats::of(&churn.del_ms).map_or(f64::NAN, |s| s.median),
            );
            churns.push(churn);
            drop(world);

            let world = World::create(args.snapshot).await?;
            let env = world.env(&agent, &work, &cgroup);
            let snapshot = snapshot(&env, &world.pods, mode, run)
                .await
                .with_context(|| format!("snapshot run {}, {}", run + 1, mode.name()))?;
            eprintln!(
                "control: snapshot {} pods run {} {:<8} programmed {:.0} ms, ztunnel {:.0} ms, annotated {:.0} ms, cpu {:.0} ms, RSS {} KiB, HWM {} KiB",
                snapshot.pods,
                run + 1,
                mode.name(),
                snapshot.programmed_ms,
                snapshot.ztunnel_ms,
                snapshot.annotated_ms,
                snapshot.agent_cpu_ms,
                snapshot.memory.vm_rss_kib,
                snapshot.memory.vm_hwm_kib,
            );
            snapshots.push(snapshot);
        }
    }

    let churn_summary = summarize_churn(&churns);
    let snapshot_summary = summarize_snapshots(&snapshots, args.runs);
    let ratios = print_tables(&churn_summary, &snapshot_summary, &args);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            churn: args.churn,
            snapshot: args.snapshot,
            runs: args.runs,
            agent,
            kube_resync_s: KUBE_RESYNC_S,
        },
        json!({
            "churn": churn_summary,
            "snapshot": snapshot_summary,
            "ratios_ebpf_over_iptables": ratios,
            "churn_samples": churns,
            "snapshot_samples": snapshots,
        }),
    )?;
    Ok(())
}

/// What one measurement runs against, made fresh for each: a node with `n`
/// pods (namespaces, cgroups, processes) and an API server on the node's
/// loopback holding the ambient namespaces.
struct World {
    // Field order is drop order: the pods' processes and the server before
    // the namespaces.
    pods: Vec<BenchPod>,
    server: ApiServer,
    _api_runtime: OwnRuntime,
    kubeconfig: PathBuf,
    _kubeconfig_dir: TempDir,
    _pods_cgroup: CgroupGuard,
    cluster: Cluster,
}

impl World {
    async fn create(n: usize) -> Result<Self> {
        let created = Instant::now();
        let cluster = Cluster::create(n as u16).context("creating the pod namespaces")?;
        let pods_cgroup = CgroupGuard::create().context("creating the pods' cgroup")?;
        let pods: Vec<BenchPod> = cluster
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| BenchPod::start(i, &p.ns.path(), p.ips(), pods_cgroup.path()))
            .collect::<Result<_>>()
            .context("starting the pods' processes")?;
        // The API server listens on the node namespace's loopback, where the
        // agent runs; the bench drives it in-process.
        let (api_runtime, failed) = named_runtime("apiserver", 1, Some(&cluster.node.path()))?;
        let server = api_runtime
            .spawn(ApiServer::start())
            .await?
            .context("starting the API server")?;
        ensure!(
            !failed.load(std::sync::atomic::Ordering::SeqCst),
            "the API server's thread could not enter the node namespace"
        );
        let kubeconfig_dir = TempDir::create("ambpf-bench-kubeconfig")?;
        let kubeconfig = kubeconfig_dir.join("kubeconfig");
        std::fs::write(&kubeconfig, server.kubeconfig())?;
        for i in 0..NAMESPACES {
            server.apply("namespaces", namespace_object(i));
        }
        eprintln!(
            "control: {n} pods (namespace, cgroup, process) and the API server in {:.1} s",
            created.elapsed().as_secs_f64()
        );
        Ok(Self {
            pods,
            server,
            _api_runtime: api_runtime,
            kubeconfig,
            _kubeconfig_dir: kubeconfig_dir,
            _pods_cgroup: pods_cgroup,
            cluster,
        })
    }

    fn env<'a>(&'a self, agent: &'a Path, work: &'a TempDir, cgroup: &'a CgroupGuard) -> Env<'a> {
        Env {
            agent,
            work,
            cgroup,
            cluster: &self.cluster,
            server: &self.server,
            kubeconfig: &self.kubeconfig,
        }
    }
}

struct Env<'a> {
    agent: &'a Path,
    work: &'a TempDir,
    cgroup: &'a CgroupGuard,
    cluster: &'a Cluster,
    server: &'a ApiServer,
    kubeconfig: &'a Path,
}

// ---------------------------------------------------------------------------
// Pods

/// A pod: its object's identity and a `sleep` in its namespace and cgroup.
struct BenchPod {
    uid: String,
    name: String,
    namespace: String,
    ips: [IpAddr; 2],
    child: Child,
    cgroup: PathBuf,
}

impl BenchPod {
    fn start(i: usize, netns: &Path, ips: [IpAddr; 2], parent_cgroup: &Path) -> Result<Self> {
        let uid = format!("c0c0c0c0-0000-4000-8000-{i:012x}");
        let cgroup = parent_cgroup.join(format!(
            "kubepods-besteffort-pod{}.slice",
            uid.replace('-', "_")
        ));
        std::fs::create_dir(&cgroup)?;
        let spawned = (|| {
            let procs = std::fs::OpenOptions::new()
                .write(true)
                .open(cgroup.join("cgroup.procs"))?;
            let ns = File::open(netns)?;
            let mut command = Command::new("sleep");
            command
                .arg("infinity")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            // SAFETY: setns and write are async-signal-safe; `ns` and
            // `procs` outlive the spawn.
            unsafe {
                command.pre_exec(move || {
                    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
                    // "0" moves the writing process (the child) into the cgroup.
                    (&procs).write_all(b"0")
                });
            }
            command.spawn()
        })();
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_dir(&cgroup);
                return Err(e.into());
            }
        };
        Ok(Self {
            uid,
            name: format!("bench-{i:04}"),
            namespace: namespace_name(i % NAMESPACES),
            ips,
            child,
            cgroup,
        })
    }

    fn object(&self) -> Value {
        let [v4, v6] = self.ips;
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "labels": { "app": self.name },
            },
            "spec": {
                "nodeName": NODE,
                "serviceAccountName": "bench-workload",
                "containers": [{ "name": "app" }],
            },
            "status": {
                "phase": "Running",
                "podIP": v4.to_string(),
                "podIPs": [{ "ip": v4.to_string() }, { "ip": v6.to_string() }],
            },
        })
    }
}

impl Drop for BenchPod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The cgroup may take a moment to notice its last process is gone.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!("bench: cannot remove {}", self.cgroup.display());
    }
}

fn namespace_name(i: usize) -> String {
    format!("bench-ambient-{i}")
}

fn namespace_object(i: usize) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace_name(i),
            "labels": { "istio.io/dataplane-mode": "ambient" },
        },
    })
}

/// Whether a recorded patch sets the redirection annotation to `enabled`.
fn enables_redirection(body: &Value) -> bool {
    body["metadata"]["annotations"][ANNOTATION].as_str() == Some("enabled")
}

/// Which pods (by name) have had their annotation enabled, from the
/// server's patches from index `from` on.
fn annotated_since(server: &ApiServer, from: usize) -> Vec<String> {
    server
        .patches()
        .into_iter()
        .skip(from)
        .filter(|p| p.resource == "pods/status" && enables_redirection(&p.body))
        .map(|p| p.name)
        .collect()
}

// ---------------------------------------------------------------------------
// The agent with the kube source

/// The agent with the Kubernetes source, spawned in the node's namespace.
fn spawn_kube_agent(env: &Env<'_>, mode: Mode, socket: &Path, log: &Path) -> Result<Agent> {
    let source = [
        OsStr::new("--pod-source"),
        OsStr::new("kube"),
        OsStr::new("--node-name"),
        OsStr::new(NODE),
        OsStr::new("--kubeconfig"),
        env.kubeconfig.as_os_str(),
    ];
    Agent::spawn(
        env.agent,
        mode,
        &env.cluster.node,
        &source,
        socket,
        env.cgroup.path(),
        log,
    )
}

/// Waits (polling every millisecond, waking early on the double's changes)
/// until `done` holds; a hang after [`TIMEOUT`] is an error.
async fn until(
    what: &str,
    agent: &mut Agent,
    double: Option<&ZtunnelDouble>,
    mut done: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    let mut changes = double.map(ZtunnelDouble::subscribe);
    loop {
        if let Some(changes) = changes.as_mut() {
            changes.borrow_and_update();
        }
        if done() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: not within {TIMEOUT:?}; the end of the agent's log:\n{}",
                agent.process.log_tail(20)
            );
        }
        agent.process.check_running()?;
        if let Some(stopped) = double.and_then(ZtunnelDouble::stopped) {
            bail!("{what}: the ztunnel double stopped: {stopped}");
        }
        match changes.as_mut() {
            Some(changes) => {
                let _ = tokio::time::timeout(Duration::from_millis(1), changes.changed()).await;
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

async fn connect_double(agent: &mut Agent, socket: &Path) -> Result<ZtunnelDouble> {
    until("the ZDS socket", agent, None, || socket_exists(socket)).await?;
    // ZDS only: starting in-pod proxies is ztunnel's cost, the same in both
    // modes, and would hide the agent's.
    let double = ZtunnelDouble::connect_with_retry(socket, ZtunnelConfig::zds_only());
    double
        .wait_until(|s| s.ready, TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("ztunnel not ready: {e:?}"))?;
    Ok(double)
}

fn socket_exists(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

// ---------------------------------------------------------------------------
// Measurements

async fn churn(env: &Env<'_>, pods: &[BenchPod], mode: Mode, run: usize) -> Result<Churn> {
    let socket = env.work.join(format!("churn-{}-{run}.sock", mode.name()));
    let log = env
        .work
        .join(format!("agent-churn-{}-{run}.log", mode.name()));
    let mut agent = spawn_kube_agent(env, mode, &socket, &log)?;
    let double = connect_double(&mut agent, &socket).await?;
    let pid = agent.pid();

    let mut add_ms = Vec::new();
    let mut annotate_ms = Vec::new();
    let cpu_before = bench::on_cpu(pid)?;
    for pod in pods {
        let patches_before = env.server.patches().len();
        let applied = Instant::now();
        env.server.apply("pods", pod.object());
        let (mut added, mut annotated) = (None, None);
        until(
            &format!("{} enrolled", pod.name),
            &mut agent,
            Some(&double),
            || {
                if added.is_none() && double.inspect(|s| s.workloads.contains_key(&pod.uid)) {
                    added = Some(applied.elapsed());
                }
                if annotated.is_none()
                    && annotated_since(env.server, patches_before).contains(&pod.name)
                {
                    annotated = Some(applied.elapsed());
                }
                added.is_some() && annotated.is_some()
            },
        )
        .await?;
        add_ms.extend(added.map(ms));
        annotate_ms.extend(annotated.map(ms));
    }
    let create_cpu = bench::on_cpu(pid)?.saturating_sub(cpu_before);
    let status_pods = match mode {
        Mode::Ebpf => Some(agent.status_pods()?),
        _ => None,
    };
    if let Some(listed) = status_pods {
        ensure!(
            listed == pods.len(),
            "ambpf status lists {listed} pods, not {}",
            pods.len()
        );
    }

    let mut del_ms = Vec::new();
    let cpu_before = bench::on_cpu(pid)?;
    for pod in pods {
        let deleted = Instant::now();
        env.server
            .delete("pods", &pod.namespace, &pod.name)
            .context("the pod was not in the API server")?;
        let mut gone = None;
        until(
            &format!("{} removed", pod.name),
            &mut agent,
            Some(&double),
            || {
                if double.inspect(|s| !s.workloads.contains_key(&pod.uid)) {
                    gone = Some(deleted.elapsed());
                }
                gone.is_some()
            },
        )
        .await?;
        del_ms.extend(gone.map(ms));
    }
    let delete_cpu = bench::on_cpu(pid)?.saturating_sub(cpu_before);
    let memory_after = bench::memory(pid)?;
    double.shutdown().await;
    agent.stop()?;
    Ok(Churn {
        mode,
        run,
        add_ms,
        annotate_ms,
        del_ms,
        create_cpu_ms: ms(create_cpu),
        delete_cpu_ms: ms(delete_cpu),
        memory_after,
        status_pods,
    })
}

async fn snapshot(env: &Env<'_>, pods: &[BenchPod], mode: Mode, run: usize) -> Result<Snapshot> {
    let n = pods.len();
    let patches_before = env.server.patches().len();
    for pod in pods {
        env.server.apply("pods", pod.object());
    }
    let socket = env
        .work
        .join(format!("snapshot-{}-{run}.sock", mode.name()));
    let log = env
        .work
        .join(format!("agent-snapshot-{}-{run}.log", mode.name()));
    let spawned = Instant::now();
    let mut agent = spawn_kube_agent(env, mode, &socket, &log)?;
    let pid = agent.pid();
    until("the ZDS socket", &mut agent, None, || {
        socket_exists(&socket)
    })
    .await?;
    let programmed = spawned.elapsed();
    let double = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only());
    let mut names: std::collections::HashSet<String> = Default::default();
    let (mut at_ztunnel, mut annotated) = (None, None);
    until("every pod", &mut agent, Some(&double), || {
        if at_ztunnel.is_none() && double.inspect(|s| s.ready && s.workloads.len() == n) {
            at_ztunnel = Some(spawned.elapsed());
        }
        if annotated.is_none() {
            names.extend(annotated_since(env.server, patches_before));
            if names.len() == n {
                annotated = Some(spawned.elapsed());
            }
        }
        at_ztunnel.is_some() && annotated.is_some()
    })
    .await?;
    let agent_cpu = bench::cpu_time(pid)?.total();
    let memory = bench::memory(pid)?;
    if mode == Mode::Ebpf {
        let listed = agent.status_pods()?;
        ensure!(listed == n, "ambpf status lists {listed} pods, not {n}");
    }
    // Remove them through the API before stopping (iptables rules stay in
    // the pods' namespaces otherwise).
    for pod in pods {
        env.server.delete("pods", &pod.namespace, &pod.name);
    }
    until("every pod removed", &mut agent, Some(&double), || {
        double.inspect(|s| s.workloads.is_empty())
    })
    .await?;
    double.shutdown().await;
    agent.stop()?;
    Ok(Snapshot {
        mode,
        run,
        pods: n,
        programmed_ms: ms(programmed),
        ztunnel_ms: at_ztunnel.map_or(f64::NAN, ms),
        annotated_ms: annotated.map_or(f64::NAN, ms),
        agent_cpu_ms: ms(agent_cpu),
        memory,
    })
}

// ---------------------------------------------------------------------------
// Results

/// Each mode's churn, pooled over the runs.
fn summarize_churn(churns: &[Churn]) -> Vec<ChurnSummary> {
    [Mode::Iptables, Mode::Ebpf]
        .into_iter()
        .filter_map(|mode| {
            let of: Vec<&Churn> = churns.iter().filter(|c| c.mode == mode).collect();
            let pooled = |f: fn(&Churn) -> &Vec<f64>| -> Vec<f64> {
                of.iter().flat_map(|c| f(c).iter().copied()).collect()
            };
            let pods = pooled(|c| &c.add_ms).len().max(1) as f64;
            Some(ChurnSummary {
                mode,
                add_ms: Stats::of(&pooled(|c| &c.add_ms))?,
                annotate_ms: Stats::of(&pooled(|c| &c.annotate_ms))?,
                del_ms: Stats::of(&pooled(|c| &c.del_ms))?,
                create_cpu_ms_per_pod: of.iter().map(|c| c.create_cpu_ms).sum::<f64>() / pods,
                delete_cpu_ms_per_pod: of.iter().map(|c| c.delete_cpu_ms).sum::<f64>() / pods,
                vm_hwm_kib: of.iter().map(|c| c.memory_after.vm_hwm_kib).max()?,
            })
        })
        .collect()
}

/// Each mode's snapshots: the steady runs (all after the first, or the
/// only one) and, with more than one run, the first apart.
fn summarize_snapshots(snapshots: &[Snapshot], runs: usize) -> Vec<SnapshotSummary> {
    let mut out = Vec::new();
    for (label, in_group) in bench::RUN_GROUPS {
        for mode in [Mode::Iptables, Mode::Ebpf] {
            let of: Vec<&Snapshot> = snapshots
                .iter()
                .filter(|s| s.mode == mode && in_group(s.run, runs))
                .collect();
            let stats =
                |f: fn(&Snapshot) -> f64| Stats::of(&of.iter().map(|s| f(s)).collect::<Vec<_>>());
            let summary = (|| {
                Some(SnapshotSummary {
                    mode,
                    runs: label,
                    pods: of.first()?.pods,
                    programmed_ms: stats(|s| s.programmed_ms)?,
                    ztunnel_ms: stats(|s| s.ztunnel_ms)?,
                    annotated_ms: stats(|s| s.annotated_ms)?,
                    agent_cpu_ms: stats(|s| s.agent_cpu_ms)?,
                    vm_rss_kib: of.iter().map(|s| s.memory.vm_rss_kib).max()?,
                    vm_hwm_kib: of.iter().map(|s| s.memory.vm_hwm_kib).max()?,
                })
            })();
            out.extend(summary);
        }
    }
    out
}

/// ebpf / iptables for each named figure.
fn ratios(
    churn: &[ChurnSummary],
    snapshot: &[SnapshotSummary],
) -> std::collections::BTreeMap<&'static str, f64> {
    let c = |mode: Mode, f: fn(&ChurnSummary) -> f64| churn.iter().find(|s| s.mode == mode).map(f);
    let s = |mode: Mode, f: fn(&SnapshotSummary) -> f64| {
        snapshot
            .iter()
            .find(|s| s.mode == mode && s.runs == "steady")
            .map(f)
    };
    let rc = |f: fn(&ChurnSummary) -> f64| sys::ratio(c(Mode::Ebpf, f), c(Mode::Iptables, f));
    let rs = |f: fn(&SnapshotSummary) -> f64| sys::ratio(s(Mode::Ebpf, f), s(Mode::Iptables, f));
    [
        ("churn_add_p50", rc(|s| s.add_ms.median)),
        ("churn_add_p99", rc(|s| s.add_ms.p99)),
        ("churn_annotate_p50", rc(|s| s.annotate_ms.median)),
        ("churn_annotate_p99", rc(|s| s.annotate_ms.p99)),
        ("churn_del_p50", rc(|s| s.del_ms.median)),
        ("churn_del_p99", rc(|s| s.del_ms.p99)),
        ("churn_create_cpu", rc(|s| s.create_cpu_ms_per_pod)),
        ("churn_delete_cpu", rc(|s| s.delete_cpu_ms_per_pod)),
        ("snapshot_programmed", rs(|s| s.programmed_ms.median)),
        ("snapshot_ztunnel", rs(|s| s.ztunnel_ms.median)),
        ("snapshot_annotated", rs(|s| s.annotated_ms.median)),
        ("snapshot_cpu", rs(|s| s.agent_cpu_ms.median)),
        ("snapshot_hwm", rs(|s| s.vm_hwm_kib as f64)),
    ]
    .into_iter()
    .collect()
}

fn print_tables(
    churn: &[ChurnSummary],
    snapshot: &[SnapshotSummary],
    args: &ControlArgs,
) -> std::collections::BTreeMap<&'static str, f64> {
    let f1 = |v: f64| format!("{v:.1}");
    let mib = |kib: u64| format!("{:.1}", kib as f64 / 1024.0);
    println!();
    println!(
        "Churn: {} pods created, then deleted, one at a time, per run (ms from the API event, pooled over {} runs; kube resync {KUBE_RESYNC_S} s)",
        args.churn, args.runs
    );
    let mut table = Table::new([
        "mode",
        "add p50",
        "add p99",
        "annotated p50",
        "annotated p99",
        "del p50",
        "del p99",
        "cpu ms/pod add",
        "cpu ms/pod del",
        "VmHWM MiB",
    ]);
    for s in churn {
        table.row([
            s.mode.name().to_owned(),
            f1(s.add_ms.median),
            f1(s.add_ms.p99),
            f1(s.annotate_ms.median),
            f1(s.annotate_ms.p99),
            f1(s.del_ms.median),
            f1(s.del_ms.p99),
            format!("{:.2}", s.create_cpu_ms_per_pod),
            format!("{:.2}", s.delete_cpu_ms_per_pod),
            mib(s.vm_hwm_kib),
        ]);
    }
    print!("{table}");
    println!();
    println!(
        "Snapshot: pods in the API server before the agent starts (ms from spawn; `steady`: median of {} run(s){}",
        if args.runs > 1 { args.runs - 1 } else { 1 },
        if args.runs > 1 {
            ", the first run apart)"
        } else {
            ")"
        }
    );
    let mut table = Table::new([
        "runs",
        "mode",
        "pods",
        "programmed",
        "at ztunnel",
        "[min–max]",
        "annotated",
        "agent cpu ms",
        "VmRSS MiB",
        "VmHWM MiB",
    ]);
    for s in snapshot {
        table.row([
            s.runs.to_owned(),
            s.mode.name().to_owned(),
            s.pods.to_string(),
            f1(s.programmed_ms.median),
            f1(s.ztunnel_ms.median),
            format!("{:.0}–{:.0}", s.ztunnel_ms.min, s.ztunnel_ms.max),
            f1(s.annotated_ms.median),
            f1(s.agent_cpu_ms.median),
            mib(s.vm_rss_kib),
            mib(s.vm_hwm_kib),
        ]);
    }
    print!("{table}");
    let ratios = ratios(churn, snapshot);
    println!();
    println!("Ratios ebpf/iptables (lower is better; snapshot figures from the steady runs)");
    let mut table = Table::new(["figure", "ebpf/iptables"]);
    for (name, r) in &ratios {
        let cell = if r.is_nan() {
            "-".to_owned()
        } else {
            format!("{r:.2}x")
        };
        table.row([(*name).to_owned(), cell]);
    }
    print!("{table}");
    ratios
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_enabling_patches_count() {
        assert!(enables_redirection(
            &json!({ "metadata": { "annotations": { ANNOTATION: "enabled" } } })
        ));
        assert!(!enables_redirection(
            &json!({ "metadata": { "annotations": { ANNOTATION: null } } })
        ));
        assert!(!enables_redirection(&json!({ "status": {} })));
    }
}
