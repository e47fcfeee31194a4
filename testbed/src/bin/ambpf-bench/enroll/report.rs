//! The `enroll` results: per-mode summaries, ratios and tables. A phase
//! left out with `--phases` has no summary, ratio or table row: `null` or
//! absent in the JSON, never a number.

use super::*;

#[derive(Clone, Debug, Serialize)]
pub(super) struct PhaseSummary {
    read_to_done_ms: Stats,
    file_to_done_ms: Stats,
    read_to_first_ms: Stats,
    agent_cpu_ms: Stats,
    /// read → done per pod, median.
    per_pod_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct ModeSummary {
    pods: usize,
    mode: Mode,
    /// `steady` (every run after the first, or the only one) or `first`.
    runs: &'static str,
    enrol: PhaseSummary,
    /// `null` when the opt-out was not measured (`--phases enrol`).
    remove: Option<PhaseSummary>,
    /// Median per-pod time of each enrolment step (ms).
    enrol_steps_ms_per_pod: BTreeMap<String, f64>,
}

/// eBPF mode's medians over a baseline's (lower is better).
#[derive(Clone, Debug, Serialize)]
pub(super) struct Ratio {
    pods: usize,
    runs: &'static str,
    /// `iptables`, `nftables` or `faster (<backend>)`: the Istio backend that
    /// enrolled faster.
    against: String,
    enrol: f64,
    enrol_cpu: f64,
    /// Absent when the opt-out was not measured (`--phases enrol`).
    #[serde(skip_serializing_if = "Option::is_none")]
    remove: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    remove_cpu: Option<f64>,
}

pub(super) fn summarize(
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
                let remove = summary
                    .remove
                    .as_ref()
                    .map(|r| [r.read_to_done_ms.median, r.agent_cpu_ms.median]);
                medians.insert(
                    mode.name(),
                    (
                        [
                            summary.enrol.read_to_done_ms.median,
                            summary.enrol.agent_cpu_ms.median,
                        ],
                        remove,
                    ),
                );
                modes.push(summary);
            }
            let Some(&(ebpf_enrol, ebpf_remove)) = medians.get("ebpf") else {
                continue;
            };
            // The faster backend by enrolment time, the headline figure.
            for baseline in bench::istio_baselines(|b| medians.get(b).map(|m| m.0[0]), true) {
                let (base_enrol, base_remove) = medians[baseline.backend];
                let r = |ebpf: f64, base: f64| sys::ratio(Some(ebpf), Some(base));
                let remove = ebpf_remove.zip(base_remove);
                ratios.push(Ratio {
                    pods: n,
                    runs: runs_label,
                    against: baseline.label,
                    enrol: r(ebpf_enrol[0], base_enrol[0]),
                    enrol_cpu: r(ebpf_enrol[1], base_enrol[1]),
                    remove: remove.map(|(e, b)| r(e[0], b[0])),
                    remove_cpu: remove.map(|(e, b)| r(e[1], b[1])),
                });
            }
        }
    }
    (modes, ratios)
}

fn summarize_mode(of: &[&Sample], n: usize, mode: Mode, runs: &'static str) -> Option<ModeSummary> {
    let summary = |phases: &[&Phase]| -> Option<PhaseSummary> {
        let stats =
            |f: &dyn Fn(&Phase) -> f64| Stats::of(&phases.iter().map(|p| f(p)).collect::<Vec<_>>());
        let read_to_done_ms = stats(&|p| p.read_to_done_ms)?;
        Some(PhaseSummary {
            per_pod_ms: read_to_done_ms.median / n as f64,
            read_to_done_ms,
            file_to_done_ms: stats(&|p| p.file_to_done_ms)?,
            read_to_first_ms: stats(&|p| p.read_to_first_ms)?,
            agent_cpu_ms: stats(&|p| p.agent_cpu_ms)?,
        })
    };
    let enrol: Vec<&Phase> = of.iter().map(|s| &s.enrol).collect();
    // Every sample's removal or none: the phases are the same for the run.
    let remove: Option<Vec<&Phase>> = of.iter().map(|s| s.remove.as_ref()).collect();
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
        enrol: summary(&enrol)?,
        remove: match remove {
            Some(remove) => Some(summary(&remove)?),
            None => None,
        },
        enrol_steps_ms_per_pod: steps
            .into_iter()
            .filter_map(|(step, v)| Some((step, Stats::of(&v)?.median)))
            .collect(),
    })
}

pub(super) fn print_tables(modes: &[ModeSummary], ratios: &[Ratio], args: &EnrollArgs) {
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
    let opt_out = args.phases.contains(&MeasuredPhase::OptOut);
    for (title, pick) in [
        (
            "Enrol: agent reads the pods file → ztunnel double holds every pod",
            (|m: &ModeSummary| Some(&m.enrol)) as fn(&ModeSummary) -> Option<&PhaseSummary>,
        ),
        (
            "Remove: agent reads the emptied file → ztunnel double holds none",
            |m: &ModeSummary| m.remove.as_ref(),
        ),
    ] {
        println!();
        if modes.iter().all(|m| pick(m).is_none()) {
            println!("{title}: not measured (--phases enrol)");
            continue;
        }
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
            let Some(p) = pick(m) else {
                continue;
            };
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
        "Ratios of medians, eBPF mode against each Istio backend and the faster of them (lower is better{})",
        if opt_out {
            ""
        } else {
            "; opt-out not measured"
        }
    );
    let mut header = vec!["pods", "runs", "against", "enrol", "enrol cpu"];
    if opt_out {
        header.extend(["remove", "remove cpu"]);
    }
    let mut table = Table::new(header);
    for r in ratios {
        let mut row = vec![
            r.pods.to_string(),
            r.runs.to_owned(),
            r.against.clone(),
            x(r.enrol),
            x(r.enrol_cpu),
        ];
        if opt_out {
            row.extend([r.remove, r.remove_cpu].map(|v| x(v.unwrap_or(f64::NAN))));
        }
        table.row(row);
    }
    print!("{table}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(run: usize, mode: Mode, enrol_ms: f64, remove_ms: Option<f64>) -> Sample {
        let phase = |ms: f64| Phase {
            file_to_done_ms: ms + 400.0,
            read_to_done_ms: ms,
            read_to_first_ms: ms / 2.0,
            agent_cpu_ms: ms / 4.0,
        };
        Sample {
            run,
            mode,
            pods: 10,
            enrol: phase(enrol_ms),
            remove: remove_ms.map(phase),
            enrol_steps_ms_per_pod: BTreeMap::new(),
            cluster_create_s: 0.1,
        }
    }

    fn report(remove: Option<f64>) -> serde_json::Value {
        let samples: Vec<Sample> = (0..2)
            .flat_map(|run| {
                [
                    sample(run, Mode::Ebpf, 10.0, remove.map(|ms| ms / 10.0)),
                    sample(run, Mode::Iptables, 200.0, remove),
                ]
            })
            .collect();
        let (summaries, ratios) = summarize(&samples, &[10], &[Mode::Iptables, Mode::Ebpf], 2);
        serde_json::json!({ "summary": summaries, "ratios": ratios, "samples": samples })
    }

    #[test]
    fn without_the_opt_out_the_report_has_no_removal_figures() {
        let report = report(None);
        for key in ["summary", "samples"] {
            for entry in report[key].as_array().unwrap() {
                assert!(entry["remove"].is_null(), "{key}: {entry}");
                assert!(entry["enrol"].is_object(), "{key}: {entry}");
            }
        }
        let ratios = report["ratios"].as_array().unwrap();
        assert!(!ratios.is_empty());
        for ratio in ratios {
            assert_eq!(ratio["enrol"], 0.05, "{ratio}");
            assert!(ratio.get("remove").is_none(), "{ratio}");
            assert!(ratio.get("remove_cpu").is_none(), "{ratio}");
        }
    }

    #[test]
    fn with_the_opt_out_the_report_has_removal_figures() {
        let report = report(Some(5000.0));
        for summary in report["summary"].as_array().unwrap() {
            assert!(summary["remove"]["read_to_done_ms"]["median"].is_number());
        }
        for ratio in report["ratios"].as_array().unwrap() {
            assert_eq!(ratio["remove"], 0.1, "{ratio}");
            assert_eq!(ratio["remove_cpu"], 0.1, "{ratio}");
        }
    }
}
