//! The one image the node runs, built here from Debian's `busybox-static`:
//! no registry is reachable, and a statically linked busybox is enough for
//! both the sandbox (pause) container and the test apps.
//!
//! It is written by [`crate::oci`] (one layer holding `/bin/busybox`).

use std::{
    io,
    path::{Path, PathBuf},
};

/// Where Debian's `busybox-static` puts the binary.
pub const BUSYBOX: &str = "/usr/bin/busybox";
/// The image's reference in the node's image store.
pub const IMAGE: &str = "localhost/ambpf/busybox:node";
/// The sandbox image's process: it only has to outlive the pod.
const PAUSE_COMMAND: [&str; 3] = ["/bin/busybox", "sleep", "2147483647"];

/// Writes the image's OCI archive under `work` and returns its path.
pub fn build(work: &Path) -> io::Result<PathBuf> {
    if !Path::new(BUSYBOX).is_file() {
        return Err(io::Error::other(format!(
            "{BUSYBOX} not found: install Debian's busybox-static"
        )));
    }
    crate::oci::build(
        work,
        &crate::oci::ImageSpec {
            reference: IMAGE,
            files: &[(PathBuf::from(BUSYBOX), "/bin/busybox".to_owned())],
            links: &[],
            entrypoint: &PAUSE_COMMAND,
            env: &["PATH=/bin"],
        },
    )
}

pub(crate) use crate::oci::run;
