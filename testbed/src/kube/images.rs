//! The images the node runs, imported into its containerd (no registry is
//! reachable): a pause image and the test app from Debian's static busybox,
//! the ztunnel double from this workspace's build, Istio's CNI node agent
//! ([`istio`]), and ambpf's own image from `cargo xtask image`.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};

use super::{Layout, ctr, istio};
use crate::oci;

/// The sandbox image (`sandbox_image` in containerd's configuration).
pub const PAUSE: &str = "localhost/ambpf/pause:3.10";
/// The test apps: busybox's `nc`, `httpd` and `wget`, and
/// [`CONN_GENERATOR`].
pub const APP: &str = "localhost/ambpf/app:1";
/// The testbed's `conn-generator` in the app image.
pub const CONN_GENERATOR: &str = "/usr/local/bin/conn-generator";
/// The ztunnel double (`ztunnel-double`).
pub const ZTUNNEL: &str = "localhost/ambpf/ztunnel-double:1";

const BUSYBOX: &str = "/usr/bin/busybox";
/// busybox applets the app image links, for tests' `kubectl exec`.
const APPLETS: [&str; 15] = [
    "sh", "nc", "httpd", "wget", "sleep", "cat", "echo", "ls", "ps", "kill", "ip", "date", "seq",
    "timeout", "nslookup",
];

/// Builds the node's own images under `<state>/images` and imports them, and
/// `ambpf` (an OCI archive from `cargo xtask image`) as `ambpf_reference`.
pub fn import_all(
    layout: &Layout,
    ambpf: Option<(&Path, &str)>,
    ztunnel_binaries: &Path,
    istio_bin: &Path,
) -> Result<()> {
    let work = layout.state.join("images");
    let busybox = PathBuf::from(BUSYBOX);
    if !busybox.is_file() {
        bail!("{BUSYBOX} not found: install Debian's busybox-static");
    }
    let pause = oci::build(
        &work.join("pause"),
        &oci::ImageSpec {
            reference: PAUSE,
            files: &[(busybox.clone(), "/bin/busybox".into())],
            links: &[],
            // It only has to outlive the pod.
            entrypoint: &["/bin/busybox", "sleep", "2147483647"],
            env: &["PATH=/bin"],
        },
    )?;
    import(layout, &pause, None)?;
    let links: Vec<(String, String)> = APPLETS
        .iter()
        .map(|a| (format!("/bin/{a}"), "busybox".to_owned()))
        .collect();
    let generator = ztunnel_binaries.join("conn-generator");
    let mut app_files = oci::program_with_libraries(&generator, CONN_GENERATOR)
        .with_context(|| format!("{}: build it first", generator.display()))?;
    app_files.push((busybox, "/bin/busybox".into()));
    let app = oci::build(
        &work.join("app"),
        &oci::ImageSpec {
            reference: APP,
            files: &app_files,
            links: &links,
            entrypoint: &["/bin/sh"],
            env: &["PATH=/bin"],
        },
    )?;
    import(layout, &app, None)?;
    let mut files = Vec::new();
    for program in ["ztunnel-double", "ztunnel-proxies"] {
        let path = ztunnel_binaries.join(program);
        files.extend(
            oci::program_with_libraries(&path, &format!("/usr/local/bin/{program}"))
                .with_context(|| format!("{}: build it first", path.display()))?,
        );
    }
    files.sort();
    files.dedup();
    let ztunnel = oci::build(
        &work.join("ztunnel"),
        &oci::ImageSpec {
            reference: ZTUNNEL,
            files: &files,
            links: &[],
            entrypoint: &["/usr/local/bin/ztunnel-double"],
            env: &["PATH=/usr/local/bin"],
        },
    )?;
    import(layout, &ztunnel, None)?;
    let istio = oci::build(
        &work.join("istio-cni"),
        &oci::ImageSpec {
            reference: istio::ISTIO_CNI_IMAGE,
            files: &istio::istio_cni_image_files(istio_bin)?,
            links: &[],
            entrypoint: istio::ISTIO_CNI_ENTRYPOINT,
            env: istio::ISTIO_CNI_ENV,
        },
    )?;
    import(layout, &istio, None)?;
    if let Some((archive, reference)) = ambpf {
        import(layout, archive, Some(reference))?;
    }
    Ok(())
}

/// `ctr images import`, then a check that `reference` is what it stored
/// (`cargo xtask image` names the image in full in the archive's index).
pub(super) fn import(layout: &Layout, archive: &Path, reference: Option<&str>) -> Result<()> {
    // The node's mount namespace has its own working directory.
    let archive = archive
        .canonicalize()
        .with_context(|| format!("{}", archive.display()))?;
    let mut cmd = ctr(layout);
    cmd.args(["images", "import"]).arg(&archive);
    super::run_checked(&mut cmd).with_context(|| format!("importing {}", archive.display()))?;
    if let Some(reference) = reference {
        let stored = list(layout)?;
        if !stored.iter().any(|r| r == reference) {
            bail!(
                "{} holds no image named {reference}; the node has {}",
                archive.display(),
                stored.join(", ")
            );
        }
    }
    Ok(())
}

/// The references in the node's image store.
pub fn list(layout: &Layout) -> Result<Vec<String>> {
    let out = ctr(layout).args(["images", "list", "-q"]).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect())
}
