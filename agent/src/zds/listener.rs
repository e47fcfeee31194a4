//! The ZDS unix socket: created safely, owner-only, replacing a stale file.

use std::{
    fs, io,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
};

use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener};

/// ztunnel's default (`INPOD_UDS`).
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("another ZDS server is already listening on {0}")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("creating the ZDS socket {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Binds the ZDS listener at `path`.
///
/// A socket file left by a dead server is replaced; one with a live server
/// behind it is not. The socket is bound under a temporary name, restricted
/// to its owner, then renamed into place, so no client can ever connect to
/// it with wider permissions.
pub fn bind(path: &Path) -> Result<UnixSeqpacketListener, ListenError> {
    let io_err = |source| ListenError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err)?;

    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            // A live server answers; a stale socket refuses the connection.
            if UnixSeqpacket::connect_blocking(path).is_ok() {
                return Err(ListenError::InUse(path.to_owned()));
            }
        }
        Ok(_) => return Err(ListenError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(e)),
    }

    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&temp);
    let listener = UnixSeqpacketListener::bind(&temp).map_err(io_err)?;
    let placed = fs::set_permissions(&temp, fs::Permissions::from_mode(0o600))
        .and_then(|()| fs::rename(&temp, path));
    if let Err(e) = placed {
        let _ = fs::remove_file(&temp);
        return Err(io_err(e));
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ambpf-zds-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[tokio::test]
    async fn socket_is_owner_only_and_a_stale_one_is_replaced() {
        let dir = temp_dir("stale");
        let path = dir.join("ztunnel.sock");
        let first = bind(&path).unwrap();
        drop(first); // leaves a stale socket file behind
        assert!(path.exists());
        let _second = bind(&path).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_live_server_is_not_displaced() {
        let dir = temp_dir("live");
        let path = dir.join("ztunnel.sock");
        let _live = bind(&path).unwrap();
        let err = bind(&path).unwrap_err();
        assert!(matches!(err, ListenError::InUse(_)), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_regular_file_is_never_deleted() {
        let dir = temp_dir("file");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ztunnel.sock");
        fs::write(&path, "precious").unwrap();
        let err = bind(&path).unwrap_err();
        assert!(matches!(err, ListenError::NotASocket(_)), "{err}");
        assert_eq!(fs::read_to_string(&path).unwrap(), "precious");
        fs::remove_dir_all(&dir).unwrap();
    }
}
