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
//! resource (403, as RBAC answers); [`ApiServer::shutdown`] and
//! [`ApiServer::restart`] on the same port (the objects survive). A process
//! of its own reaches it through [`ApiServer::kubeconfig`]; one in a test
//! node's namespace when it listens there ([`ApiServer::start_in`]).
//!
//! Not served: pagination (`limit` is ignored, lists come whole), creation,
//! deletion and update through the API, other patch types (415), TLS and
//! authentication.

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

/// A resource the server knows: its API group, URL plural, kind and scope.
#[derive(Clone, Copy, Debug)]
struct Kind {
    /// `""` for the core group.
    group: &'static str,
    /// `v1` or `{group}/v1`.
    api_version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
}

const fn core(plural: &'static str, kind: &'static str, namespaced: bool) -> Kind {
    Kind {
        group: "",
        api_version: "v1",
        plural,
        kind,
        namespaced,
    }
}

const KINDS: &[Kind] = &[
    core("pods", "Pod", true),
    core("namespaces", "Namespace", false),
    core("nodes", "Node", false),
    core("services", "Service", true),
    core("configmaps", "ConfigMap", true),
    Kind {
        group: "apps",
        api_version: "apps/v1",
        plural: "daemonsets",
        kind: "DaemonSet",
        namespaced: true,
    },
];

/// The resource named `plural` (in any group: plurals are unique here).
fn kind_of(plural: &str) -> Option<Kind> {
    KINDS.iter().copied().find(|k| k.plural == plural)
}

/// The resource named `plural` in API group `group`.
fn kind_in(group: &str, plural: &str) -> Option<Kind> {
    kind_of(plural).filter(|k| k.group == group)
}

/// One request as the server saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// Decoded query parameters.
    pub query: BTreeMap<String, String>,
}

impl RecordedRequest {
    pub fn is_watch(&self) -> bool {
        matches!(
            self.query.get("watch").map(String::as_str),
            Some("true" | "1")
        )
    }
}

/// A patch the server applied.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedPatch {
    /// `pods` or `pods/status`.
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub content_type: String,
    pub body: Value,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn name(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, kept for watches that resume from an earlier version.
struct Change {
    rv: u64,
    resource: &'static str,
    event: EventType,
    old: Option<Value>,
    new: Value,
}

/// Equality-based selector terms: (key, equal?, value).
#[derive(Clone, Debug, Default)]
struct Selector(Vec<(String, bool, String)>);

impl Selector {
    fn parse(text: Option<&String>) -> Result<Self, String> {
        let mut terms = Vec::new();
        for term in text
            .map(String::as_str)
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let (key, eq, value) = if let Some((k, v)) = term.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!("unsupported selector term {term:?}"));
            };
            terms.push((key.trim().to_owned(), eq, value.trim().to_owned()));
        }
        Ok(Self(terms))
    }

    fn matches(&self, lookup: impl Fn(&str) -> String) -> bool {
        self.0
            .iter()
            .all(|(key, eq, value)| (lookup(key) == *value) == *eq)
    }
}

/// The string value of a dotted field path, as field selectors compare it:
/// missing fields are empty.
fn field_value(object: &Value, path: &str) -> String {
    let mut at = object;
    for part in path.split('.') {
        match at.get(part) {
            Some(next) => at = next,
            None => return String::new(),
        }
    }
    match at {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn label_value(object: &Value, key: &str) -> String {
    object
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(|l| l.get(key))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object
        .get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
}

/// An open watch.
struct Subscription {
    resource: &'static str,
    namespace: Option<String>,
    fields: Selector,
    labels: Selector,
    bookmarks: bool,
    kind: Kind,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl Subscription {
    fn selects(&self, object: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && meta_str(object, "namespace") != Some(ns.as_str())
        {
            return false;
        }
        self.fields.matches(|path| field_value(object, path))
            && self.labels.matches(|key| label_value(object, key))
    }

    /// The event this watch sees for `change`, if any: an object moving into
    /// or out of the selection is ADDED or DELETED, as the API server does.
    fn event_for(&self, change: &Change) -> Option<Bytes> {
        if change.resource != self.resource {
            return None;
        }
        let now = self.selects(&change.new);
        let before = change.old.as_ref().is_some_and(|old| self.selects(old));
        let event = match (change.event, before, now) {
            (EventType::Modified, true, true) => EventType::Modified,
            (EventType::Modified, false, true) | (EventType::Added, _, true) => EventType::Added,
            (EventType::Modified, true, false) | (EventType::Deleted, _, true) => {
                EventType::Deleted
            }
            _ => return None,
        };
        Some(event_line(event.name(), &change.new))
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut metadata = json!({ "resourceVersion": rv.to_string() });
        if initial_end {
            metadata["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
        }
        event_line(
            "BOOKMARK",
            &json!({ "kind": self.kind.kind, "apiVersion": self.kind.api_version, "metadata": metadata }),
        )
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": kind, "object": object }))
        .expect("JSON values serialize");
    line.push(b'\n');
    Bytes::from(line)
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Versions below this are too old to watch from (410 Gone).
    compacted: u64,
    objects: BTreeMap<&'static str, BTreeMap<(String, String), Value>>,
    history: Vec<Change>,
    watches: Vec<Subscription>,
    denied: HashSet<(String, String)>,
    requests: Vec<RecordedRequest>,
    patches: Vec<RecordedPatch>,
    next_uid: u64,
}

impl State {
    fn bump(&mut self, object: &mut Value) -> u64 {
        self.rv += 1;
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), Value::String(self.rv.to_string()));
        }
        self.rv
    }

    /// Stores `object` under `key` with a new resourceVersion and tells the
    /// watches: MODIFIED when it replaces `old`, ADDED otherwise. Returns
    /// the stored object.
    fn store(
        &mut self,
        resource: &'static str,
        key: (String, String),
        old: Option<Value>,
        mut object: Value,
    ) -> Value {
        self.bump(&mut object);
        self.objects
            .entry(resource)
            .or_default()
            .insert(key, object.clone());
        let event = if old.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(resource, event, old, object.clone());
        object
    }

    fn key(&self, object: &Value) -> (String, String) {
        let namespace = meta_str(object, "namespace").unwrap_or("").to_owned();
        let name = meta_str(object, "name")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("malformed-{}", self.rv + 1));
        (namespace, name)
    }

    fn record(&mut self, resource: &'static str, event: EventType, old: Option<Value>, new: Value) {
        let change = Change {
            rv: self.rv,
            resource,
            event,
            old,
            new,
        };
        self.watches.retain(|w| match w.event_for(&change) {
            Some(line) => w.tx.send(line).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.history.push(change);
    }

    fn list(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        fields: &Selector,
        labels: &Selector,
    ) -> Value {
        let items: Vec<&Value> = self
            .objects
            .get(kind.plural)
            .into_iter()
            .flat_map(|objects| objects.iter())
            .filter(|((ns, _), _)| namespace.is_none_or(|want| want == ns))
            .map(|(_, object)| object)
            .filter(|o| {
                fields.matches(|p| field_value(o, p)) && labels.matches(|k| label_value(o, k))
            })
            .collect();
        json!({
            "kind": format!("{}List", kind.kind),
            "apiVersion": kind.api_version,
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": items,
        })
    }
}

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

/// A response body: a whole JSON document, or a watch stream.
pub struct ApiBody(BodyKind);

enum BodyKind {
    Full(Option<Bytes>),
    Stream {
        rx: mpsc::UnboundedReceiver<Bytes>,
        deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    },
}

impl Body for ApiBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().0 {
            BodyKind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            BodyKind::Stream { rx, deadline } => {
                if let Poll::Ready(line) = rx.poll_recv(cx) {
                    return Poll::Ready(line.map(|b| Ok(Frame::data(b))));
                }
                if let Some(deadline) = deadline
                    && deadline.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(None);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.0, BodyKind::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyKind::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            BodyKind::Stream { .. } => SizeHint::default(),
        }
    }
}

fn respond(status: StatusCode, body: &Value) -> Response<ApiBody> {
    let bytes = serde_json::to_vec(body).expect("JSON values serialize");
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(ApiBody(BodyKind::Full(Some(Bytes::from(bytes)))))
        .expect("a valid response")
}

fn status_json(code: StatusCode, reason: &str, message: &str, kind: Option<&str>) -> Value {
    let mut status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if let Some(kind) = kind {
        status["details"] = json!({ "kind": kind });
    }
    status
}

fn failure(code: StatusCode, reason: &str, message: impl Into<String>) -> Response<ApiBody> {
    respond(code, &status_json(code, reason, &message.into(), None))
}

fn percent_decode(text: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(high), Some(low)) => {
                    out.push((high * 16 + low) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(query: Option<&str>) -> BTreeMap<String, String> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// What a request addresses.
enum Target {
    Collection {
        kind: Kind,
        namespace: Option<String>,
    },
    Object {
        kind: Kind,
        namespace: String,
        name: String,
        subresource: Option<String>,
    },
}

fn route(segments: &[&str]) -> Option<Target> {
    let (group, segments) = match segments {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, "v1", rest @ ..] => (*group, rest),
        _ => return None,
    };
    let collection = |plural: &str, namespace: Option<&str>| {
        let kind = kind_in(group, plural)?;
        (kind.namespaced || namespace.is_none()).then(|| Target::Collection {
            kind,
            namespace: namespace.map(str::to_owned),
        })
    };
    let object = |plural: &str, namespace: &str, name: &str, sub: Option<&str>| {
        let kind = kind_in(group, plural)?;
        (kind.namespaced != namespace.is_empty()).then(|| Target::Object {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            subresource: sub.map(str::to_owned),
        })
    };
    match segments {
        [plural] => collection(plural, None),
        ["namespaces", ns, plural] => collection(plural, Some(ns)),
        [plural, name] => object(plural, "", name, None),
        [plural, name, sub] if *plural != "namespaces" => object(plural, "", name, Some(sub)),
        ["namespaces", ns, plural, name] => object(plural, ns, name, None),
        ["namespaces", ns, plural, name, sub] => object(plural, ns, name, Some(sub)),
        _ => None,
    }
}

async fn handle(
    state: Arc<Mutex<State>>,
    request: Request<Incoming>,
) -> Result<Response<ApiBody>, Infallible> {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    let query = parse_query(parts.uri.query());
    let recorded = RecordedRequest {
        method: parts.method.to_string(),
        path: path.clone(),
        query: query.clone(),
    };
    let watch = recorded.is_watch();
    state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .requests
        .push(recorded);
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();

    if parts.method == Method::GET
        && let Some(doc) = discovery(&segments)
    {
        return Ok(respond(StatusCode::OK, &doc));
    }
    let Some(target) = route(&segments) else {
        return Ok(failure(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        ));
    };
    let (verb, resource) = match (&parts.method, &target) {
        (&Method::GET, Target::Collection { kind, .. }) => {
            (if watch { "watch" } else { "list" }, kind.plural.to_owned())
        }
        (
            &Method::GET,
            Target::Object {
                kind, subresource, ..
            },
        ) => ("get", resource_name(*kind, subresource)),
        (
            &Method::PATCH,
            Target::Object {
                kind, subresource, ..
            },
        ) => ("patch", resource_name(*kind, subresource)),
        _ => {
            return Ok(failure(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                format!("{} is not supported on {path}", parts.method),
            ));
        }
    };
    if state
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .denied
        .contains(&(verb.to_owned(), resource.clone()))
    {
        let group = match &target {
            Target::Collection { kind, .. } | Target::Object { kind, .. } => kind.group,
        };
        let scope = match &target {
            Target::Collection {
                namespace: Some(ns),
                ..
            } => format!("in the namespace \"{ns}\""),
            Target::Object { namespace, .. } if !namespace.is_empty() => {
                format!("in the namespace \"{namespace}\"")
            }
            _ => "at the cluster scope".to_owned(),
        };
        let message = format!(
            "{resource} is forbidden: User \"system:serviceaccount:istio-system:ambpf\" cannot {verb} resource \"{resource}\" in API group \"{group}\" {scope}"
        );
        let status = status_json(
            StatusCode::FORBIDDEN,
            "Forbidden",
            &message,
            Some(&resource),
        );
        return Ok(respond(StatusCode::FORBIDDEN, &status));
    }

    let response = match target {
        Target::Collection { kind, namespace } => {
            let (fields, labels) = match (
                Selector::parse(query.get("fieldSelector")),
                Selector::parse(query.get("labelSelector")),
            ) {
                (Ok(f), Ok(l)) => (f, l),
                (Err(e), _) | (_, Err(e)) => {
                    return Ok(failure(StatusCode::BAD_REQUEST, "BadRequest", e));
                }
            };
            if watch {
                start_watch(&state, kind, namespace, fields, labels, &query)
            } else {
                let state = state.lock().unwrap_or_else(|p| p.into_inner());
                respond(
                    StatusCode::OK,
                    &state.list(kind, namespace.as_deref(), &fields, &labels),
                )
            }
        }
        Target::Object {
            kind,
            namespace,
            name,
            subresource,
        } => {
            if subresource.as_deref().is_some_and(|s| s != "status") {
                return Ok(failure(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("no subresource {subresource:?}"),
                ));
            }
            if parts.method == Method::GET {
                let state = state.lock().unwrap_or_else(|p| p.into_inner());
                match state
                    .objects
                    .get(kind.plural)
                    .and_then(|o| o.get(&(namespace.clone(), name.clone())))
                {
                    Some(object) => respond(StatusCode::OK, object),
                    None => not_found(kind, &name),
                }
            } else {
                let content_type = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let body = match body.collect().await {
                    Ok(collected) => collected.to_bytes(),
                    Err(e) => {
                        return Ok(failure(
                            StatusCode::BAD_REQUEST,
                            "BadRequest",
                            e.to_string(),
                        ));
                    }
                };
                patch(&state, kind, namespace, name, resource, content_type, &body)
            }
        }
    };
    Ok(response)
}

fn resource_name(kind: Kind, subresource: &Option<String>) -> String {
    match subresource {
        Some(sub) => format!("{}/{sub}", kind.plural),
        None => kind.plural.to_owned(),
    }
}

/// `pods` or `daemonsets.apps`, as the API server names a resource in
/// messages.
fn qualified(kind: Kind) -> String {
    match kind.group {
        "" => kind.plural.to_owned(),
        group => format!("{}.{group}", kind.plural),
    }
}

fn not_found(kind: Kind, name: &str) -> Response<ApiBody> {
    let message = format!("{} \"{name}\" not found", qualified(kind));
    respond(
        StatusCode::NOT_FOUND,
        &status_json(
            StatusCode::NOT_FOUND,
            "NotFound",
            &message,
            Some(kind.plural),
        ),
    )
}

fn discovery(segments: &[&str]) -> Option<Value> {
    Some(match segments {
        ["api"] => {
            json!({ "kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [] })
        }
        ["apis"] => {
            let mut groups: Vec<Value> = Vec::new();
            for kind in KINDS.iter().filter(|k| !k.group.is_empty()) {
                if !groups.iter().any(|g| g["name"] == kind.group) {
                    let version = json!({ "groupVersion": kind.api_version, "version": "v1" });
                    groups.push(json!({ "name": kind.group, "versions": [version], "preferredVersion": version }));
                }
            }
            json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
        }
        ["version"] => {
            json!({ "major": "1", "minor": "37", "gitVersion": "v1.37.0-ambpf-testbed", "platform": "linux/amd64" })
        }
        ["api", "v1"] => resource_list(""),
        ["apis", group, "v1"] if KINDS.iter().any(|k| k.group == *group) => resource_list(group),
        _ => return None,
    })
}

/// The APIResourceList of one group's v1.
fn resource_list(group: &str) -> Value {
    let resources: Vec<Value> = KINDS
        .iter()
        .filter(|k| k.group == group)
        .flat_map(|k| {
            let verbs = json!(["get", "list", "watch", "patch"]);
            [
                json!({ "name": k.plural, "singularName": k.kind.to_lowercase(), "namespaced": k.namespaced, "kind": k.kind, "verbs": verbs }),
                json!({ "name": format!("{}/status", k.plural), "singularName": "", "namespaced": k.namespaced, "kind": k.kind, "verbs": ["get", "patch"] }),
            ]
        })
        .collect();
    let group_version = match group {
        "" => "v1".to_owned(),
        group => format!("{group}/v1"),
    };
    json!({ "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources })
}

fn start_watch(
    state: &Arc<Mutex<State>>,
    kind: Kind,
    namespace: Option<String>,
    fields: Selector,
    labels: Selector,
    query: &BTreeMap<String, String>,
) -> Response<ApiBody> {
    let flag = |name: &str| matches!(query.get(name).map(String::as_str), Some("true" | "1"));
    let (tx, rx) = mpsc::unbounded_channel();
    let subscription = Subscription {
        resource: kind.plural,
        namespace,
        fields,
        labels,
        bookmarks: flag("allowWatchBookmarks"),
        kind,
        tx,
    };
    let deadline = query
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map(|s| Box::pin(tokio::time::sleep(Duration::from_secs(s))));
    let from = query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");
    let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
    // Everything below happens under the lock: no change slips between the
    // replay and the live events.
    let mut keep = true;
    if from.is_empty() || from == "0" || flag("sendInitialEvents") {
        for object in state
            .objects
            .get(kind.plural)
            .into_iter()
            .flat_map(|o| o.values())
        {
            if subscription.selects(object) {
                let _ = subscription.tx.send(event_line("ADDED", object));
            }
        }
        if flag("sendInitialEvents") {
            let _ = subscription.tx.send(subscription.bookmark(state.rv, true));
        }
    } else {
        match from.parse::<u64>() {
            Ok(rv) if rv < state.compacted => {
                let message = format!("too old resource version: {rv} ({})", state.compacted);
                let gone = status_json(StatusCode::GONE, "Expired", &message, None);
                let _ = subscription.tx.send(event_line("ERROR", &gone));
                keep = false;
            }
            Ok(rv) => {
                for change in state.history.iter().filter(|c| c.rv > rv) {
                    if let Some(line) = subscription.event_for(change) {
                        let _ = subscription.tx.send(line);
                    }
                }
            }
            Err(_) => {
                let message = format!("invalid resourceVersion {from:?}");
                return failure(StatusCode::BAD_REQUEST, "BadRequest", message);
            }
        }
    }
    if keep {
        state.watches.push(subscription);
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(ApiBody(BodyKind::Stream { rx, deadline }))
        .expect("a valid response")
}

/// RFC 7386 JSON merge patch.
/// A kubeconfig for a plain-HTTP API server without authentication.
pub fn kubeconfig_yaml(server: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: testbed\n  cluster:\n    server: {server}\n\
         users:\n- name: testbed\n  user: {{}}\ncontexts:\n- name: testbed\n  context:\n    cluster: testbed\n    user: testbed\n\
         current-context: testbed\n"
    )
}

pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let Value::Object(target) = target else {
        unreachable!()
    };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

fn patch(
    state: &Arc<Mutex<State>>,
    kind: Kind,
    namespace: String,
    name: String,
    resource: String,
    content_type: String,
    body: &[u8],
) -> Response<ApiBody> {
    let media = content_type.split(';').next().unwrap_or("").trim();
    if media != "application/merge-patch+json" && media != "application/strategic-merge-patch+json"
    {
        let message = format!("the body of the request was in an unknown format: {content_type}");
        return failure(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            message,
        );
    }
    let patch_body: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return failure(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("invalid patch: {e}"),
            );
        }
    };
    let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
    let key = (namespace.clone(), name.clone());
    let Some(old) = state
        .objects
        .get(kind.plural)
        .and_then(|o| o.get(&key))
        .cloned()
    else {
        return not_found(kind, &name);
    };
    let mut object = old.clone();
    merge_patch(&mut object, &patch_body);
    let object = state.store(kind.plural, key, Some(old), object);
    state.patches.push(RecordedPatch {
        resource,
        namespace,
        name,
        content_type,
        body: patch_body,
    });
    respond(StatusCode::OK, &object)
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
