//! Redirecting an enrolled pod's traffic to ztunnel, behind one per-pod
//! interface with two implementations:
//!
//! - [`ebpf`] (the default): programs loaded and attached once per node,
//!   per-pod state in pinned maps, the reply routing of [`routing`];
//! - [`iptables`]: Istio's in-pod rule set, the baseline ambpf is measured
//!   against;
//! - [`nftables`]: Istio's native nftables tables, for hosts without
//!   iptables.
//!
//! [`podnet`] and [`routing`] are the netlink plumbing both use.

pub mod check;
pub mod claims;
pub mod ebpf;
pub mod in_pod;
pub mod istio_agent;
pub use crate::bpf::NodeSetupError;
pub mod iptables;
pub mod link_kind;
pub mod nftables;
pub mod podnet;
#[cfg(any(test, feature = "test-support"))]
pub mod recorder;
pub mod retire;
pub mod routing;
pub mod rtnl;
pub mod steering;

use std::path::PathBuf;

pub use check::{CheckScope, Violation, ViolationKind};
pub use ebpf::{AddressConflict, EbpfRedirection, EnrollError, EnrolledPod};

use crate::netns::Netns;

/// Which implementation redirects pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum RedirectMode {
    Ebpf,
    Iptables,
    Nftables,
}

impl RedirectMode {
    /// As `--redirect-mode` and the chart's `redirectMode` spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        }
    }
}

/// Per-pod options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnrollOptions {
    /// Capture the pod's DNS (port 53) into ztunnel's DNS proxy.
    pub dns_capture: bool,
}

/// How long each step of one pod's enrolment took, in order (e.g.
/// `inspect`, `routing`, `steering`, `maps`): the agent sums them per step
/// for `/metrics` (`ambpf_enrol_duration_seconds{mode,step}`), and the `enroll`
/// benchmark prints the breakdown.
#[derive(Clone, Debug, Default)]
pub struct EnrolSteps(pub Vec<(&'static str, std::time::Duration)>);

impl EnrolSteps {
    /// Runs `f` as step `name`.
    pub fn time<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let started = std::time::Instant::now();
        let out = f();
        self.0.push((name, started.elapsed()));
        out
    }

    /// Records step `name` as what is left of `total` after the steps so far.
    pub fn rest(&mut self, name: &'static str, total: std::time::Duration) {
        let spent: std::time::Duration = self.0.iter().map(|(_, d)| *d).sum();
        self.0.push((name, total.saturating_sub(spent)));
    }
}

/// An enrolled pod's identity in the redirection.
///
/// Every per-pod record is owned by the netns cookie: the kernel hands out
/// cookies from one counter that only grows within a boot, so a cookie never
/// names two namespaces. nsfs inode numbers are recycled as soon as a
/// namespace is freed; the inode is kept only to find a namespace again
/// (and is checked against the cookie before anything is done in it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct PodKey {
    pub netns_cookie: u64,
    pub netns_inode: u64,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "netns cookie {} (inode {})",
            self.netns_cookie, self.netns_inode
        )
    }
}

/// What every redirection mode does for a pod.
pub trait PodRedirection: Send {
    fn mode(&self) -> RedirectMode;

    /// Starts redirecting new connections of the pod in `netns`. Idempotent.
    /// An address another enrolled pod claims goes to the newer of the two
    /// ([`claims`]); [`EnrolledPod::conflicts`] says which.
    fn enroll(&mut self, netns: &Netns, options: EnrollOptions)
    -> Result<EnrolledPod, EnrollError>;

    /// Stops redirecting new connections of the pod `pod` (works when its
    /// namespace is already gone); open connections keep working. Removes
    /// only what the pod still owns: an address a newer pod has taken over
    /// keeps that pod's records. Returns whether the pod was enrolled.
    fn unenroll(&mut self, pod: PodKey) -> Result<bool, EnrollError>;

    /// Forgets the pod `pod`, which was deleted. Istio's node agent removes
    /// nothing inside a deleted pod's namespace, which dies with it, only
    /// the pod's node-wide state; a mode may do the same. By default, as
    /// [`PodRedirection::unenroll`].
    fn forget_deleted(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        self.unenroll(pod)
    }

    /// Records who the enrolled pod `pod` is where `ambpf status` reads it
    /// without the agent (the eBPF mode's pinned map; iptables mode pins
    /// nothing). Its removal forgets it.
    fn record_identity(
        &mut self,
        _pod: PodKey,
        _identity: &crate::bpf::pod_names::PodIdentity,
    ) -> Result<(), EnrollError> {
        Ok(())
    }

    /// The pods currently enrolled.
    fn enrolled(&mut self) -> Result<Vec<PodKey>, EnrollError>;

    /// Checks the mode's state against the enrolled pods ([`check`]):
    /// `pods` are the enrolled pods the caller knows alive, with a handle on
    /// each namespace, for the checks made inside them.
    fn check(&mut self, pods: &[(PodKey, &Netns)], scope: CheckScope) -> Vec<Violation>;

    /// Repairs what can be repaired in place (records that belong to no
    /// pod, or to the wrong one) and returns the pods that must be enrolled
    /// again to repair the rest (missing steering or routing).
    fn repair(&mut self, violations: &[Violation]) -> Vec<PodKey>;
}

/// Where the node's settings for a redirection mode come from.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    /// DNS capture for the whole node (a pod can only narrow it).
    pub dns_capture: bool,
    /// The cgroup whose sockets the eBPF socket programs see (the node's
    /// root cgroup in production).
    pub cgroup: PathBuf,
}

/// The addresses a pod is redirected by: one of each family, which is what
/// a Kubernetes pod has (`status.podIPs`) and what a pod's entry holds
/// ([`ambpf_common::PodConfig::ips`]). A pod with none cannot be enrolled,
/// nor one with more of a family: connections to the addresses left out
/// would reach the app without ztunnel (the eBPF mode steers by address),
/// so it is refused, naming them, in both modes alike.
fn pod_addresses(
    net: &podnet::PodNetwork,
    netns: &Netns,
) -> Result<Vec<std::net::IpAddr>, EnrollError> {
    let (v4, v6): (Vec<_>, Vec<_>) = net.addresses.iter().partition(|ip| ip.is_ipv4());
    for (family, found) in [("IPv4", &v4), ("IPv6", &v6)] {
        if found.len() > 1 {
            return Err(EnrollError::TooManyAddresses {
                netns: netns.path().to_owned(),
                family,
                addresses: found.clone(),
            });
        }
    }
    let addresses: Vec<_> = v4.into_iter().chain(v6).collect();
    if addresses.is_empty() {
        return Err(EnrollError::NoAddress {
            netns: netns.path().to_owned(),
        });
    }
    Ok(addresses)
}
