//! The `storm` suite of `ambpf-bench` (a module of that binary, included
//! with `#[path]`; not part of the library).
//!
//! A connection storm past the original-destination capacity: the agent
//! runs with `--max-redirected-connections C`, and one enrolled pod opens
//! `M × C` connections at once (all connects first, non-blocking, to eight
//! servers in the `remote` namespace taken in turn, four on its IPv4 address
//! and four on its IPv6 one), holding every one open,
//! then waits for each one's greeting (each server greets with its port, so
//! a misrouted connection shows). What became of each connection is counted:
//! reached its server, refused (ztunnel closed it: no original destination),
//! not connected, misrouted, hung. The eBPF mode also reports the agent's
//! `ambpf_origdst_misses_total` from its `/metrics`.
//!
//! The baseline is the iptables mode in the same run (conntrack keeps every
//! REDIRECTed connection's original destination; no capacity of ambpf's),
//! with the same storm. The modes alternate from run to run, every storm gets
//! a fresh cluster, agent, ztunnel double and servers, and the first run is
//! reported apart. `--ztunnel-delay-ms` makes the double wait before asking
//! each connection's original destination (a busy ztunnel), so that more
//! records are pending at once.

use std::{collections::BTreeMap, net::SocketAddr};

use ambpf_testbed::{
    storm::{self, Greeters, StormSummary},
    ztunnel::ConnectionOutcome,
};

use super::redirect::{Agent, Mode, write_pods_file};
use super::*;

const POD_UID: &str = "storm-pod";
/// One server per port: four IPv4, four IPv6. Two families double the
/// source ports a pod has towards ztunnel's one listener per family (the
/// eBPF mode connects there), so a storm past the default capacity fits.
const PORTS_V4: [u16; 4] = [9101, 9102, 9103, 9104];
const PORTS_V6: [u16; 4] = [9105, 9106, 9107, 9108];
/// Descriptors this process holds per connection: the client, the double's
/// accepted and upstream sockets, and the server's.
const FDS_PER_CONNECTION: u64 = 4;
const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);
const READY_TIMEOUT: Duration = Duration::from_secs(60);

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
    summary: StormSummary,
    /// Connections the ztunnel double refused (no original destination).
    ztunnel_refused: usize,
    /// eBPF mode: `ambpf_origdst_misses_total` by reason, after the storm.
    misses: BTreeMap<String, u64>,
    /// From the first connect to the last connection's fate.
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
    let largest = args
        .multiples
        .iter()
        .map(|m| (f64::from(args.capacity) * m).round() as u64)
        .max()
        .unwrap_or(0);
    let limit = raise_open_file_limit(largest * FDS_PER_CONNECTION + 4096)?;
    eprintln!("storm: open-file limit {limit}");
    let mut samples = Vec::new();
    for run in 0..args.runs {
        for &multiple in &args.multiples {
            let connections = (f64::from(args.capacity) * multiple).round() as usize;
            for mode in bench::alternated([Mode::Iptables, Mode::Ebpf], run) {
                let sample = storm_once(&args, &agent, &work, &cgroup, mode, run, connections)
                    .await
                    .with_context(|| {
                        format!(
                            "run {} mode {} storm of {connections}",
                            run + 1,
                            mode.name()
                        )
                    })?;
                eprintln!(
                    "storm: run {} {:>8} {connections:>6} connections: {:?} misses {:?}",
                    run + 1,
                    mode.name(),
                    sample.summary,
                    sample.misses
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

async fn storm_once(
    args: &StormArgs,
    agent_binary: &Path,
    work: &TempDir,
    cgroup: &CgroupGuard,
    mode: Mode,
    run: usize,
    connections: usize,
) -> Result<Sample> {
    let cluster = Cluster::create(1).context("creating the cluster")?;
    let pod = &cluster.pods[0];
    // Every source port the pod may use (the sysctl is per namespace and
    // covers IPv6 too).
    pod.ns.sysctl("net.ipv4.ip_local_port_range=1024 65535")?;
    // The node's conntrack table must hold the iptables mode's storm.
    let v4 = PORTS_V4
        .iter()
        .map(|port| SocketAddr::new(cluster.remote.addrs.v4.into(), *port));
    let v6 = PORTS_V6
        .iter()
        .map(|port| SocketAddr::new(cluster.remote.addrs.v6.into(), *port));
    // Families alternate, so each takes half of the storm.
    let targets: Vec<SocketAddr> = v4.zip(v6).flat_map(|(a, b)| [a, b]).collect();
    let greeters = Greeters::start(&cluster.remote.ns, &targets)?;
    let pods_file = work.join("pods.json");
    let socket = work.join("ztunnel.sock");
    write_pods_file(&pods_file, &[(POD_UID.to_owned(), pod.ns.path())])?;
    let log = work.join(format!("agent-{}-{run}-{connections}.log", mode.name()));
    let capacity = args.capacity.to_string();
    let source = [
        std::ffi::OsStr::new("--pods-file"),
        pods_file.as_os_str(),
        std::ffi::OsStr::new("--max-redirected-connections"),
        std::ffi::OsStr::new(&capacity),
    ];
    let mut agent = Agent::spawn(
        agent_binary,
        mode,
        &cluster.node,
        &source,
        &socket,
        cgroup.path(),
        &log,
    )?;
    wait_for_socket(&mut agent.process, &socket, SOCKET_TIMEOUT).await?;
    let (zt_runtime, _) = redirect::named_runtime("ztunnel-rt", 2, None)?;
    let config =
        ZtunnelConfig::default().original_dst_delay(Duration::from_millis(args.ztunnel_delay_ms));
    let double = {
        let _enter = zt_runtime.enter();
        ZtunnelDouble::connect_with_retry(&socket, config)
    };
    double
        .wait_until(
            |s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running),
            READY_TIMEOUT,
        )
        .await
        .map_err(|e| anyhow::anyhow!("ztunnel never got the pod: {e:?}"))?;

    let patience = Duration::from_secs(args.patience_secs);
    let started = Instant::now();
    let opened =
        tokio::task::block_in_place(|| storm::storm(&pod.ns, &targets, connections, patience))?;
    let storm_ms = ms(started.elapsed());
    let summary = StormSummary::of(&opened);
    // Every connection the double accepted is recorded once decided.
    let accepted = summary.reached + summary.refused;
    let _ = double
        .wait_until(|s| s.proxied.len() >= accepted, READY_TIMEOUT)
        .await;
    let ztunnel_refused = double
        .proxied()
        .iter()
        .filter(|c| c.outcome == ConnectionOutcome::RefusedSelfCall)
        .count();
    let misses = if mode == Mode::Ebpf {
        origdst_misses(&cluster.node)?
    } else {
        BTreeMap::new()
    };
    drop(opened);
    drop(double);
    drop(zt_runtime);
    agent.stop()?;
    drop(greeters);
    Ok(Sample {
        run,
        mode: mode.name(),
        connections,
        summary,
        ztunnel_refused,
        misses,
        storm_ms,
    })
}

/// Raises this process's open-file limit (soft and hard) to at least
/// `wanted`, as far as the kernel allows (`fs.nr_open`); returns the limit.
/// Past the hard limit that takes CAP_SYS_RESOURCE: without it, a storm
/// that needs more is refused with the largest that fits.
fn raise_open_file_limit(wanted: u64) -> Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft >= wanted {
        return Ok(soft);
    }
    let ceiling: u64 = std::fs::read_to_string("/proc/sys/fs/nr_open")?
        .trim()
        .parse()
        .context("fs.nr_open")?;
    let limit = wanted.min(ceiling);
    if setrlimit(Resource::RLIMIT_NOFILE, limit, limit.max(hard)).is_ok() {
        return Ok(limit);
    }
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    bail!(
        "this storm needs {wanted} open files; the hard limit is {hard} and raising it \
         needs CAP_SYS_RESOURCE, which this process lacks: the largest storm that fits is \
         {} connections ({FDS_PER_CONNECTION} descriptors each)",
        hard.saturating_sub(4096) / FDS_PER_CONNECTION
    )
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
    misses_so_original_dst: Option<f64>,
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
                    misses_so_original_dst: (mode == "ebpf").then(|| {
                        med(mode, &|s| {
                            s.misses.get("so_original_dst").copied().unwrap_or(0) as f64
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
        "| runs | connections | mode | reached | refused | not connected | misrouted | hung | \
         misses counted | storm ms | reached vs iptables |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.2}x |",
            r.group,
            r.connections,
            r.mode,
            r.reached,
            r.refused,
            r.not_connected,
            r.misrouted,
            r.hung,
            r.misses_so_original_dst
                .map_or("–".to_owned(), |m| m.to_string()),
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
