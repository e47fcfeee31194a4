//! What a pod's network namespace holds: its cookie, interfaces and addresses.
//!
//! Everything here talks rtnetlink synchronously through [`Rtnl`], a netlink
//! socket opened on the calling thread. A socket belongs to the network
//! namespace of the thread that creates it, so the functions taking a
//! [`Netns`] open theirs inside [`Netns::run`]; nothing needs an async
//! runtime per namespace.
//!
//! [`Rtnl`] ([`super::rtnl`]) is shared with [`super::routing`] and
//! [`super::steering`].

use std::{
    io,
    net::IpAddr,
    os::fd::{AsFd, BorrowedFd},
    path::{Path, PathBuf},
};

use netlink_packet_route::{
    RouteNetlinkMessage,
    address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope},
    link::{LinkAttribute, LinkFlags, LinkMessage},
};
use nix::libc;

pub use super::rtnl::{Applied, NetlinkError, Rtnl};
use crate::netns::{Netns, NetnsError};

/// Where [`host_addresses`] and [`netns_cookie_of_current_thread`] look: the
/// namespace of the calling thread, named the way errors show it.
const CURRENT_THREAD_NETNS: &str = "/proc/thread-self/ns/net";

/// What one pod's network namespace holds, as the redirection needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodNetwork {
    /// The namespace's cookie (see [`SO_NETNS_COOKIE`]): the key the kernel
    /// programs use to find the pod.
    pub netns_cookie: u64,
    /// Every interface except loopback, by ascending index.
    pub interfaces: Vec<Interface>,
    /// Every global-scope IPv4 and IPv6 address on [`Self::interfaces`]:
    /// no loopback, no link-local (169.254/16, fe80::/10) and no address whose
    /// duplicate address detection failed. Tentative IPv6 addresses (DAD
    /// still running) are included, since they become the pod's. Each address
    /// appears once, in the kernel's order (IPv4 first).
    pub addresses: Vec<IpAddr>,
}

/// A network interface inside a namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Interface {
    pub name: String,
    pub index: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum PodNetError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(
        "reading the network namespace cookie in {}: this kernel has no SO_NETNS_COOKIE \
         (needs Linux 5.14 or later)",
        netns.display()
    )]
    CookieUnsupported { netns: PathBuf },
    #[error("reading the network namespace cookie in {}: {cause}", netns.display())]
    Cookie { netns: PathBuf, cause: io::Error },
    #[error("{what} in {}: {cause}", netns.display())]
    Netlink {
        what: &'static str,
        netns: PathBuf,
        cause: NetlinkError,
    },
}

/// Reads `netns`: its cookie, its interfaces other than loopback and their
/// global addresses.
pub fn inspect(netns: &Netns) -> Result<PodNetwork, PodNetError> {
    let path = netns.path();
    let net = netns.run(|| inspect_here(path))??;
    // From here on, the lines of the pod's span (an enrolment) carry its
    // cookie.
    tracing::Span::current().record("netns_cookie", net.netns_cookie);
    Ok(net)
}

/// The cookie of `netns` (see [`SO_NETNS_COOKIE`]).
pub fn netns_cookie(netns: &Netns) -> Result<u64, PodNetError> {
    let path = netns.path();
    netns.run(|| cookie_here(path))?
}

/// The cookie of the network namespace the calling thread is in.
pub fn netns_cookie_of_current_thread() -> Result<u64, PodNetError> {
    cookie_here(Path::new(CURRENT_THREAD_NETNS))
}

pub use crate::netns::{SO_NETNS_COOKIE, socket_netns_cookie};

/// The host's network namespaces, listed once on first need (a scan of
/// every process): where a pod known only by a record or a map entry is
/// found. By inode, confirmed by cookie, as an inode is reused once its
/// namespace is freed.
#[derive(Default)]
pub struct HostNamespaces {
    by_inode: std::cell::OnceCell<std::collections::HashMap<u64, Netns>>,
}

impl HostNamespaces {
    /// The namespace of the pod `key`, when it is still there.
    pub fn find(&self, key: super::PodKey) -> Option<&Netns> {
        self.listed()
            .get(&key.netns_inode)
            .filter(|ns| netns_cookie(ns).ok() == Some(key.netns_cookie))
    }

    /// [`Self::find`], handed over.
    pub fn take(&mut self, key: super::PodKey) -> Option<Netns> {
        self.listed();
        let by_inode = self.by_inode.get_mut()?;
        let netns = by_inode.remove(&key.netns_inode)?;
        (netns_cookie(&netns).ok() == Some(key.netns_cookie)).then_some(netns)
    }

    fn listed(&self) -> &std::collections::HashMap<u64, Netns> {
        self.by_inode.get_or_init(|| {
            crate::netns::all()
                .into_iter()
                .map(|ns| (ns.inode(), ns))
                .collect()
        })
    }
}

/// Every address of the network namespace the calling thread is in, on any
/// interface (loopback included: nodes often hold service or BGP addresses on
/// `lo`) and of any scope, except host-scope and loopback addresses, IPv6
/// link-local ones and addresses whose duplicate address detection failed.
/// The agent calls this from its own namespace for the node's addresses.
pub fn host_addresses() -> Result<Vec<IpAddr>, PodNetError> {
    let netns = Path::new(CURRENT_THREAD_NETNS);
    let mut rtnl = Rtnl::open().map_err(|source| PodNetError::Netlink {
        what: "opening a netlink route socket",
        netns: netns.to_owned(),
        cause: source,
    })?;
    let addresses = dump_addresses(&mut rtnl).map_err(|source| PodNetError::Netlink {
        what: "listing addresses",
        netns: netns.to_owned(),
        cause: source,
    })?;
    let mut out = Vec::new();
    for addr in &addresses {
        let Some(ip) = address_of(addr) else { continue };
        let scope = addr.header.scope;
        if matches!(scope, AddressScope::Host | AddressScope::Nowhere)
            || ip.is_loopback()
            || is_ipv6_link_local(ip)
            || dad_failed(addr)
        {
            continue;
        }
        push_unique(&mut out, ip);
    }
    Ok(out)
}

/// [`inspect`] from a thread already in the namespace (named `netns` in
/// errors).
pub fn inspect_here(netns: &Path) -> Result<PodNetwork, PodNetError> {
    inspect_with(&mut open_rtnl(netns)?, netns)
}

/// A netlink route socket in the calling thread's namespace (`netns` in
/// errors).
pub fn open_rtnl(netns: &Path) -> Result<Rtnl, PodNetError> {
    Rtnl::open().map_err(|source| PodNetError::Netlink {
        what: "opening a netlink route socket",
        netns: netns.to_owned(),
        cause: source,
    })
}

/// [`inspect_here`] through `rtnl`, a socket opened in the namespace, which
/// the rest of an enrolment goes on using (one socket per visit).
pub fn inspect_with(rtnl: &mut Rtnl, netns: &Path) -> Result<PodNetwork, PodNetError> {
    let netlink_err = |what| {
        let netns = netns.to_owned();
        move |source| PodNetError::Netlink {
            what,
            netns,
            cause: source,
        }
    };
    // The netlink socket was created in the namespace, so its cookie is the
    // namespace's.
    let netns_cookie = cookie_of(rtnl.as_fd(), netns)?;
    let interfaces = interfaces(rtnl).map_err(netlink_err("listing interfaces"))?;

    let addrs = dump_addresses(rtnl).map_err(netlink_err("listing addresses"))?;
    let mut addresses = Vec::new();
    for addr in &addrs {
        if !interfaces.iter().any(|i| i.index == addr.header.index) {
            continue;
        }
        let Some(ip) = address_of(addr) else { continue };
        if addr.header.scope != AddressScope::Universe
            || ip.is_loopback()
            || is_link_local(ip)
            || dad_failed(addr)
        {
            continue;
        }
        push_unique(&mut addresses, ip);
    }
    Ok(PodNetwork {
        netns_cookie,
        interfaces,
        addresses,
    })
}

/// The interfaces other than loopback of the namespace `rtnl` is in, by
/// ascending index.
pub fn interfaces(rtnl: &mut Rtnl) -> Result<Vec<Interface>, NetlinkError> {
    let links = rtnl.dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))?;
    let mut interfaces: Vec<Interface> = links
        .into_iter()
        .filter_map(|msg| match msg {
            RouteNetlinkMessage::NewLink(link) => Some(link),
            _ => None,
        })
        .filter(|link| !link.header.flags.contains(LinkFlags::Loopback))
        .map(|link| Interface {
            index: link.header.index,
            name: link
                .attributes
                .iter()
                .find_map(|attr| match attr {
                    LinkAttribute::IfName(name) => Some(name.clone()),
                    _ => None,
                })
                .unwrap_or_default(),
        })
        .collect();
    interfaces.sort_by_key(|iface| iface.index);
    Ok(interfaces)
}

fn cookie_here(netns: &Path) -> Result<u64, PodNetError> {
    // Any socket will do; a unix one needs no protocol family configured.
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|errno| PodNetError::Cookie {
        netns: netns.to_owned(),
        cause: errno.into(),
    })?;
    cookie_of(socket.as_fd(), netns)
}

fn cookie_of(socket: BorrowedFd<'_>, netns: &Path) -> Result<u64, PodNetError> {
    socket_netns_cookie(socket).map_err(|source| {
        if source.raw_os_error() == Some(libc::ENOPROTOOPT) {
            PodNetError::CookieUnsupported {
                netns: netns.to_owned(),
            }
        } else {
            PodNetError::Cookie {
                netns: netns.to_owned(),
                cause: source,
            }
        }
    })
}

fn dump_addresses(rtnl: &mut Rtnl) -> Result<Vec<AddressMessage>, NetlinkError> {
    Ok(rtnl
        .dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))?
        .into_iter()
        .filter_map(|msg| match msg {
            RouteNetlinkMessage::NewAddress(addr) => Some(addr),
            _ => None,
        })
        .collect())
}

/// The interface's own address: `IFA_LOCAL` where present (on IPv4
/// point-to-point links `IFA_ADDRESS` is the peer), else `IFA_ADDRESS`.
fn address_of(msg: &AddressMessage) -> Option<IpAddr> {
    let local = msg.attributes.iter().find_map(|attr| match attr {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        msg.attributes.iter().find_map(|attr| match attr {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

fn dad_failed(msg: &AddressMessage) -> bool {
    msg.attributes.iter().any(|attr| {
        matches!(attr, AddressAttribute::Flags(flags) if flags.contains(AddressFlags::Dadfailed))
    })
}

fn is_ipv6_link_local(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

fn push_unique(out: &mut Vec<IpAddr>, ip: IpAddr) {
    if !out.contains(&ip) {
        out.push(ip);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use ambpf_testbed::{NetnsGuard, PodAndNode};
    use nix::errno::Errno;

    use super::*;

    fn open(guard: &NetnsGuard) -> Netns {
        Netns::open(guard.path().to_str().unwrap()).unwrap()
    }

    #[test]
    fn inspect_finds_the_pod_interface_and_its_global_addresses() {
        let pn = PodAndNode::create().unwrap();
        let pod = open(&pn.pod);
        let net = inspect(&pod).unwrap();

        let eth0_index = pn
            .pod
            .run(|| nix::net::if_::if_nametoindex("eth0").unwrap())
            .unwrap();
        assert_eq!(
            net.interfaces,
            vec![Interface {
                name: "eth0".into(),
                index: eth0_index
            }]
        );
        // Not the IPv6 link-local address eth0 also has, nor lo's.
        assert_eq!(
            net.addresses,
            vec![
                IpAddr::V4(PodAndNode::POD.v4),
                IpAddr::V6(PodAndNode::POD.v6)
            ]
        );
        assert_ne!(net.netns_cookie, 0);
    }

    #[test]
    fn cookies_identify_namespaces() {
        let pn = PodAndNode::create().unwrap();
        let (pod, node) = (open(&pn.pod), open(&pn.node));
        let pod_cookie = inspect(&pod).unwrap().netns_cookie;
        let node_cookie = inspect(&node).unwrap().netns_cookie;
        assert_ne!(pod_cookie, 0);
        assert_ne!(pod_cookie, node_cookie);
        assert_eq!(netns_cookie(&pod).unwrap(), pod_cookie);

        // A socket made in the pod carries the pod's cookie, and keeps it
        // outside the namespace.
        let socket = pn
            .pod
            .run(|| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .unwrap();
        assert_eq!(socket_netns_cookie(socket.as_fd()).unwrap(), pod_cookie);
        let seen_inside = pn
            .pod
            .run(|| netns_cookie_of_current_thread().unwrap())
            .unwrap();
        assert_eq!(seen_inside, pod_cookie);
        // This thread is elsewhere.
        assert_ne!(netns_cookie_of_current_thread().unwrap(), pod_cookie);
    }

    #[test]
    fn namespace_with_only_loopback_has_no_interfaces_or_addresses() {
        let ns = NetnsGuard::create("lo").unwrap();
        let net = inspect(&open(&ns)).unwrap();
        assert!(net.interfaces.is_empty(), "{net:?}");
        assert!(net.addresses.is_empty(), "{net:?}");
        assert_ne!(net.netns_cookie, 0);
    }

    #[test]
    fn host_addresses_skip_loopback_and_ipv6_link_local() {
        let pn = PodAndNode::create().unwrap();
        // A global address on lo counts; a link-scope IPv4 address counts too.
        pn.node
            .ip(&["addr", "add", "192.0.2.7/32", "dev", "lo"])
            .unwrap();
        pn.node
            .ip(&[
                "addr",
                "add",
                "169.254.7.127/32",
                "dev",
                "veth-pod",
                "scope",
                "link",
            ])
            .unwrap();
        let addrs = pn.node.run(|| host_addresses().unwrap()).unwrap();
        let mut sorted = addrs.clone();
        sorted.sort();
        let mut expected = vec![
            IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)),
            IpAddr::V4(Ipv4Addr::new(169, 254, 7, 127)),
            IpAddr::V4(PodAndNode::NODE.v4),
            IpAddr::V6(PodAndNode::NODE.v6),
        ];
        expected.sort();
        assert_eq!(sorted, expected, "{addrs:?}");
        assert!(!addrs.contains(&IpAddr::V6(Ipv6Addr::LOCALHOST)));
    }

    #[test]
    fn errors_name_the_namespace() {
        let err = PodNetError::Netlink {
            what: "listing interfaces",
            netns: "/run/netns/x".into(),
            cause: NetlinkError::Kernel {
                errno: Errno::EPERM,
                detail: None,
            },
        };
        assert_eq!(
            err.to_string(),
            "listing interfaces in /run/netns/x: Operation not permitted"
        );
        let err = PodNetError::CookieUnsupported {
            netns: "/run/netns/x".into(),
        };
        assert!(err.to_string().contains("Linux 5.14"), "{err}");
    }
}
