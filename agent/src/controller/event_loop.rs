//! The controller's thread: a pass on every update of the source, retries
//! of failed pods and of a retirement, the state checks (records after each
//! pass, everything periodically) and the CNI's enrol requests as they come.

use std::sync::Arc;

use tokio::sync::watch;
use tracing::{info, warn};

use super::{CniRequests, Controller, RETRY_INTERVAL, SourcePods};
use crate::{
    netns::Netns,
    redirect::{CheckScope, PodKey, Violation},
};

impl Controller {
    /// Checks the redirection's state ([`crate::redirect::check`]), counts
    /// and logs every violation, repairs what can be repaired in place, and
    /// forgets the pods that must be enrolled again (the next pass does).
    /// Returns the violations found.
    pub fn check_state(&mut self, scope: CheckScope) -> Vec<Violation> {
        let known: Vec<(PodKey, &Netns)> =
            self.enrolled.values().map(|e| (e.key, &e.netns)).collect();
        let started = std::time::Instant::now();
        let violations = self.redirection.check(&known, scope);
        let scope_name = match scope {
            CheckScope::Records => "records",
            CheckScope::Full => "full",
        };
        crate::metrics::histograms().observe_state_check(scope_name, started.elapsed());
        if violations.is_empty() {
            return violations;
        }
        for violation in &violations {
            let pod = violation
                .pod
                .and_then(|key| self.enrolled.iter().find(|(_, e)| e.key == key));
            let span = match pod {
                Some((uid, e)) => {
                    let (namespace, name) = e.name.split_once('/').unwrap_or(("", &e.name));
                    crate::pod_span!("check", namespace, name, uid, e.key.netns_cookie)
                }
                None => tracing::Span::none(),
            };
            span.in_scope(|| warn!("state check: {violation}"));
            self.stats.count_violation(violation.kind);
        }
        let again = self.redirection.repair(&violations);
        self.enrolled.retain(|uid, e| {
            let forget = again.contains(&e.key);
            if forget {
                let (namespace, name) = e.name.split_once('/').unwrap_or(("", &e.name));
                let span = crate::pod_span!("repair", namespace, name, uid, e.key.netns_cookie);
                span.in_scope(|| info!("enrolling it again to repair it"));
            }
            !forget
        });
        violations
    }

    /// Applies every update from `pods`, and retries failed pods every
    /// [`RETRY_INTERVAL`], until the sender is gone.
    pub async fn run(self, pods: watch::Receiver<Arc<SourcePods>>) {
        self.run_with_requests(pods, None).await
    }

    /// Runs [`Controller::run_with_requests`] on a thread of its own, with
    /// a runtime of its own: a pass blocks that thread only, and the
    /// caller's runtime talks to it through channels alone. The thread ends
    /// when `pods`' sender is gone.
    pub fn spawn(
        self,
        pods: watch::Receiver<Arc<SourcePods>>,
        requests: Option<CniRequests>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("controller".to_owned())
            .spawn(move || runtime.block_on(self.run_with_requests(pods, requests)))
    }

    /// [`Controller::run`], also serving CNI enrol requests as they come.
    pub async fn run_with_requests(
        mut self,
        mut pods: watch::Receiver<Arc<SourcePods>>,
        mut requests: Option<CniRequests>,
    ) {
        let mut full_check = tokio::time::interval(self.check_interval);
        full_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        full_check.reset();
        let mut scope = CheckScope::Records;
        loop {
            let source = pods.borrow_and_update().clone();
            let current = self.desired(&source);
            let report = self.apply(&current);
            self.ready_for_istio(&source.istio_node_agents);
            if report.enrolled > 0 || report.removed > 0 || !report.failed.is_empty() {
                info!(
                    "pods: {} desired, {} enrolled, {} removed, {} failed",
                    current.len(),
                    report.enrolled,
                    report.removed,
                    report.failed.len()
                );
            }
            // A repair that forgot pods has the next pass enrol them again.
            let enrolled_before = self.enrolled.len();
            let burst = report.enrolled > 0 || report.removed > 0 || scope == CheckScope::Full;
            self.check_state(std::mem::replace(&mut scope, CheckScope::Records));
            let repass = self.enrolled.len() < enrolled_before;
            if burst {
                crate::memory::release_freed();
            }
            loop {
                // CNI-added pods are re-checked (is their netns gone?) until
                // the source takes them over; one may have come in this loop.
                let retry = !report.failed.is_empty()
                    || !self.explicit.is_empty()
                    || self.retiring.is_some()
                    || self.retiring_istio.is_some();
                let retry_in = self
                    .retiring
                    .as_ref()
                    .and_then(|r| r.next_step_within())
                    .unwrap_or(RETRY_INTERVAL);
                tokio::select! {
                    changed = pods.changed() => if changed.is_err() { return },
                    () = std::future::ready(()), if repass => {}
                    _ = full_check.tick() => scope = CheckScope::Full,
                    () = tokio::time::sleep(retry_in), if retry => {}
                    request = async { requests.as_mut()?.recv().await }, if requests.is_some() => {
                        let Some(first) = request else {
                            requests = None;
                            continue;
                        };
                        let mut batch = vec![first];
                        while let Some(more) = requests.as_mut().and_then(|r| r.try_recv().ok()) {
                            batch.push(more);
                        }
                        let source = pods.borrow().clone();
                        self.apply_requests(&source, batch);
                        self.check_state(CheckScope::Records);
                        continue;
                    }
                }
                break;
            }
        }
    }
}
