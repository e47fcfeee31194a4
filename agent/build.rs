//! Builds the kernel programs in `ebpf/` and leaves the BPF ELF in `OUT_DIR`,
//! where `src/bpf/object.rs` embeds it. The build steps live in
//! `xtask/src/ebpf_build.rs`, shared with `cargo xtask build-ebpf`.
//!
//! Without the nightly toolchain (plain `cargo check`/`clippy` on a machine that
//! never ran the set-up), the build embeds an empty object and says so; the
//! agent then refuses to load with an error that names the missing toolchain.

#[path = "../xtask/src/ebpf_build.rs"]
mod ebpf_build;

use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, Result};

/// `AMBPF_GIT_COMMIT` for `ambpf version`: the commit checked out, rebuilt
/// when HEAD or the branch it names moves; "unknown" outside a git checkout.
fn git_commit(root: &std::path::Path) {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=AMBPF_GIT_COMMIT={commit}");
    if let Some(dirs) = git(&["rev-parse", "--git-dir", "--git-common-dir"]) {
        let mut dirs = dirs.lines().map(|d| root.join(d));
        if let (Some(git_dir), Some(common)) = (dirs.next(), dirs.next()) {
            let branch = git(&["symbolic-ref", "-q", "HEAD"]).map(|b| common.join(b));
            // Only files that exist: cargo reruns on every build for one that does not.
            [
                Some(git_dir.join("HEAD")),
                branch,
                Some(common.join("packed-refs")),
            ]
            .into_iter()
            .flatten()
            .filter(|path| path.exists())
            .for_each(|path| println!("cargo:rerun-if-changed={}", path.display()));
        }
    }
}

fn main() -> Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.parent().context("agent/ has no parent")?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let object = out_dir.join("ambpf.bpf.o");

    for path in [
        "ebpf/src",
        "ebpf/Cargo.toml",
        "ebpf/Cargo.lock",
        "common/src",
        "xtask/src/ebpf_build.rs",
        "xtask/src/btf_names.rs",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }
    println!("cargo:rerun-if-env-changed=AMBPF_BPF_TOOLCHAIN");
    git_commit(root);
    println!("cargo:rustc-check-cfg=cfg(ambpf_ebpf_missing)");

    let toolchain = ebpf_build::toolchain_name();
    match ebpf_build::Toolchain::find(&toolchain) {
        Ok(found) => found
            .build_object(&root.join("ebpf"), &out_dir, &object)
            .context("building the eBPF object")?,
        Err(why) => {
            println!(
                "cargo:warning=eBPF programs not built ({why:#}); the agent will refuse to load. \
                 Run `rustup toolchain install {toolchain} && rustup component add rust-src \
                 llvm-tools --toolchain {toolchain}`."
            );
            println!("cargo:rustc-cfg=ambpf_ebpf_missing");
            fs::write(&object, [])?;
        }
    }
    Ok(())
}
