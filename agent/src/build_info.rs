//! Which build this is: the crate version, the git commit it was built
//! from, and a digest of the embedded BPF object, so that a team can tell
//! which kernel programs a node runs (`ambpf version`, `ambpf_build_info`).
//!
//! The agent also records its object's digest in the pin root when it loads
//! (see [`record_loaded`]); `ambpf status` compares that record with its own
//! object and warns when the pinned programs came from another build.

use std::{io, path::PathBuf, sync::OnceLock};

use serde::Serialize;

use crate::bpf::{PinLayout, object};

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BuildInfo {
    pub version: &'static str,
    /// `git rev-parse HEAD` at build time, "unknown" outside a checkout.
    pub git_commit: &'static str,
    /// SHA-256 of the embedded BPF object, lowercase hex (empty object: a
    /// build without the eBPF toolchain, which cannot load).
    pub bpf_object_sha256: String,
}

/// This binary's build.
pub fn current() -> &'static BuildInfo {
    static INFO: OnceLock<BuildInfo> = OnceLock::new();
    INFO.get_or_init(|| BuildInfo {
        version: env!("CARGO_PKG_VERSION"),
        git_commit: env!("AMBPF_GIT_COMMIT"),
        bpf_object_sha256: sha256_hex(object::OBJECT),
    })
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref().iter().fold(String::new(), |mut hex, b| {
        let _ = write!(hex, "{b:02x}");
        hex
    })
}

impl std::fmt::Display for BuildInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "ambpf {}", self.version)?;
        writeln!(f, "git commit        {}", self.git_commit)?;
        writeln!(f, "BPF object sha256 {}", self.bpf_object_sha256)
    }
}

/// Where the digest of the object whose programs are pinned is recorded:
/// `<pin root>/object/<sha256>`, an empty directory (bpffs holds no regular
/// files), replaced by every agent that loads.
fn record_dir(pins: &PinLayout) -> PathBuf {
    pins.root().join("object")
}

/// Records this build's object digest as the one whose programs are pinned.
pub fn record_loaded(pins: &PinLayout) -> io::Result<()> {
    let dir = record_dir(pins);
    let own = &current().bpf_object_sha256;
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            for entry in entries {
                let entry = entry?;
                if entry.file_name().to_str() != Some(own.as_str()) {
                    std::fs::remove_dir(entry.path())?;
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    match std::fs::create_dir_all(dir.join(own)) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

/// The digest recorded in the pin root (`None`: nothing recorded, as by an
/// agent that predates the record).
pub fn recorded(pins: &PinLayout) -> io::Result<Option<String>> {
    match std::fs::read_dir(record_dir(pins)) {
        Ok(mut entries) => Ok(entries
            .next()
            .transpose()?
            .and_then(|e| e.file_name().into_string().ok())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A warning when the pinned programs are not this build's, or `None`.
pub fn mismatch_warning(recorded: Option<&str>) -> Option<String> {
    let own = &current().bpf_object_sha256;
    match recorded {
        Some(digest) if digest == own => None,
        Some(digest) => Some(format!(
            "the pinned programs were loaded from BPF object sha256 {digest}, not this ambpf's \
             ({own}, version {}, commit {}): the agent that loaded them is another build",
            current().version,
            current().git_commit
        )),
        None => Some(format!(
            "no BPF object digest is recorded under the pin root: the pinned programs were \
             loaded by an agent older than this ambpf (version {}, BPF object sha256 {own})",
            current().version
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_the_sha256_of_the_object() {
        // sha256("abc"), FIPS 180-2's example.
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(current().bpf_object_sha256, sha256_hex(object::OBJECT));
        assert_eq!(current().version, env!("CARGO_PKG_VERSION"));
        assert!(!current().git_commit.is_empty());
    }

    #[test]
    fn a_pin_root_of_another_build_is_named() {
        let own = current().bpf_object_sha256.clone();
        assert_eq!(mismatch_warning(Some(&own)), None);
        let other = "0".repeat(64);
        let warning = mismatch_warning(Some(&other)).unwrap();
        assert!(
            warning.contains(&other) && warning.contains(&own),
            "{warning}"
        );
        assert!(mismatch_warning(None).unwrap().contains("older"));
    }
}
