//! Health, readiness and Prometheus metrics.
//!
//! - `/healthz`: the agent is running.
//! - `/readyz`: ready once a ztunnel has acked a full snapshot (as Istio's
//!   node agent reports ready), 503 before.
//! - `/metrics`: a prometheus-client [`Registry`]. The counters and gauges
//!   the agent keeps (controller, ZDS, CNI endpoint) are registered as
//!   they are, with the latency histograms ([`crate::metrics`]) and the
//!   process metrics; what the kernel programs keep in pinned maps
//!   (redirection counters, per-pod counters, map fill) is read at scrape
//!   time by [`PinsCollector`], so it survives agent restarts.
//!
//! Served by the agent's small HTTP/1.1 responder ([`crate::http`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        MetricType, counter::ConstCounter, counter::Counter, family::Family, gauge::ConstGauge,
        gauge::Gauge,
    },
    registry::Registry,
};
use tokio::{io::AsyncWriteExt, net::TcpListener};
use tracing::{debug, warn};

use crate::{
    bpf::{PinLayout, inspect, pod_counters::PodCounts},
    cni::CniStats,
    metrics::Labels,
    redirect::{EnrolSteps, RedirectMode, ViolationKind},
    zds::{ZdsHandle, ZdsStats},
};

/// Not Istio's node agent's :8000 and :15014: both agents run on a node
/// that moves from Istio's to ambpf's, each on the node's network.
pub const DEFAULT_HEALTH_LISTEN: &str = "0.0.0.0:15016";
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:15015";

/// What the controller counts, registered as it is.
#[derive(Debug, Default)]
pub struct ControllerStats {
    /// Pods whose redirection is in place, by `mode`.
    pub pods_enrolled: Family<Labels<1>, Gauge>,
    pub enroll_failures: Counter,
    pub pods_removed: Counter,
    /// Addresses claimed by two live pods (the newer took it).
    pub address_conflicts: Counter,
    /// Violations the state checks found, by `kind`.
    pub state_violations: Family<Labels<1>, Counter>,
    /// `(namespace, name)` of each pod this agent enrolled, by netns cookie:
    /// the labels of the per-pod series.
    pub pod_names: Mutex<HashMap<u64, (String, String)>>,
}

/// A redirection mode's `mode` label.
pub fn mode_name(mode: RedirectMode) -> &'static str {
    mode.name()
}

impl ControllerStats {
    pub fn record_enrol_steps(&self, mode: RedirectMode, steps: &EnrolSteps) {
        let histograms = crate::metrics::histograms();
        for (step, took) in &steps.0 {
            histograms.observe_enrol(mode_name(mode), step, *took);
        }
    }

    pub fn set_enrolled(&self, mode: RedirectMode, pods: usize) {
        self.pods_enrolled
            .get_or_create(&[("mode", mode_name(mode))])
            .set(pods as i64);
    }

    pub fn count_violation(&self, kind: ViolationKind) {
        self.state_violations
            .get_or_create(&[("kind", kind.as_str())])
            .inc();
    }

    /// Violations of `kind` found so far.
    pub fn violations(&self, kind: ViolationKind) -> u64 {
        self.state_violations
            .get_or_create(&[("kind", kind.as_str())])
            .get()
    }

    fn register(&self, registry: &mut Registry) {
        // Every kind from the start, so that an alert on a rate sees zero.
        for kind in ViolationKind::ALL {
            let _ = self
                .state_violations
                .get_or_create(&[("kind", kind.as_str())]);
        }
        registry.register(
            "pods_enrolled",
            "Pods whose traffic is redirected to ztunnel, by redirection mode",
            self.pods_enrolled.clone(),
        );
        registry.register(
            "pod_enroll_failures",
            "Attempts to enrol a pod that failed (retried)",
            self.enroll_failures.clone(),
        );
        registry.register(
            "pods_removed",
            "Pods removed from the redirection",
            self.pods_removed.clone(),
        );
        registry.register(
            "address_conflicts",
            "Addresses claimed by two live pods at once (the newer pod owns the address)",
            self.address_conflicts.clone(),
        );
        registry.register(
            "state_violations",
            "Inconsistencies the agent's state checks found, by kind (each is logged, and \
             repaired where possible)",
            self.state_violations.clone(),
        );
    }
}

/// Everything `/metrics` reports.
#[derive(Debug)]
pub struct AgentCollector {
    pub zds: ZdsHandle,
    pub controller: Arc<ControllerStats>,
    /// Pins of the eBPF mode's maps (none in iptables mode).
    pub pins: Option<PinLayout>,
    /// The CNI endpoint's answers (none without `--cni-socket`).
    pub cni: Option<Arc<CniStats>>,
}

/// A registry with every metric: ambpf's prefixed `ambpf_`, the process'
/// `process_`.
pub fn registry(collector: AgentCollector) -> Registry {
    let mut root = Registry::default();
    root.register_collector(Box::new(crate::metrics::ProcessCollector));
    let registry = root.sub_registry_with_prefix("ambpf");
    let info = crate::build_info::current();
    let build_info = Family::<Labels<3>, Gauge>::default();
    build_info
        .get_or_create(&[
            ("version", info.version),
            ("git_commit", info.git_commit),
            ("bpf_object_sha256", info.bpf_object_sha256.as_str()),
        ])
        .set(1);
    registry.register(
        "build_info",
        "This agent's build: crate version, git commit and the digest of its BPF object \
         (always 1)",
        build_info,
    );
    collector.controller.register(registry);
    collector.zds.stats().register(registry);
    if let Some(cni) = &collector.cni {
        cni.register(registry);
    }
    crate::metrics::histograms().register(registry);
    if let Some(pins) = collector.pins {
        registry.register_collector(Box::new(PinsCollector {
            map_fill: MapFill::start(pins.clone()),
            pins,
            controller: collector.controller,
        }));
    }
    root
}

/// What the kernel programs keep in the pinned maps, read at each scrape
/// (the maps' entries excepted: [`MapFill`]).
#[derive(Debug)]
pub struct PinsCollector {
    pins: PinLayout,
    controller: Arc<ControllerStats>,
    map_fill: Arc<MapFill>,
}

/// How often the maps' entries are counted.
pub const MAP_FILL_PERIOD: Duration = Duration::from_secs(15);

/// The pinned maps' entries, counted by a thread of their own every
/// [`MAP_FILL_PERIOD`] rather than at each scrape: counting walks every
/// key, one syscall each, and two full 65,536-entry LRU maps take about
/// 0.2 s of CPU, which a scrape should not wait for.
#[derive(Debug, Default)]
pub struct MapFill {
    counted: Mutex<Option<(std::time::Instant, Vec<FilledMap>)>>,
}

/// A hash or LRU map's name, entries and capacity.
#[derive(Clone, Debug)]
struct FilledMap {
    name: String,
    entries: u64,
    capacity: u32,
}

impl MapFill {
    fn start(pins: PinLayout) -> Arc<Self> {
        let fill = Arc::new(Self::default());
        let counting = fill.clone();
        let spawned = std::thread::Builder::new()
            .name("map-fill".to_owned())
            .spawn(move || {
                loop {
                    counting.count(&pins);
                    std::thread::sleep(MAP_FILL_PERIOD);
                }
            });
        if let Err(e) = spawned {
            warn!("metrics: no thread to count the maps' entries: {e}");
        }
        fill
    }

    fn count(&self, pins: &PinLayout) {
        match inspect::read_maps(pins) {
            Ok(maps) => {
                let maps = maps
                    .into_iter()
                    .filter(|m| m.fills)
                    .map(|m| FilledMap {
                        name: m.name,
                        entries: m.entries,
                        capacity: m.max_entries,
                    })
                    .collect();
                *self.counted.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((std::time::Instant::now(), maps))
            }
            Err(e) => warn!("metrics: reading the maps' entries: {e}"),
        }
    }

    /// The last count and its age; counted now if there is none yet.
    fn last(&self, pins: &PinLayout) -> Option<(Duration, Vec<FilledMap>)> {
        let read = || {
            let counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
            counted
                .as_ref()
                .map(|(at, maps)| (at.elapsed(), maps.clone()))
        };
        read().or_else(|| {
            self.count(pins);
            read()
        })
    }
}

fn family<'a>(
    encoder: &'a mut DescriptorEncoder,
    name: &'a str,
    help: &'a str,
    metric_type: MetricType,
) -> Result<prometheus_client::encoding::MetricEncoder<'a>, std::fmt::Error> {
    encoder.encode_descriptor(name, help, None, metric_type)
}

impl Collector for PinsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pins = &self.pins;
        match inspect::read_counters(pins) {
            Ok(kernel) => {
                for (name, value) in kernel {
                    let help = "Redirection events counted by the kernel programs.";
                    let name = format!("kernel_{name}");
                    let metric = ConstCounter::new(value);
                    metric.encode(family(&mut encoder, &name, help, MetricType::Counter)?)?;
                }
            }
            Err(e) => warn!("metrics: reading the kernel counters: {e}"),
        }
        match crate::bpf::capacity::read_misses(pins) {
            Ok(misses) => {
                let help = "Redirected connections whose original destination was missing \
                            when asked for (evicted from the full LRU maps, or never stored), \
                            by reason (docs/operations.md, \"Map capacities\").";
                let mut family = family(&mut encoder, "origdst_misses", help, MetricType::Counter)?;
                for (miss, value) in misses {
                    ConstCounter::new(value)
                        .encode(family.encode_family(&[("reason", miss.name())])?)?;
                }
            }
            Err(e) => warn!("metrics: reading the original-destination misses: {e}"),
        }
        if let Some((age, maps)) = self.map_fill.last(pins) {
            encode_map_fill(&mut encoder, &maps, age)?;
        }
        match crate::bpf::pod_counters::read(pins) {
            Ok(counters) => {
                let names = self
                    .controller
                    .pod_names
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                encode_pod_counters(&mut encoder, &counters, &names)?;
            }
            Err(e) => warn!("metrics: reading the per-pod counters: {e}"),
        }
        Ok(())
    }
}

/// Each hash or LRU map's entries and capacity (`ambpf_map_entries /
/// ambpf_map_capacity`: how full it is), and how old the count is.
fn encode_map_fill(
    encoder: &mut DescriptorEncoder,
    maps: &[FilledMap],
    age: Duration,
) -> Result<(), std::fmt::Error> {
    for (name, help, value) in [
        (
            "map_entries",
            "Entries in each pinned hash or LRU map, counted every 15 s (not at the scrape; \
             ambpf_map_entries_age_seconds is the count's age).",
            (|m: &FilledMap| m.entries) as fn(&FilledMap) -> u64,
        ),
        (
            "map_capacity",
            "Capacity (max_entries) of each pinned hash or LRU map.",
            |m| u64::from(m.capacity),
        ),
    ] {
        let mut family = family(encoder, name, help, MetricType::Gauge)?;
        for map in maps {
            ConstGauge::new(value(map) as i64)
                .encode(family.encode_family(&[("map", map.name.as_str())])?)?;
        }
    }
    ConstGauge::new(age.as_secs_f64()).encode(family(
        encoder,
        "map_entries_age_seconds",
        "Seconds since ambpf_map_entries was counted.",
        MetricType::Gauge,
    )?)?;
    Ok(())
}

/// One series per enrolled pod (and direction, or reason) that this agent
/// knows by name; a pod's series go with its map entry, when it is removed.
/// The counts are [`crate::bpf::pod_counters::read`]'s, as `ambpf status`
/// shows them.
fn encode_pod_counters(
    encoder: &mut DescriptorEncoder,
    counters: &HashMap<u64, PodCounts>,
    names: &HashMap<u64, (String, String)>,
) -> Result<(), std::fmt::Error> {
    let mut pods: Vec<_> = counters
        .iter()
        .filter_map(|(cookie, counts)| Some((names.get(cookie)?, *counts)))
        .collect();
    pods.sort_by(|a, b| a.0.cmp(b.0));
    /// A series of a family: its extra label (none if the name is empty),
    /// the label's value and its count.
    type Series = (&'static str, &'static str, fn(&PodCounts) -> u64);
    let families: [(&str, &str, &[Series]); 4] = [
        (
            "pod_connections_redirected",
            "Connections of the pod sent to ztunnel, by direction.",
            &[
                ("direction", "outbound", |c| c.counters.outbound_redirected),
                ("direction", "inbound", |c| c.counters.inbound_redirected),
            ],
        ),
        (
            "pod_dns_redirected",
            "DNS of the pod sent to ztunnel's DNS proxy (UDP queries, TCP connections).",
            &[("", "", |c| c.counters.dns_redirected)],
        ),
        (
            "pod_probes_bypassed",
            "Connections from the node's own addresses (kubelet probes) let through to the pod.",
            &[("", "", |c| c.counters.probes_bypassed)],
        ),
        (
            "pod_inbound_refused",
            "Inbound connections to the pod refused (the client gets an RST), by reason: \
             no_listener, ztunnel's 15006 listener is not open in the pod. Refusals for a \
             local address no pod was enrolled with name no pod: \
             ambpf_kernel_inbound_unknown_address_total.",
            &[("reason", "no_listener", |c| c.drops.inbound_no_listener)],
        ),
    ];
    for (name, help, series) in families {
        let mut family = family(encoder, name, help, MetricType::Counter)?;
        for ((namespace, pod), counts) in &pods {
            for (label, label_value, value) in series.iter() {
                let metric = ConstCounter::new(value(counts));
                let labels: &[(&str, &str)] = if label.is_empty() {
                    &[("namespace", namespace), ("pod", pod)]
                } else {
                    &[("namespace", namespace), ("pod", pod), (label, label_value)]
                };
                metric.encode(family.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

/// Serves `/metrics` from `registry` on a thread and runtime of its own:
/// a scrape is answered while the runtime's workers are busy with pod
/// events and enrolment (a pass over 1,000 pods holds a worker for tens of
/// milliseconds). Returns if that thread cannot run.
pub async fn serve_metrics(listener: TcpListener, registry: Arc<Registry>) {
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(e) => {
            warn!("metrics: cannot hand the listener to its thread: {e}");
            return;
        }
    };
    let (stopped_tx, stopped) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("metrics".to_owned())
        .spawn(move || {
            let _stopped = stopped_tx;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let served = runtime.map(|runtime| {
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener)?;
                    let encoder = MetricsEncoder::new(registry);
                    serve(listener, move |path| match path {
                        "/metrics" => encoder.encode(),
                        _ => (404, "text/plain", "not found\n".to_owned()),
                    })
                    .await;
                    Ok::<(), std::io::Error>(())
                })
            });
            if let Err(e) = served.and_then(|served| served) {
                warn!("metrics: not served: {e}");
            }
        });
    match spawned {
        Ok(_) => {
            let _ = stopped.await;
        }
        Err(e) => warn!("metrics: no thread to serve them: {e}"),
    }
}

/// Encodes the registry, sizing each answer by the last one: the text of
/// 1,000 pods' series is about half a megabyte, and growing a buffer to
/// that by doubling on every scrape leaves the heap fragmented.
struct MetricsEncoder {
    registry: Arc<Registry>,
    last_len: std::sync::atomic::AtomicUsize,
}

impl MetricsEncoder {
    fn new(registry: Arc<Registry>) -> Self {
        Self {
            registry,
            last_len: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn encode(&self) -> (u16, &'static str, String) {
        use std::sync::atomic::Ordering::Relaxed;
        let last = self.last_len.load(Relaxed);
        let mut body = String::with_capacity(last + last / 8);
        match prometheus_client::encoding::text::encode(&mut body, &self.registry) {
            Ok(()) => {
                self.last_len.store(body.len(), Relaxed);
                (
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    body,
                )
            }
            Err(_) => (500, "text/plain", "encoding failed\n".to_owned()),
        }
    }
}

/// Serves `/healthz` and `/readyz`: ready while the pod source (when there
/// is one) serves and once ztunnel has acked a snapshot.
pub async fn serve_health(
    listener: TcpListener,
    zds: ZdsHandle,
    source: Option<crate::sources::kube::SourceHealth>,
    standby: crate::zds::peer::Standby,
) {
    let not_serving = move || {
        source
            .as_ref()
            .and_then(|s| s.not_ready())
            .or_else(|| standby.why())
    };
    serve(listener, move |path| match (path, not_serving()) {
        ("/healthz", _) => (200, "text/plain", "ok\n".to_owned()),
        ("/readyz", Some(why)) => (503, "text/plain", format!("{why}\n")),
        ("/readyz", None) if ZdsStats::get(&zds.stats().snapshots_acked) > 0 => {
            (200, "text/plain", "ready\n".to_owned())
        }
        ("/readyz", None) => (
            503,
            "text/plain",
            "waiting for ztunnel to ack a snapshot\n".to_owned(),
        ),
        _ => (404, "text/plain", "not found\n".to_owned()),
    })
    .await
}

/// Largest health or metrics request accepted: a GET has no body.
const MAX_REQUEST: usize = 2048;

/// Answers each GET with `respond(path)` and closes the connection.
async fn serve<F>(listener: TcpListener, respond: F)
where
    F: Fn(&str) -> (u16, &'static str, String) + Send + Sync + 'static,
{
    let respond = Arc::new(respond);
    loop {
        let (mut conn, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!("http accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let respond = respond.clone();
        tokio::spawn(async move {
            // Slow or malformed requests are dropped.
            let read = crate::http::read_request(&mut conn, MAX_REQUEST);
            let request = match tokio::time::timeout(Duration::from_secs(5), read).await {
                Ok(Ok(request)) => request,
                _ => {
                    debug!("http: dropped an incomplete request from {peer}");
                    return;
                }
            };
            let (status, content_type, body) = match request.method.as_str() {
                "GET" => respond(&request.path),
                _ => (405, "text/plain", "only GET\n".to_owned()),
            };
            let head = crate::http::response_head(status, content_type, body.len());
            if conn.write_all(head.as_bytes()).await.is_ok() {
                let _ = conn.write_all(body.as_bytes()).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt as _;

    use super::*;
    use crate::zds::ZdsConfig;

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).await.unwrap();
        response
    }

    #[tokio::test]
    async fn readiness_waits_for_an_acked_snapshot_and_metrics_report_zds() {
        let zds = ZdsHandle::new(ZdsConfig::default());
        let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (health_addr, metrics_addr) =
            (health.local_addr().unwrap(), metrics.local_addr().unwrap());
        let controller = Arc::new(ControllerStats::default());
        controller.set_enrolled(RedirectMode::Ebpf, 3);
        controller.address_conflicts.inc();
        for _ in 0..4 {
            controller.count_violation(ViolationKind::AddressMissing);
        }
        let cni = Arc::new(CniStats::default());
        cni.skipped.inc_by(2);
        let registry = Arc::new(registry(AgentCollector {
            zds: zds.clone(),
            controller,
            pins: None,
            cni: Some(cni),
        }));
        tokio::spawn(serve_health(health, zds.clone(), None, Default::default()));
        tokio::spawn(serve_metrics(metrics, registry));

        assert!(
            get(health_addr, "/healthz")
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(
            get(health_addr, "/readyz")
                .await
                .starts_with("HTTP/1.1 503")
        );
        assert!(get(health_addr, "/nope").await.starts_with("HTTP/1.1 404"));

        let body = get(metrics_addr, "/metrics").await;
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(
            body.contains(r#"ambpf_pods_enrolled{mode="ebpf"} 3"#),
            "{body}"
        );
        assert!(body.contains("ambpf_zds_nacks_total 0"), "{body}");
        assert!(body.contains("ambpf_cni_adds_skipped_total 2"), "{body}");
        assert!(body.contains("ambpf_cni_adds_refused_total 0"), "{body}");
        assert!(body.contains("ambpf_address_conflicts_total 1"), "{body}");
        assert!(
            body.contains(r#"ambpf_state_violations_total{kind="address_missing"} 4"#),
            "{body}"
        );
        assert!(
            body.contains(r#"ambpf_state_violations_total{kind="steering_orphan"} 0"#),
            "{body}"
        );
        let info = crate::build_info::current();
        let build_info = format!(
            r#"ambpf_build_info{{version="{}",git_commit="{}",bpf_object_sha256="{}"}} 1"#,
            info.version, info.git_commit, info.bpf_object_sha256
        );
        assert!(body.contains(&build_info), "{build_info} in {body}");
        assert!(body.contains("# EOF"), "{body}");
        // The registry ends each HELP with a period of its own.
        let doubled: Vec<&str> = body
            .lines()
            .filter(|l| l.starts_with("# HELP ") && l.ends_with(".."))
            .collect();
        assert!(doubled.is_empty(), "{doubled:#?}");

        // A ztunnel connects and acks the (empty) snapshot: now ready.
        use ambpf_proto::{Message as _, zds as proto};
        let dir = std::env::temp_dir().join(format!("ambpf-observe-{}", std::process::id()));
        let socket = dir.join("ztunnel.sock");
        let server = ZdsHandle::new(ZdsConfig {
            socket: socket.clone(),
            ..ZdsConfig::default()
        });
        let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let health_addr = health.local_addr().unwrap();
        let source = crate::sources::kube::SourceHealth::new();
        tokio::spawn(serve_health(
            health,
            server.clone(),
            Some(source.clone()),
            Default::default(),
        ));
        tokio::spawn(
            server
                .clone()
                .serve_on(crate::zds::listener::bind(&socket).unwrap()),
        );
        assert!(
            get(health_addr, "/readyz")
                .await
                .starts_with("HTTP/1.1 503")
        );
        let peer = tokio_seqpacket::UnixSeqpacket::connect(&socket)
            .await
            .unwrap();
        peer.send(&proto::ZdsHello::v1().encode_to_vec())
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = peer.recv(&mut buf).await.unwrap().bytes_read();
        assert_eq!(
            proto::WorkloadRequest::decode(&buf[..n]).unwrap(),
            proto::WorkloadRequest::snapshot_sent()
        );
        peer.send(&proto::WorkloadResponse::ack("").encode_to_vec())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), server.snapshot_acked())
            .await
            .unwrap();
        // Not while the pod source cannot serve, whatever ztunnel did.
        let waiting = get(health_addr, "/readyz").await;
        assert!(waiting.starts_with("HTTP/1.1 503"), "{waiting}");
        assert!(waiting.contains("waiting for the first list"), "{waiting}");
        source.recover(crate::sources::kube::health::START);
        assert!(
            get(health_addr, "/readyz")
                .await
                .starts_with("HTTP/1.1 200")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
