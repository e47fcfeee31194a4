//! The in-pod proxies of one pod: listeners on 15001, 15006 and 15008 in the
//! pod's netns, and plain TCP proxying from sockets created there; and the
//! DNS proxy on 15053 (see `dns_server`).
//!
//! Real ztunnel decides from its xDS configuration whether to tunnel over
//! HBONE; the double has no configuration and passes every connection through
//! as plain TCP to its original destination, which is what ztunnel does for
//! destinations it does not know. 15008 is a plain-text stand-in for HBONE
//! (mTLS + HTTP/2 CONNECT): an HTTP/1.1 `CONNECT <ip:port>` request, answered
//! `200 OK`, then the stream is proxied to that target.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::BorrowedFd,
    sync::Arc,
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinSet,
};

use super::{
    ConnectionOutcome, DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT,
    ProxiedConnection, Shared,
    dns_server::{self, DnsAnswers, DnsContext},
    dns_upstream::Upstream,
    sockets::{PodSockets, canonical, so_original_dst},
};

/// ztunnel's own ports: a connection to one of them is a call to itself.
const ZTUNNEL_PORTS: [u16; 3] = [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT];
/// Per direction and connection, allocated once: large enough that copying
/// is not the bottleneck of a benchmark.
const COPY_BUFFER_LEN: usize = 64 * 1024;
/// The CONNECT request head must fit (ztunnel's HTTP/2 has no such limit, but
/// a stand-in request is a single short line plus a few headers).
const CONNECT_HEAD_MAX: usize = 4096;
/// After an accept error such as EMFILE, let connections drain before retrying.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ListenerKind {
    Outbound,
    InboundPlaintext,
    Hbone,
}

impl ListenerKind {
    const ALL: [Self; 3] = [Self::Outbound, Self::InboundPlaintext, Self::Hbone];

    fn port(self) -> u16 {
        match self {
            Self::Outbound => OUTBOUND_PORT,
            Self::InboundPlaintext => INBOUND_PLAINTEXT_PORT,
            Self::Hbone => HBONE_PORT,
        }
    }
}

/// What every connection of one pod needs.
struct ProxyContext {
    uid: String,
    sockets: PodSockets,
    shared: Arc<Shared>,
}

/// An accepted connection's addresses, as ztunnel reads them.
#[derive(Clone, Copy)]
struct Accepted {
    kind: ListenerKind,
    /// The accepted socket's peer and own address.
    client: SocketAddr,
    local: SocketAddr,
    so_original_dst: Option<SocketAddr>,
}

impl ProxyContext {
    fn record(&self, accepted: Accepted, original_dst: SocketAddr, outcome: ConnectionOutcome) {
        let Accepted {
            kind,
            client,
            local,
            so_original_dst,
        } = accepted;
        self.shared.record_connection(ProxiedConnection {
            uid: self.uid.clone(),
            listener_port: kind.port(),
            client,
            local,
            so_original_dst,
            original_dst,
            forwarded: (kind == ListenerKind::Outbound).then(|| forwarded_header(client)),
            outcome,
        });
    }
}

/// The `Forwarded` header of ztunnel's HBONE CONNECT (RFC 7239): the source
/// is the accepted socket's peer; an IPv6 one is quoted in brackets.
fn forwarded_header(source: SocketAddr) -> String {
    match source.ip() {
        IpAddr::V4(ip) => format!("for={ip}"),
        IpAddr::V6(ip) => format!("for=\"[{ip}]\""),
    }
}

/// A pod's running listeners and DNS sockets. Dropping it aborts them and
/// their connections; [`PodProxies::stop`] also waits until they are closed.
pub(super) struct PodProxies {
    listeners: JoinSet<()>,
}

impl PodProxies {
    /// Enters `netns`, listens on 15001, 15006 and 15008, and serves DNS on
    /// `127.0.0.1:15053` and `[::1]:15053` (UDP and TCP; IPv4 only if the
    /// netns has no IPv6 loopback). Nothing is left open on error.
    pub(super) async fn start(
        uid: &str,
        netns: BorrowedFd<'_>,
        shared: Arc<Shared>,
        dns_answers: DnsAnswers,
    ) -> io::Result<Self> {
        let sockets = PodSockets::enter(netns).await?;
        let mut bound = Vec::with_capacity(ListenerKind::ALL.len());
        for kind in ListenerKind::ALL {
            bound.push((kind, sockets.listener(kind.port()).await?));
        }
        let mut dns_bound = Vec::with_capacity(2);
        for address in [
            SocketAddr::from((Ipv4Addr::LOCALHOST, DNS_PORT)),
            SocketAddr::from((Ipv6Addr::LOCALHOST, DNS_PORT)),
        ] {
            if let Some(dns) = sockets.dns(address).await? {
                dns_bound.push((address, dns));
            }
        }
        let dns = Arc::new(DnsContext {
            uid: uid.to_owned(),
            answers: dns_answers,
            upstream: dns_answers
                .upstream
                .map(|address| Upstream::new(address, sockets.clone())),
            shared: shared.clone(),
        });
        let pod = Arc::new(ProxyContext {
            uid: uid.to_owned(),
            sockets,
            shared,
        });
        let mut listeners = JoinSet::new();
        for (kind, listener) in bound {
            listeners.spawn(serve(kind, listener, pod.clone()));
        }
        for (address, (udp, tcp)) in dns_bound {
            listeners.spawn(dns_server::serve_udp(udp, address, dns.clone()));
            listeners.spawn(dns_server::serve_tcp(tcp, address, dns.clone()));
        }
        Ok(Self { listeners })
    }

    /// Closes the listeners (aborting their connections) and waits for it.
    pub(super) async fn stop(mut self) {
        self.listeners.shutdown().await;
    }
}

/// Accepts connections until aborted; the connections live in a set owned by
/// this task, so aborting it aborts them too.
async fn serve(kind: ListenerKind, listener: TcpListener, pod: Arc<ProxyContext>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, client)) => {
                    connections.spawn(handle(kind, stream, canonical(client), pod.clone()));
                }
                Err(e) if is_per_connection_error(&e) => {}
                Err(e) => {
                    eprintln!("ztunnel double: pod {}: accept on port {}: {e}", pod.uid, kind.port());
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
            },
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Errors about one connection that went away before it was accepted.
fn is_per_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

async fn handle(
    kind: ListenerKind,
    mut downstream: TcpStream,
    client: SocketAddr,
    pod: Arc<ProxyContext>,
) {
    let _ = downstream.set_nodelay(true);
    let Ok(local) = downstream.local_addr().map(canonical) else {
        return;
    };
    let accepted = Accepted {
        kind,
        client,
        local,
        so_original_dst: None,
    };
    match kind {
        ListenerKind::Outbound | ListenerKind::InboundPlaintext => {
            // A busy ztunnel asks for the original destination late.
            let delay = pod.shared.original_dst_delay;
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let accepted = Accepted {
                so_original_dst: so_original_dst(&downstream),
                ..accepted
            };
            // Without SO_ORIGINAL_DST: TPROXY-style delivery (the local
            // address is the destination), or a direct connection.
            let original_dst = accepted.so_original_dst.unwrap_or(local);
            let self_call = if kind == ListenerKind::Outbound {
                is_outbound_self_call(original_dst, local)
            } else {
                is_inbound_self_call(original_dst)
            };
            if self_call {
                pod.record(accepted, original_dst, ConnectionOutcome::RefusedSelfCall);
                return;
            }
            // Inbound keeps the client's address, as ztunnel does; outbound
            // connects from the pod's own address.
            let source = (kind == ListenerKind::InboundPlaintext).then_some(client.ip());
            let mut upstream = match pod.sockets.connect(original_dst, source).await {
                Ok(upstream) => upstream,
                Err(e) => {
                    let outcome = ConnectionOutcome::UpstreamFailed(e.to_string());
                    pod.record(accepted, original_dst, outcome);
                    return;
                }
            };
            pod.record(accepted, original_dst, ConnectionOutcome::Proxied);
            relay(&mut downstream, &mut upstream).await;
        }
        ListenerKind::Hbone => serve_connect(downstream, accepted, &pod).await,
    }
}

/// The HBONE stand-in: `CONNECT <ip:port> HTTP/1.1`, then a plain tunnel.
async fn serve_connect(mut downstream: TcpStream, accepted: Accepted, pod: &ProxyContext) {
    let mut head = [0u8; CONNECT_HEAD_MAX];
    let (target, head_len, received) = match read_connect_head(&mut downstream, &mut head).await {
        Ok(parsed) => parsed,
        Err(reason) => {
            let _ = downstream
                .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                .await;
            pod.record(
                accepted,
                accepted.local,
                ConnectionOutcome::BadConnectRequest(reason),
            );
            return;
        }
    };
    if is_inbound_self_call(target) {
        let _ = downstream
            .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            .await;
        pod.record(accepted, target, ConnectionOutcome::RefusedSelfCall);
        return;
    }
    let mut upstream = match pod.sockets.connect(target, None).await {
        Ok(upstream) => upstream,
        Err(e) => {
            let _ = downstream
                .write_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
                .await;
            pod.record(
                accepted,
                target,
                ConnectionOutcome::UpstreamFailed(e.to_string()),
            );
            return;
        }
    };
    if downstream
        .write_all(b"HTTP/1.1 200 OK\r\n\r\n")
        .await
        .is_err()
    {
        return;
    }
    pod.record(accepted, target, ConnectionOutcome::Proxied);
    // Bytes the client sent right behind the request head belong upstream.
    if upstream.write_all(&head[head_len..received]).await.is_err() {
        return;
    }
    relay(&mut downstream, &mut upstream).await;
}

/// Reads up to the end of the request head; returns the target, the head's
/// length and how many bytes were read in all.
async fn read_connect_head(
    stream: &mut TcpStream,
    head: &mut [u8; CONNECT_HEAD_MAX],
) -> Result<(SocketAddr, usize, usize), String> {
    let mut received = 0;
    loop {
        if received == head.len() {
            return Err(format!("request head longer than {CONNECT_HEAD_MAX} bytes"));
        }
        let n = stream
            .read(&mut head[received..])
            .await
            .map_err(|e| format!("reading the request head: {e}"))?;
        if n == 0 {
            return Err("connection closed before the end of the request head".to_owned());
        }
        // The terminator may straddle two reads.
        let search_from = received.saturating_sub(3);
        received += n;
        if let Some(end) = find_head_end(&head[search_from..received]) {
            let head_len = search_from + end;
            let target = parse_connect_head(&head[..head_len])?;
            return Ok((target, head_len, received));
        }
    }
}

/// The index just past the first `\r\n\r\n`.
fn find_head_end(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
}

/// The target of `CONNECT <ip:port> HTTP/1.1\r\n<headers>\r\n\r\n`.
fn parse_connect_head(head: &[u8]) -> Result<SocketAddr, String> {
    let head = std::str::from_utf8(head).map_err(|_| "request head is not UTF-8".to_owned())?;
    let request_line = head.split("\r\n").next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(authority), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(format!("malformed request line {request_line:?}"));
    };
    if method != "CONNECT" {
        return Err(format!("method {method:?} is not CONNECT"));
    }
    if version != "HTTP/1.1" {
        return Err(format!("version {version:?} is not HTTP/1.1"));
    }
    authority
        .parse::<SocketAddr>()
        .map(canonical)
        .map_err(|_| format!("target {authority:?} is not an ip:port"))
}

/// ztunnel refuses outbound connections to itself on a loopback address. A
/// direct connection to the listener (no redirection: the original destination
/// is the listener's own address) is refused too: proxying it would connect
/// back to the same listener forever, where real ztunnel's xDS state would
/// reject the unknown source or loop.
fn is_outbound_self_call(original_dst: SocketAddr, local: SocketAddr) -> bool {
    ZTUNNEL_PORTS.contains(&original_dst.port())
        && (original_dst.ip().is_loopback() || original_dst == local)
}

/// ztunnel refuses inbound connections to any of its ports.
fn is_inbound_self_call(original_dst: SocketAddr) -> bool {
    ZTUNNEL_PORTS.contains(&original_dst.port())
}

/// Copies both ways until both sides are done, half-closes included. Errors
/// (resets) just end the connection.
async fn relay(downstream: &mut TcpStream, upstream: &mut TcpStream) {
    let _ = tokio::io::copy_bidirectional_with_sizes(
        downstream,
        upstream,
        COPY_BUFFER_LEN,
        COPY_BUFFER_LEN,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn connect_head_names_an_ip_and_port() {
        let head = b"CONNECT 10.244.0.2:8080 HTTP/1.1\r\nHost: 10.244.0.2:8080\r\n\r\n";
        assert_eq!(parse_connect_head(head), Ok(addr("10.244.0.2:8080")));
        let v6 = b"CONNECT [fd00:a::2]:80 HTTP/1.1\r\n\r\n";
        assert_eq!(parse_connect_head(v6), Ok(addr("[fd00:a::2]:80")));
        let mapped = b"CONNECT [::ffff:10.0.0.1]:80 HTTP/1.1\r\n\r\n";
        assert_eq!(parse_connect_head(mapped), Ok(addr("10.0.0.1:80")));
    }

    #[test]
    fn other_requests_are_rejected() {
        for head in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            b"CONNECT example.com:80 HTTP/1.1\r\n\r\n",
            b"CONNECT 10.0.0.1:80 HTTP/2\r\n\r\n",
            b"CONNECT 10.0.0.1:80\r\n\r\n",
            b"CONNECT 10.0.0.1:80 HTTP/1.1 extra\r\n\r\n",
            b"CONNECT 10.0.0.1 HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                parse_connect_head(head).is_err(),
                "{}",
                String::from_utf8_lossy(head)
            );
        }
    }

    #[test]
    fn forwarded_names_the_accepted_sockets_peer_as_rfc_7239_says() {
        assert_eq!(forwarded_header(addr("10.244.0.2:40000")), "for=10.244.0.2");
        assert_eq!(
            forwarded_header(addr("[fd00:a::2]:40000")),
            "for=\"[fd00:a::2]\""
        );
    }

    #[test]
    fn head_end_is_found_after_the_blank_line() {
        assert_eq!(find_head_end(b"CONNECT a HTTP/1.1\r\n\r\nrest"), Some(22));
        assert_eq!(find_head_end(b"CONNECT a HTTP/1.1\r\n"), None);
    }

    #[test]
    fn self_calls_follow_ztunnel() {
        let pod = addr("10.244.0.2:15001");
        // Outbound: loopback on a ztunnel port, or the listener itself.
        assert!(is_outbound_self_call(addr("127.0.0.1:15006"), pod));
        assert!(is_outbound_self_call(addr("[::1]:15008"), pod));
        assert!(is_outbound_self_call(pod, pod));
        assert!(!is_outbound_self_call(addr("127.0.0.1:8080"), pod));
        assert!(!is_outbound_self_call(addr("10.244.0.9:15008"), pod));
        // A TPROXY-style delivery: the local address is the real destination.
        let delivered = addr("10.96.0.10:80");
        assert!(!is_outbound_self_call(delivered, delivered));
        // Inbound: any ztunnel port.
        assert!(is_inbound_self_call(addr("10.244.0.2:15006")));
        assert!(is_inbound_self_call(addr("10.244.0.2:15001")));
        assert!(!is_inbound_self_call(addr("10.244.0.2:8080")));
    }
}
