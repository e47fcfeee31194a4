//! The `attach` suite's summaries (medians over runs, ratios to the TCX
//! link measured in the same run) and its tables.

use super::*;

/// One phase of one candidate at one pod count, over every run.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PhaseSummary {
    /// Per operation, every pod of every run pooled, ms.
    pub(super) op_ms: Stats,
    /// The first operation of each batch, ms, median over runs.
    pub(super) first_ms: f64,
    /// Per operation, without the first run (when there are several).
    pub(super) op_ms_later_runs: Option<Stats>,
    /// The worker thread's CPU per operation, ms, pooled.
    pub(super) op_cpu_ms: Stats,
    /// Each step per operation, pooled.
    pub(super) steps_ms: Vec<(String, Stats)>,
    /// The whole phase, ms, median over runs.
    pub(super) total_ms: f64,
    /// This process's user + system CPU over the phase, ms, median over runs.
    pub(super) process_cpu_ms: f64,
    pub(super) process_user_ms: f64,
    pub(super) process_system_ms: f64,
    /// The machine's busy CPU over the phase, ms, median over runs.
    pub(super) machine_busy_ms: f64,
    /// Entering a pod's namespace, ms, pooled.
    pub(super) enter_ms: Stats,
    /// Medians over runs of this candidate / tcx-link in the same run: the
    /// operation's p50, mean, thread CPU mean and the phase total.
    pub(super) p50_over_tcx: f64,
    pub(super) mean_over_tcx: f64,
    pub(super) cpu_over_tcx: f64,
    pub(super) total_over_tcx: f64,
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct Summary {
    pub(super) pods: usize,
    pub(super) candidate: Candidate,
    pub(super) create_s: f64,
    pub(super) attach: PhaseSummary,
    pub(super) replace: PhaseSummary,
    pub(super) detach: PhaseSummary,
}

pub(super) fn median_of(values: impl IntoIterator<Item = f64>) -> f64 {
    let values: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
    Stats::of(&values).map_or(f64::NAN, |s| s.median)
}

pub(super) fn summarize(samples: &[BatchSample], args: &AttachArgs) -> Vec<Summary> {
    let mut out = Vec::new();
    for &n in &args.pods {
        for &candidate in &args.candidates {
            let of: Vec<&BatchSample> = samples
                .iter()
                .filter(|s| s.pods == n && s.candidate == candidate)
                .collect();
            if of.is_empty() {
                continue;
            }
            let tcx = |run: usize| {
                samples
                    .iter()
                    .find(|s| s.pods == n && s.run == run && s.candidate == Candidate::TcxLink)
            };
            let phase = |pick: fn(&BatchSample) -> &Phase| -> PhaseSummary {
                let pooled = |f: fn(&Phase) -> &Vec<f64>, from_run: usize| {
                    let all: Vec<f64> = of
                        .iter()
                        .filter(|s| s.run >= from_run)
                        .flat_map(|s| f(pick(s)).iter().copied())
                        .collect();
                    Stats::of(&all)
                };
                let empty = Stats {
                    count: 0,
                    min: f64::NAN,
                    median: f64::NAN,
                    p90: f64::NAN,
                    p99: f64::NAN,
                    max: f64::NAN,
                    mean: f64::NAN,
                };
                let step_names: Vec<String> = pick(of[0])
                    .steps_ms
                    .iter()
                    .map(|(n, _)| n.clone())
                    .collect();
                let steps_ms = step_names
                    .into_iter()
                    .map(|name| {
                        let all: Vec<f64> = of
                            .iter()
                            .flat_map(|s| {
                                pick(s)
                                    .steps_ms
                                    .iter()
                                    .filter(|(n, _)| *n == name)
                                    .flat_map(|(_, v)| v.iter().copied())
                            })
                            .collect();
                        (name, Stats::of(&all).unwrap_or(empty))
                    })
                    .collect();
                let over_tcx = |f: &dyn Fn(&Phase) -> f64| {
                    median_of(
                        of.iter()
                            .map(|s| sys::ratio(Some(f(pick(s))), tcx(s.run).map(|t| f(pick(t))))),
                    )
                };
                let p50 = |p: &Phase| Stats::of(&p.op_ms).map_or(f64::NAN, |s| s.median);
                let mean = |p: &Phase| Stats::of(&p.op_ms).map_or(f64::NAN, |s| s.mean);
                let cpu = |p: &Phase| Stats::of(&p.op_cpu_ms).map_or(f64::NAN, |s| s.mean);
                PhaseSummary {
                    op_ms: pooled(|p| &p.op_ms, 0).unwrap_or(empty),
                    first_ms: median_of(of.iter().filter_map(|s| pick(s).op_ms.first().copied())),
                    op_ms_later_runs: if args.runs > 1 {
                        pooled(|p| &p.op_ms, 1)
                    } else {
                        None
                    },
                    op_cpu_ms: pooled(|p| &p.op_cpu_ms, 0).unwrap_or(empty),
                    steps_ms,
                    total_ms: median_of(of.iter().map(|s| pick(s).total_ms)),
                    process_cpu_ms: median_of(
                        of.iter()
                            .map(|s| pick(s).process_user_ms + pick(s).process_system_ms),
                    ),
                    process_user_ms: median_of(of.iter().map(|s| pick(s).process_user_ms)),
                    process_system_ms: median_of(of.iter().map(|s| pick(s).process_system_ms)),
                    machine_busy_ms: median_of(of.iter().map(|s| pick(s).machine_busy_ms)),
                    enter_ms: pooled(|p| &p.enter_ms, 0).unwrap_or(empty),
                    p50_over_tcx: over_tcx(&p50),
                    mean_over_tcx: over_tcx(&mean),
                    cpu_over_tcx: over_tcx(&cpu),
                    total_over_tcx: over_tcx(&|p| p.total_ms),
                }
            };
            out.push(Summary {
                pods: n,
                candidate,
                create_s: median_of(of.iter().map(|s| s.create_s)),
                attach: phase(|s| &s.attach),
                replace: phase(|s| &s.replace),
                detach: phase(|s| &s.detach),
            });
        }
    }
    out
}

pub(super) fn print_tables(summaries: &[Summary], samples: &[BatchSample], args: &AttachArgs) {
    let f3 = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.3}")
        }
    };
    let f1 = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.1}")
        }
    };
    let us = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{:.0}", v * 1e3)
        }
    };
    let x = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else if v < 0.01 {
            format!("{v:.4}x")
        } else {
            format!("{v:.2}x")
        }
    };
    for (title, pick) in [
        (
            "Attach",
            (|s: &Summary| &s.attach) as fn(&Summary) -> &PhaseSummary,
        ),
        ("Replace the program", |s: &Summary| &s.replace),
        ("Detach", |s: &Summary| &s.detach),
    ] {
        println!();
        println!(
            "{title}, per pod (ms; p50/p99/mean over every pod of {} runs; first = a batch's first; total and process CPU = median of runs; cpu = the calling thread's)",
            args.runs
        );
        let mut table = Table::new([
            "pods",
            "candidate",
            "p50",
            "p99",
            "mean",
            "first",
            "total ms",
            "cpu µs/op",
            "proc cpu ms",
            "p50 ÷tcx",
            "mean ÷tcx",
            "cpu ÷tcx",
        ]);
        for s in summaries {
            let p = pick(s);
            table.row([
                s.pods.to_string(),
                s.candidate.name().to_owned(),
                f3(p.op_ms.median),
                f3(p.op_ms.p99),
                f3(p.op_ms.mean),
                f3(p.first_ms),
                f1(p.total_ms),
                us(p.op_cpu_ms.mean),
                f1(p.process_cpu_ms),
                x(p.p50_over_tcx),
                x(p.mean_over_tcx),
                x(p.cpu_over_tcx),
            ]);
        }
        print!("{table}");
    }

    println!();
    println!("Steps, per pod (ms, p50 / p99 / mean, every run pooled)");
    let mut table = Table::new(["pods", "candidate", "phase", "step", "p50", "p99", "mean"]);
    for s in summaries {
        for (phase, p) in [
            ("attach", &s.attach),
            ("replace", &s.replace),
            ("detach", &s.detach),
        ] {
            for (step, stats) in &p.steps_ms {
                table.row([
                    s.pods.to_string(),
                    s.candidate.name().to_owned(),
                    phase.to_owned(),
                    step.clone(),
                    f3(stats.median),
                    f3(stats.p99),
                    f3(stats.mean),
                ]);
            }
        }
    }
    print!("{table}");

    println!();
    println!("Per run: attach p50 / detach p50 (ms), candidates in the order measured");
    let mut header = vec!["pods".to_owned(), "run".to_owned(), "order".to_owned()];
    header.extend(args.candidates.iter().map(|c| c.name().to_owned()));
    let mut table = Table::new(header);
    for &n in &args.pods {
        for run in 0..args.runs {
            let batch = |c: Candidate| {
                samples
                    .iter()
                    .find(|s| s.pods == n && s.run == run && s.candidate == c)
            };
            let mut row = vec![
                n.to_string(),
                (run + 1).to_string(),
                order(&args.candidates, run)
                    .iter()
                    .map(|c| c.name())
                    .collect::<Vec<_>>()
                    .join(","),
            ];
            row.extend(args.candidates.iter().map(|&c| match batch(c) {
                Some(b) => {
                    let p50 = |v: &[f64]| Stats::of(v).map_or(f64::NAN, |s| s.median);
                    format!(
                        "{} / {}",
                        f3(p50(&b.attach.op_ms)),
                        f3(p50(&b.detach.op_ms))
                    )
                }
                None => "-".to_owned(),
            }));
            table.row(row);
        }
    }
    print!("{table}");
    if args.runs > 1 {
        println!();
        println!("First run against later ones: attach p50 (ms)");
        let mut table = Table::new(["pods", "candidate", "run 1", "runs 2+"]);
        for s in summaries {
            let first: Vec<f64> = samples
                .iter()
                .filter(|b| b.pods == s.pods && b.candidate == s.candidate && b.run == 0)
                .flat_map(|b| b.attach.op_ms.iter().copied())
                .collect();
            table.row([
                s.pods.to_string(),
                s.candidate.name().to_owned(),
                f3(Stats::of(&first).map_or(f64::NAN, |s| s.median)),
                f3(s.attach.op_ms_later_runs.map_or(f64::NAN, |s| s.median)),
            ]);
        }
        print!("{table}");
    }
    println!();
    for &n in &args.pods {
        let created = median_of(samples.iter().filter(|s| s.pods == n).map(|s| s.create_s));
        println!(
            "{n} pod namespaces with veths created in {created:.1} s (median; not timed as attach)"
        );
    }
}
