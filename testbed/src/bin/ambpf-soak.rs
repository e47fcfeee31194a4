//! ambpf's soak with invariants: `ambpf-soak --duration 120s --pods 50`,
//! usually through `cargo xtask soak` (which builds everything first). See
//! `ambpf_testbed::soak` for what it does and checks. Exits non-zero on any
//! violation. Needs root.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use ambpf_testbed::soak::{self, Mode, SoakConfig};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ambpf-soak",
    about = "Random pod events and faults against the real agent, with invariants checked throughout"
)]
struct Cli {
    /// The ambpf agent binary.
    #[arg(long, default_value = "target/release/ambpf")]
    agent: PathBuf,
    /// The ambpf-cni plugin binary.
    #[arg(long, default_value = "target/release/ambpf-cni")]
    cni_plugin: PathBuf,
    /// The ztunnel double's proxy process [default: ztunnel-proxies beside
    /// this binary].
    #[arg(long)]
    ztunnel_proxies: Option<PathBuf>,
    /// How long events and faults go on (e.g. 90s, 30m).
    #[arg(long, default_value = "120s", value_parser = soak::parse_duration)]
    duration: Duration,
    /// Pod slots: at most this many pods at once.
    #[arg(long, default_value_t = 50)]
    pods: usize,
    /// The random seed (default: from the clock; printed, to replay).
    #[arg(long)]
    seed: Option<u64>,
    /// How the agent redirects.
    #[arg(long, value_enum, default_value_t = Mode::Ebpf)]
    mode: Mode,
    /// An ambient pod must be held by ztunnel this soon after its event.
    #[arg(long, default_value = "30s", value_parser = soak::parse_duration)]
    convergence_bound: Duration,
    /// Mean time between faults.
    #[arg(long, default_value = "8s", value_parser = soak::parse_duration)]
    fault_interval: Duration,
    /// Where to write the JSON summary.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let config = SoakConfig {
        agent: cli.agent,
        cni_plugin: cli.cni_plugin,
        ztunnel_proxies: match cli.ztunnel_proxies {
            Some(path) => path,
            None => match std::env::current_exe() {
                Ok(exe) => exe.with_file_name("ztunnel-proxies"),
                Err(e) => {
                    eprintln!("ambpf-soak: where is this binary? {e}");
                    return ExitCode::FAILURE;
                }
            },
        },
        duration: cli.duration,
        pods: cli.pods,
        seed,
        mode: cli.mode,
        convergence_bound: cli.convergence_bound,
        fault_interval: cli.fault_interval,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("ambpf-soak: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tokio::select! {
            report = soak::run(&config) => report,
            // Dropping the soak drops its guards: agent, namespaces, mounts.
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted; cleaned up")),
        }
    });
    let report = match outcome {
        Ok(report) => report,
        Err(e) => {
            eprintln!("ambpf-soak: {e:#} (seed {seed})");
            return ExitCode::FAILURE;
        }
    };
    report.print();
    if let Some(out) = &cli.out {
        let run = ambpf_testbed::bench::SuiteRun::start("soak");
        if let Err(e) = run.write_report(Some(out), &config, &report) {
            eprintln!("ambpf-soak: {e}");
            return ExitCode::FAILURE;
        }
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "ambpf-soak: {} violation(s); replay with --seed {seed}",
            report.violations.len()
        );
        ExitCode::FAILURE
    }
}
