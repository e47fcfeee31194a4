//! The control plane failing under the agent: the API server stopped and
//! started again, changes made while the agent's watches are away, and
//! etcd compacted so that the watches cannot simply resume.
//!
//! What is exercised: on its return the API server fills its watch cache
//! from a fresh list, so a watch resuming from the agent's last
//! resourceVersion (older than that list) is answered with a `410 Gone`
//! ERROR event ("too old resource version"); were the watch served by etcd
//! instead, the compactions to etcd's newest revision (one while the API
//! server is down, one after the changes) make it `410` there too. kube-rs
//! then lists again and the agent must take the listed state whole: the
//! scenario fails unless the agent logged that 410 for its pod watch, and
//! judges every pod by capture, annotation and ztunnel's log.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;

use super::client::{Cluster, Release, SYSTEM_NAMESPACE};
use super::enrolment::{
    check_pinned, cleanup, pod_states, server_deployment, wait_enrolled, wait_released,
};
use super::eventually;
use super::scenarios::{direct_is_captured, ensure_web, redirection};
use crate::kube::daemons;

/// Long enough for the agent's retries to back off well past the API
/// server's return (0.8 s doubling: the retry after 24.8 s is the next
/// after 12 s), short of the node controller's grace for the node's lease.
const APISERVER_DOWN: Duration = Duration::from_secs(20);
const ENROL_TIMEOUT: Duration = Duration::from_secs(180);
/// What the agent logs when a watch's resourceVersion is gone.
const RELIST_LOG: &str = "resource version expired (410 Gone); listing them again";

pub fn apiserver_restart(cluster: &Cluster, release: &Release) -> Result<String> {
    let kept = format!("e2e-{}-restart", release.mode);
    let unlabelled = format!("{kept}-unlabel");
    let plain = format!("{kept}-plain");
    let result = restart_under_watch(cluster, release, &kept, &unlabelled, &plain);
    cleanup(cluster, &[&kept, &unlabelled, &plain], result)
}

fn restart_under_watch(
    cluster: &Cluster,
    release: &Release,
    kept: &str,
    unlabelled: &str,
    plain: &str,
) -> Result<String> {
    ensure_web(cluster, kept, true)?;
    cluster.kubectl(&["scale", "deployment", "-n", kept, "web", "--replicas=4"])?;
    cluster.rollout(kept, "web")?;
    ensure_web(cluster, unlabelled, true)?;
    ensure_web(cluster, plain, false)?;
    let web = wait_enrolled(cluster, kept, "web", 4, &[], ENROL_TIMEOUT)?;
    let doomed = wait_enrolled(cluster, unlabelled, "web", 2, &[], ENROL_TIMEOUT)?;
    let (stay, changed) = web.split_at(2);
    let (opted, deleted) = (&changed[0], &changed[1]);
    let plain_pod = pod_states(cluster, plain, "web")?
        .into_iter()
        .next()
        .context("no plain web pod")?;

    let started = Instant::now();
    let events_before = cluster.ztunnel_events()?.len();
    let restarts_before = agent_restarts(cluster)?;

    daemons::stop(&cluster.layout, "kube-apiserver", Duration::from_secs(15))?;
    // Down long enough for the agent's retries to back off; compacting
    // meanwhile puts its watches' resourceVersions out of etcd's reach.
    std::thread::sleep(APISERVER_DOWN);
    let outage = compact_etcd(cluster);
    let back = start_apiserver(cluster);
    let first_compaction = outage?;
    back?;

    // The changes the agent must see, while its watches are still backing
    // off: new ambient pods, a deletion (and its replacement), an opt-out,
    // a namespace leaving the mesh.
    cluster.apply(&server_deployment(kept, true, "fresh", 2))?;
    cluster.kubectl(&["delete", "pod", "-n", kept, &deleted.name, "--wait=false"])?;
    cluster.kubectl(&[
        "label",
        "pod",
        "-n",
        kept,
        &opted.name,
        "istio.io/dataplane-mode=none",
    ])?;
    cluster.kubectl(&["label", "namespace", unlabelled, "istio.io/dataplane-mode-"])?;
    let last_compaction = compact_etcd(cluster)?;

    let relisted = eventually(
        "the agent's pod watch answered 410 and listed again",
        Duration::from_secs(90),
        || {
            let log = agent_log_since(cluster, started)?;
            Ok(log
                .lines()
                .any(|l| l.contains("watching pods") && l.contains(RELIST_LOG))
                .then_some(log))
        },
    )?;
    let namespaces_relisted = relisted
        .lines()
        .any(|l| l.contains("watching namespaces") && l.contains(RELIST_LOG));

    // Every pod that should be captured is: the two left alone, the
    // deleted one's replacement and the two new ones.
    let webs = wait_enrolled(cluster, kept, "web", 3, &[&opted.name], ENROL_TIMEOUT)?;
    let fresh = wait_enrolled(cluster, kept, "fresh", 2, &[], ENROL_TIMEOUT)?;
    for pod in webs.iter().chain(&fresh) {
        ensure!(
            direct_is_captured(cluster, &pod.ip, &pod.uid)?,
            "{kept}/{} is enrolled but not captured",
            pod.name
        );
    }
    let enrolled: Vec<&str> = webs.iter().chain(&fresh).map(|p| p.uid.as_str()).collect();
    check_pinned(release, cluster, &enrolled)?;

    // Those that should not be are not.
    let released: HashSet<String> = doomed
        .iter()
        .chain([opted, deleted])
        .map(|p| p.uid.clone())
        .collect();
    wait_released(cluster, release, &released, Duration::from_secs(60))?;
    for (namespace, pod) in doomed
        .iter()
        .map(|p| (unlabelled, p))
        .chain([(kept, opted)])
    {
        eventually(
            &format!("{}'s annotation cleared", pod.name),
            Duration::from_secs(60),
            || {
                Ok(redirection(cluster, namespace, &pod.name)?
                    .is_none()
                    .then_some(()))
            },
        )?;
        ensure!(
            !direct_is_captured(cluster, &pod.ip, &pod.uid)?,
            "{namespace}/{} left the mesh but is still captured",
            pod.name
        );
    }
    ensure!(
        !direct_is_captured(cluster, &plain_pod.ip, &plain_pod.uid)?,
        "{plain}/{} is outside the mesh but captured",
        plain_pod.name
    );

    // None that stayed ambient was removed in error: no Del, no re-Add,
    // no reconnection of the agent to ztunnel, no agent restart.
    let events = cluster.ztunnel_events()?;
    let after = &events[events_before.min(events.len())..];
    let churn = churn_of(after, stay.iter().map(|p| p.uid.as_str()));
    ensure!(churn.is_empty(), "pods that stayed ambient were {churn:?}");
    let reconnections = after.iter().filter(|e| e["event"] == "connected").count();
    ensure!(
        reconnections == 0,
        "the agent reconnected to ztunnel {reconnections} times"
    );
    ensure!(
        agent_restarts(cluster)? == restarts_before,
        "the agent restarted while the API server was away"
    );
    for pod in stay {
        ensure!(
            redirection(cluster, kept, &pod.name)?.as_deref() == Some("enabled"),
            "{} lost its annotation",
            pod.name
        );
    }

    Ok(format!(
        "API server down {} s; etcd compacted at revisions {first_compaction} and \
         {last_compaction}; 410 and relist of pods{}; 2 new pods and a replacement enrolled, \
         an opt-out, a deletion and an unlabelled namespace's 2 pods released, 2 untouched pods \
         never sent Del or Add",
        APISERVER_DOWN.as_secs(),
        if namespaces_relisted {
            " and namespaces"
        } else {
            ""
        },
    ))
}

/// Starts the API server again and waits until it is ready.
fn start_apiserver(cluster: &Cluster) -> Result<()> {
    daemons::start(&cluster.layout, &cluster.components, "kube-apiserver")?;
    eventually(
        "the API server ready again",
        Duration::from_secs(120),
        || {
            Ok(cluster
                .kubectl(&["get", "--raw", "/readyz"])
                .is_ok()
                .then_some(()))
        },
    )
    .map_err(|e| e.context(daemons::log_tail(&cluster.layout, "kube-apiserver", 20)))
}

/// Compacts etcd to its newest revision (through its v3 JSON gateway, with
/// the API server's client certificate); returns that revision.
fn compact_etcd(cluster: &Cluster) -> Result<u64> {
    let header = etcd(cluster, "/v3/kv/range", r#"{"key":"AA=="}"#)?;
    let revision: u64 = header["header"]["revision"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .with_context(|| format!("no revision in etcd's answer {header}"))?;
    etcd(
        cluster,
        "/v3/kv/compaction",
        &format!(r#"{{"revision":"{revision}","physical":true}}"#),
    )?;
    Ok(revision)
}

fn etcd(cluster: &Cluster, path: &str, body: &str) -> Result<Value> {
    let pki = cluster.layout.pki();
    let file = |name: &str| pki.join(name).display().to_string();
    let out = cluster.on_node(
        "curl",
        &[
            "-sS",
            "--fail-with-body",
            "--cacert",
            &file("ca.crt"),
            "--cert",
            &file("apiserver-etcd-client.crt"),
            "--key",
            &file("apiserver-etcd-client.key"),
            "-X",
            "POST",
            &format!("https://127.0.0.1:2379{path}"),
            "-d",
            body,
        ],
    )?;
    serde_json::from_str(&out).with_context(|| format!("etcd's answer to {path}: {out}"))
}

/// The agent's log since `started` (with a margin for clock granularity).
fn agent_log_since(cluster: &Cluster, started: Instant) -> Result<String> {
    cluster.kubectl(&[
        "logs",
        "-n",
        SYSTEM_NAMESPACE,
        "daemonset/ambpf",
        "-c",
        "agent",
        &format!("--since={}s", started.elapsed().as_secs() + 5),
    ])
}

/// The restarts of the agent's containers so far.
fn agent_restarts(cluster: &Cluster) -> Result<u64> {
    let pods = cluster.get_json(&[
        "pods",
        "-n",
        SYSTEM_NAMESPACE,
        "-l",
        "app.kubernetes.io/name=ambpf",
    ])?;
    Ok(pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| {
            p["status"]["containerStatuses"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|c| c["restartCount"].as_u64())
        .sum())
}

/// The ZDS Adds and Dels ztunnel got for any of `uids`, as `event uid`.
fn churn_of<'a>(events: &[Value], uids: impl Iterator<Item = &'a str>) -> Vec<String> {
    let uids: Vec<&str> = uids.collect();
    events
        .iter()
        .filter(|e| e["event"] == "add" || e["event"] == "del")
        .filter_map(|e| {
            let uid = e["uid"].as_str()?;
            uids.contains(&uid)
                .then(|| format!("{} {uid}", e["event"].as_str().unwrap_or_default()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn churn_names_adds_and_dels_of_the_given_pods_only() {
        let events = [
            json!({"event": "add", "uid": "a", "netns_inode": 1}),
            json!({"event": "connection", "uid": "a"}),
            json!({"event": "del", "uid": "b"}),
            json!({"event": "del", "uid": "c"}),
            json!({"event": "keep", "uid": "a"}),
        ];
        let churn = super::churn_of(&events, ["a", "b"].into_iter());
        assert_eq!(churn, ["add a", "del b"]);
    }
}
