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
//! (a probe is never captured) and leave them first on opt-out (a reused
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
//! Opting a pod out does what Istio's node agent does
//! (`DeleteInpodRules`): the pod's addresses leave the ipsets, then per
//! family 18 `iptables` commands, one process each and every failure
//! ignored (the six jumps `-D`, then `-F` and `-X` of both chains in
//! mangle, nat and raw; `--wait=30` with the legacy backend only), then the
//! policy rule and routes go over netlink. Nothing stays, the reply path
//! included, so connections ztunnel proxies at that moment end, as with
//! Istio (the eBPF mode keeps them: docs/parity.md). A deleted pod only
//! loses its ipset members; its namespace dies with its rules.
//! [`remove_pod_rules`] removes everything in one restore per family, and
//! [`uninstall_node`] does that for a set of pods and then removes the host
//! rules and ipsets: [`IptablesRedirection::uninstall`] for the pods it
//! enrolled, `ambpf uninstall` for every namespace [`find_pod_rules`]
//! recognises as ambpf's (from the rules alone, so this works after the
//! agent crashed too).
//!
//! # Across restarts
//!
//! Each enrolled pod is recorded under the pin root ([`records`]); a new
//! agent lists the recorded pods as enrolled until it enrols them again, and
//! removes those no source wants any more (their rules, policy routing and
//! probe members). The full state check also finds ambpf's capture rules in
//! any namespace of the node that no pod is enrolled in
//! ([`check::scan_stray_capture`]), and removes them.
//!
//! # Backends
//!
//! `nft` (`iptables-nft-restore`, ...) or `legacy` (`iptables-legacy-...`),
//! chosen explicitly or, with [`IptablesBackend::Auto`], the one the host
//! namespace already has rules in (nft when neither or both equally).

mod adopted;
pub mod ipset;
mod nat_table;
mod node;
mod probes;
mod rules;
#[cfg(test)]
mod tests;
mod tools;

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashSet},
    io,
    net::IpAddr,
};

use tracing::{info, warn};

use self::tools::{Tools, detect_backend};
pub use self::{
    node::{
        NodeUninstall, PodRulesFound, find_any_pod_capture, find_pod_capture, find_pod_rules,
        probe_set_members, remove_host_rules, remove_pod_capture, remove_pod_rules, saved_rules,
        uninstall_node,
    },
    probes::{ProbeMember, probe_set_entries},
    rules::{RuleSet, SavedRules, host_rules, pod_rules, render_fresh},
};
pub use super::in_pod::{PROBE_SNAT_V4, PROBE_SNAT_V6};
use super::{
    AddressConflict, CheckScope, EnrollError, EnrollOptions, EnrolledPod, PodKey, PodRedirection,
    RedirectMode, Violation, ViolationKind, check,
    claims::AddressClaims,
    in_pod::{
        ToolError, keep_netns, keep_open_connections,
        records::{self, PodRecords},
        tools::FALLBACK_DIRS,
    },
    podnet, routing,
};
use crate::netns::Netns;
/// The host ipsets of enrolled pods' addresses.
pub const PROBE_IPSET_V4: &str = "istio-inpod-probes-v4";
pub const PROBE_IPSET_V6: &str = "istio-inpod-probes-v6";
/// Istio's chain names.
pub const CHAIN_PREROUTING: &str = "ISTIO_PRERT";
pub const CHAIN_OUTPUT: &str = "ISTIO_OUTPUT";
pub const CHAIN_POSTROUTING: &str = "ISTIO_POSTRT";

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

    /// E.g. `ip6tables-nft`.
    fn command(self, family: Family) -> String {
        format!("{}-{}", family.tables_tool(), self.name())
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
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("removing the pod records: {0}")]
    Records(io::Error),
    #[error("{0}")]
    Ipset(#[from] ipset::IpsetError),
}

/// An enrolled pod.
#[derive(Debug)]
struct PodEntry {
    /// Held while the pod is enrolled (so its inode is not reused).
    netns: Netns,
    key: PodKey,
    addresses: Vec<IpAddr>,
    dns_capture: bool,
}

/// Istio's in-pod iptables rules, per pod, plus the host probe SNAT.
#[derive(Debug)]
pub struct IptablesRedirection {
    host: Netns,
    tools: Tools,
    /// The probe ipsets, written over netlink in the host's namespace.
    ipset: RefCell<ipset::IpsetSocket>,
    /// By netns cookie.
    pods: BTreeMap<u64, PodEntry>,
    /// Which enrolled pod owns each address's probe ipset member.
    claims: AddressClaims<IpAddr>,
    /// Where each enrolled pod is recorded for the next agent ([`records`]).
    records: Option<PodRecords>,
    /// Pods an earlier agent enrolled, by netns cookie, until enrolled
    /// again or removed.
    adopted: BTreeMap<u64, records::AdoptedPod>,
    /// Pods the eBPF mode captured, by netns cookie, whose open connections
    /// are entered in conntrack before the rules redirect anything there
    /// ([`super::in_pod::conntrack`]).
    taken_over: HashSet<u64>,
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
        let ipset = RefCell::new(ipset::IpsetSocket::open(&host)?);
        let this = Self {
            host,
            tools,
            ipset,
            pods: BTreeMap::new(),
            claims: AddressClaims::default(),
            records: None,
            adopted: BTreeMap::new(),
            taken_over: HashSet::new(),
        };
        for family in this.tools.families.keys().copied() {
            this.write_host_side(family)?;
        }
        info!(
            "iptables redirection ready ({backend} backend, host rules in {})",
            this.host.path().display()
        );
        Ok(this)
    }

    /// The host side of `family`, idempotently: its probe ipset, then the
    /// probe SNAT rules that match it.
    fn write_host_side(&self, family: Family) -> Result<(), IptablesError> {
        self.ipset
            .borrow_mut()
            .create_hash_ip(family.probe_ipset(), family == Family::V6)?;
        if self.tools.backend == IptablesBackend::Nft {
            // So that uninstalling can leave no empty table behind.
            nat_table::create_if_missing(&self.host, family)?;
        }
        let rules = host_rules(family);
        self.tools.apply(&self.host, &rules, &rules)
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

    /// Removes everything from every enrolled pod (adopted ones too), then
    /// the host rules and ipsets ([`uninstall_node`], as `ambpf uninstall`
    /// does for the pods it finds), then the pod records.
    pub fn uninstall(self) -> Result<(), EnrollError> {
        let pods = self.pods.values().map(|e| &e.netns);
        uninstall_node(&self.host, pods.chain(self.adopted_netns())).into_result()?;
        self.remove_records()
            .map_err(|e| EnrollError::from(IptablesError::Records(e)))
    }

    /// Probe ipsets, policy routing, then the in-pod rules of each family.
    fn apply_pod(
        &mut self,
        netns: &Netns,
        key: PodKey,
        addresses: &[IpAddr],
        previous: &[IpAddr],
        dns_capture: bool,
    ) -> Result<Vec<AddressConflict>, EnrollError> {
        let conflicts = self.claim_probe_addresses(key.netns_cookie, addresses, previous)?;
        routing::install_policy_routing(netns)?;
        if self.taken_over.contains(&key.netns_cookie) {
            // The rules without their redirects first: from then on every
            // connection is tracked from its first packet, untranslated.
            for family in self.tools.families.keys().copied() {
                let owned = pod_rules(family, true);
                let tracking = pod_rules(family, dns_capture).without_redirects();
                self.tools.apply(netns, &owned, &tracking)?;
            }
            keep_open_connections(netns)?;
            self.taken_over.remove(&key.netns_cookie);
        }
        for family in self.tools.families.keys().copied() {
            let owned = pod_rules(family, true);
            self.tools
                .apply(netns, &owned, &pod_rules(family, dns_capture))?;
        }
        Ok(conflicts)
    }

    /// Opts the pod out as Istio's node agent does: the probe ipset entries
    /// the pod owns, then `DeleteInpodRules` (per family its 18 `iptables`
    /// commands, then the policy rule and routes).
    fn release_pod(&mut self, cookie: u64) -> Result<(), EnrollError> {
        let Some(entry) = self.pods.get(&cookie) else {
            return Ok(());
        };
        let addresses = entry.addresses.clone();
        self.release_probe_addresses(cookie, &addresses)?;
        let entry = &self.pods[&cookie];
        for family in self.tools.families.keys().copied() {
            self.tools.delete_inpod_rules(&entry.netns, family);
        }
        routing::remove_policy_routing(&entry.netns)?;
        Ok(())
    }
}

impl IptablesRedirection {
    /// The pods (by netns cookie) the eBPF mode captured: the connections
    /// they have open when this mode first writes its rules there keep
    /// working ([`super::in_pod::conntrack`]).
    pub fn taking_over(mut self, cookies: impl IntoIterator<Item = u64>) -> Self {
        self.taken_over.extend(cookies);
        self
    }
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
        let mut steps = super::EnrolSteps::default();
        let net = steps.time("inspect", || podnet::inspect(netns))?;
        let addresses = super::pod_addresses(&net, netns)?;
        let key = PodKey {
            netns_cookie: net.netns_cookie,
            netns_inode: netns.inode(),
        };
        let previous = self
            .pods
            .get(&key.netns_cookie)
            .map(|e| e.addresses.clone());
        let kept = match previous {
            Some(_) => None,
            None => Some(keep_netns(netns).map_err(IptablesError::from)?),
        };
        let stale = previous.clone().unwrap_or_default();
        let applied = steps.time("rules", || {
            self.apply_pod(netns, key, &addresses, &stale, options.dns_capture)
        });
        let conflicts = match applied {
            Ok(conflicts) => conflicts,
            Err(e) => {
                if previous.is_none() {
                    // Leave nothing half-done behind for a pod that was
                    // not enrolled.
                    let _ = self.release_probe_addresses(key.netns_cookie, &addresses);
                    if let Err(undo) = remove_pod_rules(netns) {
                        warn!(
                            "undoing the failed enrolment of {}: {undo}",
                            netns.path().display()
                        );
                    }
                }
                return Err(e);
            }
        };
        match kept {
            Some(netns) => {
                self.pods.insert(
                    key.netns_cookie,
                    PodEntry {
                        netns,
                        key,
                        addresses: addresses.clone(),
                        dns_capture: options.dns_capture,
                    },
                );
            }
            None => {
                if let Some(entry) = self.pods.get_mut(&key.netns_cookie) {
                    entry.addresses = addresses.clone();
                    entry.dns_capture = options.dns_capture;
                }
            }
        }
        self.record(key);
        info!(
            "enrolled pod in {} with iptables ({} backend, {addresses:?}, dns capture {})",
            netns.path().display(),
            self.tools.backend,
            options.dns_capture
        );
        Ok(EnrolledPod {
            netns: netns.path().to_owned(),
            netns_inode: key.netns_inode,
            netns_cookie: key.netns_cookie,
            addresses,
            interfaces: net.interfaces.into_iter().map(|i| i.name).collect(),
            dns_capture: options.dns_capture,
            conflicts,
            steps,
        })
    }

    fn unenroll(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        let cookie = pod.netns_cookie;
        let Some(entry) = self.pods.get(&cookie) else {
            return self.unenroll_adopted(pod);
        };
        let netns_path = entry.netns.path().to_owned();
        if let Err(e) = self.release_pod(cookie) {
            // A pod whose network is torn down (no interface left) has
            // nothing worth cleaning: forget it. Otherwise keep it for a retry.
            let entry = &self.pods[&cookie];
            let torn_down = podnet::inspect(&entry.netns).is_ok_and(|n| n.interfaces.is_empty());
            if !torn_down {
                return Err(e);
            }
            warn!(
                "forgetting pod in {} (its network is gone): {e}",
                netns_path.display()
            );
        }
        if let Some(entry) = self.pods.remove(&cookie) {
            self.forget(entry.key);
        }
        info!(
            "unenrolled pod in {} ({pod}) from iptables",
            netns_path.display()
        );
        Ok(true)
    }

    fn forget_deleted(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        self.forget_deleted_pod(pod)
    }

    fn enrolled(&mut self) -> Result<Vec<PodKey>, EnrollError> {
        let enrolled = self.pods.values().map(|e| e.key);
        Ok(enrolled.chain(self.adopted_keys()).collect())
    }

    fn check(&mut self, pods: &[(PodKey, &Netns)], scope: CheckScope) -> Vec<Violation> {
        let mut out = self.check_probe_sets();
        if scope == CheckScope::Full {
            out.extend(self.check_host_rules());
            for (key, netns) in pods {
                out.extend(self.check_pod(*key, netns));
            }
            let nft = check::mixed::node_nft(&self.host);
            out.extend(check::mixed::scan_mixed_capture(
                RedirectMode::Iptables,
                pods,
                nft.as_ref(),
            ));
            let enrolled = self.pods.keys().copied();
            let enrolled = enrolled.chain(self.adopted.keys().copied()).collect();
            out.extend(check::scan_stray_capture(Some(&self.host), &enrolled, None));
        }
        out
    }

    fn repair(&mut self, violations: &[Violation]) -> Vec<PodKey> {
        self.repair_host_rules(violations);
        self.repair_probe_sets(violations);
        for violation in violations {
            if violation.kind == ViolationKind::CaptureOrphan {
                check::repair_stray_capture(violation);
            }
        }
        check::pods_to_enrol_again(violations)
    }
}
