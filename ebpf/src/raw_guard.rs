//! The raw-socket guard: TCP a pod sends through a raw socket goes around
//! the connect() hooks, where Istio's nat rules would have sent it to
//! ztunnel like any other packet. Such segments are dropped instead.
//!
//! Two cgroup programs, attached once with the others, cost nothing per
//! pod at enrolment:
//! - `sock_create` tags each raw socket opened in an enrolled pod's netns
//!   with the pod's netns cookie (socket-local storage). The kernel runs it
//!   for sockets user space opens only, so the kernel's own raw sockets
//!   (those that send TCP resets and ACKs for no socket) are never tagged.
//! - `cgroup_skb/egress` looks at a packet's socket type first (one load on
//!   the path of every stream and datagram socket), and for a tagged raw
//!   socket of a pod still enrolled drops TCP (IPv4, or IPv6 after its
//!   extension headers) unless it goes to loopback or the pod's own
//!   address, the exemptions of the capture. ztunnel's mark exempts
//!   nothing: ztunnel has no raw sockets, and CAP_NET_RAW may set it.

use ambpf_common::{Counter, IpKey, TraceDirection, TraceRecord, Verdict, trace::IPPROTO_TCP};
use aya_ebpf::{
    bindings::{__sk_buff, BPF_SK_STORAGE_GET_F_CREATE, bpf_sock},
    btf_maps::SkStorage,
    helpers::generated::{
        bpf_get_netns_cookie, bpf_sk_fullsock, bpf_sk_storage_get, bpf_skb_load_bytes,
    },
    macros::{btf_map, cgroup_skb, cgroup_sock},
    programs::{SkBuffContext, SockContext},
};

use crate::{
    addr::is_loopback,
    maps::{PODS_BY_NETNS, count, is_pod_ip},
    trace::trace,
};

#[btf_map(name = "ambpf_raw_socks")]
static RAW_SOCKS: SkStorage<u64> = SkStorage::new();

const SOCK_RAW: u32 = 3;
/// Verdicts of cgroup programs.
const ALLOW: i32 = 1;
const DROP: i32 = 0;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;

#[inline(always)]
fn raw_socks() -> *mut core::ffi::c_void {
    core::ptr::from_ref(&RAW_SOCKS).cast_mut().cast()
}

#[cgroup_sock(sock_create)]
pub fn ambpf_rawsock(ctx: SockContext) -> i32 {
    let sk = ctx.sock;
    if unsafe { (*sk).type_ } != SOCK_RAW {
        return ALLOW;
    }
    let mut netns = unsafe { bpf_get_netns_cookie(sk.cast()) };
    if unsafe { PODS_BY_NETNS.get(&netns) }.is_none() {
        return ALLOW;
    }
    // Without memory for the tag the socket would escape: refuse it.
    let tag = unsafe {
        bpf_sk_storage_get(
            raw_socks(),
            sk.cast(),
            (&raw mut netns).cast(),
            BPF_SK_STORAGE_GET_F_CREATE.into(),
        )
    };
    if tag.is_null() { DROP } else { ALLOW }
}

/// A packet's addresses and TCP ports, for the trace.
struct Segment {
    src: IpKey,
    dst: IpKey,
    ports: [u8; 4],
}

#[inline(always)]
fn load<const N: usize>(skb: *mut __sk_buff, offset: u32) -> Option<[u8; N]> {
    let mut value = [0u8; N];
    let done = unsafe {
        bpf_skb_load_bytes(
            skb.cast_const().cast(),
            offset,
            value.as_mut_ptr().cast(),
            N as u32,
        )
    };
    (done == 0).then_some(value)
}

/// The TCP segment in an IPv4 packet (ports zero in a later fragment).
#[inline(always)]
fn tcp_in_v4(skb: *mut __sk_buff) -> Option<Segment> {
    let header: [u8; 20] = load(skb, 0)?;
    if header[9] != IPPROTO_TCP {
        return None;
    }
    let ihl = u32::from(header[0] & 0x0f) * 4;
    let first_fragment = (u16::from_be_bytes([header[6], header[7]]) & 0x1fff) == 0;
    let ports = if first_fragment {
        load(skb, ihl).unwrap_or_default()
    } else {
        [0; 4]
    };
    let at = |i: usize| [header[i], header[i + 1], header[i + 2], header[i + 3]];
    Some(Segment {
        src: IpKey::v4(at(12)),
        dst: IpKey::v4(at(16)),
        ports,
    })
}

/// IPv6 extension headers that may come before TCP.
const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const AUTH: u8 = 51;
const DEST_OPTIONS: u8 = 60;
/// Extension headers walked; a packet with more is taken for TCP.
const MAX_EXTENSIONS: usize = 6;

/// The TCP segment in an IPv6 packet, after its extension headers.
#[inline(always)]
fn tcp_in_v6(skb: *mut __sk_buff) -> Option<Segment> {
    let header: [u8; 40] = load(skb, 0)?;
    let mut next = header[6];
    let mut offset = 40u32;
    let mut ports_known = true;
    for _ in 0..MAX_EXTENSIONS {
        if next == IPPROTO_TCP {
            break;
        }
        let ext: [u8; 4] = match next {
            HOP_BY_HOP | ROUTING | FRAGMENT | AUTH | DEST_OPTIONS => load(skb, offset)?,
            _ => return None,
        };
        let len = match next {
            FRAGMENT => {
                // A later fragment carries no TCP header.
                ports_known = u16::from_be_bytes([ext[2], ext[3]]) & 0xfff8 == 0;
                8
            }
            AUTH => (u32::from(ext[1]) + 2) * 4,
            _ => (u32::from(ext[1]) + 1) * 8,
        };
        next = ext[0];
        offset += len;
    }
    let ports = if next == IPPROTO_TCP && ports_known {
        load(skb, offset).unwrap_or_default()
    } else {
        [0; 4]
    };
    let at = |i: usize| {
        let mut addr = [0u8; 16];
        addr.copy_from_slice(&header[i..i + 16]);
        IpKey::v6(addr)
    };
    Some(Segment {
        src: at(8),
        dst: at(24),
        ports,
    })
}

#[cgroup_skb(egress)]
pub fn ambpf_rawguard(ctx: SkBuffContext) -> i32 {
    let skb = ctx.skb.skb;
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return ALLOW;
    }
    let sk: *mut bpf_sock = unsafe { bpf_sk_fullsock(sk) };
    if sk.is_null() || unsafe { (*sk).type_ } != SOCK_RAW {
        return ALLOW;
    }
    let tag = unsafe { bpf_sk_storage_get(raw_socks(), sk.cast(), core::ptr::null_mut(), 0) };
    if tag.is_null() {
        return ALLOW;
    }
    let netns = unsafe { *tag.cast::<u64>() };
    // A pod removed since keeps its sockets: they are its own again.
    let Some(pod) = (unsafe { PODS_BY_NETNS.get(&netns) }) else {
        return ALLOW;
    };
    // skb->protocol, a __be16, in the low bytes.
    let segment = match u16::from_be(unsafe { (*skb).protocol } as u16) {
        ETH_P_IP => tcp_in_v4(skb),
        ETH_P_IPV6 => tcp_in_v6(skb),
        _ => None,
    };
    let Some(segment) = segment else {
        return ALLOW;
    };
    // ztunnel's mark exempts nothing here: ztunnel sends no TCP through raw
    // sockets, and an app with CAP_NET_RAW may set the mark (5.17+).
    if is_loopback(&segment.dst) || is_pod_ip(pod, &segment.dst) {
        return ALLOW;
    }
    count(Counter::RawTcpDropped);
    trace(|| {
        let [a, b, c, d] = segment.ports;
        TraceRecord {
            netns_cookie: netns,
            src: segment.src,
            dst: segment.dst,
            orig_dst: segment.dst,
            src_port_be: u16::from_ne_bytes([a, b]),
            dst_port_be: u16::from_ne_bytes([c, d]),
            orig_port_be: u16::from_ne_bytes([c, d]),
            protocol: IPPROTO_TCP,
            direction: TraceDirection::Outbound as u8,
            verdict: Verdict::RawTcpDropped as u32,
            ..TraceRecord::default()
        }
    });
    DROP
}
