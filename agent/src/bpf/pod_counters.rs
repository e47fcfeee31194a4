//! Per-pod counters ([`maps::POD_COUNTERS`]): what the programs did for each
//! enrolled pod, per CPU, by netns cookie. The agent adds a pod's entry when
//! it enrols the pod and deletes it with the pod, so the map holds only
//! enrolled pods and its series on `/metrics` go with them.

use std::collections::HashMap;

use ambpf_common::{PodCounters, maps};
use aya::maps::{Map, MapData, MapError, PerCpuHashMap, PerCpuValues};
use serde::ser::SerializeMap as _;

use super::{Dataplane, PinLayout, inspect::InspectError};

/// `BPF_NOEXIST`: add the entry only if it is not there (a pod enrolled
/// again keeps its counts).
const BPF_NOEXIST: u64 = 1;

/// A pod's counters summed over CPUs; serialized as an object of named
/// counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounts(pub PodCounters);

impl PodCounts {
    /// Each count with its name, in a fixed order.
    pub fn named(&self) -> [(&'static str, u64); 4] {
        let c = &self.0;
        [
            ("outbound_redirected", c.outbound_redirected),
            ("inbound_redirected", c.inbound_redirected),
            ("dns_redirected", c.dns_redirected),
            ("probes_bypassed", c.probes_bypassed),
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
    fn pod_counters(&mut self) -> Result<PerCpuHashMap<&mut MapData, u64, PodCounters>, MapError> {
        PerCpuHashMap::try_from(self.map_mut(maps::POD_COUNTERS))
    }

    /// Gives the pod `netns_cookie` its counters, zero on every CPU, unless
    /// it has them already.
    pub(crate) fn add_pod_counters(&mut self, netns_cookie: u64) -> Result<(), MapError> {
        let cpus = aya::util::nr_cpus().map_err(|(call, io_error)| {
            MapError::SyscallError(aya::sys::SyscallError { call, io_error })
        })?;
        let zero = PerCpuValues::try_from(vec![PodCounters::default(); cpus])?;
        match self.pod_counters()?.insert(netns_cookie, zero, BPF_NOEXIST) {
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(())
            }
            other => other,
        }
    }

    /// Deletes the pod's counters (they go with the pod).
    pub(crate) fn remove_pod_counters(&mut self, netns_cookie: u64) -> Result<(), MapError> {
        match self.pod_counters()?.remove(&netns_cookie) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            // aya reports a missing key as the syscall's ENOENT: removing a
            // pod twice must not fail before its steering filter is gone.
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

/// Every pod's counters, summed over CPUs, read from the pin (empty where an
/// agent older than per-pod counters pinned its maps).
pub fn read(pins: &PinLayout) -> Result<HashMap<u64, PodCounts>, InspectError> {
    let path = pins.map(maps::POD_COUNTERS);
    if !path.exists() {
        return Ok(HashMap::new());
    }
    let map_err = |source| InspectError::Map {
        path: path.clone(),
        cause: source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    let map: PerCpuHashMap<_, u64, PodCounters> =
        PerCpuHashMap::try_from(Map::PerCpuHashMap(data)).map_err(map_err)?;
    let mut out = HashMap::new();
    for entry in map.iter() {
        let (cookie, per_cpu) = entry.map_err(map_err)?;
        let mut total = PodCounters::default();
        per_cpu.iter().for_each(|cpu| total.accumulate(cpu));
        out.insert(cookie, PodCounts(total));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_serialize_as_an_object_of_named_counts() {
        let counts = PodCounts(PodCounters {
            outbound_redirected: 3,
            inbound_redirected: 2,
            dns_redirected: 1,
            probes_bypassed: 4,
        });
        assert_eq!(
            serde_json::to_value(counts).unwrap(),
            serde_json::json!({
                "outbound_redirected": 3,
                "inbound_redirected": 2,
                "dns_redirected": 1,
                "probes_bypassed": 4,
            })
        );
    }
}
