//! Privileged: a short soak (`ambpf_testbed::soak`, what `cargo xtask soak`
//! runs for longer): the real agent with the kube source and its CNI
//! endpoint under random pod events and faults (SIGKILLs mid-snapshot and
//! mid-enrolment, ztunnel restarts and takeovers, API server outages with
//! 410) for about a minute, failing on any violated invariant.
//!
//! The seed comes from the clock unless `AMBPF_SOAK_SEED` sets it; a failure
//! prints it (`cargo xtask soak -- --seed N` replays the choices).

use std::time::Duration;

use ambpf_testbed::soak::{self, Mode, SoakConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_soak_violates_no_invariant() {
    let seed = std::env::var("AMBPF_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        });
    let config = SoakConfig {
        agent: env!("CARGO_BIN_EXE_ambpf").into(),
        cni_plugin: env!("CARGO_BIN_EXE_ambpf-cni").into(),
        // Built beside the agent by `cargo test --workspace`.
        ztunnel_proxies: std::path::Path::new(env!("CARGO_BIN_EXE_ambpf"))
            .with_file_name("ztunnel-proxies"),
        duration: Duration::from_secs(60),
        pods: 20,
        seed,
        mode: Mode::Ebpf,
        convergence_bound: Duration::from_secs(30),
        fault_interval: Duration::from_secs(6),
    };
    let report = soak::run(&config)
        .await
        .unwrap_or_else(|e| panic!("soak (seed {seed}): {e:#}"));
    report.print();
    assert!(
        report.faults.values().sum::<u64>() >= 3,
        "too few faults to mean anything: {:?}",
        report.faults
    );
    assert!(report.convergence_ms.is_some(), "no pod ever converged");
    assert!(
        report.passed(),
        "seed {seed}: {} violation(s): {:#?}",
        report.violations.len(),
        report.violations
    );
}
