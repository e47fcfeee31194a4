//! ambpf: eBPF traffic redirection for Istio ambient mode.
//!
//! The agent loads the kernel programs in `ebpf/` once per node, keeps per-pod
//! state in pinned BPF maps, and hands each pod's network namespace to ztunnel.
//!
//! - [`bpf`]: loading, attaching, pinning and inspecting the kernel programs.
//! - [`netns`]: network namespaces, opened by name or path.
//! - [`cli`]: the `ambpf` command line.

pub mod bpf;
pub mod build_info;
pub mod cli;
pub mod cni;
pub mod controller;
pub mod http;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod mounts;
pub mod netns;
pub mod observe;
pub mod redirect;
pub mod sock_diag;
pub mod sources;
pub mod status;
pub mod trace;
pub mod uninstall;
pub mod unix_socket;
pub mod zds;

/// Formats an error with its sources, `outer: inner: innermost`, for errors
/// (like aya's) whose Display leaves the cause out.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}
