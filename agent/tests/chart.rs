//! The Helm chart stays in step with the agent it deploys: every flag the
//! DaemonSet passes exists on `ambpf run` (or globally), every value a
//! template reads is defined in values.yaml, and the capabilities asked for
//! are the documented minimum. (helm itself cannot be installed on these
//! machines; this checks what would otherwise drift silently.)

use std::{collections::BTreeSet, path::PathBuf};

use clap::CommandFactory;

fn chart_file(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/ambpf")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn templates() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/ambpf/templates");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// `--flag` names passed in the DaemonSet's args.
fn daemonset_flags() -> BTreeSet<String> {
    chart_file("templates/daemonset.yaml")
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --"))
        .map(|flag| flag.split('=').next().unwrap().to_owned())
        .collect()
}

#[test]
fn every_flag_the_daemonset_passes_exists() {
    let cli = ambpf::cli::Cli::command();
    // The agent container runs `run`, the CNI installer `cni-install`.
    let subcommands = ["run", "cni-install"].map(|name| cli.find_subcommand(name).expect(name));
    let known: BTreeSet<String> = cli
        .get_arguments()
        .chain(subcommands.iter().flat_map(|c| c.get_arguments()))
        .filter_map(|a| a.get_long().map(str::to_owned))
        .collect();
    let flags = daemonset_flags();
    assert!(flags.len() >= 8, "{flags:?}");
    for flag in &flags {
        assert!(
            known.contains(flag),
            "the chart passes --{flag}, which `ambpf run` does not take"
        );
    }
}

#[test]
fn every_value_a_template_reads_is_defined() {
    let values = chart_file("values.yaml");
    let top_level: BTreeSet<&str> = values
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('#'))
        .filter_map(|l| l.split(':').next())
        .filter(|k| !k.is_empty())
        .collect();
    for (name, text) in templates() {
        for (i, _) in text.match_indices(".Values.") {
            let key: String = text[i + 8..]
                .chars()
                .take_while(|c| c.is_alphanumeric())
                .collect();
            assert!(
                top_level.contains(key.as_str()),
                "{name} reads .Values.{key}, not in values.yaml"
            );
        }
    }
}

#[test]
fn the_agent_gets_exactly_the_capabilities_it_needs() {
    let daemonset = chart_file("templates/daemonset.yaml");
    assert!(daemonset.contains("privileged: false"));
    assert!(daemonset.contains("drop: [ALL]"));
    for cap in ["BPF", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"] {
        assert!(daemonset.contains(&format!("- {cap}\n")), "missing {cap}");
    }
    // hostPID for netns discovery; the ZDS socket directory shared with ztunnel.
    assert!(daemonset.contains("hostPID: true"));
    assert!(daemonset.contains("{{ dir .Values.zdsSocket }}"));
}

#[test]
fn rbac_is_read_only_but_for_patching_pods() {
    let role = chart_file("templates/clusterrole.yaml");
    let verbs: Vec<&str> = role
        .lines()
        .filter(|l| l.trim_start().starts_with("verbs:"))
        .collect();
    assert_eq!(
        verbs,
        [
            "    verbs: [get, list, watch, patch]",
            "    verbs: [get, list, watch]"
        ]
    );
    assert!(!role.contains("secrets") && !role.contains("\"*\""));
}
