//! A hundred pods at once on the node: how long a Deployment scaled from 0
//! to 100 takes to be Ready and enrolled in an ambient namespace, against
//! the same scale-up in a namespace that is not ambient; and that scaling
//! back to 0 leaves nothing held.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};

use super::client::{Cluster, Release};
use super::enrolment::{
    PodState, check_pinned, cleanup, pod_states, server_deployment, wait_enrolled, wait_released,
};
use super::eventually;
use super::scenarios::direct_is_captured;

const REPLICAS: usize = 100;
const APP: &str = "many";
/// A hundred sandboxes on two cores: minutes, not seconds.
const SCALE_TIMEOUT: Duration = Duration::from_secs(600);

pub fn scale_100(cluster: &Cluster, release: &Release) -> Result<String> {
    let ambient = format!("e2e-{}-scale", release.mode);
    let plain = format!("{ambient}-plain");
    let result = scale_both(cluster, release, &ambient, &plain);
    cleanup(cluster, &[&ambient, &plain], result)
}

fn scale_both(cluster: &Cluster, release: &Release, ambient: &str, plain: &str) -> Result<String> {
    // The plain twin first, alone on the node: the baseline the ambient
    // scale-up is compared with.
    cluster.apply(&server_deployment(plain, false, APP, 0))?;
    let plain_ready = scale_up_plain(cluster, plain)?;
    scale_to_zero(cluster, plain)?;

    cluster.apply(&server_deployment(ambient, true, APP, 0))?;
    let started = Instant::now();
    scale(cluster, ambient, REPLICAS)?;
    let (pods, ready_after) = wait_all_ready(cluster, ambient, started)?;
    let enrolled = wait_enrolled(cluster, ambient, APP, REPLICAS, &[], SCALE_TIMEOUT)?;
    let enrolled_after = started.elapsed();
    let sample = &enrolled[0];
    ensure!(
        direct_is_captured(cluster, &sample.ip, &sample.uid)?,
        "{ambient}/{} is enrolled but not captured",
        sample.name
    );
    let uids: Vec<&str> = enrolled.iter().map(|p| p.uid.as_str()).collect();
    check_pinned(release, cluster, &uids)?;

    let released: HashSet<String> = pods
        .iter()
        .chain(&enrolled)
        .map(|p| p.uid.clone())
        .collect();
    let down = Instant::now();
    scale_to_zero(cluster, ambient)?;
    wait_released(cluster, release, &released, Duration::from_secs(120))?;
    Ok(format!(
        "0 -> {REPLICAS}: ambient Ready in {:.0} s, enrolled in {:.0} s; plain Ready in {:.0} s; \
         back to 0 and all {} released in {:.0} s",
        ready_after.as_secs_f64(),
        enrolled_after.as_secs_f64(),
        plain_ready.as_secs_f64(),
        released.len(),
        down.elapsed().as_secs_f64(),
    ))
}

/// Scales the plain twin to 100 and waits until all are Ready; none may be
/// annotated, held by ztunnel or captured. Returns the time to Ready.
fn scale_up_plain(cluster: &Cluster, plain: &str) -> Result<Duration> {
    let started = Instant::now();
    scale(cluster, plain, REPLICAS)?;
    let (pods, ready_after) = wait_all_ready(cluster, plain, started)?;
    let held = cluster.ztunnel_holds()?;
    let marked: Vec<&str> = pods
        .iter()
        .filter(|p| p.redirection.is_some() || held.contains_key(&p.uid))
        .map(|p| p.name.as_str())
        .collect();
    ensure!(
        marked.is_empty(),
        "pods outside the mesh annotated or held by ztunnel: {marked:?}"
    );
    let sample = &pods[0];
    ensure!(
        !direct_is_captured(cluster, &sample.ip, &sample.uid)?,
        "{plain}/{} is outside the mesh but captured",
        sample.name
    );
    Ok(ready_after)
}

/// Waits until the namespace's 100 pods are all Ready; returns them and
/// the time that took, counted from `started`.
fn wait_all_ready(
    cluster: &Cluster,
    namespace: &str,
    started: Instant,
) -> Result<(Vec<PodState>, Duration)> {
    let mut progress = String::from("no census yet");
    let pods = eventually(
        &format!("{REPLICAS} pods of {namespace} Ready"),
        SCALE_TIMEOUT,
        || {
            let pods = pod_states(cluster, namespace, APP)?;
            let ready = pods.iter().filter(|p| p.ready).count();
            progress = format!("{} pods, {ready} Ready", pods.len());
            Ok((pods.len() == REPLICAS && ready == REPLICAS).then_some(pods))
        },
    )
    .map_err(|e| e.context(progress))?;
    Ok((pods, started.elapsed()))
}

fn scale(cluster: &Cluster, namespace: &str, replicas: usize) -> Result<()> {
    cluster
        .kubectl(&[
            "scale",
            "deployment",
            "-n",
            namespace,
            APP,
            &format!("--replicas={replicas}"),
        ])
        .map(drop)
}

/// Scales to 0 and waits until every pod is gone.
fn scale_to_zero(cluster: &Cluster, namespace: &str) -> Result<()> {
    scale(cluster, namespace, 0)?;
    eventually(&format!("{namespace}'s pods gone"), SCALE_TIMEOUT, || {
        let pods = cluster.get_json(&["pods", "-n", namespace, "-l", &format!("app={APP}")])?;
        Ok(pods["items"]
            .as_array()
            .is_none_or(|a| a.is_empty())
            .then_some(()))
    })
}
