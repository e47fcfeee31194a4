//! ztunnel's processes, in the pinned `ambpf_zt_procs`: the programs exempt
//! a socket carrying ztunnel's mark only when ztunnel's process uses it, so
//! an app that sets the mark (CAP_NET_RAW may, on Linux 5.17 and later) is
//! captured all the same.
//!
//! The processes are the ZDS peers' ([`crate::zds::ZdsHandle::record_peers_with`]),
//! the holder of a ztunnel listener the agent filed itself because it was
//! open before the programs ([`super::listener_adoption`]; ztunnel has not
//! reconnected to this agent yet then), and their descendants (ztunnel is one process; a ztunnel that hands its
//! proxies to a child keeps them its own), each with its start time, so that a PID the kernel hands to another
//! process later is never taken for ztunnel. A process stays in the map
//! while it lives, connected or not (a ztunnel between two connections to a
//! restarting agent still owns its sockets), and leaves it when it is gone.
//! This module is the map's only writer.

use std::{future::Future, io, time::Duration};

use ambpf_common::maps;
use aya::maps::{HashMap, Map, MapData};
use tracing::{info, warn};

use super::PinLayout;

/// How often processes that died without a ZDS event are pruned.
const PRUNE_INTERVAL: Duration = Duration::from_secs(30);

/// A process's start time, in clock ticks after boot (`/proc/<pid>/stat`,
/// field 22); `None` when the process is gone.
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, field 2, is in parentheses and may hold spaces.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// The descendants of `roots`, from each process's parent in `/proc`.
fn descendants(roots: &[u32]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let after_name = &stat[stat.rfind(')')? + 1..];
            Some((pid, after_name.split_whitespace().nth(1)?.parse().ok()?))
        })
        .collect();
    let mut found: Vec<u32> = Vec::new();
    let mut frontier: Vec<u32> = roots.to_vec();
    while let Some(parent) = frontier.pop() {
        for (pid, _) in parents.iter().filter(|(_, ppid)| *ppid == parent) {
            if !found.contains(pid) && !roots.contains(pid) {
                found.push(*pid);
                frontier.push(*pid);
            }
        }
    }
    found
}

/// The pinned map under `pins`.
fn open(pins: &PinLayout) -> io::Result<HashMap<MapData, u32, u64>> {
    let data = MapData::from_pin(pins.map(maps::ZTUNNEL_PROCS)).map_err(io::Error::other)?;
    HashMap::try_from(Map::HashMap(data)).map_err(io::Error::other)
}

/// Writes the map: the `connected` PIDs and their descendants, and the
/// processes it held that still live (same PID, same start time); the rest
/// are removed. The connected processes themselves are written first, so a
/// full map never leaves ztunnel out.
pub fn update(pins: &PinLayout, connected: &[u32]) -> io::Result<()> {
    let mut map = open(pins)?;
    let held: Vec<(u32, u64)> = map.iter().filter_map(Result::ok).collect();
    let alive = |pid: u32| start_ticks(pid).map(|ticks| (pid, ticks));
    let mut wanted: Vec<(u32, u64)> = connected.iter().filter_map(|pid| alive(*pid)).collect();
    let held_alive = held
        .iter()
        .filter(|(pid, ticks)| start_ticks(*pid) == Some(*ticks))
        .copied();
    let roots: Vec<u32> = connected
        .iter()
        .copied()
        .chain(held_alive.clone().map(|(pid, _)| pid))
        .collect();
    wanted.extend(held_alive);
    wanted.extend(descendants(&roots).into_iter().filter_map(alive));
    let mut seen = std::collections::HashSet::new();
    wanted.retain(|(pid, _)| seen.insert(*pid));

    let wanted_pids: std::collections::HashSet<u32> = wanted.iter().map(|(p, _)| *p).collect();
    let gone: Vec<u32> = held
        .iter()
        .map(|(pid, _)| *pid)
        .filter(|pid| !wanted_pids.contains(pid))
        .collect();
    for pid in &gone {
        map.remove(pid).map_err(io::Error::other)?;
    }
    let mut unrecorded = 0;
    for (pid, ticks) in &wanted {
        if !held.contains(&(*pid, *ticks)) && map.insert(pid, ticks, 0).is_err() {
            unrecorded += 1;
        }
    }
    if !gone.is_empty() || wanted.len() != held.len() {
        info!(
            "ztunnel's processes: {} (ZDS peers {connected:?} and their children); {} gone",
            wanted.len() - unrecorded,
            gone.len()
        );
    }
    if unrecorded > 0 {
        warn!(
            "{unrecorded} of ztunnel's processes did not fit {} ({} entries): their marked \
             sockets are captured",
            maps::ZTUNNEL_PROCS,
            maps::ZTUNNEL_PROCS_MAX
        );
    }
    Ok(())
}

/// The ZDS server's recorder ([`crate::zds::ZdsHandle::record_peers_with`])
/// writing the map under `pins`, and a task that prunes processes that died
/// without a ZDS event every [`PRUNE_INTERVAL`].
pub fn recorder(pins: PinLayout) -> (crate::zds::PeerRecorder, impl Future<Output = ()>) {
    let write = {
        let pins = pins.clone();
        move |connected: &[u32]| {
            if let Err(e) = update(&pins, connected) {
                warn!(
                    "recording ztunnel's processes in {}: {e}",
                    maps::ZTUNNEL_PROCS
                );
            }
        }
    };
    let recorder: crate::zds::PeerRecorder = std::sync::Arc::new(write);
    let prune = async move {
        let mut every = tokio::time::interval(PRUNE_INTERVAL);
        loop {
            every.tick().await;
            if let Err(e) = update(&pins, &[]) {
                warn!(
                    "pruning ztunnel's processes in {}: {e}",
                    maps::ZTUNNEL_PROCS
                );
            }
        }
    };
    (recorder, prune)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_a_descendant() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let found = descendants(&[std::process::id()]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(found.contains(&child.id()), "{found:?}");
    }

    #[test]
    fn start_ticks_reads_this_process_and_not_a_gone_one() {
        let mine = start_ticks(std::process::id()).unwrap();
        assert!(mine > 0);
        assert_eq!(start_ticks(std::process::id()), Some(mine));
        assert_eq!(start_ticks(u32::MAX), None);
    }
}
