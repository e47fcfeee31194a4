//! What the soak runs against: a testbed node with pod slots, the test API
//! server on the node's loopback, and the pods themselves.
//!
//! A slot is one of the [`Cluster`]'s pod namespaces with its addresses. A
//! pod occupies a slot: an object in the API server, two `sleep`s in the slot's
//! namespace inside a cgroup named as the kubelet's systemd driver names a
//! pod's (so the agent's `/proc` scan finds it by UID; the first is the
//! sandbox's, kept through container restarts), and an echo server
//! on [`APP_PORT`] in the namespace (the app, target of inbound connections).
//! Deleting a pod tears its network down and gives the slot a fresh
//! namespace with the same addresses, as a node's IPAM reuses them.

use std::{
    io::Write as _,
    net::SocketAddr,
    os::{fd::AsFd, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::{CgroupGuard, apiserver::ApiServer, cluster::Cluster};

pub const NODE: &str = "soak-node";
/// Pods are spread over this many namespaces, some ambient, some not.
pub const NAMESPACES: usize = 4;
/// Each pod's echo server (inbound connections end here).
pub const APP_PORT: u16 = 8080;
/// The off-node echo server (outbound connections end here).
pub const REMOTE_PORT: u16 = 9000;
pub const MODE_LABEL: &str = "istio.io/dataplane-mode";
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";

/// A pod's own `istio.io/dataplane-mode` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodLabel {
    /// No label: its namespace decides.
    Inherit,
    Ambient,
    /// `none`: opted out whatever the namespace says.
    OptOut,
}

/// A pod in a slot.
pub struct Pod {
    pub uid: String,
    pub name: String,
    pub namespace: usize,
    pub label: PodLabel,
    pub netns_inode: u64,
    /// The object carries its IPs (what makes the kube source enrol it; a
    /// CNI-added pod is enrolled before that).
    pub listed: bool,
    /// CNI ADD enrolled it (it must be held from then on).
    pub cni_added: bool,
    /// It has been ambient: the agent keeps its reply routing while it
    /// lives (see `netstate::only_reply_routing`).
    pub ever_ambient: bool,
    pub conns: Option<super::conns::PodConns>,
    /// The sandbox's process (the oldest, as a pause container is): it
    /// holds on through container restarts.
    pause: Child,
    /// The container's process, replaced on a restart.
    process: Child,
    cgroup: PathBuf,
    _app: super::conns::Task,
}

impl Pod {
    /// Replaces the container's process (a container restart: same sandbox,
    /// namespace and cgroup, a new process).
    pub fn restart_process(&mut self, netns: &Path) -> Result<()> {
        let _ = self.process.kill();
        let _ = self.process.wait();
        self.process = spawn_in(netns, &self.cgroup)?;
        Ok(())
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for process in [&mut self.process, &mut self.pause] {
            let _ = process.kill();
            let _ = process.wait();
        }
        // The cgroup may take a moment to notice its last process is gone.
        for _ in 0..200 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!("soak: cannot remove {}", self.cgroup.display());
    }
}

/// A pod whose namespace vanished (sandbox torn down) before its object was
/// deleted.
pub struct Ghost {
    pub uid: String,
    pub name: String,
    pub namespace: usize,
    pub netns_inode: u64,
}

#[derive(Default)]
pub struct Slot {
    pub pod: Option<Pod>,
    pub ghost: Option<Ghost>,
}

impl Slot {
    pub fn is_free(&self) -> bool {
        self.pod.is_none() && self.ghost.is_none()
    }
}

pub struct World {
    // Field order is drop order: pods' processes before their cgroups'
    // parent and the namespaces.
    pub slots: Vec<Slot>,
    pub ns_ambient: [bool; NAMESPACES],
    /// When each namespace last stopped being ambient (see
    /// [`World::may_look_ambient`]).
    ns_left_ambient: [Option<Instant>; NAMESPACES],
    pub api: ApiServer,
    pub kubeconfig: PathBuf,
    pods_cgroup: CgroupGuard,
    pub cluster: Cluster,
    next_uid: u64,
    _remote_echo: super::conns::Task,
}

pub fn namespace_name(i: usize) -> String {
    format!("soak-{i}")
}

impl World {
    pub async fn create(pods: usize, dir: &Path) -> Result<Self> {
        let cluster = Cluster::create(pods as u16).context("creating the pod namespaces")?;
        let pods_cgroup = CgroupGuard::create().context("creating the pods' cgroup")?;
        let api = ApiServer::start_in(&cluster.node.path())
            .await
            .context("starting the API server")?;
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig())?;
        // The last namespace starts out not ambient.
        let ns_ambient = std::array::from_fn(|i| i + 1 < NAMESPACES);
        for (i, ambient) in ns_ambient.iter().enumerate() {
            api.apply("namespaces", namespace_object(i, *ambient));
        }
        let remote_echo = super::conns::serve_echo(
            &cluster.remote.ns,
            SocketAddr::from(([0u16; 8], REMOTE_PORT)),
        )?;
        Ok(Self {
            slots: (0..pods).map(|_| Slot::default()).collect(),
            ns_ambient,
            ns_left_ambient: [None; NAMESPACES],
            api,
            kubeconfig,
            pods_cgroup,
            cluster,
            next_uid: 0,
            _remote_echo: remote_echo,
        })
    }

    pub fn is_ambient(&self, pod: &Pod) -> bool {
        is_ambient(&self.ns_ambient, pod)
    }

    /// Whether the agent may rightly see `pod` as ambient now although it
    /// is not: its namespace stopped being ambient within
    /// [`STALE_NAMESPACE_VIEW`]. The agent watches pods and namespaces in
    /// two streams, so it may combine a pod's new state with its
    /// namespace's old one for a moment (as Istio's node agent may), longer
    /// after an API server outage, when the two lists come back one after
    /// the other. Such a pod may be enrolled briefly, and keeps its reply
    /// routing as any pod that left the mesh alive does.
    pub fn may_look_ambient(&self, pod: &Pod) -> bool {
        pod.label == PodLabel::Inherit
            && self.ns_left_ambient[pod.namespace]
                .is_some_and(|left| left.elapsed() < STALE_NAMESPACE_VIEW)
    }

    pub fn netns_path(&self, slot: usize) -> PathBuf {
        self.cluster.pods[slot].ns.path()
    }

    /// Starts a pod in free slot `slot` (process, cgroup, app) and returns
    /// it; its object is not applied yet.
    pub fn new_pod(&mut self, slot: usize, namespace: usize, label: PodLabel) -> Result<Pod> {
        self.next_uid += 1;
        let uid = format!("50a50a50-0000-4000-8000-{:012x}", self.next_uid);
        let cgroup = self.pods_cgroup.path().join(format!(
            "kubepods-besteffort-pod{}.slice",
            uid.replace('-', "_")
        ));
        std::fs::create_dir(&cgroup)?;
        let ns = &self.cluster.pods[slot].ns;
        let spawned = spawn_in(&ns.path(), &cgroup).and_then(|mut pause| {
            match spawn_in(&ns.path(), &cgroup) {
                Ok(process) => Ok((pause, process)),
                Err(e) => {
                    let _ = pause.kill();
                    let _ = pause.wait();
                    Err(e)
                }
            }
        });
        let (pause, process) = match spawned {
            Ok(both) => both,
            Err(e) => {
                let _ = std::fs::remove_dir(&cgroup);
                return Err(e);
            }
        };
        let app = super::conns::serve_echo(ns, SocketAddr::from(([0u16; 8], APP_PORT)));
        Ok(Pod {
            uid,
            name: format!("app-{}", self.next_uid),
            namespace,
            label,
            netns_inode: ns.inode()?,
            listed: false,
            cni_added: false,
            ever_ambient: false,
            conns: None,
            pause,
            process,
            cgroup,
            _app: app?,
        })
    }

    /// The pod's object; with `listed`, Running with its IPs, else Pending.
    pub fn pod_object(&self, slot: usize, pod: &Pod) -> Value {
        let mut labels = json!({ "app": pod.name });
        match pod.label {
            PodLabel::Inherit => {}
            PodLabel::Ambient => labels[MODE_LABEL] = json!("ambient"),
            PodLabel::OptOut => labels[MODE_LABEL] = json!("none"),
        }
        let status = if pod.listed {
            let [v4, v6] = self.cluster.pods[slot].ips();
            json!({
                "phase": "Running",
                "podIP": v4.to_string(),
                "podIPs": [{ "ip": v4.to_string() }, { "ip": v6.to_string() }],
            })
        } else {
            json!({ "phase": "Pending" })
        };
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": namespace_name(pod.namespace),
                "uid": pod.uid,
                "labels": labels,
            },
            "spec": {
                "nodeName": NODE,
                "serviceAccountName": "soak-workload",
                "containers": [{ "name": "app" }],
            },
            "status": status,
        })
    }

    /// Applies the pod's object, keeping what the agent patched onto it
    /// (its annotations), as a kubelet's status update does.
    pub fn apply_pod(&self, slot: usize, pod: &Pod) {
        let mut object = self.pod_object(slot, pod);
        if let Some(old) = self
            .api
            .object("pods", &namespace_name(pod.namespace), &pod.name)
            && let Some(annotations) = old["metadata"].get("annotations")
        {
            object["metadata"]["annotations"] = annotations.clone();
        }
        self.api.apply("pods", object);
    }

    pub fn delete_object(&self, namespace: usize, name: &str) {
        self.api.delete("pods", &namespace_name(namespace), name);
    }

    pub fn set_namespace_ambient(&mut self, i: usize, ambient: bool) {
        if self.ns_ambient[i] && !ambient {
            self.ns_left_ambient[i] = Some(Instant::now());
        }
        self.ns_ambient[i] = ambient;
        self.api.apply("namespaces", namespace_object(i, ambient));
    }

    /// Tears pod `slot`'s network down and gives the slot a fresh namespace
    /// with the same addresses.
    pub fn recycle(&mut self, slot: usize) -> Result<()> {
        self.cluster
            .recycle_pod(slot)
            .with_context(|| format!("recycling slot {slot}"))
    }

    /// The redirection annotation on a pod's stored object.
    pub fn annotation(&self, namespace: usize, name: &str) -> Option<String> {
        self.api
            .object("pods", &namespace_name(namespace), name)?
            .pointer(&format!(
                "/metadata/annotations/{}",
                REDIRECTION_ANNOTATION.replace('/', "~1")
            ))?
            .as_str()
            .map(str::to_owned)
    }
}

/// How long after a namespace stops being ambient the agent may still act
/// on its old label (see [`World::may_look_ambient`]).
const STALE_NAMESPACE_VIEW: Duration = Duration::from_secs(10);

/// Istio's rule: the pod's own label, else its namespace's.
pub fn is_ambient(ns_ambient: &[bool; NAMESPACES], pod: &Pod) -> bool {
    match pod.label {
        PodLabel::OptOut => false,
        PodLabel::Ambient => true,
        PodLabel::Inherit => ns_ambient[pod.namespace],
    }
}

fn namespace_object(i: usize, ambient: bool) -> Value {
    let labels = if ambient {
        json!({ MODE_LABEL: "ambient" })
    } else {
        json!({ "team": "soak" })
    };
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": namespace_name(i), "labels": labels },
    })
}

/// `sleep infinity` in the namespace at `netns`, inside `cgroup`.
fn spawn_in(netns: &Path, cgroup: &Path) -> Result<Child> {
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(cgroup.join("cgroup.procs"))?;
    let ns = std::fs::File::open(netns)?;
    let mut command = Command::new("sleep");
    command
        .arg("infinity")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setns and write are async-signal-safe; `ns` and `procs`
    // outlive the spawn.
    unsafe {
        command.pre_exec(move || {
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
            // "0" moves the writing process (the child) into the cgroup.
            (&procs).write_all(b"0")
        });
    }
    Ok(command.spawn()?)
}
