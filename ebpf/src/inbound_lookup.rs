//! sk_lookup in each enrolled pod's network namespace: inbound capture.
//!
//! The kernel runs this program wherever it looks for the listening socket
//! of a new TCP connection in the pod: after IP reassembly and after every
//! header was parsed by the stack itself, for a SYN and for a SYN-cookie
//! ACK alike. So the program parses no packet, and no packet shape (IPv4
//! fragments, IPv6 extension headers or fragments, VLAN tags) changes what
//! it takes. It takes what Istio's nat PREROUTING REDIRECT takes: every TCP
//! connection to any local address of the pod, except
//! - loopback destinations;
//! - HBONE (15008), which goes straight to ztunnel's listener;
//! - connections opened on the node, which `sock_ops` files at `connect()`
//!   ([`crate::inbound_filing`]): the pod's own to itself (ztunnel's
//!   connections to the app), which PREROUTING never sees, and the node's
//!   (kubelet's probes). A forwarded or masqueraded connection that merely
//!   carries a node address is not one of them, and is captured. (The
//!   lookup's `ingress_ifindex` cannot tell: for a local destination the
//!   kernel reports the device holding the address, not loopback.)
//! - connections from Istio's probe SNAT addresses, as Istio's in-pod rules
//!   let them through: the node's own connections once a host rule of
//!   Istio's node agent, or of ambpf's iptables or nftables mode during a
//!   change of mode, has rewritten their source, so `sock_ops`' record of
//!   them no longer matches.
//!
//! A captured connection is given ztunnel's 15006 listener of the pod
//! (filed by `sock_ops` at `listen()`): the assignment selects within the
//! listener's SO_REUSEPORT group, and the accepted socket's local address is
//! the original destination (TPROXY-style). Without a listener, or for a
//! local address the agent did not enrol, the lookup is refused: the kernel
//! answers with an RST, as it does under Istio's REDIRECT to a closed 15006.
//! Nothing reaches the app that ztunnel did not hand it.

use ambpf_common::{
    Counter, InboundRefusal, IpKey, LocalConn, LocalConnKey, SockAddr, TraceDirection, TraceRecord,
    Verdict, ztunnel,
};
use aya_ebpf::{
    bindings::{bpf_sk_lookup, sk_action::SK_DROP, sk_action::SK_PASS},
    macros::sk_lookup,
    programs::SkLookupContext,
};

use crate::{
    addr::{is_loopback, is_probe_snat, v4, v6},
    maps::{INBOUND_LISTENERS, LOCAL_CONNS, PODS_BY_IP, count, count_refusal},
    trace::{PodEvent, count_pod, count_pod_no_listener, trace},
};

const AF_INET: u32 = 2;
const IPPROTO_TCP: u32 = 6;

const FAMILY: usize = core::mem::offset_of!(bpf_sk_lookup, family);
const PROTOCOL: usize = core::mem::offset_of!(bpf_sk_lookup, protocol);
const REMOTE_IP4: usize = core::mem::offset_of!(bpf_sk_lookup, remote_ip4);
const REMOTE_IP6: usize = core::mem::offset_of!(bpf_sk_lookup, remote_ip6);
const REMOTE_PORT: usize = core::mem::offset_of!(bpf_sk_lookup, remote_port);
const LOCAL_IP4: usize = core::mem::offset_of!(bpf_sk_lookup, local_ip4);
const LOCAL_IP6: usize = core::mem::offset_of!(bpf_sk_lookup, local_ip6);
const LOCAL_PORT: usize = core::mem::offset_of!(bpf_sk_lookup, local_port);

/// One volatile load of a `T` at `offset` into the context: all are made
/// before any branch, so LLVM cannot merge the two families' loads into one
/// through a pointer that differs by branch (the verifier refuses a
/// modified context pointer).
#[inline(always)]
unsafe fn field<T: Copy>(ctx: *const bpf_sk_lookup, offset: usize) -> T {
    let base = core::hint::black_box(ctx).cast::<u8>();
    unsafe { base.add(offset).cast::<T>().read_volatile() }
}

/// The lookup's connection: the pod's side and the peer's.
struct Lookup {
    local: SockAddr,
    remote: SockAddr,
}

#[inline(always)]
fn report(lookup: &Lookup, netns: u64, to_port: u16, verdict: Verdict) {
    trace(|| TraceRecord {
        netns_cookie: netns,
        src: lookup.remote.ip,
        dst: lookup.local.ip,
        orig_dst: lookup.local.ip,
        src_port_be: lookup.remote.port_be,
        dst_port_be: to_port.to_be(),
        orig_port_be: lookup.local.port_be,
        protocol: IPPROTO_TCP as u8,
        direction: TraceDirection::Inbound as u8,
        verdict: verdict as u32,
        ..TraceRecord::default()
    });
}

#[sk_lookup]
pub fn ambpf_inbound(ctx: SkLookupContext) -> u32 {
    let raw = ctx.lookup.cast_const();
    let protocol: u32 = unsafe { field(raw, PROTOCOL) };
    // Istio's PREROUTING redirect is TCP only.
    if protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    let lookup = read_lookup(raw);
    if is_loopback(&lookup.local.ip) {
        return SK_PASS;
    }
    let local_port = u16::from_be(lookup.local.port_be);
    let Some(pod) = (unsafe { PODS_BY_IP.get(&lookup.local.ip) }) else {
        // A local address the agent did not enrol the pod with: no record
        // says whose ztunnel takes it, so it is refused, never passed.
        count_refusal(InboundRefusal::UnknownAddress);
        report(&lookup, 0, local_port, Verdict::UnknownAddress);
        return SK_DROP;
    };
    let netns = pod.netns_cookie;
    if local_port == ztunnel::HBONE_PORT {
        report(&lookup, netns, local_port, Verdict::Hbone);
        return SK_PASS;
    }
    let opened_here = LocalConnKey {
        dst: lookup.local,
        src: lookup.remote,
    };
    match unsafe { LOCAL_CONNS.get(&opened_here) }.copied() {
        Some(who) if who == LocalConn::Node as u8 => {
            count(Counter::ProbeBypassed);
            count_pod(netns, PodEvent::Probe);
            report(&lookup, netns, local_port, Verdict::ProbeBypassed);
            return SK_PASS;
        }
        Some(_) => return SK_PASS,
        None => {}
    }
    if is_probe_snat(&lookup.remote.ip) {
        count(Counter::ProbeBypassed);
        count_pod(netns, PodEvent::Probe);
        report(&lookup, netns, local_port, Verdict::ProbeBypassed);
        return SK_PASS;
    }
    match INBOUND_LISTENERS.redirect_sk_lookup(&ctx, netns, 0) {
        Ok(()) => {
            count(Counter::InboundRedirected);
            count_pod(netns, PodEvent::Inbound);
            report(
                &lookup,
                netns,
                ztunnel::INBOUND_PORT,
                Verdict::InboundSteered,
            );
            SK_PASS
        }
        // No listener filed for the pod (ztunnel not serving it yet, or
        // gone), or one the kernel refuses for this lookup.
        Err(_) => {
            count(Counter::InboundNoListener);
            count_pod_no_listener(netns);
            report(&lookup, netns, ztunnel::INBOUND_PORT, Verdict::NoListener);
            SK_DROP
        }
    }
}

/// The lookup's addresses, read up front (see [`field`]).
#[inline(always)]
fn read_lookup(raw: *const bpf_sk_lookup) -> Lookup {
    let (family, local4, remote4): (u32, u32, u32) = unsafe {
        (
            field(raw, FAMILY),
            field(raw, LOCAL_IP4),
            field(raw, REMOTE_IP4),
        )
    };
    let mut local6 = [0u32; 4];
    let mut remote6 = [0u32; 4];
    for i in 0..4 {
        unsafe {
            local6[i] = field(raw, LOCAL_IP6 + 4 * i);
            remote6[i] = field(raw, REMOTE_IP6 + 4 * i);
        }
    }
    // local_port is in host order, remote_port in network order.
    let local_port: u32 = unsafe { field(raw, LOCAL_PORT) };
    let remote_port_be: u16 = unsafe { field(raw, REMOTE_PORT) };
    let (local, remote): (IpKey, IpKey) = if family == AF_INET {
        (v4(local4), v4(remote4))
    } else {
        (v6(local6), v6(remote6))
    };
    Lookup {
        local: SockAddr {
            ip: local,
            port_be: (local_port as u16).to_be(),
            ..SockAddr::default()
        },
        remote: SockAddr {
            ip: remote,
            port_be: remote_port_be,
            ..SockAddr::default()
        },
    }
}
