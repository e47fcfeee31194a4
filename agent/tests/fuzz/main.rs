//! Property tests ("fuzzing") of everything the agent reads from outside:
//! what a ZDS peer replies ([`zds_peer`]), CNI endpoint requests ([`cni_endpoint`]:
//! HTTP framing, JSON, addresses), the CNI plugin's network configuration
//! and `prevResult` ([`cni_plugin`]), the pods file and conflist files
//! ([`files`]), Kubernetes objects through the lenient decoding
//! ([`kube_objects`]), and the pinned state `status` reads back
//! ([`pinned_state`]).
//!
//! The agent's own servers run as they do in the agent, on a runtime whose
//! threads are named [`AGENT_THREADS`]; a panic on one of them is counted
//! ([`agent_panics`]) and fails the property, and after every input the
//! server must still answer a well-formed request.
//!
//! Cases per property: proptest's default (256), a few seconds in all;
//! `PROPTEST_CASES` raises it (`cargo xtask fuzz` runs many more). An input
//! that ever failed is kept as a named regression test beside its property.

#[path = "../common/mod.rs"]
mod common;

mod cni_endpoint;
mod cni_plugin;
mod files;
mod kube_objects;
mod pinned_state;
mod zds_peer;

use std::sync::{
    Once,
    atomic::{AtomicUsize, Ordering},
};

/// The name of the agent runtime's threads.
pub const AGENT_THREADS: &str = "fuzzed-agent";

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Panics so far on the agent runtime's threads (a spawned task's panic is
/// otherwise only a log line).
pub fn agent_panics() -> usize {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some(AGENT_THREADS) {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}

/// A runtime for the agent's side, as the agent runs it.
pub fn agent_runtime() -> tokio::runtime::Runtime {
    agent_panics();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(AGENT_THREADS)
        .enable_all()
        .build()
        .unwrap()
}

/// The runner's configuration: proptest's defaults, `PROPTEST_CASES` and the
/// other `PROPTEST_*` variables included; failures are kept as named tests,
/// not in files.
pub fn config() -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        failure_persistence: None,
        ..Default::default()
    }
}
