//! What kind of link each pod interface is (veth, netkit and its mode,
//! ipvlan, macvlan, ...), as `ambpf status` and the pod-kind tests name it.
//! Nothing of the eBPF mode hangs on a pod's interfaces, so every kind is
//! served alike; docs/architecture.md ("Pod interface kinds") has what was
//! verified on which kernel.

use std::fmt;

use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{
        InfoData, InfoIpVlan, InfoMacVlan, InfoNetkit, LinkAttribute, LinkFlags, LinkInfo,
        LinkLayerType, LinkMessage,
    },
};

use super::rtnl::{NetlinkError, Rtnl};

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
    fn a_veth_is_named() {
        let pn = PodAndNode::create().unwrap();
        let ifindex = pn.pod.ifindex("eth0").unwrap();
        let kind = pn
            .pod
            .run(|| of(&mut Rtnl::open().unwrap(), ifindex).unwrap())
            .unwrap();
        assert_eq!(kind.kind, "veth");
        assert_eq!(kind.to_string(), "veth");
        assert_eq!(kind.link_layer, LinkLayerType::Ether);
    }

    #[test]
    fn a_macvlan_child_is_named_with_its_mode() {
        let cluster = Cluster::create_with_first_pod(1, PodLinkKind::Macvlan).unwrap();
        let pod = &cluster.pods[0].ns;
        let ifindex = pod.ifindex("eth0").unwrap();
        let kind = pod
            .run(|| of(&mut Rtnl::open().unwrap(), ifindex).unwrap())
            .unwrap();
        assert_eq!(kind.to_string(), "macvlan (mode bridge)");
    }
}
