//! Pinned maps left by an earlier agent, checked against this agent's object
//! before they are adopted.
//!
//! aya reuses a pinned map as it finds it, without comparing it with the
//! object's definition. After an upgrade that changed a map's key, value or
//! size, the new programs would then read the old entries with the new
//! layout. So each pinned map is compared with its definition first, and the
//! agent refuses to start, saying which map differs and how, rather than
//! redirect with misread state.
//!
//! A map whose capacity alone differs from what the flags ask (`--max-pods`,
//! `--max-redirected-connections`, `--max-host-addresses`) is adopted as it
//! is, with a warning: its entries are live pods and connections, which a
//! resize (a new map) would drop. The new capacity takes effect after
//! `ambpf uninstall`.

use std::path::PathBuf;

use ambpf_common::maps;
use aya::maps::MapInfo;

use super::{PinLayout, capacity::Capacities};

/// A pinned map that this agent's programs cannot use.
#[derive(Debug, thiserror::Error)]
#[error(
    "the map pinned at {pin} differs from this agent's {name} ({differences}); it was made by \
     another ambpf version: run `ambpf uninstall`, then start the agent again"
)]
pub struct IncompatiblePin {
    pub name: &'static str,
    pub pin: PathBuf,
    pub differences: String,
}

/// What the kernel says of a map, or what the object defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapShape {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

impl MapShape {
    /// `pinned` against `expected`, field by field; empty when they match.
    pub fn differences(pinned: &Self, expected: &Self) -> Vec<String> {
        let fields = [
            ("type", pinned.map_type, expected.map_type),
            ("key size", pinned.key_size, expected.key_size),
            ("value size", pinned.value_size, expected.value_size),
            ("max entries", pinned.max_entries, expected.max_entries),
        ];
        fields
            .into_iter()
            .filter(|(_, pinned, expected)| pinned != expected)
            .map(|(what, pinned, expected)| format!("{what} {pinned}, expected {expected}"))
            .collect()
    }
}

/// A pinned map adopted with another capacity than the flags ask.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapacityKept {
    pub name: &'static str,
    pub pinned: u32,
    pub asked: u32,
    pub flag: &'static str,
}

impl std::fmt::Display for CapacityKept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "map {} is pinned with {} entries, {} asks for {}: keeping {} (its entries are \
             live pods and connections); run `ambpf uninstall` while no pod needs the \
             redirection for the new capacity to take effect",
            self.name, self.pinned, self.flag, self.asked, self.pinned
        )
    }
}

/// Checks every map of [`maps::PINNED`] already pinned under `pins` against
/// its definition in `object`, with the capacities `capacities` asks for.
/// Maps not pinned yet are fine (they are created). Returns the capacities
/// in effect (a pinned map keeps its own) and the maps that kept theirs.
pub fn check_pinned_maps(
    object: &[u8],
    pins: &PinLayout,
    capacities: Capacities,
) -> Result<(Capacities, Vec<CapacityKept>), CompatError> {
    let mut effective = capacities;
    let mut kept = Vec::new();
    let object = aya_obj::Object::parse(object).map_err(|e| CompatError::Object(e.to_string()))?;
    for &name in maps::PINNED {
        let pin = pins.map(name);
        if !pin.exists() {
            continue;
        }
        let definition = object
            .maps
            .get(name)
            .ok_or(CompatError::NotInObject { name })?;
        let asked = capacities.of(name);
        let expected = MapShape {
            map_type: definition.map_type(),
            key_size: definition.key_size(),
            value_size: definition.value_size(),
            max_entries: asked.map_or(definition.max_entries(), |(entries, _)| entries),
        };
        let info = MapInfo::from_pin(&pin).map_err(|e| CompatError::Unreadable {
            pin: pin.clone(),
            reason: crate::error_chain(&e),
        })?;
        let pinned = MapShape {
            // MapType mirrors the kernel's enum bpf_map_type.
            map_type: info.map_type().map_or(u32::MAX, |t| t as u32),
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
        };
        if let Some((entries, flag)) = asked
            && pinned.max_entries != entries
            && MapShape::differences(
                &pinned,
                &MapShape {
                    max_entries: pinned.max_entries,
                    ..expected
                },
            )
            .is_empty()
        {
            kept.push(CapacityKept {
                name,
                pinned: pinned.max_entries,
                asked: entries,
                flag,
            });
            match name {
                maps::PODS_BY_NETNS => effective.pods = pinned.max_entries,
                maps::ORIG_BY_COOKIE => effective.redirected_connections = pinned.max_entries,
                maps::HOST_ADDRS => effective.host_addresses = pinned.max_entries,
                _ => {}
            }
            continue;
        }
        let differences = MapShape::differences(&pinned, &expected);
        if !differences.is_empty() {
            return Err(CompatError::Incompatible(IncompatiblePin {
                name,
                pin,
                differences: differences.join(", "),
            }));
        }
    }
    Ok((effective, kept))
}

#[derive(Debug, thiserror::Error)]
pub enum CompatError {
    #[error(transparent)]
    Incompatible(IncompatiblePin),
    #[error("{pin} is not a readable BPF map: {reason}")]
    Unreadable { pin: PathBuf, reason: String },
    #[error("map {name} is pinned but missing from the object")]
    NotInObject { name: &'static str },
    #[error("parsing the ambpf BPF object: {0}")]
    Object(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_each_field_that_changed() {
        let expected = MapShape {
            map_type: 1,
            key_size: 8,
            value_size: 56,
            max_entries: 4096,
        };
        assert!(MapShape::differences(&expected, &expected).is_empty());
        let pinned = MapShape {
            value_size: 48,
            max_entries: 1024,
            ..expected
        };
        assert_eq!(
            MapShape::differences(&pinned, &expected),
            [
                "value size 48, expected 56",
                "max entries 1024, expected 4096"
            ]
        );
    }

    #[test]
    #[cfg_attr(ambpf_ebpf_missing, ignore = "built without the eBPF toolchain")]
    fn every_pinned_map_is_defined_by_the_object() {
        let object = aya_obj::Object::parse(super::super::object::OBJECT).unwrap();
        for name in maps::PINNED {
            assert!(object.maps.contains_key(*name), "{name} not in the object");
        }
    }
}
