//! What `test` and `demo` need from the machine, checked before their long
//! builds so that a missing piece is named in one sentence with how to get
//! it: root, the bpf filesystem and cgroup v2 (`agent/src/mounts.rs`), and
//! for `test` the tools the tests run, from Debian's packages (installed
//! when missing and running as root with apt-get) and helm.

use std::{path::Path, process::Command};

use anyhow::{Result, bail};

// Shared with the agent, which uses all of it; the checks here use a part.
#[allow(dead_code)]
#[path = "../../agent/src/mounts.rs"]
mod mounts;

/// The tools the tests run (a program on PATH, or an absolute path) and the
/// Debian package that has each.
const TEST_TOOLS: &[(&str, &str)] = &[
    // The test namespaces and veths.
    ("ip", "iproute2"),
    // What the agent loads (agent/tests/bpftool.rs).
    ("bpftool", "bpftool"),
    // The iptables mode: both backends, the host probe SNAT's sets, and the
    // nat table it creates on a host that has none; the nftables mode's nft.
    ("iptables", "iptables"),
    ("ipset", "ipset"),
    ("nft", "nftables"),
    // The OCI image: built, then run (agent/tests/image.rs).
    ("mmdebstrap", "mmdebstrap"),
    ("umoci", "umoci"),
    ("skopeo", "skopeo"),
    ("podman", "podman"),
    ("strip", "binutils"),
    // The containerd node (testbed/src/node): the CNI plugins, busybox for
    // its image, and protoc for k8s-cri's build of its CRI client.
    ("containerd", "containerd"),
    ("runc", "runc"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("/usr/bin/busybox", "busybox-static"),
    ("protoc", "protobuf-compiler"),
    // The real node (`cargo xtask cluster`): its certificates, and the
    // off-node client's HTTP requests.
    ("openssl", "openssl"),
    ("wget", "wget"),
    // The adversarial suite's packet prober (testbed/scripts/syn_probe.py).
    ("/usr/lib/python3/dist-packages/scapy", "python3-scapy"),
];

/// The bpf filesystem and a cgroup v2 hierarchy.
pub fn check_kernel() -> Result<()> {
    mounts::check_bpffs_support()?;
    mounts::cgroup2_mount()?;
    Ok(())
}

/// Installs the Debian packages of the missing test tools (as root, with
/// apt-get), or says which to install; then checks for helm.
pub fn ensure_test_tools() -> Result<()> {
    let missing: Vec<&str> = TEST_TOOLS
        .iter()
        .filter(|(tool, _)| !found(tool))
        .map(|(_, package)| *package)
        .collect();
    if !missing.is_empty() {
        let packages = missing.join(" ");
        if euid() != 0 || !found("apt-get") {
            bail!("the tests need Debian's packages {packages}: apt-get install {packages}");
        }
        println!("xtask: installing the tests' Debian packages: {packages}");
        let apt = |args: &[&str]| -> Result<()> {
            let status = Command::new("apt-get")
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()?;
            if !status.success() {
                bail!(
                    "apt-get {} failed ({status}): install {packages} by hand",
                    args[0]
                );
            }
            Ok(())
        };
        apt(&["update", "-qq"])?;
        let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
        install.extend(&missing);
        apt(&install)?;
    }
    if std::env::var_os("HELM").is_none() && !found("helm") {
        if euid() != 0 {
            bail!(
                "the chart's tests need helm: install it with `bash .ci/install-helm` (as root), \
                 or put any helm 3 or 4 on PATH or set HELM=/path/to/helm"
            );
        }
        // The pinned helm, as CI installs it (its own downloads are out of
        // reach: see the script).
        println!("xtask: installing helm for the chart's tests (.ci/install-helm)");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/install-helm");
        let status = Command::new("bash").arg(&script).status()?;
        if !status.success() {
            bail!("{} failed ({status})", script.display());
        }
    }
    Ok(())
}

/// Whether `tool` exists: an absolute path, or a program on PATH (where the
/// tests look for it).
fn found(tool: &str) -> bool {
    if tool.starts_with('/') {
        return Path::new(tool).exists();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| dir.join(tool).is_file())
}

pub fn euid() -> u32 {
    // /proc/self/status "Uid: real effective saved fs": avoids a libc dependency.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}
