//! The `control` suite of `ambpf-bench` (a module of that binary; not part of the
//! library).
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

use ambpf_testbed::{bench::sys, cluster};
use serde_json::json;

use super::{
    redirect::{Agent, Mode, OwnRuntime, named_runtime},
    *,
};

/// A hang, not a slow result: the wait for one pod or one socket.
const TIMEOUT: Duration = Duration::from_secs(120);
/// What a wait covering many pods adds per pod on top of [`TIMEOUT`]: iptables
/// mode takes up to ~100 ms of a busy 2-core machine to enrol or remove one,
/// and a snapshot of 1,000 pods waits for all of them at once.
const TIMEOUT_PER_POD: Duration = Duration::from_millis(250);

/// How often the snapshot's scraper asks for `/metrics` (Prometheus asks
/// every 15 to 60 s; this is to time the endpoint through the enrolment).
const SCRAPE_INTERVAL: Duration = Duration::from_millis(100);
/// How long the snapshot scrapes with every pod enrolled, then (eBPF
/// mode) with full original-destination maps: longer than the agent's
/// 15 s between counts of their entries.
const SCRAPE_ENROLLED: Duration = Duration::from_secs(2);
const SCRAPE_FULL_MAPS: Duration = Duration::from_secs(17);

/// The bound on a wait for `pods` pods at once.
fn timeout_for(pods: usize) -> Duration {
    TIMEOUT + TIMEOUT_PER_POD * u32::try_from(pods).unwrap_or(u32::MAX)
}
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
    /// The modes measured, comma-separated: eBPF mode and the agent writing
    /// each of Istio's two backends.
    #[arg(long, value_enum, value_delimiter = ',', default_value = redirect::ALL_COMPARED)]
    modes: Vec<redirect::Compared>,
    /// Measurements per mode (churn and snapshot each).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds the snapshot holds every pod with nothing changing and no
    /// scrapes, measuring the agent's CPU and memory each second (0: none).
    #[arg(long, default_value_t = 0)]
    idle: u64,
}

#[derive(Serialize)]
struct Config {
    churn: usize,
    snapshot: usize,
    modes: Vec<&'static str>,
    runs: usize,
    idle_s: u64,
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
    /// `/metrics` through the enrolment and after.
    scrapes: ScrapeFigures,
    /// The idle phase (with `--idle`).
    idle: Option<Idle>,
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
    scrape: ScrapeSummary,
    /// The agent's CPU share while idle (1.0: one CPU), with `--idle`.
    idle_cpu: Option<Stats>,
    /// The largest RSS seen while idle.
    idle_max_rss_kib: Option<u64>,
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
    let modes = redirect::compared_modes(&args.modes)?;
    let suite = SuiteRun::start("control");
    let agent = std::path::absolute(&args.common.agent)?;
    let work = TempDir::create("ambpf-bench-control")?;
    let cgroup = CgroupGuard::create().context("creating the agent's cgroup")?;
    eprintln!(
        "control: churn {} pods, snapshot {} pods, {} runs of {} (order rotated), a fresh node, pods and API server for every measurement",
        args.churn,
        args.snapshot,
        args.runs,
        modes
            .iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut churns = Vec::new();
    let mut snapshots = Vec::new();
    // The last eBPF snapshot's recorded series (the docs' dashboard figure).
    let mut scrape_series = None;
    for run in 0..args.runs {
        for mode in redirect::rotated(&modes, run) {
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
            let (snapshot, series) = snapshot(&env, &world.pods, mode, run, args.idle)
                .await
                .with_context(|| format!("snapshot run {}, {}", run + 1, mode.name()))?;
            if !series.scrapes.is_empty() {
                scrape_series = Some(
                    json!({ "mode": mode, "run": run, "pods": snapshot.pods, "scrape_interval_ms": ms(SCRAPE_INTERVAL), "record_every_ms": 500, "series": series }),
                );
            }
            eprintln!(
                "control: snapshot {} pods run {} {:<8} programmed {:.0} ms, ztunnel {:.0} ms, annotated {:.0} ms, cpu {:.0} ms, RSS {} KiB (anon {}, file {}), HWM {} KiB",
                snapshot.pods,
                run + 1,
                mode.name(),
                snapshot.programmed_ms,
                snapshot.ztunnel_ms,
                snapshot.annotated_ms,
                snapshot.agent_cpu_ms,
                snapshot.memory.vm_rss_kib,
                snapshot.memory.rss_anon_kib,
                snapshot.memory.rss_file_kib,
                snapshot.memory.vm_hwm_kib,
            );
            print_scrapes(&snapshot);
            print_idle(&snapshot);
            snapshots.push(snapshot);
        }
    }

    let churn_summary = summarize_churn(&churns, &modes);
    let snapshot_summary = summarize_snapshots(&snapshots, &modes, args.runs);
    let ratios = print_tables(&churn_summary, &snapshot_summary, &args);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            churn: args.churn,
            snapshot: args.snapshot,
            modes: modes.iter().map(|m| m.name()).collect(),
            runs: args.runs,
            idle_s: args.idle,
            agent,
            kube_resync_s: KUBE_RESYNC_S,
        },
        json!({
            "churn": churn_summary,
            "snapshot": snapshot_summary,
            "ratios_ebpf_over": ratios,
            "churn_samples": churns,
            "snapshot_samples": snapshots,
            "scrape_series": scrape_series,
        }),
    )?;
    Ok(())
}

mod world;
use world::*;

mod measure;
use measure::*;

mod report;
use report::*;

mod scrape;
use scrape::*;
