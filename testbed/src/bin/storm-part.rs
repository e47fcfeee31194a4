//! One process of the `storm` benchmark (`ambpf-bench storm`): a storm past
//! the default original-destination capacity needs hundreds of thousands of
//! descriptors, more than RLIMIT_NOFILE lets one process hold, so the bench
//! spreads its clients, the ztunnel double's proxies and the servers over
//! processes of this binary, each started inside its network namespace.
//!
//! Every role raises its soft open-file limit to the hard one and talks to
//! the bench in JSON lines over stdin and stdout:
//!
//! - `clients --target <addr>... --count N --patience-secs S`: prints
//!   `{"ready":true}`, waits for a `go` line, opens the N connections (all
//!   connects first, targets in turn) and waits for each one's greeting,
//!   echoes once through every reached connection, prints the
//!   [`StormSummary`], how many no longer echoed and how long the storm
//!   took, and holds every connection open until stdin closes.
//! - `proxies --uid U [--original-dst-delay-ms D]`: one more ztunnel process
//!   for the pod (its listeners join the pod's others by SO_REUSEPORT, so
//!   the kernel spreads the connections); prints `{"ready":true}`, then
//!   answers each `report` line with what it accepted so far, until stdin
//!   closes.
//! - `greeters --address <addr>...`: the servers, each greeting with its own
//!   port; prints `{"ready":true}` and serves until stdin closes.

use std::{
    io::{self, BufRead, Write},
    net::SocketAddr,
    os::fd::AsFd,
    process::ExitCode,
    time::{Duration, Instant},
};

use ambpf_testbed::{
    storm::{self, Greeters, StormSummary},
    ztunnel::{ConnectionOutcome, ZtunnelConfig, ZtunnelDouble},
};
use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "storm-part",
    about = "One process of ambpf-bench's connection storm (clients, proxies or servers)"
)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Open connections from this namespace on `go`, report their fates.
    Clients {
        #[arg(long = "target", required = true)]
        targets: Vec<SocketAddr>,
        #[arg(long)]
        count: usize,
        #[arg(long, default_value_t = 20)]
        patience_secs: u64,
    },
    /// Serve pod `uid`'s in-pod proxies in this namespace.
    Proxies {
        #[arg(long)]
        uid: String,
        #[arg(long, default_value_t = 0)]
        original_dst_delay_ms: u64,
    },
    /// Greeting servers on these addresses of this namespace.
    Greeters {
        #[arg(long = "address", required = true)]
        addresses: Vec<SocketAddr>,
    },
}

/// A `clients` process's answer to `go`.
#[derive(Serialize)]
struct ClientsReport {
    summary: StormSummary,
    /// Reached connections an echo no longer goes through, once the storm
    /// is open.
    broken: usize,
    /// From `go` to every connection's fate.
    elapsed_ms: f64,
}

/// A `proxies` process's answer to `report`.
#[derive(Serialize)]
struct ProxiesReport {
    accepted: usize,
    /// Refused as a call to ztunnel itself: no original destination.
    refused_self_call: usize,
}

fn main() -> ExitCode {
    match run(Cli::parse().role) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("storm-part: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(role: Role) -> io::Result<()> {
    ambpf_testbed::bench::raise_fd_limit()?;
    let mut lines = io::stdin().lock().lines();
    match role {
        Role::Clients {
            targets,
            count,
            patience_secs,
        } => {
            say(&serde_json::json!({ "ready": true }))?;
            match lines.next().transpose()? {
                Some(line) if line.trim() == "go" => {}
                _ => return Ok(()),
            }
            let started = Instant::now();
            let patience = Duration::from_secs(patience_secs);
            let mut connections = storm::storm_here(&targets, count, patience)?;
            let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
            say(&ClientsReport {
                summary: StormSummary::of(&connections),
                broken: storm::broken(&mut connections),
                elapsed_ms,
            })?;
            hold(lines)
        }
        Role::Proxies {
            uid,
            original_dst_delay_ms,
        } => {
            let runtime = tokio::runtime::Runtime::new()?;
            let netns = std::fs::File::open("/proc/thread-self/ns/net")?;
            let config = ZtunnelConfig::default()
                .original_dst_delay(Duration::from_millis(original_dst_delay_ms));
            let double = runtime.block_on(ZtunnelDouble::serve_pod(&uid, netns.as_fd(), config))?;
            say(&serde_json::json!({ "ready": true }))?;
            for line in lines {
                if line?.trim() == "report" {
                    let report = double.inspect(|state| ProxiesReport {
                        accepted: state.proxied.len(),
                        refused_self_call: state
                            .proxied
                            .iter()
                            .filter(|c| c.outcome == ConnectionOutcome::RefusedSelfCall)
                            .count(),
                    });
                    say(&report)?;
                }
            }
            runtime.block_on(double.shutdown());
            Ok(())
        }
        Role::Greeters { addresses } => {
            let _greeters = Greeters::start_here(&addresses)?;
            say(&serde_json::json!({ "ready": true }))?;
            hold(lines)
        }
    }
}

/// Keeps what the role holds until the bench closes stdin.
fn hold(lines: impl Iterator<Item = io::Result<String>>) -> io::Result<()> {
    for line in lines {
        line?;
    }
    Ok(())
}

fn say(message: &impl Serialize) -> io::Result<()> {
    let mut out = io::stdout().lock();
    serde_json::to_writer(&mut out, message)?;
    out.write_all(b"\n")?;
    out.flush()
}
