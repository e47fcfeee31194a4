//! The summary: printed as tables and written as JSON like the benchmarks'
//! (`target/bench/soak.json` through `cargo xtask soak`).

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Counts, Soak, SoakConfig, agent::Sample, invariants::Violation};
use crate::bench::{Stats, Table};

#[derive(Clone, Debug, Default, Serialize)]
pub struct ConnStats {
    pub opened: u64,
    /// Echo checks passed (per pod, both connections).
    pub echoed: u64,
    pub reset: u64,
    /// Closed because the ztunnel that proxied them was taken over and
    /// stopped (their proxy ended; not the agent's doing).
    pub ended_with_ztunnel: u64,
}

/// A resource's trend over the longest-lived agent.
#[derive(Clone, Debug, Serialize)]
pub struct Slope {
    pub first: f64,
    pub last: f64,
    pub max: f64,
    /// Least-squares slope, per minute.
    pub per_minute: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Resources {
    pub pid: u32,
    pub span_s: f64,
    pub samples: usize,
    pub fds: Slope,
    pub threads: Slope,
    pub rss_kib: Slope,
}

#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    pub config: SoakConfig,
    pub duration_s: f64,
    pub events: Counts,
    pub faults: Counts,
    pub checks: Counts,
    pub agent_starts: u32,
    pub mid_snapshot_kills_hit: u64,
    /// Event to the pod held by ztunnel, ms.
    pub convergence_ms: Option<Stats>,
    /// Event to the pod gone from ztunnel, ms.
    pub removal_ms: Option<Stats>,
    pub slowest_convergence: Vec<super::invariants::Slow>,
    pub connections: ConnStats,
    /// Over the longest-lived agent, its first 5 s left out.
    pub resources: Option<Resources>,
    /// Over the whole run, every agent's samples but its first 5 s (a level
    /// that rises from one agent to the next shows here; `pid` is the last).
    pub resources_whole_run: Option<Resources>,
    pub violations: Vec<Violation>,
    /// Kept when anything failed.
    pub agent_log: Option<std::path::PathBuf>,
    pub samples: Vec<Sample>,
}

impl SoakReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The summary tables.
    pub fn print(&self) {
        let total = |c: &Counts| c.values().sum::<u64>();
        println!();
        println!(
            "Soak: {} pods, {:.0} s, {} mode, seed {}",
            self.config.pods,
            self.duration_s,
            self.config.mode.name(),
            self.config.seed
        );
        let mut table = Table::new(["what", "count"]);
        for (name, n) in &self.events {
            table.row([format!("event: {name}"), n.to_string()]);
        }
        table.row(["events applied".to_owned(), total(&self.events).to_string()]);
        for (name, n) in &self.faults {
            table.row([format!("fault: {name}"), n.to_string()]);
        }
        table.row([
            "faults injected".to_owned(),
            total(&self.faults).to_string(),
        ]);
        table.row([
            "  mid-snapshot kills that hit a partial snapshot".to_owned(),
            self.mid_snapshot_kills_hit.to_string(),
        ]);
        for (name, n) in &self.checks {
            table.row([format!("check: {name}"), n.to_string()]);
        }
        table.row([
            "invariant checks run".to_owned(),
            total(&self.checks).to_string(),
        ]);
        let c = &self.connections;
        table.row(["connection pairs opened".to_owned(), c.opened.to_string()]);
        table.row([
            "connection pair echo checks passed".to_owned(),
            c.echoed.to_string(),
        ]);
        table.row(["connection pairs reset".to_owned(), c.reset.to_string()]);
        table.row([
            "connection pairs ended with their ztunnel".to_owned(),
            c.ended_with_ztunnel.to_string(),
        ]);
        table.row(["violations".to_owned(), self.violations.len().to_string()]);
        print!("{table}");

        println!();
        let mut table = Table::new(["convergence (ms)", "n", "p50", "p99", "max"]);
        for (name, stats) in [
            ("held by ztunnel", &self.convergence_ms),
            ("gone from ztunnel", &self.removal_ms),
        ] {
            if let Some(s) = stats {
                table.row([
                    name.to_owned(),
                    s.count.to_string(),
                    format!("{:.1}", s.median),
                    format!("{:.1}", s.p99),
                    format!("{:.1}", s.max),
                ]);
            }
        }
        print!("{table}");
        for s in &self.slowest_convergence {
            println!(
                "  slow: {} took {:.0} ms (event at {:.1} s)",
                s.pod, s.ms, s.at_s
            );
        }

        for (what, r) in [
            ("the longest-lived agent", &self.resources),
            ("every agent of the run", &self.resources_whole_run),
        ] {
            let Some(r) = r else { continue };
            println!();
            println!(
                "Agent resources, {what} ({:.0} s, {} samples, start-ups left out)",
                r.span_s, r.samples
            );
            let mut table = Table::new(["resource", "first", "last", "max", "slope /min"]);
            for (name, s) in [
                ("fds", &r.fds),
                ("threads", &r.threads),
                ("RSS KiB", &r.rss_kib),
            ] {
                table.row([
                    name.to_owned(),
                    format!("{:.0}", s.first),
                    format!("{:.0}", s.last),
                    format!("{:.0}", s.max),
                    format!("{:+.2}", s.per_minute),
                ]);
            }
            print!("{table}");
        }
        println!();
        if self.violations.is_empty() {
            println!("No violations.");
        } else {
            println!("Violations:");
            let mut table = Table::new(["at s", "kind", "detail"]);
            for v in &self.violations {
                table.row([
                    format!("{:.1}", v.at_s),
                    v.kind.to_owned(),
                    v.detail.clone(),
                ]);
            }
            print!("{table}");
        }
    }
}

impl Soak<'_> {
    pub(super) fn report(&self) -> SoakReport {
        let samples = self
            .samples
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let tracker = self.tracker();
        SoakReport {
            config: self.cfg.clone(),
            duration_s: self.elapsed_s(),
            events: self.events.clone(),
            faults: self.faults.clone(),
            checks: self.checks.clone(),
            agent_starts: self.agent.starts,
            mid_snapshot_kills_hit: self.mid_snapshot_hits,
            convergence_ms: Stats::of(&tracker.enrol_ms),
            removal_ms: Stats::of(&tracker.remove_ms),
            slowest_convergence: tracker.slowest.clone(),
            connections: self.conn_stats.clone(),
            resources: resources(&samples),
            resources_whole_run: whole_run(&samples),
            violations: tracker.violations.clone(),
            agent_log: None,
            samples: samples.clone(),
        }
    }
}

/// The trends over every agent of the run, each one's start-up left out.
fn whole_run(samples: &[Sample]) -> Option<Resources> {
    let mut born: BTreeMap<u32, f64> = BTreeMap::new();
    for s in samples {
        born.entry(s.pid).or_insert(s.at_s);
    }
    let steady: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at_s >= born[&s.pid] + 5.0)
        .collect();
    trends(steady.last()?.pid, &steady)
}

/// The trends of the agent that lived longest.
fn resources(samples: &[Sample]) -> Option<Resources> {
    let mut by_pid: BTreeMap<u32, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        by_pid.entry(s.pid).or_default().push(s);
    }
    let (pid, life) = by_pid
        .into_iter()
        .max_by(|a, b| span(&a.1).total_cmp(&span(&b.1)))?;
    let born = life.first()?.at_s;
    // Start-up allocations are not a trend.
    let steady: Vec<&Sample> = life
        .iter()
        .copied()
        .filter(|s| s.at_s >= born + 5.0)
        .collect();
    let steady = if steady.len() >= 3 { steady } else { life };
    trends(pid, &steady)
}

fn trends(pid: u32, steady: &[&Sample]) -> Option<Resources> {
    let slope = |f: fn(&Sample) -> f64| {
        let points: Vec<(f64, f64)> = steady.iter().map(|s| (s.at_s, f(s))).collect();
        Slope {
            first: points.first().map_or(0.0, |p| p.1),
            last: points.last().map_or(0.0, |p| p.1),
            max: points.iter().map(|p| p.1).fold(f64::MIN, f64::max),
            per_minute: least_squares(&points) * 60.0,
        }
    };
    Some(Resources {
        pid,
        span_s: span(steady),
        samples: steady.len(),
        fds: slope(|s| s.fds as f64),
        threads: slope(|s| s.threads as f64),
        rss_kib: slope(|s| s.rss_kib as f64),
    })
}

fn span(samples: &[&Sample]) -> f64 {
    match (samples.first(), samples.last()) {
        (Some(a), Some(b)) => b.at_s - a.at_s,
        _ => 0.0,
    }
}

/// The least-squares slope of `points` (0 with fewer than two).
fn least_squares(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(x, y), p| (x + p.0 / n, y + p.1 / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(num, den), p| {
        (num + (p.0 - mx) * (p.1 - my), den + (p.0 - mx).powi(2))
    });
    if den == 0.0 { 0.0 } else { num / den }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slope_is_per_minute_of_the_longest_lived_agent() {
        let sample = |at_s: f64, pid: u32, fds: usize| Sample {
            at_s,
            pid,
            fds,
            threads: 4,
            rss_kib: 1000,
        };
        let mut samples = vec![sample(0.0, 1, 50), sample(1.0, 1, 90)];
        // pid 2 lives 60 s, its fds growing by 1 every 6 s after start-up.
        samples.extend((0..=60).map(|t| sample(t as f64 + 2.0, 2, 20 + t / 6)));
        let r = resources(&samples).unwrap();
        assert_eq!(r.pid, 2);
        assert!(
            (r.fds.per_minute - 10.0).abs() < 0.5,
            "{}",
            r.fds.per_minute
        );
        assert!(r.threads.per_minute.abs() < 1e-9);
        assert_eq!(least_squares(&[(0.0, 1.0), (2.0, 5.0)]), 2.0);
        // pid 1 lived under 5 s: nothing of it in the whole run's trend.
        let all = whole_run(&samples).unwrap();
        assert_eq!((all.pid, all.samples), (2, 56));
    }
}
