//! Reply routing inside a pod: marked packets are delivered locally.
//!
//! When ztunnel proxies an inbound connection to an app in the pod, it
//! connects from the client's own address (a transparent socket), so the
//! app's replies are addressed to a host outside the pod and would be routed
//! out of `eth0`. Istio brings them back with a mark (0x111 under mask 0xfff),
//! a policy rule sending marked packets to routing table 100, and a
//! `local default dev lo` route in that table: a marked reply is delivered
//! locally, where ztunnel's transparent socket owns that address pair. This
//! module installs the same rule and route, for IPv4 and IPv6, over rtnetlink
//! from a thread inside the pod's namespace, plus the per-namespace sysctl
//! `net.ipv4.tcp_fwmark_accept` that carries the mark from a SYN to the
//! accepted socket (see [`install_reply_routing`]).
//!
//! Everything is idempotent: installing twice changes nothing the second
//! time, removing what is not there succeeds.

use std::{
    fs,
    io::{self, Write},
    path::{Path, PathBuf},
};

use ambpf_common::ztunnel::{MARK_MASK, REPLY_MARK, REPLY_ROUTE_TABLE};
use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    link::{AfSpecInet6, AfSpecUnspec, LinkAttribute, LinkFlags, LinkMessage},
    route::{RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage},
};

use super::podnet::{Applied, NetlinkError, Rtnl};
use crate::netns::{Netns, NetnsError};

mod messages;
use messages::*;

/// Priority of the `fwmark 0x111/0xfff lookup 100` rule: Istio's own
/// (`InpodRulePriority`), so the two dataplanes leave the same rule set. It
/// only has to come before the `main` table's rule (32766), which would
/// route a reply out of the pod, and after `local` (0).
pub const REPLY_RULE_PRIORITY: u32 = 32764;

/// How many copies of a rule or route [`remove_reply_routing`] deletes at
/// most (copies made by hand or by an older agent without `NLM_F_EXCL`).
const MAX_COPIES: usize = 16;

/// Below `/proc/sys/net` ([`crate::netns::net_sysctl_path`]).
const TCP_FWMARK_ACCEPT: &str = "ipv4/tcp_fwmark_accept";

#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("{what} in {}: {cause}", netns.display())]
    Netlink {
        what: String,
        netns: PathBuf,
        cause: NetlinkError,
    },
    #[error("{what} in {}: {cause}", netns.display())]
    Sysctl {
        what: String,
        netns: PathBuf,
        cause: io::Error,
    },
    #[error("no loopback interface in {}", netns.display())]
    NoLoopback { netns: PathBuf },
}

/// What of the reply routing is in place in one namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyRoutingStatus {
    pub ipv4: FamilyStatus,
    /// `None` when IPv6 is off in the namespace (no IPv6 in the kernel, or
    /// `disable_ipv6` on the loopback), where nothing is installed for it.
    pub ipv6: Option<FamilyStatus>,
    /// `net.ipv4.tcp_fwmark_accept` is 1.
    pub tcp_fwmark_accept: bool,
}

/// The rule and the route of one IP version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FamilyStatus {
    /// `fwmark 0x111/0xfff lookup 100` at [`REPLY_RULE_PRIORITY`].
    pub rule: bool,
    /// `local default dev lo` in table 100.
    pub route: bool,
}

impl ReplyRoutingStatus {
    /// Everything [`install_reply_routing`] sets up is there.
    pub fn is_installed(&self) -> bool {
        self.policy_routing_installed() && self.tcp_fwmark_accept
    }

    /// What [`install_policy_routing`] sets up is there (the iptables
    /// mode's part: no sysctl).
    pub fn policy_routing_installed(&self) -> bool {
        let complete = |f: FamilyStatus| f.rule && f.route;
        complete(self.ipv4) && self.ipv6.is_none_or(complete)
    }
}

/// Installs reply routing in `netns`, idempotently:
///
/// - for IPv4 and IPv6, the route `local default dev lo table 100` and the
///   policy rule `fwmark 0x111/0xfff lookup 100` at [`REPLY_RULE_PRIORITY`]
///   (route first, so that no marked packet meets an empty table);
/// - `net.ipv4.tcp_fwmark_accept = 1` (per namespace; it covers IPv6 TCP too).
///
/// IPv6 is skipped when the namespace has none (see [`ReplyRoutingStatus`]).
/// A failure leaves what was done in place: calling again, or
/// [`remove_reply_routing`], finishes or undoes it.
pub fn install_reply_routing(netns: &Netns) -> Result<(), RoutingError> {
    let path = netns.path();
    netns.run(|| install_reply_routing_with(&mut open_rtnl(path)?, path))?
}

/// [`install_reply_routing`] through `rtnl`, a socket opened in the
/// namespace (named `netns` in errors), from a thread in it (for the
/// sysctl).
pub fn install_reply_routing_with(rtnl: &mut Rtnl, netns: &Path) -> Result<(), RoutingError> {
    let mut here = Here::on(rtnl, netns)?;
    here.add_policy_routing()?;
    // Why the sysctl: ztunnel's connection to an app (from the client's
    // address) is answered by the app's accepted socket, and eBPF has no
    // connmark to restore a mark onto those replies as Istio's iptables
    // do. With tcp_fwmark_accept = 1, a socket accepted from a SYN
    // carrying a mark inherits it (the SYN-ACK is already sent with it),
    // unless its listener has an SO_MARK of its own. So once the SYN
    // reaching the app carries 0x111 (ztunnel's sockets mark 0x539; the
    // redirection programs must set 0x111 on that SYN), the SYN-ACK and
    // every later reply of the connection carry 0x111, and the rule above
    // delivers them to ztunnel's transparent socket instead of routing
    // them out towards the client's address.
    here.write_sysctl(TCP_FWMARK_ACCEPT, "net.ipv4.tcp_fwmark_accept", 1)
}

/// Installs only the policy routing of [`install_reply_routing`], for IPv4
/// and IPv6, idempotently: the route `local default dev lo table 100` and
/// the rule `fwmark 0x111/0xfff lookup 100`, without the
/// `tcp_fwmark_accept` sysctl. For the iptables redirection, where the mark
/// comes from Istio's connmark rules (`CONNMARK --restore-mark` on every
/// packet of a connection ztunnel made), as in Istio itself. IPv6 is
/// skipped when the namespace has none.
pub fn install_policy_routing(netns: &Netns) -> Result<(), RoutingError> {
    let path = netns.path();
    netns.run(|| Here::on(&mut open_rtnl(path)?, path)?.add_policy_routing())?
}

/// Removes what [`install_policy_routing`] installs (every copy of the rule
/// and the route, both IP versions), idempotently, leaving the sysctl
/// alone.
pub fn remove_policy_routing(netns: &Netns) -> Result<(), RoutingError> {
    let path = netns.path();
    netns.run(|| Here::on(&mut open_rtnl(path)?, path)?.delete_policy_routing())?
}

/// Removes what [`install_reply_routing`] installs, idempotently: sets
/// `net.ipv4.tcp_fwmark_accept` back to 0 (the kernel default), then deletes
/// every copy of the rules and the routes of both IP versions. IPv6 is
/// cleaned whenever the kernel has it, even if it was disabled since.
pub fn remove_reply_routing(netns: &Netns) -> Result<(), RoutingError> {
    let path = netns.path();
    netns.run(|| {
        let mut rtnl = open_rtnl(path)?;
        let mut here = Here::on(&mut rtnl, path)?;
        here.write_sysctl(TCP_FWMARK_ACCEPT, "net.ipv4.tcp_fwmark_accept", 0)?;
        here.delete_policy_routing()
    })?
}

/// Sets `net.ipv4.tcp_fwmark_accept` back to 0 in `netns`, leaving the
/// policy routing: what the eBPF mode adds to the iptables and nftables
/// modes' reply routing, taken out when one of them takes a pod over. A
/// socket already accepted keeps the mark it inherited, so connections
/// ztunnel proxies keep their replies.
pub fn remove_fwmark_accept(netns: &Netns) -> Result<(), RoutingError> {
    let path = netns.path();
    netns.run(|| {
        let mut rtnl = open_rtnl(path)?;
        Here::on(&mut rtnl, path)?.write_sysctl(TCP_FWMARK_ACCEPT, "net.ipv4.tcp_fwmark_accept", 0)
    })?
}

/// Whether the reply routing is complete in `netns`: rule and route of each
/// IP version it uses, and the sysctl.
pub fn reply_routing_installed(netns: &Netns) -> Result<bool, RoutingError> {
    Ok(reply_routing_status(netns)?.is_installed())
}

/// What of the reply routing is in place in `netns`, read from the kernel's
/// rule and route tables and the sysctl.
pub fn reply_routing_status(netns: &Netns) -> Result<ReplyRoutingStatus, RoutingError> {
    let path = netns.path();
    netns.run(|| {
        let mut rtnl = open_rtnl(path)?;
        let mut here = Here::on(&mut rtnl, path)?;
        let ipv4 = here.family_status(IpFamily::V4)?;
        let ipv6 = if here.ipv6_enabled() {
            Some(here.family_status(IpFamily::V6)?)
        } else {
            None
        };
        let tcp_fwmark_accept =
            here.read_sysctl(TCP_FWMARK_ACCEPT, "net.ipv4.tcp_fwmark_accept")? == "1";
        Ok(ReplyRoutingStatus {
            ipv4,
            ipv6,
            tcp_fwmark_accept,
        })
    })?
}

/// A netlink route socket in the calling thread's namespace (`netns` in
/// errors).
fn open_rtnl(netns: &Path) -> Result<Rtnl, RoutingError> {
    Rtnl::open().map_err(|source| RoutingError::Netlink {
        what: "opening a netlink route socket".into(),
        netns: netns.to_owned(),
        cause: source,
    })
}

/// The reply routing of one namespace, through a socket opened in it.
struct Here<'a> {
    netns: &'a Path,
    rtnl: &'a mut Rtnl,
    lo_index: u32,
    lo_name: String,
    lo_up: bool,
    lo_ipv6: Ipv6State,
}

/// IPv6 on a namespace's loopback, as its link message reports it (the
/// `AF_INET6` device configuration in `IFLA_AF_SPEC`).
///
/// Read over netlink rather than from `/proc/sys/net/ipv6/conf/lo/disable_ipv6`
/// because on a node with many namespaces a path lookup under `/proc/sys/net`
/// is slow: every namespace has its own `net` entry under `/proc/sys`, all
/// hashed alike, and the lookup compares them one by one (about 0.3 ms per
/// lookup with 1,000 pods).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ipv6State {
    /// The kernel has no IPv6 (no `AF_INET6` configuration on the device).
    Absent,
    /// `disable_ipv6` is set on the loopback (directly, or through `all`).
    Disabled,
    Enabled,
}

impl Ipv6State {
    fn of(link: &LinkMessage) -> Self {
        let devconf = link.attributes.iter().find_map(|attr| match attr {
            LinkAttribute::AfSpecUnspec(specs) => specs.iter().find_map(|spec| match spec {
                AfSpecUnspec::Inet6(inet6) => inet6.iter().find_map(|nla| match nla {
                    AfSpecInet6::DevConf(conf) => Some(conf.disable_ipv6),
                    _ => None,
                }),
                _ => None,
            }),
            _ => None,
        });
        match devconf {
            None => Self::Absent,
            Some(0) => Self::Enabled,
            Some(_) => Self::Disabled,
        }
    }
}

impl<'a> Here<'a> {
    fn on(rtnl: &'a mut Rtnl, netns: &'a Path) -> Result<Self, RoutingError> {
        let netlink_err = |what: &str| {
            let what = what.to_owned();
            move |source| RoutingError::Netlink {
                what,
                netns: netns.to_owned(),
                cause: source,
            }
        };
        let (lo_index, lo_name, lo_up, lo_ipv6) = rtnl
            .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
            .map_err(netlink_err("listing interfaces"))?
            .into_iter()
            .find_map(|msg| match msg {
                RouteNetlinkMessage::NewLink(link)
                    if link.header.flags.contains(LinkFlags::Loopback) =>
                {
                    let name = link.attributes.iter().find_map(|attr| match attr {
                        LinkAttribute::IfName(name) => Some(name.clone()),
                        _ => None,
                    });
                    Some((
                        link.header.index,
                        name.unwrap_or_else(|| "lo".into()),
                        link.header.flags.contains(LinkFlags::Up),
                        Ipv6State::of(&link),
                    ))
                }
                _ => None,
            })
            .ok_or_else(|| RoutingError::NoLoopback {
                netns: netns.to_owned(),
            })?;
        Ok(Self {
            netns,
            rtnl,
            lo_index,
            lo_name,
            lo_up,
            lo_ipv6,
        })
    }

    /// IPv6 is usable for reply routing: the kernel has it and the loopback,
    /// the route's device, has not disabled it (the kernel refuses the route
    /// then: "IPv6 is disabled on nexthop device"). `disable_ipv6` on `all`
    /// reaches the loopback too.
    fn ipv6_enabled(&self) -> bool {
        self.lo_ipv6 == Ipv6State::Enabled
    }

    fn families(&self) -> Vec<IpFamily> {
        let mut families = vec![IpFamily::V4];
        if self.ipv6_enabled() {
            families.push(IpFamily::V6);
        }
        families
    }

    fn netlink_err(&self, what: String) -> impl FnOnce(NetlinkError) -> RoutingError + use<'_> {
        move |source| RoutingError::Netlink {
            what,
            netns: self.netns.to_owned(),
            cause: source,
        }
    }

    /// Route, then rule, of each IP version in use.
    fn add_policy_routing(&mut self) -> Result<(), RoutingError> {
        self.bring_loopback_up()?;
        for family in self.families() {
            self.add_route(family)?;
            self.add_rule(family)?;
        }
        Ok(())
    }

    /// Rules, then routes, of both IP versions (IPv6 whenever the kernel has
    /// it, even if it was disabled since).
    fn delete_policy_routing(&mut self) -> Result<(), RoutingError> {
        let mut families = vec![IpFamily::V4];
        if self.lo_ipv6 != Ipv6State::Absent {
            families.push(IpFamily::V6);
        }
        for family in families {
            self.delete_rules(family)?;
            self.delete_routes(family)?;
        }
        Ok(())
    }

    /// Sets the loopback up, as the `loopback` CNI plugin does, if it is not
    /// yet. A runtime may run the loopback plugin concurrently with the
    /// pod's network and so with this agent's enrolment (containerd's CRI
    /// attaches the two at once); the kernel refuses an IPv6 route through a
    /// device that is down ("Nexthop device is not up"), and ztunnel's
    /// sockets in the pod need the loopback anyway.
    fn bring_loopback_up(&mut self) -> Result<(), RoutingError> {
        if self.lo_up {
            return Ok(());
        }
        let mut link = LinkMessage::default();
        link.header.index = self.lo_index;
        link.header.flags = LinkFlags::Up;
        link.header.change_mask = LinkFlags::Up;
        let result = self.rtnl.execute(RouteNetlinkMessage::SetLink(link), 0);
        let what = format!("setting {} up", self.lo_name);
        result.map_err(self.netlink_err(what))?;
        self.lo_up = true;
        Ok(())
    }

    fn add_rule(&mut self, family: IpFamily) -> Result<Applied, RoutingError> {
        // NLM_F_EXCL: without it the kernel adds a duplicate rule each time;
        // with it an identical rule answers EEXIST, which is success.
        let request = RouteNetlinkMessage::NewRule(reply_rule(family));
        let result = self.rtnl.create(request, NLM_F_CREATE | NLM_F_EXCL);
        result.map_err(self.netlink_err(format!("adding {}", rule_text(family))))
    }

    fn add_route(&mut self, family: IpFamily) -> Result<Applied, RoutingError> {
        // NLM_F_REPLACE rather than NLM_F_EXCL: table 100 is reserved for
        // this route, and a different default route left in it (another
        // device, another type) must become ours, not be taken for it.
        let request = RouteNetlinkMessage::NewRoute(reply_route(family, self.lo_index, false));
        let result = self.rtnl.create(request, NLM_F_CREATE | NLM_F_REPLACE);
        let what = format!("adding {}", route_text(family, &self.lo_name));
        result.map_err(self.netlink_err(what))
    }

    fn delete_rules(&mut self, family: IpFamily) -> Result<(), RoutingError> {
        for _ in 0..MAX_COPIES {
            let request = RouteNetlinkMessage::DelRule(reply_rule(family));
            let result = self.rtnl.delete(request);
            let what = format!("removing {}", rule_text(family));
            if result.map_err(self.netlink_err(what))? == Applied::AlreadyInPlace {
                break;
            }
        }
        Ok(())
    }

    fn delete_routes(&mut self, family: IpFamily) -> Result<(), RoutingError> {
        for _ in 0..MAX_COPIES {
            let request = RouteNetlinkMessage::DelRoute(reply_route(family, self.lo_index, true));
            let result = self.rtnl.delete(request);
            let what = format!("removing {}", route_text(family, &self.lo_name));
            if result.map_err(self.netlink_err(what))? == Applied::AlreadyInPlace {
                break;
            }
        }
        Ok(())
    }

    fn family_status(&mut self, family: IpFamily) -> Result<FamilyStatus, RoutingError> {
        let mut rule_query = RuleMessage::default();
        rule_query.header.family = family.address_family();
        let rules = self.rtnl.dump(RouteNetlinkMessage::GetRule(rule_query));
        let rules = rules.map_err(self.netlink_err(format!("listing {family} policy rules")))?;
        let rule = rules.iter().any(
            |msg| matches!(msg, RouteNetlinkMessage::NewRule(rule) if is_reply_rule(rule, family)),
        );

        let mut route_query = RouteMessage::default();
        route_query.header.address_family = family.address_family();
        let routes = self.rtnl.dump(RouteNetlinkMessage::GetRoute(route_query));
        let routes = routes.map_err(self.netlink_err(format!("listing {family} routes")))?;
        let lo_index = self.lo_index;
        let route = routes.iter().any(|msg| {
            matches!(msg, RouteNetlinkMessage::NewRoute(route) if is_reply_route(route, family, lo_index))
        });
        Ok(FamilyStatus { rule, route })
    }

    /// Writes a sysctl of this thread's namespace: /proc/sys/net shows the
    /// namespace of the thread that opens a file there, not the process's.
    fn write_sysctl(&self, path: &str, name: &str, value: u32) -> Result<(), RoutingError> {
        fs::OpenOptions::new()
            .write(true)
            .open(crate::netns::net_sysctl_path(path))
            .and_then(|mut file| file.write_all(format!("{value}\n").as_bytes()))
            .map_err(|source| RoutingError::Sysctl {
                what: format!("writing {name} = {value}"),
                netns: self.netns.to_owned(),
                cause: source,
            })
    }

    fn read_sysctl(&self, path: &str, name: &str) -> Result<String, RoutingError> {
        fs::read_to_string(crate::netns::net_sysctl_path(path))
            .map(|value| value.trim().to_owned())
            .map_err(|source| RoutingError::Sysctl {
                what: format!("reading {name}"),
                netns: self.netns.to_owned(),
                cause: source,
            })
    }
}

#[cfg(test)]
mod tests;
