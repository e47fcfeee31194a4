//! The host's probe ipsets over netlink, in process, as Istio's node agent
//! writes them (`cni/pkg/ipset`): no `ipset` process per pod.
//!
//! ipset's netlink protocol is nfnetlink subsystem 6 (`ip_set.h`): a
//! request is a netlink header, an `nfgenmsg`, and attributes, some nested
//! (`IPSET_ATTR_DATA` holds an element's address and comment). Without
//! `NLM_F_EXCL` the kernel treats an existing set or member as success, as
//! `ipset -exist` does (and rewrites the member's comment). The socket is
//! opened in the host's namespace and stays bound to it.

use std::{io, net::IpAddr};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::netns::{Netns, NetnsError};

const NFNL_SUBSYS_IPSET: u16 = 6;
const NFNETLINK_V0: u8 = 0;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;

const IPSET_CMD_CREATE: u16 = 2;
const IPSET_CMD_DESTROY: u16 = 3;
const IPSET_CMD_LIST: u16 = 7;
const IPSET_CMD_ADD: u16 = 9;
const IPSET_CMD_DEL: u16 = 10;

/// The oldest protocol version the kernel accepts (Linux 3.x onwards);
/// everything asked here exists in it.
const IPSET_PROTOCOL: u8 = 6;

// Command-level attributes.
const ATTR_PROTOCOL: u16 = 1;
const ATTR_SETNAME: u16 = 2;
const ATTR_TYPENAME: u16 = 3;
const ATTR_REVISION: u16 = 4;
const ATTR_FAMILY: u16 = 5;
const ATTR_DATA: u16 = 7;
const ATTR_ADT: u16 = 8;
// Attributes inside DATA.
const ATTR_IP: u16 = 1;
const ATTR_CADT_FLAGS: u16 = 8;
const ATTR_COMMENT: u16 = 26;
// Inside IP.
const ATTR_IPADDR_IPV4: u16 = 1;
const ATTR_IPADDR_IPV6: u16 = 2;

const IPSET_FLAG_WITH_COMMENTS: u32 = 1 << 4;
/// hash:ip's first revision with comments (every kernel since 3.10 has it).
const HASH_IP_REVISION: u8 = 2;

const NLA_F_NESTED: u16 = 1 << 15;
const NLA_F_NET_BYTEORDER: u16 = 1 << 14;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_MULTI: u16 = 0x2;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;

/// Room for one datagram: the kernel fills a dump's up to a page (or 8 KiB).
const RECEIVE_BUFFER: usize = 64 * 1024;

/// The first of ipset's own error numbers (`IPSET_ERR_PRIVATE`).
const IPSET_ERR_PRIVATE: i32 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum IpsetError {
    #[error("opening a netfilter netlink socket in {netns}: {cause}")]
    Socket { netns: String, cause: io::Error },
    #[error("entering {0}")]
    Netns(#[from] NetnsError),
    #[error("ipset {command} {set}: {cause}")]
    Request {
        command: &'static str,
        set: String,
        cause: io::Error,
    },
    #[error("ipset {command} {set}: the kernel answered {why}")]
    Refused {
        command: &'static str,
        set: String,
        why: String,
    },
    #[error("ipset list {set}: an undecodable answer ({why})")]
    Garbled { set: String, why: String },
}

/// One member of a set: its address and comment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub address: IpAddr,
    pub comment: Option<String>,
}

/// A netfilter netlink socket in one namespace.
pub struct IpsetSocket {
    socket: Socket,
    seq: u32,
    netns: String,
}

impl std::fmt::Debug for IpsetSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpsetSocket")
            .field("netns", &self.netns)
            .finish()
    }
}

impl IpsetSocket {
    /// A socket in `netns` (it stays bound to the namespace it was made in).
    pub fn open(netns: &Netns) -> Result<Self, IpsetError> {
        let name = netns.path().display().to_string();
        let socket = netns
            .run(|| {
                let mut socket = Socket::new(NETLINK_NETFILTER)?;
                socket.bind_auto()?;
                socket.connect(&SocketAddr::new(0, 0))?;
                Ok::<_, io::Error>(socket)
            })?
            .map_err(|cause| IpsetError::Socket {
                netns: name.clone(),
                cause,
            })?;
        Ok(Self {
            socket,
            seq: 0,
            netns: name,
        })
    }

    /// `ipset create -exist <set> hash:ip family <v4|v6> comment`.
    pub fn create_hash_ip(&mut self, set: &str, ipv6: bool) -> Result<(), IpsetError> {
        let mut data = Attrs::default();
        data.u32_be(ATTR_CADT_FLAGS, IPSET_FLAG_WITH_COMMENTS);
        let mut attrs = Attrs::for_set(set);
        attrs.string(ATTR_TYPENAME, "hash:ip");
        attrs.u8(ATTR_REVISION, HASH_IP_REVISION);
        attrs.u8(ATTR_FAMILY, if ipv6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 });
        attrs.nested(ATTR_DATA, &data);
        self.ack("create", set, IPSET_CMD_CREATE, &attrs)
    }

    /// `ipset destroy <set>`; a missing set is not an error.
    pub fn destroy(&mut self, set: &str) -> Result<(), IpsetError> {
        match self.ack("destroy", set, IPSET_CMD_DESTROY, &Attrs::for_set(set)) {
            Err(IpsetError::Refused { why, .. }) if why.contains("does not exist") => Ok(()),
            other => other,
        }
    }

    /// `ipset add -exist <set> <address> comment <comment>`.
    pub fn add(&mut self, set: &str, address: IpAddr, comment: &str) -> Result<(), IpsetError> {
        let mut data = element(address);
        data.string(ATTR_COMMENT, comment);
        let mut attrs = Attrs::for_set(set);
        attrs.nested(ATTR_DATA, &data);
        self.ack("add", set, IPSET_CMD_ADD, &attrs)
    }

    /// `ipset del -exist <set> <address>`.
    pub fn del(&mut self, set: &str, address: IpAddr) -> Result<(), IpsetError> {
        let mut attrs = Attrs::for_set(set);
        attrs.nested(ATTR_DATA, &element(address));
        self.ack("del", set, IPSET_CMD_DEL, &attrs)
    }

    /// Whether `set` exists.
    pub fn exists(&mut self, set: &str) -> Result<bool, IpsetError> {
        match self.list(set) {
            Ok(_) => Ok(true),
            Err(IpsetError::Refused { why, .. }) if why.contains("does not exist") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The members of `set` (`ipset save <set>`).
    pub fn list(&mut self, set: &str) -> Result<Vec<Member>, IpsetError> {
        let seq = self.send(
            "list",
            set,
            IPSET_CMD_LIST,
            NLM_F_DUMP,
            &Attrs::for_set(set),
        )?;
        let mut members = Vec::new();
        loop {
            let datagram = self.receive("list", set)?;
            for message in Messages::new(&datagram) {
                let message = message.map_err(|why| garbled(set, why))?;
                if message.seq != seq {
                    continue;
                }
                match message.kind {
                    NLMSG_DONE => return Ok(members),
                    NLMSG_ERROR => {
                        check_error("list", set, message.payload)?;
                        return Ok(members);
                    }
                    _ => {
                        let attrs = message
                            .payload
                            .get(4..)
                            .ok_or_else(|| garbled(set, "no nfgenmsg"))?;
                        members.extend(listed_members(attrs).map_err(|why| garbled(set, why))?);
                        if message.flags & NLM_F_MULTI == 0 {
                            return Ok(members);
                        }
                    }
                }
            }
        }
    }

    /// Sends a request and waits for its acknowledgement.
    fn ack(
        &mut self,
        command: &'static str,
        set: &str,
        kind: u16,
        attrs: &Attrs,
    ) -> Result<(), IpsetError> {
        let seq = self.send(command, set, kind, NLM_F_ACK, attrs)?;
        loop {
            let datagram = self.receive(command, set)?;
            for message in Messages::new(&datagram) {
                let message = message.map_err(|why| garbled(set, why))?;
                if message.seq == seq && message.kind == NLMSG_ERROR {
                    return check_error(command, set, message.payload);
                }
            }
        }
    }

    fn send(
        &mut self,
        command: &'static str,
        set: &str,
        kind: u16,
        flags: u16,
        attrs: &Attrs,
    ) -> Result<u32, IpsetError> {
        self.seq = self.seq.wrapping_add(1);
        let len = NLMSG_HDRLEN + 4 + attrs.0.len();
        let mut message = Vec::with_capacity(len);
        message.extend_from_slice(&(len as u32).to_ne_bytes());
        message.extend_from_slice(&((NFNL_SUBSYS_IPSET << 8) | kind).to_ne_bytes());
        message.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        message.extend_from_slice(&self.seq.to_ne_bytes());
        message.extend_from_slice(&0u32.to_ne_bytes());
        // nfgenmsg: family (unused by ipset), version, resource id.
        message.extend_from_slice(&[NFPROTO_IPV4, NFNETLINK_V0, 0, 0]);
        message.extend_from_slice(&attrs.0);
        self.socket
            .send(&message, 0)
            .map_err(|cause| IpsetError::Request {
                command,
                set: set.to_owned(),
                cause,
            })?;
        Ok(self.seq)
    }

    /// One datagram (a dump's answers come in several).
    fn receive(&mut self, command: &'static str, set: &str) -> Result<Vec<u8>, IpsetError> {
        let mut buffer = vec![0u8; RECEIVE_BUFFER];
        let len = loop {
            match self.socket.recv(&mut &mut buffer[..], libc::MSG_TRUNC) {
                Ok(len) => break len,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(cause) => {
                    return Err(IpsetError::Request {
                        command,
                        set: set.to_owned(),
                        cause,
                    });
                }
            }
        };
        if len > RECEIVE_BUFFER {
            return Err(garbled(set, format!("a {len}-byte datagram")));
        }
        buffer.truncate(len);
        Ok(buffer)
    }
}

fn garbled(set: &str, why: impl Into<String>) -> IpsetError {
    IpsetError::Garbled {
        set: set.to_owned(),
        why: why.into(),
    }
}

/// An `NLMSG_ERROR` payload: 0 is the acknowledgement, else an errno
/// (ipset's own numbers above 4096).
fn check_error(command: &'static str, set: &str, payload: &[u8]) -> Result<(), IpsetError> {
    let code = payload
        .get(..4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or_else(|| garbled(set, "a short error message"))?;
    if code == 0 {
        return Ok(());
    }
    Err(IpsetError::Refused {
        command,
        set: set.to_owned(),
        why: describe_errno(-code),
    })
}

/// The kernel's error in ipset's words where it has its own.
fn describe_errno(errno: i32) -> String {
    let ipset = match errno - IPSET_ERR_PRIVATE {
        1 => Some("protocol error"),
        2 => Some("the set does not exist"),
        3 => Some("a set of that name exists with another type"),
        4 => Some("a set of that name exists"),
        5 => Some("the set type does not exist"),
        7 => Some("the set is full"),
        8 => Some("the set is in use by a rule"),
        _ => None,
    };
    match ipset {
        Some(text) => format!("{text} (ipset error {errno})"),
        None if errno == libc::ENOENT => "the set does not exist (ENOENT)".to_owned(),
        None => io::Error::from_raw_os_error(errno).to_string(),
    }
}

/// An element's DATA: its address.
fn element(address: IpAddr) -> Attrs {
    let mut ip = Attrs::default();
    match address {
        IpAddr::V4(v4) => ip.raw(ATTR_IPADDR_IPV4 | NLA_F_NET_BYTEORDER, &v4.octets()),
        IpAddr::V6(v6) => ip.raw(ATTR_IPADDR_IPV6 | NLA_F_NET_BYTEORDER, &v6.octets()),
    }
    let mut data = Attrs::default();
    data.nested(ATTR_IP, &ip);
    data
}

/// Netlink attributes, encoded as they are added.
#[derive(Default)]
struct Attrs(Vec<u8>);

impl Attrs {
    /// The protocol version and the set's name, which every request carries.
    fn for_set(set: &str) -> Self {
        let mut attrs = Self::default();
        attrs.u8(ATTR_PROTOCOL, IPSET_PROTOCOL);
        attrs.string(ATTR_SETNAME, set);
        attrs
    }

    fn raw(&mut self, kind: u16, value: &[u8]) {
        let len = 4 + value.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(value);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
    }

    fn u8(&mut self, kind: u16, value: u8) {
        self.raw(kind, &[value]);
    }

    fn u32_be(&mut self, kind: u16, value: u32) {
        self.raw(kind | NLA_F_NET_BYTEORDER, &value.to_be_bytes());
    }

    /// NUL-terminated, as the kernel's `NLA_NUL_STRING` policy wants.
    fn string(&mut self, kind: u16, value: &str) {
        let mut bytes = value.as_bytes().to_vec();
        bytes.push(0);
        self.raw(kind, &bytes);
    }

    fn nested(&mut self, kind: u16, inner: &Attrs) {
        self.raw(kind | NLA_F_NESTED, &inner.0);
    }
}

/// One netlink message of a datagram.
struct Message<'a> {
    kind: u16,
    flags: u16,
    seq: u32,
    payload: &'a [u8],
}

/// The messages of a datagram, in order.
struct Messages<'a> {
    rest: &'a [u8],
}

impl<'a> Messages<'a> {
    fn new(datagram: &'a [u8]) -> Self {
        Self { rest: datagram }
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Message<'a>, &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let Some(header) = self.rest.get(..NLMSG_HDRLEN) else {
            self.rest = &[];
            return Some(Err("a short netlink header"));
        };
        let len = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if len < NLMSG_HDRLEN || len > self.rest.len() {
            self.rest = &[];
            return Some(Err("a netlink length past the datagram"));
        }
        let message = Message {
            kind: u16::from_ne_bytes([header[4], header[5]]),
            flags: u16::from_ne_bytes([header[6], header[7]]),
            seq: u32::from_ne_bytes([header[8], header[9], header[10], header[11]]),
            payload: &self.rest[NLMSG_HDRLEN..len],
        };
        self.rest = self.rest.get(len.next_multiple_of(4)..).unwrap_or(&[]);
        Some(Ok(message))
    }
}

/// Iterates attributes: (type without flags, value).
fn attributes(mut bytes: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), &'static str>> {
    std::iter::from_fn(move || {
        if bytes.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([bytes[0], bytes[1]]) as usize;
        let kind = u16::from_ne_bytes([bytes[2], bytes[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > bytes.len() {
            bytes = &[];
            return Some(Err("an attribute length past its message"));
        }
        let value = &bytes[4..len];
        bytes = bytes.get(len.next_multiple_of(4)..).unwrap_or(&[]);
        Some(Ok((kind, value)))
    })
}

/// The members in one LIST answer's attributes (its ADT's DATA elements).
fn listed_members(attrs: &[u8]) -> Result<Vec<Member>, &'static str> {
    let mut members = Vec::new();
    for attr in attributes(attrs) {
        let (kind, adt) = attr?;
        if kind != ATTR_ADT {
            continue;
        }
        for element in attributes(adt) {
            let (_, data) = element?;
            members.push(member(data)?);
        }
    }
    Ok(members)
}

fn member(data: &[u8]) -> Result<Member, &'static str> {
    let (mut address, mut comment) = (None, None);
    for attr in attributes(data) {
        match attr? {
            (ATTR_IP, ip) => {
                for inner in attributes(ip) {
                    address = Some(match inner? {
                        (ATTR_IPADDR_IPV4, b) if b.len() == 4 => {
                            IpAddr::from(<[u8; 4]>::try_from(b).expect("4 bytes"))
                        }
                        (ATTR_IPADDR_IPV6, b) if b.len() == 16 => {
                            IpAddr::from(<[u8; 16]>::try_from(b).expect("16 bytes"))
                        }
                        _ => return Err("an address of neither family"),
                    });
                }
            }
            (ATTR_COMMENT, text) => {
                let text = text.split(|&b| b == 0).next().unwrap_or_default();
                comment = Some(String::from_utf8_lossy(text).into_owned());
            }
            _ => {}
        }
    }
    Ok(Member {
        address: address.ok_or("a member without an address")?,
        comment,
    })
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use ambpf_testbed::NetnsGuard;

    use super::*;

    /// `ipset save <set>` in `ns`, by the real tool: what the kernel holds.
    fn saved(ns: &NetnsGuard, set: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", ns.name(), "ipset", "save", set])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn sets_and_members_written_over_netlink_are_what_the_ipset_tool_reads() {
        let ns = NetnsGuard::create("ipset").unwrap();
        let netns = Netns::open(ns.name()).unwrap();
        let mut socket = IpsetSocket::open(&netns).unwrap();
        for _ in 0..2 {
            // Creating what exists succeeds, as `-exist` does.
            socket.create_hash_ip("probes-v4", false).unwrap();
            socket.create_hash_ip("probes-v6", true).unwrap();
        }
        let (v4, v6): (IpAddr, IpAddr) =
            ("10.244.1.2".parse().unwrap(), "fd00::2".parse().unwrap());
        socket.add("probes-v4", v4, "netns cookie 7").unwrap();
        // Adding again rewrites the comment.
        socket.add("probes-v4", v4, "netns cookie 8").unwrap();
        socket.add("probes-v6", v6, "netns cookie 9").unwrap();
        let v4_saved = saved(&ns, "probes-v4");
        let lines: Vec<&str> = v4_saved.lines().collect();
        assert!(
            lines[0].starts_with("create probes-v4 hash:ip family inet ")
                && lines[0].contains(" comment"),
            "{v4_saved}"
        );
        assert_eq!(
            lines[1..],
            ["add probes-v4 10.244.1.2 comment \"netns cookie 8\""]
        );
        assert!(saved(&ns, "probes-v6").contains("family inet6 "));
        assert_eq!(
            socket.list("probes-v6").unwrap(),
            [Member {
                address: v6,
                comment: Some("netns cookie 9".into())
            }]
        );
        // Many members come back over several dump messages.
        let many: Vec<IpAddr> = (0..600u32)
            .map(|i| std::net::Ipv4Addr::from(0x0a00_0000 + i).into())
            .collect();
        for ip in &many {
            socket.add("probes-v4", *ip, "netns cookie 1").unwrap();
        }
        assert_eq!(socket.list("probes-v4").unwrap().len(), 601);
        for ip in &many {
            socket.del("probes-v4", *ip).unwrap();
        }
        socket.del("probes-v4", v4).unwrap();
        // Deleting what is not there succeeds, as `-exist` does.
        socket.del("probes-v4", v4).unwrap();
        assert!(socket.list("probes-v4").unwrap().is_empty());

        let missing = socket.add("nope", v4, "x").unwrap_err();
        assert!(missing.to_string().contains("does not exist"), "{missing}");
        assert!(!socket.exists("nope").unwrap());
        assert!(socket.exists("probes-v6").unwrap());
        socket.destroy("probes-v4").unwrap();
        socket.destroy("probes-v4").unwrap();
        socket.destroy("probes-v6").unwrap();
        assert!(!socket.exists("probes-v6").unwrap());
    }
}
