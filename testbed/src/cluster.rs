//! A node with pods and an off-node client, each in its own namespace, for
//! traffic tests of the redirection.
//!
//! ```text
//!   pod i (eth0 10.244.i.2, fd00:a:i::2) ── vpod<i> (10.244.i.1, fd00:a:i::1) ┐
//!                                                                     node (forwards)
//!   remote (eth0 10.245.0.2, fd00:b::2) ── vremote (10.245.0.1, fd00:b::1)   ┘
//! ```
//! Every namespace routes through the node, so a pod reaches the remote
//! client and other pods via the node, as on a real node.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::{Addrs, Link, NetnsGuard};

#[derive(Debug)]
pub struct Pod {
    pub ns: NetnsGuard,
    pub addrs: Addrs,
}

impl Pod {
    pub fn ips(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.addrs.v4), IpAddr::V6(self.addrs.v6)]
    }
}

#[derive(Debug)]
pub struct Cluster {
    // Field order is drop order: leaves before the node.
    pub pods: Vec<Pod>,
    pub remote: Pod,
    pub node: NetnsGuard,
    _links: Vec<Link>,
}

fn pod_addrs(i: u8) -> (Addrs, Addrs) {
    let pod = Addrs {
        v4: Ipv4Addr::new(10, 244, i, 2),
        v6: Ipv6Addr::new(0xfd00, 0xa, u16::from(i), 0, 0, 0, 0, 2),
    };
    let gw = Addrs {
        v4: Ipv4Addr::new(10, 244, i, 1),
        v6: Ipv6Addr::new(0xfd00, 0xa, u16::from(i), 0, 0, 0, 0, 1),
    };
    (pod, gw)
}

const REMOTE: Addrs = Addrs {
    v4: Ipv4Addr::new(10, 245, 0, 2),
    v6: Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, 2),
};
const REMOTE_GW: Addrs = Addrs {
    v4: Ipv4Addr::new(10, 245, 0, 1),
    v6: Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, 1),
};

impl Cluster {
    /// A node with `pods` pods (at most 200) and one remote client.
    pub fn create(pods: u8) -> io::Result<Self> {
        let node = NetnsGuard::create("node")?;
        for sysctl in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
            node.sysctl(sysctl)?;
        }
        let mut links = Vec::new();
        let remote_ns = NetnsGuard::create("remote")?;
        links.push(Link::veth(
            &remote_ns, "eth0", REMOTE, &node, "vremote", REMOTE_GW,
        )?);
        route_via(&remote_ns, REMOTE_GW)?;
        let remote = Pod {
            ns: remote_ns,
            addrs: REMOTE,
        };

        let mut all = Vec::new();
        for i in 0..pods {
            let (addrs, gw) = pod_addrs(i + 1);
            let ns = NetnsGuard::create("pod")?;
            links.push(Link::veth(
                &ns,
                "eth0",
                addrs,
                &node,
                &format!("vpod{}", i + 1),
                gw,
            )?);
            route_via(&ns, gw)?;
            all.push(Pod { ns, addrs });
        }
        Ok(Self {
            pods: all,
            remote,
            node,
            _links: links,
        })
    }

    /// The node's own addresses (what a node agent sees in the host netns).
    pub fn node_addresses(&self) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = vec![IpAddr::V4(REMOTE_GW.v4), IpAddr::V6(REMOTE_GW.v6)];
        for i in 0..self.pods.len() as u8 {
            let (_, gw) = pod_addrs(i + 1);
            out.extend([IpAddr::V4(gw.v4), IpAddr::V6(gw.v6)]);
        }
        out
    }
}

fn route_via(ns: &NetnsGuard, gw: Addrs) -> io::Result<()> {
    ns.ip(&["route", "add", "default", "via", &gw.v4.to_string()])?;
    ns.ip(&["-6", "route", "add", "default", "via", &gw.v6.to_string()])
}
