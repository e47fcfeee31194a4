//! What the two rule-writing modes ([`super::iptables`], [`super::nftables`])
//! share: Istio's probe SNAT addresses, running a netfilter tool in a
//! namespace ([`tools`]), the record of the pods they enrolled
//! ([`records`]), and the handle each keeps on an enrolled pod's namespace.

pub mod conntrack;
pub(in crate::redirect) mod records;
pub(in crate::redirect) mod tools;

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd,
};

pub use self::tools::ToolError;
use crate::netns::Netns;

/// Where Istio SNATs host-process traffic to ambient pods (IPv4).
pub const PROBE_SNAT_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// Where Istio SNATs host-process traffic to ambient pods (IPv6; a ULA,
/// Istio's `HOST_PROBE_V6_SNAT_ADDRESS` default).
pub const PROBE_SNAT_V6: Ipv6Addr = Ipv6Addr::new(
    0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
);

/// A handle of our own on `netns` (the caller's may close): reopened by
/// path when that still names the same namespace, else through our fd.
pub(in crate::redirect) fn keep_netns(netns: &Netns) -> Result<Netns, ToolError> {
    if let Some(path) = netns.path().to_str()
        && let Ok(again) = Netns::open(path)
        && again.inode() == netns.inode()
    {
        return Ok(again);
    }
    Netns::open(&format!("/proc/self/fd/{}", netns.file().as_raw_fd())).map_err(|source| {
        ToolError::Keep {
            netns: netns.path().to_owned(),
            cause: source,
        }
    })
}

/// Enters the open connections of a pod taken over from the eBPF mode in
/// conntrack ([`conntrack`]), once its rules (without redirects) track new
/// ones.
pub(in crate::redirect) fn keep_open_connections(
    netns: &Netns,
) -> Result<(), crate::redirect::EnrollError> {
    let entered = conntrack::track_established(netns).map_err(|cause| {
        crate::redirect::EnrollError::Conntrack {
            netns: netns.path().to_owned(),
            cause,
        }
    })?;
    tracing::info!(
        "entered {entered} open connection(s) of the pod in {} in conntrack, taken over from \
         the eBPF mode: they carry on untranslated",
        netns.path().display()
    );
    Ok(())
}
