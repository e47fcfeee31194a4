//! Per-pod network plumbing for the eBPF redirection, over rtnetlink.

pub mod ebpf;
pub mod podnet;
pub mod routing;
