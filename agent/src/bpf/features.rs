//! Kernel features ambpf needs, checked before anything is loaded so that a
//! kernel lacking one is refused up front instead of half-configured.

use aya::util::KernelVersion;

#[derive(Debug, thiserror::Error)]
pub enum FeatureError {
    #[error("cannot read the kernel version: {0}")]
    Version(String),
    #[error("kernel {found} lacks {feature} (needs Linux {needed} or later)")]
    Missing {
        feature: &'static str,
        found: String,
        needed: String,
    },
}

/// A feature the dataplane depends on and the first kernel that has it.
struct Requirement {
    feature: &'static str,
    since: (u8, u8, u16),
}

/// In kernel order. The version check runs first so that an old kernel is
/// refused with the feature it lacks named; a kernel that has the version but
/// not the feature (a distribution that disabled it) is caught when the
/// program using it fails to load, with the verifier's reason.
const REQUIREMENTS: &[Requirement] = &[
    Requirement {
        feature: "bpf_sk_assign in TC programs (inbound capture)",
        since: (5, 7, 0),
    },
    Requirement {
        feature: "BPF ring buffers (kernel log records)",
        since: (5, 8, 0),
    },
    Requirement {
        feature: "cgroup getpeername hooks (apps see their original peer)",
        since: (5, 8, 0),
    },
    Requirement {
        feature: "SO_NETNS_COOKIE (identifying pods' namespaces)",
        since: (5, 14, 0),
    },
    Requirement {
        feature: "bpf_get_netns_cookie in sock_ops and sockopt programs",
        since: (5, 15, 0),
    },
    Requirement {
        feature: "TCX links (tc attachment with bpf_link)",
        since: (6, 6, 0),
    },
];

/// Checks the running kernel against every requirement.
pub fn check_kernel() -> Result<(), FeatureError> {
    let current = KernelVersion::current().map_err(|e| FeatureError::Version(e.to_string()))?;
    check_version(current)
}

fn check_version(current: KernelVersion) -> Result<(), FeatureError> {
    for req in REQUIREMENTS {
        let (major, minor, patch) = req.since;
        if current < KernelVersion::new(major, minor, patch) {
            return Err(FeatureError::Missing {
                feature: req.feature,
                found: current.to_string(),
                needed: format!("{major}.{minor}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_requirement_names_its_feature() {
        let err = check_version(KernelVersion::new(5, 10, 0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kernel 5.10.0 lacks SO_NETNS_COOKIE (identifying pods' namespaces) (needs Linux 5.14 or later)"
        );
        let err = check_version(KernelVersion::new(4, 19, 0)).unwrap_err();
        assert!(err.to_string().contains("bpf_sk_assign"), "{err}");
    }

    #[test]
    fn old_kernel_is_refused_naming_the_feature() {
        let err = check_version(KernelVersion::new(6, 1, 0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kernel 6.1.0 lacks TCX links (tc attachment with bpf_link) (needs Linux 6.6 or later)"
        );
    }

    #[test]
    fn recent_kernel_passes() {
        check_version(KernelVersion::new(6, 6, 0)).unwrap();
        check_version(KernelVersion::new(6, 18, 44)).unwrap();
    }
}
