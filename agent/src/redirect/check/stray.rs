//! Capture in the node's network namespaces that no enrolled pod is in, in
//! every mode: what an agent that stopped before removing a pod left behind
//! (Istio's in-pod rules of the iptables mode, the nftables mode's tables,
//! the eBPF mode's steering filter). It sends the namespace's traffic to a
//! ztunnel that no longer serves it, so every connection there fails.
//!
//! - Steering filters are ambpf's when they run the agent's own program, so
//!   every namespace is looked at for them ([`ViolationKind::SteeringOrphan`]).
//! - Rules carry no owner. Several agents can share a kernel (each in a
//!   namespace of its own, as in ambpf's tests), so only the node's
//!   namespaces are judged: those with an interface whose other end (a
//!   veth's peer, a macvlan's parent) is in the host namespace. Reading a
//!   namespace's rules takes a process per backend and family, so only the
//!   namespaces holding ambpf's policy rule are read: ambpf writes its
//!   in-pod rules after that rule and removes them before it. Found capture
//!   is a [`ViolationKind::CaptureOrphan`], repaired by removing everything
//!   ambpf writes in a pod (as Istio's `DeleteInpodRules` does). The
//!   nftables mode looks for its own tables instead
//!   ([`scan_stray_tables`]): those with ambpf's comment, the nat table
//!   only when it holds rules (empty base chains capture nothing).
//!
//! The reply path alone (policy routing, the mangle chains) captures
//! nothing and is not reported: the eBPF mode keeps its policy routing in a
//! pod it unenrolled, for the connections ztunnel was proxying when it
//! left, while the iptables and nftables modes remove everything at
//! opt-out, as Istio's `DeleteInpodRules` does.

use std::{collections::HashSet, os::fd::AsRawFd as _, path::Path};

use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkAttribute, LinkFlags, LinkMessage},
    nsid::{NsidAttribute, NsidMessage},
};
use tracing::{info, warn};

use super::{Violation, ViolationKind};
use crate::{
    netns::Netns,
    redirect::{
        iptables, nftables, podnet,
        routing::{self, ReplyRoutingStatus},
        rtnl::{NetlinkError, Rtnl},
        steering,
    },
};

/// What one namespace that is no enrolled pod's holds.
#[derive(Debug, Default)]
struct Visit {
    cookie: u64,
    /// One of its interfaces has its other end in the host namespace.
    on_node: bool,
    /// Interfaces with a steering filter running the agent's program.
    steering: Vec<String>,
}

/// Every namespace that is no enrolled pod's (`enrolled`, by cookie) and
/// holds capture: a steering filter running `steering_program`, or, when on
/// the node of `host` (skipped itself), ambpf's in-pod capture rules.
/// Without `host` only steering filters are looked for.
pub fn scan_stray_capture(
    host: Option<&Netns>,
    enrolled: &HashSet<u64>,
    steering_program: Option<u32>,
) -> Vec<Violation> {
    scan(host, enrolled, steering_program, PodRules::Iptables)
}

/// The nftables mode's [`scan_stray_capture`]: every namespace of the node
/// of `host` that is no enrolled pod's and holds ambpf's in-pod tables.
pub fn scan_stray_tables(
    host: &Netns,
    enrolled: &HashSet<u64>,
    nft: &nftables::Nft,
) -> Vec<Violation> {
    scan(Some(host), enrolled, None, PodRules::Nftables(nft))
}

/// Which mode's in-pod capture a scan looks for.
#[derive(Clone, Copy)]
enum PodRules<'a> {
    Iptables,
    Nftables(&'a nftables::Nft),
}

fn scan(
    host: Option<&Netns>,
    enrolled: &HashSet<u64>,
    steering_program: Option<u32>,
    rules: PodRules,
) -> Vec<Violation> {
    let mut out = Vec::new();
    let host_fd = host.map(|h| h.file().as_raw_fd());
    for netns in crate::netns::all() {
        if host.is_some_and(|h| h.inode() == netns.inode()) {
            continue;
        }
        let visit = match netns.run(|| visit_here(enrolled, host_fd, steering_program)) {
            Ok(Ok(Some(visit))) => visit,
            // Enrolled.
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => {
                out.push(unreadable(&netns, &e.to_string()));
                continue;
            }
            Err(e) => {
                out.push(unreadable(&netns, &e.to_string()));
                continue;
            }
        };
        let path = netns.path();
        if !visit.steering.is_empty() {
            out.push(
                Violation::new(
                    ViolationKind::SteeringOrphan,
                    format!(
                        "{} is no enrolled pod's and steers inbound traffic on {}",
                        path.display(),
                        visit.steering.join(", ")
                    ),
                )
                .in_netns(path),
            );
        }
        if visit.on_node {
            out.extend(check_rules(&netns, visit.cookie, rules));
        }
    }
    out
}

/// Inside the namespace: its cookie (`None` when enrolled), whether it is on
/// the node, and its steering filters.
fn visit_here(
    enrolled: &HashSet<u64>,
    host_fd: Option<i32>,
    steering_program: Option<u32>,
) -> Result<Option<Visit>, NetlinkError> {
    let Ok(cookie) = podnet::netns_cookie_of_current_thread() else {
        return Ok(None);
    };
    if enrolled.contains(&cookie) {
        return Ok(None);
    }
    let mut rtnl = Rtnl::open()?;
    let links: Vec<LinkMessage> = rtnl
        .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))?
        .into_iter()
        .filter_map(|msg| match msg {
            RouteNetlinkMessage::NewLink(link) => Some(link),
            _ => None,
        })
        .filter(|link| !link.header.flags.contains(LinkFlags::Loopback))
        .collect();
    let mut visit = Visit {
        cookie,
        ..Default::default()
    };
    if let Some(fd) = host_fd {
        // The links were listed first: listing them gives their peers'
        // namespaces an id here, which the host's is looked up by.
        if let Some(host_id) = nsid_of(&mut rtnl, fd)? {
            visit.on_node = links.iter().any(|link| {
                link.attributes
                    .iter()
                    .any(|a| matches!(a, LinkAttribute::LinkNetNsId(id) if *id == host_id))
            });
        }
    }
    if let Some(program) = steering_program {
        for link in &links {
            let ours = steering::find(&mut rtnl, link.header.index)?
                .is_some_and(|f| f.prog_id == Some(program));
            if ours {
                visit.steering.push(link_name(link));
            }
        }
    }
    Ok(Some(visit))
}

/// The id the namespace of `rtnl` gives the namespace open at `fd`; `None`
/// when it has none (nothing links the two).
fn nsid_of(rtnl: &mut Rtnl, fd: i32) -> Result<Option<i32>, NetlinkError> {
    let mut request = NsidMessage::default();
    request
        .attributes
        .push(NsidAttribute::Fd(fd.try_into().unwrap_or_default()));
    let answers = rtnl.query(RouteNetlinkMessage::GetNsId(request))?;
    Ok(answers
        .into_iter()
        .filter_map(|msg| match msg {
            RouteNetlinkMessage::NewNsId(nsid) => Some(nsid),
            _ => None,
        })
        .flat_map(|nsid| nsid.attributes)
        .find_map(|a| match a {
            NsidAttribute::Id(id) => Some(id),
            _ => None,
        })
        .filter(|id| *id >= 0))
}

fn link_name(link: &LinkMessage) -> String {
    link.attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        })
        .unwrap_or_else(|| format!("ifindex {}", link.header.index))
}

/// ambpf's in-pod capture rules in a namespace of the node no pod is
/// enrolled in, read where ambpf's policy rule is.
fn check_rules(netns: &Netns, cookie: u64, rules: PodRules) -> Option<Violation> {
    let routing = match routing::reply_routing_status(netns) {
        Ok(status) => status,
        Err(e) => return Some(unreadable(netns, &e.to_string())),
    };
    if !has_policy_rule(&routing) {
        return None;
    }
    let capture = match rules {
        PodRules::Iptables => iptables::find_pod_capture(netns).map_err(|e| e.to_string()),
        PodRules::Nftables(nft) => {
            nftables::find_pod_capture(nft, netns).map_err(|e| e.to_string())
        }
    };
    let capture = match capture {
        Ok(capture) => capture,
        Err(e) => return Some(unreadable(netns, &e.to_string())),
    };
    if capture.is_empty() {
        return None;
    }
    Some(
        Violation::new(
            ViolationKind::CaptureOrphan,
            format!(
                "{} (netns cookie {cookie}) is no enrolled pod's and holds ambpf's capture \
                 rules ({}) and policy routing ({}): its connections go to a ztunnel that \
                 does not serve it",
                netns.path().display(),
                capture.join(", "),
                routing_text(&routing)
            ),
        )
        .in_netns(netns.path()),
    )
}

fn has_policy_rule(status: &ReplyRoutingStatus) -> bool {
    status.ipv4.rule || status.ipv6.is_some_and(|s| s.rule)
}

fn routing_text(status: &ReplyRoutingStatus) -> String {
    let mut found = Vec::new();
    for (family, state) in [("IPv4", Some(status.ipv4)), ("IPv6", status.ipv6)] {
        let Some(state) = state else { continue };
        if state.rule {
            found.push(format!("{family} rule"));
        }
        if state.route {
            found.push(format!("{family} route"));
        }
    }
    found.join(", ")
}

fn unreadable(netns: &Netns, why: &str) -> Violation {
    Violation::new(
        ViolationKind::Unreadable,
        format!("looking for capture in {}: {why}", netns.path().display()),
    )
    .in_netns(netns.path())
}

/// Removes the capture a [`ViolationKind::CaptureOrphan`] names: ambpf's
/// in-pod rules in every table and backend, and its policy routing.
pub fn repair_stray_capture(violation: &Violation) {
    let Some(path) = &violation.netns else { return };
    match remove_capture(path) {
        Ok(()) => info!(
            "repaired: removed ambpf's in-pod rules and policy routing from {}",
            path.display()
        ),
        Err(e) => warn!("repairing {violation}: {e}"),
    }
}

/// The nftables mode's [`repair_stray_capture`]: removes ambpf's tables
/// and policy routing from the namespace a [`ViolationKind::CaptureOrphan`]
/// names.
pub fn repair_stray_tables(violation: &Violation, nft: &nftables::Nft) {
    let Some(path) = &violation.netns else { return };
    let removed = Netns::open(&path.to_string_lossy())
        .map_err(|e| e.to_string())
        .and_then(|netns| {
            nftables::remove_pod_tables(nft, &netns).map_err(|e| crate::error_chain(&e))
        });
    match removed {
        Ok(tables) => info!(
            "repaired: removed ambpf's nftables tables ({}) and policy routing from {}",
            tables.join(", "),
            path.display()
        ),
        Err(e) => warn!("repairing {violation}: {e}"),
    }
}

fn remove_capture(path: &Path) -> Result<(), String> {
    let netns = Netns::open(&path.to_string_lossy()).map_err(|e| e.to_string())?;
    iptables::remove_pod_rules(&netns).map_err(|e| crate::error_chain(&e))
}
