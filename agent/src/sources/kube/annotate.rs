//! Recording enrolment on the pods, as Istio's node agent does:
//! `ambient.istio.io/redirection: enabled` once a pod's redirection is in
//! place and ztunnel has acked it, `pending` while the redirection is in
//! place but ztunnel has not taken the pod (none connected, or it NACKed),
//! removed once the pod has left the mesh. Each is a JSON merge patch on the
//! pod's `status` subresource (which may change metadata, and is the lower
//! privilege); [`remove_redirection_annotations`] takes it off every pod of
//! the node for `ambpf uninstall`.
//!
//! The controller's report ([`crate::controller::ProgrammedPods`]) and the
//! ZDS server's ([`crate::zds::ZtunnelPods`]) decide a programmed pod's
//! value ([`target`]); a pod whose CNI ADD failed because ztunnel did not
//! take it is `pending` until the runtime's retry programs it. A pod annotated `enabled` stays so while no ztunnel is
//! connected: ztunnel keeps its proxies across a reconnect, and Istio does
//! not flip the annotation back either. For removing, a pod must be neither
//! programmed nor in the set the source last published (so a pod the source
//! just added is not stripped before the controller has had its pass).
//! Nothing happens before the controller's first report. A patch is not
//! repeated while the watch has not yet shown its result; failures are
//! retried on the next trigger.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
    time::Duration,
};

use futures::StreamExt as _;
use k8s_openapi::Metadata as _;
use kube::{
    Api, Client,
    api::{ListParams, Patch, PatchParams},
    runtime::reflector::Store,
};
use serde_json::json;
use tokio::sync::{Notify, watch};
use tracing::{debug, info, warn};

use super::{
    Lenient, WatchedPod,
    rules::{self, REDIRECTION_ANNOTATION, Redirection},
};
use crate::{
    controller::{PodsReport, ProgrammedPods},
    zds::{ZtunnelPodSet, ZtunnelPods, ZtunnelStatus},
};

/// What a pod's annotation should become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// Whatever it is now (nothing is known that would change it).
    Leave,
    Set(Redirection),
    Remove,
}

/// The annotation a pod should carry: `programmed` by the controller, or
/// `held_back` (its CNI ADD failed on ztunnel, the runtime retries),
/// `published` by the source, what ztunnel made of it, and the agent's value
/// it carries now.
pub(super) fn target(
    programmed: bool,
    held_back: bool,
    published: bool,
    ztunnel: Option<ZtunnelStatus>,
    current: Option<Redirection>,
) -> Target {
    if !programmed {
        if held_back {
            return Target::Set(Redirection::Pending);
        }
        return if current.is_some() && !published {
            Target::Remove
        } else {
            Target::Leave
        };
    }
    match ztunnel {
        Some(ZtunnelStatus::Acked) => Target::Set(Redirection::Enabled),
        Some(ZtunnelStatus::Refused) => Target::Set(Redirection::Pending),
        // ztunnel is away: a pod it had keeps its proxy, and its value.
        Some(ZtunnelStatus::Unserved) if current == Some(Redirection::Enabled) => Target::Leave,
        Some(ZtunnelStatus::Unserved) => Target::Set(Redirection::Pending),
        // Its Add is on its way; the answer decides, so a pod ztunnel takes
        // at once is patched once.
        None => Target::Leave,
    }
}

/// Patches to one pod whose result the watch has not shown yet.
#[derive(Debug, Default)]
struct InFlight {
    /// The value last patched (`None`: removed).
    wanted: Option<Redirection>,
    /// The pod's resourceVersion after the latest patch, per its answer.
    latest: Option<String>,
    /// Versions older than the latest patch: while the store shows one of
    /// them, the watch has not caught up and the patch is not repeated.
    superseded: Vec<String>,
}

impl InFlight {
    /// Whether the latest patch already asks for `wanted` of a pod the
    /// store shows at `version`, and the watch has not shown its result.
    fn awaits(&self, wanted: Option<Redirection>, version: Option<&str>) -> bool {
        self.wanted == wanted && version.is_some_and(|v| self.superseded.iter().any(|s| s == v))
    }

    /// Records a patch to `wanted`, sent while the store showed `before`,
    /// that left the pod at `after`. An earlier patch's result predates it
    /// too, so a quick `pending` then `enabled` is not repeated when the
    /// watch shows the `pending` version.
    fn patched(
        &mut self,
        wanted: Option<Redirection>,
        before: Option<String>,
        after: Option<String>,
    ) {
        self.wanted = wanted;
        self.superseded.extend(before);
        self.superseded
            .extend(std::mem::replace(&mut self.latest, after));
    }
}

pub(super) struct Annotator {
    client: Client,
    pods: Store<Lenient<WatchedPod>>,
    /// uid -> patches whose result the watch has not shown yet.
    in_flight: HashMap<String, InFlight>,
    /// uid -> the change whose failure was last logged as a warning, and
    /// why: each pod's failed change is warned about once, not every retry
    /// (RBAC without `patch` on pods/status fails every pod every pass).
    warned: HashMap<String, (Option<Redirection>, String)>,
}

impl Annotator {
    pub(super) fn new(client: Client, pods: Store<Lenient<WatchedPod>>) -> Self {
        Self {
            client,
            pods,
            in_flight: HashMap::new(),
            warned: HashMap::new(),
        }
    }

    /// Runs until the controller, the ZDS server or the source goes away.
    pub(super) async fn run(
        mut self,
        mut programmed: ProgrammedPods,
        mut ztunnel: ZtunnelPods,
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
            let now_ztunnel = ztunnel.borrow_and_update().clone();
            let now_published = published.borrow_and_update().clone();
            self.reconcile(&now_programmed, &now_ztunnel, &now_published)
                .await;
            tokio::select! {
                changed = programmed.changed() => if changed.is_err() { return },
                changed = ztunnel.changed() => if changed.is_err() { return },
                changed = published.changed() => if changed.is_err() { return },
                () = pods_changed.notified() => {}
                _ = tick.tick() => {}
            }
        }
    }

    async fn reconcile(
        &mut self,
        report: &PodsReport,
        ztunnel: &ZtunnelPodSet,
        published: &BTreeSet<String>,
    ) {
        let pods = self.pods.state();
        let mut present = BTreeSet::new();
        let mut changes = Vec::new();
        for pod in &pods {
            let Ok(pod) = &pod.object else { continue };
            let meta = &pod.metadata;
            let (Some(uid), Some(namespace), Some(name)) = (&meta.uid, &meta.namespace, &meta.name)
            else {
                continue;
            };
            present.insert(uid.clone());
            let current = rules::redirection_annotation(meta);
            let wanted = match target(
                report.programmed.contains(uid),
                report.held_back.contains(uid),
                published.contains(uid),
                ztunnel.get(uid).copied(),
                current,
            ) {
                Target::Leave => {
                    self.in_flight.remove(uid);
                    continue;
                }
                Target::Set(value) => Some(value),
                Target::Remove => None,
            };
            if wanted == current {
                self.in_flight.remove(uid);
                continue;
            }
            let version = meta.resource_version.clone();
            if self
                .in_flight
                .get(uid)
                .is_some_and(|patch| patch.awaits(wanted, version.as_deref()))
            {
                continue;
            }
            changes.push(Change {
                uid: uid.clone(),
                namespace: namespace.clone(),
                name: name.clone(),
                wanted,
                version,
            });
        }
        // Each patch is an API round trip of a few milliseconds, nearly all
        // of it waiting: a namespace of 100 pods labelled at once would wait
        // for them one after another. A handful at once, in any order (each
        // pod's own changes stay one per pass).
        let client = self.client.clone();
        let mut patched = futures::stream::iter(changes)
            .map(move |change| {
                let client = client.clone();
                async move {
                    let outcome =
                        patch_annotation(&client, &change.namespace, &change.name, change.wanted)
                            .await;
                    (change, outcome)
                }
            })
            .buffer_unordered(PATCHES_AT_ONCE);
        while let Some((change, outcome)) = patched.next().await {
            self.record(change, outcome);
        }
        self.in_flight.retain(|uid, _| present.contains(uid));
        self.warned.retain(|uid, _| present.contains(uid));
    }

    /// Records what patching one pod's annotation came to.
    fn record(&mut self, change: Change, outcome: Result<Option<String>, PatchError>) {
        let Change {
            uid,
            namespace,
            name,
            wanted,
            version,
        } = change;
        match outcome {
            Ok(patched_version) => {
                match wanted {
                    Some(value) => {
                        info!("pod {namespace}/{name}: {REDIRECTION_ANNOTATION}={value}")
                    }
                    None => info!("pod {namespace}/{name}: removed {REDIRECTION_ANNOTATION}"),
                }
                self.warned.remove(&uid);
                self.in_flight
                    .entry(uid)
                    .or_default()
                    .patched(wanted, version, patched_version);
            }
            Err(PatchError::Gone) => {
                debug!("pod {namespace}/{name} is gone; not annotating it");
            }
            Err(PatchError::Failed(why)) => {
                let failure = (wanted, why);
                self.in_flight.remove(&uid);
                if self.warned.get(&uid) != Some(&failure) {
                    warn!("pod {namespace}/{name}: {}; retrying", failure.1);
                    self.warned.insert(uid, failure);
                } else {
                    debug!("pod {namespace}/{name}: {}; retrying", failure.1);
                }
            }
        }
    }
}

/// How many annotation patches are in flight at once: enough to overlap
/// the API server's round trips, few enough not to crowd a node's other
/// clients (kubelet, kube-proxy) out of the API server.
const PATCHES_AT_ONCE: usize = 8;

/// One pod's annotation to change in this pass.
struct Change {
    uid: String,
    namespace: String,
    name: String,
    wanted: Option<Redirection>,
    /// The pod's resourceVersion in the store when the change was decided.
    version: Option<String>,
}

/// Sets [`REDIRECTION_ANNOTATION`] on one pod to `value`, or removes it
/// (`None`), with a JSON merge patch (`null` deletes the key, RFC 7386) on
/// the pod's `status` subresource, as Istio's node agent does: both `pods`
/// and `pods/status` may change metadata, and the latter is the lower
/// privilege. Returns the pod's resourceVersion after the patch.
async fn patch_annotation(
    client: &Client,
    namespace: &str,
    name: &str,
    value: Option<Redirection>,
) -> Result<Option<String>, PatchError> {
    let patch = json!({
        "metadata": { "annotations": { REDIRECTION_ANNOTATION: value.map(Redirection::as_str) } }
    });
    let api: Api<Lenient<WatchedPod>> = Api::namespaced(client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some("ambpf".into()),
        ..Default::default()
    };
    let what = if value.is_some() {
        "recorded"
    } else {
        "removed"
    };
    match api.patch_status(name, &params, &Patch::Merge(&patch)).await {
        Ok(pod) => Ok(pod.metadata().resource_version.clone()),
        Err(kube::Error::Api(status)) if status.code == 404 => Err(PatchError::Gone),
        Err(kube::Error::Api(status)) if status.code == 403 => Err(PatchError::Failed(format!(
            "RBAC denies the agent `patch` on pods/status in namespace {namespace}, so \
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

/// Removes `ambient.istio.io/redirection` (`enabled` or `pending`) from
/// every pod of `node_name` that carries it, for `ambpf uninstall`. Pods
/// whose spec does not parse are included (only their metadata is read).
/// Every pod is attempted, one patch each; fails only when the pods cannot
/// be listed.
pub async fn remove_redirection_annotations(
    client: &Client,
    node_name: &str,
) -> Result<Vec<AnnotationRemoval>, super::KubeSourceError> {
    let params = ListParams::default().fields(&format!("spec.nodeName={node_name}"));
    let pods = Api::<Lenient<WatchedPod>>::all(client.clone())
        .list(&params)
        .await
        .map_err(|e| super::api_error("list", "pods", e))?;
    let mut removals = Vec::new();
    for pod in &pods.items {
        let meta = pod.metadata();
        let (Some(namespace), Some(name)) = (&meta.namespace, &meta.name) else {
            continue;
        };
        if rules::redirection_annotation(meta).is_none() {
            continue;
        }
        let outcome = match patch_annotation(client, namespace, name, None).await {
            Ok(_) => Ok(true),
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

#[cfg(test)]
mod tests {
    use super::*;

    const ENABLED: Option<Redirection> = Some(Redirection::Enabled);
    const PENDING: Option<Redirection> = Some(Redirection::Pending);

    #[test]
    fn a_programmed_pod_is_enabled_once_ztunnel_acks_it_and_pending_when_refused() {
        for current in [None, PENDING, ENABLED] {
            for published in [false, true] {
                assert_eq!(
                    target(true, false, published, Some(ZtunnelStatus::Acked), current),
                    Target::Set(Redirection::Enabled)
                );
                assert_eq!(
                    target(
                        true,
                        false,
                        published,
                        Some(ZtunnelStatus::Refused),
                        current
                    ),
                    Target::Set(Redirection::Pending),
                    "a NACK undoes enabled too"
                );
            }
        }
    }

    #[test]
    fn with_no_ztunnel_a_new_pod_is_pending_and_an_enabled_one_stays_enabled() {
        let unserved = Some(ZtunnelStatus::Unserved);
        assert_eq!(
            target(true, false, true, unserved, None),
            Target::Set(Redirection::Pending)
        );
        assert_eq!(
            target(true, false, true, unserved, PENDING),
            Target::Set(Redirection::Pending)
        );
        assert_eq!(target(true, false, true, unserved, ENABLED), Target::Leave);
    }

    #[test]
    fn a_pod_whose_add_is_on_its_way_waits_for_the_answer() {
        for current in [None, PENDING, ENABLED] {
            assert_eq!(target(true, false, true, None, current), Target::Leave);
        }
    }

    #[test]
    fn a_patch_is_not_repeated_until_the_watch_shows_a_newer_version() {
        let v = |n: u32| Some(n.to_string());
        let mut patch = InFlight::default();
        // `pending` patched at version 1, leaving the pod at 2.
        patch.patched(PENDING, v(1), v(2));
        assert!(patch.awaits(PENDING, Some("1")));
        assert!(
            !patch.awaits(ENABLED, Some("1")),
            "a different value is sent"
        );
        // ztunnel acks at once: `enabled` patched while the store still
        // shows 1, leaving the pod at 3.
        patch.patched(ENABLED, v(1), v(3));
        assert!(patch.awaits(ENABLED, Some("1")));
        assert!(
            patch.awaits(ENABLED, Some("2")),
            "the watch showing the `pending` patch is not a reason to patch again"
        );
        // Another writer's version after ours: if it lost the value, patch.
        assert!(!patch.awaits(ENABLED, Some("4")));
        assert!(!patch.awaits(ENABLED, None));
    }

    #[test]
    fn a_pod_whose_cni_add_ztunnel_failed_is_pending_until_programmed() {
        for current in [None, PENDING, ENABLED] {
            for published in [false, true] {
                assert_eq!(
                    target(false, true, published, None, current),
                    Target::Set(Redirection::Pending)
                );
            }
            // The runtime's retry enrols it: the programmed pod decides.
            assert_eq!(
                target(true, false, true, Some(ZtunnelStatus::Acked), current),
                Target::Set(Redirection::Enabled)
            );
        }
    }

    #[test]
    fn a_pod_not_programmed_loses_the_annotation_only_once_the_source_dropped_it() {
        for ztunnel in [
            None,
            Some(ZtunnelStatus::Acked),
            Some(ZtunnelStatus::Refused),
            Some(ZtunnelStatus::Unserved),
        ] {
            assert_eq!(
                target(false, false, false, ztunnel, ENABLED),
                Target::Remove
            );
            assert_eq!(
                target(false, false, false, ztunnel, PENDING),
                Target::Remove
            );
            assert_eq!(target(false, false, false, ztunnel, None), Target::Leave);
            // Published but not programmed yet (or not enrolled): kept.
            assert_eq!(target(false, false, true, ztunnel, ENABLED), Target::Leave);
            assert_eq!(target(false, false, true, ztunnel, None), Target::Leave);
        }
    }
}
