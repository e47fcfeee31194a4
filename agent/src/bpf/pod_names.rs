//! Who each enrolled pod is (Kubernetes namespace, name and UID), kept in a
//! pinned hash map by netns cookie, so that `ambpf status` can name pods
//! from the pins alone, without the agent. No kernel program reads it: the
//! agent creates it (`maps/ambpf_pod_names`), writes an entry when it
//! enrols a pod and deletes it when it removes the pod. Names longer than
//! their field are cut (Kubernetes' own limits fit: 63, 253 and 36 bytes).

use std::collections::HashMap as StdHashMap;

use aya::maps::{HashMap, Map, MapData};
use serde::Serialize;

use super::{PinLayout, inspect::InspectError, sys};

/// The map's name and pin (`maps/<name>`).
pub const MAP_NAME: &str = "ambpf_pod_names";
/// As many pods as the pods map holds.
const MAX_ENTRIES: u32 = 4096;

/// A pod as Kubernetes (or the pods file) names it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PodIdentity {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The map's value: NUL-padded UTF-8.
#[repr(C)]
#[derive(Clone, Copy)]
struct Record {
    namespace: [u8; 64],
    name: [u8; 256],
    uid: [u8; 64],
}

// SAFETY: plain bytes, no padding, every bit pattern valid.
unsafe impl aya::Pod for Record {}

impl Record {
    fn new(pod: &PodIdentity) -> Self {
        fn field<const N: usize>(text: &str) -> [u8; N] {
            let mut out = [0u8; N];
            // Cut at a character boundary, leaving room for the NUL.
            let mut len = text.len().min(N - 1);
            while !text.is_char_boundary(len) {
                len -= 1;
            }
            out[..len].copy_from_slice(&text.as_bytes()[..len]);
            out
        }
        Self {
            namespace: field(&pod.namespace),
            name: field(&pod.name),
            uid: field(&pod.uid),
        }
    }

    fn identity(&self) -> PodIdentity {
        fn text(bytes: &[u8]) -> String {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            String::from_utf8_lossy(&bytes[..end]).into_owned()
        }
        PodIdentity {
            namespace: text(&self.namespace),
            name: text(&self.name),
            uid: text(&self.uid),
        }
    }
}

fn map_err(pins: &PinLayout) -> impl Fn(aya::maps::MapError) -> InspectError + '_ {
    move |source| InspectError::Map {
        path: pins.map(MAP_NAME),
        cause: source,
    }
}

fn open(pins: &PinLayout) -> Result<HashMap<MapData, u64, Record>, InspectError> {
    let data = MapData::from_pin(pins.map(MAP_NAME)).map_err(map_err(pins))?;
    HashMap::try_from(Map::HashMap(data)).map_err(map_err(pins))
}

/// Opens the pinned map, creating and pinning it first if needed.
fn open_or_create(pins: &PinLayout) -> Result<HashMap<MapData, u64, Record>, InspectError> {
    let path = pins.map(MAP_NAME);
    if !path.exists() {
        let io_err = |source| InspectError::Io {
            path: path.clone(),
            cause: source,
        };
        let fd = sys::map_create(
            sys::MAP_TYPE_HASH,
            size_of::<u64>() as u32,
            size_of::<Record>() as u32,
            MAX_ENTRIES,
            MAP_NAME,
        )
        .map_err(io_err)?;
        sys::obj_pin(&fd, &path).map_err(io_err)?;
    }
    open(pins)
}

/// Records who the pod with `netns_cookie` is.
pub fn record(pins: &PinLayout, netns_cookie: u64, pod: &PodIdentity) -> Result<(), InspectError> {
    open_or_create(pins)?
        .insert(netns_cookie, Record::new(pod), 0)
        .map_err(map_err(pins))
}

/// Forgets the pod with `netns_cookie` (nothing recorded is fine).
pub fn remove(pins: &PinLayout, netns_cookie: u64) -> Result<(), InspectError> {
    if !pins.map(MAP_NAME).exists() {
        return Ok(());
    }
    match open(pins)?.remove(&netns_cookie) {
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        other => other.map_err(map_err(pins)),
    }
}

/// Every recorded pod by netns cookie (none recorded: an empty map, as
/// under an agent older than the record).
pub fn read_all(pins: &PinLayout) -> Result<StdHashMap<u64, PodIdentity>, InspectError> {
    if !pins.map(MAP_NAME).exists() {
        return Ok(StdHashMap::new());
    }
    let map = open(pins)?;
    map.iter()
        .map(|entry| {
            entry
                .map(|(cookie, record)| (cookie, record.identity()))
                .map_err(map_err(pins))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_keeps_the_identity_and_cuts_at_a_character() {
        let pod = PodIdentity {
            namespace: "shop".into(),
            name: "web-0.canary".into(),
            uid: "6f1c2a9e-0000-4000-8000-000000000001".into(),
        };
        assert_eq!(Record::new(&pod).identity(), pod);
        let long = PodIdentity {
            namespace: "é".repeat(40),
            ..pod
        };
        let cut = Record::new(&long).identity();
        assert_eq!(
            cut.namespace,
            "é".repeat(31),
            "63 bytes hold 31 two-byte characters"
        );
    }
}
