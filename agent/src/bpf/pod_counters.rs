//! Per-pod counters ([`maps::POD_COUNTERS`], [`maps::POD_DROPS`]): what the
//! programs did for each enrolled pod, and what they refused, per CPU, by
//! netns cookie. The agent adds a pod's entries when it enrols the pod and
//! deletes them with the pod, so the maps hold only enrolled pods and their
//! series on `/metrics` go with them.

use std::collections::HashMap;

use ambpf_common::{PodCounters, PodDrops, maps};
use aya::{
    Pod,
    maps::{Map, MapData, MapError, PerCpuHashMap, PerCpuValues},
};
use serde::ser::SerializeMap as _;

use super::{Dataplane, PinLayout, inspect::InspectError};

/// `BPF_NOEXIST`: add the entry only if it is not there (a pod enrolled
/// again keeps its counts).
const BPF_NOEXIST: u64 = 1;

/// A pod's counters summed over CPUs; serialized as an object of named
/// counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounts {
    pub counters: PodCounters,
    /// Zero where an agent older than per-pod refusals pinned the maps.
    pub drops: PodDrops,
}

impl PodCounts {
    /// Each count with its name, in a fixed order (a refusal is named as
    /// the node-wide counter is).
    pub fn named(&self) -> [(&'static str, u64); 5] {
        let c = &self.counters;
        [
            ("outbound_redirected", c.outbound_redirected),
            ("inbound_redirected", c.inbound_redirected),
            ("dns_redirected", c.dns_redirected),
            ("probes_bypassed", c.probes_bypassed),
            ("inbound_no_listener", self.drops.inbound_no_listener),
        ]
    }
}

impl serde::Serialize for PodCounts {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let named = self.named();
        let mut map = serializer.serialize_map(Some(named.len()))?;
        for (name, value) in named {
            map.serialize_entry(name, &value)?;
        }
        map.end()
    }
}

impl Dataplane {
    /// Gives the pod `netns_cookie` its counters, zero on every CPU, unless
    /// it has them already. On failure, the map that refused the entry.
    pub(crate) fn add_pod_counters(
        &mut self,
        netns_cookie: u64,
    ) -> Result<(), (&'static str, MapError)> {
        add_zeroed::<PodCounters>(self.map_mut(maps::POD_COUNTERS), netns_cookie)
            .map_err(|e| (maps::POD_COUNTERS, e))?;
        add_zeroed::<PodDrops>(self.map_mut(maps::POD_DROPS), netns_cookie)
            .map_err(|e| (maps::POD_DROPS, e))
    }

    /// Deletes the pod's counters (they go with the pod).
    pub(crate) fn remove_pod_counters(
        &mut self,
        netns_cookie: u64,
    ) -> Result<(), (&'static str, MapError)> {
        remove::<PodCounters>(self.map_mut(maps::POD_COUNTERS), netns_cookie)
            .map_err(|e| (maps::POD_COUNTERS, e))?;
        remove::<PodDrops>(self.map_mut(maps::POD_DROPS), netns_cookie)
            .map_err(|e| (maps::POD_DROPS, e))
    }
}

/// Adds `netns_cookie`'s entry to the per-CPU `map`, zero on every CPU,
/// unless it is there.
fn add_zeroed<V: Pod + Default>(map: &mut Map, netns_cookie: u64) -> Result<(), MapError> {
    let cpus = aya::util::nr_cpus().map_err(|(call, io_error)| {
        MapError::SyscallError(aya::sys::SyscallError { call, io_error })
    })?;
    let zero = PerCpuValues::try_from(vec![V::default(); cpus])?;
    let mut map: PerCpuHashMap<&mut MapData, u64, V> = PerCpuHashMap::try_from(map)?;
    match map.insert(netns_cookie, zero, BPF_NOEXIST) {
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other,
    }
}

fn remove<V: Pod>(map: &mut Map, netns_cookie: u64) -> Result<(), MapError> {
    let mut map: PerCpuHashMap<&mut MapData, u64, V> = PerCpuHashMap::try_from(map)?;
    match map.remove(&netns_cookie) {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        // aya reports a missing key as the syscall's ENOENT: removing a
        // pod twice must not fail before its steering filter is gone.
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Every pod's counters, summed over CPUs, read from the pins (empty where an
/// agent older than per-pod counters pinned its maps).
pub fn read(pins: &PinLayout) -> Result<HashMap<u64, PodCounts>, InspectError> {
    let mut out: HashMap<u64, PodCounts> =
        read_sums(pins, maps::POD_COUNTERS, |c: &mut PodCounters, v| {
            c.accumulate(v)
        })?
        .into_iter()
        .map(|(cookie, counters)| {
            let counts = PodCounts {
                counters,
                drops: PodDrops::default(),
            };
            (cookie, counts)
        })
        .collect();
    for (cookie, drops) in read_sums(pins, maps::POD_DROPS, |d: &mut PodDrops, v| d.accumulate(v))?
    {
        // A pod is one with counters: a drops entry alone is a removal's
        // half, gone at the next step.
        if let Some(counts) = out.get_mut(&cookie) {
            counts.drops = drops;
        }
    }
    Ok(out)
}

/// Each entry of the per-CPU hash map `name`, summed over CPUs by `add`
/// (none when it is not pinned).
fn read_sums<V: Pod + Default>(
    pins: &PinLayout,
    name: &str,
    add: impl Fn(&mut V, &V),
) -> Result<HashMap<u64, V>, InspectError> {
    let path = pins.map(name);
    if !path.exists() {
        return Ok(HashMap::new());
    }
    let map_err = |source| InspectError::Map {
        path: path.clone(),
        cause: source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    let map: PerCpuHashMap<_, u64, V> =
        PerCpuHashMap::try_from(Map::PerCpuHashMap(data)).map_err(map_err)?;
    let mut out = HashMap::new();
    for entry in map.iter() {
        let (cookie, per_cpu) = entry.map_err(map_err)?;
        let mut total = V::default();
        per_cpu.iter().for_each(|cpu| add(&mut total, cpu));
        out.insert(cookie, total);
    }
    Ok(out)
}

/// How often the agent looks for new refusals to log: at most one line per
/// pod (and one for the node) per interval, however many it refused.
pub const REFUSAL_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// What a refusal look compares: each pod's refused connections, and the
/// node's refused for a local address no pod was enrolled with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refusals {
    pub by_pod: HashMap<u64, u64>,
    pub unknown_address: u64,
}

impl Refusals {
    /// As counted now under `pins`.
    pub fn read(pins: &PinLayout) -> Result<Self, InspectError> {
        let by_pod = read(pins)?
            .into_iter()
            .map(|(cookie, counts)| (cookie, counts.drops.inbound_no_listener))
            .collect();
        let unknown_address = super::inspect::read_counters(pins)?
            .into_iter()
            .find_map(|(name, value)| (name == "inbound_unknown_address").then_some(value))
            .unwrap_or(0);
        Ok(Self {
            by_pod,
            unknown_address,
        })
    }
}

/// Logs, every `interval`, the inbound connections refused since the last
/// look: one line per pod whose count grew, never one per connection (the
/// metrics and `ambpf status` have the totals).
pub async fn log_refusals(pins: PinLayout, interval: std::time::Duration) {
    let mut last: Option<Refusals> = None;
    let mut ticks = tokio::time::interval(interval);
    loop {
        ticks.tick().await;
        let now = match Refusals::read(&pins) {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!("reading the inbound refusal counters: {e}");
                continue;
            }
        };
        // Refusals from before this agent started were logged by an earlier one.
        if let Some(before) = &last {
            let names = super::pod_names::read_all(&pins).unwrap_or_default();
            let names = names
                .into_iter()
                .map(|(cookie, pod)| (cookie, format!("{}/{}", pod.namespace, pod.name)))
                .collect();
            for message in refusal_messages(before, &now, &names) {
                tracing::warn!("{message}");
            }
        }
        last = Some(now);
    }
}

/// What to log for the refusals counted between `before` and `now`; `names`
/// are pods' `namespace/name` by netns cookie.
pub fn refusal_messages(
    before: &Refusals,
    now: &Refusals,
    names: &HashMap<u64, String>,
) -> Vec<String> {
    let mut pods: Vec<(&u64, &u64)> = now.by_pod.iter().collect();
    pods.sort_unstable();
    let mut out: Vec<String> = pods
        .into_iter()
        .filter_map(|(cookie, total)| {
            // A pod first seen now was enrolled since with its counts at 0.
            let earlier = before.by_pod.get(cookie).copied().unwrap_or(0);
            let new = total.checked_sub(earlier).filter(|n| *n > 0)?;
            let who = names.get(cookie).map_or_else(
                || format!("pod with netns cookie {cookie}"),
                |name| format!("pod {name}"),
            );
            Some(format!(
                "{who}: {new} inbound connections refused since the last report (no_listener: \
                 ztunnel's 15006 listener is not open in the pod; {total} since enrolment)"
            ))
        })
        .collect();
    if let Some(new) = now
        .unknown_address
        .checked_sub(before.unknown_address)
        .filter(|n| *n > 0)
    {
        out.push(format!(
            "{new} inbound connections to a local address no pod was enrolled with refused \
             since the last report (unknown_address; the lookup names no pod)"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_once_per_pod_that_grew() {
        let before = Refusals {
            by_pod: HashMap::from([(1, 5), (2, 3)]),
            unknown_address: 4,
        };
        let now = Refusals {
            by_pod: HashMap::from([(1, 9), (2, 3), (3, 2)]),
            unknown_address: 4,
        };
        let names = HashMap::from([(1, "shop/web-0".to_owned())]);
        let messages = refusal_messages(&before, &now, &names);
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(
            messages[0].starts_with("pod shop/web-0: 4 inbound connections refused since"),
            "{}",
            messages[0]
        );
        assert!(messages[0].contains("9 since enrolment"), "{}", messages[0]);
        assert!(
            messages[1].starts_with("pod with netns cookie 3: 2 inbound"),
            "{}",
            messages[1]
        );
        // Nothing new: nothing said.
        assert!(refusal_messages(&now, &now, &names).is_empty());
        // The node's refusals of addresses no pod has, in one line.
        let unknown = Refusals {
            unknown_address: 6,
            ..now.clone()
        };
        let messages = refusal_messages(&now, &unknown, &names);
        assert_eq!(messages.len(), 1, "{messages:?}");
        assert!(messages[0].starts_with("2 inbound connections to a local address"));
    }

    #[test]
    fn counts_serialize_as_an_object_of_named_counts() {
        let counts = PodCounts {
            counters: PodCounters {
                outbound_redirected: 3,
                inbound_redirected: 2,
                dns_redirected: 1,
                probes_bypassed: 4,
            },
            drops: PodDrops {
                inbound_no_listener: 5,
                ..PodDrops::default()
            },
        };
        assert_eq!(
            serde_json::to_value(counts).unwrap(),
            serde_json::json!({
                "outbound_redirected": 3,
                "inbound_redirected": 2,
                "dns_redirected": 1,
                "probes_bypassed": 4,
                "inbound_no_listener": 5,
            })
        );
    }
}
