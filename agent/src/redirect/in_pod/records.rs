//! The pods the iptables and nftables modes enrolled, recorded on the node:
//! the agent holds its pods in memory, and a pod that leaves the mesh while
//! no agent runs would otherwise keep its rules for good (its traffic
//! captured for a ztunnel that no longer serves it). A new agent adopts the
//! pods of the records (`with_records` of each mode) and lists them as
//! enrolled, so that the controller's first pass removes those no source
//! wants any more, as the eBPF mode's pinned maps make it do.
//!
//! One record per pod under `<pin root>/<mode>/pods/`: an empty directory
//! named `<netns cookie>-<netns inode>` (the pin root is on bpffs, which
//! holds no regular files; a directory is created whole or not at all).
//! Written once the pod's rules are in place, removed once they are gone. A
//! name that is not a record is logged and removed.

use std::{collections::BTreeMap, io, path::PathBuf};

use tracing::{info, warn};

use crate::{
    netns::Netns,
    redirect::{PodKey, podnet::HostNamespaces},
};

/// The directory of records.
#[derive(Debug)]
pub(in crate::redirect) struct PodRecords {
    dir: PathBuf,
}

/// A pod an earlier agent enrolled that this one has not (yet).
#[derive(Debug)]
pub(in crate::redirect) struct AdoptedPod {
    pub(in crate::redirect) key: PodKey,
    /// Its namespace, held from start-up; `None` when it was gone by then.
    pub(in crate::redirect) netns: Option<Netns>,
}

impl PodRecords {
    fn open(dir: PathBuf) -> io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    /// The records under `dir` if an agent ever kept any there (another
    /// mode's, looked at without creating them).
    pub(in crate::redirect) fn existing(dir: PathBuf) -> Option<Self> {
        dir.is_dir().then_some(Self { dir })
    }

    fn path(&self, key: PodKey) -> PathBuf {
        self.dir
            .join(format!("{}-{}", key.netns_cookie, key.netns_inode))
    }

    /// The pods recorded; anything else in the directory is removed.
    pub(in crate::redirect) fn read(&self) -> io::Result<Vec<PodKey>> {
        let mut keys = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            match parse(&name.to_string_lossy()) {
                Some(key) if entry.file_type().is_ok_and(|t| t.is_dir()) => keys.push(key),
                _ => {
                    let path = entry.path();
                    warn!("{} is no pod record; removing it", path.display());
                    let removed =
                        std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
                    if let Err(e) = removed {
                        warn!("removing {}: {e}", path.display());
                    }
                }
            }
        }
        keys.sort_unstable();
        Ok(keys)
    }

    pub(in crate::redirect) fn write(&self, key: PodKey) {
        let path = self.path(key);
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => warn!(
                "recording the pod with {key} at {}: {e}; an agent started after this one \
                 will not know it",
                path.display()
            ),
        }
    }

    pub(in crate::redirect) fn remove(&self, key: PodKey) {
        let path = self.path(key);
        match std::fs::remove_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!("removing the record {}: {e}", path.display()),
        }
    }

    /// The directory, and its parent once empty.
    pub(in crate::redirect) fn remove_all(&self) -> io::Result<()> {
        match std::fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        if let Some(parent) = self.dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
        Ok(())
    }
}

impl PodRecords {
    /// The records under `dir` and the pods they name, each with its
    /// namespace when it is still there. Without a usable `dir` there are
    /// none, and the agent runs on, saying that no record is kept.
    pub(in crate::redirect) fn adopt(dir: PathBuf) -> (Option<Self>, BTreeMap<u64, AdoptedPod>) {
        let mut adopted = BTreeMap::new();
        let records = match PodRecords::open(dir.clone()) {
            Ok(records) => records,
            Err(e) => {
                warn!(
                    "keeping no record of enrolled pods ({}: {e}): an agent started after this \
                     one will not remove the pods that leave meanwhile",
                    dir.display()
                );
                return (None, adopted);
            }
        };
        let keys = match records.read() {
            Ok(keys) => keys,
            Err(e) => {
                warn!("reading the pod records in {}: {e}", dir.display());
                Vec::new()
            }
        };
        let mut host = HostNamespaces::default();
        for key in keys {
            let netns = host.take(key);
            let place = netns.as_ref().map_or_else(
                || "its namespace is gone".to_owned(),
                |ns| ns.path().display().to_string(),
            );
            info!("pod with {key} was enrolled by an earlier agent ({place})");
            adopted.insert(key.netns_cookie, AdoptedPod { key, netns });
        }
        (Some(records), adopted)
    }
}

/// `<cookie>-<inode>`.
fn parse(name: &str) -> Option<PodKey> {
    let (cookie, inode) = name.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(cookie) || !digits(inode) {
        return None;
    }
    Some(PodKey {
        netns_cookie: cookie.parse().ok()?,
        netns_inode: inode.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_are_cookie_and_inode() {
        assert_eq!(
            parse("4144-4026532001"),
            Some(PodKey {
                netns_cookie: 4144,
                netns_inode: 4_026_532_001
            })
        );
        for bad in ["", "4144", "4144-", "-1", "a-1", "1-2-3", "+1-2", "1- 2"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn records_are_written_read_and_malformed_ones_removed() {
        let dir =
            std::env::temp_dir().join(format!("ambpf-records-{}", ambpf_testbed::unique_name("")));
        let records = PodRecords::open(dir.join("iptables/pods")).unwrap();
        let key = PodKey {
            netns_cookie: 7,
            netns_inode: 99,
        };
        records.write(key);
        records.write(key);
        std::fs::create_dir(dir.join("iptables/pods/garbage")).unwrap();
        std::fs::write(dir.join("iptables/pods/8-100"), b"a file").unwrap();
        assert_eq!(records.read().unwrap(), [key]);
        assert_eq!(
            std::fs::read_dir(dir.join("iptables/pods"))
                .unwrap()
                .count(),
            1,
            "the malformed entries are gone"
        );
        records.remove(key);
        records.remove(key);
        assert!(records.read().unwrap().is_empty());
        records.remove_all().unwrap();
        assert!(!dir.join("iptables").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
