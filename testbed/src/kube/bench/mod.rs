//! `ambpf-cluster bench`: the cluster benchmarks, ambpf's node agent against
//! Istio's own (1.29.2, from its own chart) on the real node, with no agent
//! at all (`none`) as the no-capture baseline. Nothing asserts on time.
//!
//! Each run installs each agent in turn (run k starts at agent k mod n;
//! run 0 is a warm-up, reported apart), measures, and uninstalls it; the
//! ztunnel double stays installed throughout.
//!
//! - **pod start**: a Deployment in a fresh namespace (ambient, but for
//!   `none`) scaled from 0 to `--pods`. Each pod's creation is the arrival
//!   of its first event on a `kubectl get pods --watch` ([`watch`]),
//!   stamped with `CLOCK_BOOTTIME`; its start is the first thing its
//!   container does, `cat /proc/uptime` (the same clock, to 10 ms). So the
//!   figure covers scheduling, the sandbox (the CNI ADD, where the agent
//!   works) and the container's start. Ready (the condition's watch event)
//!   is reported too, but carries kubelet's 1 s status relist.
//! - **enrolling a namespace**: `--namespace-pods` Running pods in an
//!   unlabelled namespace, then the label; from the label's watch event to
//!   each pod's event carrying `ambient.istio.io/redirection: enabled`.
//! - **agent cost** ([`proc`]): the agent's process (containerd's task of
//!   its container) CPU ticks over the enrolment and over an idle window,
//!   its VmRSS with those pods enrolled.

mod measure;
mod proc;
mod report;
mod sandbox;
mod watch;

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use serde::Serialize;

use crate::bench::{Machine, Report, write_json};
use crate::kube::e2e::{Agent, Cluster, check_chart};
use measure::{Cost, Enrol, PodStart};
use report::Medians;

/// The default agents: Istio's two backends, ambpf's eBPF and iptables
/// modes, and no agent.
pub const DEFAULT_AGENTS: [Agent; 5] = [
    Agent::IstioIptables,
    Agent::IstioNftables,
    Agent::AmbpfEbpf,
    Agent::AmbpfIptables,
    Agent::None,
];

/// What the benchmarks are told.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    pub chart: PathBuf,
    pub out: PathBuf,
    pub agents: Vec<Agent>,
    /// Measured runs; one warm-up run comes first.
    pub runs: usize,
    /// Pods started per agent and run.
    pub pods: usize,
    /// One more pod every so many milliseconds; 0 starts them at once.
    pub pod_pace_ms: u64,
    /// Pods of the namespace enrolled at once.
    pub namespace_pods: usize,
    /// The idle CPU window.
    pub idle_secs: u64,
    /// Give the pods an exec readiness probe (`true`, every second).
    pub readiness_probe: bool,
    /// This program's command line, for the report.
    pub command_line: String,
}

/// One agent in one run.
#[derive(Clone, Debug, Serialize)]
pub struct AgentRun {
    pub run: usize,
    /// Its place in the run's order (0 first).
    pub position: usize,
    pub install_s: Option<f64>,
    pub pod_start: Option<PodStart>,
    /// This run's started p50 minus `none`'s in the same run.
    pub added_p50_ms: Option<f64>,
    /// This run's sandbox creation p50 minus `none`'s in the same run.
    pub added_sandbox_p50_ms: Option<f64>,
    pub enrol: Option<Enrol>,
    pub cost: Option<Cost>,
    pub error: Option<String>,
    /// What an agent left on the node after its uninstall (its CNI plugin
    /// in the configuration, its host rules), which would skew the next.
    pub leftovers: Vec<String>,
}

/// Everything of one agent.
#[derive(Clone, Debug, Serialize)]
pub struct AgentResult {
    pub agent: Agent,
    pub warmup: Option<AgentRun>,
    /// The measured runs.
    pub runs: Vec<AgentRun>,
    pub medians: Medians,
}

#[derive(Debug, Serialize)]
struct Results {
    complete: bool,
    /// The agents' order in each run, the warm-up first.
    order: Vec<Vec<Agent>>,
    agents: Vec<AgentResult>,
    comparisons: Vec<String>,
}

/// Runs the benchmarks, writing the results after each agent's turn.
pub fn run(cluster: &Cluster, options: &Options) -> Result<()> {
    if options.agents.is_empty() {
        bail!("no agents");
    }
    if options.agents.iter().any(|a| a.ambpf_mode().is_some()) {
        check_chart(&options.chart)?;
    }
    if options.agents.iter().any(|a| a.is_istio()) {
        crate::kube::istio::istio_cni_chart(cluster.components.cache())?;
    }
    println!("command: {}", options.command_line);
    let started_unix = crate::bench::unix_now();
    let started = Instant::now();
    let machine = Machine::collect();
    let commit = git_describe();
    println!(
        "cluster bench: {machine}; source {}; {} runs + 1 warm-up of {}",
        commit.as_deref().unwrap_or("unknown"),
        options.runs,
        options
            .agents
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    cluster.install_ztunnel()?;
    // A clean node: no agent, no namespace of an earlier run.
    if cluster.release_installed()? {
        cluster.helm_uninstall()?;
    }
    if cluster.istio_cni_installed()? {
        cluster.uninstall_istio_cni()?;
    }
    measure::delete_bench_namespaces(cluster)?;

    let n = options.agents.len();
    let mut results: Vec<AgentResult> = options
        .agents
        .iter()
        .map(|&agent| AgentResult {
            agent,
            warmup: None,
            runs: Vec::new(),
            medians: Medians::default(),
        })
        .collect();
    let mut order = Vec::new();
    let mut failures = Vec::new();
    for run in 0..=options.runs {
        let run_order = report::rotation(n, run);
        order.push(run_order.iter().map(|&i| options.agents[i]).collect());
        for (position, &i) in run_order.iter().enumerate() {
            let agent = options.agents[i];
            let label = if run == 0 {
                "warm-up".to_owned()
            } else {
                format!("run {run}/{}", options.runs)
            };
            println!("{label}: {agent}");
            let measured = measure_agent(cluster, options, agent, run, position);
            if let Some(e) = &measured.error {
                eprintln!("{label}: {agent} failed: {e}");
                failures.push(format!("{label} {agent}: {e}"));
            } else {
                print_run(&measured);
            }
            if run == 0 {
                results[i].warmup = Some(measured);
            } else {
                results[i].runs.push(measured);
            }
            let complete = run == options.runs && position == n - 1;
            summarise(&mut results);
            let report = Report {
                suite: "cluster".to_owned(),
                started_unix,
                duration_s: started.elapsed().as_secs_f64(),
                commit: commit.clone(),
                machine: machine.clone(),
                config: options.clone(),
                results: Results {
                    complete,
                    order: order.clone(),
                    comparisons: report::comparisons(&medians(&results)),
                    agents: results.clone(),
                },
            };
            write_json(&options.out, &report)?;
        }
    }
    let all = medians(&results);
    println!("\ncommand: {}", options.command_line);
    println!(
        "medians of {} runs (the warm-up apart); pod start = creation to the container's first instruction",
        options.runs
    );
    print!("{}", report::table(&all));
    for line in report::comparisons(&all) {
        println!("{line}");
    }
    println!("results in {}", options.out.display());
    if !failures.is_empty() {
        bail!("failed:\n{}", failures.join("\n"));
    }
    Ok(())
}

/// Installs `agent`, measures, deletes the namespaces and uninstalls it;
/// a failure is kept in the result.
fn measure_agent(
    cluster: &Cluster,
    options: &Options,
    agent: Agent,
    run: usize,
    position: usize,
) -> AgentRun {
    let mut result = AgentRun {
        run,
        position,
        install_s: None,
        pod_start: None,
        added_p50_ms: None,
        added_sandbox_p50_ms: None,
        enrol: None,
        cost: None,
        error: None,
        leftovers: Vec::new(),
    };
    let start_ns = format!("bench-start-{run}-{agent}");
    let enrol_ns = format!("bench-enrol-{run}-{agent}");
    let installing = Instant::now();
    let outcome = agent.install(cluster, &options.chart).and_then(|()| {
        result.install_s = Some(installing.elapsed().as_secs_f64());
        let pod_start = measure::pod_start(
            cluster,
            agent,
            &start_ns,
            options.pods,
            Duration::from_millis(options.pod_pace_ms),
            options.readiness_probe,
        );
        measure::delete_namespace(cluster, &start_ns)?;
        result.pod_start = Some(pod_start?);
        if agent.captures() {
            let (enrol, cost) = measure::enrol_and_cost(
                cluster,
                agent,
                &enrol_ns,
                options.namespace_pods,
                Duration::from_secs(options.idle_secs),
            )?;
            result.enrol = Some(enrol);
            result.cost = Some(cost);
        }
        Ok(())
    });
    let mut errors: Vec<String> = outcome
        .err()
        .map(|e| format!("{e:#}"))
        .into_iter()
        .collect();
    for namespace in [&start_ns, &enrol_ns] {
        if let Err(e) = measure::delete_namespace(cluster, namespace) {
            errors.push(format!("deleting {namespace}: {e:#}"));
        }
    }
    match agent.installed(cluster) {
        Ok(false) => {}
        Ok(true) => {
            if let Err(e) = agent.uninstall(cluster) {
                errors.push(format!("uninstalling: {e:#}"));
            }
        }
        Err(e) => errors.push(format!("uninstalling: {e:#}")),
    }
    result.leftovers = measure::leftovers(cluster);
    for left in &result.leftovers {
        eprintln!("bench: after {agent}: {left}");
    }
    if !errors.is_empty() {
        result.error = Some(errors.join("; "));
    }
    result
}

fn print_run(r: &AgentRun) {
    if let Some(p) = &r.pod_start {
        println!(
            "  pod start: {} pods, p50 {:.1} ms, p99 {:.1} ms (Ready p50 {:.0} ms, sandbox p50 {}); {} redirected",
            p.pods,
            p.started_ms.p50,
            p.started_ms.p99,
            p.ready_ms.p50,
            p.sandbox_ms
                .map_or_else(|| "n/a".to_owned(), |s| format!("{:.1} ms", s.p50)),
            p.redirected
        );
    }
    if let Some(e) = &r.enrol {
        println!(
            "  enrol: {} pods in {:.0} ms (p50 {:.0} ms), agent CPU {:.0} ms",
            e.pods, e.all_ms, e.per_pod_ms.p50, e.cpu.cpu_ms
        );
    }
    if let Some(c) = &r.cost {
        println!(
            "  agent: RSS {:.1} MiB (pod {:.1} MiB), idle CPU {:.2} % over {:.0} s",
            c.rss_kib as f64 / 1024.0,
            c.pod_rss_kib as f64 / 1024.0,
            c.idle.percent,
            c.idle.seconds
        );
    }
}

/// Fills each run's `added_p50_ms` (against `none` in the same run) and
/// each agent's medians.
fn summarise(results: &mut [AgentResult]) {
    // `none`'s pod start in each run: (run, started p50, sandbox p50).
    let none: Vec<(usize, f64, Option<f64>)> = results
        .iter()
        .filter(|r| r.agent == Agent::None)
        .flat_map(|r| r.runs.iter().chain(r.warmup.iter()))
        .filter_map(|run| {
            let p = run.pod_start.as_ref()?;
            Some((run.run, p.started_ms.p50, p.sandbox_ms.map(|s| s.p50)))
        })
        .collect();
    for result in results.iter_mut() {
        for run in result.runs.iter_mut().chain(result.warmup.iter_mut()) {
            let baseline = none.iter().find(|(r, ..)| *r == run.run);
            let (Some(p), Some(&(_, started, sandbox))) = (&run.pod_start, baseline) else {
                run.added_p50_ms = None;
                run.added_sandbox_p50_ms = None;
                continue;
            };
            run.added_p50_ms = Some(p.started_ms.p50 - started);
            run.added_sandbox_p50_ms = p.sandbox_ms.zip(sandbox).map(|(s, b)| s.p50 - b);
        }
        result.medians = Medians::of(result);
    }
}

fn medians(results: &[AgentResult]) -> Vec<(Agent, Medians)> {
    results
        .iter()
        .map(|r| (r.agent, r.medians.clone()))
        .collect()
}

fn git_describe() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()?;
    let commit = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !commit.trim().is_empty()).then(|| commit.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use report::Summary;

    fn run_with(run: usize, p50: f64) -> AgentRun {
        let s = Summary {
            n: 1,
            p50,
            p99: p50,
            max: p50,
        };
        AgentRun {
            run,
            position: 0,
            install_s: Some(1.0),
            pod_start: Some(PodStart {
                pods: 1,
                started_ms: s,
                ready_ms: s,
                sandbox_ms: Some(Summary {
                    p50: p50 / 10.0,
                    ..s
                }),
                redirected: 1,
                wall_s: 1.0,
                pace_ms: 1000.0,
                per_pod_started_ms: vec![p50],
            }),
            added_p50_ms: None,
            added_sandbox_p50_ms: None,
            enrol: None,
            cost: None,
            error: None,
            leftovers: Vec::new(),
        }
    }

    #[test]
    fn added_time_is_against_none_in_the_same_run() {
        let mut results = vec![
            AgentResult {
                agent: Agent::AmbpfEbpf,
                warmup: Some(run_with(0, 500.0)),
                runs: vec![run_with(1, 110.0), run_with(2, 130.0), run_with(3, 125.0)],
                medians: Medians::default(),
            },
            AgentResult {
                agent: Agent::None,
                warmup: Some(run_with(0, 400.0)),
                runs: vec![run_with(1, 100.0), run_with(2, 105.0), run_with(3, 120.0)],
                medians: Medians::default(),
            },
        ];
        summarise(&mut results);
        let added: Vec<f64> = results[0]
            .runs
            .iter()
            .filter_map(|r| r.added_p50_ms)
            .collect();
        assert_eq!(added, vec![10.0, 25.0, 5.0]);
        let added_sandbox: Vec<f64> = results[0]
            .runs
            .iter()
            .filter_map(|r| r.added_sandbox_p50_ms)
            .collect();
        assert_eq!(added_sandbox, vec![1.0, 2.5, 0.5]);
        assert_eq!(
            results[0].warmup.as_ref().unwrap().added_p50_ms,
            Some(100.0)
        );
        assert_eq!(results[0].medians.added_p50_ms, Some(10.0));
        assert_eq!(results[0].medians.added_sandbox_p50_ms, Some(1.0));
        assert_eq!(results[0].medians.started_p50_ms, Some(125.0));
        assert_eq!(results[0].medians.runs, 3);
        assert_eq!(results[1].medians.added_p50_ms, Some(0.0));
    }
}
