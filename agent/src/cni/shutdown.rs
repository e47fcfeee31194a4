//! Whether the plugin stays chained when `cni-install --watch` stops.
//!
//! The plugin fails the network setup of every new pod while no agent
//! answers, so it must not outlive ambpf on a node; but while the
//! DaemonSet's pod is upgraded or restarted it must stay, or pods started in
//! between would run unprotected. As Istio's node agent does, the installer
//! tells the two apart by its own DaemonSet, found through its pod's
//! ownerReferences: still there and not being deleted, an upgrade or a
//! restart (the next pod takes over the plugin); gone or carrying a
//! deletionTimestamp, an uninstall (the plugin and its binary go, see
//! [`super::install::uninstall`]).
//!
//! When it cannot tell (no Kubernetes configuration, no POD_NAME, the API
//! server not answering, RBAC, a pod no DaemonSet runs), the plugin stays:
//! pods that cannot start until someone removes it are recoverable, an
//! ambient pod running unprotected is not.
//!
//! `helm uninstall` deletes the DaemonSet and, moments later, its
//! ClusterRoleBinding and ServiceAccount, usually before the kubelet stops
//! this pod, so a read at shutdown is then refused. The installer therefore
//! also watches its DaemonSet while it runs ([`OwnerWatch`]): when the read
//! at shutdown fails, the DaemonSet's deletion seen by the watch still
//! decides.

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::{
    Metadata as _,
    api::{apps::v1::DaemonSet, core::v1::Pod},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::sources::kube::{Lenient, api_error};

/// How long each read from the API server at shutdown may take (the pod's
/// grace period is 30 s by default).
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The answer to one read from the API server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup<T> {
    Found(T),
    NotFound,
    /// No answer: unreachable, too slow, refused (RBAC, credentials).
    Failed(String),
}

/// The installer's own pod, from the downward API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelfPod {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for SelfPod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the decision needs of the installer's pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnPod {
    /// The DaemonSet that runs it (from its ownerReferences), if any.
    pub daemonset: Option<String>,
}

/// What the decision needs of the DaemonSet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DaemonSetState {
    /// It carries a deletionTimestamp.
    pub deleting: bool,
}

/// What happens to the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShutdownAction {
    /// The DaemonSet stays (an upgrade or a restart): the plugin stays for
    /// its next pod.
    Keep { daemonset: String },
    /// It cannot be told whether ambpf is leaving the node: the plugin stays.
    Undecided { why: String },
    /// The DaemonSet is gone or being deleted: the plugin goes.
    Remove { why: String },
}

/// The DaemonSet that controls a pod, from its ownerReferences.
pub fn owning_daemonset(meta: &ObjectMeta) -> Option<String> {
    let daemonsets: Vec<_> = meta
        .owner_references
        .iter()
        .flatten()
        .filter(|owner| owner.kind == "DaemonSet" && owner.api_version.starts_with("apps/"))
        .collect();
    daemonsets
        .iter()
        .find(|owner| owner.controller == Some(true))
        .or(daemonsets.first())
        .map(|owner| owner.name.clone())
}

/// The decision, from the installer's pod, the read of its DaemonSet at
/// shutdown (`None`: not made) and what the watch of the DaemonSet saw
/// last (`None`: nothing yet; it records answers only, never a failure).
pub fn decide(
    pod: &Lookup<OwnPod>,
    read: Option<&Lookup<DaemonSetState>>,
    watched: Option<&Lookup<DaemonSetState>>,
) -> ShutdownAction {
    let undecided = |why: String| ShutdownAction::Undecided { why };
    let name = match pod {
        Lookup::Found(OwnPod {
            daemonset: Some(name),
        }) => name,
        Lookup::Found(OwnPod { daemonset: None }) => {
            return undecided("no DaemonSet runs this pod (none in its ownerReferences)".into());
        }
        Lookup::NotFound => return undecided("the API server does not have this pod".into()),
        Lookup::Failed(why) => return undecided(format!("cannot read this pod: {why}")),
    };
    let deleted_as_seen = |why: &str| match watched {
        Some(Lookup::NotFound) => Some(ShutdownAction::Remove {
            why: format!("the watch saw DaemonSet {name} deleted ({why})"),
        }),
        Some(Lookup::Found(DaemonSetState { deleting: true })) => Some(ShutdownAction::Remove {
            why: format!("the watch saw DaemonSet {name} being deleted ({why})"),
        }),
        _ => None,
    };
    match read {
        Some(Lookup::Found(DaemonSetState { deleting: false })) => ShutdownAction::Keep {
            daemonset: name.clone(),
        },
        Some(Lookup::Found(DaemonSetState { deleting: true })) => ShutdownAction::Remove {
            why: format!("DaemonSet {name} is being deleted"),
        },
        Some(Lookup::NotFound) => ShutdownAction::Remove {
            why: format!("DaemonSet {name} is gone"),
        },
        Some(Lookup::Failed(why)) => {
            let why = format!("reading it now failed: {why}");
            deleted_as_seen(&why)
                .unwrap_or_else(|| undecided(format!("cannot read DaemonSet {name}: {why}")))
        }
        None => deleted_as_seen("it was not read now")
            .unwrap_or_else(|| undecided(format!("DaemonSet {name} was not read"))),
    }
}

/// What the watch has learnt so far.
#[derive(Debug, Default)]
struct Seen {
    pod: Option<OwnPod>,
    daemonset: Option<Lookup<DaemonSetState>>,
}

/// Reads the installer's pod, then follows its DaemonSet, while the
/// installer runs; [`OwnerWatch::decide`] at shutdown.
pub struct OwnerWatch {
    client: Client,
    pod: SelfPod,
    seen: Arc<Mutex<Seen>>,
    task: JoinHandle<()>,
}

impl OwnerWatch {
    /// Starts following. Needs a tokio runtime.
    pub fn start(client: Client, pod: SelfPod) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let task = tokio::spawn(follow(client.clone(), pod.clone(), seen.clone()));
        Self {
            client,
            pod,
            seen,
            task,
        }
    }

    /// Stops following and decides: the DaemonSet as read now, else as the
    /// watch saw it last.
    pub async fn decide(self, timeout: Duration) -> ShutdownAction {
        self.task.abort();
        let (own, watched) = {
            let seen = lock(&self.seen);
            (seen.pod.clone(), seen.daemonset.clone())
        };
        // The owner does not change; read the pod only if the watch could not.
        let pod = match own {
            Some(own) => Lookup::Found(own),
            None => read_pod(&self.client, &self.pod, timeout).await,
        };
        let read = match &pod {
            Lookup::Found(OwnPod {
                daemonset: Some(name),
            }) => Some(read_daemonset(&self.client, &self.pod.namespace, name, timeout).await),
            _ => None,
        };
        decide(&pod, read.as_ref(), watched.as_ref())
    }
}

impl Drop for OwnerWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(seen: &Mutex<Seen>) -> MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn within<T>(
    timeout: Duration,
    read: impl Future<Output = Lookup<T>>,
) -> impl Future<Output = Lookup<T>> {
    tokio::time::timeout(timeout, read).map(move |answer| {
        answer.unwrap_or_else(|_| {
            Lookup::Failed(format!(
                "the API server did not answer within {} s",
                timeout.as_secs_f64()
            ))
        })
    })
}

async fn read_pod(client: &Client, pod: &SelfPod, timeout: Duration) -> Lookup<OwnPod> {
    let api = Api::<Lenient<Pod>>::namespaced(client.clone(), &pod.namespace);
    within(timeout, async {
        match api.get_opt(&pod.name).await {
            Ok(Some(found)) => Lookup::Found(OwnPod {
                daemonset: owning_daemonset(found.metadata()),
            }),
            Ok(None) => Lookup::NotFound,
            Err(e) => Lookup::Failed(api_error("get", "pods", e).to_string()),
        }
    })
    .await
}

fn state_of(daemonset: &Lenient<DaemonSet>) -> DaemonSetState {
    DaemonSetState {
        deleting: daemonset.metadata().deletion_timestamp.is_some(),
    }
}

async fn read_daemonset(
    client: &Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Lookup<DaemonSetState> {
    let api = Api::<Lenient<DaemonSet>>::namespaced(client.clone(), namespace);
    within(timeout, async {
        match api.get_opt(name).await {
            Ok(Some(found)) => Lookup::Found(state_of(&found)),
            Ok(None) => Lookup::NotFound,
            Err(e) => Lookup::Failed(api_error("get", "daemonsets", e).to_string()),
        }
    })
    .await
}

/// Reads the pod until the API server answers, then watches its DaemonSet
/// until aborted, recording each answer in `seen`.
async fn follow(client: Client, pod: SelfPod, seen: Arc<Mutex<Seen>>) {
    const MAX_RETRY: Duration = Duration::from_secs(30);
    let mut retry = Duration::from_secs(1);
    let own = loop {
        match read_pod(&client, &pod, LOOKUP_TIMEOUT).await {
            Lookup::Found(own) => break own,
            Lookup::NotFound => warn!("pod {pod} is not in the API server; reading it again"),
            Lookup::Failed(why) => warn!("reading pod {pod}: {why}; retrying"),
        }
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(MAX_RETRY);
    };
    lock(&seen).pod = Some(own.clone());
    let Some(name) = own.daemonset else {
        warn!("no DaemonSet runs pod {pod}: on shutdown ambpf-cni stays chained");
        return;
    };
    let daemonset = format!("{}/{name}", pod.namespace);
    info!("following DaemonSet {daemonset}, which runs pod {pod}");
    let api = Api::<Lenient<DaemonSet>>::namespaced(client, &pod.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api, config).default_backoff().boxed();
    // Whether the (re)list in progress returned the DaemonSet.
    let mut listed = false;
    let mut last_error = None;
    while let Some(event) = events.next().await {
        let state = match event {
            Ok(watcher::Event::Init) => {
                listed = false;
                continue;
            }
            Ok(watcher::Event::InitApply(found) | watcher::Event::Apply(found)) => {
                listed = true;
                Lookup::Found(state_of(&found))
            }
            Ok(watcher::Event::InitDone) if listed => continue,
            Ok(watcher::Event::InitDone | watcher::Event::Delete(_)) => Lookup::NotFound,
            Err(e) => {
                let why = e.to_string();
                if last_error.as_ref() != Some(&why) {
                    warn!("watching DaemonSet {daemonset}: {why}; retrying");
                    last_error = Some(why);
                }
                continue;
            }
        };
        last_error = None;
        let mut seen = lock(&seen);
        if seen.daemonset != Some(state.clone()) {
            match &state {
                Lookup::Found(DaemonSetState { deleting: false }) => {
                    info!("DaemonSet {daemonset} exists")
                }
                Lookup::Found(DaemonSetState { deleting: true }) => {
                    info!("DaemonSet {daemonset} is being deleted")
                }
                _ => info!("DaemonSet {daemonset} is deleted"),
            }
        }
        seen.daemonset = Some(state);
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use super::*;

    fn owner(
        api_version: &str,
        kind: &str,
        name: &str,
        controller: Option<bool>,
    ) -> OwnerReference {
        OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            controller,
            block_owner_deletion: None,
        }
    }

    fn meta(owners: Vec<OwnerReference>) -> ObjectMeta {
        ObjectMeta {
            owner_references: Some(owners),
            ..Default::default()
        }
    }

    #[test]
    fn the_owner_is_the_controlling_daemonset() {
        assert_eq!(
            owning_daemonset(&meta(vec![owner(
                "apps/v1",
                "DaemonSet",
                "ambpf",
                Some(true)
            )])),
            Some("ambpf".into())
        );
        assert_eq!(
            owning_daemonset(&meta(vec![
                owner("v1", "Node", "node-1", None),
                owner("apps/v1", "DaemonSet", "other", None),
                owner("apps/v1", "DaemonSet", "ambpf", Some(true)),
            ])),
            Some("ambpf".into())
        );
        // A DaemonSet of another API group is not Kubernetes' DaemonSet.
        assert_eq!(
            owning_daemonset(&meta(vec![
                owner("apps.kruise.io/v1alpha1", "DaemonSet", "x", Some(true)),
                owner("apps/v1", "ReplicaSet", "rs", None),
            ])),
            None
        );
        assert_eq!(owning_daemonset(&ObjectMeta::default()), None);
    }

    fn pod_of(name: &str) -> Lookup<OwnPod> {
        Lookup::Found(OwnPod {
            daemonset: Some(name.into()),
        })
    }

    const PRESENT: Lookup<DaemonSetState> = Lookup::Found(DaemonSetState { deleting: false });
    const DELETING: Lookup<DaemonSetState> = Lookup::Found(DaemonSetState { deleting: true });

    fn failed(why: &str) -> Lookup<DaemonSetState> {
        Lookup::Failed(why.into())
    }

    fn is_kept(action: &ShutdownAction) -> bool {
        !matches!(action, ShutdownAction::Remove { .. })
    }

    #[test]
    fn the_plugin_stays_while_the_daemonset_stays() {
        let pod = pod_of("ambpf");
        for watched in [
            None,
            Some(&PRESENT),
            Some(&DELETING),
            Some(&Lookup::NotFound),
        ] {
            // The read at shutdown wins over what the watch saw: a DaemonSet
            // deleted and created again is the one whose pod takes over.
            assert_eq!(
                decide(&pod, Some(&PRESENT), watched),
                ShutdownAction::Keep {
                    daemonset: "ambpf".into()
                },
                "{watched:?}"
            );
        }
    }

    #[test]
    fn the_plugin_goes_with_the_daemonset() {
        let pod = pod_of("ambpf");
        let action = decide(&pod, Some(&Lookup::NotFound), Some(&PRESENT));
        assert_eq!(
            action,
            ShutdownAction::Remove {
                why: "DaemonSet ambpf is gone".into()
            }
        );
        let action = decide(&pod, Some(&DELETING), None);
        assert_eq!(
            action,
            ShutdownAction::Remove {
                why: "DaemonSet ambpf is being deleted".into()
            }
        );
        // helm uninstall: the RBAC went right after the DaemonSet, so the
        // read is refused, but the watch saw the deletion.
        for watched in [&Lookup::NotFound, &DELETING] {
            let action = decide(&pod, Some(&failed("RBAC denies")), Some(watched));
            let ShutdownAction::Remove { why } = action else {
                panic!("{action:?}")
            };
            assert!(
                why.starts_with("the watch saw DaemonSet ambpf") && why.contains("RBAC denies"),
                "{why}"
            );
        }
    }

    #[test]
    fn the_plugin_stays_when_it_cannot_be_told() {
        let pod = pod_of("ambpf");
        // The read fails and the watch saw the DaemonSet there, or nothing.
        for watched in [None, Some(&PRESENT)] {
            let action = decide(&pod, Some(&failed("connection refused")), watched);
            assert_eq!(
                action,
                ShutdownAction::Undecided {
                    why: "cannot read DaemonSet ambpf: reading it now failed: connection refused"
                        .into()
                }
            );
        }
        assert!(is_kept(&decide(&pod, None, None)));
        // Without the DaemonSet's name nothing the watch saw applies.
        for own in [
            Lookup::Failed("timeout".into()),
            Lookup::NotFound,
            Lookup::Found(OwnPod { daemonset: None }),
        ] {
            for read in [None, Some(&Lookup::NotFound), Some(&DELETING)] {
                let action = decide(&own, read, Some(&Lookup::NotFound));
                assert!(
                    matches!(action, ShutdownAction::Undecided { .. }),
                    "{own:?} {read:?}: {action:?}"
                );
            }
        }
        let ShutdownAction::Undecided { why } = decide(&Lookup::Failed("403".into()), None, None)
        else {
            unreachable!()
        };
        assert_eq!(why, "cannot read this pod: 403");
    }
}
