//! Synchronous rtnetlink requests, on a socket opened in the network
//! namespace of the calling thread.
//!
//! Requests carry a sequence number and `NLM_F_ACK`, replies are matched on
//! it, `NLMSG_ERROR` becomes a typed [`NetlinkError`] (with the kernel's
//! extended-ack text when it gives one), and [`Rtnl::create`] /
//! [`Rtnl::delete`] treat "already there" and "already gone" as success so
//! that callers are idempotent. Used by [`super::podnet`],
//! [`super::routing`] and [`super::steering`].

use std::{
    fmt, io,
    os::fd::{AsFd, BorrowedFd},
};

use netlink_packet_core::{
    DecodeError, NLM_F_ACK, NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP, NLM_F_DUMP_INTR,
    NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use nix::{errno::Errno, libc};

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

    /// Sends `request` with `NLM_F_REQUEST | NLM_F_ACK` and returns the
    /// messages the kernel answers with before its acknowledgement (a `GET`
    /// that is not a dump, such as `RTM_GETNSID`).
    pub fn query(
        &mut self,
        request: RouteNetlinkMessage,
    ) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
        let seq = self.send(request, NLM_F_REQUEST | NLM_F_ACK)?;
        let mut out = Vec::new();
        loop {
            let mut outcome = None;
            self.receive(seq, |msg| match msg.payload {
                NetlinkPayload::InnerMessage(inner) => out.push(inner),
                NetlinkPayload::Error(err) => {
                    outcome = Some(match err.code {
                        None => Ok(()),
                        Some(code) => Err(NetlinkError::Kernel {
                            errno: Errno::from_raw(-code.get()),
                            detail: extack_message(msg.header.flags, &err.header),
                        }),
                    });
                }
                _ => {}
            })?;
            if let Some(outcome) = outcome {
                return outcome.map(|()| out);
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
    use ambpf_testbed::NetnsGuard;
    use netlink_packet_route::link::LinkMessage;

    use super::*;

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
