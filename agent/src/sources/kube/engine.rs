//! The source's loop: watch events into the caches, a pass over them after
//! each burst, and the watches' health in the log.

use super::*;

type WatchResult<K> = Result<watcher::Event<Lenient<K>>, watcher::Error>;

/// The source's state between events.
pub(super) struct Engine {
    pub(super) config: KubeSourceConfig,
    pub(super) pods: Store<Lenient<WatchedPod>>,
    pub(super) namespaces: Store<Lenient<Namespace>>,
    /// Taken while discovery runs on a blocking thread.
    pub(super) resolver: Option<Box<dyn NetnsResolver>>,
    pub(super) out: watch::Sender<Arc<SourcePods>>,
    /// The UIDs last published, for the annotator.
    pub(super) published: watch::Sender<Arc<BTreeSet<String>>>,
    pub(super) pods_changed: Arc<Notify>,
    /// Where the watches' failures and the first publish are reported.
    pub(super) health: SourceHealth,
    /// What was last logged about pods and malformed objects.
    pub(super) notes: Notes,
    pub(super) first: bool,
    /// The last pass's ambient pods and what the resolver found for them:
    /// a resync that no event preceded only checks these again.
    pub(super) last: Option<Resolved>,
    /// The controller's reports: where the runtime put the pods a CNI ADD
    /// enrolled, so that discovery need not scan for them.
    pub(super) reports: Option<crate::controller::ProgrammedPods>,
}

/// Ambient pods and where their network namespaces were found.
pub(super) struct Resolved {
    queries: Vec<PodQuery>,
    found: Found,
}

type Found = std::collections::BTreeMap<String, Result<crate::zds::NetnsSource, String>>;

/// A watch's failure: logged once per run of the same failure (a 410 is
/// not one: the watcher lists again), and the agent not Ready meanwhile.
fn watch_failed(health: &SourceHealth, what: &'static str, error: &watcher::Error) {
    let text = describe_watch_error(what, error);
    let problem = health::Problem {
        kind: failure_kind(error),
        why: text.clone(),
    };
    if matches!(error, watcher::Error::WatchError(status) if status.code == 410) {
        info!("{text}");
    } else if health.fail(what, problem) {
        warn!("{text}; keeping the last known {what} and retrying, not ready meanwhile");
    } else {
        debug!("{text}");
    }
}

fn watch_answered(health: &SourceHealth, what: &'static str) {
    if health.recover(what) {
        info!("watching {what} again");
    }
}

/// The kind of a watch's failure: the API's answer by its code, or
/// `unreachable` (refused, reset, cut mid-stream: one outage, whatever the
/// retry meets).
fn failure_kind(error: &watcher::Error) -> String {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status))
        | watcher::Error::WatchError(status) => status.code.to_string(),
        watcher::Error::NoResourceVersion => "no resourceVersion".to_owned(),
        _ => "unreachable".to_owned(),
    }
}

fn describe_watch_error(what: &str, error: &watcher::Error) -> String {
    let api = |verb: &str, e: &kube::Error| match e {
        kube::Error::Api(status) if status.code == 403 => {
            format!(
                "RBAC denies the agent `{verb}` on {what}: {}",
                status.message
            )
        }
        kube::Error::Api(status) if status.code == 401 => {
            format!(
                "the API server rejected the agent's credentials (401) to {verb} {what}: {}",
                status.message
            )
        }
        other => format!("cannot {verb} {what}: {}", crate::error_chain(other)),
    };
    match error {
        watcher::Error::InitialListFailed(e) => api("list", e),
        watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => api("watch", e),
        watcher::Error::WatchError(status) if status.code == 410 => {
            format!("watching {what}: resource version expired (410 Gone); listing them again")
        }
        watcher::Error::WatchError(status) => {
            format!(
                "watching {what}: the API server sent an error ({}): {}",
                status.code, status.message
            )
        }
        watcher::Error::NoResourceVersion => {
            format!("watching {what}: the API server gave no resourceVersion")
        }
    }
}

impl Engine {
    pub(super) async fn run(
        mut self,
        pod_events: impl Stream<Item = WatchResult<WatchedPod>> + Send,
        namespace_events: impl Stream<Item = WatchResult<Namespace>> + Send,
        synced: oneshot::Sender<()>,
    ) {
        let mut pod_events = std::pin::pin!(pod_events);
        let mut namespace_events = std::pin::pin!(namespace_events);
        let (mut pods_synced, mut namespaces_synced) = (false, false);
        let mut synced = Some(synced);
        let mut tick = tokio::time::interval(self.config.resync);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Pods the resolver left for its next scan of /proc.
        let mut retry: Option<tokio::time::Instant> = None;
        loop {
            // `dirty`: a pass is due; `changed`: the caches changed since
            // the last one (else the pass only checks the namespaces found).
            let (mut dirty, mut changed) = tokio::select! {
                Some(event) = pod_events.next() => {
                    let changed = on_event("pods", event, &mut pods_synced, &self.health);
                    (changed, changed)
                }
                Some(event) = namespace_events.next() => {
                    let changed = on_event("namespaces", event, &mut namespaces_synced, &self.health);
                    (changed, changed)
                }
                _ = tick.tick() => (true, false),
                () = tokio::time::sleep_until(retry.unwrap_or_else(tokio::time::Instant::now)), if retry.is_some() => {
                    retry = None;
                    (true, false)
                }
            };
            // Take whatever else is ready, so a burst makes one pass. A
            // watch's body gives one event per HTTP chunk, and its
            // connection reads the next chunk only once this one is taken:
            // so the burst is over only when nothing is ready even after
            // the connection had its turn.
            let mut yielded = false;
            loop {
                let mut progressed = false;
                if let Some(Some(event)) = pod_events.next().now_or_never() {
                    changed |= on_event("pods", event, &mut pods_synced, &self.health);
                    progressed = true;
                }
                if let Some(Some(event)) = namespace_events.next().now_or_never() {
                    changed |= on_event("namespaces", event, &mut namespaces_synced, &self.health);
                    progressed = true;
                }
                if progressed {
                    yielded = false;
                } else if yielded {
                    break;
                } else {
                    tokio::task::yield_now().await;
                    yielded = true;
                }
            }
            dirty |= changed;
            if !(pods_synced && namespaces_synced && dirty) {
                continue;
            }
            self.publish(changed).await;
            retry = self
                .resolver
                .as_ref()
                .and_then(|resolver| resolver.retry_in())
                .map(|after| tokio::time::Instant::now() + after);
            if let Some(synced) = synced.take() {
                self.health.recover(health::START);
                let _ = synced.send(());
            }
        }
    }

    /// Gives each query the namespace the runtime named for the pod, as of
    /// the controller's latest report.
    fn name_runtime_netns(&self, queries: &mut [PodQuery]) {
        let Some(reports) = &self.reports else {
            return;
        };
        let report = reports.borrow();
        for query in queries {
            query.runtime_netns = report.runtime_netns.get(&query.uid).cloned();
        }
    }

    /// Looks for the network namespaces of `queries` on a blocking thread.
    async fn resolve(&mut self, queries: Vec<PodQuery>) -> (Vec<PodQuery>, Found) {
        let mut resolver = self
            .resolver
            .take()
            .expect("the resolver is back after each pass");
        let (resolver, queries, found) = tokio::task::spawn_blocking(move || {
            let found = resolver.resolve(&queries);
            (resolver, queries, found)
        })
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        self.resolver = Some(resolver);
        (queries, found)
    }

    /// Works out the desired pods from the caches and publishes them if they
    /// changed (the first time, always). Without a change to the caches
    /// (`caches_changed` false: a resync or a retry), the ambient pods are
    /// those of the last pass, and only their namespaces are looked at
    /// again: if each is where it was, nothing is evaluated or published.
    async fn publish(&mut self, caches_changed: bool) {
        if !caches_changed && let Some(mut last) = self.last.take() {
            self.name_runtime_netns(&mut last.queries);
            let (queries, found) = self.resolve(last.queries).await;
            if found == last.found {
                self.last = Some(Resolved { queries, found });
                return;
            }
        }
        let mut classified = evaluate::classify(
            &self.pods.state(),
            &self.namespaces.state(),
            &self.config.excluded_namespaces,
            &mut self.notes,
        );
        let mut queries = std::mem::take(&mut classified.queries);
        self.name_runtime_netns(&mut queries);
        let (queries, found) = self.resolve(queries).await;
        self.last = Some(Resolved {
            queries: queries.clone(),
            found: found.clone(),
        });
        let snapshot = classified.snapshot(queries, &found, &mut self.notes);

        let uids: BTreeSet<String> = snapshot
            .ambient
            .iter()
            .map(|s| s.workload.uid.clone())
            .collect();
        if std::mem::take(&mut self.first) {
            info!(
                "pods of node {}: {} ambient, {} not (initial snapshot)",
                self.config.node_name,
                snapshot.ambient.len(),
                snapshot.not_ambient.len()
            );
            self.out.send_replace(Arc::new(snapshot));
        } else {
            self.out.send_if_modified(|current| {
                let changed = **current != snapshot;
                if changed {
                    *current = Arc::new(snapshot);
                }
                changed
            });
        }
        self.published.send_if_modified(|current| {
            let changed = **current != uids;
            if changed {
                *current = Arc::new(uids);
            }
            changed
        });
        self.pods_changed.notify_one();
    }
}

/// Whether an event changes the caches (the store swaps in a relist only at
/// `InitDone`); marks the stream synced at `InitDone`.
fn on_event<K>(
    what: &'static str,
    event: WatchResult<K>,
    synced: &mut bool,
    health: &SourceHealth,
) -> bool
where
    K: k8s_openapi::Resource
        + k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
{
    // A pod's first event starts its `kube_event_to_programmed` clock.
    if let Ok(watcher::Event::Apply(object)) = &event
        && let Some(uid) = &k8s_openapi::Metadata::metadata(object).uid
        && what == "pods"
    {
        crate::metrics::histograms().kube_pod_event(uid);
    }
    match event {
        Ok(watcher::Event::InitDone) => {
            watch_answered(health, what);
            if !*synced {
                debug!("{what} synced");
            }
            *synced = true;
            true
        }
        Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
            watch_answered(health, what);
            true
        }
        Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => false,
        Err(error) => {
            watch_failed(health, what, &error);
            false
        }
    }
}
