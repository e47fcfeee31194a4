//! The Kubernetes pod source against the test API server
//! (`ambpf_testbed::apiserver`): the real kube-rs client, watchers and
//! reflectors over HTTP on 127.0.0.1.
//!
//! Most tests inject network namespace discovery (a path per UID); the
//! discovery test at the end runs the real thing, with a process in a real
//! network namespace and a real cgroup named after the pod. The annotation
//! is tested from the annotator's inputs, then end to end with the real
//! controller, ZDS server and the ztunnel double (`ambpf_testbed::ztunnel`).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::{Arc, Mutex},
    time::Duration,
};

use ambpf::{
    controller::{CniRequest, Controller, EnrollRequest, SourcePods},
    netns::Netns,
    redirect::recorder::Recorder,
    sources::kube::{
        KubeSource, KubeSourceConfig, KubeSourceError, KubeSourceHandle, PodQuery,
        rules::{DATAPLANE_MODE_LABEL, DNS_CAPTURE_ANNOTATION, REDIRECTION_ANNOTATION},
    },
    zds::{NetnsSource, ZdsConfig, ZdsHandle, ZdsStats, ZtunnelStatus},
};
use ambpf_testbed::{
    CgroupGuard, NetnsGuard,
    apiserver::ApiServer,
    ztunnel::{ZdsEvent, ZtunnelConfig, ZtunnelDouble, ZtunnelState},
};
use serde_json::{Value, json};
use tokio::sync::watch;

mod common;
use common::Server;

/// Generous bound for anything that must happen; the tests never assert how
/// fast, only that it happens.
const PATIENCE: Duration = Duration::from_secs(20);
const NODE: &str = "node-1";

type Pods = watch::Receiver<Arc<SourcePods>>;

fn client(server: &ApiServer) -> kube::Client {
    let config = kube::Config::new(server.url().parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

/// A config that retries fast, so that tests do not wait on backoff.
fn config() -> KubeSourceConfig {
    let mut config = KubeSourceConfig::new(NODE);
    config.resync = Duration::from_millis(200);
    config.max_backoff = Duration::from_millis(300);
    config
}

/// Discovery that is not under test: every pod is at /run/netns/<uid>.
fn fake_netns(pod: &PodQuery) -> Result<NetnsSource, String> {
    Ok(NetnsSource::Path(PathBuf::from(format!(
        "/run/netns/{}",
        pod.uid
    ))))
}

async fn start(server: &ApiServer, config: KubeSourceConfig) -> (KubeSourceHandle, Pods) {
    common::init_logging();
    let (tx, rx) = watch::channel(Arc::default());
    let source = KubeSource::new(client(server), config).with_resolver(fake_netns);
    let handle = tokio::time::timeout(PATIENCE, source.start(tx))
        .await
        .expect("synced in time")
        .unwrap();
    (handle, rx)
}

fn namespace(name: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({ DATAPLANE_MODE_LABEL: "ambient" })
    } else {
        json!({ "team": "x" })
    };
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name, "labels": labels } })
}

/// A running pod of `NODE` whose UID is `uid-<name>`.
fn pod(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": namespace, "uid": format!("uid-{name}"), "labels": { "app": name } },
        "spec": { "nodeName": NODE, "serviceAccountName": format!("sa-{name}"), "containers": [{ "name": "app" }] },
        "status": { "phase": "Running" }
    })
}

fn with(mut object: Value, path: &[&str], value: Value) -> Value {
    let mut at = &mut object;
    for key in &path[..path.len() - 1] {
        at = at.as_object_mut().unwrap().entry(*key).or_insert(json!({}));
    }
    at[path[path.len() - 1]] = value;
    object
}

/// The UIDs of the ambient pods published.
fn uids(pods: &SourcePods) -> Vec<String> {
    pods.ambient
        .iter()
        .map(|p| p.workload.uid.clone())
        .collect()
}

/// The UIDs of the pods published as not ambient.
fn not_ambient(pods: &SourcePods) -> Vec<String> {
    pods.not_ambient.keys().cloned().collect()
}

/// Waits until the published set satisfies `done`.
async fn wait_for(
    pods: &mut Pods,
    what: &str,
    done: impl Fn(&SourcePods) -> bool,
) -> Arc<SourcePods> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let current = pods.borrow_and_update().clone();
        if done(&current) {
            return current;
        }
        if tokio::time::timeout_at(deadline, pods.changed())
            .await
            .is_err()
        {
            panic!(
                "timed out waiting for {what}; published: {:?}",
                uids(&current)
            );
        }
    }
}

async fn wait_for_uids(pods: &mut Pods, expected: &[&str]) -> Arc<SourcePods> {
    wait_for(pods, &format!("{expected:?}"), |p| uids(p) == expected).await
}

async fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn istios_enrolment_rules_apply_end_to_end() {
    let server = ApiServer::start().await.unwrap();
    for (name, ambient) in [
        ("mesh", true),
        ("plain", false),
        ("kube-system", true),
        ("infra", true),
    ] {
        server.apply("namespaces", namespace(name, ambient));
    }
    let ambient_label = json!({ DATAPLANE_MODE_LABEL: "ambient" });
    server.apply("pods", pod("mesh", "by-namespace"));
    server.apply(
        "pods",
        with(
            pod("plain", "by-pod"),
            &["metadata", "labels"],
            ambient_label.clone(),
        ),
    );
    server.apply("pods", pod("plain", "unlabelled"));
    server.apply(
        "pods",
        with(
            pod("mesh", "opted-out"),
            &["metadata", "labels"],
            json!({ DATAPLANE_MODE_LABEL: "none" }),
        ),
    );
    server.apply(
        "pods",
        with(
            pod("mesh", "host-network"),
            &["spec", "hostNetwork"],
            json!(true),
        ),
    );
    server.apply(
        "pods",
        with(
            pod("mesh", "sidecar"),
            &["spec", "containers"],
            json!([{ "name": "app" }, { "name": "istio-proxy" }]),
        ),
    );
    server.apply(
        "pods",
        with(
            pod("mesh", "injected"),
            &["metadata", "annotations"],
            json!({ "sidecar.istio.io/status": "{}" }),
        ),
    );
    server.apply(
        "pods",
        with(
            pod("mesh", "finished"),
            &["status", "phase"],
            json!("Succeeded"),
        ),
    );
    server.apply(
        "pods",
        with(pod("mesh", "failed"), &["status", "phase"], json!("Failed")),
    );
    server.apply("pods", pod("kube-system", "system"));
    server.apply("pods", pod("infra", "excluded-by-config"));
    server.apply(
        "pods",
        with(
            pod("mesh", "elsewhere"),
            &["spec", "nodeName"],
            json!("node-2"),
        ),
    );
    server.apply(
        "pods",
        with(
            pod("mesh", "no-dns"),
            &["metadata", "annotations"],
            json!({ DNS_CAPTURE_ANNOTATION: "false" }),
        ),
    );

    let mut config = config();
    config.excluded_namespaces.insert("infra".into());
    let (_source, pods) = start(&server, config).await;
    // The first publish is the complete snapshot.
    let first = pods.borrow().clone();
    assert_eq!(
        uids(&first),
        ["uid-by-namespace", "uid-by-pod", "uid-no-dns"]
    );
    let by_namespace = &first.ambient[0];
    assert_eq!(by_namespace.workload.name, "by-namespace");
    assert_eq!(by_namespace.workload.namespace, "mesh");
    assert_eq!(by_namespace.workload.service_account, "sa-by-namespace");
    assert_eq!(
        by_namespace.workload.netns,
        NetnsSource::Path("/run/netns/uid-by-namespace".into())
    );
    assert_eq!(by_namespace.dns_capture, None);
    assert_eq!(first.ambient[2].dns_capture, Some(false));

    // The pods of this node only, and the watches ask for bookmarks.
    eventually("both watches", || {
        server.open_watches("pods") > 0 && server.open_watches("namespaces") > 0
    })
    .await;
    let requests = server.requests();
    let pod_watch = requests
        .iter()
        .find(|r| r.path == "/api/v1/pods" && r.is_watch())
        .expect("a watch on pods");
    assert_eq!(
        pod_watch.query["fieldSelector"],
        format!("spec.nodeName={NODE}")
    );
    assert_eq!(pod_watch.query["allowWatchBookmarks"], "true");
    assert!(
        requests
            .iter()
            .any(|r| r.path == "/api/v1/namespaces" && r.is_watch())
    );
}

#[tokio::test]
async fn relabelling_and_deleting_enrols_and_removes_pods_live() {
    let server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", false));
    server.apply("pods", pod("shop", "web"));
    let (_source, mut pods) = start(&server, config()).await;
    assert!(pods.borrow().ambient.is_empty());

    let set_ns_mode = |mode: Value| {
        server.modify("namespaces", "", "shop", |ns| {
            ns["metadata"]["labels"][DATAPLANE_MODE_LABEL] = mode
        });
    };
    let set_pod_mode = |mode: Value| {
        server.modify("pods", "shop", "web", |p| {
            p["metadata"]["labels"][DATAPLANE_MODE_LABEL] = mode
        });
    };
    set_ns_mode(json!("ambient"));
    wait_for_uids(&mut pods, &["uid-web"]).await;
    set_pod_mode(json!("none"));
    wait_for_uids(&mut pods, &[]).await;
    server.modify("pods", "shop", "web", |p| {
        p["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove(DATAPLANE_MODE_LABEL);
    });
    wait_for_uids(&mut pods, &["uid-web"]).await;
    server.modify("namespaces", "", "shop", |ns| {
        ns["metadata"]["labels"] = json!({})
    });
    wait_for_uids(&mut pods, &[]).await;
    set_pod_mode(json!("ambient"));
    wait_for_uids(&mut pods, &["uid-web"]).await;

    // New pods join; deleted and finished ones leave.
    set_ns_mode(json!("ambient"));
    server.apply("pods", pod("shop", "db"));
    server.apply("pods", pod("shop", "job"));
    wait_for_uids(&mut pods, &["uid-db", "uid-job", "uid-web"]).await;
    server.delete("pods", "shop", "db");
    wait_for_uids(&mut pods, &["uid-job", "uid-web"]).await;
    server.modify("pods", "shop", "job", |p| {
        p["status"]["phase"] = json!("Succeeded")
    });
    wait_for_uids(&mut pods, &["uid-web"]).await;
    // A pod's DNS choice is followed live too.
    server.modify("pods", "shop", "web", |p| {
        p["metadata"]["annotations"] = json!({ DNS_CAPTURE_ANNOTATION: "false" })
    });
    wait_for(&mut pods, "dns opt-out", |p| {
        p.ambient.len() == 1 && p.ambient[0].dns_capture == Some(false)
    })
    .await;
}

#[tokio::test]
async fn pods_known_not_to_be_ambient_are_published_with_why_but_not_ambient_pods_without_a_netns()
{
    let server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("mesh", true));
    server.apply("namespaces", namespace("plain", false));
    server.apply("pods", pod("mesh", "web"));
    // Ambient, but its processes are not found yet (discovery fails).
    server.apply("pods", pod("mesh", "starting"));
    server.apply(
        "pods",
        with(
            pod("mesh", "opted-out"),
            &["metadata", "labels"],
            json!({ DATAPLANE_MODE_LABEL: "none" }),
        ),
    );
    server.apply("pods", pod("plain", "unlabelled"));
    server.apply(
        "pods",
        with(
            pod("plain", "elsewhere"),
            &["spec", "nodeName"],
            json!("node-2"),
        ),
    );
    common::init_logging();
    let (tx, mut pods) = watch::channel(Arc::default());
    let _source = KubeSource::new(client(&server), config())
        .with_resolver(|pod: &PodQuery| match pod.name.as_str() {
            "starting" => Err("no process of the pod yet".to_owned()),
            _ => fake_netns(pod),
        })
        .start(tx)
        .await
        .unwrap();

    let first = pods.borrow().clone();
    assert_eq!(uids(&first), ["uid-web"]);
    // Not "uid-starting" (ambient, netns pending) nor the other node's pod.
    assert_eq!(not_ambient(&first), ["uid-opted-out", "uid-unlabelled"]);
    assert_eq!(
        first.not_ambient["uid-opted-out"],
        "the pod is labelled istio.io/dataplane-mode=none"
    );
    assert!(
        first.not_ambient["uid-unlabelled"].contains("neither the pod nor its namespace"),
        "{:?}",
        first.not_ambient
    );

    // Opting out live moves a pod across; deleted pods leave the lists.
    server.modify("pods", "mesh", "web", |p| {
        p["metadata"]["labels"][DATAPLANE_MODE_LABEL] = json!("none")
    });
    server.delete("pods", "plain", "unlabelled");
    let now = wait_for(&mut pods, "web opted out", |p| {
        uids(p).is_empty() && not_ambient(p) == ["uid-opted-out", "uid-web"]
    })
    .await;
    assert!(!now.not_ambient.contains_key("uid-starting"));
}

/// Records every set the source publishes.
fn record(mut pods: Pods) -> Arc<Mutex<Vec<Vec<String>>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn({
        let seen = seen.clone();
        async move {
            while pods.changed().await.is_ok() {
                let current = uids(&pods.borrow_and_update());
                seen.lock().unwrap().push(current);
            }
        }
    });
    seen
}

#[tokio::test]
async fn watch_errors_and_410_relists_lose_nothing() {
    let server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    server.apply("pods", pod("shop", "stable"));
    server.apply("pods", pod("shop", "doomed"));
    let (_source, mut pods) = start(&server, config()).await;
    assert_eq!(uids(&pods.borrow()), ["uid-doomed", "uid-stable"]);
    let seen = record(pods.clone());
    // The watcher's lists, not the one-object probes of a failing watch's
    // recovery check.
    let lists = || {
        server
            .requests()
            .iter()
            .filter(|r| {
                r.path == "/api/v1/pods"
                    && !r.is_watch()
                    && r.query.get("limit").map(String::as_str) != Some("1")
            })
            .count()
    };
    let lists_before = lists();

    // An error event ends the watch; the watcher resumes where it was.
    eventually("watching pods", || server.open_watches("pods") > 0).await;
    server.watch_error(500, "InternalError", "etcd hiccup");
    server.apply("pods", pod("shop", "after-error"));
    wait_for_uids(&mut pods, &["uid-after-error", "uid-doomed", "uid-stable"]).await;
    // A clean end of the watch (timeout) is resumed too.
    eventually("watching pods", || server.open_watches("pods") > 0).await;
    server.break_watches();
    server.delete("pods", "shop", "after-error");
    wait_for_uids(&mut pods, &["uid-doomed", "uid-stable"]).await;
    assert_eq!(lists(), lists_before, "resuming needs no list");

    // 410 Gone: the versions are compacted, so the pods are listed again;
    // what changed meanwhile (a deletion included) is picked up.
    eventually("watching pods", || server.open_watches("pods") > 0).await;
    server.expire();
    server.delete("pods", "shop", "doomed");
    server.apply("pods", pod("shop", "newcomer"));
    wait_for_uids(&mut pods, &["uid-newcomer", "uid-stable"]).await;
    eventually("a relist", || lists() > lists_before).await;

    // A watch resuming from a compacted version gets 410 when it starts.
    // (A pod of another node moves the version past what the watch saw.)
    eventually("watching pods", || server.open_watches("pods") > 0).await;
    let lists_before = lists();
    server.apply(
        "pods",
        with(
            pod("shop", "elsewhere"),
            &["spec", "nodeName"],
            json!("node-2"),
        ),
    );
    server.compact();
    server.break_watches();
    server.apply("pods", pod("shop", "late"));
    wait_for_uids(&mut pods, &["uid-late", "uid-newcomer", "uid-stable"]).await;
    eventually("a relist", || lists() > lists_before).await;

    // The pod present throughout was never dropped, not even mid-relist.
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty());
    for set in seen.iter() {
        assert!(set.contains(&"uid-stable".to_owned()), "{seen:?}");
    }
}

#[tokio::test]
async fn malformed_objects_are_skipped_and_the_rest_apply() {
    let server = ApiServer::start().await.unwrap();
    // A namespace whose spec does not parse still enrols by its labels.
    server.apply(
        "namespaces",
        with(
            namespace("shop", true),
            &["spec"],
            json!({ "finalizers": "not a list" }),
        ),
    );
    server.apply("pods", pod("shop", "good"));
    server.apply(
        "pods",
        with(
            pod("shop", "bad-spec"),
            &["spec", "containers"],
            json!("not a list"),
        ),
    );
    server.apply(
        "pods",
        with(
            pod("shop", "bad-meta"),
            &["metadata", "labels"],
            json!(["not", "a", "map"]),
        ),
    );
    let (_source, mut pods) = start(&server, config()).await;
    assert_eq!(uids(&pods.borrow()), ["uid-good"]);

    // Malformed watch events and lines are skipped too; later changes apply.
    server.apply(
        "pods",
        with(pod("shop", "bad-later"), &["status", "phase"], json!(42)),
    );
    eventually("watching pods", || server.open_watches("pods") > 0).await;
    server.send_raw_watch_line("pods", "{this is not json");
    server.send_raw_watch_line("pods", r#"{"type":"ADDED","object":"not an object"}"#);
    server.apply("pods", pod("shop", "good-later"));
    wait_for_uids(&mut pods, &["uid-good", "uid-good-later"]).await;

    // A malformed pod that is fixed enrols.
    server.modify("pods", "shop", "bad-spec", |p| {
        p["spec"]["containers"] = json!([{ "name": "app" }])
    });
    wait_for_uids(&mut pods, &["uid-bad-spec", "uid-good", "uid-good-later"]).await;
}

#[tokio::test]
async fn the_source_keeps_its_last_set_while_the_api_server_is_away_and_recovers() {
    let mut server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    server.apply("pods", pod("shop", "a"));
    let (source, mut pods) = start(&server, config()).await;
    assert_eq!(uids(&pods.borrow()), ["uid-a"]);

    server.shutdown().await;
    // Changes made while the source cannot see them.
    server.delete("pods", "shop", "a");
    server.apply("pods", pod("shop", "b"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(uids(&pods.borrow()), ["uid-a"], "the last set is kept");
    assert!(source.is_running());

    server.restart().await.unwrap();
    wait_for_uids(&mut pods, &["uid-b"]).await;
    server.apply("pods", pod("shop", "c"));
    wait_for_uids(&mut pods, &["uid-b", "uid-c"]).await;

    // Away long enough for its versions to be compacted: relisted on return.
    server.shutdown().await;
    server.delete("pods", "shop", "b");
    server.expire();
    server.restart().await.unwrap();
    wait_for_uids(&mut pods, &["uid-c"]).await;
}

/// A kubeconfig for `server` whose user presents `token`.
fn kubeconfig_with_token(server: &ApiServer, token: &str) -> tempfile_path::TempKubeconfig {
    tempfile_path::TempKubeconfig::new(
        &server
            .kubeconfig()
            .replace("  user: {}\n", &format!("  user: {{token: {token}}}\n")),
    )
}

mod tempfile_path {
    use std::path::{Path, PathBuf};

    /// A kubeconfig file of the test's own, removed on drop.
    pub struct TempKubeconfig(PathBuf);

    impl TempKubeconfig {
        pub fn new(yaml: &str) -> Self {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("ambpf-kubeconfig-{}-{n}", std::process::id()));
            std::fs::write(&path, yaml).unwrap();
            Self(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempKubeconfig {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Starts a source with `client` that must wait, not Ready, saying `why`,
/// having published nothing; returns the start in flight.
async fn waits_saying(
    client: kube::Client,
    why: &str,
) -> (
    tokio::task::JoinHandle<Result<KubeSourceHandle, KubeSourceError>>,
    ambpf::sources::kube::SourceHealth,
    Pods,
) {
    let (tx, rx) = watch::channel(Arc::default());
    let source = KubeSource::new(client, config())
        .named("http://test")
        .with_resolver(fake_netns);
    let health = source.health();
    let starting = tokio::spawn(source.start(tx));
    eventually(&format!("not ready: {why}"), || {
        health.not_ready().is_some_and(|r| r.contains(why))
    })
    .await;
    // Still waiting after a few retries, with nothing published.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!starting.is_finished(), "started while: {why}");
    assert!(!rx.has_changed().unwrap(), "published while: {why}");
    (starting, health, rx)
}

/// Once the API server answers, the waiting start completes with the full
/// set, and the source is ready.
async fn starts_once_mended(
    (starting, health, mut pods): (
        tokio::task::JoinHandle<Result<KubeSourceHandle, KubeSourceError>>,
        ambpf::sources::kube::SourceHealth,
        Pods,
    ),
) -> KubeSourceHandle {
    let handle = tokio::time::timeout(PATIENCE, starting)
        .await
        .expect("started once the API server answers")
        .unwrap()
        .unwrap();
    assert_eq!(uids(&pods.borrow_and_update()), ["uid-a"]);
    assert_eq!(health.not_ready(), None);
    handle
}

#[tokio::test]
async fn start_waits_not_ready_while_the_api_server_says_no_and_starts_once_it_answers() {
    common::init_logging();
    let mut server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    server.apply("pods", pod("shop", "a"));

    // A missing node name is the one start-up error: nothing to wait for.
    let (tx, _rx) = watch::channel(Arc::default());
    let err = KubeSource::new(client(&server), KubeSourceConfig::new(""))
        .start(tx)
        .await
        .err()
        .expect("an error");
    assert!(matches!(err, KubeSourceError::NoNodeName), "{err}");
    assert!(err.to_string().contains("NODE_NAME"), "{err}");

    // RBAC lacking each verb the source needs.
    for (verb, resource) in [
        ("list", "pods"),
        ("watch", "pods"),
        ("list", "namespaces"),
        ("watch", "namespaces"),
    ] {
        server.deny(verb, resource);
        let why = format!("RBAC denies the agent `{verb}` on {resource}");
        let waiting = waits_saying(client(&server), &why).await;
        server.allow(verb, resource);
        starts_once_mended(waiting).await;
    }

    // A wrong or expired token, then one the API server takes.
    server.require_token(Some("fresh"));
    let expired = kubeconfig_with_token(&server, "expired");
    let expired = ambpf::sources::kube::client(Some(expired.path()))
        .await
        .unwrap();
    let waiting = waits_saying(
        expired,
        "the API server rejected the agent's credentials (401) to list pods: Unauthorized",
    )
    .await;
    server.require_token(Some("expired"));
    starts_once_mended(waiting).await;
    server.require_token(None);

    // The API server down, named, then back.
    server.shutdown().await;
    let waiting = waits_saying(
        client(&server),
        "the API server http://test: cannot list pods from the API server",
    )
    .await;
    server.restart().await.unwrap();
    starts_once_mended(waiting).await;

    let missing = ambpf::sources::kube::client(Some(Path::new("/nonexistent/kubeconfig")))
        .await
        .err()
        .expect("no kubeconfig there");
    assert!(
        missing.to_string().contains("/nonexistent/kubeconfig"),
        "{missing}"
    );
}

#[tokio::test]
async fn a_running_source_is_not_ready_while_its_watches_fail_and_keeps_its_set() {
    let mut server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    server.apply("pods", pod("shop", "a"));
    let (source, pods) = start(&server, config()).await;
    let health = source.health();
    assert_eq!(health.not_ready(), None);

    // RBAC loses `watch` on pods; the running watch ends (as it does on
    // its timeout) and cannot start again.
    server.deny("watch", "pods");
    server.break_watches();
    eventually("not ready without watch on pods", || {
        health
            .not_ready()
            .is_some_and(|r| r.contains("RBAC denies the agent `watch` on pods"))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(uids(&pods.borrow()), ["uid-a"], "the last set is kept");
    // Back with nothing changed: no event tells the watch recovered, the
    // source finds out by itself.
    server.allow("watch", "pods");
    eventually("ready again", || health.not_ready().is_none()).await;

    server.shutdown().await;
    eventually("not ready while the API server is away", || {
        health
            .not_ready()
            .is_some_and(|r| r.contains("cannot watch"))
    })
    .await;
    assert_eq!(uids(&pods.borrow()), ["uid-a"], "the last set is kept");
    server.restart().await.unwrap();
    eventually("ready again", || health.not_ready().is_none()).await;
    assert!(source.is_running());
}

fn annotation(server: &ApiServer, name: &str) -> Option<String> {
    let pod = server.object("pods", "shop", name)?;
    pod["metadata"]["annotations"][REDIRECTION_ANNOTATION]
        .as_str()
        .map(str::to_owned)
}

/// The values (`null`: removed) each patch of pod `name` set, in order.
fn patched_values(server: &ApiServer, name: &str) -> Vec<Value> {
    server
        .patches()
        .into_iter()
        .filter(|p| p.name == name)
        .map(|p| p.body["metadata"]["annotations"][REDIRECTION_ANNOTATION].clone())
        .collect()
}

async fn eventually_annotated(server: &ApiServer, name: &str, value: Option<&str>) {
    eventually(&format!("{name} annotated {value:?}"), || {
        annotation(server, name).as_deref() == value
    })
    .await;
}

#[tokio::test]
async fn enrolment_is_recorded_from_the_controllers_and_ztunnels_reports() {
    common::init_logging();
    let server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    server.apply("pods", pod("shop", "a"));
    server.apply("pods", pod("shop", "b"));
    // Left annotated by an earlier agent, but no longer ambient.
    server.apply(
        "pods",
        with(
            with(
                pod("shop", "stale"),
                &["metadata", "annotations"],
                json!({ REDIRECTION_ANNOTATION: "pending" }),
            ),
            &["metadata", "labels"],
            json!({ DATAPLANE_MODE_LABEL: "none" }),
        ),
    );
    let (programmed_tx, programmed_rx) = watch::channel(Arc::default());
    let (ztunnel_tx, ztunnel_rx) = watch::channel(Arc::new(BTreeMap::new()));
    let (tx, mut pods) = watch::channel(Arc::default());
    let _source = KubeSource::new(client(&server), config())
        .with_resolver(fake_netns)
        .annotate_from(programmed_rx, ztunnel_rx)
        .start(tx)
        .await
        .unwrap();
    assert_eq!(uids(&pods.borrow()), ["uid-a", "uid-b"]);

    let report = |uids: &[&str]| {
        programmed_tx.send_replace(Arc::new(ambpf::controller::PodsReport {
            programmed: uids.iter().map(|u| (*u).to_owned()).collect(),
            held_back: BTreeSet::new(),
            runtime_netns: Default::default(),
        }));
    };
    let ztunnel = |uid: &str, status: ZtunnelStatus| {
        ztunnel_tx.send_modify(|pods| {
            Arc::make_mut(pods).insert(uid.to_owned(), status);
        });
    };

    // Nothing is recorded before the controller reports, whatever ztunnel
    // says.
    ztunnel("uid-a", ZtunnelStatus::Acked);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(server.patches().is_empty(), "{:?}", server.patches());

    report(&["uid-a"]);
    eventually_annotated(&server, "a", Some("enabled")).await;
    eventually_annotated(&server, "stale", None).await;
    assert_eq!(annotation(&server, "b"), None, "b is not programmed yet");
    let patch = server
        .patches()
        .into_iter()
        .find(|p| p.name == "a")
        .unwrap();
    assert_eq!(patch.resource, "pods/status");
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert_eq!(
        patch.body,
        json!({ "metadata": { "annotations": { REDIRECTION_ANNOTATION: "enabled" } } })
    );

    // Programmed, its Add on its way to ztunnel: the answer decides.
    report(&["uid-a", "uid-b"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(annotation(&server, "b"), None);

    // No ztunnel to take it: pending. RBAC denies patching pods/status
    // first: logged and retried until allowed.
    server.deny("patch", "pods/status");
    ztunnel("uid-b", ZtunnelStatus::Unserved);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(annotation(&server, "b"), None);
    server.allow("patch", "pods/status");
    eventually_annotated(&server, "b", Some("pending")).await;

    // ztunnel acks it: enabled; NACKs it: pending again.
    ztunnel("uid-b", ZtunnelStatus::Acked);
    eventually_annotated(&server, "b", Some("enabled")).await;
    ztunnel("uid-b", ZtunnelStatus::Refused);
    eventually_annotated(&server, "b", Some("pending")).await;
    ztunnel("uid-b", ZtunnelStatus::Acked);
    eventually_annotated(&server, "b", Some("enabled")).await;
    // No ztunnel connected (as after an agent restart, before ztunnel
    // reconnects): ztunnel keeps the proxies it has, so enabled stays.
    ztunnel("uid-b", ZtunnelStatus::Unserved);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(annotation(&server, "b").as_deref(), Some("enabled"));

    // b leaves the mesh: its annotation stays until the controller has
    // removed it, then goes.
    server.modify("pods", "shop", "b", |p| {
        p["metadata"]["labels"][DATAPLANE_MODE_LABEL] = json!("none")
    });
    wait_for_uids(&mut pods, &["uid-a"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(annotation(&server, "b").as_deref(), Some("enabled"));
    report(&["uid-a"]);
    eventually_annotated(&server, "b", None).await;
    let removal = server
        .patches()
        .into_iter()
        .rfind(|p| p.name == "b")
        .unwrap();
    assert_eq!(
        removal.body,
        json!({ "metadata": { "annotations": { REDIRECTION_ANNOTATION: null } } })
    );

    // Each change was patched once, on the status subresource: a patch is
    // not repeated while the watch catches up.
    assert_eq!(patched_values(&server, "a"), [json!("enabled")]);
    assert_eq!(
        patched_values(&server, "b"),
        [
            json!("pending"),
            json!("enabled"),
            json!("pending"),
            json!("enabled"),
            Value::Null
        ]
    );
    assert_eq!(patched_values(&server, "stale"), [Value::Null]);
    assert!(server.patches().iter().all(|p| p.resource == "pods/status"));
}

#[tokio::test]
async fn with_the_controller_and_ztunnel_pods_are_pending_until_ztunnel_takes_them() {
    common::init_logging();
    let server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    let names = ["a", "b", "d", "e"];
    let netns: Vec<NetnsGuard> = names
        .iter()
        .map(|_| NetnsGuard::create("kube").unwrap())
        .collect();
    let paths: BTreeMap<String, PathBuf> = names
        .iter()
        .zip(&netns)
        .map(|(name, ns)| (format!("uid-{name}"), ns.path()))
        .collect();
    server.apply("pods", pod("shop", "a"));
    server.apply("pods", pod("shop", "b"));
    let resolver = move |pod: &PodQuery| match paths.get(&pod.uid) {
        Some(path) => Ok(NetnsSource::Path(path.clone())),
        None => Err(format!("no netns for {}", pod.uid)),
    };

    let zds_server = Server::start(ZdsConfig {
        retry_delay: Duration::from_millis(100),
        max_retry_delay: Duration::from_millis(400),
        ..Default::default()
    });
    let (zds, socket) = (zds_server.handle.clone(), zds_server.socket());
    let mut controller = Controller::new(Box::new(Recorder::default()), zds.clone(), true);
    let (programmed_tx, programmed_rx) = watch::channel(Arc::default());
    controller.report_programmed(programmed_tx);
    let (tx, rx) = watch::channel(Arc::default());
    let _source = KubeSource::new(client(&server), config())
        .with_resolver(resolver)
        .annotate_from(programmed_rx, zds.ztunnel_pods())
        .start(tx)
        .await
        .unwrap();
    // As `ambpf run` does: the complete first set is programmed before
    // anything else.
    let first = controller.apply(&rx.borrow().ambient);
    assert_eq!(first.enrolled, 2);
    assert_eq!(
        zds.workloads().keys().collect::<Vec<_>>(),
        ["uid-a", "uid-b"]
    );
    tokio::spawn(controller.run(rx));

    // Redirected, but no ztunnel has them yet: pending.
    eventually_annotated(&server, "a", Some("pending")).await;
    eventually_annotated(&server, "b", Some("pending")).await;

    // ztunnel connects and acks the snapshot: enabled.
    let ztunnel =
        ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only().nack("uid-d"));
    eventually_annotated(&server, "a", Some("enabled")).await;
    eventually_annotated(&server, "b", Some("enabled")).await;
    assert!(ztunnel.is_ready());
    for name in ["a", "b"] {
        assert_eq!(
            patched_values(&server, name),
            [json!("pending"), json!("enabled")]
        );
    }

    // A pod ztunnel refuses stays pending while the agent retries it, and is
    // enabled once ztunnel takes it.
    server.apply("pods", pod("shop", "d"));
    let nacked = |s: &ZtunnelState| {
        s.events
            .iter()
            .filter(|e| matches!(e, ZdsEvent::Nacked { uid: Some(uid), .. } if uid == "uid-d"))
            .count()
    };
    ztunnel
        .wait_until(|s| nacked(s) >= 2, PATIENCE)
        .await
        .unwrap();
    eventually_annotated(&server, "d", Some("pending")).await;
    ztunnel.set_nack("uid-d", false);
    eventually_annotated(&server, "d", Some("enabled")).await;
    assert_eq!(
        patched_values(&server, "d"),
        [json!("pending"), json!("enabled")]
    );

    // ztunnel restarts: the pods it had stay enabled while it is away, and
    // its new snapshot changes nothing.
    ztunnel.shutdown().await;
    eventually("the connection gone", || {
        ZdsStats::get(&zds.stats().connections_active) == 0
    })
    .await;
    let patches_before = server.patches().len();
    // A pod that arrives meanwhile is pending...
    server.apply("pods", pod("shop", "e"));
    eventually_annotated(&server, "e", Some("pending")).await;
    let ztunnel = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only());
    // ... until the new ztunnel takes it.
    eventually_annotated(&server, "e", Some("enabled")).await;
    ztunnel
        .wait_until(|s| s.ready && s.workloads.len() == 4, PATIENCE)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let since: Vec<String> = server.patches()[patches_before..]
        .iter()
        .map(|p| p.name.clone())
        .collect();
    assert_eq!(since, ["e", "e"], "only e was patched");
    for name in ["a", "b", "d"] {
        assert_eq!(annotation(&server, name).as_deref(), Some("enabled"));
    }

    // A pod that leaves: out of ztunnel, then unannotated.
    server.modify("pods", "shop", "a", |p| {
        p["metadata"]["labels"][DATAPLANE_MODE_LABEL] = json!("none")
    });
    ztunnel
        .wait_until(|s| !s.workloads.contains_key("uid-a"), PATIENCE)
        .await
        .unwrap();
    eventually_annotated(&server, "a", None).await;
    // A pod whose netns cannot be found is not handed to ztunnel, nor
    // annotated.
    server.apply("pods", pod("shop", "c"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!zds.workloads().contains_key("uid-c"));
    assert_eq!(annotation(&server, "c"), None);
    assert!(server.patches().iter().all(|p| p.resource == "pods/status"));
}

/// Asks the controller to enrol `uid` as the CNI endpoint does; its answer.
async fn cni_add(
    requests: &tokio::sync::mpsc::Sender<CniRequest>,
    uid: &str,
    netns: &NetnsGuard,
) -> Result<(), String> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let pod = ambpf::controller::PodSpec {
        workload: ambpf::zds::Workload {
            uid: uid.to_owned(),
            name: uid.trim_start_matches("uid-").to_owned(),
            namespace: "shop".to_owned(),
            service_account: "default".to_owned(),
            netns: NetnsSource::Path(netns.path()),
            netns_inode: None,
        },
        dns_capture: None,
    };
    let request = EnrollRequest { pod, reply };
    requests.send(request.into()).await.unwrap();
    tokio::time::timeout(PATIENCE, answer)
        .await
        .expect("answered in time")
        .unwrap()
        .map(drop)
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn a_pod_enrolled_by_cni_leaves_once_the_source_sees_it_opt_out() {
    common::init_logging();
    let server = ApiServer::start().await.unwrap();
    server.apply("namespaces", namespace("shop", true));
    let (fresh, unseen) = (
        NetnsGuard::create("kcni").unwrap(),
        NetnsGuard::create("kcni").unwrap(),
    );
    let fresh_inode = Netns::open(fresh.name()).unwrap().inode();
    let recorder = Recorder::default();
    let enrolled = recorder.enrolled.clone();
    let zds = ZdsHandle::new(ZdsConfig::default());
    let controller = Controller::new(Box::new(recorder), zds.clone(), true);
    // Discovery never finds a netns: every ambient pod of the source stays
    // "netns pending", covered by its CNI add alone.
    let (tx, rx) = watch::channel(Arc::default());
    let _source = KubeSource::new(client(&server), config())
        .with_resolver(|pod: &PodQuery| Err(format!("no process of {} yet", pod.uid)))
        .start(tx)
        .await
        .unwrap();
    let mut pods = rx.clone();
    let (requests, requests_rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(controller.run_with_requests(rx, Some(requests_rx)));

    // "fresh" is added by CNI before the source has it; "unseen" the
    // source never sees (the API server does not have it).
    cni_add(&requests, "uid-fresh", &fresh).await.unwrap();
    cni_add(&requests, "uid-unseen", &unseen).await.unwrap();
    server.apply("pods", pod("shop", "fresh"));
    // A pod applied after "fresh" shows the source has seen "fresh".
    server.apply(
        "pods",
        with(
            pod("shop", "marker"),
            &["metadata", "labels"],
            json!({ DATAPLANE_MODE_LABEL: "none" }),
        ),
    );
    wait_for(&mut pods, "the marker", |p| {
        p.not_ambient.contains_key("uid-marker")
    })
    .await;
    // Known as ambient, its netns not found: the CNI add keeps it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        zds.workloads().keys().collect::<Vec<_>>(),
        ["uid-fresh", "uid-unseen"]
    );
    assert!(enrolled.lock().unwrap().contains(&fresh_inode));

    // Opted out right after its creation: out of the redirection and of
    // ztunnel's set as soon as the source sees it; "unseen" stays.
    server.modify("pods", "shop", "fresh", |p| {
        p["metadata"]["labels"][DATAPLANE_MODE_LABEL] = json!("none")
    });
    eventually("fresh removed", || {
        !zds.workloads().contains_key("uid-fresh")
    })
    .await;
    assert!(!enrolled.lock().unwrap().contains(&fresh_inode));
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["uid-unseen"]);

    // A CNI add of a pod the source knows as not ambient is refused (the
    // runtime retries it, reading the pod afresh).
    let why = cni_add(&requests, "uid-fresh", &fresh).await.unwrap_err();
    assert!(why.contains("istio.io/dataplane-mode=none"), "{why}");
    assert!(!enrolled.lock().unwrap().contains(&fresh_inode));
}

/// A process of a pod: in the pod's network namespace and in a cgroup named
/// as the kubelet's systemd driver names a pod's (`..-pod<uid_>.slice`).
struct PodProcess {
    child: Child,
    cgroup: PathBuf,
}

impl PodProcess {
    fn spawn(netns: &NetnsGuard, parent: &CgroupGuard, uid: &str) -> Self {
        let cgroup = parent.path().join(format!(
            "kubepods-besteffort-pod{}.slice",
            uid.replace('-', "_")
        ));
        std::fs::create_dir_all(&cgroup).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", netns.name(), "sleep", "300"])
            .spawn()
            .unwrap();
        std::fs::write(cgroup.join("cgroup.procs"), child.id().to_string()).unwrap();
        Self { child, cgroup }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn netns_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.pid()))
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Err(e) = std::fs::remove_dir(&self.cgroup) {
            eprintln!("cannot remove cgroup {}: {e}", self.cgroup.display());
        }
    }
}

#[tokio::test]
async fn real_network_namespaces_are_found_through_proc_and_followed_across_restarts() {
    common::init_logging();
    let server = ApiServer::start().await.unwrap();
    let cgroups = CgroupGuard::create().unwrap();
    let netns = NetnsGuard::create("kpod").unwrap();
    netns
        .ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
        ])
        .unwrap();
    netns
        .ip(&["addr", "add", "10.77.0.5/32", "dev", "eth0"])
        .unwrap();
    netns.ip(&["link", "set", "eth0", "up"]).unwrap();
    let (uid_web, uid_visitor) = (
        "6f1c2a3b-0000-4000-8000-00000000c0de",
        "6f1c2a3b-0000-4000-8000-0000000beef0",
    );

    server.apply("namespaces", namespace("shop", true));
    let status = |ip: &str| json!({ "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] });
    server.apply(
        "pods",
        with(
            with(pod("shop", "web"), &["metadata", "uid"], json!(uid_web)),
            &["status"],
            status("10.77.0.5"),
        ),
    );
    // A pod with a process in web's namespace, whose own IP is not there: a
    // visitor, not its namespace.
    server.apply(
        "pods",
        with(
            with(
                pod("shop", "visitor"),
                &["metadata", "uid"],
                json!(uid_visitor),
            ),
            &["status"],
            status("10.77.0.9"),
        ),
    );

    let mut web = PodProcess::spawn(&netns, &cgroups, uid_web);
    let _visitor = PodProcess::spawn(&netns, &cgroups, uid_visitor);
    let (tx, mut pods) = watch::channel(Arc::default());
    let _source = KubeSource::new(client(&server), config())
        .start(tx)
        .await
        .unwrap();
    let found = wait_for_uids(&mut pods, &[uid_web]).await;
    assert_eq!(
        found.ambient[0].workload.netns,
        NetnsSource::Path(web.netns_path())
    );
    let inode = |path: &Path| Netns::open(&path.to_string_lossy()).unwrap().inode();
    assert_eq!(inode(&web.netns_path()), inode(&netns.path()));

    // The container restarts: a new process in the same namespace.
    let old = web.netns_path();
    drop(web);
    web = PodProcess::spawn(&netns, &cgroups, uid_web);
    let moved = wait_for(&mut pods, "the new process", |p| {
        p.ambient.len() == 1 && p.ambient[0].workload.netns == NetnsSource::Path(web.netns_path())
    })
    .await;
    assert_ne!(moved.ambient[0].workload.netns, NetnsSource::Path(old));

    // All of the pod's processes gone: it leaves the set until it is back.
    drop(web);
    wait_for_uids(&mut pods, &[]).await;
    let _web = PodProcess::spawn(&netns, &cgroups, uid_web);
    wait_for_uids(&mut pods, &[uid_web]).await;
}
