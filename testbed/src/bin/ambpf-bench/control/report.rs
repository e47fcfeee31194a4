//! The `control` results: per-mode summaries, ratios and tables.

use super::*;

/// Each mode's churn, pooled over the runs.
pub(super) fn summarize_churn(churns: &[Churn], measured: &[Mode]) -> Vec<ChurnSummary> {
    measured
        .iter()
        .filter_map(|&mode| {
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
pub(super) fn summarize_snapshots(
    snapshots: &[Snapshot],
    measured: &[Mode],
    runs: usize,
) -> Vec<SnapshotSummary> {
    let mut out = Vec::new();
    for (label, in_group) in bench::RUN_GROUPS {
        for &mode in measured {
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
                    scrape: ScrapeSummary::of(&of),
                    idle_cpu: Stats::of(
                        &of.iter()
                            .filter_map(|s| s.idle.as_ref())
                            .flat_map(|i| i.cpu_share.iter().copied())
                            .collect::<Vec<_>>(),
                    ),
                    idle_max_rss_kib: of
                        .iter()
                        .filter_map(|s| s.idle.as_ref())
                        .flat_map(|i| i.rss_kib.iter().copied())
                        .max(),
                })
            })();
            out.extend(summary);
        }
    }
    out
}

/// Ratios by baseline, then by figure.
pub(super) type RatiosByBaseline =
    std::collections::BTreeMap<String, std::collections::BTreeMap<&'static str, f64>>;

/// A named figure and how to read it for a mode.
type Figure<'a> = (&'static str, Box<dyn Fn(&str) -> Option<f64> + 'a>);

/// eBPF mode over each Istio backend, and over the faster of them figure by
/// figure (`faster`: every figure here is lower-is-better), for each named
/// figure; snapshot figures from the steady runs.
pub(super) fn ratios(churn: &[ChurnSummary], snapshot: &[SnapshotSummary]) -> RatiosByBaseline {
    let c = |mode: &str, f: fn(&ChurnSummary) -> f64| {
        churn.iter().find(|s| s.mode.name() == mode).map(f)
    };
    let s = |mode: &str, f: fn(&SnapshotSummary) -> f64| {
        snapshot
            .iter()
            .find(|s| s.mode.name() == mode && s.runs == "steady")
            .map(f)
    };
    let figures: [Figure<'_>; 13] = [
        (
            "churn_add_p50",
            Box::new(move |m| c(m, |s| s.add_ms.median)),
        ),
        ("churn_add_p99", Box::new(move |m| c(m, |s| s.add_ms.p99))),
        (
            "churn_annotate_p50",
            Box::new(move |m| c(m, |s| s.annotate_ms.median)),
        ),
        (
            "churn_annotate_p99",
            Box::new(move |m| c(m, |s| s.annotate_ms.p99)),
        ),
        (
            "churn_del_p50",
            Box::new(move |m| c(m, |s| s.del_ms.median)),
        ),
        ("churn_del_p99", Box::new(move |m| c(m, |s| s.del_ms.p99))),
        (
            "churn_create_cpu",
            Box::new(move |m| c(m, |s| s.create_cpu_ms_per_pod)),
        ),
        (
            "churn_delete_cpu",
            Box::new(move |m| c(m, |s| s.delete_cpu_ms_per_pod)),
        ),
        (
            "snapshot_programmed",
            Box::new(move |m| s(m, |s| s.programmed_ms.median)),
        ),
        (
            "snapshot_ztunnel",
            Box::new(move |m| s(m, |s| s.ztunnel_ms.median)),
        ),
        (
            "snapshot_annotated",
            Box::new(move |m| s(m, |s| s.annotated_ms.median)),
        ),
        (
            "snapshot_cpu",
            Box::new(move |m| s(m, |s| s.agent_cpu_ms.median)),
        ),
        (
            "snapshot_hwm",
            Box::new(move |m| s(m, |s| s.vm_hwm_kib as f64)),
        ),
    ];
    let mut out = RatiosByBaseline::new();
    for (figure, value) in &figures {
        for baseline in bench::istio_baselines(value, true) {
            // One "faster" column, whichever backend was faster at this figure.
            let against = if baseline.label.starts_with("faster") {
                "faster".to_owned()
            } else {
                baseline.label
            };
            let ratio = sys::ratio(value("ebpf"), Some(baseline.value));
            out.entry(against).or_default().insert(figure, ratio);
        }
    }
    out
}

pub(super) fn print_tables(
    churn: &[ChurnSummary],
    snapshot: &[SnapshotSummary],
    args: &ControlArgs,
) -> RatiosByBaseline {
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
    print_scrape_table(snapshot);
    let ratios = ratios(churn, snapshot);
    println!();
    println!(
        "Ratios of eBPF mode over each Istio backend and over the faster of them per figure \
         (lower is better; snapshot figures from the steady runs)"
    );
    let baselines: Vec<&String> = ratios.keys().collect();
    let mut table = Table::new(
        std::iter::once("figure".to_owned()).chain(baselines.iter().map(|b| format!("ebpf/{b}"))),
    );
    let figures: std::collections::BTreeSet<&str> =
        ratios.values().flat_map(|f| f.keys().copied()).collect();
    for figure in figures {
        let cells = baselines.iter().map(|b| match ratios[*b].get(figure) {
            Some(r) if !r.is_nan() => format!("{r:.2}x"),
            _ => "-".to_owned(),
        });
        table.row(std::iter::once(figure.to_owned()).chain(cells));
    }
    print!("{table}");
    ratios
}

/// A group of snapshots' scrape times (ms): the worst over the runs, and
/// the median of the runs' medians.
#[derive(Clone, Debug, Default, Serialize)]
pub(super) struct ScrapeSummary {
    pub(super) during_enrolment_p99: Option<f64>,
    pub(super) during_enrolment_max: Option<f64>,
    pub(super) during_enrolment_count: usize,
    pub(super) enrolled_median: Option<f64>,
    pub(super) enrolled_max: Option<f64>,
    pub(super) full_maps_median: Option<f64>,
    pub(super) full_maps_max: Option<f64>,
    pub(super) lines: usize,
}

impl ScrapeSummary {
    fn of(snapshots: &[&Snapshot]) -> Self {
        let worst = |f: fn(&ScrapeFigures) -> Option<f64>| {
            snapshots
                .iter()
                .filter_map(|s| f(&s.scrapes))
                .reduce(f64::max)
        };
        let median = |f: fn(&ScrapeFigures) -> Option<f64>| {
            let medians: Vec<f64> = snapshots.iter().filter_map(|s| f(&s.scrapes)).collect();
            Stats::of(&medians).map(|s| s.median)
        };
        Self {
            during_enrolment_p99: worst(|s| s.during_enrolment_ms.map(|s| s.p99)),
            during_enrolment_max: worst(|s| s.during_enrolment_ms.map(|s| s.max)),
            during_enrolment_count: snapshots
                .iter()
                .filter_map(|s| s.scrapes.during_enrolment_ms.map(|s| s.count))
                .sum(),
            enrolled_median: median(|s| s.enrolled_ms.map(|s| s.median)),
            enrolled_max: worst(|s| s.enrolled_ms.map(|s| s.max)),
            full_maps_median: median(|s| s.full_maps_ms.map(|s| s.median)),
            full_maps_max: worst(|s| s.full_maps_ms.map(|s| s.max)),
            lines: snapshots.iter().map(|s| s.scrapes.lines).max().unwrap_or(0),
        }
    }
}

/// One snapshot's scrapes, as it ends.
pub(super) fn print_scrapes(snapshot: &Snapshot) {
    let s = &snapshot.scrapes;
    let stats = |st: &Option<Stats>| {
        st.map_or("-".to_owned(), |st| {
            format!(
                "median {:.1} p99 {:.1} max {:.1} ms ({})",
                st.median, st.p99, st.max, st.count
            )
        })
    };
    eprintln!(
        "control:   /metrics: first answer {:.0} ms after spawn; during enrolment {}; enrolled ({} lines) {}; full maps {}; map fill reported {:?}",
        s.first_answer_ms.unwrap_or(f64::NAN),
        stats(&s.during_enrolment_ms),
        s.lines,
        stats(&s.enrolled_ms),
        stats(&s.full_maps_ms),
        s.map_fill_reported,
    );
}

pub(super) fn print_idle(snapshot: &Snapshot) {
    let Some(idle) = &snapshot.idle else { return };
    let Some(cpu) = Stats::of(&idle.cpu_share) else {
        return;
    };
    eprintln!(
        "control:   idle {} s: CPU median {:.1}% p99 {:.1}% max {:.1}% of one CPU; RSS {} .. {} KiB (first, last), max {} KiB",
        idle.cpu_share.len(),
        cpu.median * 100.0,
        cpu.p99 * 100.0,
        cpu.max * 100.0,
        idle.rss_kib.first().unwrap_or(&0),
        idle.rss_kib.last().unwrap_or(&0),
        idle.rss_kib.iter().max().unwrap_or(&0),
    );
}

/// The snapshot's `/metrics` table.
pub(super) fn print_scrape_table(snapshot: &[SnapshotSummary]) {
    let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    println!();
    println!(
        "/metrics during and after the snapshot (ms, connect to last byte; worst over the runs, \
         median of the runs' medians)"
    );
    let mut table = Table::new([
        "runs",
        "mode",
        "enrolling p99",
        "enrolling max",
        "(scrapes)",
        "enrolled median",
        "enrolled max",
        "full maps median",
        "full maps max",
        "lines",
    ]);
    for s in snapshot {
        let c = &s.scrape;
        table.row([
            s.runs.to_owned(),
            s.mode.name().to_owned(),
            f(c.during_enrolment_p99),
            f(c.during_enrolment_max),
            c.during_enrolment_count.to_string(),
            f(c.enrolled_median),
            f(c.enrolled_max),
            f(c.full_maps_median),
            f(c.full_maps_max),
            c.lines.to_string(),
        ]);
    }
    print!("{table}");
}
