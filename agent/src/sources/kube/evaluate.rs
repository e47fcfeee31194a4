//! One evaluation of the caches: which pods are ambient, and, once their
//! network namespaces are looked for, the set to publish. Kept apart from
//! the watches and the resolver's thread so that it can be tested on plain
//! objects.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
};

use k8s_openapi::api::core::v1::Namespace;
use tracing::{debug, info, warn};

use super::{
    Lenient, PodQuery, WatchedPod,
    rules::{self, IstioNodeAgent},
};
use crate::{
    controller::{PodSpec, SourcePods},
    zds::{NetnsSource, Workload},
};

const DEBUG_NOTE: &str = "debug: ";

fn debug_note(text: String) -> String {
    format!("{DEBUG_NOTE}{text}")
}

/// What was last logged about each pod and each malformed object, so that
/// only changes are logged.
#[derive(Default)]
pub(super) struct Notes {
    /// uid -> the last thing logged about the pod.
    pods: HashMap<String, String>,
    /// kind/namespace/name -> resourceVersion of malformed objects logged.
    malformed: HashMap<String, Option<String>>,
}

impl Notes {
    /// Logs `text` about a pod when it differs from what was last logged
    /// (at debug level when it starts with [`DEBUG_NOTE`]).
    fn note(&mut self, uid: &str, text: String) {
        if self.pods.get(uid) == Some(&text) {
            return;
        }
        match text.strip_prefix(DEBUG_NOTE) {
            Some(quiet) => debug!("{quiet}"),
            None => info!("{text}"),
        }
        self.pods.insert(uid.to_owned(), text);
    }

    fn note_malformed<K>(&mut self, kind: &str, object: &Lenient<K>)
    where
        Lenient<K>:
            k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
    {
        let Err(why) = &object.object else { return };
        let meta = k8s_openapi::Metadata::metadata(object);
        let key = format!(
            "{kind} {}/{}",
            meta.namespace.as_deref().unwrap_or(""),
            meta.name.as_deref().unwrap_or("<unnamed>")
        );
        let version = meta.resource_version.clone();
        if self.malformed.get(&key) != Some(&version) {
            warn!(
                "skipping malformed {key} (resourceVersion {}): {why}",
                version.as_deref().unwrap_or("?")
            );
            self.malformed.insert(key, version);
        }
    }
}

/// What a pod judged ambient needs, besides its namespace, to be published.
struct Details {
    /// How messages name the pod.
    label: String,
    service_account: String,
    dns_capture: Option<bool>,
}

/// The pods of one pass judged ambient or not, before their network
/// namespaces are looked for.
pub(super) struct Classified {
    /// The ambient pods, to resolve.
    pub(super) queries: Vec<PodQuery>,
    details: HashMap<String, Details>,
    /// Every well-formed pod seen, ambient or not.
    present: BTreeSet<String>,
    not_ambient: BTreeMap<String, String>,
    /// Pods whose object cannot be read (by uid): there, not deleted.
    unreadable: BTreeSet<String>,
    /// Istio's node agent's pods, not being deleted (`namespace/name`).
    istio_node_agents: BTreeSet<String>,
    /// Istio's node agent's pods being deleted (`namespace/name`).
    istio_node_agents_stopping: BTreeSet<String>,
}

/// Judges every pod of the caches ambient or not (logging malformed objects
/// and pods that are not ambient).
pub(super) fn classify(
    pods: &[Arc<Lenient<WatchedPod>>],
    namespaces: &[Arc<Lenient<Namespace>>],
    excluded_namespaces: &BTreeSet<String>,
    notes: &mut Notes,
) -> Classified {
    let namespace_labels: HashMap<String, BTreeMap<String, String>> = namespaces
        .iter()
        .filter_map(|ns| {
            notes.note_malformed("namespace", ns);
            let meta = k8s_openapi::Metadata::metadata(ns.as_ref());
            Some((meta.name.clone()?, meta.labels.clone().unwrap_or_default()))
        })
        .collect();
    let mut classified = Classified {
        queries: Vec::new(),
        details: HashMap::new(),
        present: BTreeSet::new(),
        not_ambient: BTreeMap::new(),
        unreadable: BTreeSet::new(),
        istio_node_agents: BTreeSet::new(),
        istio_node_agents_stopping: BTreeSet::new(),
    };
    for entry in pods {
        notes.note_malformed("pod", entry);
        let Ok(pod) = &entry.object else {
            let meta = k8s_openapi::Metadata::metadata(entry.as_ref());
            classified.unreadable.extend(meta.uid.clone());
            continue;
        };
        let meta = &pod.metadata;
        let (Some(uid), Some(namespace), Some(name)) = (&meta.uid, &meta.namespace, &meta.name)
        else {
            continue;
        };
        classified.present.insert(uid.clone());
        let agents = match rules::istio_node_agent(pod) {
            Some(IstioNodeAgent::Running) => Some(&mut classified.istio_node_agents),
            Some(IstioNodeAgent::Stopping) => Some(&mut classified.istio_node_agents_stopping),
            None => None,
        };
        if let Some(agents) = agents {
            agents.insert(format!("{namespace}/{name}"));
        }
        let label = format!("pod {namespace}/{name} ({uid})");
        match rules::ambient(pod, namespace_labels.get(namespace), excluded_namespaces) {
            Ok(()) => {
                classified.details.insert(
                    uid.clone(),
                    Details {
                        label,
                        service_account: rules::service_account(pod),
                        dns_capture: rules::dns_capture(pod),
                    },
                );
                classified.queries.push(PodQuery {
                    uid: uid.clone(),
                    namespace: namespace.clone(),
                    name: name.clone(),
                    ips: rules::pod_ips(pod),
                    runtime_netns: None,
                });
            }
            Err(why) => {
                notes.note(uid, debug_note(format!("{label} is not ambient: {why}")));
                classified.not_ambient.insert(uid.clone(), why.to_string());
            }
        }
    }
    classified
}

impl Classified {
    /// The set to publish, given what the resolver `found` for `queries`
    /// (this pass's, handed back): an ambient pod whose namespace is not
    /// found waits. Forgets the notes of pods gone from the caches.
    pub(super) fn snapshot(
        mut self,
        queries: Vec<PodQuery>,
        found: &BTreeMap<String, Result<NetnsSource, String>>,
        notes: &mut Notes,
    ) -> SourcePods {
        let mut specs = Vec::new();
        let mut waiting = BTreeSet::new();
        for query in queries {
            let Details {
                label,
                service_account,
                dns_capture,
            } = self
                .details
                .remove(&query.uid)
                .expect("details of every query");
            match found.get(&query.uid) {
                Some(Ok(netns)) => {
                    notes.note(
                        &query.uid,
                        format!(
                            "{label} is ambient; its network namespace is {}",
                            netns.path().display()
                        ),
                    );
                    specs.push(PodSpec {
                        workload: Workload {
                            uid: query.uid,
                            name: query.name,
                            namespace: query.namespace,
                            service_account,
                            netns: netns.clone(),
                            netns_inode: None,
                        },
                        dns_capture,
                    });
                }
                Some(Err(why)) => {
                    notes.note(
                        &query.uid,
                        format!("{label} is ambient but not enrolled yet: {why}"),
                    );
                    waiting.insert(query.uid);
                }
                None => {
                    notes.note(
                        &query.uid,
                        format!("{label} is ambient but its network namespace is unknown"),
                    );
                    waiting.insert(query.uid);
                }
            }
        }
        specs.sort_by(|a, b| a.workload.uid.cmp(&b.workload.uid));
        notes.pods.retain(|uid, _| self.present.contains(uid));
        SourcePods {
            ambient: specs,
            not_ambient: self.not_ambient,
            waiting,
            unreadable: self.unreadable,
            // Every pod of the node the watch holds is in a list.
            absent_means_deleted: true,
            istio_node_agents: self.istio_node_agents,
            istio_node_agents_stopping: self.istio_node_agents_stopping,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::*;

    fn pod(uid: &str, namespace: &str, labels: serde_json::Value) -> Arc<Lenient<WatchedPod>> {
        let value = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"uid": uid, "namespace": namespace, "name": format!("p-{uid}"), "labels": labels},
            "spec": {"nodeName": "n1", "serviceAccountName": "sa", "containers": [{"name": "c"}]},
            "status": {"podIP": "10.0.0.7", "podIPs": [{"ip": "10.0.0.7"}]},
        });
        Arc::new(serde_json::from_value(value).unwrap())
    }

    fn namespace(name: &str, labels: serde_json::Value) -> Arc<Lenient<Namespace>> {
        let value = json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels},
        });
        Arc::new(serde_json::from_value(value).unwrap())
    }

    fn ambient_ns(name: &str) -> Arc<Lenient<Namespace>> {
        namespace(name, json!({"istio.io/dataplane-mode": "ambient"}))
    }

    fn excluded() -> BTreeSet<String> {
        ["kube-system".to_owned()].into()
    }

    fn found(
        entries: &[(&str, Result<NetnsSource, String>)],
    ) -> BTreeMap<String, Result<NetnsSource, String>> {
        entries
            .iter()
            .map(|(uid, r)| ((*uid).to_owned(), r.clone()))
            .collect()
    }

    #[test]
    fn ambient_pods_are_queried_with_their_addresses_and_the_rest_say_why_not() {
        let pods = [
            pod("a", "mesh", json!({})),
            pod("b", "plain", json!({})),
            pod("c", "mesh", json!({"istio.io/dataplane-mode": "none"})),
            pod(
                "d",
                "kube-system",
                json!({"istio.io/dataplane-mode": "ambient"}),
            ),
        ];
        let namespaces = [ambient_ns("mesh"), namespace("plain", json!({}))];
        let mut notes = Notes::default();
        let classified = classify(&pods, &namespaces, &excluded(), &mut notes);
        let queried: Vec<&str> = classified.queries.iter().map(|q| q.uid.as_str()).collect();
        assert_eq!(queried, ["a"]);
        assert_eq!(
            classified.queries[0].ips,
            ["10.0.0.7".parse::<std::net::IpAddr>().unwrap()]
        );
        let not: Vec<&str> = classified.not_ambient.keys().map(String::as_str).collect();
        assert_eq!(not, ["b", "c", "d"]);
        assert!(notes.pods["b"].starts_with(DEBUG_NOTE), "{:?}", notes.pods);
    }

    #[test]
    fn found_pods_are_published_sorted_and_the_others_wait() {
        let pods = [
            pod("z", "mesh", json!({})),
            pod("y", "mesh", json!({})),
            pod("x", "mesh", json!({})),
            pod("w", "mesh", json!({})),
        ];
        let mut notes = Notes::default();
        let mut classified = classify(&pods, &[ambient_ns("mesh")], &excluded(), &mut notes);
        let queries = std::mem::take(&mut classified.queries);
        let found = found(&[
            ("z", Ok(NetnsSource::Pid(42))),
            ("y", Ok(NetnsSource::Path(PathBuf::from("/run/netns/y")))),
            ("x", Err("no process yet".into())),
        ]);
        let snapshot = classified.snapshot(queries, &found, &mut notes);
        let ambient: Vec<&str> = snapshot
            .ambient
            .iter()
            .map(|s| s.workload.uid.as_str())
            .collect();
        assert_eq!(ambient, ["y", "z"]);
        let z = &snapshot.ambient[1];
        assert_eq!(z.workload.netns, NetnsSource::Pid(42));
        assert_eq!(z.workload.service_account, "sa");
        assert_eq!(z.workload.namespace, "mesh");
        assert_eq!(z.dns_capture, None);
        let waiting: Vec<&str> = snapshot.waiting.iter().map(String::as_str).collect();
        assert_eq!(waiting, ["w", "x"]);
        assert!(snapshot.not_ambient.is_empty());
        assert!(notes.pods["x"].contains("not enrolled yet: no process yet"));
        assert!(notes.pods["w"].contains("network namespace is unknown"));
        assert!(notes.pods["z"].contains("/proc/42/ns/net"));
    }

    #[test]
    fn a_pod_in_an_unknown_namespace_is_not_ambient_unless_labelled() {
        let pods = [
            pod("a", "gone", json!({})),
            pod("b", "gone", json!({"istio.io/dataplane-mode": "ambient"})),
        ];
        let mut notes = Notes::default();
        let classified = classify(&pods, &[], &excluded(), &mut notes);
        let queried: Vec<&str> = classified.queries.iter().map(|q| q.uid.as_str()).collect();
        assert_eq!(queried, ["b"]);
        assert!(classified.not_ambient.contains_key("a"));
    }

    #[test]
    fn malformed_and_unnamed_pods_are_skipped_and_notes_of_gone_pods_forgotten() {
        let malformed: Arc<Lenient<WatchedPod>> = Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"uid": "m", "namespace": "mesh", "name": "m", "resourceVersion": "7"},
                "spec": {"containers": "not a list"},
            }))
            .unwrap(),
        );
        assert!(malformed.object.is_err());
        let unnamed: Arc<Lenient<WatchedPod>> = Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"namespace": "mesh", "name": "no-uid"},
                "spec": {"containers": []},
            }))
            .unwrap(),
        );
        let mut notes = Notes::default();
        let namespaces = [ambient_ns("mesh")];
        let mut first = classify(
            &[
                malformed.clone(),
                unnamed.clone(),
                pod("a", "mesh", json!({})),
            ],
            &namespaces,
            &excluded(),
            &mut notes,
        );
        assert_eq!(first.queries.len(), 1);
        assert_eq!(notes.malformed["pod mesh/m"], Some("7".to_owned()));
        let queries = std::mem::take(&mut first.queries);
        first.snapshot(queries, &BTreeMap::new(), &mut notes);
        assert!(notes.pods.contains_key("a"));

        // Pod `a` is gone: its note goes with it; the malformed one stays noted.
        let mut second = classify(&[malformed], &namespaces, &excluded(), &mut notes);
        let queries = std::mem::take(&mut second.queries);
        let snapshot = second.snapshot(queries, &BTreeMap::new(), &mut notes);
        // The malformed pod is there, not deleted.
        let expected = SourcePods {
            unreadable: ["m".to_owned()].into(),
            absent_means_deleted: true,
            ..SourcePods::default()
        };
        assert_eq!(snapshot, expected);
        assert!(notes.pods.is_empty(), "{:?}", notes.pods);
        assert_eq!(notes.malformed.len(), 1);
    }
}
