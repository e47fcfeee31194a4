//! The iptables redirection: Istio's in-pod rule set (Istio 1.21+, ambient
//! mode), the baseline ambpf is measured against.
//!
//! # What is installed where
//!
//! **In each enrolled pod's network namespace**, per IP family, written in one
//! `iptables-restore --noflush` (IPv6: `ip6tables-restore`) transaction run
//! by a child process that enters the pod's netns itself (`setns` on the
//! namespace fd we hold, in `pre_exec`; no `/run/netns` name needed). The
//! text is Istio's, from `cni/pkg/iptables/testdata/*.golden`; IPv6 uses
//! `::1/128` for `127.0.0.1/32` and `fd16:9254:7127:1337:ffff:ffff:ffff:ffff`
//! for `169.254.7.127`:
//!
//! ```text
//! mangle PREROUTING -j ISTIO_PRERT
//!        ISTIO_PRERT   mark 0x539/0xfff                 CONNMARK --set-xmark 0x111/0xfff
//!        OUTPUT -j ISTIO_OUTPUT
//!        ISTIO_OUTPUT  connmark 0x111/0xfff             CONNMARK --restore-mark
//! nat    PREROUTING -j ISTIO_PRERT
//!        ISTIO_PRERT   tcp from 169.254.7.127           ACCEPT  (kubelet probes)
//!                      tcp !to 127.0.0.1, dport !15008, mark !0x539
//!                                                       REDIRECT 15006
//!        OUTPUT -j ISTIO_OUTPUT
//!        ISTIO_OUTPUT  tcp to 169.254.7.127             ACCEPT  (probe replies)
//!        [dns]         udp dport 53, !-o lo, mark !0x539
//!                                                       REDIRECT 15053
//!        [dns]         tcp dport 53, !to 127.0.0.1, mark !0x539
//!                                                       REDIRECT 15053
//!                      tcp mark 0x111/0xfff             ACCEPT
//!                      !to 127.0.0.1, -o lo             ACCEPT
//!                      tcp !to 127.0.0.1, mark !0x539   REDIRECT 15001
//! raw    [dns] PREROUTING -j ISTIO_PRERT, OUTPUT -j ISTIO_OUTPUT
//!        ISTIO_OUTPUT  udp dport 53, mark 0x539         CT --zone 1
//!        ISTIO_PRERT   udp sport 53, mark !0x539        CT --zone 1
//! policy routing (v4 and v6, over netlink): fwmark 0x111/0xfff lookup 100
//!        (pref 32764); table 100: local default dev lo
//! ```
//!
//! `[dns]` rules and the raw table only with [`EnrollOptions::dns_capture`].
//! The connmark is what brings the app's replies back to ztunnel's
//! transparent socket, so unlike the eBPF mode no `tcp_fwmark_accept`
//! sysctl is set ([`routing::install_policy_routing`]).
//!
//! **In the host namespace** (the agent's own in production), once, by
//! [`IptablesRedirection::new`]: kubelet probes are told apart from other
//! node traffic as Istio does, by SNATing TCP from host processes (a local
//! socket exists) to ambient pods' addresses:
//!
//! ```text
//! ipset istio-inpod-probes-v4  hash:ip family inet  comment   (v6: inet6)
//!       members: every enrolled pod's address, commented with its netns inode
//! nat   POSTROUTING (inserted first) -j ISTIO_POSTRT
//!       ISTIO_POSTRT -m owner --socket-exists -p tcp
//!                    -m set --match-set istio-inpod-probes-v4 dst
//!                    -j SNAT --to-source 169.254.7.127
//!                    (v6: istio-inpod-probes-v6, fd16:9254:7127:1337:ffff:ffff:ffff:ffff)
//! ```
//!
//! A pod's addresses join the ipsets before its in-pod rules are written
//! (a probe is never captured) and leave them first on unenrolment (a reused
//! address is not SNATed for long).
//!
//! # Writing and removing
//!
//! Each write reads the namespace's current rules (`iptables-save`) and
//! renders one restore input: our chains are declared with `:CHAIN - [0:0]`
//! (created, or flushed if they exist), jumps from the built-in chains are
//! added only when missing (and duplicates removed), and our chains that are
//! no longer wanted are flushed, unlinked and deleted (`-D`, `-X`). So
//! enrolling again, with the same or other options, rewrites the set
//! atomically and never duplicates anything.
//!
//! Unenrolling removes the pod's addresses from the ipsets and the capture
//! rules (nat and raw chains, jumps included), so new connections go direct,
//! and forgets the pod. As in the eBPF mode, the reply path stays while the
//! namespace lives (the mangle connmark chains and the policy routing): it
//! acts only on connections ztunnel made (mark 0x539), and without it the
//! app's replies on connections ztunnel proxies at that moment would be
//! routed out of the pod. [`remove_pod_rules`] removes everything, and
//! [`uninstall_node`] does that for a set of pods and then removes the host
//! rules and ipsets: [`IptablesRedirection::uninstall`] for the pods it
//! enrolled, `ambpf uninstall` for every namespace [`find_pod_rules`]
//! recognises as ambpf's (the agent keeps no record of its pods outside its
//! memory, so this works after it crashed too).
//!
//! # Backends
//!
//! `nft` (`iptables-nft-restore`, ...) or `legacy` (`iptables-legacy-...`),
//! chosen explicitly or, with [`IptablesBackend::Auto`], the one the host
//! namespace already has rules in (nft when neither or both equally).

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{self, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use ambpf_common::ztunnel::{
    DNS_PORT, HBONE_PORT, INBOUND_PORT, MARK, MARK_MASK, OUTBOUND_PORT, REPLY_MARK,
};
use log::{info, warn};

use super::{
    EnrollError, EnrollOptions, EnrolledPod, PodRedirection, RedirectMode, podnet, routing,
};
use crate::netns::{Netns, NetnsError};

/// Where Istio SNATs host-process traffic to ambient pods (IPv4).
pub const PROBE_SNAT_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// Where Istio SNATs host-process traffic to ambient pods (IPv6; a ULA,
/// Istio's `HOST_PROBE_V6_SNAT_ADDRESS` default).
pub const PROBE_SNAT_V6: Ipv6Addr = Ipv6Addr::new(
    0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
);
/// The host ipsets of enrolled pods' addresses.
pub const PROBE_IPSET_V4: &str = "istio-inpod-probes-v4";
pub const PROBE_IPSET_V6: &str = "istio-inpod-probes-v6";
/// Istio's chain names.
pub const CHAIN_PREROUTING: &str = "ISTIO_PRERT";
pub const CHAIN_OUTPUT: &str = "ISTIO_OUTPUT";
pub const CHAIN_POSTROUTING: &str = "ISTIO_POSTRT";
/// Conntrack zone of the DNS proxy's upstream traffic.
const DNS_CT_ZONE: u16 = 1;
/// `CONNMARK --restore-mark` masks (Istio's `InpodRestoreMask`).
const RESTORE_MASK: u32 = 0xffff_ffff;
/// Where binaries are looked for after `$PATH` (the agent may run with a
/// `$PATH` without the sbin directories).
const FALLBACK_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];
/// Present when the kernel has IPv6.
const IPV6_PROC: &str = "/proc/sys/net/ipv6";

/// Which iptables implementation writes the rules.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IptablesBackend {
    /// What the host namespace already uses: the backend holding rules
    /// there, else nft.
    #[default]
    Auto,
    /// `iptables-nft-restore` (nf_tables with the xtables compatibility).
    Nft,
    /// `iptables-legacy-restore` (x_tables).
    Legacy,
}

impl IptablesBackend {
    fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Nft => "nft",
            Self::Legacy => "legacy",
        }
    }

    /// E.g. `ip6tables-nft-restore`.
    fn binary(self, family: Family, tool: &str) -> String {
        format!("{}-{}-{tool}", family.tables_tool(), self.name())
    }
}

impl std::fmt::Display for IptablesBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An IP family: `iptables` or `ip6tables`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    fn tables_tool(self) -> &'static str {
        match self {
            Self::V4 => "iptables",
            Self::V6 => "ip6tables",
        }
    }

    /// The loopback address as Istio writes it in rules.
    fn loopback(self) -> &'static str {
        match self {
            Self::V4 => "127.0.0.1/32",
            Self::V6 => "::1/128",
        }
    }

    pub fn probe_snat(self) -> IpAddr {
        match self {
            Self::V4 => PROBE_SNAT_V4.into(),
            Self::V6 => PROBE_SNAT_V6.into(),
        }
    }

    pub fn probe_ipset(self) -> &'static str {
        match self {
            Self::V4 => PROBE_IPSET_V4,
            Self::V6 => PROBE_IPSET_V6,
        }
    }

    fn ipset_family(self) -> &'static str {
        match self {
            Self::V4 => "inet",
            Self::V6 => "inet6",
        }
    }

    pub fn of(ip: &IpAddr) -> Self {
        if ip.is_ipv4() { Self::V4 } else { Self::V6 }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error(
        "{binary} not found in $PATH or {}: {needed_for} needs it (Debian package `{package}`)",
        FALLBACK_DIRS.join(", ")
    )]
    MissingBinary {
        binary: String,
        needed_for: String,
        package: &'static str,
    },
    #[error(
        "the kernel lacks netfilter support that `{command}` needs in {} (a kernel module \
         that is not loaded, or an option built out of this kernel): {stderr}",
        netns.display()
    )]
    MissingKernelSupport {
        command: String,
        netns: PathBuf,
        stderr: String,
    },
    #[error("`{command}` failed in {}: {stderr}", netns.display())]
    Failed {
        command: String,
        netns: PathBuf,
        stderr: String,
    },
    #[error("cannot run `{command}` in {}: {source}", netns.display())]
    Spawn {
        command: String,
        netns: PathBuf,
        source: io::Error,
    },
    #[error("keeping a handle on {}: {source}", netns.display())]
    Keep { netns: PathBuf, source: NetnsError },
}

// ---------------------------------------------------------------------------
// Rule sets

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

    /// Only the tables named.
    fn only(&self, names: &[&str]) -> Self {
        Self {
            family: self.family,
            tables: self
                .tables
                .iter()
                .filter(|t| names.contains(&t.table))
                .cloned()
                .collect(),
        }
    }

    fn empty(family: Family) -> Self {
        Self {
            family,
            tables: Vec::new(),
        }
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

/// What stays in a pod after unenrolment: the connmark reply path.
fn pod_reply_rules(family: Family) -> RuleSet {
    pod_rules(family, false).only(&["mangle"])
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

    fn has_chain(&self, table: &str, chain: &str) -> bool {
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
    fn has_any_chain_of(&self, set: &RuleSet) -> bool {
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
    fn foreign_istio_chains(&self, owned: &RuleSet, skipped: &RuleSet) -> Vec<String> {
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
fn render(owned: &RuleSet, wanted: &RuleSet, current: &SavedRules) -> String {
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

// ---------------------------------------------------------------------------
// Running the tools

/// Looks `name` up in `$PATH`, then in [`FALLBACK_DIRS`].
fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(FALLBACK_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            candidate.metadata().is_ok_and(|m| {
                m.is_file()
                    && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            })
        })
}

fn require_binary(
    name: &str,
    needed_for: &str,
    package: &'static str,
) -> Result<PathBuf, IptablesError> {
    find_binary(name).ok_or_else(|| IptablesError::MissingBinary {
        binary: name.to_owned(),
        needed_for: needed_for.to_owned(),
        package,
    })
}

/// What a command printed, for errors: stderr without the usage hint, with
/// the input line a restore failed on.
fn describe_failure(stderr: &str, input: Option<&str>) -> String {
    let mut text: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Try `"))
        .collect();
    if text.is_empty() {
        text.push("no error output");
    }
    let mut out = text.join("; ");
    // Legacy and nft restores say "Error occurred at line: N"; nft also
    // says "...-restore: line N failed: ...".
    let failed_line = stderr.lines().find_map(|l| {
        let l = l.trim();
        let n = match l.strip_prefix("Error occurred at line: ") {
            Some(n) => n,
            None => l.split_once(": line ")?.1.split_once(" failed")?.0,
        };
        n.trim().parse::<usize>().ok()
    });
    if let (Some(n), Some(input)) = (failed_line, input)
        && let Some(line) = input.lines().nth(n.saturating_sub(1))
    {
        out.push_str(&format!(" (input line {n}: `{line}`)"));
    }
    out
}

/// Whether a tool's complaint means the kernel (or the xtables extensions
/// matching it) lacks something, rather than a bad rule.
fn is_missing_kernel_support(stderr: &str) -> bool {
    const SIGNS: [&str; 9] = [
        "do you need to insmod",
        "missing kernel module",
        "Couldn't load",
        "not supported",
        "you need a kernel",
        "Table does not exist",
        "Cannot open session to kernel",
        "Kernel error received: set type not supported",
        "Could not fetch rule set generation id",
    ];
    SIGNS.iter().any(|sign| stderr.contains(sign))
}

/// Runs `program args...` inside `netns` (the child process enters it before
/// exec), feeding it `input`; returns its stdout.
fn run_in(
    netns: &Netns,
    program: &Path,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, IptablesError> {
    let name = program.file_name().map_or_else(
        || program.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let command = std::iter::once(name.as_str())
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let spawn_err = |source| IptablesError::Spawn {
        command: command.clone(),
        netns: netns.path().to_owned(),
        source,
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("LC_ALL", "C");
    let fd = netns.file().as_raw_fd();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes one system call and
    // reads errno. `fd` is the namespace file this process holds open for
    // the whole call (`netns` is borrowed), so it is valid in the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
    }
    let mut child = cmd.spawn().map_err(spawn_err)?;
    if let Some(input) = input {
        // Small inputs (a few KiB): the pipe takes them whole, no deadlock
        // with the child's output.
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let written = stdin.write_all(input.as_bytes());
        drop(stdin);
        if let Err(e) = written {
            let _ = child.wait();
            return Err(spawn_err(e));
        }
    }
    let output = child.wait_with_output().map_err(spawn_err)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let mut detail = describe_failure(&stderr, input);
    if let Some(code) = output.status.code() {
        detail = format!("exit status {code}: {detail}");
    }
    let netns = netns.path().to_owned();
    Err(if is_missing_kernel_support(&stderr) {
        IptablesError::MissingKernelSupport {
            command,
            netns,
            stderr: detail,
        }
    } else {
        IptablesError::Failed {
            command,
            netns,
            stderr: detail,
        }
    })
}

/// The binaries of one backend and family.
#[derive(Clone, Debug)]
struct FamilyTools {
    restore: PathBuf,
    save: PathBuf,
}

/// Every binary a backend needs, found once.
#[derive(Clone, Debug)]
struct Tools {
    backend: IptablesBackend,
    /// Per family in use (IPv6 only when the kernel has it).
    families: BTreeMap<Family, FamilyTools>,
}

fn ipv6_in_kernel() -> bool {
    Path::new(IPV6_PROC).exists()
}

fn families_in_use() -> Vec<Family> {
    if ipv6_in_kernel() {
        Family::ALL.to_vec()
    } else {
        vec![Family::V4]
    }
}

impl Tools {
    /// The binaries of `backend` (not `Auto`), or an error naming the first
    /// one missing.
    fn find(backend: IptablesBackend) -> Result<Self, IptablesError> {
        let mut families = BTreeMap::new();
        for family in families_in_use() {
            let needed_for = format!("the iptables redirection ({backend} backend, {family})");
            let restore =
                require_binary(&backend.binary(family, "restore"), &needed_for, "iptables")?;
            let save = require_binary(&backend.binary(family, "save"), &needed_for, "iptables")?;
            families.insert(family, FamilyTools { restore, save });
        }
        Ok(Self { backend, families })
    }

    /// Backends whose binaries are all present.
    fn available() -> Vec<Self> {
        [IptablesBackend::Nft, IptablesBackend::Legacy]
            .into_iter()
            .filter_map(|b| Self::find(b).ok())
            .collect()
    }

    fn family(&self, family: Family) -> Option<&FamilyTools> {
        self.families.get(&family)
    }

    fn save(&self, netns: &Netns, family: Family) -> Result<SavedRules, IptablesError> {
        match self.family(family) {
            Some(tools) => Ok(SavedRules::parse(&run_in(netns, &tools.save, &[], None)?)),
            None => Ok(SavedRules::default()),
        }
    }

    /// Brings the chains of `owned` in `netns` to `wanted`, in one restore.
    fn apply(&self, netns: &Netns, owned: &RuleSet, wanted: &RuleSet) -> Result<(), IptablesError> {
        let Some(tools) = self.family(owned.family) else {
            return Ok(());
        };
        let current = self.save(netns, owned.family)?;
        let input = render(owned, wanted, &current);
        if input.is_empty() {
            return Ok(());
        }
        run_in(
            netns,
            &tools.restore,
            &["--noflush", "--wait"],
            Some(&input),
        )?;
        Ok(())
    }
}

/// Rules (`-A` lines and user chains) in a save output: how much a backend
/// is in use.
fn rule_count(save: &str) -> usize {
    save.lines()
        .filter(|l| l.starts_with("-A ") || (l.starts_with(':') && l.contains(" - [")))
        .count()
}

/// The backend the host namespace uses (see [`IptablesBackend::Auto`]).
fn detect_backend(host: &Netns) -> Result<IptablesBackend, IptablesError> {
    let available = Tools::available();
    match available.as_slice() {
        // The error names what the preferred backend misses.
        [] => Tools::find(IptablesBackend::Nft).map(|tools| tools.backend),
        [only] => Ok(only.backend),
        several => {
            let usage = |tools: &Tools| -> usize {
                tools
                    .families
                    .values()
                    .filter_map(|t| run_in(host, &t.save, &[], None).ok())
                    .map(|save| rule_count(&save))
                    .sum()
            };
            let nft = several.iter().find(|t| t.backend == IptablesBackend::Nft);
            let legacy = several
                .iter()
                .find(|t| t.backend == IptablesBackend::Legacy);
            let (nft_rules, legacy_rules) = (nft.map_or(0, usage), legacy.map_or(0, usage));
            Ok(if legacy_rules > nft_rules {
                IptablesBackend::Legacy
            } else {
                IptablesBackend::Nft
            })
        }
    }
}

fn ipset_binary() -> Result<PathBuf, IptablesError> {
    require_binary(
        "ipset",
        "the iptables redirection's host probe rules (ipsets istio-inpod-probes-v4/-v6)",
        "ipset",
    )
}

/// The members of a host probe ipset.
pub fn probe_set_members(host: &Netns, family: Family) -> Result<Vec<IpAddr>, IptablesError> {
    let ipset = ipset_binary()?;
    let listing = run_in(host, &ipset, &["list", family.probe_ipset()], None)?;
    Ok(listing
        .lines()
        .skip_while(|l| !l.starts_with("Members:"))
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect())
}

/// The rules of `netns` for `family` with `backend` (not `Auto`), as
/// `iptables-save` prints them.
pub fn saved_rules(
    netns: &Netns,
    backend: IptablesBackend,
    family: Family,
) -> Result<SavedRules, IptablesError> {
    let tools = Tools::find(backend)?;
    tools.save(netns, family)
}

/// Removes everything the iptables mode writes in a pod's namespace (capture
/// and reply-path chains of every table, in each backend present, and the
/// policy routing), idempotently.
pub fn remove_pod_rules(netns: &Netns) -> Result<(), EnrollError> {
    for tools in Tools::available() {
        for family in families_in_use() {
            let owned = pod_rules(family, true);
            tools.apply(netns, &owned, &RuleSet::empty(family))?;
        }
    }
    routing::remove_policy_routing(netns)?;
    Ok(())
}

/// Removes the host rules (in each backend present) and then the probe
/// ipsets, idempotently. Returns whether any of them was there.
pub fn remove_host_rules(host: &Netns) -> Result<bool, IptablesError> {
    let mut found = false;
    for tools in Tools::available() {
        for family in families_in_use() {
            let owned = host_rules(family);
            found |= tools
                .save(host, family)?
                .has_chain("nat", CHAIN_POSTROUTING);
            tools.apply(host, &owned, &RuleSet::empty(family))?;
        }
    }
    if let Some(ipset) = find_binary("ipset") {
        for family in families_in_use() {
            // `destroy` of a missing set fails; ask first.
            let exists = run_in(host, &ipset, &["list", "-name"], None)?
                .lines()
                .any(|l| l.trim() == family.probe_ipset());
            if exists {
                run_in(host, &ipset, &["destroy", family.probe_ipset()], None)?;
                found = true;
            }
        }
    }
    Ok(found)
}

/// What of Istio's in-pod chains a namespace holds ([`find_pod_rules`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodRulesFound {
    /// None of the in-pod chains, in any table, backend or family.
    None,
    /// ambpf's: only chains of its in-pod rule set ([`pod_rules`]), holding
    /// only rules that jump where its rules jump.
    Ambpf,
    /// `ISTIO_*` chains or rules ambpf does not write (an Istio sidecar's
    /// `ISTIO_INBOUND`, ...), each as `<backend> <family>: <table> <chain>...`.
    Foreign(Vec<String>),
}

/// Whether `netns` holds ambpf's in-pod rules, read with every backend
/// present, for both families: how `ambpf uninstall` recognises a pod the
/// iptables mode enrolled without the agent's memory of it. A namespace
/// counts as ambpf's when it has one of the chains ambpf writes in pods
/// (`ISTIO_PRERT`, `ISTIO_OUTPUT` in mangle, nat and raw) and every
/// `ISTIO_*` chain in it is one of those, holding only rules that jump where
/// ambpf's rules there jump. So an Istio sidecar's namespace
/// (`ISTIO_INBOUND`, `ISTIO_REDIRECT`, `RETURN` rules, ...) is foreign and
/// left alone. The host side's `ISTIO_POSTRT` (another node's, in a nested
/// setup) counts for neither, and stays. Istio's own ambient node agent
/// writes the very same in-pod rules, so its pods cannot be told apart; the
/// two do not share a node (they would share the host's ipsets and
/// `ISTIO_POSTRT`).
pub fn find_pod_rules(netns: &Netns) -> Result<PodRulesFound, IptablesError> {
    let mut found = false;
    let mut foreign = Vec::new();
    for tools in Tools::available() {
        for family in tools.families.keys().copied() {
            let saved = tools.save(netns, family)?;
            let owned = pod_rules(family, true);
            if !saved.has_any_chain_of(&owned) {
                continue;
            }
            found = true;
            let backend = tools.backend;
            foreign.extend(
                saved
                    .foreign_istio_chains(&owned, &host_rules(family))
                    .into_iter()
                    .map(|what| format!("{backend} {family}: {what}")),
            );
        }
    }
    Ok(match (found, foreign.is_empty()) {
        (false, _) => PodRulesFound::None,
        (true, true) => PodRulesFound::Ambpf,
        (true, false) => PodRulesFound::Foreign(foreign),
    })
}

/// What [`uninstall_node`] did.
#[derive(Debug)]
pub struct NodeUninstall {
    /// Each pod namespace given, by path, and how removing its rules and
    /// policy routing went.
    pub pods: Vec<(PathBuf, Result<(), EnrollError>)>,
    /// The host rules and ipsets: removed (`Ok(true)`), none there
    /// (`Ok(false)`), or `None` when kept because a pod still has its rules.
    pub host: Option<Result<bool, IptablesError>>,
}

impl NodeUninstall {
    /// The first failure, if any.
    pub fn into_result(self) -> Result<(), EnrollError> {
        for (_, result) in self.pods {
            result?;
        }
        match self.host {
            Some(Err(e)) => Err(e.into()),
            _ => Ok(()),
        }
    }
}

/// Removes the iptables mode's state from a node: everything in each of
/// `pods` ([`remove_pod_rules`]; every pod is attempted), then, once they
/// are all clean, the host rules and ipsets from `host`
/// ([`remove_host_rules`]). The host side stays while a pod still has its
/// capture rules, because that pod's kubelet probes are told apart by the
/// host's SNAT; running this again finishes the job.
pub fn uninstall_node<'a>(
    host: &Netns,
    pods: impl IntoIterator<Item = &'a Netns>,
) -> NodeUninstall {
    let pods: Vec<_> = pods
        .into_iter()
        .map(|netns| (netns.path().to_owned(), remove_pod_rules(netns)))
        .collect();
    let host = pods
        .iter()
        .all(|(_, result)| result.is_ok())
        .then(|| remove_host_rules(host));
    NodeUninstall { pods, host }
}

// ---------------------------------------------------------------------------
// The redirection

/// An enrolled pod.
#[derive(Debug)]
struct PodEntry {
    netns: Netns,
    addresses: Vec<IpAddr>,
}

/// Istio's in-pod iptables rules, per pod, plus the host probe SNAT.
#[derive(Debug)]
pub struct IptablesRedirection {
    host: Netns,
    tools: Tools,
    ipset: PathBuf,
    pods: BTreeMap<u64, PodEntry>,
}

impl IptablesRedirection {
    /// Finds the tools of `backend` (resolving `Auto` against `host`), then
    /// installs the host probe rules and ipsets in `host`, idempotently.
    /// Nothing is removed when this is dropped: pods stay redirected across
    /// agent restarts (see [`Self::uninstall`]).
    pub fn new(host: Netns, backend: IptablesBackend) -> Result<Self, IptablesError> {
        let backend = match backend {
            IptablesBackend::Auto => detect_backend(&host)?,
            chosen => chosen,
        };
        let tools = Tools::find(backend)?;
        let ipset = ipset_binary()?;
        let this = Self {
            host,
            tools,
            ipset,
            pods: BTreeMap::new(),
        };
        for family in this.tools.families.keys().copied() {
            this.ipset_run(&[
                "create",
                "-exist",
                family.probe_ipset(),
                "hash:ip",
                "family",
                family.ipset_family(),
                "comment",
            ])?;
            let rules = host_rules(family);
            this.tools.apply(&this.host, &rules, &rules)?;
        }
        info!(
            "iptables redirection ready ({backend} backend, host rules in {})",
            this.host.path().display()
        );
        Ok(this)
    }

    /// The backend in use (never `Auto`).
    pub fn backend(&self) -> IptablesBackend {
        self.tools.backend
    }

    pub fn host(&self) -> &Netns {
        &self.host
    }

    /// The rules of `netns` for `family`, as this backend's `iptables-save`
    /// prints them.
    pub fn saved_rules(&self, netns: &Netns, family: Family) -> Result<SavedRules, IptablesError> {
        self.tools.save(netns, family)
    }

    /// Removes everything from every enrolled pod, then the host rules and
    /// ipsets ([`uninstall_node`], as `ambpf uninstall` does for the pods it
    /// finds).
    pub fn uninstall(self) -> Result<(), EnrollError> {
        uninstall_node(&self.host, self.pods.values().map(|e| &e.netns)).into_result()
    }

    fn ipset_run(&self, args: &[&str]) -> Result<(), IptablesError> {
        run_in(&self.host, &self.ipset, args, None).map(drop)
    }

    fn probe_set_add(&self, ip: IpAddr, netns_inode: u64) -> Result<(), IptablesError> {
        let family = Family::of(&ip);
        if self.tools.family(family).is_none() {
            return Ok(());
        }
        let (ip, comment) = (ip.to_string(), format!("netns {netns_inode}"));
        self.ipset_run(&[
            "add",
            "-exist",
            family.probe_ipset(),
            &ip,
            "comment",
            &comment,
        ])
    }

    fn probe_set_del(&self, ip: IpAddr) -> Result<(), IptablesError> {
        let family = Family::of(&ip);
        if self.tools.family(family).is_none() {
            return Ok(());
        }
        self.ipset_run(&["del", "-exist", family.probe_ipset(), &ip.to_string()])
    }

    /// Probe ipsets, policy routing, then the in-pod rules of each family.
    fn apply_pod(
        &self,
        netns: &Netns,
        addresses: &[IpAddr],
        stale: &[IpAddr],
        dns_capture: bool,
    ) -> Result<(), EnrollError> {
        for ip in addresses {
            self.probe_set_add(*ip, netns.inode())?;
        }
        for ip in stale.iter().filter(|ip| !addresses.contains(ip)) {
            self.probe_set_del(*ip)?;
        }
        routing::install_policy_routing(netns)?;
        for family in self.tools.families.keys().copied() {
            let owned = pod_rules(family, true);
            self.tools
                .apply(netns, &owned, &pod_rules(family, dns_capture))?;
        }
        Ok(())
    }

    /// Stops capturing: probe ipset entries, then the nat and raw chains.
    fn release_pod(&self, entry: &PodEntry) -> Result<(), EnrollError> {
        for ip in &entry.addresses {
            self.probe_set_del(*ip)?;
        }
        for family in self.tools.families.keys().copied() {
            let owned = pod_rules(family, true);
            self.tools
                .apply(&entry.netns, &owned, &pod_reply_rules(family))?;
        }
        Ok(())
    }
}

/// A handle of our own on `netns` (the caller's may close): reopened by
/// path when that still names the same namespace, else through our fd.
fn keep_netns(netns: &Netns) -> Result<Netns, IptablesError> {
    if let Some(path) = netns.path().to_str()
        && let Ok(again) = Netns::open(path)
        && again.inode() == netns.inode()
    {
        return Ok(again);
    }
    Netns::open(&format!("/proc/self/fd/{}", netns.file().as_raw_fd())).map_err(|source| {
        IptablesError::Keep {
            netns: netns.path().to_owned(),
            source,
        }
    })
}

impl PodRedirection for IptablesRedirection {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Iptables
    }

    fn enroll(
        &mut self,
        netns: &Netns,
        options: EnrollOptions,
    ) -> Result<EnrolledPod, EnrollError> {
        let net = podnet::inspect(netns)?;
        let addresses = super::pod_addresses(&net, netns)?;
        let inode = netns.inode();
        let previous = self.pods.get(&inode).map(|e| e.addresses.clone());
        let kept = match previous {
            Some(_) => None,
            None => Some(keep_netns(netns)?),
        };
        let stale = previous.clone().unwrap_or_default();
        if let Err(e) = self.apply_pod(netns, &addresses, &stale, options.dns_capture) {
            if previous.is_none() {
                // Leave nothing half-done behind for a pod that was not
                // enrolled.
                for ip in &addresses {
                    let _ = self.probe_set_del(*ip);
                }
                if let Err(undo) = remove_pod_rules(netns) {
                    warn!(
                        "undoing the failed enrolment of {}: {undo}",
                        netns.path().display()
                    );
                }
            }
            return Err(e);
        }
        match kept {
            Some(netns) => {
                self.pods.insert(
                    inode,
                    PodEntry {
                        netns,
                        addresses: addresses.clone(),
                    },
                );
            }
            None => {
                if let Some(entry) = self.pods.get_mut(&inode) {
                    entry.addresses = addresses.clone();
                }
            }
        }
        info!(
            "enrolled pod in {} with iptables ({} backend, {addresses:?}, dns capture {})",
            netns.path().display(),
            self.tools.backend,
            options.dns_capture
        );
        Ok(EnrolledPod {
            netns: netns.path().to_owned(),
            netns_inode: inode,
            netns_cookie: net.netns_cookie,
            addresses,
            interfaces: net.interfaces.into_iter().map(|i| i.name).collect(),
            dns_capture: options.dns_capture,
        })
    }

    fn unenroll(&mut self, netns_inode: u64) -> Result<bool, EnrollError> {
        let Some(entry) = self.pods.get(&netns_inode) else {
            return Ok(false);
        };
        if let Err(e) = self.release_pod(entry) {
            // A pod whose network is torn down (no interface left) has
            // nothing worth cleaning: forget it. Otherwise keep it for a retry.
            let torn_down = podnet::inspect(&entry.netns).is_ok_and(|n| n.interfaces.is_empty());
            if !torn_down {
                return Err(e);
            }
            warn!(
                "forgetting pod in {} (its network is gone): {e}",
                entry.netns.path().display()
            );
            for ip in &entry.addresses {
                let _ = self.probe_set_del(*ip);
            }
        }
        let entry = self.pods.remove(&netns_inode).expect("looked up above");
        info!(
            "unenrolled pod in {} (netns inode {netns_inode}) from iptables",
            entry.netns.path().display()
        );
        Ok(true)
    }

    fn enrolled(&mut self) -> Result<Vec<u64>, EnrollError> {
        Ok(self.pods.keys().copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use ambpf_testbed::{NetnsGuard, PodAndNode};

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
    const SAVED_V4: &str = "\
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
        // What an unenrolled pod keeps (mangle only) is ambpf's too.
        let reply_path = render_fresh(&pod_reply_rules(Family::V4));
        assert!(
            SavedRules::parse(&reply_path)
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
    fn unenrolling_keeps_only_the_reply_path_and_removal_leaves_nothing() {
        let saved = SavedRules::parse(SAVED_V4);
        let owned = pod_rules(Family::V4, true);
        let unenrol = render(&owned, &pod_reply_rules(Family::V4), &saved);
        assert_eq!(
            unenrol,
            "\
*mangle
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
*nat
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-D OUTPUT -j ISTIO_OUTPUT
-D PREROUTING -j ISTIO_PRERT
-D PREROUTING -j ISTIO_PRERT
-X ISTIO_PRERT
-X ISTIO_OUTPUT
COMMIT
*raw
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-D PREROUTING -j ISTIO_PRERT
-D OUTPUT -j ISTIO_OUTPUT
-X ISTIO_OUTPUT
-X ISTIO_PRERT
COMMIT
"
        );
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

    #[test]
    fn errors_name_what_is_missing_and_what_failed() {
        let err = IptablesError::MissingBinary {
            binary: "iptables-legacy-restore".into(),
            needed_for: "the iptables redirection (legacy backend, IPv4)".into(),
            package: "iptables",
        };
        assert_eq!(
            err.to_string(),
            "iptables-legacy-restore not found in $PATH or /usr/sbin, /sbin, /usr/bin, /bin: \
             the iptables redirection (legacy backend, IPv4) needs it (Debian package `iptables`)"
        );

        let input = "*nat\n:ISTIO_X - [0:0]\n-A ISTIO_X -j NOPE\nCOMMIT\n";
        let stderr = "iptables-nft-restore v1.8.9 (nf_tables): Chain 'NOPE' does not exist\n\
                      Error occurred at line: 3\n\
                      Try `iptables-nft-restore -h' or 'iptables-nft-restore --help' for more information.\n";
        assert_eq!(
            describe_failure(stderr, Some(input)),
            "iptables-nft-restore v1.8.9 (nf_tables): Chain 'NOPE' does not exist; \
             Error occurred at line: 3 (input line 3: `-A ISTIO_X -j NOPE`)"
        );
        assert!(!is_missing_kernel_support(stderr));
        for missing in [
            "iptables-restore v1.8.9 (legacy): Couldn't load target `CT':No such file or directory",
            "iptables v1.8.9 (legacy): can't initialize iptables table `raw': Table does not exist \
             (do you need to insmod?)",
            "Warning: Extension CONNMARK revision 0 not supported, missing kernel module?",
            "ipset v7.17: Kernel error received: set type not supported",
        ] {
            assert!(is_missing_kernel_support(missing), "{missing}");
        }
    }

    #[test]
    fn backends_name_their_binaries() {
        assert_eq!(
            IptablesBackend::Nft.binary(Family::V4, "restore"),
            "iptables-nft-restore"
        );
        assert_eq!(
            IptablesBackend::Legacy.binary(Family::V6, "save"),
            "ip6tables-legacy-save"
        );
        // 13 rules and 6 user chains.
        assert_eq!(rule_count(SAVED_V4), 13 + 6);
    }

    // Privileged: real namespaces, real iptables.

    fn open(guard: &NetnsGuard) -> Netns {
        Netns::open(guard.path().to_str().unwrap()).unwrap()
    }

    fn dns(dns_capture: bool) -> EnrollOptions {
        EnrollOptions { dns_capture }
    }

    /// Every line of every table of `ns`, for both backends and families.
    fn everything(ns: &Netns) -> Vec<String> {
        let mut out = Vec::new();
        for backend in [IptablesBackend::Nft, IptablesBackend::Legacy] {
            for family in Family::ALL {
                let save = run_in(
                    ns,
                    &find_binary(&backend.binary(family, "save")).unwrap(),
                    &[],
                    None,
                )
                .unwrap();
                // Without the built-in chains' packet counters.
                out.extend(
                    save.lines()
                        .filter(|l| !l.starts_with('#'))
                        .map(|l| match l.split_once(" [") {
                            Some((chain, _)) if l.starts_with(':') => chain.to_owned(),
                            _ => l.to_owned(),
                        })
                        .map(|l| format!("{backend} {family}: {l}")),
                );
            }
        }
        out
    }

    fn istio_lines(lines: &[String]) -> Vec<&String> {
        lines.iter().filter(|l| l.contains("ISTIO_")).collect()
    }

    #[test]
    fn enrol_reenrol_unenrol_and_remove_with_each_backend() {
        for backend in [IptablesBackend::Nft, IptablesBackend::Legacy] {
            let pn = PodAndNode::create().unwrap();
            let (pod, node) = (open(&pn.pod), open(&pn.node));
            let mut redirection = IptablesRedirection::new(open(&pn.node), backend).unwrap();
            assert_eq!(redirection.backend(), backend);

            // Host: the SNAT chain, jumped to first, in this backend only.
            for family in Family::ALL {
                let saved = redirection.saved_rules(&node, family).unwrap();
                let postrt = saved.chain_rules("nat", CHAIN_POSTROUTING);
                assert_eq!(postrt.len(), 1, "{backend} {family}: {postrt:?}");
                assert!(
                    postrt[0].contains(family.probe_ipset())
                        && postrt[0].contains(&family.probe_snat().to_string()),
                    "{postrt:?}"
                );
            }

            let enrolled = redirection.enroll(&pod, dns(true)).unwrap();
            assert_eq!(enrolled.netns_inode, pod.inode());
            assert_eq!(
                enrolled.addresses,
                vec![
                    IpAddr::V4(PodAndNode::POD.v4),
                    IpAddr::V6(PodAndNode::POD.v6)
                ]
            );
            assert_eq!(enrolled.interfaces, ["eth0"]);
            assert_eq!(redirection.enrolled().unwrap(), [pod.inode()]);
            assert_eq!(
                probe_set_members(&node, Family::V4).unwrap(),
                [IpAddr::V4(PodAndNode::POD.v4)]
            );
            assert_eq!(
                probe_set_members(&node, Family::V6).unwrap(),
                [IpAddr::V6(PodAndNode::POD.v6)]
            );
            let status = routing::reply_routing_status(&pod).unwrap();
            assert!(status.ipv4.rule && status.ipv4.route, "{status:?}");
            assert!(status.ipv6.is_some_and(|s| s.rule && s.route), "{status:?}");
            assert!(!status.tcp_fwmark_accept, "iptables mode sets no sysctl");

            for family in Family::ALL {
                let saved = redirection.saved_rules(&pod, family).unwrap();
                assert_eq!(saved.tables_with_istio_chains(), ["mangle", "nat", "raw"]);
                let count = |table, chain| saved.chain_rules(table, chain).len();
                assert_eq!(count("nat", CHAIN_OUTPUT), 6, "{backend} {family}");
                assert_eq!(count("nat", CHAIN_PREROUTING), 2);
                assert_eq!(count("mangle", CHAIN_OUTPUT), 1);
                assert_eq!(count("raw", CHAIN_PREROUTING), 1);
            }
            let first = everything(&pod);
            assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::Ambpf);
            assert_eq!(find_pod_rules(&node).unwrap(), PodRulesFound::None);

            // Again: nothing changes.
            redirection.enroll(&pod, dns(true)).unwrap();
            assert_eq!(everything(&pod), first, "{backend}: enrolling twice");

            // Without DNS capture: the DNS rules and the raw table go.
            redirection.enroll(&pod, dns(false)).unwrap();
            for family in Family::ALL {
                let saved = redirection.saved_rules(&pod, family).unwrap();
                assert_eq!(saved.tables_with_istio_chains(), ["mangle", "nat"]);
                assert_eq!(saved.chain_rules("nat", CHAIN_OUTPUT).len(), 4);
            }
            redirection.enroll(&pod, dns(true)).unwrap();
            assert_eq!(everything(&pod), first, "{backend}: DNS capture back on");

            // Unenrol: capture and probe entries gone, the reply path stays.
            assert!(redirection.unenroll(pod.inode()).unwrap());
            assert!(!redirection.unenroll(pod.inode()).unwrap());
            assert!(redirection.enrolled().unwrap().is_empty());
            for family in Family::ALL {
                assert!(probe_set_members(&node, family).unwrap().is_empty());
                let saved = redirection.saved_rules(&pod, family).unwrap();
                assert_eq!(saved.tables_with_istio_chains(), ["mangle"]);
            }
            assert!(routing::reply_routing_status(&pod).unwrap().ipv4.rule);
            assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::Ambpf);

            // Full removal leaves the pod as it was.
            remove_pod_rules(&pod).unwrap();
            remove_pod_rules(&pod).unwrap();
            assert!(
                istio_lines(&everything(&pod)).is_empty(),
                "{:#?}",
                everything(&pod)
            );
            let status = routing::reply_routing_status(&pod).unwrap();
            assert!(!status.ipv4.rule && !status.ipv4.route, "{status:?}");
            assert_eq!(find_pod_rules(&pod).unwrap(), PodRulesFound::None);

            // Uninstall cleans the host, pods enrolled at the time included.
            redirection.enroll(&pod, dns(true)).unwrap();
            redirection.uninstall().unwrap();
            assert!(istio_lines(&everything(&pod)).is_empty());
            assert!(
                istio_lines(&everything(&node)).is_empty(),
                "{:#?}",
                everything(&node)
            );
            let sets = node.run(|| {
                Command::new("ipset")
                    .args(["list", "-name"])
                    .output()
                    .unwrap()
            });
            assert!(sets.unwrap().stdout.is_empty());
            // Nothing left to remove.
            assert!(!remove_host_rules(&node).unwrap());
        }
    }

    #[test]
    fn auto_prefers_the_backend_the_host_uses() {
        let ns = NetnsGuard::create("auto").unwrap();
        let host = open(&ns);
        assert_eq!(detect_backend(&host).unwrap(), IptablesBackend::Nft);
        ns.run(|| {
            let out = Command::new("iptables-legacy")
                .args(["-w", "-t", "filter", "-A", "INPUT", "-j", "ACCEPT"])
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
        })
        .unwrap();
        assert_eq!(detect_backend(&host).unwrap(), IptablesBackend::Legacy);
        let redirection = IptablesRedirection::new(open(&ns), IptablesBackend::Auto).unwrap();
        assert_eq!(redirection.backend(), IptablesBackend::Legacy);
    }

    #[test]
    fn a_failed_restore_names_the_namespace_and_says_why() {
        let ns = NetnsGuard::create("bad").unwrap();
        let netns = open(&ns);
        let tools = Tools::find(IptablesBackend::Nft).unwrap();
        let restore = &tools.family(Family::V4).unwrap().restore;
        let err = run_in(
            &netns,
            restore,
            &["--noflush"],
            Some("*nat\n-A ISTIO_NOPE -j ACCEPT\nCOMMIT\n"),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, IptablesError::Failed { .. }), "{text}");
        assert!(
            text.starts_with("`iptables-nft-restore --noflush` failed in /run/netns/"),
            "{text}"
        );
        assert!(text.contains(ns.name()), "{text}");
        assert!(
            text.contains("input line 2: `-A ISTIO_NOPE -j ACCEPT`"),
            "{text}"
        );
    }

    #[test]
    fn a_pod_without_addresses_is_refused() {
        let host = NetnsGuard::create("host").unwrap();
        let empty = NetnsGuard::create("lo").unwrap();
        let mut redirection = IptablesRedirection::new(open(&host), IptablesBackend::Nft).unwrap();
        let err = redirection.enroll(&open(&empty), dns(true)).unwrap_err();
        assert!(matches!(err, EnrollError::NoAddress { .. }), "{err}");
        assert!(redirection.enrolled().unwrap().is_empty());
        assert!(istio_lines(&everything(&open(&empty))).is_empty());
    }
}
