//! Redirecting an enrolled pod's traffic to ztunnel, behind one per-pod
//! interface with two implementations:
//!
//! - [`ebpf`] (the default): programs loaded and attached once per node,
//!   per-pod state in pinned maps, the reply routing of [`routing`];
//! - [`iptables`]: Istio's in-pod rule set, the baseline ambpf is measured
//!   against.
//!
//! [`podnet`] and [`routing`] are the netlink plumbing both use.

pub mod ebpf;
pub mod iptables;
pub mod podnet;
pub mod routing;

use std::path::PathBuf;

pub use ebpf::{EnrollError, EnrolledPod};

use crate::netns::Netns;

/// Which implementation redirects pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum RedirectMode {
    Ebpf,
    Iptables,
}

/// Per-pod options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnrollOptions {
    /// Capture the pod's DNS (port 53) into ztunnel's DNS proxy.
    pub dns_capture: bool,
}

/// What every redirection mode does for a pod.
pub trait PodRedirection: Send {
    fn mode(&self) -> RedirectMode;

    /// Starts redirecting new connections of the pod in `netns`. Idempotent.
    fn enroll(&mut self, netns: &Netns, options: EnrollOptions)
    -> Result<EnrolledPod, EnrollError>;

    /// Stops redirecting new connections of the pod whose netns has inode
    /// `netns_inode` (works when the namespace is already gone); open
    /// connections keep working. Returns whether the pod was enrolled.
    fn unenroll(&mut self, netns_inode: u64) -> Result<bool, EnrollError>;

    /// Netns inodes of the pods currently enrolled.
    fn enrolled(&mut self) -> Result<Vec<u64>, EnrollError>;
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

/// The addresses a pod is redirected by: the first of each family, which is
/// what a Kubernetes pod has. A pod with none cannot be enrolled.
fn pod_addresses(
    net: &podnet::PodNetwork,
    netns: &Netns,
) -> Result<Vec<std::net::IpAddr>, EnrollError> {
    let v4 = net.addresses.iter().find(|ip| ip.is_ipv4());
    let v6 = net.addresses.iter().find(|ip| ip.is_ipv6());
    let addresses: Vec<_> = v4.into_iter().chain(v6).copied().collect();
    if addresses.is_empty() {
        return Err(EnrollError::NoAddress {
            netns: netns.path().to_owned(),
        });
    }
    Ok(addresses)
}
