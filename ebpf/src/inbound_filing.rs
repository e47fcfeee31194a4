//! What `sock_ops` files for inbound capture ([`crate::inbound_lookup`]).
//!
//! - ztunnel's inbound listener in a pod's namespace, when ztunnel's process
//!   calls `listen()` on port 15006 with its mark: by netns cookie, in the
//!   SOCKHASH the pod's sk_lookup program assigns from. The socket leaves
//!   the map when it closes, so a stale listener is never assigned.
//! - Connections opened on the node, at `connect()`: in the node's
//!   namespace (kubelet's probes), and inside an enrolled pod to one of its
//!   own addresses (ztunnel's connections to the app, the app's calls to
//!   itself). They are the only inbound connections a pod lets reach its
//!   apps uncaptured, as Istio exempts only the host's own sockets
//!   (`-m owner --socket-exists`) and never sees what a pod sends itself.
//!   The socket's own namespace is what files them: no packet from outside
//!   can.

use ambpf_common::{LocalConn, LocalConnKey, TupleKey, ztunnel};
use aya_ebpf::{
    bindings::{BPF_ANY, bpf_sock, bpf_sock_ops},
    helpers::bpf_get_netns_cookie,
    programs::SockOpsContext,
};
use core::mem::offset_of;

use crate::{
    addr::load_field,
    maps::{Hook, INBOUND_LISTENERS, LOCAL_CONNS, is_ztunnel, node_netns},
};

/// A socket started listening: ztunnel's inbound listener of a pod is filed.
#[inline(always)]
pub fn on_listen(ctx: &SockOpsContext) {
    let ops = ctx.ops;
    let local_port: u32 = unsafe { load_field(ops, offset_of!(bpf_sock_ops, local_port)) };
    if local_port != u32::from(ztunnel::INBOUND_PORT) {
        return;
    }
    let sk = unsafe { (*ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    let mark: u32 = unsafe { load_field(sk, offset_of!(bpf_sock, mark)) };
    // TCP_LISTEN_CB runs in the listening process: where the kernel lets
    // sock_ops ask (6.10+), an app's listener on 15006 with ztunnel's mark
    // is not taken for ztunnel's; before, the mark decides, as for Istio's
    // REDIRECT to whatever listens on 15006.
    if !is_ztunnel(mark, Hook::SockOps) {
        return;
    }
    let mut netns = unsafe { bpf_get_netns_cookie(ops.cast()) };
    if netns == node_netns() {
        return;
    }
    // Not only for pods enrolled now: ztunnel may listen before the agent
    // has written the pod's records, and a pod enrolled again keeps the
    // listener ztunnel still has open.
    let _ = INBOUND_LISTENERS.update(&mut netns, unsafe { &mut *ops }, u64::from(BPF_ANY));
}

/// A socket in namespace `netns`, not an enrolled pod's, is connecting
/// (`tuple`: as the accepting side sees it): a connection of the node's own
/// is filed.
#[inline(always)]
pub fn on_node_connect(tuple: &TupleKey, netns: u64) {
    let node = node_netns();
    if node != 0 && netns == node {
        file_local(tuple, LocalConn::Node);
    }
}

/// Files the connection `tuple` (as the accepting side sees it), opened on
/// the node by `who`.
#[inline(always)]
pub fn file_local(tuple: &TupleKey, who: LocalConn) {
    let key = LocalConnKey {
        dst: tuple.local,
        src: tuple.peer,
    };
    let _ = LOCAL_CONNS.insert(&key, &(who as u8), 0);
}
