//! The `storm` suite of `ambpf-bench` (a module of that binary; not part of the
//! library).
//!
//! A connection storm past the original-destination capacity: the agent
//! runs with `--max-redirected-connections C`, and its enrolled pods open
//! `M × C` connections at once (each pod all its connects first,
//! non-blocking, to servers in the `remote` namespace taken in turn, IPv4
//! and IPv6 alternating), holding every one open, then wait for each one's
//! greeting (each server greets with its port, so a misrouted connection
//! shows). What became of each connection is counted: reached its server,
//! refused (ztunnel closed it: no original destination), not connected,
//! misrouted, hung. The eBPF mode also reports the agent's
//! `ambpf_origdst_misses_total` from its `/metrics`.
//!
//! A storm of the default capacity (65,536) and past it needs hundreds of
//! thousands of descriptors (client, ztunnel's accepted and upstream
//! sockets, server), more than RLIMIT_NOFILE lets one process hold. So the
//! storm is spread over processes of the `storm-part` binary, each within
//! its hard limit ([`Layout`]): one client process per pod, several ztunnel
//! proxy processes per pod (its listeners shared by SO_REUSEPORT, as
//! ztunnel's are), and greeter processes with two ports each. The ztunnel
//! double's ZDS side stays in this process. The original-destination maps
//! are the node's, so the pods' connections share them.
//!
//! The baseline is the iptables mode in the same run (conntrack keeps every
//! REDIRECTed connection's original destination; no capacity of ambpf's),
//! with the same storm. The modes alternate from run to run, every storm gets
//! a fresh cluster, agent, ztunnel double and servers, and the first run is
//! reported apart. `--ztunnel-delay-ms` makes the double wait before asking
//! each connection's original destination (a busy ztunnel), so that more
//! records are pending at once.

use std::collections::BTreeMap;

use ambpf_testbed::storm::StormSummary;

use super::redirect::{Agent, Mode, write_pods_file};
use super::*;

mod parts;
use parts::*;

const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);
const READY_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Args)]
pub(super) struct StormArgs {
    #[command(flatten)]
    common: Common,
    /// `--max-redirected-connections` of the agent.
    #[arg(long, default_value_t = 1024)]
    capacity: u32,
    /// Storm sizes, as multiples of the capacity, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    multiples: Vec<f64>,
    /// Runs of each storm in each mode.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Milliseconds the ztunnel double waits before asking each connection's
    /// original destination.
    #[arg(long, default_value_t = 0)]
    ztunnel_delay_ms: u64,
    /// Seconds each connection may take to be greeted or closed.
    #[arg(long, default_value_t = 20)]
    patience_secs: u64,
}

#[derive(Serialize)]
struct Config {
    capacity: u32,
    multiples: Vec<f64>,
    runs: usize,
    ztunnel_delay_ms: u64,
    agent: PathBuf,
}

#[derive(Clone, Serialize)]
struct Sample {
    run: usize,
    mode: &'static str,
    connections: usize,
    layout: Layout,
    summary: StormSummary,
    /// Reached connections an echo no longer went through once the storm was
    /// open.
    broken: usize,
    /// Connections the ztunnel double refused (no original destination).
    ztunnel_refused: usize,
    /// eBPF mode: `ambpf_origdst_misses_total` by reason, after the storm.
    misses: BTreeMap<String, u64>,
    /// From `go` to the last client process's report (every connection's
    /// fate known).
    storm_ms: f64,
}

pub(super) async fn run(args: StormArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(args.capacity > 0, "--capacity must be positive");
    ensure!(
        !args.multiples.is_empty() && args.multiples.iter().all(|m| *m > 0.0),
        "--multiples: positive numbers"
    );
    let suite = SuiteRun::start("storm");
    let agent = std::path::absolute(&args.common.agent)?;
    let work = TempDir::create("ambpf-bench-storm")?;
    let cgroup = CgroupGuard::create().context("creating a throwaway cgroup")?;
    let _inside = cgroup.enter_process()?;
    let budget = fd_budget()?;
    eprintln!("storm: up to {budget} descriptors of connections per process");
    let mut samples = Vec::new();
    for run in 0..args.runs {
        for &multiple in &args.multiples {
            let connections = (f64::from(args.capacity) * multiple).round() as usize;
            let layout = Layout::for_storm(connections as u64, budget);
            for mode in bench::alternated([Mode::Iptables, Mode::Ebpf], run) {
                let storm = Storm {
                    args: &args,
                    agent: &agent,
                    work: &work,
                    cgroup: &cgroup,
                    connections,
                    layout: layout.clone(),
                };
                let sample = storm.run(mode, run).await.with_context(|| {
                    format!(
                        "run {} mode {} storm of {connections}",
                        run + 1,
                        mode.name()
                    )
                })?;
                eprintln!(
                    "storm: run {} {:>8} {connections:>6} connections ({:?}): {:?} misses {:?}, {:.0} ms",
                    run + 1,
                    mode.name(),
                    sample.layout,
                    sample.summary,
                    sample.misses,
                    sample.storm_ms,
                );
                samples.push(sample);
            }
        }
    }
    let summary = summarize(&args, &samples);
    print_table(&args, &summary);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            capacity: args.capacity,
            multiples: args.multiples.clone(),
            runs: args.runs,
            ztunnel_delay_ms: args.ztunnel_delay_ms,
            agent,
        },
        serde_json::json!({ "summary": summary, "samples": samples }),
    )?;
    Ok(())
}

/// One storm of one mode, on a fresh cluster, agent and double.
struct Storm<'a> {
    args: &'a StormArgs,
    agent: &'a Path,
    work: &'a TempDir,
    cgroup: &'a CgroupGuard,
    connections: usize,
    layout: Layout,
}

impl Storm<'_> {
    async fn run(self, mode: Mode, run: usize) -> Result<Sample> {
        let Self {
            args,
            connections,
            ref layout,
            ..
        } = self;
        let pod_count = u16::try_from(layout.pods).context("too many storm pods")?;
        let cluster = Cluster::create(pod_count).context("creating the cluster")?;
        let uids: Vec<String> = (0..layout.pods).map(|i| format!("storm-pod-{i}")).collect();
        for pod in &cluster.pods {
            // Every source port the pod may use (the sysctl is per namespace
            // and covers IPv6 too).
            pod.ns.sysctl("net.ipv4.ip_local_port_range=1024 65535")?;
        }
        let (mut greeters, targets) = start_greeters(&cluster.remote, layout.greeters)?;

        let pods_file = self.work.join("pods.json");
        let socket = self.work.join("ztunnel.sock");
        let pods: Vec<(String, PathBuf)> = uids
            .iter()
            .zip(&cluster.pods)
            .map(|(uid, pod)| (uid.clone(), pod.ns.path()))
            .collect();
        write_pods_file(&pods_file, &pods)?;
        let log = self
            .work
            .join(format!("agent-{}-{run}-{connections}.log", mode.name()));
        let capacity = args.capacity.to_string();
        let source = [
            std::ffi::OsStr::new("--pods-file"),
            pods_file.as_os_str(),
            std::ffi::OsStr::new("--max-redirected-connections"),
            std::ffi::OsStr::new(&capacity),
        ];
        let mut agent = Agent::spawn(
            self.agent,
            mode,
            &cluster.node,
            &source,
            &socket,
            self.cgroup.path(),
            &log,
        )?;
        wait_for_socket(&mut agent.process, &socket, SOCKET_TIMEOUT).await?;
        // ztunnel's ZDS side in this process; its proxies are the `proxies`
        // parts below, several serving each pod together.
        let (zt_runtime, _) = redirect::named_runtime("ztunnel-rt", 1, None)?;
        let double = {
            let _enter = zt_runtime.enter();
            ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only())
        };
        double
            .wait_until(
                |s| s.ready && uids.iter().all(|uid| s.workloads.contains_key(uid)),
                READY_TIMEOUT,
            )
            .await
            .map_err(|e| anyhow::anyhow!("ztunnel never got the pods: {e:?}"))?;

        let mut proxies = Vec::with_capacity(layout.pods * layout.proxies_per_pod);
        let mut clients = Vec::with_capacity(layout.pods);
        let delay = args.ztunnel_delay_ms.to_string();
        for (i, (uid, pod)) in uids.iter().zip(&cluster.pods).enumerate() {
            for j in 0..layout.proxies_per_pod {
                let part_args = ["proxies", "--uid", uid, "--original-dst-delay-ms", &delay];
                proxies.push(Part::spawn(
                    &pod.ns,
                    format!("proxies {i}.{j}"),
                    &part_args,
                )?);
            }
            let mut part_args = vec![
                "clients".to_owned(),
                "--count".to_owned(),
                layout.clients_of_pod(connections, i).to_string(),
                "--patience-secs".to_owned(),
                args.patience_secs.to_string(),
            ];
            for target in &targets {
                part_args.extend(["--target".to_owned(), target.to_string()]);
            }
            clients.push(Part::spawn(&pod.ns, format!("clients {i}"), &part_args)?);
        }

        let (summary, broken, storm_ms, accepted) = tokio::task::block_in_place(|| {
            for part in greeters.iter_mut().chain(&mut proxies).chain(&mut clients) {
                part.receive::<serde_json::Value>()?;
            }
            let started = Instant::now();
            for part in &mut clients {
                part.send("go")?;
            }
            let mut summary = StormSummary::default();
            let mut broken = 0;
            for part in &mut clients {
                let report = part.receive::<ClientsReport>()?;
                summary += report.summary;
                broken += report.broken;
            }
            let storm_ms = ms(started.elapsed());
            // Every connection a proxy accepted is recorded once decided.
            let accepted = proxies_report(&mut proxies, summary.reached + summary.refused)?;
            Ok::<_, anyhow::Error>((summary, broken, storm_ms, accepted))
        })?;
        let misses = if mode == Mode::Ebpf {
            origdst_misses(&cluster.node)?
        } else {
            BTreeMap::new()
        };
        drop(clients);
        drop(proxies);
        drop(double);
        drop(zt_runtime);
        agent.stop()?;
        greeters.clear();
        Ok(Sample {
            run,
            mode: mode.name(),
            connections,
            layout: self.layout,
            summary,
            broken,
            ztunnel_refused: accepted.refused_self_call,
            misses,
            storm_ms,
        })
    }
}

/// The agent's `ambpf_origdst_misses_total` by reason.
fn origdst_misses(node: &ambpf_testbed::NetnsGuard) -> Result<BTreeMap<String, u64>> {
    Ok(parse_misses(&agent_metrics(node)?))
}

fn parse_misses(metrics: &str) -> BTreeMap<String, u64> {
    labelled_series(metrics, "ambpf_origdst_misses_total", "reason")
        .into_iter()
        .map(|(reason, value)| (reason, value as u64))
        .collect()
}

#[derive(Serialize)]
struct Row {
    group: &'static str,
    connections: usize,
    mode: &'static str,
    /// Medians over the group's runs.
    reached: f64,
    refused: f64,
    not_connected: f64,
    misrouted: f64,
    hung: f64,
    wrong_peer: f64,
    broken: f64,
    misses_so_original_dst: Option<f64>,
    misses_getpeername: Option<f64>,
    storm_ms: f64,
    /// Reached connections, this mode / iptables (median).
    reached_vs_iptables: f64,
}

fn summarize(args: &StormArgs, samples: &[Sample]) -> Vec<Row> {
    let mut rows = Vec::new();
    for (group, member) in bench::RUN_GROUPS {
        let in_group: Vec<&Sample> = samples
            .iter()
            .filter(|s| member(s.run, args.runs))
            .collect();
        if in_group.is_empty() {
            continue;
        }
        let mut sizes: Vec<usize> = in_group.iter().map(|s| s.connections).collect();
        sizes.dedup();
        sizes.sort_unstable();
        sizes.dedup();
        for connections in sizes {
            let med = |mode: &str, f: &dyn Fn(&Sample) -> f64| {
                let mut v: Vec<f64> = in_group
                    .iter()
                    .filter(|s| s.mode == mode && s.connections == connections)
                    .map(|s| f(s))
                    .collect();
                v.sort_by(f64::total_cmp);
                if v.is_empty() {
                    f64::NAN
                } else {
                    bench::median(&v)
                }
            };
            let baseline = med("iptables", &|s| s.summary.reached as f64);
            for mode in ["iptables", "ebpf"] {
                let reached = med(mode, &|s| s.summary.reached as f64);
                rows.push(Row {
                    group,
                    connections,
                    mode,
                    reached,
                    refused: med(mode, &|s| s.summary.refused as f64),
                    not_connected: med(mode, &|s| s.summary.not_connected as f64),
                    misrouted: med(mode, &|s| s.summary.misrouted as f64),
                    hung: med(mode, &|s| s.summary.hung as f64),
                    wrong_peer: med(mode, &|s| s.summary.wrong_peer as f64),
                    broken: med(mode, &|s| s.broken as f64),
                    misses_so_original_dst: (mode == "ebpf").then(|| {
                        med(mode, &|s| {
                            s.misses.get("so_original_dst").copied().unwrap_or(0) as f64
                        })
                    }),
                    misses_getpeername: (mode == "ebpf").then(|| {
                        med(mode, &|s| {
                            s.misses.get("getpeername").copied().unwrap_or(0) as f64
                        })
                    }),
                    storm_ms: med(mode, &|s| s.storm_ms),
                    reached_vs_iptables: reached / baseline,
                });
            }
        }
    }
    rows
}

fn print_table(args: &StormArgs, rows: &[Row]) {
    println!(
        "\nstorm: --max-redirected-connections {}, ztunnel delay {} ms, {} runs (medians)\n",
        args.capacity, args.ztunnel_delay_ms, args.runs
    );
    println!(
        "| runs | connections | mode | reached | refused (counted) | not connected | misrouted | \
         hung | app's peer wrong (counted) | broken after | storm ms | reached vs iptables |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let counted = |n: f64, misses: Option<f64>| match misses {
        Some(m) => format!("{n} ({m})"),
        None => n.to_string(),
    };
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.2}x |",
            r.group,
            r.connections,
            r.mode,
            r.reached,
            counted(r.refused, r.misses_so_original_dst),
            r.not_connected,
            r.misrouted,
            r.hung,
            counted(r.wrong_peer, r.misses_getpeername),
            r.broken,
            r.storm_ms,
            r.reached_vs_iptables
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_are_read_from_the_agents_metrics() {
        let metrics = "# HELP ambpf_origdst_misses x\n\
                       ambpf_origdst_misses_total{reason=\"so_original_dst\"} 17\n\
                       ambpf_origdst_misses_total{reason=\"not_stored\"} 0\n\
                       ambpf_pods_enrolled 1\n";
        let misses = parse_misses(metrics);
        assert_eq!(misses.get("so_original_dst"), Some(&17));
        assert_eq!(misses.get("not_stored"), Some(&0));
        assert_eq!(misses.len(), 2);
    }
}
