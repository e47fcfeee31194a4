//! `cargo xtask fresh`: the README's two commands (`cargo xtask demo`,
//! `cargo xtask test`), as written, on a machine that has nothing but what
//! the README asks for.
//!
//! The machine is a privileged podman container whose root is a minimal
//! Debian 12 tree (`mmdebstrap`, cached under `target/fresh/`), with the
//! host's rustup toolchains and cargo registry bound in, the host kernel's
//! modules read-only, a pure cgroup v2 hierarchy at `/sys/fs/cgroup`, and a
//! `git clone` of the workspace's committed HEAD (not the working tree), so
//! the build starts from nothing and uncommitted files cannot help it.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::image::remove_if_present;

/// Debian 12, as the README's machine.
const SUITE: &str = "bookworm";

/// What the two commands need before they can install anything themselves
/// (`cargo xtask test` installs its tests' packages with apt-get, see
/// prereqs.rs): git for the clone, a C toolchain for build scripts, iproute2
/// (the README asks for it), kmod so the kernel can load the modules the
/// tests use, procps for the tests' process checks, mount for the cgroup v2
/// mount.
const PACKAGES: &[&str] = &[
    "ca-certificates",
    "git",
    "gcc",
    "libc6-dev",
    "iproute2",
    "kmod",
    "procps",
    "mount",
];

/// The README's commands, in its order.
const COMMANDS: &[&str] = &["demo", "test"];

/// Lines of a failed command's output to print.
const TAIL: usize = 60;

const CONTAINER: &str = "ambpf-fresh";

/// Runs in the container: pure cgroup v2, then each command with its output
/// kept in `/fresh/<command>.log` and its exit code in `/fresh/<command>.rc`.
const SCRIPT: &str = r#"set -u
# podman mounts the host's hierarchy (v1 or hybrid here); the README's machine
# has cgroup v2 alone at /sys/fs/cgroup.
if [ "$(stat -f -c %T /sys/fs/cgroup)" != cgroup2fs ]; then
  umount -R /sys/fs/cgroup && mount -t cgroup2 none /sys/fs/cgroup || exit 90
fi
echo "fresh: /sys/fs/cgroup is $(stat -f -c %T /sys/fs/cgroup); kernel $(uname -r)"
# A hybrid host keeps cpu and pids in cgroup v1, where this mount namespace
# cannot see them: runc then cannot start containers, and the tests that start
# them say so and skip (ambpf_testbed::node::containers_cannot_start).
controllers=$(cat /sys/fs/cgroup/cgroup.controllers)
echo "fresh: cgroup v2 controllers: ${controllers:-none}"
case " $controllers " in
  *" cpu "*" pids "*|*" pids "*" cpu "*) ;;
  *) echo "fresh: without cpu and pids controllers the tests that start containers (node, image) skip themselves" ;;
esac
cd /root/ambpf
for command in __COMMANDS__; do
  started=$(date +%s)
  echo "fresh: cargo xtask $command"
  cargo xtask "$command" > "/fresh/$command.log" 2>&1 < /dev/null
  echo $? > "/fresh/$command.rc"
  echo "fresh: cargo xtask $command: exit $(cat "/fresh/$command.rc") after $(( $(date +%s) - started )) s"
done
"#;

pub struct Options {
    /// How long the container may run, both commands included.
    pub timeout: Duration,
    /// Keep the container's root (and the clone's build) after a pass.
    pub keep: bool,
}

pub fn run(root: &Path, options: &Options) -> Result<()> {
    let started = Instant::now();
    for tool in ["mmdebstrap", "podman", "git"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("{tool} is not installed (`apt-get install mmdebstrap podman git`)");
        }
    }
    let work = root.join("target/fresh");
    std::fs::create_dir_all(&work)?;
    let base = debian_tree(&work)?;

    // A copy per run: apt-get and the build change the root, and the next run
    // must start from the cached tree again.
    let run_dir = work.join("run");
    remove_if_present(&run_dir)?;
    std::fs::create_dir_all(&run_dir)?;
    let rootfs = run_dir.join("rootfs");
    step(Command::new("cp").arg("-a").arg(&base).arg(&rootfs))?;
    let clone = rootfs.join("root/ambpf");
    step(
        Command::new("git")
            .args(["clone", "--quiet", "--no-hardlinks"])
            .arg(root)
            .arg(&clone),
    )?;
    let head =
        output(
            Command::new("git")
                .current_dir(&clone)
                .args(["log", "-1", "--format=%h %s"]),
        )?;
    println!("fresh: clone of HEAD {}", head.trim());
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let prepared = started.elapsed();

    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()));
    let rustup = env_path("RUSTUP_HOME").unwrap_or_else(|| home.join(".rustup"));
    let cargo_home = env_path("CARGO_HOME").unwrap_or_else(|| home.join(".cargo"));
    // podman's default nproc/nofile limits exceed what some sandboxed hosts let
    // runc set (as in agent/tests/image.rs).
    let conf = run_dir.join("containers.conf");
    std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n")?;
    let _ = Command::new("podman")
        .args(["rm", "--force", "--ignore", CONTAINER])
        .output();

    let mut podman = Command::new("podman");
    podman
        .env("CONTAINERS_CONF", &conf)
        .args(["run", "--rm", "--privileged", "--name", CONTAINER])
        .args(["--hostname", "fresh", "--tz", "UTC"])
        .arg("--rootfs")
        .arg(format!("--volume={}:/root/.rustup", rustup.display()))
        .arg(format!("--volume={}:/root/.cargo", cargo_home.display()))
        .arg(format!("--volume={}:/fresh", logs.display()))
        .args([
            "--env=HOME=/root",
            "--env=RUSTUP_HOME=/root/.rustup",
            "--env=CARGO_HOME=/root/.cargo",
            "--env=PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--env=DEBIAN_FRONTEND=noninteractive",
        ]);
    // A kernel with its modules built in has none to bind.
    if Path::new("/lib/modules").is_dir() {
        podman.arg("--volume=/lib/modules:/lib/modules:ro");
    }
    // Passed on where set (CI sets them); never CARGO_TARGET_DIR, which would
    // share the host's build.
    for var in ["CARGO_BUILD_JOBS", "CARGO_INCREMENTAL", "CARGO_TERM_COLOR"] {
        if let Ok(value) = std::env::var(var) {
            podman.arg(format!("--env={var}={value}"));
        }
    }
    // The chart's tests need helm, which the README has installed apart from
    // the two commands (`bash .ci/install-helm`): the host's, when it has one.
    match find_on_path("helm") {
        Some(helm) => {
            podman.arg(format!(
                "--volume={}:/usr/local/bin/helm:ro",
                helm.display()
            ));
        }
        None => println!("fresh: no helm on this host; the container installs it"),
    }
    let script = SCRIPT.replace("__COMMANDS__", &COMMANDS.join(" "));
    let script = if find_on_path("helm").is_some() {
        script
    } else {
        script.replace(
            "cd /root/ambpf\n",
            "cd /root/ambpf\nbash .ci/install-helm || exit 91\n",
        )
    };
    // With --rootfs, the image argument is the root's path.
    podman.arg(&rootfs).args(["/bin/bash", "-c", &script]);

    println!(
        "fresh: root and clone ready after {:.0} s; running {} in the container (timeout {} min)",
        prepared.as_secs_f64(),
        COMMANDS
            .iter()
            .map(|c| format!("`cargo xtask {c}`"))
            .collect::<Vec<_>>()
            .join(" and "),
        options.timeout.as_secs() / 60
    );
    let container_started = Instant::now();
    let status = wait_with_timeout(&mut podman, options.timeout)?;
    let took = started.elapsed();

    let mut failed = Vec::new();
    for command in COMMANDS {
        let rc = std::fs::read_to_string(logs.join(format!("{command}.rc")))
            .ok()
            .and_then(|rc| rc.trim().parse::<i32>().ok());
        let log = logs.join(format!("{command}.log"));
        match rc {
            Some(0) => println!("fresh: `cargo xtask {command}` passed"),
            _ => {
                let why = match rc {
                    Some(rc) => format!("exit {rc}"),
                    None => "did not finish".to_owned(),
                };
                println!(
                    "fresh: `cargo xtask {command}` FAILED ({why}); last lines of {}:",
                    log.display()
                );
                println!("{}", tail(&log, TAIL));
                // A backtrace can fill the tail: the failing tests by name.
                let failures = grep(&log, &[" FAILED", "panicked at", "Error: "]);
                if !failures.is_empty() {
                    println!("fresh: failures in {}:\n{failures}", log.display());
                }
                failed.push(format!("`cargo xtask {command}` ({why})"));
            }
        }
    }
    println!(
        "fresh: {:.1} min in all ({:.1} min in the container); logs in {}",
        took.as_secs_f64() / 60.0,
        container_started.elapsed().as_secs_f64() / 60.0,
        logs.display()
    );
    match status {
        None => bail!(
            "the container ran out of its {} min; failed or unfinished: {}",
            options.timeout.as_secs() / 60,
            failed.join(", ")
        ),
        Some(_) if !failed.is_empty() => bail!("failed: {}", failed.join(", ")),
        Some(status) if !status.success() => bail!("the container exited with {status}"),
        Some(_) => {
            // The clone's build is several GB; the logs stay.
            if !options.keep {
                remove_if_present(&rootfs)?;
            }
            Ok(())
        }
    }
}

/// The minimal Debian tree, cached under `work` by suite and package list
/// (`rm -r target/fresh` to refresh it).
fn debian_tree(work: &Path) -> Result<PathBuf> {
    let tree = work.join(format!("debian-{SUITE}-{}", PACKAGES.join("-")));
    let complete = tree.with_extension("complete");
    if complete.exists() && tree.is_dir() {
        return Ok(tree);
    }
    // Trees of other package lists are stale.
    for entry in std::fs::read_dir(work)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("debian-") {
            remove_if_present(&path)?;
        }
    }
    let partial = work.join(format!("debian-{SUITE}.partial"));
    remove_if_present(&partial)?;
    println!("fresh: building the Debian {SUITE} root with mmdebstrap");
    // The apt variant (Essential and apt, maintainer scripts run): apt-get
    // works inside, as on any Debian machine.
    step(
        Command::new("mmdebstrap")
            .args(["--quiet", "--variant=apt", "--format=directory"])
            .arg(format!("--include={}", PACKAGES.join(",")))
            .arg(SUITE)
            .arg(&partial),
    )?;
    std::fs::rename(&partial, &tree)?;
    // Written last: a tree without it was not built completely.
    std::fs::write(&complete, "")?;
    Ok(tree)
}

/// Runs `cmd` (its output passed through) for at most `timeout`; `None` when
/// it was stopped for taking longer.
fn wait_with_timeout(
    cmd: &mut Command,
    timeout: Duration,
) -> Result<Option<std::process::ExitStatus>> {
    let mut child = cmd
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("running {cmd:?}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            println!(
                "fresh: timed out after {} min; stopping the container",
                timeout.as_secs() / 60
            );
            let _ = Command::new("podman").args(["kill", CONTAINER]).output();
            let _ = child.wait();
            let _ = Command::new("podman")
                .args(["rm", "--force", "--ignore", CONTAINER])
                .output();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(no output: {e})"),
    }
}

/// The lines of `path` that contain any of `needles`.
fn grep(path: &Path, needles: &[&str]) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|line| needles.iter().any(|n| line.contains(n)))
        .collect::<Vec<_>>()
        .join("\n")
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn find_on_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|p| p.is_file())
}

fn step(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
