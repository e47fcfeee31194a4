//! Health, readiness and Prometheus metrics.
//!
//! - `/healthz`: the agent is running.
//! - `/readyz`: ready once a ztunnel has acked a full snapshot (as Istio's
//!   node agent reports ready), 503 before.
//! - `/metrics`: pods enrolled, ZDS connections, acks, NACKs and timeouts,
//!   and the redirection counters the kernel programs keep (read from the
//!   pinned map at scrape time, so they survive agent restarts).
//!
//! Served by the agent's small HTTP/1.1 responder ([`crate::http`]).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use log::{debug, warn};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use tokio::{io::AsyncWriteExt, net::TcpListener};

use crate::{
    bpf::{PinLayout, inspect},
    cni::CniStats,
    redirect::{EnrolSteps, ViolationKind},
    zds::{ZdsHandle, ZdsStats},
};

/// Istio's node agent serves health on :8000 and metrics on :15014.
pub const DEFAULT_HEALTH_LISTEN: &str = "0.0.0.0:8000";
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:15014";

/// Counters the controller keeps for metrics.
#[derive(Debug, Default)]
pub struct ControllerStats {
    pub pods_enrolled: AtomicU64,
    pub enroll_failures: AtomicU64,
    pub pods_removed: AtomicU64,
    /// Addresses claimed by two live pods (the newer took it).
    pub address_conflicts: AtomicU64,
    /// Violations the state checks found, by [`ViolationKind::index`].
    pub state_violations: [AtomicU64; ViolationKind::ALL.len()],
    /// Enrolment time by step ([`EnrolSteps`]): (times, total seconds).
    pub enrol_steps: std::sync::Mutex<std::collections::BTreeMap<&'static str, (u64, f64)>>,
    /// `(namespace, name)` of each pod this agent enrolled, by netns cookie:
    /// the labels of the per-pod series.
    pub pod_names: std::sync::Mutex<std::collections::HashMap<u64, (String, String)>>,
}

impl ControllerStats {
    pub fn record_enrol_steps(&self, steps: &EnrolSteps) {
        let mut totals = self.enrol_steps.lock().unwrap_or_else(|p| p.into_inner());
        for (step, took) in &steps.0 {
            let total = totals.entry(step).or_default();
            total.0 += 1;
            total.1 += took.as_secs_f64();
        }
    }
}

/// Everything `/metrics` reports, gathered at scrape time.
#[derive(Debug)]
pub struct AgentCollector {
    pub zds: ZdsHandle,
    pub controller: Arc<ControllerStats>,
    /// Pins of the eBPF mode's maps (none in iptables mode).
    pub pins: Option<PinLayout>,
    /// The CNI endpoint's answers (none without `--cni-socket`).
    pub cni: Option<Arc<CniStats>>,
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value as i64);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for AgentCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let zds = self.zds.stats();
        {
            let info = crate::build_info::current();
            let metric = ConstGauge::new(1i64);
            let help = "This agent's build: crate version, git commit and the digest of its BPF \
                        object (always 1).";
            let mut family =
                encoder.encode_descriptor("build_info", help, None, metric.metric_type())?;
            metric.encode(family.encode_family(&[
                ("version", info.version),
                ("git_commit", info.git_commit),
                ("bpf_object_sha256", info.bpf_object_sha256.as_str()),
            ])?)?;
        }
        gauge(
            &mut encoder,
            "pods_enrolled",
            "Pods whose traffic is redirected to ztunnel.",
            get(&self.controller.pods_enrolled),
        )?;
        counter(
            &mut encoder,
            "pod_enroll_failures",
            "Attempts to enrol a pod that failed (retried).",
            get(&self.controller.enroll_failures),
        )?;
        counter(
            &mut encoder,
            "pods_removed",
            "Pods removed from the redirection.",
            get(&self.controller.pods_removed),
        )?;
        counter(
            &mut encoder,
            "address_conflicts",
            "Addresses claimed by two live pods at once (the newer pod owns the address).",
            get(&self.controller.address_conflicts),
        )?;
        {
            let help = "Inconsistencies the agent's state checks found, by kind (each is \
                        logged, and repaired where possible).";
            let metric = ConstCounter::new(0u64);
            let mut family =
                encoder.encode_descriptor("state_violations", help, None, metric.metric_type())?;
            for kind in ViolationKind::ALL {
                let value = get(&self.controller.state_violations[kind.index()]);
                ConstCounter::new(value)
                    .encode(family.encode_family(&[("kind", kind.as_str())])?)?;
            }
        }
        {
            let steps = self
                .controller
                .enrol_steps
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for (name, help, value) in [
                (
                    "enrol_step_seconds",
                    "Time spent enrolling pods, by step (divide by ambpf_enrol_steps_total for \
                     the mean).",
                    (|&(_, s): &(u64, f64)| ConstCounter::new(s)) as fn(&(u64, f64)) -> _,
                ),
                (
                    "enrol_steps",
                    "Enrolment steps completed, by step.",
                    |&(n, _): &(u64, f64)| ConstCounter::new(n as f64),
                ),
            ] {
                let mut family = encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    ConstCounter::new(0.0).metric_type(),
                )?;
                for (step, totals) in &steps {
                    value(totals).encode(family.encode_family(&[("step", *step)])?)?;
                }
            }
        }
        gauge(
            &mut encoder,
            "zds_connections_active",
            "ztunnel connections open now.",
            ZdsStats::get(&zds.connections_active),
        )?;
        counter(
            &mut encoder,
            "zds_connections",
            "ztunnel connections accepted.",
            ZdsStats::get(&zds.connections_accepted),
        )?;
        counter(
            &mut encoder,
            "zds_snapshots_acked",
            "Full snapshots ztunnel acked.",
            ZdsStats::get(&zds.snapshots_acked),
        )?;
        counter(
            &mut encoder,
            "zds_adds_acked",
            "AddWorkload requests acked.",
            ZdsStats::get(&zds.adds_acked),
        )?;
        counter(
            &mut encoder,
            "zds_dels_acked",
            "DelWorkload requests acked.",
            ZdsStats::get(&zds.dels_acked),
        )?;
        counter(
            &mut encoder,
            "zds_nacks",
            "Requests ztunnel refused (NACK).",
            ZdsStats::get(&zds.nacks),
        )?;
        counter(
            &mut encoder,
            "zds_ack_timeouts",
            "Requests ztunnel did not answer in time.",
            ZdsStats::get(&zds.ack_timeouts),
        )?;
        counter(
            &mut encoder,
            "zds_peer_errors",
            "ztunnel connections closed on an error.",
            ZdsStats::get(&zds.peer_errors),
        )?;
        counter(
            &mut encoder,
            "zds_send_failures",
            "Pods that could not be sent to ztunnel.",
            ZdsStats::get(&zds.send_failures),
        )?;

        if let Some(cni) = &self.cni {
            for (name, help, value) in [
                (
                    "cni_adds_enrolled",
                    "Pods enrolled before their CNI ADD was answered.",
                    &cni.enrolled,
                ),
                (
                    "cni_adds_skipped",
                    "CNI ADDs let through without enrolment (pod not ambient or gone).",
                    &cni.skipped,
                ),
                (
                    "cni_adds_refused",
                    "CNI ADDs failed by the agent (the pod's network setup fails and is retried).",
                    &cni.refused,
                ),
                (
                    "cni_requests_invalid",
                    "Requests to the CNI endpoint that were not a valid ADD.",
                    &cni.invalid,
                ),
            ] {
                counter(&mut encoder, name, help, get(value))?;
            }
            let help = "Time the agent spent answering CNI ADDs, by phase: decide (ambient or \
                        not), enrol (waiting for the controller and its enrolment), ztunnel \
                        (waiting for ztunnel's ack of the pod), answer (request read to \
                        answer ready). Divide by the ADDs answered for the mean.";
            let mut family = encoder.encode_descriptor(
                "cni_add_seconds",
                help,
                None,
                ConstCounter::new(0.0).metric_type(),
            )?;
            for phase in crate::cni::AddPhase::ALL {
                ConstCounter::new(cni.seconds(phase))
                    .encode(family.encode_family(&[("phase", phase.name())])?)?;
            }
        }

        let Some(pins) = &self.pins else {
            return Ok(());
        };
        match inspect::read_counters(pins) {
            Ok(kernel) => {
                for (name, value) in kernel {
                    let help = "Redirection events counted by the kernel programs.";
                    counter(&mut encoder, &format!("kernel_{name}"), help, value)?;
                }
            }
            Err(e) => warn!("metrics: reading the kernel counters: {e}"),
        }
        match crate::bpf::capacity::read_misses(pins) {
            Ok(misses) => {
                let help = "Redirected connections whose original destination was missing \
                            when asked for (evicted from the full LRU maps, or never stored), \
                            by reason (docs/operations.md, \"Map capacities\").";
                let metric = ConstCounter::new(0u64);
                let mut family = encoder.encode_descriptor(
                    "origdst_misses",
                    help,
                    None,
                    metric.metric_type(),
                )?;
                for (miss, value) in misses {
                    ConstCounter::new(value)
                        .encode(family.encode_family(&[("reason", miss.name())])?)?;
                }
            }
            Err(e) => warn!("metrics: reading the original-destination misses: {e}"),
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

/// One series per enrolled pod (and direction) that this agent knows by
/// name; a pod's series go with its map entry, when it is removed.
fn encode_pod_counters(
    encoder: &mut DescriptorEncoder,
    counters: &std::collections::HashMap<u64, crate::bpf::pod_counters::PodCounts>,
    names: &std::collections::HashMap<u64, (String, String)>,
) -> Result<(), std::fmt::Error> {
    let mut pods: Vec<_> = counters
        .iter()
        .filter_map(|(cookie, counts)| Some((names.get(cookie)?, counts.0)))
        .collect();
    pods.sort_by(|a, b| a.0.cmp(b.0));
    /// A series of a family: its `direction` label (none if empty) and its count.
    type Series = (&'static str, fn(&ambpf_common::PodCounters) -> u64);
    let families: [(&str, &str, &[Series]); 3] = [
        (
            "pod_connections_redirected",
            "Connections of the pod sent to ztunnel, by direction.",
            &[
                ("outbound", |c| c.outbound_redirected),
                ("inbound", |c| c.inbound_redirected),
            ],
        ),
        (
            "pod_dns_redirected",
            "DNS of the pod sent to ztunnel's DNS proxy (UDP queries, TCP connections).",
            &[("", |c| c.dns_redirected)],
        ),
        (
            "pod_probes_bypassed",
            "Connections from the node's own addresses (kubelet probes) let through to the pod.",
            &[("", |c| c.probes_bypassed)],
        ),
    ];
    for (name, help, series) in families {
        let mut family = encoder.encode_descriptor(
            name,
            help,
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for ((namespace, pod), counts) in &pods {
            for (direction, value) in series.iter() {
                let metric = ConstCounter::new(value(counts));
                let labels: &[(&str, &str)] = if direction.is_empty() {
                    &[("namespace", namespace), ("pod", pod)]
                } else {
                    &[
                        ("namespace", namespace),
                        ("pod", pod),
                        ("direction", direction),
                    ]
                };
                metric.encode(family.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

/// A registry with every ambpf metric, prefixed `ambpf_`.
pub fn registry(collector: AgentCollector) -> Registry {
    let mut registry = Registry::with_prefix("ambpf");
    registry.register_collector(Box::new(collector));
    registry
}

/// Serves `/metrics` from `registry`.
pub async fn serve_metrics(listener: TcpListener, registry: Arc<Registry>) {
    serve(listener, move |path| match path {
        "/metrics" => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, &registry) {
                Ok(()) => (
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    body,
                ),
                Err(_) => (500, "text/plain", "encoding failed\n".to_owned()),
            }
        }
        _ => (404, "text/plain", "not found\n".to_owned()),
    })
    .await
}

/// Serves `/healthz` and `/readyz`.
pub async fn serve_health(listener: TcpListener, zds: ZdsHandle) {
    serve(listener, move |path| match path {
        "/healthz" => (200, "text/plain", "ok\n".to_owned()),
        "/readyz" if ZdsStats::get(&zds.stats().snapshots_acked) > 0 => {
            (200, "text/plain", "ready\n".to_owned())
        }
        "/readyz" => (
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
            let response = crate::http::response(status, content_type, &body);
            let _ = conn.write_all(response.as_bytes()).await;
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
        controller.pods_enrolled.store(3, Ordering::Relaxed);
        controller.address_conflicts.store(1, Ordering::Relaxed);
        controller.state_violations[ViolationKind::AddressMissing.index()]
            .store(4, Ordering::Relaxed);
        let cni = Arc::new(CniStats::default());
        cni.skipped.store(2, Ordering::Relaxed);
        let registry = Arc::new(registry(AgentCollector {
            zds: zds.clone(),
            controller,
            pins: None,
            cni: Some(cni),
        }));
        tokio::spawn(serve_health(health, zds.clone()));
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
        assert!(body.contains("ambpf_pods_enrolled 3"), "{body}");
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
        tokio::spawn(serve_health(health, server.clone()));
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
        assert!(
            get(health_addr, "/readyz")
                .await
                .starts_with("HTTP/1.1 200")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
