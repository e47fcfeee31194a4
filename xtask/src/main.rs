//! Developer commands for ambpf: `cargo xtask <command>`.
//!
//! - `build-ebpf`: build the kernel programs into `target/bpf/ambpf.bpf.o`.
//! - `demo`: run the agent against a throwaway pod namespace on this machine.
//! - `node`: run the testbed's containerd node until Ctrl-C (needs root).
//! - `test`: lint, then run every test, privileged ones included (needs root),
//!   and check that the run left the host's network state and bpffs as they were.
//! - `fuzz`: the property tests of `agent/tests/fuzz` with many more cases
//!   than `test` runs (needs root).
//! - `bench <suite>`: build, then run a benchmark suite of `ambpf-bench`
//!   (needs root); results in `target/bench/<suite>.json`.
//! - `soak`: build, then run the soak with invariants (`ambpf-soak`, needs
//!   root): random pod events and faults against the real agent; summary in
//!   `target/bench/soak.json`, non-zero exit on any violation.
//! - `image`: build the release binaries and the OCI image (`image.rs`).
//! - `kernels`: the privileged suites and the demo under Debian's kernels,
//!   each booted under QEMU (`kernels.rs`).
//! - `plots`: draw the benchmark figures of `docs/figures/` from the results
//!   in `docs/results/` (`plots.rs`); `--from target/bench` copies a new
//!   run's results there first.
//! - `cluster`: a real Kubernetes node built from source, and the
//!   end-to-end suite and the cluster benchmarks on it (`cluster.rs`).
//! - `fresh`: the README's `demo` and `test` in a privileged container on a
//!   minimal Debian 12 root, from a clone of the committed HEAD (`fresh.rs`).

mod cluster;
mod ebpf_build;
mod fresh;
mod host_state;
mod image;
mod kernels;
mod plots;
mod prereqs;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the eBPF object on its own (the agent build embeds it anyway).
    BuildEbpf {
        /// Where to write the object.
        #[arg(long, default_value = "target/bpf/ambpf.bpf.o")]
        out: PathBuf,
    },
    /// Build the agent and run the demo: a throwaway pod namespace, the agent
    /// attached to it, traffic, and what is loaded.
    Demo {
        /// Arguments for the demo binary (see `--help` after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the agent and the benchmarks, and run one benchmark suite (e.g.
    /// `enroll`), writing `target/bench/<suite>.json`. Needs root.
    Bench {
        /// The suite: `zds`, `redirect`, `enroll`, `control`, `attach`, `storm` or
        /// `podstart` (see
        /// `target/release/ambpf-bench --help`, and `<suite> --help` for its
        /// arguments); or `cluster`, the same as `cargo xtask cluster bench`.
        suite: String,
        /// Extra arguments for the suite (e.g. `--pods 100,1000 --runs 7`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start the testbed's containerd node (CRI, real CNI plugins, a local
    /// busybox image) in its own network namespace and cgroup, until Ctrl-C.
    /// Needs root and Debian's containerd, runc, containernetworking-plugins
    /// and busybox-static.
    Node {
        /// Arguments for `ambpf-node` (see `--help` after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the agent and the soak, and run it: random pod events and
    /// faults against the real agent with invariants checked throughout,
    /// writing `target/bench/soak.json`; fails on any violation. Needs root.
    Soak {
        /// Arguments for `ambpf-soak` (e.g. `--duration 30m --pods 1000
        /// --seed 7`; see `target/release/ambpf-soak --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the release binaries and the OCI image the chart runs, tagged
    /// as the chart's default image (version from the workspace), into
    /// `target/image/`: an OCI layout and an archive for `podman load` or
    /// `skopeo copy`. Needs root, mmdebstrap, umoci and skopeo.
    Image {
        /// Tag the image as this `repository:tag` instead.
        #[arg(long)]
        reference: Option<String>,
    },
    /// Run the property tests of everything the agent reads from outside
    /// (`agent/tests/fuzz`) with many cases; `test` runs them with 256 each.
    /// Needs root.
    Fuzz {
        /// Inputs per property.
        #[arg(long, default_value_t = 20_000)]
        cases: u32,
        /// Extra arguments for the test binary (e.g. a property's name).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Draw the benchmark figures (`docs/figures/*.svg`) from the suites'
    /// results in `docs/results/`; each caption names the results file, the
    /// run and this command.
    Plots {
        /// First copy the figures' suites' results from this directory (where
        /// `cargo xtask bench` writes them: `target/bench`) into `docs/results/`.
        #[arg(long)]
        from: Option<PathBuf>,
    },
    /// Fetch Debian's kernels (5.10, 6.1, 6.12), boot each under QEMU and
    /// run the privileged redirection suites and the demo in it, as root;
    /// prints the matrix (also `target/kernels/matrix.md`). Needs root.
    Kernels {
        /// `5.10`, `6.1`, `6.12` or `all`.
        #[arg(long, default_value = "all")]
        kernel: String,
        /// Only these suites (repeatable): redirect, parity,
        /// inbound_sk_lookup, restart, address_reuse, cni, pod_kinds, coexistence, demo.
        /// Default: all.
        #[arg(long)]
        suite: Vec<String>,
        /// Minutes each guest may take, boot included.
        #[arg(long, default_value_t = 45)]
        timeout: u64,
        /// Arguments for every test binary (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the README's `cargo xtask demo` and `cargo xtask test` in a
    /// privileged podman container: a minimal Debian 12 root (mmdebstrap,
    /// cached in `target/fresh/`), the host's rustup toolchains, a clone of
    /// the committed HEAD, pure cgroup v2. Needs root, mmdebstrap and podman.
    Fresh {
        /// Minutes the container may take, both commands included (a loaded
        /// 2-vCPU machine has taken 47).
        #[arg(long, default_value_t = 80)]
        timeout: u64,
        /// Keep the container's root and the clone's build after a pass.
        #[arg(long)]
        keep: bool,
    },
    /// A real Kubernetes node on this machine (`cluster.rs`): `build` its
    /// components from the Go module proxy (cached outside the work tree),
    /// `up`, `down`, `status`, `kubectl ...`, `e2e`, the end-to-end suite
    /// with ambpf installed by its chart, and `bench`, ambpf's agent against
    /// Istio's own. Needs root.
    Cluster {
        #[command(subcommand)]
        action: cluster::Action,
    },
    /// Run clippy and every test (unit and privileged), then check that the
    /// host's iptables, ipsets, policy rules, routes and /sys/fs/bpf are as
    /// they were before. Needs root.
    Test {
        /// Extra arguments passed to `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let root = workspace_root();
    let command = Cli::parse().command;
    // Before anything else, so that a user without root learns it first.
    if let Some(why) = command.needs_root() {
        require_root(why)?;
    }
    // Drawing figures needs no kernel-program toolchain, nor does a fresh
    // container's run, which builds in the container.
    if !matches!(command, Cmd::Plots { .. } | Cmd::Fresh { .. }) {
        ensure_bpf_toolchain()?;
    }
    match command {
        Cmd::BuildEbpf { out } => {
            let out = root.join(out);
            let work = root.join("target/bpf");
            std::fs::create_dir_all(&work)?;
            ebpf_build::Toolchain::find(&ebpf_build::toolchain_name())?.build_object(
                &root.join("ebpf"),
                &work,
                &out,
            )?;
            println!("{}", out.display());
            Ok(())
        }
        Cmd::Demo { args } => {
            prereqs::check_kernel()?;
            cargo(
                &root,
                &["build", "--release", "-p", "ambpf", "-p", "ambpf-testbed"],
            )?;
            let demo = root.join("target/release/ambpf-demo");
            let mut cmd = Command::new(demo);
            cmd.arg("--agent")
                .arg(root.join("target/release/ambpf"))
                .args(&args);
            run(&mut cmd)
        }
        Cmd::Bench { suite, args } if suite == "cluster" => {
            cluster::run_action(&root, cluster::Action::Bench { keep: false, args })
        }
        Cmd::Bench { suite, args } => {
            let mut build = vec!["build", "--release", "-p", "ambpf", "-p", "ambpf-testbed"];
            if suite == "podstart" {
                // The containerd node, whose CRI client's build needs protoc.
                build.extend(["--features", "ambpf-testbed/node"]);
            }
            cargo(&root, &build)?;
            let release = root.join("target/release");
            let out = root.join("target/bench").join(format!("{suite}.json"));
            let mut cmd = Command::new(release.join("ambpf-bench"));
            cmd.arg(&suite)
                .arg("--agent")
                .arg(release.join("ambpf"))
                .arg("--out")
                .arg(out)
                .args(&args);
            run(&mut cmd)
        }
        Cmd::Node { args } => {
            cargo(
                &root,
                &[
                    "build",
                    "-p",
                    "ambpf",
                    "-p",
                    "ambpf-testbed",
                    "--features",
                    "ambpf-testbed/node",
                ],
            )?;
            let mut cmd = Command::new(root.join("target/debug/ambpf-node"));
            cmd.args(&args);
            run(&mut cmd)
        }
        Cmd::Soak { args } => {
            cargo(
                &root,
                &["build", "--release", "-p", "ambpf", "-p", "ambpf-testbed"],
            )?;
            let release = root.join("target/release");
            let mut cmd = Command::new(release.join("ambpf-soak"));
            cmd.arg("--agent")
                .arg(release.join("ambpf"))
                .arg("--cni-plugin")
                .arg(release.join("ambpf-cni"))
                .arg("--out")
                .arg(root.join("target/bench/soak.json"))
                .args(&args);
            run(&mut cmd)
        }
        Cmd::Plots { from } => plots::run(&root, from.as_deref()).map(drop),
        Cmd::Image { reference } => {
            cargo(&root, &["build", "--release", "-p", "ambpf", "--bins"])?;
            build_image(&root, reference).map(drop)
        }
        Cmd::Cluster { action } => cluster::run_action(&root, action),
        Cmd::Fuzz { cases, args } => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
            run(Command::new(cargo)
                .current_dir(&root)
                .env("PROPTEST_CASES", cases.to_string())
                .args(["test", "-p", "ambpf", "--test", "fuzz", "--"])
                .args(&args))
        }
        Cmd::Kernels {
            kernel,
            suite,
            timeout,
            args,
        } => {
            let mut plan = kernels::Plan::new(&kernel, &suite, args)?;
            plan.timeout = std::time::Duration::from_secs(timeout * 60);
            kernels::run(&root, &plan)
        }
        Cmd::Fresh { timeout, keep } => fresh::run(
            &root,
            &fresh::Options {
                timeout: std::time::Duration::from_secs(timeout * 60),
                keep,
            },
        ),
        Cmd::Test { args } => {
            prereqs::check_kernel()?;
            prereqs::ensure_test_tools()?;
            // Formatting first: it needs no build, and fails in seconds.
            cargo(&root, &["fmt", "--all", "--check"])?;
            cargo(
                &root,
                &[
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ],
            )?;
            let mut test = vec!["test", "--workspace", "--all-targets"];
            if !args.is_empty() {
                test.push("--");
                test.extend(args.iter().map(String::as_str));
            }
            // Built first, so that the snapshots bracket only the tests.
            let mut build = test[..3].to_vec();
            build.push("--no-run");
            cargo(&root, &build)?;
            let host = host_state::Place::host();
            let before = host_state::Snapshot::take(&host);
            let tested = cargo(&root, &test);
            let changed = before.report(&host_state::Snapshot::take(&host));
            match (tested, changed) {
                (tested, None) => tested,
                (Ok(()), Some(report)) => bail!("{report}"),
                (Err(e), Some(report)) => Err(e.context(report)),
            }
        }
    }
}

impl Cmd {
    /// Why the command needs root, if it does.
    fn needs_root(&self) -> Option<&'static str> {
        Some(match self {
            Cmd::BuildEbpf { .. } | Cmd::Plots { .. } => return None,
            Cmd::Demo { .. } => "the demo creates network namespaces and loads BPF programs",
            Cmd::Bench { .. } => {
                "benchmarks create network namespaces and run the agent, which loads BPF programs"
            }
            Cmd::Node { .. } => {
                "the node creates a network namespace and cgroups and runs containerd"
            }
            Cmd::Soak { .. } => {
                "the soak creates network namespaces and runs the agent, which loads BPF programs"
            }
            Cmd::Image { .. } => {
                "mmdebstrap and umoci keep the image's file ownership only as root"
            }
            Cmd::Fuzz { .. } => "the ZDS property creates network namespaces",
            Cmd::Kernels { .. } => "the guests run the privileged tests as root",
            Cmd::Fresh { .. } => "mmdebstrap and the privileged container need root",
            Cmd::Cluster { .. } => "the node's daemons, namespaces and cgroups need root",
            Cmd::Test { .. } => {
                "the privileged tests create namespaces, veths, cgroups and bpffs mounts"
            }
        })
    }
}

fn build_image(root: &Path, reference: Option<String>) -> Result<image::Image> {
    let version = env!("CARGO_PKG_VERSION");
    let reference = match reference {
        Some(reference) => reference,
        None => {
            let values = std::fs::read_to_string(root.join("charts/ambpf/values.yaml"))?;
            format!("{}:{version}", image::chart_repository(&values)?)
        }
    };
    let release = root.join("target/release");
    let built = image::build(&image::ImageSpec {
        binaries: &[release.join("ambpf"), release.join("ambpf-cni")],
        reference,
        work: root.join("target/image"),
        version: version.to_owned(),
    })?;
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    println!(
        "{}: root filesystem {:.1} MiB, archive {:.1} MiB\n  OCI layout  {}\n  OCI archive {}\n\
         load it:    podman load -i {archive}\n\
         push it:    skopeo copy oci-archive:{archive} docker://<registry>/ambpf:{version}",
        built.reference,
        mib(built.rootfs_bytes),
        mib(built.archive_bytes),
        built.layout.display(),
        built.archive.display(),
        archive = built.archive.display(),
    );
    Ok(built)
}

/// Makes sure the pinned nightly can build the kernel programs (rust-src for
/// `-Z build-std=core`, llvm-tools for `llc`), installing the toolchain and
/// its components when missing; quick and idempotent when it can.
fn ensure_bpf_toolchain() -> Result<()> {
    let toolchain = ebpf_build::toolchain_name();
    if ebpf_build::Toolchain::find(&toolchain).is_ok() {
        return Ok(());
    }
    run(Command::new("rustup").args([
        "toolchain",
        "install",
        &toolchain,
        "--profile",
        "minimal",
        "--component",
        "rust-src",
        "--component",
        "llvm-tools",
    ]))
    .with_context(|| format!("installing toolchain `{toolchain}` with rust-src and llvm-tools"))
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

fn require_root(why: &str) -> Result<()> {
    if prereqs::euid() != 0 {
        bail!("run as root: {why}");
    }
    Ok(())
}

fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    run(Command::new(cargo).current_dir(root).args(args))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}
