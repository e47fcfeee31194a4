//! Files the agent reads: the pods file (`--pods-file`) and the node's CNI
//! conflists (`cni-install`, `uninstall`). Malformed input is an error
//! naming the file, or a skipped entry with its index; a file the agent
//! cannot use is left exactly as it was; other plugins' entries are kept.

use std::path::Path;

use ambpf::{
    cni::{
        PLUGIN_TYPE,
        install::{self, InstallConfig},
    },
    sources::local,
};
use proptest::prelude::*;
use serde_json::{Value, json};

use crate::cni_endpoint::any_json;

/// A pods-file entry with each field right, wrong or missing.
fn pod_entry() -> impl Strategy<Value = Value> {
    let text = || {
        prop_oneof![
            3 => prop::sample::select(vec!["a", "b", "web-0", "", "ns-x"]).prop_map(Value::from),
            1 => any_json()
        ]
    };
    let optional = |value: BoxedStrategy<Value>| prop::option::weighted(0.7, value);
    (
        optional(text().boxed()),
        optional(text().boxed()),
        optional(text().boxed()),
        optional(text().boxed()),
        optional(
            prop_oneof![
                Just(json!("/run/netns/x")),
                Just(json!("pod-a")),
                any_json()
            ]
            .boxed(),
        ),
        optional(prop_oneof![any::<u32>().prop_map(Value::from), any_json()].boxed()),
        optional(prop_oneof![any::<bool>().prop_map(Value::from), any_json()].boxed()),
        prop::option::weighted(0.1, any_json()),
    )
        .prop_map(|(uid, name, namespace, sa, netns, pid, dns, unknown)| {
            let mut entry = serde_json::Map::new();
            for (key, value) in [
                ("uid", uid),
                ("name", name),
                ("namespace", namespace),
                ("serviceAccount", sa),
                ("netns", netns),
                ("pid", pid),
                ("dnsCapture", dns),
                ("extra", unknown),
            ] {
                if let Some(value) = value {
                    entry.insert(key.to_owned(), value);
                }
            }
            Value::Object(entry)
        })
        .prop_flat_map(|entry| {
            // Now and then the same fields as an array, which is no entry.
            let fields = Value::Array(entry.as_object().unwrap().values().cloned().collect());
            prop_oneof![8 => Just(entry), 1 => Just(fields)]
        })
}

fn check<S: Strategy>(strategy: S, property: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    let mut runner = proptest::test_runner::TestRunner::new(crate::config());
    if let Err(e) = runner.run(&strategy, property) {
        panic!("{e}");
    }
}

#[test]
fn a_pods_file_yields_valid_pods_and_names_every_entry_it_skips() {
    let file = prop_oneof![
        4 => prop::collection::vec(pod_entry(), 0..6).prop_map(|pods| json!({ "pods": pods }).to_string()),
        1 => any_json().prop_map(|v| v.to_string()),
        1 => ".{0,200}",
        1 => prop::collection::vec(pod_entry(), 0..3).prop_map(|pods| json!([pods]).to_string()),
    ];
    check(file, |text| {
        let path = Path::new("/etc/ambpf/pods.json");
        let entries = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("pods")?.as_array().map(Vec::len));
        match local::parse(&text, path) {
            Ok(parsed) => {
                let entries = entries
                    .ok_or_else(|| TestCaseError::fail("parsed a file without a pods array"))?;
                prop_assert_eq!(parsed.pods.len() + parsed.skipped.len(), entries);
                let json: Value = serde_json::from_str(&text).unwrap();
                let listed: Vec<&str> = json["pods"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|entry| entry.as_object()?.get("uid")?.as_str())
                    .collect();
                let mut uids = std::collections::HashSet::new();
                for pod in &parsed.pods {
                    prop_assert!(
                        listed.contains(&pod.workload.uid.as_str()),
                        "{} is no entry's uid",
                        pod.workload.uid
                    );
                    prop_assert!(!pod.workload.uid.is_empty());
                    prop_assert!(uids.insert(pod.workload.uid.clone()), "duplicate uid");
                }
                for why in &parsed.skipped {
                    prop_assert!(why.starts_with("pods["), "{}", why);
                }
            }
            Err(e) => prop_assert!(e.to_string().contains("/etc/ambpf/pods.json"), "{}", e),
        }
        Ok(())
    });
}

/// A conflist-like file: plugin lists holding other plugins, ambpf's entry
/// (any number of times, anywhere), or anything; or not JSON at all.
fn conflist_text() -> impl Strategy<Value = Vec<u8>> {
    let plugin = prop_oneof![
        3 => "[a-z-]{1,10}".prop_map(|t| json!({ "type": t })),
        2 => Just(json!({ "type": PLUGIN_TYPE, "agentSocket": "/old.sock" })),
        1 => any_json(),
    ];
    prop_oneof![
        4 => (prop::collection::vec(plugin, 0..5), any_json()).prop_map(|(plugins, other)| {
            json!({ "cniVersion": "1.0.0", "name": "k8s", "plugins": plugins, "other": other })
                .to_string()
                .into_bytes()
        }),
        1 => any_json().prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..256),
        1 => Just(format!("{{\"plugins\": [{{\"type\": \"{PLUGIN_TYPE}\"").into_bytes()),
    ]
}

fn plugin_types(conflist: &Value) -> Vec<Value> {
    conflist["plugins"]
        .as_array()
        .map(|p| p.iter().map(|e| e["type"].clone()).collect())
        .unwrap_or_default()
}

fn others(types: &[Value]) -> Vec<Value> {
    types
        .iter()
        .filter(|t| *t != PLUGIN_TYPE)
        .cloned()
        .collect()
}

#[test]
fn install_and_uninstall_keep_other_plugins_and_leave_what_they_cannot_read() {
    check(conflist_text(), |text| {
        let dir = std::env::temp_dir().join(format!(
            "ambpf-fuzz-conflist-{}",
            ambpf_testbed::unique_name("")
        ));
        let (conf_dir, bin_dir) = (dir.join("net.d"), dir.join("bin"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        let path = conf_dir.join("10-k8s.conflist");
        std::fs::write(&path, &text).unwrap();
        let result = (|| {
            let config = InstallConfig {
                conf_dir: conf_dir.clone(),
                bin_dir: bin_dir.clone(),
                plugin_binary: None,
                agent_socket: "/var/run/ambpf/pluginevent.sock".into(),
                agent_timeout_seconds: None,
            };
            let before: Option<Value> = serde_json::from_slice(&text).ok();
            match install::install_once(&config) {
                Ok(_) => {
                    let after: Value =
                        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                    let types = plugin_types(&after);
                    prop_assert_eq!(types.last(), Some(&json!(PLUGIN_TYPE)));
                    prop_assert_eq!(types.iter().filter(|t| **t == PLUGIN_TYPE).count(), 1);
                    let before = before.ok_or_else(|| {
                        TestCaseError::fail("installed into a file that is not JSON")
                    })?;
                    prop_assert_eq!(others(&plugin_types(&before)), others(&types));
                    let again = install::install_once(&config).unwrap();
                    prop_assert!(!again.conflist_changed, "a second install changed the file");
                }
                Err(e) => {
                    prop_assert_eq!(
                        &std::fs::read(&path).unwrap(),
                        &text,
                        "a refused file was changed"
                    );
                    prop_assert!(e.to_string().contains("10-k8s.conflist"), "{}", e);
                }
            }
            let installed = std::fs::read(&path).unwrap();
            let removed = install::uninstall(&conf_dir, &bin_dir);
            let now = std::fs::read(&path).unwrap();
            match serde_json::from_slice::<Value>(&now) {
                Ok(now_json) if removed.errors.is_empty() => {
                    prop_assert!(
                        !plugin_types(&now_json).contains(&json!(PLUGIN_TYPE))
                            || now_json["plugins"].as_array().is_none()
                    );
                    if let Ok(installed) = serde_json::from_slice::<Value>(&installed) {
                        prop_assert_eq!(others(&plugin_types(&installed)), plugin_types(&now_json));
                    }
                }
                _ => prop_assert_eq!(now, installed, "uninstall changed a file it could not read"),
            }
            Ok(())
        })();
        let _ = std::fs::remove_dir_all(&dir);
        result
    });
}
