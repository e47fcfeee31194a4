//! The nftables redirection: Istio 1.28's native nftables rules
//! (`global.nativeNftables=true`), for hosts without iptables.
//!
//! # What is installed where
//!
//! **In each enrolled pod's network namespace**, three `inet` tables, each
//! added, flushed and rebuilt in one `nft -f -` transaction run by a child
//! that enters the namespace ([`rules::pod_script`], Istio's
//! `cni/pkg/nftables/testdata/default.golden` plus its `ip6` rules):
//!
//! ```text
//! istio-ambient-nat     prerouting (nat, -100), output (nat, -100):
//!                       probe-address accept, inbound redirect to 15006
//!                       (not to loopback, 15008 or mark 0x539), [dns] to
//!                       15053, mark 0x111 and loopback accepts, outbound
//!                       redirect to 15001
//! istio-ambient-mangle  prerouting (filter, -150): mark 0x539 sets connmark
//!                       0x111; output (route, -150): connmark 0x111 restored
//! istio-ambient-raw     [dns] prerouting/output (filter, -300): DNS in
//!                       conntrack zone 1
//! policy routing        fwmark 0x111/0xfff lookup 100, local default dev lo
//!                       (over netlink, shared with the iptables mode)
//! ```
//!
//! Each table carries ambpf's comment ([`OWNED_COMMENT`]), set when it is
//! created, as knftables marks its tables: a pod whose table of the same
//! name lacks it is another tool's (Istio's CNI agent, say), and is refused
//! with its tables untouched. A pod's first write creates the tables with
//! `create table` (which fails if one exists), so the check costs a read
//! only when a table is already there.
//!
//! **In the host namespace**, once, by [`NftablesRedirection::new`]: the
//! table `inet istio-ambient-nat` with the sets `istio-inpod-probes-v4/-v6`
//! (every enrolled pod's addresses, each commented with its owner, as the
//! iptables mode's ipsets) and a postrouting rule (nat, priority 100) that
//! SNATs TCP from local sockets to members to 169.254.7.127
//! (`fd16:9254:7127:1337:ffff:ffff:ffff:ffff`). Istio matches kubelet's UID
//! there (`meta skuid <uid>`) because nft has no `--socket-exists`; ambpf
//! matches `meta skuid >= 0`, which is true of every packet that has a full
//! local socket in this namespace and false of every other (the kernel's
//! `meta skuid` stops the rule when there is none): the very set of packets
//! that Istio's iptables rule (`-m owner --socket-exists`) and ambpf's
//! iptables mode SNAT. Forwarded traffic (kube-proxy's) has no local socket
//! and is captured, as there.
//!
//! # Process counts
//!
//! A new pod costs one `nft -f -` in its namespace and one on the host (its
//! addresses' members, both families in one transaction); re-enrolling
//! with the same addresses costs the pod's one. A deleted pod costs one
//! host transaction and nothing in its namespace. An opt-out is Istio's
//! `DeleteInpodRules`: the host transaction for the members, then one in
//! the namespace deleting its tables (a failure only logged, as Istio
//! does), then the policy rule and routes over netlink. Nothing stays:
//! deleting the nat table unhooks NAT from the namespace and the reply path
//! goes, so connections ztunnel proxies at that moment end, as with Istio.
//! Istio's transaction names the raw table always and fails whole for a
//! pod without DNS capture (no raw table), leaving its tables; ambpf names
//! only the tables the pod has.
//!
//! # Across restarts
//!
//! As the iptables mode: each enrolled pod is recorded (`nftables/pods/`
//! under the pin root), a new agent adopts the records and removes the pods
//! no source wants, and the full state check finds ambpf's tables in any
//! namespace of the node that no pod is enrolled in
//! ([`check::scan_stray_tables`]) and removes them.
//!
//! # Refusals
//!
//! At start-up, before anything is written: `nft` missing, `nft` built
//! without JSON (the mode reads sets through `nft -j`), `nft` older than
//! [`MIN_NFT_VERSION`], and a host table of the same name that is not
//! ambpf's.

mod host;
mod pod_tables;
mod rules;
#[cfg(test)]
mod tests;
mod tool;

use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    path::PathBuf,
};

use tracing::{info, warn};

pub use self::{
    host::{
        PodCapture, find_any_pod_capture, find_pod_capture, find_pod_tables, probe_set_entries,
        remove_foreign_host_table, remove_foreign_pod_capture, remove_host_table,
        remove_pod_capture, remove_pod_tables,
    },
    rules::{delete_tables, host_script, pod_script},
    tool::Nft,
};
use super::{
    CheckScope, EnrollError, EnrollOptions, EnrolledPod, PodKey, PodRedirection, RedirectMode,
    Violation, ViolationKind, check,
    claims::AddressClaims,
    in_pod::{
        ToolError, keep_netns,
        records::{self, PodRecords},
    },
    podnet, routing,
};
use crate::netns::Netns;

pub const NAT_TABLE: &str = "istio-ambient-nat";
pub const MANGLE_TABLE: &str = "istio-ambient-mangle";
pub const RAW_TABLE: &str = "istio-ambient-raw";
pub const POD_TABLES: [&str; 3] = [NAT_TABLE, MANGLE_TABLE, RAW_TABLE];
/// Istio's probe sets keep the ipsets' names.
pub const PROBE_SET_V4: &str = "istio-inpod-probes-v4";
pub const PROBE_SET_V6: &str = "istio-inpod-probes-v6";
/// The comment on every table ambpf creates.
pub const OWNED_COMMENT: &str = "ambpf: Istio ambient redirection";
/// The conntrack zone of DNS between ztunnel and resolvers.
const ZONE_DNS: u32 = 1;
/// nft 1.0.1 is the first that reads only the table it is asked about;
/// older ones parse the whole ruleset for any command, so a table another
/// tool wrote with newer features fails or crashes them (knftables'
/// minimum, for the same reason; Istio #58492 is this with sets).
pub const MIN_NFT_VERSION: (u32, u32, u32) = (1, 0, 1);

#[derive(Debug, thiserror::Error)]
pub enum NftablesError {
    #[error(
        "nft not found in $PATH or /usr/sbin, /sbin, /usr/bin, /bin: the nftables redirection \
         needs it (Debian and RHEL package `nftables`)"
    )]
    Missing,
    #[error(
        "{nft} has no JSON support (`nft -j` says \"JSON support not compiled-in\"): the \
         nftables redirection reads its sets as JSON; install an nft built with libjansson"
    )]
    NoJson { nft: String },
    #[error(
        "{nft} is nftables {found}; the nftables redirection needs {needed} or later (older \
         ones parse every table of a namespace, and fail on other tools' newer ones)"
    )]
    TooOld {
        nft: String,
        found: String,
        needed: String,
    },
    #[error("{nft} --version printed no version: {output:?}")]
    Unversioned { nft: String, output: String },
    #[error(
        "{} holds nftables table(s) {} that ambpf did not create (no `{OWNED_COMMENT}` \
         comment): another tool's; left untouched, not enrolled",
        netns.display(), tables.join(", ")
    )]
    ForeignTables {
        netns: PathBuf,
        tables: Vec<&'static str>,
    },
    #[error("reading {what}: {cause}")]
    Unreadable { what: String, cause: String },
    #[error("{0}")]
    Run(ToolError),
    #[error("removing the pod records: {0}")]
    Records(std::io::Error),
}

/// The probe sets of the families in use.
fn probe_sets() -> impl Iterator<Item = &'static str> {
    let ipv6 = ipv6_in_kernel();
    [PROBE_SET_V4, PROBE_SET_V6]
        .into_iter()
        .take(if ipv6 { 2 } else { 1 })
}

fn ipv6_in_kernel() -> bool {
    std::path::Path::new("/proc/sys/net/ipv6").exists()
}

#[derive(Debug)]
struct PodEntry {
    netns: Netns,
    key: PodKey,
    addresses: Vec<IpAddr>,
    /// Whether the raw table was written (what the opt-out deletes).
    dns_capture: bool,
}

/// Istio's in-pod nftables tables, per pod, plus the host probe SNAT.
#[derive(Debug)]
pub struct NftablesRedirection {
    host: Netns,
    nft: Nft,
    ipv6: bool,
    pods: BTreeMap<u64, PodEntry>,
    claims: AddressClaims<IpAddr>,
    records: Option<PodRecords>,
    adopted: BTreeMap<u64, records::AdoptedPod>,
    /// Pods the eBPF mode captured, by netns cookie, whose open connections
    /// are entered in conntrack before the rules redirect anything there
    /// ([`super::in_pod::conntrack`]).
    taken_over: HashSet<u64>,
    /// Set once the agent takes a node over from Istio's node agent, which
    /// left its tables (the names of ambpf's, without its comment) in its
    /// pods: they are replaced by ambpf's in one transaction rather than
    /// refusing the pod ([`super::istio_agent`]).
    replacing_istio: bool,
}

impl NftablesRedirection {
    /// Finds and vets `nft`, then writes the host table in `host`.
    pub fn new(host: Netns) -> Result<Self, NftablesError> {
        let nft = Nft::find(&host)?;
        Self::with_nft(host, nft)
    }

    /// [`Self::new`] on a node taken over from Istio's node agent: its host
    /// table, if it left one, is replaced, and so are its tables in the pods
    /// ([`Self::replacing_istio_tables`]).
    pub fn taking_over_istio(host: Netns) -> Result<Self, NftablesError> {
        let nft = Nft::find(&host)?;
        if remove_foreign_host_table(&nft, &host)? {
            info!(
                "removed the host table {NAT_TABLE} Istio's node agent left in {}: the nftables \
                 mode writes its own",
                host.path().display()
            );
        }
        Ok(Self::with_nft(host, nft)?.replacing_istio_tables(true))
    }

    /// As [`Self::new`] with a vetted `nft`.
    pub fn with_nft(host: Netns, nft: Nft) -> Result<Self, NftablesError> {
        let present = nft.inet_tables(&host)?;
        if present.iter().any(|t| t == NAT_TABLE) && !nft.owns(&host, NAT_TABLE)? {
            return Err(NftablesError::ForeignTables {
                netns: host.path().to_owned(),
                tables: vec![NAT_TABLE],
            });
        }
        let ipv6 = ipv6_in_kernel();
        nft.apply(&host, &host_script(ipv6))?;
        info!(
            "nftables redirection ready (nft {}.{}.{}, host table in {})",
            nft.version.0,
            nft.version.1,
            nft.version.2,
            host.path().display()
        );
        Ok(Self {
            host,
            nft,
            ipv6,
            pods: BTreeMap::new(),
            claims: AddressClaims::default(),
            records: None,
            adopted: BTreeMap::new(),
            taken_over: HashSet::new(),
            replacing_istio: false,
        })
    }

    /// The pods (by netns cookie) the eBPF mode captured: the connections
    /// they have open when this mode first writes its tables there keep
    /// working ([`super::in_pod::conntrack`]).
    /// Replaces Istio's node agent's tables in the pods it enrols (a
    /// takeover from that agent), rather than refusing them.
    pub fn replacing_istio_tables(mut self, replacing: bool) -> Self {
        self.replacing_istio = replacing;
        self
    }

    pub fn taking_over(mut self, cookies: impl IntoIterator<Item = u64>) -> Self {
        self.taken_over.extend(cookies);
        self
    }

    pub fn nft(&self) -> &Nft {
        &self.nft
    }

    /// Records enrolled pods under `dir` and adopts those an earlier agent
    /// recorded there ([`records`]).
    pub fn with_records(mut self, dir: PathBuf) -> Self {
        let (records, adopted) = PodRecords::adopt(dir);
        self.records = records;
        self.adopted = adopted;
        self
    }

    /// Removes everything from every enrolled and adopted pod, then the host
    /// table, then the records.
    pub fn uninstall(self) -> Result<(), EnrollError> {
        let adopted = self.adopted.values().filter_map(|p| p.netns.as_ref());
        for netns in self.pods.values().map(|e| &e.netns).chain(adopted) {
            remove_pod_tables(&self.nft, netns)?;
        }
        remove_host_table(&self.nft, &self.host)?;
        if let Some(records) = &self.records {
            records.remove_all().map_err(NftablesError::Records)?;
        }
        Ok(())
    }

    fn record(&mut self, key: PodKey) {
        self.adopted.remove(&key.netns_cookie);
        if let Some(records) = &self.records {
            records.write(key);
        }
    }

    fn forget(&mut self, key: PodKey) {
        if let Some(records) = &self.records {
            records.remove(key);
        }
    }

    /// Removes a pod an earlier agent enrolled: its members, then all its
    /// tables and policy routing.
    fn unenroll_adopted(&mut self, key: PodKey) -> Result<bool, EnrollError> {
        let Some(pod) = self.adopted.get(&key.netns_cookie) else {
            return Ok(false);
        };
        let key = pod.key;
        self.release_members_naming(key.netns_cookie)?;
        if let Some(netns) = &self.adopted[&key.netns_cookie].netns {
            if let Err(e) = remove_pod_tables(&self.nft, netns) {
                let torn_down = podnet::inspect(netns).is_ok_and(|n| n.interfaces.is_empty());
                if !torn_down {
                    return Err(e);
                }
            }
            info!(
                "removed the nftables tables and reply routing of {} ({key}), enrolled by an \
                 earlier agent",
                netns.path().display()
            );
        }
        self.adopted.remove(&key.netns_cookie);
        self.forget(key);
        Ok(true)
    }

    fn check_pod(&self, key: PodKey, netns: &Netns) -> Vec<Violation> {
        let mut out = Vec::new();
        let unreadable = |e: String| Violation::new(ViolationKind::Unreadable, e).for_pod(key);
        if let (Ok(net), Some(entry)) = (podnet::inspect(netns), self.pods.get(&key.netns_cookie)) {
            out.extend(crate::redirect::check::addresses_changed(
                key,
                &entry.addresses,
                &net,
                netns,
            ));
        }
        match find_pod_tables(&self.nft, netns) {
            Ok((ours, _)) if ours.contains(&NAT_TABLE) => {}
            Ok(_) => out.push(
                Violation::new(
                    ViolationKind::RulesMissing,
                    format!("the pod with {key} lacks its table {NAT_TABLE}"),
                )
                .for_pod(key),
            ),
            Err(e) => out.push(unreadable(format!("the pod with {key}: {e}"))),
        }
        match routing::reply_routing_status(netns) {
            Ok(status) if status.policy_routing_installed() => {}
            Ok(status) => out.push(
                Violation::new(
                    ViolationKind::RoutingMissing,
                    format!("the pod with {key} lacks part of its policy routing: {status:?}"),
                )
                .for_pod(key),
            ),
            Err(e) => out.push(unreadable(format!("the pod with {key}: {e}"))),
        }
        out
    }
}

impl PodRedirection for NftablesRedirection {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Nftables
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
        let cookie = key.netns_cookie;
        let previous = self.pods.get(&cookie).map(|e| e.addresses.clone());
        let known = previous.is_some();
        let kept = if known {
            None
        } else {
            Some(keep_netns(netns).map_err(NftablesError::from)?)
        };
        let stale = previous.unwrap_or_default();
        let conflicts = steps.time("probes", || {
            self.claim_probe_addresses(cookie, &addresses, &stale)
        })?;
        // The tables first: a pod whose tables another tool holds is refused
        // before anything of its policy routing (which may be that tool's,
        // Istio's the same) is touched.
        let written = steps.time("rules", || {
            self.write_pod(netns, cookie, options.dns_capture, known)?;
            routing::install_policy_routing(netns).map_err(EnrollError::from)
        });
        if let Err(e) = written {
            if !known {
                // Nothing half-done for a pod that was not enrolled; a
                // refused pod's tables are another's and stay.
                let _ = self.release_probe_addresses(cookie, &addresses);
                if !matches!(
                    e,
                    EnrollError::Nftables(NftablesError::ForeignTables { .. })
                ) && let Err(undo) = remove_pod_tables(&self.nft, netns)
                {
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
                let entry = PodEntry {
                    netns,
                    key,
                    addresses: addresses.clone(),
                    dns_capture: options.dns_capture,
                };
                self.pods.insert(cookie, entry);
            }
            None => {
                if let Some(entry) = self.pods.get_mut(&cookie) {
                    entry.addresses = addresses.clone();
                    entry.dns_capture = options.dns_capture;
                }
            }
        }
        self.record(key);
        info!(
            "enrolled pod in {} with nftables ({addresses:?}, dns capture {})",
            netns.path().display(),
            options.dns_capture
        );
        Ok(EnrolledPod {
            netns: netns.path().to_owned(),
            netns_inode: key.netns_inode,
            netns_cookie: cookie,
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
        let addresses = entry.addresses.clone();
        self.release_probe_addresses(cookie, &addresses)?;
        let entry = &self.pods[&cookie];
        // Istio's `DeleteInpodRules`: one transaction deleting the tables,
        // whose failure is only logged, then the policy rule and routes.
        let script = rules::istio_delete_pod_tables(entry.dns_capture);
        if let Err(e) = self.nft.apply(&entry.netns, &script) {
            warn!(
                "deleting the tables of {}, as Istio's node agent does: {e}",
                entry.netns.path().display()
            );
        }
        if let Err(e) = routing::remove_policy_routing(&entry.netns) {
            let torn_down = podnet::inspect(&entry.netns).is_ok_and(|n| n.interfaces.is_empty());
            if !torn_down {
                return Err(e.into());
            }
            warn!(
                "forgetting pod in {} (its network is gone): {e}",
                entry.netns.path().display()
            );
        }
        if let Some(entry) = self.pods.remove(&cookie) {
            info!(
                "unenrolled pod in {} ({pod}) from nftables",
                entry.netns.path().display()
            );
            self.forget(entry.key);
        }
        Ok(true)
    }

    /// As Istio's node agent: the pod's set members go, nothing is done in
    /// its namespace, which dies with it.
    fn forget_deleted(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        let cookie = pod.netns_cookie;
        let Some(entry) = self.pods.get(&cookie) else {
            return self.unenroll_adopted(pod);
        };
        let addresses = entry.addresses.clone();
        self.release_probe_addresses(cookie, &addresses)?;
        if let Some(entry) = self.pods.remove(&cookie) {
            self.forget(entry.key);
        }
        Ok(true)
    }

    fn enrolled(&mut self) -> Result<Vec<PodKey>, EnrollError> {
        let enrolled = self.pods.values().map(|e| e.key);
        Ok(enrolled
            .chain(self.adopted.values().map(|p| p.key))
            .collect())
    }

    fn check(&mut self, pods: &[(PodKey, &Netns)], scope: CheckScope) -> Vec<Violation> {
        let mut out = self.check_probe_sets();
        if scope == CheckScope::Full {
            // Unless reading the probe sets already found the table gone.
            if !out
                .iter()
                .any(|v| v.kind == ViolationKind::HostRulesMissing)
            {
                out.extend(self.check_host_table());
            }
            for (key, netns) in pods {
                out.extend(self.check_pod(*key, netns));
            }
            out.extend(check::mixed::scan_mixed_capture(
                RedirectMode::Nftables,
                pods,
                Some(&self.nft),
            ));
            let enrolled = self.pods.keys().chain(self.adopted.keys()).copied();
            let enrolled = enrolled.collect();
            out.extend(check::scan_stray_tables(&self.host, &enrolled, &self.nft));
        }
        out
    }

    fn repair(&mut self, violations: &[Violation]) -> Vec<PodKey> {
        self.repair_host_table(violations);
        self.repair_probe_sets(violations);
        for violation in violations {
            if violation.kind == ViolationKind::CaptureOrphan {
                check::repair_stray_tables(violation, &self.nft);
            }
        }
        check::pods_to_enrol_again(violations)
    }
}
