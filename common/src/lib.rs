//! Types shared by the ambpf kernel programs (`ebpf/`) and the agent (`agent/`).
//!
//! Everything here is `#[repr(C)]` with explicit padding so that the kernel and
//! userspace agree on the layout byte for byte. Names of programs and maps are
//! kept here too: they are what `bpftool prog show` / `bpftool map show` print,
//! and the kernel truncates object names to 15 bytes, which the tests below
//! enforce.
#![no_std]

/// Program names as the kernel knows them (the eBPF function symbols).
pub mod programs {
    /// TC program counting packets that enter an interface (TCX ingress).
    pub const IFACE_COUNT_INGRESS: &str = "ambpf_cnt_in";
    /// TC program counting packets that leave an interface (TCX egress).
    pub const IFACE_COUNT_EGRESS: &str = "ambpf_cnt_out";

    /// Every program the agent loads, in load order.
    pub const ALL: &[&str] = &[IFACE_COUNT_INGRESS, IFACE_COUNT_EGRESS];
}

/// Map names as the kernel knows them; also the file names of their pins.
pub mod maps {
    /// Per-CPU packet and byte counters, keyed by [`crate::IfaceStatsKey`].
    pub const IFACE_STATS: &str = "ambpf_if_stats";
    /// The ring buffer aya-log-ebpf writes log records to (name fixed by aya-log).
    pub const AYA_LOGS: &str = "AYA_LOGS";

    /// Maps the agent pins under `<pin root>/maps/`. `AYA_LOGS` is not pinned: it
    /// belongs to the agent process that drains it.
    pub const PINNED: &[&str] = &[IFACE_STATS];
}

/// Kernel object names are at most `BPF_OBJ_NAME_LEN - 1` bytes.
pub const BPF_OBJ_NAME_MAX: usize = 15;

/// Which way a packet crossed an interface, as seen by the TC hook.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Ingress = 0,
    Egress = 1,
}

impl Direction {
    pub const fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// Key of [`maps::IFACE_STATS`]: one interface and direction.
///
/// The ifindex is only unique within a network namespace. A TC program cannot
/// learn the namespace of the device it runs on (`bpf_get_netns_cookie` on an
/// skb reports the *socket's* namespace, or the initial one when there is no
/// socket, as on ingress), so counters of same-numbered devices in different
/// namespaces add up; attach them to devices with distinct ifindexes (host-side
/// veths) when that matters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IfaceStatsKey {
    pub ifindex: u32,
    /// A [`Direction`] as u32 (an enum is not a valid `Pod`).
    pub direction: u32,
}

/// Value of [`maps::IFACE_STATS`], one per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfaceStats {
    pub packets: u64,
    pub bytes: u64,
}

impl IfaceStats {
    /// Adds another CPU's share.
    pub fn accumulate(&mut self, other: &IfaceStats) {
        self.packets = self.packets.wrapping_add(other.packets);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain #[repr(C)] structs of integers with no implicit padding.
    unsafe impl aya::Pod for super::IfaceStatsKey {}
    unsafe impl aya::Pod for super::IfaceStats {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn names_fit_the_kernel_limit() {
        for name in programs::ALL.iter().chain(maps::PINNED) {
            assert!(
                name.len() <= BPF_OBJ_NAME_MAX,
                "{name} would be truncated by the kernel"
            );
        }
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<IfaceStatsKey>(), 8);
        assert_eq!(size_of::<IfaceStats>(), 16);
    }

    #[test]
    fn stats_accumulate_across_cpus() {
        let mut total = IfaceStats::default();
        total.accumulate(&IfaceStats {
            packets: 2,
            bytes: 100,
        });
        total.accumulate(&IfaceStats {
            packets: 3,
            bytes: 60,
        });
        assert_eq!(
            total,
            IfaceStats {
                packets: 5,
                bytes: 160
            }
        );
    }
}
