//! The OCI image: `ambpf` and `ambpf-cni` on a Debian root filesystem that
//! holds only what the iptables mode runs (iptables and ip6tables with their
//! nft and legacy variants, and `nft`, with which it marks a host
//! `nat` table it creates and later removes it) and the libraries these
//! need: no shell, no package manager, the agent itself is the entrypoint.
//!
//! Built without a container registry, from Debian's own tools and packages:
//! `mmdebstrap --variant=extract` unpacks the packages and their library
//! dependencies (no maintainer scripts, so no shell is needed in the image),
//! `umoci` turns the tree into a one-layer OCI image layout, and `skopeo`
//! writes the OCI archive that `podman load` and `skopeo copy` read.
//!
//! Shared by `cargo xtask image` (the release binaries) and
//! `agent/tests/image.rs` (the test build's binaries, same recipe).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

/// The Debian release the root filesystem comes from: the one the binaries
/// are built on, so its glibc is the one they link against.
pub const SUITE: &str = "bookworm";

/// Debian packages in the image (their library dependencies come along).
/// nftables brings `nft` and libnftables; its service unit, example rule
/// sets and configuration are pruned.
pub const PACKAGES: &[&str] = &["iptables", "nftables", "libgcc-s1"];

/// Where the binaries go, and the entrypoint.
pub const BIN_DIR: &str = "usr/local/bin";
pub const ENTRYPOINT: &str = "/usr/local/bin/ambpf";

/// What Debian's `update-alternatives` would link, which extraction skips:
/// the unsuffixed names point at the nft variants, as on a default Debian
/// 12 host. The agent itself calls the suffixed binaries of the backend it
/// detects.
const ALTERNATIVES: &[(&str, &str)] = &[
    ("iptables", "xtables-nft-multi"),
    ("iptables-restore", "xtables-nft-multi"),
    ("iptables-save", "xtables-nft-multi"),
    ("ip6tables", "xtables-nft-multi"),
    ("ip6tables-restore", "xtables-nft-multi"),
    ("ip6tables-save", "xtables-nft-multi"),
];

/// Parts of the extracted packages nothing in the image reads.
const PRUNED: &[&str] = &[
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/lintian",
    "usr/share/bash-completion",
    "usr/share/locale",
    "usr/bin/iptables-xml",
    "lib/systemd",
    "usr/lib/systemd",
    "etc/nftables.conf",
    "var/cache",
    "var/log",
    "var/lib/apt",
];

/// One image to build.
#[derive(Debug)]
pub struct ImageSpec<'a> {
    /// The binaries to put in `/usr/local/bin` (debug info is stripped from
    /// the copies).
    pub binaries: &'a [PathBuf],
    /// `repository:tag`, as the chart names its image.
    pub reference: String,
    /// Scratch and output directory (the Debian tree is cached here).
    pub work: PathBuf,
    /// `org.opencontainers.image.version`.
    pub version: String,
}

/// What [`build`] made.
#[derive(Debug)]
pub struct Image {
    /// The OCI image layout directory (tag: the reference's tag).
    pub layout: PathBuf,
    /// The OCI archive (`podman load -i`, `skopeo copy oci-archive:...`).
    pub archive: PathBuf,
    pub reference: String,
    /// Bytes of the image's root filesystem, uncompressed.
    pub rootfs_bytes: u64,
    /// Bytes of the archive (the compressed layer, config and manifest).
    pub archive_bytes: u64,
}

pub fn build(spec: &ImageSpec<'_>) -> Result<Image> {
    let (_, tag) = split_reference(&spec.reference)?;
    std::fs::create_dir_all(&spec.work)
        .with_context(|| format!("creating {}", spec.work.display()))?;
    let base = debian_tree(&spec.work)?;

    let name = file_safe(&spec.reference);
    let rootfs = spec.work.join(format!("{name}.rootfs"));
    remove_if_present(&rootfs)?;
    run(Command::new("cp").arg("-a").arg(&base).arg(&rootfs))?;
    let bin_dir = rootfs.join(BIN_DIR);
    std::fs::create_dir_all(&bin_dir)?;
    for binary in spec.binaries {
        let file = binary
            .file_name()
            .with_context(|| format!("{} has no file name", binary.display()))?;
        // Debug info stays with the build (a stripped copy is what ships).
        run(Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(bin_dir.join(file))
            .arg(binary))?;
    }
    for (link, target) in ALTERNATIVES {
        let path = rootfs.join("usr/sbin").join(link);
        if !path.exists() {
            std::os::unix::fs::symlink(target, &path)
                .with_context(|| format!("linking {}", path.display()))?;
        }
    }
    // Mount points the chart's volumes use, and a writable /run and /tmp.
    for dir in ["run/netns", "run/ztunnel", "run/ambpf", "sys/fs/bpf", "tmp"] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    // /var/run is /run, as on the node: the runtime names pods' namespaces
    // /var/run/netns/... in CNI calls, and the chart mounts /run/netns.
    let var_run = rootfs.join("var/run");
    if var_run.symlink_metadata().is_ok_and(|m| m.is_dir()) {
        std::fs::remove_dir_all(&var_run)?;
    }
    if var_run.symlink_metadata().is_err() {
        std::fs::create_dir_all(rootfs.join("var"))?;
        std::os::unix::fs::symlink("../run", &var_run)?;
    }
    let rootfs_bytes = tree_bytes(&rootfs)?;

    let layout = spec.work.join(format!("{name}.oci"));
    remove_if_present(&layout)?;
    let image = format!("{}:{tag}", layout.display());
    run(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image", &image]))?;
    run(Command::new("umoci")
        .args(["insert", "--image", &image])
        .arg(&rootfs)
        .arg("/"))?;
    run(Command::new("umoci").args([
        "config",
        "--image",
        &image,
        "--config.entrypoint",
        ENTRYPOINT,
        "--config.env",
        "PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--config.workingdir",
        "/",
        "--config.label",
        &format!("org.opencontainers.image.version={}", spec.version),
        "--config.label",
        "org.opencontainers.image.title=ambpf",
        "--config.label",
        "org.opencontainers.image.description=eBPF traffic redirection for Istio ambient mode",
    ]))?;
    run(Command::new("umoci").args(["gc", "--layout"]).arg(&layout))?;
    std::fs::remove_dir_all(&rootfs)?;

    let archive = spec.work.join(format!("{name}.oci.tar"));
    remove_if_present(&archive)?;
    run(Command::new("skopeo").args([
        "copy",
        "--quiet",
        &format!("oci:{image}"),
        &format!("oci-archive:{}:{}", archive.display(), spec.reference),
    ]))?;
    let archive_bytes = std::fs::metadata(&archive)?.len();
    Ok(Image {
        layout,
        archive,
        reference: spec.reference.clone(),
        rootfs_bytes,
        archive_bytes,
    })
}

/// The extracted Debian packages, pruned, cached under `work` by suite and
/// package list (`rm -r` it to refresh).
fn debian_tree(work: &Path) -> Result<PathBuf> {
    let tree = work.join(format!("debian-{SUITE}-{}", PACKAGES.join("-")));
    let complete = tree.with_extension("complete");
    if complete.exists() && tree.is_dir() {
        return Ok(tree);
    }
    for tool in ["mmdebstrap", "umoci", "skopeo", "strip"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!(
                "{tool} is not installed; the image needs mmdebstrap, umoci, skopeo and binutils \
                 (`apt-get install mmdebstrap umoci skopeo binutils`)"
            );
        }
    }
    let partial = work.join(format!("debian-{SUITE}.partial"));
    remove_if_present(&partial)?;
    remove_if_present(&tree)?;
    remove_if_present(&complete)?;
    run(Command::new("mmdebstrap")
        .args(["--quiet", "--variant=extract", "--format=directory"])
        .arg(format!("--include={}", PACKAGES.join(",")))
        .arg(SUITE)
        .arg(&partial))?;
    for pruned in PRUNED {
        remove_if_present(&partial.join(pruned))?;
    }
    for binary in ["usr/sbin/nft"] {
        if !partial.join(binary).exists() {
            bail!("{}: mmdebstrap left no {binary}", partial.display());
        }
    }
    std::fs::rename(&partial, &tree)?;
    // Written last: a tree without it was not extracted completely.
    std::fs::write(&complete, "")?;
    Ok(tree)
}

/// `repository:tag`, split at the tag's colon (a registry may have a port).
pub fn split_reference(reference: &str) -> Result<(&str, &str)> {
    match reference.rsplit_once(':') {
        Some((repository, tag))
            if !repository.is_empty() && !tag.is_empty() && !tag.contains('/') =>
        {
            Ok((repository, tag))
        }
        _ => bail!("image reference {reference:?} is not repository:tag"),
    }
}

/// The chart's default `image.repository` (charts/ambpf/values.yaml).
pub fn chart_repository(values_yaml: &str) -> Result<String> {
    let mut in_image = false;
    for line in values_yaml.lines() {
        if !line.starts_with([' ', '#']) && !line.is_empty() {
            in_image = line.trim_end() == "image:";
            continue;
        }
        if let Some(value) = line.trim().strip_prefix("repository:").filter(|_| in_image) {
            return Ok(value.trim().trim_matches('"').to_owned());
        }
    }
    bail!("values.yaml has no image.repository")
}

fn file_safe(reference: &str) -> String {
    reference
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Removes a file or a directory tree; one that is not there is fine.
pub(crate) fn remove_if_present(path: &Path) -> Result<()> {
    let removed = if path.is_dir() && !path.is_symlink() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match removed {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Bytes of regular files under `dir` (symlinks not followed).
fn tree_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            total += tree_bytes(&entry.path())?;
        } else if kind.is_file() {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_split_at_the_tag() {
        assert_eq!(
            split_reference("ghcr.io/ambpf/ambpf:0.1.0").unwrap(),
            ("ghcr.io/ambpf/ambpf", "0.1.0")
        );
        assert_eq!(
            split_reference("localhost:5000/ambpf:dev").unwrap(),
            ("localhost:5000/ambpf", "dev")
        );
        assert!(split_reference("localhost:5000/ambpf").is_err());
        assert!(split_reference("ambpf").is_err());
    }

    #[test]
    fn the_chart_repository_is_read_from_the_image_block() {
        let values = "name: x\nrepository: wrong\nimage:\n  # where\n  repository: ghcr.io/ambpf/ambpf\n  tag: \"\"\nother:\n  repository: no\n";
        assert_eq!(chart_repository(values).unwrap(), "ghcr.io/ambpf/ambpf");
        assert!(chart_repository("image:\n  tag: x\n").is_err());
    }
}
