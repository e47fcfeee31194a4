//! One mode of one run of the `redirect` suite: a fresh cluster, the agent
//! and ztunnel double in the redirecting modes, and the traffic of
//! `--direction` measured at each client count.

use super::*;

/// Where the app of the pod listens in `--direction inbound`.
const APP_PORT: u16 = 8080;
/// Where the resolver is asked in `--direction dns`.
const RESOLVER_PORT: u16 = 53;

/// The traffic of one direction: its server, its load generator and what
/// the load generator asks.
pub(crate) struct Traffic {
    kind: Direction,
    target: SocketAddr,
    loadgen: LoadGen,
    // Dropped after the load generator (field order).
    _server: OwnRuntime,
}

impl Traffic {
    /// The server of `kind` at `target` in `server_ns`, its load generator
    /// in `client_ns`.
    pub(crate) fn start(
        kind: Direction,
        client_ns: &NetnsGuard,
        server_ns: &NetnsGuard,
        target: SocketAddr,
        loadgen_threads: usize,
    ) -> Result<Self> {
        // Many short connections: the whole port range, and TIME_WAIT ports
        // reused (the test's own namespaces only).
        for ns in [client_ns, server_ns] {
            ns.sysctl("net.ipv4.ip_local_port_range=10000 65000")?;
            ns.sysctl("net.ipv4.tcp_tw_reuse=1")?;
        }
        let server = match kind {
            Direction::Outbound | Direction::Inbound => start_echo(server_ns, target)?,
            Direction::Dns => dns::start_resolver(server_ns, target)?,
        };
        Ok(Self {
            kind,
            target,
            loadgen: LoadGen::new(client_ns, loadgen_threads)?,
            _server: server,
        })
    }

    /// `count` exchanges one after another (connections, or DNS queries).
    pub(crate) async fn sequential(&self, count: u64) -> Result<()> {
        match self.kind {
            Direction::Dns => self.loadgen.sequential_queries(self.target, count).await,
            _ => self.loadgen.sequential(self.target, count).await,
        }
    }

    /// The rate and latency at `clients`; `taken` is called after each test
    /// and returns what ztunnel took of it (ok, failed).
    pub(crate) async fn point(
        &self,
        clients: usize,
        warmup: Duration,
        duration: Duration,
        agent_pid: Option<u32>,
        taken: &dyn Fn() -> (usize, usize),
    ) -> Result<Point> {
        let target = self.target;
        let us = |ns: Option<u64>| ns.map_or(f64::NAN, |ns| ns as f64 / 1e3);
        let latency_of = |histogram: &Histogram, cpu: CpuSample, proxied: usize| LatencySample {
            requests: histogram.count(),
            per_second: histogram.count() as f64 / cpu.wall_s,
            p50_us: us(histogram.percentile_ns(50.0)),
            p99_us: us(histogram.percentile_ns(99.0)),
            mean_us: histogram.mean_ns().map_or(f64::NAN, |ns| ns / 1e3),
            max_us: us(histogram.max_ns()),
            proxied,
            cpu,
        };
        if self.kind == Direction::Dns {
            // One test gives both: each query is a new exchange and is timed.
            let (queries, errors, histogram, cpu) = self
                .loadgen
                .queries(target, clients, warmup, duration, agent_pid)
                .await
                .with_context(|| format!("DNS queries, {clients} clients"))?;
            let (proxied, proxy_failures) = taken();
            return Ok(Point {
                clients,
                rate: RateSample {
                    connections: queries,
                    errors,
                    per_second: queries as f64 / cpu.wall_s,
                    proxied,
                    proxy_failures,
                    cpu: cpu.clone(),
                },
                latency: latency_of(&histogram, cpu, proxied),
            });
        }
        let (connections, errors, per_second, cpu) = self
            .loadgen
            .rate(target, clients, warmup, duration, agent_pid)
            .await
            .with_context(|| format!("connection rate, {clients} clients"))?;
        let (proxied, proxy_failures) = taken();
        let rate = RateSample {
            connections,
            errors,
            per_second,
            proxied,
            proxy_failures,
            cpu,
        };
        let (histogram, cpu) = self
            .loadgen
            .latency(target, clients, warmup, duration, agent_pid)
            .await
            .with_context(|| format!("latency, {clients} clients"))?;
        let (proxied, _) = taken();
        Ok(Point {
            clients,
            rate,
            latency: latency_of(&histogram, cpu, proxied),
        })
    }
}

/// What the double took of the traffic since last asked: connections through
/// its proxies (ok, failed), or queries its DNS proxy answered.
pub(crate) fn taken_by(double: &ZtunnelDouble, kind: Direction) -> (usize, usize) {
    if kind == Direction::Dns {
        return (double.take_dns_queries().len(), 0);
    }
    let taken = double.take_proxied();
    let ok = taken
        .iter()
        .filter(|c| c.outcome == ConnectionOutcome::Proxied)
        .count();
    (ok, taken.len() - ok)
}

/// nf_conntrack_count in the pod's and the node's namespace around
/// `traffic`'s sequential exchanges.
pub(crate) async fn conntrack_around(
    traffic: &Traffic,
    pod: &NetnsGuard,
    node: &NetnsGuard,
    connections: u64,
) -> Result<Conntrack> {
    let count = |ns: &NetnsGuard| ns.run(sys::conntrack_count).ok().flatten();
    let (pod_before, node_before) = (count(pod), count(node));
    traffic
        .sequential(connections)
        .await
        .context("the conntrack connections")?;
    let (pod_after, node_after) = (count(pod), count(node));
    let per = |before: Option<u64>, after: Option<u64>| {
        Some((after? as f64 - before.unwrap_or(0) as f64) / connections as f64)
    };
    Ok(Conntrack {
        connections,
        pod_before,
        pod_after,
        node_before,
        node_after,
        pod_per_connection: per(pod_before, pod_after),
        node_per_connection: per(node_before, node_after),
    })
}

pub(crate) async fn measure_mode(
    args: &RedirectArgs,
    agent_binary: &Path,
    work: &TempDir,
    cgroup: &CgroupGuard,
    mode: Mode,
    run: usize,
) -> Result<ModeRun> {
    let cluster = Cluster::create(1).context("creating the cluster")?;
    let pod = &cluster.pods[0];
    let remote = &cluster.remote;
    // The pod's side is where its app is: the client outbound and for DNS,
    // the server inbound.
    let traffic = match args.direction {
        Direction::Outbound => {
            let target = SocketAddr::new(remote.addrs.v4.into(), PEER_PORT);
            Traffic::start(
                Direction::Outbound,
                &pod.ns,
                &remote.ns,
                target,
                args.loadgen_threads,
            )?
        }
        Direction::Inbound => {
            let target = SocketAddr::new(pod.addrs.v4.into(), APP_PORT);
            Traffic::start(
                Direction::Inbound,
                &remote.ns,
                &pod.ns,
                target,
                args.loadgen_threads,
            )?
        }
        Direction::Dns => {
            let target = SocketAddr::new(remote.addrs.v4.into(), RESOLVER_PORT);
            Traffic::start(
                Direction::Dns,
                &pod.ns,
                &remote.ns,
                target,
                args.loadgen_threads,
            )?
        }
    };

    let mut redirected = None;
    if mode != Mode::Direct {
        let enrolled = if mode.captures() {
            vec![(POD_UID.to_owned(), pod.ns.path())]
        } else {
            Vec::new()
        };
        let served = Served::start(
            agent_binary,
            mode,
            &cluster.node,
            &enrolled,
            cgroup,
            work,
            run,
        )
        .await?;
        let reader = match mode {
            Mode::EbpfTraced => {
                let log = work.join(format!("trace-{run}.log"));
                Some(served.agent.attach_trace_reader(&log).await?)
            }
            _ => None,
        };
        redirected = Some((served, reader));
    }
    let agent_pid = redirected.as_ref().map(|(served, _)| served.agent.pid());
    let taken = || {
        redirected.as_ref().map_or((0, 0), |(served, _)| {
            taken_by(&served.double, args.direction)
        })
    };

    // Conntrack: a fixed number of sequential exchanges.
    let conntrack =
        conntrack_around(&traffic, &pod.ns, &cluster.node, args.conntrack_connections).await?;
    let (proxied, _) = taken();
    if mode.captures() {
        ensure!(
            proxied as u64 >= args.conntrack_connections,
            "only {proxied} of {} exchanges went through ztunnel",
            args.conntrack_connections
        );
    } else {
        ensure!(
            proxied == 0,
            "{proxied} of a bystander's exchanges went through ztunnel"
        );
    }

    let warmup = Duration::from_secs_f64(args.warmup_secs);
    let duration = Duration::from_secs_f64(args.duration_secs);
    let mut points = Vec::new();
    for &clients in &args.clients {
        let point = traffic
            .point(clients, warmup, duration, agent_pid, &taken)
            .await?;
        eprintln!(
            "redirect: run {} {:<8} {:>2} clients: {:>8.0} {}/s ({} errors, busiest {}), p50 {:>7.1} µs p99 {:>7.1} µs ({:.0} req/s, busiest {})",
            run + 1,
            mode.name(),
            clients,
            point.rate.per_second,
            args.direction.unit(),
            point.rate.errors,
            point.rate.cpu.busiest().0,
            point.latency.p50_us,
            point.latency.p99_us,
            point.latency.per_second,
            point.latency.cpu.busiest().0,
        );
        points.push(point);
    }

    if let Some((served, reader)) = redirected {
        if let Some(mut reader) = reader {
            reader.stop()?;
            let records = std::fs::read_to_string(reader.log_path())?
                .lines()
                .filter(|l| l.contains("\"verdict\""))
                .count();
            eprintln!(
                "redirect: run {} the trace reader printed {records} records",
                run + 1
            );
            ensure!(records > 0, "the trace reader printed no record");
        }
        served.stop().await?;
    }
    drop(traffic);
    drop(cluster);
    Ok(ModeRun {
        run,
        mode,
        conntrack,
        points,
    })
}
