//! The measurements of one agent in one run: pod start, enrolling a
//! namespace, and what the agent costs.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use serde_json::json;

use super::proc::{self, AgentProcesses, CpuShare};
use super::report::Summary;
use super::sandbox::{self, LogMark};
use super::watch::{Watch, boottime, name_of, pod_ready};
use crate::kube::e2e::{Agent, Cluster, eventually};
use crate::kube::manifest::{AMBIENT, AppDeployment};

pub const AMBIENT_LABEL: &str = "istio.io/dataplane-mode=ambient";
pub const REDIRECTION: &str = "ambient.istio.io/redirection";
/// Every namespace the benchmark makes carries it, for the cleanup.
pub const BENCH_LABEL: &str = "ambpf-bench=true";

/// A namespace and a Deployment of `replicas` pods of the app image whose
/// container first prints `/proc/uptime` (when it began, on the machine's
/// `CLOCK_BOOTTIME`, to the centisecond), then sleeps.
pub fn workload_yaml(
    namespace: &str,
    ambient: bool,
    app: &str,
    replicas: usize,
    probe: bool,
) -> String {
    let bench = ("ambpf-bench", "true");
    let labels = [bench, AMBIENT];
    let readiness = [(
        "readinessProbe",
        json!({"exec": {"command": ["true"]}, "periodSeconds": 1}),
    )];
    AppDeployment {
        namespace,
        labels: if ambient { &labels } else { &labels[..1] },
        app,
        replicas,
        container: "app",
        shell: "cat /proc/uptime; exec sleep 2147483647",
        container_fields: if probe { &readiness } else { &[] },
        service_links: false,
    }
    .yaml()
}

/// `[pod/<name>/<container>] <uptime> <idle>` lines of `kubectl logs
/// --prefix`: each pod's first uptime.
pub fn parse_uptime_logs(logs: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in logs.lines() {
        let Some(rest) = line.strip_prefix("[pod/") else {
            continue;
        };
        let Some((target, text)) = rest.split_once("] ") else {
            continue;
        };
        let Some((pod, _container)) = target.split_once('/') else {
            continue;
        };
        let Some(uptime) = text
            .split_whitespace()
            .next()
            .and_then(|u| u.parse::<f64>().ok())
        else {
            continue;
        };
        out.entry(pod.to_owned()).or_insert(uptime);
    }
    out
}

/// Pod start in one run.
#[derive(Clone, Debug, Serialize)]
pub struct PodStart {
    pub pods: usize,
    /// Creation (the pod's first watch event) to its container's first
    /// instruction (its `/proc/uptime`): 10 ms resolution.
    pub started_ms: Summary,
    /// Creation to the `Ready` condition's watch event: kubelet reports it
    /// at its next status sync after the container started (its PLEG
    /// relists every second), so it carries up to a second of kubelet's
    /// own timing.
    pub ready_ms: Summary,
    /// containerd's sandbox creation (the CNI chain runs inside it), from
    /// its own log to the nanosecond ([`sandbox`]).
    pub sandbox_ms: Option<Summary>,
    /// Pods that carried `ambient.istio.io/redirection: enabled` at the end.
    pub redirected: usize,
    pub wall_s: f64,
    /// One more pod every `pace_ms`; 0: all at once.
    pub pace_ms: f64,
    pub per_pod_started_ms: Vec<f64>,
}

/// Scales a Deployment in a fresh namespace (ambient unless `agent` is
/// `none`) from 0 to `pods`, one more every `pace` (at once if zero), and
/// times each pod; deletes the namespace.
pub fn pod_start(
    cluster: &Cluster,
    agent: Agent,
    namespace: &str,
    pods: usize,
    pace: Duration,
    probe: bool,
) -> Result<PodStart> {
    cluster.apply(&workload_yaml(
        namespace,
        agent.captures(),
        "podstart",
        0,
        probe,
    ))?;
    wait_service_account(cluster, namespace);
    let watch = Watch::start(cluster, &["pods", "-n", namespace])?;
    let containerd_log = LogMark::now(&cluster.layout.log("containerd"))?;
    let started = Instant::now();
    let scale = |replicas: usize| {
        cluster.kubectl(&[
            "scale",
            "-n",
            namespace,
            "deployment/podstart",
            &format!("--replicas={replicas}"),
        ])
    };
    // Paced, a pod at a time: the time a pod's start takes on a quiet node,
    // which is what an agent adds to each pod; at once, the node's burst.
    let mut scaled_to = if pace.is_zero() { pods } else { 1 };
    scale(scaled_to)?;
    let mut next_scale = Instant::now() + pace;
    let mut created: HashMap<String, f64> = HashMap::new();
    let mut ready: HashMap<String, f64> = HashMap::new();
    let deadline = Instant::now() + pace * pods as u32 + Duration::from_secs(300 + 2 * pods as u64);
    while ready.len() < pods {
        if scaled_to < pods && Instant::now() >= next_scale {
            scaled_to += 1;
            scale(scaled_to)?;
            next_scale += pace;
        }
        if Instant::now() > deadline {
            bail!(
                "{namespace}: {} of {pods} pods Ready after {:.0} s",
                ready.len(),
                started.elapsed().as_secs_f64()
            );
        }
        let wait = if scaled_to < pods {
            next_scale.saturating_duration_since(Instant::now())
        } else {
            Duration::from_secs(1)
        };
        let Some((at, pod)) = watch.next(wait.max(Duration::from_millis(1)))? else {
            continue;
        };
        let Some(name) = name_of(&pod) else { continue };
        created.entry(name.to_owned()).or_insert(at);
        if pod_ready(&pod) {
            ready.entry(name.to_owned()).or_insert(at);
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    drop(watch);
    let logs = cluster.kubectl(&[
        "logs",
        "-n",
        namespace,
        "-l",
        "app=podstart",
        "--prefix",
        "--tail=-1",
        &format!("--max-log-requests={}", pods + 10),
    ])?;
    let uptimes = parse_uptime_logs(&logs);
    let sandbox_ms: Vec<f64> = sandbox::durations_ms(&containerd_log.since()?, namespace)
        .into_iter()
        .filter(|(pod, _)| created.contains_key(pod))
        .map(|(_, took)| took)
        .collect();
    let mut started_ms = Vec::new();
    let mut ready_ms = Vec::new();
    for (name, at) in &created {
        if let Some(r) = ready.get(name) {
            ready_ms.push((r - at) * 1000.0);
        }
        if let Some(u) = uptimes.get(name) {
            started_ms.push((u - at) * 1000.0);
        }
    }
    if started_ms.len() < pods {
        eprintln!(
            "bench: {namespace}: {} of {pods} pods printed their start time",
            started_ms.len()
        );
    }
    if agent.captures() {
        // The agent annotates a pod once it is redirected, maybe after Ready.
        let _ = eventually("pods annotated", Duration::from_secs(30), || {
            Ok((redirected_pods(cluster, namespace)? >= pods).then_some(()))
        });
    }
    let redirected = redirected_pods(cluster, namespace)?;
    if agent.captures() && redirected < pods {
        eprintln!(
            "bench: {namespace}: only {redirected} of {pods} pods were redirected under {agent}"
        );
    }
    Ok(PodStart {
        pods,
        started_ms: Summary::of(&started_ms).context("no pod printed its start")?,
        ready_ms: Summary::of(&ready_ms).context("no pod Ready")?,
        sandbox_ms: Summary::of(&sandbox_ms),
        redirected,
        wall_s,
        pace_ms: pace.as_secs_f64() * 1e3,
        per_pod_started_ms: started_ms,
    })
}

fn redirected_pods(cluster: &Cluster, namespace: &str) -> Result<usize> {
    let pods = cluster.get_json(&["pods", "-n", namespace])?;
    Ok(pods["items"].as_array().map_or(0, |items| {
        items
            .iter()
            .filter(|p| p["metadata"]["annotations"][REDIRECTION] == "enabled")
            .count()
    }))
}

/// Pods are refused until the namespace's `default` ServiceAccount exists.
fn wait_service_account(cluster: &Cluster, namespace: &str) {
    if let Err(e) = eventually(
        "the default ServiceAccount",
        Duration::from_secs(30),
        || {
            Ok(cluster
                .kubectl(&["get", "serviceaccount", "-n", namespace, "default"])
                .is_ok()
                .then_some(()))
        },
    ) {
        eprintln!("bench: {namespace}: {e:#}");
    }
}

/// Enrolling a namespace of running pods, and the agent's cost.
#[derive(Clone, Debug, Serialize)]
pub struct Enrol {
    pub pods: usize,
    /// The label's watch event to the last pod's annotation event.
    pub all_ms: f64,
    /// Per pod: the label to its annotation.
    pub per_pod_ms: Summary,
    /// The agent's CPU (with its children) from before the label to the
    /// last annotation, in clock ticks (10 ms).
    pub cpu: CpuShare,
}

#[derive(Clone, Debug, Serialize)]
pub struct Cost {
    pub agent_pid: u32,
    /// The agent's resident memory with the namespace's pods enrolled.
    pub rss_kib: u64,
    /// Every container of the agent's pod together (ambpf also runs its
    /// `cni-installer`).
    pub pod_rss_kib: u64,
    /// The agent's CPU over the idle window, nothing happening.
    pub idle: CpuShare,
}

/// `pods` pods Running in an unlabelled namespace; then the label, timed
/// until each pod is annotated redirected; then the agent's memory and its
/// idle CPU over `idle`. Deletes nothing (the caller deletes the namespace).
pub fn enrol_and_cost(
    cluster: &Cluster,
    agent: Agent,
    namespace: &str,
    pods: usize,
    idle: Duration,
) -> Result<(Enrol, Cost)> {
    cluster.apply(&workload_yaml(namespace, false, "enrol", pods, false))?;
    cluster.kubectl(&[
        "rollout",
        "status",
        "-n",
        namespace,
        "deployment/enrol",
        &format!("--timeout={}s", 300 + 3 * pods),
    ])?;
    let processes = AgentProcesses::find(cluster, agent)?;
    let pod_watch = Watch::start(cluster, &["pods", "-n", namespace])?;
    let ns_watch = Watch::start(cluster, &["namespace", namespace])?;
    // The initial list: every pod, none annotated.
    let mut events = Vec::new();
    let mut seen = HashSet::new();
    let listed_by = Instant::now() + Duration::from_secs(30);
    while seen.len() < pods && Instant::now() < listed_by {
        if let Some((at, pod)) = pod_watch.next(Duration::from_millis(200))? {
            seen.extend(name_of(&pod).map(str::to_owned));
            events.push((at, pod));
        }
    }
    let cpu_before = processes.agent_stat()?;
    let wall = Instant::now();
    cluster.kubectl(&["label", "namespace", namespace, AMBIENT_LABEL])?;
    let (key, value) = AMBIENT_LABEL.split_once('=').unwrap_or_default();
    let labelled_at = loop {
        let Some((at, ns)) = ns_watch.next(Duration::from_secs(30))? else {
            bail!("{namespace}: no watch event with its label in 30 s");
        };
        if ns["metadata"]["labels"][key] == value {
            break at;
        }
    };
    let mut annotated: HashMap<String, f64> = HashMap::new();
    for (at, pod) in &events {
        consider(*at, pod, &mut annotated);
    }
    if !annotated.is_empty() {
        bail!(
            "{namespace}: {} pods were annotated before the label",
            annotated.len()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(300 + 2 * pods as u64);
    while annotated.len() < pods {
        if Instant::now() > deadline {
            bail!(
                "{namespace}: {} of {pods} pods annotated after the label",
                annotated.len()
            );
        }
        if let Some((at, pod)) = pod_watch.next(Duration::from_secs(1))? {
            consider(at, &pod, &mut annotated);
        }
    }
    let cpu_after = processes.agent_stat()?;
    let cpu = proc::cpu_share(
        &cpu_before,
        &cpu_after,
        wall.elapsed().as_secs_f64(),
        proc::clock_ticks_per_second(),
    );
    drop(pod_watch);
    drop(ns_watch);
    let per_pod: Vec<f64> = annotated
        .values()
        .map(|at| (at - labelled_at) * 1000.0)
        .collect();
    let all_ms = per_pod.iter().copied().fold(0.0, f64::max);
    let enrol = Enrol {
        pods,
        all_ms,
        per_pod_ms: Summary::of(&per_pod).context("no pod annotated")?,
        cpu,
    };
    // Let the enrolment's garbage settle before reading memory.
    std::thread::sleep(Duration::from_secs(5));
    let (rss_kib, pod_rss_kib) = processes.rss_kib()?;
    let idle = proc::idle_cpu(&processes, idle)?;
    Ok((
        enrol,
        Cost {
            agent_pid: processes.agent_pid,
            rss_kib,
            pod_rss_kib,
            idle,
        },
    ))
}

/// Files a pod's first event carrying the redirection annotation.
fn consider(at: f64, pod: &serde_json::Value, annotated: &mut HashMap<String, f64>) {
    if let Some(name) = name_of(pod)
        && pod["metadata"]["annotations"][REDIRECTION] == "enabled"
    {
        annotated.entry(name.to_owned()).or_insert(at);
    }
}

/// What a node agent may leave on the node that would change the next
/// agent's figures: a CNI configuration naming a plugin of Istio or ambpf,
/// nftables tables, ipsets and iptables chains of either. Best effort: a
/// tool the node lacks is skipped.
pub fn leftovers(cluster: &Cluster) -> Vec<String> {
    let mut found = Vec::new();
    if let Ok(files) = cluster.on_node("ls", &["-1", "/etc/cni/net.d"]) {
        for file in files.lines() {
            if let Ok(text) = cluster.on_node("cat", &[&format!("/etc/cni/net.d/{file}")])
                && !agent_mentions(&text).is_empty()
            {
                found.push(format!(
                    "/etc/cni/net.d/{file} names {}",
                    agent_mentions(&text).join(" ")
                ));
            }
        }
    }
    for (program, args) in [
        ("nft", &["list", "tables"][..]),
        ("ipset", &["list", "-n"][..]),
        ("iptables-save", &[][..]),
    ] {
        if let Ok(out) = cluster.on_node(program, args) {
            let lines = agent_mentions(&out);
            if !lines.is_empty() {
                found.push(format!("{program}: {}", lines.join("; ")));
            }
        }
    }
    found
}

/// The lines of `text` naming Istio or ambpf, but for the node's own CNI
/// network, `ambpf-cluster` (its conflist and the bridge plugin's
/// masquerade rules' comments name it).
fn agent_mentions(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase().replace("ambpf-cluster", "");
            l.contains("istio") || l.contains("ambpf")
        })
        .map(|l| l.trim().to_owned())
        .collect()
}

/// Deletes a namespace and waits until it is gone.
pub fn delete_namespace(cluster: &Cluster, namespace: &str) -> Result<()> {
    cluster
        .kubectl(&[
            "delete",
            "namespace",
            namespace,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=600s",
        ])
        .map(drop)
}

/// Deletes every namespace a benchmark made (an interrupted run's).
pub fn delete_bench_namespaces(cluster: &Cluster) -> Result<()> {
    let started = boottime();
    cluster.kubectl(&[
        "delete",
        "namespace",
        "-l",
        BENCH_LABEL,
        "--wait=true",
        "--timeout=600s",
    ])?;
    if boottime() - started > 1.0 {
        println!(
            "deleted the namespaces of an earlier run in {:.0} s",
            boottime() - started
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uptime_logs_give_each_pods_first_line() {
        let logs = "[pod/podstart-7d9c-abcde/app] 21136.42 27513.61\n\
                    [pod/podstart-7d9c-fghij/app] 21137.05 27514.00\n\
                    [pod/podstart-7d9c-abcde/app] 99999.00 0\n\
                    garbage line\n";
        let uptimes = parse_uptime_logs(logs);
        assert_eq!(uptimes.len(), 2);
        assert!((uptimes["podstart-7d9c-abcde"] - 21136.42).abs() < 1e-9);
        assert!((uptimes["podstart-7d9c-fghij"] - 21137.05).abs() < 1e-9);
    }

    #[test]
    fn leftovers_are_agents_not_the_nodes_own_network() {
        let conflist =
            r#"{"name": "ambpf-cluster", "plugins": [{"type": "bridge"}, {"type": "istio-cni"}]}"#;
        assert_eq!(agent_mentions(conflist).len(), 1);
        let nat = "-A POSTROUTING -s 10.244.0.5/32 -m comment --comment \"name: \\\"ambpf-cluster\\\" id: \\\"abc\\\"\" -j CNI-1\n\
                   -A ISTIO_POSTRT -m owner --socket-exists -j SNAT\n";
        assert_eq!(
            agent_mentions(nat),
            vec!["-A ISTIO_POSTRT -m owner --socket-exists -j SNAT"]
        );
        assert!(agent_mentions("table inet filter\n").is_empty());
    }

    #[test]
    fn the_workload_is_ambient_only_when_asked() {
        let labels = |yaml: &str| {
            let namespace: serde_json::Value =
                serde_json::from_str(yaml.split("\n---\n").next().unwrap()).unwrap();
            namespace["metadata"]["labels"].clone()
        };
        let ambient = workload_yaml("ns", true, "podstart", 0, false);
        assert_eq!(
            labels(&ambient),
            json!({"ambpf-bench": "true", "istio.io/dataplane-mode": "ambient"})
        );
        assert!(!ambient.contains("readinessProbe"));
        let plain = workload_yaml("ns", false, "enrol", 100, true);
        assert_eq!(labels(&plain), json!({"ambpf-bench": "true"}));
        assert!(plain.contains("readinessProbe"));
    }
}
