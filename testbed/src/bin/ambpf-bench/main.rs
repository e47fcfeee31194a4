//! ambpf's benchmarks: `ambpf-bench <suite> --agent <ambpf binary> --out <json>`,
//! usually through `cargo xtask bench <suite>` (which builds everything first).
//!
//! Every suite measures the real agent binary and, in the same run, a minimal
//! baseline doing the same job, and reports the ratio: results are compared
//! across commits and machines as ratios, never as absolute pass/fail.
//!
//! Suites:
//! - `zds`: how long the agent takes to hand ztunnel a snapshot of N pods over
//!   ZDS, against a floor server that sends the same messages and nothing else.
//! - `redirect`: traffic from an enrolled pod through the ztunnel double,
//!   direct (the floor), iptables and eBPF in the same run: connection rate,
//!   latency, conntrack entries, CPU per process; outbound, inbound or DNS
//!   queries (`--direction`; `redirect.rs`);
//! - `bystander`: what the agent in each mode costs connections it does not
//!   capture (a pod that is not enrolled, the node's own), against no agent
//!   (`bystander.rs`);
//! - `enroll`: time for the agent to enrol and remove N pods, eBPF against
//!   iptables in the same run (`enroll.rs`);
//! - `control`: the Kubernetes control path: API event to redirection, to the
//!   annotation and to removal, pod by pod, and a start-up snapshot of N pods,
//!   eBPF against iptables (`control.rs`);
//! - `attach`: the kernel's cost of attaching the inbound steering program to
//!   N fresh pods, TCX link against clsact + cls_bpf, an sk_lookup netns link
//!   and TCX without a link (`attach.rs`);
//! - `storm`: more concurrent redirected connections than the
//!   original-destination maps hold: what became of each, eBPF against
//!   iptables (`storm.rs`);
//! - `podstart`: CRI RunPodSandbox latency on a containerd node with no
//!   ambpf, iptables and eBPF mode (`podstart.rs`).
//!
//! Further suites become variants of [`Suite`], each with its own arguments
//! and [`Common`] ones, using the helpers of `ambpf_testbed::bench`.
//!
//! Needs root: the agent loads BPF programs and the suites create network
//! namespaces, cgroups and bpffs mounts. Everything is removed on exit, on
//! errors and on Ctrl-C (SIGINT or SIGTERM).

use std::{
    collections::BTreeMap,
    fs::File,
    os::{
        fd::AsFd,
        unix::{fs::FileTypeExt, process::CommandExt as _},
    },
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    sync::Arc,
    time::{Duration, Instant},
};

use ambpf_proto::{
    Message as _, ZTUNNEL_READ_BUFFER,
    zds::{WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello},
};
use ambpf_testbed::{
    BpffsMount, CgroupGuard,
    bench::{self, Memory, ProcessGuard, Stats, SuiteRun, Table, TempDir, ms},
    cluster::{self, Cluster},
    ztunnel::{ZdsEvent, ZtunnelConfig, ZtunnelDouble, ZtunnelState},
};
use anyhow::{Context as _, Result, bail, ensure};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use tokio::sync::watch;
use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener, ancillary::AncillaryMessageWriter};

#[derive(Parser)]
#[command(
    name = "ambpf-bench",
    about = "ambpf's benchmarks: the real agent against a baseline measured in the same run"
)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Subcommand)]
enum Suite {
    /// Time for the agent to send ztunnel a full ZDS snapshot of N pods, against
    /// a minimal floor ZDS server sending the same messages.
    Zds(zds::ZdsArgs),
    /// Traffic from an enrolled pod through the ztunnel double to a peer:
    /// connection rate, latency, conntrack and CPU, for direct, iptables and
    /// eBPF redirection.
    Redirect(redirect::RedirectArgs),
    /// What ambpf costs traffic it does not capture: a pod that is not
    /// enrolled and the node's own connections, with the agent in each mode
    /// against no agent.
    Bystander(bystander::BystanderArgs),
    /// Time for the agent to enrol and remove N pods, iptables against eBPF.
    Enroll(enroll::EnrollArgs),
    /// The Kubernetes control path (kube source against a test API server):
    /// event to redirection, annotation and removal per pod, and a start-up
    /// snapshot of N pods, iptables against eBPF.
    Control(control::ControlArgs),
    /// Attaching the inbound steering program to N fresh pods: TCX link,
    /// clsact + cls_bpf, sk_lookup netns link, TCX without a link; per attach,
    /// replace and detach, side by side.
    Attach(attach::AttachArgs),
    /// A connection storm past the original-destination capacity: what
    /// became of each connection (reached, refused and counted, misrouted,
    /// hung), eBPF against iptables.
    Storm(storm::StormArgs),
    /// A pod's start as kubelet sees it: CRI RunPodSandbox on a containerd
    /// node with no ambpf, with ambpf in iptables mode and in eBPF mode.
    /// Built with the `node` feature only.
    #[cfg(feature = "node")]
    Podstart(podstart::PodstartArgs),
}

/// Arguments every suite takes.
#[derive(Args)]
struct Common {
    /// The ambpf agent binary.
    #[arg(long, default_value = "target/release/ambpf")]
    agent: PathBuf,
    /// Where to write the JSON result (nothing written without it).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("ambpf-bench: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        tokio::select! {
            result = run(cli) => result,
            // Dropping the suite's future drops its guards: the agent is
            // stopped, namespaces, mounts and files removed.
            signal = termination() => Err(anyhow::anyhow!("interrupted by {signal}; cleaned up")),
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambpf-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.suite {
        Suite::Zds(args) => zds::run(args).await,
        Suite::Redirect(args) => redirect::run(args).await,
        Suite::Bystander(args) => bystander::run(args).await,
        Suite::Enroll(args) => enroll::run(args).await,
        Suite::Control(args) => control::run(args).await,
        Suite::Attach(args) => attach::run(args).await,
        Suite::Storm(args) => storm::run(args).await,
        #[cfg(feature = "node")]
        Suite::Podstart(args) => podstart::run(args).await,
    }
}

/// Resolves on SIGINT or SIGTERM, with the signal's name.
async fn termination() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        // Without handlers the default action (exit) applies; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// Checks what every suite needs before creating anything.
fn preflight(common: &Common) -> Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "run as root: the agent loads BPF programs and the suite creates network namespaces and bpffs mounts"
    );
    ensure!(
        common.agent.is_file(),
        "no agent binary at {} (build it with `cargo build --release -p ambpf`, or use `cargo xtask bench`)",
        common.agent.display()
    );
    let limit = bench::raise_fd_limit().context("raising the open-file limit")?;
    ensure!(
        limit >= 4096,
        "the open-file limit is {limit}; the ztunnel double holds a netns fd per pod"
    );
    Ok(())
}

/// Where the agent serves `/metrics` (its default), in the node namespace.
const AGENT_METRICS: &str = "127.0.0.1:15014";

/// The agent's `/metrics` page, read from inside the node namespace.
fn agent_metrics(node: &ambpf_testbed::NetnsGuard) -> Result<String> {
    use std::io::{Read as _, Write as _};
    let body = node.run(|| -> std::io::Result<String> {
        let mut conn = std::net::TcpStream::connect(AGENT_METRICS)?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")?;
        let mut body = String::new();
        conn.read_to_string(&mut body)?;
        Ok(body)
    })??;
    Ok(body)
}

/// The series of the metric family `name` (`ambpf_..._total`) in a
/// `/metrics` page with one label `label`: label value -> sample.
fn labelled_series(metrics: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let prefix = format!("{name}{{{label}=\"");
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix(prefix.as_str()))
        .filter_map(|rest| {
            let (value_of_label, sample) = rest.split_once("\"} ")?;
            Some((value_of_label.to_owned(), sample.trim().parse().ok()?))
        })
        .collect()
}

/// Waits until `path` is a unix socket (the agent binds it under a temporary
/// name and renames it into place, so it exists only once it listens).
async fn wait_for_socket(agent: &mut ProcessGuard, path: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        agent.check_running()?;
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the agent did not create {} within {timeout:?}; the end of its log:\n{}",
                path.display(),
                agent.log_tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `condition` every millisecond until it holds; an error after
/// `timeout` (a hang, not a slow result: no benchmark asserts on time).
async fn poll_until(
    what: &str,
    timeout: Duration,
    mut condition: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !condition()? {
        if Instant::now() > deadline {
            bail!("{what}: not within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// A task aborted when dropped, so a suite that fails leaves nothing running.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

mod redirect;

mod bystander;

mod enroll;

mod control;

mod attach;

mod storm;

#[cfg(feature = "node")]
mod podstart;

mod zds;
