//! cgroup socket-address programs: outbound capture at connect() time.
//!
//! For a socket in an enrolled pod's netns (by netns cookie), not ztunnel's
//! (SO_MARK 0x539), and not to loopback or the pod's own addresses:
//! - TCP `connect()` is rewritten to ztunnel's outbound listener 15001 on
//!   loopback, DNS (port 53, TCP or connected UDP) to the DNS proxy 15053;
//!   the socket is first bound to the pod's own address (`bpf_bind`, port
//!   left to the kernel), so the app's `getsockname()` and the peer of
//!   ztunnel's accepted socket are `podIP:port`, exactly as under Istio's
//!   nat OUTPUT REDIRECT (which keeps the source the route chose and maps
//!   the destination to loopback);
//! - unconnected UDP `sendmsg()` to port 53 goes to 15053 as well, from
//!   the pod's address (the datagram's source, `msg_src_ip4/6`);
//! - `recvmsg()` makes DNS answers appear to come from the resolver asked,
//!   and `getpeername()` shows the app the peer it asked for.
//!
//! The original destination is kept by socket cookie; `orig_dst` turns it
//! into ztunnel's SO_ORIGINAL_DST answer.

use ambpf_common::{
    Counter, IpKey, Miss, PodConfig, SockAddr, TraceDirection, TraceRecord, Verdict, pod_flags,
    trace::{IPPROTO_TCP, IPPROTO_UDP},
    ztunnel,
};
use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr, sockaddr},
    helpers::{bpf_bind, bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};

use crate::{
    addr::{
        LOOPBACK_V4, LOOPBACK_V6, SockaddrIn, SockaddrIn6, is_loopback, load_field, load_ip6,
        store_ip6, v4, v4_be, v6, v6_be,
    },
    maps::{ORIG_BY_COOKIE, PODS_BY_NETNS, count, count_miss, dns_capture, is_pod_ip},
    trace::{PodEvent, count_pod, trace},
};

const SOCK_STREAM: u32 = 1;
const USER_IP6: usize = core::mem::offset_of!(bpf_sock_addr, user_ip6);
const MSG_SRC_IP6: usize = core::mem::offset_of!(bpf_sock_addr, msg_src_ip6);
const DNS_PORT: u16 = 53;
/// Verdict of cgroup sock_addr programs: let the call proceed.
const ALLOW: i32 = 1;
/// Verdict refusing the call (EPERM).
const DENY: i32 = 0;

/// Where a captured socket goes, and what to count.
struct Capture {
    port: u16,
    counter: Counter,
    pod_event: PodEvent,
    verdict: Verdict,
    /// The pod's address of the destination's family (none: the pod has
    /// none of that family).
    source: Option<IpKey>,
    /// Connect to ztunnel's outbound listener on the pod's own address,
    /// not on loopback ([`pod_flags::OUTBOUND_VIA_POD_ADDRESS`]).
    via_pod_address: bool,
}

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// The pod's address of the family of `dst` (IPv4, v4-mapped or not, or
/// IPv6): the one the kernel picks as the source towards `dst`.
#[inline(always)]
fn pod_address_for(pod: &PodConfig, dst: &IpKey) -> Option<IpKey> {
    let [a, b] = pod.ips;
    let fits = |ip: &IpKey| *ip != IpKey::default() && ip.is_v4() == dst.is_v4();
    if fits(&a) {
        Some(a)
    } else if fits(&b) {
        Some(b)
    } else {
        None
    }
}

/// How the app's socket is bound before the rewrite.
enum Bound {
    /// Not at all: bind it to the pod's address.
    Nothing,
    /// To a port only: its source is picked at connect, from the new
    /// destination.
    PortOnly,
    /// To an address: it keeps it.
    Address,
}

#[inline(always)]
fn bound(sa: *mut bpf_sock_addr, v6: bool) -> Bound {
    // SAFETY: the kernel always provides the socket in sock_addr programs.
    let sk: *const bpf_sock = unsafe { (*sa).__bindgen_anon_1.sk };
    let port: u32 = unsafe { load_field(sk, core::mem::offset_of!(bpf_sock, src_port)) };
    let has_address = if v6 {
        let ip = unsafe { load_ip6(sk, core::mem::offset_of!(bpf_sock, src_ip6)) };
        ip != [0; 4]
    } else {
        let ip: u32 = unsafe { load_field(sk, core::mem::offset_of!(bpf_sock, src_ip4)) };
        ip != 0
    };
    match (has_address, port) {
        (true, _) => Bound::Address,
        (false, 0) => Bound::Nothing,
        (false, _) => Bound::PortOnly,
    }
}

/// Binds the socket to `ip` with port 0 (the kernel picks the port at
/// connect, as with IP_BIND_ADDRESS_NO_PORT). `v6`: the socket is IPv6
/// (`ip` may be v4-mapped on a dual-stack socket).
#[inline(always)]
fn bind_to(sa: *mut bpf_sock_addr, ip: &IpKey, v6: bool) -> bool {
    let done = if v6 {
        let mut addr = SockaddrIn6 {
            family: AF_INET6,
            port_be: 0,
            flowinfo: 0,
            addr_be: v6_be(ip),
            scope_id: 0,
        };
        unsafe {
            bpf_bind(
                sa,
                (&raw mut addr).cast::<sockaddr>(),
                size_of::<SockaddrIn6>() as i32,
            )
        }
    } else {
        let mut addr = SockaddrIn {
            family: AF_INET,
            port_be: 0,
            addr_be: v4_be(ip),
            zero: [0; 8],
        };
        unsafe {
            bpf_bind(
                sa,
                (&raw mut addr).cast::<sockaddr>(),
                size_of::<SockaddrIn>() as i32,
            )
        }
    };
    done == 0
}

/// Where a captured socket connects: ztunnel's listener on loopback, the
/// socket bound to the pod's address first. A socket already bound to a
/// port alone cannot be bound again: for ztunnel's outbound listener it is
/// sent to the pod's own address instead, which gives it the pod's address
/// as source too (ztunnel listens on every address); the DNS proxy listens
/// on loopback only.
#[inline(always)]
fn target(sa: *mut bpf_sock_addr, capture: &Capture, v6: bool, loopback: IpKey) -> IpKey {
    let Some(source) = capture.source else {
        return loopback;
    };
    let outbound = capture.port == ztunnel::OUTBOUND_PORT;
    let to_pod = outbound && capture.via_pod_address;
    match bound(sa, v6) {
        Bound::Nothing => {
            bind_to(sa, &source, v6);
            if to_pod { source } else { loopback }
        }
        Bound::PortOnly if outbound => source,
        Bound::Address if to_pod => source,
        Bound::PortOnly | Bound::Address => loopback,
    }
}

/// Unconnected UDP (`sendmsg`) cannot be bound, but the hook may pick the
/// datagram's source: the pod's address, so ztunnel's DNS proxy sees the
/// query come from `podIP:port` as under Istio's REDIRECT (which keeps the
/// source the route chose), not from loopback. A socket bound to an address
/// keeps it. `v6`: the socket is IPv6 (`source` then must be IPv6: a
/// v4-mapped destination goes through `sendmsg4`).
#[inline(always)]
fn set_datagram_source(sa: *mut bpf_sock_addr, capture: &Capture, v6: bool) {
    let Some(source) = capture.source else {
        return;
    };
    if matches!(bound(sa, v6), Bound::Address) {
        return;
    }
    if v6 {
        if !source.is_v4() {
            unsafe { store_ip6(sa, MSG_SRC_IP6, v6_be(&source)) };
        }
    } else {
        unsafe { (*sa).msg_src_ip4 = v4_be(&source) };
    }
}

/// The enrolled pod the socket's namespace belongs to, with its cookie.
#[inline(always)]
fn enrolled_pod(sa: *mut bpf_sock_addr) -> Option<(u64, &'static PodConfig)> {
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    let pod = unsafe { PODS_BY_NETNS.get(&netns) }?;
    Some((netns, pod))
}

/// Whether the socket is ztunnel's own: SO_MARK 0x539 on a socket of
/// ztunnel's process (sock_addr programs run in the calling process).
#[inline(always)]
fn is_ztunnel(sa: *mut bpf_sock_addr) -> bool {
    // SAFETY: the kernel always provides the socket in sock_addr programs.
    let mark = unsafe { (*(*sa).__bindgen_anon_1.sk).mark };
    crate::maps::is_ztunnel(mark, crate::maps::Hook::SockAddr)
}

/// Where a socket of the enrolled `pod` goes, or why it is left alone.
#[inline(always)]
fn decide(
    sa: *mut bpf_sock_addr,
    pod: &PodConfig,
    dst: &IpKey,
    dst_port_be: u16,
    tcp: bool,
) -> Result<Capture, Verdict> {
    if is_ztunnel(sa) {
        return Err(Verdict::ExemptZtunnel);
    }
    if is_loopback(dst) {
        return Err(Verdict::ExemptLoopback);
    }
    if is_pod_ip(pod, dst) {
        return Err(Verdict::ExemptOwnAddress);
    }
    let source = pod_address_for(pod, dst);
    let dns = u16::from_be(dst_port_be) == DNS_PORT;
    if dns && dns_capture(pod) {
        return Ok(Capture {
            port: ztunnel::DNS_PORT,
            counter: Counter::DnsRedirected,
            pod_event: PodEvent::Dns,
            verdict: Verdict::DnsCaptured,
            source,
            via_pod_address: false,
        });
    }
    if tcp {
        return Ok(Capture {
            port: ztunnel::OUTBOUND_PORT,
            counter: Counter::OutboundRedirected,
            pod_event: PodEvent::Outbound,
            verdict: Verdict::Captured,
            source,
            via_pod_address: pod.flags & pod_flags::OUTBOUND_VIA_POD_ADDRESS != 0,
        });
    }
    Err(if dns {
        Verdict::ExemptDnsOff
    } else {
        Verdict::ExemptNotTcp
    })
}

/// The socket's own address and port (network order) as bound so far.
#[inline(always)]
fn source_of(sa: *mut bpf_sock_addr, v6: bool) -> (IpKey, u16) {
    // SAFETY: the kernel always provides the socket in sock_addr programs.
    let sk: *const bpf_sock = unsafe { (*sa).__bindgen_anon_1.sk };
    let port: u32 = unsafe { load_field(sk, core::mem::offset_of!(bpf_sock, src_port)) };
    let ip = if v6 {
        crate::addr::v6(unsafe { load_ip6(sk, core::mem::offset_of!(bpf_sock, src_ip6)) })
    } else {
        crate::addr::v4(unsafe { load_field(sk, core::mem::offset_of!(bpf_sock, src_ip4)) })
    };
    (ip, (port as u16).to_be())
}

/// Accounts for a decision on an enrolled pod's socket: counters when
/// captured, and a trace record. Unconnected UDP (`sendmsg`) is traced for
/// DNS only: every datagram passes here.
#[inline(always)]
fn report(
    sa: *mut bpf_sock_addr,
    netns: u64,
    decision: &Result<Capture, Verdict>,
    (to, to_port_be): (IpKey, u16),
    (dst, dst_port_be): (IpKey, u16),
    (tcp, connect, v6): (bool, bool, bool),
) {
    if let Ok(capture) = decision {
        count(capture.counter);
        count_pod(netns, capture.pod_event);
    }
    if !connect && u16::from_be(dst_port_be) != DNS_PORT {
        return;
    }
    let verdict = match decision {
        Ok(capture) => capture.verdict,
        Err(verdict) => *verdict,
    };
    trace(|| {
        let (src, src_port_be) = source_of(sa, v6);
        TraceRecord {
            netns_cookie: netns,
            src,
            dst: to,
            orig_dst: dst,
            src_port_be,
            dst_port_be: to_port_be,
            orig_port_be: dst_port_be,
            protocol: if tcp { IPPROTO_TCP } else { IPPROTO_UDP },
            direction: TraceDirection::Outbound as u8,
            verdict: verdict as u32,
            ..TraceRecord::default()
        }
    });
}

/// Keeps the original destination by socket cookie; false if it could not
/// be stored (the LRU evicts rather than fails, so only on an error).
#[inline(always)]
fn remember(sa: *mut bpf_sock_addr, dst: IpKey, port_be: u16) -> bool {
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let orig = SockAddr {
        ip: dst,
        port_be,
        _pad: [0; 6],
    };
    ORIG_BY_COOKIE.insert(&cookie, &orig, 0).is_ok()
}

/// `connect`: the hook may bind the socket (`sendmsg` may not). Returns
/// the hook's verdict: a connection whose original destination could not
/// be stored is refused (EPERM) rather than handed to ztunnel without it.
#[inline(always)]
fn redirect4(ctx: &SockAddrContext, tcp: bool, connect: bool) -> i32 {
    let sa = ctx.sock_addr;
    let Some((netns, pod)) = enrolled_pod(sa) else {
        return ALLOW;
    };
    let (ip_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16) };
    let dst = v4(ip_be);
    let decision = decide(sa, pod, &dst, port_be, tcp);
    let mut to = (dst, port_be);
    if let Ok(capture) = &decision {
        if !remember(sa, dst, port_be) {
            count_miss(Miss::NotStored);
            return DENY;
        }
        let ip = if connect {
            target(sa, capture, false, LOOPBACK_V4)
        } else {
            set_datagram_source(sa, capture, false);
            LOOPBACK_V4
        };
        to = (ip, capture.port.to_be());
        unsafe {
            (*sa).user_ip4 = v4_be(&ip);
            (*sa).user_port = u32::from(to.1);
        }
    }
    report(sa, netns, &decision, to, (dst, port_be), (tcp, connect, false));
    ALLOW
}

#[inline(always)]
fn redirect6(ctx: &SockAddrContext, tcp: bool, connect: bool) -> i32 {
    let sa = ctx.sock_addr;
    let Some((netns, pod)) = enrolled_pod(sa) else {
        return ALLOW;
    };
    let (ip_be, port_be) = unsafe { (load_ip6(sa, USER_IP6), (*sa).user_port as u16) };
    let dst = v6(ip_be);
    let decision = decide(sa, pod, &dst, port_be, tcp);
    let mut to = (dst, port_be);
    if let Ok(capture) = &decision {
        if !remember(sa, dst, port_be) {
            count_miss(Miss::NotStored);
            return DENY;
        }
        // A v4-mapped destination stays v4: ztunnel's listeners are dual-stack.
        let loopback = if dst.is_v4() {
            LOOPBACK_V4
        } else {
            LOOPBACK_V6
        };
        let ip = if connect {
            target(sa, capture, true, loopback)
        } else {
            set_datagram_source(sa, capture, true);
            loopback
        };
        to = (ip, capture.port.to_be());
        unsafe {
            store_ip6(sa, USER_IP6, v6_be(&ip));
            (*sa).user_port = u32::from(to.1);
        }
    }
    report(sa, netns, &decision, to, (dst, port_be), (tcp, connect, true));
    ALLOW
}

#[cgroup_sock_addr(connect4)]
pub fn ambpf_connect4(ctx: SockAddrContext) -> i32 {
    let tcp = unsafe { (*ctx.sock_addr).type_ } == SOCK_STREAM;
    redirect4(&ctx, tcp, true)
}

#[cgroup_sock_addr(connect6)]
pub fn ambpf_connect6(ctx: SockAddrContext) -> i32 {
    let tcp = unsafe { (*ctx.sock_addr).type_ } == SOCK_STREAM;
    redirect6(&ctx, tcp, true)
}

/// Unconnected UDP: only DNS is captured.
#[cgroup_sock_addr(sendmsg4)]
pub fn ambpf_sendmsg4(ctx: SockAddrContext) -> i32 {
    redirect4(&ctx, false, false)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn ambpf_sendmsg6(ctx: SockAddrContext) -> i32 {
    redirect6(&ctx, false, false)
}

/// The original peer of a redirected socket, if `(ip, port)` is where it was
/// redirected to.
#[inline(always)]
fn original_peer(
    sa: *mut bpf_sock_addr,
    ip: &IpKey,
    port_be: u16,
    dns_only: bool,
) -> Option<SockAddr> {
    let port = u16::from_be(port_be);
    let redirected = port == ztunnel::DNS_PORT || (!dns_only && port == ztunnel::OUTBOUND_PORT);
    if !redirected {
        return None;
    }
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    let pod = unsafe { PODS_BY_NETNS.get(&netns) }?;
    // Loopback, or the pod's own address for a socket bound to a port
    // alone (see `target`).
    if !is_loopback(ip) && !(port == ztunnel::OUTBOUND_PORT && is_pod_ip(pod, ip)) {
        return None;
    }
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let Some(orig) = (unsafe { ORIG_BY_COOKIE.get(&cookie) }) else {
        // A socket redirected to ztunnel's outbound listener whose record
        // the full LRU evicted (or one connected there directly).
        if !dns_only {
            count_miss(Miss::PeerName);
        }
        return None;
    };
    if dns_only && u16::from_be(orig.port_be) != DNS_PORT {
        return None;
    }
    Some(*orig)
}

#[inline(always)]
fn restore4(ctx: &SockAddrContext, dns_only: bool) {
    let sa = ctx.sock_addr;
    let (ip_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16) };
    if let Some(orig) = original_peer(sa, &v4(ip_be), port_be, dns_only)
        && orig.ip.is_v4()
    {
        unsafe {
            (*sa).user_ip4 = v4_be(&orig.ip);
            (*sa).user_port = u32::from(orig.port_be);
        }
    }
}

#[inline(always)]
fn restore6(ctx: &SockAddrContext, dns_only: bool) {
    let sa = ctx.sock_addr;
    let (ip_be, port_be) = unsafe { (load_ip6(sa, USER_IP6), (*sa).user_port as u16) };
    if let Some(orig) = original_peer(sa, &v6(ip_be), port_be, dns_only) {
        unsafe {
            store_ip6(sa, USER_IP6, v6_be(&orig.ip));
            (*sa).user_port = u32::from(orig.port_be);
        }
    }
}

/// DNS answers from ztunnel's proxy appear to come from the resolver asked.
#[cgroup_sock_addr(recvmsg4)]
pub fn ambpf_recvmsg4(ctx: SockAddrContext) -> i32 {
    restore4(&ctx, true);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn ambpf_recvmsg6(ctx: SockAddrContext) -> i32 {
    restore6(&ctx, true);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn ambpf_peername4(ctx: SockAddrContext) -> i32 {
    restore4(&ctx, false);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn ambpf_peername6(ctx: SockAddrContext) -> i32 {
    restore6(&ctx, false);
    ALLOW
}
