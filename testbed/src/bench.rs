//! A small framework for ambpf's benchmarks (`ambpf-bench`, behind
//! `cargo xtask bench <suite>`).
//!
//! Benchmarks here report ratios against a baseline measured in the same run
//! on the same machine, never pass/fail against absolute numbers: a suite
//! measures the agent and a minimal "floor" doing the same job, and the
//! interesting figure is how far above the floor the agent is.
//!
//! What a suite gets from this module:
//! - [`Stats`]: median, p90, p99, min, max and mean over repeated runs;
//! - [`Table`]: a plain-text table for the terminal;
//! - [`Machine`]: kernel (`uname -r`), CPU count and model, memory, to tell
//!   results from different machines apart;
//! - [`cpu_time`] / [`CpuWatch`]: per-process CPU time from `/proc/<pid>/stat`,
//!   to tell which process saturated the CPU (agent, ztunnel double, traffic
//!   generator) when a suite is CPU bound; [`on_cpu`] / [`thread_on_cpu`]:
//!   the same to the nanosecond from `schedstat`, for short spans;
//! - [`memory`]: VmRSS and VmHWM from `/proc/<pid>/status`;
//! - [`ProcessGuard`]: a child process (the real agent binary) with its output
//!   in a log file, stopped with SIGTERM (then SIGKILL) when dropped;
//! - [`TempDir`], [`write_json`], [`SuiteRun`], [`Report`]: throwaway files
//!   and the JSON result file.

use std::{
    fmt, fs,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use serde::Serialize;

use crate::unique_name;

/// `d` in milliseconds, as a float (the unit tables and JSON use).
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------
// Statistics

/// Summary of repeated measurements, in the unit of the samples.
///
/// Percentiles are nearest-rank: the smallest sample such that at least p %
/// of the samples are less than or equal to it. With few runs the high
/// percentiles are the maximum (p90 of 7 runs is the 7th), which is honest:
/// 7 runs say nothing finer about the tail.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Stats {
    pub count: usize,
    pub min: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Stats {
    /// `None` for no samples or a sample that is not a finite number.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() || samples.iter().any(|s| !s.is_finite()) {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            count: sorted.len(),
            min: sorted[0],
            median: median(&sorted),
            p90: percentile(&sorted, 90.0),
            p99: percentile(&sorted, 99.0),
            max: sorted[sorted.len() - 1],
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
        })
    }

    /// Every figure multiplied by `factor` (e.g. per pod: `1.0 / pods`).
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            count: self.count,
            min: self.min * factor,
            median: self.median * factor,
            p90: self.p90 * factor,
            p99: self.p99 * factor,
            max: self.max * factor,
            mean: self.mean * factor,
        }
    }
}

/// The median of sorted samples (the mean of the middle two for an even
/// count). Panics on an empty slice.
/// The order two modes are measured in for run `run` (0-based): alternated,
/// so neither always meets the machine's state the other left (page cache,
/// kernel slabs, namespaces being freed).
pub fn alternated<T: Copy>(modes: [T; 2], run: usize) -> [T; 2] {
    if run.is_multiple_of(2) {
        modes
    } else {
        [modes[1], modes[0]]
    }
}

/// The order `n` lanes are measured in for round `round` (0-based), as a
/// balanced Latin square (Williams' design): over `n` rounds (`2n` for an
/// odd `n`) each lane goes first equally often and directly follows every
/// other lane equally often, so no lane always meets what one other left.
pub fn balanced_order(n: usize, round: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    // 0, 1, n-1, 2, n-2, ...: each difference between neighbours once.
    let mut base = Vec::with_capacity(n);
    let (mut low, mut high) = (0, n);
    for i in 0..n {
        if i % 2 == 0 {
            base.push(low);
            low += 1;
        } else {
            high -= 1;
            base.push(high);
        }
    }
    // An odd n needs the mirrored square too.
    if n % 2 == 1 && (round / n) % 2 == 1 {
        base.reverse();
    }
    base.into_iter().map(|lane| (lane + round) % n).collect()
}

/// Istio's two in-pod backends, as ambpf's `iptables` and `nftables` modes
/// write them: what a user would run instead of eBPF mode, so every suite
/// compares eBPF mode with each of them and with the faster of the two.
pub const ISTIO_BACKENDS: [&str; 2] = ["iptables", "nftables"];

/// One baseline of a figure: an Istio backend's value, labelled by the
/// backend or, for the faster of two, `faster (<backend>)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Baseline {
    pub label: String,
    pub backend: &'static str,
    pub value: f64,
}

/// The baselines of one figure: each Istio backend that `value` has, then
/// the faster of them (the smaller value where `lower_is_better`, else the
/// larger) when both were measured.
pub fn istio_baselines(
    value: impl Fn(&str) -> Option<f64>,
    lower_is_better: bool,
) -> Vec<Baseline> {
    let mut baselines: Vec<Baseline> = ISTIO_BACKENDS
        .iter()
        .filter_map(|&backend| {
            let value = value(backend).filter(|v| v.is_finite())?;
            Some(Baseline {
                label: backend.to_owned(),
                backend,
                value,
            })
        })
        .collect();
    let faster = baselines.iter().cloned().reduce(|a, b| {
        let b_faster = if lower_is_better {
            b.value < a.value
        } else {
            b.value > a.value
        };
        if b_faster { b } else { a }
    });
    if let (Some(faster), true) = (faster, baselines.len() > 1) {
        baselines.push(Baseline {
            label: format!("faster ({})", faster.backend),
            ..faster
        });
    }
    baselines
}

/// Which runs make the steady figures: every run after the first, which is
/// reported apart (a first run meets cold caches and binaries), or the one
/// run there was.
pub fn steady_run(run: usize, runs: usize) -> bool {
    run > 0 || runs == 1
}

/// A group of runs a suite summarises on its own: its label and which runs
/// (0-based run, runs) belong to it.
pub type RunGroup = (&'static str, fn(usize, usize) -> bool);

/// The steady runs ([`steady_run`]) and, with more than one run, the first.
pub const RUN_GROUPS: [RunGroup; 2] = [
    ("steady", steady_run),
    ("first", |run, runs| run == 0 && runs > 1),
];

pub fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    assert!(n > 0, "median of no samples");
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// The nearest-rank `p`-th percentile (0 < p <= 100) of sorted samples.
/// Panics on an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    assert!(n > 0, "percentile of no samples");
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

// ---------------------------------------------------------------------------
// Tables

/// A plain-text table: the first column left-aligned, the others (numbers)
/// right-aligned, columns as wide as their widest cell.
#[derive(Clone, Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Self {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Self {
        self.rows.push(cells.into_iter().map(Into::into).collect());
        self
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let columns = self
            .rows
            .iter()
            .map(Vec::len)
            .chain([self.header.len()])
            .max()
            .unwrap_or(0);
        let mut widths = vec![0; columns];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, row: &[String]| -> fmt::Result {
            let mut text = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = row.get(i).map(String::as_str).unwrap_or("");
                if i > 0 {
                    text.push_str("  ");
                }
                if i == 0 {
                    text.push_str(&format!("{cell:<width$}"));
                } else {
                    text.push_str(&format!("{cell:>width$}"));
                }
            }
            writeln!(f, "{}", text.trim_end())
        };
        line(f, &self.header)?;
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        line(f, &rule)?;
        for row in &self.rows {
            line(f, row)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// The machine

/// What a result depends on besides the code.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// `uname -r`.
    pub kernel: String,
    /// CPUs this process may run on.
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub memory_kib: Option<u64>,
}

impl Machine {
    pub fn collect() -> Self {
        let kernel = Command::new("uname")
            .arg("-r")
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
            .or_else(|| {
                fs::read_to_string("/proc/sys/kernel/osrelease")
                    .ok()
                    .map(|s| s.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu_model = fs::read_to_string("/proc/cpuinfo").ok().and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        });
        let memory_kib = fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| status_kib(&info, "MemTotal"));
        Self {
            kernel,
            cpus,
            cpu_model,
            memory_kib,
        }
    }
}

impl fmt::Display for Machine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kernel {}, {} CPUs", self.kernel, self.cpus)?;
        if let Some(model) = &self.cpu_model {
            write!(f, " ({model})")?;
        }
        if let Some(kib) = self.memory_kib {
            write!(f, ", {:.1} GiB", kib as f64 / (1024.0 * 1024.0))?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Processes: CPU time, memory, descriptors

/// CPU time a process (all its threads, live and exited) has used, from
/// `/proc/<pid>/stat`. Resolution is the kernel's clock tick (USER_HZ,
/// 10 ms nearly everywhere): sum over a span long enough to be meaningful.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CpuTime {
    pub user: Duration,
    pub system: Duration,
}

impl CpuTime {
    pub fn total(&self) -> Duration {
        self.user + self.system
    }

    /// The time used since `earlier` (zero if the counters went backwards).
    pub fn since(&self, earlier: &CpuTime) -> CpuTime {
        CpuTime {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// Reads [`CpuTime`] of `pid` (`std::process::id()` for this process).
pub fn cpu_time(pid: u32) -> std::io::Result<CpuTime> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat_cpu(&stat, clock_ticks_per_second()).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected /proc/{pid}/stat: {stat}"),
        )
    })
}

/// utime and stime (fields 14 and 15) of a `/proc/<pid>/stat` line. The
/// command name (field 2) may contain spaces and parentheses, so fields are
/// counted from its closing parenthesis.
fn parse_stat_cpu(stat: &str, ticks_per_second: u64) -> Option<CpuTime> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    let mut fields = after_comm.split_whitespace();
    // After ')' come field 3 (state) onwards: utime is the 12th, stime the 13th.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let tick = |t: u64| Duration::from_nanos(t.saturating_mul(1_000_000_000) / ticks_per_second);
    Some(CpuTime {
        user: tick(utime),
        system: tick(stime),
    })
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as u64 } else { 100 }
}

/// Time `pid` has spent on a CPU, to the nanosecond: its process CPU-time
/// clock (`clock_getcpuclockid`), which counts every thread, those that have
/// exited included (the agent enrols each pod on a short-lived thread, which
/// a sum over `/proc/<pid>/task/*/schedstat` would miss). Precise enough for
/// per-run deltas of a few milliseconds, where [`cpu_time`]'s clock ticks
/// are not.
pub fn on_cpu(pid: u32) -> std::io::Result<Duration> {
    use nix::{
        time::{clock_getcpuclockid, clock_gettime},
        unistd::Pid,
    };
    let pid = i32::try_from(pid).map_err(std::io::Error::other)?;
    let clock = clock_getcpuclockid(Pid::from_raw(pid))?;
    Ok(Duration::from(clock_gettime(clock)?))
}

/// [`on_cpu`] for one thread (`tid` from `gettid()`).
pub fn thread_on_cpu(pid: u32, tid: u32) -> std::io::Result<Duration> {
    parse_schedstat(&fs::read_to_string(format!(
        "/proc/{pid}/task/{tid}/schedstat"
    ))?)
}

/// The first field of `schedstat`: nanoseconds on a CPU.
fn parse_schedstat(text: &str) -> std::io::Result<Duration> {
    text.split_whitespace()
        .next()
        .and_then(|ns| ns.parse().ok())
        .map(Duration::from_nanos)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unexpected schedstat {text:?} (kernel without CONFIG_SCHED_INFO?)"),
            )
        })
}

/// CPU used by one process over a span, and how many cores' worth that is.
#[derive(Clone, Debug, Serialize)]
pub struct CpuUsage {
    pub label: String,
    pub pid: u32,
    pub user_ms: f64,
    pub system_ms: f64,
    pub wall_ms: f64,
    /// CPU time over wall time: 1.0 is one core kept busy the whole span.
    pub cores: f64,
}

/// Samples the CPU time of several processes at the start and end of a span;
/// the process with the highest [`CpuUsage::cores`] is the one that saturated
/// a CPU, if any did.
#[derive(Debug)]
pub struct CpuWatch {
    started: Instant,
    processes: Vec<(String, u32, CpuTime)>,
}

impl CpuWatch {
    pub fn start<'a>(processes: impl IntoIterator<Item = (&'a str, u32)>) -> std::io::Result<Self> {
        let processes = processes
            .into_iter()
            .map(|(label, pid)| Ok((label.to_owned(), pid, cpu_time(pid)?)))
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            started: Instant::now(),
            processes,
        })
    }

    /// Usage of every process since [`CpuWatch::start`], busiest first.
    pub fn finish(&self) -> std::io::Result<Vec<CpuUsage>> {
        let wall = self.started.elapsed();
        let mut usage = self
            .processes
            .iter()
            .map(|(label, pid, before)| {
                let used = cpu_time(*pid)?.since(before);
                Ok(CpuUsage {
                    label: label.clone(),
                    pid: *pid,
                    user_ms: ms(used.user),
                    system_ms: ms(used.system),
                    wall_ms: ms(wall),
                    cores: used.total().as_secs_f64() / wall.as_secs_f64().max(1e-9),
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        usage.sort_by(|a, b| b.cores.total_cmp(&a.cores));
        Ok(usage)
    }
}

/// Resident memory of a process, from `/proc/<pid>/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// Resident now.
    pub vm_rss_kib: u64,
    /// The most ever resident (high-water mark).
    pub vm_hwm_kib: u64,
    /// Of the resident now: the process's own (heap, stacks) and the pages
    /// of mapped files (its binary), which are clean and shared.
    pub rss_anon_kib: u64,
    pub rss_file_kib: u64,
}

pub fn memory(pid: u32) -> std::io::Result<Memory> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    match (status_kib(&status, "VmRSS"), status_kib(&status, "VmHWM")) {
        (Some(vm_rss_kib), Some(vm_hwm_kib)) => Ok(Memory {
            vm_rss_kib,
            vm_hwm_kib,
            rss_anon_kib: status_kib(&status, "RssAnon").unwrap_or(0),
            rss_file_kib: status_kib(&status, "RssFile").unwrap_or(0),
        }),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("no VmRSS/VmHWM in /proc/{pid}/status (a kernel thread or a zombie?)"),
        )),
    }
}

/// The value of a `Key:   1234 kB` line.
fn status_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// What each open descriptor of `pid` points at (`socket:[123]`, a path...).
pub fn open_fds(pid: u32) -> std::io::Result<Vec<String>> {
    let mut targets = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))? {
        // A descriptor closed between readdir and readlink is simply gone.
        if let Ok(target) = fs::read_link(entry?.path()) {
            targets.push(target.to_string_lossy().into_owned());
        }
    }
    Ok(targets)
}

/// How many sockets `pid` has open.
pub fn socket_count(pid: u32) -> std::io::Result<usize> {
    Ok(open_fds(pid)?
        .iter()
        .filter(|t| t.starts_with("socket:"))
        .count())
}

/// Raises this process's open-file soft limit to its hard limit: a ztunnel
/// double holding a netns fd per pod needs more than the usual 1024.
pub fn raise_fd_limit() -> std::io::Result<u64> {
    let mut limit = nix::libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct passed.
    unsafe {
        if nix::libc::getrlimit(nix::libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            if nix::libc::setrlimit(nix::libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(limit.rlim_cur)
}

/// A child process with stdout and stderr in a log file, stopped with SIGTERM
/// (SIGKILL after [`ProcessGuard::STOP_GRACE`]) and reaped when dropped.
#[derive(Debug)]
pub struct ProcessGuard {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl ProcessGuard {
    /// How long a stopped process may take to exit before it is killed.
    pub const STOP_GRACE: Duration = Duration::from_secs(10);

    /// Spawns `command` with its output appended to `log`.
    pub fn spawn(name: &str, mut command: Command, log: &Path) -> std::io::Result<Self> {
        let out = fs::OpenOptions::new().create(true).append(true).open(log)?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("starting {name}: {e}")))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
            log: log.to_owned(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// An error (with the end of its log) if the process has exited.
    pub fn check_running(&mut self) -> std::io::Result<()> {
        let Some(child) = self.child.as_mut() else {
            return Err(std::io::Error::other(format!("{} was stopped", self.name)));
        };
        match child.try_wait()? {
            None => Ok(()),
            Some(status) => Err(std::io::Error::other(format!(
                "{} exited early ({status}); the end of its log {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail(20)
            ))),
        }
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGTERM, then waits; SIGKILL if it does not exit within
    /// [`ProcessGuard::STOP_GRACE`]. Returns how it exited.
    pub fn stop(&mut self) -> std::io::Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(std::io::Error::other(format!(
                "{} was stopped already",
                self.name
            )));
        };
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Self::STOP_GRACE;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                eprintln!(
                    "bench: {} ignored SIGTERM for {:?}; killing it",
                    self.name,
                    Self::STOP_GRACE
                );
                let _ = child.kill();
                return child.wait();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        if self.child.is_some()
            && let Err(e) = self.stop()
        {
            eprintln!("bench: stopping {}: {e}", self.name);
        }
    }
}

/// A fresh directory under the system temp dir, removed with its contents
/// when dropped.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn create(prefix: &str) -> std::io::Result<Self> {
        let path = std::env::temp_dir().join(format!("{prefix}-{}", unique_name("")));
        fs::create_dir(&path)?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.path) {
            eprintln!("bench: cannot remove {}: {e}", self.path.display());
        }
    }
}

// ---------------------------------------------------------------------------
// Results

/// The JSON result of one suite run.
#[derive(Debug, Serialize)]
pub struct Report<C: Serialize, R: Serialize> {
    pub suite: String,
    /// Seconds since the Unix epoch when the suite started.
    pub started_unix: u64,
    pub duration_s: f64,
    /// The source the run was built from: `git describe --always --dirty`
    /// of the working directory (`cargo xtask bench` runs from the
    /// workspace), `None` outside a git checkout.
    pub commit: Option<String>,
    pub machine: Machine,
    /// The suite's parameters.
    pub config: C,
    pub results: R,
}

/// A suite run: when it started and on what machine, for its [`Report`].
pub struct SuiteRun {
    suite: &'static str,
    started_unix: u64,
    started: Instant,
    commit: Option<String>,
    pub machine: Machine,
}

impl SuiteRun {
    /// Starts the clock and describes the machine (printed to stderr).
    pub fn start(suite: &'static str) -> Self {
        let machine = Machine::collect();
        let commit = source_commit();
        eprintln!(
            "{suite}: {machine}; source {}",
            commit.as_deref().unwrap_or("unknown")
        );
        Self {
            suite,
            started_unix: unix_now(),
            started: Instant::now(),
            commit,
            machine,
        }
    }

    /// Writes the suite's [`Report`] to `out`, when given.
    pub fn write_report(
        self,
        out: Option<&Path>,
        config: impl Serialize,
        results: impl Serialize,
    ) -> std::io::Result<()> {
        let Some(out) = out else {
            return Ok(());
        };
        let report = Report {
            suite: self.suite.to_owned(),
            started_unix: self.started_unix,
            duration_s: self.started.elapsed().as_secs_f64(),
            commit: self.commit,
            machine: self.machine,
            config,
            results,
        };
        write_json(out, &report).map_err(|e| {
            std::io::Error::new(e.kind(), format!("writing {}: {e}", out.display()))
        })?;
        println!("wrote {}", out.display());
        Ok(())
    }
}

/// `git describe --always --dirty --abbrev=12` here, if this is a checkout.
fn source_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()?;
    let commit = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !commit.trim().is_empty()).then(|| commit.trim().to_owned())
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes `value` as pretty JSON to `path`, creating its directory; written
/// under a temporary name and renamed, so a reader never sees half a file.
pub fn write_json(path: &Path, value: &impl Serialize) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir)?;
    }
    let mut text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    text.push('\n');
    let temp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    fs::write(&temp, text)?;
    fs::rename(&temp, path).inspect_err(|_| {
        let _ = fs::remove_file(&temp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baselines_are_each_istio_backend_and_the_faster_per_figure() {
        let times = |b: &str| match b {
            "iptables" => Some(12.0),
            "nftables" => Some(9.0),
            _ => None,
        };
        let labelled = |baselines: Vec<Baseline>| -> Vec<(String, &str, f64)> {
            baselines
                .into_iter()
                .map(|b| (b.label, b.backend, b.value))
                .collect()
        };
        assert_eq!(
            labelled(istio_baselines(times, true)),
            [
                ("iptables".to_owned(), "iptables", 12.0),
                ("nftables".to_owned(), "nftables", 9.0),
                ("faster (nftables)".to_owned(), "nftables", 9.0)
            ]
        );
        // A rate: the larger is the faster.
        assert_eq!(
            labelled(istio_baselines(times, false))[2],
            ("faster (iptables)".to_owned(), "iptables", 12.0)
        );
        // One backend measured: no "faster" row; a NaN is not a measurement.
        let one = |b: &str| (b == "iptables").then_some(3.0).or(Some(f64::NAN));
        assert_eq!(
            labelled(istio_baselines(one, true)),
            [("iptables".to_owned(), "iptables", 3.0)]
        );
        assert!(istio_baselines(|_| None, true).is_empty());
    }

    #[test]
    fn balanced_orders_put_each_lane_first_and_after_each_other_equally_often() {
        for n in 1..=5usize {
            let rounds = if n % 2 == 0 { n } else { 2 * n };
            let mut first = vec![0; n];
            let mut follows = vec![vec![0; n]; n];
            for round in 0..rounds {
                let order = balanced_order(n, round);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "a permutation");
                first[order[0]] += 1;
                for pair in order.windows(2) {
                    follows[pair[0]][pair[1]] += 1;
                }
            }
            assert!(first.iter().all(|&f| f == rounds / n), "n {n}: {first:?}");
            for (a, row) in follows.iter().enumerate() {
                for (b, &count) in row.iter().enumerate() {
                    let expected = if a == b { 0 } else { rounds / n };
                    assert_eq!(count, expected, "n {n}: {b} after {a}");
                }
            }
        }
    }

    #[test]
    fn stats_of_an_odd_number_of_runs() {
        let s = Stats::of(&[7.0, 1.0, 5.0, 3.0, 2.0, 6.0, 4.0]).unwrap();
        assert_eq!(s.count, 7);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.median, 4.0);
        assert_eq!(s.max, 7.0);
        assert_eq!(s.mean, 4.0);
        // Nearest rank: ceil(0.9 * 7) = 7th, ceil(0.99 * 7) = 7th.
        assert_eq!(s.p90, 7.0);
        assert_eq!(s.p99, 7.0);
    }

    #[test]
    fn median_of_an_even_number_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[1.0, 2.0, 4.0, 10.0]), 3.0);
        assert_eq!(Stats::of(&[5.0]).unwrap().median, 5.0);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 90.0), 90.0);
        assert_eq!(percentile(&sorted, 99.0), 99.0);
        assert_eq!(percentile(&sorted, 100.0), 100.0);
        assert_eq!(percentile(&sorted, 0.1), 1.0);
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 90.0), 9.0);
        assert_eq!(percentile(&ten, 99.0), 10.0);
    }

    #[test]
    fn no_stats_without_finite_samples() {
        assert_eq!(Stats::of(&[]), None);
        assert_eq!(Stats::of(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn scaling_keeps_the_count() {
        let s = Stats::of(&[100.0, 200.0, 300.0]).unwrap().scaled(0.01);
        assert_eq!(s.count, 3);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
    }

    #[test]
    fn table_aligns_columns() {
        let mut table = Table::new(["pods", "median ms"]);
        table.row(["100", "1.5"]).row(["1000", "12.25"]);
        assert_eq!(
            table.to_string(),
            "pods  median ms\n----  ---------\n100         1.5\n1000      12.25\n"
        );
    }

    #[test]
    fn cpu_fields_are_counted_after_the_command_name() {
        // A command name with spaces and a parenthesis, as a thread may have.
        let stat = "42 (tokio) worker) S 1 42 42 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 3 0 5 0 0";
        let cpu = parse_stat_cpu(stat, 100).unwrap();
        assert_eq!(cpu.user, Duration::from_millis(2500));
        assert_eq!(cpu.system, Duration::from_millis(300));
        assert_eq!(cpu.total(), Duration::from_millis(2800));
        assert!(parse_stat_cpu("42 (x) S 1", 100).is_none());
    }

    #[test]
    fn this_process_has_cpu_time_memory_and_descriptors() {
        let pid = std::process::id();
        let before = cpu_time(pid).unwrap();
        assert!(cpu_time(pid).unwrap().total() >= before.total());
        assert!(on_cpu(pid).unwrap() > Duration::ZERO);
        let tid = nix::unistd::gettid().as_raw() as u32;
        assert!(thread_on_cpu(pid, tid).unwrap() <= on_cpu(pid).unwrap());
        let mem = memory(pid).unwrap();
        assert!(mem.vm_rss_kib > 0 && mem.vm_hwm_kib >= mem.vm_rss_kib);
        assert!(!open_fds(pid).unwrap().is_empty());
        let usage = CpuWatch::start([("self", pid)]).unwrap().finish().unwrap();
        assert_eq!(usage.len(), 1);
        assert_eq!(usage[0].label, "self");
    }

    #[test]
    fn cpu_of_threads_that_have_exited_still_counts() {
        use nix::time::{ClockId, clock_gettime};
        let pid = std::process::id();
        let before = on_cpu(pid).unwrap();
        std::thread::spawn(|| {
            let spent = || Duration::from(clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap());
            while spent() < Duration::from_millis(30) {}
        })
        .join()
        .unwrap();
        assert!(on_cpu(pid).unwrap() - before >= Duration::from_millis(30));
    }

    #[test]
    fn schedstat_is_nanoseconds_on_cpu() {
        assert_eq!(
            parse_schedstat("1500000 20 3\n").unwrap(),
            Duration::from_micros(1500)
        );
        assert!(parse_schedstat("").is_err());
    }

    #[test]
    fn status_lines_are_parsed_in_kib() {
        let status = "Name:\tambpf\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(10240));
        assert_eq!(status_kib(status, "VmHWM"), Some(20480));
        assert_eq!(status_kib(status, "VmSwap"), None);
    }
}

// ---------------------------------------------------------------------------
// Traffic and enrolment suites (`redirect`, `enroll`)

pub mod histogram;
pub mod sys;
