//! cgroup socket-address programs: outbound capture at connect() time.
//!
//! For a socket in an enrolled pod's netns (by netns cookie), not ztunnel's
//! (SO_MARK 0x539), and not to loopback or the pod's own addresses:
//! - TCP `connect()` is rewritten to ztunnel's outbound listener 15001 on
//!   loopback, DNS (port 53, TCP or connected UDP) to the DNS proxy 15053;
//! - unconnected UDP `sendmsg()` to port 53 goes to 15053 as well;
//! - `recvmsg()` makes DNS answers appear to come from the resolver asked,
//!   and `getpeername()` shows the app the peer it asked for.
//!
//! The original destination is kept by socket cookie; `orig_dst` turns it
//! into ztunnel's SO_ORIGINAL_DST answer.

use ambpf_common::{Counter, IpKey, PodConfig, SockAddr, ztunnel};
use aya_ebpf::{
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};

use crate::{
    addr::{LOOPBACK_V4, LOOPBACK_V6, is_loopback, load_ip6, store_ip6, v4, v4_be, v6, v6_be},
    maps::{ORIG_BY_COOKIE, PODS_BY_NETNS, count, dns_capture, is_pod_ip},
};

const SOCK_STREAM: u32 = 1;
const USER_IP6: usize = core::mem::offset_of!(bpf_sock_addr, user_ip6);
const DNS_PORT: u16 = 53;
/// Verdict of cgroup sock_addr programs: let the call proceed.
const ALLOW: i32 = 1;

/// Where a captured socket goes, and what to count.
struct Capture {
    port: u16,
    counter: Counter,
}

#[inline(always)]
fn enrolled_pod(sa: *mut bpf_sock_addr) -> Option<&'static PodConfig> {
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    let pod = unsafe { PODS_BY_NETNS.get(&netns) }?;
    // SAFETY: the kernel always provides the socket in sock_addr programs.
    let mark = unsafe { (*(*sa).__bindgen_anon_1.sk).mark };
    if mark & ztunnel::MARK_MASK == ztunnel::MARK {
        return None; // ztunnel's own socket
    }
    Some(pod)
}

#[inline(always)]
fn capture(sa: *mut bpf_sock_addr, dst: &IpKey, dst_port_be: u16, tcp: bool) -> Option<Capture> {
    let pod = enrolled_pod(sa)?;
    if is_loopback(dst) || is_pod_ip(pod, dst) {
        return None;
    }
    if u16::from_be(dst_port_be) == DNS_PORT && dns_capture(pod) {
        return Some(Capture {
            port: ztunnel::DNS_PORT,
            counter: Counter::DnsRedirected,
        });
    }
    if tcp {
        return Some(Capture {
            port: ztunnel::OUTBOUND_PORT,
            counter: Counter::OutboundRedirected,
        });
    }
    None
}

#[inline(always)]
fn remember(sa: *mut bpf_sock_addr, dst: IpKey, port_be: u16) {
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let orig = SockAddr {
        ip: dst,
        port_be,
        _pad: [0; 6],
    };
    let _ = ORIG_BY_COOKIE.insert(&cookie, &orig, 0);
}

#[inline(always)]
fn redirect4(ctx: &SockAddrContext, tcp: bool) {
    let sa = ctx.sock_addr;
    let (ip_be, port_be) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16) };
    let dst = v4(ip_be);
    if let Some(capture) = capture(sa, &dst, port_be, tcp) {
        remember(sa, dst, port_be);
        unsafe {
            (*sa).user_ip4 = v4_be(&LOOPBACK_V4);
            (*sa).user_port = u32::from(capture.port.to_be());
        }
        count(capture.counter);
    }
}

#[inline(always)]
fn redirect6(ctx: &SockAddrContext, tcp: bool) {
    let sa = ctx.sock_addr;
    let (ip_be, port_be) = unsafe { (load_ip6(sa, USER_IP6), (*sa).user_port as u16) };
    let dst = v6(ip_be);
    if let Some(capture) = capture(sa, &dst, port_be, tcp) {
        remember(sa, dst, port_be);
        // A v4-mapped destination stays v4: ztunnel's listeners are dual-stack.
        let target = if dst.is_v4() {
            v6_be(&IpKey::v4([127, 0, 0, 1]))
        } else {
            v6_be(&LOOPBACK_V6)
        };
        unsafe {
            store_ip6(sa, USER_IP6, target);
            (*sa).user_port = u32::from(capture.port.to_be());
        }
        count(capture.counter);
    }
}

#[cgroup_sock_addr(connect4)]
pub fn ambpf_connect4(ctx: SockAddrContext) -> i32 {
    let tcp = unsafe { (*ctx.sock_addr).type_ } == SOCK_STREAM;
    redirect4(&ctx, tcp);
    ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn ambpf_connect6(ctx: SockAddrContext) -> i32 {
    let tcp = unsafe { (*ctx.sock_addr).type_ } == SOCK_STREAM;
    redirect6(&ctx, tcp);
    ALLOW
}

/// Unconnected UDP: only DNS is captured.
#[cgroup_sock_addr(sendmsg4)]
pub fn ambpf_sendmsg4(ctx: SockAddrContext) -> i32 {
    redirect4(&ctx, false);
    ALLOW
}

#[cgroup_sock_addr(sendmsg6)]
pub fn ambpf_sendmsg6(ctx: SockAddrContext) -> i32 {
    redirect6(&ctx, false);
    ALLOW
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
    if !is_loopback(ip) {
        return None;
    }
    let port = u16::from_be(port_be);
    let redirected = port == ztunnel::DNS_PORT || (!dns_only && port == ztunnel::OUTBOUND_PORT);
    if !redirected {
        return None;
    }
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    unsafe { PODS_BY_NETNS.get(&netns) }?;
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let orig = unsafe { ORIG_BY_COOKIE.get(&cookie) }?;
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
