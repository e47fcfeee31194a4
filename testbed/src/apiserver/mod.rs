//! A test Kubernetes API server: enough of the core/v1 REST API (and of
//! apps/v1 for `daemonsets`) for kube-rs's client, watchers and reflectors,
//! served over plain HTTP/1.1 on 127.0.0.1.
//!
//! Objects are arbitrary JSON (so a test can store malformed ones) kept per
//! resource (`pods`, `namespaces`, `daemonsets`, ...), keyed by namespace and
//! name. Every change bumps one global `resourceVersion`, as etcd does, and
//! is kept in a history that watches replay from the version they ask for.
//!
//! Served, under `/api/v1` for the core resources and `/apis/apps/v1` for
//! `daemonsets` (written for the core group below):
//! - list: `GET /api/v1/{resource}` and `/api/v1/namespaces/{ns}/{resource}`,
//!   with `fieldSelector` and `labelSelector` (`=`, `==`, `!=`), answering a
//!   `{Kind}List` whose `metadata.resourceVersion` is the current version;
//! - watch: the same with `watch=true`: a chunked stream of JSON lines
//!   (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK` when `allowWatchBookmarks`,
//!   `ERROR`), resuming after `resourceVersion` (absent or `0`: the current
//!   objects as `ADDED` first), ending after `timeoutSeconds`; a version older
//!   than the last [`ApiServer::expire`] gets an `ERROR` event with code 410,
//!   as a real API server answers a compacted version; `sendInitialEvents`
//!   (streaming lists) ends the initial objects with the
//!   `k8s.io/initial-events-end` bookmark;
//! - get: `GET /api/v1/namespaces/{ns}/{resource}/{name}`, `/api/v1/{resource}/{name}`;
//! - patch: `PATCH` on an object or its `status` subresource with
//!   `application/merge-patch+json` (RFC 7386), recorded for
//!   [`ApiServer::patches`];
//! - discovery: `/api`, `/api/v1`, `/apis`, `/apis/apps/v1`, `/version`.
//!
//! Test controls: [`ApiServer::apply`], [`ApiServer::modify`] and
//! [`ApiServer::delete`] objects; [`ApiServer::expire`] or
//! [`ApiServer::compact`] resource versions (410); end watches with
//! [`ApiServer::break_watches`] or [`ApiServer::watch_error`]; send
//! [`ApiServer::send_raw_watch_line`]; [`ApiServer::deny`] a verb on a
//! resource (403, as RBAC answers); accept only one bearer token
//! ([`ApiServer::require_token`]; any other gets 401, as a real API server
//! answers a wrong or expired token); [`ApiServer::shutdown`] and
//! [`ApiServer::restart`] on the same port (the objects survive). A process
//! of its own reaches it through [`ApiServer::kubeconfig`]; one in a test
//! node's namespace when it listens there ([`ApiServer::start_in`]).
//!
//! Not served: pagination (`limit` is ignored, lists come whole), creation,
//! deletion and update through the API, other patch types (415), TLS, and
//! authentication other than one bearer token.

use std::{
    collections::{BTreeMap, HashSet},
    convert::Infallible,
    future::Future as _,
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
    time::Duration,
};

use http_body_util::BodyExt as _;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Body, Bytes, Frame, Incoming, SizeHint},
    header,
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::{
    net::TcpListener,
    sync::mpsc,
    task::{JoinHandle, JoinSet},
};

mod http;
mod store;
pub use http::ApiBody;
use http::*;
pub use store::merge_patch;
use store::*;

/// A listener on `addr` in the network namespace at `netns` (the caller's
/// when `None`): a socket stays in the namespace it was made in.
fn bind_in(netns: Option<&Path>, addr: SocketAddr) -> io::Result<TcpListener> {
    let bind = || {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok::<_, io::Error>(listener)
    };
    let listener = match netns {
        None => bind()?,
        Some(path) => {
            let file = std::fs::File::open(path)?;
            std::thread::scope(|scope| {
                scope
                    .spawn(|| {
                        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)?;
                        bind()
                    })
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })?
        }
    };
    TcpListener::from_std(listener)
}

/// A running (or shut down) test API server. Dropping it stops serving.
pub struct ApiServer {
    state: Arc<Mutex<State>>,
    addr: SocketAddr,
    /// The network namespace it listens in; `None`: the caller's.
    netns: Option<PathBuf>,
    task: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts serving on a free port of 127.0.0.1. Needs a tokio runtime.
    pub async fn start() -> io::Result<Self> {
        Self::start_listening(None)
    }

    /// [`Self::start`] on the loopback of the network namespace at `netns`
    /// (a test node's), so that an agent running there reaches it.
    pub async fn start_in(netns: &Path) -> io::Result<Self> {
        Self::start_listening(Some(netns.to_owned()))
    }

    fn start_listening(netns: Option<PathBuf>) -> io::Result<Self> {
        let listener = bind_in(netns.as_deref(), SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            rv: 1,
            next_uid: 1,
            ..State::default()
        }));
        let task = tokio::spawn(serve(listener, state.clone()));
        Ok(Self {
            state,
            addr,
            netns,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:<port>`: the cluster URL for a `kube::Config`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for this server, for a process given `--kubeconfig`.
    pub fn kubeconfig(&self) -> String {
        kubeconfig_yaml(&self.url())
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Stops serving: the listener closes and every connection, open watches
    /// included, is cut. The objects are kept for [`Self::restart`].
    pub async fn shutdown(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        self.lock().watches.clear();
    }

    /// Serves again on the same port, with the same objects and versions.
    pub async fn restart(&mut self) -> io::Result<()> {
        self.shutdown().await;
        let listener = bind_in(self.netns.as_deref(), self.addr)?;
        self.task = Some(tokio::spawn(serve(listener, self.state.clone())));
        Ok(())
    }

    pub fn is_serving(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Creates or replaces an object of `resource` (`pods`, `namespaces`,
    /// `daemonsets`, ...): ADDED or MODIFIED to watches. Any JSON is stored
    /// as given (a malformed object included); `metadata.resourceVersion` is
    /// set when `metadata` is an object, and `metadata.uid` when it has none.
    /// Returns the stored object.
    pub fn apply(&self, resource: &str, mut object: Value) -> Value {
        let kind = kind_of(resource).unwrap_or_else(|| panic!("unknown resource {resource}"));
        let mut state = self.lock();
        let key = state.key(&object);
        let old = state
            .objects
            .get(kind.plural)
            .and_then(|o| o.get(&key))
            .cloned();
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut)
            && !meta.contains_key("uid")
        {
            let uid = match old.as_ref().and_then(|o| meta_str(o, "uid")) {
                Some(uid) => uid.to_owned(),
                None => {
                    state.next_uid += 1;
                    format!("00000000-0000-4000-8000-{:012x}", state.next_uid)
                }
            };
            meta.insert("uid".into(), Value::String(uid));
        }
        state.store(kind.plural, key, old, object)
    }

    /// Changes an object in place (MODIFIED), e.g. sets
    /// `metadata.deletionTimestamp`; `namespace` is empty for cluster-scoped
    /// resources. Returns the new object, `None` when absent.
    pub fn modify(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> Option<Value> {
        let kind = kind_of(resource)?;
        let mut state = self.lock();
        let key = (namespace.to_owned(), name.to_owned());
        let old = state.objects.get(kind.plural)?.get(&key)?.clone();
        let mut object = old.clone();
        change(&mut object);
        Some(state.store(kind.plural, key, Some(old), object))
    }

    /// Deletes an object (DELETED, carrying a new resourceVersion).
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = kind_of(resource)?;
        let mut state = self.lock();
        let key = (namespace.to_owned(), name.to_owned());
        let mut object = state.objects.get_mut(kind.plural)?.remove(&key)?;
        state.bump(&mut object);
        state.record(kind.plural, EventType::Deleted, None, object.clone());
        Some(object)
    }

    /// The stored object, if any.
    pub fn object(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = kind_of(resource)?;
        self.lock()
            .objects
            .get(kind.plural)?
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Makes every version up to now too old: open watches get an ERROR event
    /// with code 410 (Expired) and end, and a watch resuming from an earlier
    /// version gets the same, so clients must list again.
    pub fn expire(&self) {
        self.compact();
        let mut state = self.lock();
        let gone = status_json(
            StatusCode::GONE,
            "Expired",
            "too old resource version (compacted)",
            None,
        );
        for watch in state.watches.drain(..) {
            let _ = watch.tx.send(event_line("ERROR", &gone));
        }
    }

    /// Makes every version up to now too old to resume a watch from (410),
    /// leaving open watches be.
    pub fn compact(&self) {
        let mut state = self.lock();
        state.compacted = state.rv;
        state.history.clear();
    }

    /// Sends an ERROR event with `code` to every open watch and ends them.
    pub fn watch_error(&self, code: u16, reason: &str, message: &str) {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let error = status_json(status, reason, message, None);
        for watch in self.lock().watches.drain(..) {
            let _ = watch.tx.send(event_line("ERROR", &error));
        }
    }

    /// Ends every open watch stream cleanly (as the API server does when a
    /// watch times out); clients resume from their last version.
    pub fn break_watches(&self) {
        self.lock().watches.clear();
    }

    /// Sends `line` (anything, e.g. not JSON) as one line of every open watch
    /// of `resource`.
    pub fn send_raw_watch_line(&self, resource: &str, line: &str) {
        let mut bytes = line.as_bytes().to_vec();
        bytes.push(b'\n');
        let bytes = Bytes::from(bytes);
        self.lock()
            .watches
            .retain(|w| w.resource != resource || w.tx.send(bytes.clone()).is_ok());
    }

    /// Sends a BOOKMARK with the current version to every watch that allows them.
    pub fn bookmark(&self) {
        let mut state = self.lock();
        let rv = state.rv;
        state
            .watches
            .retain(|w| !w.bookmarks || w.tx.send(w.bookmark(rv, false)).is_ok());
    }

    /// Open watches of `resource`.
    pub fn open_watches(&self, resource: &str) -> usize {
        self.lock()
            .watches
            .iter()
            .filter(|w| w.resource == resource && !w.tx.is_closed())
            .count()
    }

    /// Answers `verb` (`list`, `watch`, `get`, `patch`) on `resource`
    /// (`pods`, `pods/status`, `namespaces`, ...) with 403 Forbidden.
    pub fn deny(&self, verb: &str, resource: &str) {
        self.lock()
            .denied
            .insert((verb.to_owned(), resource.to_owned()));
    }

    /// Accepts only requests with `Authorization: Bearer <token>` (any
    /// other gets 401 Unauthorized); `None`: no authentication.
    pub fn require_token(&self, token: Option<&str>) {
        self.lock().token = token.map(str::to_owned);
    }

    pub fn allow(&self, verb: &str, resource: &str) {
        self.lock()
            .denied
            .remove(&(verb.to_owned(), resource.to_owned()));
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.lock().requests.clone()
    }

    pub fn patches(&self) -> Vec<RecordedPatch> {
        self.lock().patches.clone()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn serve(listener: TcpListener, state: Arc<Mutex<State>>) {
    // Dropping the set (when this task is aborted) aborts every connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let state = state.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |request| handle(state.clone(), request));
                        let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// A kubeconfig for a plain-HTTP API server without authentication.
pub fn kubeconfig_yaml(server: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: testbed\n  cluster:\n    server: {server}\n\
         users:\n- name: testbed\n  user: {{}}\ncontexts:\n- name: testbed\n  context:\n    cluster: testbed\n    user: testbed\n\
         current-context: testbed\n"
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[test]
    fn kubeconfig_names_the_server_without_credentials() {
        let yaml = kubeconfig_yaml("http://127.0.0.1:4321");
        assert!(yaml.contains("    server: http://127.0.0.1:4321\n"));
        assert!(yaml.contains("current-context: testbed\n"));
        assert!(yaml.contains("  user: {}\n"));
    }

    /// One request over a fresh connection, read to the end.
    async fn raw(server: &ApiServer, request: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        stream.read_to_end(&mut out).await.unwrap();
        String::from_utf8(out).unwrap()
    }

    fn get(path: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
    }

    fn pod(name: &str, node: &str) -> Value {
        json!({ "metadata": { "name": name, "namespace": "shop" }, "spec": { "nodeName": node } })
    }

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut target = json!({ "a": "b", "c": { "d": "e", "f": "g" } });
        merge_patch(&mut target, &json!({ "a": "z", "c": { "f": null } }));
        assert_eq!(target, json!({ "a": "z", "c": { "d": "e" } }));
    }

    #[test]
    fn query_strings_are_decoded() {
        let q = parse_query(Some("fieldSelector=spec.nodeName%3Dnode-1&watch=true&x"));
        assert_eq!(q["fieldSelector"], "spec.nodeName=node-1");
        assert_eq!(q["watch"], "true");
        assert_eq!(q["x"], "");
    }

    #[tokio::test]
    async fn lists_filter_by_field_and_watches_replay_then_stream() {
        let server = ApiServer::start().await.unwrap();
        server.apply("pods", pod("a", "node-1"));
        server.apply("pods", pod("b", "node-2"));
        let list = raw(
            &server,
            &get("/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1"),
        )
        .await;
        assert!(list.starts_with("HTTP/1.1 200"), "{list}");
        let json: Value = serde_json::from_str(list.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(json["kind"], "PodList");
        assert_eq!(json["items"].as_array().unwrap().len(), 1);
        assert_eq!(json["metadata"]["resourceVersion"], "3");

        // A watch from version 2 replays b's creation (filtered out) and
        // then streams live changes; it ends after timeoutSeconds.
        let watch = tokio::spawn({
            let addr = server.addr();
            async move {
                let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                let request = get(
                    "/api/v1/pods?watch=true&resourceVersion=2&timeoutSeconds=1&fieldSelector=spec.nodeName%3Dnode-1",
                );
                stream.write_all(request.as_bytes()).await.unwrap();
                let mut out = Vec::new();
                stream.read_to_end(&mut out).await.unwrap();
                String::from_utf8(out).unwrap()
            }
        });
        while server.open_watches("pods") == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        server.modify("pods", "shop", "a", |p| {
            p["metadata"]["labels"] = json!({ "x": "y" })
        });
        server.delete("pods", "shop", "a");
        let text = watch.await.unwrap();
        assert!(
            text.contains("Transfer-Encoding: chunked")
                || text.contains("transfer-encoding: chunked"),
            "{text}"
        );
        let modified = text.find("\"MODIFIED\"").expect("MODIFIED event");
        let deleted = text.find("\"DELETED\"").expect("DELETED event");
        assert!(modified < deleted);
        assert!(!text.contains("\"name\":\"b\""), "{text}");
    }

    #[tokio::test]
    async fn expired_versions_are_gone_and_rbac_denials_are_403() {
        let server = ApiServer::start().await.unwrap();
        server.apply("pods", pod("a", "n"));
        server.expire();
        let text = raw(&server, &get("/api/v1/pods?watch=true&resourceVersion=1")).await;
        assert!(text.contains("\"ERROR\"") && text.contains("410"), "{text}");

        server.deny("list", "namespaces");
        let text = raw(&server, &get("/api/v1/namespaces")).await;
        assert!(text.starts_with("HTTP/1.1 403"), "{text}");
        assert!(
            text.contains("cannot list resource \\\"namespaces\\\""),
            "{text}"
        );
        let text = raw(
            &server,
            &get("/api/v1/namespaces?watch=true&timeoutSeconds=1"),
        )
        .await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    #[tokio::test]
    async fn a_wrong_or_missing_token_is_401_as_a_real_api_server_answers() {
        let server = ApiServer::start().await.unwrap();
        server.require_token(Some("right"));
        let with = |token: &str| {
            format!(
                "GET /api HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
            )
        };
        for request in [get("/api/v1/pods"), with("expired"), with("right-ish")] {
            let text = raw(&server, &request).await;
            assert!(text.starts_with("HTTP/1.1 401"), "{text}");
            assert_eq!(
                body(&text),
                json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "Unauthorized", "reason": "Unauthorized", "code": 401
                })
            );
        }
        let text = raw(&server, &with("right")).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        server.require_token(None);
        let text = raw(&server, &get("/api/v1/pods")).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    /// The body of a raw response, as JSON.
    fn body(response: &str) -> Value {
        serde_json::from_str(response.split("\r\n\r\n").nth(1).unwrap()).unwrap()
    }

    #[tokio::test]
    async fn daemonsets_are_served_under_apps_v1() {
        let server = ApiServer::start().await.unwrap();
        server.apply(
            "daemonsets",
            json!({
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": { "name": "ambpf", "namespace": "istio-system" },
            }),
        );
        let path = "/apis/apps/v1/namespaces/istio-system/daemonsets/ambpf";
        let text = raw(&server, &get(path)).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        let found = body(&text);
        assert_eq!(found["metadata"]["name"], "ambpf");
        assert!(found["metadata"]["uid"].is_string(), "{found}");
        assert!(found["metadata"].get("deletionTimestamp").is_none());

        let text = raw(
            &server,
            &get("/apis/apps/v1/namespaces/istio-system/daemonsets"),
        )
        .await;
        let list = body(&text);
        assert_eq!(list["kind"], "DaemonSetList");
        assert_eq!(list["apiVersion"], "apps/v1");
        assert_eq!(list["items"].as_array().unwrap().len(), 1);

        // Absent, or asked for in the wrong group: 404, as the API server says it.
        let text = raw(
            &server,
            &get("/apis/apps/v1/namespaces/istio-system/daemonsets/other"),
        )
        .await;
        assert!(text.starts_with("HTTP/1.1 404"), "{text}");
        assert_eq!(
            body(&text)["message"],
            "daemonsets.apps \"other\" not found"
        );
        for wrong in [
            "/api/v1/namespaces/istio-system/daemonsets/ambpf",
            "/apis/apps/v1/namespaces/istio-system/pods",
            "/apis/batch/v1/namespaces/istio-system/daemonsets/ambpf",
        ] {
            let text = raw(&server, &get(wrong)).await;
            assert!(text.starts_with("HTTP/1.1 404"), "{wrong}: {text}");
        }

        // Being deleted, then gone.
        server
            .modify("daemonsets", "istio-system", "ambpf", |ds| {
                ds["metadata"]["deletionTimestamp"] = json!("2026-12-02T10:00:00Z")
            })
            .unwrap();
        let text = raw(&server, &get(path)).await;
        assert_eq!(
            body(&text)["metadata"]["deletionTimestamp"],
            "2026-12-02T10:00:00Z"
        );
        server
            .delete("daemonsets", "istio-system", "ambpf")
            .unwrap();
        let text = raw(&server, &get(path)).await;
        assert!(text.starts_with("HTTP/1.1 404"), "{text}");

        server.deny("get", "daemonsets");
        let text = raw(&server, &get(path)).await;
        assert!(text.starts_with("HTTP/1.1 403"), "{text}");
        assert!(
            body(&text)["message"]
                .as_str()
                .unwrap()
                .contains("cannot get resource \"daemonsets\" in API group \"apps\""),
            "{text}"
        );

        // Discovery names the group.
        let groups = body(&raw(&server, &get("/apis")).await);
        assert_eq!(groups["groups"][0]["name"], "apps");
        let resources = body(&raw(&server, &get("/apis/apps/v1")).await);
        assert_eq!(resources["groupVersion"], "apps/v1");
        assert_eq!(resources["resources"][0]["name"], "daemonsets");
        let core = body(&raw(&server, &get("/api/v1")).await);
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        assert!(names.contains(&"pods") && !names.contains(&"daemonsets"));
    }

    #[tokio::test]
    async fn patches_merge_and_the_server_restarts_on_its_port() {
        let mut server = ApiServer::start().await.unwrap();
        server.apply("pods", pod("a", "n"));
        let body = r#"{"metadata":{"annotations":{"k":"v"}}}"#;
        let request = format!(
            "PATCH /api/v1/namespaces/shop/pods/a/status HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
             Content-Type: application/merge-patch+json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let text = raw(&server, &request).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert_eq!(
            server.object("pods", "shop", "a").unwrap()["metadata"]["annotations"]["k"],
            "v"
        );
        assert_eq!(server.patches()[0].resource, "pods/status");

        let port = server.addr().port();
        server.shutdown().await;
        assert!(tokio::net::TcpStream::connect(server.addr()).await.is_err());
        server.restart().await.unwrap();
        assert_eq!(server.addr().port(), port);
        let text = raw(&server, &get("/api/v1/namespaces/shop/pods/a")).await;
        assert!(text.contains("\"k\":\"v\""), "{text}");
    }
}
