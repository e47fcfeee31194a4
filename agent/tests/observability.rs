//! Privileged: what a platform team reads from a real agent.
//!
//! - Its log lines, with `--log-format json`, are JSON objects, and a line
//!   about a pod carries the pod (`namespace/name`), its UID and its netns
//!   cookie.
//! - Its `/metrics` is a valid exposition: every family has HELP and TYPE,
//!   every sample belongs to a family, histogram buckets are cumulative
//!   and end in `_count`; values move with real work (pods enrolled,
//!   enrolment steps and ZDS acks observed, the per-pod counters); label
//!   values from pod names are escaped.
//! - Every metric the chart's Grafana dashboard queries is exported.
//! - A log format or filter that does not parse stops the agent at once.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
};

use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard,
    cluster::Cluster,
    ztunnel::{ZtunnelConfig, ZtunnelDouble},
};
use serde_json::Value;

mod common;
use common::agent::{Proc, TempDir, serve_echo, wait_for};

const METRICS: &str = "127.0.0.1:15014";
/// A pod name with every character the exposition format escapes, and
/// UTF-8 (the pods file takes any string; the API server would not).
const ODD_NAME: &str = "we\"b\\0\nü";

fn scrape(node: &NetnsGuard) -> String {
    node.run(|| {
        let mut conn = TcpStream::connect(METRICS).unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_owned()
    })
    .unwrap()
}

/// A parsed exposition: each family's type, and every sample.
#[derive(Debug, Default)]
struct Exposition {
    types: BTreeMap<String, String>,
    helps: BTreeSet<String>,
    /// (name, labels as written, value).
    samples: Vec<(String, String, f64)>,
}

impl Exposition {
    /// Parses `text`, checking it as it goes.
    fn parse(text: &str) -> Self {
        let mut out = Exposition::default();
        assert_eq!(text.lines().last(), Some("# EOF"), "no # EOF");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                out.helps.insert(rest.split(' ').next().unwrap().to_owned());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(
                    out.types.insert(name.to_owned(), kind.to_owned()).is_none(),
                    "{name} declared twice"
                );
            } else if line.starts_with('#') {
                assert!(line == "# EOF" || line.starts_with("# UNIT "), "{line}");
            } else {
                // name{labels} value: the labels may hold spaces and braces
                // (escaped quotes only), the value never does.
                let (series, value) = line.rsplit_once(' ').unwrap();
                let (name, labels) = match series.split_once('{') {
                    Some((name, labels)) => (name, labels.strip_suffix('}').unwrap()),
                    None => (series, ""),
                };
                let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
                out.samples
                    .push((name.to_owned(), labels.to_owned(), value));
            }
        }
        for family in out.types.keys() {
            assert!(out.helps.contains(family), "{family} has no HELP");
        }
        for (name, _, _) in &out.samples {
            assert!(out.family_of(name).is_some(), "{name} belongs to no family");
        }
        out.check_histograms();
        out
    }

    /// The family a sample name belongs to.
    fn family_of(&self, sample: &str) -> Option<&str> {
        let suffixes: &[&str] = &[
            "", "_total", "_bucket", "_sum", "_count", "_created", "_info",
        ];
        suffixes.iter().find_map(|suffix| {
            let family = sample.strip_suffix(suffix)?;
            self.types.get_key_value(family).map(|(k, _)| k.as_str())
        })
    }

    /// Buckets rise with `le` and the `+Inf` bucket is the count.
    fn check_histograms(&self) {
        for (family, _) in self.types.iter().filter(|(_, kind)| *kind == "histogram") {
            let bucket = format!("{family}_bucket");
            let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
            for (name, labels, value) in &self.samples {
                if *name != bucket {
                    continue;
                }
                let mut pairs = parse_labels(labels);
                let at = pairs.iter().position(|(k, _)| k == "le").unwrap();
                let (_, le) = pairs.remove(at);
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse()
                        .unwrap_or_else(|_| panic!("le {le:?} in {labels}"))
                };
                series
                    .entry(format!("{pairs:?}"))
                    .or_default()
                    .push((le, *value));
            }
            for (labels, buckets) in series {
                assert!(
                    buckets
                        .windows(2)
                        .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
                    "{family}{{{labels}}} buckets not cumulative: {buckets:?}"
                );
                let (last_le, last) = *buckets.last().unwrap();
                assert!(last_le.is_infinite(), "{family}{{{labels}}} has no +Inf");
                let count = self
                    .samples
                    .iter()
                    .find(|(n, l, _)| {
                        *n == format!("{family}_count")
                            && format!("{:?}", parse_labels(l)) == labels
                    })
                    .map(|s| s.2);
                assert_eq!(
                    Some(last),
                    count,
                    "{family}{{{labels}}}: +Inf bucket vs count"
                );
            }
        }
    }

    fn value(&self, name: &str, labels: &str) -> Option<f64> {
        self.samples
            .iter()
            .find(|(n, l, _)| n == name && l == labels)
            .map(|s| s.2)
    }

    /// The sum of `name`'s samples whose labels contain `having`.
    fn sum(&self, name: &str, having: &str) -> f64 {
        self.samples
            .iter()
            .filter(|(n, l, _)| n == name && l.contains(having))
            .map(|s| s.2)
            .sum()
    }
}

/// `k="v",..` as (key, unescaped value) pairs.
fn parse_labels(labels: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = labels.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "{labels}");
        let mut value = String::new();
        loop {
            match chars
                .next()
                .unwrap_or_else(|| panic!("unterminated: {labels}"))
            {
                '"' => break,
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c @ ('\\' | '"')) => value.push(c),
                    other => panic!("bad escape {other:?} in {labels}"),
                },
                '\n' => panic!("raw newline in {labels}"),
                c => value.push(c),
            }
        }
        pairs.push((key, value));
        match chars.next() {
            None | Some(',') => {}
            other => panic!("{other:?} after a label in {labels}"),
        }
    }
    pairs
}

/// The metric names the dashboard's queries read.
fn dashboard_metrics() -> BTreeSet<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/ambpf/dashboards/ambpf.json"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut word = String::new();
            for c in expr.chars().chain([' ']) {
                if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                    word.push(c);
                    continue;
                }
                if word.starts_with("ambpf_") || word.starts_with("process_") {
                    names.insert(std::mem::take(&mut word));
                }
                word.clear();
            }
        }
    }
    assert!(names.len() >= 10, "{names:?}");
    names
}

fn pods_json(pods: &[(&str, &str, &NetnsGuard)]) -> String {
    let entries: Vec<Value> = pods
        .iter()
        .map(|(uid, name, ns)| {
            serde_json::json!({
                "uid": uid, "name": name, "namespace": "shop",
                "netns": ns.path().display().to_string(),
            })
        })
        .collect();
    serde_json::json!({ "pods": entries }).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_agent_logs_pod_fields_as_json_and_exports_a_valid_exposition() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(2).unwrap();
    let (web0, odd) = (&cluster.pods[0], &cluster.pods[1]);
    let dir = std::env::temp_dir().join(ambpf_testbed::unique_name("ambpf-observability-"));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let (socket, pods_file, log) = (
        dir.join("ztunnel.sock"),
        dir.join("pods.json"),
        dir.join("agent.log"),
    );
    std::fs::write(&pods_file, pods_json(&[])).unwrap();
    let mut command = common::agent::agent_command(
        &cluster.node,
        &pins,
        &socket,
        &pods_file,
        cgroup.path(),
        METRICS,
    );
    command
        .args([
            "--log-format",
            "json",
            "--log-level",
            "info,ambpf::zds=debug",
        ])
        .stderr(std::fs::File::create(&log).unwrap());
    let _agent = Proc(command.spawn().unwrap());
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default());
    if let Err(e) = ztunnel
        .wait_until(|s| s.ready, common::agent::AGENT_PATIENCE)
        .await
    {
        panic!(
            "ztunnel not ready ({e:?}); the agent said:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    // No pods yet.
    let before = Exposition::parse(&tokio::task::block_in_place(|| scrape(&cluster.node)));
    assert_eq!(
        before.value("ambpf_pods_enrolled", "mode=\"ebpf\""),
        Some(0.0)
    );

    // Two pods, one with a name the exposition must escape.
    let web0_uid = "web-0-uid";
    std::fs::write(
        &pods_file,
        pods_json(&[
            (web0_uid, "web-0", &web0.ns),
            ("odd-uid", ODD_NAME, &odd.ns),
        ]),
    )
    .unwrap();
    wait_for(
        || {
            tokio::task::block_in_place(|| scrape(&cluster.node))
                .contains("ambpf_pods_enrolled{mode=\"ebpf\"} 2")
        },
        "two pods enrolled",
    )
    .await;
    ztunnel
        .wait_until(|s| s.workloads.len() == 2, common::agent::AGENT_PATIENCE)
        .await
        .unwrap();
    // Work the per-pod counters: web-0 connects out (redirected to ztunnel).
    let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), 8080);
    serve_echo(&cluster.remote.ns, remote);
    let _ = web0
        .ns
        .run(|| TcpStream::connect_timeout(&remote, std::time::Duration::from_secs(5)));

    // The maps' entries are counted every 15 s (off the scrape): wait for
    // a count after the enrolment.
    let mut text = tokio::task::block_in_place(|| scrape(&cluster.node));
    let moved = |text: &str| {
        let after = Exposition::parse(text);
        after.sum("ambpf_map_entries", "map=\"ambpf_pods\"")
            > before.sum("ambpf_map_entries", "map=\"ambpf_pods\"")
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !moved(&text) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        text = tokio::task::block_in_place(|| scrape(&cluster.node));
    }
    let after = Exposition::parse(&text);
    for (name, having) in [
        ("ambpf_enrol_duration_seconds_count", "mode=\"ebpf\""),
        ("ambpf_zds_ack_duration_seconds_count", "message=\"add\""),
        ("ambpf_zds_adds_acked_total", ""),
        ("ambpf_map_entries", "map=\"ambpf_pods\""),
        ("process_cpu_seconds_total", ""),
        ("process_resident_memory_bytes", ""),
    ] {
        assert!(
            after.sum(name, having) > before.sum(name, having),
            "{name}{{{having}}} did not move: {} then {}",
            before.sum(name, having),
            after.sum(name, having)
        );
    }
    assert!(after.sum("ambpf_map_capacity", "map=\"ambpf_pods\"") >= 2.0);
    assert_eq!(
        after.value(
            "ambpf_pod_connections_redirected_total",
            "namespace=\"shop\",pod=\"web-0\",direction=\"outbound\""
        ),
        Some(1.0),
        "{text}"
    );
    // Quotes, backslashes and newlines escaped; UTF-8 as it is.
    let escaped = r#"namespace="shop",pod="we\"b\\0\nü""#;
    assert_eq!(
        after.value("ambpf_pod_dns_redirected_total", escaped),
        Some(0.0),
        "{text}"
    );

    // The dashboard cannot drift: every metric it reads is exported.
    for metric in dashboard_metrics() {
        assert!(
            after.family_of(&metric).is_some(),
            "the dashboard queries {metric}, which the agent does not export"
        );
    }

    // The log: JSON lines, and the enrolment of web-0 with its fields.
    let log = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    let cookie = |span: &Value| span["netns_cookie"].as_u64();
    let about_web0: Vec<&Value> = lines
        .iter()
        .filter(|l| l["span"]["pod"] == "shop/web-0")
        .collect();
    let enrol = about_web0
        .iter()
        .find(|l| l["span"]["name"] == "enrol")
        .unwrap_or_else(|| panic!("no enrol line about web-0 in {log}"));
    assert_eq!(enrol["span"]["uid"], web0_uid, "{enrol}");
    assert!(cookie(&enrol["span"]).is_some_and(|c| c != 0), "{enrol}");
    assert!(
        enrol["level"].is_string() && enrol["message"].is_string(),
        "{enrol}"
    );
    let odd_line = lines
        .iter()
        .find(|l| l["span"]["pod"] == format!("shop/{ODD_NAME}"))
        .unwrap_or_else(|| panic!("no line about {ODD_NAME:?} in {log}"));
    assert_eq!(odd_line["span"]["uid"], "odd-uid");
    ztunnel.shutdown().await;
}

#[test]
fn a_log_format_or_filter_that_does_not_parse_stops_the_agent() {
    let ambpf = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ambpf"));
        command.stdout(Stdio::null()).env_remove("RUST_LOG");
        command
    };
    let fails = |command: &mut Command, says: &str| {
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{command:?} succeeded");
        assert!(stderr.contains(says), "{command:?}: {stderr}");
    };
    fails(
        ambpf().args(["--log-format", "xml", "version"]),
        "invalid value 'xml' for '--log-format",
    );
    fails(
        ambpf().args(["--log-level", "ambpf::zds=loud", "version"]),
        "invalid value 'ambpf::zds=loud' for '--log-level",
    );
    fails(
        ambpf().env("RUST_LOG", "ambpf=loud").arg("version"),
        "RUST_LOG \"ambpf=loud\" is not a log filter",
    );
    // The flag wins over RUST_LOG, which is then not read.
    let out = ambpf()
        .env("RUST_LOG", "ambpf=loud")
        .args(["--log-level", "debug", "version"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
