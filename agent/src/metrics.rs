//! The agent's latency histograms and the process metrics.
//!
//! The histograms are process-wide (one agent per process; tests in one
//! process share them, which only adds samples): the CNI endpoint, the
//! controller, the ZDS server and the kube source record into them without
//! a handle threaded through each. [`crate::observe::registry`] registers
//! them with the counters each component keeps.

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::ConstCounter,
        family::Family,
        gauge::ConstGauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// A series' labels: fixed names, values from a fixed set.
pub type Labels<const N: usize> = [(&'static str, &'static str); N];

type HistogramFamily<const N: usize> = Family<Labels<N>, Histogram, fn() -> Histogram>;

/// The latency histograms, with buckets chosen for what each measures.
pub struct Histograms {
    /// `{phase}`: decide (watch caches, or an API server lookup: tens of
    /// µs to seconds), enrol, ztunnel (its ack: ms, up to the ADD budget),
    /// answer. 0.25 ms to 16 s.
    pub cni_add: HistogramFamily<1>,
    /// `{mode, step}`: one enrolment step (a map write, a netlink request,
    /// an iptables-restore): 20 µs to 0.5 s.
    pub enrol: HistogramFamily<2>,
    /// `{message}`: a ZDS request until ztunnel's answer (Add: starting the
    /// pod's proxy; the ack timeout is 5 s): 0.5 ms to 8 s.
    pub zds_ack: HistogramFamily<1>,
    /// `{scope}`: one state check, records alone or inside every pod's
    /// namespace (grows with the pods): 0.5 ms to 16 s.
    pub state_check: HistogramFamily<1>,
    /// A pod's first watch event until its redirection is in place (the
    /// sandbox's creation and the pod's addresses included): 5 ms to 80 s.
    pub kube_event_to_programmed: Histogram,
    /// Pods' first watch events not yet programmed, by UID.
    seen: Mutex<HashMap<String, Instant>>,
}

fn cni_add_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 17))
}
fn enrol_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_02, 2.5, 12))
}
fn zds_ack_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_5, 2.0, 15))
}
fn state_check_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_5, 2.0, 16))
}

static HISTOGRAMS: LazyLock<Histograms> = LazyLock::new(|| Histograms {
    cni_add: Family::new_with_constructor(cni_add_histogram),
    enrol: Family::new_with_constructor(enrol_histogram),
    zds_ack: Family::new_with_constructor(zds_ack_histogram),
    state_check: Family::new_with_constructor(state_check_histogram),
    kube_event_to_programmed: Histogram::new(exponential_buckets(0.005, 2.0, 15)),
    seen: Mutex::new(HashMap::new()),
});

/// Pods seen but never programmed (not ambient, deleted first) are
/// forgotten after this long.
const SEEN_FOR: Duration = Duration::from_secs(600);

pub fn histograms() -> &'static Histograms {
    &HISTOGRAMS
}

impl Histograms {
    pub fn observe_cni_add(&self, phase: &'static str, took: Duration) {
        self.cni_add
            .get_or_create(&[("phase", phase)])
            .observe(took.as_secs_f64());
    }

    pub fn observe_enrol(&self, mode: &'static str, step: &'static str, took: Duration) {
        self.enrol
            .get_or_create(&[("mode", mode), ("step", step)])
            .observe(took.as_secs_f64());
    }

    pub fn observe_zds_ack(&self, message: &'static str, took: Duration) {
        self.zds_ack
            .get_or_create(&[("message", message)])
            .observe(took.as_secs_f64());
    }

    pub fn observe_state_check(&self, scope: &'static str, took: Duration) {
        self.state_check
            .get_or_create(&[("scope", scope)])
            .observe(took.as_secs_f64());
    }

    /// A watch event about pod `uid`: the first since it was last
    /// programmed starts its clock.
    pub fn kube_pod_event(&self, uid: &str) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains_key(uid) {
            return;
        }
        let now = Instant::now();
        if seen.len() >= 4096 {
            seen.retain(|_, at| now.duration_since(*at) < SEEN_FOR);
        }
        seen.insert(uid.to_owned(), now);
    }

    /// Pod `uid` was handled by the controller: if `programmed` (newly
    /// enrolled), the time since its first watch event is observed. Either
    /// way its clock stops (a later event of a pod already in place, such
    /// as a status update, needs no programming).
    pub fn pod_handled(&self, uid: &str, programmed: bool) {
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(uid);
        if let (Some(at), true) = (seen, programmed) {
            self.kube_event_to_programmed
                .observe(at.elapsed().as_secs_f64());
        }
    }

    /// Registers every histogram in `registry`. The series whose labels
    /// are known up front exist from the start (an empty family is not
    /// exported at all, and dashboards and alerts would not find it).
    pub fn register(&self, registry: &mut Registry) {
        for phase in crate::cni::AddPhase::ALL {
            let _ = self.cni_add.get_or_create(&[("phase", phase.name())]);
        }
        for message in ["add", "del", "keep", "snapshot_sent"] {
            let _ = self.zds_ack.get_or_create(&[("message", message)]);
        }
        for scope in ["records", "full"] {
            let _ = self.state_check.get_or_create(&[("scope", scope)]);
        }
        registry.register(
            "cni_add_duration_seconds",
            "Time the agent spent answering CNI ADDs, by phase: decide (ambient or not), \
             enrol (waiting for the controller and its enrolment), ztunnel (waiting for \
             ztunnel's ack of the pod), answer (request read to answer ready)",
            self.cni_add.clone(),
        );
        registry.register(
            "enrol_duration_seconds",
            "Time each enrolment step took, by redirection mode and step",
            self.enrol.clone(),
        );
        registry.register(
            "zds_ack_duration_seconds",
            "Time from a ZDS request to ztunnel's answer (ack or NACK), by message",
            self.zds_ack.clone(),
        );
        registry.register(
            "state_check_duration_seconds",
            "Time one state check took, by scope (records: maps and pins; full: also \
             inside every enrolled pod's namespace)",
            self.state_check.clone(),
        );
        registry.register(
            "kube_event_to_programmed_seconds",
            "Time from a pod's first watch event to its redirection in place (its sandbox's \
             creation and addresses included)",
            self.kube_event_to_programmed.clone(),
        );
    }
}

/// `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_open_fds` and
/// `process_start_time_seconds` from /proc/self, as Prometheus' client
/// libraries name them.
#[derive(Debug)]
pub struct ProcessCollector;

/// What /proc/self says, read at scrape time.
#[derive(Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    pub start_time_seconds: f64,
}

impl ProcessStats {
    pub fn read() -> std::io::Result<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat")?;
        // Fields after the command name, which is in parentheses and may
        // hold spaces: state is field 3, utime 14, stime 15, starttime 22,
        // vsize 23, rss 24.
        let after = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest)
            .ok_or_else(|| std::io::Error::other("unreadable /proc/self/stat"))?;
        let fields: Vec<&str> = after.split_whitespace().collect();
        let field =
            |n: usize| -> u64 { fields.get(n - 3).and_then(|f| f.parse().ok()).unwrap_or(0) };
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        // SAFETY: as above.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
        let boot = std::fs::read_to_string("/proc/stat")?
            .lines()
            .find_map(|line| line.strip_prefix("btime ")?.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let open_fds = std::fs::read_dir("/proc/self/fd")?.count() as u64;
        Ok(Self {
            cpu_seconds: (field(14) + field(15)) as f64 / ticks,
            resident_bytes: field(24) * page,
            virtual_bytes: field(23),
            open_fds,
            start_time_seconds: boot as f64 + field(22) as f64 / ticks,
        })
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(stats) = ProcessStats::read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(stats.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            cpu.metric_type(),
        )?)?;
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                stats.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                stats.virtual_bytes as f64,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors.",
                stats.open_fds as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                stats.start_time_seconds,
            ),
        ] {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_stats_are_this_process() {
        let before = ProcessStats::read().unwrap();
        // Some CPU time and memory of our own.
        let block = vec![1u8; 8 << 20];
        let mut x = 0u64;
        for i in 0..50_000_000u64 {
            x = x.wrapping_add(i ^ u64::from(block[(i as usize) % block.len()]));
        }
        std::hint::black_box(x);
        let after = ProcessStats::read().unwrap();
        assert!(
            after.cpu_seconds > before.cpu_seconds,
            "{before:?} {after:?}"
        );
        assert!(after.resident_bytes >= 8 << 20, "{after:?}");
        assert!(after.open_fds >= 3, "{after:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            after.start_time_seconds <= now + 1.0
                && after.start_time_seconds > now - 86_400.0 * 365.0,
            "{after:?}"
        );
    }

    #[test]
    fn a_pod_is_timed_from_its_first_event_until_programmed_once() {
        let h = histograms();
        let count = || {
            let mut body = String::new();
            let mut registry = Registry::default();
            registry.register("t", "t", h.kube_event_to_programmed.clone());
            prometheus_client::encoding::text::encode(&mut body, &registry).unwrap();
            body.lines()
                .find_map(|l| l.strip_prefix("t_count ")?.parse::<u64>().ok())
                .unwrap()
        };
        let before = count();
        h.kube_pod_event("uid-timed");
        h.kube_pod_event("uid-timed");
        h.pod_handled("uid-timed", true);
        h.pod_handled("uid-timed", true);
        h.kube_pod_event("uid-kept");
        h.pod_handled("uid-kept", false);
        h.pod_handled("uid-kept", true);
        // Other tests of this binary may observe too; ours added exactly one.
        assert!(count() > before);
    }
}
