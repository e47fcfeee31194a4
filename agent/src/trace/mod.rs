//! `ambpf trace`: the redirect decisions of the kernel programs, live.
//!
//! The programs write one [`TraceRecord`] per decision into the pinned ring
//! buffer [`maps::TRACE_RING`] while a reader holds the gate's lease
//! ([`gate`]); this reader prints each one (filtered) as a line or as JSON,
//! and the records the ring buffer had no room for (a reader that fell
//! behind: the programs never wait for it) as a lost count.

pub mod event;
pub mod gate;

use std::collections::HashMap;

use ambpf_common::{TraceRecord, maps};
use anyhow::{Context as _, Result};
use aya::maps::{Map, MapData, PerCpuArray, RingBuf};
use clap::Args;

use crate::bpf::PinLayout;
use event::{Filter, TraceEvent};

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Only this pod's decisions: `namespace/name` or a netns cookie
    /// (repeatable).
    #[arg(long = "pod", value_name = "POD")]
    pub pods: Vec<String>,
    /// Only `outbound` or `inbound` decisions.
    #[arg(long, value_parser = event::parse_direction)]
    pub direction: Option<ambpf_common::TraceDirection>,
    /// Only these verdicts (repeatable): captured, dns_captured,
    /// exempt_loopback, exempt_own_address, exempt_ztunnel, exempt_not_tcp,
    /// exempt_dns_off, inbound_steered, probe_bypassed, hbone, no_listener,
    /// orig_dst_missing.
    #[arg(long = "verdict", value_name = "VERDICT", value_parser = event::parse_verdict)]
    pub verdicts: Vec<ambpf_common::Verdict>,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("no ambpf state at {0}: no agent has run with this --pin-root (or it was uninstalled)")]
    NoState(std::path::PathBuf),
    #[error(
        "{0} holds no trace ring buffer: the agent that pinned this state predates `ambpf \
         trace`; upgrade it (the new agent pins the ring buffer when it starts)"
    )]
    AgentTooOld(std::path::PathBuf),
}

/// Pods' `namespace/name` by netns cookie, for the `pod` column, from the
/// record the agent pins at enrolment (`maps/ambpf_pod_names`); a pod not
/// (yet) recorded there is shown by its netns cookie.
fn pod_names(pins: &PinLayout) -> HashMap<u64, String> {
    match crate::bpf::pod_names::read_all(pins) {
        Ok(names) => names
            .into_iter()
            .map(|(cookie, pod)| (cookie, format!("{}/{}", pod.namespace, pod.name)))
            .collect(),
        Err(e) => {
            tracing::warn!("pods' names unreadable, showing netns cookies: {e}");
            HashMap::new()
        }
    }
}

pub fn run(pins: &PinLayout, args: TraceArgs) -> Result<()> {
    let filter = Filter {
        pods: args.pods,
        direction: args.direction,
        verdicts: args.verdicts,
    };
    let ring_path = pins.map(maps::TRACE_RING);
    if !ring_path.exists() {
        return Err(if pins.maps_dir().exists() {
            TraceError::AgentTooOld(pins.root().to_owned()).into()
        } else {
            TraceError::NoState(pins.root().to_owned()).into()
        });
    }
    let ring = MapData::from_pin(&ring_path)
        .and_then(|data| RingBuf::try_from(Map::RingBuf(data)))
        .with_context(|| format!("opening the trace ring buffer {}", ring_path.display()))?;
    let lease = gate::Lease::acquire(pins)?
        .ok_or_else(|| TraceError::AgentTooOld(pins.root().to_owned()))?;
    let names = pod_names(pins);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(read_records(
            ring,
            lease,
            LostCounter::open(pins),
            filter,
            args.json,
            names,
        ))
}

/// The programs' count of records the ring buffer had no room for.
struct LostCounter(Option<PerCpuArray<MapData, u64>>);

impl LostCounter {
    fn open(pins: &PinLayout) -> Self {
        let map = MapData::from_pin(pins.map(maps::TRACE_LOST))
            .ok()
            .and_then(|data| PerCpuArray::try_from(Map::PerCpuArray(data)).ok());
        Self(map)
    }

    fn total(&self) -> u64 {
        self.0
            .as_ref()
            .and_then(|map| map.get(&0, 0).ok())
            .map_or(0, |per_cpu| per_cpu.iter().sum())
    }
}

/// Wall-clock minus monotonic time, to date records.
fn boot_offset_ns() -> u64 {
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    wall.saturating_sub(gate::monotonic_ns())
}

async fn read_records(
    ring: RingBuf<MapData>,
    mut lease: gate::Lease,
    lost: LostCounter,
    filter: Filter,
    json: bool,
    names: HashMap<u64, String>,
) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // SAFETY: the RingBuf owns its map fd and keeps it open while the
    // AsyncFd holds it; reading never closes or replaces it.
    let mut ring = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE)
    }?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut renew = tokio::time::interval(gate::RENEW_EVERY);
    let offset = boot_offset_ns();
    let mut lost_before = lost.total();
    let mut out = std::io::LineWriter::new(std::io::stdout().lock());
    eprintln!("ambpf trace: reading redirect decisions (Ctrl-C to stop)");
    // A closed stdout (the pipe's reader left) ends the trace quietly; the
    // lease goes with it.
    let result: std::io::Result<()> = async {
        loop {
            tokio::select! {
                _ = interrupt.recv() => return Ok(()),
                _ = terminate.recv() => return Ok(()),
                _ = renew.tick() => {
                    lease.renew().map_err(std::io::Error::other)?;
                    let total = lost.total();
                    if total > lost_before {
                        print_lost(&mut out, total - lost_before, json)?;
                        lost_before = total;
                    }
                }
                ready = ring.readable_mut() => {
                    let mut guard = ready?;
                    while let Some(item) = guard.get_inner_mut().next() {
                        print_record(&mut out, &item, offset, &names, &filter, json)?;
                    }
                    guard.clear_ready();
                }
            }
        }
    }
    .await;
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("ambpf trace"),
    }
}

fn print_record(
    out: &mut impl std::io::Write,
    bytes: &[u8],
    offset: u64,
    names: &HashMap<u64, String>,
    filter: &Filter,
    json: bool,
) -> std::io::Result<()> {
    if bytes.len() < size_of::<TraceRecord>() {
        return writeln!(
            out,
            "ambpf trace: a record of {} bytes, too short",
            bytes.len()
        );
    }
    // SAFETY: TraceRecord is plain integers; the ring buffer's bytes may be
    // unaligned, hence read_unaligned.
    let record: TraceRecord = unsafe { bytes.as_ptr().cast::<TraceRecord>().read_unaligned() };
    let event = match TraceEvent::decode(&record, offset, names) {
        Ok(event) => event,
        Err(e) => {
            eprintln!("ambpf trace: {e}");
            return Ok(());
        }
    };
    if !filter.matches(&event) {
        return Ok(());
    }
    if json {
        let line = serde_json::to_string(&event).map_err(std::io::Error::other)?;
        writeln!(out, "{line}")
    } else {
        writeln!(out, "{}", event.line())
    }
}

fn print_lost(out: &mut impl std::io::Write, lost: u64, json: bool) -> std::io::Result<()> {
    if json {
        writeln!(out, "{}", serde_json::json!({ "lost_records": lost }))
    } else {
        writeln!(
            out,
            "-- {lost} records lost: the ring buffer was full (this reader fell behind)"
        )
    }
}
