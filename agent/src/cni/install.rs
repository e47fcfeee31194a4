//! Chains the plugin into the node's CNI configuration and keeps it there.
//!
//! The plugin entry `{"type": "ambpf-cni", "agentSocket": ...}` is appended
//! to the `plugins` of the first `*.conflist` (by name) in the configuration
//! directory, and the plugin binary is copied into the CNI bin directory.
//! Both are idempotent; [`keep_installed`] re-applies them on a poll, so an
//! entry removed (e.g. by the network plugin rewriting its conflist) comes
//! back.

use std::{
    fs, io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::Duration,
};

use log::{info, warn};
use serde_json::{Value, json};

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
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a CNI conflist: {why}")]
    Invalid { path: PathBuf, why: String },
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
        source,
    }
}

/// The first `*.conflist` in `dir`, by name (the one the runtime uses).
pub fn find_conflist(dir: &Path) -> Result<PathBuf, InstallError> {
    let mut lists: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "conflist") && p.is_file())
        .collect();
    lists.sort();
    lists
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

/// `conflist` with exactly one plugin entry equal to `entry`, last; `None`
/// when it already is so.
fn with_entry(mut conflist: Value, entry: &Value) -> Result<Option<Value>, String> {
    let plugins = conflist
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or("no \"plugins\" array")?;
    let ours = |p: &Value| p.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE);
    if plugins.iter().filter(|p| ours(p)).count() == 1 && plugins.last() == Some(entry) {
        return Ok(None);
    }
    plugins.retain(|p| !ours(p));
    plugins.push(entry.clone());
    Ok(Some(conflist))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so the
/// runtime never reads a half-written file.
fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<(), InstallError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Not *.conflist, so the runtime never picks the temporary file up.
    let temp = dir.join(format!(".{name}.ambpf-{}.tmp", std::process::id()));
    let written = fs::write(&temp, bytes)
        .and_then(|()| fs::set_permissions(&temp, fs::Permissions::from_mode(mode)))
        .and_then(|()| fs::rename(&temp, path));
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(io_err(path)(e));
    }
    Ok(())
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
            write_atomically(&target, &wanted, 0o755)?;
            installed.binary_changed = true;
        }
    }
    let path = find_conflist(&config.conf_dir)?;
    let text = fs::read(&path).map_err(io_err(&path))?;
    let invalid = |why: String| InstallError::Invalid {
        path: path.clone(),
        why,
    };
    let conflist: Value = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
    if let Some(updated) = with_entry(conflist, &plugin_entry(config)).map_err(invalid)? {
        let mut bytes = serde_json::to_vec_pretty(&updated).expect("a JSON value serializes");
        bytes.push(b'\n');
        let mode = fs::metadata(&path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o644);
        write_atomically(&path, &bytes, mode)?;
        installed.conflist_changed = true;
    }
    installed.conflist = path;
    Ok(installed)
}

/// [`install_once`] now and every `interval`, forever: repairs the entry or
/// the binary when something removes them.
pub async fn keep_installed(config: InstallConfig, interval: Duration) {
    loop {
        match install_once(&config) {
            Ok(done) if done.conflist_changed || done.binary_changed => info!(
                "CNI plugin installed in {} (conflist changed: {}, binary changed: {})",
                done.conflist.display(),
                done.conflist_changed,
                done.binary_changed
            ),
            Ok(_) => {}
            Err(e) => warn!("installing the CNI plugin: {e}"),
        }
        tokio::time::sleep(interval).await;
    }
}
