//! The redirected connections the kernel holds an original destination for
//! ([`maps::ORIG_BY_TUPLE`]), as `ambpf status` shows them.
//!
//! sock_ops files an entry when a redirected app socket connects (to
//! ztunnel's 15001, or its DNS proxy's 15053 for DNS over TCP) and deletes it
//! when that socket closes, so the map holds the open ones (the LRU only
//! evicts when it is full). Its key is the connection as ztunnel's accepted
//! socket sees it and its value the destination the app asked for, which is
//! all a status can tell truthfully: the app's own address (its
//! `getsockname()`, and the peer ztunnel's socket sees), the address ztunnel
//! accepted it on, and the original destination (the app's `getpeername()`
//! and ztunnel's `SO_ORIGINAL_DST` answer). Inbound connections leave no
//! record: `bpf_sk_assign` rewrites nothing, so ztunnel's socket holds the
//! original destination as its own address.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr, SocketAddr},
};

use ambpf_common::{IpKey, SockAddr, TupleKey, maps};
use aya::maps::{HashMap, Map, MapData};
use serde::Serialize;

use super::{PinLayout, inspect::InspectError};

/// One open redirected connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct RedirectedConnection {
    /// The app's socket: its `getsockname()`, and the peer of ztunnel's
    /// accepted socket.
    pub app: SocketAddr,
    /// Where ztunnel accepted it (its accepted socket's own address).
    pub ztunnel: SocketAddr,
    /// The destination the app connected to: its `getpeername()`, and
    /// ztunnel's `SO_ORIGINAL_DST` answer.
    pub original_destination: SocketAddr,
}

/// The open redirected connections by the netns cookie of the pod that
/// made them, each pod's sorted (empty where the map is not pinned).
pub fn read(pins: &PinLayout) -> Result<BTreeMap<u64, Vec<RedirectedConnection>>, InspectError> {
    let path = pins.map(maps::ORIG_BY_TUPLE);
    let mut out: BTreeMap<u64, Vec<RedirectedConnection>> = BTreeMap::new();
    if !path.exists() {
        return Ok(out);
    }
    let map_err = |source| InspectError::Map {
        path: path.clone(),
        cause: source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    let map: HashMap<_, TupleKey, SockAddr> =
        HashMap::try_from(Map::LruHashMap(data)).map_err(map_err)?;
    for entry in map.iter() {
        // An entry deleted while walking ends the walk's view of it: skip.
        let Ok((key, orig)) = entry else { continue };
        out.entry(key.netns_cookie)
            .or_default()
            .push(RedirectedConnection {
                app: socket_addr(&key.peer),
                ztunnel: socket_addr(&key.local),
                original_destination: socket_addr(&orig),
            });
    }
    for connections in out.values_mut() {
        connections.sort_unstable();
    }
    Ok(out)
}

fn socket_addr(addr: &SockAddr) -> SocketAddr {
    SocketAddr::new(ip(addr.ip), u16::from_be(addr.port_be))
}

fn ip(key: IpKey) -> IpAddr {
    let v6 = Ipv6Addr::from(key.addr);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_come_back_in_host_order_and_unmapped() {
        let addr = SockAddr {
            ip: IpKey::v4([10, 244, 1, 2]),
            port_be: 15001u16.to_be(),
            _pad: [0; 6],
        };
        assert_eq!(
            socket_addr(&addr),
            "10.244.1.2:15001".parse::<SocketAddr>().unwrap()
        );
        let v6 = SockAddr {
            ip: IpKey::v6("fd00:a:1::2".parse::<Ipv6Addr>().unwrap().octets()),
            port_be: 9000u16.to_be(),
            _pad: [0; 6],
        };
        assert_eq!(
            socket_addr(&v6),
            "[fd00:a:1::2]:9000".parse::<SocketAddr>().unwrap()
        );
    }
}
