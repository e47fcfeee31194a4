//! Reading what ambpf has in the kernel back from the pins alone, so it works
//! from any process, while an agent runs or after it died.

use std::{fs, io, path::PathBuf};

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
    pub build: PinnedBuild,
    /// How steered SYNs reach ztunnel's listener ([`super::inbound`]).
    pub inbound: super::InboundPath,
    pub pods: Vec<EnrolledPodEntry>,
    pub maps: Vec<PinnedMap>,
    /// The interface counters' TCX links (`--attach`, `ambpf attach`).
    pub tc_links: Vec<PinnedTcLink>,
    /// Every other pinned link (socket programs on cgroups; pods' sk_lookup
    /// links), with the program it runs.
    pub links: Vec<PinnedLinkEntry>,
    /// Redirection events counted in the kernel, summed over CPUs, by name.
    #[serde(serialize_with = "as_object")]
    pub counters: Vec<(&'static str, u64)>,
    pub iface_stats: Vec<IfaceStatsEntry>,
    /// Open redirected connections of namespaces that are no enrolled
    /// pod's (a pod removed while its connections live on).
    pub redirected_without_pod: Vec<UnenrolledRedirected>,
}

/// An open redirected connection of a namespace no enrolled pod has.
#[derive(Debug, Serialize)]
pub struct UnenrolledRedirected {
    pub netns_cookie: u64,
    #[serde(flatten)]
    pub connection: super::redirected::RedirectedConnection,
}

/// Which build's programs are pinned, against this binary's.
#[derive(Debug, Serialize)]
pub struct PinnedBuild {
    /// The BPF object digest the loading agent recorded (`None`: an agent
    /// older than the record).
    pub pinned_object_sha256: Option<String>,
    /// This binary.
    pub this_binary: crate::build_info::BuildInfo,
    /// Set when the pinned programs are not this binary's.
    pub warning: Option<String>,
}

fn as_object<S: serde::Serializer>(pairs: &[(&'static str, u64)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap as _;
    let mut map = s.serialize_map(Some(pairs.len()))?;
    for (name, value) in pairs {
        map.serialize_entry(name, value)?;
    }
    map.end()
}

#[derive(Debug, Serialize)]
pub struct EnrolledPodEntry {
    /// Namespace, name and UID, as the agent recorded them at enrolment
    /// (`None`: enrolled by an agent older than the record).
    pub pod: Option<super::pod_names::PodIdentity>,
    pub netns_cookie: u64,
    pub netns_inode: u64,
    pub addresses: Vec<std::net::IpAddr>,
    pub dns_capture: bool,
    /// An earlier agent created the `clsact` qdisc its steering filter sat
    /// on (uninstall removes both).
    #[serde(skip)]
    pub steering_qdisc_created: bool,
    /// The pod's inbound capture: its pinned sk_lookup link (`None`: none
    /// is pinned, and inbound connections to the pod are not captured).
    pub inbound_link: Option<InboundLinkEntry>,
    /// What the programs did for the pod, summed over CPUs (`None`: no
    /// counters, as with pods an agent older than per-pod counters enrolled).
    pub counters: Option<super::pod_counters::PodCounts>,
    /// The pod's open outbound connections redirected to ztunnel, as the
    /// app and ztunnel see them ([`super::redirected`]).
    pub redirected: Vec<super::redirected::RedirectedConnection>,
}

#[derive(Debug, Serialize)]
pub struct InboundLinkEntry {
    /// The program the link runs.
    pub program_id: u32,
    /// Whether it is attached to the pod's own namespace (by the inode's
    /// low 32 bits, which the kernel reports); `false` once that namespace
    /// is gone.
    pub in_pod_netns: bool,
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
    /// Entries in use (an array's are all its slots).
    pub entries: u64,
    pub pin: PathBuf,
    /// A hash or LRU map, whose entries come and go (not an array, whose
    /// slots are all in use, nor a ring buffer, sized in bytes).
    #[serde(skip)]
    pub fills: bool,
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
    #[error(
        "pin root {path} does not exist: ambpf is not installed there (is --pin-root the \
         agent's? the chart's default is {default})",
        default = super::DEFAULT_PIN_ROOT
    )]
    NoPinRoot { path: PathBuf },
    #[error(transparent)]
    NotBpffs(super::pins::PinError),
    #[error(
        "pin root {path} is on bpffs but holds no ambpf state (no pinned maps or links): no \
         agent has run with this pin root, or `ambpf uninstall` removed it"
    )]
    NoState { path: PathBuf },
    #[error("reading {path}: {cause}")]
    Io { path: PathBuf, cause: io::Error },
    #[error("opening pinned map {path}: {cause}")]
    Map {
        path: PathBuf,
        cause: aya::maps::MapError,
    },
    #[error("opening pinned link {path}: {cause}")]
    Link {
        path: PathBuf,
        cause: aya::programs::links::LinkError,
    },
}

/// Checks that the pin root exists, is on bpffs, and holds ambpf's state,
/// saying which of these it is not.
pub fn check_pin_root(pins: &PinLayout) -> Result<(), InspectError> {
    let root = pins.root();
    if !root.exists() {
        return Err(InspectError::NoPinRoot {
            path: root.to_owned(),
        });
    }
    super::pins::check_bpffs(root).map_err(InspectError::NotBpffs)?;
    let has_state = maps::PINNED.iter().any(|name| pins.map(name).exists())
        || ["links/cgroup", "links/tc", "links/pods"]
            .iter()
            .any(|dir| read_dir_sorted(&root.join(dir)).is_ok_and(|found| !found.is_empty()));
    if !has_state {
        return Err(InspectError::NoState {
            path: root.to_owned(),
        });
    }
    Ok(())
}

/// Everything under the pin root, which must hold ambpf's state
/// ([`check_pin_root`]). Missing pins are simply absent; unreadable ones
/// are errors.
pub fn read_status(pins: &PinLayout) -> Result<Status, InspectError> {
    check_pin_root(pins)?;
    let maps_out = read_maps(pins)?;
    let recorded = crate::build_info::recorded(pins).map_err(|source| InspectError::Io {
        path: pins.root().join("object"),
        cause: source,
    })?;
    let mut pods = with_counters(with_inbound_links(read_pods(pins)?, pins), pins)?;
    let mut names = super::pod_names::read_all(pins)?;
    let mut redirected = super::redirected::read(pins)?;
    for pod in &mut pods {
        pod.pod = names.remove(&pod.netns_cookie);
        pod.redirected = redirected.remove(&pod.netns_cookie).unwrap_or_default();
    }
    let redirected_without_pod = redirected
        .into_iter()
        .flat_map(|(netns_cookie, connections)| {
            connections
                .into_iter()
                .map(move |connection| UnenrolledRedirected {
                    netns_cookie,
                    connection,
                })
        })
        .collect();
    Ok(Status {
        pin_root: pins.root().to_owned(),
        build: PinnedBuild {
            warning: crate::build_info::mismatch_warning(recorded.as_deref()),
            pinned_object_sha256: recorded,
            this_binary: crate::build_info::current().clone(),
        },
        inbound: super::inbound::pinned_path(pins),
        pods,
        maps: maps_out,
        tc_links: read_tc_links(pins)?,
        links: read_other_links(pins)?,
        counters: read_counters(pins)?,
        iface_stats: read_iface_stats(pins)?,
        redirected_without_pod,
    })
}

/// Entries in use: the keys of a hash map (whatever their type: the walk
/// only needs the key size), all slots of an array.
fn count_entries(info: &aya::maps::MapInfo, data: MapData) -> u64 {
    use aya::maps::MapType;
    match info.map_type() {
        Ok(MapType::Array | MapType::PerCpuArray) => u64::from(info.max_entries()),
        _ => count_keys(&data, info.key_size() as usize),
    }
}

/// Every pinned map with its entries and capacity (`ambpf status` and
/// `/metrics`' map fill).
pub fn read_maps(pins: &PinLayout) -> Result<Vec<PinnedMap>, InspectError> {
    let mut maps_out = Vec::new();
    for name in maps::PINNED.iter().chain([&super::pod_names::MAP_NAME]) {
        let path = pins.map(name);
        if !path.exists() {
            continue;
        }
        let data = open_map(&path)?;
        let info = data.info().map_err(|source| InspectError::Map {
            path: path.clone(),
            cause: source,
        })?;
        maps_out.push(PinnedMap {
            name: info.name_as_str().unwrap_or(name).to_owned(),
            id: info.id(),
            max_entries: info.max_entries(),
            fills: fills(&info),
            entries: count_entries(&info, data),
            pin: path,
        });
    }
    Ok(maps_out)
}

fn fills(info: &aya::maps::MapInfo) -> bool {
    use aya::maps::MapType;
    matches!(
        info.map_type(),
        Ok(MapType::Hash | MapType::LruHash | MapType::PerCpuHash | MapType::LruPerCpuHash)
    )
}

/// BPF_MAP_GET_NEXT_KEY from the start until the end.
fn count_keys(data: &MapData, key_size: usize) -> u64 {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let fd = data.fd().as_fd().as_raw_fd();
    let mut key = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    let mut count = 0u64;
    let mut first = true;
    loop {
        if !super::sys::map_next_key(fd, (!first).then_some(&key[..]), &mut next) {
            return count;
        }
        count += 1;
        first = false;
        std::mem::swap(&mut key, &mut next);
    }
}

/// The enrolled pods, as the socket programs see them.
pub fn read_pods(pins: &PinLayout) -> Result<Vec<EnrolledPodEntry>, InspectError> {
    let path = pins.map(maps::PODS_BY_NETNS);
    if !path.exists() {
        return Ok(Vec::new());
    }
    let map = pod_map(&path)?;
    let map_err = |source| InspectError::Map {
        path: path.clone(),
        cause: source,
    };
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
            pod: None,
            netns_cookie: cookie,
            netns_inode: pod.netns_inode,
            addresses,
            dns_capture: pod.flags & ambpf_common::pod_flags::DNS_CAPTURE != 0,
            steering_qdisc_created: pod.flags & ambpf_common::pod_flags::STEERING_QDISC_CREATED
                != 0,
            inbound_link: None,
            counters: None,
            redirected: Vec::new(),
        });
    }
    pods.sort_by_key(|p| p.netns_inode);
    Ok(pods)
}

/// Takes the pod with `netns_cookie` out of the pinned pod map, so the
/// socket programs no longer capture in its namespace (the eBPF mode's
/// retirement, once another mode holds the pod); absent already is fine.
pub fn forget_pod(pins: &PinLayout, netns_cookie: u64) -> Result<(), InspectError> {
    let path = pins.map(maps::PODS_BY_NETNS);
    match pod_map(&path)?.remove(&netns_cookie) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(cause) => Err(InspectError::Map { path, cause }),
    }
}

/// The pinned pod map at `path`.
fn pod_map(path: &std::path::Path) -> Result<HashMap<MapData, u64, PodConfig>, InspectError> {
    HashMap::try_from(Map::HashMap(open_map(path)?)).map_err(|cause| InspectError::Map {
        path: path.to_owned(),
        cause,
    })
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

/// Reads each pod's pinned sk_lookup link.
fn with_inbound_links(mut pods: Vec<EnrolledPodEntry>, pins: &PinLayout) -> Vec<EnrolledPodEntry> {
    for pod in &mut pods {
        let pin = super::inbound::link_pin(pins, pod.netns_cookie);
        pod.inbound_link = super::inbound::link_info(&pin)
            .ok()
            .map(|(program_id, inode)| InboundLinkEntry {
                program_id,
                in_pod_netns: inode == Some(pod.netns_inode as u32),
            });
    }
    pods
}

/// The kernel's redirection counters, summed over CPUs.
pub fn read_counters(pins: &PinLayout) -> Result<Vec<(&'static str, u64)>, InspectError> {
    let slots: Vec<u32> = Counter::ALL.iter().map(|c| *c as u32).collect();
    let Some(sums) = per_cpu_sums(&pins.map(maps::COUNTERS), &slots)? else {
        return Ok(Vec::new());
    };
    let mut out: Vec<(&'static str, u64)> =
        Counter::ALL.iter().map(|c| c.name()).zip(sums).collect();
    // Inbound connections refused, by reason (absent before an agent that
    // counts them pinned the map).
    let refusals = &ambpf_common::InboundRefusal::ALL;
    let slots: Vec<u32> = refusals.iter().map(|r| *r as u32).collect();
    if let Some(sums) = per_cpu_sums(&pins.map(maps::INBOUND_REFUSED), &slots)? {
        out.extend(refusals.iter().zip(sums).map(|(why, sum)| {
            let name = match why {
                ambpf_common::InboundRefusal::UnknownAddress => "inbound_unknown_address",
            };
            (name, sum)
        }));
    }
    Ok(out)
}

/// The pinned per-CPU array at `path`, each of `slots` summed over CPUs
/// (`None` when nothing is pinned there).
pub(super) fn per_cpu_sums(
    path: &std::path::Path,
    slots: &[u32],
) -> Result<Option<Vec<u64>>, InspectError> {
    if !path.exists() {
        return Ok(None);
    }
    let map_err = |source| InspectError::Map {
        path: path.to_owned(),
        cause: source,
    };
    let array: PerCpuArray<_, u64> =
        PerCpuArray::try_from(Map::PerCpuArray(open_map(path)?)).map_err(map_err)?;
    slots
        .iter()
        .map(|slot| Ok(array.get(slot, 0).map_err(map_err)?.iter().sum()))
        .collect::<Result<_, _>>()
        .map(Some)
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
        cause: source,
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
            cause: source,
        })?;
    let mut out = Vec::new();
    for entry in map.iter() {
        let (key, per_cpu) = entry.map_err(|source| InspectError::Map {
            path: path.clone(),
            cause: source,
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
                cause: source,
            });
        }
    };
    let mut paths = entries
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| InspectError::Io {
            path: dir.to_owned(),
            cause: source,
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
        cause: source,
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
