//! `docs/figures/dashboard.svg`: panels of the chart's Grafana dashboard
//! (charts/ambpf/dashboards/ambpf.json), their PromQL evaluated here over
//! the scrapes the `control` bench recorded from a real agent through a
//! 1,000-pod snapshot (`results.scrape_series` of `docs/results/control.json`).
//! Not Grafana: `rate` is the increase over a short window divided by its
//! span, `histogram_quantile` interpolates within buckets as Prometheus does.

use std::collections::BTreeMap;

use super::*;

/// `$__rate_interval`: the scrapes are kept every 0.5 s and the agent's
/// life in the bench is under a minute, so a window of a few samples.
const RATE_WINDOW_S: f64 = 2.0;
const PANEL_COLUMNS: usize = 2;

/// The recorded scrapes: series names and, per scrape, its time and values.
struct Scrapes {
    series: Vec<(String, Labels)>,
    at: Vec<f64>,
    values: Vec<Vec<f64>>,
}

type Labels = BTreeMap<String, String>;

/// `name{a="x",b="y"}` into its name and labels (the dashboard's series have
/// no commas or quotes in their values).
fn parse_series(series: &str) -> (String, Labels) {
    let Some((name, rest)) = series.split_once('{') else {
        return (series.to_owned(), Labels::new());
    };
    let labels = rest
        .trim_end_matches('}')
        .split(',')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            Some((k.to_owned(), v.trim_matches('"').to_owned()))
        })
        .collect();
    (name.to_owned(), labels)
}

impl Scrapes {
    fn from_report(report: &Value) -> Result<Self> {
        let recorded = &report["results"]["scrape_series"]["series"];
        let names = array(&recorded["series"], "results.scrape_series.series.series")?;
        let mut out = Self {
            series: names
                .iter()
                .map(|n| parse_series(n.as_str().unwrap_or_default()))
                .collect(),
            at: Vec::new(),
            values: Vec::new(),
        };
        for scrape in array(&recorded["scrapes"], "results.scrape_series.series.scrapes")? {
            out.at
                .push(scrape["at_s"].as_f64().context("a scrape without at_s")?);
            // Absent series were NaN, which JSON writes as null.
            out.values.push(
                array(&scrape["values"], "values")?
                    .iter()
                    .map(|v| v.as_f64().unwrap_or(f64::NAN))
                    .collect(),
            );
        }
        ensure!(out.at.len() > 2, "fewer than three recorded scrapes");
        Ok(out)
    }

    /// Indices of the series of family `name`.
    fn family(&self, name: &str) -> Vec<usize> {
        (0..self.series.len())
            .filter(|&i| self.series[i].0 == name)
            .collect()
    }

    /// `rate(series[RATE_WINDOW_S])` at scrape `k`: the increase since the
    /// first scrape inside the window, per second of their distance.
    fn rate(&self, series: usize, k: usize) -> Option<f64> {
        let from = (0..k).find(|&j| self.at[k] - self.at[j] <= RATE_WINDOW_S)?;
        let (v0, v1) = (self.values[from][series], self.values[k][series]);
        (v0.is_finite() && v1.is_finite() && v1 >= v0)
            .then(|| (v1 - v0) / (self.at[k] - self.at[from]))
    }

    /// `sum by (by) (f)` over the series of `family` at scrape `k`.
    fn sum_by(
        &self,
        family: &str,
        by: &[&str],
        f: impl Fn(usize) -> Option<f64>,
    ) -> BTreeMap<Vec<String>, f64> {
        let mut sums = BTreeMap::new();
        for i in self.family(family) {
            let Some(v) = f(i) else { continue };
            let key = by
                .iter()
                .map(|l| self.series[i].1.get(*l).cloned().unwrap_or_default())
                .collect();
            *sums.entry(key).or_insert(0.0) += v;
        }
        sums
    }

    /// `histogram_quantile(q, sum by (le, by) (rate(family_bucket[w])))`
    /// at scrape `k`, by the `by` labels' values.
    fn histogram_quantile(
        &self,
        q: f64,
        family: &str,
        by: &[&str],
        k: usize,
    ) -> BTreeMap<Vec<String>, f64> {
        let mut with_le = by.to_vec();
        with_le.push("le");
        let rates = self.sum_by(&format!("{family}_bucket"), &with_le, |i| self.rate(i, k));
        let mut groups: BTreeMap<Vec<String>, Vec<(f64, f64)>> = BTreeMap::new();
        for (mut key, rate) in rates {
            let le = key.pop().unwrap_or_default();
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::NAN)
            };
            groups.entry(key).or_default().push((le, rate));
        }
        groups
            .into_iter()
            .filter_map(|(key, mut buckets)| {
                buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
                Some((key, bucket_quantile(q, &buckets)?))
            })
            .collect()
    }
}

/// Prometheus' `histogram_quantile` over cumulative `(le, count)` buckets
/// ending in `+Inf`: none without observations.
fn bucket_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let i = buckets.iter().position(|b| b.1 >= rank)?;
    let (upper, count) = buckets[i];
    if upper.is_infinite() {
        return Some(buckets.get(i.wrapping_sub(1))?.0);
    }
    let (lower, below) = match i {
        0 if upper > 0.0 => (0.0, 0.0),
        0 => return Some(upper),
        _ => buckets[i - 1],
    };
    Some(lower + (upper - lower) * (rank - below) / (count - below))
}

/// A panel: its title, y axis and lines (name, points).
struct Panel {
    title: &'static str,
    y: &'static str,
    lines: Vec<(String, Vec<(f64, f64)>)>,
}

/// Each scrape's `query` values gathered into one line per key.
fn lines_of(
    scrapes: &Scrapes,
    name: impl Fn(&[String]) -> String,
    query: impl Fn(usize) -> BTreeMap<Vec<String>, f64>,
) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for k in 0..scrapes.at.len() {
        for (key, v) in query(k) {
            if v.is_finite() {
                lines
                    .entry(name(&key))
                    .or_default()
                    .push((scrapes.at[k], v));
            }
        }
    }
    lines.into_iter().collect()
}

fn panels(s: &Scrapes) -> Vec<Panel> {
    let value = |k: usize| move |i: usize| Some(s.values[k][i]).filter(|v| v.is_finite());
    let joined = |key: &[String]| key.join(" ");
    let ms = |mut m: BTreeMap<Vec<String>, f64>| {
        m.values_mut().for_each(|v| *v *= 1e3);
        m
    };
    let maps_by_name = |k: usize| {
        // max by (map) (ambpf_map_entries / ambpf_map_capacity)
        let entries = s.sum_by("ambpf_map_entries", &["map"], value(k));
        let capacity = s.sum_by("ambpf_map_capacity", &["map"], value(k));
        entries
            .into_iter()
            .filter_map(|(map, e)| Some((map.clone(), e / capacity.get(&map)?)))
            .collect::<BTreeMap<_, _>>()
    };
    let mut fill = lines_of(s, joined, maps_by_name);
    // Maps that stayed empty would crowd the legend.
    fill.retain(|(_, points)| points.iter().any(|p| p.1 > 0.0));
    vec![
        Panel {
            title: "Pods enrolled: sum by (mode) (ambpf_pods_enrolled)",
            y: "pods",
            lines: lines_of(s, joined, |k| {
                s.sum_by("ambpf_pods_enrolled", &["mode"], value(k))
            }),
        },
        Panel {
            title: "Enrolment latency by step (p99): ambpf_enrol_duration_seconds",
            y: "ms",
            lines: lines_of(s, joined, |k| {
                ms(
                    s.histogram_quantile(
                        0.99,
                        "ambpf_enrol_duration_seconds",
                        &["mode", "step"],
                        k,
                    ),
                )
            }),
        },
        Panel {
            title: "ZDS acks and NACKs: sum(rate(ambpf_zds_*_total))",
            y: "per second",
            lines: lines_of(
                s,
                |key| key[0].clone(),
                |k| {
                    [
                        ("adds acked", "ambpf_zds_adds_acked_total"),
                        ("dels acked", "ambpf_zds_dels_acked_total"),
                        ("NACKs", "ambpf_zds_nacks_total"),
                        ("ack timeouts", "ambpf_zds_ack_timeouts_total"),
                    ]
                    .into_iter()
                    .filter_map(|(label, family)| {
                        let sum = s.sum_by(family, &[], |i| s.rate(i, k));
                        Some((vec![label.to_owned()], *sum.get(&Vec::new())?))
                    })
                    .collect()
                },
            ),
        },
        Panel {
            title: "Agent CPU: rate(process_cpu_seconds_total)",
            y: "CPUs",
            lines: lines_of(
                s,
                |_| "agent".to_owned(),
                |k| s.sum_by("process_cpu_seconds_total", &[], |i| s.rate(i, k)),
            ),
        },
        Panel {
            title: "Map fill ratio: max by (map) (ambpf_map_entries / ambpf_map_capacity)",
            y: "share of capacity",
            lines: fill,
        },
        Panel {
            title: "Agent RSS: process_resident_memory_bytes",
            y: "MiB",
            lines: lines_of(
                s,
                |_| "agent".to_owned(),
                |k| {
                    s.sum_by("process_resident_memory_bytes", &[], value(k))
                        .into_iter()
                        .map(|(key, v)| (key, v / 1_048_576.0))
                        .collect()
                },
            ),
        },
    ]
}

/// Draws the panels on `area`, titled as what they are.
pub(super) fn draw(report: &Value, area: &Area<'_>) -> Result<()> {
    let scrapes = Scrapes::from_report(report)?;
    let recorded = &report["results"]["scrape_series"];
    let (title, grid) = area.split_vertically(34);
    title
        .draw_text(
            &format!(
                "The dashboard's queries over a real agent's scrapes ({}-pod snapshot, {} mode), \
                 drawn by cargo xtask plots; not Grafana",
                recorded["pods"].as_u64().unwrap_or(0),
                recorded["mode"].as_str().unwrap_or("?"),
            ),
            &(FONT, 15).into_font().color(&BLACK),
            (14, 10),
        )
        .map_err(plot_err)?;
    let panels = panels(&scrapes);
    let rows = panels.len().div_ceil(PANEL_COLUMNS);
    let x_hi = scrapes.at.last().copied().unwrap_or(1.0);
    for (panel, cell) in panels.iter().zip(grid.split_evenly((rows, PANEL_COLUMNS))) {
        draw_panel(panel, &cell, x_hi)?;
    }
    Ok(())
}

/// Line colours, in order (colour-blind safe).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(90, 90, 90),
    RGBColor(240, 228, 66),
];

fn draw_panel(panel: &Panel, area: &Area<'_>, x_hi: f64) -> Result<()> {
    let y_hi = panel
        .lines
        .iter()
        .flat_map(|l| l.1.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, (FONT, 12))
        .margin(8)
        .x_label_area_size(30)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..x_hi, 0.0..y_hi)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("s since the agent started")
        .y_desc(panel.y)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| {
            if *v >= 10.0 {
                format!("{v:.0}")
            } else if *v >= 1.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.2}")
            }
        })
        .label_style((FONT, 10))
        .draw()
        .map_err(plot_err)?;
    if panel.lines.is_empty() {
        chart
            .draw_series(std::iter::once(Text::new(
                "no samples",
                (x_hi * 0.4, y_hi * 0.5),
                (FONT, 12),
            )))
            .map_err(plot_err)?;
    }
    for (i, (name, points)) in panel.lines.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        // Points too: a quantile exists only while its window holds
        // observations, a few scrapes.
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 2, colour.filled())))
            .map_err(plot_err)?;
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], colour.stroke_width(2)));
    }
    if !panel.lines.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::MiddleLeft)
            .label_font((FONT, 9))
            .background_style(WHITE.mix(0.8))
            .border_style(RGBColor(200, 200, 200))
            .draw()
            .map_err(plot_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets_as_prometheus_does() {
        let buckets = [
            (0.1, 50.0),
            (0.2, 90.0),
            (0.4, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert_eq!(bucket_quantile(0.5, &buckets), Some(0.1));
        let p70 = bucket_quantile(0.7, &buckets).unwrap();
        assert!((p70 - 0.15).abs() < 1e-12, "{p70}");
        let p95 = bucket_quantile(0.95, &buckets).unwrap();
        assert!((p95 - 0.3).abs() < 1e-12, "{p95}");
        // Past the last finite bucket: its bound.
        let tail = [(0.1, 10.0), (f64::INFINITY, 20.0)];
        assert_eq!(bucket_quantile(0.99, &tail), Some(0.1));
        assert_eq!(
            bucket_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
    }

    #[test]
    fn series_names_split_into_labels() {
        let (name, labels) = parse_series(
            r#"ambpf_enrol_duration_seconds_bucket{mode="ebpf",step="maps",le="+Inf"}"#,
        );
        assert_eq!(name, "ambpf_enrol_duration_seconds_bucket");
        assert_eq!(labels["step"], "maps");
        assert_eq!(labels["le"], "+Inf");
        assert_eq!(
            parse_series("process_cpu_seconds_total").0,
            "process_cpu_seconds_total"
        );
    }
}
