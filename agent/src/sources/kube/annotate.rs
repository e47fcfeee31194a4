//! Recording enrolment on the pods: `ambient.istio.io/redirection: enabled`
//! on a pod once the controller reports it programmed, removed once the pod
//! has left the mesh, with a JSON merge patch on the pod, as Istio's node
//! agent does; [`remove_redirection_annotations`] takes it off every pod of
//! the node for `ambpf uninstall`.
//!
//! The controller's report ([`crate::controller::ProgrammedPods`]) is the
//! truth for adding. For removing, a pod must be neither programmed nor in
//! the set the source last published (so a pod the source just added is not
//! stripped before the controller has had its pass). Nothing happens before
//! the controller's first report. A patch is not repeated while the watch
//! has not yet shown its result; failures are retried on the next trigger.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::{Metadata as _, api::core::v1::Pod};
use kube::{
    Api, Client,
    api::{ListParams, Patch, PatchParams},
    runtime::reflector::Store,
};
use log::{debug, info, warn};
use serde_json::json;
use tokio::sync::{Notify, watch};

use super::{
    Lenient,
    rules::{self, REDIRECTION_ANNOTATION, REDIRECTION_ENABLED},
};
use crate::controller::ProgrammedPods;

pub(super) struct Annotator {
    client: Client,
    pods: Store<Lenient<Pod>>,
    /// uid -> (annotation wanted, the pod's resourceVersion when patched):
    /// patches whose result the watch has not shown yet.
    in_flight: HashMap<String, (bool, Option<String>)>,
    /// The last patch failure logged as a warning, to log a run of the same
    /// failure once.
    last_failure: Option<String>,
}

impl Annotator {
    pub(super) fn new(client: Client, pods: Store<Lenient<Pod>>) -> Self {
        Self {
            client,
            pods,
            in_flight: HashMap::new(),
            last_failure: None,
        }
    }

    /// Runs until the controller or the source goes away.
    pub(super) async fn run(
        mut self,
        mut programmed: ProgrammedPods,
        mut published: watch::Receiver<Arc<BTreeSet<String>>>,
        pods_changed: Arc<Notify>,
        retry: Duration,
    ) {
        // Nothing is known to be programmed before the controller's first pass.
        if programmed.changed().await.is_err() {
            return;
        }
        let mut tick = tokio::time::interval(retry);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let now_programmed = programmed.borrow_and_update().clone();
            let now_published = published.borrow_and_update().clone();
            self.reconcile(&now_programmed, &now_published).await;
            tokio::select! {
                changed = programmed.changed() => if changed.is_err() { return },
                changed = published.changed() => if changed.is_err() { return },
                () = pods_changed.notified() => {}
                _ = tick.tick() => {}
            }
        }
    }

    async fn reconcile(&mut self, programmed: &BTreeSet<String>, published: &BTreeSet<String>) {
        let pods = self.pods.state();
        let mut present = BTreeSet::new();
        for pod in &pods {
            let Ok(pod) = &pod.object else { continue };
            let meta = &pod.metadata;
            let (Some(uid), Some(namespace), Some(name)) = (&meta.uid, &meta.namespace, &meta.name)
            else {
                continue;
            };
            present.insert(uid.clone());
            let has = rules::annotated_enabled(pod);
            let wanted = if programmed.contains(uid) {
                true
            } else if has && !published.contains(uid) {
                false
            } else {
                self.in_flight.remove(uid);
                continue;
            };
            if wanted == has {
                self.in_flight.remove(uid);
                continue;
            }
            let version = meta.resource_version.clone();
            if self.in_flight.get(uid) == Some(&(wanted, version.clone())) {
                continue;
            }
            match self.patch(namespace, name, wanted).await {
                Ok(()) => {
                    let what = if wanted { "recorded" } else { "removed" };
                    info!("pod {namespace}/{name}: {what} {REDIRECTION_ANNOTATION}");
                    self.in_flight.insert(uid.clone(), (wanted, version));
                    self.last_failure = None;
                }
                Err(PatchError::Gone) => {
                    debug!("pod {namespace}/{name} is gone; not annotating it");
                }
                Err(PatchError::Failed(why)) => {
                    if self.last_failure.as_ref() != Some(&why) {
                        warn!("pod {namespace}/{name}: {why}; retrying");
                    } else {
                        debug!("pod {namespace}/{name}: {why}; retrying");
                    }
                    self.last_failure = Some(why);
                    self.in_flight.remove(uid);
                }
            }
        }
        self.in_flight.retain(|uid, _| present.contains(uid));
    }

    async fn patch(&self, namespace: &str, name: &str, enabled: bool) -> Result<(), PatchError> {
        patch_annotation(&self.client, namespace, name, enabled).await
    }
}

/// Sets (`enabled`) or removes [`REDIRECTION_ANNOTATION`] on one pod, with a
/// JSON merge patch (`null` deletes the key, RFC 7386).
async fn patch_annotation(
    client: &Client,
    namespace: &str,
    name: &str,
    enabled: bool,
) -> Result<(), PatchError> {
    let value = if enabled {
        json!(REDIRECTION_ENABLED)
    } else {
        json!(null)
    };
    let patch = json!({ "metadata": { "annotations": { REDIRECTION_ANNOTATION: value } } });
    let api: Api<Lenient<Pod>> = Api::namespaced(client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some("ambpf".into()),
        ..Default::default()
    };
    let what = if enabled { "recorded" } else { "removed" };
    match api.patch(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Err(PatchError::Gone),
        Err(kube::Error::Api(status)) if status.code == 403 => Err(PatchError::Failed(format!(
            "RBAC denies the agent `patch` on pods in namespace {namespace}, so \
             {REDIRECTION_ANNOTATION} cannot be {what}: {}",
            status.message
        ))),
        Err(e) => Err(PatchError::Failed(format!(
            "patching {REDIRECTION_ANNOTATION}: {}",
            crate::error_chain(&e)
        ))),
    }
}

/// What [`remove_redirection_annotations`] did to one pod.
#[derive(Debug)]
pub struct AnnotationRemoval {
    /// `namespace/name`.
    pub pod: String,
    /// `Ok(true)`: removed; `Ok(false)`: the pod was deleted meanwhile;
    /// `Err`: why the patch failed.
    pub outcome: Result<bool, String>,
}

/// Removes `ambient.istio.io/redirection: enabled` from every pod of
/// `node_name` that carries it, for `ambpf uninstall`. Pods whose spec does
/// not parse are included (only their metadata is read). Every pod is
/// attempted, one patch each; fails only when the pods cannot be listed.
pub async fn remove_redirection_annotations(
    client: &Client,
    node_name: &str,
) -> Result<Vec<AnnotationRemoval>, super::KubeSourceError> {
    let params = ListParams::default().fields(&format!("spec.nodeName={node_name}"));
    let pods = match Api::<Lenient<Pod>>::all(client.clone()).list(&params).await {
        Ok(pods) => pods,
        Err(e) => {
            return Err(super::check("list", "pods", Err(e)).expect_err("a failed list"));
        }
    };
    let mut removals = Vec::new();
    for pod in &pods.items {
        let meta = pod.metadata();
        let annotated = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(REDIRECTION_ANNOTATION))
            .is_some_and(|v| v == REDIRECTION_ENABLED);
        let (Some(namespace), Some(name)) = (&meta.namespace, &meta.name) else {
            continue;
        };
        if !annotated {
            continue;
        }
        let outcome = match patch_annotation(client, namespace, name, false).await {
            Ok(()) => Ok(true),
            Err(PatchError::Gone) => Ok(false),
            Err(PatchError::Failed(why)) => Err(why),
        };
        removals.push(AnnotationRemoval {
            pod: format!("{namespace}/{name}"),
            outcome,
        });
    }
    Ok(removals)
}

enum PatchError {
    Gone,
    Failed(String),
}
