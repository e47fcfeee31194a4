//! How many entries the maps that hold per-pod and per-connection state
//! get, set at load (`--max-pods`, `--max-redirected-connections`,
//! `--max-host-addresses`), and what a full map costs (the miss counters).
//!
//! Past each capacity (docs/operations.md "Map capacities"):
//! - pods map full: enrolling one more pod fails with an error naming the
//!   map and its capacity, nothing of it is left installed, and the pods
//!   already enrolled keep being served;
//! - original-destination maps full: they are LRUs, so a new connection
//!   evicts the least recently used record. A record is needed only until
//!   ztunnel has read it (and for the app's `getpeername()`); one evicted
//!   before that makes ztunnel refuse the connection (it cannot tell where
//!   it was going), and the programs count it ([`ambpf_common::Miss`]);
//! - host addresses beyond the capacity are not exempted: their traffic to
//!   pods goes through ztunnel like any other (logged at start).

use std::path::Path;

use ambpf_common::{Miss, maps};
use aya::EbpfLoader;

use super::inspect::InspectError;

/// The capacities the agent loads the maps with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    /// Enrolled pods (the pods and per-pod counter maps; the pod-address
    /// map gets twice as many, one address of each family).
    pub pods: u32,
    /// Redirected connections whose original destination is remembered at
    /// once (each of the two LRU maps).
    pub redirected_connections: u32,
    /// The node's own addresses exempted as the host's.
    pub host_addresses: u32,
}

impl Default for Capacities {
    fn default() -> Self {
        Self {
            pods: maps::DEFAULT_MAX_PODS,
            redirected_connections: maps::DEFAULT_MAX_REDIRECTED,
            host_addresses: maps::HOST_ADDRS_MAX,
        }
    }
}

/// The capacity flags of `ambpf run`.
#[derive(Debug, clap::Args)]
pub struct CapacityArgs {
    /// eBPF mode: pods the maps hold (docs/operations.md "Map capacities"). Maps
    /// already pinned keep the capacity they were made with (a warning
    /// says so) until `ambpf uninstall`.
    #[arg(long, env = "AMBPF_MAX_PODS", default_value_t = maps::DEFAULT_MAX_PODS)]
    pub max_pods: u32,

    /// eBPF mode: redirected connections whose original destination is
    /// remembered at once, node-wide (LRU: the least recently used record
    /// goes first; a connection whose record went before ztunnel read it is
    /// refused and counted in `ambpf_origdst_misses_total`).
    #[arg(
        long,
        env = "AMBPF_MAX_REDIRECTED_CONNECTIONS",
        default_value_t = maps::DEFAULT_MAX_REDIRECTED
    )]
    pub max_redirected_connections: u32,

    /// eBPF mode: node addresses exempted as the host's (kubelet probes).
    #[arg(long, env = "AMBPF_MAX_HOST_ADDRESSES", default_value_t = maps::HOST_ADDRS_MAX)]
    pub max_host_addresses: u32,
}

impl From<&CapacityArgs> for Capacities {
    fn from(args: &CapacityArgs) -> Self {
        Self {
            pods: args.max_pods,
            redirected_connections: args.max_redirected_connections,
            host_addresses: args.max_host_addresses,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{flag} must be between 1 and {max}, not {value}")]
pub struct CapacityError {
    pub flag: &'static str,
    pub value: u32,
    pub max: u32,
}

/// Entries one map may be given: the kernel's hash maps preallocate every
/// entry, so a typo should not ask for gigabytes.
const LIMIT: u32 = 1 << 24;

impl Capacities {
    /// Checks every capacity is usable.
    pub fn validate(&self) -> Result<(), CapacityError> {
        for (flag, value) in [
            ("--max-pods", self.pods),
            ("--max-redirected-connections", self.redirected_connections),
            ("--max-host-addresses", self.host_addresses),
        ] {
            if value == 0 || value > LIMIT {
                return Err(CapacityError {
                    flag,
                    value,
                    max: LIMIT,
                });
            }
        }
        Ok(())
    }

    /// The entries `map` gets, and the flag that sets them; `None` for maps
    /// of a fixed size.
    pub fn of(&self, map: &str) -> Option<(u32, &'static str)> {
        Some(match map {
            maps::PODS_BY_NETNS
            | maps::POD_COUNTERS
            | maps::POD_DROPS
            | maps::INBOUND_LISTENERS => (self.pods, "--max-pods"),
            maps::PODS_BY_IP => (self.pods.saturating_mul(2), "--max-pods"),
            maps::ORIG_BY_COOKIE | maps::ORIG_BY_TUPLE => {
                (self.redirected_connections, "--max-redirected-connections")
            }
            maps::HOST_ADDRS => (self.host_addresses, "--max-host-addresses"),
            _ => return None,
        })
    }

    /// Sets every capacity on `loader` (used for maps not pinned yet).
    pub fn apply(&self, loader: &mut EbpfLoader<'_>) {
        for name in maps::PINNED {
            if let Some((entries, _)) = self.of(name) {
                loader.map_max_entries(name, entries);
            }
        }
    }
}

/// Original-destination records found missing, by reason, summed over
/// CPUs (empty before the agent first pinned the map).
pub fn read_misses(pins: &super::PinLayout) -> Result<Vec<(Miss, u64)>, InspectError> {
    let slots: Vec<u32> = Miss::ALL.iter().map(|m| *m as u32).collect();
    let sums = super::inspect::per_cpu_sums(&pins.map(maps::MISSES), &slots)?;
    Ok(sums.map_or_else(Vec::new, |sums| {
        Miss::ALL.iter().copied().zip(sums).collect()
    }))
}

/// The entries the map pinned at `pin` was created with.
pub fn pinned_max_entries(pin: &Path) -> Option<u32> {
    aya::maps::MapInfo::from_pin(pin)
        .ok()
        .map(|info| info.max_entries())
}

/// How often the agent looks for new misses to log.
pub const MISS_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Logs, every `interval`, the misses counted since the last look, with
/// what to do about them (the metric has the totals).
pub async fn log_misses(
    pins: super::PinLayout,
    capacities: Capacities,
    interval: std::time::Duration,
) {
    let mut last: Option<Vec<(Miss, u64)>> = None;
    let mut ticks = tokio::time::interval(interval);
    loop {
        ticks.tick().await;
        let now = match read_misses(&pins) {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!("reading the original-destination miss counters: {e}");
                continue;
            }
        };
        // Misses from before this agent started were logged by an earlier one.
        if let Some(before) = &last {
            for message in miss_messages(before, &now, capacities) {
                tracing::warn!("{message}");
            }
        }
        last = Some(now);
    }
}

/// What to log for the misses counted between `before` and `now`.
pub fn miss_messages(
    before: &[(Miss, u64)],
    now: &[(Miss, u64)],
    capacities: Capacities,
) -> Vec<String> {
    let capacity = capacities.redirected_connections;
    now.iter()
        .filter_map(|(miss, total)| {
            let earlier = before
                .iter()
                .find(|(m, _)| m == miss)
                .map_or(0, |(_, n)| *n);
            let new = total.checked_sub(earlier).filter(|n| *n > 0)?;
            let what = match miss {
                Miss::OrigDst => {
                    "redirected connections reached ztunnel without their original \
                                  destination and were refused by it"
                }
                Miss::NotStored => {
                    "connections were refused at connect() because their \
                                    original destination could not be stored"
                }
                Miss::PeerName => {
                    "getpeername() calls on redirected sockets found no original \
                                   destination (the app saw ztunnel's address)"
                }
            };
            Some(format!(
                "{new} {what} ({total} since the maps were created; \
                 ambpf_origdst_misses_total{{reason=\"{}\"}}): the original-destination maps \
                 {} and {} hold {capacity} connections (--max-redirected-connections); more \
                 were opened at once than that, raise it (docs/operations.md, \"Map capacities\")",
                miss.name(),
                maps::ORIG_BY_COOKIE,
                maps::ORIG_BY_TUPLE,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_map_to_their_maps_and_flags() {
        let c = Capacities {
            pods: 10,
            redirected_connections: 100,
            host_addresses: 5,
        };
        assert_eq!(c.of(maps::PODS_BY_NETNS), Some((10, "--max-pods")));
        assert_eq!(c.of(maps::PODS_BY_IP), Some((20, "--max-pods")));
        assert_eq!(c.of(maps::POD_COUNTERS), Some((10, "--max-pods")));
        assert_eq!(
            c.of(maps::ORIG_BY_TUPLE),
            Some((100, "--max-redirected-connections"))
        );
        assert_eq!(c.of(maps::HOST_ADDRS), Some((5, "--max-host-addresses")));
        assert_eq!(c.of(maps::COUNTERS), None);
        assert!(c.validate().is_ok());
        let err = Capacities { pods: 0, ..c }.validate().unwrap_err();
        assert!(err.to_string().contains("--max-pods"), "{err}");
    }

    #[test]
    fn only_new_misses_are_logged_with_the_capacity() {
        let before = [(Miss::OrigDst, 3), (Miss::PeerName, 1)];
        let now = [(Miss::OrigDst, 5), (Miss::PeerName, 1)];
        let messages = miss_messages(&before, &now, Capacities::default());
        assert_eq!(messages.len(), 1, "{messages:?}");
        assert!(
            messages[0].starts_with("2 redirected connections"),
            "{messages:?}"
        );
        assert!(messages[0].contains("65536"), "{messages:?}");
        assert!(messages[0].contains("--max-redirected-connections"));
        assert!(miss_messages(&now, &now, Capacities::default()).is_empty());
    }
}
