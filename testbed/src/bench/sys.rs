//! What the traffic and enrolment suites read from the kernel: CPU time per
//! group of threads (by thread name) and of the whole machine, conntrack
//! counts, and when another process opens a file (inotify).

use std::{
    fs,
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

/// CPU time of this process's threads, grouped by thread-name prefix.
///
/// Each group's time is the sum of `/proc/<pid>/task/<tid>/schedstat` of the
/// live threads whose name (`comm`) starts with its prefix; threads matching
/// no prefix count as `other`. Name the threads of each runtime (tokio's
/// `thread_name`) to tell the load generator, the ztunnel double and the echo
/// server apart inside one process. Kernel work done on a thread's behalf
/// (the network stack in softirq on the sending thread) counts for it unless
/// the kernel accounts IRQ time apart.
pub fn thread_groups_on_cpu(pid: u32, prefixes: &[&str]) -> std::io::Result<ThreadGroups> {
    let mut groups = vec![Duration::ZERO; prefixes.len()];
    let mut other = Duration::ZERO;
    for task in fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path();
        // A thread that exited since readdir simply no longer counts.
        let (Ok(comm), Ok(schedstat)) = (
            fs::read_to_string(path.join("comm")),
            fs::read_to_string(path.join("schedstat")),
        ) else {
            continue;
        };
        let Some(on_cpu) = schedstat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse().ok())
            .map(Duration::from_nanos)
        else {
            continue;
        };
        match prefixes.iter().position(|p| comm.trim_end().starts_with(p)) {
            Some(i) => groups[i] += on_cpu,
            None => other += on_cpu,
        }
    }
    Ok(ThreadGroups { groups, other })
}

/// See [`thread_groups_on_cpu`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ThreadGroups {
    /// In the order of the prefixes.
    pub groups: Vec<Duration>,
    pub other: Duration,
}

impl ThreadGroups {
    /// Time used since `earlier` (zero where a group went backwards because
    /// a thread exited).
    pub fn since(&self, earlier: &ThreadGroups) -> ThreadGroups {
        ThreadGroups {
            groups: self
                .groups
                .iter()
                .zip(
                    earlier
                        .groups
                        .iter()
                        .chain(std::iter::repeat(&Duration::ZERO)),
                )
                .map(|(now, then)| now.saturating_sub(*then))
                .collect(),
            other: self.other.saturating_sub(earlier.other),
        }
    }
}

/// The whole machine's CPU time from the first line of `/proc/stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineCpu {
    /// user + nice + system + irq + softirq.
    pub busy: Duration,
    /// idle + iowait.
    pub idle: Duration,
    /// Time the hypervisor gave to others.
    pub steal: Duration,
    /// irq + softirq (part of `busy`): mostly the network stack's receive
    /// work. Without IRQ time accounting it is also counted in the thread it
    /// interrupted, so it overlaps the per-thread figures.
    pub irq: Duration,
}

impl MachineCpu {
    pub fn read() -> std::io::Result<Self> {
        let stat = fs::read_to_string("/proc/stat")?;
        parse_proc_stat(&stat, clock_ticks_per_second()).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected /proc/stat")
        })
    }

    pub fn since(&self, earlier: &MachineCpu) -> MachineCpu {
        MachineCpu {
            busy: self.busy.saturating_sub(earlier.busy),
            idle: self.idle.saturating_sub(earlier.idle),
            steal: self.steal.saturating_sub(earlier.steal),
            irq: self.irq.saturating_sub(earlier.irq),
        }
    }
}

fn parse_proc_stat(stat: &str, ticks_per_second: u64) -> Option<MachineCpu> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let field = |i: usize| fields.get(i).copied().unwrap_or(0);
    let tick = |t: u64| Duration::from_nanos(t.saturating_mul(1_000_000_000) / ticks_per_second);
    if fields.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal ...
    Some(MachineCpu {
        busy: tick(field(0) + field(1) + field(2) + field(5) + field(6)),
        idle: tick(field(3) + field(4)),
        steal: tick(field(7)),
        irq: tick(field(5) + field(6)),
    })
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as u64 } else { 100 }
}

/// `nf_conntrack_count` as seen by the calling thread's network namespace
/// (`None` when conntrack is not loaded).
pub fn conntrack_count() -> Option<u64> {
    fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Reports when any process opens a file named `name` in a directory
/// (inotify `IN_OPEN`): the moment an agent polling a file actually reads it.
/// A thread blocks on the inotify descriptor; it ends when the watcher is
/// dropped (the descriptor is closed after the watch is removed).
pub struct OpenWatcher {
    fd: std::os::fd::OwnedFd,
    wd: i32,
    opened: mpsc::Receiver<Instant>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OpenWatcher {
    pub fn new(dir: &Path, name: &str) -> std::io::Result<Self> {
        use std::os::{fd::FromRawFd, unix::ffi::OsStrExt};
        // SAFETY: plain syscalls on a descriptor this function owns.
        let fd = unsafe { nix::libc::inotify_init1(nix::libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned from here on.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let dir_c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor and NUL-terminated path.
        let wd = unsafe {
            nix::libc::inotify_add_watch(fd.as_raw_fd(), dir_c.as_ptr(), nix::libc::IN_OPEN)
        };
        if wd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let reader = fd.try_clone()?;
        let (tx, opened) = mpsc::channel();
        let name = name.to_owned();
        let thread = std::thread::Builder::new()
            .name("bench-inotify".to_owned())
            .spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    // SAFETY: reading into a buffer of the given length.
                    let n = unsafe {
                        nix::libc::read(reader.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
                    };
                    if n <= 0 {
                        return;
                    }
                    let at = Instant::now();
                    let events = parse_inotify_events(&buf[..n as usize]);
                    if events.iter().any(|e| e.mask & nix::libc::IN_IGNORED != 0) {
                        return;
                    }
                    if events.iter().any(|e| e.name == name.as_bytes()) && tx.send(at).is_err() {
                        return;
                    }
                }
            })?;
        // The watch is removed on drop, which wakes the thread with
        // IN_IGNORED.
        Ok(Self {
            fd,
            wd,
            opened,
            thread: Some(thread),
        })
    }

    /// Forgets opens seen so far.
    pub fn clear(&self) {
        while self.opened.try_recv().is_ok() {}
    }

    /// The first open seen (since the last [`OpenWatcher::clear`]), waiting
    /// up to `timeout`.
    pub fn next_open(&self, timeout: Duration) -> Option<Instant> {
        self.opened.recv_timeout(timeout).ok()
    }
}

impl Drop for OpenWatcher {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // Removing the watch queues IN_IGNORED, which ends the reading thread.
        // SAFETY: a valid descriptor and watch.
        unsafe { nix::libc::inotify_rm_watch(self.fd.as_raw_fd(), self.wd) };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One `struct inotify_event`.
#[derive(Debug, PartialEq, Eq)]
struct InotifyEvent<'a> {
    mask: u32,
    /// Without the NUL padding.
    name: &'a [u8],
}

/// The events in a buffer read from an inotify descriptor: each a 16-byte
/// header (wd, mask, cookie, len) and `len` bytes of NUL-padded name.
fn parse_inotify_events(mut buf: &[u8]) -> Vec<InotifyEvent<'_>> {
    let mut events = Vec::new();
    while buf.len() >= 16 {
        let word = |i: usize| u32::from_ne_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        let mask = word(4);
        let len = word(12) as usize;
        let Some(raw) = buf.get(16..16 + len) else {
            break;
        };
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        events.push(InotifyEvent {
            mask,
            name: &raw[..end],
        });
        buf = &buf[16 + len..];
    }
    events
}

/// `a / b`, or NaN when either is missing or `b` is zero (shown as "-").
pub fn ratio(a: Option<f64>, b: Option<f64>) -> f64 {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => a / b,
        _ => f64::NAN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_busy_idle_and_steal() {
        let stat = "cpu  100 5 50 1000 20 3 7 11 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n";
        let cpu = parse_proc_stat(stat, 100).unwrap();
        assert_eq!(cpu.busy, Duration::from_millis(1650));
        assert_eq!(cpu.idle, Duration::from_millis(10200));
        assert_eq!(cpu.steal, Duration::from_millis(110));
        assert_eq!(cpu.irq, Duration::from_millis(100));
        assert!(parse_proc_stat("intr 1 2\n", 100).is_none());
    }

    #[test]
    fn inotify_events_are_split_and_names_unpadded() {
        let mut buf = Vec::new();
        for (mask, name) in [(0x20u32, &b"pods.json\0\0\0\0\0\0\0"[..]), (0x20, &b""[..])] {
            buf.extend_from_slice(&1i32.to_ne_bytes());
            buf.extend_from_slice(&mask.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
            buf.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            buf.extend_from_slice(name);
        }
        let events = parse_inotify_events(&buf);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].name, b"pods.json");
        assert_eq!(events[0].mask, 0x20);
        assert_eq!(events[1].name, b"");
        // A truncated event is not read.
        assert_eq!(parse_inotify_events(&buf[..20]).len(), 0);
    }

    #[test]
    fn thread_groups_split_this_process() {
        let pid = std::process::id();
        let groups = thread_groups_on_cpu(pid, &["no-such-thread"]).unwrap();
        assert_eq!(groups.groups, vec![Duration::ZERO]);
        assert!(groups.other > Duration::ZERO);
        let later = thread_groups_on_cpu(pid, &["no-such-thread"]).unwrap();
        assert!(later.since(&groups).other <= later.other);
    }

    #[test]
    fn ratios_of_missing_values_are_nan() {
        assert_eq!(ratio(Some(3.0), Some(2.0)), 1.5);
        assert!(ratio(None, Some(2.0)).is_nan());
        assert!(ratio(Some(1.0), Some(0.0)).is_nan());
    }
}
