//! Single-layer OCI images written here, for nodes that reach no registry:
//! an OCI image layout in a tar archive, which `ctr images import` takes
//! as it is.

use std::{
    fs, io,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::json;

/// One image: the files of its one layer and how it runs.
#[derive(Debug)]
pub struct ImageSpec<'a> {
    /// `repository:tag`, the name containerd stores it under.
    pub reference: &'a str,
    /// `(file on this machine, absolute path in the image)`.
    pub files: &'a [(PathBuf, String)],
    /// Symbolic links to add: `(path in the image, target)`.
    pub links: &'a [(String, String)],
    pub entrypoint: &'a [&'a str],
    pub env: &'a [&'a str],
}

/// Writes the image's OCI archive as `<work>/image.tar` and returns it.
pub fn build(work: &Path, spec: &ImageSpec<'_>) -> io::Result<PathBuf> {
    let layout = work.join("oci");
    let _ = fs::remove_dir_all(&layout);
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs)?;
    let rootfs = work.join("rootfs");
    let _ = fs::remove_dir_all(&rootfs);
    fs::create_dir_all(&rootfs)?;
    for (from, to) in spec.files {
        let dest = rootfs.join(to.trim_start_matches('/'));
        fs::create_dir_all(dest.parent().unwrap_or(&rootfs))?;
        fs::copy(from, &dest).map_err(|e| io::Error::other(format!("{}: {e}", from.display())))?;
    }
    for (path, target) in spec.links {
        let dest = rootfs.join(path.trim_start_matches('/'));
        fs::create_dir_all(dest.parent().unwrap_or(&rootfs))?;
        std::os::unix::fs::symlink(target, dest)?;
    }
    let layer = work.join("layer.tar");
    run(Command::new("tar")
        .args([
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--sort=name",
            "-cf",
        ])
        .arg(&layer)
        .arg("-C")
        .arg(&rootfs)
        .arg("."))?;
    let layer = fs::read(&layer)?;
    let layer_digest = add_blob(&blobs, &layer)?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": spec.entrypoint, "Env": spec.env },
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
            "annotations": { "io.containerd.image.name": spec.reference },
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

/// A dynamically linked program and the shared libraries `ldd` names, at
/// the same paths, so that it runs in an image without a distribution.
pub fn program_with_libraries(
    program: &Path,
    in_image: &str,
) -> io::Result<Vec<(PathBuf, String)>> {
    let mut files = vec![(program.to_owned(), in_image.to_owned())];
    let out = Command::new("ldd").arg(program).output()?;
    // A static program: "not a dynamic executable", exit 1.
    if out.status.success() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(path) = path.filter(|p| p.starts_with('/')) {
                let real = fs::canonicalize(path)?;
                files.push((real, path.to_owned()));
            }
        }
    }
    Ok(files)
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
