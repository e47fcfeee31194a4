//! The rule model: what is written in a pod's or the host's namespace, how
//! `iptables-save` output is read back, and the restore input that turns
//! one into the other.

use std::collections::{BTreeMap, BTreeSet};

use ambpf_common::ztunnel::{
    DNS_PORT, HBONE_PORT, INBOUND_PORT, MARK, MARK_MASK, OUTBOUND_PORT, REPLY_MARK,
};

use super::{CHAIN_OUTPUT, CHAIN_POSTROUTING, CHAIN_PREROUTING, Family};

/// Conntrack zone of the DNS proxy's upstream traffic.
const DNS_CT_ZONE: u16 = 1;
/// `CONNMARK --restore-mark` masks (Istio's `InpodRestoreMask`).
const RESTORE_MASK: u32 = 0xffff_ffff;

/// A jump from a built-in chain into one of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Jump {
    from: &'static str,
    to: &'static str,
    /// `-I <from> 1` rather than `-A <from>`.
    first: bool,
}

impl Jump {
    const fn append(from: &'static str, to: &'static str) -> Self {
        Self {
            from,
            to,
            first: false,
        }
    }

    fn add(&self) -> String {
        if self.first {
            format!("-I {} 1 -j {}", self.from, self.to)
        } else {
            format!("-A {} -j {}", self.from, self.to)
        }
    }

    fn delete(&self) -> String {
        format!("-D {} -j {}", self.from, self.to)
    }
}

/// Our chains, jumps and rules in one table.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TableRules {
    table: &'static str,
    /// In declaration order.
    chains: Vec<&'static str>,
    jumps: Vec<Jump>,
    /// Complete `-A <chain> ...` lines, in order.
    rules: Vec<String>,
}

/// Everything we write in one namespace for one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSet {
    pub family: Family,
    tables: Vec<TableRules>,
}

impl RuleSet {
    fn table(&self, name: &str) -> Option<&TableRules> {
        self.tables.iter().find(|t| t.table == name)
    }

    pub(super) fn empty(family: Family) -> Self {
        Self {
            family,
            tables: Vec::new(),
        }
    }

    /// The rule set with the nat chains empty: their hooks registered (so
    /// conntrack tracks every connection from its first packet, with no
    /// translation), nothing redirected.
    pub(super) fn without_redirects(mut self) -> Self {
        for table in self.tables.iter_mut().filter(|t| t.table == "nat") {
            table.rules.clear();
        }
        self
    }

    /// The tables that capture (nat and raw), without mangle's reply path:
    /// the connmark rules that carry the replies of connections ztunnel
    /// already proxies, which capture nothing.
    pub(super) fn capture_only(mut self) -> Self {
        self.tables.retain(|t| t.table != "mangle");
        self
    }
}

/// The in-pod rule set of Istio for `family`, with or without DNS capture.
pub fn pod_rules(family: Family, dns_capture: bool) -> RuleSet {
    let (prert, output) = (CHAIN_PREROUTING, CHAIN_OUTPUT);
    let mark = format!("{MARK:#x}/{MARK_MASK:#x}");
    let reply_mark = format!("{REPLY_MARK:#x}/{MARK_MASK:#x}");
    let lo = family.loopback();
    let probe = family.probe_snat();

    let mangle = TableRules {
        table: "mangle",
        chains: vec![prert, output],
        jumps: vec![
            Jump::append("PREROUTING", prert),
            Jump::append("OUTPUT", output),
        ],
        rules: vec![
            format!("-A {prert} -m mark --mark {mark} -j CONNMARK --set-xmark {reply_mark}"),
            format!(
                "-A {output} -m connmark --mark {reply_mark} -j CONNMARK --restore-mark \
                 --nfmask {RESTORE_MASK:#x} --ctmask {RESTORE_MASK:#x}"
            ),
        ],
    };

    let mut nat_rules = vec![
        format!("-A {prert} -s {probe} -p tcp -m tcp -j ACCEPT"),
        format!("-A {output} -d {probe} -p tcp -m tcp -j ACCEPT"),
        format!(
            "-A {prert} ! -d {lo} -p tcp ! --dport {HBONE_PORT} -m mark ! --mark {mark} \
             -j REDIRECT --to-ports {INBOUND_PORT}"
        ),
    ];
    if dns_capture {
        nat_rules.push(format!(
            "-A {output} ! -o lo -p udp -m mark ! --mark {mark} -m udp --dport 53 \
             -j REDIRECT --to-port {DNS_PORT}"
        ));
        nat_rules.push(format!(
            "-A {output} ! -d {lo} -p tcp --dport 53 -m mark ! --mark {mark} \
             -j REDIRECT --to-ports {DNS_PORT}"
        ));
    }
    nat_rules.extend([
        format!("-A {output} -p tcp -m mark --mark {reply_mark} -j ACCEPT"),
        format!("-A {output} ! -d {lo} -o lo -j ACCEPT"),
        format!(
            "-A {output} ! -d {lo} -p tcp -m mark ! --mark {mark} \
             -j REDIRECT --to-ports {OUTBOUND_PORT}"
        ),
    ]);
    let nat = TableRules {
        table: "nat",
        chains: vec![prert, output],
        jumps: vec![
            Jump::append("OUTPUT", output),
            Jump::append("PREROUTING", prert),
        ],
        rules: nat_rules,
    };

    let mut tables = vec![mangle, nat];
    if dns_capture {
        tables.push(TableRules {
            table: "raw",
            chains: vec![output, prert],
            jumps: vec![
                Jump::append("PREROUTING", prert),
                Jump::append("OUTPUT", output),
            ],
            rules: vec![
                format!(
                    "-A {output} -p udp -m mark --mark {mark} -m udp --dport 53 \
                     -j CT --zone {DNS_CT_ZONE}"
                ),
                format!(
                    "-A {prert} -p udp -m mark ! --mark {mark} -m udp --sport 53 \
                     -j CT --zone {DNS_CT_ZONE}"
                ),
            ],
        });
    }
    RuleSet { family, tables }
}

/// Istio's `DeleteInpodRules` (`cni/pkg/iptables/iptables.go`,
/// `executeDeleteCommands`): the arguments of one `iptables` command each,
/// in Istio's order. The six jumps go first (nat `OUTPUT` before raw, nat
/// `PREROUTING` last, as Istio lists them), then both chains are flushed in
/// mangle, nat and raw, then deleted in the same order.
pub(super) fn istio_delete_commands() -> Vec<Vec<&'static str>> {
    let (prert, output) = (CHAIN_PREROUTING, CHAIN_OUTPUT);
    let jumps = [
        ("mangle", "PREROUTING", prert),
        ("mangle", "OUTPUT", output),
        ("nat", "OUTPUT", output),
        ("raw", "PREROUTING", prert),
        ("raw", "OUTPUT", output),
        ("nat", "PREROUTING", prert),
    ];
    let mut commands: Vec<Vec<&str>> = jumps
        .iter()
        .map(|&(table, from, to)| vec!["-t", table, "-D", from, "-j", to])
        .collect();
    for op in ["-F", "-X"] {
        for table in ["mangle", "nat", "raw"] {
            for chain in [prert, output] {
                commands.push(vec!["-t", table, op, chain]);
            }
        }
    }
    commands
}

/// The host rule set for `family`: SNAT of host-process TCP to pods in the
/// probe ipset.
pub fn host_rules(family: Family) -> RuleSet {
    let chain = CHAIN_POSTROUTING;
    RuleSet {
        family,
        tables: vec![TableRules {
            table: "nat",
            chains: vec![chain],
            jumps: vec![Jump {
                from: "POSTROUTING",
                to: chain,
                first: true,
            }],
            rules: vec![format!(
                "-A {chain} -m owner --socket-exists -p tcp -m set --match-set {} dst \
                 -j SNAT --to-source {}",
                family.probe_ipset(),
                family.probe_snat()
            )],
        }],
    }
}

/// One namespace's rules as `iptables-save` prints them, per table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedRules {
    tables: BTreeMap<String, SavedTable>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct SavedTable {
    chains: BTreeSet<String>,
    rules: Vec<String>,
}

impl SavedRules {
    pub fn parse(save: &str) -> Self {
        let mut out = Self::default();
        let mut table: Option<&mut SavedTable> = None;
        for line in save.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('*') {
                table = Some(out.tables.entry(name.trim().to_owned()).or_default());
            } else if line == "COMMIT" {
                table = None;
            } else if let Some(t) = table.as_deref_mut() {
                if let Some(decl) = line.strip_prefix(':') {
                    if let Some(name) = decl.split_whitespace().next() {
                        t.chains.insert(name.to_owned());
                    }
                } else if line.starts_with("-A ") {
                    t.rules.push(line.to_owned());
                }
            }
        }
        out
    }

    pub(super) fn has_chain(&self, table: &str, chain: &str) -> bool {
        self.tables
            .get(table)
            .is_some_and(|t| t.chains.contains(chain))
    }

    /// How many copies of exactly `-A <from> -j <to>` the table holds.
    fn jumps(&self, table: &str, jump: &Jump) -> usize {
        self.tables.get(table).map_or(0, |t| {
            t.rules
                .iter()
                .filter(|r| r.split_whitespace().eq(["-A", jump.from, "-j", jump.to]))
                .count()
        })
    }

    /// Whether the capture of [`pod_rules`] is in place: nat PREROUTING and
    /// OUTPUT jump to ambpf's chains, which redirect to ztunnel's inbound
    /// and outbound ports.
    pub fn captures(&self) -> bool {
        let jumps = |from, to| self.jumps("nat", &Jump::append(from, to)) > 0;
        let redirects = |chain: &str, port: u16| {
            let target = format!("-j REDIRECT --to-ports {port}");
            self.chain_rules("nat", chain)
                .iter()
                .any(|rule| rule.ends_with(&target))
        };
        jumps("PREROUTING", CHAIN_PREROUTING)
            && jumps("OUTPUT", CHAIN_OUTPUT)
            && redirects(CHAIN_PREROUTING, INBOUND_PORT)
            && redirects(CHAIN_OUTPUT, OUTBOUND_PORT)
    }

    /// Whether the probe SNAT of [`host_rules`] is in place for `family`:
    /// nat POSTROUTING jumps to its chain, which SNATs the probe ipset's
    /// members.
    pub fn snats_probes(&self, family: Family) -> bool {
        let jump = Jump::append("POSTROUTING", CHAIN_POSTROUTING);
        let matches_set = format!("--match-set {} dst", family.probe_ipset());
        let snat = format!("-j SNAT --to-source {}", family.probe_snat());
        self.jumps("nat", &jump) > 0
            && self
                .chain_rules("nat", CHAIN_POSTROUTING)
                .iter()
                .any(|rule| rule.contains(&matches_set) && rule.ends_with(&snat))
    }

    /// The `-A` lines of `chain` in `table`.
    pub fn chain_rules(&self, table: &str, chain: &str) -> Vec<String> {
        let prefix = format!("-A {chain} ");
        self.tables.get(table).map_or_else(Vec::new, |t| {
            t.rules
                .iter()
                .filter(|r| r.starts_with(&prefix))
                .cloned()
                .collect()
        })
    }

    /// Whether any of Istio's chains (ISTIO_*) exists in any table.
    pub fn has_istio_chains(&self) -> bool {
        self.tables
            .values()
            .any(|t| t.chains.iter().any(|c| c.starts_with("ISTIO_")))
    }

    /// Whether any chain `set` declares exists in its table.
    pub(super) fn has_any_chain_of(&self, set: &RuleSet) -> bool {
        set.tables
            .iter()
            .any(|t| t.chains.iter().any(|c| self.has_chain(t.table, c)))
    }

    /// What Istio-named in these rules is not ambpf's, against `owned` (the
    /// most ambpf writes in such a namespace): `ISTIO_*` chains `owned` does
    /// not declare in that table, and rules in the ones it does whose target
    /// none of `owned`'s rules in that table has. Targets rather than whole
    /// rules are compared, because each backend prints a rule its own way
    /// (`-s 169.254.7.127/32`, added `-m tcp`, ...). The chains of `skipped`
    /// are neither.
    pub(super) fn foreign_istio_chains(&self, owned: &RuleSet, skipped: &RuleSet) -> Vec<String> {
        let mut foreign = Vec::new();
        for (name, table) in &self.tables {
            let owned_table = owned.table(name);
            let chains: &[&str] = owned_table.map_or(&[], |t| &t.chains);
            let skipped: &[&str] = skipped.table(name).map_or(&[], |t| &t.chains);
            let targets: BTreeSet<&str> = owned_table
                .into_iter()
                .flat_map(|t| &t.rules)
                .filter_map(|rule| rule_target(rule))
                .collect();
            for chain in table.chains.iter().filter(|c| c.starts_with("ISTIO_")) {
                if skipped.contains(&chain.as_str()) {
                    continue;
                }
                if !chains.contains(&chain.as_str()) {
                    foreign.push(format!("{name} {chain}"));
                    continue;
                }
                for rule in self.chain_rules(name, chain) {
                    match rule_target(&rule) {
                        Some(target) if targets.contains(target) => {}
                        Some(target) => foreign.push(format!("{name} {chain} -j {target}")),
                        None => foreign.push(format!("{name} {chain}: `{rule}`")),
                    }
                }
            }
        }
        foreign
    }

    /// Tables holding one of Istio's chains.
    pub fn tables_with_istio_chains(&self) -> Vec<String> {
        self.tables
            .iter()
            .filter(|(_, t)| t.chains.iter().any(|c| c.starts_with("ISTIO_")))
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// The target of a rule (`-j TARGET`, `--jump TARGET`), if it has one.
fn rule_target(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    words.find(|w| *w == "-j" || *w == "--jump")?;
    words.next()
}

/// The restore input (for `--noflush`) that turns `current` into `wanted`
/// for the chains of `owned` (everything we may have written in such a
/// namespace); empty when there is nothing to do. Tables of `owned` that
/// `wanted` leaves out are cleaned of our chains and jumps.
pub(super) fn render(owned: &RuleSet, wanted: &RuleSet, current: &SavedRules) -> String {
    let mut out = String::new();
    for owned_table in &owned.tables {
        let name = owned_table.table;
        let mut lines: Vec<String> = Vec::new();
        let wanted_table = wanted.table(name);
        let keep_chains: &[&str] = wanted_table.map_or(&[], |t| &t.chains);
        let keep_jumps: &[Jump] = wanted_table.map_or(&[], |t| &t.jumps);
        let stale_chains: Vec<&str> = owned_table
            .chains
            .iter()
            .copied()
            .filter(|c| !keep_chains.contains(c) && current.has_chain(name, c))
            .collect();
        let stale_jumps: Vec<(Jump, usize)> = owned_table
            .jumps
            .iter()
            .filter(|j| !keep_jumps.contains(j))
            .map(|j| (*j, current.jumps(name, j)))
            .filter(|(_, n)| *n > 0)
            .collect();
        if wanted_table.is_none() && stale_chains.is_empty() && stale_jumps.is_empty() {
            continue;
        }
        // Declaring a chain creates it, or flushes it if it exists.
        for chain in keep_chains.iter().chain(&stale_chains) {
            lines.push(format!(":{chain} - [0:0]"));
        }
        for jump in keep_jumps {
            match current.jumps(name, jump) {
                0 => lines.push(jump.add()),
                n => lines.extend((1..n).map(|_| jump.delete())),
            }
        }
        for (jump, copies) in stale_jumps {
            lines.extend((0..copies).map(|_| jump.delete()));
        }
        for chain in stale_chains {
            lines.push(format!("-X {chain}"));
        }
        if let Some(t) = wanted_table {
            lines.extend(t.rules.iter().cloned());
        }
        out.push_str(&format!("*{name}\n"));
        for line in lines {
            out.push_str(&line);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The restore input that writes `wanted` into a namespace without rules.
pub fn render_fresh(wanted: &RuleSet) -> String {
    render(wanted, wanted, &SavedRules::default())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Istio's golden files write chains with `-N`; our restore input
    /// declares them with `:CHAIN - [0:0]` instead (creates the chain, or
    /// flushes it when it exists, so that enrolling again is idempotent).
    /// Everything else is compared verbatim.
    fn from_golden(golden: &str) -> String {
        golden
            .lines()
            .map(|line| match line.strip_prefix("-N ") {
                Some(chain) => format!(":{chain} - [0:0]\n"),
                None => format!("{line}\n"),
            })
            .collect()
    }

    /// `cni/pkg/iptables/testdata/default_ipv6.golden` (istio/istio, the
    /// iptables-restore generation of the file), its IPv4 half.
    const GOLDEN_DEFAULT_V4: &str = "\
* mangle
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
* nat
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_PRERT -s 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT
* raw
-N ISTIO_OUTPUT
-N ISTIO_PRERT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT";

    /// The IPv6 half of the same file, with the probe address Istio
    /// defaults to (the golden file configures a random one,
    /// `e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164`).
    const GOLDEN_DEFAULT_V6: &str = "\
* mangle
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
* nat
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_PRERT -s fd16:9254:7127:1337:ffff:ffff:ffff:ffff -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d fd16:9254:7127:1337:ffff:ffff:ffff:ffff -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d ::1/128 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT ! -d ::1/128 -p tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d ::1/128 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d ::1/128 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT
* raw
-N ISTIO_OUTPUT
-N ISTIO_PRERT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT";

    /// `dns_pod_disabled_and_on_globally.golden`: no DNS rules, no raw table.
    const GOLDEN_NO_DNS_V4: &str = "\
* mangle
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
* nat
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_PRERT -s 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d 169.254.7.127 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT";

    /// `hostprobe_ipv6.golden` (both halves).
    const GOLDEN_HOSTPROBE_V4: &str = "\
* nat
-N ISTIO_POSTRT
-I POSTROUTING 1 -j ISTIO_POSTRT
-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127
COMMIT";
    const GOLDEN_HOSTPROBE_V6: &str = "\
* nat
-N ISTIO_POSTRT
-I POSTROUTING 1 -j ISTIO_POSTRT
-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v6 dst -j SNAT --to-source fd16:9254:7127:1337:ffff:ffff:ffff:ffff
COMMIT";

    /// Istio writes `* table`; iptables-restore takes `*table` too.
    fn golden(text: &str) -> String {
        from_golden(&text.replace("* ", "*"))
    }

    #[test]
    fn pod_rules_are_istios_for_each_family_with_dns_capture() {
        assert_eq!(
            render_fresh(&pod_rules(Family::V4, true)),
            golden(GOLDEN_DEFAULT_V4)
        );
        assert_eq!(
            render_fresh(&pod_rules(Family::V6, true)),
            golden(GOLDEN_DEFAULT_V6)
        );
    }

    #[test]
    fn without_dns_capture_there_are_no_dns_rules_and_no_raw_table() {
        assert_eq!(
            render_fresh(&pod_rules(Family::V4, false)),
            golden(GOLDEN_NO_DNS_V4)
        );
        let v6 = render_fresh(&pod_rules(Family::V6, false));
        let expected: String = golden(GOLDEN_DEFAULT_V6)
            .split("*raw")
            .next()
            .unwrap()
            .lines()
            .filter(|l| !l.contains("--dport 53"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(v6, expected);
    }

    #[test]
    fn host_rules_are_istios() {
        assert_eq!(
            render_fresh(&host_rules(Family::V4)),
            golden(GOLDEN_HOSTPROBE_V4)
        );
        assert_eq!(
            render_fresh(&host_rules(Family::V6)),
            golden(GOLDEN_HOSTPROBE_V6)
        );
    }

    /// What `iptables-nft-save` prints after the v4 set with DNS capture
    /// was restored (taken from a real run), plus a duplicate jump.
    pub(in crate::redirect::iptables) const SAVED_V4: &str = "\
# Generated by iptables-nft-save v1.8.9 (nf_tables)
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
COMMIT
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -d 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT
COMMIT
";

    #[test]
    fn save_output_is_read_per_table() {
        let saved = SavedRules::parse(SAVED_V4);
        assert!(saved.has_chain("mangle", "ISTIO_PRERT"));
        assert!(!saved.has_chain("filter", "ISTIO_PRERT"));
        assert_eq!(
            saved.jumps("nat", &Jump::append("PREROUTING", "ISTIO_PRERT")),
            2
        );
        assert_eq!(
            saved.jumps("raw", &Jump::append("OUTPUT", "ISTIO_OUTPUT")),
            1
        );
        assert_eq!(
            saved.jumps("mangle", &Jump::append("OUTPUT", "ISTIO_PRERT")),
            0
        );
        assert_eq!(
            saved.chain_rules("nat", "ISTIO_PRERT"),
            ["-A ISTIO_PRERT -s 169.254.7.127/32 -p tcp -m tcp -j ACCEPT"]
        );
        assert_eq!(saved.tables_with_istio_chains(), ["mangle", "nat", "raw"]);
        assert!(!SavedRules::parse("").has_istio_chains());
    }

    /// What `iptables-save` prints in an Istio sidecar pod (istio-iptables,
    /// abridged): Istio's names, not ambpf's chains.
    const SAVED_SIDECAR: &str = "\
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_INBOUND - [0:0]
:ISTIO_IN_REDIRECT - [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_REDIRECT - [0:0]
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A OUTPUT -p tcp -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
";

    #[test]
    fn only_ambpfs_own_chains_and_rules_count_as_ambpfs() {
        let owned = pod_rules(Family::V4, true);
        let host = host_rules(Family::V4);
        assert!(
            SavedRules::parse(SAVED_V4)
                .foreign_istio_chains(&owned, &host)
                .is_empty()
        );
        // Part of the set (the mangle chains of an opt-out cut short) is
        // ambpf's too.
        let reply_path = "*mangle\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n\
            -A PREROUTING -j ISTIO_PRERT\n-A OUTPUT -j ISTIO_OUTPUT\n\
            -A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff\n\
            -A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark \
            --nfmask 0xffffffff --ctmask 0xffffffff\nCOMMIT\n";
        assert!(
            SavedRules::parse(reply_path)
                .foreign_istio_chains(&owned, &host)
                .is_empty()
        );
        assert_eq!(
            SavedRules::parse(SAVED_SIDECAR).foreign_istio_chains(&owned, &host),
            [
                "nat ISTIO_INBOUND",
                "nat ISTIO_IN_REDIRECT",
                "nat ISTIO_OUTPUT -j RETURN",
                "nat ISTIO_OUTPUT -j ISTIO_REDIRECT",
                "nat ISTIO_REDIRECT",
            ]
        );
        // The host chain is neither ours nor foreign here.
        let with_host = format!("{SAVED_V4}{}", render_fresh(&host));
        let saved = SavedRules::parse(&with_host);
        assert!(saved.has_any_chain_of(&owned));
        assert!(saved.foreign_istio_chains(&owned, &host).is_empty());
        let host_only = SavedRules::parse(&render_fresh(&host));
        assert!(!host_only.has_any_chain_of(&owned));
        // Our chain names in a table we never write, or a rule of ours
        // without a target, are not ours either.
        let odd = "*filter\n:ISTIO_OUTPUT - [0:0]\nCOMMIT\n\
                   *mangle\n:ISTIO_PRERT - [0:0]\n-A ISTIO_PRERT -m mark --mark 0x1\nCOMMIT\n";
        assert_eq!(
            SavedRules::parse(odd).foreign_istio_chains(&owned, &host),
            [
                "filter ISTIO_OUTPUT",
                "mangle ISTIO_PRERT: `-A ISTIO_PRERT -m mark --mark 0x1`"
            ]
        );
        assert_eq!(
            rule_target("-A X -p tcp -j REDIRECT --to-ports 1"),
            Some("REDIRECT")
        );
        assert_eq!(rule_target("-A X --jump CT --zone 1"), Some("CT"));
        assert_eq!(rule_target("-A X -m mark --mark 0x1"), None);
    }

    #[test]
    fn enrolling_again_rewrites_the_chains_without_adding_jumps() {
        let saved = SavedRules::parse(SAVED_V4);
        let input = render(
            &pod_rules(Family::V4, true),
            &pod_rules(Family::V4, true),
            &saved,
        );
        // Only the jumps differ from a fresh write: none is added again, and
        // the duplicate one goes.
        let fresh = render_fresh(&pod_rules(Family::V4, true));
        let without_jumps: String = fresh
            .lines()
            .filter(|l| !(l.starts_with("-A ") && l.split_whitespace().count() == 4))
            .map(|l| format!("{l}\n"))
            .collect();
        let expected = without_jumps.replacen(
            "*nat\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n",
            "*nat\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n-D PREROUTING -j ISTIO_PRERT\n",
            1,
        );
        assert!(expected.contains("-D PREROUTING"));
        assert_eq!(input, expected);
    }

    #[test]
    fn opting_out_runs_istios_delete_commands_in_its_order() {
        let commands: Vec<String> = istio_delete_commands()
            .iter()
            .map(|args| format!("iptables {}", args.join(" ")))
            .collect();
        assert_eq!(
            commands.join("\n"),
            "\
iptables -t mangle -D PREROUTING -j ISTIO_PRERT
iptables -t mangle -D OUTPUT -j ISTIO_OUTPUT
iptables -t nat -D OUTPUT -j ISTIO_OUTPUT
iptables -t raw -D PREROUTING -j ISTIO_PRERT
iptables -t raw -D OUTPUT -j ISTIO_OUTPUT
iptables -t nat -D PREROUTING -j ISTIO_PRERT
iptables -t mangle -F ISTIO_PRERT
iptables -t mangle -F ISTIO_OUTPUT
iptables -t nat -F ISTIO_PRERT
iptables -t nat -F ISTIO_OUTPUT
iptables -t raw -F ISTIO_PRERT
iptables -t raw -F ISTIO_OUTPUT
iptables -t mangle -X ISTIO_PRERT
iptables -t mangle -X ISTIO_OUTPUT
iptables -t nat -X ISTIO_PRERT
iptables -t nat -X ISTIO_OUTPUT
iptables -t raw -X ISTIO_PRERT
iptables -t raw -X ISTIO_OUTPUT"
        );
    }

    #[test]
    fn removal_leaves_nothing() {
        let saved = SavedRules::parse(SAVED_V4);
        let owned = pod_rules(Family::V4, true);
        let removal = render(&owned, &RuleSet::empty(Family::V4), &saved);
        assert!(removal.starts_with(
            "\
*mangle
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-D PREROUTING -j ISTIO_PRERT
-D OUTPUT -j ISTIO_OUTPUT
-X ISTIO_PRERT
-X ISTIO_OUTPUT
COMMIT
*nat
"
        ));
        assert!(!removal.contains("-A "), "{removal}");
        // Nothing of ours left: nothing to write.
        assert_eq!(
            render(&owned, &RuleSet::empty(Family::V4), &SavedRules::default()),
            ""
        );
    }
}
