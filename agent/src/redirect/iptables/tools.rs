//! Finding the iptables and ipset binaries of a backend.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use tracing::debug;

use super::{
    Family, IptablesBackend, IptablesError,
    rules::{RuleSet, SavedRules, istio_delete_commands, render},
};
use crate::{
    netns::Netns,
    redirect::in_pod::tools::{find_binary, run_in},
};

/// Present when the kernel has IPv6.
const IPV6_PROC: &str = "/proc/sys/net/ipv6";

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

/// The binaries of one backend and family.
#[derive(Clone, Debug)]
pub(super) struct FamilyTools {
    restore: PathBuf,
    save: PathBuf,
    /// The single-command tool (`iptables-nft`, ...), for Istio's opt-out.
    tables: PathBuf,
}

/// Every binary a backend needs, found once.
#[derive(Clone, Debug)]
pub(super) struct Tools {
    pub(super) backend: IptablesBackend,
    /// Per family in use (IPv6 only when the kernel has it).
    pub(super) families: BTreeMap<Family, FamilyTools>,
}

fn ipv6_in_kernel() -> bool {
    Path::new(IPV6_PROC).exists()
}

pub(super) fn families_in_use() -> Vec<Family> {
    if ipv6_in_kernel() {
        Family::ALL.to_vec()
    } else {
        vec![Family::V4]
    }
}

impl Tools {
    /// The binaries of `backend` (not `Auto`), or an error naming the first
    /// one missing.
    pub(super) fn find(backend: IptablesBackend) -> Result<Self, IptablesError> {
        let mut families = BTreeMap::new();
        for family in families_in_use() {
            let needed_for = format!("the iptables redirection ({backend} backend, {family})");
            let restore =
                require_binary(&backend.binary(family, "restore"), &needed_for, "iptables")?;
            let save = require_binary(&backend.binary(family, "save"), &needed_for, "iptables")?;
            let tables = require_binary(&backend.command(family), &needed_for, "iptables")?;
            families.insert(
                family,
                FamilyTools {
                    restore,
                    save,
                    tables,
                },
            );
        }
        Ok(Self { backend, families })
    }

    /// Backends whose binaries are all present.
    pub(super) fn available() -> Vec<Self> {
        [IptablesBackend::Nft, IptablesBackend::Legacy]
            .into_iter()
            .filter_map(|b| Self::find(b).ok())
            .collect()
    }

    pub(super) fn family(&self, family: Family) -> Option<&FamilyTools> {
        self.families.get(&family)
    }

    pub(super) fn save(&self, netns: &Netns, family: Family) -> Result<SavedRules, IptablesError> {
        match self.family(family) {
            Some(tools) => Ok(SavedRules::parse(&run_in(netns, &tools.save, &[], None)?)),
            None => Ok(SavedRules::default()),
        }
    }

    /// Brings the chains of `owned` in `netns` to `wanted`, in one restore.
    pub(super) fn apply(
        &self,
        netns: &Netns,
        owned: &RuleSet,
        wanted: &RuleSet,
    ) -> Result<(), IptablesError> {
        let Some(tools) = self.family(owned.family) else {
            return Ok(());
        };
        let current = self.save(netns, owned.family)?;
        let input = render(owned, wanted, &current);
        if input.is_empty() {
            return Ok(());
        }
        let args: Vec<&str> = std::iter::once("--noflush")
            .chain(self.lock_flags().iter().copied())
            .collect();
        run_in(netns, &tools.restore, &args, Some(&input))?;
        Ok(())
    }

    /// The xtables lock flags Istio's node agent passes to a command that
    /// writes (`executeXTables`): none with nft, which takes no xtables
    /// lock; `--wait=30` with legacy.
    fn lock_flags(&self) -> &'static [&'static str] {
        match self.backend {
            IptablesBackend::Legacy => &["--wait=30"],
            IptablesBackend::Nft | IptablesBackend::Auto => &[],
        }
    }

    /// Istio's `DeleteInpodRules` for `family` in `netns`: one `iptables`
    /// process per command ([`istio_delete_commands`]), every failure
    /// ignored as Istio ignores it (a chain already gone, or never written:
    /// raw without DNS capture).
    pub(super) fn delete_inpod_rules(&self, netns: &Netns, family: Family) {
        let Some(tools) = self.family(family) else {
            return;
        };
        for command in istio_delete_commands() {
            let args: Vec<&str> = command
                .into_iter()
                .chain(self.lock_flags().iter().copied())
                .collect();
            if let Err(e) = run_in(netns, &tools.tables, &args, None) {
                debug!("ignored, as Istio's node agent ignores it: {e}");
            }
        }
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
pub(super) fn detect_backend(host: &Netns) -> Result<IptablesBackend, IptablesError> {
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

#[cfg(test)]
mod tests {
    use std::process::Command;

    use ambpf_testbed::NetnsGuard;

    use super::*;
    use crate::redirect::{
        in_pod::tools::ToolError,
        iptables::{IptablesRedirection, rules::tests::SAVED_V4, tests::open},
    };

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
        assert!(matches!(err, ToolError::Failed { .. }), "{text}");
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
}
