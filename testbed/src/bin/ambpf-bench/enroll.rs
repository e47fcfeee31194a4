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
//! routing, sk_lookup link, map writes; iptables mode: inspection, rules).
//!
//! `--phases enrol` measures the enrolment only: iptables mode's opt-out of
//! many pods takes minutes (about 0.5 s a pod), the enrolment seconds. The
//! agent is then stopped with the pods enrolled and their namespaces are
//! deleted, as after every measurement; deleting a pod's namespace is all
//! its removal takes (Istio runs nothing in a deleted pod), so nothing of
//! the opt-out is timed, and the JSON says so (`remove: null`, no remove
//! ratios).

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
    /// The phases timed, comma-separated. `enrol` alone gives no opt-out
    /// figure: the agent is stopped with the pods enrolled and their
    /// namespaces are deleted (which is all a deleted pod's removal takes;
    /// Istio runs nothing in it), sparing iptables mode's opt-out of about
    /// 0.5 s a pod. `opt-out` needs `enrol` (the pods it removes).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "enrol,opt-out"
    )]
    phases: Vec<MeasuredPhase>,
}

#[derive(Serialize)]
struct Config {
    pods: Vec<usize>,
    modes: Vec<&'static str>,
    runs: usize,
    phases: Vec<MeasuredPhase>,
    agent: PathBuf,
}

/// The phases a measurement times (`--phases`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum MeasuredPhase {
    /// The pods written to the pods file → the ztunnel double holds them all.
    Enrol,
    /// The pods file emptied → the double holds none (Istio's
    /// `DeleteInpodRules` in iptables mode, about 0.5 s a pod).
    OptOut,
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
    /// `null` when the opt-out was not measured (`--phases enrol`).
    remove: Option<Phase>,
    /// The agent's enrolment time per pod by step (ms), from its metrics.
    enrol_steps_ms_per_pod: BTreeMap<String, f64>,
    /// Creating the measurement's fresh pod namespaces (s).
    cluster_create_s: f64,
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
    ensure!(
        args.phases.contains(&MeasuredPhase::Enrol),
        "--phases: `opt-out` needs `enrol` (the pods it removes)"
    );
    let opt_out = args.phases.contains(&MeasuredPhase::OptOut);
    let modes = compared_modes(&args.modes)?;
    let suite = SuiteRun::start("enroll");
    let agent = std::path::absolute(&args.common.agent)?;
    eprintln!(
        "enroll: pods {:?}, {} runs of {} (order rotated), fresh pod namespaces for every measurement{}",
        args.pods,
        args.runs,
        modes
            .iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join(", "),
        if opt_out {
            ""
        } else {
            "; enrolment only, no opt-out"
        }
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
                let mut sample = measure(
                    &agent, &work, &cgroup, &watcher, &cluster, &pods, mode, run, opt_out,
                )
                .await
                .with_context(|| format!("{n} pods, run {}, {}", run + 1, mode.name()))?;
                sample.cluster_create_s = cluster_create_s;
                drop(cluster);
                let remove = match &sample.remove {
                    Some(remove) => format!(
                        "remove {:>8.1} ms (agent cpu {:>7.1})",
                        remove.read_to_done_ms, remove.agent_cpu_ms
                    ),
                    None => "remove not measured".to_owned(),
                };
                eprintln!(
                    "enroll: {n:>4} pods run {} {:<8} enrol {:>8.1} ms (file→done {:>7.1}, agent cpu {:>7.1}), {remove}; namespaces made in {cluster_create_s:.1} s",
                    run + 1,
                    mode.name(),
                    sample.enrol.read_to_done_ms,
                    sample.enrol.file_to_done_ms,
                    sample.enrol.agent_cpu_ms,
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
            phases: args.phases.clone(),
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
    opt_out: bool,
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
    // Without the opt-out the agent stops with the pods enrolled; their
    // namespaces go with the cluster.
    let remove = if opt_out {
        let remove = phase(&agent, &double, watcher, &pods_file, &[], |count, _| {
            (count < n, count == 0)
        })
        .await
        .context("removing")?;
        Some(remove)
    } else {
        None
    };
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

mod report;
use report::{print_tables, summarize};

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

    #[test]
    fn phases_default_to_both_and_opt_out_can_be_left_out() {
        use clap::Parser as _;
        let phases = |extra: &[&str]| {
            let cli = crate::Cli::try_parse_from(["ambpf-bench", "enroll"].iter().chain(extra))
                .unwrap_or_else(|e| panic!("{extra:?}: {e}"));
            let crate::Suite::Enroll(args) = cli.suite else {
                panic!("not the enroll suite");
            };
            args.phases
        };
        assert_eq!(phases(&[]), [MeasuredPhase::Enrol, MeasuredPhase::OptOut]);
        assert_eq!(phases(&["--phases", "enrol"]), [MeasuredPhase::Enrol]);
        assert!(
            crate::Cli::try_parse_from(["ambpf-bench", "enroll", "--phases", "remove"]).is_err()
        );
    }
}
