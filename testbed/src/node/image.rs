//! The one image the node runs, built here from Debian's `busybox-static`:
//! no registry is reachable, and a statically linked busybox is enough for
//! both the sandbox (pause) container and the test apps.
//!
//! It is written as an OCI image layout in a tar archive (one layer holding
//! `/bin/busybox`), which `ctr images import` takes as it is.

use std::{
    fs, io,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::json;

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
    let layout = work.join("oci");
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs)?;
    let rootfs = work.join("rootfs");
    fs::create_dir_all(rootfs.join("bin"))?;
    fs::copy(BUSYBOX, rootfs.join("bin/busybox"))?;
    let layer = work.join("layer.tar");
    run(Command::new("tar")
        .args(["--owner=0", "--group=0", "--numeric-owner", "-cf"])
        .arg(&layer)
        .arg("-C")
        .arg(&rootfs)
        .arg("bin"))?;
    let layer = fs::read(&layer)?;
    let layer_digest = add_blob(&blobs, &layer)?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": PAUSE_COMMAND, "Env": ["PATH=/bin"] },
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
    })
    .to_string();
    let config_digest = add_blob(&blobs, config.as_bytes())?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }],
    })
    .to_string();
    let manifest_digest = add_blob(&blobs, manifest.as_bytes())?;
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "annotations": { "io.containerd.image.name": IMAGE },
        }],
    });
    fs::write(layout.join("index.json"), index.to_string())?;
    fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    let archive = work.join("image.tar");
    run(Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(&layout)
        .args(["oci-layout", "index.json", "blobs"]))?;
    Ok(archive)
}

/// Stores `content` as a blob named by its digest, which it returns.
fn add_blob(blobs: &Path, content: &[u8]) -> io::Result<String> {
    let tmp = blobs.join("incoming");
    fs::write(&tmp, content)?;
    let out = Command::new("sha256sum").arg(&tmp).output()?;
    if !out.status.success() {
        return Err(io::Error::other("sha256sum failed"));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = text
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    fs::rename(&tmp, blobs.join(&hex))?;
    Ok(format!("sha256:{hex}"))
}

pub(crate) fn run(command: &mut Command) -> io::Result<()> {
    let out = command.output()?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{:?}: {}",
        command,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}
