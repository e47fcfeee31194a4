//! `ambpf cni-install`: chain the plugin, keep it chained, and decide at
//! shutdown whether to leave it (an upgrade) or remove it (an uninstall).

use anyhow::{Context as _, Result};
use tracing::info;

use super::{CniInstallArgs, run::shutdown_signal};
use crate::sources;

pub(super) fn cni_install(args: CniInstallArgs) -> Result<()> {
    use crate::cni::install::{InstallConfig, Installed, install_once, install_then_keep};
    let owner = args.owner_lookup();
    let plugin_binary = match args.plugin_binary {
        Some(path) => path,
        None => std::env::current_exe()?
            .parent()
            .context("locating the ambpf-cni binary")?
            .join(crate::cni::PLUGIN_TYPE),
    };
    let config = InstallConfig {
        conf_dir: args.conf_dir,
        bin_dir: args.bin_dir,
        plugin_binary: Some(plugin_binary),
        agent_socket: args.agent_socket,
        agent_timeout_seconds: args.agent_timeout,
    };
    let chained = |done: &Installed| {
        println!(
            "ambpf-cni chained in {} (conflist changed: {}, binary changed: {})",
            done.conflist.display(),
            done.conflist_changed,
            done.binary_changed
        )
    };
    let Some(every) = args.watch else {
        chained(&install_once(&config)?);
        return Ok(());
    };
    let every = std::time::Duration::try_from_secs_f64(every).context("--watch")?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            // Listening first: a signal from here on gets the decision below.
            let shutdown = shutdown_signal()?;
            let owner = match owner {
                Ok((kubeconfig, pod)) => match sources::kube::client(kubeconfig.as_deref()).await {
                    Ok(client) => Ok(crate::cni::shutdown::OwnerWatch::start(client, pod)),
                    Err(e) => Err(e.to_string()),
                },
                Err(why) => Err(why),
            };
            match &owner {
                Ok(_) => info!(
                    "on shutdown ambpf-cni stays chained if this pod's DaemonSet is still \
                     there, and is removed if it is gone or being deleted"
                ),
                Err(why) => tracing::warn!("on shutdown ambpf-cni will stay chained: {why}"),
            }
            tokio::select! {
                () = install_then_keep(config.clone(), every, chained) => {}
                () = shutdown => {}
            }
            let action = match owner {
                Ok(watch) => watch.decide(crate::cni::shutdown::LOOKUP_TIMEOUT).await,
                Err(why) => crate::cni::shutdown::ShutdownAction::Undecided { why },
            };
            on_shutdown(action, &config)
        })
}

/// Leaves the plugin chained or removes it, as `action` says.
fn on_shutdown(
    action: crate::cni::shutdown::ShutdownAction,
    config: &crate::cni::install::InstallConfig,
) -> Result<()> {
    use crate::cni::shutdown::ShutdownAction;
    let (conf_dir, bin_dir) = (config.conf_dir.display(), config.bin_dir.display());
    let by_hand = format!(
        "run `ambpf uninstall --cni-conf-dir {conf_dir} --cni-bin-dir \
         {bin_dir}` on the node (which also removes the rest of ambpf's node state), or delete \
         the plugin of type {plugin} from the *.conflist in {conf_dir} and {bin_dir}/{plugin}",
        plugin = crate::cni::PLUGIN_TYPE
    );
    match action {
        ShutdownAction::Keep { daemonset } => {
            info!(
                "stopping: DaemonSet {daemonset} is still there and not being deleted (an upgrade \
                 or a restart): ambpf-cni stays chained for its next pod"
            );
            Ok(())
        }
        ShutdownAction::Undecided { why } => {
            tracing::warn!(
                "stopping: ambpf-cni stays chained in {conf_dir}, since it cannot be told whether \
                 ambpf is being removed from this node: {why}. While no ambpf agent runs, new pods \
                 on this node fail to start. If ambpf is being removed, {by_hand}"
            );
            Ok(())
        }
        ShutdownAction::Remove { why } => {
            info!("stopping: {why}: ambpf is being uninstalled, removing ambpf-cni");
            let done = crate::cni::install::uninstall(&config.conf_dir, &config.bin_dir);
            for list in &done.unchained {
                info!("un-chained ambpf-cni from {}", list.display());
            }
            if let Some(binary) = &done.binary_removed {
                info!("removed {}", binary.display());
            }
            if done.errors.is_empty() {
                return Ok(());
            }
            for error in &done.errors {
                tracing::error!("removing ambpf-cni: {error}");
            }
            anyhow::bail!("ambpf-cni could not be removed completely: {by_hand}")
        }
    }
}
