//! ztunnel's DNS proxy in one pod: `127.0.0.1:15053` and `[::1]:15053`, UDP
//! and TCP. The double has no service registry: with an upstream it forwards
//! every query there ([`super::dns_upstream`]); without one it answers every
//! A query with one configured IPv4 address, every AAAA query with one IPv6
//! address, anything else with NOERROR and no answer.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, UdpSocket},
    task::JoinSet,
};

use super::{
    DnsQuery, DnsTransport, Shared,
    dns::{self, Parsed},
    dns_upstream::Upstream,
    sockets::canonical,
};

/// Datagrams are read into this, allocated once per socket. Queries are far
/// smaller (a question is at most 255 + 4 octets); a longer datagram is
/// truncated, which leaves its header and question intact.
const UDP_BUFFER_LEN: usize = 4096;
/// A response: header, question, one AAAA record, TCP length prefix.
const RESPONSE_CAPACITY: usize = 2 + dns::HEADER_LEN + dns::MAX_NAME_LEN + 4 + 28;
/// After an error that is not about one peer, do not spin.
const ERROR_PAUSE: Duration = Duration::from_millis(50);

/// What the double answers, or where it forwards.
#[derive(Clone, Copy, Debug)]
pub(super) struct DnsAnswers {
    pub(super) v4: Ipv4Addr,
    pub(super) v6: Ipv6Addr,
    pub(super) upstream: Option<SocketAddr>,
}

impl DnsAnswers {
    pub(super) fn of(config: &super::ZtunnelConfig) -> Self {
        Self {
            v4: config.dns_answer_v4,
            v6: config.dns_answer_v6,
            upstream: config.dns_upstream,
        }
    }

    /// A and AAAA of class IN (or ANY) get the configured address.
    fn answer(&self, question: &dns::Question<'_>) -> Option<IpAddr> {
        if question.qclass != dns::CLASS_IN && question.qclass != dns::CLASS_ANY {
            return None;
        }
        match question.qtype {
            dns::TYPE_A => Some(self.v4.into()),
            dns::TYPE_AAAA => Some(self.v6.into()),
            _ => None,
        }
    }
}

/// What every DNS socket of one pod needs.
pub(super) struct DnsContext {
    pub(super) uid: String,
    pub(super) answers: DnsAnswers,
    /// Made from `answers.upstream` with the pod's sockets.
    pub(super) upstream: Option<Upstream>,
    pub(super) shared: Arc<Shared>,
}

/// What became of one message.
enum Reply<'m> {
    /// A query, answered (with an address or none).
    Answered(dns::Question<'m>, Option<IpAddr>),
    /// A header that reads, refused with FORMERR or NOTIMP.
    Refused,
    /// Too short, or a response: dropped unanswered.
    Dropped,
}

impl DnsAnswers {
    /// Appends the response to `message` to `out` (nothing when dropped).
    fn reply<'m>(&self, message: &'m [u8], out: &mut Vec<u8>) -> Reply<'m> {
        match dns::parse_query(message) {
            Some(Parsed::Query(header, question)) => {
                let answer = self.answer(&question);
                dns::write_response(&header, Some(&question), dns::RCODE_NOERROR, answer, out);
                Reply::Answered(question, answer)
            }
            Some(Parsed::Reject(header, rcode)) => {
                dns::write_response(&header, None, rcode, None, out);
                Reply::Refused
            }
            None => Reply::Dropped,
        }
    }
}

impl DnsContext {
    /// Appends the response to `message` to `out` (the upstream's, if the
    /// pod has one, for a query), recording the query; false if the message
    /// is dropped unanswered.
    async fn respond(
        &self,
        message: &[u8],
        transport: DnsTransport,
        client: SocketAddr,
        server: SocketAddr,
        out: &mut Vec<u8>,
    ) -> bool {
        let reply = match (&self.upstream, dns::parse_query(message)) {
            (Some(upstream), Some(Parsed::Query(header, question))) => {
                let answer = upstream
                    .relay(message, &header, &question, transport, out)
                    .await;
                Reply::Answered(question, answer)
            }
            // Messages that are no query are refused or dropped as without
            // an upstream.
            _ => self.answers.reply(message, out),
        };
        match reply {
            Reply::Answered(question, answer) => {
                // Recorded before the answer leaves, so a test that has the
                // answer finds the record.
                self.shared.record_dns(DnsQuery {
                    uid: self.uid.clone(),
                    transport,
                    client,
                    server,
                    name: question.name(),
                    qtype: question.qtype,
                    answer,
                });
                true
            }
            Reply::Refused => {
                self.shared.record_dns_rejected();
                true
            }
            Reply::Dropped => {
                self.shared.record_dns_rejected();
                false
            }
        }
    }
}

/// A plain resolver, for what DNS costs without ztunnel: answers UDP
/// queries on `socket` as the DNS proxy does (the same answers, FORMERR and
/// NOTIMP, the same messages dropped), records nothing. Runs until aborted.
pub async fn serve_resolver_udp(socket: UdpSocket, answer_v4: Ipv4Addr, answer_v6: Ipv6Addr) {
    let answers = DnsAnswers {
        v4: answer_v4,
        v6: answer_v6,
        upstream: None,
    };
    let mut request = vec![0u8; UDP_BUFFER_LEN].into_boxed_slice();
    let mut response = Vec::with_capacity(RESPONSE_CAPACITY);
    loop {
        let (len, client) = match socket.recv_from(&mut request).await {
            Ok(received) => received,
            Err(e) if is_per_peer_error(&e) => continue,
            Err(e) => {
                eprintln!("resolver double: udp: {e}");
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        response.clear();
        if !matches!(
            answers.reply(&request[..len], &mut response),
            Reply::Dropped
        ) {
            let _ = socket.send_to(&response, client).await;
        }
    }
}

/// Answers datagrams on `socket` until aborted; buffers are reused.
pub(super) async fn serve_udp(socket: UdpSocket, server: SocketAddr, dns: Arc<DnsContext>) {
    let mut request = vec![0u8; UDP_BUFFER_LEN].into_boxed_slice();
    let mut response = Vec::with_capacity(RESPONSE_CAPACITY);
    loop {
        let (len, client) = match socket.recv_from(&mut request).await {
            Ok(received) => received,
            Err(e) if is_per_peer_error(&e) => continue,
            Err(e) => {
                eprintln!("ztunnel double: pod {}: DNS on udp {server}: {e}", dns.uid);
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        let client = canonical(client);
        response.clear();
        // One at a time: a forwarded query holds the socket until its
        // answer or SERVFAIL, at most the upstream's timeout.
        if dns
            .respond(
                &request[..len],
                DnsTransport::Udp,
                client,
                server,
                &mut response,
            )
            .await
        {
            // A client that went away is not the server's problem.
            let _ = socket.send_to(&response, client).await;
        }
    }
}

/// Accepts DNS-over-TCP connections until aborted; they live in a set owned
/// by this task, so aborting it aborts them too.
pub(super) async fn serve_tcp(listener: TcpListener, server: SocketAddr, dns: Arc<DnsContext>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, client)) => {
                    connections.spawn(serve_tcp_connection(stream, canonical(client), server, dns.clone()));
                }
                Err(e) if is_per_peer_error(&e) => {}
                Err(e) => {
                    eprintln!("ztunnel double: pod {}: DNS accept on tcp {server}: {e}", dns.uid);
                    tokio::time::sleep(ERROR_PAUSE).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Length-prefixed messages, answered in order, until the client closes the
/// connection; a message without a readable header closes it.
async fn serve_tcp_connection(
    mut stream: TcpStream,
    client: SocketAddr,
    server: SocketAddr,
    dns: Arc<DnsContext>,
) {
    let _ = stream.set_nodelay(true);
    let mut request = Vec::with_capacity(512);
    let mut response = Vec::with_capacity(RESPONSE_CAPACITY);
    loop {
        let mut prefix = [0u8; 2];
        if stream.read_exact(&mut prefix).await.is_err() {
            return;
        }
        request.resize(usize::from(u16::from_be_bytes(prefix)), 0);
        if stream.read_exact(&mut request).await.is_err() {
            return;
        }
        response.clear();
        response.extend_from_slice(&[0, 0]);
        if !dns
            .respond(&request, DnsTransport::Tcp, client, server, &mut response)
            .await
        {
            return;
        }
        let Ok(len) = u16::try_from(response.len() - 2) else {
            return;
        };
        response[..2].copy_from_slice(&len.to_be_bytes());
        if stream.write_all(&response).await.is_err() {
            return;
        }
    }
}

/// Errors about one peer (an ICMP error for an earlier datagram, a
/// connection gone before it was accepted): carry on at once.
fn is_per_peer_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_resolver_answers_as_the_dns_proxy_does_and_drops_what_it_drops() {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let resolver = socket.local_addr().unwrap();
        let v4 = Ipv4Addr::new(10, 96, 7, 7);
        let serving = tokio::spawn(serve_resolver_udp(
            socket,
            v4,
            "fd00:96::7".parse().unwrap(),
        ));
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.connect(resolver).await.unwrap();
        let mut buffer = [0u8; 512];
        let patience = Duration::from_secs(5);

        // A response is dropped unanswered, as the DNS proxy drops it.
        let mut response = dns::encode_query(9, "a.example", dns::TYPE_A).unwrap();
        response[2] |= 0x80;
        client.send(&response).await.unwrap();
        // A query is answered with the configured address and its id.
        let query = dns::encode_query(0x4242, "a.example", dns::TYPE_A).unwrap();
        client.send(&query).await.unwrap();
        let len = tokio::time::timeout(patience, client.recv(&mut buffer))
            .await
            .expect("an answer")
            .unwrap();
        let answer = dns::Response::parse(&buffer[..len]).unwrap();
        assert_eq!(
            answer.header.id, 0x4242,
            "the first datagram back answers the query"
        );
        assert_eq!(answer.addresses(), [IpAddr::V4(v4)]);
        // A header that reads with a question that does not gets FORMERR.
        client.send(&query[..dns::HEADER_LEN + 3]).await.unwrap();
        let len = tokio::time::timeout(patience, client.recv(&mut buffer))
            .await
            .expect("a FORMERR")
            .unwrap();
        let refused = dns::Header::parse(&buffer[..len]).unwrap();
        assert_eq!(refused.rcode(), dns::RCODE_FORMERR);
        serving.abort();
    }

    fn question(message: &[u8]) -> dns::Question<'_> {
        match dns::parse_query(message) {
            Some(Parsed::Query(_, question)) => question,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_and_aaaa_of_class_in_or_any_are_answered() {
        let answers = DnsAnswers {
            v4: Ipv4Addr::new(10, 96, 0, 53),
            v6: "fd00:96::53".parse().unwrap(),
            upstream: None,
        };
        let a = dns::encode_query(1, "a.example", dns::TYPE_A).unwrap();
        assert_eq!(answers.answer(&question(&a)), Some(answers.v4.into()));
        let aaaa = dns::encode_query(1, "a.example", dns::TYPE_AAAA).unwrap();
        assert_eq!(answers.answer(&question(&aaaa)), Some(answers.v6.into()));
        let txt = dns::encode_query(1, "a.example", 16).unwrap();
        assert_eq!(answers.answer(&question(&txt)), None);
        // Class CHAOS gets nothing; class ANY is answered.
        let mut chaos = a.clone();
        let len = chaos.len();
        chaos[len - 1] = 3;
        assert_eq!(answers.answer(&question(&chaos)), None);
        chaos[len - 1] = 255;
        assert_eq!(answers.answer(&question(&chaos)), Some(answers.v4.into()));
    }
}
