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

/// Priority of the `fwmark 0x111/0xfff lookup 100` rule: Istio's own
/// (`InpodRulePriority`), so the two dataplanes leave the same rule set. It
/// only has to come before the `main` table's rule (32766), which would
/// route a reply out of the pod, and after `local` (0).
pub const REPLY_RULE_PRIORITY: u32 = 32764;

/// How many copies of a rule or route [`remove_reply_routing`] deletes at
/// most (copies made by hand or by an older agent without `NLM_F_EXCL`).
const MAX_COPIES: usize = 16;

const TCP_FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";

#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("{what} in {}: {source}", netns.display())]
    Netlink {
        what: String,
        netns: PathBuf,
        source: NetlinkError,
    },
    #[error("{what} in {}: {source}", netns.display())]
    Sysctl {
        what: String,
        netns: PathBuf,
        source: io::Error,
    },
    #[error("no loopback interface in {}", netns.display())]
    NoLoopback { netns: PathBuf },
}

/// An IP version, for messages and netlink requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    fn address_family(self) -> AddressFamily {
        match self {
            Self::V4 => AddressFamily::Inet,
            Self::V6 => AddressFamily::Inet6,
        }
    }

    fn default_prefix(self) -> &'static str {
        match self {
            Self::V4 => "0.0.0.0/0",
            Self::V6 => "::/0",
        }
    }
}

impl std::fmt::Display for IpFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
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

/// The rule as `ip rule` prints it, for messages.
fn rule_text(family: IpFamily) -> String {
    format!(
        "{family} policy rule priority {REPLY_RULE_PRIORITY} fwmark {REPLY_MARK:#x}/{MARK_MASK:#x} \
         lookup {REPLY_ROUTE_TABLE}"
    )
}

fn route_text(family: IpFamily, lo: &str) -> String {
    format!(
        "{family} route local {} dev {lo} table {REPLY_ROUTE_TABLE}",
        family.default_prefix()
    )
}

/// The routing-table id in a message header: ids above 255 travel only in
/// the `*_TABLE` attribute, with `RT_TABLE_UNSPEC` in the header.
fn header_table(id: u32) -> u8 {
    u8::try_from(id).unwrap_or(0)
}

fn reply_rule(family: IpFamily) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = family.address_family();
    rule.header.table = header_table(REPLY_ROUTE_TABLE);
    rule.header.action = RuleAction::ToTable;
    rule.attributes = vec![
        RuleAttribute::Priority(REPLY_RULE_PRIORITY),
        RuleAttribute::FwMark(REPLY_MARK),
        RuleAttribute::FwMask(MARK_MASK),
        RuleAttribute::Table(REPLY_ROUTE_TABLE),
    ];
    rule
}

fn is_reply_rule(rule: &RuleMessage, family: IpFamily) -> bool {
    let has = |wanted: &RuleAttribute| rule.attributes.contains(wanted);
    let table = rule
        .attributes
        .iter()
        .find_map(|attr| match attr {
            RuleAttribute::Table(id) => Some(*id),
            _ => None,
        })
        .unwrap_or(u32::from(rule.header.table));
    // Only a rule that selects every marked packet and nothing else counts.
    let narrowed = rule.header.src_len != 0
        || rule.header.dst_len != 0
        || rule.header.flags.contains(RuleFlags::Invert)
        || rule.attributes.iter().any(|attr| {
            matches!(
                attr,
                RuleAttribute::Iifname(_)
                    | RuleAttribute::Oifname(_)
                    | RuleAttribute::IpProtocol(_)
                    | RuleAttribute::SourcePortRange(_)
                    | RuleAttribute::DestinationPortRange(_)
                    | RuleAttribute::UidRange(_)
            )
        });
    rule.header.family == family.address_family()
        && rule.header.action == RuleAction::ToTable
        && table == REPLY_ROUTE_TABLE
        && has(&RuleAttribute::Priority(REPLY_RULE_PRIORITY))
        && has(&RuleAttribute::FwMark(REPLY_MARK))
        && has(&RuleAttribute::FwMask(MARK_MASK))
        && !narrowed
}

/// `local default dev lo table 100`. For a deletion the protocol is left
/// unspecified and the scope is `RT_SCOPE_NOWHERE`, both wildcards to the
/// kernel (as `ip route del` sends them).
fn reply_route(family: IpFamily, lo_index: u32, for_delete: bool) -> RouteMessage {
    let mut route = RouteMessage::default();
    route.header.address_family = family.address_family();
    route.header.destination_prefix_length = 0;
    route.header.table = header_table(REPLY_ROUTE_TABLE);
    route.header.kind = RouteType::Local;
    if for_delete {
        route.header.protocol = RouteProtocol::Unspec;
        route.header.scope = RouteScope::NoWhere;
    } else {
        route.header.protocol = RouteProtocol::Static;
        route.header.scope = RouteScope::Host;
    }
    route.attributes = vec![
        RouteAttribute::Table(REPLY_ROUTE_TABLE),
        RouteAttribute::Oif(lo_index),
    ];
    route
}

fn is_reply_route(route: &RouteMessage, family: IpFamily, lo_index: u32) -> bool {
    let table = route
        .attributes
        .iter()
        .find_map(|attr| match attr {
            RouteAttribute::Table(id) => Some(*id),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table));
    route.header.address_family == family.address_family()
        && route.header.kind == RouteType::Local
        && route.header.destination_prefix_length == 0
        && route.header.source_prefix_length == 0
        && table == REPLY_ROUTE_TABLE
        && route.attributes.contains(&RouteAttribute::Oif(lo_index))
}

/// A netlink socket in the namespace being changed, on its thread.
/// A netlink route socket in the calling thread's namespace (`netns` in
/// errors).
fn open_rtnl(netns: &Path) -> Result<Rtnl, RoutingError> {
    Rtnl::open().map_err(|source| RoutingError::Netlink {
        what: "opening a netlink route socket".into(),
        netns: netns.to_owned(),
        source,
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
                source,
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
            source,
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
            .open(path)
            .and_then(|mut file| file.write_all(format!("{value}\n").as_bytes()))
            .map_err(|source| RoutingError::Sysctl {
                what: format!("writing {name} = {value}"),
                netns: self.netns.to_owned(),
                source,
            })
    }

    fn read_sysctl(&self, path: &str, name: &str) -> Result<String, RoutingError> {
        fs::read_to_string(path)
            .map(|value| value.trim().to_owned())
            .map_err(|source| RoutingError::Sysctl {
                what: format!("reading {name}"),
                netns: self.netns.to_owned(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Write},
        net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
        process::Command,
        time::Duration,
    };

    use ambpf_testbed::{NetnsGuard, PodAndNode};
    use socket2::{Domain, SockRef, Socket, Type};

    use super::*;

    fn open(guard: &NetnsGuard) -> Netns {
        Netns::open(guard.path().to_str().unwrap()).unwrap()
    }

    /// The reply rules and table-100 routes in `ns`, read with a dump of our
    /// own, per family: (rules, routes).
    fn dump_reply_routing(ns: &NetnsGuard, family: IpFamily) -> (usize, Vec<RouteMessage>) {
        ns.run(|| {
            let mut rtnl = Rtnl::open().unwrap();
            let mut query = RuleMessage::default();
            query.header.family = family.address_family();
            let rules = rtnl
                .dump(RouteNetlinkMessage::GetRule(query))
                .unwrap()
                .into_iter()
                .filter(|msg| matches!(msg, RouteNetlinkMessage::NewRule(rule) if rule.attributes.contains(&RuleAttribute::FwMark(REPLY_MARK))))
                .count();
            let mut query = RouteMessage::default();
            query.header.address_family = family.address_family();
            let routes = rtnl
                .dump(RouteNetlinkMessage::GetRoute(query))
                .unwrap()
                .into_iter()
                .filter_map(|msg| match msg {
                    RouteNetlinkMessage::NewRoute(route)
                        if route.attributes.contains(&RouteAttribute::Table(REPLY_ROUTE_TABLE)) =>
                    {
                        Some(route)
                    }
                    _ => None,
                })
                .collect();
            (rules, routes)
        })
        .unwrap()
    }

    fn sysctl(ns: &NetnsGuard, path: &str) -> String {
        ns.run(|| fs::read_to_string(path).unwrap().trim().to_owned())
            .unwrap()
    }

    /// `ip -n <ns> <args>` output: a second opinion on what netlink says.
    fn ip_show(ns: &NetnsGuard, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["-n", ns.name()])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn install_is_idempotent_and_visible_in_the_kernel_tables() {
        let pn = PodAndNode::create().unwrap();
        let pod = open(&pn.pod);
        assert!(!reply_routing_installed(&pod).unwrap());

        install_reply_routing(&pod).unwrap();
        install_reply_routing(&pod).unwrap();
        assert!(reply_routing_installed(&pod).unwrap());
        let status = reply_routing_status(&pod).unwrap();
        assert_eq!(
            status.ipv6,
            Some(FamilyStatus {
                rule: true,
                route: true
            })
        );

        for family in [IpFamily::V4, IpFamily::V6] {
            let (rules, routes) = dump_reply_routing(&pn.pod, family);
            assert_eq!(rules, 1, "{family}: one rule after two installs");
            assert_eq!(routes.len(), 1, "{family}: {routes:?}");
            let route = &routes[0];
            assert_eq!(route.header.kind, RouteType::Local);
            assert_eq!(route.header.destination_prefix_length, 0);
            assert!(
                route.attributes.contains(&RouteAttribute::Oif(1)),
                "{route:?}"
            );
        }
        for v in ["-4", "-6"] {
            let rules = ip_show(&pn.pod, &[v, "rule", "show"]);
            assert!(
                rules.contains("32764:\tfrom all fwmark 0x111/0xfff lookup 100"),
                "{rules}"
            );
            let routes = ip_show(&pn.pod, &[v, "route", "show", "table", "100"]);
            assert!(routes.starts_with("local default dev lo"), "{routes}");
            assert_eq!(routes.lines().count(), 1, "{routes}");
        }
        assert_eq!(sysctl(&pn.pod, TCP_FWMARK_ACCEPT), "1");
        // Per namespace: the node next door is untouched.
        assert_eq!(sysctl(&pn.node, TCP_FWMARK_ACCEPT), "0");
        assert!(!reply_routing_installed(&open(&pn.node)).unwrap());
    }

    #[test]
    fn remove_is_idempotent_and_leaves_nothing() {
        let pn = PodAndNode::create().unwrap();
        let pod = open(&pn.pod);
        // Removing what was never installed is fine.
        remove_reply_routing(&pod).unwrap();

        install_reply_routing(&pod).unwrap();
        // A copy the kernel tells apart (another protocol, as another tool
        // would leave) goes too.
        pn.pod
            .ip(&[
                "rule",
                "add",
                "fwmark",
                "0x111/0xfff",
                "lookup",
                "100",
                "pref",
                "32764",
                "protocol",
                "static",
            ])
            .unwrap();
        assert_eq!(dump_reply_routing(&pn.pod, IpFamily::V4).0, 2);

        remove_reply_routing(&pod).unwrap();
        remove_reply_routing(&pod).unwrap();
        for family in [IpFamily::V4, IpFamily::V6] {
            let (rules, routes) = dump_reply_routing(&pn.pod, family);
            assert_eq!(rules, 0, "{family}");
            assert!(routes.is_empty(), "{family}: {routes:?}");
        }
        assert_eq!(sysctl(&pn.pod, TCP_FWMARK_ACCEPT), "0");
        let status = reply_routing_status(&pod).unwrap();
        let none = FamilyStatus {
            rule: false,
            route: false,
        };
        assert_eq!(
            status,
            ReplyRoutingStatus {
                ipv4: none,
                ipv6: Some(none),
                tcp_fwmark_accept: false
            }
        );
    }

    #[test]
    fn policy_routing_alone_leaves_the_sysctl_alone() {
        let pn = PodAndNode::create().unwrap();
        let pod = open(&pn.pod);
        install_policy_routing(&pod).unwrap();
        install_policy_routing(&pod).unwrap();
        let status = reply_routing_status(&pod).unwrap();
        let both = FamilyStatus {
            rule: true,
            route: true,
        };
        assert_eq!(status.ipv4, both);
        assert_eq!(status.ipv6, Some(both));
        assert!(!status.tcp_fwmark_accept);
        for family in [IpFamily::V4, IpFamily::V6] {
            let (rules, routes) = dump_reply_routing(&pn.pod, family);
            assert_eq!((rules, routes.len()), (1, 1), "{family}");
        }

        // Removing it does not touch a sysctl someone else set.
        pn.pod.sysctl("net.ipv4.tcp_fwmark_accept=1").unwrap();
        remove_policy_routing(&pod).unwrap();
        remove_policy_routing(&pod).unwrap();
        for family in [IpFamily::V4, IpFamily::V6] {
            let (rules, routes) = dump_reply_routing(&pn.pod, family);
            assert_eq!((rules, routes.len()), (0, 0), "{family}");
        }
        assert_eq!(sysctl(&pn.pod, TCP_FWMARK_ACCEPT), "1");
    }

    #[test]
    fn install_replaces_a_stale_default_route_in_table_100() {
        let pn = PodAndNode::create().unwrap();
        let pod = open(&pn.pod);
        pn.pod
            .ip(&["route", "add", "default", "dev", "eth0", "table", "100"])
            .unwrap();
        install_reply_routing(&pod).unwrap();
        assert!(reply_routing_installed(&pod).unwrap());
        let (_, routes) = dump_reply_routing(&pn.pod, IpFamily::V4);
        assert_eq!(routes.len(), 1, "{routes:?}");
        assert_eq!(routes[0].header.kind, RouteType::Local);
    }

    #[test]
    fn namespace_with_only_loopback_works() {
        let ns = NetnsGuard::create("lo").unwrap();
        let netns = open(&ns);
        install_reply_routing(&netns).unwrap();
        assert!(reply_routing_installed(&netns).unwrap());
        remove_reply_routing(&netns).unwrap();
        assert!(!reply_routing_installed(&netns).unwrap());
        assert_eq!(dump_reply_routing(&ns, IpFamily::V6).0, 0);
    }

    #[test]
    fn a_loopback_still_down_is_brought_up_first() {
        let ns = NetnsGuard::create("lodown").unwrap();
        ip_show(&ns, &["link", "set", "lo", "down"]);
        assert!(!ip_show(&ns, &["link", "show", "lo"]).contains(",UP"));
        let netns = open(&ns);
        install_reply_routing(&netns).unwrap();
        assert!(ip_show(&ns, &["link", "show", "lo"]).contains(",UP"));
        let status = reply_routing_status(&netns).unwrap();
        assert!(status.is_installed(), "{status:?}");
        assert!(status.ipv6.is_some(), "IPv6 skipped: {status:?}");
        assert_eq!(dump_reply_routing(&ns, IpFamily::V6).1.len(), 1);
        remove_reply_routing(&netns).unwrap();
    }

    #[test]
    fn ipv6_disabled_is_skipped() {
        let ns = NetnsGuard::create("no6").unwrap();
        ns.run(|| fs::write("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1").unwrap())
            .unwrap();
        let netns = open(&ns);
        install_reply_routing(&netns).unwrap();
        let status = reply_routing_status(&netns).unwrap();
        assert_eq!(status.ipv6, None);
        assert_eq!(
            status.ipv4,
            FamilyStatus {
                rule: true,
                route: true
            }
        );
        assert!(status.is_installed());
        let (rules, routes) = dump_reply_routing(&ns, IpFamily::V6);
        assert_eq!((rules, routes.len()), (0, 0));
        remove_reply_routing(&netns).unwrap();
        assert_eq!(dump_reply_routing(&ns, IpFamily::V4).0, 0);
    }

    #[test]
    fn ipv6_disabled_on_the_loopback_alone_is_skipped() {
        let ns = NetnsGuard::create("lo6").unwrap();
        let netns = open(&ns);
        // Installed with IPv6 first, then IPv6 disabled on `lo` only: the
        // status no longer reads IPv6, and removal still takes its rule.
        install_reply_routing(&netns).unwrap();
        ns.run(|| fs::write("/proc/sys/net/ipv6/conf/lo/disable_ipv6", "1").unwrap())
            .unwrap();
        let status = reply_routing_status(&netns).unwrap();
        assert_eq!(status.ipv6, None, "{status:?}");
        assert!(status.is_installed(), "{status:?}");
        install_reply_routing(&netns).unwrap();
        remove_reply_routing(&netns).unwrap();
        assert_eq!(dump_reply_routing(&ns, IpFamily::V6).0, 0);
        assert_eq!(dump_reply_routing(&ns, IpFamily::V4).0, 0);
    }

    #[test]
    fn errors_say_what_failed_and_where() {
        let err = RoutingError::Netlink {
            what: format!("adding {}", rule_text(IpFamily::V4)),
            netns: "/run/netns/x".into(),
            source: NetlinkError::Kernel {
                errno: nix::errno::Errno::EPERM,
                detail: None,
            },
        };
        assert_eq!(
            err.to_string(),
            "adding IPv4 policy rule priority 32764 fwmark 0x111/0xfff lookup 100 \
             in /run/netns/x: Operation not permitted"
        );
    }

    #[test]
    fn kernel_refusals_carry_the_extended_ack_text() {
        // The IPv6 route on a loopback with IPv6 disabled, sent regardless.
        let ns = NetnsGuard::create("eack").unwrap();
        let err = ns
            .run(|| {
                fs::write("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1").unwrap();
                let mut rtnl = Rtnl::open().unwrap();
                let route = reply_route(IpFamily::V6, 1, false);
                rtnl.create(RouteNetlinkMessage::NewRoute(route), NLM_F_CREATE)
                    .unwrap_err()
            })
            .unwrap();
        let NetlinkError::Kernel { detail, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(
            detail.as_deref(),
            Some("IPv6 is disabled on nexthop device"),
            "{err}"
        );
    }

    /// Addresses no interface in the pod holds, reached only by routing.
    const ELSEWHERE_V4: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
    const ELSEWHERE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 1);
    const WAIT: Duration = Duration::from_millis(500);

    fn transparent_socket(addr: IpAddr, ty: Type) -> Socket {
        let socket = Socket::new(Domain::for_address(SocketAddr::new(addr, 0)), ty, None).unwrap();
        match addr {
            IpAddr::V4(_) => socket.set_ip_transparent_v4(true).unwrap(),
            IpAddr::V6(_) => socket.set_ip_transparent_v6(true).unwrap(),
        }
        socket
    }

    /// A pod with a default route to the node, so a reply that is not
    /// delivered locally has somewhere else to go (and is lost there).
    fn pod_with_default_routes() -> PodAndNode {
        let pn = PodAndNode::create().unwrap();
        let (v4, v6) = (
            PodAndNode::NODE.v4.to_string(),
            PodAndNode::NODE.v6.to_string(),
        );
        pn.pod.ip(&["route", "add", "default", "via", &v4]).unwrap();
        pn.pod
            .ip(&["-6", "route", "add", "default", "via", &v6])
            .unwrap();
        pn
    }

    /// Sends one datagram from a socket with `mark` to `elsewhere:port`,
    /// where a transparent socket in the pod listens; says whether it arrived.
    fn marked_datagram_arrives(pn: &PodAndNode, elsewhere: IpAddr, mark: u32) -> bool {
        pn.pod
            .run(|| {
                let listener = transparent_socket(elsewhere, Type::DGRAM);
                listener
                    .bind(&SocketAddr::new(elsewhere, 0).into())
                    .unwrap();
                listener.set_read_timeout(Some(WAIT)).unwrap();
                let to = listener.local_addr().unwrap();
                let sender = Socket::new(
                    Domain::for_address(to.as_socket().unwrap()),
                    Type::DGRAM,
                    None,
                )
                .unwrap();
                sender.set_mark(mark).unwrap();
                sender.send_to(b"reply", &to).unwrap();
                let mut buf = [std::mem::MaybeUninit::new(0u8); 16];
                match listener.recv(&mut buf) {
                    Ok(n) => n == 5,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
                    Err(e) => panic!("{e}"),
                }
            })
            .unwrap()
    }

    #[test]
    fn marked_packets_to_foreign_addresses_are_delivered_in_the_pod() {
        let pn = pod_with_default_routes();
        let pod = open(&pn.pod);
        for elsewhere in [IpAddr::V4(ELSEWHERE_V4), IpAddr::V6(ELSEWHERE_V6)] {
            assert!(
                !marked_datagram_arrives(&pn, elsewhere, REPLY_MARK),
                "{elsewhere} before"
            );
        }
        install_reply_routing(&pod).unwrap();
        for elsewhere in [IpAddr::V4(ELSEWHERE_V4), IpAddr::V6(ELSEWHERE_V6)] {
            assert!(
                marked_datagram_arrives(&pn, elsewhere, REPLY_MARK),
                "{elsewhere}"
            );
            // Only the reply mark (under its mask) is diverted.
            assert!(
                marked_datagram_arrives(&pn, elsewhere, 0xf111),
                "{elsewhere} 0xf111"
            );
            assert!(
                !marked_datagram_arrives(&pn, elsewhere, 0),
                "{elsewhere} unmarked"
            );
            assert!(
                !marked_datagram_arrives(&pn, elsewhere, 0x539),
                "{elsewhere} 0x539"
            );
        }
        remove_reply_routing(&pod).unwrap();
        for elsewhere in [IpAddr::V4(ELSEWHERE_V4), IpAddr::V6(ELSEWHERE_V6)] {
            assert!(
                !marked_datagram_arrives(&pn, elsewhere, REPLY_MARK),
                "{elsewhere} after"
            );
        }
    }

    /// ztunnel's inbound hop in miniature: a transparent client socket bound
    /// to a foreign (client) address connects, with `mark`, to an app
    /// listening on the pod's address. The SYN is local either way; the
    /// SYN-ACK and the data replies are addressed to the foreign address.
    /// Returns the accepted socket's mark when a request and its reply made
    /// it through, `None` when the handshake did not complete.
    fn spoofed_connection(pn: &PodAndNode, client: IpAddr, app: IpAddr, mark: u32) -> Option<u32> {
        pn.pod
            .run(|| {
                let listener = TcpListener::bind(SocketAddr::new(app, 0)).unwrap();
                let socket = transparent_socket(client, Type::STREAM);
                socket.set_mark(mark).unwrap();
                socket.bind(&SocketAddr::new(client, 0).into()).unwrap();
                let to = listener.local_addr().unwrap().into();
                if let Err(e) = socket.connect_timeout(&to, WAIT) {
                    assert!(
                        matches!(
                            e.kind(),
                            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                        ),
                        "{e}"
                    );
                    return None;
                }
                let (mut accepted, peer) = listener.accept().unwrap();
                assert_eq!(peer.ip(), client);
                let mut stream = std::net::TcpStream::from(socket);
                stream.set_read_timeout(Some(WAIT)).unwrap();
                stream.write_all(b"ping").unwrap();
                let mut buf = [0; 4];
                accepted.read_exact(&mut buf).unwrap();
                accepted.write_all(b"pong").unwrap();
                stream.read_exact(&mut buf).unwrap();
                assert_eq!(&buf, b"pong");
                Some(SockRef::from(&accepted).mark().unwrap())
            })
            .unwrap()
    }

    #[test]
    fn replies_of_a_marked_connection_reach_the_transparent_client() {
        let pn = pod_with_default_routes();
        let pod = open(&pn.pod);
        let pairs = [
            (IpAddr::V4(ELSEWHERE_V4), IpAddr::V4(PodAndNode::POD.v4)),
            (IpAddr::V6(ELSEWHERE_V6), IpAddr::V6(PodAndNode::POD.v6)),
        ];
        for (client, app) in pairs {
            assert_eq!(
                spoofed_connection(&pn, client, app, REPLY_MARK),
                None,
                "{client} before"
            );
        }
        install_reply_routing(&pod).unwrap();
        for (client, app) in pairs {
            // The accepted socket took the SYN's mark: every reply carries it.
            assert_eq!(
                spoofed_connection(&pn, client, app, REPLY_MARK),
                Some(REPLY_MARK),
                "{client}"
            );
            assert_eq!(
                spoofed_connection(&pn, client, app, 0),
                None,
                "{client} unmarked"
            );
        }
        // Rule and route alone are not enough: without tcp_fwmark_accept the
        // SYN-ACK leaves unmarked and goes out to the node.
        pn.pod
            .run(|| fs::write(TCP_FWMARK_ACCEPT, "0").unwrap())
            .unwrap();
        for (client, app) in pairs {
            assert_eq!(
                spoofed_connection(&pn, client, app, REPLY_MARK),
                None,
                "{client} sysctl 0"
            );
        }
        remove_reply_routing(&pod).unwrap();
        for (client, app) in pairs {
            assert_eq!(
                spoofed_connection(&pn, client, app, REPLY_MARK),
                None,
                "{client} after"
            );
        }
    }
}
