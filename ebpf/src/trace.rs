//! What the programs report about their decisions: per-pod counters, and
//! trace records for `ambpf trace` while a reader is attached.
//!
//! The gate costs one array lookup per decision while no reader is attached
//! (its lease is 0); the record is built only when it is open. A full ring
//! buffer (a reader that stopped reading) never blocks: the record is
//! counted as lost and the decision goes on.

use ambpf_common::TraceRecord;
use aya_ebpf::helpers::bpf_ktime_get_ns;

use crate::maps::{POD_COUNTERS, POD_DROPS, TRACE_GATE, TRACE_LOST, TRACE_RING};

/// Which of a pod's counters an event adds to.
#[derive(Clone, Copy)]
pub enum PodEvent {
    Outbound,
    Inbound,
    Dns,
    Probe,
}

/// Adds one to the pod's counter (the agent made the pod's entry at
/// enrolment; a pod without one is not counted).
#[inline(always)]
pub fn count_pod(netns_cookie: u64, event: PodEvent) {
    let Some(counters) = POD_COUNTERS.get_ptr_mut(&netns_cookie) else {
        return;
    };
    // Per-CPU value: no other CPU writes it.
    unsafe {
        let field = match event {
            PodEvent::Outbound => &raw mut (*counters).outbound_redirected,
            PodEvent::Inbound => &raw mut (*counters).inbound_redirected,
            PodEvent::Dns => &raw mut (*counters).dns_redirected,
            PodEvent::Probe => &raw mut (*counters).probes_bypassed,
        };
        *field += 1;
    }
}

/// Counts an inbound connection of the pod refused for want of ztunnel's
/// listener (the agent made the pod's entry at enrolment, as for
/// [`count_pod`]).
#[inline(always)]
pub fn count_pod_no_listener(netns_cookie: u64) {
    if let Some(drops) = POD_DROPS.get_ptr_mut(&netns_cookie) {
        // Per-CPU value: no other CPU writes it.
        unsafe { (*drops).inbound_no_listener += 1 };
    }
}

/// Whether a reader holds the gate's lease now.
#[inline(always)]
fn reader_attached() -> bool {
    match TRACE_GATE.get(0) {
        Some(gate) if gate.until_ns != 0 => {
            let now = unsafe { bpf_ktime_get_ns() };
            now < gate.until_ns
        }
        _ => false,
    }
}

/// Writes the record `build` makes, if a reader is attached.
#[inline(always)]
pub fn trace(build: impl FnOnce() -> TraceRecord) {
    if !reader_attached() {
        return;
    }
    match TRACE_RING.reserve(0) {
        Some(mut entry) => {
            let mut record = build();
            record.timestamp_ns = unsafe { bpf_ktime_get_ns() };
            entry.write(record);
            entry.submit(0);
        }
        None => {
            if let Some(lost) = TRACE_LOST.get_ptr_mut(0) {
                unsafe { *lost += 1 };
            }
        }
    }
}
