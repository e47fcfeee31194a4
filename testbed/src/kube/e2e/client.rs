//! The suite's hands on the cluster: kubectl and helm as the cluster's
//! admin, commands in the node's and the outside's namespaces, and the
//! ztunnel double's log.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use super::eventually;
use crate::kube::{Components, Layout, in_node};

/// The namespace ambpf and the ztunnel double are installed in, as
/// ztunnel's.
pub const SYSTEM_NAMESPACE: &str = "istio-system";
pub const RELEASE: &str = "ambpf";
/// The chart's label on ambpf's pods.
const AMBPF_SELECTOR: &str = "app.kubernetes.io/name=ambpf";

/// The node, as the suite drives it.
#[derive(Debug)]
pub struct Cluster {
    pub layout: Layout,
    pub components: Components,
    pub helm: PathBuf,
    /// ambpf's image, as `repository:tag`.
    pub ambpf_image: String,
}

/// An installed release of the chart.
#[derive(Debug, Clone)]
pub struct Release {
    pub mode: String,
    /// The chart it was installed from, to install it again.
    pub chart: PathBuf,
    /// The node before the install, for the uninstall's comparison.
    pub before: super::node_state::NodeState,
}

impl Cluster {
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        crate::kube::kubectl(&self.layout, &self.components, args)
    }

    /// `kubectl <args>` to run as the caller likes (its status read).
    pub fn kubectl_command(&self, args: &[&str]) -> Command {
        let kubectl = self.components.kube("kubectl");
        let mut cmd = in_node(&self.layout, &kubectl.display().to_string());
        cmd.arg(format!(
            "--kubeconfig={}",
            self.layout.admin_kubeconfig().display()
        ))
        .args(args);
        cmd
    }

    /// `kubectl apply -f -` with `yaml`.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        crate::kube::kubectl_apply(&self.layout, &self.components, yaml)
    }

    /// A JSON object from `kubectl get <args> -o json`.
    pub fn get_json(&self, args: &[&str]) -> Result<Value> {
        let mut all = vec!["get"];
        all.extend(args);
        all.extend(["-o", "json"]);
        Ok(serde_json::from_str(&self.kubectl(&all)?)?)
    }

    /// A command in the node's namespaces (as a hostNetwork process).
    pub fn on_node(&self, program: &str, args: &[&str]) -> Result<String> {
        crate::kube::checked_stdout(in_node(&self.layout, program).args(args), program, args)
    }

    /// A command on the off-node client (the outside namespace); its
    /// output and whether it succeeded.
    pub fn from_outside(&self, program: &str, args: &[&str]) -> Result<(bool, String)> {
        outcome(
            Command::new("ip")
                .args(["netns", "exec", &self.layout.outside_netns, program])
                .args(args),
        )
    }

    pub(super) fn helm(&self) -> Command {
        // helm reads the chart from the host's files and reaches the API
        // server in the node's network namespace.
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.layout.node_netns))
            .arg("--")
            .arg(&self.helm)
            .arg("--kubeconfig")
            .arg(self.layout.admin_kubeconfig());
        cmd
    }

    /// `helm install ambpf <chart>` with only the image values (and the
    /// mode) set, as users install it; waits until the DaemonSet is Ready.
    pub fn helm_install(&self, chart: &Path, mode: &str) -> Result<Release> {
        self.helm_install_as(chart, mode, true)
    }

    /// [`Cluster::helm_install`], waiting for the DaemonSet to be Ready or
    /// not (`wait`: an agent standing by beside Istio's is not Ready).
    pub fn helm_install_as(&self, chart: &Path, mode: &str, wait: bool) -> Result<Release> {
        let before = super::node_state::NodeState::read(self)?;
        let (repository, tag) = self
            .ambpf_image
            .rsplit_once(':')
            .context("ambpf's image has no tag")?;
        let out = self
            .helm()
            .args(["install", RELEASE])
            .arg(chart)
            .args(["-n", SYSTEM_NAMESPACE, "--create-namespace"])
            .args(["--set", &format!("image.repository={repository}")])
            .args(["--set", &format!("image.tag={tag}")])
            .args(["--set", "image.pullPolicy=Never"])
            .args(["--set", &format!("redirectMode={mode}")])
            .args(if wait {
                &["--wait", "--timeout", "120s"][..]
            } else {
                &[]
            })
            .output()?;
        if !out.status.success() {
            bail!(
                "helm install: {}\n{}",
                String::from_utf8_lossy(&out.stderr).trim(),
                self.agent_diagnostics()
            );
        }
        Ok(Release {
            mode: mode.to_owned(),
            chart: chart.to_owned(),
            before,
        })
    }

    /// `helm upgrade` of ambpf's release to redirection mode `mode`, the
    /// rest of its values as they are, waited for.
    pub fn helm_set_mode(&self, chart: &Path, mode: &str) -> Result<()> {
        let out = self
            .helm()
            .args(["upgrade", RELEASE])
            .arg(chart)
            .args(["-n", SYSTEM_NAMESPACE, "--reuse-values"])
            .args(["--set", &format!("redirectMode={mode}")])
            .args(["--wait", "--timeout", "180s"])
            .output()?;
        if !out.status.success() {
            bail!(
                "helm upgrade to {mode}: {}\n{}",
                String::from_utf8_lossy(&out.stderr).trim(),
                self.agent_diagnostics()
            );
        }
        Ok(())
    }

    /// The running agent's log, whole.
    pub fn agent_log(&self) -> Result<String> {
        self.kubectl(&[
            "logs",
            "-n",
            SYSTEM_NAMESPACE,
            "-l",
            AMBPF_SELECTOR,
            "-c",
            "agent",
            "--tail=-1",
        ])
    }

    pub fn helm_uninstall(&self) -> Result<()> {
        self.uninstall_release(RELEASE, AMBPF_SELECTOR)
    }

    /// `helm uninstall <release>`, then waits until the pods matching
    /// `selector` are gone: a DaemonSet's pods are gone only once their
    /// shutdown ran.
    pub(super) fn uninstall_release(&self, release: &str, selector: &str) -> Result<()> {
        let out = self
            .helm()
            .args(["uninstall", release, "-n", SYSTEM_NAMESPACE])
            .args(["--wait", "--timeout", "120s"])
            .output()?;
        if !out.status.success() {
            bail!(
                "helm uninstall {release}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        eventually(
            &format!("{release}'s pods gone"),
            Duration::from_secs(90),
            || {
                let pods = self.get_json(&["pods", "-n", SYSTEM_NAMESPACE, "-l", selector])?;
                Ok(pods["items"]
                    .as_array()
                    .is_none_or(|a| a.is_empty())
                    .then_some(()))
            },
        )
    }

    pub fn release_installed(&self) -> Result<bool> {
        self.release_exists(RELEASE)
    }

    pub(super) fn release_exists(&self, release: &str) -> Result<bool> {
        let out = self
            .helm()
            .args(["status", release, "-n", SYSTEM_NAMESPACE])
            .output()?;
        Ok(out.status.success())
    }

    /// Status, events and logs of ambpf's pods, for a failure's message.
    pub fn agent_diagnostics(&self) -> String {
        self.pods_diagnostics(AMBPF_SELECTOR)
    }

    /// Status, events and logs of the pods matching `selector`.
    pub(super) fn pods_diagnostics(&self, selector: &str) -> String {
        let mut text = String::new();
        for args in [
            vec!["get", "pods", "-A", "-o", "wide"],
            vec!["describe", "pods", "-n", SYSTEM_NAMESPACE, "-l", selector],
            vec![
                "logs",
                "-n",
                SYSTEM_NAMESPACE,
                "-l",
                selector,
                "--all-containers",
                "--tail=40",
            ],
        ] {
            match self.kubectl(&args) {
                Ok(out) => text.push_str(&out),
                Err(e) => text.push_str(&format!("{e:#}\n")),
            }
        }
        text
    }

    /// The ztunnel double's DaemonSet, Ready.
    pub fn install_ztunnel(&self) -> Result<()> {
        self.apply(include_str!("../../../manifests/ztunnel-double.yaml"))?;
        self.kubectl(&[
            "rollout",
            "status",
            "-n",
            SYSTEM_NAMESPACE,
            "daemonset/ztunnel",
            "--timeout=120s",
        ])
        .map(drop)
    }

    /// Every event the ztunnel double logged, oldest first (its JSON lines).
    pub fn ztunnel_events(&self) -> Result<Vec<Value>> {
        self.ztunnel_log("--tail=-1")
    }

    /// The events the double logged in the last `seconds`: cheap under
    /// heavy traffic, and whole even after the kubelet rotated the log.
    pub fn recent_ztunnel_events(&self, seconds: u64) -> Result<Vec<Value>> {
        self.ztunnel_log(&format!("--since={seconds}s"))
    }

    fn ztunnel_log(&self, window: &str) -> Result<Vec<Value>> {
        let log = self.kubectl(&["logs", "-n", SYSTEM_NAMESPACE, "daemonset/ztunnel", window])?;
        Ok(log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .collect())
    }

    /// The proxied connections the double logged for pod `uid`.
    pub fn proxied_for(&self, uid: &str) -> Result<Vec<Value>> {
        Ok(self
            .ztunnel_events()?
            .into_iter()
            .filter(|e| e["event"] == "connection" && e["uid"] == uid)
            .collect())
    }

    /// How many connections the double proxied for these pods, on one of
    /// its listeners (15001 outbound, 15006 inbound) or on any.
    pub fn proxied_count(
        &self,
        pods: &[(String, String, String)],
        listener: Option<u16>,
    ) -> Result<usize> {
        Ok(self
            .ztunnel_events()?
            .iter()
            .filter(|e| e["event"] == "connection")
            .filter(|e| pods.iter().any(|(_, uid, _)| e["uid"] == uid.as_str()))
            .filter(|e| listener.is_none_or(|port| e["listener_port"] == port))
            .count())
    }

    /// The pods of `namespace` with label `app=<app>`: `(name, uid, ip)`.
    pub fn pods(&self, namespace: &str, app: &str) -> Result<Vec<(String, String, String)>> {
        let pods = self.get_json(&["pods", "-n", namespace, "-l", &format!("app={app}")])?;
        Ok(pods["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .map(|p| {
                        (
                            p["metadata"]["name"]
                                .as_str()
                                .unwrap_or_default()
                                .to_owned(),
                            p["metadata"]["uid"].as_str().unwrap_or_default().to_owned(),
                            p["status"]["podIP"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Waits until a rollout of `deployment` in `namespace` is complete.
    pub fn rollout(&self, namespace: &str, deployment: &str) -> Result<()> {
        self.kubectl(&[
            "rollout",
            "status",
            "-n",
            namespace,
            &format!("deployment/{deployment}"),
            "--timeout=120s",
        ])
        .map(drop)
    }
}

impl Cluster {
    /// The pods ztunnel holds now, by UID, with the network namespace
    /// (inode) it was handed: the last connection's snapshot, then the
    /// adds and deletes after it.
    pub fn ztunnel_holds(&self) -> Result<std::collections::HashMap<String, u64>> {
        Ok(holds(&self.ztunnel_events()?))
    }

    /// `ctr` against the node's containerd, in the CRI plugin's namespace.
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        crate::kube::checked_stdout(crate::kube::ctr(&self.layout).args(args), "ctr", args)
    }

    /// The pod's sandbox containers (the runtime's IDs).
    pub fn sandboxes(&self, uid: &str) -> Result<Vec<String>> {
        let filter = format!(
            "labels.\"io.kubernetes.pod.uid\"=={uid},labels.\"io.cri-containerd.kind\"==sandbox"
        );
        Ok(self
            .ctr(&["containers", "list", "-q", &filter])?
            .lines()
            .map(str::to_owned)
            .collect())
    }

    /// Moves a DaemonSet off the node (a node selector nothing matches) or
    /// back, and waits until its pods are gone or Ready.
    pub fn park_daemonset(&self, namespace: &str, name: &str, parked: bool) -> Result<()> {
        let patch = if parked {
            r#"{"spec":{"template":{"spec":{"nodeSelector":{"ambpf.e2e/parked":"true"}}}}}"#
                .to_owned()
        } else {
            r#"[{"op":"remove","path":"/spec/template/spec/nodeSelector/ambpf.e2e~1parked"}]"#
                .to_owned()
        };
        let kind = if parked { "strategic" } else { "json" };
        self.kubectl(&[
            "patch",
            "daemonset",
            "-n",
            namespace,
            name,
            "--type",
            kind,
            "-p",
            &patch,
        ])?;
        if parked {
            eventually(
                &format!("{name}'s pods gone"),
                Duration::from_secs(90),
                || {
                    let pods =
                        self.get_json(&["pods", "-n", namespace, "-l", &daemonset_selector(name)])?;
                    Ok(pods["items"]
                        .as_array()
                        .is_none_or(|a| a.is_empty())
                        .then_some(()))
                },
            )
        } else {
            self.kubectl(&[
                "rollout",
                "status",
                "-n",
                namespace,
                &format!("daemonset/{name}"),
                "--timeout=120s",
            ])
            .map(drop)
        }
    }

    /// ambpf's `status -o json` from its agent container (eBPF mode).
    /// The pods ambpf's pinned state holds (eBPF mode), as (uid, netns inode).
    pub fn ambpf_pods(&self) -> Result<Vec<(String, u64)>> {
        let status = self.ambpf_status()?;
        Ok(status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                (
                    p["pod"]["uid"].as_str().unwrap_or_default().to_owned(),
                    p["netns_inode"].as_u64().unwrap_or_default(),
                )
            })
            .collect())
    }

    /// `ambpf status --check` in the agent's pod: whether it passed, and
    /// what it said.
    pub fn ambpf_status_check(&self) -> Result<(bool, String)> {
        outcome(&mut self.ambpf_in_agent(&["status", "--check"]))
    }

    fn ambpf_status(&self) -> Result<Value> {
        let out = crate::kube::checked_stdout(
            &mut self.ambpf_in_agent(&["status", "-o", "json"]),
            "ambpf",
            &["status", "-o", "json"],
        )?;
        Ok(serde_json::from_str(&out)?)
    }

    /// `ambpf <args>` in the agent's container, on ambpf's pin root.
    fn ambpf_in_agent(&self, args: &[&str]) -> Command {
        let mut all = vec![
            "exec",
            "-n",
            SYSTEM_NAMESPACE,
            "daemonset/ambpf",
            "-c",
            "agent",
            "--",
            "ambpf",
            "--pin-root",
            "/sys/fs/bpf/ambpf",
        ];
        all.extend(args);
        self.kubectl_command(&all)
    }

    /// `kubectl rollout status` of DaemonSet `name` in the system namespace.
    pub fn daemonset_rolled_out(&self, name: &str, timeout: Duration) -> Result<()> {
        self.kubectl(&[
            "rollout",
            "status",
            "-n",
            SYSTEM_NAMESPACE,
            &format!("daemonset/{name}"),
            &format!("--timeout={}s", timeout.as_secs()),
        ])
        .map(drop)
    }

    /// `kubectl rollout restart` of DaemonSet `name`, waited for.
    pub fn restart_daemonset(&self, name: &str, timeout: Duration) -> Result<()> {
        self.kubectl(&[
            "rollout",
            "restart",
            "-n",
            SYSTEM_NAMESPACE,
            &format!("daemonset/{name}"),
        ])?;
        self.daemonset_rolled_out(name, timeout)
    }
}

/// Runs `cmd`: whether it succeeded, and its output and errors.
fn outcome(cmd: &mut Command) -> Result<(bool, String)> {
    let out = cmd.output()?;
    Ok((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

fn daemonset_selector(name: &str) -> String {
    match name {
        "ambpf" => "app.kubernetes.io/name=ambpf".to_owned(),
        other => format!("app={other}"),
    }
}

/// See [`Cluster::ztunnel_holds`].
pub fn holds(events: &[Value]) -> std::collections::HashMap<String, u64> {
    use std::collections::HashMap;
    let mut held: HashMap<String, u64> = HashMap::new();
    let mut snapshot: Option<HashMap<String, u64>> = None;
    for e in events {
        let uid = e["uid"].as_str().unwrap_or_default().to_owned();
        match e["event"].as_str() {
            Some("connected") => snapshot = Some(HashMap::new()),
            Some("snapshot_sent") => held = snapshot.take().unwrap_or_default(),
            Some("add") => {
                let inode = e["netns_inode"].as_u64().unwrap_or_default();
                match snapshot.as_mut() {
                    Some(s) => s.insert(uid, inode),
                    None => held.insert(uid, inode),
                };
            }
            Some("keep") => {
                if let (Some(s), Some(inode)) = (snapshot.as_mut(), held.get(&uid)) {
                    s.insert(uid, *inode);
                }
            }
            Some("del") => {
                held.remove(&uid);
            }
            _ => {}
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn holds_follow_the_last_snapshot_then_adds_and_deletes() {
        let events = [
            json!({"event": "connected", "connection": 1}),
            json!({"event": "add", "uid": "a", "netns_inode": 1}),
            json!({"event": "add", "uid": "b", "netns_inode": 2}),
            json!({"event": "snapshot_sent"}),
            json!({"event": "del", "uid": "b"}),
            json!({"event": "connected", "connection": 2}),
            json!({"event": "keep", "uid": "a"}),
            json!({"event": "add", "uid": "c", "netns_inode": 3}),
            json!({"event": "snapshot_sent"}),
            json!({"event": "add", "uid": "a", "netns_inode": 4}),
        ];
        let held = super::holds(&events);
        assert_eq!(held.len(), 2);
        assert_eq!(held["a"], 4);
        assert_eq!(held["c"], 3);
    }
}
