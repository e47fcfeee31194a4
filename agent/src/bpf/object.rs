//! The BPF object built from `ebpf/` by `build.rs`, embedded in the binary.

/// The BPF ELF, 8-byte aligned as the ELF parser requires.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ambpf.bpf.o"));

/// Why the object is unusable, if it is: set when this binary was built on a
/// machine without the nightly toolchain that compiles the kernel programs.
pub fn missing_reason() -> Option<&'static str> {
    if cfg!(ambpf_ebpf_missing) || OBJECT.is_empty() {
        Some(
            "this ambpf binary was built without its eBPF programs (the nightly toolchain with \
             rust-src and llvm-tools was missing at build time); rebuild after `rustup component \
             add rust-src llvm-tools --toolchain nightly`",
        )
    } else {
        None
    }
}
