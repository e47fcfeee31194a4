//! A pod's open TCP connections entered in conntrack before Istio's nat
//! rules first apply there, so that they keep working.
//!
//! Nothing tracks connections in a namespace without netfilter rules, which
//! is what the eBPF mode leaves a pod. Once nat rules are written there,
//! conntrack picks an open connection up at its next packet (mid-stream,
//! `nf_conntrack_tcp_loose`), as a new connection, and Istio's REDIRECT
//! applies to it: an inbound connection ztunnel took from the eBPF mode
//! would have its next packet sent to 15006, where no socket has its tuple,
//! and be reset. So when the iptables or nftables mode takes a pod over
//! from the eBPF mode, it first writes its rules with the nat chains empty
//! (from then on, every connection is tracked from its first packet with no
//! translation), then enters every established TCP connection of the pod
//! over ctnetlink (an entry without a NAT binding, which nat never touches
//! afterwards; one already picked up is left as it is), then writes the
//! full rules. New connections are redirected from then on; the open ones
//! carry on as they were.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use crate::netns::Netns;

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const NLA_F_NESTED: u16 = 1 << 15;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;

const IPS_SEEN_REPLY: u32 = 1 << 1;
const IPS_ASSURED: u32 = 1 << 2;
const IPS_CONFIRMED: u32 = 1 << 3;
/// The status an entry is created with: kernels since 6.3 (and stable
/// backports) mark an entry confirmed before applying the status asked for,
/// and refuse a status that would change that bit (EBUSY); earlier ones
/// refuse a status that sets it. So the first is tried, then the second.
const STATUSES: [u32; 2] = [
    IPS_CONFIRMED | IPS_SEEN_REPLY | IPS_ASSURED,
    IPS_SEEN_REPLY | IPS_ASSURED,
];
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
/// `IP_CT_TCP_FLAG_BE_LIBERAL`: the sequence numbers were never seen, so
/// no packet is judged out of window.
const TCP_FLAG_BE_LIBERAL: u8 = 0x08;
/// conntrack's own timeout for an established TCP connection (5 days).
const ESTABLISHED_TIMEOUT_SECS: u32 = 432_000;

/// An open connection as one of its sockets in the pod sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenConnection {
    pub local: SocketAddr,
    pub remote: SocketAddr,
}

/// Enters each established TCP connection of `netns` in its conntrack table
/// (those with a loopback end aside: Istio's rules never translate them);
/// returns how many were entered, not counting those already tracked.
pub fn track_established(netns: &Netns) -> io::Result<usize> {
    netns
        .run(|| {
            let connections = established()?;
            if connections.is_empty() {
                return Ok(0);
            }
            let socket = open()?;
            let mut entered = 0;
            for (seq, connection) in connections.iter().enumerate() {
                match create(&socket, connection, seq as u32 + 1) {
                    Ok(()) => entered += 1,
                    // Tracked already (picked up since the rules were
                    // written, or the other end of a connection with both
                    // ends in the pod).
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!(
                                "entering {} -> {} in conntrack: {e}",
                                connection.remote, connection.local
                            ),
                        ));
                    }
                }
            }
            Ok(entered)
        })
        .map_err(io::Error::other)?
}

/// The calling thread's namespace's established TCP connections.
fn established() -> io::Result<Vec<OpenConnection>> {
    let mut out = Vec::new();
    for (table, v6) in [
        ("/proc/thread-self/net/tcp", false),
        ("/proc/thread-self/net/tcp6", true),
    ] {
        match std::fs::read_to_string(table) {
            Ok(text) => out.extend(parse_established(&text, v6)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Established (`01`) sockets of a `/proc/net/tcp{,6}` table, without
/// those with a loopback end.
pub fn parse_established(text: &str, v6: bool) -> Vec<OpenConnection> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if *fields.get(3)? != "01" {
                return None;
            }
            let local = parse_address(fields.get(1)?, v6)?;
            let remote = parse_address(fields.get(2)?, v6)?;
            let loopback = local.ip().is_loopback() || remote.ip().is_loopback();
            (!loopback).then_some(OpenConnection { local, remote })
        })
        .collect()
}

/// `0100007F:1F90` (IPv4: one word in host order) or 32 hex digits (IPv6:
/// four words, each in host order), a colon and the port. A v4-mapped IPv6
/// address is returned as IPv4, which is how conntrack files it.
fn parse_address(text: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = if v6 {
        let mut bytes = [0u8; 16];
        for i in 0..4 {
            bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
        }
        let v6 = std::net::Ipv6Addr::from(bytes);
        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
    } else {
        IpAddr::from(word(0)?)
    };
    Some(SocketAddr::new(ip, port))
}

fn open() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned from here.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One `IPCTNL_MSG_CT_NEW` (create only) for `connection`, as the remote
/// end opened it, and its acknowledgement.
fn create(socket: &OwnedFd, connection: &OpenConnection, seq: u32) -> io::Result<()> {
    let mut result = Ok(());
    for status in STATUSES {
        result = send_and_ack(socket, &new_entry(connection, seq, status), seq);
        if !matches!(&result, Err(e) if e.raw_os_error() == Some(libc::EBUSY)) {
            break;
        }
    }
    result
}

fn send_and_ack(socket: &OwnedFd, message: &[u8], seq: u32) -> io::Result<()> {
    // SAFETY: the buffer is valid for its length; the kernel is the peer.
    let sent = unsafe {
        libc::send(
            socket.as_raw_fd(),
            message.as_ptr().cast(),
            message.len(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reply = [0u8; 4096];
    loop {
        // SAFETY: the buffer is valid for writes of its length.
        let got = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                reply.as_mut_ptr().cast(),
                reply.len(),
                0,
            )
        };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        let got = got as usize;
        if got < 20 {
            return Err(io::Error::other("short netlink answer"));
        }
        let kind = u16::from_ne_bytes([reply[4], reply[5]]);
        let answer_seq = u32::from_ne_bytes([reply[8], reply[9], reply[10], reply[11]]);
        if answer_seq != seq || kind != libc::NLMSG_ERROR as u16 {
            continue;
        }
        let errno = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
        return match errno {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(-e)),
        };
    }
}

/// The message: nlmsghdr, nfgenmsg, then the entry's attributes.
fn new_entry(connection: &OpenConnection, seq: u32, status: u32) -> Vec<u8> {
    let (client, server) = (connection.remote, connection.local);
    let family = if client.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let mut body = Vec::new();
    // nfgenmsg: family, version, resource id.
    body.extend_from_slice(&[family as u8, 0, 0, 0]);
    nested(&mut body, CTA_TUPLE_ORIG, |b| tuple(b, client, server));
    nested(&mut body, CTA_TUPLE_REPLY, |b| tuple(b, server, client));
    attr(&mut body, CTA_STATUS, &status.to_be_bytes());
    attr(
        &mut body,
        CTA_TIMEOUT,
        &ESTABLISHED_TIMEOUT_SECS.to_be_bytes(),
    );
    nested(&mut body, CTA_PROTOINFO, |b| {
        nested(b, CTA_PROTOINFO_TCP, |b| {
            attr(b, CTA_PROTOINFO_TCP_STATE, &[TCP_CONNTRACK_ESTABLISHED]);
            let liberal = [TCP_FLAG_BE_LIBERAL, TCP_FLAG_BE_LIBERAL];
            attr(b, CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, &liberal);
            attr(b, CTA_PROTOINFO_TCP_FLAGS_REPLY, &liberal);
        });
    });
    let kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW;
    let flags =
        (libc::NLM_F_REQUEST | libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
    let mut message = Vec::with_capacity(16 + body.len());
    message.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    message.extend_from_slice(&kind.to_ne_bytes());
    message.extend_from_slice(&flags.to_ne_bytes());
    message.extend_from_slice(&seq.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend_from_slice(&body);
    message
}

fn tuple(out: &mut Vec<u8>, src: SocketAddr, dst: SocketAddr) {
    nested(out, CTA_TUPLE_IP, |b| match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            attr(b, CTA_IP_V4_SRC, &s.octets());
            attr(b, CTA_IP_V4_DST, &d.octets());
        }
        (s, d) => {
            let v6 = |ip: IpAddr| match ip {
                IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                IpAddr::V6(v6) => v6.octets(),
            };
            attr(b, CTA_IP_V6_SRC, &v6(s));
            attr(b, CTA_IP_V6_DST, &v6(d));
        }
    });
    nested(out, CTA_TUPLE_PROTO, |b| {
        attr(b, CTA_PROTO_NUM, &[libc::IPPROTO_TCP as u8]);
        attr(b, CTA_PROTO_SRC_PORT, &src.port().to_be_bytes());
        attr(b, CTA_PROTO_DST_PORT, &dst.port().to_be_bytes());
    });
}

fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    out.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

fn nested(out: &mut Vec<u8>, kind: u16, fill: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    fill(out);
    let len = (out.len() - start) as u16;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn established_sockets_are_read_without_loopback_ends() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0201F40A:1F90 0301F40A:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 41002 1
   1: 0201F40A:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 41001 1
   2: 0100007F:3A99 0100007F:C001 01 00000000:00000000 00:00000000 00000000     0        0 41003 1
";
        assert_eq!(
            parse_established(v4, false),
            [OpenConnection {
                local: "10.244.1.2:8080".parse().unwrap(),
                remote: "10.244.1.3:41394".parse().unwrap(),
            }]
        );
        // ::ffff:10.244.1.2 and fd00::3, as a dual-stack socket shows them.
        let v6 =
            "  sl  local_address                         remote_address                        st
   0: 0000000000000000FFFF00000201F40A:1F90 000000FD000000000000000003000000:A1B2 01 0
";
        assert_eq!(
            parse_established(v6, true),
            [OpenConnection {
                local: "10.244.1.2:8080".parse().unwrap(),
                remote: "[fd00::3]:41394".parse().unwrap(),
            }]
        );
    }
}
