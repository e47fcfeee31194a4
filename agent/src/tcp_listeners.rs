//! The TCP sockets listening in the calling thread's network namespace
//! (run inside a pod's namespace: `Netns::run`), asked of the kernel over
//! `NETLINK_SOCK_DIAG` for the LISTEN state alone.
//!
//! Not `/proc/net/tcp`: reading it walks the kernel's whole established
//! table, which every namespace of the node shares, whatever the namespace
//! holds. On a node with traffic that is milliseconds of kernel time per
//! read, and the eBPF mode looks for ztunnel's listener at every pod's
//! first enrolment, inside the pod's start. A dump for LISTEN only walks
//! the listening table.

use std::io;

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// A socket in state LISTEN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    /// The socket's inode (`/proc/<pid>/fd/<n>` links to `socket:[inode]`).
    pub inode: u64,
    /// Connections the kernel completed that the holder has not accepted
    /// yet.
    pub accept_queue: u32,
}

/// How often a dump the kernel marks inconsistent is read again.
const DUMP_ATTEMPTS: u32 = 5;

/// The listeners on `port`, both families.
pub fn on_port(port: u16) -> io::Result<Vec<Listener>> {
    let socket = open()?;
    let mut listeners = Vec::new();
    for (family, socket_id) in [
        (AF_INET, SocketId::new_v4()),
        (AF_INET6, SocketId::new_v6()),
    ] {
        listeners.extend(
            dump(&socket, family, socket_id)?
                .into_iter()
                .filter(|l| l.0 == port)
                .map(|l| l.1),
        );
    }
    Ok(listeners)
}

fn open() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// Every TCP listener of `family` in the namespace, with its port.
fn dump(socket: &Socket, family: u8, socket_id: SocketId) -> io::Result<Vec<(u16, Listener)>> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut request = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id,
        })
        .into(),
    );
    request.finalize();
    let mut bytes = vec![0; request.buffer_len()];
    request.serialize(&mut bytes);
    let mut buf = vec![0u8; 32 * 1024];
    'attempt: for _ in 0..DUMP_ATTEMPTS {
        socket.send(&bytes, 0)?;
        let mut found = Vec::new();
        let mut interrupted = false;
        loop {
            let len = socket.recv(&mut &mut buf[..], 0)?;
            let mut rest = &buf[..len];
            while !rest.is_empty() {
                let message = <NetlinkMessage<SockDiagMessage>>::deserialize(rest)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let length = message.header.length as usize;
                interrupted |= message.header.flags & NLM_F_DUMP_INTR != 0;
                match message.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                        let header = &response.header;
                        found.push((
                            header.socket_id.source_port,
                            Listener {
                                inode: u64::from(header.inode),
                                accept_queue: header.recv_queue,
                            },
                        ));
                    }
                    NetlinkPayload::Done(_) => {
                        if interrupted {
                            continue 'attempt;
                        }
                        return Ok(found);
                    }
                    NetlinkPayload::Error(e) => {
                        return Err(e.to_io());
                    }
                    _ => {}
                }
                if length == 0 || length > rest.len() {
                    break;
                }
                rest = &rest[length..];
            }
        }
    }
    Err(io::Error::other(format!(
        "the listening sockets changed during {DUMP_ATTEMPTS} reads in a row"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In this process's namespace: a listener of the test's own is found
    /// with its inode and its accept queue, on its port only.
    #[test]
    fn a_listener_is_found_with_its_accept_queue() {
        use std::os::fd::AsRawFd as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let inode = {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", listener.as_raw_fd()));
            let link = link.unwrap().to_string_lossy().into_owned();
            link.trim_start_matches("socket:[")
                .trim_end_matches(']')
                .parse::<u64>()
                .unwrap()
        };
        let waiting = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let found = on_port(port).unwrap();
        assert_eq!(
            found,
            [Listener {
                inode,
                accept_queue: 1
            }]
        );
        drop(waiting);
        let _ = listener.accept().unwrap();
        let none = on_port(port.wrapping_add(1).max(1)).unwrap();
        assert!(none.iter().all(|l| l.inode != inode));
    }
}
