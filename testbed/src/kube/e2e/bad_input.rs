//! Bad input on the real node: RBAC lacking a verb, the API server stopped
//! under a running agent and at an agent's start (and, in [`super::cni_config`],
//! the conflist rewritten by another installer and raced by one). Each must give a clear log line, an
//! agent that is not Ready while it cannot serve (its own `/readyz` on the
//! node, and the pod's Ready condition), and no pod losing or half-gaining
//! its capture, judged by the ztunnel double's log against a plain twin.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use super::client::{Cluster, Release, SYSTEM_NAMESPACE};
use super::eventually;
use super::scenarios::{WEB_PORT, direct_is_captured, ensure_web, pod_phase, redirection};
use crate::kube::daemons;

/// The chart's default health port, on the node (the agent is hostNetwork).
const HEALTH_PORT: u16 = 15016;
const AGENT_SELECTOR: &str = "app.kubernetes.io/name=ambpf";

/// A web pod: `(name, uid, ip)`.
type Pod = (String, String, String);

/// An ambient namespace and its plain twin, each with two web pods, the
/// ambient ones captured and annotated, the plain ones not captured.
fn captured_and_plain(cluster: &Cluster, ambient: &str, plain: &str) -> Result<(Vec<Pod>, Pod)> {
    ensure_web(cluster, ambient, true)?;
    ensure_web(cluster, plain, false)?;
    let webs = cluster.pods(ambient, "web")?;
    ensure!(webs.len() == 2, "want 2 web pods in {ambient}");
    for (name, uid, ip) in &webs {
        eventually(
            &format!("{name} annotated"),
            Duration::from_secs(60),
            || redirection(cluster, ambient, name),
        )?;
        ensure!(
            direct_is_captured(cluster, ip, uid)?,
            "{ambient}/{name} not captured to begin with"
        );
    }
    let twin = cluster
        .pods(plain, "web")?
        .into_iter()
        .next()
        .context("no plain web pod")?;
    ensure!(
        !direct_is_captured(cluster, &twin.2, &twin.1)?,
        "{plain}/{} is outside the mesh but captured",
        twin.0
    );
    Ok((webs, twin))
}

/// Captured pods stay captured and the plain twin stays not.
fn captures_unchanged(cluster: &Cluster, webs: &[Pod], twin: &Pod, when: &str) -> Result<()> {
    for (name, uid, ip) in webs {
        ensure!(
            direct_is_captured(cluster, ip, uid)?,
            "{name} lost its capture {when}"
        );
    }
    ensure!(
        !direct_is_captured(cluster, &twin.2, &twin.1)?,
        "{} is outside the mesh but captured {when}",
        twin.0
    );
    Ok(())
}

/// The agent's `/readyz` on the node: status and body.
fn readyz(cluster: &Cluster) -> Result<(u16, String)> {
    let out = cluster.on_node(
        "curl",
        &[
            "-sS",
            "-m",
            "5",
            "-w",
            "\n%{http_code}",
            &format!("http://127.0.0.1:{HEALTH_PORT}/readyz"),
        ],
    )?;
    let (body, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", &out));
    Ok((code.trim().parse()?, body.to_owned()))
}

/// Waits until `/readyz` answers 503 saying `why`; returns the body.
fn not_ready_saying(cluster: &Cluster, why: &str, timeout: Duration) -> Result<String> {
    let mut last = String::new();
    eventually(&format!("/readyz 503 saying {why:?}"), timeout, || {
        let (code, body) = readyz(cluster)?;
        last = format!("{code} {body}");
        Ok((code == 503 && body.contains(why)).then_some(body))
    })
    .with_context(|| format!("last answer: {last}"))
}

/// Waits until the agent's pod is Ready again, its `/readyz` included.
fn agent_ready(cluster: &Cluster, timeout: Duration) -> Result<()> {
    eventually("the agent Ready", timeout, || {
        let ready = agent_pod(cluster)?.1 && readyz(cluster)?.0 == 200;
        Ok(ready.then_some(()))
    })
    .map_err(|e| e.context(cluster.agent_diagnostics()))
}

/// The agent's pod (not being deleted) and whether it is Ready.
pub(super) fn agent_pod(cluster: &Cluster) -> Result<(String, bool)> {
    let pods = cluster.get_json(&["pods", "-n", SYSTEM_NAMESPACE, "-l", AGENT_SELECTOR])?;
    let pod = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null())
        .context("no agent pod")?;
    let ready = pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    Ok((name.to_owned(), ready))
}

/// A container's log; `previous` for the one before its last restart.
pub(super) fn log_of(
    cluster: &Cluster,
    pod: &str,
    container: &str,
    previous: bool,
) -> Result<String> {
    let mut args = vec!["logs", "-n", SYSTEM_NAMESPACE, pod, "-c", container];
    if previous {
        args.push("--previous");
    }
    cluster.kubectl(&args)
}

pub(super) fn lines_with(log: &str, all: &[&str]) -> usize {
    log.lines()
        .filter(|l| all.iter().all(|part| l.contains(part)))
        .count()
}

/// Sets the verbs of the chart's ClusterRole rule for `resource`; returns
/// the verbs it had.
fn set_verbs(cluster: &Cluster, resource: &str, verbs: &[&str]) -> Result<Value> {
    let role = cluster.get_json(&["clusterrole", "ambpf"])?;
    let rules = role["rules"].as_array().context("no rules")?;
    let index = rules
        .iter()
        .position(|r| {
            r["resources"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|r| r == resource))
        })
        .with_context(|| format!("no rule for {resource}"))?;
    let patch =
        json!([{ "op": "replace", "path": format!("/rules/{index}/verbs"), "value": verbs }]);
    cluster.kubectl(&[
        "patch",
        "clusterrole",
        "ambpf",
        "--type",
        "json",
        "-p",
        &patch.to_string(),
    ])?;
    Ok(rules[index]["verbs"].clone())
}

fn restore_verbs(cluster: &Cluster, resource: &str, verbs: &Value) -> Result<()> {
    let verbs: Vec<&str> = verbs
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    set_verbs(cluster, resource, &verbs).map(drop)
}

/// Replaces the agent's pod (its DaemonSet stays: an agent restart, which
/// keeps the node's state); returns the new pod's name.
fn replace_agent(cluster: &Cluster) -> Result<String> {
    let (old, _) = agent_pod(cluster)?;
    cluster.kubectl(&[
        "delete",
        "pod",
        "-n",
        SYSTEM_NAMESPACE,
        &old,
        "--wait=true",
        "--timeout=90s",
    ])?;
    eventually("a new agent pod running", Duration::from_secs(90), || {
        let (name, _) = agent_pod(cluster)?;
        let running = name != old && pod_phase_in(cluster, &name)? == "Running";
        Ok(running.then_some(name))
    })
}

fn pod_phase_in(cluster: &Cluster, name: &str) -> Result<String> {
    pod_phase(cluster, SYSTEM_NAMESPACE, name)
}

/// RBAC without `list`/`watch` on namespaces: a restarted agent says so,
/// is not Ready, keeps every capture, and serves once RBAC is mended.
/// Without `patch` on pods/status: the agent serves (capture does not need
/// the annotation) and warns once per pod, not at every pass.
pub fn rbac_lacking_a_verb(cluster: &Cluster, release: &Release) -> Result<String> {
    let ambient = format!("e2e-{}-rbac", release.mode);
    let plain = format!("{ambient}-plain");
    let (webs, twin) = captured_and_plain(cluster, &ambient, &plain)?;

    let had = set_verbs(cluster, "namespaces", &["get"])?;
    let denied = (|| -> Result<String> {
        let agent = replace_agent(cluster)?;
        let why = "RBAC denies the agent `list` on namespaces";
        not_ready_saying(cluster, why, Duration::from_secs(60))?;
        // Several retries later: still not Ready, still said once.
        std::thread::sleep(Duration::from_secs(12));
        let (_, ready) = agent_pod(cluster)?;
        ensure!(!ready, "the agent is Ready without list on namespaces");
        captures_unchanged(cluster, &webs, &twin, "while the agent cannot list")?;
        let log = log_of(cluster, &agent, "agent", false)?;
        let said = lines_with(&log, &[why, "not ready, retrying"]);
        ensure!(said == 1, "the agent said {said} times: {why}:\n{log}");
        Ok(agent)
    })();
    restore_verbs(cluster, "namespaces", &had)?;
    let agent = denied?;
    agent_ready(cluster, Duration::from_secs(120))?;
    let log = log_of(cluster, &agent, "agent", false)?;
    ensure!(
        lines_with(&log, &["answers: listing the pods of node"]) == 1,
        "no line saying the API server answers:\n{log}"
    );
    captures_unchanged(cluster, &webs, &twin, "once RBAC was mended")?;

    // The annotation cannot be written: a replacement pod still enrols.
    let had = set_verbs(cluster, "pods/status", &["get"])?;
    let unannotated = (|| -> Result<Pod> {
        let (gone, _, _) = &webs[0];
        let started = Instant::now();
        cluster.kubectl(&["delete", "pod", "-n", &ambient, gone, "--wait=false"])?;
        cluster.rollout(&ambient, "web")?;
        let fresh = eventually("a replacement web pod", Duration::from_secs(60), || {
            Ok(cluster
                .pods(&ambient, "web")?
                .into_iter()
                .find(|(name, _, ip)| {
                    name != gone && !webs.iter().any(|w| &w.0 == name) && !ip.is_empty()
                }))
        })?;
        ensure!(
            direct_is_captured(cluster, &fresh.2, &fresh.1)?,
            "{} not captured without the annotation",
            fresh.0
        );
        // Five of the annotator's retries at least (one per 5 s resync).
        std::thread::sleep(Duration::from_secs(26));
        ensure!(
            redirection(cluster, &ambient, &fresh.0)?.is_none(),
            "{} annotated without patch on pods/status",
            fresh.0
        );
        ensure!(readyz(cluster)?.0 == 200, "the agent stopped serving");
        let log = cluster.kubectl(&[
            "logs",
            "-n",
            SYSTEM_NAMESPACE,
            &agent,
            "-c",
            "agent",
            &format!("--since={}s", started.elapsed().as_secs() + 5),
        ])?;
        let warned = lines_with(
            &log,
            &[
                "WARN",
                &fresh.0,
                "RBAC denies the agent `patch` on pods/status",
            ],
        );
        // Once per change of the value wanted (`pending`, then `enabled`
        // if ztunnel's ack came after the first try), not at every retry.
        ensure!(
            (1..=2).contains(&warned),
            "{} warned about {warned} times, not once per change:\n{log}",
            fresh.0
        );
        Ok(fresh)
    })();
    restore_verbs(cluster, "pods/status", &had)?;
    let fresh = unannotated?;
    eventually(
        &format!("{} annotated once RBAC allows it", fresh.0),
        Duration::from_secs(60),
        || {
            Ok(
                (redirection(cluster, &ambient, &fresh.0)?.as_deref() == Some("enabled"))
                    .then_some(()),
            )
        },
    )?;
    cluster.kubectl(&["delete", "namespace", &ambient, &plain, "--wait=false"])?;
    Ok(format!(
        "without list on namespaces: a restarted agent not Ready saying so once, {} pods kept \
         captured, Ready once mended; without patch on pods/status: a new pod captured, warned \
         about once, annotated once mended",
        webs.len()
    ))
}

/// The API server stopped under a running agent, then at an agent's start
/// (its container killed and restarted by the kubelet meanwhile): the agent
/// is not Ready saying why each time, every capture holds throughout (the
/// ztunnel double logged the connections made meanwhile, the plain twin's
/// none), and it is Ready again once the API server answers.
pub fn api_server_down(cluster: &Cluster, release: &Release) -> Result<String> {
    let ambient = format!("e2e-{}-apidown", release.mode);
    let plain = format!("{ambient}-plain");
    let (webs, twin) = captured_and_plain(cluster, &ambient, &plain)?;
    agent_ready(cluster, Duration::from_secs(60))?;
    let (agent, _) = agent_pod(cluster)?;
    let proxied = |cluster: &Cluster| -> Result<(usize, usize)> {
        Ok((
            cluster.proxied_count(&webs, None)?,
            cluster.proxied_count(std::slice::from_ref(&twin), None)?,
        ))
    };
    let before = proxied(cluster)?;

    daemons::stop(&cluster.layout, "kube-apiserver", Duration::from_secs(15))?;
    let outage = Instant::now();
    let during = (|| -> Result<(String, String, usize)> {
        let running = not_ready_saying(cluster, "cannot watch", Duration::from_secs(30))?;
        let calls = connect_to_all(cluster, &webs, &twin)?;
        kill_container(cluster, &agent, "agent")?;
        let starting = not_ready_saying(
            cluster,
            "not ready: the API server https://",
            Duration::from_secs(60),
        )?;
        Ok((
            running,
            starting,
            calls + connect_to_all(cluster, &webs, &twin)?,
        ))
    })();
    let down_for = outage.elapsed();
    daemons::start(&cluster.layout, &cluster.components, "kube-apiserver")?;
    eventually("the API server ready", Duration::from_secs(120), || {
        Ok(cluster
            .kubectl(&["get", "--raw", "/readyz"])
            .is_ok()
            .then_some(()))
    })?;
    let (running, starting, calls) = during?;
    agent_ready(cluster, Duration::from_secs(120))?;

    let after = proxied(cluster)?;
    ensure!(
        after.0 >= before.0 + calls,
        "{} of {calls} connections to captured pods passed ztunnel while the API server was down",
        after.0 - before.0
    );
    ensure!(
        after.1 == before.1,
        "the plain twin was captured while the API server was down"
    );
    captures_unchanged(cluster, &webs, &twin, "after the API server's return")?;
    let previous = log_of(cluster, &agent, "agent", true)?;
    ensure!(
        lines_with(&previous, &["cannot watch pods", "not ready meanwhile"]) == 1,
        "the running agent did not say once that it cannot watch pods:\n{previous}"
    );
    let current = log_of(cluster, &agent, "agent", false)?;
    // Once for the outage, whatever each retry met (an API server coming
    // up may deny requests until its RBAC is loaded: another kind).
    let said = lines_with(
        &current,
        &[
            "cannot list pods from the API server",
            "not ready, retrying with backoff",
        ],
    );
    ensure!(
        said == 1,
        "the restarted agent said {said} times that the API server is away:\n{current}"
    );
    ensure!(
        lines_with(&current, &["answers: listing the pods of node"]) == 1,
        "the restarted agent did not say the API server answers:\n{current}"
    );
    cluster.kubectl(&["delete", "namespace", &ambient, &plain, "--wait=false"])?;
    Ok(format!(
        "API server down {:.0} s: running agent not Ready ({}), restarted agent not Ready ({}), \
         {calls} connections to captured pods proxied meanwhile, none of the plain twin's; Ready \
         again after",
        down_for.as_secs_f64(),
        running.trim(),
        starting.trim()
    ))
}

/// Connects from outside to each captured pod and the plain twin;
/// returns the connections made to captured pods.
fn connect_to_all(cluster: &Cluster, webs: &[Pod], twin: &Pod) -> Result<usize> {
    for (name, _, ip) in webs.iter().chain([twin]) {
        let (ok, out) = cluster.from_outside(
            "wget",
            &["-T", "5", "-qO-", &format!("http://{ip}:{WEB_PORT}/")],
        )?;
        ensure!(ok, "{name} ({ip}) from outside: {out}");
    }
    Ok(webs.len())
}

/// Kills a pod's container (as the OOM killer would); the kubelet starts
/// it again, without the API server.
fn kill_container(cluster: &Cluster, pod: &str, container: &str) -> Result<()> {
    let filter = format!(
        "labels.\"io.kubernetes.pod.name\"=={pod},labels.\"io.kubernetes.container.name\"=={container}"
    );
    let ids = cluster.ctr(&["containers", "list", "-q", &filter])?;
    let mut killed = 0;
    for id in ids.lines() {
        // Earlier instances have no task left.
        if cluster.ctr(&["tasks", "kill", "-s", "SIGKILL", id]).is_ok() {
            killed += 1;
        }
    }
    if killed == 0 {
        bail!("no running {container} container of {pod}: {ids}");
    }
    Ok(())
}
