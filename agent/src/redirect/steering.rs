//! Inbound steering on a pod's interfaces, as agents before the sk_lookup
//! capture ([`crate::bpf::inbound`]) installed it: ambpf's steering program
//! as a direct-action `cls_bpf` filter on the ingress hook of a `clsact`
//! qdisc, set up over rtnetlink in the pod's namespace. This agent installs
//! none; it finds and removes what an earlier one left (on re-enrolment,
//! removal, repair and uninstall). What follows is why those agents chose it.
//!
//! Why not a TCX link: creating one waits out an RCU grace period under the
//! RTNL lock (about 13 ms a pod on this kind of machine, and threads do not
//! help), while adding a filter costs next to nothing (`cargo xtask bench
//! attach`; numbers in docs/benchmarks.md). The filter keeps what the link gave:
//!
//! - it lives in the kernel without the agent (no pin needed): traffic is
//!   steered while the agent is down;
//! - a new agent replaces the program of the filter in place (a filter
//!   change with the same priority and handle swaps the program atomically),
//!   so no SYN is ever seen by neither program;
//! - `bpftool net show` (inside the pod's namespace) and `tc filter show dev
//!   eth0 ingress` list it, by the program's name.
//!
//! ambpf's filter is identified by [`PRIORITY`], [`HANDLE`] and the program
//! name; only that filter is ever created, replaced or deleted. An existing
//! `clsact` (or `ingress`) qdisc, and other filters on it, are used and left
//! as they are; a `clsact` qdisc ambpf had to create is removed with the
//! filter when nothing else is on it.

use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcBpfFlags, TcFilterBpf, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};
use nix::errno::Errno;

use super::{
    ebpf::EnrollError,
    podnet,
    rtnl::{Applied, NetlinkError, Rtnl},
};
use crate::netns::Netns;

/// The filter's priority: 1, so that it runs before filters others add with
/// the usual priorities (it passes on everything it does not steer).
pub const PRIORITY: u16 = 1;
/// The filter's handle within its priority.
pub const HANDLE: u32 = 0xa3bf;

/// `ETH_P_ALL`, as `tcm_info` carries it (network order).
const ETH_P_ALL: u16 = 0x0003;

/// What attaching did on one interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attached {
    /// The interface had no `clsact` qdisc and ambpf created one.
    pub qdisc_created: bool,
    /// ambpf's filter was there and its program was replaced.
    pub replaced: bool,
}

/// ambpf's filter as the kernel lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub ifindex: u32,
    /// The program's name (`ambpf_pod_in:[<id>]` style names are split).
    pub name: String,
    pub prog_id: Option<u32>,
    pub direct_action: bool,
}

fn header(ifindex: u32) -> TcMessage {
    let mut msg = TcMessage::default();
    msg.header.index = ifindex as i32;
    msg
}

fn clsact(ifindex: u32) -> TcMessage {
    let mut msg = header(ifindex);
    msg.header.parent = TcHandle::CLSACT;
    msg.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    msg.attributes.push(TcAttribute::Kind("clsact".into()));
    msg
}

fn filter(ifindex: u32) -> TcMessage {
    let mut msg = header(ifindex);
    msg.header.parent = TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_INGRESS,
    };
    msg.header.handle = HANDLE.into();
    msg.header.info = (u32::from(PRIORITY) << 16) | u32::from(ETH_P_ALL.to_be());
    msg
}

/// Attaches `program` (named `name`) as ambpf's filter on the ingress of
/// `ifindex`, or replaces the program of the filter already there. The
/// calling thread's `rtnl` must be in the interface's namespace.
pub fn attach(
    rtnl: &mut Rtnl,
    ifindex: u32,
    program: BorrowedFd<'_>,
    name: &str,
) -> Result<Attached, NetlinkError> {
    let qdisc_created = rtnl.create(
        RouteNetlinkMessage::NewQueueDiscipline(clsact(ifindex)),
        NLM_F_CREATE | NLM_F_EXCL,
    )? == Applied::Changed;
    let mut msg = filter(ifindex);
    msg.attributes
        .push(TcAttribute::Kind(TcFilterBpf::KIND.into()));
    msg.attributes.push(TcAttribute::Options(vec![
        TcOption::Bpf(TcFilterBpfOption::ProgFd(program.as_raw_fd() as u32)),
        TcOption::Bpf(TcFilterBpfOption::ProgName(name.into())),
        TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
    ]));
    // A new filter first; where ambpf's is there, the same request without
    // NLM_F_EXCL changes it: cls_bpf swaps the program in one step.
    let new = RouteNetlinkMessage::NewTrafficFilter(msg);
    let replaced = match rtnl.create(new.clone(), NLM_F_CREATE | NLM_F_EXCL) {
        Ok(Applied::Changed) => false,
        Ok(Applied::AlreadyInPlace) => {
            rtnl.execute(new, NLM_F_CREATE)?;
            true
        }
        Err(e) => {
            if qdisc_created {
                let _ = rtnl.delete(RouteNetlinkMessage::DelQueueDiscipline(clsact(ifindex)));
            }
            return Err(e);
        }
    };
    Ok(Attached {
        qdisc_created,
        replaced,
    })
}

/// Every filter on the ingress of `ifindex`: (priority, handle, kind, and
/// for ambpf's, what it runs).
fn ingress_filters(rtnl: &mut Rtnl, ifindex: u32) -> Result<Vec<TcMessage>, NetlinkError> {
    let mut query = header(ifindex);
    query.header.parent = TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_INGRESS,
    };
    match rtnl.dump(RouteNetlinkMessage::GetTrafficFilter(query)) {
        Ok(msgs) => Ok(msgs
            .into_iter()
            .filter_map(|msg| match msg {
                RouteNetlinkMessage::NewTrafficFilter(f) => Some(f),
                _ => None,
            })
            // The dump lists each priority once without a handle (the
            // classifier itself), then its filters.
            .filter(|f| u32::from(f.header.handle) != 0)
            .collect()),
        // No qdisc on the interface: no filter.
        Err(e) if matches!(e.errno(), Some(Errno::EINVAL | Errno::ENOENT)) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn is_ambpfs(msg: &TcMessage) -> bool {
    msg.header.info >> 16 == u32::from(PRIORITY) && u32::from(msg.header.handle) == HANDLE
}

/// ambpf's filter on the ingress of `ifindex`, if there is one.
pub fn find(rtnl: &mut Rtnl, ifindex: u32) -> Result<Option<Filter>, NetlinkError> {
    Ok(ingress_filters(rtnl, ifindex)?
        .into_iter()
        .find(is_ambpfs)
        .map(|msg| {
            let mut found = Filter {
                ifindex,
                name: String::new(),
                prog_id: None,
                direct_action: false,
            };
            for attr in &msg.attributes {
                let TcAttribute::Options(options) = attr else {
                    continue;
                };
                for option in options {
                    match option {
                        TcOption::Bpf(TcFilterBpfOption::ProgName(name)) => {
                            // The kernel lists "<name>:[<id>]" for some loaders.
                            found.name = name.split(':').next().unwrap_or(name).to_owned();
                        }
                        TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => found.prog_id = Some(*id),
                        TcOption::Bpf(TcFilterBpfOption::Flags(flags)) => {
                            found.direct_action = flags.contains(TcBpfFlags::DirectAction);
                        }
                        _ => {}
                    }
                }
            }
            found
        }))
}

/// Removes ambpf's filter from the ingress of `ifindex` (idempotent), and
/// the `clsact` qdisc too when ambpf created it (`qdisc_created`) and no
/// filter is left on it, in either direction.
pub fn detach(rtnl: &mut Rtnl, ifindex: u32, qdisc_created: bool) -> Result<Applied, NetlinkError> {
    let removed = match rtnl.delete(RouteNetlinkMessage::DelTrafficFilter(filter(ifindex))) {
        // No qdisc at all: nothing of ambpf's there.
        Err(e) if e.errno() == Some(Errno::EINVAL) => return Ok(Applied::AlreadyInPlace),
        other => other?,
    };
    if qdisc_created
        && ingress_filters(rtnl, ifindex)?.is_empty()
        && !has_egress_filters(rtnl, ifindex)?
    {
        rtnl.delete(RouteNetlinkMessage::DelQueueDiscipline(clsact(ifindex)))?;
    }
    Ok(removed)
}

fn has_egress_filters(rtnl: &mut Rtnl, ifindex: u32) -> Result<bool, NetlinkError> {
    let mut query = header(ifindex);
    query.header.parent = TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_EGRESS,
    };
    match rtnl.dump(RouteNetlinkMessage::GetTrafficFilter(query)) {
        Ok(msgs) => Ok(msgs.iter().any(|msg| {
            matches!(msg, RouteNetlinkMessage::NewTrafficFilter(f) if u32::from(f.header.handle) != 0)
        })),
        Err(e) if matches!(e.errno(), Some(Errno::EINVAL | Errno::ENOENT)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes ambpf's steering filter from every interface in `netns`.
pub fn detach_steering(netns: &Netns, qdisc_created: bool) -> Result<(), EnrollError> {
    let path = netns.path();
    netns.run(|| {
        let steering_err = |iface: String| {
            move |source| EnrollError::Steering {
                iface,
                netns: path.to_owned(),
                cause: source,
            }
        };
        let mut rtnl = Rtnl::open().map_err(steering_err("-".into()))?;
        let interfaces = podnet::interfaces(&mut rtnl).map_err(steering_err("-".into()))?;
        for iface in interfaces {
            detach(&mut rtnl, iface.index, qdisc_created).map_err(steering_err(iface.name))?;
        }
        Ok(())
    })?
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use ambpf_testbed::{NetnsGuard, PodAndNode};

    use super::*;

    /// A minimal SCHED_CLS program (`r0 = -1; exit`: pass everything on),
    /// loaded with bpf(2), standing in for ambpf's steering program.
    fn pass_program() -> std::os::fd::OwnedFd {
        crate::bpf::sys::load_minimal_program(crate::bpf::sys::PROG_TYPE_SCHED_CLS, -1).unwrap()
    }

    fn tc(ns: &NetnsGuard, args: &str) -> String {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", ns.name(), "tc"])
            .args(args.split_whitespace())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tc {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn eth0(ns: &NetnsGuard) -> u32 {
        ns.run(|| nix::net::if_::if_nametoindex("eth0").unwrap())
            .unwrap()
    }

    #[test]
    fn attach_replace_find_and_detach_leave_nothing_of_ambpfs() {
        let pn = PodAndNode::create().unwrap();
        let ifindex = eth0(&pn.pod);
        let (first, second) = (pass_program(), pass_program());
        pn.pod
            .run(|| {
                let mut rtnl = Rtnl::open().unwrap();
                assert_eq!(find(&mut rtnl, ifindex).unwrap(), None);
                let done = attach(&mut rtnl, ifindex, first.as_fd(), "ambpf_pod_in").unwrap();
                assert_eq!(
                    done,
                    Attached {
                        qdisc_created: true,
                        replaced: false
                    }
                );
                let found = find(&mut rtnl, ifindex).unwrap().unwrap();
                assert_eq!(found.name, "ambpf_pod_in");
                assert!(found.direct_action);
                let first_id = found.prog_id.unwrap();

                let again = attach(&mut rtnl, ifindex, second.as_fd(), "ambpf_pod_in").unwrap();
                assert_eq!(
                    again,
                    Attached {
                        qdisc_created: false,
                        replaced: true
                    }
                );
                let second_id = find(&mut rtnl, ifindex).unwrap().unwrap().prog_id.unwrap();
                assert_ne!(first_id, second_id, "the program was replaced in place");

                assert_eq!(detach(&mut rtnl, ifindex, true).unwrap(), Applied::Changed);
                assert_eq!(find(&mut rtnl, ifindex).unwrap(), None);
                assert_eq!(
                    detach(&mut rtnl, ifindex, true).unwrap(),
                    Applied::AlreadyInPlace
                );
            })
            .unwrap();
        assert!(
            !tc(&pn.pod, "qdisc show dev eth0").contains("clsact"),
            "the qdisc ambpf made is gone"
        );
    }

    #[test]
    fn a_foreign_qdisc_and_filter_are_used_and_left_alone() {
        let pn = PodAndNode::create().unwrap();
        let ifindex = eth0(&pn.pod);
        tc(&pn.pod, "qdisc add dev eth0 clsact");
        tc(
            &pn.pod,
            "filter add dev eth0 ingress prio 100 protocol all u32 match u32 0 0 flowid 1:1",
        );
        let program = pass_program();
        pn.pod
            .run(|| {
                let mut rtnl = Rtnl::open().unwrap();
                let done = attach(&mut rtnl, ifindex, program.as_fd(), "ambpf_pod_in").unwrap();
                assert!(!done.qdisc_created);
                // Even told it made the qdisc, detach keeps one that holds
                // another filter.
                detach(&mut rtnl, ifindex, true).unwrap();
            })
            .unwrap();
        let filters = tc(&pn.pod, "filter show dev eth0 ingress");
        assert!(filters.contains("u32"), "{filters}");
        assert!(!filters.contains("ambpf_pod_in"), "{filters}");
        assert!(tc(&pn.pod, "qdisc show dev eth0").contains("clsact"));
    }

    #[test]
    fn a_filter_of_another_kind_at_ambpfs_priority_is_a_clear_error_and_nothing_is_left() {
        let pn = PodAndNode::create().unwrap();
        let ifindex = eth0(&pn.pod);
        tc(&pn.pod, "qdisc add dev eth0 clsact");
        tc(
            &pn.pod,
            "filter add dev eth0 ingress prio 1 protocol all u32 match u32 0 0 flowid 1:1",
        );
        let program = pass_program();
        let err = pn
            .pod
            .run(|| {
                let mut rtnl = Rtnl::open().unwrap();
                attach(&mut rtnl, ifindex, program.as_fd(), "ambpf_pod_in").unwrap_err()
            })
            .unwrap();
        assert!(err.errno().is_some(), "{err}");
        let filters = tc(&pn.pod, "filter show dev eth0 ingress");
        assert!(
            filters.contains("u32") && !filters.contains("ambpf"),
            "{filters}"
        );
    }
}
