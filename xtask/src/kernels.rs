//! `cargo xtask kernels`: the privileged suites under the kernels of the
//! distributions ambpf is run on, each booted under QEMU.
//!
//! Debian's kernel packages are fetched with a private APT configuration
//! (the host's own sources are left alone) and unpacked, never installed,
//! under `target/kernels/`. virtme-ng boots each with this machine's root
//! filesystem read-only over 9p, so the guest runs the test binaries built
//! here, as root, with cgroup v2 as the guest mounts it (pure v2 at
//! `/sys/fs/cgroup`). QEMU runs in software (TCG): a PVM `/dev/kvm` cannot
//! boot stock kernels. Each guest has a deadline; one that fails to boot or
//! hangs is ended and reported as such, and the next kernel still runs.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// A Debian kernel: the newest package named `prefix<number>suffix`.
pub struct Kernel {
    pub short: &'static str,
    prefix: &'static str,
    suffix: &'static str,
    /// Who runs it.
    pub runs_on: &'static str,
}

pub const KERNELS: &[Kernel] = &[
    Kernel {
        short: "5.10",
        prefix: "linux-image-5.10.0-",
        suffix: "-amd64-unsigned",
        runs_on: "Debian 11, older Amazon Linux",
    },
    Kernel {
        short: "6.1",
        prefix: "linux-image-6.1.0-",
        suffix: "-amd64-unsigned",
        runs_on: "Debian 12, Amazon Linux 2023",
    },
    Kernel {
        short: "6.12",
        prefix: "linux-image-6.12.",
        suffix: "+deb13-amd64-unsigned",
        runs_on: "Debian 13, RHEL 10",
    },
];

/// The privileged redirection suites (test targets of the agent).
pub const SUITES: &[&str] = &[
    "redirect",
    "parity",
    "adversarial",
    "inbound_sk_lookup",
    "restart",
    "address_reuse",
    "cni",
    "pod_kinds",
    "coexistence",
];

/// What a guest runs besides the suites.
const DEMO: &str = "demo";

/// The suites run in a guest.
pub struct Plan<'a> {
    pub kernels: Vec<&'a Kernel>,
    pub suites: Vec<String>,
    pub demo: bool,
    /// Arguments for every test binary (a name filter, `--test-threads`).
    pub test_args: Vec<String>,
    /// Per guest, boot included.
    pub timeout: Duration,
}

impl Plan<'_> {
    pub fn new(kernel: &str, suites: &[String], test_args: Vec<String>) -> Result<Self> {
        let kernels: Vec<_> = KERNELS
            .iter()
            .filter(|k| kernel == "all" || k.short == kernel)
            .collect();
        if kernels.is_empty() {
            let known: Vec<_> = KERNELS.iter().map(|k| k.short).collect();
            bail!(
                "--kernel {kernel}: expected one of {} or all",
                known.join(", ")
            );
        }
        let mut wanted: Vec<String> = if suites.is_empty() {
            SUITES
                .iter()
                .map(|s| s.to_string())
                .chain([DEMO.into()])
                .collect()
        } else {
            suites.to_vec()
        };
        if let Some(bad) = wanted
            .iter()
            .find(|s| !SUITES.contains(&s.as_str()) && *s != DEMO)
        {
            bail!(
                "--suite {bad}: expected one of {}, {DEMO}",
                SUITES.join(", ")
            );
        }
        let demo = wanted.iter().any(|s| s == DEMO);
        wanted.retain(|s| s != DEMO);
        Ok(Self {
            kernels,
            suites: wanted,
            demo,
            test_args,
            timeout: Duration::from_secs(45 * 60),
        })
    }
}

/// Runs `plan`; prints the matrix and writes it to `target/kernels/matrix.md`.
/// Fails if any suite failed or any guest did not finish.
pub fn run(root: &Path, plan: &Plan) -> Result<()> {
    let work = root.join("target/kernels");
    fs::create_dir_all(&work)?;
    let vng = host_tools(&work)?;
    let binaries = build(root, plan)?;
    let mut rows = Vec::new();
    for kernel in &plan.kernels {
        let vmlinuz = fetch(&work, kernel)?;
        let out = work.join("out").join(kernel.short);
        let _ = fs::remove_dir_all(&out);
        fs::create_dir_all(&out)?;
        let script = guest_script(root, &binaries, plan, &out);
        let script_path = work.join(format!("guest-{}.sh", kernel.short));
        fs::write(&script_path, script)?;
        println!(
            "xtask kernels: booting {} ({})",
            kernel.short,
            vmlinuz.display()
        );
        let started = Instant::now();
        let ended = boot(&vng, &vmlinuz, &work, &script_path, &out, plan.timeout)?;
        rows.push(Row::read(kernel, &out, plan, ended, started.elapsed()));
    }
    let table = matrix(&rows);
    println!("{table}");
    fs::write(work.join("matrix.md"), &table)?;
    let failed: Vec<_> = rows
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.kernel)
        .collect();
    if !failed.is_empty() {
        bail!(
            "kernels {}: see target/kernels/out/<kernel>/*.log",
            failed.join(", ")
        );
    }
    Ok(())
}

/// QEMU (bookworm-backports: virtme-ng wants a newer one than bookworm's),
/// kmod and udev on the host, and virtme-ng in a venv under `work`; returns
/// the `vng` program.
fn host_tools(work: &Path) -> Result<PathBuf> {
    let apt = AptConfig::write(work)?;
    let missing: Vec<_> = [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("modprobe", "kmod"),
        ("udevadm", "udev"),
    ]
    .into_iter()
    .filter(|(tool, _)| !on_path(tool))
    .map(|(_, package)| package)
    .collect();
    if !missing.is_empty() {
        apt.update(&apt.tools)?;
        let mut install = Command::new("apt-get");
        install
            .env("APT_CONFIG", &apt.tools)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends", "-t"])
            .arg("bookworm-backports")
            .args(&missing);
        super::run(&mut install).context("installing QEMU, kmod and udev")?;
    }
    let venv = work.join("venv");
    let vng = venv.join("bin/vng");
    if !vng.exists() {
        super::run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
        super::run(Command::new(venv.join("bin/pip")).args(["install", "-q", "virtme-ng==1.42"]))
            .context("installing virtme-ng from PyPI")?;
    }
    Ok(vng)
}

fn on_path(tool: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| dir.join(tool).is_file())
}

/// Private APT configurations: `kernels` sees every suite with a kernel we
/// boot, `tools` only bookworm and its backports (what the host may install).
struct AptConfig {
    kernels: PathBuf,
    tools: PathBuf,
}

impl AptConfig {
    fn write(work: &Path) -> Result<Self> {
        let dir = work.join("apt");
        let debian = "http://deb.debian.org/debian";
        let security = "http://deb.debian.org/debian-security";
        let bookworm = format!(
            "deb {debian} bookworm main\ndeb {debian} bookworm-updates main\n\
             deb {debian} bookworm-backports main\ndeb {security} bookworm-security main\n"
        );
        let kernels = format!(
            "{bookworm}deb {security} bullseye-security main\ndeb {security} trixie-security main\n"
        );
        let config = |name: &str, sources: &str| -> Result<PathBuf> {
            let state = dir.join(name);
            for sub in ["lists/partial", "cache/archives/partial", "parts"] {
                fs::create_dir_all(state.join(sub))?;
            }
            fs::write(state.join("sources.list"), sources)?;
            let conf = state.join("apt.conf");
            let s = state.display();
            fs::write(
                &conf,
                format!(
                    "Dir::Etc::SourceList \"{s}/sources.list\";\n\
                     Dir::Etc::SourceParts \"{s}/parts\";\n\
                     Dir::Etc::Parts \"{s}/parts\";\n\
                     Dir::Etc::PreferencesParts \"{s}/parts\";\n\
                     Dir::State::Lists \"{s}/lists\";\n\
                     Dir::Cache \"{s}/cache\";\n\
                     Acquire::Languages \"none\";\n"
                ),
            )?;
            Ok(conf)
        };
        Ok(Self {
            kernels: config("kernels", &kernels)?,
            tools: config("tools", &bookworm)?,
        })
    }

    /// `apt-get update` unless done in the last day.
    fn update(&self, conf: &Path) -> Result<()> {
        let stamp = conf.with_file_name("updated");
        let fresh = fs::metadata(&stamp)
            .and_then(|m| m.modified())
            .is_ok_and(|t| {
                t.elapsed()
                    .is_ok_and(|age| age < Duration::from_secs(86_400))
            });
        if !fresh {
            super::run(
                Command::new("apt-get")
                    .env("APT_CONFIG", conf)
                    .args(["update", "-q"]),
            )?;
            fs::write(&stamp, "")?;
        }
        Ok(())
    }
}

/// The newest package of `kernel`, downloaded and unpacked under `work`
/// (once); returns its vmlinuz, with its modules beside it where vng looks.
fn fetch(work: &Path, kernel: &Kernel) -> Result<PathBuf> {
    let apt = AptConfig::write(work)?;
    apt.update(&apt.kernels)?;
    let names = Command::new("apt-cache")
        .env("APT_CONFIG", &apt.kernels)
        .args(["pkgnames", kernel.prefix])
        .output()?;
    let package = String::from_utf8_lossy(&names.stdout)
        .lines()
        .filter_map(|name| {
            let middle = name
                .strip_prefix(kernel.prefix)?
                .strip_suffix(kernel.suffix)?;
            Some((middle.parse::<u32>().ok()?, name.to_owned()))
        })
        .max()
        .map(|(_, name)| name)
        .with_context(|| format!("no Debian package {}<n>{}", kernel.prefix, kernel.suffix))?;
    let unpacked = work.join(&package);
    if !unpacked.join("boot").exists() {
        let debs = work.join("debs");
        fs::create_dir_all(&debs)?;
        super::run(
            Command::new("apt-get")
                .current_dir(&debs)
                .env("APT_CONFIG", &apt.kernels)
                .args(["download", "-q", &package]),
        )?;
        let deb = fs::read_dir(&debs)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_")))
            })
            .with_context(|| format!("{package} was not downloaded"))?;
        let partial = work.join(format!("{package}.partial"));
        let _ = fs::remove_dir_all(&partial);
        super::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))?;
        fs::rename(&partial, &unpacked)?;
    }
    fs::read_dir(unpacked.join("boot"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .with_context(|| format!("{package} has no vmlinuz"))
}

/// The test binaries (and the demo's) the guests run.
struct Binaries {
    suites: BTreeMap<String, PathBuf>,
    demo: PathBuf,
    agent: PathBuf,
}

fn build(root: &Path, plan: &Plan) -> Result<Binaries> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args(["test", "-p", "ambpf", "--no-run", "--message-format=json"]);
    for suite in &plan.suites {
        cmd.args(["--test", suite]);
    }
    let out = cmd.stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut suites = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact"
            && msg["target"]["kind"][0] == "test"
            && let (Some(name), Some(exe)) =
                (msg["target"]["name"].as_str(), msg["executable"].as_str())
        {
            suites.insert(name.to_owned(), PathBuf::from(exe));
        }
    }
    if plan.demo {
        super::cargo(root, &["build", "-p", "ambpf", "-p", "ambpf-testbed"])?;
    }
    Ok(Binaries {
        suites,
        demo: root.join("target/debug/ambpf-demo"),
        agent: root.join("target/debug/ambpf"),
    })
}

/// The script the guest runs as root: the bpf filesystem (the guest mounts
/// none), then each suite, its output and exit status into `out`.
fn guest_script(root: &Path, bins: &Binaries, plan: &Plan, out: &Path) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let args: Vec<_> = plan.test_args.iter().map(|a| quote(a)).collect();
    let out = out.display();
    let mut s = format!(
        "#!/bin/sh\nset -u\nexport RUST_BACKTRACE=1\n\
         mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf\nmkdir -p /run/netns\n\
         uname -r > {out}/kernel\ncd {}\n",
        root.join("agent").display()
    );
    // The adversarial suite's size and seed, as the host sets them.
    for (key, value) in std::env::vars().filter(|(k, _)| k.starts_with("AMBPF_ADVERSARIAL_")) {
        let _ = writeln!(s, "export {key}={}", quote(&value));
    }
    for suite in &plan.suites {
        let bin = bins
            .suites
            .get(suite)
            .map_or("false".into(), |b| b.display().to_string());
        let _ = writeln!(
            s,
            "{bin} {} > {out}/{suite}.log 2>&1; echo $? > {out}/{suite}.rc",
            args.join(" ")
        );
    }
    if plan.demo {
        let _ = writeln!(
            s,
            "{} --agent {} > {out}/{DEMO}.log 2>&1; echo $? > {out}/{DEMO}.rc",
            bins.demo.display(),
            bins.agent.display()
        );
    }
    let _ = writeln!(s, "touch {out}/done");
    s
}

/// How a guest ended.
#[derive(Clone, Copy, PartialEq)]
enum Ended {
    Finished,
    TimedOut,
    /// vng exited before the script finished (a boot failure, a panic).
    Died,
}

fn boot(
    vng: &Path,
    vmlinuz: &Path,
    work: &Path,
    script: &Path,
    out: &Path,
    timeout: Duration,
) -> Result<Ended> {
    let console = fs::File::create(out.join("console.log"))?;
    let mut child = Command::new(vng)
        .env("PATH", path_with(vng.parent().unwrap()))
        .arg("--disable-kvm")
        .arg("--run")
        .arg(vmlinuz)
        .args(["--memory", "2G", "--cpus", "2"])
        .arg(format!("--rwdir={}", work.join("out").display()))
        .arg("--exec")
        .arg(format!("sh {}", script.display()))
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console)
        // Its own group, so that QEMU is ended with it.
        .process_group(0)
        .spawn()
        .context("starting vng")?;
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait()?.is_some() {
            return Ok(if out.join("done").exists() {
                Ended::Finished
            } else {
                Ended::Died
            });
        }
        if Instant::now() > deadline {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            return Ok(Ended::TimedOut);
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn path_with(dir: &Path) -> std::ffi::OsString {
    let mut dirs = vec![dir.to_owned()];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(dirs).expect("PATH entries")
}

/// One suite's outcome in one guest.
struct Outcome {
    suite: String,
    /// Exit status, or `None` when it never finished.
    status: Option<i32>,
    /// (passed, failed) per mode (`ebpf`, `iptables`, `-` for neither).
    modes: BTreeMap<&'static str, (u32, u32)>,
    failures: Vec<String>,
}

struct Row {
    kernel: &'static str,
    runs_on: &'static str,
    release: String,
    ended: Ended,
    took: Duration,
    outcomes: Vec<Outcome>,
}

impl Row {
    fn read(kernel: &Kernel, out: &Path, plan: &Plan, ended: Ended, took: Duration) -> Self {
        let suites = plan
            .suites
            .iter()
            .cloned()
            .chain(plan.demo.then(|| DEMO.into()));
        let outcomes = suites
            .map(|suite| {
                let log = fs::read_to_string(out.join(format!("{suite}.log"))).unwrap_or_default();
                let status = fs::read_to_string(out.join(format!("{suite}.rc")))
                    .ok()
                    .and_then(|s| s.trim().parse().ok());
                let (modes, failures) = tally(&log);
                Outcome {
                    suite,
                    status,
                    modes,
                    failures,
                }
            })
            .collect();
        Self {
            kernel: kernel.short,
            runs_on: kernel.runs_on,
            release: fs::read_to_string(out.join("kernel"))
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "(did not boot)".into()),
            ended,
            took,
            outcomes,
        }
    }

    fn passed(&self) -> bool {
        self.ended == Ended::Finished && self.outcomes.iter().all(|o| o.status == Some(0))
    }
}

/// Per mode, the tests passed and failed in a libtest log, and the failures.
fn tally(log: &str) -> (BTreeMap<&'static str, (u32, u32)>, Vec<String>) {
    let mut modes = BTreeMap::new();
    let mut failures = Vec::new();
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("test ") else {
            continue;
        };
        let Some((name, result)) = rest.rsplit_once(" ... ") else {
            continue;
        };
        let mode = if name.ends_with("ebpf") {
            "ebpf"
        } else if name.ends_with("iptables") {
            "iptables"
        } else {
            "-"
        };
        let entry = modes.entry(mode).or_insert((0, 0));
        match result {
            "ok" => entry.0 += 1,
            "FAILED" => {
                entry.1 += 1;
                failures.push(name.to_owned());
            }
            _ => {}
        }
    }
    (modes, failures)
}

/// The results as a Markdown table, then each failure.
fn matrix(rows: &[Row]) -> String {
    let mut s = String::from("| kernel | release | suite | result | eBPF | iptables | other |\n");
    s.push_str("|---|---|---|---|---|---|---|\n");
    let count = |o: &Outcome, mode| {
        o.modes
            .get(mode)
            .map_or("-".into(), |(ok, bad)| format!("{ok}/{}", ok + bad))
    };
    for row in rows {
        let head = format!("{} ({})", row.kernel, row.runs_on);
        if row.ended != Ended::Finished {
            let why = match row.ended {
                Ended::TimedOut => format!("guest ended after {}s (timeout)", row.took.as_secs()),
                _ => "guest died (see console.log)".into(),
            };
            let _ = writeln!(s, "| {head} | {} | - | {why} | | | |", row.release);
        }
        for o in &row.outcomes {
            let result = match o.status {
                Some(0) => "pass".to_owned(),
                Some(code) => format!("FAIL ({code})"),
                None => "not run".to_owned(),
            };
            let _ = writeln!(
                s,
                "| {head} | {} | {} | {result} | {} | {} | {} |",
                row.release,
                o.suite,
                count(o, "ebpf"),
                count(o, "iptables"),
                count(o, "-")
            );
        }
        let _ = writeln!(
            s,
            "| {head} | | (guest, boot included) | {}s | | | |",
            row.took.as_secs()
        );
    }
    for row in rows {
        for o in &row.outcomes {
            for failure in &o.failures {
                let _ = writeln!(s, "- {} {}: {failure}", row.kernel, o.suite);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_libtest_log_is_tallied_per_mode() {
        let log = "test a::ebpf ... ok\ntest a::iptables ... ok\ntest b::ebpf ... FAILED\n\
                   test c ... ignored\ntest d ... ok\n";
        let (modes, failures) = tally(log);
        assert_eq!(modes["ebpf"], (1, 1));
        assert_eq!(modes["iptables"], (1, 0));
        assert_eq!(modes["-"], (1, 0));
        assert_eq!(failures, ["b::ebpf"]);
    }

    #[test]
    fn kernels_and_suites_are_checked() {
        assert!(Plan::new("4.19", &[], vec![]).is_err());
        assert!(Plan::new("6.1", &["nope".into()], vec![]).is_err());
        let plan = Plan::new("all", &["redirect".into(), "demo".into()], vec![]).unwrap();
        assert_eq!(plan.kernels.len(), KERNELS.len());
        assert_eq!(plan.suites, ["redirect"]);
        assert!(plan.demo);
    }
}
