//! Privileged: an agent meeting maps pinned by an ambpf whose map layout
//! differs refuses to start, naming the map and the difference, and changes
//! nothing; maps of the same layout are adopted (see `restart.rs`).

use std::process::Command;

use ambpf::bpf::{Dataplane, LoadError, PinLayout, compat::CompatError};
use ambpf_common::maps;
use ambpf_testbed::BpffsMount;

#[test]
fn pinned_maps_of_another_layout_are_refused_with_what_differs() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    pins.prepare().unwrap();
    // As an older agent could have left it: same name, a smaller value.
    let old = pins.map(maps::PODS_BY_NETNS);
    let out = Command::new("bpftool")
        .args(["map", "create"])
        .arg(&old)
        .args(["type", "hash", "key", "8", "value", "48", "entries", "4096"])
        .args(["name", maps::PODS_BY_NETNS])
        .output()
        .expect("bpftool must be installed (apt install bpftool)");
    assert!(out.status.success(), "{out:?}");

    let err = match Dataplane::load(pins.clone()) {
        Ok(_) => panic!("an incompatible pinned map was adopted"),
        Err(e) => e,
    };
    let LoadError::PinnedMap(CompatError::Incompatible(pin)) = &err else {
        panic!("unexpected error: {err}");
    };
    assert_eq!(pin.name, maps::PODS_BY_NETNS);
    let message = err.to_string();
    assert!(message.contains("value size 48, expected 56"), "{message}");
    assert!(message.contains("ambpf uninstall"), "{message}");

    // Nothing else was created or attached, and the old map is left as it was.
    for name in maps::PINNED.iter().filter(|n| **n != maps::PODS_BY_NETNS) {
        assert!(!pins.map(name).exists(), "{name} was pinned");
    }
    assert!(old.exists());
    let links = pins.root().join("links");
    let attached: Vec<_> = walk(&links);
    assert!(attached.is_empty(), "links pinned: {attached:?}");
}

/// Every file below `dir` (none when it does not exist).
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| {
            let path = e.path();
            if path.is_dir() {
                walk(&path)
            } else {
                vec![path]
            }
        })
        .collect()
}
