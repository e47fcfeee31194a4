//! `cargo xtask plots`: the benchmark figures of `docs/`, drawn as SVG from
//! the suites' JSON results kept in `docs/results/`, so that they are
//! regenerated, never drawn by hand.
//!
//! `--from target/bench` first copies the results of a new run
//! (`cargo xtask bench <suite>` writes `target/bench/<suite>.json`) into
//! `docs/results/`; every figure is then drawn from `docs/results/` alone.
//! Each figure's caption names the results file, the benchmark command and
//! run it came from (read back from the file's own `config`, `machine` and
//! `started_unix`), and this command.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use plotters::{coord::Shift, prelude::*};
use serde_json::Value;

/// Where the results live, relative to the workspace root.
pub const RESULTS_DIR: &str = "docs/results";
/// Where the figures go, relative to the workspace root.
pub const FIGURES_DIR: &str = "docs/figures";

/// The command that draws every figure, as its captions say.
const COMMAND: &str = "cargo xtask plots";

const WIDTH: u32 = 900;
const HEIGHT: u32 = 560;
/// Height of the caption under the chart.
const CAPTION_HEIGHT: u32 = 78;
const FONT: &str = "sans-serif";

/// One figure: the suite whose results it draws and the file it writes.
struct Figure {
    suite: &'static str,
    file: &'static str,
    height: u32,
    draw: fn(&Value, &Area<'_>) -> Result<()>,
}

const FIGURES: &[Figure] = &[
    Figure {
        suite: "enroll",
        file: "enroll-time.svg",
        height: HEIGHT,
        draw: draw_enroll,
    },
    Figure {
        suite: "redirect",
        file: "redirect-rate.svg",
        height: HEIGHT,
        draw: draw_redirect,
    },
    Figure {
        suite: "podstart",
        file: "podstart-latency.svg",
        height: HEIGHT,
        draw: draw_podstart,
    },
    Figure {
        suite: "control",
        file: "dashboard.svg",
        height: 820,
        draw: dashboard::draw,
    },
];

mod dashboard;

/// The suites whose results the figures read (what `--from` copies).
pub fn suites() -> impl Iterator<Item = &'static str> {
    FIGURES.iter().map(|f| f.suite)
}

/// Copies new results from `from` (if given), then draws every figure whose
/// results exist. Returns the figures written.
pub fn run(root: &Path, from: Option<&Path>) -> Result<Vec<PathBuf>> {
    let results = root.join(RESULTS_DIR);
    let figures = root.join(FIGURES_DIR);
    if let Some(from) = from {
        let from = root.join(from);
        let copied = copy_results(&from, &results)?;
        ensure!(
            !copied.is_empty(),
            "{} holds none of {}.json",
            from.display(),
            suites().collect::<Vec<_>>().join(".json, ")
        );
        for path in copied {
            println!("copied {}", path.display());
        }
    }
    std::fs::create_dir_all(&figures).with_context(|| format!("creating {}", figures.display()))?;
    let mut written = Vec::new();
    for figure in FIGURES {
        let source = results.join(format!("{}.json", figure.suite));
        if !source.exists() {
            println!(
                "{}: no {} (run `cargo xtask bench {}`, then `{COMMAND} --from target/bench`)",
                figure.file,
                source.display(),
                figure.suite
            );
            continue;
        }
        let report = read_report(&source, figure.suite)?;
        let out = figures.join(figure.file);
        draw_figure(figure, &report, &out)
            .with_context(|| format!("drawing {} from {}", out.display(), source.display()))?;
        println!("wrote {}", out.display());
        written.push(out);
    }
    Ok(written)
}

/// Copies `<suite>.json` of each figure's suite from `from` into `to`,
/// checking that each is that suite's report.
fn copy_results(from: &Path, to: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    let mut copied = Vec::new();
    for suite in suites() {
        let source = from.join(format!("{suite}.json"));
        if !source.exists() {
            continue;
        }
        read_report(&source, suite)?;
        let target = to.join(format!("{suite}.json"));
        std::fs::copy(&source, &target)
            .with_context(|| format!("copying {} to {}", source.display(), target.display()))?;
        copied.push(target);
    }
    Ok(copied)
}

fn read_report(path: &Path, suite: &str) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let report: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let named = report["suite"].as_str().unwrap_or("(none)");
    ensure!(
        named == suite,
        "{} is the report of suite {named:?}, not {suite:?}",
        path.display()
    );
    Ok(report)
}

fn draw_figure(figure: &Figure, report: &Value, out: &Path) -> Result<()> {
    let root = SVGBackend::new(out, (WIDTH, figure.height)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (chart, caption) = root.split_vertically(figure.height - CAPTION_HEIGHT);
    (figure.draw)(report, &chart)?;
    let lines = caption_lines(figure.suite, report);
    for (i, line) in lines.iter().enumerate() {
        caption
            .draw_text(
                line,
                &(FONT, 13).into_font().color(&RGBColor(60, 60, 60)),
                (14, 6 + 17 * i as i32),
            )
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("{e}")
}

// ---------------------------------------------------------------------------
// Captions

/// The caption under a figure: the data, the run it came from, and the
/// command that drew it.
fn caption_lines(suite: &str, report: &Value) -> Vec<String> {
    let machine = &report["machine"];
    let when = report["started_unix"]
        .as_u64()
        .map_or_else(|| "date unknown".to_owned(), utc_date);
    let kernel = machine["kernel"].as_str().unwrap_or("unknown");
    let cpus = machine["cpus"]
        .as_u64()
        .map_or_else(String::new, |n| format!(", {n} CPUs"));
    vec![
        format!(
            "Data: {RESULTS_DIR}/{suite}.json, one run of `{}`",
            bench_command(suite, &report["config"])
        ),
        format!("({when}, kernel {kernel}{cpus}; a shared machine: compare modes within the run)."),
        format!("Figure drawn by `{COMMAND}` (xtask/src/plots.rs) from that file."),
    ]
}

/// The benchmark command that produced a report, from the arguments its
/// `config` records.
fn bench_command(suite: &str, config: &Value) -> String {
    let list = |key: &str| {
        config[key].as_array().map(|values| {
            values
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
    };
    let number = |key: &str| config[key].as_f64().map(format_number);
    let names = |key: &str| {
        config[key].as_array().map(|values| {
            let names: Vec<&str> = values.iter().filter_map(Value::as_str).collect();
            names.join(",")
        })
    };
    let mut args: Vec<String> = Vec::new();
    let mut push = |flag: &str, value: Option<String>| {
        if let Some(value) = value {
            args.push(format!("--{flag} {value}"));
        }
    };
    match suite {
        "enroll" => {
            push("pods", list("pods"));
            push("runs", number("runs"));
            // Only where they differ from the suite's defaults.
            push("phases", names("phases").filter(|v| v != "enrol,opt-out"));
            push(
                "modes",
                names("modes").filter(|v| v != "iptables,nftables,ebpf"),
            );
        }
        "redirect" => {
            push("clients", list("clients"));
            push("duration-secs", number("duration_s"));
            // Only where they differ from the suite's defaults.
            push("warmup-secs", number("warmup_s").filter(|v| v != "0.5"));
            push(
                "conntrack-connections",
                number("conntrack_connections").filter(|v| v != "200"),
            );
            push(
                "loadgen-threads",
                number("loadgen_threads").filter(|v| v != "2"),
            );
            push("runs", number("runs"));
        }
        "podstart" => {
            push("pods", number("pods"));
            push("warmup", number("warmup"));
        }
        "control" => {
            push("churn", number("churn"));
            push("snapshot", number("snapshot"));
            push("runs", number("runs"));
            push("idle", number("idle_s").filter(|v| v != "0"));
            push("modes", names("modes"));
        }
        _ => {}
    }
    if suite == "redirect" && config["trace_reader"].as_bool() == Some(true) {
        args.push("--trace-reader".to_owned());
    }
    if args.is_empty() {
        format!("cargo xtask bench {suite}")
    } else {
        format!("cargo xtask bench {suite} -- {}", args.join(" "))
    }
}

/// `3` for 3.0, `0.5` for 0.5.
fn format_number(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

/// An axis label: whole numbers without a fraction, others to one digit.
fn tick(value: f64) -> String {
    if value.fract() == 0.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// `YYYY-MM-DD` (UTC) of a Unix time.
fn utc_date(unix: u64) -> String {
    // Howard Hinnant's days-to-civil.
    let days = (unix / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

// ---------------------------------------------------------------------------
// Data

/// The colour of a mode (or node), the same in every figure.
fn colour(mode: &str) -> RGBColor {
    match mode {
        "ebpf" => RGBColor(0, 114, 178),
        "iptables" => RGBColor(213, 94, 0),
        "direct" | "no ambpf" => RGBColor(90, 90, 90),
        other if other.starts_with("no ambpf") => RGBColor(170, 170, 170),
        "ebpf+trace" => RGBColor(86, 180, 233),
        _ => RGBColor(0, 158, 115),
    }
}

/// One mode's line: (x, y) points in order, and every measurement beside it.
#[derive(Debug, Default, PartialEq)]
struct Series {
    name: String,
    line: Vec<(f64, f64)>,
    samples: Vec<(f64, f64)>,
}

fn series_mut<'a>(all: &'a mut Vec<Series>, name: &str) -> &'a mut Series {
    if let Some(i) = all.iter().position(|s| s.name == name) {
        return &mut all[i];
    }
    all.push(Series {
        name: name.to_owned(),
        ..Series::default()
    });
    all.last_mut().expect("just pushed")
}

/// Enrolment time (ms, from the agent reading the pods file to the double
/// holding every pod) against pod count: the steady runs' medians as the
/// line, every measurement as a point.
fn enroll_series(report: &Value) -> Result<Vec<Series>> {
    let results = &report["results"];
    let mut all = Vec::new();
    for row in array(&results["summary"], "results.summary")? {
        if row["runs"] != "steady" {
            continue;
        }
        let (Some(mode), Some(pods), Some(ms)) = (
            row["mode"].as_str(),
            row["pods"].as_f64(),
            row["enrol"]["read_to_done_ms"]["median"].as_f64(),
        ) else {
            bail!("results.summary: a row without mode, pods or enrol.read_to_done_ms.median");
        };
        series_mut(&mut all, mode).line.push((pods, ms));
    }
    for sample in array(&results["samples"], "results.samples")? {
        let (Some(mode), Some(pods), Some(ms)) = (
            sample["mode"].as_str(),
            sample["pods"].as_f64(),
            sample["enrol"]["read_to_done_ms"].as_f64(),
        ) else {
            bail!("results.samples: a sample without mode, pods or enrol.read_to_done_ms");
        };
        series_mut(&mut all, mode).samples.push((pods, ms));
    }
    finish(all)
}

/// New connections per second against concurrent clients: the medians over
/// the runs as the line, every run as a point.
fn redirect_series(report: &Value) -> Result<Vec<Series>> {
    let results = &report["results"];
    let mut all = Vec::new();
    for row in array(&results["summary"]["modes"], "results.summary.modes")? {
        let (Some(mode), Some(clients), Some(rate)) = (
            row["mode"].as_str(),
            row["clients"].as_f64(),
            row["conn_per_s"]["median"].as_f64(),
        ) else {
            bail!("results.summary.modes: a row without mode, clients or conn_per_s.median");
        };
        series_mut(&mut all, mode).line.push((clients, rate));
    }
    for run in array(&results["runs"], "results.runs")? {
        let mode = run["mode"]
            .as_str()
            .ok_or_else(|| anyhow!("results.runs: a run without its mode"))?;
        for point in array(&run["points"], "results.runs[].points")? {
            let (Some(clients), Some(rate)) = (
                point["clients"].as_f64(),
                point["rate"]["per_second"].as_f64(),
            ) else {
                bail!("results.runs[].points: a point without clients or rate.per_second");
            };
            series_mut(&mut all, mode).samples.push((clients, rate));
        }
    }
    finish(all)
}

/// RunPodSandbox latency per node, as a cumulative distribution: x the
/// latency (ms), y the share of pods that started within it.
fn podstart_series(report: &Value) -> Result<Vec<Series>> {
    let mut all = Vec::new();
    for node in array(&report["results"]["modes"], "results.modes")? {
        let name = node["node"]
            .as_str()
            .or_else(|| node["mode"].as_str())
            .ok_or_else(|| anyhow!("results.modes: a node without its name"))?;
        let samples: Vec<f64> = array(&node["samples_ms"], "results.modes[].samples_ms")?
            .iter()
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| anyhow!("samples_ms: not a number"))
            })
            .collect::<Result<_>>()?;
        ensure!(!samples.is_empty(), "node {name:?} has no samples");
        series_mut(&mut all, name).line = cdf(&samples);
    }
    ensure!(!all.is_empty(), "results.modes is empty");
    Ok(all)
}

/// The empirical cumulative distribution of `samples` as a step line.
fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len() as f64;
    let mut line = Vec::with_capacity(2 * sorted.len());
    for (i, &x) in sorted.iter().enumerate() {
        line.push((x, i as f64 / n));
        line.push((x, (i + 1) as f64 / n));
    }
    line
}

/// A step line up to `x_max`, ending there at the share it had reached.
fn cut_at(line: &[(f64, f64)], x_max: f64) -> Vec<(f64, f64)> {
    let mut cut: Vec<(f64, f64)> = line.iter().copied().filter(|&(x, _)| x <= x_max).collect();
    if cut.len() < line.len() {
        let reached = cut.last().map_or(0.0, |&(_, y)| y);
        cut.push((x_max, reached));
    }
    cut
}

/// The latency at which a CDF step line reaches `share`.
fn quantile(line: &[(f64, f64)], share: f64) -> f64 {
    line.iter()
        .find(|&&(_, y)| y >= share)
        .or(line.last())
        .map_or(f64::NAN, |&(x, _)| x)
}

fn array<'a>(value: &'a Value, what: &str) -> Result<&'a Vec<Value>> {
    value
        .as_array()
        .ok_or_else(|| anyhow!("{what}: missing or not a list"))
}

/// Lines in x order; no empty result.
fn finish(mut all: Vec<Series>) -> Result<Vec<Series>> {
    ensure!(!all.is_empty(), "no data");
    for series in &mut all {
        series.line.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(all)
}

/// The range of every value of `pick` over the series, lines and samples.
fn span(all: &[Series], pick: impl Fn(&(f64, f64)) -> f64) -> (f64, f64) {
    all.iter()
        .flat_map(|s| s.line.iter().chain(&s.samples))
        .map(pick)
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        })
}

// ---------------------------------------------------------------------------
// Drawing

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw_enroll(report: &Value, area: &Area<'_>) -> Result<()> {
    let all = enroll_series(report)?;
    let (x_lo, x_hi) = span(&all, |p| p.0);
    let (y_lo, y_hi) = span(&all, |p| p.1);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Enrolling N pods: time until ztunnel holds them all, per mode",
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x_lo * 0.8..x_hi * 1.25).log_scale(),
            (y_lo * 0.7..y_hi * 1.4).log_scale(),
        )
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("pods enrolled at once (log)")
        .y_desc("ms, pods file read to ztunnel holding all (log)")
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style((FONT, 13))
        .draw()
        .map_err(plot_err)?;
    draw_lines(&mut chart, &all, "median of the steady runs", "every run")?;
    Ok(())
}

fn draw_redirect(report: &Value, area: &Area<'_>) -> Result<()> {
    let all = redirect_series(report)?;
    let (x_lo, x_hi) = span(&all, |p| p.0);
    let (_, y_hi) = span(&all, |p| p.1);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "New connections per second through the ztunnel double, per mode",
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d((x_lo * 0.8..x_hi * 1.25).log_scale(), 0.0..y_hi * 1.15)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("concurrent clients (log)")
        .y_desc("connections/s (connect, 64 B echo, close)")
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 13))
        .draw()
        .map_err(plot_err)?;
    draw_lines(&mut chart, &all, "median of the runs", "every run")?;
    Ok(())
}

fn draw_podstart(report: &Value, area: &Area<'_>) -> Result<()> {
    let all = podstart_series(report)?;
    let (x_lo, _) = span(&all, |p| p.0);
    // The tail past the slowest node's p99 (a pod or two each) would squeeze
    // the rest into a corner: the axis ends a little past it.
    let x_hi = all
        .iter()
        .map(|s| quantile(&s.line, 0.99))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Pod start (CRI RunPodSandbox) latency distribution, per node",
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d((x_lo * 0.9)..(x_hi * 1.1), 0.0..1.0)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("ms (the axis ends past the slowest node's p99; slower pods are off its right)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("share of pods started within")
        .label_style((FONT, 13))
        .draw()
        .map_err(plot_err)?;
    for series in &all {
        let colour = colour(&series.name);
        let dashed = series.name.contains("2nd");
        let style = if dashed {
            colour.mix(0.6).stroke_width(2)
        } else {
            colour.stroke_width(2)
        };
        let label = format!("{} ({} pods)", series.name, series.line.len() / 2);
        chart
            .draw_series(LineSeries::new(cut_at(&series.line, x_hi * 1.1), style))
            .map_err(plot_err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// Each series as a line with its points on it and every sample as a small
/// hollow circle, with a legend.
fn draw_lines<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    all: &[Series],
    line_name: &str,
    sample_name: &str,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for series in all {
        let colour = colour(&series.name);
        chart
            .draw_series(LineSeries::new(
                series.line.iter().copied(),
                colour.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label(format!("{}: {line_name}", series.name))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour));
        chart
            .draw_series(
                series
                    .line
                    .iter()
                    .map(|&p| Circle::new(p, 4, colour.filled())),
            )
            .map_err(plot_err)?;
        chart
            .draw_series(
                series
                    .samples
                    .iter()
                    .map(|&p| Circle::new(p, 3, colour.mix(0.7).stroke_width(1))),
            )
            .map_err(plot_err)?
            .label(format!("{}: {sample_name}", series.name))
            .legend(move |(x, y)| Circle::new((x + 12, y), 3, colour.mix(0.7).stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn enroll_report() -> Value {
        let stats = |median: f64| json!({ "median": median });
        json!({
            "suite": "enroll",
            "started_unix": 1_796_423_761u64,
            "machine": { "kernel": "6.18.0-test", "cpus": 2 },
            "config": { "pods": [1, 10], "runs": 2, "agent": "target/release/ambpf" },
            "results": {
                "summary": [
                    { "pods": 1, "mode": "ebpf", "runs": "steady", "enrol": { "read_to_done_ms": stats(2.0) } },
                    { "pods": 1, "mode": "ebpf", "runs": "first", "enrol": { "read_to_done_ms": stats(9.0) } },
                    { "pods": 10, "mode": "ebpf", "runs": "steady", "enrol": { "read_to_done_ms": stats(6.0) } },
                    { "pods": 10, "mode": "iptables", "runs": "steady", "enrol": { "read_to_done_ms": stats(120.0) } },
                    { "pods": 1, "mode": "iptables", "runs": "steady", "enrol": { "read_to_done_ms": stats(14.0) } }
                ],
                "samples": [
                    { "run": 0, "mode": "ebpf", "pods": 1, "enrol": { "read_to_done_ms": 9.0 } },
                    { "run": 1, "mode": "ebpf", "pods": 1, "enrol": { "read_to_done_ms": 2.0 } },
                    { "run": 0, "mode": "iptables", "pods": 10, "enrol": { "read_to_done_ms": 120.0 } }
                ]
            }
        })
    }

    #[test]
    fn the_caption_names_the_bench_command_from_the_reports_config() {
        assert_eq!(
            bench_command("enroll", &json!({ "pods": [1, 10, 100], "runs": 3 })),
            "cargo xtask bench enroll -- --pods 1,10,100 --runs 3"
        );
        assert_eq!(
            bench_command(
                "enroll",
                &json!({ "pods": [1000], "runs": 4, "phases": ["enrol"] })
            ),
            "cargo xtask bench enroll -- --pods 1000 --runs 4 --phases enrol"
        );
        assert_eq!(
            bench_command(
                "redirect",
                &json!({ "clients": [1, 8, 64], "duration_s": 2.0, "warmup_s": 0.5,
                         "runs": 3, "conntrack_connections": 200, "loadgen_threads": 2 })
            ),
            "cargo xtask bench redirect -- --clients 1,8,64 --duration-secs 2 --runs 3"
        );
        assert_eq!(
            bench_command(
                "redirect",
                &json!({ "clients": [1], "duration_s": 1.5, "warmup_s": 0.0, "runs": 1,
                         "conntrack_connections": 50, "loadgen_threads": 2 })
            ),
            "cargo xtask bench redirect -- --clients 1 --duration-secs 1.5 --warmup-secs 0 \
             --conntrack-connections 50 --runs 1"
        );
        assert_eq!(
            bench_command("podstart", &json!({ "pods": 150, "warmup": 3 })),
            "cargo xtask bench podstart -- --pods 150 --warmup 3"
        );
        let caption = caption_lines("enroll", &enroll_report()).join(" ");
        assert!(caption.contains("docs/results/enroll.json"), "{caption}");
        assert!(caption.contains("`cargo xtask bench enroll -- --pods 1,10 --runs 2`"));
        assert!(
            caption.contains("2026-12-04, kernel 6.18.0-test, 2 CPUs"),
            "{caption}"
        );
        assert!(caption.contains("`cargo xtask plots`"));
    }

    #[test]
    fn dates_are_utc_days() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
        assert_eq!(utc_date(1_796_423_761), "2026-12-04");
    }

    #[test]
    fn enrolment_lines_are_the_steady_medians_and_points_every_sample() {
        let all = enroll_series(&enroll_report()).unwrap();
        let ebpf = all.iter().find(|s| s.name == "ebpf").unwrap();
        assert_eq!(ebpf.line, vec![(1.0, 2.0), (10.0, 6.0)]);
        assert_eq!(ebpf.samples, vec![(1.0, 9.0), (1.0, 2.0)]);
        let iptables = all.iter().find(|s| s.name == "iptables").unwrap();
        assert_eq!(iptables.line, vec![(1.0, 14.0), (10.0, 120.0)]);
    }

    #[test]
    fn a_cdf_steps_up_one_sample_at_a_time() {
        let line = cdf(&[3.0, 1.0]);
        assert_eq!(line, vec![(1.0, 0.0), (1.0, 0.5), (3.0, 0.5), (3.0, 1.0)]);
        assert_eq!(quantile(&line, 0.5), 1.0);
        assert_eq!(quantile(&line, 0.99), 3.0);
        assert_eq!(cut_at(&line, 2.0), vec![(1.0, 0.0), (1.0, 0.5), (2.0, 0.5)]);
        assert_eq!(cut_at(&line, 3.0), line);
    }

    #[test]
    fn figures_are_drawn_from_the_results_and_a_missing_one_is_skipped() {
        let root = std::env::temp_dir().join(format!("xtask-plots-{}", std::process::id()));
        let bench = root.join("target/bench");
        std::fs::create_dir_all(&bench).unwrap();
        std::fs::write(bench.join("enroll.json"), enroll_report().to_string()).unwrap();
        // Another suite's report under this name is refused.
        std::fs::write(bench.join("podstart.json"), enroll_report().to_string()).unwrap();
        let refused = run(&root, Some(Path::new("target/bench"))).unwrap_err();
        assert!(
            format!("{refused:#}").contains("not \"podstart\""),
            "{refused:#}"
        );

        std::fs::remove_file(bench.join("podstart.json")).unwrap();
        let written = run(&root, Some(Path::new("target/bench"))).unwrap();
        assert_eq!(
            written,
            vec![root.join(FIGURES_DIR).join("enroll-time.svg")]
        );
        assert!(root.join(RESULTS_DIR).join("enroll.json").exists());
        let svg = std::fs::read_to_string(&written[0]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        assert!(svg.contains("cargo xtask bench enroll -- --pods 1,10 --runs 2"));
        assert!(svg.contains("cargo xtask plots"));
        // Drawn again from docs/results alone, the same figure.
        let again = run(&root, None).unwrap();
        assert_eq!(std::fs::read_to_string(&again[0]).unwrap(), svg);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
