//! The `redirect` suite's DNS traffic (`--direction dns`): a resolver double
//! in the remote namespace and UDP queries from the pod's app, each on a new
//! socket connected to the resolver, as a libc stub resolver asks.

use ambpf_testbed::ztunnel::{DEFAULT_DNS_ANSWER_V4, DEFAULT_DNS_ANSWER_V6, dns as wire};
use tokio::net::UdpSocket;

use super::*;

/// The name every query asks for (A).
const QUERY_NAME: &str = "bench.ambpf.test";

/// The resolver double at `addr` in `netns`: what the pod asks without
/// redirection. It answers as ztunnel's DNS proxy does.
pub(super) fn start_resolver(netns: &NetnsGuard, addr: SocketAddr) -> Result<OwnRuntime> {
    let (runtime, failed) = named_runtime("echo-rt", 2, Some(&netns.path()))?;
    ensure!(
        !failed.load(Ordering::SeqCst),
        "resolver threads: setns failed"
    );
    let socket = netns.run(|| std::net::UdpSocket::bind(addr))??;
    socket.set_nonblocking(true)?;
    runtime.spawn(async move {
        let Ok(socket) = UdpSocket::from_std(socket) else {
            eprintln!("redirect: resolver: cannot register the socket");
            return;
        };
        ambpf_testbed::ztunnel::serve_resolver_udp(
            socket,
            DEFAULT_DNS_ANSWER_V4,
            DEFAULT_DNS_ANSWER_V6,
        )
        .await;
    });
    Ok(runtime)
}

/// One query on a new socket connected to `resolver`: the answer must carry
/// the query's id and the address the doubles give.
async fn one_query(resolver: SocketAddr, id: u16, query: &mut [u8]) -> std::io::Result<()> {
    let socket = UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0)).await?;
    socket.connect(resolver).await?;
    query[..2].copy_from_slice(&id.to_be_bytes());
    socket.send(query).await?;
    let mut answer = [0u8; 512];
    let len = socket.recv(&mut answer).await?;
    let answered = wire::Response::parse(&answer[..len]).is_ok_and(|r| {
        r.header.id == id && r.addresses() == [std::net::IpAddr::V4(DEFAULT_DNS_ANSWER_V4)]
    });
    if answered {
        Ok(())
    } else {
        Err(std::io::Error::other("not the answer to the query"))
    }
}

fn query() -> Result<Vec<u8>> {
    wire::encode_query(0, QUERY_NAME, wire::TYPE_A).map_err(|e| anyhow::anyhow!("{e}"))
}

impl LoadGen {
    /// `count` queries one after another.
    pub(super) async fn sequential_queries(&self, resolver: SocketAddr, count: u64) -> Result<()> {
        let mut query = query()?;
        self.runtime
            .spawn(async move {
                for i in 0..count {
                    tokio::time::timeout(IO_TIMEOUT, one_query(resolver, i as u16, &mut query))
                        .await??;
                }
                Ok::<_, anyhow::Error>(())
            })
            .await?
    }

    /// `clients` asking one query after another for `warmup`, then for
    /// `duration` measured: answered queries, failed ones (a lost datagram
    /// waits out [`IO_TIMEOUT`]), each answered query's time, and the CPU.
    pub(super) async fn queries(
        &self,
        resolver: SocketAddr,
        clients: usize,
        warmup: Duration,
        duration: Duration,
        agent: Option<u32>,
    ) -> Result<(u64, u64, Histogram, CpuSample)> {
        let phase = Arc::new(AtomicU8::new(WARMUP));
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let phase = phase.clone();
                let query = query();
                self.runtime.spawn(async move {
                    let mut query = query?;
                    let (mut histogram, mut errors, mut id) = (Histogram::new(), 0u64, 0u16);
                    loop {
                        let now = phase.load(Ordering::Relaxed);
                        if now == STOP {
                            return Ok::<_, anyhow::Error>((histogram, errors));
                        }
                        id = id.wrapping_add(1);
                        let started = Instant::now();
                        let asked =
                            tokio::time::timeout(IO_TIMEOUT, one_query(resolver, id, &mut query))
                                .await;
                        if now != RECORD {
                            continue;
                        }
                        match asked {
                            Ok(Ok(())) => histogram.record(started.elapsed()),
                            _ => errors += 1,
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
        let (mut merged, mut errors) = (Histogram::new(), 0);
        for task in tasks {
            let (histogram, failed) = task.await??;
            merged.merge(&histogram);
            errors += failed;
        }
        Ok((merged.count(), errors, merged, after.since(&before)))
    }
}
