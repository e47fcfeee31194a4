//! Addresses as the maps key them ([`IpKey`]: IPv4 as v4-mapped IPv6).

use std::net::IpAddr;

use ambpf_common::IpKey;

pub fn ip_key(ip: IpAddr) -> IpKey {
    match ip {
        IpAddr::V4(v4) => IpKey::v4(v4.octets()),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpKey::v4(v4.octets()),
            None => IpKey::v6(v6.octets()),
        },
    }
}

/// An address key back as an address.
pub fn ip_addr(key: IpKey) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from(key.addr);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}
