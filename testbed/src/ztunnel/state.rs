//! What a double exposes: its ZDS events, pods, connections and the
//! records of what its proxies did.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// What the double saw and did on the ZDS socket, in order.
///
/// Request events (`Add`, `Keep`, `Del`, `SnapshotSent`) are recorded for
/// requests that were ACKed, before the ACK is sent; any other response is a
/// `Nacked` with the exact text sent. A `ProtocolError` follows the `Nacked`
/// of the request that stopped the client for good.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ZdsEvent {
    /// Connection number `connection` (from 1) is up and the hello was sent.
    Connected {
        connection: u32,
    },
    Add {
        uid: String,
        name: String,
        namespace: String,
        service_account: String,
        netns_inode: u64,
    },
    Keep {
        uid: String,
    },
    Del {
        uid: String,
    },
    SnapshotSent,
    /// A NACK; `uid` when the request could be decoded.
    Nacked {
        uid: Option<String>,
        reason: String,
    },
    ProtocolError {
        reason: String,
    },
    Disconnected {
        connection: u32,
        reason: String,
    },
}

/// A pod whose Add was ACKed and not yet undone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Workload {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// Inode of the netns fd received with the Add (`ls -Li /proc/<pid>/ns/net`).
    pub netns_inode: u64,
    /// The pod's listeners are up (false in ZDS-only mode).
    pub proxies_running: bool,
}

/// One ZDS connection: which pods it sent, as the snapshot reconciliation sees
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ZdsConnection {
    /// From 1, in connection order.
    pub id: u32,
    /// Uids of every Add received on this connection (ACKed or not), in order.
    pub added: Vec<String>,
    /// Uids of every Keep ACKed on this connection, in order.
    pub kept: Vec<String>,
    pub snapshot_sent: bool,
    /// Why the connection ended, once it has.
    pub ended: Option<String>,
}

/// What became of a connection accepted by an in-pod listener.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionOutcome {
    /// Connected upstream; bytes are (or were) copied both ways.
    Proxied,
    /// A call to ztunnel itself (outbound to a loopback address or to the
    /// listener itself on 15001/15006/15008; inbound to any of those ports),
    /// closed without connecting upstream.
    RefusedSelfCall,
    /// The upstream connection failed.
    UpstreamFailed(String),
    /// 15008 only: not a well-formed `CONNECT <ip:port> HTTP/1.1` request.
    BadConnectRequest(String),
}

/// A connection accepted by a pod's listener, recorded once its fate is
/// decided (for `Proxied`: once upstream is connected, before any byte is
/// copied).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxiedConnection {
    pub uid: String,
    /// 15001, 15006 or 15008.
    pub listener_port: u16,
    /// The peer of the accepted socket (IPv4-mapped addresses unmapped).
    pub client: SocketAddr,
    /// The accepted socket's own address (IPv4-mapped addresses unmapped).
    pub local: SocketAddr,
    /// What `SO_ORIGINAL_DST` (IPv4, then IPv6) answered on the accepted
    /// socket, `None` if it failed (no NAT and no ambpf answer); never asked
    /// on 15008.
    pub so_original_dst: Option<SocketAddr>,
    /// SO_ORIGINAL_DST, else the accepted socket's local address; for 15008
    /// the CONNECT target (or the local address if the request was
    /// unreadable).
    pub original_dst: SocketAddr,
    /// 15001 only: the `Forwarded` header ztunnel's HBONE CONNECT for this
    /// connection carries, built as ztunnel builds it, from the accepted
    /// socket's peer (`for=10.0.0.1`, `for="[fd00::1]"`).
    pub forwarded: Option<String>,
    pub outcome: ConnectionOutcome,
}

/// How a DNS query reached the DNS proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsTransport {
    Udp,
    Tcp,
}

/// A DNS query the double answered (NOERROR, with or without an answer, or
/// what its upstream answered), recorded before the answer is sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsQuery {
    pub uid: String,
    pub transport: DnsTransport,
    /// The querier as the DNS socket sees it (IPv4-mapped addresses
    /// unmapped): after a redirection, the app's socket address as rewritten
    /// on the way (a loopback or the pod's address, and the app's port).
    pub client: SocketAddr,
    /// The DNS socket that got it: `127.0.0.1:15053` or `[::1]:15053`.
    pub server: SocketAddr,
    /// The first question's name, without the final dot (`.` for the root),
    /// unusual bytes escaped (`\.`, `\DDD`).
    pub name: String,
    pub qtype: u16,
    /// The address answered: for A and AAAA of class IN or ANY; with an
    /// upstream, the first address of the answer relayed.
    pub answer: Option<IpAddr>,
}

/// Everything observable about the double. Read it with
/// [`ZtunnelDouble::inspect`], [`ZtunnelDouble::state`] or in a
/// [`ZtunnelDouble::wait_until`] predicate.
#[derive(Clone, Debug, Default)]
pub struct ZtunnelState {
    pub events: Vec<ZdsEvent>,
    /// Pods by uid.
    pub workloads: BTreeMap<String, Workload>,
    /// Uids whose proxies failed to start, retried periodically.
    pub pending: BTreeSet<String>,
    /// Every connection so far, oldest first.
    pub connections: Vec<ZdsConnection>,
    pub connected: bool,
    /// SnapshotSent received on the current connection and nothing pending
    /// (ztunnel's `/healthz/ready`).
    pub ready: bool,
    /// Why the ZDS client stopped for good (protocol error, or the single
    /// connection of [`ZtunnelDouble::connect`] ended). Pods keep running.
    pub stopped: Option<String>,
    pub proxied: Vec<ProxiedConnection>,
    /// Every DNS query answered, in order.
    pub dns_queries: Vec<DnsQuery>,
    /// DNS messages not answered normally: dropped (shorter than a header,
    /// or a response) or answered FORMERR or NOTIMP.
    pub dns_rejected: u64,
}

impl ZtunnelState {
    /// The connection in progress or the last one.
    pub fn current_connection(&self) -> Option<&ZdsConnection> {
        self.connections.last()
    }

    /// Events since the last `Connected` (all of them if never connected).
    pub fn current_connection_events(&self) -> &[ZdsEvent] {
        let start = self
            .events
            .iter()
            .rposition(|e| matches!(e, ZdsEvent::Connected { .. }))
            .unwrap_or(0);
        &self.events[start..]
    }

    pub(super) fn connection_mut(&mut self) -> Option<&mut ZdsConnection> {
        self.connections.last_mut()
    }
}

/// A predicate did not hold in time; carries the state for the failure message.
#[derive(Debug)]
pub struct WaitTimeout {
    pub waited: Duration,
    pub state: Box<ZtunnelState>,
}

impl WaitTimeout {
    /// A state with more events or records than this is summarised, with
    /// its last events, rather than printed whole (a long soak's is
    /// millions of lines).
    const PRINTED_IN_FULL: usize = 200;
}

impl fmt::Display for WaitTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.state;
        write!(f, "condition not met within {:?}; ", self.waited)?;
        let largest = [s.events.len(), s.proxied.len(), s.dns_queries.len()];
        if largest.into_iter().max().unwrap_or(0) <= Self::PRINTED_IN_FULL {
            return write!(f, "ztunnel double state: {s:#?}");
        }
        let tail = &s.events[s.events.len().saturating_sub(Self::PRINTED_IN_FULL)..];
        let current = s.current_connection().map(|c| {
            format!(
                "#{} ({} added, {} kept, snapshot sent: {}, ended: {:?})",
                c.id,
                c.added.len(),
                c.kept.len(),
                c.snapshot_sent,
                c.ended
            )
        });
        write!(
            f,
            "ztunnel double: connected {}, ready {}, stopped {:?}, {} workloads, pending {:?}, \
             connection {} of {}, {} proxied and {} DNS records; its last {} of {} events: {tail:#?}",
            s.connected,
            s.ready,
            s.stopped,
            s.workloads.len(),
            s.pending,
            current.unwrap_or_else(|| "none".to_owned()),
            s.connections.len(),
            s.proxied.len(),
            s.dns_queries.len(),
            tail.len(),
            s.events.len(),
        )
    }
}

impl std::error::Error for WaitTimeout {}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout_with(events: usize) -> String {
        let state = ZtunnelState {
            events: (0..events)
                .map(|i| ZdsEvent::Keep {
                    uid: format!("uid-{i}"),
                })
                .collect(),
            ..ZtunnelState::default()
        };
        WaitTimeout {
            waited: Duration::from_secs(1),
            state: Box::new(state),
        }
        .to_string()
    }

    #[test]
    fn a_small_state_is_printed_whole_and_a_large_one_summarised() {
        let small = timeout_with(3);
        assert!(
            small.contains("ztunnel double state: ZtunnelState"),
            "{small}"
        );
        assert!(
            small.contains("uid-0") && small.contains("uid-2"),
            "{small}"
        );

        let large = timeout_with(10_000);
        assert!(large.contains("its last 200 of 10000 events"), "{large}");
        assert!(
            large.contains("uid-9999") && large.contains("uid-9800"),
            "{large}"
        );
        assert!(!large.contains("\"uid-9799\""), "older events are left out");
    }
}
