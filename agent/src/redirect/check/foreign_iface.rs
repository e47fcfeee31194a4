//! The programs on an enrolled pod's interfaces, read inside its namespace:
//! TCX programs (run first) and `clsact` filters (in priority order), both
//! directions, with an earlier agent's steering filter marked as ambpf's.

use std::collections::HashSet;

use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcOption},
};

use crate::{
    bpf::{
        foreign::{IfaceHookPrograms, IfaceProgram, Owner, hook_program},
        sys,
    },
    redirect::{
        podnet,
        rtnl::{NetlinkError, Rtnl},
        steering,
    },
};

/// The `clsact` filters on one direction of `ifindex`, in the order they
/// run (the kernel lists them by priority).
fn clsact_filters(
    rtnl: &mut Rtnl,
    ifindex: u32,
    minor: u16,
) -> Result<Vec<IfaceProgram>, NetlinkError> {
    let mut query = netlink_packet_route::tc::TcMessage::default();
    query.header.index = ifindex as i32;
    query.header.parent = TcHandle {
        major: 0xffff,
        minor,
    };
    let msgs = match rtnl.dump(RouteNetlinkMessage::GetTrafficFilter(query)) {
        Ok(msgs) => msgs,
        // No qdisc on the interface: no filter.
        Err(e)
            if matches!(
                e.errno(),
                Some(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT)
            ) =>
        {
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    let ingress = minor == TcHandle::MIN_INGRESS;
    Ok(msgs
        .into_iter()
        .filter_map(|msg| match msg {
            RouteNetlinkMessage::NewTrafficFilter(f) => Some(f),
            _ => None,
        })
        // Each priority is listed once without a handle, then its filters.
        .filter(|f| u32::from(f.header.handle) != 0)
        .map(|f| {
            let priority = (f.header.info >> 16) as u16;
            let handle = u32::from(f.header.handle);
            let mut program = IfaceProgram {
                id: None,
                name: String::new(),
                owner: Owner::Other,
                priority: Some(priority),
                handle: Some(handle),
            };
            for attr in &f.attributes {
                match attr {
                    TcAttribute::Kind(kind) if program.name.is_empty() => {
                        program.name.clone_from(kind)
                    }
                    TcAttribute::Options(options) => {
                        for option in options {
                            match option {
                                TcOption::Bpf(TcFilterBpfOption::ProgName(name)) => {
                                    name.split(':')
                                        .next()
                                        .unwrap_or(name)
                                        .clone_into(&mut program.name);
                                }
                                TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => {
                                    program.id = Some(*id)
                                }
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
            }
            if ingress
                && priority == steering::PRIORITY
                && handle == steering::HANDLE
                && program.name == ambpf_common::programs::POD_INGRESS
            {
                program.owner = Owner::Ambpf;
            }
            program
        })
        .collect())
}

/// `enum bpf_attach_type`: BPF_TCX_INGRESS, BPF_TCX_EGRESS.
const TCX_INGRESS: u32 = 46;
const TCX_EGRESS: u32 = 47;

/// The TCX programs on `attach_type` of `ifindex` in the calling thread's
/// namespace; none on a kernel without TCX.
fn tcx_programs(ifindex: u32, attach_type: u32, own: &HashSet<u32>) -> Vec<IfaceProgram> {
    sys::prog_query(ifindex, attach_type, 0)
        .unwrap_or_default()
        .into_iter()
        .map(|id| {
            let program = hook_program(id, own);
            IfaceProgram {
                id: Some(id),
                name: program.name,
                owner: program.owner,
                priority: None,
                handle: None,
            }
        })
        .collect()
}

/// The programs on every hook of every interface in the calling thread's
/// namespace, `own_tcx` being the ids of ambpf's TCX programs.
pub(super) fn iface_hooks(
    netns_inode: u64,
    own_tcx: &HashSet<u32>,
) -> Result<Vec<IfaceHookPrograms>, NetlinkError> {
    let mut rtnl = Rtnl::open()?;
    let mut out = Vec::new();
    for iface in podnet::interfaces(&mut rtnl)? {
        let hooks = [
            (
                "tcx_ingress",
                tcx_programs(iface.index, TCX_INGRESS, own_tcx),
            ),
            (
                "tc_ingress",
                clsact_filters(&mut rtnl, iface.index, TcHandle::MIN_INGRESS)?,
            ),
            ("tcx_egress", tcx_programs(iface.index, TCX_EGRESS, own_tcx)),
            (
                "tc_egress",
                clsact_filters(&mut rtnl, iface.index, TcHandle::MIN_EGRESS)?,
            ),
        ];
        for (hook, programs) in hooks {
            out.push(IfaceHookPrograms {
                netns_inode,
                iface: iface.name.clone(),
                ifindex: iface.index,
                hook,
                programs,
            });
        }
    }
    Ok(out)
}
