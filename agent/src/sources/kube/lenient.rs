//! Objects that always deserialize, so that one malformed object cannot stop
//! a list or a watch.
//!
//! kube-rs decodes a list as a whole: with `Api<Pod>` a single pod that does
//! not parse fails the list, the watcher never syncs, and every other pod on
//! the node goes unserved. [`Lenient<K>`] accepts any JSON object: its
//! metadata is read as far as it can be (so the reflector can still key it),
//! and [`Lenient::object`] holds the typed object or why it is malformed. The
//! source logs and skips the malformed ones.

use k8s_openapi::{Metadata, Resource, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use serde::{Deserialize, Deserializer, de::DeserializeOwned};
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct Lenient<K> {
    /// The typed object, or why it does not parse.
    pub object: Result<K, String>,
    /// The metadata of an object that does not parse, as far as it reads
    /// (a parsed object's metadata is its own: the caches keep it once).
    salvaged: Option<Box<ObjectMeta>>,
}

impl<K> Lenient<K> {
    pub fn new(object: K) -> Self {
        Self {
            object: Ok(object),
            salvaged: None,
        }
    }
}

/// Metadata the agent never reads and a cluster can make large: server-side
/// apply's `managedFields` (often most of an object's size) and kubectl's
/// copy of the last applied object. Dropped before decoding, as Istio's
/// informers drop them, so the caches of a node's pods stay small.
fn strip_unused(value: &mut Value) {
    let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    meta.remove("managedFields");
    if let Some(annotations) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

impl<'de, K: DeserializeOwned> Deserialize<'de> for Lenient<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut value = Value::deserialize(deserializer)?;
        strip_unused(&mut value);
        match K::deserialize(&value) {
            Ok(object) => Ok(Self::new(object)),
            Err(e) => {
                let raw_meta = value.get("metadata").unwrap_or(&Value::Null);
                let metadata =
                    ObjectMeta::deserialize(raw_meta).unwrap_or_else(|_| salvage(raw_meta));
                Ok(Self {
                    object: Err(e.to_string()),
                    salvaged: Some(Box::new(metadata)),
                })
            }
        }
    }
}

/// The identifying fields of metadata that does not parse as a whole.
fn salvage(meta: &Value) -> ObjectMeta {
    let text = |field: &str| meta.get(field).and_then(Value::as_str).map(str::to_owned);
    ObjectMeta {
        name: text("name"),
        namespace: text("namespace"),
        uid: text("uid"),
        resource_version: text("resourceVersion"),
        ..Default::default()
    }
}

impl<K: Resource> Resource for Lenient<K> {
    const API_VERSION: &'static str = K::API_VERSION;
    const GROUP: &'static str = K::GROUP;
    const KIND: &'static str = K::KIND;
    const VERSION: &'static str = K::VERSION;
    const URL_PATH_SEGMENT: &'static str = K::URL_PATH_SEGMENT;
    type Scope = K::Scope;
}

/// What [`Lenient::metadata`] answers for an object that does not parse and
/// kept no metadata (none is built so: a fallback, not a panic).
static NO_METADATA: std::sync::LazyLock<ObjectMeta> = std::sync::LazyLock::new(ObjectMeta::default);

impl<K: Resource + Metadata<Ty = ObjectMeta>> Metadata for Lenient<K> {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        match (&self.object, &self.salvaged) {
            (Ok(object), _) => object.metadata(),
            (Err(_), Some(salvaged)) => salvaged,
            (Err(_), None) => &NO_METADATA,
        }
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match (&mut self.object, &mut self.salvaged) {
            (Ok(object), _) => object.metadata_mut(),
            (Err(_), salvaged) => salvaged.get_or_insert_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::api::ObjectList;

    use super::*;
    use crate::sources::kube::WatchedPod;

    #[test]
    fn a_malformed_item_does_not_fail_its_list() {
        let list: ObjectList<Lenient<WatchedPod>> = serde_json::from_value(serde_json::json!({
            "kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
            "items": [
                {"metadata": {"name": "good", "namespace": "shop", "uid": "u1", "resourceVersion": "5"},
                 "spec": {"containers": [{"name": "web"}]}},
                {"metadata": {"name": "bad", "namespace": "shop", "uid": "u2", "resourceVersion": "6"},
                 "spec": {"containers": "not a list"}},
                {"metadata": {"name": "worse", "namespace": "shop", "labels": ["x"], "resourceVersion": "6"}},
                "not even an object"
            ]
        }))
        .unwrap();
        assert_eq!(list.items.len(), 4);
        assert!(list.items[0].object.is_ok());
        assert!(list.items[1].object.is_err());
        assert_eq!(list.items[1].metadata().uid.as_deref(), Some("u2"));
        // Metadata that does not parse keeps what identifies the object.
        assert_eq!(list.items[2].metadata().name.as_deref(), Some("worse"));
        assert_eq!(
            list.items[2].metadata().resource_version.as_deref(),
            Some("6")
        );
        assert!(list.items[3].object.is_err());
    }

    #[test]
    fn managed_fields_and_the_last_applied_copy_are_not_kept() {
        let pod: Lenient<WatchedPod> = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web", "namespace": "shop", "uid": "u1",
                "labels": {"app": "web"},
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"big\": true}",
                    "ambient.istio.io/redirection": "enabled"
                },
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
            },
            "spec": {"containers": [{"name": "web"}]}
        }))
        .unwrap();
        // One copy of the metadata: the typed object's.
        let typed = pod.object.as_ref().unwrap();
        assert!(std::ptr::eq(pod.metadata(), &typed.metadata));
        let meta = pod.metadata();
        assert!(meta.managed_fields.is_none());
        let annotations = meta.annotations.as_ref().unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            ["ambient.istio.io/redirection"]
        );
        assert_eq!(meta.labels.as_ref().unwrap()["app"], "web");
    }
}
