//! The HTTP side: routes, handlers, watch streams and response bodies.

use super::*;

/// A response body: a whole JSON document, or a watch stream.
pub struct ApiBody(BodyKind);

pub(super) enum BodyKind {
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

pub(super) fn respond(status: StatusCode, body: &Value) -> Response<ApiBody> {
    let bytes = serde_json::to_vec(body).expect("JSON values serialize");
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(ApiBody(BodyKind::Full(Some(Bytes::from(bytes)))))
        .expect("a valid response")
}

pub(super) fn status_json(
    code: StatusCode,
    reason: &str,
    message: &str,
    kind: Option<&str>,
) -> Value {
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

pub(super) fn failure(
    code: StatusCode,
    reason: &str,
    message: impl Into<String>,
) -> Response<ApiBody> {
    respond(code, &status_json(code, reason, &message.into(), None))
}

pub(super) fn percent_decode(text: &str) -> String {
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

pub(super) fn parse_query(query: Option<&str>) -> BTreeMap<String, String> {
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
pub(super) enum Target {
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

pub(super) fn route(segments: &[&str]) -> Option<Target> {
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

pub(super) async fn handle(
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
    let token = {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        state.requests.push(recorded);
        state.token.clone()
    };
    // Authentication comes first, discovery included, and says no more than
    // a real API server does about a wrong or expired token.
    if let Some(token) = token
        && parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            != Some(format!("Bearer {token}").as_str())
    {
        return Ok(failure(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ));
    }
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

pub(super) fn resource_name(kind: Kind, subresource: &Option<String>) -> String {
    match subresource {
        Some(sub) => format!("{}/{sub}", kind.plural),
        None => kind.plural.to_owned(),
    }
}

/// `pods` or `daemonsets.apps`, as the API server names a resource in
/// messages.
pub(super) fn qualified(kind: Kind) -> String {
    match kind.group {
        "" => kind.plural.to_owned(),
        group => format!("{}.{group}", kind.plural),
    }
}

pub(super) fn not_found(kind: Kind, name: &str) -> Response<ApiBody> {
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

pub(super) fn discovery(segments: &[&str]) -> Option<Value> {
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
pub(super) fn resource_list(group: &str) -> Value {
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

pub(super) fn start_watch(
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

pub(super) fn patch(
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
