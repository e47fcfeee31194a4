//! The pods ztunnel should proxy, as the ZDS server sees them.

use std::{
    collections::BTreeMap, fs::File, io, os::unix::fs::MetadataExt, path::PathBuf, sync::Arc,
};

use ambpf_proto::zds;

/// Where a pod's network namespace can be opened.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NetnsSource {
    /// A bind-mounted namespace (`/run/netns/<name>`, the CNI's netns path)
    /// or any `/proc/<pid>/ns/net`.
    Path(PathBuf),
    /// A process of the pod; its namespace is `/proc/<pid>/ns/net`.
    Pid(u32),
}

impl NetnsSource {
    pub fn path(&self) -> PathBuf {
        match self {
            NetnsSource::Path(path) => path.clone(),
            NetnsSource::Pid(pid) => PathBuf::from(format!("/proc/{pid}/ns/net")),
        }
    }

    /// Opens the namespace: the fd handed to ztunnel. Closed when dropped,
    /// so a sent fd never outlives its message.
    pub fn open(&self) -> io::Result<(File, u64)> {
        let path = self.path();
        let file = File::open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))?;
        let inode = file.metadata()?.ino();
        Ok((file, inode))
    }
}

/// An ambient pod on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// The pod's UID: ztunnel's key.
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns: NetnsSource,
    /// The inode of the namespace the agent enrolled for the pod, once it
    /// has (`None` from pod sources): the pod's identity towards ztunnel. A
    /// sandbox re-created at the same path is another namespace, and gets a
    /// fresh Add.
    pub netns_inode: Option<u64>,
}

impl Workload {
    pub fn info(&self) -> zds::WorkloadInfo {
        zds::WorkloadInfo {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            service_account: self.service_account.clone(),
        }
    }
}

/// The full set of workloads, by UID. Shared immutably by every connection;
/// an update replaces the whole map (cheap: updates are rare next to reads).
pub type WorkloadSet = Arc<BTreeMap<String, Workload>>;
