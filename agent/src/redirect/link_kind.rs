//! What kind of link each pod interface is, and whether ambpf's inbound
//! steering can serve it.
//!
//! The steering program ([`super::steering`]) reads a SYN's addresses and
//! ports behind a 14-byte Ethernet header. Every interface whose frames
//! carry one gets the filter: veth (most CNI plugins), netkit in either
//! mode (its L3 mode, Cilium's default, has no ARP but keeps the header:
//! link type Ether), ipvlan in either mode, macvlan. An interface that is up
//! without one (a tun device, an ipip or WireGuard tunnel) would have its
//! SYNs misread and go to the app uncaptured, so a pod with one is refused,
//! naming the interface's kind and why, rather than enrolled half
//! captured. docs/architecture.md ("Pod interface kinds") has what was
//! verified on which kernel.

use std::fmt;

use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{
        InfoData, InfoIpVlan, InfoMacVlan, InfoNetkit, LinkAttribute, LinkFlags, LinkInfo,
        LinkLayerType, LinkMessage,
    },
};

use super::{
    EnrollError,
    podnet::Interface,
    rtnl::{NetlinkError, Rtnl},
};

/// An interface's link kind as `ip -d link` names it (`veth`, `netkit`,
/// `ipvlan`, ...), its mode where it has one, and its link-layer type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkKind {
    /// Empty for a device without a link kind (a physical NIC).
    pub kind: String,
    pub mode: Option<String>,
    pub link_layer: LinkLayerType,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.kind.is_empty() {
            "a device without a link kind"
        } else {
            &self.kind
        };
        match &self.mode {
            Some(mode) => write!(f, "{kind} (mode {mode})"),
            None => f.write_str(kind),
        }
    }
}

impl LinkKind {
    /// Why ambpf's steering filter cannot serve this interface, if it
    /// cannot.
    pub fn unsteerable_because(&self) -> Option<String> {
        // A device that is down receives nothing: the fallback tunnels the
        // ipip, sit and gre modules add, down, to every namespace (`tunl0`
        // on a Calico IPIP node) must not keep pods out.
        if self.link_layer == LinkLayerType::Ether || !self.up {
            return None;
        }
        Some(format!(
            "its frames have no Ethernet header (link type {:?}), and ambpf's inbound \
             steering program reads SYNs behind one: inbound connections would bypass \
             ztunnel. Such a pod can be redirected in the iptables or nftables mode",
            self.link_layer
        ))
    }
}

/// The kind of the interface `ifindex` in the namespace `rtnl` is in.
pub fn of(rtnl: &mut Rtnl, ifindex: u32) -> Result<LinkKind, NetlinkError> {
    let mut query = LinkMessage::default();
    query.header.index = ifindex;
    let answers = rtnl.query(RouteNetlinkMessage::GetLink(query))?;
    let link = answers
        .into_iter()
        .find_map(|msg| match msg {
            RouteNetlinkMessage::NewLink(link) => Some(link),
            _ => None,
        })
        .unwrap_or_default();
    Ok(from_message(&link))
}

/// Refuses a pod that has an interface ambpf's steering cannot serve
/// (see the module's notes), before anything is installed in it: a pod is captured
/// on all its interfaces or not enrolled.
pub fn refuse_unsteerable(
    rtnl: &mut Rtnl,
    netns: &std::path::Path,
    interfaces: &[Interface],
) -> Result<(), EnrollError> {
    for iface in interfaces {
        let kind = of(rtnl, iface.index).map_err(|cause| EnrollError::Steering {
            iface: iface.name.clone(),
            netns: netns.to_owned(),
            cause,
        })?;
        if let Some(reason) = kind.unsteerable_because() {
            return Err(EnrollError::UnsteerableInterface {
                iface: iface.name.clone(),
                netns: netns.to_owned(),
                kind: kind.to_string(),
                reason,
            });
        }
    }
    Ok(())
}

/// The interfaces of the namespace `rtnl` is in that ambpf's steering
/// cannot serve, each as "<name> is <kind>, and <why>": for the state
/// check, since one can come up after the pod was enrolled.
pub fn unsteerable(rtnl: &mut Rtnl, interfaces: &[Interface]) -> Result<Vec<String>, NetlinkError> {
    let mut out = Vec::new();
    for iface in interfaces {
        let kind = of(rtnl, iface.index)?;
        if let Some(reason) = kind.unsteerable_because() {
            out.push(format!("{} is {kind}, and {reason}", iface.name));
        }
    }
    Ok(out)
}

fn from_message(link: &LinkMessage) -> LinkKind {
    let mut out = LinkKind {
        kind: String::new(),
        mode: None,
        link_layer: link.header.link_layer_type,
        up: link.header.flags.contains(LinkFlags::Up),
    };
    let infos = link.attributes.iter().filter_map(|attr| match attr {
        LinkAttribute::LinkInfo(infos) => Some(infos),
        _ => None,
    });
    for info in infos.flatten() {
        match info {
            LinkInfo::Kind(kind) => out.kind = kind.to_string(),
            LinkInfo::Data(data) => out.mode = mode_of(data),
            _ => {}
        }
    }
    out
}

fn mode_of(data: &InfoData) -> Option<String> {
    let mode = match data {
        InfoData::Netkit(infos) => infos.iter().find_map(|i| match i {
            InfoNetkit::Mode(mode) => Some(format!("{mode:?}")),
            _ => None,
        }),
        InfoData::IpVlan(infos) => infos.iter().find_map(|i| match i {
            InfoIpVlan::Mode(mode) => Some(format!("{mode:?}")),
            _ => None,
        }),
        InfoData::MacVlan(infos) => infos.iter().find_map(|i| match i {
            InfoMacVlan::Mode(mode) => Some(format!("{mode:?}")),
            _ => None,
        }),
        _ => None,
    };
    mode.map(|m| m.to_lowercase())
}

#[cfg(test)]
mod tests {
    use ambpf_testbed::{
        PodAndNode,
        cluster::{Cluster, PodLinkKind},
    };

    use super::*;

    #[test]
    fn a_veth_is_named_and_steerable() {
        let pn = PodAndNode::create().unwrap();
        let ifindex = pn.pod.ifindex("eth0").unwrap();
        let kind = pn
            .pod
            .run(|| of(&mut Rtnl::open().unwrap(), ifindex).unwrap())
            .unwrap();
        assert_eq!(kind.kind, "veth");
        assert_eq!(kind.to_string(), "veth");
        assert_eq!(kind.unsteerable_because(), None);
    }

    #[test]
    fn a_macvlan_child_is_named_with_its_mode_and_steerable() {
        let cluster = Cluster::create_with_first_pod(1, PodLinkKind::Macvlan).unwrap();
        let pod = &cluster.pods[0].ns;
        let ifindex = pod.ifindex("eth0").unwrap();
        let kind = pod
            .run(|| of(&mut Rtnl::open().unwrap(), ifindex).unwrap())
            .unwrap();
        assert_eq!(kind.to_string(), "macvlan (mode bridge)");
        assert_eq!(kind.unsteerable_because(), None);
    }

    #[test]
    fn a_link_without_ethernet_headers_is_unsteerable_and_says_why() {
        let kind = LinkKind {
            kind: "tun".into(),
            mode: None,
            link_layer: LinkLayerType::None,
            up: true,
        };
        assert_eq!(kind.to_string(), "tun");
        let why = kind.unsteerable_because().unwrap();
        assert!(why.contains("no Ethernet header"), "{why}");
        // Down, it receives nothing.
        let down = LinkKind { up: false, ..kind };
        assert_eq!(down.unsteerable_because(), None);
    }
}
