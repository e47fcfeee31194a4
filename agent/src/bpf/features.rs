//! Kernel features ambpf needs, probed before anything is loaded so that a
//! kernel lacking one is refused up front, with the feature named, instead
//! of half-configured.
//!
//! Each feature is found by asking the kernel for it (a helper call the
//! verifier accepts, a map or program type it creates, a socket option it
//! answers), never by reading the version: distributions backport features
//! and configure others out. The version given is the first upstream kernel
//! with the feature (from the kernel's documentation of each helper and
//! attach type), for the error message and the README's table.
//!
//! TCX is not needed: pods' inbound steering is a cls_bpf filter. Only the
//! optional interface counters (`--attach`) use TCX links, and ask for them
//! when they attach ([`tcx_supported`]).

use std::os::fd::AsFd as _;

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported},
};

use super::sys;

#[derive(Debug, thiserror::Error)]
pub enum FeatureError {
    #[error("this kernel lacks {feature} (upstream since Linux {since})")]
    Missing {
        feature: &'static str,
        since: &'static str,
    },
    #[error("probing the kernel for {feature}: {reason}")]
    Probe {
        feature: &'static str,
        reason: String,
    },
}

/// A kernel feature and how to ask for it.
pub struct Feature {
    pub name: &'static str,
    /// First upstream kernel that has it.
    pub since: &'static str,
    pub probe: fn() -> Result<bool, String>,
}

impl Feature {
    /// Asks the kernel; names the feature when it lacks it.
    pub fn check(&self) -> Result<(), FeatureError> {
        check(self)
    }
}

fn helper(program: ProgramType, helper: BpfHelper) -> Result<bool, String> {
    is_helper_supported(program, helper).map_err(|e| e.to_string())
}

/// `enum bpf_attach_type` values probed here.
const BPF_CGROUP_INET4_GETPEERNAME: u32 = 29;
const BPF_TCX_INGRESS: u32 = 46;
/// `enum bpf_prog_type`.
const PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;

/// What the dataplane needs, in the order the kernel gained it; and one of
/// the inbound paths ([`super::inbound`]).
pub const REQUIRED: &[Feature] = &[
    Feature {
        name: "bpf_skc_lookup_tcp in TC programs (finding ztunnel's inbound listener)",
        since: "5.2",
        probe: || {
            helper(
                ProgramType::SchedClassifier,
                BpfHelper::BPF_FUNC_skc_lookup_tcp,
            )
        },
    },
    Feature {
        name: "bpf_sk_assign in TC programs (inbound capture)",
        since: "5.7",
        probe: || helper(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_sk_assign),
    },
    Feature {
        name: "bpf_get_netns_cookie in cgroup socket-address programs (outbound capture)",
        since: "5.7",
        probe: || {
            helper(
                ProgramType::CgroupSockAddr,
                BpfHelper::BPF_FUNC_get_netns_cookie,
            )
        },
    },
    Feature {
        name: "BPF ring buffers (kernel log records)",
        since: "5.8",
        probe: || is_map_supported(MapType::RingBuf).map_err(|e| e.to_string()),
    },
    Feature {
        name: "cgroup getpeername hooks (apps see their original peer)",
        since: "5.8",
        probe: || {
            let program = sys::load_minimal_program_for(
                PROG_TYPE_CGROUP_SOCK_ADDR,
                BPF_CGROUP_INET4_GETPEERNAME,
                1,
            );
            refused_as_unknown(program.map(drop))
        },
    },
    Feature {
        name: "SO_NETNS_COOKIE (identifying pods' namespaces)",
        since: "5.14",
        probe: || {
            let socket = std::net::UdpSocket::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            match crate::netns::socket_netns_cookie(socket.as_fd()) {
                Ok(_) => Ok(true),
                Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => Ok(false),
                Err(e) => Err(e.to_string()),
            }
        },
    },
    Feature {
        name: "bpf_get_netns_cookie in sock_ops programs (original destinations, reply marks)",
        since: "5.15",
        probe: || helper(ProgramType::SockOps, BpfHelper::BPF_FUNC_get_netns_cookie),
    },
    Feature {
        name: "bpf_get_netns_cookie in cgroup sockopt programs (SO_ORIGINAL_DST)",
        since: "5.15",
        probe: || {
            helper(
                ProgramType::CgroupSockopt,
                BpfHelper::BPF_FUNC_get_netns_cookie,
            )
        },
    },
];

/// What the raw-socket guard needs (optional: without it the agent warns
/// and runs without the guard, as before it existed).
pub const RAW_GUARD: &[Feature] = &[
    Feature {
        name: "socket-local storage maps (the raw-socket guard)",
        since: "5.2",
        probe: || is_map_supported(MapType::SkStorage).map_err(|e| e.to_string()),
    },
    Feature {
        name: "bpf_sk_storage_get in cgroup_skb programs (the raw-socket guard)",
        since: "5.2",
        probe: || helper(ProgramType::CgroupSkb, BpfHelper::BPF_FUNC_sk_storage_get),
    },
    Feature {
        name: "bpf_sk_storage_get in cgroup sock programs (the raw-socket guard)",
        since: "5.9",
        probe: || helper(ProgramType::CgroupSock, BpfHelper::BPF_FUNC_sk_storage_get),
    },
];

/// TCX links, for the interface counters only.
pub const TCX: Feature = Feature {
    name: "TCX links (tc attachment with bpf_link, for the interface counters)",
    since: "6.6",
    probe: tcx_probe,
};

/// An attach type or program the kernel does not know is refused with
/// `EINVAL`; anything else it answers means it knows it.
fn refused_as_unknown(result: std::io::Result<()>) -> Result<bool, String> {
    match result {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

fn tcx_probe() -> Result<bool, String> {
    // A TCX link on interface 0: a kernel with TCX looks for the device
    // (ENODEV); one without refuses the attach type (EINVAL).
    let program =
        sys::load_minimal_program(sys::PROG_TYPE_SCHED_CLS, -1).map_err(|e| e.to_string())?;
    match sys::link_create(program.as_fd(), 0, BPF_TCX_INGRESS) {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e.to_string()),
        Ok(_) => Err("the kernel attached to interface 0".into()),
    }
}

fn check(feature: &Feature) -> Result<(), FeatureError> {
    match (feature.probe)() {
        Ok(true) => Ok(()),
        Ok(false) => Err(FeatureError::Missing {
            feature: feature.name,
            since: feature.since,
        }),
        Err(reason) => Err(FeatureError::Probe {
            feature: feature.name,
            reason,
        }),
    }
}

/// Probes the running kernel for every required feature; names each one
/// missing.
pub fn check_kernel() -> Result<(), KernelError> {
    let missing: Vec<_> = REQUIRED.iter().filter_map(|f| check(f).err()).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(KernelError(missing))
    }
}

/// What [`check_kernel`] found missing, one feature a line.
#[derive(Debug, thiserror::Error)]
#[error("the kernel cannot run ambpf's eBPF mode:{}", list(.0))]
pub struct KernelError(pub Vec<FeatureError>);

fn list(errors: &[FeatureError]) -> String {
    errors.iter().map(|e| format!("\n  - {e}")).collect()
}

/// Telling ztunnel's sockets by their process, not their mark alone
/// (optional: without it the mark alone exempts, as under Istio's rules).
pub const ZTUNNEL_PROCESS_IN_SOCK_ADDR: Feature = Feature {
    name: "bpf_get_current_pid_tgid in cgroup sock_addr programs (ztunnel's outbound and DNS \
           exemption tied to its process)",
    since: "6.1",
    probe: || {
        helper(
            ProgramType::CgroupSockAddr,
            BpfHelper::BPF_FUNC_get_current_pid_tgid,
        )
    },
};
pub const ZTUNNEL_PROCESS_IN_SOCK_OPS: Feature = Feature {
    name: "bpf_get_current_pid_tgid in sock_ops programs (ztunnel's inbound listener and its \
           connections to the app tied to its process)",
    since: "6.10",
    probe: || {
        helper(
            ProgramType::SockOps,
            BpfHelper::BPF_FUNC_get_current_pid_tgid,
        )
    },
};

/// Whether the raw-socket guard can load, or why not.
pub fn raw_guard_supported() -> Result<(), FeatureError> {
    RAW_GUARD.iter().try_for_each(check)
}

/// Whether the interface counters can attach (TCX), or why not.
pub fn tcx_supported() -> Result<(), FeatureError> {
    check(&TCX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_kernel_has_every_feature_and_tcx() {
        let inbound = super::super::inbound::SK_LOOKUP;
        let process = [&ZTUNNEL_PROCESS_IN_SOCK_ADDR, &ZTUNNEL_PROCESS_IN_SOCK_OPS];
        for feature in REQUIRED
            .iter()
            .chain(RAW_GUARD)
            .chain(inbound)
            .chain(process)
        {
            assert_eq!((feature.probe)(), Ok(true), "{}", feature.name);
        }
        tcx_supported().unwrap();
    }

    #[test]
    fn a_missing_feature_is_named_with_its_first_kernel() {
        let absent = Feature {
            name: "a feature",
            since: "9.9",
            probe: || Ok(false),
        };
        assert_eq!(
            check(&absent).unwrap_err().to_string(),
            "this kernel lacks a feature (upstream since Linux 9.9)"
        );
        let broken = Feature {
            name: "a feature",
            since: "9.9",
            probe: || Err("EPERM".into()),
        };
        assert!(
            check(&broken)
                .unwrap_err()
                .to_string()
                .contains("probing the kernel for a feature: EPERM")
        );
    }

    #[test]
    fn an_unknown_attach_type_reads_as_missing() {
        // What a kernel before 5.8 answers for the getpeername hook.
        let program = sys::load_minimal_program_for(PROG_TYPE_CGROUP_SOCK_ADDR, 9999, 1);
        assert_eq!(refused_as_unknown(program.map(drop)), Ok(false));
    }
}
