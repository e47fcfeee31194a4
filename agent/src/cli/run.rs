//! `ambpf run`: the agent. Loads or adopts the dataplane, serves ZDS and
//! the CNI endpoint, and follows the pod source until SIGTERM.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use tracing::info;

use super::{PodSource, RunArgs, parse_attach};
use crate::{
    bpf::{self, Dataplane, PinLayout},
    controller::{Controller, SourcePods},
    netns::Netns,
    observe,
    redirect::{
        PodRedirection, RedirectMode, iptables::IptablesRedirection, istio_agent::IstioRetirement,
        nftables::NftablesRedirection, podnet, retire::Retirement,
    },
    sources, zds,
};

pub(super) fn run(pins: PinLayout, args: RunArgs) -> Result<()> {
    // Validate every argument before touching the kernel.
    let pod_source = args.pod_source()?;
    // Before anything of this agent's is made there: ambpf's first start on
    // the node, whose pods another agent may have captured.
    let first_on_node = std::fs::read_dir(pins.root()).map_or(true, |mut d| d.next().is_none());
    raise_fd_limit();
    crate::memory::limit_arenas();
    let targets = args
        .attach
        .iter()
        .map(|spec| {
            let (ns, iface) = parse_attach(spec)?;
            Ok((Netns::open(ns)?, iface.to_owned()))
        })
        .collect::<Result<Vec<_>>>()?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let zds_config = zds::ZdsConfig {
        socket: args.zds_socket,
        ack_timeout: std::time::Duration::try_from_secs_f64(args.zds_ack_timeout)
            .context("--zds-ack-timeout")?,
        ..Default::default()
    };
    let state_check_interval = std::time::Duration::try_from_secs_f64(args.state_check_interval)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--state-check-interval must be a positive number of seconds")?;
    let cgroup = match args.cgroup {
        Some(path) => given_cgroup(path)?,
        None => default_cgroup()?,
    };
    let kernel_pins = (args.redirect_mode == RedirectMode::Ebpf).then(|| pins.clone());
    // An uninstall at shutdown removes this mode's state under this root.
    let (uninstall_pins, mode) = (pins.clone(), args.redirect_mode);
    let retire_pins = pins.clone();
    let capacities = bpf::Capacities::from(&args.capacities);
    capacities.validate()?;
    runtime.block_on(async move {
        // Endpoints first: a port already taken is a start-up error.
        let health = tokio::net::TcpListener::bind(args.health_listen)
            .await
            .with_context(|| format!("binding the health endpoint {}", args.health_listen))?;
        let metrics = tokio::net::TcpListener::bind(args.metrics_listen)
            .await
            .with_context(|| format!("binding the metrics endpoint {}", args.metrics_listen))?;
        let mut _pin_root_lock = None;
        let early_redirection: Option<Box<dyn PodRedirection>> = match args.redirect_mode {
            RedirectMode::Ebpf => {
                // Before anything is made, so that a refused kernel is left
                // as it was.
                bpf::features::check_kernel()?;
                bpf::inbound::choose(args.inbound_assign, &pins)?;
                // One agent writes a pin root at a time (see PinRootLock).
                pins.prepare()?;
                _pin_root_lock = Some(bpf::pins::PinRootLock::acquire(&pins)?);
                let mut dataplane =
                    Dataplane::load_inbound(pins.clone(), capacities, args.inbound_assign)?;
                info!("inbound path: {}", dataplane.inbound());
                // Loading parsed the kernel's BTF: the largest allocation
                // the agent ever makes, freed by now.
                crate::memory::release_freed();
                dataplane.forward_kernel_logs()?;
                tokio::spawn(bpf::capacity::log_misses(
                    pins.clone(),
                    dataplane.capacities(),
                    bpf::capacity::MISS_LOG_INTERVAL,
                ));
                tokio::spawn(bpf::pod_counters::log_refusals(
                    pins.clone(),
                    bpf::pod_counters::REFUSAL_LOG_INTERVAL,
                ));
                // The counters are an observation aid: without TCX they are
                // skipped, the redirection does not need them.
                match bpf::features::tcx_supported() {
                    Ok(()) => {
                        for (netns, iface) in &targets {
                            dataplane.attach_iface_counters(netns, iface)?;
                        }
                    }
                    Err(e) if !targets.is_empty() => {
                        tracing::warn!("--attach: running without the interface counters: {e}")
                    }
                    Err(_) => {}
                }
                // The agent runs in the node's network namespace (hostNetwork).
                dataplane.serve_node(
                    &cgroup,
                    args.dns_capture,
                    &podnet::host_addresses()?,
                    podnet::netns_cookie_of_current_thread()?,
                )?;
                info!(
                    "eBPF redirection ready (pin root {}, cgroup {})",
                    pins_root(&dataplane),
                    cgroup.display()
                );
                Some(Box::new(crate::redirect::EbpfRedirection::new(dataplane)))
            }
            // The rule modes write node state as they are made: after any
            // standby beside another node agent, whose own it would be.
            RedirectMode::Iptables | RedirectMode::Nftables => None,
        };
        let zds_socket = zds_config.socket.clone();
        let zds = zds::ZdsHandle::new(zds_config);
        let standby = zds::peer::Standby::default();
        if args.redirect_mode == RedirectMode::Ebpf {
            // ztunnel's marked sockets are exempt only in its own process.
            let (recorder, prune) = bpf::ztunnel_procs::recorder(pins.clone());
            zds.record_peers_with(recorder);
            tokio::spawn(prune);
        }
        let (pods_tx, pods_rx) =
            tokio::sync::watch::channel(std::sync::Arc::new(SourcePods::default()));
        let (programmed_tx, programmed_rx) =
            tokio::sync::watch::channel(std::sync::Arc::new(Default::default()));
        let mut kube_source = None;
        // Served from before the pod source starts: a wait for the API
        // server is live and says why it is not ready.
        let mut health = Some(health);
        // This pod's DaemonSet, followed to tell an uninstall at shutdown.
        let mut owner = None;
        // Without Kubernetes there is no one to ask which pods are ambient.
        let mut cni_selection = crate::cni::selection::PodSelection::Every;
        match (pod_source, args.pods_file) {
            (Some(PodSource::Local), Some(path)) => {
                sources::local::watch(path, pods_tx.clone())?;
            }
            (Some(PodSource::Kube), _) => {
                use sources::kube::{KubeSource, KubeSourceConfig};
                let (client, api_server) =
                    sources::kube::connect(args.kubeconfig.as_deref()).await?;
                owner = match (&args.pod_name, &args.pod_namespace) {
                    (Some(name), Some(namespace)) if !name.is_empty() && !namespace.is_empty() => {
                        Some(crate::cni::shutdown::OwnerWatch::start(
                            client.clone(),
                            crate::cni::shutdown::SelfPod {
                                namespace: namespace.clone(),
                                name: name.clone(),
                            },
                        ))
                    }
                    _ => None,
                };
                let mut config = KubeSourceConfig::new(args.node_name.clone().unwrap_or_default());
                config.excluded_namespaces = args
                    .excluded_namespaces
                    .into_iter()
                    .filter(|ns| !ns.is_empty())
                    .collect();
                let lookup = crate::cni::selection::AmbientLookup::new(
                    client.clone(),
                    config.excluded_namespaces.clone(),
                );
                info!(
                    "waiting for the pods of node {} from the API server",
                    config.node_name
                );
                let source = KubeSource::new(client, config)
                    .named(api_server)
                    .annotate_from(programmed_rx, zds.ztunnel_pods());
                if let Some(listener) = health.take() {
                    tokio::spawn(observe::serve_health(
                        listener,
                        zds.clone(),
                        Some(source.health()),
                        standby.clone(),
                    ));
                }
                let started = source.start(pods_tx.clone()).await?;
                // The CNI endpoint reads pods from the source's caches, and
                // through its client what they do not have yet.
                cni_selection = crate::cni::selection::PodSelection::Ambient(
                    lookup.with_caches(started.caches()),
                );
                kube_source = Some(started);
            }
            _ => tracing::warn!(
                "no pod source (give --pods-file, or run in a cluster): no pods enrol"
            ),
        }
        let cni_stats = std::sync::Arc::new(crate::cni::CniStats::default());
        if let Some(listener) = health {
            tokio::spawn(observe::serve_health(
                listener,
                zds.clone(),
                None,
                standby.clone(),
            ));
        }
        let (cni_shutdown, cni_shutdown_rx) = tokio::sync::watch::channel(false);
        let cni_endpoint = args.cni_socket.clone().map(|path| {
            Box::new((
                path,
                crate::cni::server::Endpoint {
                    // Replaced as the endpoint starts.
                    controller: tokio::sync::mpsc::channel(1).0,
                    zds: zds.clone(),
                    selection: cni_selection,
                    stats: cni_stats.clone(),
                    shutdown: cni_shutdown_rx,
                    standby: standby.clone(),
                },
            ))
        });
        let mut cni = CniEndpoint::Unstarted(cni_endpoint);
        // Another node agent serving ztunnel (Istio's, on a node moving to
        // ambpf) is waited for, the CNI endpoint admitting only the pods it
        // captured meanwhile; then its pods are taken over.
        let conf_dir = args.cni_conf_dir.as_deref();
        // Istio's agent's stopping pods: its shutdown deletes the host rules.
        let stopping = || -> Vec<String> {
            let source = pods_rx.borrow();
            source.istio_node_agents_stopping.iter().cloned().collect()
        };
        let other = zds::peer::other_agent(&zds_socket, conf_dir, &stopping())
            .inspect_err(|e| tracing::warn!("looking for another ZDS server: {e}"));
        let took_over = match other {
            Ok(None) => false,
            _ => {
                cni.start()?;
                tokio::select! {
                    stood_by = standby.wait_for_others(&zds_socket, conf_dir, &stopping) => stood_by,
                    signal = wait_for_shutdown() => {
                        signal?;
                        info!("shutting down while standing by; nothing of ambpf's is in any pod");
                        return Ok(());
                    }
                }
            }
        };
        // Istio's node agent leaves its capture in the pods when it stops:
        // looked for after a takeover, at ambpf's first start on the node,
        // or where an agent killed halfway left it.
        let taking_over_istio =
            took_over || first_on_node || IstioRetirement::under_way(retire_pins.root());
        if taking_over_istio {
            IstioRetirement::mark_under_way(retire_pins.root());
        }
        let redirection: Box<dyn PodRedirection> = match (args.redirect_mode, early_redirection) {
            (_, Some(redirection)) => redirection,
            (RedirectMode::Iptables, None) => {
                // The host side (probe SNAT) lives in the agent's own namespace.
                let host = Netns::open("/proc/self/ns/net")?;
                // Its pods are recorded under the pin root, so that a
                // restart removes the pods that left while no agent ran.
                let redirection = IptablesRedirection::new(host, args.iptables_backend)?
                    .with_records(pins.iptables_pods_dir())
                    .taking_over(crate::redirect::retire::ebpf_pods(&pins));
                info!(
                    "iptables redirection ready ({:?} backend)",
                    redirection.backend()
                );
                Box::new(redirection)
            }
            (RedirectMode::Nftables, None) => {
                // As iptables mode: the host table in the agent's namespace,
                // the pods recorded under the pin root.
                let host = Netns::open("/proc/self/ns/net")?;
                let redirection = if taking_over_istio {
                    NftablesRedirection::taking_over_istio(host)?
                } else {
                    NftablesRedirection::new(host)?
                };
                let redirection = redirection
                    .with_records(pins.nftables_pods_dir())
                    .taking_over(crate::redirect::retire::ebpf_pods(&pins));
                Box::new(redirection)
            }
            (RedirectMode::Ebpf, None) => unreachable!("the eBPF mode is made early"),
        };
        // Program every current pod before ztunnel can connect, so that its
        // first snapshot is complete (and restarts reconcile pinned state).
        let mut controller = Controller::new(redirection, zds.clone(), args.dns_capture);
        controller.set_check_interval(state_check_interval);
        if kube_source.is_some() {
            controller.report_programmed(programmed_tx);
        }
        // Served from the runtime's workers while this thread programs the
        // initial pods: liveness probes and scrapes answer through a long
        // first pass (iptables mode takes seconds per hundred pods).
        let registry = observe::registry(observe::AgentCollector {
            zds: zds.clone(),
            controller: controller.stats(),
            pins: kernel_pins,
            cni: args.cni_socket.is_some().then(|| cni_stats.clone()),
        });
        tokio::spawn(observe::serve_metrics(
            metrics,
            std::sync::Arc::new(registry),
        ));
        let host = Netns::open("/proc/self/ns/net")?;
        if taking_over_istio {
            controller.retire_istio_agent(IstioRetirement::new(mode, &host, retire_pins.root()));
        }
        // Another mode's capture left by a `helm upgrade` that changed the
        // mode stays until this mode holds each pod, then goes.
        if let Some(retirement) = Retirement::find(mode, retire_pins, host) {
            controller.retire_previous(retirement);
        }
        let first = controller.apply(&pods_rx.borrow().ambient);
        controller.check_state(crate::redirect::CheckScope::Records);
        cni.start()?;
        let (cni_server, cni_requests) = cni.into_parts();
        info!(
            "initial pods: {} enrolled, {} stale removed, {} failed",
            first.enrolled,
            first.removed,
            first.failed.len()
        );
        // The initial pod list, decoded and programmed, frees far more than
        // the agent keeps (the BTF parse was trimmed after loading).
        crate::memory::release_freed();
        tokio::spawn(crate::memory::release_freed_periodically());
        // Its own thread: passes block (namespaces entered, iptables-restore
        // run) while ZDS, the CNI endpoint and the probes must answer.
        let controller_thread = controller.spawn(pods_rx, cni_requests)?;
        let server = tokio::spawn(zds.clone().serve());
        info!("ambpf agent ready");
        tokio::select! {
            served = server => served??,
            signal = wait_for_shutdown() => signal?,
        }
        // ADDs in flight are answered, their pods abandoned through the
        // controller, before it stops.
        cni_shutdown.send_replace(true);
        if let Some(cni_server) = cni_server {
            let _ = tokio::time::timeout(CNI_DRAIN, cni_server).await;
        }
        drop(pods_tx);
        let action = match owner {
            Some(watch) => watch.decide(crate::cni::shutdown::LOOKUP_TIMEOUT).await,
            None => crate::cni::shutdown::ShutdownAction::Undecided {
                why: "not in a cluster, or POD_NAME and POD_NAMESPACE not set".to_owned(),
            },
        };
        let crate::cni::shutdown::ShutdownAction::Remove { why } = action else {
            info!("shutting down; pinned attachments stay in place");
            return Ok(());
        };
        // Istio's node agent installed (its plugin chained) takes the pods
        // over: they keep their annotations, and lose ambpf's capture only
        // once Istio's is in place.
        let istio_chained = conf_dir.map_or_else(Vec::new, |dir| {
            crate::cni::install::chaining(dir, zds::peer::ISTIO_PLUGIN_TYPE)
        });
        let handing_over = !istio_chained.is_empty();
        if handing_over {
            info!(
                "Istio's node agent is installed (its plugin is chained in {}): handing the pods \
                 over to it",
                istio_chained
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        // The controller finishes its pass and stops first (it stops once the
        // source, which holds the other sender of its pods, is gone): one
        // owner of the state at a time.
        drop(kube_source);
        let stopped = tokio::time::timeout(
            CONTROLLER_STOP,
            tokio::task::spawn_blocking(move || controller_thread.join()),
        )
        .await;
        if stopped.is_err() {
            tracing::warn!(
                "the controller did not stop within {} s; removing the node state anyway",
                CONTROLLER_STOP.as_secs()
            );
        }
        info!(
            "shutting down: {why}: ambpf is being uninstalled, removing its state from this node"
        );
        let config = crate::uninstall::UninstallConfig {
            pins: uninstall_pins,
            mode: Some(mode),
            kube: (!handing_over).then(|| crate::uninstall::KubeTarget {
                kubeconfig: args.kubeconfig,
                node_name: args.node_name.unwrap_or_default(),
            }),
            // The installer container takes the plugin out.
            cni_conf_dir: PathBuf::new(),
            cni_bin_dir: PathBuf::new(),
            keep_cni: true,
        };
        tokio::task::spawn_blocking(move || {
            if handing_over {
                hand_over(&config)
            } else {
                crate::uninstall::uninstall(&config)
            }
        })
        .await?
    })
}

/// The uninstall with Istio's node agent installed. The eBPF mode's
/// capture goes once Istio's is in each pod. The iptables and nftables
/// modes' rules are Istio's own rules (its agent rewrote them in every pod
/// at its start-up), so they stay with it, but for the nftables mode's
/// tables where Istio's agent writes iptables rules; their records go.
fn hand_over(config: &crate::uninstall::UninstallConfig) -> Result<()> {
    if config.mode == Some(RedirectMode::Ebpf) {
        crate::redirect::istio_agent::await_istio_capture(
            &config.pins,
            crate::redirect::istio_agent::HANDOVER_AT_MOST,
        );
        return crate::uninstall::uninstall(config);
    }
    if config.mode == Some(RedirectMode::Nftables) {
        crate::redirect::istio_agent::hand_over_nftables(&config.pins);
    }
    // The pin root holds only ambpf's records in these modes; a mount point
    // is never removed.
    let root = config.pins.root();
    if !crate::bpf::pins::is_mount_root(root)
        && let Err(e) = std::fs::remove_dir_all(root)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("removing {}: {e}", root.display());
    }
    info!(
        "the {} mode's rules are Istio's own: left in every pod and on the node for Istio's \
         node agent",
        config.mode.map_or("rule", RedirectMode::name)
    );
    Ok(())
}

/// The CNI endpoint: started during a standby, or after the first pass.
enum CniEndpoint {
    Unstarted(Option<Box<(PathBuf, crate::cni::server::Endpoint)>>),
    Started(
        tokio::task::JoinHandle<()>,
        tokio::sync::mpsc::Receiver<crate::controller::CniRequest>,
    ),
}

impl CniEndpoint {
    /// Binds and serves it, once; nothing without a socket.
    fn start(&mut self) -> Result<()> {
        let CniEndpoint::Unstarted(Some(unstarted)) = self else {
            return Ok(());
        };
        let (path, endpoint) = &**unstarted;
        let listener = crate::cni::server::bind(path)?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let endpoint = crate::cni::server::Endpoint {
            controller: tx,
            ..endpoint.clone()
        };
        info!("CNI endpoint on {}", path.display());
        *self = CniEndpoint::Started(
            tokio::spawn(crate::cni::server::serve(listener, endpoint)),
            rx,
        );
        Ok(())
    }

    fn into_parts(
        self,
    ) -> (
        Option<tokio::task::JoinHandle<()>>,
        Option<tokio::sync::mpsc::Receiver<crate::controller::CniRequest>>,
    ) {
        match self {
            CniEndpoint::Started(server, requests) => (Some(server), Some(requests)),
            CniEndpoint::Unstarted(_) => (None, None),
        }
    }
}

/// How long the controller has to finish its pass before an uninstall.
const CONTROLLER_STOP: std::time::Duration = std::time::Duration::from_secs(10);

/// How long the CNI endpoint's ADDs in flight have to answer at shutdown.
const CNI_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Raises the soft limit on open files to the hard one, as Go's runtime does
/// for Istio's node agent: the agent holds each enrolled pod's namespace
/// open (twice: the controller and the redirection), so a node with a
/// thousand pods needs more than the common soft limit of 1,024.
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                tracing::warn!(
                    "cannot raise the open-file limit to {}: {}",
                    limit.rlim_max,
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

fn pins_root(dataplane: &Dataplane) -> String {
    dataplane.pins().root().display().to_string()
}

/// `--cgroup` as given, or the cgroup v2 hierarchy below it where it is a
/// hybrid host's `/sys/fs/cgroup` (the chart mounts the host's whichever
/// layout the node has).
fn given_cgroup(path: PathBuf) -> Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    match crate::mounts::cgroup2_at_or_below(&path, &mountinfo) {
        Some(found) if found == path => Ok(path),
        Some(found) => {
            tracing::info!(
                "{} holds cgroup v1 controllers; using the cgroup v2 hierarchy at {}",
                path.display(),
                found.display()
            );
            Ok(found)
        }
        // Attaching names the path and why it is refused.
        None => Ok(path),
    }
}

/// The cgroup v2 mount, from mountinfo: /sys/fs/cgroup on pure cgroup v2
/// hosts, its `unified` subdirectory on hybrid ones.
fn default_cgroup() -> Result<PathBuf> {
    crate::mounts::cgroup2_mount().context("finding the cgroup v2 hierarchy (or give --cgroup)")
}

async fn wait_for_shutdown() -> Result<()> {
    shutdown_signal()?.await;
    Ok(())
}

/// Catches SIGTERM and SIGINT from now on; the future ends at the first.
/// Needs a tokio runtime.
pub(super) fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
