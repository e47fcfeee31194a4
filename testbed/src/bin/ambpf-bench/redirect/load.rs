//! The `redirect` suite's traffic: the echo server, the load generator and the
//! CPU each process spent on it.

use super::*;

/// CPU in use over one test, in cores (1.0: one CPU busy the whole time).
#[derive(Clone, Debug, Serialize)]
pub(super) struct CpuSample {
    pub(super) wall_s: f64,
    pub(super) loadgen: f64,
    pub(super) ztunnel: f64,
    pub(super) echo: f64,
    /// The agent process (not running in direct mode).
    pub(super) agent: Option<f64>,
    /// This process's other threads (the bench's own runtime).
    pub(super) bench_other: f64,
    /// The whole machine (`/proc/stat`: user, system, irq, softirq).
    pub(super) machine_busy: f64,
    /// The machine's irq + softirq (mostly the network stack's receive
    /// side); it may also be counted in the threads above.
    pub(super) machine_softirq: f64,
    pub(super) machine_steal: f64,
}

impl CpuSample {
    /// The busiest of the measured processes.
    pub(super) fn busiest(&self) -> (&'static str, f64) {
        let mut candidates = vec![
            ("loadgen", self.loadgen),
            ("ztunnel", self.ztunnel),
            ("echo", self.echo),
        ];
        if let Some(agent) = self.agent {
            candidates.push(("agent", agent));
        }
        candidates
            .into_iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or(("-", 0.0))
    }
}

pub(super) struct Probe {
    pub(super) at: Instant,
    pub(super) threads: ThreadGroups,
    pub(super) agent: Option<Duration>,
    pub(super) machine: MachineCpu,
}

impl Probe {
    pub(super) fn take(agent: Option<u32>) -> Result<Self> {
        Ok(Self {
            at: Instant::now(),
            threads: sys::thread_groups_on_cpu(std::process::id(), &GROUPS)?,
            agent: agent.map(bench::on_cpu).transpose()?,
            machine: MachineCpu::read()?,
        })
    }

    pub(super) fn since(&self, earlier: &Probe) -> CpuSample {
        let wall = self.at.duration_since(earlier.at).as_secs_f64().max(1e-9);
        let cores = |d: Duration| d.as_secs_f64() / wall;
        let threads = self.threads.since(&earlier.threads);
        let machine = self.machine.since(&earlier.machine);
        CpuSample {
            wall_s: wall,
            loadgen: cores(threads.groups[0]),
            ztunnel: cores(threads.groups[1]),
            echo: cores(threads.groups[2]),
            agent: match (self.agent, earlier.agent) {
                (Some(now), Some(then)) => Some(cores(now.saturating_sub(then))),
                _ => None,
            },
            bench_other: cores(threads.other),
            machine_busy: cores(machine.busy),
            machine_softirq: cores(machine.irq),
            machine_steal: cores(machine.steal),
        }
    }
}

// ---------------------------------------------------------------------------
// Echo server and load generator

/// The echo server: one task per connection echoing into one buffer.
pub(super) fn start_echo(remote: &NetnsGuard, addr: SocketAddr) -> Result<OwnRuntime> {
    let (runtime, failed) = named_runtime("echo-rt", 2, Some(&remote.path()))?;
    ensure!(!failed.load(Ordering::SeqCst), "echo threads: setns failed");
    let listener = remote.run(|| ambpf_testbed::storm::listen(addr))??;
    runtime.spawn(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
            eprintln!("redirect: echo server: cannot register the listener");
            return;
        };
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            let _ = conn.set_nodelay(true);
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if conn.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    Ok(runtime)
}

/// One new connection: connect, one request and its echo, close.
pub(super) async fn one_connection(target: SocketAddr) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(target).await?;
    stream.set_nodelay(true)?;
    let request = [0x5au8; MESSAGE];
    let mut reply = [0u8; MESSAGE];
    stream.write_all(&request).await?;
    stream.read_exact(&mut reply).await?;
    Ok(())
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct RateSample {
    pub(super) connections: u64,
    pub(super) errors: u64,
    pub(super) per_second: f64,
    /// Connections the ztunnel double recorded over the whole test (warm-up
    /// included): 0 in direct mode, all of them otherwise.
    pub(super) proxied: usize,
    pub(super) proxy_failures: usize,
    pub(super) cpu: CpuSample,
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct LatencySample {
    pub(super) requests: u64,
    pub(super) per_second: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) mean_us: f64,
    pub(super) max_us: f64,
    pub(super) proxied: usize,
    pub(super) cpu: CpuSample,
}

pub(super) const WARMUP: u8 = 0;
pub(super) const RECORD: u8 = 1;
pub(super) const STOP: u8 = 2;

pub(super) struct LoadGen {
    pub(super) runtime: OwnRuntime,
}

impl LoadGen {
    pub(super) fn new(pod: &NetnsGuard, threads: usize) -> Result<Self> {
        let (runtime, failed) = named_runtime("loadgen-rt", threads, Some(&pod.path()))?;
        ensure!(
            !failed.load(Ordering::SeqCst),
            "load generator threads: setns failed"
        );
        Ok(Self { runtime })
    }

    /// `count` connections one after another.
    pub(super) async fn sequential(&self, target: SocketAddr, count: u64) -> Result<()> {
        self.runtime
            .spawn(async move {
                for _ in 0..count {
                    tokio::time::timeout(IO_TIMEOUT, one_connection(target)).await??;
                }
                Ok::<_, anyhow::Error>(())
            })
            .await?
    }

    pub(super) async fn rate(
        &self,
        target: SocketAddr,
        clients: usize,
        warmup: Duration,
        duration: Duration,
        agent: Option<u32>,
    ) -> Result<(u64, u64, f64, CpuSample)> {
        let done = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let (done, errors, stop) = (done.clone(), errors.clone(), stop.clone());
                self.runtime.spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match tokio::time::timeout(IO_TIMEOUT, one_connection(target)).await {
                            Ok(Ok(())) => {
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {
                                errors.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(warmup).await;
        let (first, before) = (done.load(Ordering::Relaxed), Probe::take(agent)?);
        let errors_before = errors.load(Ordering::Relaxed);
        tokio::time::sleep(duration).await;
        let (last, after) = (done.load(Ordering::Relaxed), Probe::take(agent)?);
        let errors_during = errors.load(Ordering::Relaxed) - errors_before;
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await?;
        }
        let cpu = after.since(&before);
        let connections = last - first;
        Ok((
            connections,
            errors_during,
            connections as f64 / cpu.wall_s,
            cpu,
        ))
    }

    pub(super) async fn latency(
        &self,
        target: SocketAddr,
        clients: usize,
        warmup: Duration,
        duration: Duration,
        agent: Option<u32>,
    ) -> Result<(Histogram, CpuSample)> {
        let phase = Arc::new(AtomicU8::new(WARMUP));
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let phase = phase.clone();
                self.runtime.spawn(async move {
                    let mut histogram = Histogram::new();
                    let mut stream =
                        tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(target)).await??;
                    stream.set_nodelay(true)?;
                    let request = [0x5au8; MESSAGE];
                    let mut reply = [0u8; MESSAGE];
                    loop {
                        let now = phase.load(Ordering::Relaxed);
                        if now == STOP {
                            return Ok::<_, anyhow::Error>(histogram);
                        }
                        let started = Instant::now();
                        tokio::time::timeout(IO_TIMEOUT, async {
                            stream.write_all(&request).await?;
                            stream.read_exact(&mut reply).await
                        })
                        .await??;
                        if now == RECORD {
                            histogram.record(started.elapsed());
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(warmup).await;
        phase.store(RECORD, Ordering::Relaxed);
        let before = Probe::take(agent)?;
        tokio::time::sleep(duration).await;
        let after = Probe::take(agent)?;
        phase.store(STOP, Ordering::Relaxed);
        let mut merged = Histogram::new();
        for task in tasks {
            merged.merge(&task.await??);
        }
        Ok((merged, after.since(&before)))
    }
}
