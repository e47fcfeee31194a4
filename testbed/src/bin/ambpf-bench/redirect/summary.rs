//! The `redirect` suite's summary over runs, and its tables.

use super::*;

#[derive(Clone, Debug, Serialize)]
pub(crate) struct ModeSummary {
    pub(super) clients: usize,
    pub(super) mode: Mode,
    pub(super) conn_per_s: Stats,
    pub(super) rate_errors: u64,
    pub(super) p50_us: Stats,
    pub(super) p99_us: Stats,
    pub(super) req_per_s: Stats,
    /// Medians over the runs, in cores.
    pub(super) rate_cpu: CoresSummary,
    pub(super) latency_cpu: CoresSummary,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct CoresSummary {
    pub(super) loadgen: f64,
    pub(super) ztunnel: f64,
    pub(super) echo: f64,
    pub(super) agent: Option<f64>,
    pub(super) machine_busy: f64,
    pub(super) machine_softirq: f64,
    pub(super) busiest: &'static str,
}

impl CoresSummary {
    pub(super) fn of(samples: &[&CpuSample]) -> Self {
        let med = |f: &dyn Fn(&CpuSample) -> f64| {
            Stats::of(&samples.iter().map(|s| f(s)).collect::<Vec<_>>())
                .map_or(f64::NAN, |s| s.median)
        };
        let agent = samples
            .iter()
            .map(|s| s.agent)
            .collect::<Option<Vec<_>>>()
            .and_then(|a| Stats::of(&a))
            .map(|s| s.median);
        let sample = CpuSample {
            wall_s: 0.0,
            loadgen: med(&|s| s.loadgen),
            ztunnel: med(&|s| s.ztunnel),
            echo: med(&|s| s.echo),
            agent,
            bench_other: med(&|s| s.bench_other),
            machine_busy: med(&|s| s.machine_busy),
            machine_softirq: med(&|s| s.machine_softirq),
            machine_steal: med(&|s| s.machine_steal),
        };
        Self {
            loadgen: sample.loadgen,
            ztunnel: sample.ztunnel,
            echo: sample.echo,
            agent,
            machine_busy: sample.machine_busy,
            machine_softirq: sample.machine_softirq,
            busiest: sample.busiest().0,
        }
    }
}

/// One comparison at one client count: `mode`'s medians over `against`'s.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Ratios {
    pub(super) clients: usize,
    pub(super) mode: String,
    /// `iptables`, `nftables`, `faster (<backend>)` (the Istio backend with
    /// the higher connection rate), `direct` or `ebpf`.
    pub(super) against: String,
    pub(super) conn_rate: f64,
    pub(super) p50: f64,
    pub(super) p99: f64,
}

/// What each comparison is for, as the tables head them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Comparison {
    /// eBPF mode against each Istio backend, the faster of them, and direct.
    Redirection,
    /// A trace reader attached against not.
    TraceReader,
    /// A pod that is not enrolled, the agent running, against no agent.
    Bystander,
}

impl Comparison {
    fn of(mode: &str) -> Self {
        match mode {
            "ebpf+trace" => Comparison::TraceReader,
            m if m.ends_with(" bystander") => Comparison::Bystander,
            _ => Comparison::Redirection,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct ConntrackSummary {
    pub(super) mode: Mode,
    pub(super) pod_per_connection: Option<f64>,
    pub(super) node_per_connection: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Summary {
    pub(super) modes: Vec<ModeSummary>,
    pub(super) ratios: Vec<Ratios>,
    pub(super) conntrack: Vec<ConntrackSummary>,
}

pub(crate) fn summarize(runs: &[ModeRun], clients: &[usize], measured: &[Mode]) -> Summary {
    let mut modes = Vec::new();
    let mut ratios = Vec::new();
    for &c in clients {
        let mut medians = std::collections::HashMap::new();
        for &mode in measured {
            let points: Vec<&Point> = runs
                .iter()
                .filter(|r| r.mode == mode)
                .flat_map(|r| r.points.iter().filter(|p| p.clients == c))
                .collect();
            let stats = |f: &dyn Fn(&Point) -> f64| {
                Stats::of(&points.iter().map(|p| f(p)).collect::<Vec<_>>())
            };
            let (Some(conn), Some(p50), Some(p99), Some(req)) = (
                stats(&|p| p.rate.per_second),
                stats(&|p| p.latency.p50_us),
                stats(&|p| p.latency.p99_us),
                stats(&|p| p.latency.per_second),
            ) else {
                continue;
            };
            medians.insert(mode.name(), (conn.median, p50.median, p99.median));
            modes.push(ModeSummary {
                clients: c,
                mode,
                conn_per_s: conn,
                rate_errors: points.iter().map(|p| p.rate.errors).sum(),
                p50_us: p50,
                p99_us: p99,
                req_per_s: req,
                rate_cpu: CoresSummary::of(&points.iter().map(|p| &p.rate.cpu).collect::<Vec<_>>()),
                latency_cpu: CoresSummary::of(
                    &points.iter().map(|p| &p.latency.cpu).collect::<Vec<_>>(),
                ),
            });
        }
        let get = |m: &str| medians.get(m).copied();
        let mut row = |mode: &str, against: String, baseline: Option<(f64, f64, f64)>| {
            if let (Some(of), Some(base)) = (get(mode), baseline) {
                ratios.push(Ratios {
                    clients: c,
                    mode: mode.to_owned(),
                    against,
                    conn_rate: of.0 / base.0,
                    p50: of.1 / base.1,
                    p99: of.2 / base.2,
                });
            }
        };
        // The faster Istio backend by connection rate, the headline figure.
        for baseline in bench::istio_baselines(|b| get(b).map(|t| t.0), false) {
            row("ebpf", baseline.label, get(baseline.backend));
        }
        row("ebpf", "direct".to_owned(), get("direct"));
        row("ebpf+trace", "ebpf".to_owned(), get("ebpf"));
        for bystander in ["ebpf bystander", "iptables bystander", "nftables bystander"] {
            row(bystander, "direct".to_owned(), get("direct"));
        }
    }
    let conntrack = measured
        .iter()
        .map(|&mode| {
            let median = |f: &dyn Fn(&Conntrack) -> Option<f64>| {
                runs.iter()
                    .filter(|r| r.mode == mode)
                    .map(|r| f(&r.conntrack))
                    .collect::<Option<Vec<_>>>()
                    .and_then(|v| Stats::of(&v))
                    .map(|s| s.median)
            };
            ConntrackSummary {
                mode,
                pod_per_connection: median(&|c| c.pod_per_connection),
                node_per_connection: median(&|c| c.node_per_connection),
            }
        })
        .collect();
    Summary {
        modes,
        ratios,
        conntrack,
    }
}

/// What the tables say of the runs they print.
pub(crate) struct Tables<'a> {
    pub(crate) direction: Direction,
    pub(crate) duration_secs: f64,
    pub(crate) conntrack_connections: u64,
    /// Whose traffic the bystander modes' ratios are of.
    pub(crate) bystander: &'a str,
}

impl RedirectArgs {
    pub(super) fn tables(&self) -> Tables<'static> {
        Tables {
            direction: self.direction,
            duration_secs: self.duration_secs,
            conntrack_connections: self.conntrack_connections,
            bystander: "a pod that is not enrolled",
        }
    }
}

/// Prints the tables of one group of runs (`steady`: every run after the
/// first; `first`: the first, reported apart).
pub(crate) fn print_tables(summary: &Summary, runs: &[ModeRun], args: &Tables<'_>, group: &str) {
    let counted = runs
        .iter()
        .map(|r| r.run)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let f0 = |v: f64| format!("{v:.0}");
    let f1 = |v: f64| format!("{v:.1}");
    let f2 = |v: f64| format!("{v:.2}");
    let x = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.2}x")
        }
    };
    println!();
    println!("== {group} ({counted} run(s); modes in balanced order, fresh namespaces each)");
    let (what, unit) = match args.direction {
        Direction::Outbound => (
            format!(
                "New outbound connections per second (each: connect, {MESSAGE} B request/echo, close)"
            ),
            "conn/s",
        ),
        Direction::Inbound => (
            format!(
                "New inbound connections per second, off-node client to the pod's app (each: connect, {MESSAGE} B request/echo, close)"
            ),
            "conn/s",
        ),
        Direction::Dns => (
            "UDP DNS queries per second (each: a new socket, connect, an A query, its answer); \
             the latency table below is of the same queries"
                .to_owned(),
            "queries/s",
        ),
    };
    println!(
        "{what}, median of {counted} runs of {} s; CPU in cores (medians)",
        args.duration_secs
    );
    let mut table = Table::new([
        "clients", "mode", unit, "min", "max", "errors", "loadgen", "ztunnel", "echo", "agent",
        "softirq", "machine", "busiest",
    ]);
    for m in &summary.modes {
        let cpu = &m.rate_cpu;
        table.row([
            m.clients.to_string(),
            m.mode.name().to_owned(),
            f0(m.conn_per_s.median),
            f0(m.conn_per_s.min),
            f0(m.conn_per_s.max),
            m.rate_errors.to_string(),
            f2(cpu.loadgen),
            f2(cpu.ztunnel),
            f2(cpu.echo),
            cpu.agent.map_or("-".to_owned(), f2),
            f2(cpu.machine_softirq),
            f2(cpu.machine_busy),
            cpu.busiest.to_owned(),
        ]);
    }
    print!("{table}");
    println!();
    if args.direction == Direction::Dns {
        println!("Query latency (send to answer), µs, median of {counted} runs");
    } else {
        println!(
            "Request latency on kept-alive connections ({MESSAGE} B ping-pong per client), µs, median of {counted} runs"
        );
    }
    let mut table = Table::new([
        "clients", "mode", "p50", "p99", "p99 max", "req/s", "loadgen", "ztunnel", "echo",
        "softirq", "machine", "busiest",
    ]);
    for m in &summary.modes {
        let cpu = &m.latency_cpu;
        table.row([
            m.clients.to_string(),
            m.mode.name().to_owned(),
            f1(m.p50_us.median),
            f1(m.p99_us.median),
            f1(m.p99_us.max),
            f0(m.req_per_s.median),
            f2(cpu.loadgen),
            f2(cpu.ztunnel),
            f2(cpu.echo),
            f2(cpu.machine_softirq),
            f2(cpu.machine_busy),
            cpu.busiest.to_owned(),
        ]);
    }
    print!("{table}");
    println!();
    for (comparison, title) in [
        (
            Comparison::Redirection,
            "Ratios of medians, eBPF mode against each Istio backend, the faster of them and no \
             redirection (conn/s: higher is better; latency: lower is better)"
                .to_owned(),
        ),
        (
            Comparison::TraceReader,
            "Cost of a trace reader: ebpf+trace / ebpf, ratios of medians".to_owned(),
        ),
        (
            Comparison::Bystander,
            format!(
                "Cost to bystanders: {}, the agent running / no agent, ratios of medians",
                args.bystander
            ),
        ),
    ] {
        let rows: Vec<&Ratios> = summary
            .ratios
            .iter()
            .filter(|r| Comparison::of(&r.mode) == comparison)
            .collect();
        if rows.is_empty() {
            continue;
        }
        println!();
        println!("{title}");
        let mut table = Table::new(["clients", "mode", "against", unit, "p50", "p99"]);
        for r in rows {
            table.row([
                r.clients.to_string(),
                r.mode.clone(),
                r.against.clone(),
                x(r.conn_rate),
                x(r.p50),
                x(r.p99),
            ]);
        }
        print!("{table}");
    }
    println!();
    println!(
        "conntrack entries created per connection ({} sequential connections; nf_conntrack_count in the pod's and the node's namespace)",
        args.conntrack_connections
    );
    let mut table = Table::new(["mode", "pod", "node", "runs (pod/node after)"]);
    for c in &summary.conntrack {
        let after: Vec<String> = runs
            .iter()
            .filter(|r| r.mode == c.mode)
            .map(|r| {
                let n = |v: Option<u64>| v.map_or("-".to_owned(), |v| v.to_string());
                format!("{}/{}", n(r.conntrack.pod_after), n(r.conntrack.node_after))
            })
            .collect();
        table.row([
            c.mode.name().to_owned(),
            c.pod_per_connection.map_or("-".to_owned(), f2),
            c.node_per_connection.map_or("-".to_owned(), f2),
            after.join(" "),
        ]);
    }
    print!("{table}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu() -> CpuSample {
        CpuSample {
            wall_s: 1.0,
            loadgen: 0.5,
            ztunnel: 0.0,
            echo: 0.4,
            agent: None,
            bench_other: 0.0,
            machine_busy: 1.0,
            machine_softirq: 0.1,
            machine_steal: 0.0,
        }
    }

    /// One mode's run at one client count: its rate and latencies.
    fn measured(run: usize, mode: Mode, conn_per_s: f64, p50_us: f64, p99_us: f64) -> ModeRun {
        ModeRun {
            run,
            mode,
            conntrack: Conntrack {
                connections: 10,
                pod_before: None,
                pod_after: None,
                node_before: None,
                node_after: None,
                pod_per_connection: None,
                node_per_connection: None,
            },
            points: vec![Point {
                clients: 8,
                rate: RateSample {
                    connections: conn_per_s as u64,
                    errors: 0,
                    per_second: conn_per_s,
                    proxied: 0,
                    proxy_failures: 0,
                    cpu: cpu(),
                },
                latency: LatencySample {
                    requests: 1,
                    per_second: 1.0,
                    p50_us,
                    p99_us,
                    mean_us: p50_us,
                    max_us: p99_us,
                    proxied: 0,
                    cpu: cpu(),
                },
            }],
        }
    }

    fn ratio<'a>(summary: &'a Summary, mode: &str, against: &str) -> &'a Ratios {
        summary
            .ratios
            .iter()
            .find(|r| r.mode == mode && r.against == against)
            .unwrap_or_else(|| panic!("no {mode} against {against}: {:?}", summary.ratios))
    }

    #[test]
    fn bystanders_are_compared_with_no_agent_by_the_medians_of_their_runs() {
        let modes = [Mode::Direct, Mode::EbpfBystander, Mode::IptablesBystander];
        let runs = vec![
            measured(1, Mode::Direct, 1000.0, 10.0, 40.0),
            measured(2, Mode::Direct, 1200.0, 12.0, 50.0),
            measured(3, Mode::Direct, 900.0, 30.0, 60.0),
            measured(1, Mode::EbpfBystander, 950.0, 11.0, 44.0),
            measured(2, Mode::EbpfBystander, 5000.0, 11.0, 44.0),
            measured(3, Mode::EbpfBystander, 100.0, 11.0, 44.0),
            measured(1, Mode::IptablesBystander, 800.0, 20.0, 100.0),
        ];
        let summary = summarize(&runs, &[8], &modes);
        let ebpf = ratio(&summary, "ebpf bystander", "direct");
        // Medians: direct 1000 conn/s, p50 12, p99 50; ebpf 950, 11, 44.
        assert!((ebpf.conn_rate - 0.95).abs() < 1e-9, "{ebpf:?}");
        assert!((ebpf.p50 - 11.0 / 12.0).abs() < 1e-9, "{ebpf:?}");
        assert!((ebpf.p99 - 44.0 / 50.0).abs() < 1e-9, "{ebpf:?}");
        let iptables = ratio(&summary, "iptables bystander", "direct");
        assert!((iptables.conn_rate - 0.8).abs() < 1e-9, "{iptables:?}");
        // No redirecting mode was measured: no eBPF-against-backend rows.
        assert!(summary.ratios.iter().all(|r| r.against == "direct"));
        assert!(
            summary
                .ratios
                .iter()
                .all(|r| r.mode.ends_with(" bystander"))
        );
    }

    #[test]
    fn ebpf_mode_is_compared_with_each_backend_and_the_faster_of_them() {
        let modes = [Mode::Direct, Mode::Iptables, Mode::Nftables, Mode::Ebpf];
        let runs = vec![
            measured(1, Mode::Direct, 2000.0, 10.0, 20.0),
            measured(1, Mode::Iptables, 500.0, 40.0, 80.0),
            measured(1, Mode::Nftables, 400.0, 50.0, 90.0),
            measured(1, Mode::Ebpf, 600.0, 30.0, 60.0),
        ];
        let summary = summarize(&runs, &[8], &modes);
        let faster = ratio(&summary, "ebpf", "faster (iptables)");
        assert!((faster.conn_rate - 1.2).abs() < 1e-9, "{faster:?}");
        assert!((ratio(&summary, "ebpf", "nftables").conn_rate - 1.5).abs() < 1e-9);
        assert!((ratio(&summary, "ebpf", "direct").p50 - 3.0).abs() < 1e-9);
        // A client count nobody measured has no rows.
        assert!(summarize(&runs, &[64], &modes).ratios.is_empty());
    }
}
