//! The cluster benchmarks' arithmetic and report: percentiles, the agents'
//! rotation, medians over the measured runs, ratios against Istio's faster
//! backend.

use serde::Serialize;

use super::AgentResult;
use crate::bench::{Table, median, percentile};
use crate::kube::e2e::Agent;

/// Percentiles of a set of samples (milliseconds).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Nearest-rank percentiles; `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Self> {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|s| s.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            n: sorted.len(),
            p50: percentile(&sorted, 50.0),
            p99: percentile(&sorted, 99.0),
            max: sorted[sorted.len() - 1],
        })
    }
}

/// The order of `n` agents in run `run` (0 is the warm-up): starting at
/// agent `run mod n`, so each goes first as often as the others.
pub fn rotation(n: usize, run: usize) -> Vec<usize> {
    (0..n).map(|i| (run + i) % n).collect()
}

/// The median of the values there are; `None` for none.
pub fn median_of(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = values
        .into_iter()
        .flatten()
        .filter(|v| v.is_finite())
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(median(&v))
}

/// `ours / theirs` as `0.42x`; `n/a` when the baseline is not positive (an
/// added time within noise of zero has no meaningful ratio).
pub fn ratio(ours: f64, theirs: f64) -> String {
    if theirs > 0.0 && theirs.is_finite() && ours.is_finite() {
        format!("{:.2}x", ours / theirs)
    } else {
        "n/a".to_owned()
    }
}

/// The medians of one agent over the measured runs (the warm-up apart).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Medians {
    pub runs: usize,
    pub install_s: Option<f64>,
    pub started_p50_ms: Option<f64>,
    pub started_p99_ms: Option<f64>,
    /// Per run: this agent's started p50 minus `none`'s in the same run.
    pub added_p50_ms: Option<f64>,
    /// Per run: this agent's sandbox creation p50 minus `none`'s.
    pub added_sandbox_p50_ms: Option<f64>,
    pub sandbox_p50_ms: Option<f64>,
    pub ready_p50_ms: Option<f64>,
    pub enrol_all_ms: Option<f64>,
    pub enrol_p50_ms: Option<f64>,
    pub enrol_cpu_ms: Option<f64>,
    pub rss_kib: Option<f64>,
    pub pod_rss_kib: Option<f64>,
    pub idle_cpu_pct: Option<f64>,
}

impl Medians {
    pub fn of(result: &AgentResult) -> Self {
        let runs = &result.runs;
        let m = |f: &dyn Fn(&super::AgentRun) -> Option<f64>| median_of(runs.iter().map(f));
        Self {
            runs: runs.iter().filter(|r| r.error.is_none()).count(),
            install_s: m(&|r| r.install_s),
            started_p50_ms: m(&|r| r.pod_start.as_ref().map(|p| p.started_ms.p50)),
            started_p99_ms: m(&|r| r.pod_start.as_ref().map(|p| p.started_ms.p99)),
            added_p50_ms: m(&|r| r.added_p50_ms),
            added_sandbox_p50_ms: m(&|r| r.added_sandbox_p50_ms),
            sandbox_p50_ms: m(&|r| r.pod_start.as_ref()?.sandbox_ms.map(|s| s.p50)),
            ready_p50_ms: m(&|r| r.pod_start.as_ref().map(|p| p.ready_ms.p50)),
            enrol_all_ms: m(&|r| r.enrol.as_ref().map(|e| e.all_ms)),
            enrol_p50_ms: m(&|r| r.enrol.as_ref().map(|e| e.per_pod_ms.p50)),
            enrol_cpu_ms: m(&|r| r.enrol.as_ref().map(|e| e.cpu.cpu_ms)),
            rss_kib: m(&|r| r.cost.as_ref().map(|c| c.rss_kib as f64)),
            pod_rss_kib: m(&|r| r.cost.as_ref().map(|c| c.pod_rss_kib as f64)),
            idle_cpu_pct: m(&|r| r.cost.as_ref().map(|c| c.idle.percent)),
        }
    }
}

/// A compared figure: its name, unit, how it is shown, and where it is.
struct Metric {
    name: &'static str,
    unit: &'static str,
    scale: f64,
    decimals: usize,
    get: fn(&Medians) -> Option<f64>,
}

const METRICS: [Metric; 9] = [
    Metric {
        name: "pod start added p50",
        unit: "ms",
        scale: 1.0,
        decimals: 1,
        get: |m| m.added_p50_ms,
    },
    Metric {
        name: "sandbox added p50",
        unit: "ms",
        scale: 1.0,
        decimals: 1,
        get: |m| m.added_sandbox_p50_ms,
    },
    Metric {
        name: "sandbox p50",
        unit: "ms",
        scale: 1.0,
        decimals: 1,
        get: |m| m.sandbox_p50_ms,
    },
    Metric {
        name: "pod start p50",
        unit: "ms",
        scale: 1.0,
        decimals: 1,
        get: |m| m.started_p50_ms,
    },
    Metric {
        name: "pod start p99",
        unit: "ms",
        scale: 1.0,
        decimals: 1,
        get: |m| m.started_p99_ms,
    },
    Metric {
        name: "enrolling the namespace",
        unit: "ms",
        scale: 1.0,
        decimals: 0,
        get: |m| m.enrol_all_ms,
    },
    Metric {
        name: "enrolment CPU",
        unit: "ms",
        scale: 1.0,
        decimals: 0,
        get: |m| m.enrol_cpu_ms,
    },
    Metric {
        name: "agent RSS",
        unit: "MiB",
        scale: 1.0 / 1024.0,
        decimals: 1,
        get: |m| m.rss_kib,
    },
    Metric {
        name: "idle CPU",
        unit: "%",
        scale: 1.0,
        decimals: 2,
        get: |m| m.idle_cpu_pct,
    },
];

fn cell(value: Option<f64>, scale: f64, decimals: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{:.*}", decimals, v * scale))
}

/// Istio's agent with the lowest value of a figure, and that value.
fn best_istio(all: &[(Agent, Medians)], get: fn(&Medians) -> Option<f64>) -> Option<(Agent, f64)> {
    all.iter()
        .filter(|(a, _)| a.is_istio())
        .filter_map(|(a, m)| get(m).map(|v| (*a, v)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
}

/// One line per ambpf agent and figure: its median against Istio's faster
/// backend's for that figure, e.g. `ambpf-ebpf pod start added p50 3.1 ms
/// vs istio-iptables 41.0 ms (0.08x)`.
pub fn comparisons(all: &[(Agent, Medians)]) -> Vec<String> {
    let mut lines = Vec::new();
    for (agent, medians) in all.iter().filter(|(a, _)| a.ambpf_mode().is_some()) {
        for metric in &METRICS {
            let (Some(ours), Some((istio, theirs))) =
                ((metric.get)(medians), best_istio(all, metric.get))
            else {
                continue;
            };
            lines.push(format!(
                "{agent} {} {} {} vs {istio} {} {} ({})",
                metric.name,
                cell(Some(ours), metric.scale, metric.decimals),
                metric.unit,
                cell(Some(theirs), metric.scale, metric.decimals),
                metric.unit,
                ratio(ours, theirs)
            ));
        }
    }
    lines
}

/// The medians of every agent, one row each.
pub fn table(all: &[(Agent, Medians)]) -> Table {
    let mut table = Table::new([
        "agent",
        "runs",
        "start p50 ms",
        "start p99 ms",
        "added p50 ms",
        "sandbox p50 ms",
        "sandbox added ms",
        "Ready p50 ms",
        "enrol all ms",
        "enrol p50 ms",
        "enrol CPU ms",
        "RSS MiB",
        "pod RSS MiB",
        "idle CPU %",
    ]);
    for (agent, m) in all {
        table.row([
            agent.name().to_owned(),
            m.runs.to_string(),
            cell(m.started_p50_ms, 1.0, 1),
            cell(m.started_p99_ms, 1.0, 1),
            cell(m.added_p50_ms, 1.0, 1),
            cell(m.sandbox_p50_ms, 1.0, 1),
            cell(m.added_sandbox_p50_ms, 1.0, 1),
            cell(m.ready_p50_ms, 1.0, 0),
            cell(m.enrol_all_ms, 1.0, 0),
            cell(m.enrol_p50_ms, 1.0, 0),
            cell(m.enrol_cpu_ms, 1.0, 0),
            cell(m.rss_kib, 1.0 / 1024.0, 1),
            cell(m.pod_rss_kib, 1.0 / 1024.0, 1),
            cell(m.idle_cpu_pct, 1.0, 2),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Summary::of(&samples).unwrap();
        assert_eq!((s.n, s.p50, s.p99, s.max), (100, 50.0, 99.0, 100.0));
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.p50, s.p99, s.max), (2.0, 3.0, 3.0));
        assert_eq!(Summary::of(&[]), None);
        assert_eq!(Summary::of(&[f64::NAN]), None);
    }

    #[test]
    fn each_run_starts_one_agent_later() {
        assert_eq!(rotation(5, 0), vec![0, 1, 2, 3, 4]);
        assert_eq!(rotation(5, 1), vec![1, 2, 3, 4, 0]);
        assert_eq!(rotation(5, 7), vec![2, 3, 4, 0, 1]);
        assert_eq!(rotation(1, 3), vec![0]);
        // Over n runs each agent is first once.
        let firsts: Vec<usize> = (0..4).map(|r| rotation(4, r)[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2, 3]);
    }

    #[test]
    fn medians_skip_missing_values() {
        assert_eq!(
            median_of([Some(3.0), None, Some(1.0), Some(2.0)]),
            Some(2.0)
        );
        assert_eq!(median_of([Some(4.0), Some(1.0)]), Some(2.5));
        assert_eq!(median_of([None, None]), None);
    }

    #[test]
    fn ratios_need_a_positive_baseline() {
        assert_eq!(ratio(5.0, 20.0), "0.25x");
        assert_eq!(ratio(30.0, 20.0), "1.50x");
        assert_eq!(ratio(5.0, 0.0), "n/a");
        assert_eq!(ratio(5.0, -2.0), "n/a");
    }

    #[test]
    fn ambpf_is_compared_with_istios_faster_backend() {
        let m = |added: f64, rss: Option<f64>| Medians {
            added_p50_ms: Some(added),
            rss_kib: rss,
            ..Medians::default()
        };
        let all = vec![
            (Agent::IstioIptables, m(40.0, Some(51200.0))),
            (Agent::IstioNftables, m(30.0, Some(61440.0))),
            (Agent::AmbpfEbpf, m(3.0, Some(20480.0))),
            (Agent::None, m(0.0, None)),
        ];
        let lines = comparisons(&all);
        assert_eq!(
            lines,
            vec![
                "ambpf-ebpf pod start added p50 3.0 ms vs istio-nftables 30.0 ms (0.10x)",
                "ambpf-ebpf agent RSS 20.0 MiB vs istio-iptables 50.0 MiB (0.40x)",
            ]
        );
        let table = table(&all).to_string();
        assert!(table.contains("istio-nftables"));
        assert!(table.lines().count() >= 5);
    }
}
