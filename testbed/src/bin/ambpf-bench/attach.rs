//! The `attach` suite of `ambpf-bench` (a module of that binary; not part of the
//! library).
//!
//! What the kernel charges to hook the inbound steering program onto one pod,
//! for each way of attaching it, measured side by side in the same run:
//!
//! - `tcx-link`: a TCX link, `BPF_LINK_CREATE` with the pod interface's index
//!   and `BPF_TCX_INGRESS` (what the agent did before this suite's results
//!   moved it to `clsact`; the ratios' baseline); replaced with
//!   `BPF_LINK_UPDATE`, detached by closing the link;
//! - `clsact`: a `clsact` qdisc and a direct-action `cls_bpf` filter over
//!   rtnetlink (`RTM_NEWQDISC`, then `RTM_NEWTFILTER` kind `bpf` with
//!   `TCA_BPF_FD`, `TCA_BPF_NAME`, `TCA_BPF_FLAGS` = direct action, priority
//!   1, handle 1), the way Cilium attached before TCX and the way the agent
//!   steers pods now (`agent/src/redirect/steering.rs`, handle `0xa3bf`);
//!   replaced with `RTM_NEWTFILTER` on the same priority and handle without
//!   `NLM_F_EXCL`;
//!   detached with `RTM_DELTFILTER` then `RTM_DELQDISC`;
//! - `sk-lookup`: an `sk_lookup` program on the pod's network namespace,
//!   `BPF_LINK_CREATE` with the netns fd and `BPF_SK_LOOKUP`; replaced with
//!   `BPF_LINK_UPDATE`, detached by closing the link;
//! - `tcx-prog`: TCX without a link, `BPF_PROG_ATTACH` / `BPF_PROG_DETACH`
//!   with the interface's index (replaced with `BPF_F_REPLACE`).
//!
//! What the programs do does not change what attaching them costs, so the
//! suite loads minimal ones itself with `bpf(2)`: a `SCHED_CLS` program
//! returning `TC_ACT_UNSPEC` and an `SK_LOOKUP` program returning `SK_PASS`,
//! two of each so that a replacement really swaps programs.
//!
//! For each pod count N, each run and each candidate, N fresh pod network
//! namespaces are created, each with a veth pair whose pod end is `eth0`
//! (the other ends in a fresh node namespace), before any clock starts; they
//! serve one candidate once and are then deleted. The candidates' order
//! rotates from run to run. One worker thread then enters each pod's
//! namespace in turn (netlink sockets and interface indexes belong to the
//! namespace of the calling thread) and, pod by pod, attaches; then replaces
//! every pod's program; then detaches. Each operation is timed on its own
//! (wall clock, and the worker thread's CPU time from
//! `CLOCK_THREAD_CPUTIME_ID`), with its steps apart (for `clsact`: socket,
//! qdisc, filter); entering the namespace is timed apart and is not part of
//! an operation. Each phase also records its whole wall time, this
//! process's CPU time (`getrusage`, user and system) and the machine's busy
//! time (`/proc/stat`, all CPUs: kernel work done off this thread, such as
//! RCU callbacks or IPIs, shows there). Wall time above the thread's CPU
//! time is time the operation waited, e.g. for an RCU grace period.
//!
//! Before a batch is timed the suite waits for the previous batch's
//! namespaces to be gone (the kernel dismantles a namespace asynchronously,
//! under the RTNL lock that every candidate but `sk-lookup` takes) and then
//! lets the new one settle.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::atomic::{AtomicBool, Ordering},
};

use ambpf_testbed::{
    Addrs, Link, NetnsGuard,
    bench::{
        CpuTime,
        sys::{self, MachineCpu},
    },
};
use nix::{
    libc,
    sched::{CloneFlags, setns},
};

use super::*;

/// Pod counts above this would run out of the suite's address plan.
const MAX_PODS: usize = 5000;
/// Waiting for a previous batch's namespaces to be dismantled.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Args)]
pub(super) struct AttachArgs {
    #[command(flatten)]
    common: Common,
    /// Pod counts, comma-separated (each pod a fresh network namespace with a
    /// veth pair, per run and per candidate).
    #[arg(long, value_delimiter = ',', default_value = "10,100")]
    pods: Vec<usize>,
    /// Runs per pod count; each run measures every candidate once.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The candidates, comma-separated (ratios are against `tcx-link`).
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "tcx-link,clsact,sk-lookup,tcx-prog"
    )]
    candidates: Vec<Candidate>,
    /// Milliseconds to wait between creating a batch of namespaces and
    /// timing it.
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// Keep a pod of its own attached with tcx-link, clsact and sk-lookup for
    /// the whole suite, so that no batch's first attach is the one that turns
    /// on the kernel's static keys for TC ingress, TCX and sk_lookup (as on a
    /// node with pods already enrolled).
    #[arg(long)]
    hold_static_keys: bool,
}

/// A way to attach the inbound steering program to a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Candidate {
    /// `BPF_LINK_CREATE`, `BPF_TCX_INGRESS` on the interface.
    TcxLink,
    /// `clsact` qdisc + direct-action `cls_bpf` filter over rtnetlink.
    Clsact,
    /// `BPF_LINK_CREATE`, `BPF_SK_LOOKUP` on the network namespace.
    SkLookup,
    /// `BPF_PROG_ATTACH`, `BPF_TCX_INGRESS` on the interface (no link).
    TcxProg,
}

impl Candidate {
    fn name(self) -> &'static str {
        match self {
            Self::TcxLink => "tcx-link",
            Self::Clsact => "clsact",
            Self::SkLookup => "sk-lookup",
            Self::TcxProg => "tcx-prog",
        }
    }
}

/// The programs, loaded once; each attach uses the first of a pair, each
/// replacement the second.
struct Programs {
    tc: [OwnedFd; 2],
    sk_lookup: [OwnedFd; 2],
}

impl Programs {
    fn load() -> io::Result<Self> {
        Ok(Self {
            tc: [
                bpf::load(bpf::Program::SchedCls, "ambpf_attach_a")?,
                bpf::load(bpf::Program::SchedCls, "ambpf_attach_b")?,
            ],
            sk_lookup: [
                bpf::load(bpf::Program::SkLookup, "ambpf_attach_a")?,
                bpf::load(bpf::Program::SkLookup, "ambpf_attach_b")?,
            ],
        })
    }
}

/// Where one pod's program goes; the calling thread is in `netns`.
struct Target<'a> {
    netns: BorrowedFd<'a>,
    /// `eth0`'s index in `netns`.
    ifindex: u32,
}

/// What one pod keeps attached between the phases.
enum Attachment {
    /// A TCX or netns link: closing it detaches.
    Link(OwnedFd),
    /// Attached without a link (`tcx-prog`), or a tc filter (`clsact`).
    Unowned,
}

/// Times the steps of one operation.
struct Clock {
    started: Instant,
    last: Instant,
    cpu_started: Duration,
    steps: Vec<(&'static str, Duration)>,
}

impl Clock {
    fn start() -> Self {
        let cpu_started = thread_cpu();
        let now = Instant::now();
        Self {
            started: now,
            last: now,
            cpu_started,
            steps: Vec::with_capacity(3),
        }
    }

    /// Ends step `name` (it began where the previous one ended).
    fn step(&mut self, name: &'static str) {
        let now = Instant::now();
        self.steps.push((name, now - self.last));
        self.last = now;
    }

    /// Wall time and the thread's CPU time from the start to the last step.
    fn finish(self) -> (Duration, Duration, Vec<(&'static str, Duration)>) {
        let cpu = thread_cpu().saturating_sub(self.cpu_started);
        (self.last - self.started, cpu, self.steps)
    }
}

impl Candidate {
    fn attach(
        self,
        programs: &Programs,
        target: &Target,
        clock: &mut Clock,
    ) -> io::Result<Attachment> {
        Ok(match self {
            Self::TcxLink => {
                let link =
                    bpf::link_create(programs.tc[0].as_fd(), target.ifindex, bpf::TCX_INGRESS)?;
                clock.step("link_create");
                Attachment::Link(link)
            }
            Self::SkLookup => {
                let link = bpf::link_create(
                    programs.sk_lookup[0].as_fd(),
                    target.netns.as_raw_fd() as u32,
                    bpf::SK_LOOKUP,
                )?;
                clock.step("link_create");
                Attachment::Link(link)
            }
            Self::TcxProg => {
                bpf::prog_attach(target.ifindex, programs.tc[0].as_fd(), None)?;
                clock.step("prog_attach");
                Attachment::Unowned
            }
            Self::Clsact => {
                let mut rtnl = tc::Rtnl::open()?;
                clock.step("socket");
                rtnl.create_clsact(target.ifindex)?;
                clock.step("qdisc");
                rtnl.set_filter(
                    target.ifindex,
                    programs.tc[0].as_fd(),
                    "ambpf_attach_a",
                    true,
                )?;
                clock.step("filter");
                Attachment::Unowned
            }
        })
    }

    /// Swaps the attached program for the second of its pair.
    fn replace(
        self,
        programs: &Programs,
        target: &Target,
        attached: &Attachment,
        clock: &mut Clock,
    ) -> io::Result<()> {
        match (self, attached) {
            (Self::TcxLink, Attachment::Link(link)) => {
                bpf::link_update(link.as_fd(), programs.tc[1].as_fd())?;
                clock.step("link_update");
            }
            (Self::SkLookup, Attachment::Link(link)) => {
                bpf::link_update(link.as_fd(), programs.sk_lookup[1].as_fd())?;
                clock.step("link_update");
            }
            (Self::TcxProg, _) => {
                bpf::prog_attach(
                    target.ifindex,
                    programs.tc[1].as_fd(),
                    Some(programs.tc[0].as_fd()),
                )?;
                clock.step("prog_attach_replace");
            }
            (Self::Clsact, _) => {
                let mut rtnl = tc::Rtnl::open()?;
                clock.step("socket");
                rtnl.set_filter(
                    target.ifindex,
                    programs.tc[1].as_fd(),
                    "ambpf_attach_b",
                    false,
                )?;
                clock.step("filter");
            }
            (_, Attachment::Unowned) => {
                return Err(io::Error::other(format!("{} keeps no link", self.name())));
            }
        }
        Ok(())
    }

    /// Detaches what [`Candidate::attach`] attached (and replaced).
    fn detach(
        self,
        programs: &Programs,
        target: &Target,
        attached: Attachment,
        clock: &mut Clock,
    ) -> io::Result<()> {
        match (self, attached) {
            (Self::TcxLink | Self::SkLookup, Attachment::Link(link)) => {
                // The last reference: the kernel detaches before close returns.
                drop(link);
                clock.step("close");
            }
            (Self::TcxProg, _) => {
                bpf::prog_detach(target.ifindex, programs.tc[1].as_fd())?;
                clock.step("prog_detach");
            }
            (Self::Clsact, _) => {
                let mut rtnl = tc::Rtnl::open()?;
                clock.step("socket");
                rtnl.delete_filter(target.ifindex)?;
                clock.step("filter");
                rtnl.delete_clsact(target.ifindex)?;
                clock.step("qdisc");
            }
            (_, Attachment::Unowned) => {
                return Err(io::Error::other(format!("{} keeps no link", self.name())));
            }
        }
        Ok(())
    }
}

/// The CPU time of the calling thread, to the nanosecond.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec passed and nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// This process's CPU time (all threads) from `getrusage`, to the microsecond.
fn process_cpu() -> CpuTime {
    // SAFETY: an all-zero rusage is a valid value; getrusage writes it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is valid for writes.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    CpuTime {
        user: time(usage.ru_utime),
        system: time(usage.ru_stime),
    }
}

// ---------------------------------------------------------------------------
// bpf(2)

mod bpf;

// ---------------------------------------------------------------------------
// tc over rtnetlink

mod tc;

// ---------------------------------------------------------------------------
// Pods

/// A batch of fresh pods for one candidate in one run.
struct Batch {
    // Field order is drop order: the pods go before their node.
    pods: Vec<NetnsGuard>,
    node: NetnsGuard,
    created: Duration,
}

/// Pod `i`'s end (`eth0`, `.2` / `::2`) and its node end (`.1` / `::1`):
/// a /24 and a /64 of their own.
fn addresses(i: usize) -> (Addrs, Addrs) {
    let (hi, lo) = ((100 + i / 256) as u8, (i % 256) as u8);
    let v6 = |host| std::net::Ipv6Addr::new(0xfd00, 0xa77, 0, i as u16, 0, 0, 0, host);
    (
        Addrs {
            v4: std::net::Ipv4Addr::new(10, hi, lo, 2),
            v6: v6(2),
        },
        Addrs {
            v4: std::net::Ipv4Addr::new(10, hi, lo, 1),
            v6: v6(1),
        },
    )
}

impl Batch {
    /// N pods and their node, made by a few threads at once (most of the
    /// time goes to running `ip`).
    fn create(n: usize, stop: &AtomicBool) -> Result<Self> {
        let started = Instant::now();
        let node = NetnsGuard::create("atnode").context("creating the node namespace")?;
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get().min(4));
        let made = std::sync::atomic::AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let create = |i: usize| -> Result<NetnsGuard> {
            ensure!(!stop.load(Ordering::Relaxed), "stopped");
            let pod = NetnsGuard::create("atpod").context("creating a pod namespace")?;
            let (pod_addrs, node_addrs) = addresses(i);
            Link::veth(&pod, "eth0", pod_addrs, &node, &format!("p{i}"), node_addrs)
                .with_context(|| format!("creating pod {i}'s veth"))?;
            let made = made.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= 500 && made.is_multiple_of(250) {
                eprintln!(
                    "attach:   {made} of {n} pod namespaces in {:.0} s",
                    started.elapsed().as_secs_f64()
                );
            }
            Ok(pod)
        };
        // Thread t makes pods t, t + threads, ...; any failure stops them all.
        let mut parts: Vec<Vec<(usize, NetnsGuard)>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let (create, failed) = (&create, &failed);
                    scope.spawn(move || -> Result<Vec<(usize, NetnsGuard)>> {
                        let mut mine = Vec::new();
                        for i in (t..n).step_by(threads) {
                            ensure!(!failed.load(Ordering::Relaxed), "another thread failed");
                            match create(i) {
                                Ok(pod) => mine.push((i, pod)),
                                Err(e) => {
                                    failed.store(true, Ordering::Relaxed);
                                    return Err(e);
                                }
                            }
                        }
                        Ok(mine)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect::<Result<_>>()
        })?;
        let mut pods: Vec<(usize, NetnsGuard)> = parts.drain(..).flatten().collect();
        pods.sort_by_key(|(i, _)| *i);
        Ok(Self {
            pods: pods.into_iter().map(|(_, pod)| pod).collect(),
            node,
            created: started.elapsed(),
        })
    }

    /// Deletes the pods, waits until the kernel has dismantled them (their
    /// veths' node ends gone), then deletes the node.
    fn teardown(self) -> Result<Duration> {
        let started = Instant::now();
        let Self { pods, node, .. } = self;
        drop(pods);
        loop {
            let left = node
                .run(|| nix::net::if_::if_nameindex().map(|l| l.iter().count()))?
                .context("listing the node's interfaces")?;
            if left <= 1 {
                break;
            }
            if started.elapsed() > TEARDOWN_TIMEOUT {
                eprintln!(
                    "attach: {} veths still in the node namespace after {TEARDOWN_TIMEOUT:?}; going on",
                    left - 1
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(node);
        Ok(started.elapsed())
    }
}

// ---------------------------------------------------------------------------
// Measuring

/// One phase (attach, replace or detach) over every pod of a batch.
#[derive(Clone, Debug, Default, Serialize)]
struct Phase {
    /// Wall time of each operation, ms, in pod order.
    op_ms: Vec<f64>,
    /// The worker thread's CPU time of each operation, ms.
    op_cpu_ms: Vec<f64>,
    /// Each step's wall time, ms, per pod.
    steps_ms: Vec<(String, Vec<f64>)>,
    /// Entering each pod's namespace (setns), ms; not part of an operation.
    enter_ms: Vec<f64>,
    /// The whole loop over the pods, entering their namespaces included.
    total_ms: f64,
    /// This process's CPU time over the loop (getrusage).
    process_user_ms: f64,
    process_system_ms: f64,
    /// Every CPU's busy time over the loop (/proc/stat, 10 ms ticks): work
    /// the kernel does elsewhere shows here, and so does other load.
    machine_busy_ms: f64,
}

impl Phase {
    fn record(&mut self, wall: Duration, cpu: Duration, steps: Vec<(&'static str, Duration)>) {
        self.op_ms.push(ms(wall));
        self.op_cpu_ms.push(ms(cpu));
        for (name, took) in steps {
            match self.steps_ms.iter_mut().find(|(n, _)| n == name) {
                Some((_, v)) => v.push(ms(took)),
                None => self.steps_ms.push((name.to_owned(), vec![ms(took)])),
            }
        }
    }
}

#[derive(Clone, Debug, Serialize)]
struct BatchSample {
    pods: usize,
    run: usize,
    /// Position of the candidate in this run's order (0 = first).
    position: usize,
    candidate: Candidate,
    /// Creating the namespaces and veths, s (not timed as attach).
    create_s: f64,
    /// Waiting for the previous batch to be dismantled, s.
    previous_teardown_s: f64,
    attach: Phase,
    replace: Phase,
    detach: Phase,
}

/// Runs `op` in every pod's namespace, on this thread (which ends up in the
/// last pod's namespace: call it on a thread of its own).
fn phase(
    netns: &[File],
    stop: &AtomicBool,
    mut op: impl FnMut(usize, &mut Clock) -> io::Result<()>,
) -> Result<Phase> {
    let mut out = Phase::default();
    let machine = MachineCpu::read()?;
    let process = process_cpu();
    let started = Instant::now();
    for (i, ns) in netns.iter().enumerate() {
        ensure!(!stop.load(Ordering::Relaxed), "stopped");
        let entering = Instant::now();
        setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).context("entering a pod namespace")?;
        out.enter_ms.push(ms(entering.elapsed()));
        let mut clock = Clock::start();
        op(i, &mut clock).with_context(|| format!("pod {i}"))?;
        let (wall, cpu, steps) = clock.finish();
        out.record(wall, cpu, steps);
    }
    out.total_ms = ms(started.elapsed());
    let process = process_cpu().since(&process);
    out.process_user_ms = ms(process.user);
    out.process_system_ms = ms(process.system);
    out.machine_busy_ms = ms(MachineCpu::read()?.since(&machine).busy);
    Ok(out)
}

/// Attaches, replaces and detaches `candidate` on every pod of `batch`.
fn measure(
    candidate: Candidate,
    programs: &Programs,
    batch: &Batch,
    stop: &AtomicBool,
) -> Result<[Phase; 3]> {
    // Opened before any clock starts; sk_lookup's target, and the way in.
    let netns: Vec<File> = batch
        .pods
        .iter()
        .map(|p| File::open(p.path()))
        .collect::<io::Result<_>>()?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<[Phase; 3]> {
                // This thread moves from namespace to namespace and ends there.
                let mut ifindex = Vec::with_capacity(netns.len());
                for ns in &netns {
                    setns(ns.as_fd(), CloneFlags::CLONE_NEWNET)?;
                    ifindex.push(nix::net::if_::if_nametoindex("eth0").context("eth0")?);
                }
                let target = |i: usize| Target {
                    netns: netns[i].as_fd(),
                    ifindex: ifindex[i],
                };
                let mut attached: Vec<Option<Attachment>> = Vec::with_capacity(netns.len());
                let attach = phase(&netns, stop, |i, clock| {
                    attached.push(Some(candidate.attach(programs, &target(i), clock)?));
                    Ok(())
                })
                .context("attaching")?;
                let replace = phase(&netns, stop, |i, clock| {
                    let link = attached[i].as_ref().expect("attached");
                    candidate.replace(programs, &target(i), link, clock)
                })
                .context("replacing")?;
                let detach = phase(&netns, stop, |i, clock| {
                    let link = attached[i].take().expect("attached");
                    candidate.detach(programs, &target(i), link, clock)
                })
                .context("detaching")?;
                Ok([attach, replace, detach])
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// A pod kept attached with every kind of hook (see
/// `--hold-static-keys`).
struct KeyHolder {
    // Field order is drop order: detached before the namespace goes.
    _attached: Vec<Attachment>,
    _batch: Batch,
}

impl KeyHolder {
    fn create(programs: &Programs, stop: &AtomicBool) -> Result<Self> {
        let batch = Batch::create(1, stop)?;
        let pod = &batch.pods[0];
        let netns = File::open(pod.path())?;
        let attached = pod.run(|| -> io::Result<Vec<Attachment>> {
            let target = Target {
                netns: netns.as_fd(),
                ifindex: nix::net::if_::if_nametoindex("eth0")?,
            };
            [Candidate::TcxLink, Candidate::Clsact, Candidate::SkLookup]
                .into_iter()
                .map(|c| c.attach(programs, &target, &mut Clock::start()))
                .collect()
        })??;
        Ok(Self {
            _attached: attached,
            _batch: batch,
        })
    }
}

/// Run `run`'s order: the candidates rotated by one place per run.
fn order(candidates: &[Candidate], run: usize) -> Vec<Candidate> {
    let mut order = candidates.to_vec();
    order.rotate_left(run % candidates.len().max(1));
    order
}

// ---------------------------------------------------------------------------
// Summaries

#[derive(Serialize)]
struct Config {
    pods: Vec<usize>,
    runs: usize,
    candidates: Vec<Candidate>,
    settle_ms: u64,
    hold_static_keys: bool,
}

mod report;
use report::{print_tables, summarize};

// ---------------------------------------------------------------------------
// The suite

pub(super) async fn run(args: AttachArgs) -> Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "run as root: the suite creates network namespaces and loads BPF programs"
    );
    ensure!(args.runs > 0, "--runs must be at least 1");
    ensure!(
        !args.candidates.is_empty(),
        "--candidates: name at least one"
    );
    ensure!(
        !args.pods.is_empty() && args.pods.iter().all(|&n| (1..=MAX_PODS).contains(&n)),
        "--pods: counts between 1 and {MAX_PODS}"
    );
    let largest = args.pods.iter().copied().max().unwrap_or(0) as u64;
    let limit = bench::raise_fd_limit().context("raising the open-file limit")?;
    ensure!(
        limit >= 2 * largest + 64,
        "the open-file limit is {limit}; {largest} pods need a link and a netns fd each"
    );
    // Dropped when the suite's future is (Ctrl-C): the blocking work stops
    // at the next pod and its guards remove what it made.
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let _stop = StopOnDrop(stop.clone());
    tokio::task::spawn_blocking(move || run_blocking(args, &stop))
        .await
        .context("the suite's thread")?
}

fn run_blocking(args: AttachArgs, stop: &AtomicBool) -> Result<()> {
    let suite = SuiteRun::start("attach");
    eprintln!(
        "attach: pods {:?}, {} runs of {}",
        args.pods,
        args.runs,
        args.candidates
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let programs = Programs::load().context("loading the programs")?;
    let holder = match args.hold_static_keys {
        true => Some(KeyHolder::create(&programs, stop).context("attaching the key holder")?),
        false => None,
    };
    let mut samples = Vec::new();
    let mut previous: Option<Batch> = None;
    for &n in &args.pods {
        for run in 0..args.runs {
            for (position, candidate) in order(&args.candidates, run).into_iter().enumerate() {
                let previous_teardown = match previous.take() {
                    Some(batch) => batch.teardown()?,
                    None => Duration::ZERO,
                };
                let batch = Batch::create(n, stop)?;
                std::thread::sleep(Duration::from_millis(args.settle_ms));
                let [attach, replace, detach] = measure(candidate, &programs, &batch, stop)
                    .with_context(|| format!("{n} pods, run {}, {}", run + 1, candidate.name()))?;
                let p50 = |p: &Phase| Stats::of(&p.op_ms).map_or(f64::NAN, |s| s.median);
                eprintln!(
                    "attach: {n:>4} pods run {} {:<9} attach p50 {:>7.3} ms (total {:>8.1} ms), replace p50 {:>7.3} ms, detach p50 {:>7.3} ms (total {:>8.1} ms); created in {:.1} s",
                    run + 1,
                    candidate.name(),
                    p50(&attach),
                    attach.total_ms,
                    p50(&replace),
                    p50(&detach),
                    detach.total_ms,
                    batch.created.as_secs_f64(),
                );
                samples.push(BatchSample {
                    pods: n,
                    run,
                    position,
                    candidate,
                    create_s: batch.created.as_secs_f64(),
                    previous_teardown_s: previous_teardown.as_secs_f64(),
                    attach,
                    replace,
                    detach,
                });
                previous = Some(batch);
            }
        }
    }
    if let Some(batch) = previous.take() {
        batch.teardown()?;
    }
    drop(holder);
    let summaries = summarize(&samples, &args);
    print_tables(&summaries, &samples, &args);
    suite.write_report(
        args.common.out.as_deref(),
        Config {
            pods: args.pods.clone(),
            runs: args.runs,
            candidates: args.candidates.clone(),
            settle_ms: args.settle_ms,
            hold_static_keys: args.hold_static_keys,
        },
        serde_json::json!({ "summary": summaries, "batches": samples }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use ambpf_testbed::PodAndNode;

    use super::*;

    #[test]
    fn candidates_rotate_from_run_to_run() {
        let all = [
            Candidate::TcxLink,
            Candidate::Clsact,
            Candidate::SkLookup,
            Candidate::TcxProg,
        ];
        assert_eq!(order(&all, 0), all);
        assert_eq!(order(&all, 1)[0], Candidate::Clsact);
        assert_eq!(order(&all, 4), all);
        let (pod, node) = addresses(4999);
        assert_eq!(pod.v4, std::net::Ipv4Addr::new(10, 119, 135, 2));
        assert_eq!(node.v4, std::net::Ipv4Addr::new(10, 119, 135, 1));
    }

    /// Privileged: each candidate really attaches, replaces and detaches, as
    /// the kernel reports it.
    #[test]
    fn every_candidate_attaches_replaces_and_detaches() {
        let programs = Programs::load().unwrap();
        let pn = PodAndNode::create().unwrap();
        let netns = File::open(pn.pod.path()).unwrap();
        pn.pod
            .run(|| {
                let target = Target {
                    netns: netns.as_fd(),
                    ifindex: nix::net::if_::if_nametoindex("eth0").unwrap(),
                };
                // What the kernel says is attached: programs on TCX ingress,
                // on the netns' sk_lookup hook, and bpf filters on ingress.
                let state = || {
                    let tcx = bpf::attached_count(target.ifindex, bpf::TCX_INGRESS).unwrap();
                    let sk = bpf::attached_count(target.netns.as_raw_fd() as u32, bpf::SK_LOOKUP)
                        .unwrap();
                    let filters = tc::Rtnl::open()
                        .and_then(|mut r| r.ingress_filters(target.ifindex))
                        .unwrap_or_default();
                    (tcx, sk, filters)
                };
                let none = (0, 0, Vec::<String>::new());
                assert_eq!(state(), none);
                for candidate in [
                    Candidate::TcxLink,
                    Candidate::Clsact,
                    Candidate::SkLookup,
                    Candidate::TcxProg,
                ] {
                    let name = candidate.name();
                    let attached = candidate
                        .attach(&programs, &target, &mut Clock::start())
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    let expected = |prog: &str| match candidate {
                        Candidate::TcxLink | Candidate::TcxProg => (1, 0, vec![]),
                        Candidate::SkLookup => (0, 1, vec![]),
                        Candidate::Clsact => (0, 0, vec![prog.to_owned()]),
                    };
                    assert_eq!(state(), expected("ambpf_attach_a"), "{name} attached");
                    candidate
                        .replace(&programs, &target, &attached, &mut Clock::start())
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert_eq!(state(), expected("ambpf_attach_b"), "{name} replaced");
                    let mut clock = Clock::start();
                    candidate
                        .detach(&programs, &target, attached, &mut clock)
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert_eq!(state(), none, "{name} detached");
                    let (_, _, steps) = clock.finish();
                    assert!(!steps.is_empty());
                }
            })
            .unwrap();
    }
}
