//! What a pod's network namespace holds: its cookie, interfaces and addresses.
//!
//! Everything here talks rtnetlink synchronously through [`Rtnl`], a netlink
//! socket opened on the calling thread. A socket belongs to the network
//! namespace of the thread that creates it, so the functions taking a
//! [`Netns`] open theirs inside [`Netns::run`]; nothing needs an async
//! runtime per namespace.
//!
//! [`Rtnl`] is shared with [`super::routing`]: requests carry a sequence
//! number and `NLM_F_ACK`, replies are matched on it, `NLMSG_ERROR` becomes a
//! typed [`NetlinkError`] (with the kernel's extended-ack text when it gives
//! one), and [`Rtnl::create`] / [`Rtnl::delete`] treat "already there" and
//! "already gone" as success so that callers are idempotent.

use std::{
    fmt, io,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::{Path, PathBuf},
};

use netlink_packet_core::{
    DecodeError, NLM_F_ACK, NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP, NLM_F_DUMP_INTR,
    NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope},
    link::{LinkAttribute, LinkFlags, LinkMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use nix::{errno::Errno, libc};

use crate::netns::{Netns, NetnsError};

/// `SO_NETNS_COOKIE` from `asm-generic/socket.h` (Linux 5.14): the 64-bit
/// cookie of the network namespace a socket belongs to. It is the value the
/// kernel programs read with `bpf_get_netns_cookie`, unique for the life of
/// the host (never reused, unlike an nsfs inode number).
pub const SO_NETNS_COOKIE: libc::c_int = 71;

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
    #[error("reading the network namespace cookie in {}: {source}", netns.display())]
    Cookie { netns: PathBuf, source: io::Error },
    #[error("{what} in {}: {source}", netns.display())]
    Netlink {
        what: &'static str,
        netns: PathBuf,
        source: NetlinkError,
    },
}

/// Reads `netns`: its cookie, its interfaces other than loopback and their
/// global addresses.
pub fn inspect(netns: &Netns) -> Result<PodNetwork, PodNetError> {
    let path = netns.path();
    netns.run(|| inspect_here(path))?
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

/// The cookie of the network namespace `socket` belongs to (the namespace of
/// the thread that created it, wherever the descriptor has travelled since).
/// Fails with `ENOPROTOOPT` before Linux 5.14.
pub fn socket_netns_cookie(socket: BorrowedFd<'_>) -> io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes and `len` holds the
    // size of `cookie`; the kernel writes at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != size_of::<u64>() {
        return Err(io::Error::other(format!(
            "SO_NETNS_COOKIE returned {len} bytes, expected 8"
        )));
    }
    Ok(cookie)
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
        source,
    })?;
    let addresses = dump_addresses(&mut rtnl).map_err(|source| PodNetError::Netlink {
        what: "listing addresses",
        netns: netns.to_owned(),
        source,
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

fn inspect_here(netns: &Path) -> Result<PodNetwork, PodNetError> {
    let netlink_err = |what| {
        let netns = netns.to_owned();
        move |source| PodNetError::Netlink {
            what,
            netns,
            source,
        }
    };
    let mut rtnl = Rtnl::open().map_err(netlink_err("opening a netlink route socket"))?;
    // The netlink socket was created on this thread, so it is in the namespace.
    let netns_cookie = cookie_of(rtnl.as_fd(), netns)?;
    let links = rtnl
        .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
        .map_err(netlink_err("listing interfaces"))?;
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

    let addrs = dump_addresses(&mut rtnl).map_err(netlink_err("listing addresses"))?;
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
        source: errno.into(),
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
                source,
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

// ---------------------------------------------------------------------------
// Synchronous rtnetlink requests.

/// A failed rtnetlink exchange.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("cannot open a netlink route socket: {0}")]
    Socket(#[source] io::Error),
    #[error("sending to the kernel: {0}")]
    Send(#[source] io::Error),
    #[error("receiving from the kernel: {0}")]
    Receive(#[source] io::Error),
    /// The kernel refused the request (`NLMSG_ERROR` with a negative code).
    #[error("{}", KernelRefusal { errno: *errno, detail: detail.as_deref() })]
    Kernel {
        errno: Errno,
        /// The kernel's extended-ack message, when it gave one.
        detail: Option<String>,
    },
    #[error("cannot decode the kernel's reply: {0}")]
    Decode(#[source] DecodeError),
    #[error("the kernel's reply of {len} bytes did not fit the {capacity}-byte buffer")]
    Truncated { len: usize, capacity: usize },
    #[error("the listing kept changing while it was read (NLM_F_DUMP_INTR {0} times)")]
    DumpInterrupted(u32),
}

impl NetlinkError {
    /// The errno the kernel answered with, if it refused the request.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            Self::Kernel { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

struct KernelRefusal<'a> {
    errno: Errno,
    detail: Option<&'a str>,
}

impl fmt::Display for KernelRefusal<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.errno.desc())?;
        match self.detail {
            Some(detail) => write!(f, " ({detail})"),
            None => Ok(()),
        }
    }
}

/// Whether an idempotent request changed anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The kernel made the change.
    Changed,
    /// The object was already there (create) or already gone (delete).
    AlreadyInPlace,
}

/// A `NETLINK_ROUTE` socket in the network namespace of the thread that
/// opened it, used one request at a time.
#[derive(Debug)]
pub struct Rtnl {
    socket: Socket,
    next_seq: u32,
    buf: Vec<u8>,
}

/// Receive buffer: the kernel fills dump datagrams up to about 32 KiB; a
/// larger one is reported as [`NetlinkError::Truncated`], never cut short.
const RECV_BUF_LEN: usize = 64 * 1024;
/// How often a dump the kernel marked inconsistent is restarted.
const DUMP_ATTEMPTS: u32 = 5;
/// `NLMSGERR_ATTR_MSG` from `linux/netlink.h`: the extended-ack text.
const NLMSGERR_ATTR_MSG: u16 = 1;

impl Rtnl {
    /// Opens a socket in the calling thread's network namespace, with
    /// extended acks (the kernel explains its refusals) and capped acks (it
    /// does not echo the request back).
    pub fn open() -> Result<Self, NetlinkError> {
        let mut socket = Socket::new(NETLINK_ROUTE).map_err(NetlinkError::Socket)?;
        socket.bind_auto().map_err(NetlinkError::Socket)?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(NetlinkError::Socket)?;
        // Both are conveniences: a kernel without them still answers.
        let _ = socket.set_ext_ack(true);
        let _ = socket.set_cap_ack(true);
        Ok(Self {
            socket,
            next_seq: 1,
            buf: vec![0; RECV_BUF_LEN],
        })
    }

    /// Sends `request` with `NLM_F_REQUEST | NLM_F_ACK | flags` and waits for
    /// the kernel's acknowledgement.
    pub fn execute(
        &mut self,
        request: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<(), NetlinkError> {
        let seq = self.send(request, NLM_F_REQUEST | NLM_F_ACK | flags)?;
        loop {
            let mut outcome = None;
            self.receive(seq, |msg| {
                if let NetlinkPayload::Error(err) = msg.payload {
                    outcome = Some(match err.code {
                        None => Ok(()),
                        Some(code) => Err(NetlinkError::Kernel {
                            errno: Errno::from_raw(-code.get()),
                            detail: extack_message(msg.header.flags, &err.header),
                        }),
                    });
                }
                // Anything else (an NLM_F_ECHO copy) is not the answer.
            })?;
            if let Some(outcome) = outcome {
                return outcome;
            }
        }
    }

    /// [`Self::execute`] for a creation (`flags` usually `NLM_F_CREATE |
    /// NLM_F_EXCL`): `EEXIST` means the object is already there.
    pub fn create(
        &mut self,
        request: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Applied, NetlinkError> {
        match self.execute(request, flags) {
            Ok(()) => Ok(Applied::Changed),
            Err(err) if err.errno() == Some(Errno::EEXIST) => Ok(Applied::AlreadyInPlace),
            Err(err) => Err(err),
        }
    }

    /// [`Self::execute`] for a deletion: `ENOENT` (no such rule) and `ESRCH`
    /// (no such route, or no such table) mean it is already gone.
    pub fn delete(&mut self, request: RouteNetlinkMessage) -> Result<Applied, NetlinkError> {
        match self.execute(request, 0) {
            Ok(()) => Ok(Applied::Changed),
            Err(err) if matches!(err.errno(), Some(Errno::ENOENT | Errno::ESRCH)) => {
                Ok(Applied::AlreadyInPlace)
            }
            Err(err) => Err(err),
        }
    }

    /// Sends `request` with `NLM_F_REQUEST | NLM_F_DUMP` and collects every
    /// message of the answer. A dump the kernel marks inconsistent (the table
    /// changed while it was read) is restarted.
    pub fn dump(
        &mut self,
        request: RouteNetlinkMessage,
    ) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
        for _ in 0..DUMP_ATTEMPTS {
            let seq = self.send(request.clone(), NLM_F_REQUEST | NLM_F_DUMP)?;
            let mut out = Vec::new();
            let mut interrupted = false;
            let mut end: Option<Result<(), NetlinkError>> = None;
            while end.is_none() {
                self.receive(seq, |msg| {
                    if msg.header.flags & NLM_F_DUMP_INTR != 0 {
                        interrupted = true;
                    }
                    match msg.payload {
                        NetlinkPayload::InnerMessage(inner) if end.is_none() => out.push(inner),
                        NetlinkPayload::Done(done) if done.code < 0 => {
                            end = Some(Err(NetlinkError::Kernel {
                                errno: Errno::from_raw(-done.code),
                                detail: None,
                            }));
                        }
                        NetlinkPayload::Done(_) => end = Some(Ok(())),
                        NetlinkPayload::Error(err) => {
                            end = Some(match err.code {
                                None => Ok(()),
                                Some(code) => Err(NetlinkError::Kernel {
                                    errno: Errno::from_raw(-code.get()),
                                    detail: extack_message(msg.header.flags, &err.header),
                                }),
                            });
                        }
                        _ => {}
                    }
                })?;
            }
            end.expect("loop ends with an outcome")?;
            if !interrupted {
                return Ok(out);
            }
        }
        Err(NetlinkError::DumpInterrupted(DUMP_ATTEMPTS))
    }

    fn send(&mut self, request: RouteNetlinkMessage, flags: u16) -> Result<u32, NetlinkError> {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1).max(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(request));
        msg.finalize();
        let mut bytes = vec![0; msg.buffer_len()];
        msg.serialize(&mut bytes);
        let sent = self.socket.send(&bytes, 0).map_err(NetlinkError::Send)?;
        if sent != bytes.len() {
            return Err(NetlinkError::Send(io::Error::other(format!(
                "sent {sent} of {} bytes",
                bytes.len()
            ))));
        }
        Ok(seq)
    }

    /// Reads one datagram and hands each message answering `seq` to `each`;
    /// messages answering anything else (a request abandoned after an error)
    /// are dropped.
    fn receive(
        &mut self,
        seq: u32,
        mut each: impl FnMut(NetlinkMessage<RouteNetlinkMessage>),
    ) -> Result<(), NetlinkError> {
        let capacity = self.buf.len();
        let len = loop {
            match self.socket.recv(&mut &mut self.buf[..], libc::MSG_TRUNC) {
                Ok(len) => break len,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(NetlinkError::Receive(err)),
            }
        };
        if len > capacity {
            return Err(NetlinkError::Truncated { len, capacity });
        }
        let mut rest = &self.buf[..len];
        while !rest.is_empty() {
            let msg_len = NetlinkBuffer::new_checked(rest)
                .map_err(NetlinkError::Decode)?
                .length() as usize;
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rest[..msg_len])
                .map_err(NetlinkError::Decode)?;
            if msg.header.sequence_number == seq {
                each(msg);
            }
            rest = &rest[msg_len.next_multiple_of(4).min(rest.len())..];
        }
        Ok(())
    }
}

impl AsFd for Rtnl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

/// The text of an extended ack: `payload` is what follows the error code
/// (the request's header, or the whole request when the ack is not capped),
/// then, when the kernel set `NLM_F_ACK_TLVS`, netlink attributes.
fn extack_message(reply_flags: u16, payload: &[u8]) -> Option<String> {
    if reply_flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    let request_len = if reply_flags & NLM_F_CAPPED != 0 {
        16
    } else {
        u32::from_ne_bytes(payload.get(..4)?.try_into().ok()?) as usize
    };
    let mut tlvs = payload.get(request_len.next_multiple_of(4)..)?;
    while tlvs.len() >= 4 {
        let len = u16::from_ne_bytes([tlvs[0], tlvs[1]]) as usize;
        let kind = u16::from_ne_bytes([tlvs[2], tlvs[3]]) & 0x3fff;
        if len < 4 || len > tlvs.len() {
            break;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let text = &tlvs[4..len];
            let text = text.split(|&b| b == 0).next().unwrap_or_default();
            return Some(String::from_utf8_lossy(text).into_owned());
        }
        tlvs = &tlvs[len.next_multiple_of(4).min(tlvs.len())..];
    }
    None
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use ambpf_testbed::{NetnsGuard, PodAndNode};

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
            source: NetlinkError::Kernel {
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

    #[test]
    fn refusals_are_typed_and_the_socket_stays_in_step() {
        let ns = NetnsGuard::create("rtnl").unwrap();
        ns.run(|| {
            let mut rtnl = Rtnl::open().unwrap();
            let links = rtnl
                .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
                .unwrap();
            assert_eq!(links.len(), 1, "only lo: {links:?}");
            // Deleting a link that does not exist: ENODEV, and the socket
            // still answers the next request with the right sequence number.
            let mut missing = LinkMessage::default();
            missing.header.index = 4242;
            let err = rtnl
                .execute(RouteNetlinkMessage::DelLink(missing), 0)
                .unwrap_err();
            assert_eq!(err.errno(), Some(Errno::ENODEV), "{err}");
            let again = rtnl
                .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
                .unwrap();
            let indexes = |msgs: &[RouteNetlinkMessage]| -> Vec<u32> {
                msgs.iter()
                    .filter_map(|msg| match msg {
                        RouteNetlinkMessage::NewLink(link) => Some(link.header.index),
                        _ => None,
                    })
                    .collect()
            };
            assert_eq!(indexes(&again), indexes(&links));
        })
        .unwrap();
    }
}
