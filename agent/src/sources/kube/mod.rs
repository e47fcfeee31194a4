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
//! Until the API server answers a list and a watch of both, [`KubeSource::start`]
//! waits, retrying with backoff and logging each new reason once; while a
//! watch fails later, the source keeps its last set. Both make the agent not
//! Ready ([`SourceHealth`]) without changing what is enrolled.
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
mod engine;
mod evaluate;
pub mod health;
pub mod lenient;
pub mod netns;
pub mod pod;
pub mod rules;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use futures::{FutureExt as _, Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt as _,
        reflector::{self, Store},
        utils::Backoff,
        watcher,
    },
};
use tokio::{
    sync::{Notify, oneshot, watch},
    task::JoinHandle,
};
use tracing::{debug, info, warn};

use self::{engine::Engine, evaluate::Notes};
pub use self::{
    health::SourceHealth,
    lenient::Lenient,
    netns::{NetnsResolver, PodQuery, ProcNetnsFinder},
    pod::WatchedPod,
};
use crate::{
    controller::{ProgrammedPods, SourcePods},
    zds::ZtunnelPods,
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
    connect(kubeconfig).await.map(|(client, _)| client)
}

/// [`client`], and the URL of the API server it talks to.
pub async fn connect(kubeconfig: Option<&Path>) -> Result<(Client, String), KubeSourceError> {
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
    let url = config.cluster_url.to_string();
    Ok((
        Client::try_from(config).map_err(KubeSourceError::Client)?,
        url,
    ))
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
    health: SourceHealth,
    api_server: String,
}

/// The running source's tasks; dropping it stops them.
pub struct KubeSourceHandle {
    tasks: Vec<JoinHandle<()>>,
    caches: KubeCaches,
    health: SourceHealth,
}

/// The source's caches of this node's pods and of the namespaces, kept by
/// its watches.
#[derive(Clone)]
pub struct KubeCaches {
    pub pods: Store<Lenient<WatchedPod>>,
    pub namespaces: Store<Lenient<Namespace>>,
}

impl KubeSourceHandle {
    /// The source's caches, for readers that can do with what the watches
    /// have delivered (the CNI endpoint).
    pub fn caches(&self) -> KubeCaches {
        self.caches.clone()
    }

    /// Whether the source serves (see [`SourceHealth`]).
    pub fn health(&self) -> SourceHealth {
        self.health.clone()
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
            health: SourceHealth::new(),
            api_server: "the API server".to_owned(),
        }
    }

    /// Names the API server in the log (`client` does not tell its URL).
    pub fn named(mut self, api_server: impl std::fmt::Display) -> Self {
        self.api_server = format!("the API server {api_server}");
        self
    }

    /// Whether the source serves: follow it from before [`Self::start`].
    pub fn health(&self) -> SourceHealth {
        self.health.clone()
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

    /// Waits until the API server answers (and RBAC allows) a list and a
    /// watch of pods and namespaces, retrying with backoff and not Ready
    /// meanwhile; starts the reflectors and returns once the first complete
    /// set has been published into `pods`. Needs a tokio runtime.
    pub async fn start(
        self,
        pods: watch::Sender<Arc<SourcePods>>,
    ) -> Result<KubeSourceHandle, KubeSourceError> {
        let Self {
            client,
            config,
            resolver,
            annotate,
            health,
            api_server,
        } = self;
        if config.node_name.is_empty() {
            return Err(KubeSourceError::NoNodeName);
        }
        let node_selector = format!("spec.nodeName={}", config.node_name);
        wait_for_api_server(&client, &node_selector, &health, &api_server, &config).await;

        let backoff = || RetryBackoff::new(config.max_backoff);
        let (pod_store, pod_writer) = reflector::store::<Lenient<WatchedPod>>();
        let pod_events = reflector::reflector(
            pod_writer,
            watcher(
                Api::<Lenient<WatchedPod>>::all(client.clone()),
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
            health: health.clone(),
            notes: Notes::default(),
            first: true,
            last: None,
            reports: annotate.as_ref().map(|(programmed, _)| programmed.clone()),
        };
        let caches = KubeCaches {
            pods: pod_store.clone(),
            namespaces: namespace_store,
        };
        let (synced_tx, synced_rx) = oneshot::channel();
        let mut tasks = vec![
            tokio::spawn(engine.run(pod_events, namespace_events, synced_tx)),
            tokio::spawn(health::recheck(
                client.clone(),
                node_selector,
                health.clone(),
                config.resync,
            )),
        ];
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
        let handle = KubeSourceHandle {
            tasks,
            caches,
            health,
        };
        synced_rx.await.map_err(|_| KubeSourceError::Stopped)?;
        Ok(handle)
    }
}

/// Probes the API server until it answers what the source needs; each new
/// reason it does not is logged once, and is the agent's readiness answer.
async fn wait_for_api_server(
    client: &Client,
    node_selector: &str,
    health: &SourceHealth,
    api_server: &str,
    config: &KubeSourceConfig,
) {
    let mut backoff = RetryBackoff::new(config.max_backoff);
    let mut failing = false;
    loop {
        let Err(error) = health::probe(client, node_selector).await else {
            if failing {
                info!(
                    "{api_server} answers: listing the pods of node {}",
                    config.node_name
                );
            }
            return;
        };
        let why = format!("{api_server}: {error}");
        let kind = match &error {
            KubeSourceError::Forbidden { verb, resource, .. } => format!("403 {verb} {resource}"),
            KubeSourceError::Unauthorized { .. } => "401".to_owned(),
            _ => "unreachable".to_owned(),
        };
        let problem = health::Problem {
            kind,
            why: format!("not ready: {why}"),
        };
        if health.fail(health::START, problem) {
            warn!(
                "{why}; not ready, retrying with backoff (up to {} s)",
                config.max_backoff.as_secs()
            );
        } else {
            debug!("{why}");
        }
        failing = true;
        tokio::time::sleep(backoff.next().unwrap_or(config.max_backoff)).await;
    }
}

fn check<T>(
    verb: &'static str,
    resource: &'static str,
    result: Result<T, kube::Error>,
) -> Result<T, KubeSourceError> {
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
