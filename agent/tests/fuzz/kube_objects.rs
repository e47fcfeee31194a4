//! Kubernetes objects through the lenient decoding and the ambient rules:
//! pods whose every field may be right, wrong-typed or missing. A list with
//! such pods still decodes, its good pods still parse, and deciding about a
//! pod (the source's rules, the CNI endpoint's verdict) never panics and
//! never enrols a pod that opted out, runs a sidecar or host networking.

use std::collections::{BTreeMap, BTreeSet};

use ambpf::{
    cni::{
        CmdAdd,
        selection::{self, SkipReason, Verdict},
    },
    sources::kube::{WatchedPod, lenient::Lenient, rules},
};
use k8s_openapi::{Metadata as _, api::core::v1::Pod};
use kube::api::ObjectList;
use proptest::prelude::*;
use serde_json::{Value, json};

use crate::cni_endpoint::any_json;

/// `right` most of the time, else anything, or the field left out.
fn field(right: BoxedStrategy<Value>) -> BoxedStrategy<Option<Value>> {
    prop_oneof![
        6 => right.prop_map(Some),
        1 => any_json().prop_map(Some),
        2 => Just(None),
    ]
    .boxed()
}

fn text(choices: Vec<&'static str>) -> BoxedStrategy<Value> {
    prop::sample::select(choices).prop_map(Value::from).boxed()
}

fn map_of(keys: Vec<&'static str>, values: Vec<&'static str>) -> BoxedStrategy<Value> {
    prop::collection::btree_map(
        prop::sample::select(keys).prop_map(str::to_owned),
        prop::sample::select(values).prop_map(Value::from),
        0..3,
    )
    .prop_map(|m| Value::Object(m.into_iter().collect()))
    .boxed()
}

fn object(fields: Vec<(&'static str, Option<Value>)>) -> Value {
    Value::Object(
        fields
            .into_iter()
            .filter_map(|(k, v)| Some((k.to_owned(), v?)))
            .collect(),
    )
}

/// A pod object as the API server might send it, fields right or not.
fn pod_json() -> impl Strategy<Value = Value> {
    let labels = map_of(
        vec![rules::DATAPLANE_MODE_LABEL, "app"],
        vec!["ambient", "none", "", "web"],
    );
    let annotations = map_of(
        vec![
            rules::SIDECAR_STATUS_ANNOTATION,
            rules::DNS_CAPTURE_ANNOTATION,
            rules::REDIRECTION_ANNOTATION,
        ],
        vec!["true", "F", "enabled", "pending", "yes", ""],
    );
    let metadata = (
        field(text(vec!["web-0", "db-0", ""])),
        field(text(vec!["shop", "kube-system"])),
        field(text(vec!["uid-1", "uid-2", ""])),
        field(labels),
        field(annotations),
        field(text(vec!["1", "42"])),
    )
        .prop_map(|(name, namespace, uid, labels, annotations, rv)| {
            object(vec![
                ("name", name),
                ("namespace", namespace),
                ("uid", uid),
                ("labels", labels),
                ("annotations", annotations),
                ("resourceVersion", rv),
            ])
        });
    let container = field(text(vec!["app", rules::SIDECAR_CONTAINER]))
        .prop_map(|name| object(vec![("name", name)]));
    let containers = prop::collection::vec(container, 0..3)
        .prop_map(Value::from)
        .boxed();
    let spec = (
        field(containers.clone()),
        field(containers),
        field(any::<bool>().prop_map(Value::from).boxed()),
        field(text(vec!["web", ""])),
        field(text(vec!["node-1"])),
    )
        .prop_map(|(containers, init, host_network, sa, node)| {
            object(vec![
                ("containers", containers),
                ("initContainers", init),
                ("hostNetwork", host_network),
                ("serviceAccountName", sa),
                ("nodeName", node),
            ])
        });
    let ip = || text(vec!["10.244.1.5", "fd00::5", "10.244.1.5/24", "", "x"]);
    let status = (
        field(text(vec!["Running", "Pending", "Succeeded", "Failed"])),
        field(ip()),
        field(
            prop::collection::vec(field(ip()).prop_map(|ip| object(vec![("ip", ip)])), 0..3)
                .prop_map(Value::from)
                .boxed(),
        ),
    )
        .prop_map(|(phase, pod_ip, pod_ips)| {
            object(vec![
                ("phase", phase),
                ("podIP", pod_ip),
                ("podIPs", pod_ips),
            ])
        });
    (
        field(metadata.boxed()),
        field(spec.boxed()),
        field(status.boxed()),
    )
        .prop_map(|(metadata, spec, status)| {
            let mut pod = object(vec![
                ("metadata", metadata),
                ("spec", spec),
                ("status", status),
            ]);
            pod["apiVersion"] = json!("v1");
            pod["kind"] = json!("Pod");
            pod
        })
}

const GOOD: &str = "good-uid";

fn good_pod() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "good", "namespace": "shop", "uid": GOOD, "resourceVersion": "3"},
        "spec": {"containers": [{"name": "app"}]}
    })
}

#[test]
fn any_pod_decodes_leniently_and_is_decided_without_enrolling_what_must_not_be() {
    let input = (
        prop::collection::vec(pod_json(), 0..4),
        prop::option::of(map_of(
            vec![rules::DATAPLANE_MODE_LABEL, "team"],
            vec!["ambient", "none", "x"],
        )),
    );
    let mut runner = proptest::test_runner::TestRunner::new(crate::config());
    let result = runner.run(&input, |(pods, namespace_labels)| {
        let mut items = pods.clone();
        items.push(good_pod());
        let list_json = json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "9"},
            "items": items,
        });
        let list: ObjectList<Lenient<WatchedPod>> = serde_json::from_value(list_json.clone())
            .map_err(|e| TestCaseError::fail(format!("the list did not decode: {e}")))?;
        prop_assert_eq!(list.items.len(), pods.len() + 1);
        // The caches keep only what the rules read: never stricter than
        // k8s-openapi's full Pod, and reading the same values from it.
        let full: ObjectList<Lenient<Pod>> = serde_json::from_value(list_json)
            .map_err(|e| TestCaseError::fail(format!("the list did not decode: {e}")))?;
        for (watched, full) in list.items.iter().zip(&full.items) {
            match (&watched.object, &full.object) {
                (Ok(watched), Ok(full)) => {
                    prop_assert_eq!(read_by_rules(watched), read_by_rules_full(full));
                }
                (Err(why), Ok(_)) => {
                    prop_assert!(false, "refused what k8s-openapi reads: {}", why);
                }
                (_, Err(_)) => {}
            }
        }
        let labels: Option<BTreeMap<String, String>> =
            namespace_labels.and_then(|v| serde_json::from_value(v).ok());
        let excluded = BTreeSet::from(["kube-system".to_owned()]);
        for (raw, item) in pods.iter().zip(&list.items) {
            // Metadata is read as far as it goes.
            let uid = raw.pointer("/metadata/uid").and_then(Value::as_str);
            if let Some(uid) = uid {
                prop_assert_eq!(item.metadata().uid.as_deref(), Some(uid));
            }
            if let Ok(pod) = &item.object {
                let _ = rules::pod_ips(pod);
                let _ = rules::dns_capture(pod);
                let _ = rules::service_account(pod);
                let _ = rules::redirection_annotation(&pod.metadata);
            }
            let add = CmdAdd {
                pod_name: "web-0".into(),
                pod_namespace: "shop".into(),
                pod_uid: "uid-1".into(),
                netns: "/run/netns/x".into(),
                ips: Vec::new(),
            };
            let verdict = selection::decide(&add, Some(item), labels.as_ref(), &excluded);
            if let Some(uid) = &item.metadata().uid
                && uid != "uid-1"
            {
                prop_assert!(
                    matches!(&verdict, Ok(Verdict::Skip(SkipReason::Replaced { .. }))),
                    "{:?}",
                    verdict
                );
            }
            if let Ok(Verdict::Enroll(_)) = verdict {
                let pod = item.object.as_ref().unwrap();
                let pod_mode = pod
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(rules::DATAPLANE_MODE_LABEL));
                prop_assert_ne!(pod_mode.map(String::as_str), Some("none"));
                prop_assert!(!rules::has_sidecar(pod));
                prop_assert_ne!(pod.spec.as_ref().and_then(|s| s.host_network), Some(true));
                prop_assert_ne!(pod.metadata.namespace.as_deref(), Some("kube-system"));
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The fields the ambient rules read, as one comparable value.
type RuleFields = (
    k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    Option<(
        Vec<String>,
        Option<Vec<String>>,
        Option<bool>,
        Option<String>,
    )>,
    Option<(Option<String>, Option<String>, Option<Vec<String>>)>,
);

/// [`RuleFields`] of a `WatchedPod` or of k8s-openapi's `Pod`: the same
/// expression over both, whose fields have the same names.
macro_rules! rule_fields {
    ($pod:expr) => {{
        let pod = $pod;
        (
            pod.metadata.clone(),
            pod.spec.as_ref().map(|s| {
                (
                    s.containers.iter().map(|c| c.name.clone()).collect(),
                    s.init_containers
                        .as_ref()
                        .map(|init| init.iter().map(|c| c.name.clone()).collect()),
                    s.host_network,
                    s.service_account_name.clone(),
                )
            }),
            pod.status.as_ref().map(|s| {
                (
                    s.phase.clone(),
                    s.pod_ip.clone(),
                    s.pod_ips
                        .as_ref()
                        .map(|ips| ips.iter().map(|ip| ip.ip.clone()).collect()),
                )
            }),
        )
    }};
}

fn read_by_rules(pod: &WatchedPod) -> RuleFields {
    rule_fields!(pod)
}

fn read_by_rules_full(pod: &Pod) -> RuleFields {
    rule_fields!(pod)
}
