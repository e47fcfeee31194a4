//! Which of the pods the plugin posts the agent enrols.
//!
//! With the Kubernetes pod source the endpoint decides as Istio's CNI plugin
//! does: it reads the pod and its namespace from the source's caches (as
//! Istio's node agent reads its informers'), or from the API server (the
//! client the source uses) when the caches do not have this pod (by UID) or
//! its namespace yet, and applies the ambient rules ([`rules::ambient`]).
//!
//! - Not ambient: skipped; the plugin lets the pod start unredirected.
//! - A namespace in the excluded list is skipped without asking, so system
//!   pods start even while the API server is away.
//! - The pod is gone from the API server, or its name now belongs to a pod
//!   with another UID: it was deleted while its sandbox was being set up;
//!   skipped (the runtime is about to tear the sandbox down).
//! - No answer (API server unreachable, slower than [`API_TIMEOUT`], RBAC,
//!   a pod object that does not parse): an error, so the ADD fails and the
//!   runtime retries the sandbox. The agent cannot tell whether the pod is
//!   ambient, and starting an ambient app without redirection is worse than
//!   a retried pod start.
//!
//! Without Kubernetes (the local pod source, or none) there is no one to
//! ask: every posted pod is enrolled.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use k8s_openapi::{Metadata as _, api::core::v1::Namespace};
use kube::{Api, Client, runtime::reflector::ObjectRef};

use super::CmdAdd;
use crate::{
    controller::PodSpec,
    sources::kube::{
        KubeCaches, KubeSourceError, Lenient, WatchedPod, api_error,
        rules::{self, NotAmbient},
    },
    zds::{NetnsSource, Workload},
};

/// How long the two reads from the API server may take together.
pub const API_TIMEOUT: Duration = Duration::from_secs(5);

/// Which posted pods are enrolled.
#[derive(Clone)]
pub enum PodSelection {
    /// Every one (no Kubernetes to ask).
    Every,
    /// The ambient ones, by the pod and its namespace in the API server.
    Ambient(AmbientLookup),
}

/// Istio's ambient rules on pods read from the source's caches or the API
/// server.
#[derive(Clone)]
pub struct AmbientLookup {
    client: Client,
    caches: Option<KubeCaches>,
    excluded_namespaces: Arc<BTreeSet<String>>,
    timeout: Duration,
}

/// What to do with a posted pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Enroll(PodSpec),
    Skip(SkipReason),
}

/// Why a posted pod is not enrolled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    NotAmbient(NotAmbient),
    /// The API server has no such pod.
    PodNotFound,
    /// The pod's name belongs to a newer pod, with this UID.
    Replaced {
        uid: String,
    },
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::NotAmbient(why) => write!(f, "not ambient: {why}"),
            SkipReason::PodNotFound => f.write_str(
                "the pod is not in the API server (deleted while its network was being set up)",
            ),
            SkipReason::Replaced { uid } => write!(
                f,
                "a newer pod of that name (UID {uid}) replaced it (deleted while its network was \
                 being set up)"
            ),
        }
    }
}

/// Why it cannot be told whether a posted pod is ambient.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error(transparent)]
    Api(KubeSourceError),
    #[error("the API server did not answer within {} s", .0.as_secs_f64())]
    Timeout(Duration),
    #[error("the pod object from the API server does not parse: {0}")]
    MalformedPod(String),
}

impl PodSelection {
    /// Decides about a posted pod.
    pub async fn select(&self, add: &CmdAdd) -> Result<Verdict, LookupError> {
        match self {
            PodSelection::Every => Ok(Verdict::Enroll(posted_pod(add))),
            PodSelection::Ambient(lookup) => lookup.select(add).await,
        }
    }
}

impl AmbientLookup {
    pub fn new(client: Client, excluded_namespaces: BTreeSet<String>) -> Self {
        Self {
            client,
            caches: None,
            excluded_namespaces: Arc::new(excluded_namespaces),
            timeout: API_TIMEOUT,
        }
    }

    /// Reads the pod and its namespace from `caches` first: a pod start
    /// then waits on no API round trip.
    pub fn with_caches(mut self, caches: KubeCaches) -> Self {
        self.caches = Some(caches);
        self
    }

    /// The decision from the caches, if they hold this pod (same UID) and
    /// its namespace. A cache that lags (the pod just created, or replaced
    /// by a newer one of the same name) leaves it to the API server.
    fn select_cached(&self, add: &CmdAdd) -> Option<Result<Verdict, LookupError>> {
        let caches = self.caches.as_ref()?;
        let pod = caches
            .pods
            .get(&ObjectRef::new(&add.pod_name).within(&add.pod_namespace))?;
        if pod.metadata().uid.as_deref() != Some(add.pod_uid.as_str()) {
            return None;
        }
        let namespace = caches.namespaces.get(&ObjectRef::new(&add.pod_namespace))?;
        let labels = namespace.metadata().labels.as_ref();
        Some(decide(add, Some(&*pod), labels, &self.excluded_namespaces))
    }

    /// Replaces [`API_TIMEOUT`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn select(&self, add: &CmdAdd) -> Result<Verdict, LookupError> {
        if self.excluded_namespaces.contains(&add.pod_namespace) {
            return Ok(Verdict::Skip(SkipReason::NotAmbient(
                NotAmbient::ExcludedNamespace,
            )));
        }
        if let Some(cached) = self.select_cached(add) {
            return cached;
        }
        let pods = Api::<Lenient<WatchedPod>>::namespaced(self.client.clone(), &add.pod_namespace);
        let namespaces = Api::<Lenient<Namespace>>::all(self.client.clone());
        // Both at once: the pod's start waits on them.
        let reads = async {
            tokio::join!(
                pods.get_opt(&add.pod_name),
                namespaces.get_opt(&add.pod_namespace)
            )
        };
        let (pod, namespace) = tokio::time::timeout(self.timeout, reads)
            .await
            .map_err(|_| LookupError::Timeout(self.timeout))?;
        let pod = pod.map_err(|e| LookupError::Api(api_error("get", "pods", e)))?;
        if pod.is_none() {
            // The namespace does not matter then, nor whether it could be read.
            return decide(add, None, None, &self.excluded_namespaces);
        }
        let namespace =
            namespace.map_err(|e| LookupError::Api(api_error("get", "namespaces", e)))?;
        // A namespace that is gone (or unreadable as a whole) counts as
        // unlabelled, as in the source.
        let labels = namespace
            .as_ref()
            .and_then(|ns| ns.metadata().labels.as_ref());
        decide(add, pod.as_ref(), labels, &self.excluded_namespaces)
    }
}

/// The decision for a posted pod, from what the API server holds: `pod`
/// (`None`: not found) and its namespace's labels.
pub fn decide(
    add: &CmdAdd,
    pod: Option<&Lenient<WatchedPod>>,
    namespace_labels: Option<&BTreeMap<String, String>>,
    excluded_namespaces: &BTreeSet<String>,
) -> Result<Verdict, LookupError> {
    let Some(pod) = pod else {
        return Ok(Verdict::Skip(SkipReason::PodNotFound));
    };
    if let Some(uid) = &pod.metadata().uid
        && *uid != add.pod_uid
    {
        return Ok(Verdict::Skip(SkipReason::Replaced { uid: uid.clone() }));
    }
    let pod = pod
        .object
        .as_ref()
        .map_err(|why| LookupError::MalformedPod(why.clone()))?;
    match rules::ambient(pod, namespace_labels, excluded_namespaces) {
        Err(why) => Ok(Verdict::Skip(SkipReason::NotAmbient(why))),
        // As the source will report it (but for the netns path): ztunnel
        // gets the pod's service account now, and its DNS choice applies
        // from the start.
        Ok(()) => Ok(Verdict::Enroll(PodSpec {
            workload: Workload {
                service_account: rules::service_account(pod),
                ..posted_pod(add).workload
            },
            dns_capture: rules::dns_capture(pod),
        })),
    }
}

/// The pod as the plugin describes it.
fn posted_pod(add: &CmdAdd) -> PodSpec {
    PodSpec {
        workload: Workload {
            uid: add.pod_uid.clone(),
            name: add.pod_name.clone(),
            namespace: add.pod_namespace.clone(),
            // Not known from the CNI call; a pod source fills it in when it
            // reports the pod.
            service_account: String::new(),
            netns: NetnsSource::Path(PathBuf::from(&add.netns)),
            netns_inode: None,
        },
        dns_capture: None,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use crate::sources::kube::pod::{NamedContainer, WatchedPodSpec};

    use super::*;

    const UID: &str = "6f1c2a3b-0000-4000-8000-00000000c0de";

    fn add() -> CmdAdd {
        CmdAdd {
            pod_name: "web-0".into(),
            pod_namespace: "shop".into(),
            pod_uid: UID.into(),
            netns: "/var/run/netns/cni-1234".into(),
            ips: vec!["10.244.1.5".parse().unwrap()],
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// The pod as the API server has it when the runtime calls ADD.
    fn pod(pod_labels: &[(&str, &str)]) -> WatchedPod {
        WatchedPod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                namespace: Some("shop".into()),
                uid: Some(UID.into()),
                labels: Some(labels(pod_labels)),
                ..Default::default()
            },
            spec: Some(WatchedPodSpec {
                service_account_name: Some("web".into()),
                containers: vec![NamedContainer { name: "web".into() }],
                ..Default::default()
            }),
            status: None,
        }
    }

    fn excluded() -> BTreeSet<String> {
        ["kube-system".to_owned()].into()
    }

    const AMBIENT: &[(&str, &str)] = &[(rules::DATAPLANE_MODE_LABEL, "ambient")];

    fn decide_for(pod: &WatchedPod, namespace: &[(&str, &str)]) -> Verdict {
        decide(
            &add(),
            Some(&Lenient::new(pod.clone())),
            Some(&labels(namespace)),
            &excluded(),
        )
        .unwrap()
    }

    #[test]
    fn an_ambient_pod_is_enrolled_with_its_identity_from_the_api_server() {
        let mut annotated = pod(&[]);
        annotated.metadata.annotations = Some(labels(&[(rules::DNS_CAPTURE_ANNOTATION, "false")]));
        let Verdict::Enroll(spec) = decide_for(&annotated, AMBIENT) else {
            panic!("not enrolled");
        };
        assert_eq!(
            spec,
            PodSpec {
                workload: Workload {
                    uid: UID.into(),
                    name: "web-0".into(),
                    namespace: "shop".into(),
                    service_account: "web".into(),
                    netns: NetnsSource::Path("/var/run/netns/cni-1234".into()),
                    netns_inode: None,
                },
                dns_capture: Some(false),
            }
        );
        // By the pod's own label too.
        assert!(matches!(
            decide_for(&pod(AMBIENT), &[("team", "shop")]),
            Verdict::Enroll(_)
        ));
        // The namespace gone or unreadable counts as unlabelled.
        let by_pod_only = decide(&add(), Some(&Lenient::new(pod(AMBIENT))), None, &excluded());
        assert!(matches!(by_pod_only, Ok(Verdict::Enroll(_))));
    }

    #[test]
    fn pods_that_are_not_ambient_are_skipped_with_the_rule_that_says_so() {
        let not = |why| Verdict::Skip(SkipReason::NotAmbient(why));
        assert_eq!(
            decide_for(&pod(&[]), &[("team", "shop")]),
            not(NotAmbient::NotLabelled)
        );
        assert_eq!(
            decide(&add(), Some(&Lenient::new(pod(&[]))), None, &excluded()).unwrap(),
            not(NotAmbient::NotLabelled)
        );
        assert_eq!(
            decide_for(&pod(&[(rules::DATAPLANE_MODE_LABEL, "none")]), AMBIENT),
            not(NotAmbient::OptedOut)
        );
        let mut sidecar = pod(&[]);
        sidecar
            .spec
            .as_mut()
            .unwrap()
            .containers
            .push(NamedContainer {
                name: rules::SIDECAR_CONTAINER.into(),
            });
        assert_eq!(decide_for(&sidecar, AMBIENT), not(NotAmbient::Sidecar));
        let mut system = pod(AMBIENT);
        system.metadata.namespace = Some("kube-system".into());
        assert_eq!(
            decide_for(&system, AMBIENT),
            not(NotAmbient::ExcludedNamespace)
        );
        let reason = SkipReason::NotAmbient(NotAmbient::NotLabelled).to_string();
        assert!(
            reason.starts_with("not ambient: ")
                && reason.contains("istio.io/dataplane-mode=ambient"),
            "{reason}"
        );
    }

    #[test]
    fn a_pod_deleted_during_its_setup_is_skipped() {
        assert_eq!(
            decide(&add(), None, Some(&labels(AMBIENT)), &excluded()).unwrap(),
            Verdict::Skip(SkipReason::PodNotFound)
        );
        // Deleted and re-created under the same name (a StatefulSet's pod):
        // this sandbox is the old pod's.
        let mut newer = pod(AMBIENT);
        newer.metadata.uid = Some("7a2e0000-0000-4000-8000-000000000001".into());
        let verdict = decide_for(&newer, AMBIENT);
        assert_eq!(
            verdict,
            Verdict::Skip(SkipReason::Replaced {
                uid: "7a2e0000-0000-4000-8000-000000000001".into()
            })
        );
        let Verdict::Skip(reason) = verdict else {
            unreachable!()
        };
        assert!(reason.to_string().contains("7a2e0000"), "{reason}");
    }

    #[test]
    fn a_pod_object_that_does_not_parse_is_an_error_not_a_guess() {
        let malformed: Lenient<WatchedPod> = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "web-0", "namespace": "shop", "uid": UID,
                          "labels": { "istio.io/dataplane-mode": "ambient" } },
            "spec": { "containers": "not a list" }
        }))
        .unwrap();
        let err = decide(&add(), Some(&malformed), None, &excluded()).unwrap_err();
        assert!(matches!(err, LookupError::MalformedPod(_)), "{err}");
        assert!(err.to_string().contains("does not parse"), "{err}");
    }

    #[tokio::test]
    async fn an_api_server_that_does_not_answer_is_a_timeout_but_excluded_pods_need_no_answer() {
        // Accepts connections and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", silent.local_addr().unwrap());
        let client = Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
        let lookup =
            AmbientLookup::new(client, excluded()).with_timeout(Duration::from_millis(200));
        let selection = PodSelection::Ambient(lookup);
        let err = selection.select(&add()).await.unwrap_err();
        assert!(matches!(err, LookupError::Timeout(_)), "{err}");
        assert_eq!(
            err.to_string(),
            "the API server did not answer within 0.2 s"
        );

        let system = CmdAdd {
            pod_namespace: "kube-system".into(),
            ..add()
        };
        assert_eq!(
            selection.select(&system).await.unwrap(),
            Verdict::Skip(SkipReason::NotAmbient(NotAmbient::ExcludedNamespace))
        );
    }

    #[tokio::test]
    async fn the_caches_answer_for_the_pod_they_hold_and_the_api_server_for_the_rest() {
        use k8s_openapi::api::core::v1::Namespace;
        use kube::runtime::{reflector, watcher};
        // The API server never answers: only the caches can decide in time.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", silent.local_addr().unwrap());
        let client = Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
        let (pods, mut pod_writer) = reflector::store::<Lenient<WatchedPod>>();
        let (namespaces, mut namespace_writer) = reflector::store::<Lenient<Namespace>>();
        pod_writer.apply_watcher_event(&watcher::Event::Apply(Lenient::new(pod(&[]))));
        let shop = Namespace {
            metadata: ObjectMeta {
                name: Some("shop".into()),
                labels: Some(labels(AMBIENT)),
                ..Default::default()
            },
            ..Default::default()
        };
        namespace_writer.apply_watcher_event(&watcher::Event::Apply(Lenient::new(shop)));
        let lookup = AmbientLookup::new(client, excluded())
            .with_timeout(Duration::from_millis(200))
            .with_caches(KubeCaches { pods, namespaces });
        let selection = PodSelection::Ambient(lookup);
        let Verdict::Enroll(spec) = selection.select(&add()).await.unwrap() else {
            panic!("not enrolled");
        };
        assert_eq!(spec.workload.uid, UID);

        // The cache holds an older pod of that name: ask the API server.
        let replaced = CmdAdd {
            pod_uid: "6f1c2a3b-0000-4000-8000-0000000000ff".into(),
            ..add()
        };
        let err = selection.select(&replaced).await.unwrap_err();
        assert!(matches!(err, LookupError::Timeout(_)), "{err}");
        // A pod the cache does not have yet, too.
        let unseen = CmdAdd {
            pod_name: "web-1".into(),
            ..add()
        };
        let err = selection.select(&unseen).await.unwrap_err();
        assert!(matches!(err, LookupError::Timeout(_)), "{err}");
    }

    #[tokio::test]
    async fn without_kubernetes_every_posted_pod_is_enrolled_as_posted() {
        let verdict = PodSelection::Every.select(&add()).await.unwrap();
        let Verdict::Enroll(spec) = verdict else {
            panic!("skipped")
        };
        assert_eq!(spec.workload.uid, UID);
        assert_eq!(spec.workload.service_account, "");
        assert_eq!(
            spec.workload.netns,
            NetnsSource::Path("/var/run/netns/cni-1234".into())
        );
        assert_eq!(spec.dns_capture, None);
    }
}
