//! One behaviour tested in both redirection modes, `<name>::ebpf` and
//! `<name>::iptables` (`in_both_modes!`), or in all three, with
//! `<name>::nftables` (`in_all_modes!`), for the test binaries that
//! `mod modes;`.
//!
//! Tests of one binary run one at a time ([`SERIAL`]): the eBPF mode's socket
//! programs act on every process in the cgroup a test enters, and a test's
//! traffic and counters must be its own.

// Binaries that use the pod fixture alone need SERIAL, not the macro.
#![allow(unused_macros)]

pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// - `in_both_modes!(name, |mode, cgroup| { ... })`: the body runs with the
///   mode and, in eBPF mode, a cgroup of its own that this process is in
///   (`Option<&CgroupGuard>`);
/// - `in_both_modes!(name, |f| { ... })`: the same with the pod fixture
///   (`pod_fixture::fixture`) as `f`;
/// - `in_both_modes!(name)`: `async fn name(mode)` of the calling module,
///   which makes its own node and cgroup.
macro_rules! in_both_modes {
    ($name:ident, |$mode:ident, $cgroup:ident| $body:block) => {
        mod $name {
            use super::*;

            async fn run($mode: RedirectMode) {
                let _serial = crate::modes::SERIAL.lock().await;
                let cgroup = ($mode == RedirectMode::Ebpf)
                    .then(|| ambpf_testbed::CgroupGuard::create().unwrap());
                let _inside = cgroup.as_ref().map(|c| c.enter_process().unwrap());
                #[allow(unused_variables)]
                let $cgroup = cgroup.as_ref();
                $body
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn ebpf() {
                run(RedirectMode::Ebpf).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn iptables() {
                run(RedirectMode::Iptables).await
            }
        }
    };
    ($name:ident, |$f:ident| $body:block) => {
        in_both_modes!($name, |mode, cgroup| {
            #[allow(unused_mut)]
            let mut $f = fixture(mode, cgroup).await;
            $body
        });
    };
    ($name:ident) => {
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn ebpf() {
                let _serial = crate::modes::SERIAL.lock().await;
                super::$name(RedirectMode::Ebpf).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn iptables() {
                let _serial = crate::modes::SERIAL.lock().await;
                super::$name(RedirectMode::Iptables).await
            }
        }
    };
}

/// As `in_both_modes!`, plus `<name>::nftables`.
macro_rules! in_all_modes {
    ($name:ident, |$mode:ident, $cgroup:ident| $body:block) => {
        mod $name {
            use super::*;

            async fn run($mode: RedirectMode) {
                let _serial = crate::modes::SERIAL.lock().await;
                let cgroup = ($mode == RedirectMode::Ebpf)
                    .then(|| ambpf_testbed::CgroupGuard::create().unwrap());
                let _inside = cgroup.as_ref().map(|c| c.enter_process().unwrap());
                #[allow(unused_variables)]
                let $cgroup = cgroup.as_ref();
                $body
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn ebpf() {
                run(RedirectMode::Ebpf).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn iptables() {
                run(RedirectMode::Iptables).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn nftables() {
                run(RedirectMode::Nftables).await
            }
        }
    };
    ($name:ident, |$f:ident| $body:block) => {
        in_all_modes!($name, |mode, cgroup| {
            #[allow(unused_mut)]
            let mut $f = fixture(mode, cgroup).await;
            $body
        });
    };
    ($name:ident) => {
        mod $name {
            use super::*;

            async fn run(mode: RedirectMode) {
                let _serial = crate::modes::SERIAL.lock().await;
                super::$name(mode).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn ebpf() {
                run(RedirectMode::Ebpf).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn iptables() {
                run(RedirectMode::Iptables).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn nftables() {
                run(RedirectMode::Nftables).await
            }
        }
    };
}
