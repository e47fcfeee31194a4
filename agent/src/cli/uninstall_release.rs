//! `ambpf uninstall-release`: the chart's `pre-delete` hook.
//!
//! `helm uninstall` deletes the DaemonSet and, in the same breath, the
//! agents' ServiceAccount and RBAC; the kubelet stops each agent only
//! later, so an agent's own uninstall would find itself unable to clear the
//! `ambient.istio.io/redirection` annotation of its node's pods. Helm runs
//! this hook, and waits for it, before it deletes anything of the release:
//! it deletes the DaemonSet in the foreground (the object stays, marked for
//! deletion, which each agent reads as an uninstall, until the garbage
//! collector has deleted every agent pod, and a pod is gone only once its
//! agent has finished) and waits for it to be gone, so every agent
//! uninstalls with its credentials still valid.
//!
//! An agent that does not finish in time (a node down) is reported and
//! left: the uninstall goes on, as it would without the hook.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use clap::Args;
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::{
    Api,
    api::{DeleteParams, PropagationPolicy},
};
use tracing::{info, warn};

use crate::sources::kube::api_error;

#[derive(Debug, Args)]
pub struct UninstallReleaseArgs {
    /// The release's namespace.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: String,
    /// The agents' DaemonSet.
    #[arg(long)]
    pub daemonset: String,
    /// How long the agents may take to uninstall, in seconds.
    #[arg(long, default_value_t = 240)]
    pub timeout_secs: u64,
    /// The kubeconfig (default: the in-cluster service account).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
}

/// How often the DaemonSet is read while its agents finish.
const POLL: Duration = Duration::from_secs(1);

pub fn uninstall_release(args: UninstallReleaseArgs) -> Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: UninstallReleaseArgs) -> Result<()> {
    let client = crate::sources::kube::client(args.kubeconfig.as_deref()).await?;
    let daemonsets: Api<DaemonSet> = Api::namespaced(client, &args.namespace);
    let name = format!("{}/{}", args.namespace, args.daemonset);
    let foreground = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..DeleteParams::default()
    };
    match daemonsets.delete(&args.daemonset, &foreground).await {
        Ok(_) => info!("DaemonSet {name}: deleting; waiting for every agent to uninstall"),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            info!("DaemonSet {name}: already gone");
            return Ok(());
        }
        Err(e) => {
            return Err(api_error("delete", "daemonsets", e))
                .with_context(|| format!("deleting DaemonSet {name}"));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut last_reported = None;
    loop {
        match daemonsets.get_opt(&args.daemonset).await {
            Ok(None) => {
                info!("DaemonSet {name}: gone; every agent has uninstalled");
                return Ok(());
            }
            Ok(Some(daemonset)) => {
                let left = daemonset
                    .status
                    .as_ref()
                    .map_or(0, |s| s.current_number_scheduled);
                if last_reported != Some(left) {
                    info!("DaemonSet {name}: {left} agent pods still uninstalling");
                    last_reported = Some(left);
                }
            }
            Err(e) => warn!("DaemonSet {name}: {}", api_error("get", "daemonsets", e)),
        }
        if Instant::now() >= deadline {
            warn!(
                "DaemonSet {name}: agents still running after {} s; the uninstall goes on \
                 without them (a node that is down keeps its annotations until \
                 `ambpf uninstall` runs there)",
                args.timeout_secs
            );
            return Ok(());
        }
        tokio::time::sleep(POLL).await;
    }
}
