//! The `enroll` suite of `ambpf-bench` (a module of that binary; not part of the
//! library).
//!
//! Time for the agent to enrol N pods and to remove them, in eBPF mode and
//! in the two modes that write Istio's backends (iptables, nftables); those
//! measured in the same run are the baselines, and the faster of them the
//! headline one. As a user meets them: every measurement gets a fresh testbed
//! [`Cluster`] (each pod its own network namespace, an `eth0` with IPv4 and
//! IPv6 addresses, veth'd to the node), so no mode enrols a namespace
//! another measurement enrolled before; the order of the modes rotates from
//! run to run (each goes first equally often); and the first run is reported
//! apart from the rest.
//!
//! One measurement: the agent starts with an empty pods file and the ztunnel
//! double connects (ready, no pods). The bench writes the file with N pods;
//! the agent polls it every 500 ms, so "file → done" includes up to 500 ms
//! of polling. The moment the agent reads the file is taken from inotify
//! (`IN_OPEN` on the file), and the headline is "read → done": from the
//! agent opening the file to the double holding all N pods (every Add
//! received and acked). The double runs ZDS-only (no in-pod proxies: starting
//! them is ztunnel's cost, the same in both modes, about 16 ms a pod for the
//! double, and would hide the agent's). That is the end-to-end
//! signal and works for both modes; in eBPF mode `ambpf status --json` is
//! checked afterwards (not timed) to list N pods. Removal: the file is
//! emptied; read → the double has none left (every Del received). A pods file
//! lists only the pods to enrol, so a pod it drops may still run and is
//! opted out (Istio's `DeleteInpodRules` in the baselines); a deleted pod's
//! removal (its probe members only) needs a source that tells deletion
//! apart, the Kubernetes one, and is `control`'s churn `del`. The agent's
//! CPU time over each phase (schedstat) is the steadier figure.
//!
//! After the enrolment the agent's `/metrics` gives where its time went, per
//! step (`ambpf_enrol_duration_seconds{mode,step}`: namespace inspection, reply
//! routing, steering filter, map writes; iptables mode: inspection, rules).

use std::collections::BTreeMap;

use ambpf_testbed::{
    bench::sys::{self, OpenWatcher},
    cluster,
};

use super::{
    redirect::{ALL_COMPARED, Agent, Compared, Mode, compared_modes, rotated, write_pods_file},
    *,
};

/// A hang, not a slow result.
const TIMEOUT: Duration = Duration::from_secs(120);
/// What a phase adds per pod on top of [`TIMEOUT`]: iptables mode's opt-out
/// is Istio's 36 processes a pod, each waiting out an RCU grace period
/// (about 0.5 s a pod on a quiet 2-core machine, more on a busy one).
const TIMEOUT_PER_POD: Duration = Duration::from_secs(2);
const PODS_FILE: &str = "pods.json";

#[derive(Args)]
pub(super) struct EnrollArgs {
    #[command(flatten)]
    common: Common,
    /// Pod counts (each pod its own network namespace; at most 2559).
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pods: Vec<usize>,
    /// The modes measured, comma-separated: eBPF mode and the agent writing
    /// each of Istio's two backends.
    #[arg(long, value_enum, value_delimiter = ',', default_value = ALL_COMPARED)]
    modes: Vec<Compared>,
    /// Measurements per pod count and mode.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

#[derive(Serialize)]
struct Config {
    pods: Vec<usize>,
    modes: Vec<&'static str>,
    runs: usize,
    agent: PathBuf,
}

/// One phase (enrol or remove) of one measurement, in milliseconds.
#[derive(Clone, Debug, Serialize)]
struct Phase {
    /// From the file written to done (includes the agent's polling).
    file_to_done_ms: f64,
    /// From the agent opening the file to done.
    read_to_done_ms: f64,
    /// From the agent opening the file to the double's first change (the
    /// first pod added or removed).
    read_to_first_ms: f64,
    /// The agent's CPU time from the file written to done.
    agent_cpu_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
struct Sample {
    run: usize,
    mode: Mode,
    pods: usize,
    enrol: Phase,
    remove: Phase,
    /// The agent's enrolment time per pod by step (ms), from its metrics.
    enrol_steps_ms_per_pod: BTreeMap<String, f64>,
    /// Creating the measurement's fresh pod namespaces (s).
    cluster_create_s: f64,
}

#[derive(Clone, Debug, Serialize)]
struct PhaseSummary {
    read_to_done_ms: Stats,
    file_to_done_ms: Stats,
    read_to_first_ms: Stats,
    agent_cpu_ms: Stats,
    /// read → done per pod, median.
    per_pod_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
struct ModeSummary {
    pods: usize,
    mode: Mode,
    /// `steady` (every run after the first, or the only one) or `first`.
    runs: &'static str,
    enrol: PhaseSummary,
    remove: PhaseSummary,
    /// Median per-pod time of each enrolment step (ms).
    enrol_steps_ms_per_pod: BTreeMap<String, f64>,
}

/// eBPF mode's medians over a baseline's (lower is better).
#[derive(Clone, Debug, Serialize)]
struct Ratio {
    pods: usize,
    runs: &'static str,
    /// `iptables`, `nftables` or `faster (<backend>)`: the Istio backend that
    /// enrolled faster.
    against: String,
    enrol: f64,
    enrol_cpu: f64,
    remove: f64,
    remove_cpu: f64,
}

pub(super) async fn run(args: EnrollArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(
        !args.pods.is_empty()
            && args
                .pods
                .iter()
                .all(|&n| (1..=cluster::MAX_PODS).contains(&n)),
        "--pods: counts between 1 and {} (the testbed cluster's limit)",
        cluster::MAX_PODS
    );
    let modes = compared_modes(&args.modes)?;
    let suite = SuiteRun::start("enroll");
    let agent = std::path::absolute(&args.common.agent)?;
    eprintln!(
        "enroll: pods {:?}, {} runs of {} (order rotated), fresh pod namespaces for every measurement",
        args.pods,
        args.runs,
        modes
            .iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let work = TempDir::create("ambpf-bench-enroll")?;
    let cgroup = CgroupGuard::create().context("creating a throwaway cgroup")?;
    let watcher = OpenWatcher::new(work.path(), PODS_FILE)?;

    let mut samples = Vec::new();
    for &n in &args.pods {
        for run in 0..args.runs {
            for mode in rotated(&modes, run) {
                let created = Instant::now();
                let cluster = Cluster::create(n as u16).context("creating the pod namespaces")?;
                let cluster_create_s = created.elapsed().as_secs_f64();
                let pods: Vec<(String, PathBuf)> = cluster
                    .pods
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (format!("{n:08x}-e0e0-4000-8000-{i:012x}"), p.ns.path()))
                    .collect();
                let mut sample =
                    measure(&agent, &work, &cgroup, &watcher, &cluster, &pods, mode, run)
                        .await
                        .with_context(|| format!("{n} pods, run {}, {}", run + 1, mode.name()))?;
                sample.cluster_create_s = cluster_create_s;
                drop(cluster);
                eprintln!(
                    "enroll: {n:>4} pods run {} {:<8} enrol {:>8.1} ms (file→done {:>7.1}, agent cpu {:>7.1}), remove {:>8.1} ms (agent cpu {:>7.1}); namespaces made in {cluster_create_s:.1} s",
                    run + 1,
                    mode.name(),
                    sample.enrol.read_to_done_ms,
                    sample.enrol.file_to_done_ms,
                    sample.enrol.agent_cpu_ms,
                    sample.remove.read_to_done_ms,
                    sample.remove.agent_cpu_ms,
                );
                samples.push(sample);
            }
        }
    }
    let (summaries, ratios) = summarize(&samples, &args.pods, &modes, args.runs);
    print_tables(&summaries, &ratios, &args);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            pods: args.pods.clone(),
            modes: modes.iter().map(|m| m.name()).collect(),
            runs: args.runs,
            agent,
        },
        serde_json::json!({ "summary": summaries, "ratios": ratios, "samples": samples }),
    )?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    agent_binary: &Path,
    work: &TempDir,
    cgroup: &CgroupGuard,
    watcher: &OpenWatcher,
    cluster: &Cluster,
    pods: &[(String, PathBuf)],
    mode: Mode,
    run: usize,
) -> Result<Sample> {
    let n = pods.len();
    let pods_file = work.join(PODS_FILE);
    let socket = work.join("ztunnel.sock");
    write_pods_file(&pods_file, &[])?;
    let log = work.join(format!("agent-{n}-{}-{run}.log", mode.name()));
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
    // ZDS only: starting in-pod proxies is ztunnel's cost (about 16 ms a pod
    // for the double), the same in both modes, and would hide the agent's.
    let double = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only());
    double
        .wait_until(|s| s.ready, TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("ztunnel not ready: {e:?}"))?;

    let enrol = phase(&agent, &double, watcher, &pods_file, pods, |count, _| {
        (count >= 1, count == n)
    })
    .await
    .context("enrolling")?;
    let enrol_steps_ms_per_pod = enrol_steps(&cluster.node)
        .context("reading the agent's enrolment steps from /metrics")?
        .into_iter()
        .map(|(step, (count, seconds))| (step, seconds * 1000.0 / count.max(1.0)))
        .collect();
    if mode == Mode::Ebpf {
        let listed = agent.status_pods()?;
        ensure!(listed == n, "ambpf status lists {listed} pods, not {n}");
    }
    let remove = phase(&agent, &double, watcher, &pods_file, &[], |count, _| {
        (count < n, count == 0)
    })
    .await
    .context("removing")?;
    double.shutdown().await;
    agent.stop()?;
    Ok(Sample {
        run,
        mode,
        pods: n,
        enrol,
        remove,
        enrol_steps_ms_per_pod,
        cluster_create_s: f64::NAN,
    })
}

/// The agent's `ambpf_enrol_duration_seconds` histogram by step, summed
/// over modes: (times, seconds).
fn enrol_steps(node: &ambpf_testbed::NetnsGuard) -> Result<BTreeMap<String, (f64, f64)>> {
    Ok(parse_enrol_steps(&agent_metrics(node)?))
}

fn parse_enrol_steps(metrics: &str) -> BTreeMap<String, (f64, f64)> {
    let mut steps: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in metrics.lines() {
        let Some((series, sample)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(sample) = sample.parse::<f64>() else {
            continue;
        };
        let (count, labels) =
            if let Some(labels) = series.strip_prefix("ambpf_enrol_duration_seconds_count{") {
                (true, labels)
            } else if let Some(labels) = series.strip_prefix("ambpf_enrol_duration_seconds_sum{") {
                (false, labels)
            } else {
                continue;
            };
        let Some(step) = labels
            .split(',')
            .find_map(|label| label.strip_prefix("step=\""))
            .and_then(|rest| rest.split('"').next())
        else {
            continue;
        };
        let entry = steps.entry(step.to_owned()).or_default();
        if count {
            entry.0 += sample;
        } else {
            entry.1 += sample;
        }
    }
    steps
}

/// Writes `pods` to the file and waits until `progress(workloads, all
/// proxies running)` says done; it also says when the first change is seen.
async fn phase(
    agent: &Agent,
    double: &ZtunnelDouble,
    watcher: &OpenWatcher,
    pods_file: &Path,
    pods: &[(String, PathBuf)],
    progress: impl Fn(usize, bool) -> (bool, bool),
) -> Result<Phase> {
    let pid = agent.pid();
    watcher.clear();
    let mut changes = double.subscribe();
    let cpu_before = bench::on_cpu(pid)?;
    let written = Instant::now();
    write_pods_file(pods_file, pods)?;
    // The pods to add, or those to remove (the double holds them).
    let changing = pods.len().max(double.inspect(|s| s.workloads.len()));
    let limit = TIMEOUT + TIMEOUT_PER_POD * changing as u32;
    let deadline = tokio::time::Instant::now() + limit;
    let mut first = None;
    let done = loop {
        changes.borrow_and_update();
        let (count, running) = double.inspect(|s| {
            (
                s.workloads.len(),
                s.workloads.values().all(|w| w.proxies_running),
            )
        });
        let now = Instant::now();
        let (started, finished) = progress(count, running);
        if started && first.is_none() {
            first = Some(now);
        }
        if finished {
            break now;
        }
        if let Some(stopped) = double.stopped() {
            bail!("the ztunnel double stopped: {stopped}");
        }
        if tokio::time::timeout_at(deadline, changes.changed())
            .await
            .is_err()
        {
            bail!(
                "not done within {limit:?} ({count} pods at ztunnel); the end of the agent's log:\n{}",
                agent.process.log_tail(20)
            );
        }
    };
    let agent_cpu = bench::on_cpu(pid)?.saturating_sub(cpu_before);
    let read = watcher
        .next_open(Duration::from_secs(1))
        .context("inotify saw no open of the pods file")?;
    let first = first.unwrap_or(done);
    let since_read = |t: Instant| ms(t.saturating_duration_since(read));
    Ok(Phase {
        file_to_done_ms: ms(done.duration_since(written)),
        read_to_done_ms: since_read(done),
        read_to_first_ms: since_read(first),
        agent_cpu_ms: ms(agent_cpu),
    })
}

fn summarize(
    samples: &[Sample],
    counts: &[usize],
    measured: &[Mode],
    runs: usize,
) -> (Vec<ModeSummary>, Vec<Ratio>) {
    let mut modes = Vec::new();
    let mut ratios = Vec::new();
    for &n in counts {
        for (runs_label, in_group) in bench::RUN_GROUPS {
            let mut medians = std::collections::HashMap::new();
            for &mode in measured {
                let of: Vec<&Sample> = samples
                    .iter()
                    .filter(|s| s.pods == n && s.mode == mode && in_group(s.run, runs))
                    .collect();
                let Some(summary) = summarize_mode(&of, n, mode, runs_label) else {
                    continue;
                };
                medians.insert(
                    mode.name(),
                    [
                        summary.enrol.read_to_done_ms.median,
                        summary.enrol.agent_cpu_ms.median,
                        summary.remove.read_to_done_ms.median,
                        summary.remove.agent_cpu_ms.median,
                    ],
                );
                modes.push(summary);
            }
            let Some(ebpf) = medians.get("ebpf") else {
                continue;
            };
            // The faster backend by enrolment time, the headline figure.
            for baseline in bench::istio_baselines(|b| medians.get(b).map(|m| m[0]), true) {
                let base = medians[baseline.backend];
                let r = |i: usize| sys::ratio(Some(ebpf[i]), Some(base[i]));
                ratios.push(Ratio {
                    pods: n,
                    runs: runs_label,
                    against: baseline.label,
                    enrol: r(0),
                    enrol_cpu: r(1),
                    remove: r(2),
                    remove_cpu: r(3),
                });
            }
        }
    }
    (modes, ratios)
}

fn summarize_mode(of: &[&Sample], n: usize, mode: Mode, runs: &'static str) -> Option<ModeSummary> {
    let summary = |phase: &dyn Fn(&Sample) -> &Phase| -> Option<PhaseSummary> {
        let stats = |f: &dyn Fn(&Phase) -> f64| {
            Stats::of(&of.iter().map(|s| f(phase(s))).collect::<Vec<_>>())
        };
        let read_to_done_ms = stats(&|p| p.read_to_done_ms)?;
        Some(PhaseSummary {
            per_pod_ms: read_to_done_ms.median / n as f64,
            read_to_done_ms,
            file_to_done_ms: stats(&|p| p.file_to_done_ms)?,
            read_to_first_ms: stats(&|p| p.read_to_first_ms)?,
            agent_cpu_ms: stats(&|p| p.agent_cpu_ms)?,
        })
    };
    let mut steps: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for sample in of {
        for (step, ms) in &sample.enrol_steps_ms_per_pod {
            steps.entry(step.clone()).or_default().push(*ms);
        }
    }
    Some(ModeSummary {
        pods: n,
        mode,
        runs,
        enrol: summary(&|s| &s.enrol)?,
        remove: summary(&|s| &s.remove)?,
        enrol_steps_ms_per_pod: steps
            .into_iter()
            .filter_map(|(step, v)| Some((step, Stats::of(&v)?.median)))
            .collect(),
    })
}

fn print_tables(modes: &[ModeSummary], ratios: &[Ratio], args: &EnrollArgs) {
    let f1 = |v: f64| format!("{v:.1}");
    let f2 = |v: f64| format!("{v:.2}");
    let f3 = |v: f64| format!("{v:.3}");
    let x = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.2}x")
        }
    };
    let steady_runs = if args.runs > 1 { args.runs - 1 } else { 1 };
    for (title, pick) in [
        (
            "Enrol: agent reads the pods file → ztunnel double holds every pod",
            (|m: &ModeSummary| &m.enrol) as fn(&ModeSummary) -> &PhaseSummary,
        ),
        (
            "Remove: agent reads the emptied file → ztunnel double holds none",
            |m: &ModeSummary| &m.remove,
        ),
    ] {
        println!();
        println!(
            "{title} (ms; fresh namespaces each; `steady`: median of {steady_runs} run(s){}",
            if args.runs > 1 {
                ", the first run apart)"
            } else {
                ")"
            }
        );
        let mut table = Table::new([
            "pods",
            "runs",
            "mode",
            "median",
            "min",
            "max",
            "ms/pod",
            "first change",
            "file→done",
            "agent cpu",
        ]);
        for m in modes {
            let p = pick(m);
            table.row([
                m.pods.to_string(),
                m.runs.to_owned(),
                m.mode.name().to_owned(),
                f1(p.read_to_done_ms.median),
                f1(p.read_to_done_ms.min),
                f1(p.read_to_done_ms.max),
                f2(p.per_pod_ms),
                f1(p.read_to_first_ms.median),
                f1(p.file_to_done_ms.median),
                f1(p.agent_cpu_ms.median),
            ]);
        }
        print!("{table}");
    }
    println!();
    println!("Where enrolment time goes, per pod (ms, the agent's own step timings, median)");
    let mut table = Table::new(["pods", "runs", "mode", "steps"]);
    for m in modes {
        let steps: Vec<String> = m
            .enrol_steps_ms_per_pod
            .iter()
            .map(|(step, ms)| format!("{step} {}", f3(*ms)))
            .collect();
        table.row([
            m.pods.to_string(),
            m.runs.to_owned(),
            m.mode.name().to_owned(),
            steps.join(", "),
        ]);
    }
    print!("{table}");
    println!();
    println!(
        "Ratios of medians, eBPF mode against each Istio backend and the faster of them (lower is better)"
    );
    let mut table = Table::new([
        "pods",
        "runs",
        "against",
        "enrol",
        "enrol cpu",
        "remove",
        "remove cpu",
    ]);
    for r in ratios {
        table.row([
            r.pods.to_string(),
            r.runs.to_owned(),
            r.against.clone(),
            x(r.enrol),
            x(r.enrol_cpu),
            x(r.remove),
            x(r.remove_cpu),
        ]);
    }
    print!("{table}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enrolment_steps_are_read_from_the_agents_metrics() {
        let metrics = "# HELP ambpf_enrol_duration_seconds x\n\
            ambpf_enrol_duration_seconds_sum{mode=\"ebpf\",step=\"inspect\"} 0.002\n\
            ambpf_enrol_duration_seconds_count{mode=\"ebpf\",step=\"inspect\"} 4\n\
            ambpf_enrol_duration_seconds_bucket{mode=\"ebpf\",step=\"inspect\",le=\"0.1\"} 4\n\
            ambpf_enrol_duration_seconds_sum{mode=\"ebpf\",step=\"maps\"} 0.5\n\
            ambpf_pods_enrolled{mode=\"ebpf\"} 4\n";
        let steps = parse_enrol_steps(metrics);
        assert_eq!(steps.len(), 2);
        assert_eq!(steps["inspect"], (4.0, 0.002));
        assert_eq!(steps["maps"], (0.0, 0.5));
    }
}
