//! The ambpf kernel programs.
//!
//! Built by `agent/build.rs` with the nightly toolchain for `bpfel-unknown-none`
//! and embedded in the agent binary. One module per attach point, as in
//! Cilium's `bpf/`: each module holds its programs and the maps only it uses.
#![no_std]
#![no_main]

mod addr;
mod iface_counter;
mod inbound_filing;
mod inbound_lookup;
mod maps;
mod orig_dst;
mod pod_ingress;
mod raw_guard;
mod sock_redirect;
mod tcp_reset;
mod trace;

/// GPL-compatible licence string: required for GPL-only helpers.
#[unsafe(no_mangle)]
#[unsafe(link_section = "license")]
pub static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier proves programs cannot reach here; an infinite loop would be
    // rejected anyway, so tell LLVM this is unreachable.
    unsafe { core::hint::unreachable_unchecked() }
}
