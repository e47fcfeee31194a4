//! Unix sockets the agent serves on (ZDS, the CNI endpoint): created safely.
//!
//! A socket file left by a dead server is replaced; one with a live server
//! behind it is not, and a file that is not a socket is never deleted. The
//! socket is bound under a temporary name, restricted to its owner, then
//! renamed into place, so no client can ever connect to it with wider
//! permissions.

use std::{
    fs, io,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
};

#[derive(Debug, thiserror::Error)]
pub enum SocketFileError {
    #[error("another server is already listening on {0}")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("creating the socket {path}: {cause}")]
    Io { path: PathBuf, cause: io::Error },
}

/// Binds at `path` with `bind`; `is_live` says whether a server answers on an
/// existing socket file there.
pub fn bind_owner_only<L>(
    path: &Path,
    is_live: impl FnOnce(&Path) -> bool,
    bind: impl FnOnce(&Path) -> io::Result<L>,
) -> Result<L, SocketFileError> {
    let io_err = |source| SocketFileError::Io {
        path: path.to_owned(),
        cause: source,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err)?;

    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            // A live server answers; a stale socket refuses the connection.
            if is_live(path) {
                return Err(SocketFileError::InUse(path.to_owned()));
            }
        }
        Ok(_) => return Err(SocketFileError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(e)),
    }

    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&temp);
    let listener = bind(&temp).map_err(io_err)?;
    let placed = fs::set_permissions(&temp, fs::Permissions::from_mode(0o600))
        .and_then(|()| fs::rename(&temp, path));
    if let Err(e) = placed {
        let _ = fs::remove_file(&temp);
        return Err(io_err(e));
    }
    Ok(listener)
}
