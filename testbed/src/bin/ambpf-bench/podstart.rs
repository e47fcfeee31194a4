//! `podstart`: what ambpf adds to a pod's start, as kubelet sees it: the
//! latency of CRI RunPodSandbox on the testbed's containerd node
//! ([`Node`]: containerd 1.6, the real `bridge`/`host-local` plugins), with
//! no ambpf, with ambpf in iptables mode and in eBPF mode.
//!
//! Each mode has its own node (containerd, network namespace, cgroup, API
//! server on the node's loopback); in the two ambpf modes `ambpf cni-install`
//! chained `ambpf-cni` into its conflist and `ambpf run --pod-source kube`
//! serves it, with a ZDS-only ztunnel double connected, so a sandbox's CNI
//! ADD returns only once the pod is redirected and ztunnel has acked it
//! (the agent's time is reported by phase: decide, enrol, and the wait for
//! ztunnel's ack).
//! A fourth node without ambpf (`no ambpf, 2nd`) is the control: what two
//! identical nodes differ by in the same run is the floor under which an
//! "added" figure is noise. Rounds start one fresh ambient pod per node,
//! nodes in a balanced order (each first, and right after each other node,
//! equally often), so all share the machine's noise; each pod is
//! removed (StopPodSandbox, RemovePodSandbox, deleted from the API server,
//! gone from the double) before the next, untimed.

use std::ffi::OsStr;

use ambpf_testbed::{
    apiserver::ApiServer,
    node::{Cri, Node, NodeConfig, PodSpec, namespace_object},
};
use serde_json::json;

use super::{
    redirect::{Agent, Mode},
    *,
};

const NODE_NAME: &str = "bench-node";
const NAMESPACE: &str = "mesh";
/// A hang, not a slow result.
const TIMEOUT: Duration = Duration::from_secs(120);
const SOCKET_TIMEOUT: Duration = Duration::from_secs(30);
/// The nodes: the baseline first, the control last.
const LANES: [(Mode, &str); 5] = [
    (Mode::Direct, "no ambpf"),
    (Mode::Iptables, "iptables"),
    (Mode::Nftables, "nftables"),
    (Mode::Ebpf, "ebpf"),
    (Mode::Direct, "no ambpf, 2nd"),
];

#[derive(Args)]
pub(super) struct PodstartArgs {
    #[command(flatten)]
    common: Common,
    /// Pods measured per mode.
    #[arg(long, default_value_t = 60)]
    pods: usize,
    /// Rounds run first and not counted (caches, first-pod setup).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
}

#[derive(Serialize)]
struct Config {
    pods: usize,
    warmup: usize,
    agent: PathBuf,
    containerd: String,
}

#[derive(Clone, Debug, Serialize)]
struct ModeResult {
    /// `direct`: no ambpf.
    mode: Mode,
    node: &'static str,
    run_pod_sandbox_ms: Stats,
    /// p50 and p99 over no ambpf's.
    added_p50_ms: f64,
    added_p99_ms: f64,
    /// The agent's own mean time per measured ADD, by phase
    /// (`ambpf_cni_add_duration_seconds_sum`): how much of what is added happens
    /// between the plugin's request and the agent's answer.
    agent_ms_per_add: BTreeMap<String, f64>,
    samples_ms: Vec<f64>,
}

/// One mode's node, and its agent and double.
struct Lane {
    mode: Mode,
    label: &'static str,
    // Field order is drop order: the agent before its node.
    agent: Option<Agent>,
    ztunnel: Option<ZtunnelDouble>,
    api: ApiServer,
    cri: Cri,
    node: Node,
    samples: Vec<f64>,
    /// Each round's untimed teardown, to see where a round's time goes:
    /// StopPodSandbox + RemovePodSandbox, then the API delete until the
    /// double's Del.
    remove_ms: Vec<f64>,
    ztunnel_del_ms: Vec<f64>,
    /// The agent's CNI timings when the measured rounds began.
    agent_before: BTreeMap<String, f64>,
    agent_ms_per_add: BTreeMap<String, f64>,
}

impl Lane {
    async fn start(
        (mode, label): (Mode, &'static str),
        binary: &Path,
        work: &TempDir,
    ) -> Result<Self> {
        let node = Node::start(NodeConfig::default()).context("starting containerd")?;
        let cri = node.cri().await?;
        let api = ApiServer::start_in(&node.netns.path()).await?;
        api.apply("namespaces", namespace_object(NAMESPACE, true));
        let mut lane = Self {
            mode,
            label,
            agent: None,
            ztunnel: None,
            api,
            cri,
            node,
            samples: Vec::new(),
            remove_ms: Vec::new(),
            ztunnel_del_ms: Vec::new(),
            agent_before: BTreeMap::new(),
            agent_ms_per_add: BTreeMap::new(),
        };
        if mode != Mode::Direct {
            lane.start_agent(binary, work).await?;
        }
        Ok(lane)
    }

    /// `ambpf run` on the node, the plugin chained, the double connected.
    async fn start_agent(&mut self, binary: &Path, work: &TempDir) -> Result<()> {
        let name = self.mode.name();
        let kubeconfig = work.join(format!("kubeconfig-{name}"));
        std::fs::write(&kubeconfig, self.api.kubeconfig())?;
        let cni_socket = work.join(format!("cni-{name}.sock"));
        let zds_socket = work.join(format!("ztunnel-{name}.sock"));
        let source = [
            OsStr::new("--pod-source"),
            OsStr::new("kube"),
            OsStr::new("--node-name"),
            OsStr::new(NODE_NAME),
            OsStr::new("--kubeconfig"),
            kubeconfig.as_os_str(),
            OsStr::new("--cni-socket"),
            cni_socket.as_os_str(),
        ];
        let mut agent = Agent::spawn(
            binary,
            self.mode,
            &self.node.netns,
            &source,
            &zds_socket,
            &self.node.cgroup_v2(),
            &work.join(format!("agent-{name}.log")),
        )?;
        wait_for_socket(&mut agent.process, &cni_socket, SOCKET_TIMEOUT).await?;
        let plugin = binary.with_file_name("ambpf-cni");
        let out = self.node.cni_install(binary, &plugin, &cni_socket)?;
        ensure!(
            out.status.success(),
            "ambpf cni-install: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.ztunnel = Some(ZtunnelDouble::connect_with_retry(
            &zds_socket,
            ZtunnelConfig::zds_only(),
        ));
        self.agent = Some(agent);
        Ok(())
    }

    /// The agent's CNI timings so far (seconds by phase, and `adds`), none
    /// without an agent.
    fn agent_cni_times(&self) -> Result<BTreeMap<String, f64>> {
        if self.agent.is_none() {
            return Ok(BTreeMap::new());
        }
        let mut times = parse_cni_times(&agent_metrics(&self.node.netns)?);
        // Everything the agent does for a round (one ADD each), not only
        // the ADD: the source's passes, the annotation, the removal.
        if let Some(agent) = &self.agent {
            let cpu = ambpf_testbed::bench::cpu_time(agent.pid())?
                .total()
                .as_secs_f64();
            times.insert("cpu per round".to_owned(), cpu);
        }
        Ok(times)
    }

    /// Starts a fresh pod, timing RunPodSandbox, then removes it.
    async fn measure_one(&mut self, round: usize) -> Result<f64> {
        let pod = PodSpec::new(NAMESPACE, &format!("bench-{round}"));
        self.api.apply("pods", pod.object(NODE_NAME));
        let started = Instant::now();
        let sandbox = tokio::time::timeout(TIMEOUT, self.cri.run_sandbox(&pod))
            .await
            .context("RunPodSandbox hung")?;
        let elapsed = ms(started.elapsed());
        let sandbox = sandbox.map_err(|e| {
            let agent_log = self.agent.as_ref().map(|a| a.process.log_tail(20));
            anyhow::anyhow!(
                "RunPodSandbox ({}): {e}\n{}",
                self.mode.name(),
                agent_log.unwrap_or_default()
            )
        })?;
        let removing = Instant::now();
        tokio::time::timeout(TIMEOUT, self.cri.remove_pod(&sandbox))
            .await
            .context("removing the sandbox hung")??;
        self.remove_ms.push(ms(removing.elapsed()));
        let deleting = Instant::now();
        self.api.delete("pods", NAMESPACE, &pod.name);
        if let Some(ztunnel) = &self.ztunnel {
            let uid = pod.uid.clone();
            ztunnel
                .wait_until(|s| !s.workloads.contains_key(&uid), TIMEOUT)
                .await
                .map_err(|e| anyhow::anyhow!("pod {} never left ztunnel: {e}", pod.uid))?;
            self.ztunnel_del_ms.push(ms(deleting.elapsed()));
        }
        Ok(elapsed)
    }
}

/// The agent's CNI ADD time so far, in seconds by phase
/// (`ambpf_cni_add_duration_seconds_sum{phase}`), and the ADDs answered
/// (`adds`: enrolled, skipped or refused).
fn parse_cni_times(metrics: &str) -> BTreeMap<String, f64> {
    let mut times = labelled_series(metrics, "ambpf_cni_add_duration_seconds_sum", "phase");
    let adds = ["enrolled", "skipped", "refused"]
        .iter()
        .filter_map(|outcome| {
            let line = format!("ambpf_cni_adds_{outcome}_total ");
            metrics.lines().find_map(|l| l.strip_prefix(line.as_str()))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum();
    times.insert("adds".to_owned(), adds);
    times
}

pub(super) async fn run(args: PodstartArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.pods > 0, "--pods must be at least 1");
    let suite = SuiteRun::start("podstart");
    let binary = std::path::absolute(&args.common.agent)?;
    let work = TempDir::create("ambpf-bench-podstart")?;
    let mut lanes = Vec::new();
    for lane in LANES {
        let lane = Lane::start(lane, &binary, &work)
            .await
            .with_context(|| format!("setting up the {} node", lane.1))?;
        lanes.push(lane);
    }
    let containerd = lanes[0].cri.version().await?.runtime_version;
    for round in 0..args.warmup + args.pods {
        for k in bench::balanced_order(lanes.len(), round) {
            let lane = &mut lanes[k];
            let elapsed = lane
                .measure_one(round)
                .await
                .with_context(|| format!("round {round}, {}", lane.label))?;
            if round >= args.warmup {
                lane.samples.push(elapsed);
            }
        }
        if round + 1 == args.warmup {
            for lane in &mut lanes {
                lane.agent_before = lane.agent_cni_times()?;
            }
        }
        if (round + 1) % 10 == 0 {
            eprintln!("podstart: {} rounds", round + 1);
            for lane in &lanes {
                let p50 = |v: &[f64]| Stats::of(v).map_or(f64::NAN, |s| s.median);
                eprintln!(
                    "podstart:   {:<13} RunPodSandbox p50 {:.1} ms; untimed: remove p50 {:.1} ms, API delete to ztunnel Del p50 {:.1} ms",
                    lane.label,
                    p50(&lane.samples),
                    p50(&lane.remove_ms),
                    p50(&lane.ztunnel_del_ms),
                );
            }
        }
    }
    for lane in &mut lanes {
        let after = lane.agent_cni_times()?;
        let before = |key: &str| lane.agent_before.get(key).copied().unwrap_or(0.0);
        let adds = after.get("adds").copied().unwrap_or(0.0) - before("adds");
        if adds > 0.0 {
            lane.agent_ms_per_add = after
                .iter()
                .filter(|(phase, _)| *phase != "adds")
                .map(|(phase, s)| (phase.clone(), (s - before(phase)) * 1e3 / adds))
                .collect();
        }
    }
    let results = summarize(&lanes)?;
    print_table(&results, args.pods);
    drop(lanes);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            pods: args.pods,
            warmup: args.warmup,
            agent: binary,
            containerd,
        },
        json!({ "modes": results }),
    )?;
    Ok(())
}

fn summarize(lanes: &[Lane]) -> Result<Vec<ModeResult>> {
    let stats = |lane: &Lane| Stats::of(&lane.samples).context("no samples");
    let none = stats(&lanes[0])?;
    lanes
        .iter()
        .map(|lane| {
            let s = stats(lane)?;
            Ok(ModeResult {
                mode: lane.mode,
                node: lane.label,
                run_pod_sandbox_ms: s,
                added_p50_ms: s.median - none.median,
                added_p99_ms: s.p99 - none.p99,
                agent_ms_per_add: lane.agent_ms_per_add.clone(),
                samples_ms: lane.samples.clone(),
            })
        })
        .collect()
}

fn print_table(results: &[ModeResult], pods: usize) {
    let f1 = |v: f64| format!("{v:.1}");
    println!();
    println!(
        "RunPodSandbox, {pods} fresh pods per node (ms; \"added\" over the first node without ambpf)"
    );
    let mut table = Table::new([
        "node",
        "p50",
        "p90",
        "p99",
        "mean",
        "added p50",
        "added p99",
    ]);
    for r in results {
        let s = &r.run_pod_sandbox_ms;
        table.row([
            r.node.to_owned(),
            f1(s.median),
            f1(s.p90),
            f1(s.p99),
            f1(s.mean),
            f1(r.added_p50_ms),
            f1(r.added_p99_ms),
        ]);
    }
    println!("{table}");
    if let Some(control) = results.last() {
        println!(
            "two nodes without ambpf differ by {:.1} ms at p50, {:.1} ms at p99 in this run: \
             \"added\" figures within that are noise",
            control.added_p50_ms, control.added_p99_ms
        );
    }
    let lane = |label: &str| results.iter().find(|r| r.node == label);
    if let Some(ebpf) = lane("ebpf") {
        let p50 = |r: &ModeResult| Some(r.run_pod_sandbox_ms.median);
        for baseline in bench::istio_baselines(|b| lane(b).and_then(p50), true) {
            let Some(base) = lane(baseline.backend) else {
                continue;
            };
            println!(
                "eBPF over {}: p50 {:.2}x, p99 {:.2}x; added p50 {:.1} ms vs {:.1} ms",
                baseline.label,
                ebpf.run_pod_sandbox_ms.median / base.run_pod_sandbox_ms.median,
                ebpf.run_pod_sandbox_ms.p99 / base.run_pod_sandbox_ms.p99,
                ebpf.added_p50_ms,
                base.added_p50_ms,
            );
        }
    }
    for r in results.iter().filter(|r| !r.agent_ms_per_add.is_empty()) {
        let phases: Vec<String> = r
            .agent_ms_per_add
            .iter()
            .map(|(phase, ms)| format!("{phase} {ms:.2}"))
            .collect();
        println!(
            "{}: the agent's time per ADD, mean ms: {} (the rest of \"added\" is outside the agent: \
             the plugin's exec and request, containerd)",
            r.node,
            phases.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cni_times_are_read_from_the_agents_metrics() {
        // The agent's registry (`ambpf::observe::registry`) encoded after
        // three ADDs: two enrolled, one skipped (decided only).
        let metrics = include_str!("testdata/cni-metrics.txt");
        let times = parse_cni_times(metrics);
        let close = |key: &str, want: f64| {
            let got = times[key];
            assert!((got - want).abs() < 1e-9, "{key}: {got} != {want}");
        };
        close("decide", 0.0023);
        close("enrol", 0.0055);
        close("ztunnel", 0.0117);
        close("answer", 0.0206);
        close("adds", 3.0);
        assert_eq!(times.len(), 5, "{times:?}");
    }
}
