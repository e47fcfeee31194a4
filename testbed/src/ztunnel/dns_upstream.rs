//! The DNS proxy's upstream: ztunnel answers the names of its own registry
//! and forwards every other query to the resolvers of its own
//! `/etc/resolv.conf` (the cluster's DNS). The double's registry is empty (it
//! gets no xDS), so with an upstream ([`ZtunnelConfig::dns_upstream`]) it
//! forwards every query.
//!
//! As ztunnel's forwarder, each query leaves from a socket made in the pod's
//! netns with SO_MARK 0x539, like every upstream socket of ztunnel's in-pod
//! proxies: the pod's redirection must let it pass, or the query would come
//! back to the proxy. It goes over the transport the query came on; the
//! upstream's response is relayed as it is, and no response in time (or one
//! that does not read as the response to that query) is answered SERVFAIL.
//!
//! [`ZtunnelConfig::dns_upstream`]: super::ZtunnelConfig::dns_upstream

use std::{
    io,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{
    DnsTransport,
    dns::{self, Header, Question},
    sockets::PodSockets,
};

/// How long one forwarded query may take before it is answered SERVFAIL
/// (a stub resolver retries after about 5 s).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// A UDP response is read whole, whatever size the client allowed.
const UDP_RESPONSE_MAX: usize = u16::MAX as usize;

/// Where one pod's DNS proxy forwards, and how it makes its sockets.
pub(super) struct Upstream {
    address: SocketAddr,
    sockets: PodSockets,
    timeout: Duration,
}

impl Upstream {
    pub(super) fn new(address: SocketAddr, sockets: PodSockets) -> Self {
        Self {
            address,
            sockets,
            timeout: UPSTREAM_TIMEOUT,
        }
    }

    /// Forwards `query` (whose header and first question are `header` and
    /// `question`) and appends the upstream's response to `out`, or SERVFAIL;
    /// returns the first address the relayed response answers.
    pub(super) async fn relay(
        &self,
        query: &[u8],
        header: &Header,
        question: &Question<'_>,
        transport: DnsTransport,
        out: &mut Vec<u8>,
    ) -> Option<IpAddr> {
        let exchanged = tokio::time::timeout(self.timeout, self.exchange(query, transport)).await;
        if let Ok(Ok(response)) = exchanged {
            match dns::Response::parse(&response) {
                Ok(parsed) if parsed.header.id == header.id => {
                    out.extend_from_slice(&response);
                    return parsed.addresses().first().copied();
                }
                _ => {}
            }
        }
        dns::write_response(header, Some(question), dns::RCODE_SERVFAIL, None, out);
        None
    }

    /// One query and its response, over `transport`.
    async fn exchange(&self, query: &[u8], transport: DnsTransport) -> io::Result<Vec<u8>> {
        let id = Header::parse(query).map(|h| h.id);
        match transport {
            DnsTransport::Udp => {
                let socket = self.sockets.udp_upstream(self.address).await?;
                socket.send(query).await?;
                let mut response = vec![0u8; UDP_RESPONSE_MAX];
                // The socket is connected, so only the upstream's datagrams
                // arrive; a late answer to an earlier query is skipped.
                loop {
                    let len = socket.recv(&mut response).await?;
                    if Header::parse(&response[..len]).map(|h| h.id) == id {
                        response.truncate(len);
                        return Ok(response);
                    }
                }
            }
            DnsTransport::Tcp => {
                let mut stream = self.sockets.connect(self.address, None).await?;
                let len = u16::try_from(query.len())
                    .map_err(|_| io::Error::other("a query longer than 65535 octets"))?;
                let mut framed = Vec::with_capacity(2 + query.len());
                framed.extend_from_slice(&len.to_be_bytes());
                framed.extend_from_slice(query);
                stream.write_all(&framed).await?;
                let mut prefix = [0u8; 2];
                stream.read_exact(&mut prefix).await?;
                let mut response = vec![0u8; usize::from(u16::from_be_bytes(prefix))];
                stream.read_exact(&mut response).await?;
                Ok(response)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fs::File,
        net::{Ipv4Addr, UdpSocket as StdUdpSocket},
        os::fd::AsFd,
    };

    use tokio::net::{TcpListener, UdpSocket};

    use super::*;
    use crate::{
        NetnsGuard,
        ztunnel::{ZtunnelConfig, ZtunnelDouble, dns::Parsed},
    };

    const RELAYED: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 5);

    /// What a real resolver sends back: the query's id and question, one A
    /// record, in DNS wire format.
    fn upstream_answer(query: &[u8]) -> Vec<u8> {
        let Some(Parsed::Query(header, question)) = dns::parse_query(query) else {
            panic!("the upstream got no query: {query:?}");
        };
        let mut response = Vec::new();
        dns::write_response(
            &header,
            Some(&question),
            dns::RCODE_NOERROR,
            Some(RELAYED.into()),
            &mut response,
        );
        response
    }

    /// A UDP resolver on the namespace's loopback that first answers with a
    /// stray id, then properly; returns its address and the queries it got.
    async fn udp_resolver(ns: &NetnsGuard) -> (SocketAddr, tokio::task::JoinHandle<Vec<u8>>) {
        let socket = ns
            .run(|| StdUdpSocket::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        socket.set_nonblocking(true).unwrap();
        let socket = UdpSocket::from_std(socket).unwrap();
        let address = socket.local_addr().unwrap();
        let serving = tokio::spawn(async move {
            let mut query = vec![0u8; 512];
            let (len, client) = socket.recv_from(&mut query).await.unwrap();
            query.truncate(len);
            let mut stray = upstream_answer(&query);
            stray[1] ^= 0xff;
            socket.send_to(&stray, client).await.unwrap();
            socket
                .send_to(&upstream_answer(&query), client)
                .await
                .unwrap();
            query
        });
        (address, serving)
    }

    fn pod_netns(ns: &NetnsGuard) -> File {
        File::open(ns.path()).unwrap()
    }

    /// Needs root: creates a network namespace. The whole path: the pod's
    /// DNS proxy relays the upstream's answer and records it.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_query_over_udp_is_relayed_from_the_pod_and_recorded() {
        let ns = NetnsGuard::create("dns-upstream").unwrap();
        let (upstream, resolver) = udp_resolver(&ns).await;
        let double = ZtunnelDouble::serve_pod(
            "pod-a",
            pod_netns(&ns).as_fd(),
            ZtunnelConfig::default().dns_upstream(upstream),
        )
        .await
        .unwrap();
        let client = ns
            .run(|| StdUdpSocket::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        client.set_nonblocking(true).unwrap();
        let client = UdpSocket::from_std(client).unwrap();
        let query = dns::encode_query(0x5151, "web.e2e.svc.cluster.local", dns::TYPE_A).unwrap();
        client.send_to(&query, "127.0.0.1:15053").await.unwrap();
        let mut buffer = [0u8; 512];
        let len = tokio::time::timeout(Duration::from_secs(5), client.recv(&mut buffer))
            .await
            .expect("a relayed answer")
            .unwrap();
        assert_eq!(
            resolver.await.unwrap(),
            query,
            "the query is forwarded as sent"
        );
        assert_eq!(
            &buffer[..len],
            upstream_answer(&query),
            "the answer is relayed as the upstream sent it, the stray one skipped"
        );
        let recorded = double.dns_queries();
        assert_eq!(recorded.len(), 1, "{recorded:?}");
        assert_eq!(recorded[0].name, "web.e2e.svc.cluster.local");
        assert_eq!(recorded[0].transport, DnsTransport::Udp);
        assert_eq!(recorded[0].answer, Some(RELAYED.into()));
        double.shutdown().await;
    }

    fn question(query: &[u8]) -> (Header, Question<'_>) {
        match dns::parse_query(query) {
            Some(Parsed::Query(header, question)) => (header, question),
            other => panic!("{other:?}"),
        }
    }

    /// Needs root: creates a network namespace.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_query_over_tcp_is_relayed_over_tcp() {
        let ns = NetnsGuard::create("dns-upstream").unwrap();
        let listener = ns
            .run(|| std::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = TcpListener::from_std(listener).unwrap();
        let address = listener.local_addr().unwrap();
        let resolver = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut prefix = [0u8; 2];
            stream.read_exact(&mut prefix).await.unwrap();
            let mut query = vec![0u8; usize::from(u16::from_be_bytes(prefix))];
            stream.read_exact(&mut query).await.unwrap();
            let answer = upstream_answer(&query);
            let mut framed = (answer.len() as u16).to_be_bytes().to_vec();
            framed.extend_from_slice(&answer);
            stream.write_all(&framed).await.unwrap();
        });
        let upstream = Upstream::new(
            address,
            PodSockets::enter(pod_netns(&ns).as_fd()).await.unwrap(),
        );
        let query = dns::encode_query(7, "web.e2e.svc.cluster.local", dns::TYPE_A).unwrap();
        let (header, q) = question(&query);
        let mut out = Vec::new();
        let answer = upstream
            .relay(&query, &header, &q, DnsTransport::Tcp, &mut out)
            .await;
        resolver.await.unwrap();
        assert_eq!(answer, Some(RELAYED.into()));
        assert_eq!(out, upstream_answer(&query));
    }

    /// Needs root: creates a network namespace. A silent upstream and a
    /// refused one both give SERVFAIL with the query's id and question.
    #[tokio::test(flavor = "multi_thread")]
    async fn no_answer_from_upstream_is_servfail() {
        let ns = NetnsGuard::create("dns-upstream").unwrap();
        let silent = ns
            .run(|| StdUdpSocket::bind("127.0.0.1:0"))
            .unwrap()
            .unwrap();
        let mut upstream = Upstream::new(
            silent.local_addr().unwrap(),
            PodSockets::enter(pod_netns(&ns).as_fd()).await.unwrap(),
        );
        upstream.timeout = Duration::from_millis(300);
        let query = dns::encode_query(9, "nowhere.example", dns::TYPE_A).unwrap();
        let (header, q) = question(&query);
        for transport in [DnsTransport::Udp, DnsTransport::Tcp] {
            // Nothing listens on TCP at that port: refused.
            let mut out = Vec::new();
            let answer = upstream
                .relay(&query, &header, &q, transport, &mut out)
                .await;
            assert_eq!(answer, None);
            let response = dns::Response::parse(&out).unwrap();
            assert_eq!(response.header.id, 9, "{transport:?}");
            assert_eq!(response.rcode(), dns::RCODE_SERVFAIL, "{transport:?}");
            assert_eq!(response.questions[0].name, "nowhere.example");
        }
    }
}
