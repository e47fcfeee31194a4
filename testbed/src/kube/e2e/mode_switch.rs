//! `helm upgrade --set redirectMode=<another>` and back, under traffic: a
//! pod opening a connection every 5 ms and holding long ones open to an
//! ambient echo server, for the whole of both switches. The agent of the
//! new mode enrols every pod beside the old capture, then retires the old
//! one (the agent's `redirect::retire`); every connection must succeed, none
//! may be reset, new ones stay captured, and each switch ends with the new
//! agent saying the old mode is retired. Run from each mode ([`plan`]).

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};

use super::client::{Cluster, Release};
use super::eventually;
use super::rollout::{captured_after, judge, start_traffic, stop_generator};

/// How long the traffic runs before the first switch.
const LEAD: Duration = Duration::from_secs(5);
/// How long the traffic runs around the switches, at least.
const AT_LEAST: Duration = Duration::from_secs(30);

/// The switches from each mode, in order, ending in it: the three modes'
/// runs cover every ordered pair, each under the generator's traffic.
fn plan(mode: &str) -> &'static [(&'static str, &'static str)] {
    match mode {
        "ebpf" => &[("ebpf", "iptables"), ("iptables", "ebpf")],
        "iptables" => &[("iptables", "nftables"), ("nftables", "iptables")],
        _ => &[("nftables", "ebpf"), ("ebpf", "nftables")],
    }
}

pub fn mode_switch(cluster: &Cluster, release: &Release) -> Result<String> {
    let namespace = format!("e2e-{}-switch", release.mode);
    let result = switches_under_traffic(cluster, release, &namespace);
    if result.is_err() {
        // The scenarios after run in the release's own mode.
        let _ = cluster.helm_set_mode(&release.chart, &release.mode);
    }
    cluster.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    result
}

fn switches_under_traffic(cluster: &Cluster, release: &Release, namespace: &str) -> Result<String> {
    let (echo, generator, captured) = start_traffic(cluster, namespace)?;
    let traffic = Instant::now();
    // Traffic before the first switch as well as after the last.
    std::thread::sleep(LEAD);
    let mut switches = Vec::new();
    for (from, to) in plan(&release.mode) {
        switches.push(switch(cluster, release, from, to)?);
    }
    let captured_after = captured_after(cluster, &generator, &echo, "the switches")?;
    std::thread::sleep(AT_LEAST.saturating_sub(traffic.elapsed()));
    let summary = stop_generator(cluster, namespace, &generator.name)?;
    judge(&summary, captured, captured_after, &switches.join(", "))
}

/// One `helm upgrade` from `from` to `to`, until the old mode is retired.
fn switch(cluster: &Cluster, release: &Release, from: &str, to: &str) -> Result<String> {
    let began = Instant::now();
    cluster
        .helm_set_mode(&release.chart, to)
        .with_context(|| format!("switching from {from} to {to}"))?;
    let upgraded = began.elapsed().as_secs_f64();
    retired(cluster, from, to)?;
    Ok(format!(
        "{from} -> {to} in {upgraded:.1} s, retired after {:.1} s",
        began.elapsed().as_secs_f64()
    ))
}

/// Waits until the agent running in `to` mode has retired the `from` mode
/// (its log says so), and checks that it says nothing of a pod left
/// behind.
fn retired(cluster: &Cluster, from: &str, to: &str) -> Result<()> {
    let done = format!("the {from} mode is retired");
    let log = eventually(
        &format!("the {to} agent retiring the {from} mode"),
        Duration::from_secs(90),
        || {
            let log = cluster.agent_log()?;
            Ok(log.contains(&done).then_some(log))
        },
    )
    .with_context(|| cluster.agent_diagnostics())?;
    let trouble: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("retried after the next pass"))
        .collect();
    ensure!(
        trouble.is_empty(),
        "the {to} agent retired the {from} mode after trouble:\n{}",
        trouble.join("\n")
    );
    Ok(())
}
