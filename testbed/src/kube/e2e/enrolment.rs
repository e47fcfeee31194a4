//! Pods' enrolment as the suite judges it, for many pods at once: Ready,
//! annotated `enabled` by the agent, held by ztunnel; and released: no
//! annotation, no ztunnel hold, nothing in ambpf's pinned state.

use std::{collections::HashSet, time::Duration};

use anyhow::{Result, ensure};
use serde_json::Value;

use super::client::{Cluster, Release};
use super::eventually;
use super::scenarios::WEB_PORT;
use crate::kube::manifest::{AMBIENT, AppDeployment, httpd};

/// One pod as read from the API server.
#[derive(Debug, Clone)]
pub(super) struct PodState {
    pub name: String,
    pub uid: String,
    pub ip: String,
    pub ready: bool,
    /// `ambient.istio.io/redirection`, if set.
    pub redirection: Option<String>,
}

impl PodState {
    fn from_json(pod: &Value) -> Self {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let ready = pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        Self {
            name: text(&pod["metadata"]["name"]),
            uid: text(&pod["metadata"]["uid"]),
            ip: text(&pod["status"]["podIP"]),
            ready,
            redirection: pod["metadata"]["annotations"]["ambient.istio.io/redirection"]
                .as_str()
                .map(str::to_owned),
        }
    }

    /// Ready, marked `enabled` by the agent, and held by ztunnel.
    pub fn enrolled(&self, held: &std::collections::HashMap<String, u64>) -> bool {
        self.ready && self.redirection.as_deref() == Some("enabled") && held.contains_key(&self.uid)
    }
}

/// The pods of `namespace` labelled `app=<app>`, not being deleted.
pub(super) fn pod_states(cluster: &Cluster, namespace: &str, app: &str) -> Result<Vec<PodState>> {
    let pods = cluster.get_json(&["pods", "-n", namespace, "-l", &format!("app={app}")])?;
    Ok(pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(PodState::from_json)
        .collect())
}

/// Waits until `namespace` has exactly `count` pods of `app` besides
/// `excluded` (by name), every one enrolled; returns them.
pub(super) fn wait_enrolled(
    cluster: &Cluster,
    namespace: &str,
    app: &str,
    count: usize,
    excluded: &[&str],
    timeout: Duration,
) -> Result<Vec<PodState>> {
    let mut progress = String::from("no census yet");
    eventually(
        &format!("{count} {app} pods of {namespace} enrolled"),
        timeout,
        || {
            let pods: Vec<PodState> = pod_states(cluster, namespace, app)?
                .into_iter()
                .filter(|p| !excluded.contains(&p.name.as_str()))
                .collect();
            let held = cluster.ztunnel_holds()?;
            let ready = pods.iter().filter(|p| p.ready).count();
            let enrolled = pods.iter().filter(|p| p.enrolled(&held)).count();
            progress = format!(
                "{} pods, {ready} Ready, {enrolled} Ready, annotated and held by ztunnel",
                pods.len()
            );
            Ok((pods.len() == count && enrolled == count).then_some(pods))
        },
    )
    .map_err(|e| e.context(progress))
}

/// Waits until ztunnel holds none of `uids` and, in eBPF mode, ambpf's
/// pinned state has none of them either.
pub(super) fn wait_released(
    cluster: &Cluster,
    release: &Release,
    uids: &HashSet<String>,
    timeout: Duration,
) -> Result<()> {
    let mut left = Vec::new();
    eventually("pods released by ztunnel", timeout, || {
        left = cluster
            .ztunnel_holds()?
            .into_keys()
            .filter(|uid| uids.contains(uid))
            .collect();
        Ok(left.is_empty().then_some(()))
    })
    .map_err(|e| e.context(format!("ztunnel still holds {left:?}")))?;
    if release.mode == "ebpf" {
        let pinned: Vec<String> = cluster
            .ambpf_pods()?
            .into_iter()
            .map(|(uid, _)| uid)
            .filter(|uid| uids.contains(uid))
            .collect();
        ensure!(pinned.is_empty(), "ambpf still holds {pinned:?}");
    }
    Ok(())
}

/// In eBPF mode, every one of `uids` is in ambpf's pinned state.
pub(super) fn check_pinned(release: &Release, cluster: &Cluster, uids: &[&str]) -> Result<()> {
    if release.mode != "ebpf" {
        return Ok(());
    }
    let pinned: HashSet<String> = cluster
        .ambpf_pods()?
        .into_iter()
        .map(|(uid, _)| uid)
        .collect();
    let missing: Vec<&&str> = uids.iter().filter(|u| !pinned.contains(**u)).collect();
    ensure!(missing.is_empty(), "ambpf does not hold {missing:?}");
    Ok(())
}

/// A namespace (ambient or not) with a Deployment of `replicas` busybox
/// httpd pods labelled `app=<app>`, with no probes (so that a hundred of
/// them do not load the node with probes).
pub(super) fn server_deployment(
    namespace: &str,
    ambient: bool,
    app: &str,
    replicas: u32,
) -> String {
    AppDeployment {
        namespace,
        labels: if ambient { &[AMBIENT] } else { &[] },
        app,
        replicas: replicas as usize,
        container: "server",
        shell: &httpd(WEB_PORT),
        container_fields: &[],
        service_links: true,
    }
    .yaml()
}

/// Deletes the scenario's namespaces without waiting; `result` is the
/// scenario's, and wins over a failed deletion.
pub(super) fn cleanup<T>(cluster: &Cluster, namespaces: &[&str], result: Result<T>) -> Result<T> {
    let mut args = vec!["delete", "namespace"];
    args.extend(namespaces);
    args.extend(["--wait=false", "--ignore-not-found"]);
    let deleted = cluster.kubectl(&args);
    let value = result?;
    deleted?;
    Ok(value)
}
