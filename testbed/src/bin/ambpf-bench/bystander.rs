//! The `bystander` suite of `ambpf-bench`: what ambpf costs traffic it does
//! not capture.
//!
//! A node (a testbed [`Cluster`] of two pods) with pod 1 enrolled and pod 2
//! not (a pod outside the ambient mesh), in up to four modes measured in the
//! same run, in a rotated order each round:
//!
//! - `direct`: no agent, nothing enrolled: the floor;
//! - `iptables bystander`, `nftables bystander`, `ebpf bystander`: the agent
//!   in that mode with pod 1 enrolled and the ztunnel double serving it.
//!
//! Two bystanders are measured in each, to the echo server in the `remote`
//! namespace (off the node): pod 2's app (`pod`: in iptables and nftables
//! modes nothing of ambpf is in its namespace; in eBPF mode the socket
//! programs run for its connects and let them go) and the node namespace's
//! own connections (`node`: where iptables and nftables modes keep the host
//! probe rules). This process, and so every load-generator thread, is in the
//! cgroup the agent attaches its socket programs to (`--cgroup`), checked per
//! measurement from `/proc/self/task/*/cgroup`; the programs that run there
//! are read with `BPF_PROG_QUERY`, and, when the machine's BPF statistics
//! are on (`kernel.bpf_stats_enabled`, never changed by the suite), how
//! often each ran for the bystander's traffic.
//!
//! Each mode of each run gets a fresh cluster, echo server, agent and
//! double; the first run is reported apart. Each bystander's figures are
//! the `redirect` suite's (connection rate, kept-alive latency, conntrack
//! entries, CPU), summarised by the same code.

use std::net::SocketAddr;

use ambpf_testbed::NetnsGuard;

use super::*;
use crate::redirect::{
    ALL_COMPARED, Compared, Direction, Mode, ModeRun, PEER_PORT, POD_UID, Served, Tables, Traffic,
    compared_modes, conntrack_around, print_tables, rotated, summarize, taken_by,
};

mod programs;
use programs::Program;

#[derive(Args)]
pub(super) struct BystanderArgs {
    #[command(flatten)]
    common: Common,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    clients: Vec<usize>,
    /// Measured seconds per test (after the warm-up).
    #[arg(long, default_value_t = 2.0)]
    duration_secs: f64,
    /// Unmeasured seconds at the start of each test.
    #[arg(long, default_value_t = 0.5)]
    warmup_secs: f64,
    /// The agent's modes measured beside no agent, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = ALL_COMPARED)]
    modes: Vec<Compared>,
    /// Rounds of the modes, each in a rotated order.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Sequential connections for the conntrack count.
    #[arg(long, default_value_t = 200)]
    conntrack_connections: u64,
    /// Worker threads of the load generator's runtime.
    #[arg(long, default_value_t = 2)]
    loadgen_threads: usize,
}

/// Whose connections are measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Source {
    /// A pod on the node that is not enrolled.
    Pod,
    /// The node namespace itself.
    Node,
}

impl Source {
    const ALL: [Source; 2] = [Source::Pod, Source::Node];

    fn name(self) -> &'static str {
        match self {
            Source::Pod => "pod",
            Source::Node => "node",
        }
    }

    fn described(self) -> &'static str {
        match self {
            Source::Pod => "a pod that is not enrolled (another pod is)",
            Source::Node => "the node namespace's own connections",
        }
    }
}

/// The agent's mode with no pod of the bystander's enrolled.
fn bystander_mode(mode: Mode) -> Mode {
    match mode {
        Mode::Iptables => Mode::IptablesBystander,
        Mode::Nftables => Mode::NftablesBystander,
        _ => Mode::EbpfBystander,
    }
}

#[derive(Serialize)]
struct Config {
    clients: Vec<usize>,
    duration_s: f64,
    warmup_s: f64,
    runs: usize,
    conntrack_connections: u64,
    loadgen_threads: usize,
    /// Whether the kernel counted program runs (`kernel.bpf_stats_enabled`).
    bpf_stats_enabled: bool,
    agent: PathBuf,
}

/// One bystander in one mode of one run.
#[derive(Clone, Debug, Serialize)]
struct SourceRun {
    source: Source,
    /// The programs that ran at the bystander's cgroup, and how often over
    /// its traffic (0 with the machine's BPF statistics off).
    programs: Vec<Program>,
    #[serde(flatten)]
    measured: ModeRun,
}

pub(super) async fn run(args: BystanderArgs) -> Result<()> {
    preflight(&args.common)?;
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(
        !args.clients.is_empty() && args.clients.iter().all(|&c| c > 0),
        "--clients: positive counts"
    );
    ensure!(
        args.duration_secs > 0.0 && args.warmup_secs >= 0.0,
        "--duration-secs must be positive"
    );
    let suite = SuiteRun::start("bystander");
    let agent = std::path::absolute(&args.common.agent)?;
    let mut modes = vec![Mode::Direct];
    modes.extend(compared_modes(&args.modes)?.into_iter().map(bystander_mode));
    let stats = programs::stats_enabled();
    let names: Vec<&str> = modes.iter().map(|m| m.name()).collect();
    eprintln!(
        "bystander: clients {:?}, {} s (+{} s warm-up) per test, {} runs of {}; program run counts {}",
        args.clients,
        args.duration_secs,
        args.warmup_secs,
        args.runs,
        names.join(", "),
        if stats {
            "on (kernel.bpf_stats_enabled)"
        } else {
            "off (kernel.bpf_stats_enabled is 0; the programs attached are still checked)"
        }
    );
    let work = TempDir::create("ambpf-bench-bystander")?;
    let cgroup = CgroupGuard::create().context("creating a throwaway cgroup")?;
    let _inside = cgroup.enter_process()?;

    let mut runs: Vec<SourceRun> = Vec::new();
    for run in 0..args.runs {
        let order = rotated(&modes, run);
        let names: Vec<&str> = order.iter().map(|m| m.name()).collect();
        eprintln!(
            "bystander: run {} of {}: {}",
            run + 1,
            args.runs,
            names.join(", ")
        );
        for &mode in &order {
            let measured = measure_mode(&args, &agent, &work, &cgroup, mode, run, stats)
                .await
                .with_context(|| format!("run {} mode {}", run + 1, mode.name()))?;
            runs.extend(measured);
        }
    }

    let mut results = serde_json::Map::new();
    for source in Source::ALL {
        let mut summaries = serde_json::Map::new();
        for (group, member) in bench::RUN_GROUPS {
            let in_group: Vec<ModeRun> = runs
                .iter()
                .filter(|r| r.source == source && member(r.measured.run, args.runs))
                .map(|r| r.measured.clone())
                .collect();
            if in_group.is_empty() {
                continue;
            }
            let summary = summarize(&in_group, &args.clients, &modes);
            println!();
            println!("#### bystander: {}", source.described());
            let tables = Tables {
                direction: Direction::Outbound,
                duration_secs: args.duration_secs,
                conntrack_connections: args.conntrack_connections,
                bystander: source.described(),
            };
            print_tables(&summary, &in_group, &tables, group);
            let key = if group == "steady" {
                "summary"
            } else {
                "summary_first"
            };
            summaries.insert(key.to_owned(), serde_json::to_value(&summary)?);
        }
        results.insert(source.name().to_owned(), summaries.into());
    }
    print_program_runs(&runs, stats);
    results.insert("runs".to_owned(), serde_json::to_value(&runs)?);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            clients: args.clients.clone(),
            duration_s: args.duration_secs,
            warmup_s: args.warmup_secs,
            runs: args.runs,
            conntrack_connections: args.conntrack_connections,
            loadgen_threads: args.loadgen_threads,
            bpf_stats_enabled: stats,
            agent,
        },
        results,
    )?;
    Ok(())
}

/// The programs at the bystanders' cgroup per mode, and (statistics on)
/// their runs per connection of the bystander's.
fn print_program_runs(runs: &[SourceRun], stats: bool) {
    println!();
    println!(
        "Programs at the bystanders' cgroup (BPF_PROG_QUERY, effective){}",
        if stats {
            "; runs per connection of the bystander's (run_cnt)"
        } else {
            "; run counts not read: kernel.bpf_stats_enabled is 0"
        }
    );
    let mut table = Table::new(["run", "mode", "source", "programs", "connect4 runs/conn"]);
    for r in runs {
        let connections: u64 = r.measured.points.iter().map(|p| p.connections()).sum();
        let connect4: u64 = r
            .programs
            .iter()
            .filter(|p| p.hook == programs::CONNECT4)
            .map(|p| p.run_count)
            .sum();
        let hooks: Vec<&str> = r.programs.iter().map(|p| p.hook).collect();
        table.row([
            (r.measured.run + 1).to_string(),
            r.measured.mode.name().to_owned(),
            r.source.name().to_owned(),
            if hooks.is_empty() {
                "-".to_owned()
            } else {
                hooks.join(",")
            },
            if stats && connections > 0 {
                format!("{:.2}", connect4 as f64 / connections as f64)
            } else {
                "-".to_owned()
            },
        ]);
    }
    print!("{table}");
}

async fn measure_mode(
    args: &BystanderArgs,
    agent_binary: &Path,
    work: &TempDir,
    cgroup: &CgroupGuard,
    mode: Mode,
    run: usize,
    stats: bool,
) -> Result<Vec<SourceRun>> {
    let cluster = Cluster::create(2).context("creating the cluster")?;
    let (enrolled, bystander) = (&cluster.pods[0], &cluster.pods[1]);
    let target = SocketAddr::new(cluster.remote.addrs.v4.into(), PEER_PORT);

    let mut served = None;
    if mode != Mode::Direct {
        let enrolled = [(POD_UID.to_owned(), enrolled.ns.path())];
        served = Some(
            Served::start(
                agent_binary,
                mode,
                &cluster.node,
                &enrolled,
                cgroup,
                work,
                run,
            )
            .await?,
        );
    }
    let agent_pid = served.as_ref().map(|s| s.agent.pid());
    let taken = || {
        served
            .as_ref()
            .map_or((0, 0), |s| taken_by(&s.double, Direction::Outbound))
    };

    let warmup = Duration::from_secs_f64(args.warmup_secs);
    let duration = Duration::from_secs_f64(args.duration_secs);
    let mut measured = Vec::new();
    for source in Source::ALL {
        let client: &NetnsGuard = match source {
            Source::Pod => &bystander.ns,
            Source::Node => &cluster.node,
        };
        let traffic = Traffic::start(
            Direction::Outbound,
            client,
            &cluster.remote.ns,
            target,
            args.loadgen_threads,
        )?;
        let outside = programs::threads_outside(cgroup.path(), "loadgen")?;
        ensure!(
            outside.is_empty(),
            "load-generator threads outside the agent's cgroup {}: {outside:?}",
            cgroup.path().display()
        );
        let before = programs::attached(cgroup.path())?;
        if mode == Mode::EbpfBystander {
            ensure!(
                before.iter().any(|p| p.hook == programs::CONNECT4),
                "no connect4 program at {}: the eBPF mode's hooks would not run for the bystander",
                cgroup.path().display()
            );
        }
        let conntrack =
            conntrack_around(&traffic, client, &cluster.node, args.conntrack_connections).await?;
        let mut points = Vec::new();
        for &clients in &args.clients {
            let point = traffic
                .point(clients, warmup, duration, agent_pid, &taken)
                .await?;
            eprintln!(
                "bystander: run {} {:<18} {:<4} {:>2} clients: {:>8.0} conn/s, p50 {:>7.1} µs p99 {:>7.1} µs",
                run + 1,
                mode.name(),
                source.name(),
                clients,
                point.per_second(),
                point.p50_us(),
                point.p99_us(),
            );
            points.push(point);
        }
        let after = programs::attached(cgroup.path())?;
        let ran = programs::runs_since(&before, &after);
        let (proxied, failed) = taken();
        ensure!(
            proxied + failed == 0,
            "{} of the {} bystander's connections went to ztunnel",
            proxied + failed,
            source.name()
        );
        if stats && mode == Mode::EbpfBystander {
            let connect4: u64 = ran
                .iter()
                .filter(|p| p.hook == programs::CONNECT4)
                .map(|p| p.run_count)
                .sum();
            let connections: u64 = points.iter().map(|p| p.connections()).sum();
            ensure!(
                connect4 >= connections,
                "connect4 ran {connect4} times for {connections} connections of the {}",
                source.name()
            );
        }
        drop(traffic);
        measured.push(SourceRun {
            source,
            programs: ran,
            measured: ModeRun {
                run,
                mode,
                conntrack,
                points,
            },
        });
    }

    if let Some(served) = served {
        served.stop().await?;
    }
    drop(cluster);
    Ok(measured)
}
