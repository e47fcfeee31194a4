//! Privileged: `ambpf trace` and the per-pod counters, with the real agent,
//! the real `ambpf` CLI and real traffic between a testbed cluster's
//! namespaces through the ztunnel double.
//!
//! Pod `web-0` is served by the double; pod `web-1` is enrolled too, but the
//! double refuses it (NACK), so no ztunnel listener exists in its namespace:
//! inbound SYNs to it meet no listener. Checked: each kind of decision shows
//! in the trace with its pod, direction, tuple and original destination; a
//! second reader is refused while one reads; a reader that dies frees the
//! gate; filters select; a reader that stops reading loses records (counted
//! and shown) while the connections go on; the per-pod counters and their
//! `/metrics` series grow for the pod whose traffic it was and go with it;
//! web-1's refused connections are counted for it and logged once per
//! report, never per connection.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use ambpf_common::{TraceGate, maps};
use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    ztunnel::{ZtunnelConfig, ZtunnelDouble, dns},
};
use aya::maps::{Array, Map, MapData};
use serde_json::Value;

mod common;
use common::agent::{Proc, TempDir, serve_echo as serve, wait_for as wait_until};

const PATIENCE: Duration = Duration::from_secs(20);
const WEB0: &str = "web-0-uid";
const WEB1: &str = "web-1-uid";
const APP_PORT: u16 = 8080;
const METRICS: &str = "127.0.0.1:15014";
/// Tests move this process between cgroups: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn ambpf(pins: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ambpf"));
    cmd.arg("--pin-root").arg(pins);
    cmd
}

/// A running `ambpf trace`: its stdout lines as they come.
struct Trace {
    proc: Proc,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Trace {
    /// Starts it and waits until it holds the gate (it says so on stderr).
    fn start(pins: &Path, args: &[&str]) -> Self {
        let (mut child, stdout) = Self::spawn(pins, args);
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let collect = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                collect.lock().unwrap().push(line);
            }
        });
        let _ = child.stdout.take();
        Self {
            proc: Proc(child),
            lines,
        }
    }

    /// Starts it with its output left unread (a reader that stopped reading).
    fn spawn(pins: &Path, args: &[&str]) -> (Child, std::process::ChildStdout) {
        let mut child = ambpf(pins)
            .arg("trace")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (ready_tx, ready_rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = ready_tx.send(line);
            }
        });
        let said = ready_rx.recv_timeout(PATIENCE).expect("trace said nothing");
        assert!(said.contains("reading redirect decisions"), "{said}");
        let stdout = child.stdout.take().unwrap();
        (child, stdout)
    }

    fn records(&self) -> Vec<Value> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Waits for a record with `verdict` of the pod `cookie` and returns it.
    async fn wait_for(&self, verdict: &str, cookie: u64) -> Value {
        self.wait_for_matching(verdict, cookie, |_| true).await
    }

    /// The first record of that verdict in that pod that `matches` accepts:
    /// one pod's decisions of the same verdict (ztunnel's upstream and its
    /// delivery to the app, say) arrive in no fixed order.
    async fn wait_for_matching(
        &self,
        verdict: &str,
        cookie: u64,
        matches: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            if let Some(record) = self
                .records()
                .into_iter()
                .find(|r| r["verdict"] == verdict && r["netns_cookie"] == cookie && matches(r))
            {
                return record;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {verdict} record for cookie {cookie} in {:#?}",
                self.records()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops it as Ctrl-C would.
    fn interrupt(self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.proc.0.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
        let mut proc = self.proc;
        proc.0.wait().unwrap()
    }
}

fn gate(pins: &Path) -> TraceGate {
    let data = MapData::from_pin(pins.join("maps").join(maps::TRACE_GATE)).unwrap();
    let array: Array<_, TraceGate> = Array::try_from(Map::Array(data)).unwrap();
    array.get(&0, 0).unwrap()
}

fn status(pins: &Path) -> Value {
    let out = ambpf(pins).args(["status", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The enrolled pod whose first address is `ip`, as `status --json` shows it.
fn pod_status(status: &Value, ip: IpAddr) -> Option<Value> {
    status["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["addresses"][0] == ip.to_string())
        .cloned()
}

fn metrics(node: &NetnsGuard) -> String {
    node.run(|| {
        let mut conn = TcpStream::connect(METRICS).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        conn.read_to_string(&mut body).unwrap();
        body
    })
    .unwrap()
}

/// A TCP connection from `ns` to `to`, closed at once; whether it connected.
fn connect(ns: &NetnsGuard, to: SocketAddr, within: Duration) -> bool {
    ns.run(|| TcpStream::connect_timeout(&to, within).is_ok())
        .unwrap()
}

fn pods_json(pods: &[(&str, &str, &NetnsGuard)]) -> String {
    let entries: Vec<String> = pods
        .iter()
        .map(|(uid, name, ns)| {
            format!(
                r#"{{"uid": "{uid}", "name": "{name}", "namespace": "shop", "netns": "{}"}}"#,
                ns.path().display()
            )
        })
        .collect();
    format!(r#"{{"pods": [{}]}}"#, entries.join(", "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn trace_shows_every_decision_and_counters_follow_the_pod() {
    let _serial = SERIAL.lock().await;
    let bpffs = BpffsMount::create().unwrap();
    let pins = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(2).unwrap();
    let (web0, web1) = (&cluster.pods[0], &cluster.pods[1]);
    let dir = std::env::temp_dir().join(format!("ambpf-trace-{}", ambpf_testbed::unique_name("")));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let (socket, pods_file) = (dir.join("ztunnel.sock"), dir.join("pods.json"));
    std::fs::write(
        &pods_file,
        pods_json(&[(WEB0, "web-0", &web0.ns), (WEB1, "web-1", &web1.ns)]),
    )
    .unwrap();

    let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), 9000);
    serve(&cluster.remote.ns, remote);
    let any = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), APP_PORT);
    serve(&web0.ns, any);
    serve(&web1.ns, any);
    let log = dir.join("agent.log");
    let _agent = Proc(
        common::agent::agent_command(
            &cluster.node,
            &pins,
            &socket,
            &pods_file,
            cgroup.path(),
            METRICS,
        )
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap(),
    );
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default().nack(WEB1));
    ztunnel
        .wait_until(
            // Not `ready`: web-1 stays pending.
            |s| s.workloads.get(WEB0).is_some_and(|w| w.proxies_running),
            PATIENCE,
        )
        .await
        .unwrap();
    let web0_ip: IpAddr = web0.addrs.v4.into();
    let web1_ip: IpAddr = web1.addrs.v4.into();
    wait_until(
        || pod_status(&status(&pins), web1_ip).is_some(),
        "web-1 to be enrolled",
    )
    .await;
    let before = status(&pins);
    let cookie = |ip| {
        pod_status(&before, ip).unwrap()["netns_cookie"]
            .as_u64()
            .unwrap()
    };
    let (cookie0, cookie1) = (cookie(web0_ip), cookie(web1_ip));
    let zero = serde_json::json!({
        "outbound_redirected": 0, "inbound_redirected": 0,
        "dns_redirected": 0, "probes_bypassed": 0, "inbound_no_listener": 0,
    });
    assert_eq!(
        pod_status(&before, web0_ip).unwrap()["counters"],
        zero,
        "{before}"
    );

    // No reader: the gate is closed.
    assert_eq!(gate(&pins).until_ns, 0);
    let trace = Trace::start(&pins, &["--json"]);
    assert_eq!(gate(&pins).reader_pid, trace.proc.0.id());
    // One reader at a time: a second is refused, naming the first.
    let second = ambpf(&pins).arg("trace").output().unwrap();
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{said}");
    assert!(
        said.contains(&format!("pid {}", trace.proc.0.id())),
        "{said}"
    );

    let node_ip = cluster.node_addresses()[2];
    let to_app = |ip| SocketAddr::new(ip, APP_PORT);
    tokio::task::block_in_place(|| {
        // Outbound: captured, and ztunnel's own upstream connection exempt.
        assert!(connect(&web0.ns, remote, PATIENCE));
        // To its own address and to loopback: exempt.
        assert!(connect(&web0.ns, to_app(web0_ip), PATIENCE));
        connect(&web0.ns, "127.0.0.1:1".parse().unwrap(), PATIENCE);
        // DNS over unconnected UDP: captured (the double answers).
        web0.ns
            .run(|| {
                let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
                udp.set_read_timeout(Some(PATIENCE)).unwrap();
                let query = dns::encode_query(7, "trace.ambpf.test", dns::TYPE_A).unwrap();
                udp.send_to(&query, SocketAddr::new(remote.ip(), 53))
                    .unwrap();
                udp.recv_from(&mut [0u8; 512]).expect("DNS answer");
                // Connected UDP elsewhere: not TCP, not DNS.
                udp.connect(SocketAddr::new(remote.ip(), 5000)).unwrap();
            })
            .unwrap();
        // Inbound: steered; from the node: a probe; to 15008: HBONE.
        assert!(connect(&cluster.remote.ns, to_app(web0_ip), PATIENCE));
        assert!(connect(&cluster.node, to_app(web0_ip), PATIENCE));
        assert!(connect(
            &cluster.remote.ns,
            SocketAddr::new(web0_ip, 15008),
            PATIENCE
        ));
        // web-1 has no ztunnel listener: its inbound SYNs are dropped.
        for _ in 0..3 {
            assert!(!connect(
                &cluster.remote.ns,
                to_app(web1_ip),
                Duration::from_millis(300)
            ));
        }
        // Straight to ztunnel's 15001, bypassing the capture: ztunnel asks
        // for an original destination ambpf never recorded.
        connect(&web0.ns, SocketAddr::new(web0_ip, 15001), PATIENCE);
    });

    let captured = trace.wait_for("captured", cookie0).await;
    assert_eq!(captured["direction"], "outbound");
    assert_eq!(captured["protocol"], "tcp");
    assert_eq!(captured["original_dst"], remote.to_string());
    assert_eq!(captured["dst"], "127.0.0.1:15001");
    assert_eq!(
        captured["src"].as_str().unwrap().split(':').next(),
        Some("10.244.1.2")
    );
    // ztunnel's upstream connection for the captured one, which carries its
    // original destination.
    trace
        .wait_for_matching("exempt_ztunnel", cookie0, |r| {
            r["original_dst"] == remote.to_string()
        })
        .await;
    let own = trace.wait_for("exempt_own_address", cookie0).await;
    assert_eq!(own["dst"], to_app(web0_ip).to_string());
    trace.wait_for("exempt_loopback", cookie0).await;
    let dns = trace.wait_for("dns_captured", cookie0).await;
    assert_eq!(
        (&dns["protocol"], &dns["dst"], &dns["original_dst"]),
        (
            &Value::from("udp"),
            &Value::from("127.0.0.1:15053"),
            &Value::from(SocketAddr::new(remote.ip(), 53).to_string())
        )
    );
    let udp = trace.wait_for("exempt_not_tcp", cookie0).await;
    assert_eq!(
        udp["original_dst"],
        SocketAddr::new(remote.ip(), 5000).to_string()
    );
    let inbound = trace.wait_for("inbound_steered", cookie0).await;
    assert_eq!(inbound["direction"], "inbound");
    assert_eq!(inbound["dst"], SocketAddr::new(web0_ip, 15006).to_string());
    assert_eq!(inbound["original_dst"], to_app(web0_ip).to_string());
    assert_eq!(
        inbound["src"].as_str().unwrap().split(':').next(),
        Some(cluster.remote.addrs.v4.to_string().as_str())
    );
    let probe = trace.wait_for("probe_bypassed", cookie0).await;
    assert_eq!(
        probe["src"].as_str().unwrap().rsplit_once(':').unwrap().0,
        node_ip.to_string()
    );
    trace.wait_for("hbone", cookie0).await;
    let refused = trace.wait_for("no_listener", cookie1).await;
    assert_eq!(refused["original_dst"], to_app(web1_ip).to_string());
    let missing = trace.wait_for("orig_dst_missing", cookie0).await;
    assert_eq!(missing["original_dst"], Value::Null);
    // Only where ztunnel's outbound listener asks: an inbound connection's
    // local address is its original destination.
    let records = trace.records();
    let missing: Vec<&Value> = records
        .iter()
        .filter(|r| r["verdict"] == "orig_dst_missing")
        .collect();
    assert!(
        missing
            .iter()
            .all(|r| r["dst"] == SocketAddr::new(web0_ip, 15001).to_string()),
        "{missing:#?}"
    );
    assert!(
        trace
            .records()
            .iter()
            .all(|r| r["pod"].is_null() || r["pod"].is_string())
    );

    // Stopped, the reader closes the gate at once.
    assert!(trace.interrupt().success());
    assert_eq!(gate(&pins), TraceGate::default());

    // Filters: only what was asked for.
    let inbound_only = Trace::start(
        &pins,
        &["--direction", "inbound", "--verdict", "probe_bypassed"],
    );
    tokio::task::block_in_place(|| {
        assert!(connect(&web0.ns, remote, PATIENCE));
        assert!(connect(&cluster.remote.ns, to_app(web0_ip), PATIENCE));
        assert!(connect(&cluster.node, to_app(web0_ip), PATIENCE));
    });
    wait_until(
        || !inbound_only.lines.lock().unwrap().is_empty(),
        "the filtered trace to print",
    )
    .await;
    // A reader killed outright cannot clear the gate; the next one takes
    // over at once (its holder is gone), and the lease runs out anyway.
    let lines = inbound_only.lines.lock().unwrap().clone();
    assert!(
        lines
            .iter()
            .all(|l| l.contains(" inbound tcp ") && l.ends_with(" probe_bypassed")),
        "{lines:?}"
    );
    let killed_pid = inbound_only.proc.0.id();
    drop(inbound_only);
    assert_eq!(gate(&pins).reader_pid, killed_pid);
    let next = Trace::start(&pins, &["--json"]);
    assert_eq!(gate(&pins).reader_pid, next.proc.0.id());
    drop(next);
    let until = gate(&pins).until_ns;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert!(
        until <= monotonic_ns(),
        "a dead reader's lease must run out (until {until})"
    );

    // The counters: web-0's grew; web-1's refusals alone, each counted.
    let counted = status(&pins);
    let counters = |ip| pod_status(&counted, ip).unwrap()["counters"].clone();
    let web0_counters = counters(web0_ip);
    for name in [
        "outbound_redirected",
        "inbound_redirected",
        "dns_redirected",
        "probes_bypassed",
    ] {
        assert!(
            web0_counters[name].as_u64().unwrap() >= 1,
            "{name}: {web0_counters}"
        );
    }
    assert_eq!(web0_counters["inbound_no_listener"], 0, "{counted}");
    let mut web1_refused = zero.clone();
    web1_refused["inbound_no_listener"] = 3.into();
    assert_eq!(counters(web1_ip), web1_refused, "{counted}");
    // Node-wide, as before.
    assert_eq!(counted["counters"]["inbound_no_listener"], 3, "{counted}");
    let text = ambpf(&pins).arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("[outbound_redirected "), "{text}");
    let web1_row = text
        .lines()
        .find(|l| l.trim_start().starts_with("shop/web-1 "))
        .unwrap_or_else(|| panic!("no row of web-1 in {text}"));
    assert!(web1_row.contains("inbound_no_listener 3]"), "{web1_row}");
    let scraped = tokio::task::block_in_place(|| metrics(&cluster.node));
    let outbound = web0_counters["outbound_redirected"].as_u64().unwrap();
    for series in [
        format!(
            r#"ambpf_pod_connections_redirected_total{{namespace="shop",pod="web-0",direction="outbound"}} {outbound}"#
        ),
        r#"ambpf_pod_dns_redirected_total{namespace="shop",pod="web-0"}"#.to_owned(),
        r#"ambpf_pod_probes_bypassed_total{namespace="shop",pod="web-1"} 0"#.to_owned(),
        r#"ambpf_pod_inbound_refused_total{namespace="shop",pod="web-1",reason="no_listener"} 3"#
            .to_owned(),
        r#"ambpf_pod_inbound_refused_total{namespace="shop",pod="web-0",reason="no_listener"} 0"#
            .to_owned(),
        "ambpf_kernel_inbound_no_listener_total 3".to_owned(),
    ] {
        assert!(scraped.contains(&series), "{series} missing from {scraped}");
    }
    // The agent says so, once per report and pod, not per connection.
    let said = |log: &str| {
        log.lines()
            .filter(|l| l.contains("pod shop/web-1: ") && l.contains("inbound connections refused"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    wait_until(
        || !said(&std::fs::read_to_string(&log).unwrap()).is_empty(),
        "the agent to log web-1's refusals",
    )
    .await;
    // One line, unless a report fell between the three connections.
    let lines = said(&std::fs::read_to_string(&log).unwrap());
    let reported: u64 = lines
        .iter()
        .map(|l| {
            let count = l.split("pod shop/web-1: ").nth(1).unwrap();
            count.split(' ').next().unwrap().parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(reported, 3, "{lines:?}");
    assert!(lines.len() <= 2, "{lines:?}");

    // web-0 goes: its counters and its series go with it.
    std::fs::write(&pods_file, pods_json(&[(WEB1, "web-1", &web1.ns)])).unwrap();
    wait_until(
        || pod_status(&status(&pins), web0_ip).is_none(),
        "web-0 to be removed",
    )
    .await;
    for map in [maps::POD_COUNTERS, maps::POD_DROPS] {
        let entries = PerCpuKeys::read(&pins, map);
        assert_eq!(entries, vec![cookie1], "counters left behind in {map}");
    }
    let scraped = tokio::task::block_in_place(|| metrics(&cluster.node));
    assert!(!scraped.contains(r#"pod="web-0""#), "{scraped}");
    assert!(scraped.contains(r#"pod="web-1""#), "{scraped}");
    ztunnel.shutdown().await;
}

fn lost_records(pins: &Path) -> u64 {
    let data = MapData::from_pin(pins.join("maps").join(maps::TRACE_LOST)).unwrap();
    let array: aya::maps::PerCpuArray<_, u64> =
        aya::maps::PerCpuArray::try_from(Map::PerCpuArray(data)).unwrap();
    array.get(&0, 0).unwrap().iter().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reader_that_stops_reading_loses_records_and_slows_nothing() {
    let _serial = SERIAL.lock().await;
    let bpffs = BpffsMount::create().unwrap();
    let pins = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0];
    let dir = std::env::temp_dir().join(format!("ambpf-trace-{}", ambpf_testbed::unique_name("")));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let (socket, pods_file) = (dir.join("ztunnel.sock"), dir.join("pods.json"));
    std::fs::write(&pods_file, pods_json(&[(WEB0, "web-0", &pod.ns)])).unwrap();
    let _agent = common::agent::spawn_agent(
        &cluster.node,
        &pins,
        &socket,
        &pods_file,
        cgroup.path(),
        METRICS,
    );
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default());
    ztunnel
        .wait_until(|s| s.ready && s.workloads.contains_key(WEB0), PATIENCE)
        .await
        .unwrap();

    // Its output is never read: the pipe fills, it blocks writing, and the
    // ring buffer fills behind it.
    let (child, stdout) = Trace::spawn(&pins, &["--json"]);
    let _reader = Proc(child);
    assert_eq!(lost_records(&pins), 0);
    // Several times what the pipe and the ring buffer hold: every
    // connect() is decided (exempt, loopback) and refused, none waits.
    let refused = tokio::task::block_in_place(|| {
        pod.ns
            .run(|| {
                (0..8000)
                    .filter(|_| {
                        TcpStream::connect("127.0.0.1:1")
                            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
                    })
                    .count()
            })
            .unwrap()
    });
    assert_eq!(refused, 8000);
    let lost = lost_records(&pins);
    assert!(lost > 0, "the ring buffer never filled");
    // Read again, the reader reports what it lost.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut records = 0;
    let reported = loop {
        let line = rx.recv_timeout(PATIENCE).expect("no lost count reported");
        if line.contains("lost_records") {
            break serde_json::from_str::<Value>(&line).unwrap()["lost_records"].clone();
        }
        records += 1;
    };
    assert!(reported.as_u64().unwrap() > 0, "{reported}");
    assert!(records < 8000, "{records} records, none lost");
    ztunnel.shutdown().await;
}

/// The cookies that have per-pod counters, read from the pinned map.
struct PerCpuKeys;

impl PerCpuKeys {
    /// Both per-pod maps' values are 32 bytes.
    fn read(pins: &Path, name: &str) -> Vec<u64> {
        let data = MapData::from_pin(pins.join("maps").join(name)).unwrap();
        let map: aya::maps::PerCpuHashMap<_, u64, ambpf_common::PodCounters> =
            aya::maps::PerCpuHashMap::try_from(Map::PerCpuHashMap(data)).unwrap();
        map.keys().map(Result::unwrap).collect()
    }
}

fn monotonic_ns() -> u64 {
    ambpf::trace::gate::monotonic_ns()
}

#[test]
fn trace_without_the_ring_buffer_says_why() {
    let bpffs = BpffsMount::create().unwrap();
    // Nothing there at all.
    let nothing = ambpf(&bpffs.path().join("ambpf"))
        .arg("trace")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&nothing.stderr);
    assert!(!nothing.status.success());
    assert!(said.contains("no ambpf state at"), "{said}");
    // State from an agent that predates tracing: maps, no ring buffer.
    let older = bpffs.path().join("older");
    std::fs::create_dir_all(older.join("maps")).unwrap();
    let out = ambpf(&older).arg("trace").output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(said.contains("predates `ambpf trace`"), "{said}");
    // A bad filter names the valid values.
    let out = ambpf(&older)
        .args(["trace", "--verdict", "nope"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("dns_captured"),
        "{said}"
    );
}
