//! What the test suite must leave as it found it: the host's packet filter
//! rules (iptables and ip6tables, nft and legacy backends), ipsets, policy
//! rules, routes and the `/sys/fs/bpf` tree.
//!
//! `cargo xtask test` takes a [`Snapshot`] before `cargo test` and another
//! after, and fails naming every line that differs. Taking both around the
//! whole run, rather than in each test binary, means test binaries running
//! side by side never see each other's work in progress.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

/// Where a snapshot is taken: the network namespace of this process, or a
/// named one (`ip netns exec`), and a bpffs directory to list.
pub struct Place {
    pub netns: Option<String>,
    pub bpffs: PathBuf,
}

impl Place {
    /// The host: this process's network namespace and `/sys/fs/bpf`.
    pub fn host() -> Self {
        Self {
            netns: None,
            bpffs: PathBuf::from("/sys/fs/bpf"),
        }
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        match &self.netns {
            None => {
                let mut cmd = Command::new(program);
                cmd.args(args);
                cmd
            }
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns, program]).args(args);
                cmd
            }
        }
    }
}

/// Each section's lines, normalized so that only changes of state differ
/// (no packet counters, no route lifetimes counting down).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    sections: BTreeMap<String, Vec<String>>,
}

type Normalize = fn(&str) -> Vec<String>;

impl Snapshot {
    pub fn take(place: &Place) -> Self {
        let mut snapshot = Self::default();
        for backend in ["nft", "legacy"] {
            for tool in ["iptables", "ip6tables"] {
                let save = format!("{tool}-{backend}-save");
                snapshot.record(place, &save, &[], iptables_lines);
            }
        }
        snapshot.record(place, "ipset", &["save"], sorted_lines);
        for family in ["-4", "-6"] {
            snapshot.record(place, "ip", &[family, "rule", "show"], plain_lines);
            snapshot.record(
                place,
                "ip",
                &[family, "route", "show", "table", "all"],
                route_lines,
            );
        }
        let mut files = Vec::new();
        list_tree(&place.bpffs, &place.bpffs, &mut files);
        files.sort();
        snapshot
            .sections
            .insert(format!("ls -R {}", place.bpffs.display()), files);
        snapshot
    }

    /// Runs `program args` at `place`; a tool that is missing or fails is
    /// recorded as such, so that it compares equal to itself.
    fn record(&mut self, place: &Place, program: &str, args: &[&str], normalize: Normalize) {
        let name = std::iter::once(program)
            .chain(args.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        let lines = match place.command(program, args).output() {
            Ok(out) if out.status.success() => normalize(&String::from_utf8_lossy(&out.stdout)),
            Ok(out) => vec![format!("(failed: {})", out.status)],
            Err(e) => vec![format!("(not run: {})", e.kind())],
        };
        self.sections.insert(name, lines);
    }

    /// Every line that is in one snapshot and not the other, by section:
    /// `"<section>: - <line>"` for gone, `"<section>: + <line>"` for new.
    pub fn differences(&self, after: &Snapshot) -> Vec<String> {
        let empty = Vec::new();
        let mut out = Vec::new();
        let names: std::collections::BTreeSet<_> =
            self.sections.keys().chain(after.sections.keys()).collect();
        for name in names {
            let before = self.sections.get(name).unwrap_or(&empty);
            let now = after.sections.get(name).unwrap_or(&empty);
            for line in before.iter().filter(|l| !now.contains(l)) {
                out.push(format!("{name}: - {line}"));
            }
            for line in now.iter().filter(|l| !before.contains(l)) {
                out.push(format!("{name}: + {line}"));
            }
        }
        out
    }

    /// A report of [`Self::differences`] for a failure message.
    pub fn report(&self, after: &Snapshot) -> Option<String> {
        let differences = self.differences(after);
        if differences.is_empty() {
            return None;
        }
        let mut report = String::from(
            "the test run changed the host (or something else on this machine did meanwhile):\n",
        );
        for line in differences {
            let _ = writeln!(report, "  {line}");
        }
        Some(report)
    }
}

fn plain_lines(text: &str) -> Vec<String> {
    text.lines().map(str::to_owned).collect()
}

fn sorted_lines(text: &str) -> Vec<String> {
    let mut lines = plain_lines(text);
    lines.sort();
    lines
}

/// `*-save` output without its comments (a timestamp) and chain counters.
fn iptables_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.split_once(" [") {
            Some((chain, _)) if l.starts_with(':') => chain.to_owned(),
            _ => l.to_owned(),
        })
        .collect()
}

/// Routes without `expires <n>sec`, which counts down on router-advertised
/// IPv6 routes.
fn route_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|line| {
            let mut words = Vec::new();
            let mut iter = line.split_whitespace();
            while let Some(word) = iter.next() {
                if word == "expires" {
                    iter.next();
                } else {
                    words.push(word);
                }
            }
            words.join(" ")
        })
        .collect()
}

/// Every path under `dir`, relative to `root`; directories end with `/`.
fn list_tree(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let relative = path.strip_prefix(root).unwrap_or(&path).display();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(format!("{relative}/"));
            list_tree(root, &path, out);
        } else {
            out.push(relative.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_timestamps_and_lifetimes_are_not_state() {
        let a = "# Generated by iptables-nft-save v1.8.9 on Thu Dec  3 18:00:00 2026\n\
                 *nat\n:PREROUTING ACCEPT [12:720]\n-A POSTROUTING -j ISTIO_POSTRT\nCOMMIT\n";
        let b = "# Generated by iptables-nft-save v1.8.9 on Thu Dec  3 19:00:00 2026\n\
                 *nat\n:PREROUTING ACCEPT [99:5940]\n-A POSTROUTING -j ISTIO_POSTRT\nCOMMIT\n";
        assert_eq!(iptables_lines(a), iptables_lines(b));
        assert_eq!(
            route_lines(
                "default via fe80::1 dev eth0 proto ra metric 1024 expires 1790sec pref medium"
            ),
            route_lines(
                "default via fe80::1 dev eth0 proto ra metric 1024 expires 12sec pref medium"
            ),
        );
    }

    #[test]
    fn a_removed_chain_and_a_new_rule_are_both_named() {
        let section = |lines: &[&str]| Snapshot {
            sections: BTreeMap::from([(
                "iptables-nft-save".to_owned(),
                lines.iter().map(|l| (*l).to_owned()).collect(),
            )]),
        };
        let before = section(&["*nat", ":ISTIO_POSTRT -", "COMMIT"]);
        let after = section(&["*nat", "-A OUTPUT -j ACCEPT", "COMMIT"]);
        assert_eq!(
            before.differences(&after),
            [
                "iptables-nft-save: - :ISTIO_POSTRT -",
                "iptables-nft-save: + -A OUTPUT -j ACCEPT"
            ]
        );
        assert_eq!(before.report(&before), None);
        assert!(before.report(&after).unwrap().contains("ISTIO_POSTRT"));
    }

    /// A throwaway network namespace and directory, removed on drop.
    struct Scratch {
        place: Place,
    }

    impl Scratch {
        fn create() -> Self {
            let name = format!("ambpf-hoststate-{}", std::process::id());
            let ok = Command::new("ip").args(["netns", "add", &name]).status();
            assert!(ok.unwrap().success(), "ip netns add {name}");
            let bpffs = std::env::temp_dir().join(&name);
            std::fs::create_dir(&bpffs).unwrap();
            Self {
                place: Place {
                    netns: Some(name),
                    bpffs,
                },
            }
        }

        fn run(&self, program: &str, args: &[&str]) {
            let out = self.place.command(program, args).output().unwrap();
            assert!(out.status.success(), "{program} {args:?}: {out:?}");
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let name = self.place.netns.as_deref().unwrap();
            let _ = Command::new("ip").args(["netns", "del", name]).status();
            let _ = std::fs::remove_dir_all(&self.place.bpffs);
        }
    }

    /// Privileged: each kind of state the check covers, changed in a
    /// namespace of the test's own, is reported.
    #[test]
    fn every_kind_of_change_is_reported() {
        let scratch = Scratch::create();
        scratch.run("ip", &["link", "set", "lo", "up"]);
        let before = Snapshot::take(&scratch.place);
        assert_eq!(before.differences(&Snapshot::take(&scratch.place)), [""; 0]);

        scratch.run("iptables-nft", &["-t", "nat", "-N", "ISTIO_POSTRT"]);
        scratch.run("ip6tables-legacy", &["-t", "mangle", "-N", "ISTIO_OUTPUT"]);
        scratch.run("ipset", &["create", "istio-inpod-probes-v4", "hash:ip"]);
        scratch.run(
            "ip",
            &["rule", "add", "fwmark", "0x111/0xfff", "table", "100"],
        );
        scratch.run(
            "ip",
            &[
                "route", "add", "local", "default", "dev", "lo", "table", "100",
            ],
        );
        std::fs::create_dir(scratch.place.bpffs.join("ambpf")).unwrap();

        let found = before.differences(&Snapshot::take(&scratch.place));
        for expected in [
            "iptables-nft-save: + :ISTIO_POSTRT -",
            "ip6tables-legacy-save: + :ISTIO_OUTPUT -",
            "ipset save: + create istio-inpod-probes-v4 hash:ip",
            "ip -4 rule show: + ",
            "ip -4 route show table all: + local default dev lo table 100",
            "ambpf/",
        ] {
            assert!(
                found
                    .iter()
                    .any(|l| l.starts_with(expected) || l.ends_with(expected)),
                "{expected:?} not in {found:#?}"
            );
        }
    }
}
