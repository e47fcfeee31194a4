//! The objects, their history of changes, selectors and watch subscriptions.

use super::*;

/// A resource the server knows: its API group, URL plural, kind and scope.
#[derive(Clone, Copy, Debug)]
pub(super) struct Kind {
    /// `""` for the core group.
    pub(super) group: &'static str,
    /// `v1` or `{group}/v1`.
    pub(super) api_version: &'static str,
    pub(super) plural: &'static str,
    pub(super) kind: &'static str,
    pub(super) namespaced: bool,
}

pub(super) const fn core(plural: &'static str, kind: &'static str, namespaced: bool) -> Kind {
    Kind {
        group: "",
        api_version: "v1",
        plural,
        kind,
        namespaced,
    }
}

pub(super) const KINDS: &[Kind] = &[
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
pub(super) fn kind_of(plural: &str) -> Option<Kind> {
    KINDS.iter().copied().find(|k| k.plural == plural)
}

/// The resource named `plural` in API group `group`.
pub(super) fn kind_in(group: &str, plural: &str) -> Option<Kind> {
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
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(super) fn name(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, kept for watches that resume from an earlier version.
pub(super) struct Change {
    pub(super) rv: u64,
    pub(super) resource: &'static str,
    pub(super) event: EventType,
    pub(super) old: Option<Value>,
    pub(super) new: Value,
}

/// Equality-based selector terms: (key, equal?, value).
#[derive(Clone, Debug, Default)]
pub(super) struct Selector(Vec<(String, bool, String)>);

impl Selector {
    pub(super) fn parse(text: Option<&String>) -> Result<Self, String> {
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

    pub(super) fn matches(&self, lookup: impl Fn(&str) -> String) -> bool {
        self.0
            .iter()
            .all(|(key, eq, value)| (lookup(key) == *value) == *eq)
    }
}

/// The string value of a dotted field path, as field selectors compare it:
/// missing fields are empty.
pub(super) fn field_value(object: &Value, path: &str) -> String {
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

pub(super) fn label_value(object: &Value, key: &str) -> String {
    object
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(|l| l.get(key))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

pub(super) fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object
        .get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
}

/// An open watch.
pub(super) struct Subscription {
    pub(super) resource: &'static str,
    pub(super) namespace: Option<String>,
    pub(super) fields: Selector,
    pub(super) labels: Selector,
    pub(super) bookmarks: bool,
    pub(super) kind: Kind,
    pub(super) tx: mpsc::UnboundedSender<Bytes>,
}

impl Subscription {
    pub(super) fn selects(&self, object: &Value) -> bool {
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
    pub(super) fn event_for(&self, change: &Change) -> Option<Bytes> {
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

    pub(super) fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
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

pub(super) fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": kind, "object": object }))
        .expect("JSON values serialize");
    line.push(b'\n');
    Bytes::from(line)
}

#[derive(Default)]
pub(super) struct State {
    pub(super) rv: u64,
    /// Versions below this are too old to watch from (410 Gone).
    pub(super) compacted: u64,
    pub(super) objects: BTreeMap<&'static str, BTreeMap<(String, String), Value>>,
    pub(super) history: Vec<Change>,
    pub(super) watches: Vec<Subscription>,
    pub(super) denied: HashSet<(String, String)>,
    /// The only bearer token accepted, when set (else no authentication).
    pub(super) token: Option<String>,
    pub(super) requests: Vec<RecordedRequest>,
    pub(super) patches: Vec<RecordedPatch>,
    pub(super) next_uid: u64,
}

impl State {
    pub(super) fn bump(&mut self, object: &mut Value) -> u64 {
        self.rv += 1;
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), Value::String(self.rv.to_string()));
        }
        self.rv
    }

    /// Stores `object` under `key` with a new resourceVersion and tells the
    /// watches: MODIFIED when it replaces `old`, ADDED otherwise. Returns
    /// the stored object.
    pub(super) fn store(
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

    pub(super) fn key(&self, object: &Value) -> (String, String) {
        let namespace = meta_str(object, "namespace").unwrap_or("").to_owned();
        let name = meta_str(object, "name")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("malformed-{}", self.rv + 1));
        (namespace, name)
    }

    pub(super) fn record(
        &mut self,
        resource: &'static str,
        event: EventType,
        old: Option<Value>,
        new: Value,
    ) {
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

    pub(super) fn list(
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

/// RFC 7386 JSON merge patch.
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
