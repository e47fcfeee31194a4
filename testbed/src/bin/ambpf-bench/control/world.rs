//! What one `control` measurement runs against: a fresh node, its pods
//! (namespace, kubelet-named cgroup, process) and the API server, and the
//! agent spawned with the Kubernetes source.

use std::{ffi::OsStr, io::Write as _, net::IpAddr, process::Child};

use ambpf_testbed::apiserver::ApiServer;
use serde_json::{Value, json};

use super::*;

/// What one measurement runs against, made fresh for each: a node with `n`
/// pods (namespaces, cgroups, processes) and an API server on the node's
/// loopback holding the ambient namespaces.
pub(super) struct World {
    // Field order is drop order: the pods' processes and the server before
    // the namespaces.
    pub(super) pods: Vec<BenchPod>,
    server: ApiServer,
    _api_runtime: OwnRuntime,
    kubeconfig: PathBuf,
    _kubeconfig_dir: TempDir,
    _pods_cgroup: CgroupGuard,
    cluster: Cluster,
}

impl World {
    pub(super) async fn create(n: usize) -> Result<Self> {
        let created = Instant::now();
        let cluster = Cluster::create(n as u16).context("creating the pod namespaces")?;
        let pods_cgroup = CgroupGuard::create().context("creating the pods' cgroup")?;
        let pods: Vec<BenchPod> = cluster
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| BenchPod::start(i, &p.ns.path(), p.ips(), pods_cgroup.path()))
            .collect::<Result<_>>()
            .context("starting the pods' processes")?;
        // The API server listens on the node namespace's loopback, where the
        // agent runs; the bench drives it in-process.
        let (api_runtime, failed) = named_runtime("apiserver", 1, Some(&cluster.node.path()))?;
        let server = api_runtime
            .spawn(ApiServer::start())
            .await?
            .context("starting the API server")?;
        ensure!(
            !failed.load(std::sync::atomic::Ordering::SeqCst),
            "the API server's thread could not enter the node namespace"
        );
        let kubeconfig_dir = TempDir::create("ambpf-bench-kubeconfig")?;
        let kubeconfig = kubeconfig_dir.join("kubeconfig");
        std::fs::write(&kubeconfig, server.kubeconfig())?;
        for i in 0..NAMESPACES {
            server.apply("namespaces", namespace_object(i));
        }
        eprintln!(
            "control: {n} pods (namespace, cgroup, process) and the API server in {:.1} s",
            created.elapsed().as_secs_f64()
        );
        Ok(Self {
            pods,
            server,
            _api_runtime: api_runtime,
            kubeconfig,
            _kubeconfig_dir: kubeconfig_dir,
            _pods_cgroup: pods_cgroup,
            cluster,
        })
    }

    pub(super) fn env<'a>(
        &'a self,
        agent: &'a Path,
        work: &'a TempDir,
        cgroup: &'a CgroupGuard,
    ) -> Env<'a> {
        Env {
            agent,
            work,
            cgroup,
            cluster: &self.cluster,
            server: &self.server,
            kubeconfig: &self.kubeconfig,
        }
    }
}

pub(super) struct Env<'a> {
    pub(super) agent: &'a Path,
    pub(super) work: &'a TempDir,
    pub(super) cgroup: &'a CgroupGuard,
    pub(super) cluster: &'a Cluster,
    pub(super) server: &'a ApiServer,
    pub(super) kubeconfig: &'a Path,
}

// ---------------------------------------------------------------------------
// Pods

/// A pod: its object's identity and a `sleep` in its namespace and cgroup.
pub(super) struct BenchPod {
    pub(super) uid: String,
    pub(super) name: String,
    pub(super) namespace: String,
    pub(super) ips: [IpAddr; 2],
    pub(super) child: Child,
    pub(super) cgroup: PathBuf,
}

impl BenchPod {
    fn start(i: usize, netns: &Path, ips: [IpAddr; 2], parent_cgroup: &Path) -> Result<Self> {
        let uid = format!("c0c0c0c0-0000-4000-8000-{i:012x}");
        let cgroup = parent_cgroup.join(format!(
            "kubepods-besteffort-pod{}.slice",
            uid.replace('-', "_")
        ));
        std::fs::create_dir(&cgroup)?;
        let spawned = (|| {
            let procs = std::fs::OpenOptions::new()
                .write(true)
                .open(cgroup.join("cgroup.procs"))?;
            let ns = File::open(netns)?;
            let mut command = Command::new("sleep");
            command
                .arg("infinity")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            // SAFETY: setns and write are async-signal-safe; `ns` and
            // `procs` outlive the spawn.
            unsafe {
                command.pre_exec(move || {
                    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
                    // "0" moves the writing process (the child) into the cgroup.
                    (&procs).write_all(b"0")
                });
            }
            command.spawn()
        })();
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_dir(&cgroup);
                return Err(e.into());
            }
        };
        Ok(Self {
            uid,
            name: format!("bench-{i:04}"),
            namespace: namespace_name(i % NAMESPACES),
            ips,
            child,
            cgroup,
        })
    }

    pub(super) fn object(&self) -> Value {
        let [v4, v6] = self.ips;
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "labels": { "app": self.name },
            },
            "spec": {
                "nodeName": NODE,
                "serviceAccountName": "bench-workload",
                "containers": [{ "name": "app" }],
            },
            "status": {
                "phase": "Running",
                "podIP": v4.to_string(),
                "podIPs": [{ "ip": v4.to_string() }, { "ip": v6.to_string() }],
            },
        })
    }
}

impl Drop for BenchPod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The cgroup may take a moment to notice its last process is gone.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!("bench: cannot remove {}", self.cgroup.display());
    }
}

pub(super) fn namespace_name(i: usize) -> String {
    format!("bench-ambient-{i}")
}

pub(super) fn namespace_object(i: usize) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": namespace_name(i),
            "labels": { "istio.io/dataplane-mode": "ambient" },
        },
    })
}

/// Whether a recorded patch sets the redirection annotation to `enabled`.
pub(super) fn enables_redirection(body: &Value) -> bool {
    body["metadata"]["annotations"][ANNOTATION].as_str() == Some("enabled")
}

/// Which pods (by name) have had their annotation enabled, from the
/// server's patches from index `from` on.
pub(super) fn annotated_since(server: &ApiServer, from: usize) -> Vec<String> {
    server
        .patches()
        .into_iter()
        .skip(from)
        .filter(|p| p.resource == "pods/status" && enables_redirection(&p.body))
        .map(|p| p.name)
        .collect()
}

// ---------------------------------------------------------------------------
// The agent with the kube source

/// The agent with the Kubernetes source, spawned in the node's namespace.
pub(super) fn spawn_kube_agent(
    env: &Env<'_>,
    mode: Mode,
    socket: &Path,
    log: &Path,
) -> Result<Agent> {
    let source = [
        OsStr::new("--pod-source"),
        OsStr::new("kube"),
        OsStr::new("--node-name"),
        OsStr::new(NODE),
        OsStr::new("--kubeconfig"),
        env.kubeconfig.as_os_str(),
    ];
    Agent::spawn(
        env.agent,
        mode,
        &env.cluster.node,
        &source,
        socket,
        env.cgroup.path(),
        log,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_enabling_patches_count() {
        assert!(enables_redirection(
            &json!({ "metadata": { "annotations": { ANNOTATION: "enabled" } } })
        ));
        assert!(!enables_redirection(
            &json!({ "metadata": { "annotations": { ANNOTATION: null } } })
        ));
        assert!(!enables_redirection(&json!({ "status": {} })));
    }
}
