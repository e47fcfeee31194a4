//! Sockets inside a pod's network namespace, with ztunnel's options.
//!
//! Network namespaces are per thread and a socket belongs to the namespace it
//! was created in, whatever thread uses it later. So each pod gets one
//! long-lived thread that has entered its netns and only creates sockets on
//! request; connecting, accepting and copying happen on tokio.

use std::{
    io,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    os::fd::{BorrowedFd, OwnedFd},
    sync::mpsc,
};

use nix::sched::{CloneFlags, setns};
use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::{
    net::{TcpListener, TcpSocket, TcpStream, UdpSocket},
    sync::oneshot,
};

use super::ZTUNNEL_MARK;

const LISTEN_BACKLOG: i32 = 1024;
const SOCKET_THREAD_STACK: usize = 128 * 1024;

enum SocketRequest {
    Listener {
        port: u16,
        reply: oneshot::Sender<io::Result<std::net::TcpListener>>,
    },
    Upstream {
        target: SocketAddr,
        source: Option<IpAddr>,
        reply: oneshot::Sender<io::Result<std::net::TcpStream>>,
    },
    Dns {
        address: SocketAddr,
        reply: oneshot::Sender<io::Result<Option<DnsSockets>>>,
    },
    DnsUpstream {
        target: SocketAddr,
        reply: oneshot::Sender<io::Result<std::net::UdpSocket>>,
    },
}

/// The DNS proxy's UDP socket and TCP listener on one address.
pub(super) struct DnsSockets {
    pub(super) udp: std::net::UdpSocket,
    pub(super) tcp: std::net::TcpListener,
}

/// Creates sockets in one pod's netns. The thread ends once every handle
/// (clones included) is dropped.
#[derive(Clone)]
pub(super) struct PodSockets {
    requests: mpsc::Sender<SocketRequest>,
}

impl PodSockets {
    /// Starts the pod's socket thread in `netns`.
    pub(super) async fn enter(netns: BorrowedFd<'_>) -> io::Result<Self> {
        // The thread gets its own fd and closes it once inside: the thread
        // itself then keeps the namespace, and the pod's fd stays the only one.
        let netns = netns.try_clone_to_owned()?;
        let (requests, receiver) = mpsc::channel();
        let (entered_tx, entered_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("ztunnel-pod-ns".to_owned())
            // It only makes sockets: a small stack keeps hundreds of pods cheap.
            .stack_size(SOCKET_THREAD_STACK)
            .spawn(move || {
                let entered = enter_netns(netns);
                let serve = entered.is_ok();
                let _ = entered_tx.send(entered);
                if serve {
                    serve_requests(receiver);
                }
            })?;
        entered_rx
            .await
            .map_err(|_| io::Error::other("the pod netns thread exited"))??;
        Ok(Self { requests })
    }

    /// A listener on `[::]:port` with ztunnel's options, registered with tokio.
    pub(super) async fn listener(&self, port: u16) -> io::Result<TcpListener> {
        let (reply, response) = oneshot::channel();
        self.request(SocketRequest::Listener { port, reply })?;
        let listener = receive_reply(response).await?;
        TcpListener::from_std(listener)
    }

    /// Connects to `target` from a socket created in the pod's netns with
    /// SO_MARK 0x539; with `source`, bound to that (possibly non-local)
    /// address, as ztunnel keeps the client's address on inbound.
    pub(super) async fn connect(
        &self,
        target: SocketAddr,
        source: Option<IpAddr>,
    ) -> io::Result<TcpStream> {
        let (reply, response) = oneshot::channel();
        self.request(SocketRequest::Upstream {
            target,
            source,
            reply,
        })?;
        let socket = TcpSocket::from_std_stream(receive_reply(response).await?);
        socket.connect(target).await
    }

    /// The DNS proxy's UDP socket and TCP listener on `address`
    /// (`127.0.0.1:15053` or `[::1]:15053`) with ztunnel's options,
    /// registered with tokio; `None` if the netns lacks the address's family
    /// (IPv6 disabled).
    pub(super) async fn dns(
        &self,
        address: SocketAddr,
    ) -> io::Result<Option<(UdpSocket, TcpListener)>> {
        let (reply, response) = oneshot::channel();
        self.request(SocketRequest::Dns { address, reply })?;
        match receive_reply(response).await? {
            Some(sockets) => Ok(Some((
                UdpSocket::from_std(sockets.udp)?,
                TcpListener::from_std(sockets.tcp)?,
            ))),
            None => Ok(None),
        }
    }

    /// A UDP socket created in the pod's netns with SO_MARK 0x539 and
    /// connected to `target`, registered with tokio: the DNS proxy's
    /// forwarding socket.
    pub(super) async fn udp_upstream(&self, target: SocketAddr) -> io::Result<UdpSocket> {
        let (reply, response) = oneshot::channel();
        self.request(SocketRequest::DnsUpstream { target, reply })?;
        UdpSocket::from_std(receive_reply(response).await?)
    }

    fn request(&self, request: SocketRequest) -> io::Result<()> {
        self.requests
            .send(request)
            .map_err(|_| io::Error::other("the pod netns thread is gone"))
    }
}

async fn receive_reply<T>(response: oneshot::Receiver<io::Result<T>>) -> io::Result<T> {
    response
        .await
        .map_err(|_| io::Error::other("the pod netns thread dropped the request"))?
}

fn enter_netns(netns: OwnedFd) -> io::Result<()> {
    setns(&netns, CloneFlags::CLONE_NEWNET).map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!("setns into the pod netns: {e}"),
        )
    })
}

fn serve_requests(requests: mpsc::Receiver<SocketRequest>) {
    for request in requests {
        // A requester that went away just drops its socket.
        match request {
            SocketRequest::Listener { port, reply } => {
                let _ = reply.send(listener_socket(port));
            }
            SocketRequest::Upstream {
                target,
                source,
                reply,
            } => {
                let _ = reply.send(upstream_socket(target, source));
            }
            SocketRequest::Dns { address, reply } => {
                let _ = reply.send(dns_sockets(address));
            }
            SocketRequest::DnsUpstream { target, reply } => {
                let _ = reply.send(dns_upstream_socket(target));
            }
        }
    }
}

/// `[::]:port`, dual-stack, IP_TRANSPARENT (so TPROXY-style delivery of
/// foreign destinations works), SO_REUSEPORT, SO_MARK 0x539, non-blocking.
fn listener_socket(port: u16) -> io::Result<std::net::TcpListener> {
    let address = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
    let context = |what: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("listener {address}: {what}: {e}"))
    };
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| context("socket", e))?;
    socket
        .set_only_v6(false)
        .map_err(|e| context("IPV6_V6ONLY off", e))?;
    socket
        .set_reuse_address(true)
        .map_err(|e| context("SO_REUSEADDR", e))?;
    socket
        .set_reuse_port(true)
        .map_err(|e| context("SO_REUSEPORT", e))?;
    // ztunnel sets the IPv4 option on its [::] listeners; Linux applies
    // SOL_IP options to IPv6 sockets too, and the flag covers both families.
    socket
        .set_ip_transparent_v4(true)
        .map_err(|e| context("IP_TRANSPARENT", e))?;
    socket
        .set_mark(ZTUNNEL_MARK)
        .map_err(|e| context("SO_MARK", e))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| context("O_NONBLOCK", e))?;
    socket
        .bind(&address.into())
        .map_err(|e| context("bind", e))?;
    socket
        .listen(LISTEN_BACKLOG)
        .map_err(|e| context("listen", e))?;
    Ok(socket.into())
}

/// The DNS proxy's sockets on `address`, UDP and TCP, SO_MARK 0x539 and
/// SO_REUSEPORT (as every in-pod socket of ztunnel's), non-blocking. `None`
/// for an IPv6 address in a netns without IPv6 (no `::1` on `lo`, or no IPv6
/// at all): ztunnel then serves DNS on IPv4 only.
pub(super) fn dns_sockets(address: SocketAddr) -> io::Result<Option<DnsSockets>> {
    let context = |protocol: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("DNS {protocol} socket {address}: {e}"))
    };
    let udp = match dns_socket(address, Type::DGRAM) {
        Ok(udp) => udp,
        Err(e) if address.is_ipv6() && is_family_unavailable(&e) => return Ok(None),
        Err(e) => return Err(context("udp", e)),
    };
    let tcp = dns_socket(address, Type::STREAM).map_err(|e| context("tcp", e))?;
    tcp.listen(LISTEN_BACKLOG)
        .map_err(|e| context("tcp listen", e))?;
    Ok(Some(DnsSockets {
        udp: udp.into(),
        tcp: tcp.into(),
    }))
}

/// A bound socket of `kind` on `address` for the DNS proxy.
fn dns_socket(address: SocketAddr, kind: Type) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(address), kind, None)?;
    if address.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    if kind == Type::STREAM {
        socket.set_reuse_address(true)?;
    }
    socket.set_reuse_port(true)?;
    socket.set_mark(ZTUNNEL_MARK)?;
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    Ok(socket)
}

/// An error from `what` on the socket `label`, naming both.
fn socket_error(label: &str, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{label}: {what}: {e}"))
}

/// A socket for `target` marked 0x539, as ztunnel marks its own traffic so
/// that no redirection captures it.
fn marked_socket(
    target: SocketAddr,
    kind: Type,
    protocol: Protocol,
    label: &str,
) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(target), kind, Some(protocol))
        .map_err(|e| socket_error(label, "socket", e))?;
    socket
        .set_mark(ZTUNNEL_MARK)
        .map_err(|e| socket_error(label, "SO_MARK", e))?;
    Ok(socket)
}

/// A non-blocking UDP socket marked 0x539, on an ephemeral port, connected
/// to `target`.
fn dns_upstream_socket(target: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let label = format!("DNS upstream socket to {target}");
    let socket = marked_socket(target, Type::DGRAM, Protocol::UDP, &label)?;
    socket
        .set_nonblocking(true)
        .map_err(|e| socket_error(&label, "O_NONBLOCK", e))?;
    socket
        .connect(&target.into())
        .map_err(|e| socket_error(&label, "connect", e))?;
    Ok(socket.into())
}

/// The address (EADDRNOTAVAIL) or its whole family (EAFNOSUPPORT) is missing
/// from the netns.
fn is_family_unavailable(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::AddrNotAvailable || e.raw_os_error() == Some(nix::libc::EAFNOSUPPORT)
}

/// An unconnected, non-blocking TCP socket for `target`, marked 0x539; with
/// `source`, IP_TRANSPARENT + IP_FREEBIND and bound to `source`:0.
fn upstream_socket(target: SocketAddr, source: Option<IpAddr>) -> io::Result<std::net::TcpStream> {
    let label = format!("upstream socket to {target}");
    let context = |what: &str, e: io::Error| socket_error(&label, what, e);
    let socket = marked_socket(target, Type::STREAM, Protocol::TCP, &label)?;
    socket
        .set_tcp_nodelay(true)
        .map_err(|e| context("TCP_NODELAY", e))?;
    if let Some(source) = source {
        match (source, target) {
            (IpAddr::V4(_), SocketAddr::V4(_)) => {
                socket
                    .set_ip_transparent_v4(true)
                    .map_err(|e| context("IP_TRANSPARENT", e))?;
                socket
                    .set_freebind_v4(true)
                    .map_err(|e| context("IP_FREEBIND", e))?;
            }
            (IpAddr::V6(_), SocketAddr::V6(_)) => {
                socket
                    .set_ip_transparent_v6(true)
                    .map_err(|e| context("IPV6_TRANSPARENT", e))?;
                socket
                    .set_freebind_v6(true)
                    .map_err(|e| context("IPV6_FREEBIND", e))?;
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "upstream socket to {target}: source {source} is of another address family"
                    ),
                ));
            }
        }
        socket
            .bind(&SocketAddr::new(source, 0).into())
            .map_err(|e| context(&format!("bind to {source}"), e))?;
    }
    socket
        .set_nonblocking(true)
        .map_err(|e| context("O_NONBLOCK", e))?;
    Ok(socket.into())
}

/// SO_ORIGINAL_DST (conntrack REDIRECT, or ambpf's answer), IPv4 then IPv6;
/// `None` when neither answers. IPv4-mapped addresses are unmapped.
pub(super) fn so_original_dst(stream: &TcpStream) -> Option<SocketAddr> {
    let socket = SockRef::from(stream);
    socket
        .original_dst_v4()
        .or_else(|_| socket.original_dst_v6())
        .ok()
        .and_then(|address| address.as_socket())
        .map(canonical)
}

/// `::ffff:a.b.c.d` as `a.b.c.d`, as ztunnel's `to_canonical`.
pub(super) fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::NetnsGuard;

    const DNS_V4: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 15053);
    const DNS_V6: SocketAddr = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 15053);

    /// Checks one DNS socket's options as the kernel reports them.
    fn assert_ztunnel_dns_socket(socket: SockRef<'_>, address: SocketAddr, kind: Type) {
        assert_eq!(socket.mark().unwrap(), ZTUNNEL_MARK, "{address} {kind:?}");
        assert!(socket.reuse_port().unwrap(), "{address} {kind:?}");
        assert!(socket.nonblocking().unwrap(), "{address} {kind:?}");
        assert_eq!(socket.r#type().unwrap(), kind);
        assert_eq!(socket.local_addr().unwrap().as_socket(), Some(address));
    }

    /// Needs root: creates a network namespace.
    #[test]
    fn dns_sockets_carry_ztunnel_mark_on_both_loopbacks() {
        let ns = NetnsGuard::create("dns").unwrap();
        for address in [DNS_V4, DNS_V6] {
            let sockets = ns
                .run(|| dns_sockets(address))
                .unwrap()
                .unwrap()
                .expect("loopback is up: both families are available");
            assert_ztunnel_dns_socket(SockRef::from(&sockets.udp), address, Type::DGRAM);
            assert_ztunnel_dns_socket(SockRef::from(&sockets.tcp), address, Type::STREAM);
            // The listener listens.
            let accepting = SockRef::from(&sockets.tcp).is_listener().unwrap();
            assert!(accepting, "{address}");
        }
    }

    /// Needs root: creates a network namespace.
    #[test]
    fn dns_sockets_on_ipv6_are_skipped_without_ipv6_loopback() {
        let ns = NetnsGuard::create("dns").unwrap();
        ns.ip(&["addr", "del", "::1/128", "dev", "lo"]).unwrap();
        assert!(ns.run(|| dns_sockets(DNS_V6)).unwrap().unwrap().is_none());
        assert!(ns.run(|| dns_sockets(DNS_V4)).unwrap().unwrap().is_some());
    }

    #[test]
    fn v4_mapped_addresses_are_unmapped() {
        let mapped: SocketAddr = "[::ffff:10.244.0.2]:15006".parse().unwrap();
        assert_eq!(canonical(mapped), "10.244.0.2:15006".parse().unwrap());
        let v6: SocketAddr = "[fd00:a::2]:15006".parse().unwrap();
        assert_eq!(canonical(v6), v6);
    }
}
