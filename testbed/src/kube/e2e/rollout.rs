//! `kubectl rollout restart daemonset/ambpf`, ten times in a row, under
//! traffic: a pod opening a connection every 5 ms and holding long ones
//! open, to an ambient echo server. Every connection must succeed and no
//! established one may be reset; new connections stay captured throughout.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;

use super::client::{Cluster, Release};
use super::eventually;
use crate::kube::images::{APP, CONN_GENERATOR};

const RESTARTS: usize = 10;
const ECHO_PORT: u16 = 9000;
const EVERY_MS: u64 = 5;
const LONG_CONNECTIONS: usize = 8;
/// The generator's pod stops once this file exists.
const STOP_FILE: &str = "/tmp/stop";
/// The share of the asked-for connection rate the generator must reach.
/// Below it, the run would not be the load it claims to be. The 2-core node
/// also runs the control plane and both ends of every connection through
/// the ztunnel double's proxies.
const MIN_RATE_SHARE: f64 = 0.5;
/// How far back "recent" events of the double go: the log of this much
/// traffic is large, and the kubelet rotates it.
const RECENT_SECS: u64 = 5;

pub fn rollout_restart(cluster: &Cluster, release: &Release) -> Result<String> {
    let namespace = format!("e2e-{}-rollout", release.mode);
    let result = restarts_under_traffic(cluster, &namespace);
    cluster.kubectl(&["delete", "namespace", &namespace, "--wait=false"])?;
    result
}

fn restarts_under_traffic(cluster: &Cluster, namespace: &str) -> Result<String> {
    let (echo, generator, captured) = start_traffic(cluster, namespace)?;
    let started = Instant::now();
    let mut took = Vec::new();
    for restart in 1..=RESTARTS {
        let began = Instant::now();
        restart_agent(cluster).with_context(|| {
            format!(
                "restart {restart} of {RESTARTS}\n{}",
                cluster.agent_diagnostics()
            )
        })?;
        took.push(began.elapsed().as_secs_f64());
    }
    let restarts_took = started.elapsed().as_secs_f64();
    let captured_after = captured_after(cluster, &generator, &echo, "the restarts")?;
    let summary = stop_generator(cluster, namespace, &generator.name)?;
    let slowest = took.iter().copied().fold(0.0, f64::max);
    let during = format!("{RESTARTS} restarts in {restarts_took:.0} s (slowest {slowest:.1} s)");
    judge(&summary, captured, captured_after, &during)
}

/// The echo server and the generator in `namespace`, once ztunnel proxies
/// the generator's connections at both ends (how many, lately).
pub(super) fn start_traffic(
    cluster: &Cluster,
    namespace: &str,
) -> Result<(EchoServer, Generator, (usize, usize))> {
    let echo = echo_server(cluster, namespace)?;
    let generator = start_generator(cluster, namespace, &echo.cluster_ip)?;
    let captured = eventually(
        "the generator's connections proxied by ztunnel at both ends",
        Duration::from_secs(30),
        || recently_captured(cluster, &generator, &echo.uid),
    )?;
    Ok((echo, generator, captured))
}

/// The generator's connections opened after `what`, not ones still in the
/// log, proxied at both ends: both pods' proxies still in ztunnel and both
/// captures in place. Polled, since a read just after the kubelet rotated
/// the double's log holds less than the window.
pub(super) fn captured_after(
    cluster: &Cluster,
    generator: &Generator,
    echo: &EchoServer,
    what: &str,
) -> Result<(usize, usize)> {
    std::thread::sleep(Duration::from_secs(RECENT_SECS));
    eventually(
        &format!("the generator's connections proxied at both ends after {what}"),
        Duration::from_secs(30),
        || recently_captured(cluster, generator, &echo.uid),
    )
    .with_context(|| cluster.agent_diagnostics())
}

pub(super) struct EchoServer {
    pub(super) uid: String,
    pub(super) cluster_ip: String,
}

/// An ambient namespace with one echo server behind a ClusterIP Service.
fn echo_server(cluster: &Cluster, namespace: &str) -> Result<EchoServer> {
    cluster.apply(&format!(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: {namespace}
  labels: {{istio.io/dataplane-mode: ambient}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: echo, namespace: {namespace}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: echo}}}}
  template:
    metadata: {{labels: {{app: echo}}}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: echo
        image: {APP}
        imagePullPolicy: Never
        command: ["{CONN_GENERATOR}", "echo", "--port", "{ECHO_PORT}"]
        readinessProbe: {{tcpSocket: {{port: {ECHO_PORT}}}, periodSeconds: 2}}
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: {namespace}}}
spec:
  selector: {{app: echo}}
  ports: [{{port: {ECHO_PORT}, targetPort: {ECHO_PORT}}}]
"#
    ))?;
    cluster.rollout(namespace, "echo")?;
    let (_, uid, _) = cluster
        .pods(namespace, "echo")?
        .into_iter()
        .next()
        .context("no echo pod")?;
    let service = cluster.get_json(&["service", "-n", namespace, "echo"])?;
    let cluster_ip = service["spec"]["clusterIP"]
        .as_str()
        .context("the echo Service has no ClusterIP")?
        .to_owned();
    Ok(EchoServer { uid, cluster_ip })
}

pub(super) struct Generator {
    pub(super) name: String,
    pub(super) uid: String,
}

/// The generator's pod, once its long connections are open.
fn start_generator(cluster: &Cluster, namespace: &str, echo_ip: &str) -> Result<Generator> {
    let name = "conn-generator";
    cluster.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}, labels: {{app: conn-generator}}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: generator
    image: {APP}
    imagePullPolicy: Never
    command: ["{CONN_GENERATOR}", "run", "--target", "{echo_ip}:{ECHO_PORT}",
              "--every-ms", "{EVERY_MS}", "--long", "{LONG_CONNECTIONS}",
              "--stop-file", "{STOP_FILE}"]
"#
    ))?;
    eventually(
        "the generator's long connections open",
        Duration::from_secs(60),
        || {
            if super::scenarios::pod_phase(cluster, namespace, name)? == "Failed" {
                bail!("{}", generator_log(cluster, namespace, name));
            }
            let log = cluster
                .kubectl(&["logs", "-n", namespace, name])
                .unwrap_or_default();
            Ok(log.contains(r#""event":"started""#).then_some(()))
        },
    )?;
    let pod = cluster.get_json(&["pod", "-n", namespace, name])?;
    Ok(Generator {
        name: name.to_owned(),
        uid: pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    })
}

fn generator_log(cluster: &Cluster, namespace: &str, name: &str) -> String {
    cluster
        .kubectl(&["logs", "-n", namespace, name])
        .unwrap_or_else(|e| format!("{e:#}"))
}

/// How many of the generator's connections ztunnel proxied lately, out of
/// its pod (outbound listener) and into the echo server's (inbound): `None`
/// unless both saw some.
fn recently_captured(
    cluster: &Cluster,
    generator: &Generator,
    echo_uid: &str,
) -> Result<Option<(usize, usize)>> {
    let events = cluster.recent_ztunnel_events(RECENT_SECS)?;
    let count = |uid: &str, listener: u16| {
        events
            .iter()
            .filter(|e| e["event"] == "connection" && e["uid"] == uid)
            .filter(|e| e["listener_port"] == listener)
            .count()
    };
    let counts = (count(&generator.uid, 15001), count(echo_uid, 15006));
    Ok((counts.0 > 0 && counts.1 > 0).then_some(counts))
}

/// One `rollout restart`, waited for as an operator would.
fn restart_agent(cluster: &Cluster) -> Result<()> {
    cluster.restart_daemonset("ambpf", Duration::from_secs(180))
}

/// Stops the generator and returns its summary.
pub(super) fn stop_generator(cluster: &Cluster, namespace: &str, name: &str) -> Result<Value> {
    cluster.kubectl(&[
        "exec",
        "-n",
        namespace,
        name,
        "--",
        "sh",
        "-c",
        &format!(": > {STOP_FILE}"),
    ])?;
    eventually("the generator's summary", Duration::from_secs(60), || {
        let phase = super::scenarios::pod_phase(cluster, namespace, name)?;
        match phase.as_str() {
            "Succeeded" => {}
            "Failed" => bail!(
                "the generator failed: {}",
                generator_log(cluster, namespace, name)
            ),
            _ => return Ok(None),
        }
        let log = generator_log(cluster, namespace, name);
        let summary = log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["event"] == "summary");
        match summary {
            Some(summary) => Ok(Some(summary)),
            None => bail!("the generator left no summary: {log}"),
        }
    })
}

/// Fails unless every connection of the generator's `summary` succeeded,
/// every long one is alive and the rate was reached; `during` says what
/// the traffic ran through, for the report.
pub(super) fn judge(
    summary: &Value,
    captured: (usize, usize),
    captured_after: (usize, usize),
    during: &str,
) -> Result<String> {
    let number = |key: &str| summary[key].as_u64().unwrap_or(u64::MAX);
    let rate = summary["rate_per_s"].as_f64().unwrap_or_default();
    let wanted = summary["wanted_per_s"].as_f64().unwrap_or_default();
    let seen = format!(
        "{during}; {} connections in \
         {:.0} s ({rate:.0}/s, {wanted:.0}/s asked), {} succeeded, {} connect failures, {} \
         timeouts, {} resets, {} garbled; {} of {} long connections alive after {} exchanges; \
         ztunnel proxied {}/{} (out/in) of the last {RECENT_SECS} s before and {}/{} after",
        number("attempts"),
        summary["seconds"].as_f64().unwrap_or_default(),
        number("succeeded"),
        number("connect_failed"),
        number("timeouts"),
        number("resets"),
        number("garbled"),
        number("long_alive"),
        number("long_opened"),
        number("long_exchanges"),
        captured.0,
        captured.1,
        captured_after.0,
        captured_after.1,
    );
    let failures = ["connect_failed", "timeouts", "resets", "garbled"]
        .iter()
        .fold(0u64, |sum, key| sum.saturating_add(number(key)));
    ensure!(
        failures == 0 && number("succeeded") == number("attempts"),
        "{seen}; first failures: {}",
        summary["first_errors"]
    );
    ensure!(
        number("long_alive") == LONG_CONNECTIONS as u64,
        "{seen}: long connections lost; first failures: {}",
        summary["first_errors"]
    );
    ensure!(
        rate >= wanted * MIN_RATE_SHARE,
        "{seen}: the generator reached {rate:.0} of the {wanted:.0} connections/s asked"
    );
    Ok(seen)
}
