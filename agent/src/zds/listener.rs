//! The ZDS unix socket: created safely, owner-only, replacing a stale file.

use std::path::Path;

use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener};

/// ztunnel's default (`INPOD_UDS`).
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

pub use crate::unix_socket::SocketFileError as ListenError;

/// Binds the ZDS listener at `path`, owner-only, replacing a stale socket
/// file but never a live server's (see [`crate::unix_socket`]).
pub fn bind(path: &Path) -> Result<UnixSeqpacketListener, ListenError> {
    crate::unix_socket::bind_owner_only(
        path,
        |path| UnixSeqpacket::connect_blocking(path).is_ok(),
        |temp| UnixSeqpacketListener::bind(temp),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{fs, os::unix::fs::MetadataExt, path::PathBuf};

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
