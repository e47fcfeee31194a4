//! The `nft -f -` scripts: Istio 1.28's in-pod tables (its
//! `cni/pkg/nftables/testdata/*.golden`), the host's probe table, and their
//! removal. Each table is added (with ambpf's comment), flushed and rebuilt
//! in the one transaction, as knftables does.

use std::fmt::Write;

use super::{
    MANGLE_TABLE, NAT_TABLE, OWNED_COMMENT, PROBE_SET_V4, PROBE_SET_V6, RAW_TABLE, ZONE_DNS,
};
use crate::redirect::in_pod::{PROBE_SNAT_V4, PROBE_SNAT_V6};

const MARK: &str = "0x539";
const MASK: &str = "0xfff";
const TPROXY_MARK: &str = "0x111";

/// One table's script: base chains `(name, type, hook, priority)`, the
/// `istio-*` chains they jump to, and the rules `(chain, rule)` in order.
struct Table<'a> {
    name: &'a str,
    base: [(&'a str, &'a str, &'a str, i32); 2],
    rules: Vec<(&'a str, String)>,
}

impl Table<'_> {
    fn render(&self, out: &mut String) {
        let t = self.name;
        writeln!(
            out,
            "add table inet {t} {{ comment \"{OWNED_COMMENT}\" ; }}"
        )
        .unwrap();
        writeln!(out, "flush table inet {t}").unwrap();
        for (chain, kind, hook, prio) in self.base {
            writeln!(
                out,
                "add chain inet {t} {chain} {{ type {kind} hook {hook} priority {prio} ; }}"
            )
            .unwrap();
        }
        for chain in ["istio-prerouting", "istio-output"] {
            writeln!(out, "add chain inet {t} {chain}").unwrap();
        }
        for (chain, rule) in &self.rules {
            writeln!(out, "add rule inet {t} {chain} {rule}").unwrap();
        }
    }
}

fn rule(chain: &'static str, text: impl Into<String>) -> (&'static str, String) {
    (chain, text.into())
}

/// The pod's three tables, in one script. `ipv6`: the kernel has IPv6 (the
/// `ip6` rules are Istio's `AppendV6RuleIfSupported`). Without DNS capture
/// the raw table is removed rather than left from an earlier write.
pub fn pod_script(dns_capture: bool, ipv6: bool) -> String {
    pod_script_with(dns_capture, ipv6, true)
}

/// [`pod_script`], or with `redirects` false, the same tables with the nat
/// chains empty: their hooks registered (conntrack tracks every connection
/// from its first packet, untranslated), nothing redirected.
pub fn pod_script_with(dns_capture: bool, ipv6: bool, redirects: bool) -> String {
    let (pre, out) = ("istio-prerouting", "istio-output");
    let v6 = |r: (&'static str, String)| ipv6.then_some(r);
    let not_ours = format!("mark and {MASK} != {MARK}");
    let mut nat: Vec<(&str, String)> = vec![
        rule("output", "jump istio-output"),
        rule("prerouting", "jump istio-prerouting"),
    ];
    nat.push(rule(
        pre,
        format!("meta l4proto tcp ip saddr {PROBE_SNAT_V4} counter accept"),
    ));
    nat.extend(v6(rule(
        pre,
        format!("meta l4proto tcp ip6 saddr {PROBE_SNAT_V6} counter accept"),
    )));
    nat.push(rule(
        out,
        format!("meta l4proto tcp ip daddr {PROBE_SNAT_V4} counter accept"),
    ));
    nat.extend(v6(rule(
        out,
        format!("meta l4proto tcp ip6 daddr {PROBE_SNAT_V6} counter accept"),
    )));
    nat.push(rule(
        pre,
        format!(
            "ip daddr != 127.0.0.1/32 tcp dport != 15008 {not_ours} counter redirect to :15006"
        ),
    ));
    nat.extend(v6(rule(
        pre,
        format!("ip6 daddr != ::1/128 tcp dport != 15008 {not_ours} counter redirect to :15006"),
    )));
    if dns_capture {
        nat.push(rule(
            out,
            format!("oifname != lo {not_ours} udp dport 53 counter redirect to :15053"),
        ));
        nat.push(rule(
            out,
            format!("ip daddr != 127.0.0.1/32 tcp dport 53 {not_ours} counter redirect to :15053"),
        ));
        nat.extend(v6(rule(
            out,
            format!("ip6 daddr != ::1/128 tcp dport 53 {not_ours} counter redirect to :15053"),
        )));
    }
    nat.push(rule(
        out,
        format!("meta l4proto tcp mark and {MASK} == {TPROXY_MARK} counter accept"),
    ));
    nat.push(rule(
        out,
        "oifname lo ip daddr != 127.0.0.1/32 counter accept",
    ));
    nat.extend(v6(rule(
        out,
        "oifname lo ip6 daddr != ::1/128 counter accept",
    )));
    nat.push(rule(
        out,
        format!("meta l4proto tcp ip daddr != 127.0.0.1/32 {not_ours} counter redirect to :15001"),
    ));
    nat.extend(v6(rule(
        out,
        format!("meta l4proto tcp ip6 daddr != ::1/128 {not_ours} counter redirect to :15001"),
    )));

    if !redirects {
        nat.truncate(2);
    }
    let mut script = String::new();
    Table {
        name: NAT_TABLE,
        base: [
            ("prerouting", "nat", "prerouting", -100),
            ("output", "nat", "output", -100),
        ],
        rules: nat,
    }
    .render(&mut script);
    Table {
        name: MANGLE_TABLE,
        base: [
            ("prerouting", "filter", "prerouting", -150),
            ("output", "route", "output", -150),
        ],
        rules: vec![
            rule("prerouting", "jump istio-prerouting"),
            rule("output", "jump istio-output"),
            rule(
                pre,
                format!(
                    "meta mark & {MASK} == {MARK} counter ct mark set ct mark & 0xfffff000 | \
                     {TPROXY_MARK}"
                ),
            ),
            rule(
                out,
                format!("ct mark and {MASK} == {TPROXY_MARK} counter meta mark set ct mark"),
            ),
        ],
    }
    .render(&mut script);
    if dns_capture {
        Table {
            name: RAW_TABLE,
            base: [
                ("prerouting", "filter", "prerouting", -300),
                ("output", "filter", "output", -300),
            ],
            rules: vec![
                rule("prerouting", "jump istio-prerouting"),
                rule("output", "jump istio-output"),
                rule(
                    out,
                    format!(
                        "udp dport 53 meta mark and {MASK} == {MARK} counter ct zone set {ZONE_DNS}"
                    ),
                ),
                rule(
                    pre,
                    format!(
                        "udp sport 53 meta mark and {MASK} != {MARK} counter ct zone set {ZONE_DNS}"
                    ),
                ),
            ],
        }
        .render(&mut script);
    } else {
        script.push_str(&delete_tables(&[RAW_TABLE]));
    }
    script
}

/// The opt-out transaction of Istio's `DeleteInpodRules`
/// (`cni/pkg/nftables/nftables.go`): a plain `delete table` of each pod
/// table, which fails the whole transaction if one is missing. Istio names
/// the raw table always, so for a pod without DNS capture (no raw table)
/// its transaction fails and every table stays; ambpf names the raw table
/// only when it wrote it.
pub fn istio_delete_pod_tables(dns_capture: bool) -> String {
    let tables: &[&str] = if dns_capture {
        &[NAT_TABLE, MANGLE_TABLE, RAW_TABLE]
    } else {
        &[NAT_TABLE, MANGLE_TABLE]
    };
    tables
        .iter()
        .map(|t| format!("delete table inet {t}\n"))
        .collect()
}

/// Deletes the `inet` tables `names`, whether they exist or not (a delete
/// of a missing table would fail the transaction, so each is added first).
pub fn delete_tables(names: &[&str]) -> String {
    let mut out = String::new();
    for t in names {
        writeln!(out, "add table inet {t}\ndelete table inet {t}").unwrap();
    }
    out
}

/// The host's table: the probe sets and the postrouting SNAT of TCP from
/// local sockets to their members (Istio's `hostprobe.golden`, matching any
/// local socket where Istio matches kubelet's UID; see the module docs).
/// The sets are created if missing and never flushed: their members
/// outlive an agent restart.
pub fn host_script(ipv6: bool) -> String {
    let t = NAT_TABLE;
    let mut out = String::new();
    writeln!(
        out,
        "add table inet {t} {{ comment \"{OWNED_COMMENT}\" ; }}"
    )
    .unwrap();
    writeln!(
        out,
        "add chain inet {t} postrouting {{ type nat hook postrouting priority 100 ; }}"
    )
    .unwrap();
    writeln!(out, "flush chain inet {t} postrouting").unwrap();
    let families = [
        ("ipv4_addr", PROBE_SET_V4, "ip", PROBE_SNAT_V4.to_string()),
        ("ipv6_addr", PROBE_SET_V6, "ip6", PROBE_SNAT_V6.to_string()),
    ];
    for (kind, set, proto, snat) in families.iter().take(if ipv6 { 2 } else { 1 }) {
        writeln!(
            out,
            "add set inet {t} {set} {{ type {kind} ; comment \"ambient pods' addresses\" ; }}"
        )
        .unwrap();
        writeln!(
            out,
            "add rule inet {t} postrouting meta l4proto tcp meta skuid >= 0 {proto} daddr @{set} \
             counter snat {proto} to {snat}"
        )
        .unwrap();
    }
    out
}

/// Sets each of `elements` (address, owner comment) as a member of its
/// family's probe set, replacing the comment of one already there.
pub fn add_elements(elements: &[(std::net::IpAddr, String)]) -> String {
    let mut out = String::new();
    for (ip, comment) in elements {
        let set = format!("inet {NAT_TABLE} {}", set_of(ip));
        writeln!(out, "add element {set} {{ {ip} }}").unwrap();
        writeln!(out, "delete element {set} {{ {ip} }}").unwrap();
        writeln!(out, "add element {set} {{ {ip} comment \"{comment}\" }}").unwrap();
    }
    out
}

/// Removes each of `ips` from its probe set, whether there or not.
pub fn delete_elements(ips: &[std::net::IpAddr]) -> String {
    let mut out = String::new();
    for ip in ips {
        let set = format!("inet {NAT_TABLE} {}", set_of(ip));
        writeln!(out, "add element {set} {{ {ip} }}").unwrap();
        writeln!(out, "delete element {set} {{ {ip} }}").unwrap();
    }
    out
}

pub fn set_of(ip: &std::net::IpAddr) -> &'static str {
    if ip.is_ipv4() {
        PROBE_SET_V4
    } else {
        PROBE_SET_V6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Istio's `default.golden` (IPv4, DNS capture on), whitespace
    /// normalised.
    const DEFAULT_GOLDEN: &str = "\
add table inet istio-ambient-nat
flush table inet istio-ambient-nat
add chain inet istio-ambient-nat prerouting { type nat hook prerouting priority -100 ; }
add chain inet istio-ambient-nat output { type nat hook output priority -100 ; }
add chain inet istio-ambient-nat istio-prerouting
add chain inet istio-ambient-nat istio-output
add rule inet istio-ambient-nat output jump istio-output
add rule inet istio-ambient-nat prerouting jump istio-prerouting
add rule inet istio-ambient-nat istio-prerouting meta l4proto tcp ip saddr 169.254.7.127 counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip daddr 169.254.7.127 counter accept
add rule inet istio-ambient-nat istio-prerouting ip daddr != 127.0.0.1/32 tcp dport != 15008 mark and 0xfff != 0x539 counter redirect to :15006
add rule inet istio-ambient-nat istio-output oifname != lo mark and 0xfff != 0x539 udp dport 53 counter redirect to :15053
add rule inet istio-ambient-nat istio-output ip daddr != 127.0.0.1/32 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053
add rule inet istio-ambient-nat istio-output meta l4proto tcp mark and 0xfff == 0x111 counter accept
add rule inet istio-ambient-nat istio-output oifname lo ip daddr != 127.0.0.1/32 counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip daddr != 127.0.0.1/32 mark and 0xfff != 0x539 counter redirect to :15001
add table inet istio-ambient-mangle
flush table inet istio-ambient-mangle
add chain inet istio-ambient-mangle prerouting { type filter hook prerouting priority -150 ; }
add chain inet istio-ambient-mangle output { type route hook output priority -150 ; }
add chain inet istio-ambient-mangle istio-prerouting
add chain inet istio-ambient-mangle istio-output
add rule inet istio-ambient-mangle prerouting jump istio-prerouting
add rule inet istio-ambient-mangle output jump istio-output
add rule inet istio-ambient-mangle istio-prerouting meta mark & 0xfff == 0x539 counter ct mark set ct mark & 0xfffff000 | 0x111
add rule inet istio-ambient-mangle istio-output ct mark and 0xfff == 0x111 counter meta mark set ct mark
add table inet istio-ambient-raw
flush table inet istio-ambient-raw
add chain inet istio-ambient-raw prerouting { type filter hook prerouting priority -300 ; }
add chain inet istio-ambient-raw output { type filter hook output priority -300 ; }
add chain inet istio-ambient-raw istio-prerouting
add chain inet istio-ambient-raw istio-output
add rule inet istio-ambient-raw prerouting jump istio-prerouting
add rule inet istio-ambient-raw output jump istio-output
add rule inet istio-ambient-raw istio-output udp dport 53 meta mark and 0xfff == 0x539 counter ct zone set 1
add rule inet istio-ambient-raw istio-prerouting udp sport 53 meta mark and 0xfff != 0x539 counter ct zone set 1
";

    /// The script without ambpf's table comments, for comparison.
    fn without_comment(script: &str) -> String {
        script.replace(&format!(" {{ comment \"{OWNED_COMMENT}\" ; }}"), "")
    }

    #[test]
    fn the_ipv4_script_is_istios_default_golden() {
        assert_eq!(without_comment(&pod_script(true, false)), DEFAULT_GOLDEN);
    }

    #[test]
    fn every_table_carries_ambpfs_comment() {
        let script = pod_script(true, true);
        for t in [NAT_TABLE, MANGLE_TABLE, RAW_TABLE] {
            let line = format!("add table inet {t} {{ comment \"{OWNED_COMMENT}\" ; }}\n");
            assert!(script.contains(&line), "{t}");
        }
    }

    #[test]
    fn ipv6_adds_istios_ip6_rules_after_each_ipv4_one() {
        let script = without_comment(&pod_script(true, true));
        let v4: Vec<&str> = DEFAULT_GOLDEN.lines().collect();
        let v6: Vec<&str> = script.lines().filter(|l| !v4.contains(l)).collect();
        // Istio's `dns_pod_disabled_and_on_globally_ipv6.golden` and the DNS
        // rule's ip6 twin.
        assert_eq!(
            v6,
            [
                "add rule inet istio-ambient-nat istio-prerouting meta l4proto tcp ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter accept",
                "add rule inet istio-ambient-nat istio-output meta l4proto tcp ip6 daddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter accept",
                "add rule inet istio-ambient-nat istio-prerouting ip6 daddr != ::1/128 tcp dport != 15008 mark and 0xfff != 0x539 counter redirect to :15006",
                "add rule inet istio-ambient-nat istio-output ip6 daddr != ::1/128 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053",
                "add rule inet istio-ambient-nat istio-output oifname lo ip6 daddr != ::1/128 counter accept",
                "add rule inet istio-ambient-nat istio-output meta l4proto tcp ip6 daddr != ::1/128 mark and 0xfff != 0x539 counter redirect to :15001",
            ]
        );
        // Each ip6 rule follows its ip twin in its chain.
        let lines: Vec<&str> = script.lines().collect();
        for rule in v6 {
            let at = lines.iter().position(|l| *l == rule).unwrap();
            assert!(lines[at - 1].contains(" ip ") || lines[at - 1].contains("127.0.0.1"));
        }
    }

    #[test]
    fn the_opt_out_deletes_the_tables_the_pod_has_in_one_transaction() {
        assert_eq!(
            istio_delete_pod_tables(true),
            "delete table inet istio-ambient-nat\n\
             delete table inet istio-ambient-mangle\n\
             delete table inet istio-ambient-raw\n"
        );
        assert_eq!(
            istio_delete_pod_tables(false),
            "delete table inet istio-ambient-nat\ndelete table inet istio-ambient-mangle\n"
        );
    }

    #[test]
    fn without_dns_capture_there_is_no_dns_rule_and_the_raw_table_goes() {
        let script = pod_script(false, true);
        assert!(!script.contains("15053") && !script.contains("ct zone"));
        assert!(
            script.ends_with(
                "add table inet istio-ambient-raw\ndelete table inet istio-ambient-raw\n"
            )
        );
    }

    #[test]
    fn the_host_script_is_istios_hostprobe_golden_with_any_local_socket() {
        let script = host_script(true);
        assert!(script.contains(
            "add rule inet istio-ambient-nat postrouting meta l4proto tcp meta skuid >= 0 ip \
             daddr @istio-inpod-probes-v4 counter snat ip to 169.254.7.127\n"
        ));
        assert!(script.contains(
            "add rule inet istio-ambient-nat postrouting meta l4proto tcp meta skuid >= 0 ip6 \
             daddr @istio-inpod-probes-v6 counter snat ip6 to \
             fd16:9254:7127:1337:ffff:ffff:ffff:ffff\n"
        ));
        assert!(
            script.contains("priority 100 ;"),
            "Istio's postrouting priority"
        );
        assert!(!host_script(false).contains("v6"));
        assert!(!script.contains("flush table"), "set members survive");
    }
}
