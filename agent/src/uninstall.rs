//! `ambpf uninstall`: removes everything ambpf made on a node, from what
//! the node itself shows, so that it works while no agent runs, after one
//! crashed, and on a node where nothing is installed. First the `ambpf-cni`
//! plugin comes out of the node's CNI configuration
//! ([`cni::install::uninstall`]): it fails every pod's start while no agent
//! answers. Then, in this order:
//!
//! 1. **eBPF mode**: the reply routing of every pod in the pinned pods map
//!    (its namespace found again by inode), then the pin tree, which
//!    detaches every program. The pins stay if a pod could not be cleaned,
//!    so that running again still knows that pod.
//! 2. **iptables mode**: every network namespace of the host is examined
//!    (the agent's records of its pods may be stale, or missing when an
//!    older agent kept none): named under /run/netns or /var/run/netns, or
//!    held by a process; the host's own is skipped. Those holding ambpf's
//!    in-pod chains ([`iptables::find_pod_rules`]) lose them and their
//!    policy routing; then the host's probe rules and ipsets go, unless a
//!    pod kept its rules ([`iptables::uninstall_node`]), and then the
//!    agent's records of its pods under the pin root.
//! 3. **Kubernetes**: `ambient.istio.io/redirection: enabled` comes off this
//!    node's pods, when the API server is configured as for `run`.
//!
//! Every step is idempotent and prints a line per thing it removed; a failure
//! is printed and the rest carries on, and the command then fails.

use std::path::{Path, PathBuf};

use crate::{
    bpf::{PinLayout, inspect},
    cni,
    netns::Netns,
    redirect::{
        RedirectMode, check, ebpf,
        iptables::{self, PodRulesFound},
        nftables, podnet, routing,
    },
    sources::kube,
};

/// Where the annotations are removed.
#[derive(Clone, Debug)]
pub struct KubeTarget {
    pub kubeconfig: Option<PathBuf>,
    /// Empty when not given: an error once the API server is reached for.
    pub node_name: String,
}

#[derive(Clone, Debug)]
pub struct UninstallConfig {
    pub pins: PinLayout,
    /// Only this mode's state (default: both).
    pub mode: Option<RedirectMode>,
    /// `None`: no Kubernetes access configured, annotations are skipped.
    pub kube: Option<KubeTarget>,
    /// The node's CNI configuration and plugin directories.
    pub cni_conf_dir: PathBuf,
    pub cni_bin_dir: PathBuf,
    /// Leave the plugin chained: only an agent's own state goes (a test or
    /// demo agent beside a real installation).
    pub keep_cni: bool,
}

/// Lines for the user, and how many steps failed.
#[derive(Debug, Default)]
struct Report {
    failures: usize,
}

impl Report {
    fn done(&mut self, line: impl std::fmt::Display) {
        println!("{line}");
    }

    fn failed(&mut self, line: impl std::fmt::Display) {
        eprintln!("{line}");
        self.failures += 1;
    }
}

/// Runs every step; an error at the end when any of them failed.
pub fn uninstall(config: &UninstallConfig) -> anyhow::Result<()> {
    // As `run` refuses it: the pins are removed by removing the root whole,
    // which at a mount point would take other programs' pins along.
    if crate::bpf::pins::is_mount_root(config.pins.root()) {
        return Err(crate::bpf::pins::PinError::MountRoot {
            path: config.pins.root().to_owned(),
        }
        .into());
    }
    let mut report = Report::default();
    if config.keep_cni {
        let chained = cni::install::chained_in(&config.cni_conf_dir);
        report.done(if chained.is_empty() {
            format!(
                "{} is not chained in {} (--keep-cni: not looked after)",
                cni::PLUGIN_TYPE,
                config.cni_conf_dir.display()
            )
        } else {
            let lists: Vec<String> = chained.iter().map(|p| p.display().to_string()).collect();
            format!(
                "{} left chained in {} (--keep-cni)",
                cni::PLUGIN_TYPE,
                lists.join(", ")
            )
        });
    } else {
        cni_plugin(&config.cni_conf_dir, &config.cni_bin_dir, &mut report);
    }
    // The host's namespaces, listed once for both modes: finding each pod
    // by inode on its own would scan /proc once a pod.
    let namespaces = std::cell::OnceCell::new();
    let namespaces = || namespaces.get_or_init(crate::netns::all);
    let this_mode = |mode| config.mode.is_none_or(|m| m == mode);
    if this_mode(RedirectMode::Ebpf) {
        ebpf_state(&config.pins, namespaces, &mut report);
    }
    for mode in [RedirectMode::Iptables, RedirectMode::Nftables] {
        if !this_mode(mode) {
            continue;
        }
        match Netns::open("/proc/self/ns/net") {
            Ok(host) if mode == RedirectMode::Iptables => {
                iptables_state(&host, namespaces(), &config.pins, &mut report)
            }
            Ok(host) => nftables_state(&host, namespaces(), &config.pins, &mut report),
            Err(e) => report.failed(format!("{mode:?}: opening this host's namespace: {e}")),
        }
    }
    match &config.kube {
        Some(target) => annotations(target, &mut report),
        None => report.done(format!(
            "no Kubernetes access configured (give --kubeconfig and --node-name, or run in a \
             cluster): pods' {} annotations left in place",
            kube::rules::REDIRECTION_ANNOTATION
        )),
    }
    match report.failures {
        0 => Ok(()),
        n => anyhow::bail!("uninstall incomplete: {n} step(s) failed (see above); run it again"),
    }
}

/// The CNI plugin, un-chained first so that pods can start on the node.
fn cni_plugin(conf_dir: &Path, bin_dir: &Path, report: &mut Report) {
    let done = cni::install::uninstall(conf_dir, bin_dir);
    for list in &done.unchained {
        report.done(format!(
            "un-chained {} from {}",
            cni::PLUGIN_TYPE,
            list.display()
        ));
    }
    match &done.binary_removed {
        Some(binary) => report.done(format!("removed {}", binary.display())),
        None if done.unchained.is_empty() && done.errors.is_empty() => report.done(format!(
            "{} is not chained in {} and not in {}",
            cni::PLUGIN_TYPE,
            conf_dir.display(),
            bin_dir.display()
        )),
        None => {}
    }
    for error in &done.errors {
        report.failed(format!("un-chaining {}: {error}", cni::PLUGIN_TYPE));
    }
}

/// The enrolled pods' steering filters and reply routing, any other
/// steering filter running the agent's program, then the pins.
fn ebpf_state<'a>(
    pins: &PinLayout,
    namespaces: impl FnOnce() -> &'a Vec<Netns>,
    report: &mut Report,
) {
    let mut pods_left = false;
    match inspect::read_pods(pins) {
        Ok(pods) if pods.is_empty() => {}
        Ok(pods) => {
            let by_inode: std::collections::HashMap<u64, &Netns> =
                namespaces().iter().map(|n| (n.inode(), n)).collect();
            // The table readying pods for Istio's agent's rules, where one
            // came ([`crate::redirect::istio_agent::IstioArrival`]).
            let nft = std::cell::OnceCell::new();
            let node_nft = check::mixed::own_node_nft;
            for pod in pods {
                // An inode number is reused once its namespace is freed:
                // only the namespace with the pod's cookie is the pod's.
                let Some(netns) = by_inode
                    .get(&pod.netns_inode)
                    .filter(|ns| podnet::netns_cookie(ns).ok() == Some(pod.netns_cookie))
                else {
                    report.done(format!(
                        "pod netns {} is gone; nothing to remove in it",
                        pod.netns_inode
                    ));
                    continue;
                };
                let removed = ebpf::detach_steering(netns, pod.steering_qdisc_created)
                    .map_err(|e| crate::error_chain(&e))
                    .and_then(|()| {
                        routing::remove_reply_routing(netns).map_err(|e| crate::error_chain(&e))
                    })
                    .and_then(|()| match nft.get_or_init(node_nft) {
                        Some(nft) => {
                            crate::redirect::istio_agent::remove_conntrack_table(nft, netns)
                        }
                        None => Ok(()),
                    });
                match removed {
                    Ok(()) => report.done(format!(
                        "removed the steering and reply routing of {}",
                        netns.path().display()
                    )),
                    Err(e) => {
                        pods_left = true;
                        report.failed(format!(
                            "removing the steering and reply routing of {}: {e}",
                            netns.path().display()
                        ));
                    }
                }
            }
        }
        // Unreadable pins cannot say which pods to clean; removing them is
        // still what the user asked for.
        Err(e) => report.failed(format!(
            "reading the enrolled pods under {}: {}",
            pins.root().display(),
            crate::error_chain(&e)
        )),
    }
    // Filters of pods no longer enrolled (their removal failed, or an agent
    // died mid-way): found by the program they run.
    if let Some(program) = crate::bpf::pinned_steering_program(pins) {
        for stray in check::scan_orphan_steering(program, &Default::default()) {
            let Some(path) = &stray.netns else { continue };
            let removed = Netns::open(&path.to_string_lossy())
                .map_err(|e| e.to_string())
                .and_then(|ns| ebpf::detach_steering(&ns, false).map_err(|e| e.to_string()));
            match removed {
                Ok(()) => report.done(format!("removed the steering in {}", path.display())),
                Err(e) => {
                    pods_left = true;
                    report.failed(format!("removing the steering in {}: {e}", path.display()));
                }
            }
        }
    }
    let root = pins.root();
    if pods_left {
        report.done(format!(
            "kept {}: it records the pods not yet cleaned",
            root.display()
        ));
        return;
    }
    remove_pins(pins, report);
}

/// The pin root, whole (never a mount point: refused at the start).
fn remove_pins(pins: &PinLayout, report: &mut Report) {
    let root = pins.root();
    match std::fs::remove_dir_all(root) {
        Ok(()) => report.done(format!("removed {}", root.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            report.done(format!("nothing pinned under {}", root.display()))
        }
        Err(e) => report.failed(format!("removing {}: {e}", root.display())),
    }
}

/// Every namespace holding ambpf's in-pod chains, then the host side, then
/// the agent's records of its pods.
fn iptables_state(host: &Netns, namespaces: &[Netns], pins: &PinLayout, report: &mut Report) {
    let mut pods = Vec::new();
    for netns in namespaces {
        if netns.inode() == host.inode() {
            continue;
        }
        match iptables::find_pod_rules(netns) {
            Ok(PodRulesFound::None) => {}
            Ok(PodRulesFound::Ambpf) => pods.push(netns),
            Ok(PodRulesFound::Foreign(what)) => report.done(format!(
                "left {}: its Istio chains are not ambpf's ({})",
                netns.path().display(),
                what.join(", ")
            )),
            Err(e) => report.failed(format!(
                "reading the iptables rules of {}: {}",
                netns.path().display(),
                crate::error_chain(&e)
            )),
        }
    }
    let done = iptables::uninstall_node(host, pods);
    let host_clean = matches!(done.host, Some(Ok(_)));
    for (path, result) in done.pods {
        match result {
            Ok(()) => report.done(format!(
                "removed the iptables rules and reply routing of {}",
                path.display()
            )),
            Err(e) => report.failed(format!(
                "removing the iptables rules of {}: {}",
                path.display(),
                crate::error_chain(&e)
            )),
        }
    }
    match done.host {
        Some(Ok(true)) => report.done(format!(
            "removed the host probe rules ({}) and ipsets ({}, {})",
            iptables::CHAIN_POSTROUTING,
            iptables::PROBE_IPSET_V4,
            iptables::PROBE_IPSET_V6
        )),
        Some(Ok(false)) => {}
        Some(Err(e)) => report.failed(format!(
            "removing the host probe rules and ipsets: {}",
            crate::error_chain(&e)
        )),
        None => report.done(
            "kept the host probe rules and ipsets: a pod still has its rules (its kubelet \
             probes need them)",
        ),
    }
    if host_clean {
        remove_pod_records(pins, report);
    }
}

/// Every namespace holding the nftables mode's tables (those with ambpf's
/// comment; another tool's stay), then the host table, then the records.
fn nftables_state(host: &Netns, namespaces: &[Netns], pins: &PinLayout, report: &mut Report) {
    let nft = match nftables::Nft::find(host) {
        Ok(nft) => nft,
        // No nft, no nftables mode: nothing of it can be there.
        Err(nftables::NftablesError::Missing) => return,
        Err(e) => return report.failed(format!("nftables: {}", crate::error_chain(&e))),
    };
    let mut clean = true;
    for netns in namespaces.iter().filter(|ns| ns.inode() != host.inode()) {
        let path = netns.path().display();
        match nftables::remove_pod_tables(&nft, netns) {
            Ok(removed) if removed.is_empty() => {}
            Ok(removed) => report.done(format!(
                "removed the nftables tables ({}) and reply routing of {path}",
                removed.join(", ")
            )),
            Err(e) => {
                clean = false;
                let e = crate::error_chain(&e);
                report.failed(format!("removing the nftables tables of {path}: {e}"));
            }
        }
    }
    if !clean {
        return report.done(
            "kept the host's nftables probe table: a pod still has its tables (its kubelet \
             probes need it)",
        );
    }
    match nftables::remove_host_table(&nft, host) {
        Ok(true) => report.done(format!(
            "removed the host's nftables table inet {} (probe rule and sets)",
            nftables::NAT_TABLE
        )),
        Ok(false) => {}
        Err(e) => {
            let e = crate::error_chain(&e);
            return report.failed(format!("removing the host's nftables table: {e}"));
        }
    }
    remove_records_dir(pins.nftables_pods_dir(), report);
}

/// The iptables mode's records of its pods (only once every pod is clean:
/// they are how a new agent finds what is left).
fn remove_pod_records(pins: &PinLayout, report: &mut Report) {
    remove_records_dir(pins.iptables_pods_dir(), report);
}

fn remove_records_dir(dir: PathBuf, report: &mut Report) {
    let Some(parent) = dir.parent() else { return };
    match std::fs::remove_dir_all(parent) {
        Ok(()) => report.done(format!("removed {}", parent.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => report.failed(format!("removing {}: {e}", parent.display())),
    }
    // The pin root too, once nothing else is in it (the other mode's
    // records or pins keep it).
    if let Some(root) = parent.parent()
        && std::fs::remove_dir(root).is_ok()
    {
        report.done(format!("removed {}", root.display()));
    }
}

/// The redirection annotation, off this node's pods.
fn annotations(target: &KubeTarget, report: &mut Report) {
    if target.node_name.is_empty() {
        report.failed(format!(
            "annotations: {}",
            kube::KubeSourceError::NoNodeName
        ));
        return;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return report.failed(format!("annotations: starting a runtime: {e}")),
    };
    let removals = runtime.block_on(async {
        let client = kube::client(target.kubeconfig.as_deref()).await?;
        kube::annotate::remove_redirection_annotations(&client, &target.node_name).await
    });
    let annotation = kube::rules::REDIRECTION_ANNOTATION;
    match removals {
        Ok(removals) => {
            if removals.is_empty() {
                report.done(format!(
                    "no pod of node {} carries {annotation}",
                    target.node_name
                ));
            }
            for removal in removals {
                match removal.outcome {
                    Ok(true) => {
                        report.done(format!("removed {annotation} from pod {}", removal.pod))
                    }
                    Ok(false) => report.done(format!("pod {} is gone", removal.pod)),
                    Err(why) => report.failed(format!("pod {}: {why}", removal.pod)),
                }
            }
        }
        Err(e) => report.failed(format!("annotations: {e}")),
    }
}
