//! TC ingress on an enrolled pod's interfaces: inbound capture.
//!
//! A TCP SYN to one of the pod's addresses is handed to ztunnel's inbound
//! listener (15006) with `bpf_sk_assign`, as TPROXY would: the accepted
//! socket's local address is the original destination, so ztunnel needs no
//! SO_ORIGINAL_DST. Only SYNs are steered; the rest of the handshake and the
//! connection find their socket through the kernel's established lookup.
//!
//! Before Linux 6.5 the TC `bpf_sk_assign` refuses SO_REUSEPORT listeners,
//! and ztunnel's are. There the agent sets [`INBOUND_VIA_SK_LOOKUP`]: the
//! program puts the listener it found in `INBOUND_LISTENERS` and the SYN's
//! tuple in `INBOUND_SYNS`, and lets the SYN go on to the pod's sk_lookup
//! program ([`crate::inbound_lookup`]), whose assignment takes reuseport
//! groups. Every decision stays here.
//!
//! Not captured, as in Istio: HBONE (15008, straight to ztunnel's listener),
//! and traffic from this node's own addresses (the host network namespace,
//! where kubelet probes come from). With no ztunnel listener the SYN is
//! refused with an RST, as the kernel does under Istio's REDIRECT to a closed
//! 15006 ([`crate::tcp_reset`]); it never reaches the app.

use ambpf_common::{
    Counter, IpKey, SockAddr, SteeredSynKey, TraceDirection, TraceRecord, Verdict, ztunnel,
};
use aya_ebpf::{
    Global,
    bindings::{
        BPF_ANY, BPF_F_CURRENT_NETNS, TC_ACT_OK, TC_ACT_SHOT, bpf_sock, bpf_sock_tuple,
        tcx_action_base::TCX_NEXT,
    },
    helpers::{bpf_map_update_elem, bpf_sk_assign, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};

use crate::{
    addr::{v4, v6},
    maps::{HOST_ADDRS, INBOUND_LISTENERS, INBOUND_SYNS, PODS_BY_IP, count},
    tcp_reset::{ETH_HLEN, refuse},
    trace::{PodEvent, count_pod, trace},
};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
const BPF_TCP_LISTEN: u32 = 10;
/// IPv6 extension headers skipped on the way to TCP.
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_DEST_OPTS: u8 = 60;
const MAX_IPV6_EXT_HEADERS: usize = 3;

/// Set by the agent at load (read-only data, so the verifier prunes the
/// path not taken): non-zero where the kernel's TC `bpf_sk_assign` refuses
/// SO_REUSEPORT listeners.
#[unsafe(no_mangle)]
static INBOUND_VIA_SK_LOOKUP: Global<u8> = Global::new(0);

#[classifier]
pub fn ambpf_pod_in(ctx: TcContext) -> i32 {
    steer(&ctx).unwrap_or(TCX_NEXT)
}

/// A parsed TCP SYN.
struct Syn {
    src: IpKey,
    dst: IpKey,
    /// Host order.
    dport: u16,
    /// Network order.
    sport_be: u16,
    tuple: bpf_sock_tuple,
    /// Offset of the TCP header.
    l4: usize,
}

/// Reports an inbound decision on a SYN to the pod `netns`; `to_port`:
/// where it goes (ztunnel's listener, or where it was sent).
#[inline(always)]
fn report(syn: &Syn, netns: u64, to_port: u16, verdict: Verdict) {
    trace(|| TraceRecord {
        netns_cookie: netns,
        src: syn.src,
        dst: syn.dst,
        orig_dst: syn.dst,
        src_port_be: syn.sport_be,
        dst_port_be: to_port.to_be(),
        orig_port_be: syn.dport.to_be(),
        protocol: IPPROTO_TCP,
        direction: TraceDirection::Inbound as u8,
        verdict: verdict as u32,
        ..TraceRecord::default()
    });
}

/// Sizes of `bpf_sock_tuple`'s IPv4 and IPv6 variants.
const TUPLE_V4_LEN: u32 = 12;
const TUPLE_V6_LEN: u32 = 36;

#[inline(always)]
fn steer(ctx: &TcContext) -> Result<i32, i64> {
    let Some(syn) = parse_syn(ctx)? else {
        return Ok(TCX_NEXT);
    };
    let Some(pod) = (unsafe { PODS_BY_IP.get(&syn.dst) }) else {
        return Ok(TCX_NEXT); // not (or no longer) enrolled
    };
    let netns = pod.netns_cookie;
    if syn.dport == ztunnel::HBONE_PORT {
        report(&syn, netns, syn.dport, Verdict::Hbone);
        return Ok(TCX_NEXT);
    }
    if unsafe { HOST_ADDRS.get(&syn.src) }.is_some() {
        count(Counter::ProbeBypassed);
        count_pod(netns, PodEvent::Probe);
        report(&syn, netns, syn.dport, Verdict::ProbeBypassed);
        return Ok(TCX_NEXT);
    }
    let (action, verdict) = assign_to_inbound_listener(ctx, &syn, netns);
    match verdict {
        Verdict::InboundSteered => {
            count(Counter::InboundRedirected);
            count_pod(netns, PodEvent::Inbound);
        }
        _ => count(Counter::InboundNoListener),
    }
    report(&syn, netns, ztunnel::INBOUND_PORT, verdict);
    Ok(action)
}

#[inline(always)]
fn assign_to_inbound_listener(ctx: &TcContext, syn: &Syn, pod_netns: u64) -> (i32, Verdict) {
    let mut tuple = syn.tuple;
    // Look up ztunnel's listener on the same destination address, port 15006.
    // (Writing a union field is safe; reading one is not.)
    if syn.dst.is_v4() {
        tuple.__bindgen_anon_1.ipv4.dport = ztunnel::INBOUND_PORT.to_be();
    } else {
        tuple.__bindgen_anon_1.ipv6.dport = ztunnel::INBOUND_PORT.to_be();
    }
    let skb = ctx.skb.skb.cast();
    // The tuple size must be a constant the verifier can see at the call.
    let netns = BPF_F_CURRENT_NETNS as u64;
    let sk = unsafe {
        if syn.dst.is_v4() {
            bpf_skc_lookup_tcp(skb, &raw mut tuple, TUPLE_V4_LEN, netns, 0)
        } else {
            bpf_skc_lookup_tcp(skb, &raw mut tuple, TUPLE_V6_LEN, netns, 0)
        }
    };
    if sk.is_null() {
        return (refuse(ctx, syn.dst.is_v4(), syn.l4), Verdict::NoListener);
    }
    if unsafe { (*sk).state } != BPF_TCP_LISTEN {
        unsafe { bpf_sk_release(sk.cast()) };
        return (refuse(ctx, syn.dst.is_v4(), syn.l4), Verdict::NoListener);
    }
    let assigned = if INBOUND_VIA_SK_LOOKUP.load() != 0 {
        hand_to_sk_lookup(syn, pod_netns, sk.cast())
    } else {
        unsafe { bpf_sk_assign(skb, sk.cast(), 0) }
    };
    unsafe { bpf_sk_release(sk.cast()) };
    if assigned != 0 {
        return (TC_ACT_SHOT, Verdict::NoListener);
    }
    (TC_ACT_OK, Verdict::InboundSteered)
}

/// Records `listener` as the pod's (`netns`) inbound listener and the SYN as
/// steered, for [`crate::inbound_lookup`]; non-zero when either write fails.
#[inline(always)]
fn hand_to_sk_lookup(syn: &Syn, netns: u64, listener: *mut bpf_sock) -> i64 {
    let mut key = netns;
    // From TC, a SOCKHASH takes a socket the program holds (5.10+).
    let stored = unsafe {
        bpf_map_update_elem(
            core::ptr::from_ref(&INBOUND_LISTENERS).cast_mut().cast(),
            (&raw mut key).cast(),
            listener.cast(),
            u64::from(BPF_ANY),
        )
    };
    if stored != 0 {
        return stored;
    }
    let steered = SteeredSynKey {
        _zero: 0,
        dst: SockAddr {
            ip: syn.dst,
            port_be: syn.dport.to_be(),
            ..SockAddr::default()
        },
        src: SockAddr {
            ip: syn.src,
            port_be: syn.sport_be,
            ..SockAddr::default()
        },
    };
    match INBOUND_SYNS.insert(&steered, &netns, 0) {
        Ok(()) => 0,
        Err(e) => i64::from(e),
    }
}

/// The packet as a TCP SYN (without ACK), or `None` for anything else.
#[inline(always)]
fn parse_syn(ctx: &TcContext) -> Result<Option<Syn>, i64> {
    let proto = u16::from_be(ctx.load::<u16>(12)?);
    // SAFETY: an all-zero tuple is a valid value of the union.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let (src, dst, l4) = match proto {
        ETH_P_IP => {
            let version_ihl: u8 = ctx.load(ETH_HLEN)?;
            let frag: u16 = u16::from_be(ctx.load(ETH_HLEN + 6)?);
            let next: u8 = ctx.load(ETH_HLEN + 9)?;
            // Later fragments carry no TCP header.
            if next != IPPROTO_TCP || frag & 0x1fff != 0 {
                return Ok(None);
            }
            let saddr: u32 = ctx.load(ETH_HLEN + 12)?;
            let daddr: u32 = ctx.load(ETH_HLEN + 16)?;
            tuple.__bindgen_anon_1.ipv4.saddr = saddr;
            tuple.__bindgen_anon_1.ipv4.daddr = daddr;
            let l4 = ETH_HLEN + usize::from(version_ihl & 0x0f) * 4;
            (v4(saddr), v4(daddr), l4)
        }
        ETH_P_IPV6 => {
            let mut next: u8 = ctx.load(ETH_HLEN + 6)?;
            let saddr: [u32; 4] = ctx.load(ETH_HLEN + 8)?;
            let daddr: [u32; 4] = ctx.load(ETH_HLEN + 24)?;
            let mut l4 = ETH_HLEN + 40;
            for _ in 0..MAX_IPV6_EXT_HEADERS {
                if next != IPV6_HOP_BY_HOP && next != IPV6_ROUTING && next != IPV6_DEST_OPTS {
                    break;
                }
                let header_len: u8 = ctx.load(l4 + 1)?;
                next = ctx.load(l4)?;
                l4 += (usize::from(header_len) + 1) * 8;
            }
            if next != IPPROTO_TCP {
                return Ok(None);
            }
            tuple.__bindgen_anon_1.ipv6.saddr = saddr;
            tuple.__bindgen_anon_1.ipv6.daddr = daddr;
            (v6(saddr), v6(daddr), l4)
        }
        _ => return Ok(None),
    };
    let flags: u8 = ctx.load(l4 + 13)?;
    if flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
        return Ok(None);
    }
    let sport: u16 = ctx.load(l4)?;
    let dport: u16 = ctx.load(l4 + 2)?;
    if proto == ETH_P_IP {
        tuple.__bindgen_anon_1.ipv4.sport = sport;
        tuple.__bindgen_anon_1.ipv4.dport = dport;
    } else {
        tuple.__bindgen_anon_1.ipv6.sport = sport;
        tuple.__bindgen_anon_1.ipv6.dport = dport;
    }
    Ok(Some(Syn {
        src,
        dst,
        dport: u16::from_be(dport),
        sport_be: sport,
        tuple,
        l4,
    }))
}
