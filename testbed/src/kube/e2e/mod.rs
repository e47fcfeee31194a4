//! The end-to-end suite on the real node: ambpf installed by its chart
//! (`helm install`, only the image values changed), the ztunnel double as a
//! DaemonSet sharing the ZDS socket's directory, pods made by the kubelet,
//! Services by kube-proxy. Each scenario runs in each mode it applies to.
//!
//! Capture is judged by the ztunnel double's log (every connection its
//! proxies take, with the pod, the listener and the original destination),
//! against a namespace that is not ambient, where the same traffic must
//! leave no trace in it: a scenario that cannot tell captured from
//! uncaptured fails.

mod bad_input;
mod client;
mod cni_config;
mod control_plane;
mod dns;
mod enrolment;
mod fidelity;
mod istio_agent;
mod lifecycle;
mod migration;
mod mode_switch;
mod node_state;
mod rollout;
mod rule_dump;
mod scale;
mod scenarios;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

pub use client::{Cluster, SYSTEM_NAMESPACE};
pub use istio_agent::{Agent, ISTIO_CNI_RELEASE};

/// The modes every scenario runs in: ambpf's eBPF mode and Istio's two
/// rule sets as ambpf applies them.
pub const MODES: [&str; 3] = ["ebpf", "iptables", "nftables"];

/// What the suite is told.
#[derive(Debug)]
pub struct Options {
    pub chart: PathBuf,
    pub out: PathBuf,
    pub modes: Vec<String>,
    /// Only scenarios whose name contains one of these.
    pub scenarios: Vec<String>,
}

/// One scenario's outcome in one mode.
#[derive(Debug, Serialize)]
pub struct Outcome {
    pub scenario: &'static str,
    pub mode: String,
    pub passed: bool,
    pub seconds: f64,
    /// What was seen, or why it failed.
    pub detail: String,
}

/// Runs the suite; fails if any scenario failed.
pub fn run(cluster: &Cluster, options: &Options) -> Result<()> {
    let mut outcomes = Vec::new();
    cluster.install_ztunnel()?;
    for mode in &options.modes {
        if !MODES.contains(&mode.as_str()) {
            bail!("no mode {mode}: {}", MODES.join(", "));
        }
    }
    // Every mode's scenarios on one install, then each isolated scenario
    // on one of its own.
    let mut installs: Vec<(&String, &[scenarios::Scenario])> = Vec::new();
    installs.extend(options.modes.iter().map(|m| (m, scenarios::ALL)));
    for scenario in scenarios::ISOLATED {
        installs.extend(
            options
                .modes
                .iter()
                .map(|m| (m, std::slice::from_ref(scenario))),
        );
    }
    for (mode, set) in installs {
        let selected: Vec<&scenarios::Scenario> = set
            .iter()
            .filter(|s| (s.applies)(mode) && selected(options, s.name))
            .collect();
        if selected.is_empty() {
            continue;
        }
        let release = cluster
            .helm_install(&options.chart, mode)
            .with_context(|| format!("installing ambpf in {mode} mode"));
        let release = match release {
            Ok(r) => r,
            Err(e) => {
                outcomes.push(Outcome {
                    scenario: "install",
                    mode: mode.clone(),
                    passed: false,
                    seconds: 0.0,
                    detail: format!("{e:#}"),
                });
                let _ = cluster.helm_uninstall();
                continue;
            }
        };
        for scenario in selected {
            let outcome = run_one(cluster, &release, scenario, mode);
            println!(
                "{} {:<28} {:<9} {:>6.1} s  {}",
                if outcome.passed { "ok  " } else { "FAIL" },
                outcome.scenario,
                outcome.mode,
                outcome.seconds,
                outcome.detail.lines().next().unwrap_or_default()
            );
            outcomes.push(outcome);
        }
        // Every install ends with the uninstall scenario's own checks, or a
        // plain uninstall when it was not selected.
        if cluster.release_installed()? {
            cluster.helm_uninstall()?;
        }
    }
    if let Some(dir) = options.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&options.out, serde_json::to_vec_pretty(&outcomes)?)?;
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.passed)
        .map(|o| format!("{} ({}): {}", o.scenario, o.mode, o.detail))
        .collect();
    println!(
        "{} of {} passed; results in {}",
        outcomes.len() - failed.len(),
        outcomes.len(),
        options.out.display()
    );
    if !failed.is_empty() {
        bail!("failed:\n{}", failed.join("\n"));
    }
    Ok(())
}

/// Whether `--scenario` selects the scenario `name` (none given: all but
/// those run on demand only, [`scenarios::ON_DEMAND`]).
fn selected(options: &Options, name: &str) -> bool {
    if options.scenarios.is_empty() {
        return !scenarios::ON_DEMAND.contains(&name);
    }
    options.scenarios.iter().any(|s| name.contains(s.as_str()))
}

fn run_one(
    cluster: &Cluster,
    release: &client::Release,
    scenario: &scenarios::Scenario,
    mode: &str,
) -> Outcome {
    let started = Instant::now();
    let result = (scenario.run)(cluster, release);
    Outcome {
        scenario: scenario.name,
        mode: mode.to_owned(),
        passed: result.is_ok(),
        seconds: started.elapsed().as_secs_f64(),
        detail: match result {
            Ok(seen) => seen,
            Err(e) => format!("{e:#}"),
        },
    }
}

/// Polls `check` until it returns `Some`, or fails naming `what`.
pub fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() > deadline {
            return Err(match last_error {
                Some(e) => e.context(format!("{what}: not after {} s", timeout.as_secs())),
                None => anyhow::anyhow!("{what}: not after {} s", timeout.as_secs()),
            });
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The chart's directory must hold a chart.
pub fn check_chart(chart: &Path) -> Result<()> {
    if !chart.join("Chart.yaml").is_file() {
        bail!("{} is not a chart", chart.display());
    }
    Ok(())
}
