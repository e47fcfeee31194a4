//! A `clsact` qdisc and a direct-action `cls_bpf` filter, as
//! `tc qdisc add dev X clsact` and `tc filter add dev X ingress prio 1
//! handle 1 bpf da fd F name N` would make them, over a netlink socket
//! in the calling thread's network namespace.

use std::{io, os::fd::AsRawFd, os::fd::BorrowedFd};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// The filter's priority and handle: fixed, so that a replacement or a
/// deletion names the same filter.
const PRIORITY: u16 = 1;
const HANDLE: u32 = 1;
/// `ETH_P_ALL`: the filter sees every protocol.
const ETH_P_ALL: u16 = 0x0003;

/// A `NETLINK_ROUTE` socket, one request at a time.
pub struct Rtnl {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Rtnl {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            seq: 0,
            buf: vec![0; 32 * 1024],
        })
    }

    /// `RTM_NEWQDISC clsact` on `ifindex` (`NLM_F_EXCL`: a new one).
    pub fn create_clsact(&mut self, ifindex: u32) -> io::Result<()> {
        self.request(
            RouteNetlinkMessage::NewQueueDiscipline(clsact(ifindex)),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map_err(|e| context(e, "RTM_NEWQDISC clsact", ifindex))
    }

    /// `RTM_DELQDISC clsact` on `ifindex`.
    pub fn delete_clsact(&mut self, ifindex: u32) -> io::Result<()> {
        self.request(RouteNetlinkMessage::DelQueueDiscipline(clsact(ifindex)), 0)
            .map_err(|e| context(e, "RTM_DELQDISC clsact", ifindex))
    }

    /// `RTM_NEWTFILTER bpf` on ingress of `ifindex` running `prog` in
    /// direct action: a new filter (`NLM_F_EXCL`) if `new`, else the
    /// existing one's program replaced.
    pub fn set_filter(
        &mut self,
        ifindex: u32,
        prog: BorrowedFd,
        name: &str,
        new: bool,
    ) -> io::Result<()> {
        let mut msg = filter(ifindex);
        msg.attributes.push(TcAttribute::Options(vec![
            TcOption::Bpf(TcFilterBpfOption::ProgFd(prog.as_raw_fd() as u32)),
            TcOption::Bpf(TcFilterBpfOption::ProgName(name.to_owned())),
            TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
        ]));
        let flags = if new {
            NLM_F_CREATE | NLM_F_EXCL
        } else {
            NLM_F_CREATE
        };
        self.request(RouteNetlinkMessage::NewTrafficFilter(msg), flags)
            .map_err(|e| context(e, "RTM_NEWTFILTER bpf", ifindex))
    }

    /// `RTM_DELTFILTER` of the filter [`Rtnl::set_filter`] made.
    pub fn delete_filter(&mut self, ifindex: u32) -> io::Result<()> {
        self.request(RouteNetlinkMessage::DelTrafficFilter(filter(ifindex)), 0)
            .map_err(|e| context(e, "RTM_DELTFILTER bpf", ifindex))
    }

    /// The names of the bpf programs of `ifindex`'s ingress filters.
    #[cfg(test)]
    pub fn ingress_filters(&mut self, ifindex: u32) -> io::Result<Vec<String>> {
        let mut msg = TcMessage::with_index(ifindex as i32);
        msg.header.parent = ingress();
        let seq = self.send(
            RouteNetlinkMessage::GetTrafficFilter(msg),
            NLM_F_REQUEST | netlink_packet_core::NLM_F_DUMP,
        )?;
        let mut names = Vec::new();
        loop {
            for msg in self.receive(seq)? {
                match msg.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewTrafficFilter(f)) => {
                        for attr in f.attributes {
                            let TcAttribute::Options(options) = attr else {
                                continue;
                            };
                            names.extend(options.into_iter().filter_map(|o| match o {
                                TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => Some(n),
                                _ => None,
                            }));
                        }
                    }
                    NetlinkPayload::Done(_) => return Ok(names),
                    NetlinkPayload::Error(e) => return Err(io::Error::other(format!("{e:?}"))),
                    _ => {}
                }
            }
        }
    }

    /// Sends `msg` with `NLM_F_REQUEST | NLM_F_ACK | flags` and waits for
    /// the kernel's answer.
    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        let seq = self.send(msg, NLM_F_REQUEST | NLM_F_ACK | flags)?;
        loop {
            for msg in self.receive(seq)? {
                if let NetlinkPayload::Error(err) = msg.payload {
                    return match err.code {
                        None => Ok(()),
                        Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                    };
                }
            }
        }
    }

    fn send(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<u32> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        msg.finalize();
        let mut bytes = vec![0; msg.buffer_len()];
        msg.serialize(&mut bytes);
        self.socket.send(&bytes, 0)?;
        Ok(self.seq)
    }

    /// One datagram's messages answering `seq`.
    fn receive(&mut self, seq: u32) -> io::Result<Vec<NetlinkMessage<RouteNetlinkMessage>>> {
        let len = self.socket.recv(&mut &mut self.buf[..], 0)?;
        let mut rest = &self.buf[..len];
        let mut out = Vec::new();
        while !rest.is_empty() {
            let msg_len = NetlinkBuffer::new_checked(rest)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?
                .length() as usize;
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rest[..msg_len])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            if msg.header.sequence_number == seq {
                out.push(msg);
            }
            rest = &rest[msg_len.next_multiple_of(4).min(rest.len())..];
        }
        Ok(out)
    }
}

fn context(e: io::Error, what: &str, ifindex: u32) -> io::Error {
    io::Error::new(e.kind(), format!("{what} on ifindex {ifindex}: {e}"))
}

/// `ffff:fff2`, the clsact qdisc's ingress hook.
fn ingress() -> TcHandle {
    TcHandle {
        major: TcHandle::CLSACT.major,
        minor: TcHandle::MIN_INGRESS,
    }
}

/// The clsact qdisc of `ifindex`: handle `ffff:`, parent `ffff:fff1`.
fn clsact(ifindex: u32) -> TcMessage {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = TcHandle::CLSACT;
    msg.header.handle = TcHandle {
        major: TcHandle::CLSACT.major,
        minor: 0,
    };
    msg.attributes.push(TcAttribute::Kind("clsact".to_owned()));
    msg
}

/// The bpf filter of `ifindex`, without options: ingress, priority 1,
/// all protocols, handle 1.
fn filter(ifindex: u32) -> TcMessage {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = ingress();
    msg.header.handle = TcHandle::from(HANDLE);
    // tcm_info: priority in the upper half, protocol (network order) in
    // the lower.
    msg.header.info = (u32::from(PRIORITY) << 16) | u32::from(ETH_P_ALL.to_be());
    msg.attributes.push(TcAttribute::Kind("bpf".to_owned()));
    msg
}
