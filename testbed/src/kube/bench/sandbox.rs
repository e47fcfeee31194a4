//! How long containerd took to create each pod's sandbox, from its own log:
//! the network setup (the CNI chain, where a node agent adds its ADD) is
//! inside it, and nothing of the scheduler's or the kubelet's timing is.
//!
//! containerd's CRI service logs, at info, `RunPodSandbox for
//! &PodSandboxMetadata{Name:..,Uid:..,Namespace:..,Attempt:0,}` when a
//! request arrives and the same with `returns sandbox id "..."` when it
//! succeeds, each stamped `time="<RFC 3339, nanoseconds>"`. A failed
//! attempt (`... failed, error`) is not a duration: the kubelet retries with
//! `Attempt` counted up, and the successful attempt is the one measured.

use std::{
    collections::HashMap,
    io::{Read as _, Seek as _, SeekFrom},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

/// A place in containerd's log, to read what was logged after it.
pub struct LogMark {
    path: PathBuf,
    offset: u64,
}

impl LogMark {
    /// The log's end now.
    pub fn now(path: &Path) -> Result<Self> {
        let offset = std::fs::metadata(path)
            .with_context(|| format!("containerd's log {}", path.display()))?
            .len();
        Ok(Self {
            path: path.to_owned(),
            offset,
        })
    }

    /// Everything logged since the mark.
    pub fn since(&self) -> Result<String> {
        let mut file = std::fs::File::open(&self.path)?;
        file.seek(SeekFrom::Start(self.offset))?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        Ok(text)
    }
}

/// Each pod of `namespace` whose sandbox was created in `log`: the time
/// from containerd's receiving the request to its answer, in milliseconds.
pub fn durations_ms(log: &str, namespace: &str) -> HashMap<String, f64> {
    let mut asked: HashMap<(String, String), f64> = HashMap::new();
    let mut took = HashMap::new();
    for line in log.lines() {
        let Some(event) = parse(line) else { continue };
        if event.namespace != namespace {
            continue;
        }
        let key = (event.pod.to_owned(), event.attempt.to_owned());
        match event.kind {
            Kind::Asked => {
                asked.insert(key, event.at);
            }
            Kind::Returned => {
                if let Some(start) = asked.remove(&key) {
                    took.insert(key.0, (event.at - start) * 1e3);
                }
            }
        }
    }
    took
}

#[derive(Debug, PartialEq)]
enum Kind {
    Asked,
    Returned,
}

#[derive(Debug)]
struct Event<'a> {
    at: f64,
    pod: &'a str,
    namespace: &'a str,
    attempt: &'a str,
    kind: Kind,
}

fn parse(line: &str) -> Option<Event<'_>> {
    let message = line
        .split_once("msg=\"RunPodSandbox for &PodSandboxMetadata{")?
        .1;
    let (fields, rest) = message.split_once('}')?;
    let kind = if rest.starts_with(" returns sandbox id") {
        Kind::Returned
    } else if rest.starts_with('"') {
        Kind::Asked
    } else {
        // `failed, error`: not a duration.
        return None;
    };
    let field = |name: &str| {
        fields
            .split(',')
            .find_map(|f| f.strip_prefix(name)?.strip_prefix(':'))
    };
    let time = line.split_once("time=\"")?.1.split_once('"')?.0;
    Some(Event {
        at: unix_seconds(time)?,
        pod: field("Name")?,
        namespace: field("Namespace")?,
        attempt: field("Attempt")?,
        kind,
    })
}

/// containerd's stamp (RFC 3339, nanoseconds) as seconds since the epoch.
fn unix_seconds(time: &str) -> Option<f64> {
    let at: jiff::Timestamp = time.parse().ok()?;
    Some(at.as_second() as f64 + f64::from(at.subsec_nanosecond()) / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"time="2026-12-06T08:00:00.100000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:podstart-7c9-abcde,Uid:1111,Namespace:bench-start-1-ambpf-ebpf,Attempt:0,}"
time="2026-12-06T08:00:00.150000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:other,Uid:2222,Namespace:elsewhere,Attempt:0,}"
time="2026-12-06T08:00:00.142500000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:podstart-7c9-abcde,Uid:1111,Namespace:bench-start-1-ambpf-ebpf,Attempt:0,} returns sandbox id \"0123\""
time="2026-12-06T08:00:01.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:podstart-7c9-fghij,Uid:3333,Namespace:bench-start-1-ambpf-ebpf,Attempt:0,}"
time="2026-12-06T08:00:03.000000000Z" level=error msg="RunPodSandbox for &PodSandboxMetadata{Name:podstart-7c9-fghij,Uid:3333,Namespace:bench-start-1-ambpf-ebpf,Attempt:0,} failed, error" error="plugin type=\"ambpf-cni\" failed (add): ztunnel did not take the pod"
time="2026-12-06T08:00:04.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:podstart-7c9-fghij,Uid:3333,Namespace:bench-start-1-ambpf-ebpf,Attempt:1,}"
time="2026-12-06T08:00:04.020000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:podstart-7c9-fghij,Uid:3333,Namespace:bench-start-1-ambpf-ebpf,Attempt:1,} returns sandbox id \"4567\""
"#;

    #[test]
    fn each_pods_successful_attempt_is_timed_and_other_namespaces_ignored() {
        let took = durations_ms(LOG, "bench-start-1-ambpf-ebpf");
        assert_eq!(took.len(), 2);
        assert!((took["podstart-7c9-abcde"] - 42.5).abs() < 1e-3);
        // The failed attempt is no duration; the retry is.
        assert!((took["podstart-7c9-fghij"] - 20.0).abs() < 1e-3);
        assert!(durations_ms(LOG, "nowhere").is_empty());
    }

    #[test]
    fn timestamps_with_offsets_are_the_same_instant() {
        let utc = unix_seconds("2026-12-06T08:00:00.5Z").unwrap();
        let cet = unix_seconds("2026-12-06T09:00:00.5+01:00").unwrap();
        assert_eq!(utc, cet);
        // 2026-12-06T08:00:00Z, from `date -u -d ... +%s`.
        assert_eq!(
            unix_seconds("2026-12-06T08:00:00Z").unwrap(),
            1_796_544_000.0
        );
    }
}
