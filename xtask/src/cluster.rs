//! `cargo xtask cluster ...`: builds what the node runs and hands over to
//! the testbed's `ambpf-cluster` (`testbed/src/kube/`), which runs it.
//!
//! - `build`: Kubernetes and etcd from the Go module proxy, cached outside
//!   the work tree (`$AMBPF_CACHE`, else `~/.cache/ambpf`), keyed by version.
//! - `up`: builds ambpf's release binaries, its image and the ztunnel
//!   double, then starts the node with them imported; waits until Ready.
//! - `down`, `status`, `kubectl ...`: as they say.
//! - `e2e`: `build`, `up`, the end-to-end suite, then `down` (even when the
//!   suite fails, unless `--keep`).
//! - `bench`: `build`, `up`, the cluster benchmarks (ambpf's agent against
//!   Istio's own), then `down` (unless `--keep`). Results in
//!   `target/cluster/bench.json`.

use std::{path::Path, process::Command};

use anyhow::Result;
use clap::Subcommand;

use crate::{build_image, cargo, run};

#[derive(Subcommand)]
pub enum Action {
    /// Build Kubernetes and etcd from the Go module proxy, unless cached.
    Build,
    /// Build ambpf's image and the ztunnel double, start the node with them
    /// imported, and wait until it is Ready.
    Up,
    /// Stop the node and give the host back as it was.
    Down,
    /// Each of the node's daemons, and the node as the API server sees it.
    Status,
    /// kubectl as the cluster's admin (e.g. `cargo xtask cluster kubectl get pods -A`).
    Kubectl {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The end-to-end suite: build, up, every scenario in every mode it
    /// applies to, down. Results in `target/cluster/e2e.json`.
    E2e {
        /// Leave the node up afterwards.
        #[arg(long)]
        keep: bool,
        /// Arguments for `ambpf-cluster e2e` (e.g. `--scenario capture`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The cluster benchmarks: build, up, pod start, enrolling a namespace
    /// and the agent's cost for Istio's own agent (both backends), ambpf's
    /// and none, then down. Results in `target/cluster/bench.json`.
    Bench {
        /// Leave the node up afterwards.
        #[arg(long)]
        keep: bool,
        /// Arguments for `ambpf-cluster bench` (e.g. `--runs 3 --pods 50`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

pub fn run_action(root: &Path, action: Action) -> Result<()> {
    let cluster = root.join("target/release/ambpf-cluster");
    let build_cluster_tool = || {
        cargo(
            root,
            &[
                "build",
                "--release",
                "-p",
                "ambpf-testbed",
                "--bin",
                "ambpf-cluster",
            ],
        )
    };
    match action {
        Action::Build => {
            build_cluster_tool()?;
            run(Command::new(&cluster).arg("build"))
        }
        Action::Up => {
            crate::prereqs::ensure_test_tools()?;
            build_cluster_tool()?;
            run(Command::new(&cluster).arg("build"))?;
            up(root, &cluster)
        }
        Action::Down => {
            build_cluster_tool()?;
            run(Command::new(&cluster).arg("down"))
        }
        Action::Status => {
            build_cluster_tool()?;
            run(Command::new(&cluster).arg("status"))
        }
        Action::Kubectl { args } => {
            build_cluster_tool()?;
            run(Command::new(&cluster).arg("kubectl").args(&args))
        }
        Action::E2e { keep, args } => {
            build_cluster_tool()?;
            on_a_node(root, &cluster, keep, "e2e", &args)
        }
        Action::Bench { keep, args } => {
            build_cluster_tool()?;
            on_a_node(root, &cluster, keep, "bench", &args)
        }
    }
}

/// `build`, `up`, `ambpf-cluster <command>` (results in
/// `target/cluster/<command>.json`), then `down` unless `keep`; fails if
/// the host is not as it was before `up`.
fn on_a_node(
    root: &Path,
    cluster: &Path,
    keep: bool,
    command: &str,
    args: &[String],
) -> Result<()> {
    // containerd, runc, the CNI plugins, busybox, openssl, the image tools, helm.
    crate::prereqs::ensure_test_tools()?;
    run(Command::new(cluster).arg("build"))?;
    let host = crate::host_state::Place::host();
    let before = crate::host_state::Snapshot::take(&host);
    let result = up(root, cluster).and_then(|()| {
        run(Command::new(cluster)
            .arg(command)
            .arg("--chart")
            .arg(root.join("charts/ambpf"))
            .arg("--out")
            .arg(root.join(format!("target/cluster/{command}.json")))
            .args(args))
    });
    if keep {
        return result;
    }
    run(Command::new(cluster).arg("down"))?;
    match (
        result,
        before.report(&crate::host_state::Snapshot::take(&host)),
    ) {
        (result, None) => result,
        (Ok(()), Some(report)) => anyhow::bail!("cluster down: {report}"),
        (Err(e), Some(report)) => Err(e.context(report)),
    }
}

/// ambpf's image and the double's binaries, then `ambpf-cluster up`.
fn up(root: &Path, cluster: &Path) -> Result<()> {
    cargo(
        root,
        &[
            "build",
            "--release",
            "-p",
            "ambpf",
            "-p",
            "ambpf-testbed",
            "--bins",
        ],
    )?;
    let image = build_image(root, None)?;
    run(Command::new(cluster)
        .arg("up")
        .arg("--ambpf-image")
        .arg(&image.archive)
        .arg("--ambpf-reference")
        .arg(&image.reference))
}
