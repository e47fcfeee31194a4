//! The kinds of link a pod's `eth0` can be, as CNI plugins make them: a veth
//! pair (most plugins), a netkit pair (Cilium 1.16 on), or an ipvlan or
//! macvlan child of a node device (Multus secondary networks).
//!
//! ```text
//!   veth, netkit:    pod eth0 ── vpod<n> / nkpod<n> (gateway addresses), node
//!   ipvlan, macvlan: pod eth0 ──┐
//!                    node lan<n> ┴ children of lower<n> (node), a veth for
//!                    the NIC whose wire's other end wire<n> is at the remote
//! ```
//!
//! The node's child `lan<n>` holds the gateway addresses.
//! An ipvlan or macvlan child cannot talk to its parent, so the node talks
//! to the pod through a child of its own, as a Multus node does. Every link
//! is made over rtnetlink (Debian 12's iproute2 cannot make netkit), inside
//! the cluster's namespaces only, and goes with them.
//!
//! A kind this kernel cannot make (no netkit, no ipvlan module) is reported
//! as [`io::ErrorKind::Unsupported`] with the kind's name and the kernel's
//! answer, found by trying, so that tests skip it by name.

use std::{fmt, fs::File, io, os::fd::AsRawFd};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{
        InfoData, InfoIpVlan, InfoKind, InfoMacVlan, InfoNetkit, IpVlanMode, LinkAttribute,
        LinkInfo, LinkMessage, MacVlanMode, NetkitMode, NetkitPolicy,
    },
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

#[allow(unused_imports)] // in the docs
use super::REMOTE;
use super::{Cluster, pod_addrs};
use crate::NetnsGuard;

/// What a pod's `eth0` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PodLinkKind {
    /// A veth pair, its peer `vpod<n>` on the node (what
    /// [`Cluster::create`] makes).
    Veth,
    /// A netkit pair in L3 mode (Cilium's default): no link-layer header,
    /// the primary `nkpod<n>` on the node.
    NetkitL3,
    /// A netkit pair in L2 mode: Ethernet frames.
    NetkitL2,
    /// An ipvlan child in L2 mode of the node's `lower<n>`.
    IpvlanL2,
    /// An ipvlan child in L3 mode: the node namespace routes its traffic.
    IpvlanL3,
    /// A macvlan child in bridge mode of the node's `lower<n>`.
    Macvlan,
}

impl PodLinkKind {
    pub const ALL: [Self; 6] = [
        Self::Veth,
        Self::NetkitL3,
        Self::NetkitL2,
        Self::IpvlanL2,
        Self::IpvlanL3,
        Self::Macvlan,
    ];

    /// The kind's name, as `ip -d link` shows it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Veth => "veth",
            Self::NetkitL3 => "netkit (l3)",
            Self::NetkitL2 => "netkit (l2)",
            Self::IpvlanL2 => "ipvlan (l2)",
            Self::IpvlanL3 => "ipvlan (l3)",
            Self::Macvlan => "macvlan (bridge)",
        }
    }
}

impl fmt::Display for PodLinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Cluster {
    /// A node with `pods` pods, pod 1's `eth0` a link of `kind`, the others
    /// veths. An [`io::ErrorKind::Unsupported`] error names a kind this
    /// kernel cannot make.
    pub fn create_with_first_pod(pods: u16, kind: PodLinkKind) -> io::Result<Self> {
        let mut cluster = Self::create(pods)?;
        if kind != PodLinkKind::Veth {
            cluster.relink_pod(0, kind)?;
        }
        Ok(cluster)
    }

    /// Gives pod `i` (0-based), a veth pod, a new `eth0` of `kind` in its
    /// namespace, with the same addresses, gateway and routes.
    pub fn relink_pod(&mut self, i: usize, kind: PodLinkKind) -> io::Result<()> {
        let n = self.tear_down_network(i)?;
        let pod = &self.pods[i].ns;
        if kind == PodLinkKind::Veth {
            return self.connect_pods(&[(n, pod)]);
        }
        let pod_netns = File::open(pod.path())?;
        let node_side = match kind {
            PodLinkKind::Veth => unreachable!("handled above"),
            PodLinkKind::NetkitL3 | PodLinkKind::NetkitL2 => {
                let primary = format!("nkpod{n}");
                let mode = if kind == PodLinkKind::NetkitL3 {
                    NetkitMode::L3
                } else {
                    NetkitMode::L2
                };
                new_link(&self.node, netkit(&primary, mode, &pod_netns))
                    .map_err(unsupported(kind))?;
                primary
            }
            PodLinkKind::IpvlanL2 | PodLinkKind::IpvlanL3 | PodLinkKind::Macvlan => {
                self.connect_as_child(n, kind, &pod_netns)?
            }
        };
        self.address_pod_link(n, pod, &node_side)
    }

    /// Pod `n`'s `eth0` as an ipvlan or macvlan child of a new parent
    /// `lower<n>`, and the node's own child `lan<n>`, which it returns.
    fn connect_as_child(&self, n: u16, kind: PodLinkKind, pod_netns: &File) -> io::Result<String> {
        let lower = format!("lower{n}");
        let child = format!("lan{n}");
        // The parent stands in for the node's NIC: one end of a veth
        // pair (kernels without `dummy` still have veth) whose other
        // end is on the off-node network, in the remote's namespace.
        let wire = format!("wire{n}");
        self.node.ip(&[
            "link",
            "add",
            &lower,
            "type",
            "veth",
            "peer",
            "name",
            &wire,
            "netns",
            self.remote.ns.name(),
        ])?;
        self.remote.ns.ip(&["link", "set", &wire, "up"])?;
        self.node.ip(&["link", "set", &lower, "up"])?;
        if kind == PodLinkKind::IpvlanL3 {
            self.uplink_through(&lower, &wire, n)?;
        }
        let lower_index = self.node.ifindex(&lower)?;
        let data = match kind {
            PodLinkKind::IpvlanL2 => InfoData::IpVlan(vec![InfoIpVlan::Mode(IpVlanMode::L2)]),
            PodLinkKind::IpvlanL3 => InfoData::IpVlan(vec![InfoIpVlan::Mode(IpVlanMode::L3)]),
            _ => InfoData::MacVlan(vec![InfoMacVlan::Mode(MacVlanMode::Bridge)]),
        };
        let info_kind = if kind == PodLinkKind::Macvlan {
            InfoKind::MacVlan
        } else {
            InfoKind::IpVlan
        };
        for (name, netns) in [(child.as_str(), None), ("eth0", Some(&pod_netns))] {
            let mut msg = named(name);
            msg.attributes.push(LinkAttribute::Link(lower_index));
            if let Some(netns) = netns {
                msg.attributes
                    .push(LinkAttribute::NetNsFd(netns.as_raw_fd()));
            }
            msg.attributes.push(LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(info_kind.clone()),
                LinkInfo::Data(data.clone()),
            ]));
            new_link(&self.node, msg).map_err(unsupported(kind))?;
        }
        Ok(child)
    }

    /// An ipvlan child in L3 mode sends what is not for another child out
    /// of its parent, routed in the parent's namespace with the parent as
    /// the outgoing device, as through the node's NIC onto its network. So
    /// the parent `lower` and its wire's other end `wire` (at the remote)
    /// get addresses, and the node a route to the remote through `wire`
    /// behind its own (metric 0) through `vremote`. The remote answers
    /// through the node, as to any pod.
    fn uplink_through(&self, lower: &str, wire: &str, n: u16) -> io::Result<()> {
        let (lower_v4, wire_v4) = (format!("10.243.{n}.2"), format!("10.243.{n}.1"));
        let (lower_v6, wire_v6) = (format!("fd00:c:{n:x}::2"), format!("fd00:c:{n:x}::1"));
        crate::ip_batch(
            Some(self.remote.ns.name()),
            &[
                format!("addr add {wire_v4}/24 dev {wire}"),
                format!("addr add {wire_v6}/64 dev {wire} nodad"),
            ],
        )?;
        crate::ip_batch(
            Some(self.node.name()),
            &[
                format!("addr add {lower_v4}/24 dev {lower}"),
                format!("addr add {lower_v6}/64 dev {lower} nodad"),
                format!("route add {REMOTE_NET_V4}/24 via {wire_v4} dev {lower} metric 2000"),
                format!("route add {REMOTE_NET_V6}/64 via {wire_v6} dev {lower} metric 2000"),
            ],
        )
    }

    /// Addresses and routes on both ends of pod `n`'s new link; neighbours
    /// are learnt (one pod's few entries).
    fn address_pod_link(&self, n: u16, pod: &NetnsGuard, node_side: &str) -> io::Result<()> {
        let (addrs, gw) = pod_addrs(n);
        crate::ip_batch(
            Some(self.node.name()),
            &[
                format!("addr add {}/24 dev {node_side}", gw.v4),
                format!("addr add {}/64 dev {node_side} nodad", gw.v6),
                format!("link set {node_side} up"),
            ],
        )?;
        crate::ip_batch(
            Some(pod.name()),
            &[
                "link set lo up".to_owned(),
                format!("addr add {}/24 dev eth0", addrs.v4),
                format!("addr add {}/64 dev eth0 nodad", addrs.v6),
                "link set eth0 up".to_owned(),
                format!("route add default via {}", gw.v4),
                format!("route add default via {}", gw.v6),
            ],
        )
    }
}

/// Maps the kernel's answer for a kind it cannot make (`EOPNOTSUPP`: no
/// such link kind, nor a module for it) to [`io::ErrorKind::Unsupported`],
/// naming the kind.
/// The remote client's subnets (its address is [`REMOTE`]).
const REMOTE_NET_V4: &str = "10.245.0.0";
const REMOTE_NET_V6: &str = "fd00:b::";

fn unsupported(kind: PodLinkKind) -> impl Fn(io::Error) -> io::Error {
    move |e| {
        if e.raw_os_error() == Some(nix::libc::EOPNOTSUPP) {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!("this kernel cannot make a link of kind {kind}: {e}"),
            )
        } else {
            io::Error::new(e.kind(), format!("making a link of kind {kind}: {e}"))
        }
    }
}

fn named(name: &str) -> LinkMessage {
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.into()));
    msg
}

/// A netkit pair: the primary `primary` where the request is made, its peer
/// `eth0` in `pod_netns`, both forwarding (no program attached).
fn netkit(primary: &str, mode: NetkitMode, pod_netns: &File) -> LinkMessage {
    let mut peer = named("eth0");
    peer.attributes
        .push(LinkAttribute::NetNsFd(pod_netns.as_raw_fd()));
    let mut msg = named(primary);
    msg.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Netkit),
        LinkInfo::Data(InfoData::Netkit(vec![
            InfoNetkit::Mode(mode),
            InfoNetkit::Policy(NetkitPolicy::Pass),
            InfoNetkit::PeerPolicy(NetkitPolicy::Pass),
            InfoNetkit::Peer(peer),
        ])),
    ]));
    msg
}

/// `RTM_NEWLINK` with `msg`, made from inside `ns` (`NLM_F_EXCL`: a new
/// link), failing with the kernel's errno.
fn new_link(ns: &NetnsGuard, msg: LinkMessage) -> io::Result<()> {
    ns.run(|| {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
        header.sequence_number = 1;
        let mut request = NetlinkMessage::new(
            header,
            NetlinkPayload::from(RouteNetlinkMessage::NewLink(msg)),
        );
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        socket.send(&bytes, 0)?;
        let mut buf = vec![0; 16 * 1024];
        loop {
            let len = socket.recv(&mut &mut buf[..], 0)?;
            let mut rest = &buf[..len];
            while !rest.is_empty() {
                let invalid = |e: netlink_packet_core::DecodeError| {
                    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
                };
                let msg_len = NetlinkBuffer::new_checked(rest).map_err(invalid)?.length() as usize;
                let answer = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rest[..msg_len])
                    .map_err(invalid)?;
                if let NetlinkPayload::Error(err) = answer.payload {
                    return match err.code {
                        None => Ok(()),
                        Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                    };
                }
                rest = &rest[msg_len.next_multiple_of(4).min(rest.len())..];
            }
        }
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tests::assert_reachable;

    #[test]
    fn every_kind_this_kernel_makes_reaches_the_remote_and_the_node() {
        for kind in PodLinkKind::ALL {
            let cluster = match Cluster::create_with_first_pod(2, kind) {
                Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                    eprintln!("skipping {kind}: {e}");
                    continue;
                }
                other => other.unwrap_or_else(|e| panic!("{kind}: {e}")),
            };
            assert_reachable(&cluster, 0);
            assert_reachable(&cluster, 1);
        }
    }
}
