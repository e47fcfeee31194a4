//! Finding the iptables and ipset binaries and running them in a namespace.

use std::{
    collections::BTreeMap,
    io::{self, Write},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use tracing::debug;

use super::{
    Family, IptablesBackend, IptablesError,
    rules::{RuleSet, SavedRules, istio_delete_commands, render},
};
use crate::netns::Netns;

/// Where binaries are looked for after `$PATH` (the agent may run with a
/// `$PATH` without the sbin directories).
pub(super) const FALLBACK_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];
/// Present when the kernel has IPv6.
const IPV6_PROC: &str = "/proc/sys/net/ipv6";

/// Looks `name` up in `$PATH`, then in [`FALLBACK_DIRS`].
pub(in crate::redirect) fn find_binary(name: &str) -> Option<PathBuf> {
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

#[cfg(test)]
thread_local! {
    /// Processes [`run_in`] started on this thread, for tests that count
    /// them against Istio's per-pod operations.
    pub(in crate::redirect) static PROCESSES_STARTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs `program args...` inside `netns` (the child process enters it before
/// exec), feeding it `input`; returns its stdout.
pub(in crate::redirect) fn run_in(
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
        cause: source,
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
    #[cfg(test)]
    PROCESSES_STARTED.with(|n| n.set(n.get() + 1));
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
    use ambpf_testbed::NetnsGuard;

    use super::*;
    use crate::redirect::iptables::{IptablesRedirection, rules::tests::SAVED_V4, tests::open};

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
}
