//! `kubectl get <what> --watch -o json`, each object stamped with the
//! machine's `CLOCK_BOOTTIME` as it arrives: the cluster benchmarks' clock.
//! One process streams every change, so an event's time is its delivery by
//! the API server's watch (milliseconds), not a poll's period.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Stdio},
    sync::{
        Arc, Mutex,
        mpsc::{self, Receiver, RecvTimeoutError},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::kube::{e2e::Cluster, in_node};

/// Seconds since boot on `CLOCK_BOOTTIME`: the clock `/proc/uptime` reads
/// (to the centisecond), inside containers as on the host.
pub fn boottime() -> f64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map_or(0.0, |t| t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9)
}

/// A running watch; killed when dropped.
pub struct Watch {
    child: Child,
    events: Receiver<(f64, Value)>,
    stderr: Arc<Mutex<Vec<String>>>,
    what: String,
}

impl Watch {
    /// Starts `kubectl get <args> --watch -o json` in the node and returns
    /// once its watch request was answered (kubectl's `-v=6` request log
    /// names `watch=true` with `200 OK`): anything created after that is
    /// seen as it is created. Objects that existed before come first, as
    /// the initial list.
    pub fn start(cluster: &Cluster, args: &[&str]) -> Result<Self> {
        let what = args.join(" ");
        let mut cmd = in_node(
            &cluster.layout,
            &cluster.components.kube("kubectl").display().to_string(),
        );
        cmd.arg(format!(
            "--kubeconfig={}",
            cluster.layout.admin_kubeconfig().display()
        ))
        .arg("get")
        .args(args)
        .args(["--watch", "-o", "json", "-v=6"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("kubectl get {what} --watch"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let stderr = child.stderr.take().context("no stderr")?;
        let (events_tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            let stream =
                serde_json::Deserializer::from_reader(BufReader::new(stdout)).into_iter::<Value>();
            for value in stream {
                let Ok(value) = value else { break };
                if events_tx.send((boottime(), value)).is_err() {
                    break;
                }
            }
        });
        let (ready_tx, ready) = mpsc::channel();
        let kept = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&kept);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if is_watch_answered(&line) {
                    let _ = ready_tx.send(());
                } else if !line.contains("round_trippers") && !line.contains("loader.go") {
                    let mut kept = lines.lock().unwrap_or_else(|e| e.into_inner());
                    kept.push(line);
                    let excess = kept.len().saturating_sub(20);
                    kept.drain(..excess);
                }
            }
        });
        let mut watch = Self {
            child,
            events,
            stderr: kept,
            what,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match ready.recv_timeout(Duration::from_millis(100)) {
                Ok(()) => return Ok(watch),
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = watch.child.wait();
                    bail!(
                        "kubectl get {} --watch exited: {}",
                        watch.what,
                        watch.stderr_tail()
                    );
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if let Some(status) = watch.child.try_wait()? {
                bail!(
                    "kubectl get {} --watch exited ({status}): {}",
                    watch.what,
                    watch.stderr_tail()
                );
            }
            if Instant::now() > deadline {
                // The request log's format changed: go on, a little late.
                eprintln!(
                    "bench: kubectl get {} --watch logged no answered watch request in 20 s; going on",
                    watch.what
                );
                return Ok(watch);
            }
        }
    }

    /// The next object and when it arrived ([`boottime`]), or `None` once
    /// `timeout` passed with none.
    pub fn next(&self, timeout: Duration) -> Result<Option<(f64, Value)>> {
        match self.events.recv_timeout(timeout) {
            Ok(event) => Ok(Some(event)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => bail!(
                "kubectl get {} --watch ended: {}",
                self.what,
                self.stderr_tail()
            ),
        }
    }

    fn stderr_tail(&self) -> String {
        self.stderr.lock().map(|l| l.join("\n")).unwrap_or_default()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Our own child (nsenter execs kubectl), by its handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a `kubectl -v=6` line logs the watch request's answer, in the
/// old (`GET https://...&watch=true 200 OK in 3 milliseconds`) or the
/// structured (`"Response" verb="GET" url="...watch=true..." status="200 OK"`)
/// form.
fn is_watch_answered(line: &str) -> bool {
    line.contains("watch=true") && line.contains("200 OK")
}

/// Whether a pod object's `Ready` condition is `True`.
pub fn pod_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

pub fn name_of(object: &Value) -> Option<&str> {
    object["metadata"]["name"].as_str()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn answered_watch_requests_are_recognised_in_both_log_forms() {
        assert!(super::is_watch_answered(
            "I0101 round_trippers.go:553] GET https://10.200.0.2:6443/api/v1/namespaces/x/pods?resourceVersion=7&watch=true 200 OK in 2 milliseconds"
        ));
        assert!(super::is_watch_answered(
            r#"I0101 round_trippers.go:632] "Response" verb="GET" url="https://10.200.0.2:6443/api/v1/namespaces/x/pods?allowWatchBookmarks=true&watch=true" status="200 OK" milliseconds=3"#
        ));
        assert!(!super::is_watch_answered(
            "I0101 round_trippers.go:553] GET https://10.200.0.2:6443/api/v1/namespaces/x/pods?limit=500 200 OK in 4 milliseconds"
        ));
    }

    #[test]
    fn readiness_is_the_ready_condition() {
        let ready = json!({"status": {"conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True"}]}});
        let not = json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}});
        assert!(super::pod_ready(&ready));
        assert!(!super::pod_ready(&not));
        assert!(!super::pod_ready(&json!({})));
    }

    #[test]
    fn boottime_moves_forward() {
        let a = super::boottime();
        let b = super::boottime();
        assert!(a > 0.0 && b >= a);
    }
}
