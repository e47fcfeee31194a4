//! The Kubernetes pod source: the ambient pods of this node, from the API
//! server, as Istio's node agent finds them.
//!
//! Two kube-rs reflectors keep the pods of this node (field selector
//! `spec.nodeName=<node>`) and every namespace. Once both caches have synced,
//! and again after every change (and every [`KubeSourceConfig::resync`], since
//! processes come and go without the API server knowing), the source works
//! out which pods are ambient ([`rules::ambient`]), finds their network
//! namespaces ([`netns`]) and publishes the full set into the controller's
//! watch channel, with the pods it judged not ambient and why (so that a pod
//! the CNI plugin enrolled leaves when it opts out; an ambient pod whose
//! network namespace is not found yet is in neither list). The first publish
//! is a complete snapshot: [`KubeSource::start`] returns only after it, so
//! the caller can program every pod before serving ztunnel, and can
//! reconcile state pinned by an earlier agent against the truth rather than
//! against an empty set.
//!
//! Relabelling a namespace or a pod enrols or removes its pods at once.
//! Objects that do not parse are logged and skipped ([`Lenient`]); the rest
//! still apply. When the API server is unreachable, or a watch fails, the
//! last published set stays and the reflectors retry with backoff; a `410
//! Gone` makes them list again, and the store is swapped only when the new
//! list is complete, so nothing is lost or removed in between.
//!
//! With [`KubeSource::annotate_from`], enrolled pods get
//! `ambient.istio.io/redirection: enabled` once ztunnel has them (`pending`
//! while it has not), removed when they leave the mesh ([`annotate`]).

pub mod annotate;
pub mod lenient;
pub mod netns;
pub mod rules;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use futures::{FutureExt as _, Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api, Client, Config,
    api::ListParams,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt as _,
        reflector::{self, Store},
        utils::Backoff,
        watcher,
    },
};
use log::{debug, info, warn};
use tokio::{
    sync::{Notify, oneshot, watch},
    task::JoinHandle,
};

pub use self::{
    lenient::Lenient,
    netns::{NetnsResolver, PodQuery, ProcNetnsFinder},
};
use crate::{
    controller::{PodSpec, ProgrammedPods, SourcePods},
    zds::{Workload, ZtunnelPods},
};

/// What the source needs to know beyond the API server.
#[derive(Clone, Debug)]
pub struct KubeSourceConfig {
    /// This node's name (`spec.nodeName` of its pods).
    pub node_name: String,
    /// Namespaces whose pods never enrol.
    pub excluded_namespaces: BTreeSet<String>,
    /// The proc filesystem scanned for pods' network namespaces.
    pub proc_root: PathBuf,
    /// How often the pods are re-evaluated without an event: network
    /// namespaces found, re-checked after container restarts; failed
    /// annotation patches retried.
    pub resync: Duration,
    /// The longest wait between retries of a failed list or watch.
    pub max_backoff: Duration,
}

impl KubeSourceConfig {
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            excluded_namespaces: rules::DEFAULT_EXCLUDED_NAMESPACES
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            proc_root: PathBuf::from("/proc"),
            resync: Duration::from_secs(5),
            max_backoff: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error(
        "the node name is not set: give --node-name or set NODE_NAME (in a DaemonSet, from the \
         downward API's spec.nodeName)"
    )]
    NoNodeName,
    #[error(
        "no Kubernetes credentials: not running in a cluster (KUBERNETES_SERVICE_HOST is unset) and no \
         kubeconfig (KUBECONFIG is unset and there is no ~/.kube/config); give --kubeconfig"
    )]
    NoCredentials,
    #[error("reading the kubeconfig {}: {}", path.display(), crate::error_chain(source))]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("the in-cluster configuration: {}", crate::error_chain(.0))]
    InCluster(#[source] kube::config::InClusterError),
    #[error("building the Kubernetes client: {}", crate::error_chain(.0))]
    Client(#[source] kube::Error),
    #[error(
        "RBAC denies the agent `{verb}` on {resource} ({message}); its service account needs \
         {verb} on {resource}"
    )]
    Forbidden {
        verb: &'static str,
        resource: &'static str,
        message: String,
    },
    #[error(
        "the API server rejected the agent's credentials (401) to {verb} {resource}: {message}"
    )]
    Unauthorized {
        verb: &'static str,
        resource: &'static str,
        message: String,
    },
    #[error(
        "cannot {verb} {resource} from the API server: {}",
        crate::error_chain(source)
    )]
    Api {
        verb: &'static str,
        resource: &'static str,
        source: kube::Error,
    },
    #[error("the pod source stopped before its caches synced")]
    Stopped,
}

/// Whether Kubernetes is used without being asked for: `kubeconfig` given,
/// or running in a cluster. (`run` then picks the kube source, `uninstall`
/// removes the annotations, `cni-install` checks its DaemonSet on shutdown.)
pub fn configured(kubeconfig: Option<&Path>) -> bool {
    kubeconfig.is_some() || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
}

/// Whether Kubernetes credentials can be found: `kubeconfig` given, running
/// in a cluster, `KUBECONFIG` set or `~/.kube/config` present.
pub fn credentials_available(kubeconfig: Option<&Path>) -> bool {
    kubeconfig.is_some()
        || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        || std::env::var_os("KUBECONFIG").is_some()
        || std::env::var_os("HOME")
            .is_some_and(|home| Path::new(&home).join(".kube/config").exists())
}

/// A client from `kubeconfig`, else the in-cluster service account, else the
/// default kubeconfig (`KUBECONFIG`, `~/.kube/config`).
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, KubeSourceError> {
    let config = match kubeconfig {
        Some(path) => {
            let error = |source| KubeSourceError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let file = Kubeconfig::read_from(path).map_err(error)?;
            Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(error)?
        }
        None if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => {
            Config::incluster().map_err(KubeSourceError::InCluster)?
        }
        None if credentials_available(None) => {
            Config::from_kubeconfig(&KubeConfigOptions::default())
                .await
                .map_err(|source| KubeSourceError::Kubeconfig {
                    path: default_kubeconfig(),
                    source,
                })?
        }
        None => return Err(KubeSourceError::NoCredentials),
    };
    info!("Kubernetes API server: {}", config.cluster_url);
    Client::try_from(config).map_err(KubeSourceError::Client)
}

fn default_kubeconfig() -> PathBuf {
    match std::env::var_os("KUBECONFIG") {
        Some(path) => PathBuf::from(path),
        None => Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".kube/config"),
    }
}

/// The source, before [`KubeSource::start`].
pub struct KubeSource {
    client: Client,
    config: KubeSourceConfig,
    resolver: Box<dyn NetnsResolver>,
    annotate: Option<(ProgrammedPods, ZtunnelPods)>,
}

/// The running source's tasks; dropping it stops them.
pub struct KubeSourceHandle {
    tasks: Vec<JoinHandle<()>>,
    caches: KubeCaches,
}

/// The source's caches of this node's pods and of the namespaces, kept by
/// its watches.
#[derive(Clone)]
pub struct KubeCaches {
    pub pods: Store<Lenient<Pod>>,
    pub namespaces: Store<Lenient<Namespace>>,
}

impl KubeSourceHandle {
    /// The source's caches, for readers that can do with what the watches
    /// have delivered (the CNI endpoint).
    pub fn caches(&self) -> KubeCaches {
        self.caches.clone()
    }

    /// Whether every task still runs (they only end when stopped or on a panic).
    pub fn is_running(&self) -> bool {
        self.tasks.iter().all(|t| !t.is_finished())
    }
}

impl Drop for KubeSourceHandle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl KubeSource {
    /// A source discovering network namespaces under `config.proc_root`.
    pub fn new(client: Client, config: KubeSourceConfig) -> Self {
        let resolver = Box::new(ProcNetnsFinder::new(&config.proc_root));
        Self {
            client,
            config,
            resolver,
            annotate: None,
        }
    }

    /// Replaces network namespace discovery.
    pub fn with_resolver(mut self, resolver: impl NetnsResolver) -> Self {
        self.resolver = Box::new(resolver);
        self
    }

    /// Records enrolment on the pods from the controller's reports (see
    /// [`crate::controller::Controller::report_programmed`]) and the ZDS
    /// server's ([`crate::zds::ZdsHandle::ztunnel_pods`]).
    pub fn annotate_from(mut self, programmed: ProgrammedPods, ztunnel: ZtunnelPods) -> Self {
        self.annotate = Some((programmed, ztunnel));
        self
    }

    /// Checks access, starts the reflectors and returns once the first
    /// complete set has been published into `pods`. Needs a tokio runtime.
    pub async fn start(
        self,
        pods: watch::Sender<Arc<SourcePods>>,
    ) -> Result<KubeSourceHandle, KubeSourceError> {
        let Self {
            client,
            config,
            resolver,
            annotate,
        } = self;
        if config.node_name.is_empty() {
            return Err(KubeSourceError::NoNodeName);
        }
        let node_selector = format!("spec.nodeName={}", config.node_name);
        preflight(&client, &node_selector).await?;

        let backoff = || RetryBackoff::new(config.max_backoff);
        let (pod_store, pod_writer) = reflector::store::<Lenient<Pod>>();
        let pod_events = reflector::reflector(
            pod_writer,
            watcher(
                Api::<Lenient<Pod>>::all(client.clone()),
                watcher::Config::default().fields(&node_selector),
            ),
        )
        .backoff(backoff());
        let (namespace_store, namespace_writer) = reflector::store::<Lenient<Namespace>>();
        let namespace_events = reflector::reflector(
            namespace_writer,
            watcher(
                Api::<Lenient<Namespace>>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .backoff(backoff());

        let (published_tx, published_rx) = watch::channel(Arc::new(BTreeSet::new()));
        let pods_changed = Arc::new(Notify::new());
        let engine = Engine {
            config: config.clone(),
            pods: pod_store.clone(),
            namespaces: namespace_store.clone(),
            resolver: Some(resolver),
            out: pods,
            published: published_tx,
            pods_changed: pods_changed.clone(),
            notes: HashMap::new(),
            malformed: HashMap::new(),
            first: true,
        };
        let caches = KubeCaches {
            pods: pod_store.clone(),
            namespaces: namespace_store,
        };
        let (synced_tx, synced_rx) = oneshot::channel();
        let mut tasks = vec![tokio::spawn(engine.run(
            pod_events,
            namespace_events,
            synced_tx,
        ))];
        if let Some((programmed, ztunnel)) = annotate {
            let annotator = annotate::Annotator::new(client, pod_store);
            tasks.push(tokio::spawn(annotator.run(
                programmed,
                ztunnel,
                published_rx,
                pods_changed,
                config.resync,
            )));
        }
        let handle = KubeSourceHandle { tasks, caches };
        synced_rx.await.map_err(|_| KubeSourceError::Stopped)?;
        Ok(handle)
    }
}

/// Lists pods of the node and namespaces once, so that missing credentials
/// or RBAC are a clear start-up error rather than a retry loop.
async fn preflight(client: &Client, node_selector: &str) -> Result<(), KubeSourceError> {
    let params = ListParams::default().fields(node_selector).limit(1);
    let pods = Api::<Lenient<Pod>>::all(client.clone()).list(&params).await;
    check("list", "pods", pods.map(drop))?;
    let namespaces = Api::<Lenient<Namespace>>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await;
    check("list", "namespaces", namespaces.map(drop))
}

fn check(
    verb: &'static str,
    resource: &'static str,
    result: Result<(), kube::Error>,
) -> Result<(), KubeSourceError> {
    result.map_err(|e| api_error(verb, resource, e))
}

/// What a failed request to the API server means: RBAC and credential
/// problems named as such, anything else with its causes.
pub(crate) fn api_error(
    verb: &'static str,
    resource: &'static str,
    error: kube::Error,
) -> KubeSourceError {
    match error {
        kube::Error::Api(status) if status.code == 403 => KubeSourceError::Forbidden {
            verb,
            resource,
            message: status.message,
        },
        kube::Error::Api(status) if status.code == 401 => KubeSourceError::Unauthorized {
            verb,
            resource,
            message: status.message,
        },
        source => KubeSourceError::Api {
            verb,
            resource,
            source,
        },
    }
}

/// Exponential backoff for the reflectors' retries, from 800 ms (as
/// client-go) up to a maximum; reset by the first success.
struct RetryBackoff {
    next: Duration,
    max: Duration,
}

impl RetryBackoff {
    const INITIAL: Duration = Duration::from_millis(800);

    fn new(max: Duration) -> Self {
        Self {
            next: Self::INITIAL.min(max),
            max,
        }
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        Some(delay)
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = Self::INITIAL.min(self.max);
    }
}

type WatchResult<K> = Result<watcher::Event<Lenient<K>>, watcher::Error>;

/// The source's state between events.
struct Engine {
    config: KubeSourceConfig,
    pods: Store<Lenient<Pod>>,
    namespaces: Store<Lenient<Namespace>>,
    /// Taken while discovery runs on a blocking thread.
    resolver: Option<Box<dyn NetnsResolver>>,
    out: watch::Sender<Arc<SourcePods>>,
    /// The UIDs last published, for the annotator.
    published: watch::Sender<Arc<BTreeSet<String>>>,
    pods_changed: Arc<Notify>,
    /// uid -> the last thing logged about the pod, to log changes only.
    notes: HashMap<String, String>,
    /// kind/namespace/name -> resourceVersion of malformed objects logged.
    malformed: HashMap<String, Option<String>>,
    first: bool,
}

/// Logs a watch's failures once per run of failures.
#[derive(Default)]
struct StreamHealth {
    failing: Option<String>,
}

impl StreamHealth {
    fn failed(&mut self, what: &str, error: &watcher::Error) {
        let text = describe_watch_error(what, error);
        if matches!(error, watcher::Error::WatchError(status) if status.code == 410) {
            info!("{text}");
        } else if self.failing.as_ref() != Some(&text) {
            warn!("{text}; keeping the last known {what} and retrying");
        } else {
            debug!("{text}");
        }
        self.failing = Some(text);
    }

    fn ok(&mut self, what: &str) {
        if self.failing.take().is_some() {
            info!("watching {what} again");
        }
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
    async fn run(
        mut self,
        pod_events: impl Stream<Item = WatchResult<Pod>> + Send,
        namespace_events: impl Stream<Item = WatchResult<Namespace>> + Send,
        synced: oneshot::Sender<()>,
    ) {
        let mut pod_events = std::pin::pin!(pod_events);
        let mut namespace_events = std::pin::pin!(namespace_events);
        let (mut pods_synced, mut namespaces_synced) = (false, false);
        let (mut pod_health, mut namespace_health) =
            (StreamHealth::default(), StreamHealth::default());
        let mut synced = Some(synced);
        let mut tick = tokio::time::interval(self.config.resync);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Pods the resolver left for its next scan of /proc.
        let mut retry: Option<tokio::time::Instant> = None;
        loop {
            let mut dirty = tokio::select! {
                Some(event) = pod_events.next() => on_event("pods", event, &mut pods_synced, &mut pod_health),
                Some(event) = namespace_events.next() => {
                    on_event("namespaces", event, &mut namespaces_synced, &mut namespace_health)
                }
                _ = tick.tick() => true,
                () = tokio::time::sleep_until(retry.unwrap_or_else(tokio::time::Instant::now)), if retry.is_some() => {
                    retry = None;
                    true
                }
            };
            // Take whatever else is ready, so a burst makes one pass.
            loop {
                let mut progressed = false;
                if let Some(Some(event)) = pod_events.next().now_or_never() {
                    dirty |= on_event("pods", event, &mut pods_synced, &mut pod_health);
                    progressed = true;
                }
                if let Some(Some(event)) = namespace_events.next().now_or_never() {
                    dirty |= on_event(
                        "namespaces",
                        event,
                        &mut namespaces_synced,
                        &mut namespace_health,
                    );
                    progressed = true;
                }
                if !progressed {
                    break;
                }
            }
            if !(pods_synced && namespaces_synced && dirty) {
                continue;
            }
            self.publish().await;
            retry = self
                .resolver
                .as_ref()
                .and_then(|resolver| resolver.retry_in())
                .map(|after| tokio::time::Instant::now() + after);
            if let Some(synced) = synced.take() {
                let _ = synced.send(());
            }
        }
    }

    /// Works out the desired pods from the caches and publishes them if they
    /// changed (the first time, always).
    async fn publish(&mut self) {
        let namespace_labels: HashMap<String, BTreeMap<String, String>> = self
            .namespaces
            .state()
            .iter()
            .filter_map(|ns| {
                self.note_malformed("namespace", ns);
                let meta = k8s_openapi::Metadata::metadata(ns.as_ref());
                Some((meta.name.clone()?, meta.labels.clone().unwrap_or_default()))
            })
            .collect();
        let mut queries = Vec::new();
        let mut details = HashMap::new();
        let mut present = BTreeSet::new();
        let mut not_ambient = BTreeMap::new();
        for entry in self.pods.state() {
            self.note_malformed("pod", &entry);
            let Ok(pod) = &entry.object else { continue };
            let meta = &pod.metadata;
            let (Some(uid), Some(namespace), Some(name)) = (&meta.uid, &meta.namespace, &meta.name)
            else {
                continue;
            };
            present.insert(uid.clone());
            let label = format!("pod {namespace}/{name} ({uid})");
            match rules::ambient(
                pod,
                namespace_labels.get(namespace),
                &self.config.excluded_namespaces,
            ) {
                Ok(()) => {
                    let service_account = rules::service_account(pod);
                    details.insert(
                        uid.clone(),
                        (label, service_account, rules::dns_capture(pod)),
                    );
                    queries.push(PodQuery {
                        uid: uid.clone(),
                        namespace: namespace.clone(),
                        name: name.clone(),
                        ips: rules::pod_ips(pod),
                    });
                }
                Err(why) => {
                    self.note(uid, debug_note(format!("{label} is not ambient: {why}")));
                    not_ambient.insert(uid.clone(), why.to_string());
                }
            }
        }

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

        let mut specs = Vec::new();
        let mut waiting = BTreeSet::new();
        for query in queries {
            let (label, service_account, dns_capture) =
                details.remove(&query.uid).expect("details of every query");
            match found.get(&query.uid) {
                Some(Ok(netns)) => {
                    self.note(
                        &query.uid,
                        format!(
                            "{label} is ambient; its network namespace is {}",
                            netns.path().display()
                        ),
                    );
                    specs.push(PodSpec {
                        workload: Workload {
                            uid: query.uid,
                            name: query.name,
                            namespace: query.namespace,
                            service_account,
                            netns: netns.clone(),
                        },
                        dns_capture,
                    });
                }
                Some(Err(why)) => {
                    self.note(
                        &query.uid,
                        format!("{label} is ambient but not enrolled yet: {why}"),
                    );
                    waiting.insert(query.uid);
                }
                None => {
                    self.note(
                        &query.uid,
                        format!("{label} is ambient but its network namespace is unknown"),
                    );
                    waiting.insert(query.uid);
                }
            }
        }
        specs.sort_by(|a, b| a.workload.uid.cmp(&b.workload.uid));
        self.notes.retain(|uid, _| present.contains(uid));

        let uids: BTreeSet<String> = specs.iter().map(|s| s.workload.uid.clone()).collect();
        let snapshot = SourcePods {
            ambient: specs,
            not_ambient,
            waiting,
        };
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

    /// Logs `text` about a pod when it differs from what was last logged
    /// (at debug level when it starts with [`DEBUG_NOTE`]).
    fn note(&mut self, uid: &str, text: String) {
        if self.notes.get(uid) == Some(&text) {
            return;
        }
        match text.strip_prefix(DEBUG_NOTE) {
            Some(quiet) => debug!("{quiet}"),
            None => info!("{text}"),
        }
        self.notes.insert(uid.to_owned(), text);
    }

    fn note_malformed<K>(&mut self, kind: &str, object: &Lenient<K>)
    where
        Lenient<K>:
            k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
    {
        let Err(why) = &object.object else { return };
        let meta = k8s_openapi::Metadata::metadata(object);
        let key = format!(
            "{kind} {}/{}",
            meta.namespace.as_deref().unwrap_or(""),
            meta.name.as_deref().unwrap_or("<unnamed>")
        );
        let version = meta.resource_version.clone();
        if self.malformed.get(&key) != Some(&version) {
            warn!(
                "skipping malformed {key} (resourceVersion {}): {why}",
                version.as_deref().unwrap_or("?")
            );
            self.malformed.insert(key, version);
        }
    }
}

const DEBUG_NOTE: &str = "debug: ";

fn debug_note(text: String) -> String {
    format!("{DEBUG_NOTE}{text}")
}

/// Whether an event changes the caches (the store swaps in a relist only at
/// `InitDone`); marks the stream synced at `InitDone`.
fn on_event<K>(
    what: &str,
    event: WatchResult<K>,
    synced: &mut bool,
    health: &mut StreamHealth,
) -> bool {
    match event {
        Ok(watcher::Event::InitDone) => {
            health.ok(what);
            if !*synced {
                debug!("{what} synced");
            }
            *synced = true;
            true
        }
        Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
            health.ok(what);
            true
        }
        Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => false,
        Err(error) => {
            health.failed(what, &error);
            false
        }
    }
}
