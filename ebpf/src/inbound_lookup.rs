//! sk_lookup in an enrolled pod's network namespace: the last step of
//! inbound capture on kernels whose TC `bpf_sk_assign` refuses SO_REUSEPORT
//! listeners (before 6.5).
//!
//! The steering program ([`crate::pod_ingress`]) decided on the SYN: it put
//! ztunnel's inbound listener in `INBOUND_LISTENERS` (by the pod's netns
//! cookie) and the SYN's tuple in `INBOUND_SYNS`. Here, where the kernel
//! looks for the SYN's listening socket, a recorded tuple gets that
//! listener; the assignment from sk_lookup selects within the listener's
//! reuseport group, as a plain lookup would. Any other lookup (a tuple the
//! steering program let through, UDP) is left to the kernel.

use ambpf_common::{SockAddr, TupleKey};
use aya_ebpf::{
    bindings::{bpf_sk_lookup, sk_action::SK_DROP, sk_action::SK_PASS},
    macros::sk_lookup,
    programs::SkLookupContext,
};

use crate::{
    addr::{v4, v6},
    maps::{INBOUND_LISTENERS, INBOUND_SYNS},
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

#[sk_lookup]
pub fn ambpf_inbound(ctx: SkLookupContext) -> u32 {
    let lookup = ctx.lookup.cast_const();
    let protocol: u32 = unsafe { field(lookup, PROTOCOL) };
    if protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    let (family, local4, remote4): (u32, u32, u32) = unsafe {
        (
            field(lookup, FAMILY),
            field(lookup, LOCAL_IP4),
            field(lookup, REMOTE_IP4),
        )
    };
    let mut local6 = [0u32; 4];
    let mut remote6 = [0u32; 4];
    for i in 0..4 {
        unsafe {
            local6[i] = field(lookup, LOCAL_IP6 + 4 * i);
            remote6[i] = field(lookup, REMOTE_IP6 + 4 * i);
        }
    }
    let (local, remote) = if family == AF_INET {
        (v4(local4), v4(remote4))
    } else {
        (v6(local6), v6(remote6))
    };
    // local_port is in host order, remote_port in network order.
    let local_port: u32 = unsafe { field(lookup, LOCAL_PORT) };
    let remote_port_be: u16 = unsafe { field(lookup, REMOTE_PORT) };
    let tuple = TupleKey {
        netns_cookie: 0,
        local: SockAddr {
            ip: local,
            port_be: (local_port as u16).to_be(),
            ..SockAddr::default()
        },
        peer: SockAddr {
            ip: remote,
            port_be: remote_port_be,
            ..SockAddr::default()
        },
    };
    let Some(netns) = (unsafe { INBOUND_SYNS.get(tuple) }).copied() else {
        return SK_PASS;
    };
    // A retransmitted SYN is recorded again by the steering program.
    let _ = INBOUND_SYNS.remove(tuple);
    match INBOUND_LISTENERS.redirect_sk_lookup(&ctx, netns, 0) {
        Ok(()) => SK_PASS,
        // Steered, and the listener gone since: never to the app. The
        // client's retransmission meets the steering program's refusal.
        Err(_) => SK_DROP,
    }
}
