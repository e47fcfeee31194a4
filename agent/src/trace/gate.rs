//! The trace gate ([`maps::TRACE_GATE`]): the programs write records only
//! while a reader's lease on it runs. The reader renews the lease every
//! [`RENEW_EVERY`] and clears it when it stops; a reader that dies without
//! clearing it (SIGKILL, a crash) stops emission once its lease runs out,
//! after at most [`LEASE`]. A BPF ring buffer has one consumer position, so
//! one reader holds the gate at a time: a second is refused while the first
//! lives, and takes over from one that died.

use std::{path::PathBuf, time::Duration};

use ambpf_common::{TraceGate, maps};
use aya::maps::{Array, Map, MapData, MapError};

use crate::bpf::PinLayout;

/// How long a lease runs without renewal.
pub const LEASE: Duration = Duration::from_secs(3);
/// How often a reader renews its lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error(
        "another `ambpf trace` (pid {pid}) is reading the trace ring buffer; its records go to \
         one reader at a time"
    )]
    Busy { pid: u32 },
    #[error("the trace gate {path}: {cause}")]
    Map { path: PathBuf, cause: MapError },
}

/// Who holds the gate, as `reader` sees it at `now_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// No lease runs, or its reader is gone: free to take.
    Nobody,
    /// `reader` itself.
    Us,
    /// Another live reader.
    Other(u32),
}

/// Decides who holds `gate`: a lease that ran out, or whose reader is no
/// longer alive, is nobody's.
pub fn holder(gate: &TraceGate, now_ns: u64, reader: u32, alive: impl Fn(u32) -> bool) -> Holder {
    if gate.until_ns == 0 || gate.until_ns <= now_ns {
        return Holder::Nobody;
    }
    if gate.reader_pid == reader {
        return Holder::Us;
    }
    if alive(gate.reader_pid) {
        Holder::Other(gate.reader_pid)
    } else {
        Holder::Nobody
    }
}

/// `bpf_ktime_get_ns()`'s clock.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// This process's lease on the gate, cleared on drop.
pub struct Lease {
    gate: Array<MapData, TraceGate>,
    path: PathBuf,
    pid: u32,
}

impl Lease {
    /// Opens the pinned gate (`Ok(None)`: not pinned) and takes the lease,
    /// unless another live reader holds it.
    pub fn acquire(pins: &PinLayout) -> Result<Option<Self>, GateError> {
        let path = pins.map(maps::TRACE_GATE);
        if !path.exists() {
            return Ok(None);
        }
        let map_err = |source| GateError::Map {
            path: path.clone(),
            cause: source,
        };
        let data = MapData::from_pin(&path).map_err(map_err)?;
        let gate = Array::try_from(Map::Array(data)).map_err(map_err)?;
        let mut lease = Self {
            gate,
            path,
            pid: std::process::id(),
        };
        let current = lease.read()?;
        match holder(&current, monotonic_ns(), lease.pid, process_alive) {
            Holder::Other(pid) => Err(GateError::Busy { pid }),
            Holder::Nobody | Holder::Us => {
                lease.write(monotonic_ns() + LEASE.as_nanos() as u64)?;
                Ok(Some(lease))
            }
        }
    }

    fn read(&self) -> Result<TraceGate, GateError> {
        self.gate.get(&0, 0).map_err(|source| GateError::Map {
            path: self.path.clone(),
            cause: source,
        })
    }

    fn write(&mut self, until_ns: u64) -> Result<(), GateError> {
        let gate = TraceGate {
            until_ns,
            reader_pid: if until_ns == 0 { 0 } else { self.pid },
            _pad: 0,
        };
        self.gate.set(0, gate, 0).map_err(|source| GateError::Map {
            path: self.path.clone(),
            cause: source,
        })
    }

    /// Extends the lease; fails if another reader took the gate meanwhile
    /// (two readers started at the same moment: the later write won).
    pub fn renew(&mut self) -> Result<(), GateError> {
        let current = self.read()?;
        if let Holder::Other(pid) = holder(&current, monotonic_ns(), self.pid, process_alive) {
            return Err(GateError::Busy { pid });
        }
        self.write(monotonic_ns() + LEASE.as_nanos() as u64)
    }
}

impl Drop for Lease {
    /// Closes the gate at once, if the lease is still this reader's.
    fn drop(&mut self) {
        if let Ok(current) = self.read()
            && current.reader_pid == self.pid
        {
            let _ = self.write(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;

    fn gate(until_ns: u64, reader_pid: u32) -> TraceGate {
        TraceGate {
            until_ns,
            reader_pid,
            _pad: 0,
        }
    }

    #[test]
    fn a_closed_or_expired_gate_is_free() {
        assert_eq!(holder(&gate(0, 0), NOW, 7, |_| true), Holder::Nobody);
        assert_eq!(holder(&gate(NOW, 9), NOW, 7, |_| true), Holder::Nobody);
        assert_eq!(holder(&gate(NOW - 1, 9), NOW, 7, |_| true), Holder::Nobody);
    }

    #[test]
    fn a_running_lease_belongs_to_its_live_reader() {
        assert_eq!(holder(&gate(NOW + 1, 7), NOW, 7, |_| false), Holder::Us);
        assert_eq!(
            holder(&gate(NOW + 1, 9), NOW, 7, |_| true),
            Holder::Other(9)
        );
    }

    #[test]
    fn a_dead_readers_lease_is_free_before_it_runs_out() {
        assert_eq!(
            holder(&gate(NOW + 1, 9), NOW, 7, |pid| pid != 9),
            Holder::Nobody
        );
    }
}
