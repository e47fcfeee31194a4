//! Other owners' programs on the hooks ambpf uses: a socket load balancer
//! (Cilium's or Calico's) in the cgroup's connect, sendmsg, recvmsg and
//! getpeername hooks, tc filters and TCX programs on the pods' interfaces.
//!
//! Order decides whether both work. Cgroup programs of one hook run in
//! turn, those of a descendant cgroup before an ancestor's: ambpf's connect
//! and sendmsg must run before a load balancer's, or it records the backend
//! the balancer chose instead of the service address, and ztunnel gets that
//! as the original destination; its getpeername and recvmsg must run after,
//! or another program may rewrite the address ambpf answers the app. The
//! pods' interfaces' programs are listed for the record: inbound capture is
//! the pod's socket lookup, which they do not stand before (only an earlier
//! agent's steering filter could be kept from SYNs by filters ahead of it).
//!
//! [`scan_cgroup`] lists the cgroup's in run order, marking ambpf's own, for
//! `ambpf status --check`; the pods' interfaces are listed by whoever finds
//! the pods and enters their namespaces, with [`iface_warnings`].
//! [`Warning`]s name each program that runs where it can break capture.

mod render;

use std::{
    collections::HashSet,
    fmt,
    fs::File,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use serde::Serialize;
use tracing::warn;

pub use render::render;

use super::{
    PinLayout,
    cgroup::{HOOKS, RAW_GUARD_HOOKS},
    sys::{self, CgroupHook},
};

/// Whose a program is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    Ambpf,
    Other,
}

/// One program on a hook.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HookProgram {
    pub id: u32,
    pub name: String,
    pub owner: Owner,
}

/// The programs of one cgroup hook.
#[derive(Clone, Debug, Serialize)]
pub struct CgroupHookPrograms {
    pub hook: &'static str,
    /// Every program that runs for sockets of ambpf's cgroup, in the order
    /// they run (its ancestors' after its own).
    pub effective: Vec<HookProgram>,
    /// Programs attached to cgroups below ambpf's: they run before ambpf's
    /// for the sockets there.
    pub below: Vec<(PathBuf, Vec<HookProgram>)>,
}

/// The programs on one hook of a pod's interface, in the order they run.
#[derive(Clone, Debug, Serialize)]
pub struct IfaceHookPrograms {
    pub netns_inode: u64,
    pub iface: String,
    pub ifindex: u32,
    /// `tcx_ingress`, `tc_ingress` (`clsact` filters), `tcx_egress`,
    /// `tc_egress`.
    pub hook: &'static str,
    pub programs: Vec<IfaceProgram>,
}

/// A program on an interface; a `clsact` filter has a priority and handle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IfaceProgram {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<u32>,
    pub name: String,
    pub owner: Owner,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handle: Option<u32>,
}

/// Another owner's program that runs where it can break capture.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Warning {
    pub hook: String,
    pub program_id: Option<u32>,
    pub program_name: String,
    pub detail: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.hook, self.detail)
    }
}

/// What [`scan`] found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Programs {
    /// ambpf's cgroup (`None` where no socket program of ambpf's is pinned,
    /// or its cgroup is gone).
    pub cgroup: Option<PathBuf>,
    pub cgroup_hooks: Vec<CgroupHookPrograms>,
    pub interfaces: Vec<IfaceHookPrograms>,
    pub warnings: Vec<Warning>,
    /// What could not be read, each naming what.
    pub unreadable: Vec<String>,
}

/// Cgroups below ambpf's looked at, at most: a node has a few per pod.
const MOST_CGROUPS_BELOW: usize = 20_000;

/// The ids of the programs in ambpf's cgroup links pinned in `links_dir`.
fn own_cgroup_programs(links_dir: &Path) -> HashSet<u32> {
    use std::os::fd::AsFd as _;
    HOOKS
        .iter()
        .chain(RAW_GUARD_HOOKS)
        .filter_map(|(program, _)| sys::obj_get(&links_dir.join(program)).ok())
        .filter_map(|link| sys::link_info(link.as_fd()).ok())
        .map(|info| info.prog_id)
        .collect()
}

pub(crate) fn hook_program(id: u32, own: &HashSet<u32>) -> HookProgram {
    HookProgram {
        id,
        name: sys::prog_info_by_id(id).map_or_else(|_| "?".to_owned(), |info| info.name),
        owner: if own.contains(&id) {
            Owner::Ambpf
        } else {
            Owner::Other
        },
    }
}

/// Every cgroup below `cgroup`, breadth first, at most
/// [`MOST_CGROUPS_BELOW`].
fn cgroups_below(cgroup: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut next = 0;
    let mut dirs = vec![cgroup.to_owned()];
    while next < dirs.len() && out.len() < MOST_CGROUPS_BELOW {
        let Ok(entries) = std::fs::read_dir(&dirs[next]) else {
            next += 1;
            continue;
        };
        next += 1;
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                out.push(entry.path());
                dirs.push(entry.path());
            }
        }
    }
    out
}

/// The programs on each of ambpf's cgroup hooks of `cgroup`, ambpf's own
/// being those in the links pinned in `links_dir`.
pub fn cgroup_hooks(
    cgroup: &Path,
    links_dir: &Path,
) -> Result<Vec<CgroupHookPrograms>, std::io::Error> {
    let own = own_cgroup_programs(links_dir);
    let dir = File::open(cgroup)?;
    let below: Vec<(PathBuf, File)> = cgroups_below(cgroup)
        .into_iter()
        .filter_map(|path| File::open(&path).ok().map(|f| (path, f)))
        .collect();
    let mut out = Vec::new();
    for &(_, hook) in HOOKS.iter().chain(RAW_GUARD_HOOKS) {
        let target = dir.as_raw_fd() as u32;
        let effective = sys::prog_query(target, hook as u32, sys::F_QUERY_EFFECTIVE)?
            .into_iter()
            .map(|id| hook_program(id, &own))
            .collect();
        let below = below
            .iter()
            .filter_map(|(path, file)| {
                let ids = sys::prog_query(file.as_raw_fd() as u32, hook as u32, 0).ok()?;
                (!ids.is_empty()).then(|| {
                    let programs = ids.into_iter().map(|id| hook_program(id, &own)).collect();
                    (path.clone(), programs)
                })
            })
            .collect();
        out.push(CgroupHookPrograms {
            hook: hook.name(),
            effective,
            below,
        });
    }
    Ok(out)
}

fn cgroup_hook(name: &str) -> Option<CgroupHook> {
    HOOKS
        .iter()
        .chain(RAW_GUARD_HOOKS)
        .map(|(_, hook)| *hook)
        .find(|hook| hook.name() == name)
}

/// Other owners' cgroup programs that run where they break capture: before
/// ambpf's on the hooks that redirect, after it on those that answer the
/// app ([`CgroupHook::answers_the_app`]). A hook without ambpf's program
/// says nothing (the state check names that).
pub fn cgroup_warnings(cgroup: &Path, hooks: &[CgroupHookPrograms]) -> Vec<Warning> {
    let mut out = Vec::new();
    for hooked in hooks {
        let Some(hook) = cgroup_hook(hooked.hook) else {
            continue;
        };
        let Some(ours) = hooked
            .effective
            .iter()
            .position(|p| p.owner == Owner::Ambpf)
        else {
            continue;
        };
        let warn = |p: &HookProgram, detail: String| Warning {
            hook: hook.name().to_owned(),
            program_id: Some(p.id),
            program_name: p.name.clone(),
            detail,
        };
        let ambpf_name = &hooked.effective[ours].name;
        let (others, when) = if hook.answers_the_app() {
            (&hooked.effective[ours + 1..], "after")
        } else {
            (&hooked.effective[..ours], "before")
        };
        let harm = if hook.answers_the_app() {
            "it may rewrite the address ambpf answers the app"
        } else {
            "a socket load balancer there rewrites the destination first, and ztunnel gets \
             the backend, not the service address, as the original destination"
        };
        for p in others.iter().filter(|p| p.owner == Owner::Other) {
            let detail = format!(
                "program {} {} of another owner runs {when} ambpf's {ambpf_name} for sockets of \
                 cgroup {}: {harm}",
                p.id,
                p.name,
                cgroup.display()
            );
            out.push(warn(p, detail));
        }
        if hook.answers_the_app() {
            continue;
        }
        for (path, programs) in &hooked.below {
            for p in programs.iter().filter(|p| p.owner == Owner::Other) {
                let detail = format!(
                    "program {} {} of another owner is attached to cgroup {}, below ambpf's \
                     ({}), so it runs before ambpf's {ambpf_name} for the sockets there: {harm}",
                    p.id,
                    p.name,
                    path.display(),
                    cgroup.display()
                );
                out.push(warn(p, detail));
            }
        }
    }
    out
}

/// Logs [`cgroup_warnings`] of ambpf's cgroup `cgroup` (the agent, once
/// its socket programs are attached).
pub fn log_cgroup_warnings(cgroup: &Path, links_dir: &Path) {
    match cgroup_hooks(cgroup, links_dir) {
        Ok(hooks) => {
            for warning in cgroup_warnings(cgroup, &hooks) {
                warn!("other eBPF programs: {warning}");
            }
        }
        Err(e) => warn!(
            "listing the programs on cgroup {}'s hooks: {e}",
            cgroup.display()
        ),
    }
}

/// The cgroup with inode `inode` under the cgroup2 mount, looked for
/// breadth first.
fn cgroup_by_inode(inode: u64) -> Option<PathBuf> {
    let root = crate::mounts::cgroup2_mount().ok()?;
    if root.metadata().ok()?.ino() == inode {
        return Some(root);
    }
    cgroups_below(&root)
        .into_iter()
        .find(|path| path.metadata().is_ok_and(|m| m.ino() == inode))
}

/// ambpf's cgroup (the first with links pinned under `pins`) and the
/// directory of its links.
fn pinned_cgroup(pins: &PinLayout) -> Option<(PathBuf, PathBuf)> {
    let dir = pins.root().join("links/cgroup");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|entry| {
        let inode: u64 = entry.file_name().to_str()?.parse().ok()?;
        Some((cgroup_by_inode(inode)?, entry.path()))
    })
}

/// The programs on ambpf's cgroup hooks under `pins`, with their warnings;
/// the pods' interfaces are left to the caller, which finds the pods.
pub fn scan_cgroup(pins: &PinLayout) -> Programs {
    let mut found = Programs::default();
    if let Some((cgroup, links_dir)) = pinned_cgroup(pins) {
        match cgroup_hooks(&cgroup, &links_dir) {
            Ok(hooks) => {
                found.warnings = cgroup_warnings(&cgroup, &hooks);
                found.cgroup_hooks = hooks;
            }
            Err(e) => found
                .unreadable
                .push(format!("the hooks of cgroup {}: {e}", cgroup.display())),
        }
        found.cgroup = Some(cgroup);
    }
    found
}

/// The ids of ambpf's TCX programs pinned under `pins` (the interface
/// counters'), to mark them among an interface's.
pub fn own_tcx_programs(pins: &PinLayout) -> HashSet<u32> {
    super::inspect::read_tc_links(pins)
        .map(|links| links.into_iter().map(|l| l.program_id).collect())
        .unwrap_or_default()
}

/// Other owners' `clsact` ingress filters listed ahead of an earlier
/// agent's steering filter on a pod's interface. (Inbound capture is now the
/// pod's socket lookup, which every packet delivered in the pod meets
/// whatever runs on its interfaces before: TCX programs and filters are
/// listed, not warned about.)
pub fn iface_warnings(hooks: &[IfaceHookPrograms]) -> Vec<Warning> {
    let mut out = Vec::new();
    for hooked in hooks {
        let (ahead, why): (Vec<&IfaceProgram>, &str) = match hooked.hook {
            "tc_ingress" => {
                let Some(ours) = hooked.programs.iter().position(|p| p.owner == Owner::Ambpf)
                else {
                    continue;
                };
                (
                    hooked.programs[..ours]
                        .iter()
                        .filter(|p| p.owner == Owner::Other)
                        .collect(),
                    "SYNs reach ambpf's steering filter only while it returns TC_ACT_UNSPEC",
                )
            }
            _ => continue,
        };
        for p in ahead {
            out.push(Warning {
                hook: hooked.hook.to_owned(),
                program_id: p.id,
                program_name: p.name.clone(),
                detail: format!(
                    "program {} {} of another owner runs before ambpf's steering filter on {} \
                     (netns inode {}): {why}",
                    p.id.map_or_else(|| "?".to_owned(), |id| id.to_string()),
                    p.name,
                    hooked.iface,
                    hooked.netns_inode
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(id: u32, name: &str, owner: Owner) -> HookProgram {
        HookProgram {
            id,
            name: name.to_owned(),
            owner,
        }
    }

    fn hook(hook: CgroupHook, effective: Vec<HookProgram>) -> CgroupHookPrograms {
        CgroupHookPrograms {
            hook: hook.name(),
            effective,
            below: Vec::new(),
        }
    }

    #[test]
    fn a_balancer_ahead_of_ambpfs_connect_or_behind_its_getpeername_is_named() {
        let cgroup = Path::new("/sys/fs/cgroup");
        let ours = |id| program(id, "ambpf_x", Owner::Ambpf);
        let lb = |id| program(id, "lb_x", Owner::Other);
        let mut below = hook(CgroupHook::Inet6Connect, vec![ours(5)]);
        below.below = vec![(cgroup.join("pods"), vec![lb(6)])];
        let hooks = [
            // Harmless orders: no warning.
            hook(CgroupHook::Inet4Connect, vec![ours(1), lb(2)]),
            hook(CgroupHook::Inet4Getpeername, vec![lb(3), ours(4)]),
            // Harmful ones.
            hook(CgroupHook::Udp4Sendmsg, vec![lb(7), ours(8)]),
            hook(CgroupHook::Inet6Getpeername, vec![ours(9), lb(10)]),
            below,
            // Without ambpf's program there is no order to judge.
            hook(CgroupHook::Udp6Sendmsg, vec![lb(11)]),
        ];
        let warnings = cgroup_warnings(cgroup, &hooks);
        let named: Vec<(&str, Option<u32>)> = warnings
            .iter()
            .map(|w| (w.hook.as_str(), w.program_id))
            .collect();
        assert_eq!(
            named,
            [
                ("cgroup_udp4_sendmsg", Some(7)),
                ("cgroup_inet6_getpeername", Some(10)),
                ("cgroup_inet6_connect", Some(6)),
            ]
        );
        assert!(warnings[0].detail.contains("runs before ambpf's"));
        assert!(warnings[1].detail.contains("runs after ambpf's"));
        assert!(warnings[2].detail.contains("/sys/fs/cgroup/pods"));
    }

    fn iface_program(id: u32, name: &str, owner: Owner, priority: Option<u16>) -> IfaceProgram {
        IfaceProgram {
            id: Some(id),
            name: name.to_owned(),
            owner,
            priority,
            handle: priority.map(|_| 1),
        }
    }

    #[test]
    fn filters_ahead_of_an_earlier_steering_filter_are_named_and_tcx_is_not() {
        let on = |hook, programs| IfaceHookPrograms {
            netns_inode: 1,
            iface: "eth0".to_owned(),
            ifindex: 2,
            hook,
            programs,
        };
        let steering = iface_program(1, "ambpf_pod_in", Owner::Ambpf, Some(1));
        let hooks = [
            on(
                "tcx_ingress",
                vec![iface_program(2, "mon", Owner::Other, None)],
            ),
            on(
                "tc_ingress",
                vec![
                    iface_program(3, "early", Owner::Other, Some(1)),
                    steering,
                    iface_program(4, "late", Owner::Other, Some(10)),
                ],
            ),
            on(
                "tc_egress",
                vec![iface_program(5, "out", Owner::Other, Some(1))],
            ),
        ];
        let named: Vec<Option<u32>> = iface_warnings(&hooks)
            .iter()
            .map(|w| w.program_id)
            .collect();
        assert_eq!(named, [Some(3)]);
        let shown = render(&Programs {
            interfaces: hooks.to_vec(),
            ..Programs::default()
        });
        assert!(
            shown.contains("prio 1 handle 0x1 3 early, prio 1 handle 0x1 *1 ambpf_pod_in"),
            "{shown}"
        );
    }
}
