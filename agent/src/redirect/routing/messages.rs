//! The reply rule and route as netlink messages, and how to recognise them in a
//! dump.

use super::*;

/// An IP version, for messages and netlink requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub(super) fn address_family(self) -> AddressFamily {
        match self {
            Self::V4 => AddressFamily::Inet,
            Self::V6 => AddressFamily::Inet6,
        }
    }

    pub(super) fn default_prefix(self) -> &'static str {
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

/// The rule as `ip rule` prints it, for messages.
pub(super) fn rule_text(family: IpFamily) -> String {
    format!(
        "{family} policy rule priority {REPLY_RULE_PRIORITY} fwmark {REPLY_MARK:#x}/{MARK_MASK:#x} \
         lookup {REPLY_ROUTE_TABLE}"
    )
}

pub(super) fn route_text(family: IpFamily, lo: &str) -> String {
    format!(
        "{family} route local {} dev {lo} table {REPLY_ROUTE_TABLE}",
        family.default_prefix()
    )
}

/// The routing-table id in a message header: ids above 255 travel only in
/// the `*_TABLE` attribute, with `RT_TABLE_UNSPEC` in the header.
pub(super) fn header_table(id: u32) -> u8 {
    u8::try_from(id).unwrap_or(0)
}

pub(super) fn reply_rule(family: IpFamily) -> RuleMessage {
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

pub(super) fn is_reply_rule(rule: &RuleMessage, family: IpFamily) -> bool {
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

/// `local default dev lo table 100`, with the protocol Istio's node agent
/// gives it (`boot`, netlink's default for a route added without one: `ip
/// route` prints Istio's and ours alike). For a deletion the protocol is
/// left unspecified and the scope is `RT_SCOPE_NOWHERE`, both wildcards to
/// the kernel (as `ip route del` sends them).
pub(super) fn reply_route(family: IpFamily, lo_index: u32, for_delete: bool) -> RouteMessage {
    let mut route = RouteMessage::default();
    route.header.address_family = family.address_family();
    route.header.destination_prefix_length = 0;
    route.header.table = header_table(REPLY_ROUTE_TABLE);
    route.header.kind = RouteType::Local;
    if for_delete {
        route.header.protocol = RouteProtocol::Unspec;
        route.header.scope = RouteScope::NoWhere;
    } else {
        route.header.protocol = RouteProtocol::Boot;
        route.header.scope = RouteScope::Host;
    }
    route.attributes = vec![
        RouteAttribute::Table(REPLY_ROUTE_TABLE),
        RouteAttribute::Oif(lo_index),
    ];
    route
}

pub(super) fn is_reply_route(route: &RouteMessage, family: IpFamily, lo_index: u32) -> bool {
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
