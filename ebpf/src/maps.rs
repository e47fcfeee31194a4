//! Maps shared by the redirection programs; all pinned by the agent.

use ambpf_common::{
    Counter, InboundRefusal, IpKey, LocalConnKey, Miss, NodeConfig, PodConfig, PodCounters,
    PodDrops, SockAddr, SteeredSynKey, TraceGate, TraceRecord, TupleKey,
};
use aya_ebpf::{
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf, SockHash},
    macros::btf_map,
};

// Capacities are the defaults; the agent sets each at load (`--max-pods`,
// `--max-redirected-connections`, `--max-host-addresses`).

/// Pods one node can run, with headroom.
const MAX_PODS: usize = ambpf_common::maps::DEFAULT_MAX_PODS as usize;
/// Redirected connections remembered at once; LRU, so the least recently
/// used (long closed, or long since answered) go first. A record missing
/// when asked for is counted in `MISSES`.
const MAX_REDIRECTED: usize = ambpf_common::maps::DEFAULT_MAX_REDIRECTED as usize;

#[btf_map(name = "ambpf_pods")]
pub static PODS_BY_NETNS: HashMap<u64, PodConfig, { MAX_PODS }> = HashMap::new();

#[btf_map(name = "ambpf_pod_ips")]
pub static PODS_BY_IP: HashMap<IpKey, PodConfig, { 2 * MAX_PODS }> = HashMap::new();

#[btf_map(name = "ambpf_host_ips")]
pub static HOST_ADDRS: HashMap<IpKey, u8, { ambpf_common::maps::HOST_ADDRS_MAX as usize }> =
    HashMap::new();

#[btf_map(name = "ambpf_node_cfg")]
pub static NODE_CONFIG: Array<NodeConfig, 1> = Array::new();

#[btf_map(name = "ambpf_orig_ck")]
pub static ORIG_BY_COOKIE: LruHashMap<u64, SockAddr, { MAX_REDIRECTED }> = LruHashMap::new();

#[btf_map(name = "ambpf_orig_tpl")]
pub static ORIG_BY_TUPLE: LruHashMap<TupleKey, SockAddr, { MAX_REDIRECTED }> = LruHashMap::new();

#[btf_map(name = "ambpf_in_lsn")]
pub static INBOUND_LISTENERS: SockHash<u64, { MAX_PODS }> = SockHash::new();

#[btf_map(name = "ambpf_in_syns")]
pub static INBOUND_SYNS: LruHashMap<
    SteeredSynKey,
    u64,
    { ambpf_common::maps::INBOUND_SYNS_MAX as usize },
> = LruHashMap::new();

#[btf_map(name = "ambpf_own_conns")]
pub static LOCAL_CONNS: LruHashMap<
    LocalConnKey,
    u8,
    { ambpf_common::maps::LOCAL_CONNS_MAX as usize },
> = LruHashMap::new();

#[btf_map(name = "ambpf_node_ns")]
pub static NODE_NETNS: Array<u64, 1> = Array::new();

#[btf_map(name = "ambpf_refusals")]
pub static INBOUND_REFUSED: PerCpuArray<
    u64,
    { ambpf_common::maps::INBOUND_REFUSED_SLOTS as usize },
> = PerCpuArray::new();

#[btf_map(name = "ambpf_zt_procs")]
pub static ZTUNNEL_PROCS: HashMap<u32, u64, { ambpf_common::maps::ZTUNNEL_PROCS_MAX as usize }> =
    HashMap::new();

#[btf_map(name = "ambpf_counters")]
pub static COUNTERS: PerCpuArray<u64, { Counter::COUNT as usize }> = PerCpuArray::new();

#[btf_map(name = "ambpf_pod_cnt")]
pub static POD_COUNTERS: PerCpuHashMap<u64, PodCounters, { MAX_PODS }> = PerCpuHashMap::new();

#[btf_map(name = "ambpf_pod_drops")]
pub static POD_DROPS: PerCpuHashMap<u64, PodDrops, { MAX_PODS }> = PerCpuHashMap::new();

/// Bytes of trace records held for a reader: about 3,000 records of 80
/// bytes (a power of two of pages, as the kernel requires).
const TRACE_RING_BYTES: usize = 256 * 1024;

#[btf_map(name = "ambpf_trace")]
pub static TRACE_RING: RingBuf<TraceRecord, { TRACE_RING_BYTES }> = RingBuf::new();

#[btf_map(name = "ambpf_trace_on")]
pub static TRACE_GATE: Array<TraceGate, 1> = Array::new();

#[btf_map(name = "ambpf_trc_lost")]
pub static TRACE_LOST: PerCpuArray<u64, 1> = PerCpuArray::new();

#[btf_map(name = "ambpf_misses")]
pub static MISSES: PerCpuArray<u64, { ambpf_common::maps::MISS_SLOTS as usize }> =
    PerCpuArray::new();

/// Counts an inbound connection refused for `why`.
#[inline(always)]
pub fn count_refusal(why: InboundRefusal) {
    if let Some(value) = INBOUND_REFUSED.get_ptr_mut(why as u32) {
        // Per-CPU slot: no other CPU writes it.
        unsafe { *value += 1 };
    }
}

/// The node's network namespace cookie (0 until the agent sets it).
#[inline(always)]
pub fn node_netns() -> u64 {
    NODE_NETNS.get(0).copied().unwrap_or(0)
}

/// Set by the agent at load (read-only data, so the verifier prunes the
/// path not taken, helper call included, on kernels that refuse it): whether
/// sock_addr, and sock_ops, programs may ask for the calling process.
#[unsafe(no_mangle)]
static ZTUNNEL_PROCESS_IN_SOCK_ADDR: aya_ebpf::Global<u8> = aya_ebpf::Global::new(0);
#[unsafe(no_mangle)]
static ZTUNNEL_PROCESS_IN_SOCK_OPS: aya_ebpf::Global<u8> = aya_ebpf::Global::new(0);

/// Where a socket's exemption is decided.
#[derive(Clone, Copy)]
pub enum Hook {
    SockAddr,
    SockOps,
}

/// Whether `mark` is ztunnel's and, where the kernel lets `hook` ask, the
/// calling process is ztunnel (as its ZDS connection told the agent): the
/// exemption of ztunnel's sockets. Call only in the context of the socket's
/// own process (a socket system call).
#[inline(always)]
pub fn is_ztunnel(mark: u32, hook: Hook) -> bool {
    if mark & ambpf_common::ztunnel::MARK_MASK != ambpf_common::ztunnel::MARK {
        return false;
    }
    let ask = match hook {
        Hook::SockAddr => ZTUNNEL_PROCESS_IN_SOCK_ADDR.load(),
        Hook::SockOps => ZTUNNEL_PROCESS_IN_SOCK_OPS.load(),
    };
    if ask == 0 {
        return true;
    }
    let tgid = (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32;
    unsafe { ZTUNNEL_PROCS.get(&tgid) }.is_some()
}

/// Counts a missing original-destination record.
#[inline(always)]
pub fn count_miss(miss: Miss) {
    if let Some(value) = MISSES.get_ptr_mut(miss as u32) {
        // Per-CPU slot: no other CPU writes it.
        unsafe { *value += 1 };
    }
}

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(value) = COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU slot: no other CPU writes it.
        unsafe { *value += 1 };
    }
}

/// Whether DNS capture is on for `pod`: on for the node and for the pod.
#[inline(always)]
pub fn dns_capture(pod: &PodConfig) -> bool {
    let node = NODE_CONFIG.get(0).is_some_and(|c| c.dns_capture != 0);
    node && pod.flags & ambpf_common::pod_flags::DNS_CAPTURE != 0
}

/// Whether `ip` is one of the pod's own addresses.
#[inline(always)]
pub fn is_pod_ip(pod: &PodConfig, ip: &IpKey) -> bool {
    pod.ips[0].addr == ip.addr || pod.ips[1].addr == ip.addr
}
