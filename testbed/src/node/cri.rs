//! A CRI client for the node's containerd, making the calls kubelet makes
//! to start and stop a pod.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    self as cri, image_service_client::ImageServiceClient,
    runtime_service_client::RuntimeServiceClient,
};
use serde_json::{Value, json};
use tonic::{
    Status,
    transport::{Channel, Endpoint, Uri},
};

use super::image::IMAGE;

/// A pod as kubelet describes it to the runtime, and as the API server has it.
#[derive(Clone, Debug)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub labels: BTreeMap<String, String>,
}

impl PodSpec {
    /// A pod with a UID (a version-4-shaped UUID) no other pod on this
    /// machine has: the process ID, a sequence number and the clock.
    pub fn new(namespace: &str, name: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let sequence = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: format!(
                "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
                std::process::id(),
                sequence & 0xffff,
                (sequence >> 16) & 0xfff,
                (nanos >> 48) & 0xfff,
                nanos & 0xffff_ffff_ffff,
            ),
            labels: BTreeMap::from([("app".to_owned(), name.to_owned())]),
        }
    }

    /// The pod object of `node_name` as the API server has it while the
    /// pod's sandbox starts (no IP yet).
    pub fn object(&self, node_name: &str) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name, "namespace": self.namespace, "uid": self.uid,
                "labels": self.labels,
            },
            "spec": {
                "nodeName": node_name, "serviceAccountName": "default",
                "containers": [{ "name": "app", "image": IMAGE }],
            },
            "status": { "phase": "Pending" },
        })
    }
}

/// A namespace object, labelled `istio.io/dataplane-mode=ambient` or not.
pub fn namespace_object(name: &str, ambient: bool) -> Value {
    let labels = if ambient {
        json!({ "istio.io/dataplane-mode": "ambient" })
    } else {
        json!({ "team": "x" })
    };
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name, "labels": labels } })
}

/// A started pod: its sandbox and app container.
#[derive(Clone, Debug)]
pub struct RunningPod {
    pub sandbox_id: String,
    pub container_id: String,
    /// The address the CNI plugins gave the sandbox.
    pub ip: String,
}

/// A connection to the node's CRI services.
#[derive(Clone)]
pub struct Cri {
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    /// The node's cgroup (cgroupfs syntax), parent of every pod's.
    cgroup_root: String,
    log_root: PathBuf,
}

/// kubelet's default for its runtime calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

impl Cri {
    /// Connects to `socket`. Pods' cgroups go under `cgroup_root`, their
    /// logs under `log_root`.
    pub async fn connect(
        socket: PathBuf,
        cgroup_root: String,
        log_root: PathBuf,
    ) -> Result<Self, tonic::transport::Error> {
        // The URI is required and ignored: every connection is to `socket`.
        let channel = Endpoint::from_static("http://localhost")
            .timeout(CALL_TIMEOUT)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(socket).await?,
                    ))
                }
            }))
            .await?;
        Ok(Self {
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            cgroup_root,
            log_root,
        })
    }

    /// The runtime's name and version.
    pub async fn version(&self) -> Result<cri::VersionResponse, Status> {
        let request = cri::VersionRequest::default();
        Ok(self.runtime.clone().version(request).await?.into_inner())
    }

    /// The image references the runtime has.
    pub async fn images(&self) -> Result<Vec<String>, Status> {
        let request = cri::ListImagesRequest::default();
        let images = self.images.clone().list_images(request).await?.into_inner();
        Ok(images
            .images
            .into_iter()
            .flat_map(|image| image.repo_tags)
            .collect())
    }

    /// kubelet's cgroup parent for a best-effort pod.
    pub fn cgroup_parent(&self, pod: &PodSpec) -> String {
        format!("{}/kubepods/besteffort/pod{}", self.cgroup_root, pod.uid)
    }

    fn sandbox_config(&self, pod: &PodSpec) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: pod.name.clone(),
                uid: pod.uid.clone(),
                namespace: pod.namespace.clone(),
                attempt: 0,
            }),
            hostname: pod.name.clone(),
            log_directory: self.log_root.join(&pod.uid).display().to_string(),
            labels: pod
                .labels
                .clone()
                .into_iter()
                .chain([
                    ("io.kubernetes.pod.name".to_owned(), pod.name.clone()),
                    (
                        "io.kubernetes.pod.namespace".to_owned(),
                        pod.namespace.clone(),
                    ),
                    ("io.kubernetes.pod.uid".to_owned(), pod.uid.clone()),
                ])
                .collect(),
            linux: Some(cri::LinuxPodSandboxConfig {
                cgroup_parent: self.cgroup_parent(pod),
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption::default()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// RunPodSandbox: the sandbox, its network namespace and the CNI ADD.
    /// The error is the runtime's, which carries the CNI plugins' own.
    pub async fn run_sandbox(&self, pod: &PodSpec) -> Result<String, Status> {
        let request = cri::RunPodSandboxRequest {
            config: Some(self.sandbox_config(pod)),
            runtime_handler: String::new(),
        };
        let reply = self.runtime.clone().run_pod_sandbox(request).await?;
        Ok(reply.into_inner().pod_sandbox_id)
    }

    /// CreateContainer then StartContainer: the app, running `command` in
    /// the busybox image.
    pub async fn start_container(
        &self,
        pod: &PodSpec,
        sandbox_id: &str,
        name: &str,
        attempt: u32,
        command: &[&str],
    ) -> Result<String, Status> {
        let request = cri::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
            config: Some(cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: name.to_owned(),
                    attempt,
                }),
                image: Some(cri::ImageSpec {
                    image: IMAGE.to_owned(),
                    ..Default::default()
                }),
                command: command.iter().map(|s| (*s).to_owned()).collect(),
                log_path: format!("{name}/{attempt}.log"),
                linux: Some(cri::LinuxContainerConfig::default()),
                ..Default::default()
            }),
            sandbox_config: Some(self.sandbox_config(pod)),
        };
        let mut runtime = self.runtime.clone();
        let id = runtime
            .create_container(request)
            .await?
            .into_inner()
            .container_id;
        let start = cri::StartContainerRequest {
            container_id: id.clone(),
        };
        runtime.start_container(start).await?;
        Ok(id)
    }

    /// RunPodSandbox, then the app container, as kubelet starts a pod.
    pub async fn start_pod(&self, pod: &PodSpec, command: &[&str]) -> Result<RunningPod, Status> {
        let sandbox_id = self.run_sandbox(pod).await?;
        let container_id = self
            .start_container(pod, &sandbox_id, "app", 0, command)
            .await?;
        let ip = self.sandbox_ip(&sandbox_id).await?;
        Ok(RunningPod {
            sandbox_id,
            container_id,
            ip,
        })
    }

    /// The sandbox's IP, from its status.
    pub async fn sandbox_ip(&self, sandbox_id: &str) -> Result<String, Status> {
        let request = cri::PodSandboxStatusRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
            verbose: false,
        };
        let status = self.runtime.clone().pod_sandbox_status(request).await?;
        Ok(status
            .into_inner()
            .status
            .and_then(|s| s.network)
            .map(|n| n.ip)
            .unwrap_or_default())
    }

    /// The container's state (`CONTAINER_RUNNING`, `CONTAINER_EXITED`, ...).
    pub async fn container_state(&self, container_id: &str) -> Result<cri::ContainerState, Status> {
        let request = cri::ContainerStatusRequest {
            container_id: container_id.to_owned(),
            verbose: false,
        };
        let status = self.runtime.clone().container_status(request).await?;
        let state = status
            .into_inner()
            .status
            .map(|s| s.state)
            .unwrap_or_default();
        Ok(cri::ContainerState::try_from(state).unwrap_or(cri::ContainerState::ContainerUnknown))
    }

    /// StopContainer (no grace period), then RemoveContainer.
    pub async fn remove_container(&self, container_id: &str) -> Result<(), Status> {
        let mut runtime = self.runtime.clone();
        let stop = cri::StopContainerRequest {
            container_id: container_id.to_owned(),
            timeout: 0,
        };
        runtime.stop_container(stop).await?;
        let remove = cri::RemoveContainerRequest {
            container_id: container_id.to_owned(),
        };
        runtime.remove_container(remove).await?;
        Ok(())
    }

    /// StopPodSandbox (its containers, then CNI DEL), then RemovePodSandbox,
    /// as kubelet removes a pod.
    pub async fn remove_pod(&self, sandbox_id: &str) -> Result<(), Status> {
        let mut runtime = self.runtime.clone();
        let stop = cri::StopPodSandboxRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
        };
        runtime.stop_pod_sandbox(stop).await?;
        let remove = cri::RemovePodSandboxRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
        };
        runtime.remove_pod_sandbox(remove).await?;
        Ok(())
    }

    /// The IDs of every sandbox the runtime has.
    pub async fn sandboxes(&self) -> Result<Vec<String>, Status> {
        let request = cri::ListPodSandboxRequest::default();
        let list = self.runtime.clone().list_pod_sandbox(request).await?;
        Ok(list.into_inner().items.into_iter().map(|s| s.id).collect())
    }
}
