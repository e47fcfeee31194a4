//! Scenarios of things that happen to pods and agents on a node: ztunnel
//! away while pods start, a sandbox re-created by the runtime, changes made
//! while the agent is down.

use std::time::Duration;

use anyhow::{Result, ensure};

use super::client::{Cluster, Release, SYSTEM_NAMESPACE};
use super::eventually;
use super::scenarios::{
    WEB_PORT, client_pod, direct_is_captured, ensure_web, outbound_proxied, pod_phase, redirection,
};

/// Pods started while no ztunnel runs: their sandboxes fail with ambpf's
/// retryable error, kubelet retries, and they start once ztunnel is back,
/// captured from their first connection.
pub fn no_ztunnel(cluster: &Cluster, release: &Release) -> Result<String> {
    let namespace = format!("e2e-{}-late", release.mode);
    ensure_web(cluster, &namespace, true)?;
    cluster.park_daemonset(SYSTEM_NAMESPACE, "ztunnel", true)?;
    let result = (|| {
        let name = client_pod(cluster, &namespace)?;
        // Long enough for a few of kubelet's retries.
        std::thread::sleep(Duration::from_secs(15));
        let phase = pod_phase(cluster, &namespace, &name)?;
        ensure!(
            phase == "Pending",
            "{name} is {phase} with no ztunnel running"
        );
        let events = cluster.kubectl(&[
            "get",
            "events",
            "-n",
            &namespace,
            "--field-selector",
            &format!("involvedObject.name={name},reason=FailedCreatePodSandBox"),
            "-o",
            "jsonpath={.items[*].message}",
        ])?;
        ensure!(
            events.contains("ambpf"),
            "{name}'s sandbox did not fail with ambpf's error; events: {events}"
        );
        Ok((name, events))
    })();
    cluster.park_daemonset(SYSTEM_NAMESPACE, "ztunnel", false)?;
    let (name, events) = result?;
    let uid = eventually(&format!("{name} done"), Duration::from_secs(120), || {
        let pod = cluster.get_json(&["pod", "-n", &namespace, &name])?;
        Ok(match pod["status"]["phase"].as_str() {
            Some("Succeeded") | Some("Failed") => Some(
                pod["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ),
            _ => None,
        })
    })?;
    ensure!(
        pod_phase(cluster, &namespace, &name)? == "Succeeded",
        "{name} failed once ztunnel was back"
    );
    ensure!(
        outbound_proxied(cluster, &uid)?,
        "{name}'s first connection did not pass ztunnel"
    );
    cluster.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    let reason = events.split("failed (add): ").nth(1).unwrap_or(&events);
    Ok(format!(
        "pending while ztunnel was away ({}); started and captured once it was back",
        reason.chars().take(120).collect::<String>()
    ))
}

/// A pod's sandbox killed and re-created by kubelet: a new network
/// namespace, captured from its first packet and handed to ztunnel; the old
/// one forgotten.
pub fn sandbox_recreated(cluster: &Cluster, release: &Release) -> Result<String> {
    let namespace = format!("e2e-{}", release.mode);
    ensure_web(cluster, &namespace, true)?;
    let (name, uid, _) = cluster
        .pods(&namespace, "web")?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no web pod in {namespace}"))?;
    let old = eventually(
        &format!("ztunnel holds {name}"),
        Duration::from_secs(30),
        || Ok(cluster.ztunnel_holds()?.get(&uid).copied()),
    )?;
    let sandboxes = cluster.sandboxes(&uid)?;
    ensure!(sandboxes.len() == 1, "{name} has sandboxes {sandboxes:?}");
    let restarts = |pod: &serde_json::Value| {
        pod["status"]["containerStatuses"][0]["restartCount"]
            .as_u64()
            .unwrap_or(0)
    };
    let restarts_before = restarts(&cluster.get_json(&["pod", "-n", &namespace, &name])?);
    cluster.ctr(&["tasks", "kill", "--signal", "SIGKILL", &sandboxes[0]])?;
    let new = eventually(
        &format!("ztunnel handed {name}'s new namespace"),
        Duration::from_secs(90),
        || {
            Ok(cluster
                .ztunnel_holds()?
                .get(&uid)
                .copied()
                .filter(|inode| *inode != old))
        },
    )?;
    cluster.rollout(&namespace, "web")?;
    let ip = eventually(
        &format!("{name} Ready again"),
        Duration::from_secs(60),
        || {
            // Ready in a status written since the kill (its container
            // restarted): an older one still shows the old sandbox's address.
            let pod = cluster.get_json(&["pod", "-n", &namespace, &name])?;
            let ready = pod["status"]["containerStatuses"][0]["ready"] == true
                && restarts(&pod) > restarts_before;
            Ok(ready.then(|| {
                pod["status"]["podIP"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            }))
        },
    )?;
    ensure!(
        direct_is_captured(cluster, &ip, &uid)?,
        "{name}'s new sandbox is not captured"
    );
    if release.mode == "ebpf" {
        let entries: Vec<u64> = cluster
            .ambpf_pods()?
            .into_iter()
            .filter(|(held, _)| *held == uid)
            .map(|(_, inode)| inode)
            .collect();
        ensure!(
            entries == [new],
            "ambpf holds {name} as {entries:?}, want only {new}"
        );
    }
    Ok(format!(
        "netns {old} -> {new}: handed to ztunnel, captured, the old one forgotten"
    ))
}

/// With the agent stopped, a pod is deleted, another opts out and a
/// namespace is unlabelled; once the agent is back none keeps any capture
/// or annotation, and ztunnel no longer holds them.
pub fn changes_while_agent_down(cluster: &Cluster, release: &Release) -> Result<String> {
    let first = format!("e2e-{}-down-a", release.mode);
    let second = format!("e2e-{}-down-b", release.mode);
    ensure_web(cluster, &first, true)?;
    ensure_web(cluster, &second, true)?;
    let a = cluster.pods(&first, "web")?;
    let b = cluster.pods(&second, "web")?;
    ensure!(
        a.len() == 2 && b.len() == 2,
        "want 2 web pods in each namespace"
    );
    for (name, uid, ip) in a.iter().chain(&b) {
        eventually(
            &format!("{name} annotated"),
            Duration::from_secs(30),
            || redirection(cluster, namespace_of(name, &a, &first, &second), name),
        )?;
        ensure!(
            direct_is_captured(cluster, ip, uid)?,
            "{name} not captured to begin with"
        );
    }
    cluster.park_daemonset(SYSTEM_NAMESPACE, "ambpf", true)?;
    let (deleted, deleted_uid, _) = &a[0];
    let (opted, opted_uid, opted_ip) = &a[1];
    let changes = (|| {
        cluster.kubectl(&[
            "delete",
            "pod",
            "-n",
            &first,
            deleted,
            "--wait=true",
            "--timeout=60s",
        ])?;
        cluster.kubectl(&[
            "label",
            "pod",
            "-n",
            &first,
            opted,
            "istio.io/dataplane-mode=none",
        ])?;
        cluster.kubectl(&["label", "namespace", &second, "istio.io/dataplane-mode-"])
    })();
    cluster.park_daemonset(SYSTEM_NAMESPACE, "ambpf", false)?;
    changes?;
    eventually("the agent's catch-up", Duration::from_secs(60), || {
        let held = cluster.ztunnel_holds()?;
        let stale = [deleted_uid, opted_uid, &b[0].1, &b[1].1]
            .into_iter()
            .any(|uid| held.contains_key(uid.as_str()));
        Ok((!stale).then_some(()))
    })?;
    ensure!(
        redirection(cluster, &first, opted)?.is_none(),
        "{opted} still annotated"
    );
    ensure!(
        !direct_is_captured(cluster, opted_ip, opted_uid)?,
        "{opted} opted out but still captured"
    );
    for (name, uid, ip) in &b {
        ensure!(
            redirection(cluster, &second, name)?.is_none(),
            "{name} still annotated"
        );
        ensure!(
            !direct_is_captured(cluster, ip, uid)?,
            "{name}'s namespace unlabelled but still captured"
        );
    }
    if release.mode == "ebpf" {
        let gone = [deleted_uid, opted_uid, &b[0].1, &b[1].1];
        let stale: Vec<String> = cluster
            .ambpf_pods()?
            .into_iter()
            .filter(|(uid, _)| gone.contains(&uid))
            .map(|(uid, _)| uid)
            .collect();
        ensure!(stale.is_empty(), "ambpf still holds {stale:?}");
    }
    cluster.kubectl(&["delete", "namespace", &first, &second, "--wait=false"])?;
    Ok(format!(
        "deleted, opted-out and unlabelled pods released by the restarted agent (web port {WEB_PORT})"
    ))
}

fn namespace_of<'a>(
    name: &str,
    a: &[(String, String, String)],
    first: &'a str,
    second: &'a str,
) -> &'a str {
    if a.iter().any(|(n, _, _)| n == name) {
        first
    } else {
        second
    }
}
