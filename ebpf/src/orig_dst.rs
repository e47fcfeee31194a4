//! ztunnel's view of redirected connections.
//!
//! - sock_ops, at `connect()` of a redirected app socket (its source port is
//!   known by then), files its original destination under the tuple that
//!   ztunnel's accepted socket will see; `getsockopt(SO_ORIGINAL_DST)` on
//!   that socket then answers from it, as conntrack does under REDIRECT.
//!   The record lives as long as ztunnel's side of the connection, as a
//!   conntrack entry does: an app that closes before ztunnel has accepted
//!   (a request sent, then close; a busy ztunnel) must not take it away.
//! - sock_ops also marks ztunnel's connections to an app of its own pod with
//!   0x111: with `tcp_fwmark_accept` the app's socket inherits the mark, and
//!   the policy rule `fwmark 0x111/0xfff lookup 100` (`local default dev lo`)
//!   routes its replies, SYN-ACK included, back to ztunnel's transparent
//!   socket instead of out of the pod (Istio: connmark 0x111).

use ambpf_common::{
    Counter, IpKey, LocalConn, Miss, SockAddr, TraceDirection, TraceRecord, TupleKey, Verdict,
    trace::IPPROTO_TCP, ztunnel,
};
use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_SOCK_OPS_TCP_LISTEN_CB, BPF_TCP_CLOSE, SO_MARK,
        SOL_SOCKET, bpf_sock, bpf_sock_ops,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_setsockopt},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};

use core::mem::offset_of;

use crate::{
    addr::{SockaddrIn, SockaddrIn6, load_field, load_ip6, v4, v4_be, v6, v6_be},
    inbound_filing,
    maps::{ORIG_BY_COOKIE, ORIG_BY_TUPLE, PODS_BY_NETNS, count, count_miss, is_pod_ip},
    trace::trace,
};

const AF_INET: u32 = 2;
const AF_INET6: u16 = 10;
const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
const SO_ORIGINAL_DST: i32 = 80;

#[sock_ops]
pub fn ambpf_sockops(ctx: SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => on_connect(&ctx),
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => on_accepted(&ctx),
        BPF_SOCK_OPS_STATE_CB => on_state_change(&ctx),
        BPF_SOCK_OPS_TCP_LISTEN_CB => inbound_filing::on_listen(&ctx),
        _ => {}
    }
    1
}

/// A socket of a redirected connection closed: forget what is filed for
/// it, so nothing is left behind (the LRU is only the backstop). The app's
/// socket takes its record by cookie (its `getpeername()`); ztunnel's
/// accepted socket on its outbound listener takes the tuple record, which
/// ztunnel reads once it accepts, however long after the app's close.
#[inline(always)]
fn on_state_change(ctx: &SockOpsContext) {
    // args[1] is the new state.
    let new_state: u32 =
        unsafe { load_field(ctx.ops, offset_of!(bpf_sock_ops, __bindgen_anon_1) + 4) };
    if new_state != BPF_TCP_CLOSE {
        return;
    }
    let ops = ctx.ops;
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let key = own_tuple(ops, netns);
    if u16::from_be(key.local.port_be) == ztunnel::OUTBOUND_PORT {
        let _ = ORIG_BY_TUPLE.remove(&key);
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(ops.cast()) };
    let _ = ORIG_BY_COOKIE.remove(&cookie);
}

/// ztunnel's outbound listener in an enrolled pod completed a handshake:
/// a connection with a record is followed to its close, which forgets it.
#[inline(always)]
fn on_accepted(ctx: &SockOpsContext) {
    let ops = ctx.ops;
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let key = own_tuple(ops, netns);
    if u16::from_be(key.local.port_be) != ztunnel::OUTBOUND_PORT {
        return;
    }
    if unsafe { ORIG_BY_TUPLE.get(&key) }.is_some() {
        let _ = ctx.set_cb_flags(BPF_SOCK_OPS_STATE_CB_FLAG as i32);
    }
}

/// The connection of the socket behind `ops` as that socket sees it.
#[inline(always)]
fn own_tuple(ops: *mut bpf_sock_ops, netns: u64) -> TupleKey {
    let (swapped, _) = accepted_tuple(ops, netns);
    TupleKey {
        netns_cookie: netns,
        local: swapped.peer,
        peer: swapped.local,
    }
}

/// The connection of the socket behind `ops` as the socket accepting it
/// sees it (local and peer swapped), and the remote address.
#[inline(always)]
fn accepted_tuple(ops: *mut bpf_sock_ops, netns: u64) -> (TupleKey, IpKey) {
    let conn = unsafe { read_sock_ops(ops) };
    let (local, remote) = if conn.family == AF_INET {
        (v4(conn.local_ip4), v4(conn.remote_ip4))
    } else {
        (v6(conn.local_ip6), v6(conn.remote_ip6))
    };
    // local_port is in host order; remote_port holds the network-order port
    // in its upper 16 bits on little-endian machines.
    let local_port_be = (conn.local_port as u16).to_be();
    let remote_port_be = (conn.remote_port >> 16) as u16;
    let key = TupleKey {
        netns_cookie: netns,
        local: SockAddr {
            ip: remote,
            port_be: remote_port_be,
            _pad: [0; 6],
        },
        peer: SockAddr {
            ip: local,
            port_be: local_port_be,
            _pad: [0; 6],
        },
    };
    (key, remote)
}

#[inline(always)]
fn on_connect(ctx: &SockOpsContext) {
    let ops = ctx.ops;
    let netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    let (key, remote) = accepted_tuple(ops, netns);
    let pod = unsafe { PODS_BY_NETNS.get(&netns) };
    // To its own address: the pod's inbound capture must let it through
    // (ztunnel's connection to the app; an app redirected to
    // `podIP:15001`; the app calling itself).
    if let Some(pod) = pod
        && is_pod_ip(pod, &remote)
    {
        inbound_filing::file_local(&key, LocalConn::SamePod);
    }
    // Redirected at connect(): filed for ztunnel even when the pod left the
    // pod map since (another mode took it over in between), as only this
    // record knows where the connection was going.
    let cookie = unsafe { bpf_get_socket_cookie(ops.cast()) };
    if let Some(orig) = unsafe { ORIG_BY_COOKIE.get(&cookie) } {
        let _ = ORIG_BY_TUPLE.insert(&key, orig, 0);
        // Be told when it closes, to forget its cookie record then.
        let _ = ctx.set_cb_flags(BPF_SOCK_OPS_STATE_CB_FLAG as i32);
        return;
    }
    let Some(pod) = pod else {
        inbound_filing::on_node_connect(&key, netns);
        return;
    };

    let sk = unsafe { (*ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    let mark: u32 = unsafe { load_field(sk, offset_of!(bpf_sock, mark)) };
    // TCP_CONNECT_CB runs in the connecting process.
    if crate::maps::is_ztunnel(mark, crate::maps::Hook::SockOps) && is_pod_ip(pod, &remote) {
        let mut reply_mark = ztunnel::REPLY_MARK as i32;
        let set = unsafe {
            bpf_setsockopt(
                ops.cast(),
                SOL_SOCKET as i32,
                SO_MARK as i32,
                (&raw mut reply_mark).cast(),
                size_of::<i32>() as i32,
            )
        };
        if set == 0 {
            count(Counter::ReplyMarked);
        }
    }
}

/// The fields of a `bpf_sock` the tuple needs.
struct SockFields {
    family: u32,
    src_ip4: u32,
    dst_ip4: u32,
    src_ip6: [u32; 4],
    dst_ip6: [u32; 4],
    src_port: u32,
    dst_port: u16,
}

/// The fields of a `bpf_sock_ops` the tuple needs.
struct SockOpsFields {
    family: u32,
    local_ip4: u32,
    remote_ip4: u32,
    local_ip6: [u32; 4],
    remote_ip6: [u32; 4],
    local_port: u32,
    remote_port: u32,
}

// The verifier accepts loads from a context or socket only at constant
// offsets from its pointer, never through a pointer into it. LLVM computes
// such a pointer when loads of one struct sit in different branches, so
// every field is read up front, in one block, and `black_box` keeps the
// loads from being sunk back into the branches.

#[inline(always)]
unsafe fn read_sock(sk: *const bpf_sock) -> SockFields {
    unsafe {
        core::hint::black_box(SockFields {
            family: load_field(sk, offset_of!(bpf_sock, family)),
            src_ip4: load_field(sk, offset_of!(bpf_sock, src_ip4)),
            dst_ip4: load_field(sk, offset_of!(bpf_sock, dst_ip4)),
            src_ip6: load_ip6(sk, offset_of!(bpf_sock, src_ip6)),
            dst_ip6: load_ip6(sk, offset_of!(bpf_sock, dst_ip6)),
            src_port: load_field(sk, offset_of!(bpf_sock, src_port)),
            dst_port: load_field(sk, offset_of!(bpf_sock, dst_port)),
        })
    }
}

#[inline(always)]
unsafe fn read_sock_ops(ops: *const bpf_sock_ops) -> SockOpsFields {
    unsafe {
        core::hint::black_box(SockOpsFields {
            family: load_field(ops, offset_of!(bpf_sock_ops, family)),
            local_ip4: load_field(ops, offset_of!(bpf_sock_ops, local_ip4)),
            remote_ip4: load_field(ops, offset_of!(bpf_sock_ops, remote_ip4)),
            local_ip6: load_ip6(ops, offset_of!(bpf_sock_ops, local_ip6)),
            remote_ip6: load_ip6(ops, offset_of!(bpf_sock_ops, remote_ip6)),
            local_port: load_field(ops, offset_of!(bpf_sock_ops, local_port)),
            remote_port: load_field(ops, offset_of!(bpf_sock_ops, remote_port)),
        })
    }
}

#[cgroup_sockopt(getsockopt)]
pub fn ambpf_origdst(ctx: SockoptContext) -> i32 {
    answer_original_dst(&ctx);
    1
}

#[inline(always)]
fn answer_original_dst(ctx: &SockoptContext) {
    let so = ctx.sockopt;
    let (level, optname) = unsafe { ((*so).level, (*so).optname) };
    if optname != SO_ORIGINAL_DST || (level != SOL_IP && level != SOL_IPV6) {
        return;
    }
    let sk = unsafe { (*so).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    let netns = unsafe { bpf_get_netns_cookie(so.cast()) };
    let (local, peer, src_port, dst_port) = unsafe {
        let sock = read_sock(sk);
        if sock.family == AF_INET {
            (
                v4(sock.src_ip4),
                v4(sock.dst_ip4),
                sock.src_port,
                sock.dst_port,
            )
        } else {
            (
                v6(sock.src_ip6),
                v6(sock.dst_ip6),
                sock.src_port,
                sock.dst_port,
            )
        }
    };
    let key = TupleKey {
        netns_cookie: netns,
        local: SockAddr {
            ip: local,
            port_be: (src_port as u16).to_be(),
            _pad: [0; 6],
        },
        peer: SockAddr {
            ip: peer,
            port_be: dst_port,
            _pad: [0; 6],
        },
    };
    let Some(orig) = (unsafe { ORIG_BY_TUPLE.get(&key) }) else {
        // Only ambpf's to answer on ztunnel's outbound listener in an
        // enrolled pod (inbound, the local address is the original
        // destination: nothing is missing).
        // A connection netfilter redirected (another mode's rules, or
        // Istio's, beside this capture during a change) has its answer from
        // conntrack already: not a miss.
        let outbound = u16::from_be(key.local.port_be) == ztunnel::OUTBOUND_PORT;
        let answered = unsafe { (*so).retval } == 0;
        if outbound && !answered && unsafe { PODS_BY_NETNS.get(&netns) }.is_some() {
            // Once per connection: ztunnel asks IPv4 first, IPv6 after.
            if level == SOL_IP {
                count_miss(Miss::OrigDst);
            }
            trace(|| TraceRecord {
                netns_cookie: netns,
                src: key.peer.ip,
                dst: key.local.ip,
                orig_dst: IpKey::default(),
                src_port_be: key.peer.port_be,
                dst_port_be: key.local.port_be,
                protocol: IPPROTO_TCP,
                direction: TraceDirection::Outbound as u8,
                verdict: Verdict::OrigDstMissing as u32,
                ..TraceRecord::default()
            });
        }
        return;
    };
    // Answer the family that was asked: ztunnel asks IPv4 first, then IPv6.
    if orig.ip.is_v4() != (level == SOL_IP) {
        return;
    }
    let optval = unsafe { (*so).__bindgen_anon_2.optval } as *mut u8;
    let end = unsafe { (*so).__bindgen_anon_3.optval_end } as *mut u8;
    let len = if level == SOL_IP {
        size_of::<SockaddrIn>()
    } else {
        size_of::<SockaddrIn6>()
    };
    if optval.is_null() || unsafe { optval.add(len) } > end {
        return;
    }
    unsafe {
        if level == SOL_IP {
            optval.cast::<SockaddrIn>().write_unaligned(SockaddrIn {
                family: AF_INET as u16,
                port_be: orig.port_be,
                addr_be: v4_be(&orig.ip),
                zero: [0; 8],
            });
        } else {
            optval.cast::<SockaddrIn6>().write_unaligned(SockaddrIn6 {
                family: AF_INET6,
                port_be: orig.port_be,
                flowinfo: 0,
                addr_be: v6_be(&orig.ip),
                scope_id: 0,
            });
        }
        (*so).optlen = len as i32;
        (*so).retval = 0;
    }
    count(Counter::OriginalDstAnswered);
}
