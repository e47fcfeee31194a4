//! TC programs that count the packets and bytes crossing an interface.
//!
//! Attached through TCX on both directions; they never change a verdict
//! (`TCX_NEXT`), so they coexist with any other TCX program on the device.

use ambpf_common::{Direction, IfaceStats, IfaceStatsKey};
use aya_ebpf::{
    bindings::{BPF_NOEXIST, tcx_action_base::TCX_NEXT},
    btf_maps::PerCpuHashMap,
    macros::{btf_map, classifier},
    programs::TcContext,
};
use aya_log_ebpf::info;

/// Interfaces one node can plausibly carry: pods' veths plus host devices.
const MAX_IFACES: usize = 16 * 1024;

#[btf_map(name = "ambpf_if_stats")]
static IFACE_STATS: PerCpuHashMap<IfaceStatsKey, IfaceStats, MAX_IFACES> = PerCpuHashMap::new();

#[classifier]
pub fn ambpf_cnt_in(ctx: TcContext) -> i32 {
    count(&ctx, Direction::Ingress);
    TCX_NEXT
}

#[classifier]
pub fn ambpf_cnt_out(ctx: TcContext) -> i32 {
    count(&ctx, Direction::Egress);
    TCX_NEXT
}

#[inline(always)]
fn count(ctx: &TcContext, direction: Direction) {
    let skb = ctx.skb.skb;
    // SAFETY: `skb` is the context pointer the kernel handed to this program.
    let (ifindex, len) = unsafe { ((*skb).ifindex, (*skb).len) };
    let key = IfaceStatsKey {
        ifindex,
        direction: direction as u32,
    };
    if let Some(stats) = IFACE_STATS.get_ptr_mut(&key) {
        // Per-CPU value: no other CPU writes this slot.
        unsafe {
            (*stats).packets += 1;
            (*stats).bytes += u64::from(len);
        }
        return;
    }
    let first = IfaceStats {
        packets: 1,
        bytes: u64::from(len),
    };
    if IFACE_STATS
        .insert(&key, &first, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        // One literal per direction: a runtime-length string argument would
        // need a variable-length memcpy, which the BPF backend cannot emit.
        match direction {
            Direction::Ingress => info!(ctx, "first packet on ifindex {} ingress", ifindex),
            Direction::Egress => info!(ctx, "first packet on ifindex {} egress", ifindex),
        }
    }
}
