//! Recording enrolment on the pods: `ambient.istio.io/redirection: enabled`
//! on a pod once the controller reports it programmed, removed once the pod
//! has left the mesh, with a JSON merge patch on the pod, as Istio's node
//! agent does.
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

use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
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
        let value = if enabled {
            json!(REDIRECTION_ENABLED)
        } else {
            json!(null)
        };
        let patch = json!({ "metadata": { "annotations": { REDIRECTION_ANNOTATION: value } } });
        let api: Api<Lenient<Pod>> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams {
            field_manager: Some("ambpf".into()),
            ..Default::default()
        };
        match api.patch(name, &params, &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Err(PatchError::Gone),
            Err(kube::Error::Api(status)) if status.code == 403 => {
                Err(PatchError::Failed(format!(
                    "RBAC denies the agent `patch` on pods in namespace {namespace}, so {REDIRECTION_ANNOTATION} \
                 cannot be recorded: {}",
                    status.message
                )))
            }
            Err(e) => Err(PatchError::Failed(format!(
                "patching {REDIRECTION_ANNOTATION}: {}",
                crate::error_chain(&e)
            ))),
        }
    }
}

enum PatchError {
    Gone,
    Failed(String),
}
