//! What a node agent wrote for one enrolled pod, read back with the
//! kernel's own tools and normalised so that two agents' dumps compare line
//! by line: the pod's rules (`iptables-save` in both the legacy and the nft
//! view, both families, and `nft list ruleset`) and policy routing, and the
//! node's probe rules (its Istio chains and tables, the probe ipsets) and
//! policy routing.
//!
//! Each normalisation drops or renames only what differs between any two
//! enrolments of the same agent (counters, timestamps, the pod's address,
//! UID and owner token, other pods' set members), never the shape of a rule.

use anyhow::{Context as _, Result, bail};

use super::client::Cluster;

/// One tool's normalised output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    pub lines: Vec<String>,
}

/// The pod a dump is about: its values are renamed to placeholders.
#[derive(Debug, Clone)]
pub struct PodIdentity {
    pub ip: String,
    pub uid: String,
}

/// A line present in one dump only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub section: String,
    /// The side the line is on: `istio` or `ambpf`.
    pub side: Side,
    pub line: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Istio,
    Ambpf,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sign = match self.side {
            Side::Istio => "- istio",
            Side::Ambpf => "+ ambpf",
        };
        write!(f, "[{}] {sign}: {}", self.section, self.line)
    }
}

/// The rule tools run inside the pod's network namespace, by section name.
const POD_TOOLS: [(&str, &[&str]); 9] = [
    ("iptables-legacy-save", &[]),
    ("iptables-nft-save", &[]),
    ("ip6tables-legacy-save", &[]),
    ("ip6tables-nft-save", &[]),
    ("nft", &["list", "ruleset"]),
    ("ip", &["-4", "rule"]),
    ("ip", &["-6", "rule"]),
    ("ip", &["-4", "route", "show", "table", "all"]),
    ("ip", &["-6", "route", "show", "table", "all"]),
];

/// The probe sets both backends fill with enrolled pods' addresses.
const PROBE_SETS: [&str; 2] = ["istio-inpod-probes-v4", "istio-inpod-probes-v6"];

/// The pod's rules and routing, read in the network namespace of its
/// sandbox's process `pid`.
pub fn pod_sections(cluster: &Cluster, pid: u32, pod: &PodIdentity) -> Result<Vec<Section>> {
    let pid = pid.to_string();
    let mut sections = Vec::new();
    for (program, args) in POD_TOOLS {
        let mut command = vec!["-t", pid.as_str(), "-n", "--", program];
        command.extend(args);
        let text = cluster
            .on_node("nsenter", &command)
            .with_context(|| format!("{program} {} in the pod", args.join(" ")))?;
        let lines = match program {
            "nft" => normalise_nft(&text),
            "ip" => text.lines().map(str::to_owned).collect(),
            _ => normalise_iptables_save(&text),
        };
        sections.push(section(
            &format!("pod {program} {}", args.join(" ")),
            lines,
            pod,
        ));
    }
    Ok(sections)
}

/// The node's side: the Istio chains of its iptables (both views, both
/// families), its Istio nftables tables, the probe ipsets and its policy
/// routing. The node's own rules (kube-proxy's, the bridge plugin's) are
/// neither agent's and are left out.
pub fn node_sections(cluster: &Cluster, pod: &PodIdentity) -> Result<Vec<Section>> {
    let mut sections = Vec::new();
    for save in [
        "iptables-legacy-save",
        "iptables-nft-save",
        "ip6tables-legacy-save",
        "ip6tables-nft-save",
    ] {
        let text = cluster.on_node(save, &[])?;
        let lines = istio_lines(&normalise_iptables_save(&text));
        sections.push(section(&format!("node {save}"), lines, pod));
    }
    let ruleset = cluster.on_node("nft", &["list", "ruleset"])?;
    let lines = keep_own_members(&istio_tables(&normalise_nft(&ruleset)), &pod.ip);
    sections.push(section("node nft list ruleset", lines, pod));
    for set in PROBE_SETS {
        // A missing set is a finding, not an error: one agent may use
        // nftables sets instead.
        let lines = match cluster.on_node("ipset", &["list", set]) {
            Ok(text) => normalise_ipset(&text, &pod.ip),
            Err(_) => vec!["(no such set)".to_owned()],
        };
        sections.push(section(&format!("node ipset {set}"), lines, pod));
    }
    for family in ["-4", "-6"] {
        let text = cluster.on_node("ip", &[family, "rule"])?;
        sections.push(section(
            &format!("node ip {family} rule"),
            text.lines().map(str::to_owned).collect(),
            pod,
        ));
    }
    Ok(sections)
}

/// Whether the node holds nothing of either agent's probe rules: every
/// Istio chain, table and set gone (an agent's uninstall must leave none).
pub fn node_is_clean(sections: &[Section]) -> Vec<String> {
    sections
        .iter()
        .filter(|s| !s.name.contains(" ip "))
        .filter(|s| !(s.lines.is_empty() || s.lines == ["(no such set)"]))
        .map(|s| format!("{}: {}", s.name, s.lines.join(" | ")))
        .collect()
}

fn section(name: &str, lines: Vec<String>, pod: &PodIdentity) -> Section {
    Section {
        name: name.to_owned(),
        lines: lines
            .iter()
            .map(|l| anonymise(l, pod))
            .filter(|l| !l.is_empty())
            .collect(),
    }
}

/// The pod's own values become placeholders: each enrolment gets a new
/// address, UID and link-local address, and ambpf names a set member's
/// owner by the netns cookie, a number per pod. The token around the value
/// stays, so a UID where the other agent names a cookie still shows.
fn anonymise(line: &str, pod: &PodIdentity) -> String {
    let mut line = line.trim_end().to_owned();
    if !pod.uid.is_empty() {
        line = line.replace(&pod.uid, "<pod-uid>");
    }
    if !pod.ip.is_empty() {
        line = replace_address(&line, &pod.ip, "<pod-ip>");
    }
    line = replace_after(&line, "netns cookie ", "<cookie>");
    line.split(' ')
        .map(|token| {
            if token.starts_with("fe80::") && !token.contains('/') {
                "<link-local>"
            } else {
                token
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Replaces `address` where it stands as a whole address (not as the prefix
/// of a longer one: 10.244.0.5 is not in 10.244.0.50).
fn replace_address(line: &str, address: &str, with: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(address) {
        let after = &rest[at + address.len()..];
        let before_ok = rest[..at]
            .chars()
            .last()
            .is_none_or(|c| !(c.is_ascii_hexdigit() || c == '.' || c == ':'));
        let after_ok = after
            .chars()
            .next()
            .is_none_or(|c| !(c.is_ascii_digit() || c == '.'));
        out.push_str(&rest[..at]);
        out.push_str(if before_ok && after_ok { with } else { address });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// Replaces the digits after each `marker`.
fn replace_after(line: &str, marker: &str, with: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(marker) {
        out.push_str(&rest[..at + marker.len()]);
        rest = &rest[at + marker.len()..];
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 {
            out.push_str(with);
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// `iptables-save` without its `#` lines (the tool's version and the time
/// of the dump, and warnings about the other view) and without the chains'
/// packet and byte counters (`:CHAIN POLICY [p:b]`): traffic, not rules.
pub fn normalise_iptables_save(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.rfind(" [")) {
            (true, Some(at)) if l.ends_with(']') => l[..at].to_owned(),
            _ => l.to_owned(),
        })
        .collect()
}

/// The lines of an `iptables-save` that name Istio (its chains, the jumps to
/// them, rules matching its probe sets), each prefixed with its table.
fn istio_lines(lines: &[String]) -> Vec<String> {
    let mut table = "";
    let mut kept = Vec::new();
    for line in lines {
        if let Some(name) = line.strip_prefix('*') {
            table = name;
        } else if line.to_ascii_lowercase().contains("istio") {
            kept.push(format!("{table}: {line}"));
        }
    }
    kept
}

/// `nft list ruleset` without counters' values (`counter packets N bytes M`
/// becomes `counter`: whether a rule counts is kept, what it counted is
/// traffic) and without handles (`# handle N`, the kernel's numbering).
pub fn normalise_nft(text: &str) -> Vec<String> {
    text.lines()
        .map(|line| {
            let line = match line.find(" # handle ") {
                Some(at) => &line[..at],
                None => line,
            };
            let mut out = String::new();
            let mut tokens = line.split(' ').peekable();
            let mut first = true;
            while let Some(token) = tokens.next() {
                if !first {
                    out.push(' ');
                }
                first = false;
                out.push_str(token);
                // iptables-nft's rules start their line with it.
                if token.trim_start() == "counter" && tokens.peek() == Some(&"packets") {
                    // `packets N bytes M`
                    for _ in 0..4 {
                        tokens.next();
                    }
                }
            }
            out
        })
        .collect()
}

/// The `table ... { ... }` blocks of a ruleset whose name contains `istio`.
fn istio_tables(lines: &[String]) -> Vec<String> {
    let mut kept = Vec::new();
    let mut keeping = false;
    for line in lines {
        if line.starts_with("table ") {
            keeping = line.contains("istio");
        }
        if keeping {
            kept.push(line.clone());
        }
        if line == "}" {
            keeping = false;
        }
    }
    kept
}

/// A set's `elements = { a comment "x", b comment "y" }` (one or several
/// lines) reduced to the pod's own element: the others are other pods',
/// which differ with whatever else runs on the node.
fn keep_own_members(lines: &[String], pod_ip: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut iter = lines.iter();
    while let Some(line) = iter.next() {
        let Some(at) = line.find("elements = {") else {
            out.push(line.clone());
            continue;
        };
        let mut text = line[at + "elements = {".len()..].to_owned();
        while !text.contains('}') {
            match iter.next() {
                Some(next) => text.push_str(next),
                None => break,
            }
        }
        let body = text.split('}').next().unwrap_or_default();
        let own: Vec<&str> = body
            .split(',')
            .map(str::trim)
            .filter(|e| e.split_whitespace().next() == Some(pod_ip))
            .collect();
        out.push(format!(
            "{}elements = {{ {} }}",
            &line[..at],
            own.join(", ")
        ));
    }
    out
}

/// `ipset list <set>` with the header lines that depend on the node's load
/// (memory, entry count, the hash's random `initval`) dropped and the
/// members reduced to the pod's own.
pub fn normalise_ipset(text: &str, pod_ip: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_members = false;
    for line in text.lines() {
        if in_members {
            if line.split_whitespace().next() == Some(pod_ip) {
                out.push(line.to_owned());
            }
            continue;
        }
        if line.starts_with("Size in memory:") || line.starts_with("Number of entries:") {
            continue;
        }
        if line == "Members:" {
            in_members = true;
        }
        out.push(match line.find(" initval ") {
            Some(at) if line.starts_with("Header:") => {
                let rest = &line[at + " initval ".len()..];
                let after = rest.find(' ').map(|i| &rest[i..]).unwrap_or_default();
                format!("{}{after}", &line[..at])
            }
            _ => line.to_owned(),
        });
    }
    out
}

/// The lines only one side has, section by section, in order (a longest
/// common subsequence per section: a rule moved shows on both sides).
pub fn differences(istio: &[Section], ambpf: &[Section]) -> Result<Vec<Difference>> {
    let mut out = Vec::new();
    for (a, b) in istio.iter().zip(ambpf) {
        if a.name != b.name {
            bail!("sections out of step: {} and {}", a.name, b.name);
        }
        for (side, line) in line_diff(&a.lines, &b.lines) {
            out.push(Difference {
                section: a.name.clone(),
                side,
                line,
            });
        }
    }
    Ok(out)
}

fn line_diff(a: &[String], b: &[String]) -> Vec<(Side, String)> {
    // common[i][j]: the longest common subsequence of a[i..] and b[j..].
    let mut common = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            common[i][j] = if a[i] == b[j] {
                common[i + 1][j + 1] + 1
            } else {
                common[i + 1][j].max(common[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if j == b.len() || (i < a.len() && common[i + 1][j] >= common[i][j + 1]) {
            out.push((Side::Istio, a[i].clone()));
            i += 1;
        } else {
            out.push((Side::Ambpf, b[j].clone()));
            j += 1;
        }
    }
    out
}

/// The process ID of the sandbox (pause) container of pod `uid`, whose
/// network namespace is the pod's.
pub fn sandbox_pid(cluster: &Cluster, uid: &str) -> Result<u32> {
    let sandboxes = cluster.sandboxes(uid)?;
    let tasks = cluster.ctr(&["tasks", "ls"])?;
    tasks
        .lines()
        .filter_map(|l| {
            let mut fields = l.split_whitespace();
            let id = fields.next()?;
            let pid = fields.next()?.parse().ok()?;
            (sandboxes.iter().any(|s| s == id) && fields.next() == Some("RUNNING")).then_some(pid)
        })
        .next()
        .with_context(|| format!("no running sandbox for pod {uid} (sandboxes {sandboxes:?})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn iptables_save_loses_its_comments_and_counters_only() {
        let save = "# Generated by iptables-save v1.8.11 (nf_tables) on Sun Dec  6 08:00:00 2026\n\
                    *nat\n:PREROUTING ACCEPT [12:720]\n:ISTIO_PRERT - [0:0]\n\
                    -A PREROUTING -j ISTIO_PRERT\n\
                    -A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT\nCOMMIT\n# Completed on x\n";
        assert_eq!(
            normalise_iptables_save(save),
            lines(
                "*nat\n:PREROUTING ACCEPT\n:ISTIO_PRERT -\n-A PREROUTING -j ISTIO_PRERT\n\
                 -A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT\nCOMMIT"
            )
        );
    }

    #[test]
    fn node_iptables_keep_istio_lines_with_their_table() {
        let save = lines(
            "*nat\n:KUBE-SERVICES -\n:ISTIO_POSTRT -\n-A POSTROUTING -j ISTIO_POSTRT\n\
             -A KUBE-SERVICES -j KUBE-NODEPORTS\n\
             -A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127\nCOMMIT",
        );
        let kept = istio_lines(&save);
        assert_eq!(kept.len(), 3);
        assert_eq!(kept[0], "nat: :ISTIO_POSTRT -");
        assert!(kept[2].starts_with("nat: -A ISTIO_POSTRT -m owner"));
    }

    #[test]
    fn nft_counters_and_handles_go_but_the_counter_stays() {
        let ruleset = "table inet istio-ambient-nat { # handle 7\n\
                       \t\tip saddr 169.254.7.127 tcp dport 0-65535 counter packets 3 bytes 180 accept\n\
                       \t\tcounter packets 1 bytes 76 jump ISTIO_PRERT\n}";
        assert_eq!(
            normalise_nft(ruleset),
            lines(
                "table inet istio-ambient-nat {\n\t\tip saddr 169.254.7.127 tcp dport 0-65535 counter accept\n\
                 \t\tcounter jump ISTIO_PRERT\n}"
            )
        );
    }

    #[test]
    fn only_istio_tables_and_the_pods_own_members_are_kept() {
        let ruleset = lines(
            "table ip filter {\n\tchain INPUT {\n\t}\n}\n\
             table inet istio-ambient-nat {\n\tset istio-inpod-probes-v4 {\n\t\ttype ipv4_addr\n\
             \t\telements = { 10.244.0.5 comment \"a\",\n\t\t\t     10.244.0.50 comment \"b\" }\n\t}\n}",
        );
        let kept = keep_own_members(&istio_tables(&ruleset), "10.244.0.5");
        assert_eq!(kept[0], "table inet istio-ambient-nat {");
        assert!(kept.contains(&"\t\telements = { 10.244.0.5 comment \"a\" }".to_owned()));
        assert!(
            !kept
                .iter()
                .any(|l| l.contains("filter") || l.contains("10.244.0.50"))
        );
    }

    #[test]
    fn ipset_keeps_its_type_and_the_pods_member() {
        let list = "Name: istio-inpod-probes-v4\nType: hash:ip\nRevision: 6\n\
                    Header: family inet hashsize 1024 maxelem 65536 comment bucketsize 12 initval 0x5e1c2a3b\n\
                    Size in memory: 512\nReferences: 1\nNumber of entries: 2\nMembers:\n\
                    10.244.0.5 comment \"uid-1\"\n10.244.0.9 comment \"uid-2\"\n";
        assert_eq!(
            normalise_ipset(list, "10.244.0.5"),
            lines(
                "Name: istio-inpod-probes-v4\nType: hash:ip\nRevision: 6\n\
                 Header: family inet hashsize 1024 maxelem 65536 comment bucketsize 12\n\
                 References: 1\nMembers:\n10.244.0.5 comment \"uid-1\""
            )
        );
    }

    #[test]
    fn the_pods_values_become_placeholders_but_their_kind_stays() {
        let pod = PodIdentity {
            ip: "10.244.0.5".into(),
            uid: "1f2e".into(),
        };
        assert_eq!(
            anonymise("10.244.0.5 comment \"1f2e\"", &pod),
            "<pod-ip> comment \"<pod-uid>\""
        );
        assert_eq!(
            anonymise("10.244.0.50 comment \"netns cookie 4097\"", &pod),
            "10.244.0.50 comment \"netns cookie <cookie>\""
        );
        assert_eq!(
            anonymise("local fe80::a8c1:abff:fe00:1 dev eth0 table local", &pod),
            "local <link-local> dev eth0 table local"
        );
        assert_eq!(anonymise("fe80::/64 dev eth0", &pod), "fe80::/64 dev eth0");
    }

    #[test]
    fn differences_name_each_side_and_keep_order() {
        let istio = [Section {
            name: "pod nft list ruleset".into(),
            lines: lines("a\nb\nc\nd"),
        }];
        let ambpf = [Section {
            name: "pod nft list ruleset".into(),
            lines: lines("a\nc\nb\nd\ne"),
        }];
        let found: Vec<String> = differences(&istio, &ambpf)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.contains(&"[pod nft list ruleset] + ambpf: e".to_owned()));
        assert!(differences(&istio, &istio).unwrap().is_empty());
        let renamed = [Section {
            name: "node ipset".into(),
            lines: vec![],
        }];
        assert!(differences(&istio, &renamed).is_err());
    }
}
