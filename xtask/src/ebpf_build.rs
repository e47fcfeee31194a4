//! Building the ambpf kernel programs (`ebpf/`) into one BPF ELF object.
//!
//! Shared, through `#[path]`, by `agent/build.rs` (which embeds the object in
//! the agent) and `cargo xtask build-ebpf` (which leaves it on disk for
//! inspection), so both produce the same object the same way.
//!
//! bpf-linker is not required: the eBPF crate is a `staticlib` built with the
//! nightly toolchain for `bpfel-unknown-none` (`-Z build-std=core`, fat LTO),
//! so its archive holds one LLVM bitcode module; the nightly's own `llc`
//! (from the `llvm-tools` component) compiles that module to a BPF object,
//! whose BTF names are then made kernel-acceptable (see `btf_names.rs`).

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

#[path = "btf_names.rs"]
mod btf_names;

/// The nightly that builds the kernel programs, pinned by date so every
/// machine builds the same object: rustc 1.97.0-nightly (e50aa6fba
/// 2026-05-19), LLVM 22.1.
pub const PINNED_NIGHTLY: &str = "nightly-2026-05-20";

/// The toolchain that builds the kernel programs, unless `AMBPF_BPF_TOOLCHAIN`
/// names another.
pub fn toolchain_name() -> String {
    env::var("AMBPF_BPF_TOOLCHAIN").unwrap_or_else(|_| PINNED_NIGHTLY.to_owned())
}

pub struct Toolchain {
    name: String,
    /// `lib/rustlib/<host>/bin` of the toolchain: llc, llvm-ar, llvm-link.
    llvm_bin: PathBuf,
}

impl Toolchain {
    pub fn find(name: &str) -> Result<Self> {
        let sysroot = rustup(name, "rustc").args(["--print", "sysroot"]).output();
        let sysroot = match sysroot {
            Ok(out) if out.status.success() => PathBuf::from(String::from_utf8(out.stdout)?.trim()),
            Ok(out) => bail!(
                "toolchain `{name}` unavailable: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => bail!("cannot run rustup: {e}"),
        };
        let host = host_triple(&sysroot)?;
        let llvm_bin = sysroot.join("lib/rustlib").join(host).join("bin");
        if !llvm_bin.join("llc").exists() {
            bail!("`llvm-tools` component missing from toolchain `{name}`");
        }
        if !sysroot.join("lib/rustlib/src/rust/library/core").exists() {
            bail!("`rust-src` component missing from toolchain `{name}`");
        }
        Ok(Self {
            name: name.to_owned(),
            llvm_bin,
        })
    }

    /// Builds `ebpf_dir` and writes the BPF ELF to `object`, using `work_dir`
    /// for intermediate files.
    pub fn build_object(&self, ebpf_dir: &Path, work_dir: &Path, object: &Path) -> Result<()> {
        let target_dir = ebpf_dir.join("target");
        let mut cargo = rustup(&self.name, "cargo");
        cargo
            .current_dir(ebpf_dir)
            .args(["build", "--release", "-Z", "build-std=core"])
            .args(["--target", "bpfel-unknown-none"])
            .arg("--target-dir")
            .arg(&target_dir);
        run(&mut cargo)?;

        let archive = target_dir.join("bpfel-unknown-none/release/libambpf_ebpf.a");
        let members = work_dir.join("bitcode");
        let _ = fs::remove_dir_all(&members);
        fs::create_dir_all(&members)?;
        run(Command::new(self.llvm_bin.join("llvm-ar"))
            .current_dir(&members)
            .arg("x")
            .arg(&archive))?;
        let mut modules: Vec<PathBuf> = fs::read_dir(&members)?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        modules.sort();
        let module = match modules.as_slice() {
            [] => bail!("{} holds no bitcode", archive.display()),
            [one] => one.clone(),
            // Fat LTO normally leaves one module; link any stragglers into it.
            many => {
                let linked = work_dir.join("ambpf.linked.bc");
                run(Command::new(self.llvm_bin.join("llvm-link"))
                    .args(many)
                    .arg("-o")
                    .arg(&linked))?;
                linked
            }
        };
        // Inline everything, as bpf-linker does: the BPF backend cannot emit a
        // memcpy whose length only a caller knows (aya-log's record writers
        // are closures that rustc's LTO leaves out of line).
        let inlined = work_dir.join("ambpf.inlined.bc");
        run(Command::new(self.llvm_bin.join("opt"))
            .args(["-passes=default<O3>", "-inline-threshold=100000"])
            .arg(&module)
            .arg("-o")
            .arg(&inlined))?;
        run(Command::new(self.llvm_bin.join("llc"))
            .args(["-march=bpfel", "-mcpu=v3", "-filetype=obj", "-O2"])
            .arg(&inlined)
            .arg("-o")
            .arg(object))?;
        let mut elf = fs::read(object)?;
        btf_names::sanitize_object(&mut elf)
            .with_context(|| format!("fixing the BTF names of {}", object.display()))?;
        fs::write(object, elf)?;
        Ok(())
    }
}
/// The host triple, from the build script's environment or the toolchain's
/// own library directory.
fn host_triple(sysroot: &Path) -> Result<String> {
    if let Ok(host) = env::var("HOST") {
        return Ok(host);
    }
    for entry in fs::read_dir(sysroot.join("lib/rustlib"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.contains("-linux-") && sysroot.join("lib/rustlib").join(&name).join("bin").exists()
        {
            return Ok(name);
        }
    }
    bail!("cannot tell the host triple of {}", sysroot.display())
}

/// A command of `toolchain`, with the outer (stable) build's settings removed
/// so that they do not leak into the nested nightly build.
fn rustup(toolchain: &str, tool: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, tool]);
    for var in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTDOC",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTUP_TOOLCHAIN",
        "CARGO",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
