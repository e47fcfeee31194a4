//! The soak: the real agent (`ambpf run --pod-source kube --cni-socket`)
//! against the test API server, the ztunnel double and real pod namespaces,
//! under random pod events and faults for a set time, with invariants
//! checked throughout (`cargo xtask soak`, `ambpf-soak`).
//!
//! - Events (`events.rs`): pods created (through the API server alone, or
//!   CNI ADD through the real `ambpf-cni` first), deleted (the object first,
//!   or the namespace vanishing before the delete event), relabelled (pod:
//!   opt-out, opt-in and back; namespace: ambient and back), containers
//!   restarted (same namespace, process replaced).
//! - Faults (`faults.rs`), at random moments: the agent SIGKILLed and
//!   restarted (at any time, right after pods were created, and in the
//!   middle of its ZDS snapshot), the ztunnel double restarting twice in a
//!   row and being taken over by a new one, and API server outages ending in
//!   410 (compacted versions: the agent must list again).
//! - Invariants (`checks.rs`, `invariants.rs`): every ambient pod with a
//!   live namespace is redirected and held by ztunnel within the bound
//!   (convergence p50/p99/max); nothing (map entry, pinned link, steering
//!   filter, rule, route, annotation, netns fd) outlives its pod, and nothing
//!   is installed in a pod that is not ambient or in the node's namespace;
//!   long-lived connections of live pods (outbound and inbound, opened
//!   before each fault) still echo after it; the agent's fds, threads and
//!   RSS stay flat (their slope over the run).
//!
//! Every choice comes from one seeded generator (`--seed` replays the
//! choices). The summary is printed as a table and written as JSON like the
//! benchmarks' (`report.rs`).

mod agent;
mod checks;
mod conns;
mod events;
mod faults;
mod invariants;
mod netstate;
mod report;
mod rng;
mod world;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

pub use report::SoakReport;

use crate::{
    CgroupGuard,
    bench::TempDir,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};

/// How the agent redirects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Ebpf,
    Iptables,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SoakConfig {
    /// The `ambpf` binary.
    pub agent: PathBuf,
    /// The `ambpf-cni` binary.
    pub cni_plugin: PathBuf,
    /// The ztunnel double's proxy process (`ztunnel-proxies`): the proxies
    /// run apart from this process, as ztunnel's do, so that a thousand
    /// pods, their connections and two ztunnels during a takeover each
    /// have their own descriptor limit.
    pub ztunnel_proxies: PathBuf,
    #[serde(serialize_with = "as_secs")]
    pub duration: Duration,
    /// Pod slots (pods at once, at most).
    pub pods: usize,
    pub seed: u64,
    pub mode: Mode,
    /// An ambient pod must be held by ztunnel this soon after its event.
    #[serde(serialize_with = "as_secs")]
    pub convergence_bound: Duration,
    /// Mean time between faults.
    #[serde(serialize_with = "as_secs")]
    pub fault_interval: Duration,
}

impl SoakConfig {
    /// How every ztunnel double of the soak runs.
    fn ztunnel(&self) -> ZtunnelConfig {
        ZtunnelConfig::default().proxy_process(&self.ztunnel_proxies)
    }
}

fn as_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// `90`, `90s`, `2m`, `1h`, `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}`: not a duration (e.g. 90s, 2m, 1h)"))?;
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("`{text}`: unknown unit `{other}` (ms, s, m, h)")),
    };
    Ok(Duration::from_secs_f64(value * scale))
}

/// Counts by name, for the summary.
pub type Counts = BTreeMap<&'static str, u64>;

pub(crate) struct Soak<'a> {
    cfg: &'a SoakConfig,
    start: Instant,
    rng: rng::Rng,
    world: world::World,
    agent: agent::Agent,
    /// The ztunnel that serves now, shared with the observer task.
    double: Arc<Mutex<Arc<ZtunnelDouble>>>,
    /// Which double is current (connections record the one they went through).
    double_generation: u64,
    tracker: Arc<Mutex<invariants::Tracker>>,
    leaks: invariants::Leaks,
    events: Counts,
    faults: Counts,
    checks: Counts,
    samples: Arc<Mutex<Vec<agent::Sample>>>,
    api_down: bool,
    /// Pods whose namespace vanished, to delete at the given time.
    ghost_deletes: Vec<(usize, Instant)>,
    conn_round: u64,
    conn_stats: report::ConnStats,
    mid_snapshot_hits: u64,
}

/// Runs the soak. Needs root and a multi-threaded tokio runtime.
pub async fn run(cfg: &SoakConfig) -> Result<SoakReport> {
    if !nix::unistd::geteuid().is_root() {
        bail!("run as root: the soak creates network namespaces and the agent loads BPF programs");
    }
    for (what, path) in [
        ("agent", &cfg.agent),
        ("CNI plugin", &cfg.cni_plugin),
        ("ztunnel-proxies", &cfg.ztunnel_proxies),
    ] {
        if !path.is_file() {
            bail!("no {what} binary at {}", path.display());
        }
    }
    if !(2..=crate::cluster::MAX_PODS).contains(&cfg.pods) {
        bail!(
            "--pods: between 2 and {} (the testbed cluster's limit)",
            crate::cluster::MAX_PODS
        );
    }
    crate::bench::raise_fd_limit().context("raising the open-file limit")?;
    eprintln!(
        "soak: seed {} ({} pods, {:?}, {} mode; replay with --seed {})",
        cfg.seed,
        cfg.pods,
        cfg.duration,
        cfg.mode.name(),
        cfg.seed
    );
    let dir = TempDir::create("ambpf-soak")?;
    // The agent's socket programs see the sockets of processes in this
    // cgroup: this process (its pod-side sockets) and the agent.
    let cgroup = CgroupGuard::create().context("creating the agent's cgroup")?;
    let _inside = cgroup.enter_process()?;
    let world = world::World::create(cfg.pods, dir.path()).await?;
    let mut agent = agent::Agent::new(
        &cfg.agent,
        cfg.mode,
        &world.cluster.node,
        &world.kubeconfig,
        &cgroup,
        dir.path(),
    )?;
    agent.start()?;
    let double = ZtunnelDouble::connect_with_retry(&agent.zds_socket, cfg.ztunnel());
    let start = Instant::now();
    let tracker = Arc::new(Mutex::new(invariants::Tracker::new(
        start,
        cfg.convergence_bound,
    )));
    let double = Arc::new(Mutex::new(Arc::new(double)));
    let observer = observe(double.clone(), tracker.clone());
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = sample_every_second(agent.pid_cell(), start, samples.clone());
    let mut soak = Soak {
        cfg,
        start,
        rng: rng::Rng::new(cfg.seed),
        world,
        agent,
        double,
        double_generation: 1,
        tracker,
        leaks: invariants::Leaks::default(),
        events: Counts::new(),
        faults: Counts::new(),
        checks: Counts::new(),
        samples: samples.clone(),
        api_down: false,
        ghost_deletes: Vec::new(),
        conn_round: 0,
        conn_stats: report::ConnStats::default(),
        mid_snapshot_hits: 0,
    };
    let outcome = soak.drive().await;
    drop((observer, sampler));
    let mut report = soak.report();
    if outcome.is_err() || !report.passed() {
        // The agent's log outlives the run's directory.
        let kept = std::env::temp_dir().join(format!("ambpf-soak-agent-{}.log", cfg.seed));
        if std::fs::copy(soak.agent.log(), &kept).is_ok() {
            eprintln!("soak: the agent's log is kept at {}", kept.display());
            report.agent_log = Some(kept);
        }
    }
    outcome?;
    soak.agent.stop()?;
    Ok(report)
}

/// Every 10 ms, the current double's pods against the expectations.
fn observe(
    double: Arc<Mutex<Arc<ZtunnelDouble>>>,
    tracker: Arc<Mutex<invariants::Tracker>>,
) -> conns::Task {
    conns::Task::spawn(async move {
        loop {
            let current = double.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let now = Instant::now();
            current.inspect(|s| {
                tracker
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .observe(&s.workloads, now)
            });
            drop(current);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// Every second, the running agent's fds, threads and RSS.
fn sample_every_second(
    pid: Arc<std::sync::atomic::AtomicU32>,
    start: Instant,
    samples: Arc<Mutex<Vec<agent::Sample>>>,
) -> conns::Task {
    conns::Task::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let pid = pid.load(std::sync::atomic::Ordering::SeqCst);
            if pid != 0
                && let Some(sample) = agent::sample(pid, start.elapsed().as_secs_f64())
            {
                samples
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(sample);
            }
        }
    })
}

impl Soak<'_> {
    fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn double(&self) -> Arc<ZtunnelDouble> {
        self.double
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, invariants::Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn violation(&self, kind: &'static str, detail: String) {
        self.tracker().violation(kind, detail);
    }

    async fn drive(&mut self) -> Result<()> {
        self.double()
            .wait_until(|s| s.ready, Duration::from_secs(60))
            .await
            .map_err(|e| anyhow::anyhow!("ztunnel never ready: {e}"))?;
        // Start with most slots filled.
        let initial = self.cfg.pods * 3 / 4;
        for _ in 0..initial {
            self.create_pod(false).await?;
        }
        self.settle().await;
        eprintln!(
            "soak: {initial} pods up at {:.1} s; events and faults for {:?}",
            self.elapsed_s(),
            self.cfg.duration
        );
        let end = Instant::now() + self.cfg.duration;
        let mut next_fault = Instant::now() + self.fault_gap();
        let mut next_check = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end {
            let now = Instant::now();
            if now >= next_check {
                self.check_round(false).await?;
                next_check = Instant::now() + Duration::from_secs(2);
            }
            if now >= next_fault {
                self.fault().await?;
                next_fault = Instant::now() + self.fault_gap();
            } else {
                self.random_event().await?;
                let pause = self.rng.millis(20, 200);
                tokio::time::sleep(pause).await;
            }
            self.due_ghost_deletes(false);
            self.tracker().overdue(Instant::now());
            if let Err(e) = self.agent.check_running() {
                self.violation("agent", format!("the agent exited by itself: {e:#}"));
                self.agent.start()?;
            }
        }
        self.finish().await
    }

    /// Exponentially distributed, mean `fault_interval`.
    fn fault_gap(&mut self) -> Duration {
        let u = self.rng.unit();
        let mean = self.cfg.fault_interval.as_secs_f64();
        Duration::from_secs_f64((-(1.0 - u).ln() * mean).clamp(mean / 10.0, mean * 4.0))
    }

    /// Waits until every expectation is met, or the bound passed (the
    /// tracker then names the late pods).
    async fn settle(&mut self) {
        let deadline = Instant::now() + self.cfg.convergence_bound;
        while self.tracker().pending() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The observer's next pass, so that `done` times are recorded.
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.tracker()
            .overdue(Instant::now() + Duration::from_millis(1));
    }

    /// The end: settle and check everything, then delete every pod and
    /// check that nothing of them is left.
    async fn finish(&mut self) -> Result<()> {
        eprintln!(
            "soak: events stop at {:.1} s; final checks",
            self.elapsed_s()
        );
        self.due_ghost_deletes(true);
        self.settle().await;
        self.check_conns().await;
        self.check_round(true).await?;
        let slots: Vec<usize> = (0..self.world.slots.len())
            .filter(|&i| self.world.slots[i].pod.is_some())
            .collect();
        for slot in slots {
            self.delete_pod(slot, false)?;
        }
        self.due_ghost_deletes(true);
        self.settle().await;
        // Two rounds: a leftover counts when seen twice.
        self.check_round(true).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.check_round(true).await?;
        self.check_empty();
        Ok(())
    }
}
