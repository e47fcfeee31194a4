//! The part of a Pod the agent reads, and nothing else.
//!
//! k8s-openapi's `Pod` has a field for everything the API server may send:
//! its `PodSpec` and `Container` alone take kilobytes in memory even when
//! empty, and a real pod's env, volumes, probes and statuses add to that.
//! The reflector keeps every pod of the node for the agent's lifetime, so
//! the caches hold this instead: the metadata, and the few fields of spec
//! and status that [`rules`](super::rules) reads. Unknown fields are skipped
//! while decoding, as an informer with a transform drops them in Istio.
//! Field names and types are k8s-openapi's, so the rules read as they would
//! on a full `Pod`.

use k8s_openapi::{
    Metadata, Resource, api::core::v1::Pod, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{Deserialize, Deserializer};

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct WatchedPod {
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    pub spec: Option<WatchedPodSpec>,
    pub status: Option<WatchedPodStatus>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WatchedPodSpec {
    /// Absent or null reads as none, as in k8s-openapi.
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<NamedContainer>,
    pub init_containers: Option<Vec<NamedContainer>>,
    pub host_network: Option<bool>,
    pub service_account_name: Option<String>,
}

/// A container, by name only (a sidecar is found by its name).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct NamedContainer {
    /// Absent or null reads as empty, as in k8s-openapi.
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WatchedPodStatus {
    pub phase: Option<String>,
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pub pod_ips: Option<Vec<PodIp>>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct PodIp {
    /// Absent or null reads as empty (and so as no address), as in
    /// k8s-openapi.
    #[serde(default, deserialize_with = "null_as_default")]
    pub ip: String,
}

/// A required field that is null reads as its default, as k8s-openapi
/// reads every field (it decodes them all as optional).
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

impl Resource for WatchedPod {
    const API_VERSION: &'static str = Pod::API_VERSION;
    const GROUP: &'static str = Pod::GROUP;
    const KIND: &'static str = Pod::KIND;
    const VERSION: &'static str = Pod::VERSION;
    const URL_PATH_SEGMENT: &'static str = Pod::URL_PATH_SEGMENT;
    type Scope = <Pod as Resource>::Scope;
}

impl Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod as the API server sends it: everything the agent does not read
    /// is dropped, and what it reads keeps k8s-openapi's meaning.
    #[test]
    fn a_full_pod_keeps_only_what_the_rules_read() {
        let pod: WatchedPod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u1",
                         "labels": {"app": "web"}, "annotations": {"a": "b"}},
            "spec": {
                "nodeName": "n1", "serviceAccountName": "web", "hostNetwork": false,
                "containers": [{"name": "web", "image": "nginx", "env": [{"name": "X", "value": "1"}],
                                "ports": [{"containerPort": 80}]}],
                "initContainers": [{"name": "istio-proxy", "image": "proxyv2", "restartPolicy": "Always"}],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "tolerations": [{"key": "k", "operator": "Exists"}]
            },
            "status": {
                "phase": "Running", "podIP": "10.0.0.7",
                "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}],
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "web", "ready": true, "restartCount": 0, "image": "nginx",
                                       "imageID": "", "state": {"running": {}}}]
            }
        }))
        .unwrap();
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.containers, [NamedContainer { name: "web".into() }]);
        assert_eq!(
            spec.init_containers.as_ref().unwrap()[0].name,
            "istio-proxy"
        );
        assert_eq!(spec.host_network, Some(false));
        assert_eq!(spec.service_account_name.as_deref(), Some("web"));
        let status = pod.status.as_ref().unwrap();
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.7"));
        assert_eq!(status.pod_ips.as_ref().unwrap()[1].ip, "fd00::7");
        assert_eq!(pod.metadata.labels.as_ref().unwrap()["app"], "web");
    }

    /// Whatever k8s-openapi's `Pod` accepts, this accepts, and a field the
    /// rules read that k8s-openapi refuses, this refuses too: a malformed
    /// pod is reported as malformed, never read as a pod without a sidecar
    /// or without addresses. A malformed field the rules never read does
    /// not stop the pod here (the API server validates pods, so it is not
    /// one a cluster can hold). The fuzz test `kube_objects` checks the
    /// same on generated pods.
    #[test]
    fn parses_what_k8s_openapi_parses_and_refuses_what_the_rules_cannot_read() {
        for (object, full_parses, parses) in [
            (serde_json::json!({}), true, true),
            (serde_json::json!({"spec": {}, "status": {}}), true, true),
            (
                serde_json::json!({"metadata": null, "spec": {"containers": null}}),
                true,
                true,
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": null}]}}),
                true,
                true,
            ),
            (
                serde_json::json!({"status": {"podIPs": [{"ip": null}]}}),
                true,
                true,
            ),
            (
                serde_json::json!({"spec": {"containers": [{"image": "no name"}]}}),
                true,
                true,
            ),
            (
                serde_json::json!({"status": {"podIPs": [{"address": "10.0.0.7"}]}}),
                true,
                true,
            ),
            (
                serde_json::json!({"spec": {"containers": "not a list"}}),
                false,
                false,
            ),
            (
                serde_json::json!({"spec": {"containers": [{"name": 7}]}}),
                false,
                false,
            ),
            (
                serde_json::json!({"spec": {"initContainers": {"name": "x"}}}),
                false,
                false,
            ),
            (
                serde_json::json!({"spec": {"hostNetwork": "yes"}}),
                false,
                false,
            ),
            (
                serde_json::json!({"spec": {"serviceAccountName": ["web"]}}),
                false,
                false,
            ),
            (serde_json::json!({"status": {"phase": 1}}), false, false),
            (
                serde_json::json!({"status": {"podIP": false}}),
                false,
                false,
            ),
            (
                serde_json::json!({"status": {"podIPs": "10.0.0.7"}}),
                false,
                false,
            ),
            (
                serde_json::json!({"metadata": {"labels": ["x"]}}),
                false,
                false,
            ),
            (
                serde_json::json!({"spec": {"nodeName": false}}),
                false,
                true,
            ),
            (
                serde_json::json!({"status": {"conditions": 3}}),
                false,
                true,
            ),
        ] {
            let full = serde_json::from_value::<Pod>(object.clone()).is_ok();
            let watched = serde_json::from_value::<WatchedPod>(object.clone()).is_ok();
            assert_eq!(full, full_parses, "k8s-openapi on {object}");
            assert_eq!(watched, parses, "{object}");
        }
    }
}
