//! Chains the plugin into the node's CNI configuration and keeps it there.
//!
//! The plugin entry `{"type": "ambpf-cni", "agentSocket": ...}` is appended
//! to the `plugins` of the first `*.conflist` (by name) in the configuration
//! directory, and the plugin binary is copied into the CNI bin directory.
//! Both are idempotent; [`keep_installed`] re-applies them whenever the
//! directory changes and on a poll, so an entry removed (e.g. by the network
//! plugin rewriting its conflist) comes back. Every write is a temporary
//! file renamed over the conflist, made only if the file still holds what
//! was read, so neither the runtime nor another installer ever reads a
//! half-written file, and another installer's change is built on rather
//! than overwritten. [`uninstall`] takes both out again, so that pods can start on a node
//! ambpf has left (the plugin fails every pod while no agent answers).

use std::{
    fs, io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{Value, json};
use tracing::{info, warn};

use super::PLUGIN_TYPE;

pub const DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
pub const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";

#[derive(Clone, Debug)]
pub struct InstallConfig {
    /// Where the node's `*.conflist` lives.
    pub conf_dir: PathBuf,
    /// Where the runtime looks for plugin binaries.
    pub bin_dir: PathBuf,
    /// The `ambpf-cni` binary to copy there (none: do not copy).
    pub plugin_binary: Option<PathBuf>,
    /// The agent's endpoint, written into the plugin entry.
    pub agent_socket: PathBuf,
    /// How long the plugin waits for the agent, in seconds (written into the
    /// entry when set).
    pub agent_timeout_seconds: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("no *.conflist in {0}")]
    NoConflist(PathBuf),
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: io::Error },
    #[error("{path}: not a CNI conflist: {why}")]
    Invalid { path: PathBuf, why: String },
    #[error(
        "{0}: another writer kept replacing it while ambpf-cni was being chained; trying again \
         at the next check"
    )]
    Contended(PathBuf),
}

/// What [`install_once`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Installed {
    /// The conflist that carries the entry.
    pub conflist: PathBuf,
    pub conflist_changed: bool,
    pub binary_changed: bool,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.to_owned(),
        cause: source,
    }
}

/// Every `*.conflist` in `dir`, by name.
fn conflists(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut lists: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "conflist") && p.is_file())
        .collect();
    lists.sort();
    Ok(lists)
}

/// The first `*.conflist` in `dir`, by name (the one the runtime uses).
pub fn find_conflist(dir: &Path) -> Result<PathBuf, InstallError> {
    conflists(dir)
        .map_err(io_err(dir))?
        .into_iter()
        .next()
        .ok_or_else(|| InstallError::NoConflist(dir.to_owned()))
}

/// The plugin entry for `config`.
pub fn plugin_entry(config: &InstallConfig) -> Value {
    let mut entry = json!({
        "type": PLUGIN_TYPE,
        "agentSocket": config.agent_socket.to_string_lossy(),
    });
    if let Some(timeout) = config.agent_timeout_seconds {
        entry["agentTimeoutSeconds"] = json!(timeout);
    }
    entry
}

/// Whether a plugin entry is ambpf's.
fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// `conflist` with exactly one plugin entry equal to `entry`, last; `None`
/// when it already is so.
fn with_entry(mut conflist: Value, entry: &Value) -> Result<Option<Value>, String> {
    let plugins = conflist
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or("no \"plugins\" array")?;
    if plugins.iter().filter(|p| is_ours(p)).count() == 1 && plugins.last() == Some(entry) {
        return Ok(None);
    }
    plugins.retain(|p| !is_ours(p));
    plugins.push(entry.clone());
    Ok(Some(conflist))
}

/// `conflist` without ambpf's plugin entries; `None` when it has none.
fn without_entry(mut conflist: Value) -> Option<Value> {
    let plugins = conflist.get_mut("plugins").and_then(Value::as_array_mut)?;
    let before = plugins.len();
    plugins.retain(|p| !is_ours(p));
    (plugins.len() != before).then_some(conflist)
}

/// How often a conflist is read again when another writer replaced it
/// between ambpf's read and its write.
const WRITE_ATTEMPTS: usize = 5;

/// Rewrites the conflist at `path` with `change` (`None`: nothing to
/// change), atomically and with the file's mode, unless another writer
/// (another CNI installer) replaced it since it was read: then it is read
/// again and changed anew, so their change is kept rather than overwritten.
/// Whether it was rewritten. `before_write` runs between the read and the
/// write (a test's racing writer).
fn rewrite_conflist(
    path: &Path,
    change: impl Fn(Value) -> Result<Option<Value>, String>,
    mut before_write: impl FnMut(),
) -> Result<bool, InstallError> {
    for _ in 0..WRITE_ATTEMPTS {
        let text = fs::read(path).map_err(io_err(path))?;
        let conflist: Value = serde_json::from_slice(&text).map_err(|e| InstallError::Invalid {
            path: path.to_owned(),
            why: e.to_string(),
        })?;
        let change = change(conflist).map_err(|why| InstallError::Invalid {
            path: path.to_owned(),
            why,
        })?;
        let Some(updated) = change else {
            return Ok(false);
        };
        let mut bytes = serde_json::to_vec_pretty(&updated).expect("a JSON value serializes");
        // As the file was, so that unchaining gives back the bytes chaining
        // found (keys keep their order too: serde_json's `preserve_order`).
        if text.ends_with(b"\n") || text.is_empty() {
            bytes.push(b'\n');
        }
        let mode = fs::metadata(path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o644);
        before_write();
        if write_atomically(path, &bytes, mode, Some(&text))? {
            return Ok(true);
        }
    }
    Err(InstallError::Contended(path.to_owned()))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so the
/// runtime never reads a half-written file. With `expected`, only if the
/// file still holds those bytes just before the rename (whether it wrote):
/// the window in which another writer's change can be lost shrinks from
/// the whole read-modify-write to the rename.
fn write_atomically(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    expected: Option<&[u8]>,
) -> Result<bool, InstallError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Not *.conflist, so the runtime never picks the temporary file up;
    // one per write, so that writers never share one.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let temp = dir.join(format!(".{name}.ambpf-{}-{write}.tmp", std::process::id()));
    let written = fs::write(&temp, bytes)
        .and_then(|()| fs::set_permissions(&temp, fs::Permissions::from_mode(mode)))
        .and_then(|()| match expected {
            Some(expected) if fs::read(path)? != expected => Ok(false),
            _ => fs::rename(&temp, path).map(|()| true),
        });
    if !matches!(written, Ok(true)) {
        let _ = fs::remove_file(&temp);
    }
    written.map_err(io_err(path))
}

/// Whether `target` is already a copy of `source`: same size and written
/// after it (the copy is made after reading the source), or same bytes. The
/// cheap check first, so a repair poll does not read a large binary.
fn same_binary(source: &Path, target: &Path) -> bool {
    let (Ok(src), Ok(dst)) = (fs::metadata(source), fs::metadata(target)) else {
        return false;
    };
    if src.len() != dst.len() {
        return false;
    }
    if let (Ok(src_time), Ok(dst_time)) = (src.modified(), dst.modified())
        && dst_time >= src_time
    {
        return true;
    }
    matches!((fs::read(source), fs::read(target)), (Ok(a), Ok(b)) if a == b)
}

/// Adds the plugin entry and copies the binary, changing only what differs.
pub fn install_once(config: &InstallConfig) -> Result<Installed, InstallError> {
    let mut installed = Installed::default();
    if let Some(source) = &config.plugin_binary {
        let target = config.bin_dir.join(PLUGIN_TYPE);
        if !same_binary(source, &target) {
            let wanted = fs::read(source).map_err(io_err(source))?;
            fs::create_dir_all(&config.bin_dir).map_err(io_err(&config.bin_dir))?;
            write_atomically(&target, &wanted, 0o755, None)?;
            installed.binary_changed = true;
        }
    }
    let path = find_conflist(&config.conf_dir)?;
    installed.conflist_changed = chain(&path, &plugin_entry(config), || {})?;
    installed.conflist = path;
    Ok(installed)
}

/// Chains `entry` into the conflist at `path` (see [`rewrite_conflist`]).
fn chain(path: &Path, entry: &Value, before_write: impl FnMut()) -> Result<bool, InstallError> {
    rewrite_conflist(path, |conflist| with_entry(conflist, entry), before_write)
}

/// What [`uninstall`] removed, and what it could not.
#[derive(Debug, Default)]
pub struct Uninstalled {
    /// The conflists that carried the plugin and no longer do.
    pub unchained: Vec<PathBuf>,
    /// The plugin binary, when there was one.
    pub binary_removed: Option<PathBuf>,
    /// What could not be removed (the rest was still done).
    pub errors: Vec<InstallError>,
}

/// Takes the plugin out of the node: its entries (type `ambpf-cni`) from
/// every `*.conflist` in `conf_dir`, each rewritten atomically with the other
/// plugins kept, then its binary from `bin_dir`. Idempotent: a conflist
/// without the entry is not rewritten, and a missing directory has nothing
/// to remove. A conflist that cannot be read or rewritten is reported in
/// [`Uninstalled::errors`]; the others, and the binary, are still done.
pub fn uninstall(conf_dir: &Path, bin_dir: &Path) -> Uninstalled {
    let mut done = Uninstalled::default();
    let lists = match conflists(conf_dir) {
        Ok(lists) => lists,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            done.errors.push(io_err(conf_dir)(e));
            Vec::new()
        }
    };
    for path in lists {
        match unchain(&path) {
            Ok(true) => done.unchained.push(path),
            Ok(false) => {}
            Err(e) => done.errors.push(e),
        }
    }
    let binary = bin_dir.join(PLUGIN_TYPE);
    match fs::remove_file(&binary) {
        Ok(()) => done.binary_removed = Some(binary),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => done.errors.push(io_err(&binary)(e)),
    }
    done
}

/// The conflists of `conf_dir` that chain the plugin (unreadable ones are
/// left out: this only informs what `uninstall --keep-cni` says).
pub fn chained_in(conf_dir: &Path) -> Vec<PathBuf> {
    chaining(conf_dir, PLUGIN_TYPE)
}

/// The conflists of `conf_dir` that chain a plugin of type `plugin_type`
/// (unreadable or malformed ones are left out).
pub fn chaining(conf_dir: &Path, plugin_type: &str) -> Vec<PathBuf> {
    conflists(conf_dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|path| {
            fs::read(path)
                .ok()
                .and_then(|text| serde_json::from_slice::<Value>(&text).ok())
                .and_then(|list| {
                    list.get("plugins")?.as_array().map(|p| {
                        p.iter().any(|plugin| {
                            plugin.get("type").and_then(Value::as_str) == Some(plugin_type)
                        })
                    })
                })
                .unwrap_or(false)
        })
        .collect()
}

/// Removes ambpf's entries from one conflist; whether it had any.
fn unchain(path: &Path) -> Result<bool, InstallError> {
    let text = fs::read(path).map_err(io_err(path))?;
    // A file that does not name the plugin holds nothing of ours, whatever
    // else it holds (another plugin's malformed file is not ours to judge).
    let needle = PLUGIN_TYPE.as_bytes();
    if !text.windows(needle.len()).any(|w| w == needle) {
        return Ok(false);
    }
    rewrite_conflist(path, |conflist| Ok(without_entry(conflist)), || {})
}

/// When to look at the CNI configuration again: as soon as its directory
/// changes (another installer writing a conflist) and every `interval`
/// besides.
struct Checks {
    changes: Option<super::conf_dir_watch::DirChanges>,
    conf_dir: PathBuf,
    interval: Duration,
}

impl Checks {
    fn new(conf_dir: &Path, interval: Duration) -> Self {
        let changes = match super::conf_dir_watch::DirChanges::new(conf_dir) {
            Ok(changes) => Some(changes),
            Err(e) => {
                warn!(
                    "cannot watch {} ({e}): checking the plugin every {} s only",
                    conf_dir.display(),
                    interval.as_secs_f64()
                );
                None
            }
        };
        Self {
            changes,
            conf_dir: conf_dir.to_owned(),
            interval,
        }
    }

    async fn next(&self) {
        let Some(changes) = &self.changes else {
            return tokio::time::sleep(self.interval).await;
        };
        tokio::select! {
            changed = changes.changed() => if let Err(e) = changed {
                warn!("watching {}: {e}", self.conf_dir.display());
                tokio::time::sleep(self.interval).await;
            },
            () = tokio::time::sleep(self.interval) => {}
        }
    }
}

/// Logs a failure to install once until it changes.
fn failed(failing: &mut Option<String>, error: &InstallError, waiting: bool) {
    let text = error.to_string();
    if failing.as_ref() != Some(&text) {
        if waiting {
            warn!(
                "cannot chain the CNI plugin yet: {text}; waiting for the configuration (the \
                 network plugin may not have written it yet)"
            );
        } else {
            warn!("installing the CNI plugin: {text}");
        }
    }
    *failing = Some(text);
}

/// [`install_once`] until it succeeds, then [`keep_installed`], forever.
/// At a node's start the network plugin may not have written its conflist
/// yet (or be halfway through): ambpf's installer waits for it, as Istio's
/// does, rather than fail and be restarted with a growing backoff. `chained`
/// is told the first success.
pub async fn install_then_keep(
    config: InstallConfig,
    interval: Duration,
    chained: impl FnOnce(&Installed),
) {
    let checks = Checks::new(&config.conf_dir, interval);
    let mut failing = None;
    loop {
        match install_once(&config) {
            Ok(done) => {
                chained(&done);
                break;
            }
            Err(e) => failed(&mut failing, &e, true),
        }
        checks.next().await;
    }
    checks.next().await;
    keep(&config, &checks).await
}

/// [`install_once`] now, whenever the configuration directory changes (as
/// another installer rewrites a conflist), and every `interval` besides,
/// forever: repairs the entry or the binary when something removes them.
/// Each repair is logged once; a failure once until it changes.
pub async fn keep_installed(config: InstallConfig, interval: Duration) {
    keep(&config, &Checks::new(&config.conf_dir, interval)).await
}

async fn keep(config: &InstallConfig, checks: &Checks) {
    let mut failing = None;
    loop {
        match install_once(config) {
            Ok(done) => {
                if done.conflist_changed {
                    info!(
                        "re-chained ambpf-cni into {}: its entry was missing or not as ambpf \
                         writes it (another installer rewrote the file); the other plugins are \
                         kept",
                        done.conflist.display()
                    );
                }
                if done.binary_changed {
                    info!("copied ambpf-cni into {} again", config.bin_dir.display());
                }
                failing = None;
            }
            Err(e) => failed(&mut failing, &e, false),
        }
        checks.next().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of the test's own, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("ambpf-cni-install-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("net.d")).unwrap();
            fs::create_dir_all(dir.join("bin")).unwrap();
            Self(dir)
        }

        fn conf_dir(&self) -> PathBuf {
            self.0.join("net.d")
        }

        fn bin_dir(&self) -> PathBuf {
            self.0.join("bin")
        }

        fn config(&self) -> InstallConfig {
            let plugin = self.0.join("ambpf-cni.src");
            fs::write(&plugin, b"#!/bin/true\n").unwrap();
            InstallConfig {
                conf_dir: self.conf_dir(),
                bin_dir: self.bin_dir(),
                plugin_binary: Some(plugin),
                agent_socket: PathBuf::from("/var/run/ambpf/pluginevent.sock"),
                agent_timeout_seconds: None,
            }
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn network(name: &str) -> Value {
        json!({
            "cniVersion": "1.0.0",
            "name": name,
            "plugins": [
                { "type": "ptp", "ipam": { "type": "host-local", "subnet": "10.244.1.0/24" } },
                { "type": "portmap", "capabilities": { "portMappings": true } }
            ]
        })
    }

    fn read_json(path: &Path) -> Value {
        serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
    }

    fn file_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The plugins' types, in order.
    fn plugin_types(list: &Value) -> Vec<String> {
        list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap().to_owned())
            .collect()
    }

    /// Another installer's version of the network: its own plugin added,
    /// ambpf's dropped, and a generation of its own.
    fn rewritten(generation: u64) -> Value {
        let mut list = network("k8s-pod-network");
        list["generation"] = json!(generation);
        list["plugins"]
            .as_array_mut()
            .unwrap()
            .push(json!({ "type": "other-installer" }));
        list
    }

    /// Another installer writes its version `generation` of the file.
    fn rewrite(path: &Path, generation: u64) {
        write_atomically(
            path,
            rewritten(generation).to_string().as_bytes(),
            0o644,
            None,
        )
        .unwrap();
    }

    #[test]
    fn a_rewrite_between_read_and_write_is_built_on_not_overwritten() {
        let dir = TempDir::new();
        let path = dir.conf_dir().join("10-ptp.conflist");
        fs::write(&path, network("k8s-pod-network").to_string()).unwrap();
        let entry = plugin_entry(&dir.config());
        // Another installer replaces the file after ambpf read it, before
        // ambpf writes.
        let mut raced = false;
        let changed = chain(&path, &entry, || {
            if !std::mem::replace(&mut raced, true) {
                rewrite(&path, 7);
            }
        })
        .unwrap();
        assert!(changed && raced);
        let list = read_json(&path);
        assert_eq!(
            list["generation"], 7,
            "the other installer's change was lost"
        );
        assert_eq!(
            plugin_types(&list),
            ["ptp", "portmap", "other-installer", PLUGIN_TYPE]
        );

        // One that never stops rewriting: ambpf gives up for this round
        // rather than overwrite it.
        let mut generation = 8;
        rewrite(&path, generation);
        let contended = chain(&dir.conf_dir().join("10-ptp.conflist"), &entry, || {
            generation += 1;
            rewrite(&path, generation);
        });
        assert!(
            matches!(contended, Err(InstallError::Contended(_))),
            "{contended:?}"
        );
        assert_eq!(read_json(&path), rewritten(generation));
        assert_eq!(file_names(&dir.conf_dir()), ["10-ptp.conflist"]);
    }

    #[test]
    fn racing_another_installer_ends_valid_with_both_plugins_once_and_nothing_torn() {
        let dir = TempDir::new();
        let config = dir.config();
        let path = dir.conf_dir().join("10-ptp.conflist");
        fs::write(&path, rewritten(0).to_string()).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Rewrites the file from its own template, dropping ambpf's entry;
        // every other time in place and in two halves, as a careless
        // installer does (a reader can see half a file then).
        let rewriter = std::thread::spawn({
            let (path, stop) = (path.clone(), stop.clone());
            move || {
                let mut generation = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    generation += 1;
                    let bytes = rewritten(generation).to_string().into_bytes();
                    if generation % 2 == 0 {
                        write_atomically(&path, &bytes, 0o644, None).unwrap();
                    } else {
                        use std::io::Write as _;
                        let mut file = fs::File::create(&path).unwrap();
                        let (head, tail) = bytes.split_at(bytes.len() / 2);
                        file.write_all(head).unwrap();
                        std::thread::sleep(Duration::from_micros(200));
                        file.write_all(tail).unwrap();
                    }
                    std::thread::sleep(Duration::from_micros(500));
                }
                generation
            }
        });
        let (mut chained, mut torn) = (0, 0);
        let racing_until = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < racing_until {
            match install_once(&config) {
                Ok(done) => chained += usize::from(done.conflist_changed),
                // Half of the other installer's file: nothing written.
                Err(InstallError::Invalid { .. } | InstallError::Contended(_)) => torn += 1,
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let last = rewriter.join().unwrap();
        assert!(
            chained > 0 && last > 10,
            "no race: {chained} chained, {last} rewrites"
        );

        // The other installer has stopped with its last version in place
        // (or ambpf's on top of it): ambpf's next check leaves both.
        install_once(&config).unwrap();
        let list = read_json(&path);
        assert_eq!(
            plugin_types(&list),
            ["ptp", "portmap", "other-installer", PLUGIN_TYPE],
            "after {chained} chains and {torn} torn or contended reads"
        );
        assert_eq!(file_names(&dir.conf_dir()), ["10-ptp.conflist"]);
    }

    #[tokio::test]
    async fn a_conflist_rewritten_by_another_installer_is_re_chained_at_once() {
        let dir = TempDir::new();
        let path = dir.conf_dir().join("10-ptp.conflist");
        fs::write(&path, network("k8s-pod-network").to_string()).unwrap();
        // A poll far longer than the test: only the directory's change can
        // wake the installer in time.
        let keeper = tokio::spawn(keep_installed(dir.config(), Duration::from_secs(3600)));
        let chained = || {
            fs::read(&path)
                .ok()
                .and_then(|text| serde_json::from_slice::<Value>(&text).ok())
                .is_some_and(|list| {
                    plugin_types(&list).last().map(String::as_str) == Some(PLUGIN_TYPE)
                })
        };
        // Chained again after each of three rewrites, and after the last.
        for rewrite_after in [Some(1), Some(2), Some(3), None] {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while !chained() {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "not re-chained in 5 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if let Some(generation) = rewrite_after {
                rewrite(&path, generation);
            }
        }
        keeper.abort();
        assert_eq!(read_json(&path)["generation"], 3);
    }

    #[tokio::test]
    async fn before_the_network_plugin_writes_its_conflist_the_installer_waits_for_it() {
        let dir = TempDir::new();
        let path = dir.conf_dir().join("10-ptp.conflist");
        let (told, mut first) = tokio::sync::mpsc::unbounded_channel();
        // A poll far longer than the test: the conflist's arrival wakes it.
        let installer = tokio::spawn(install_then_keep(
            dir.config(),
            Duration::from_secs(3600),
            move |done: &Installed| told.send(done.conflist.clone()).unwrap(),
        ));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!installer.is_finished(), "gave up without a conflist");
        assert!(first.try_recv().is_err());
        // The network plugin's installer, halfway and then done.
        fs::write(&path, b"{ \"cniVersion\": ").unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        write_atomically(
            &path,
            network("k8s-pod-network").to_string().as_bytes(),
            0o644,
            None,
        )
        .unwrap();
        let chained_in = tokio::time::timeout(Duration::from_secs(5), first.recv())
            .await
            .expect("chained once the conflist is there")
            .unwrap();
        assert_eq!(chained_in, path);
        assert_eq!(
            plugin_types(&read_json(&path)),
            ["ptp", "portmap", PLUGIN_TYPE]
        );
        // Then kept: a rewrite is re-chained.
        write_atomically(
            &path,
            network("k8s-pod-network").to_string().as_bytes(),
            0o644,
            None,
        )
        .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while plugin_types(&read_json(&path)).len() != 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "not re-chained in 5 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        installer.abort();
    }

    #[test]
    fn uninstall_unchains_every_conflist_and_removes_the_binary() {
        let dir = TempDir::new();
        let conf_dir = dir.conf_dir();
        let first = conf_dir.join("10-ptp.conflist");
        let second = conf_dir.join("20-other.conflist");
        fs::write(&first, network("k8s-pod-network").to_string()).unwrap();
        fs::set_permissions(&first, fs::Permissions::from_mode(0o600)).unwrap();
        install_once(&dir.config()).unwrap();
        // An entry of ours in another conflist too (an older installer's,
        // chained in the middle), and one that never had it.
        let mut other = network("other");
        other["plugins"].as_array_mut().unwrap().insert(
            1,
            json!({ "type": PLUGIN_TYPE, "agentSocket": "/old.sock" }),
        );
        fs::write(&second, other.to_string()).unwrap();
        let untouched = conf_dir.join("30-untouched.conflist");
        let untouched_text = "{ \"name\": \"x\",\n  \"plugins\": [ {\"type\": \"bridge\"} ] }\n";
        fs::write(&untouched, untouched_text).unwrap();
        // Not JSON, but not ours to judge: it does not name the plugin.
        let broken = conf_dir.join("40-broken.conflist");
        fs::write(&broken, "{ not json").unwrap();
        assert!(dir.bin_dir().join(PLUGIN_TYPE).exists());

        let done = uninstall(&conf_dir, &dir.bin_dir());
        assert!(done.errors.is_empty(), "{:?}", done.errors);
        assert_eq!(done.unchained, [first.clone(), second.clone()]);
        assert_eq!(done.binary_removed, Some(dir.bin_dir().join(PLUGIN_TYPE)));
        // Exactly the other plugins are left, in their order.
        assert_eq!(read_json(&first), network("k8s-pod-network"));
        assert_eq!(read_json(&second), network("other"));
        assert_eq!(fs::read_to_string(&untouched).unwrap(), untouched_text);
        assert_eq!(fs::read_to_string(&broken).unwrap(), "{ not json");
        let mode = fs::metadata(&first).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(!dir.bin_dir().join(PLUGIN_TYPE).exists());
        // No temporary file left behind.
        assert_eq!(
            file_names(&conf_dir),
            [
                "10-ptp.conflist",
                "20-other.conflist",
                "30-untouched.conflist",
                "40-broken.conflist"
            ]
        );

        // Again: nothing left to remove, nothing rewritten.
        let before = fs::metadata(&first).unwrap().modified().unwrap();
        let again = uninstall(&conf_dir, &dir.bin_dir());
        assert!(again.errors.is_empty() && again.unchained.is_empty());
        assert_eq!(again.binary_removed, None);
        assert_eq!(fs::metadata(&first).unwrap().modified().unwrap(), before);
    }

    #[test]
    fn uninstall_reports_a_conflist_it_cannot_read_and_does_the_rest() {
        let dir = TempDir::new();
        let chained = dir.conf_dir().join("10-ptp.conflist");
        fs::write(&chained, network("k8s-pod-network").to_string()).unwrap();
        install_once(&dir.config()).unwrap();
        // Names the plugin but does not parse: it may chain it, so it is an
        // error rather than silently left.
        let broken = dir.conf_dir().join("05-broken.conflist");
        fs::write(&broken, r#"{ "plugins": [ { "type": "ambpf-cni" "#).unwrap();

        let done = uninstall(&dir.conf_dir(), &dir.bin_dir());
        assert_eq!(done.unchained, std::slice::from_ref(&chained));
        assert!(done.binary_removed.is_some());
        assert_eq!(done.errors.len(), 1, "{:?}", done.errors);
        let error = done.errors[0].to_string();
        assert!(
            error.contains("05-broken.conflist") && error.contains("not a CNI conflist"),
            "{error}"
        );
        assert_eq!(read_json(&chained), network("k8s-pod-network"));
    }

    #[test]
    fn uninstall_where_nothing_was_installed_is_a_no_op() {
        let dir = TempDir::new();
        let missing = dir.0.join("no-such-dir");
        let done = uninstall(&missing, &missing);
        assert!(done.errors.is_empty() && done.unchained.is_empty());
        assert_eq!(done.binary_removed, None);
        assert!(!missing.exists());

        let list = dir.conf_dir().join("10-ptp.conflist");
        fs::write(&list, network("k8s-pod-network").to_string()).unwrap();
        let done = uninstall(&dir.conf_dir(), &dir.bin_dir());
        assert!(done.errors.is_empty() && done.unchained.is_empty());
        assert_eq!(
            fs::read_to_string(&list).unwrap(),
            network("k8s-pod-network").to_string()
        );
    }
}
