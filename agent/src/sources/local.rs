//! The local pod source: a JSON file describing pods and their network
//! namespaces, for running without Kubernetes (the demo, benchmarks, tests).
//!
//! ```json
//! { "pods": [
//!     { "uid": "6f1c...", "name": "web-0", "namespace": "shop",
//!       "serviceAccount": "web", "netns": "/run/netns/web-0" },
//!     { "uid": "9a2e...", "name": "db-0", "namespace": "shop", "pid": 4242 }
//! ] }
//! ```
//! Each pod names its namespace by `netns` (a path, or a name under
//! /run/netns) or by `pid` (any process in the pod). The file is re-read when
//! it changes. A malformed file is reported and the previous pods are kept; a
//! malformed entry is reported and skipped, the others still apply.
//!
//! The file lists the pods to enrol and nothing else, so this source never
//! knows a pod as not ambient: a pod the CNI plugin enrolled stays until the
//! file lists it or its netns is gone.

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use serde::Deserialize;
use tracing::{info, warn};

use std::sync::Arc;

use tokio::sync::watch;

use crate::{
    controller::{PodSpec, SourcePods},
    netns::NAMED_NETNS_DIR,
    zds::{NetnsSource, Workload},
};

#[derive(Debug, Deserialize)]
struct PodsFile {
    pods: Vec<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LocalPod {
    uid: String,
    name: String,
    namespace: String,
    #[serde(default = "default_service_account")]
    service_account: String,
    netns: Option<String>,
    pid: Option<u32>,
    /// The pod's DNS capture choice (Istio: the pod annotation); absent
    /// follows the node.
    dns_capture: Option<bool>,
}

fn default_service_account() -> String {
    "default".to_owned()
}

#[derive(Debug, thiserror::Error)]
pub enum LocalSourceError {
    #[error("reading {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path} is not a pods file: {cause}")]
    Parse {
        path: PathBuf,
        cause: serde_json::Error,
    },
}

/// The pods of a file, with one message per entry that was skipped.
pub struct Parsed {
    pub pods: Vec<PodSpec>,
    pub skipped: Vec<String>,
}

pub fn parse(text: &str, path: &Path) -> Result<Parsed, LocalSourceError> {
    let parse_error = |source| LocalSourceError::Parse {
        path: path.to_owned(),
        cause: source,
    };
    // Objects only: serde also reads a struct from an array of its fields,
    // so `[[]]` would otherwise be a file with no pods.
    let value: serde_json::Value = serde_json::from_str(text).map_err(parse_error)?;
    if !value.is_object() {
        return Err(parse_error(serde::de::Error::custom(
            "expected an object with a `pods` array",
        )));
    }
    let file: PodsFile = serde_json::from_value(value).map_err(parse_error)?;
    let mut pods = Vec::new();
    let mut skipped = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (index, entry) in file.pods.into_iter().enumerate() {
        if !entry.is_object() {
            skipped.push(format!("pods[{index}]: not an object"));
            continue;
        }
        let pod = match serde_json::from_value::<LocalPod>(entry) {
            Ok(pod) => pod,
            Err(e) => {
                skipped.push(format!("pods[{index}]: {e}"));
                continue;
            }
        };
        let netns = match (pod.netns, pod.pid) {
            (Some(netns), None) if netns.contains('/') => NetnsSource::Path(netns.into()),
            (Some(name), None) => NetnsSource::Path(Path::new(NAMED_NETNS_DIR).join(name)),
            (None, Some(pid)) => NetnsSource::Pid(pid),
            _ => {
                skipped.push(format!(
                    "pods[{index}] ({}): give exactly one of `netns` and `pid`",
                    pod.uid
                ));
                continue;
            }
        };
        if pod.uid.is_empty() || !seen.insert(pod.uid.clone()) {
            skipped.push(format!(
                "pods[{index}]: empty or duplicate uid {:?}",
                pod.uid
            ));
            continue;
        }
        pods.push(PodSpec {
            workload: Workload {
                uid: pod.uid,
                name: pod.name,
                namespace: pod.namespace,
                service_account: pod.service_account,
                netns,
                netns_inode: None,
            },
            dns_capture: pod.dns_capture,
        });
    }
    Ok(Parsed { pods, skipped })
}

/// Publishes the pods of `path` to `pods` now, then again whenever the file
/// changes. Returns after the first load so that the caller can program a
/// complete snapshot before serving ztunnel. Needs a tokio runtime.
pub fn watch(
    path: PathBuf,
    pods: watch::Sender<Arc<SourcePods>>,
) -> Result<tokio::task::JoinHandle<()>, LocalSourceError> {
    let mut last = load(&path, &pods)?;
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let modified = modified(&path);
            if modified == last {
                continue;
            }
            match load(&path, &pods) {
                Ok(stamp) => last = stamp,
                Err(e) => {
                    warn!("{e}; keeping the previous pods");
                    last = modified;
                }
            }
        }
    }))
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn load(
    path: &Path,
    pods: &watch::Sender<Arc<SourcePods>>,
) -> Result<Option<SystemTime>, LocalSourceError> {
    let stamp = modified(path);
    let text = std::fs::read_to_string(path).map_err(|source| LocalSourceError::Read {
        path: path.to_owned(),
        cause: source,
    })?;
    let parsed = parse(&text, path)?;
    for why in &parsed.skipped {
        warn!("{}: skipped {why}", path.display());
    }
    info!("{}: {} pods", path.display(), parsed.pods.len());
    pods.send_replace(Arc::new(SourcePods {
        ambient: parsed.pods,
        ..Default::default()
    }));
    Ok(stamp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_name_their_netns_by_path_name_or_pid() {
        let text = r#"{"pods": [
            {"uid": "a", "name": "web", "namespace": "shop", "serviceAccount": "web", "netns": "/proc/1/ns/net"},
            {"uid": "b", "name": "db", "namespace": "shop", "netns": "db-ns"},
            {"uid": "c", "name": "job", "namespace": "batch", "pid": 42}
        ]}"#;
        let parsed = parse(text, Path::new("pods.json")).unwrap();
        assert!(parsed.skipped.is_empty(), "{:?}", parsed.skipped);
        let netns: Vec<_> = parsed
            .pods
            .iter()
            .map(|p| p.workload.netns.path())
            .collect();
        assert_eq!(
            netns,
            [
                PathBuf::from("/proc/1/ns/net"),
                PathBuf::from("/run/netns/db-ns"),
                PathBuf::from("/proc/42/ns/net")
            ]
        );
        assert_eq!(parsed.pods[1].workload.service_account, "default");
        assert_eq!(
            parsed
                .pods
                .iter()
                .map(|p| p.dns_capture)
                .collect::<Vec<_>>(),
            [None, None, None]
        );
    }

    #[test]
    fn a_malformed_entry_is_skipped_and_the_rest_kept() {
        let text = r#"{"pods": [
            {"uid": "a", "name": "web", "namespace": "shop", "netns": "x"},
            {"uid": "b", "name": 7, "namespace": "shop", "netns": "y"},
            {"uid": "c", "name": "both", "namespace": "shop", "netns": "z", "pid": 3},
            {"uid": "a", "name": "dup", "namespace": "shop", "netns": "w"},
            {"uid": "d", "name": "typo", "namespace": "shop", "netnss": "v"}
        ]}"#;
        let parsed = parse(text, Path::new("pods.json")).unwrap();
        let uids: Vec<_> = parsed
            .pods
            .iter()
            .map(|p| p.workload.uid.as_str())
            .collect();
        assert_eq!(uids, ["a"]);
        assert_eq!(parsed.skipped.len(), 4, "{:?}", parsed.skipped);
        assert!(parsed.skipped[0].starts_with("pods[1]"));
    }

    /// Found by the property tests (`tests/fuzz`): serde reads a struct
    /// from an array of its fields, so `[[]]` was a file with no pods (and
    /// the agent removed every pod), and an array an entry.
    #[test]
    fn arrays_are_neither_a_pods_file_nor_an_entry() {
        let path = Path::new("/etc/ambpf/pods.json");
        let err = parse("[[]]", path).err().unwrap();
        assert!(err.to_string().contains("expected an object"), "{err}");
        let parsed = parse(
            r#"{"pods": [["a", "web", "shop", "sa", "ns", null, null]]}"#,
            path,
        )
        .unwrap();
        assert!(parsed.pods.is_empty());
        assert_eq!(parsed.skipped, ["pods[0]: not an object"]);
    }

    #[test]
    fn a_malformed_file_is_an_error_naming_the_file() {
        let err = parse("{\"pods\": [", Path::new("/etc/ambpf/pods.json"))
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .starts_with("/etc/ambpf/pods.json is not a pods file"),
            "{err}"
        );
    }
}
