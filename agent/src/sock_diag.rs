//! Listening sockets of the calling thread's network namespace (run inside
//! a pod's namespace with `Netns::run`), asked of the kernel over
//! `NETLINK_SOCK_DIAG` for the LISTEN state alone: TCP listeners by port,
//! and unix listeners by the inode of the file they are bound to.
//!
//! Not `/proc/net/tcp`: reading it walks the kernel's whole established
//! table, which every namespace of the node shares, whatever the namespace
//! holds. On a node with traffic that is milliseconds of kernel time per
//! read, and the eBPF mode looks for ztunnel's listener at every pod's
//! first enrolment, inside the pod's start. A dump for LISTEN only walks
//! the listening table.

use std::io;

use netlink_packet_core::Emitable as _;
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
    unix::{self, ShowFlags, UnixRequest},
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

/// The TCP listeners on `port`, both families.
pub fn tcp_listeners(port: u16) -> io::Result<Vec<Listener>> {
    let socket = open()?;
    let mut listeners = Vec::new();
    for (family, socket_id) in [
        (AF_INET, SocketId::new_v4()),
        (AF_INET6, SocketId::new_v6()),
    ] {
        let request = SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id,
        });
        dump(&socket, request, |message| {
            if let SockDiagMessage::InetResponse(response) = message {
                let header = &response.header;
                if header.socket_id.source_port == port {
                    listeners.push(Listener {
                        inode: u64::from(header.inode),
                        accept_queue: header.recv_queue,
                    });
                }
            }
        })?;
    }
    Ok(listeners)
}

/// Whether a unix socket of the namespace listens on the file whose inode
/// is `file_inode` (a socket file left by a server that is gone has none).
pub fn unix_listener_on(file_inode: u64) -> io::Result<bool> {
    let socket = open()?;
    let request = SockDiagMessage::UnixRequest(UnixRequest {
        state_flags: unix::StateFlags::LISTEN,
        inode: 0,
        show_flags: ShowFlags::VFS,
        cookie: [0; 8],
    });
    let mut found = false;
    dump(&socket, request, |message| {
        if let SockDiagMessage::UnixResponse(response) = message {
            found |= response.nlas.iter().any(|nla| match nla {
                unix::nlas::Nla::Vfs(vfs) => u64::from(vfs_inode(vfs)) == file_inode,
                _ => false,
            });
        }
    })?;
    Ok(found)
}

/// The file inode of `UNIX_DIAG_VFS` (`struct unix_diag_vfs`: inode, then
/// device), which the crate keeps private: read back from its encoding.
fn vfs_inode(vfs: &unix::nlas::Vfs) -> u32 {
    let mut bytes = [0u8; 8];
    vfs.emit(&mut bytes);
    u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn open() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// Sends `request` as a dump and hands each answer to `on_message`, read
/// again whole while the kernel marks the dump inconsistent.
fn dump(
    socket: &Socket,
    request: SockDiagMessage,
    mut on_message: impl FnMut(SockDiagMessage),
) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut request = NetlinkMessage::new(header, request.into());
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
                    NetlinkPayload::InnerMessage(inner) => found.push(inner),
                    NetlinkPayload::Done(_) => {
                        if interrupted {
                            continue 'attempt;
                        }
                        found.into_iter().for_each(&mut on_message);
                        return Ok(());
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
        let found = tcp_listeners(port).unwrap();
        assert_eq!(
            found,
            [Listener {
                inode,
                accept_queue: 1
            }]
        );
        drop(waiting);
        let _ = listener.accept().unwrap();
        let none = tcp_listeners(port.wrapping_add(1).max(1)).unwrap();
        assert!(none.iter().all(|l| l.inode != inode));
    }

    /// A unix listener is found by its socket file's inode while it
    /// listens, and no longer once closed, its file left behind.
    #[test]
    fn a_unix_listener_is_found_by_its_file() {
        use std::os::unix::fs::MetadataExt as _;
        let dir = std::env::temp_dir().join(format!("ambpf-sock-diag-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("server.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let inode = std::fs::metadata(&path).unwrap().ino();
        assert!(unix_listener_on(inode).unwrap());
        drop(listener);
        assert!(path.exists());
        assert!(!unix_listener_on(inode).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
