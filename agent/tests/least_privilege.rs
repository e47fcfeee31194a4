//! Privileged: what the agent serves on the node is for root alone. A user
//! that is not root cannot connect to the ZDS socket (ztunnel's netns fds)
//! or the CNI endpoint (which enrols pods), as the agent binds them.
//!
//! What an app inside a pod can do about its capture (ztunnel's mark) is in
//! `redirect.rs`, in both modes.

use std::{io, os::unix::net::UnixStream, path::Path};

use ambpf_testbed::privileges::{Privileges, drop_thread_privileges};
use socket2::{Domain, SockAddr, Socket, Type};

/// A directory removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Connects to the ZDS socket (SOCK_SEQPACKET) and to the CNI endpoint
/// (SOCK_STREAM) from a thread with only `privileges`.
fn connect_as(privileges: Privileges, zds: &Path, cni: &Path) -> (io::Result<()>, io::Result<()>) {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                drop_thread_privileges(privileges).unwrap();
                let seqpacket = Socket::new(Domain::UNIX, Type::SEQPACKET, None).unwrap();
                let zds = seqpacket.connect(&SockAddr::unix(zds).unwrap());
                let cni = UnixStream::connect(cni).map(drop);
                (zds, cni)
            })
            .join()
            .unwrap()
    })
}

#[tokio::test]
async fn only_root_connects_to_the_zds_socket_and_the_cni_endpoint() {
    let dir = TempDir(std::env::temp_dir().join(format!(
        "ambpf-privilege-{}",
        ambpf_testbed::unique_name("")
    )));
    let (zds, cni) = (dir.0.join("ztunnel.sock"), dir.0.join("pluginevent.sock"));
    let _zds = ambpf::zds::listener::bind(&zds).unwrap();
    let _cni = ambpf::cni::server::bind(&cni).unwrap();
    // The directories on the way are open to everyone: the socket files'
    // own permissions are what keeps others out.
    let mode = std::os::unix::fs::MetadataExt::mode(&std::fs::metadata(&dir.0).unwrap());
    assert_eq!(mode & 0o001, 0o001, "{mode:o}");
    let (zds_root, cni_root) = connect_as(Privileges::Only(&[]), &zds, &cni);
    zds_root.unwrap();
    cni_root.unwrap();
    let (zds_user, cni_user) = connect_as(Privileges::Nobody, &zds, &cni);
    for (what, result) in [("ZDS", zds_user), ("CNI", cni_user)] {
        let e = result.expect_err(what);
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{what}: {e}");
    }
}
