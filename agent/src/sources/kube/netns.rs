//! Finding a pod's network namespace on the host.
//!
//! The API server says which pods run here, not where their namespaces are.
//! As Istio's node agent does for pods that were running before it started,
//! [`ProcNetnsFinder`] scans `/proc` for processes whose cgroup path names the
//! pod's UID (`pod<uid>` as cgroupfs writes it, `pod<uid_with_underscores>`
//! as the systemd driver does; cgroup v1 and v2 lines alike), takes the
//! network namespace of the oldest such process (the sandbox's pause process
//! is the first one started), skips the host's own namespace, and, when the
//! pod has IPs, keeps a namespace only if one of them is configured inside it
//! (a process of one pod may be visiting another pod's namespace).
//!
//! The answer is `/proc/<pid>/ns/net` of a live process. It is cached by pod
//! UID with the namespace's inode and checked on every pass: while the
//! process lives and is still in that namespace (one `stat`), and, checked
//! every [`OWNERSHIP_RECHECK`], still belongs to the pod, the same path is
//! given (so that ztunnel is not told of a change); when the sandbox is
//! recreated (the process is gone, or its namespace changed) the pod is
//! found again.
//!
//! A pod a CNI ADD enrolled needs no scan: the runtime named its namespace
//! (`CNI_NETNS`, a path the runtime removes with the sandbox), and the
//! controller reports that path with the namespace's inode
//! ([`PodQuery::runtime_netns`]). The path is taken while it still holds
//! that namespace (one `stat`) and, once the pod has IPs, one of them;
//! a later ADD (a re-created sandbox) names the new one. Scanning the node
//! for each new pod cost more of the agent's CPU than the rest of its
//! start-up together, beside the runtime starting the pod's containers.
//!
//! What it costs grows with the node: a scan reads the cgroup file of every
//! process, and the source passes on every pod event. So a pass checks the
//! cached answers with one `stat` each, and scans run on a CPU budget
//! ([`ScanBudget`]): a burst of [`SCAN_BURST`] of scanning at once, then
//! [`SCAN_CPU_SHARE`] of the time, however busy the node; pods a skipped
//! scan would have looked for are retried when the budget allows
//! ([`NetnsResolver::retry_in`]). A pod whose status has no IP yet sets
//! off no scan of its own: its sandbox's network is not set up (the CNI ADD
//! enrols it then), and the status update that brings the IP is the event
//! to look for it on. On a node of 1,000 pods under churn,
//! scanning on every event took a CPU; a fixed 200 ms between scans instead
//! made a new pod wait up to 200 ms on a quiet node.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs,
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

pub use crate::controller::RuntimeNetns;
use crate::{netns::Netns, redirect::podnet, zds::NetnsSource};

/// What discovery needs to know of a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodQuery {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// The pod's IPs from its status; empty early in its life.
    pub ips: Vec<IpAddr>,
    /// Where the container runtime put the pod's namespace, if a CNI ADD
    /// enrolled it: taken before any scan while it still holds that namespace.
    pub runtime_netns: Option<RuntimeNetns>,
}

/// Finds the network namespaces of pods: [`ProcNetnsFinder`], or any
/// `FnMut(&PodQuery) -> Result<NetnsSource, String>` (for tests where
/// discovery is not what is tested).
pub trait NetnsResolver: Send + 'static {
    /// The namespace of each pod, by UID, or why it was not found. Called
    /// with every ambient pod on each pass; pods not asked for again may be
    /// forgotten.
    fn resolve(&mut self, pods: &[PodQuery]) -> BTreeMap<String, Result<NetnsSource, String>>;

    /// When pods of the last [`Self::resolve`] were left unresolved without
    /// being looked for, how soon to call again.
    fn retry_in(&self) -> Option<Duration> {
        None
    }
}

/// How often cached answers are checked to still belong to their pod (a
/// pid reused by another pod's process in the same namespace).
pub const OWNERSHIP_RECHECK: Duration = Duration::from_secs(5);
/// The share of the time scans of the proc filesystem may take, once their
/// burst is spent.
pub const SCAN_CPU_SHARE: f64 = 0.2;
/// How much scanning may run back to back on a node that was quiet.
pub const SCAN_BURST: Duration = Duration::from_millis(200);

/// Why a pod whose status has no IP is not looked for (see [`ProcNetnsFinder::resolve`]).
const NO_IP_YET: &str = "its status has no IP yet, so its sandbox's network is not set up (the \
                         CNI plugin enrols it then); looked for once it has one";

/// Time the proc filesystem scans may take: credit that grows with the
/// wall clock at a fixed share, up to a burst, and that each scan spends by
/// what it took (a token bucket of CPU time).
#[derive(Clone, Copy, Debug)]
pub struct ScanBudget {
    share: f64,
    burst: f64,
    /// Seconds of scanning allowed now; below zero after an overrun.
    credit: f64,
    updated: Instant,
}

impl ScanBudget {
    /// `share` of the time, after a `burst` (which it starts with).
    pub fn new(share: f64, burst: Duration) -> Self {
        Self {
            share,
            burst: burst.as_secs_f64(),
            credit: burst.as_secs_f64(),
            updated: Instant::now(),
        }
    }

    /// No limit at all (tests).
    pub fn unlimited() -> Self {
        Self::new(f64::MAX, Duration::from_secs(u64::from(u32::MAX)))
    }

    /// The credit as of now.
    fn credit(&self) -> f64 {
        let earned = self.updated.elapsed().as_secs_f64() * self.share;
        (self.credit + earned).min(self.burst)
    }

    /// How long until a scan may run, if not now.
    fn wait(&self) -> Option<Duration> {
        let credit = self.credit();
        (credit < 0.0).then(|| Duration::from_secs_f64(-credit / self.share))
    }

    fn spend(&mut self, scan: Duration) {
        self.credit = self.credit() - scan.as_secs_f64();
        self.updated = Instant::now();
    }
}

impl<F> NetnsResolver for F
where
    F: FnMut(&PodQuery) -> Result<NetnsSource, String> + Send + 'static,
{
    fn resolve(&mut self, pods: &[PodQuery]) -> BTreeMap<String, Result<NetnsSource, String>> {
        pods.iter()
            .map(|pod| (pod.uid.clone(), self(pod)))
            .collect()
    }
}

/// Checks that the namespace at a path holds one of the IPs.
pub type Verifier = Box<dyn Fn(&Path, &[IpAddr]) -> Result<bool, String> + Send>;

/// Discovery by scanning a proc filesystem (see the module documentation).
pub struct ProcNetnsFinder {
    proc_root: PathBuf,
    cache: HashMap<String, Found>,
    host_netns: Option<u64>,
    verify: Verifier,
    scan_budget: ScanBudget,
    ownership_recheck: Duration,
    /// When the cached answers' owners were last checked.
    ownership_checked: Option<Instant>,
    /// Pods were left for a later scan.
    scan_deferred: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Found {
    at: FoundAt,
    inode: u64,
}

/// Where a found namespace is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
enum FoundAt {
    /// `/proc/<pid>/ns/net` of the pod's oldest process.
    Process(u32),
    /// The path the runtime gave in the pod's CNI ADD.
    Runtime(PathBuf),
}

#[derive(Clone, Copy, Debug)]
struct Candidate {
    pid: u32,
    inode: u64,
    start: u64,
}

impl ProcNetnsFinder {
    /// Scans `proc_root` (normally `/proc`; tests give a fake tree). The
    /// host namespace skipped is this process's own (the agent runs with the
    /// host's network).
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
            cache: HashMap::new(),
            host_netns: fs::metadata("/proc/self/ns/net").ok().map(|m| m.ino()),
            verify: Box::new(holds_any_ip),
            scan_budget: ScanBudget::new(SCAN_CPU_SHARE, SCAN_BURST),
            ownership_recheck: OWNERSHIP_RECHECK,
            ownership_checked: None,
            scan_deferred: false,
        }
    }

    /// Replaces the check that a namespace holds one of the pod's IPs.
    pub fn with_verifier(mut self, verify: Verifier) -> Self {
        self.verify = verify;
        self
    }

    /// Replaces the scans' budget and [`OWNERSHIP_RECHECK`].
    pub fn with_pacing(mut self, scans: ScanBudget, ownership: Duration) -> Self {
        self.scan_budget = scans;
        self.ownership_recheck = ownership;
        self
    }

    /// Treats the namespace with this inode as the host's (never a pod's).
    pub fn with_host_netns(mut self, inode: Option<u64>) -> Self {
        self.host_netns = inode;
        self
    }

    fn netns_path(&self, pid: u32) -> PathBuf {
        self.proc_root.join(pid.to_string()).join("ns/net")
    }

    fn path_of(&self, found: &Found) -> PathBuf {
        match &found.at {
            FoundAt::Process(pid) => self.netns_path(*pid),
            FoundAt::Runtime(path) => path.clone(),
        }
    }

    fn inode_of(&self, pid: u32) -> Option<u64> {
        inode_at(&self.netns_path(pid))
    }

    fn uids_of(&self, pid: u32) -> Option<Vec<String>> {
        let text = fs::read_to_string(self.proc_root.join(pid.to_string()).join("cgroup")).ok()?;
        Some(pod_uids_in_cgroup(&text))
    }

    /// The cached answer, if the process (or the runtime's path) is still
    /// in the same namespace and, with `owner`, the process still belongs to
    /// the pod (a runtime path names one sandbox for its whole life).
    fn still_valid(&self, uid: &str, found: &Found, owner: bool) -> bool {
        match &found.at {
            FoundAt::Process(pid) => {
                self.inode_of(*pid) == Some(found.inode)
                    && (!owner
                        || self
                            .uids_of(*pid)
                            .is_some_and(|uids| uids.iter().any(|u| u == uid)))
            }
            FoundAt::Runtime(path) => inode_at(path) == Some(found.inode),
        }
    }

    /// The namespace the runtime named for `pod`, if its path still holds
    /// the namespace enrolled, that is not the host's, and (once the pod has
    /// IPs) it holds one of them.
    fn named_by_runtime(&self, pod: &PodQuery) -> Option<Found> {
        let named = pod.runtime_netns.as_ref()?;
        if inode_at(&named.path) != Some(named.inode) || Some(named.inode) == self.host_netns {
            return None;
        }
        if !pod.ips.is_empty() && (self.verify)(&named.path, &pod.ips) != Ok(true) {
            return None;
        }
        Some(Found {
            at: FoundAt::Runtime(named.path.clone()),
            inode: named.inode,
        })
    }

    /// Whether `last` is `interval` or longer ago (or never was).
    fn due(last: Option<Instant>, interval: Duration) -> bool {
        last.is_none_or(|at| at.elapsed() >= interval)
    }

    /// Processes of the wanted pods, by pod UID.
    fn scan(&self, wanted: &HashSet<&str>) -> Result<HashMap<String, Vec<Candidate>>, String> {
        let entries = fs::read_dir(&self.proc_root)
            .map_err(|e| format!("reading {}: {e}", self.proc_root.display()))?;
        let mut found: HashMap<String, Vec<Candidate>> = HashMap::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Some(uids) = self.uids_of(pid) else {
                continue;
            };
            for uid in uids.into_iter().filter(|u| wanted.contains(u.as_str())) {
                let Some(inode) = self.inode_of(pid) else {
                    continue;
                };
                if Some(inode) == self.host_netns {
                    continue;
                }
                let start = start_time(&self.proc_root.join(pid.to_string()).join("stat"))
                    .unwrap_or(u64::MAX);
                found
                    .entry(uid)
                    .or_default()
                    .push(Candidate { pid, inode, start });
            }
        }
        Ok(found)
    }

    fn choose(&self, pod: &PodQuery, candidates: Option<&Vec<Candidate>>) -> Result<Found, String> {
        let mut candidates = candidates.cloned().unwrap_or_default();
        if candidates.is_empty() {
            return Err(format!(
                "no process of the pod in its own network namespace under {}",
                self.proc_root.display()
            ));
        }
        candidates.sort_by_key(|c| (c.start, c.pid));
        let mut seen = HashSet::new();
        let mut rejected = Vec::new();
        for candidate in candidates.iter().filter(|c| seen.insert(c.inode)) {
            let found = Found {
                at: FoundAt::Process(candidate.pid),
                inode: candidate.inode,
            };
            if pod.ips.is_empty() {
                return Ok(found);
            }
            let path = self.netns_path(candidate.pid);
            match (self.verify)(&path, &pod.ips) {
                Ok(true) => return Ok(found),
                Ok(false) => rejected.push(format!("{} holds none", path.display())),
                Err(e) => rejected.push(format!("{}: {e}", path.display())),
            }
        }
        let ips: Vec<String> = pod.ips.iter().map(ToString::to_string).collect();
        Err(format!(
            "no network namespace of the pod's processes holds its IPs {} ({})",
            ips.join(", "),
            rejected.join("; ")
        ))
    }
}

impl NetnsResolver for ProcNetnsFinder {
    fn resolve(&mut self, pods: &[PodQuery]) -> BTreeMap<String, Result<NetnsSource, String>> {
        let asked: HashSet<&str> = pods.iter().map(|p| p.uid.as_str()).collect();
        self.cache.retain(|uid, _| asked.contains(uid.as_str()));
        let owners = Self::due(self.ownership_checked, self.ownership_recheck);
        if owners {
            self.ownership_checked = Some(Instant::now());
        }
        self.scan_deferred = false;
        let mut results = BTreeMap::new();
        let mut missing = Vec::new();
        for pod in pods {
            // The cached answer stands while it is valid and the runtime
            // names no other namespace (a re-created sandbox's ADD).
            let cached = self
                .cache
                .get(&pod.uid)
                .filter(|found| {
                    self.still_valid(&pod.uid, found, owners)
                        && pod
                            .runtime_netns
                            .as_ref()
                            .is_none_or(|named| named.inode == found.inode)
                })
                .map(|found| self.path_of(found));
            let path = cached.or_else(|| {
                let found = self.named_by_runtime(pod)?;
                let path = self.path_of(&found);
                self.cache.insert(pod.uid.clone(), found);
                Some(path)
            });
            match path {
                Some(path) => {
                    results.insert(pod.uid.clone(), Ok(NetnsSource::Path(path)));
                }
                None => {
                    self.cache.remove(&pod.uid);
                    missing.push(pod);
                }
            }
        }
        if missing.is_empty() {
            return results;
        }
        // A pod whose status has no IP yet has no sandbox network to find
        // (or has had one only since its CNI ADD, which enrols it): it sets
        // off no scan of its own. Each event of a starting pod would
        // otherwise scan every process of the node for nothing, beside the
        // runtime setting the pod up. It is looked for with pods that do.
        if missing.iter().all(|pod| pod.ips.is_empty()) {
            for pod in missing {
                results.insert(pod.uid.clone(), Err(NO_IP_YET.to_owned()));
            }
            return results;
        }
        if let Some(wait) = self.scan_budget.wait() {
            self.scan_deferred = true;
            for pod in missing {
                let why = format!(
                    "not looked for yet (the proc filesystem is scanned again in {wait:?})"
                );
                results.insert(pod.uid.clone(), Err(why));
            }
            return results;
        }
        let started = Instant::now();
        let wanted: HashSet<&str> = missing.iter().map(|p| p.uid.as_str()).collect();
        let scanned = self.scan(&wanted);
        self.scan_budget.spend(started.elapsed());
        for pod in missing {
            let result = match &scanned {
                Ok(scanned) => self.choose(pod, scanned.get(&pod.uid)),
                Err(e) => Err(e.clone()),
            };
            let result = result.map(|found| {
                let path = self.path_of(&found);
                self.cache.insert(pod.uid.clone(), found);
                NetnsSource::Path(path)
            });
            results.insert(pod.uid.clone(), result);
        }
        results
    }

    fn retry_in(&self) -> Option<Duration> {
        // Once the budget allows, at once: the deferred pods must not wait
        // for the next event.
        self.scan_deferred
            .then(|| self.scan_budget.wait().unwrap_or(Duration::ZERO))
    }
}

/// The inode of the file at `path` (a namespace's, where one is mounted).
fn inode_at(path: &Path) -> Option<u64> {
    fs::metadata(path).ok().map(|m| m.ino())
}

/// Whether the namespace at `path` has one of `ips` on an interface.
fn holds_any_ip(path: &Path, ips: &[IpAddr]) -> Result<bool, String> {
    let netns = Netns::open(&path.to_string_lossy()).map_err(|e| e.to_string())?;
    let network = podnet::inspect(&netns).map_err(|e| crate::error_chain(&e))?;
    Ok(ips.iter().any(|ip| network.addresses.contains(ip)))
}

/// `starttime` (field 22) of `/proc/<pid>/stat`: clock ticks after boot.
fn start_time(stat: &Path) -> Option<u64> {
    let text = fs::read_to_string(stat).ok()?;
    // The command name (field 2) may hold spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The pod UIDs named in the contents of a `/proc/<pid>/cgroup` file, in
/// their canonical (dashed, lowercase) form. Each line is
/// `hierarchy:controllers:path`; in the path a UID follows `pod` after a
/// separator, dashed (cgroupfs: `/kubepods/burstable/pod<uid>/<container>`)
/// or with underscores (systemd: `kubepods-burstable-pod<uid_>.slice`).
pub fn pod_uids_in_cgroup(text: &str) -> Vec<String> {
    let mut uids = Vec::new();
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(_), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let bytes = path.as_bytes();
        let mut from = 0;
        while let Some(at) = path[from..].find("pod").map(|i| i + from) {
            from = at + 3;
            let after_separator =
                at > 0 && matches!(bytes[at - 1], b'/' | b'-' | b'_' | b'.' | b':');
            if let Some(uid) = uid_at(&path[at + 3..])
                && after_separator
                && !uids.contains(&uid)
            {
                uids.push(uid);
            }
        }
    }
    uids
}

/// A UID (8-4-4-4-12 hex digits, grouped by `-` or `_`) at the start of
/// `text` and followed by a separator or the end.
fn uid_at(text: &str) -> Option<String> {
    const GROUPS: [usize; 5] = [8, 4, 4, 4, 12];
    let bytes = text.as_bytes();
    let len = GROUPS.iter().sum::<usize>() + 4;
    if bytes.len() < len {
        return None;
    }
    let separator = bytes[8];
    if separator != b'-' && separator != b'_' {
        return None;
    }
    let mut at = 0;
    for (i, group) in GROUPS.iter().enumerate() {
        if i > 0 {
            if bytes[at] != separator {
                return None;
            }
            at += 1;
        }
        if !bytes[at..at + group].iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        at += group;
    }
    if bytes.get(len).is_some_and(|b| b.is_ascii_alphanumeric()) {
        return None;
    }
    Some(text[..len].replace('_', "-").to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    const UID_A: &str = "2c48913c-b29f-11e7-9350-020968147796";
    const UID_B: &str = "72f7f152-440c-66ac-9084-e0fc1d8a910c";
    const UID_C: &str = "0b7c2e3a-6d41-4f0e-9a57-3c1d2e4f5a6b";

    #[test]
    fn cgroup_lines_of_every_driver_and_version_name_the_pod() {
        let cgroupfs_v2 = format!("0::/kubepods/burstable/pod{UID_A}/9bca8d63d5fa61078384\n");
        assert_eq!(pod_uids_in_cgroup(&cgroupfs_v2), [UID_A]);

        let systemd_v1 = format!(
            "12:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-9bca.scope\n\
             1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-9bca.scope\n\
             0::/\n",
            UID_A.replace('-', "_"),
            UID_A.replace('-', "_"),
        );
        assert_eq!(pod_uids_in_cgroup(&systemd_v1), [UID_A]);

        // containerd's systemd driver with a colon-separated container part.
        let cri = format!(
            "0::/kubepods-besteffort-pod{}.slice:cri-containerd:b2a102854b49\n",
            UID_B.replace('-', "_")
        );
        assert_eq!(pod_uids_in_cgroup(&cri), [UID_B]);

        // Nested under a container runtime's own cgroup (kind, docker).
        let nested = format!(
            "0::/docker/8d461fa5/kubepods/besteffort/pod{}/aff34703\n",
            UID_B.to_uppercase()
        );
        assert_eq!(pod_uids_in_cgroup(&nested), [UID_B]);
    }

    #[test]
    fn cgroup_lines_without_a_pod_name_none() {
        for text in [
            "0::/\n",
            "0::/system.slice/containerd.service\n",
            "0::/kubepods/burstable\n",
            "0::/kubepods.slice/kubepods-burstable.slice\n",
            // Not a UID: too short, bad digits, mixed separators, glued on.
            "0::/kubepods/pod2c48913c-b29f-11e7-9350-02096814779\n",
            "0::/kubepods/pod2c48913c-b29f-11e7-9350-02096814779z/x\n",
            "0::/kubepods/pod2c48913c-b29f_11e7-9350-020968147796/x\n",
            "0::/kubepods/mypod2c48913c-b29f-11e7-9350-020968147796/x\n",
            "0::/kubepods/pod2c48913c-b29f-11e7-9350-020968147796abc\n",
            "garbage without colons pod2c48913c-b29f-11e7-9350-020968147796\n",
            "",
        ] {
            assert!(pod_uids_in_cgroup(text).is_empty(), "{text:?}");
        }
    }

    /// A fake proc tree: `<root>/<pid>/{cgroup,stat,ns/net}`.
    struct FakeProc {
        root: PathBuf,
    }

    impl FakeProc {
        fn new() -> Self {
            let root = std::env::temp_dir()
                .join(format!("ambpf-fakeproc-{}", ambpf_testbed::unique_name("")));
            fs::create_dir_all(&root).unwrap();
            Self { root }
        }

        fn process(&self, pid: u32, cgroup: &str, start: u64) {
            let dir = self.root.join(pid.to_string());
            fs::create_dir_all(dir.join("ns")).unwrap();
            fs::write(dir.join("cgroup"), cgroup).unwrap();
            let fields: Vec<String> = (3..=21).map(|i| i.to_string()).collect();
            fs::write(
                dir.join("stat"),
                format!(
                    "{pid} (pause (x)) S {} {start} 0 0\n",
                    fields[1..].join(" ")
                ),
            )
            .unwrap();
            fs::write(dir.join("ns/net"), "").unwrap();
        }

        /// Puts `pid` in the same (fake) namespace as `other`.
        fn share_netns(&self, pid: u32, other: u32) {
            let net = self.root.join(pid.to_string()).join("ns/net");
            fs::remove_file(&net).unwrap();
            fs::hard_link(self.root.join(other.to_string()).join("ns/net"), net).unwrap();
        }

        /// A new namespace for `pid` (a new inode).
        fn new_netns(&self, pid: u32) {
            let net = self.root.join(pid.to_string()).join("ns/net");
            let tmp = net.with_extension("new");
            fs::write(&tmp, "").unwrap();
            fs::rename(tmp, net).unwrap();
        }

        fn kill(&self, pid: u32) {
            fs::remove_dir_all(self.root.join(pid.to_string())).unwrap();
        }

        fn path(&self, pid: u32) -> NetnsSource {
            NetnsSource::Path(self.root.join(pid.to_string()).join("ns/net"))
        }
    }

    impl Drop for FakeProc {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.root);
        }
    }

    fn v2(uid: &str) -> String {
        format!("0::/kubepods/burstable/pod{uid}/c0ffee\n")
    }

    /// A finder that scans and checks owners on every pass.
    fn unthrottled(root: &Path) -> ProcNetnsFinder {
        ProcNetnsFinder::new(root)
            .with_pacing(ScanBudget::unlimited(), Duration::ZERO)
            .with_verifier(fake_namespaces_hold_every_ip())
    }

    /// The pods' IP in these tests: a fake namespace (a plain file) cannot
    /// be looked into, so [`fake_namespaces_hold_every_ip`] takes it as held.
    const IP: &str = "10.244.0.9";

    fn fake_namespaces_hold_every_ip() -> Verifier {
        Box::new(|_: &Path, _: &[IpAddr]| Ok(true))
    }

    #[test]
    fn scans_are_spaced_and_owners_rechecked_on_their_interval() {
        let proc = FakeProc::new();
        proc.process(200, &v2(UID_A), 10);
        let mut finder = ProcNetnsFinder::new(&proc.root)
            .with_host_netns(None)
            .with_verifier(fake_namespaces_hold_every_ip())
            .with_pacing(
                ScanBudget::new(0.001, Duration::ZERO),
                Duration::from_millis(300),
            );
        let started = Instant::now();
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(200))
        );
        let scan_at_most = started.elapsed();
        assert_eq!(finder.retry_in(), None);

        // A pod that appears right after a scan is left for the next one,
        // and the caller is told when to come back.
        proc.process(400, &v2(UID_B), 20);
        let found = finder.resolve(&[query(UID_A, &[IP]), query(UID_B, &[IP])]);
        assert_eq!(found[UID_A], Ok(proc.path(200)));
        assert!(
            found[UID_B]
                .as_ref()
                .unwrap_err()
                .contains("not looked for yet")
        );
        // At a 0.1% share, a scan is paid back in 1,000 times what it took.
        let retry = finder.retry_in().expect("a scan was deferred");
        assert!(
            retry <= scan_at_most * 1000,
            "{retry:?} after {scan_at_most:?}"
        );

        // Within the owner interval a cached answer is taken on its
        // namespace alone; past it, a pid now another pod's is not.
        fs::write(proc.root.join("200/cgroup"), v2(UID_B)).unwrap();
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(200))
        );
        std::thread::sleep(retry.max(Duration::from_millis(300)) + Duration::from_millis(1));
        let found = finder.resolve(&[query(UID_A, &[IP]), query(UID_B, &[IP])]);
        assert!(found[UID_A].is_err(), "{found:?}");
        assert_eq!(found[UID_B], Ok(proc.path(200)));
        assert_eq!(finder.retry_in(), None);
    }

    #[test]
    fn new_pods_on_a_quiet_node_are_scanned_at_once_and_a_spent_budget_paces_scans() {
        let proc = FakeProc::new();
        // Other processes, so that a scan costs something.
        for pid in 1000..1200 {
            proc.process(pid, &v2(UID_B), u64::from(pid));
        }
        // With credit left, every new pod is looked for at once.
        let mut finder = ProcNetnsFinder::new(&proc.root)
            .with_host_netns(None)
            .with_verifier(fake_namespaces_hold_every_ip())
            .with_pacing(
                ScanBudget::new(0.001, Duration::from_secs(60)),
                Duration::ZERO,
            );
        let mut asked = Vec::new();
        for (pid, uid) in [(200, UID_A), (300, UID_C)] {
            proc.process(pid, &v2(uid), u64::from(pid));
            asked.push(query(uid, &[IP]));
            assert_eq!(finder.resolve(&asked)[uid], Ok(proc.path(pid)));
            assert_eq!(finder.retry_in(), None);
        }

        // Without, the next scan waits until what the last one took is
        // earned back at the budget's share of the time.
        let mut finder = ProcNetnsFinder::new(&proc.root)
            .with_host_netns(None)
            .with_verifier(fake_namespaces_hold_every_ip())
            .with_pacing(ScanBudget::new(0.001, Duration::ZERO), Duration::ZERO);
        let started = Instant::now();
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(200))
        );
        let scan_at_most = started.elapsed();
        let found = finder.resolve(&[query(UID_A, &[IP]), query(UID_C, &[IP])]);
        assert!(found[UID_C].is_err(), "{found:?}");
        let wait = finder.retry_in().expect("a scan was deferred");
        assert!(
            wait <= scan_at_most * 1000,
            "{wait:?} after {scan_at_most:?}"
        );
        // Once earned back, the deferred pods are still to be retried, at
        // once (not left for the next event), and then found.
        std::thread::sleep(wait + Duration::from_millis(1));
        assert_eq!(finder.retry_in(), Some(Duration::ZERO));
        let found = finder.resolve(&[query(UID_A, &[IP]), query(UID_C, &[IP])]);
        assert_eq!(found[UID_C], Ok(proc.path(300)));
        assert_eq!(finder.retry_in(), None);
    }

    fn query(uid: &str, ips: &[&str]) -> PodQuery {
        PodQuery {
            uid: uid.into(),
            namespace: "shop".into(),
            name: "web".into(),
            ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            runtime_netns: None,
        }
    }

    #[test]
    fn start_time_is_read_past_a_command_with_parentheses() {
        let proc = FakeProc::new();
        proc.process(7, "", 4242);
        assert_eq!(start_time(&proc.root.join("7/stat")), Some(4242));
    }

    #[test]
    fn the_oldest_process_of_each_pod_gives_the_namespace_and_is_cached() {
        let proc = FakeProc::new();
        proc.process(300, &v2(UID_A), 50); // app container, started later
        proc.process(200, &v2(UID_A), 10); // pause
        proc.share_netns(300, 200);
        proc.process(
            400,
            &format!(
                "1:name=systemd:/kubepods-pod{}.slice\n",
                UID_B.replace('-', "_")
            ),
            5,
        );
        proc.process(500, "0::/system.slice/sshd.service\n", 1);
        let mut finder = unthrottled(&proc.root).with_host_netns(None);

        let found = finder.resolve(&[
            query(UID_A, &[IP]),
            query(UID_B, &[IP]),
            query("missing", &[IP]),
        ]);
        assert_eq!(found[UID_A], Ok(proc.path(200)));
        assert_eq!(found[UID_B], Ok(proc.path(400)));
        assert!(
            found["missing"]
                .as_ref()
                .unwrap_err()
                .contains("no process of the pod"),
            "{found:?}"
        );

        // An older process appearing later does not move a valid answer.
        proc.process(100, &v2(UID_A), 1);
        proc.share_netns(100, 200);
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(200))
        );
    }

    #[test]
    fn a_restarted_sandbox_or_a_reused_pid_is_found_again() {
        let proc = FakeProc::new();
        proc.process(200, &v2(UID_A), 10);
        proc.process(300, &v2(UID_A), 20);
        proc.share_netns(300, 200);
        let mut finder = unthrottled(&proc.root).with_host_netns(None);
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(200))
        );

        // The process is gone: another one of the pod takes over.
        proc.kill(200);
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(300))
        );

        // Its namespace changed (sandbox recreated): found again, same pid.
        let before = finder.cache[UID_A].clone();
        proc.new_netns(300);
        let inode = fs::metadata(proc.root.join("300/ns/net")).unwrap().ino();
        assert_ne!(before.inode, inode);
        assert_eq!(
            finder.resolve(&[query(UID_A, &[IP])])[UID_A],
            Ok(proc.path(300))
        );
        assert_eq!(
            finder.cache[UID_A],
            Found {
                at: FoundAt::Process(300),
                inode
            }
        );

        // The pid now belongs to someone else: not the pod's any more.
        fs::write(proc.root.join("300/cgroup"), v2(UID_B)).unwrap();
        assert!(finder.resolve(&[query(UID_A, &[IP])])[UID_A].is_err());
    }

    #[test]
    fn the_host_namespace_is_never_a_pods() {
        let proc = FakeProc::new();
        proc.process(200, &v2(UID_A), 10);
        let host = fs::metadata(proc.root.join("200/ns/net")).unwrap().ino();
        let mut finder = unthrottled(&proc.root).with_host_netns(Some(host));
        assert!(finder.resolve(&[query(UID_A, &[IP])])[UID_A].is_err());
    }

    #[test]
    fn with_ips_only_a_namespace_holding_one_is_taken() {
        let proc = FakeProc::new();
        // A process of the pod visiting another namespace, older than the pod's own.
        proc.process(100, &v2(UID_A), 1);
        proc.process(200, &v2(UID_A), 10);
        let own = proc.root.join("200/ns/net");
        let checked = Arc::new(Mutex::new(Vec::new()));
        let verifier: Verifier = Box::new({
            let (own, checked) = (own.clone(), checked.clone());
            move |path: &Path, ips: &[IpAddr]| {
                checked.lock().unwrap().push(path.to_owned());
                assert_eq!(ips, ["10.0.0.5".parse::<IpAddr>().unwrap()]);
                Ok(path == own)
            }
        });
        let mut finder = unthrottled(&proc.root)
            .with_host_netns(None)
            .with_verifier(verifier);
        assert_eq!(
            finder.resolve(&[query(UID_A, &["10.0.0.5"])])[UID_A],
            Ok(proc.path(200))
        );
        assert_eq!(checked.lock().unwrap().len(), 2);

        // A cached answer is not verified again.
        finder.resolve(&[query(UID_A, &["10.0.0.5"])]);
        assert_eq!(checked.lock().unwrap().len(), 2);

        // No namespace holds the IP: an error naming it.
        let mut strict = unthrottled(&proc.root)
            .with_host_netns(None)
            .with_verifier(Box::new(|_: &Path, _: &[IpAddr]| Ok(false)));
        let err = strict
            .resolve(&[query(UID_A, &["10.0.0.5"])])
            .remove(UID_A)
            .unwrap()
            .unwrap_err();
        assert!(err.contains("holds its IPs 10.0.0.5"), "{err}");
    }

    /// A file standing for a namespace the runtime mounted for a sandbox.
    fn runtime_netns(proc: &FakeProc, name: &str) -> RuntimeNetns {
        let path = proc.root.join(name);
        fs::write(&path, "").unwrap();
        let inode = fs::metadata(&path).unwrap().ino();
        RuntimeNetns { path, inode }
    }

    fn named(uid: &str, ips: &[&str], runtime: &RuntimeNetns) -> PodQuery {
        PodQuery {
            runtime_netns: Some(runtime.clone()),
            ..query(uid, ips)
        }
    }

    /// A pod a CNI ADD enrolled is taken where the runtime put it, with no
    /// scan: while the path holds the namespace enrolled and one of the
    /// pod's IPs; else it is looked for as any pod is.
    #[test]
    fn the_namespace_the_runtime_named_is_taken_while_it_holds_the_pod() {
        let proc = FakeProc::new();
        let cni = runtime_netns(&proc, "cni-1");
        let checked = Arc::new(Mutex::new(Vec::new()));
        let verifier: Verifier = Box::new({
            let checked = checked.clone();
            move |path: &Path, _: &[IpAddr]| {
                checked.lock().unwrap().push(path.to_owned());
                Ok(!path.ends_with("cni-elsewhere"))
            }
        });
        // No process of the pod in the proc tree: an answer can only come
        // from the runtime's path.
        let mut finder = unthrottled(&proc.root)
            .with_host_netns(None)
            .with_verifier(verifier);
        let found = finder.resolve(&[named(UID_A, &[IP], &cni)]);
        assert_eq!(found[UID_A], Ok(NetnsSource::Path(cni.path.clone())));
        assert_eq!(finder.retry_in(), None);
        assert_eq!(*checked.lock().unwrap(), std::slice::from_ref(&cni.path));
        // Cached: one `stat`, not verified again.
        finder.resolve(&[named(UID_A, &[IP], &cni)]);
        assert_eq!(checked.lock().unwrap().len(), 1);

        // A path that holds another namespace (re-mounted), or a namespace
        // without the pod's IPs, is not the pod's.
        let mut moved = runtime_netns(&proc, "cni-2");
        moved.inode += 1;
        let elsewhere = runtime_netns(&proc, "cni-elsewhere");
        let found = finder.resolve(&[named(UID_B, &[IP], &moved), named(UID_C, &[IP], &elsewhere)]);
        assert!(found[UID_B].is_err(), "{found:?}");
        assert!(found[UID_C].is_err(), "{found:?}");
    }

    #[test]
    fn a_runtime_path_gone_is_scanned_for_and_a_new_one_replaces_a_cached_answer() {
        let proc = FakeProc::new();
        proc.process(200, &v2(UID_A), 10);
        let mut finder = unthrottled(&proc.root).with_host_netns(None);
        let first = runtime_netns(&proc, "cni-1");
        assert_eq!(
            finder.resolve(&[named(UID_A, &[IP], &first)])[UID_A],
            Ok(NetnsSource::Path(first.path.clone()))
        );
        // The sandbox is gone, its path with it: the pod is scanned for.
        fs::remove_file(&first.path).unwrap();
        assert_eq!(
            finder.resolve(&[named(UID_A, &[IP], &first)])[UID_A],
            Ok(proc.path(200))
        );
        // A re-created sandbox's ADD names a new namespace: it replaces the
        // cached answer, whose process is still there.
        let second = runtime_netns(&proc, "cni-2");
        assert_eq!(
            finder.resolve(&[named(UID_A, &[IP], &second)])[UID_A],
            Ok(NetnsSource::Path(second.path.clone()))
        );
        // Named by the runtime as the cached process's namespace: the cached
        // path stays (ztunnel is told of no change).
        let pause = RuntimeNetns {
            path: proc.root.join("200/ns/net"),
            inode: fs::metadata(proc.root.join("200/ns/net")).unwrap().ino(),
        };
        fs::remove_file(&second.path).unwrap();
        finder.resolve(&[query(UID_A, &[IP])]);
        assert_eq!(
            finder.resolve(&[named(UID_A, &[IP], &pause)])[UID_A],
            Ok(proc.path(200))
        );
    }

    #[test]
    fn pods_no_longer_asked_for_are_forgotten() {
        let proc = FakeProc::new();
        proc.process(200, &v2(UID_A), 10);
        let mut finder = unthrottled(&proc.root).with_host_netns(None);
        finder.resolve(&[query(UID_A, &[IP])]);
        assert!(finder.cache.contains_key(UID_A));
        finder.resolve(&[]);
        assert!(finder.cache.is_empty());
    }

    /// A starting pod's events (its status without an IP) scan nothing: a
    /// process of the pod is found only along with a pod that sets off a
    /// scan, or once the pod's status has its IP.
    #[test]
    fn a_pod_without_an_ip_sets_off_no_scan_of_its_own() {
        let proc = FakeProc::new();
        proc.process(200, &v2(UID_A), 10);
        proc.process(300, &v2(UID_B), 20);
        let mut finder = unthrottled(&proc.root).with_host_netns(None);
        let err = finder.resolve(&[query(UID_A, &[])]).remove(UID_A).unwrap();
        assert_eq!(err, Err(NO_IP_YET.to_owned()));
        assert_eq!(finder.retry_in(), None, "nothing deferred to retry");

        let found = finder.resolve(&[query(UID_A, &[]), query(UID_B, &[IP])]);
        assert_eq!(found[UID_A], Ok(proc.path(200)));
        assert_eq!(found[UID_B], Ok(proc.path(300)));

        let mut finder = unthrottled(&proc.root).with_host_netns(None);
        assert!(finder.resolve(&[query(UID_B, &[])])[UID_B].is_err());
        assert_eq!(
            finder.resolve(&[query(UID_B, &[IP])])[UID_B],
            Ok(proc.path(300))
        );
    }

    #[test]
    fn closures_resolve_too() {
        let mut resolver = |pod: &PodQuery| {
            Ok(NetnsSource::Path(PathBuf::from(format!(
                "/run/netns/{}",
                pod.name
            ))))
        };
        let found = NetnsResolver::resolve(&mut resolver, &[query(UID_A, &[IP])]);
        assert_eq!(found[UID_A], Ok(NetnsSource::Path("/run/netns/web".into())));
    }
}
