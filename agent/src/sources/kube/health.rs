//! Whether the pod source can serve: what the agent's readiness reports.
//!
//! Without a list and a watch that answer, the agent cannot know which pods
//! of its node are ambient: it is not Ready (its `/readyz` says why) until
//! the API server answers again, as Istio's node agent is not ready before
//! its informers have synced. Being not Ready changes nothing on the node:
//! the pods enrolled stay as they are (the source keeps its last set), and
//! nothing is enrolled or removed on partial knowledge.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client,
    api::{ListParams, WatchParams},
};
use tokio::sync::watch;
use tracing::info;

use super::{KubeSourceError, Lenient, WatchedPod, check};

/// What keeps the source from serving, by concern: `start` until the first
/// complete set is published, and each watch (`pods`, `namespaces`) while it
/// fails. Cheap to clone; every clone sees the same state.
#[derive(Clone, Debug)]
pub struct SourceHealth {
    problems: Arc<watch::Sender<Problems>>,
}

type Problems = BTreeMap<&'static str, Problem>;

/// Why a concern fails, and the kind of failure (e.g. `403`, or
/// `unreachable` for a connection refused, reset or cut): a failure of
/// the kind already reported is news to no one, whatever its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub kind: String,
    pub why: String,
}

/// The concern of a source that has not published its first set yet.
pub(crate) const START: &str = "start";

impl Default for SourceHealth {
    fn default() -> Self {
        Self::new()
    }
}

impl SourceHealth {
    /// A source that has not started yet: not ready.
    pub fn new() -> Self {
        let first = BTreeMap::from([(
            START,
            Problem {
                kind: "starting".to_owned(),
                why: "waiting for the first list of pods and namespaces from the API server"
                    .to_owned(),
            },
        )]);
        Self {
            problems: Arc::new(watch::channel(first).0),
        }
    }

    /// `None` when the source serves, else why it does not.
    pub fn not_ready(&self) -> Option<String> {
        let problems = self.problems.borrow();
        (!problems.is_empty()).then(|| {
            problems
                .values()
                .map(|p| p.why.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// Follows the state (for tests and for [`recheck`]).
    pub fn subscribe(&self) -> watch::Receiver<Problems> {
        self.problems.subscribe()
    }

    /// Marks `concern` failing; whether that is news (it was not failing,
    /// or with another kind of failure), and so worth a warning.
    pub(super) fn fail(&self, concern: &'static str, problem: Problem) -> bool {
        let mut news = false;
        self.problems.send_if_modified(|problems| {
            let before = problems.insert(concern, problem.clone());
            news = before.as_ref().is_none_or(|b| b.kind != problem.kind);
            before.as_ref() != Some(&problem)
        });
        news
    }

    /// Marks `concern` well; whether it was failing.
    pub(crate) fn recover(&self, concern: &'static str) -> bool {
        self.problems
            .send_if_modified(|problems| problems.remove(concern).is_some())
    }

    /// Whether a watch is failing.
    fn watch_failing(problems: &Problems) -> bool {
        problems.keys().any(|concern| *concern != START)
    }
}

/// Lists pods of the node and namespaces once, and starts a watch of each:
/// whether the API server answers and RBAC allows what the source needs.
pub(super) async fn probe(client: &Client, node_selector: &str) -> Result<(), KubeSourceError> {
    let pods = Api::<Lenient<WatchedPod>>::all(client.clone());
    let listed = pods
        .list(&ListParams::default().fields(node_selector).limit(1))
        .await;
    let version = check("list", "pods", listed.map(|l| l.metadata.resource_version))?;
    let watched = pods
        .watch(
            &WatchParams::default().fields(node_selector).timeout(1),
            version.as_deref().unwrap_or("0"),
        )
        .await;
    check("watch", "pods", watched.map(drop))?;
    let namespaces = Api::<Lenient<Namespace>>::all(client.clone());
    let listed = namespaces.list(&ListParams::default().limit(1)).await;
    let version = check(
        "list",
        "namespaces",
        listed.map(|l| l.metadata.resource_version),
    )?;
    let watched = namespaces
        .watch(
            &WatchParams::default().timeout(1),
            version.as_deref().unwrap_or("0"),
        )
        .await;
    check("watch", "namespaces", watched.map(drop))
}

/// While a watch fails, probes the API server every `interval`; once the
/// probe passes, the watches are taken as recovered. A watch that resumes
/// where it left off yields nothing until the next change, so without this
/// a quiet cluster would keep the agent not Ready after the API server is
/// back. A watch that still fails marks itself failing again.
pub(super) async fn recheck(
    client: Client,
    node_selector: String,
    health: SourceHealth,
    interval: Duration,
) {
    let mut problems = health.subscribe();
    loop {
        if problems
            .wait_for(SourceHealth::watch_failing)
            .await
            .is_err()
        {
            return;
        }
        tokio::time::sleep(interval).await;
        if !SourceHealth::watch_failing(&problems.borrow()) {
            continue;
        }
        if probe(&client, &node_selector).await.is_ok() {
            let recovered: Vec<&'static str> = problems
                .borrow()
                .keys()
                .copied()
                .filter(|concern| *concern != START)
                .collect();
            for concern in &recovered {
                health.recover(concern);
            }
            info!(
                "the API server answers again: watching {} again, ready",
                recovered.join(" and ")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_once_started_and_while_no_watch_fails() {
        let health = SourceHealth::new();
        assert!(
            health
                .not_ready()
                .unwrap()
                .contains("waiting for the first list")
        );
        health.recover(START);
        assert_eq!(health.not_ready(), None);
        let problem = |kind: &str, why: &str| Problem {
            kind: kind.to_owned(),
            why: why.to_owned(),
        };
        assert!(health.fail("pods", problem("unreachable", "cannot watch pods: EOF")));
        // Another text of the same kind: readiness says it, no news.
        assert!(!health.fail(
            "pods",
            problem("unreachable", "cannot watch pods: connection refused")
        ));
        assert!(health.fail(
            "namespaces",
            problem("403", "RBAC denies `watch` on namespaces")
        ));
        assert_eq!(
            health.not_ready().as_deref(),
            Some("RBAC denies `watch` on namespaces; cannot watch pods: connection refused")
        );
        assert!(SourceHealth::watch_failing(&health.subscribe().borrow()));
        assert!(health.recover("pods"));
        assert!(!health.recover("pods"));
        health.recover("namespaces");
        assert_eq!(health.not_ready(), None);
    }
}
