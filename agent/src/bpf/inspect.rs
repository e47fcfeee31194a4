//! Reading what ambpf has in the kernel back from the pins alone, so it works
//! from any process, while an agent runs or after it died.

use std::{fmt, fs, io, path::PathBuf};

use ambpf_common::{Counter, Direction, IfaceStats, IfaceStatsKey, IpKey, PodConfig, maps};
use aya::{
    maps::{HashMap, Map, MapData, PerCpuArray, PerCpuHashMap},
    programs::{
        ProgramInfo,
        links::{FdLink, PinnedLink},
        loaded_programs,
    },
};
use serde::Serialize;

use super::PinLayout;

#[derive(Debug, Serialize)]
pub struct Status {
    pub pin_root: PathBuf,
    pub maps: Vec<PinnedMap>,
    pub tc_links: Vec<PinnedTcLink>,
    pub iface_stats: Vec<IfaceStatsEntry>,
    pub pods: Vec<EnrolledPodEntry>,
    /// Every other pinned link (socket programs on cgroups, pods' inbound
    /// steering), with the program it runs.
    pub links: Vec<PinnedLinkEntry>,
    /// Redirection events counted in the kernel, summed over CPUs.
    pub counters: Vec<(&'static str, u64)>,
}

#[derive(Debug, Serialize)]
pub struct EnrolledPodEntry {
    pub netns_cookie: u64,
    pub netns_inode: u64,
    pub addresses: Vec<std::net::IpAddr>,
    pub dns_capture: bool,
    /// ambpf created the `clsact` qdisc its steering filter sits on.
    #[serde(skip)]
    pub steering_qdisc_created: bool,
    /// ambpf's steering filter on each interface of the pod, read inside
    /// its namespace (`None`: the namespace is gone or was not looked at).
    pub steering: Option<Vec<SteeringFilterEntry>>,
    /// What the programs did for the pod, summed over CPUs (`None`: no
    /// counters, as with pods an agent older than per-pod counters enrolled).
    pub counters: Option<super::pod_counters::PodCounts>,
}

#[derive(Debug, Serialize)]
pub struct SteeringFilterEntry {
    pub iface: String,
    pub ifindex: u32,
    /// The program the filter runs (`None`: no ambpf filter there).
    pub program_id: Option<u32>,
    pub program_name: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct PinnedLinkEntry {
    pub pin: PathBuf,
    pub link_id: u32,
    pub program_id: u32,
    pub program_name: String,
}

#[derive(Debug, Serialize)]
pub struct PinnedMap {
    pub name: String,
    pub id: u32,
    pub max_entries: u32,
    /// Entries in use, for the hash maps that hold per-pod or per-connection
    /// state (what must not leak).
    pub entries: Option<u64>,
    pub pin: PathBuf,
}

#[derive(Debug, Serialize)]
pub struct PinnedTcLink {
    pub pin: PathBuf,
    pub netns_inode: u64,
    pub ifindex: u32,
    pub direction: &'static str,
    pub link_id: u32,
    pub program_id: u32,
    pub program_name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IfaceStatsEntry {
    pub ifindex: u32,
    pub direction: &'static str,
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("opening pinned map {path}: {source}")]
    Map {
        path: PathBuf,
        source: aya::maps::MapError,
    },
    #[error("opening pinned link {path}: {source}")]
    Link {
        path: PathBuf,
        source: aya::programs::links::LinkError,
    },
}

/// Everything under the pin root. Missing pins are simply absent (an agent
/// that never ran has nothing to show); unreadable ones are errors.
pub fn read_status(pins: &PinLayout) -> Result<Status, InspectError> {
    let mut maps_out = Vec::new();
    for name in maps::PINNED {
        let path = pins.map(name);
        if !path.exists() {
            continue;
        }
        let data = open_map(&path)?;
        let info = data.info().map_err(|source| InspectError::Map {
            path: path.clone(),
            source,
        })?;
        maps_out.push(PinnedMap {
            name: info.name_as_str().unwrap_or(name).to_owned(),
            id: info.id(),
            max_entries: info.max_entries(),
            entries: count_entries(name, data),
            pin: path,
        });
    }
    Ok(Status {
        pin_root: pins.root().to_owned(),
        maps: maps_out,
        tc_links: read_tc_links(pins)?,
        iface_stats: read_iface_stats(pins)?,
        pods: with_counters(with_steering(read_pods(pins)?), pins)?,
        links: read_other_links(pins)?,
        counters: read_counters(pins)?,
    })
}

/// Entries of the maps holding per-pod and per-connection state.
fn count_entries(name: &str, data: MapData) -> Option<u64> {
    fn keys<K: aya::Pod, V: aya::Pod>(data: MapData) -> Option<u64> {
        let map: HashMap<_, K, V> = HashMap::try_from(Map::HashMap(data)).ok()?;
        Some(map.keys().filter(Result::is_ok).count() as u64)
    }
    use ambpf_common::{SockAddr, TupleKey};
    match name {
        maps::PODS_BY_NETNS => keys::<u64, PodConfig>(data),
        maps::PODS_BY_IP => keys::<IpKey, PodConfig>(data),
        maps::HOST_ADDRS => keys::<IpKey, u8>(data),
        maps::ORIG_BY_COOKIE => keys::<u64, SockAddr>(data),
        maps::ORIG_BY_TUPLE => keys::<TupleKey, SockAddr>(data),
        _ => None,
    }
}

/// The enrolled pods, as the socket programs see them.
pub fn read_pods(pins: &PinLayout) -> Result<Vec<EnrolledPodEntry>, InspectError> {
    let path = pins.map(maps::PODS_BY_NETNS);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let map_err = |source| InspectError::Map {
        path: path.clone(),
        source,
    };
    let map: HashMap<_, u64, PodConfig> =
        HashMap::try_from(Map::HashMap(open_map(&path)?)).map_err(map_err)?;
    let mut pods = Vec::new();
    for entry in map.iter() {
        let (cookie, pod) = entry.map_err(map_err)?;
        let addresses = pod
            .ips
            .iter()
            .filter(|ip| **ip != IpKey::default())
            .map(|ip| {
                let v6 = std::net::Ipv6Addr::from(ip.addr);
                v6.to_ipv4_mapped()
                    .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4)
            })
            .collect();
        pods.push(EnrolledPodEntry {
            netns_cookie: cookie,
            netns_inode: pod.netns_inode,
            addresses,
            dns_capture: pod.flags & ambpf_common::pod_flags::DNS_CAPTURE != 0,
            steering_qdisc_created: pod.flags & ambpf_common::pod_flags::STEERING_QDISC_CREATED
                != 0,
            steering: None,
            counters: None,
        });
    }
    pods.sort_by_key(|p| p.netns_inode);
    Ok(pods)
}

/// Adds each pod's counters.
fn with_counters(
    mut pods: Vec<EnrolledPodEntry>,
    pins: &PinLayout,
) -> Result<Vec<EnrolledPodEntry>, InspectError> {
    let mut counters = super::pod_counters::read(pins)?;
    for pod in &mut pods {
        pod.counters = counters.remove(&pod.netns_cookie);
    }
    Ok(pods)
}

/// Reads each pod's steering filters inside its namespace (found by inode,
/// confirmed by cookie).
fn with_steering(mut pods: Vec<EnrolledPodEntry>) -> Vec<EnrolledPodEntry> {
    use crate::redirect::{podnet, rtnl::Rtnl, steering};
    let configs: Vec<PodConfig> = pods
        .iter()
        .map(|p| PodConfig {
            netns_cookie: p.netns_cookie,
            netns_inode: p.netns_inode,
            ..Default::default()
        })
        .collect();
    let mut located = crate::redirect::check::locate_pods(&configs, &[]);
    for pod in &mut pods {
        let Some(netns) = located.remove(&pod.netns_cookie).flatten() else {
            continue;
        };
        pod.steering = netns
            .run(|| -> Option<Vec<SteeringFilterEntry>> {
                let mut rtnl = Rtnl::open().ok()?;
                let interfaces = podnet::interfaces(&mut rtnl).ok()?;
                interfaces
                    .into_iter()
                    .map(|iface| {
                        let filter = steering::find(&mut rtnl, iface.index).ok()?;
                        Some(SteeringFilterEntry {
                            iface: iface.name,
                            ifindex: iface.index,
                            program_id: filter.as_ref().and_then(|f| f.prog_id),
                            program_name: filter.map(|f| f.name),
                        })
                    })
                    .collect()
            })
            .ok()
            .flatten();
    }
    pods
}

/// The kernel's redirection counters, summed over CPUs.
pub fn read_counters(pins: &PinLayout) -> Result<Vec<(&'static str, u64)>, InspectError> {
    let path = pins.map(maps::COUNTERS);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let map_err = |source| InspectError::Map {
        path: path.clone(),
        source,
    };
    let array: PerCpuArray<_, u64> =
        PerCpuArray::try_from(Map::PerCpuArray(open_map(&path)?)).map_err(map_err)?;
    Counter::ALL
        .iter()
        .map(|counter| {
            let per_cpu = array.get(&(*counter as u32), 0).map_err(map_err)?;
            Ok((counter.name(), per_cpu.iter().sum()))
        })
        .collect()
}

/// Links pinned outside `links/tc` (cgroup socket programs, pods' steering).
fn read_other_links(pins: &PinLayout) -> Result<Vec<PinnedLinkEntry>, InspectError> {
    let programs: Vec<ProgramInfo> = loaded_programs().filter_map(Result::ok).collect();
    let mut out = Vec::new();
    for kind in ["links/cgroup", "links/pods"] {
        for dir in read_dir_sorted(&pins.root().join(kind))? {
            for pin in read_dir_sorted(&dir)? {
                let (link_id, program_id, program_name) = pinned_link(&pin, &programs)?;
                out.push(PinnedLinkEntry {
                    pin,
                    link_id,
                    program_id,
                    program_name,
                });
            }
        }
    }
    Ok(out)
}

fn open_map(path: &std::path::Path) -> Result<MapData, InspectError> {
    MapData::from_pin(path).map_err(|source| InspectError::Map {
        path: path.to_owned(),
        source,
    })
}

/// Every pinned TC link, with the program it runs.
pub fn read_tc_links(pins: &PinLayout) -> Result<Vec<PinnedTcLink>, InspectError> {
    let programs: Vec<ProgramInfo> = loaded_programs().filter_map(Result::ok).collect();
    let mut out = Vec::new();
    for netns_dir in read_dir_sorted(&pins.tc_links_dir())? {
        let Some(netns_inode) = file_name(&netns_dir).and_then(|n| n.parse().ok()) else {
            continue;
        };
        for pin in read_dir_sorted(&netns_dir)? {
            let Some((ifindex, direction)) =
                file_name(&pin).and_then(super::pins::parse_tc_link_name)
            else {
                continue;
            };
            let (link_id, program_id, program_name) = pinned_link(&pin, &programs)?;
            out.push(PinnedTcLink {
                pin,
                netns_inode,
                ifindex,
                direction: direction.as_str(),
                link_id,
                program_id,
                program_name,
            });
        }
    }
    Ok(out)
}

/// The interface counters, summed over CPUs, in a stable order.
pub fn read_iface_stats(pins: &PinLayout) -> Result<Vec<IfaceStatsEntry>, InspectError> {
    let path = pins.map(maps::IFACE_STATS);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let map = Map::PerCpuHashMap(open_map(&path)?);
    let map: PerCpuHashMap<_, IfaceStatsKey, IfaceStats> =
        PerCpuHashMap::try_from(map).map_err(|source| InspectError::Map {
            path: path.clone(),
            source,
        })?;
    let mut out = Vec::new();
    for entry in map.iter() {
        let (key, per_cpu) = entry.map_err(|source| InspectError::Map {
            path: path.clone(),
            source,
        })?;
        let mut total = IfaceStats::default();
        per_cpu.iter().for_each(|cpu| total.accumulate(cpu));
        out.push(IfaceStatsEntry {
            ifindex: key.ifindex,
            direction: if key.direction == Direction::Ingress as u32 {
                Direction::Ingress.as_str()
            } else {
                Direction::Egress.as_str()
            },
            packets: total.packets,
            bytes: total.bytes,
        });
    }
    out.sort_by_key(|e| (e.ifindex, e.direction));
    Ok(out)
}

fn read_dir_sorted(dir: &std::path::Path) -> Result<Vec<PathBuf>, InspectError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(InspectError::Io {
                path: dir.to_owned(),
                source,
            });
        }
    };
    let mut paths = entries
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| InspectError::Io {
            path: dir.to_owned(),
            source,
        })?;
    paths.sort();
    Ok(paths)
}

/// The link pinned at `pin`: its id, its program's id and name.
fn pinned_link(
    pin: &std::path::Path,
    programs: &[ProgramInfo],
) -> Result<(u32, u32, String), InspectError> {
    let link_err = |source| InspectError::Link {
        path: pin.to_owned(),
        source,
    };
    let info = FdLink::from(PinnedLink::from_pin(pin).map_err(link_err)?)
        .info()
        .map_err(link_err)?;
    let name = programs
        .iter()
        .find(|p| p.id() == info.program_id())
        .and_then(|p| p.name_as_str())
        .unwrap_or("?")
        .to_owned();
    Ok((info.id(), info.program_id(), name))
}

fn file_name(path: &std::path::Path) -> Option<&str> {
    path.file_name()?.to_str()
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "pin root: {}", self.pin_root.display())?;
        writeln!(f, "maps:")?;
        if self.maps.is_empty() {
            writeln!(f, "  (none pinned)")?;
        }
        for m in &self.maps {
            writeln!(
                f,
                "  {:<16} id {:<6} max_entries {:<6} {}",
                m.name,
                m.id,
                m.max_entries,
                m.pin.display()
            )?;
        }
        writeln!(f, "tc links (TCX):")?;
        if self.tc_links.is_empty() {
            writeln!(f, "  (none pinned)")?;
        }
        for l in &self.tc_links {
            writeln!(
                f,
                "  netns {:<11} ifindex {:<4} {:<8} link {:<5} prog {:<5} {}",
                l.netns_inode, l.ifindex, l.direction, l.link_id, l.program_id, l.program_name
            )?;
        }
        writeln!(f, "enrolled pods:")?;
        if self.pods.is_empty() {
            writeln!(f, "  (none)")?;
        }
        for p in &self.pods {
            let addrs: Vec<String> = p.addresses.iter().map(|a| a.to_string()).collect();
            writeln!(
                f,
                "  netns {:<11} cookie {:<8} dns {:<5} {}",
                p.netns_inode,
                p.netns_cookie,
                p.dns_capture,
                addrs.join(" ")
            )?;
            if let Some(counters) = &p.counters {
                let counts: Vec<String> = counters
                    .named()
                    .iter()
                    .map(|(name, value)| format!("{name} {value}"))
                    .collect();
                writeln!(f, "    counters: {}", counts.join(", "))?;
            }
            match &p.steering {
                None => writeln!(f, "    steering: (namespace not found)")?,
                Some(filters) => {
                    for s in filters {
                        match s.program_id {
                            Some(id) => writeln!(
                                f,
                                "    steering: {} (ifindex {}) tc ingress filter, prog {id} {}",
                                s.iface,
                                s.ifindex,
                                s.program_name.as_deref().unwrap_or("?")
                            )?,
                            None => writeln!(
                                f,
                                "    steering: {} (ifindex {}) NONE",
                                s.iface, s.ifindex
                            )?,
                        }
                    }
                }
            }
        }
        writeln!(f, "links:")?;
        for l in &self.links {
            let pin = l.pin.strip_prefix(&self.pin_root).unwrap_or(&l.pin);
            writeln!(
                f,
                "  {:<48} link {:<5} prog {:<5} {}",
                pin.display(),
                l.link_id,
                l.program_id,
                l.program_name
            )?;
        }
        writeln!(f, "redirection counters:")?;
        for (name, value) in &self.counters {
            writeln!(f, "  {name:<24} {value:>10}")?;
        }
        writeln!(f, "interface counters:")?;
        if self.iface_stats.is_empty() {
            writeln!(f, "  (no packets seen)")?;
        }
        for s in &self.iface_stats {
            writeln!(
                f,
                "  ifindex {:<4} {:<8} {:>10} packets {:>12} bytes",
                s.ifindex, s.direction, s.packets, s.bytes
            )?;
        }
        Ok(())
    }
}
