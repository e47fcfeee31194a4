//! Migrating a node between Istio's own node agent (either backend) and
//! ambpf, live, under traffic: a pod opening a connection every 5 ms and
//! holding long ones open to an ambient echo server, for the whole switch.
//!
//! From Istio's agent ([`from_istio_iptables`], [`from_istio_nftables`]):
//! The switch as a user makes it: `helm install ambpf` while Istio's agent
//! runs (ambpf stands by: it serves no ZDS and enrols nothing), a pod
//! created meanwhile (Istio's agent captures it, ambpf's plugin admits it),
//! Istio's agent restarted (ambpf waits on), then `helm uninstall istio-cni` (its agent closes its ZDS socket and
//! leaves its capture in every pod). ambpf then enrols every pod beside
//! Istio's rules, serves ztunnel, and removes Istio's capture pod by pod.
//! Every connection must succeed, none may be reset, ztunnel must proxy new
//! ones afterwards at both ends, the pod made during the standby must be
//! captured, and `ambpf status --check` must find no pod with Istio's
//! capture left.
//!
//! Killed halfway ([`from_istio_interrupted`]): the same move from Istio's
//! iptables backend, with ambpf's agent SIGKILLed as it begins the takeover;
//! the restarted agent must carry it on to the same end.
//!
//! To Istio's agent ([`to_istio_iptables`], [`to_istio_nftables`]): `helm
//! install istio-cni` beside ambpf's eBPF mode (its start-up writes its
//! rules into every ambient pod), then `helm uninstall ambpf`, which hands
//! the pods over: ambpf's capture goes from each once Istio's is there, and
//! the annotations stay. The same traffic bar, ztunnel proxying both ends
//! after, and nothing of ambpf's left pinned.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};

use super::client::{Cluster, Release};
use super::eventually;
use super::istio_agent::ISTIO_CNI_DAEMONSET;
use super::rollout::{captured_after, judge, start_traffic, stop_generator};
use super::rule_dump::sandbox_pid;
use super::scenarios::{WEB_PORT, direct_is_captured};
use crate::kube::manifest::httpd;

/// How long the traffic runs under Istio's agent before ambpf comes.
const LEAD: Duration = Duration::from_secs(5);
/// How long the traffic runs around the switch, at least.
const AT_LEAST: Duration = Duration::from_secs(30);

pub fn from_istio_iptables(cluster: &Cluster, release: &Release) -> Result<String> {
    from_istio(cluster, release, false)
}

pub fn from_istio_nftables(cluster: &Cluster, release: &Release) -> Result<String> {
    from_istio(cluster, release, true)
}

fn from_istio(cluster: &Cluster, release: &Release, nftables: bool) -> Result<String> {
    let backend = if nftables { "nftables" } else { "iptables" };
    let namespace = format!("e2e-{}-from-istio-{backend}", release.mode);
    moved_from_istio(cluster, release, &namespace, || {
        switch_under_traffic(cluster, release, &namespace, nftables)
    })
}

/// Runs `switch` on a node under Istio's agent alone (ambpf uninstalled
/// first), with both agents' state in its error, then leaves the node as
/// the suite expects it: ambpf installed in its mode, Istio's agent gone,
/// `namespace` going.
fn moved_from_istio(
    cluster: &Cluster,
    release: &Release,
    namespace: &str,
    switch: impl FnOnce() -> Result<String>,
) -> Result<String> {
    cluster.helm_uninstall()?;
    let result = switch().with_context(|| {
        format!(
            "{}\n{}",
            cluster.agent_diagnostics(),
            cluster.istio_cni_diagnostics()
        )
    });
    if cluster.istio_cni_installed()? {
        cluster.uninstall_istio_cni()?;
    }
    if !cluster.release_installed()? {
        cluster.helm_install(&release.chart, &release.mode)?;
    }
    cluster.kubectl(&["delete", "namespace", namespace, "--wait=false"])?;
    result
}

fn switch_under_traffic(
    cluster: &Cluster,
    release: &Release,
    namespace: &str,
    nftables: bool,
) -> Result<String> {
    cluster.install_istio_cni(nftables)?;
    let (echo, generator, captured) = start_traffic(cluster, namespace)?;
    let traffic = Instant::now();
    std::thread::sleep(LEAD);

    let began = Instant::now();
    install_beside_istio(cluster, release)?;
    let late = late_pod(cluster, namespace)?;
    // Istio's agent restarted meanwhile is not gone: ambpf waits on.
    cluster.restart_daemonset(ISTIO_CNI_DAEMONSET, TIMEOUT)?;
    ensure!(
        !cluster.agent_log()?.contains(TAKING_OVER),
        "ambpf took over while Istio's agent restarted"
    );

    let uninstalling = Instant::now();
    cluster.uninstall_istio_cni()?;
    let istio_gone = uninstalling.elapsed().as_secs_f64();
    let log = eventually("ambpf retiring Istio's capture", TIMEOUT, || {
        let log = cluster.agent_log().unwrap_or_default();
        Ok(log
            .contains("Istio's node agent's capture is retired")
            .then_some(log))
    })?;
    let retried: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("retried after the next pass"))
        .collect();
    ensure!(
        retried.is_empty(),
        "ambpf retired Istio's capture after trouble:\n{}",
        retried.join("\n")
    );
    cluster.daemonset_rolled_out("ambpf", TIMEOUT)?;
    let switched = began.elapsed().as_secs_f64();

    let captured_after = captured_after(cluster, &generator, &echo, "the takeover")?;
    let (uid, ip) = late;
    ensure!(
        direct_is_captured(cluster, &ip, &uid)?,
        "the pod created while ambpf stood by is not captured after the takeover"
    );
    ambpf_alone(cluster, &release.mode, &[&echo.uid, &uid], "the takeover")?;
    std::thread::sleep(AT_LEAST.saturating_sub(traffic.elapsed()));
    let summary = stop_generator(cluster, namespace, &generator.name)?;
    let removed = log
        .lines()
        .filter(|l| l.contains("removed Istio's node agent's capture"))
        .count();
    judge(
        &summary,
        captured,
        captured_after,
        &format!(
            "ambpf installed beside Istio's agent, which was uninstalled in {istio_gone:.1} s; \
             ambpf Ready {switched:.1} s after its install, Istio's capture removed from \
             {removed} pods, the standby's new pod captured"
        ),
    )
}

const TIMEOUT: Duration = Duration::from_secs(120);

/// `helm install ambpf` beside Istio's agent, not waited for (standing by,
/// it is not Ready) but until its agent says it stands by.
fn install_beside_istio(cluster: &Cluster, release: &Release) -> Result<()> {
    cluster.helm_install_as(&release.chart, &release.mode, false)?;
    eventually("ambpf standing by beside Istio's agent", TIMEOUT, || {
        Ok(cluster
            .agent_log()
            .unwrap_or_default()
            .contains("ambpf stands by")
            .then_some(()))
    })
}

/// The node as ambpf alone holds it after `what`: the host's probe SNAT in
/// place, no pod of `uids` with Istio's capture, and in the eBPF mode
/// (whose pods are checked for another capture on demand) `ambpf status
/// --check` clean.
fn ambpf_alone(cluster: &Cluster, mode: &str, uids: &[&str], what: &str) -> Result<()> {
    if let Some(missing) = host_probe_snat_missing(cluster, mode)? {
        bail!("{missing}");
    }
    let left = istio_capture_left(cluster, mode, uids)?;
    ensure!(
        left.is_empty(),
        "Istio's capture left after {what}:\n{}",
        left.join("\n")
    );
    if mode == "ebpf" {
        let (ok, check) = cluster.ambpf_status_check()?;
        ensure!(
            ok && !check.contains("mixed_capture"),
            "ambpf status --check after {what}:\n{check}"
        );
    }
    Ok(())
}

/// Istio's capture still in the pods `uids` once ambpf in `mode` holds
/// them, each named: its nat chains in either iptables view (but in the
/// iptables mode, whose rules they are), and a table of Istio's names
/// without ambpf's comment that redirects or is the raw one. The mangle
/// reply path stays on purpose.
fn istio_capture_left(cluster: &Cluster, mode: &str, uids: &[&str]) -> Result<Vec<String>> {
    let mut left = Vec::new();
    for uid in uids {
        let pid = sandbox_pid(cluster, uid)?.to_string();
        let in_pod = |program: &str, args: &[&str]| {
            let mut command = vec!["-t", pid.as_str(), "-n", "--", program];
            command.extend(args);
            cluster.on_node("nsenter", &command)
        };
        if mode != "iptables" {
            for save in ["iptables-legacy-save", "iptables-nft-save"] {
                let text = in_pod(save, &["-t", "nat"]).unwrap_or_default();
                if text.contains(":ISTIO_PRERT") || text.contains(":ISTIO_OUTPUT") {
                    left.push(format!("pod {uid}: {save}: Istio's nat chains"));
                }
            }
        }
        let ruleset = in_pod("nft", &["list", "ruleset"])?;
        for table in ruleset.split("\ntable ") {
            let table = table.trim_start_matches("table ");
            let Some(name) = table.lines().next() else {
                continue;
            };
            let istio = name.starts_with("inet istio-ambient-");
            let ambpf = table.contains("comment \"ambpf");
            let captures = name.starts_with("inet istio-ambient-raw") || table.contains("redirect");
            if istio && !ambpf && captures {
                left.push(format!(
                    "pod {uid}: nft table {}",
                    name.trim_end_matches(" {")
                ));
            }
        }
    }
    Ok(left)
}
/// The host's probe SNAT missing once ambpf in a rule mode holds the node
/// (the eBPF mode's probes need none): Istio's agent, stopping, deletes
/// its own, whose names the rule modes share. Waited for Istio's pod to
/// be gone first, so that a late deletion is seen.
fn host_probe_snat_missing(cluster: &Cluster, mode: &str) -> Result<Option<String>> {
    eventually("Istio's node agent's pod gone", TIMEOUT, || {
        let pods = cluster.kubectl(&[
            "get",
            "pods",
            "-A",
            "-l",
            "k8s-app=istio-cni-node",
            "-o",
            "name",
        ])?;
        Ok(pods.trim().is_empty().then_some(()))
    })?;
    let listing = match mode {
        "nftables" => cluster
            .on_node("nft", &["list", "table", "inet", "istio-ambient-nat"])
            .unwrap_or_default(),
        "iptables" => ["iptables-legacy-save", "iptables-nft-save"]
            .map(|save| cluster.on_node(save, &["-t", "nat"]).unwrap_or_default())
            .join("\n"),
        _ => return Ok(None),
    };
    // The SNAT to Istio's probe address (169.254.7.127), as each writes it.
    let snat = listing.lines().any(|line| {
        line.contains("169.254.7.127") && (line.contains("snat") || line.contains("SNAT"))
    });
    Ok((!snat).then(|| {
        format!("the host's probe SNAT is missing after the takeover (the {mode} mode):\n{listing}")
    }))
}

/// What the agent says as it ends its standby.
const TAKING_OVER: &str = "taking its pods over";

/// An ambient web pod created while ambpf stands by: Istio's agent
/// captures it, and it must start. Returns its uid and address.
fn late_pod(cluster: &Cluster, namespace: &str) -> Result<(String, String)> {
    cluster.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: late, namespace: {namespace}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: web
    image: {app}
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "{shell}"]
    readinessProbe: {{tcpSocket: {{port: {WEB_PORT}}}, periodSeconds: 1}}
"#,
        app = crate::kube::images::APP,
        shell = httpd(WEB_PORT),
    ))?;
    cluster.kubectl(&[
        "wait",
        "--for=condition=Ready",
        "-n",
        namespace,
        "pod/late",
        "--timeout=90s",
    ])?;
    let pod = cluster.get_json(&["pod", "-n", namespace, "late"])?;
    let field = |path: &[&str]| {
        path.iter()
            .fold(&pod, |v, k| &v[*k])
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    Ok((field(&["metadata", "uid"]), field(&["status", "podIP"])))
}

/// Istio's agent (iptables backend) -> ambpf, with ambpf's agent killed
/// (SIGKILL) as it begins to take the pods over: the restarted agent must
/// carry the takeover on, to every pod captured once and in ztunnel, under
/// the same traffic bar.
pub fn from_istio_interrupted(cluster: &Cluster, release: &Release) -> Result<String> {
    let namespace = format!("e2e-{}-from-istio-interrupted", release.mode);
    moved_from_istio(cluster, release, &namespace, || {
        interrupted_under_traffic(cluster, release, &namespace)
    })
}

fn interrupted_under_traffic(
    cluster: &Cluster,
    release: &Release,
    namespace: &str,
) -> Result<String> {
    cluster.install_istio_cni(false)?;
    let (echo, generator, captured) = start_traffic(cluster, namespace)?;
    let traffic = Instant::now();
    std::thread::sleep(LEAD);
    install_beside_istio(cluster, release)?;
    let agent_log = agent_log_file(cluster)?;
    // The kill is watched for beside the uninstall: the takeover begins as
    // Istio's pod goes, which is when the uninstall returns.
    let killed = std::thread::scope(|scope| {
        let killer = scope.spawn(|| kill_at(&agent_log, TAKING_OVER, TIMEOUT));
        cluster.uninstall_istio_cni()?;
        killer.join().expect("the killer thread")
    })?;
    let removed_before = killed
        .lines()
        .filter(|l| l.contains("removed Istio's node agent's capture"))
        .count();
    let retired_before = killed.contains(RETIRED);
    let first_pass = if killed.contains("initial pods:") {
        "after"
    } else {
        "before"
    };
    // Restarted by the kubelet: its container Ready again.
    eventually("ambpf's agent restarted and Ready", TIMEOUT, || {
        let pod = agent_pod_field(
            cluster,
            "{.items[0].status.containerStatuses[?(@.name==\"agent\")]}",
        )?;
        let status: serde_json::Value = serde_json::from_str(&pod).unwrap_or_default();
        let restarted = status["restartCount"].as_u64().unwrap_or(0) >= 1;
        Ok((restarted && status["ready"] == true).then_some(()))
    })?;
    if !retired_before {
        eventually(
            "the restarted agent retiring Istio's capture",
            TIMEOUT,
            || {
                Ok(cluster
                    .agent_log()
                    .unwrap_or_default()
                    .contains(RETIRED)
                    .then_some(()))
            },
        )?;
    }
    let captured_after = captured_after(cluster, &generator, &echo, "the restart")?;
    let pods = [echo.uid.as_str(), generator.uid.as_str()];
    ambpf_alone(cluster, &release.mode, &pods, "the interrupted takeover")?;
    std::thread::sleep(AT_LEAST.saturating_sub(traffic.elapsed()));
    let summary = stop_generator(cluster, namespace, &generator.name)?;
    let when = if retired_before {
        "after it had retired Istio's capture".to_owned()
    } else {
        format!(
            "with Istio's capture removed from {removed_before} pods; the restarted agent \
             retired the rest"
        )
    };
    judge(
        &summary,
        captured,
        captured_after,
        &format!(
            "ambpf's agent killed as it began the takeover ({first_pass} its first pass), {when}"
        ),
    )
}

/// What the agent says once no pod keeps Istio's capture.
const RETIRED: &str = "Istio's node agent's capture is retired";

/// `jsonpath` of ambpf's agent's pods.
fn agent_pod_field(cluster: &Cluster, jsonpath: &str) -> Result<String> {
    cluster.kubectl(&[
        "get",
        "pods",
        "-n",
        super::client::SYSTEM_NAMESPACE,
        "-l",
        "app.kubernetes.io/name=ambpf",
        "-o",
        &format!("jsonpath={jsonpath}"),
    ])
}

/// The agent container's log file on the node (the kubelet's, under the
/// cluster's state directory, named by the pod's name and uid), which is
/// read far faster than `kubectl logs` answers.
fn agent_log_file(cluster: &Cluster) -> Result<std::path::PathBuf> {
    let pod = agent_pod_field(
        cluster,
        "{.items[0].metadata.name}_{.items[0].metadata.uid}",
    )?;
    let dir = format!("{}_{}", super::client::SYSTEM_NAMESPACE, pod.trim());
    Ok(cluster
        .layout
        .state
        .join("log/pods")
        .join(dir)
        .join("agent/0.log"))
}

/// SIGKILLs ambpf's agent as soon as `log` says `what`; returns the log
/// as it was then.
fn kill_at(log: &std::path::Path, what: &str, timeout: Duration) -> Result<String> {
    let began = Instant::now();
    while began.elapsed() < timeout {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(what) {
            // The agent's process: `ambpf ... run --redirect-mode=...`.
            let killed = std::process::Command::new("pkill")
                .args(["-KILL", "-f", "--", " run --redirect-mode="])
                .status()?;
            ensure!(killed.success(), "pkill found no agent to kill");
            return Ok(text);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    bail!("{} never said {what:?} in {timeout:?}", log.display())
}

pub fn to_istio_iptables(cluster: &Cluster, release: &Release) -> Result<String> {
    to_istio(cluster, release, false)
}

pub fn to_istio_nftables(cluster: &Cluster, release: &Release) -> Result<String> {
    to_istio(cluster, release, true)
}

fn to_istio(cluster: &Cluster, release: &Release, nftables: bool) -> Result<String> {
    let backend = if nftables { "nftables" } else { "iptables" };
    let namespace = format!("e2e-{}-to-istio-{backend}", release.mode);
    let result = hand_over_under_traffic(cluster, &namespace, nftables).with_context(|| {
        format!(
            "{}\n{}",
            cluster.agent_diagnostics(),
            cluster.istio_cni_diagnostics()
        )
    });
    // Left as the suite expects it: ambpf installed in its mode, Istio's
    // agent gone. Its pods go first: Istio's agent leaves its rules in them.
    cluster.kubectl(&[
        "delete",
        "namespace",
        &namespace,
        "--wait=true",
        "--timeout=90s",
    ])?;
    if cluster.istio_cni_installed()? {
        cluster.uninstall_istio_cni()?;
    }
    if !cluster.release_installed()? {
        cluster.helm_install(&release.chart, &release.mode)?;
    }
    result
}

fn hand_over_under_traffic(cluster: &Cluster, namespace: &str, nftables: bool) -> Result<String> {
    let (echo, generator, captured) = start_traffic(cluster, namespace)?;
    let traffic = Instant::now();
    std::thread::sleep(LEAD);
    let began = Instant::now();
    cluster.install_istio_cni_beside_ambpf(nftables, &[])?;
    let installed = began.elapsed().as_secs_f64();
    let uninstalling = Instant::now();
    cluster.helm_uninstall()?;
    let uninstalled = uninstalling.elapsed().as_secs_f64();
    let captured_after = captured_after(cluster, &generator, &echo, "the hand-over")?;
    let pinned = cluster.on_node("sh", &["-c", "ls -A /sys/fs/bpf/ambpf 2>/dev/null | wc -l"])?;
    ensure!(
        pinned.trim() == "0",
        "ambpf's pins are left after its uninstall: {pinned}"
    );
    if !nftables {
        // Istio's iptables rules capture the pods: no table of ambpf's stays.
        for uid in [&echo.uid, &generator.uid] {
            let pid = sandbox_pid(cluster, uid)?.to_string();
            let ruleset = cluster.on_node(
                "nsenter",
                &["-t", &pid, "-n", "--", "nft", "list", "ruleset"],
            )?;
            ensure!(
                !ruleset.contains("comment \"ambpf"),
                "ambpf's tables left in pod {uid} after its uninstall:\n{ruleset}"
            );
        }
    }
    std::thread::sleep(AT_LEAST.saturating_sub(traffic.elapsed()));
    let summary = stop_generator(cluster, namespace, &generator.name)?;
    judge(
        &summary,
        captured,
        captured_after,
        &format!(
            "Istio's agent installed beside ambpf in {installed:.1} s, then ambpf uninstalled \
             in {uninstalled:.1} s"
        ),
    )
}
