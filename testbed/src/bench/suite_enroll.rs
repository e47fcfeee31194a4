//! The `enroll` suite of `ambpf-bench` (a module of that binary, included
//! with `#[path]`; not part of the library).
//!
//! Time for the agent to enrol N pods and to remove them, in the iptables
//! and the eBPF mode, interleaved (iptables, ebpf, repeat); the iptables mode
//! measured in the same run is the baseline.
//!
//! Each pod is its own network namespace of a testbed [`Cluster`] (an
//! `eth0` with IPv4 and IPv6 addresses, veth'd to the node). The cluster is
//! limited to 200 pods (its addressing), so 1,000 pods are not measured: the
//! tables give the per-pod time of the largest N and an extrapolation to
//! 1,000, labelled as such.
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
//! emptied; read → the double has none left (every Del received). The agent's
//! CPU time over each phase (schedstat) is the steadier figure.

use ambpf_testbed::bench::sys::{self, OpenWatcher};

use super::{
    redirect::{Agent, Mode, write_pods_file},
    *,
};

/// A hang, not a slow result.
const TIMEOUT: Duration = Duration::from_secs(120);
const PODS_FILE: &str = "pods.json";
/// The testbed cluster's limit.
const MAX_PODS: usize = 200;

#[derive(Args)]
pub(super) struct EnrollArgs {
    #[command(flatten)]
    common: Common,
    /// Pod counts (each pod its own network namespace; at most 200).
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pods: Vec<usize>,
    /// Measurements per pod count and mode.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

#[derive(Serialize)]
struct Config {
    pods: Vec<usize>,
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
    enrol: PhaseSummary,
    remove: PhaseSummary,
}

#[derive(Clone, Debug, Serialize)]
struct Ratio {
    pods: usize,
    enrol_ebpf_over_iptables: f64,
    enrol_cpu_ebpf_over_iptables: f64,
    remove_ebpf_over_iptables: f64,
    remove_cpu_ebpf_over_iptables: f64,
}

pub(super) async fn run(args: EnrollArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(
        !args.pods.is_empty() && args.pods.iter().all(|&n| (1..=MAX_PODS).contains(&n)),
        "--pods: counts between 1 and {MAX_PODS} (the testbed cluster's limit)"
    );
    let suite = SuiteRun::start("enroll");
    let agent = std::path::absolute(&args.common.agent)?;
    eprintln!(
        "enroll: pods {:?}, {} runs of iptables, ebpf each",
        args.pods, args.runs
    );
    let work = TempDir::create("ambpf-bench-enroll")?;
    let cgroup = CgroupGuard::create().context("creating a throwaway cgroup")?;
    let watcher = OpenWatcher::new(work.path(), PODS_FILE)?;

    let mut samples = Vec::new();
    for &n in &args.pods {
        let created = Instant::now();
        let cluster = Cluster::create(n as u8).context("creating the pod namespaces")?;
        eprintln!(
            "enroll: {n} pod namespaces created in {:.1} s",
            created.elapsed().as_secs_f64()
        );
        let pods: Vec<(String, PathBuf)> = cluster
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("{n:08x}-e0e0-4000-8000-{i:012x}"), p.ns.path()))
            .collect();
        for run in 0..args.runs {
            for mode in [Mode::Iptables, Mode::Ebpf] {
                let sample = measure(&agent, &work, &cgroup, &watcher, &cluster, &pods, mode, run)
                    .await
                    .with_context(|| format!("{n} pods, run {}, {}", run + 1, mode.name()))?;
                eprintln!(
                    "enroll: {n:>3} pods run {} {:<8} enrol {:>8.1} ms (file→done {:>7.1}, agent cpu {:>7.1}), remove {:>8.1} ms (agent cpu {:>7.1})",
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
    let (modes, ratios) = summarize(&samples, &args.pods);
    print_tables(&modes, &ratios, &args);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            pods: args.pods.clone(),
            runs: args.runs,
            agent,
        },
        serde_json::json!({ "summary": modes, "ratios": ratios, "samples": samples }),
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
    })
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
    let deadline = tokio::time::Instant::now() + TIMEOUT;
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
                "not done within {TIMEOUT:?} ({count} pods at ztunnel); the end of the agent's log:\n{}",
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

fn summarize(samples: &[Sample], counts: &[usize]) -> (Vec<ModeSummary>, Vec<Ratio>) {
    let mut modes = Vec::new();
    let mut ratios = Vec::new();
    for &n in counts {
        let mut medians = std::collections::HashMap::new();
        for mode in [Mode::Iptables, Mode::Ebpf] {
            let of: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.pods == n && s.mode == mode)
                .collect();
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
            let (Some(enrol), Some(remove)) = (summary(&|s| &s.enrol), summary(&|s| &s.remove))
            else {
                continue;
            };
            medians.insert(
                mode.name(),
                [
                    enrol.read_to_done_ms.median,
                    enrol.agent_cpu_ms.median,
                    remove.read_to_done_ms.median,
                    remove.agent_cpu_ms.median,
                ],
            );
            modes.push(ModeSummary {
                pods: n,
                mode,
                enrol,
                remove,
            });
        }
        let r = |i: usize| {
            sys::ratio(
                medians.get("ebpf").map(|m: &[f64; 4]| m[i]),
                medians.get("iptables").map(|m: &[f64; 4]| m[i]),
            )
        };
        ratios.push(Ratio {
            pods: n,
            enrol_ebpf_over_iptables: r(0),
            enrol_cpu_ebpf_over_iptables: r(1),
            remove_ebpf_over_iptables: r(2),
            remove_cpu_ebpf_over_iptables: r(3),
        });
    }
    (modes, ratios)
}

fn print_tables(modes: &[ModeSummary], ratios: &[Ratio], args: &EnrollArgs) {
    let f1 = |v: f64| format!("{v:.1}");
    let f2 = |v: f64| format!("{v:.2}");
    let x = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.2}x")
        }
    };
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
        println!("{title} (ms, {} runs each)", args.runs);
        let mut table = Table::new([
            "pods",
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
    println!("Ratios ebpf/iptables of medians (lower is better)");
    let mut table = Table::new(["pods", "enrol", "enrol cpu", "remove", "remove cpu"]);
    for r in ratios {
        table.row([
            r.pods.to_string(),
            x(r.enrol_ebpf_over_iptables),
            x(r.enrol_cpu_ebpf_over_iptables),
            x(r.remove_ebpf_over_iptables),
            x(r.remove_cpu_ebpf_over_iptables),
        ]);
    }
    print!("{table}");
    if let Some(largest) = modes.iter().map(|m| m.pods).max() {
        println!();
        println!(
            "1,000 pods EXTRAPOLATED (not measured: the testbed cluster stops at {MAX_PODS}) from the per-pod time at {largest} pods:"
        );
        for m in modes.iter().filter(|m| m.pods == largest) {
            println!(
                "  {:<8} enrol ≈ {:.0} ms, remove ≈ {:.0} ms",
                m.mode.name(),
                m.enrol.per_pod_ms * 1000.0,
                m.remove.per_pod_ms * 1000.0
            );
        }
    }
}
