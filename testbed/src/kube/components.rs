//! The node's components, built from their published Go modules and cached
//! outside the work tree, one directory per component and version:
//! `<cache>/cluster/<component>-<version>/bin/`.
//!
//! - Kubernetes: `k8s.io/kubernetes` cannot be built as a dependency on its
//!   own, because its `go.mod` points each staging module (`k8s.io/api`,
//!   `k8s.io/client-go`, ...) at `./staging/...`. A wrapper module requires
//!   it and replaces every staging module with its published `v0.<minor>.<patch>`,
//!   read from the release's own `go.mod`.
//! - Istio's CNI node agent and plugin ([`super::istio`]), the baseline.
//! - etcd: `go.etcd.io/etcd/server/v3`, whose root is the `etcd` command,
//!   through the same kind of wrapper (its `go.mod` replaces its siblings
//!   with local paths too).
//! - CoreDNS: `github.com/coredns/coredns`, the cluster's DNS
//!   ([`super::coredns`]), through the same kind of wrapper, with the
//!   plugins of its release's `plugin.cfg`.
//!
//! containerd and runc are Debian's (`containerd` 1.6, `runc`): kubelet
//! 1.37 still talks to containerd 1.6 (it warns that the CRI lacks
//! `RuntimeConfig` and reads the cgroup driver from its own configuration,
//! which the node sets from the host).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

/// The Kubernetes release: the newest the proxy serves whose kubelet still
/// starts on a cgroup v1 (hybrid) host with `failCgroupV1: false` and talks
/// to containerd 1.6. 1.38 drops both.
pub const KUBERNETES: &str = "v1.37.2";
/// The etcd release Kubernetes 1.37 is tested with (kubeadm's 3.7.0),
/// at its newest patch.
pub const ETCD: &str = "v3.7.3";
/// The CoreDNS release (kubeadm 1.37 deploys the 1.1x line).
pub const COREDNS: &str = "v1.15.0";

/// The Kubernetes commands the node runs, and kubectl.
pub const KUBERNETES_COMMANDS: [&str; 6] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
    "kubectl",
];

/// Where the built components live.
#[derive(Clone, Debug)]
pub struct Components {
    cache: PathBuf,
}

impl Components {
    /// `$AMBPF_CACHE`, else `$XDG_CACHE_HOME/ambpf`, else `~/.cache/ambpf`.
    pub fn from_env() -> Self {
        let cache = std::env::var_os("AMBPF_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("ambpf")))
            .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/ambpf")))
            .unwrap_or_else(|| PathBuf::from("/var/cache/ambpf"));
        Self {
            cache: cache.join("cluster"),
        }
    }

    pub fn kubernetes_dir(&self) -> PathBuf {
        self.cache.join(format!("kubernetes-{KUBERNETES}"))
    }

    pub fn etcd_dir(&self) -> PathBuf {
        self.cache.join(format!("etcd-{ETCD}"))
    }

    pub fn coredns_dir(&self) -> PathBuf {
        self.cache.join(format!("coredns-{COREDNS}"))
    }

    pub fn coredns(&self) -> PathBuf {
        self.coredns_dir().join("bin/coredns")
    }

    /// One Kubernetes command (`kubelet`, `kubectl`, ...).
    pub fn kube(&self, command: &str) -> PathBuf {
        self.kubernetes_dir().join("bin").join(command)
    }

    /// `<cache>/cluster`, where every component has its directory.
    pub fn cache(&self) -> &Path {
        &self.cache
    }

    pub fn etcd(&self) -> PathBuf {
        self.etcd_dir().join("bin/etcd")
    }

    /// What is missing, by the path that should be there.
    pub fn missing(&self) -> Vec<PathBuf> {
        KUBERNETES_COMMANDS
            .iter()
            .map(|c| self.kube(c))
            .chain([self.etcd(), self.coredns()])
            .chain(
                super::istio::ISTIO_CNI_BINARIES
                    .map(|b| super::istio::istio_dir(&self.cache).join("bin").join(b)),
            )
            .filter(|p| !p.is_file())
            .collect()
    }

    /// Builds what is not cached yet; prints what it did and how long it took.
    pub fn build(&self) -> Result<()> {
        let go = find_go()?;
        if KUBERNETES_COMMANDS.iter().all(|c| self.kube(c).is_file()) {
            println!(
                "kubernetes {KUBERNETES}: cached in {}",
                self.kubernetes_dir().display()
            );
        } else {
            let started = Instant::now();
            build_kubernetes(&go, &self.kubernetes_dir())?;
            println!(
                "kubernetes {KUBERNETES}: built in {:.0} s into {}",
                started.elapsed().as_secs_f64(),
                self.kubernetes_dir().display()
            );
        }
        super::istio::build_istio_cni(&self.cache)?;
        // Each module's root package is its command.
        for (name, version, binary, module) in [
            ("etcd", ETCD, self.etcd(), "go.etcd.io/etcd/server/v3"),
            (
                "coredns",
                COREDNS,
                self.coredns(),
                "github.com/coredns/coredns",
            ),
        ] {
            if binary.is_file() {
                println!("{name} {version}: cached in {}", binary.display());
            } else {
                let started = Instant::now();
                build_wrapped(&go, name, module, version, &binary)?;
                println!(
                    "{name} {version}: built in {:.0} s into {}",
                    started.elapsed().as_secs_f64(),
                    binary.display()
                );
            }
        }
        Ok(())
    }
}

pub(super) fn find_go() -> Result<PathBuf> {
    if let Some(go) = std::env::var_os("GO") {
        return Ok(go.into());
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .chain([PathBuf::from("/usr/local/go/bin")])
    {
        if dir.join("go").is_file() {
            return Ok(dir.join("go"));
        }
    }
    bail!(
        "the cluster's components (Kubernetes, etcd, Istio's CNI agent) are built with Go (1.26 or newer): put `go` on PATH or set GO"
    )
}

fn build_kubernetes(go: &Path, dir: &Path) -> Result<()> {
    let src = dir.join("src");
    fs::create_dir_all(&src)?;
    // The release's own go.mod names its staging modules.
    let module = format!("k8s.io/kubernetes@{KUBERNETES}");
    let out = go_command(go, &src)
        .args(["mod", "download", "-json", &module])
        .current_dir(std::env::temp_dir())
        .output()
        .context("go mod download")?;
    if !out.status.success() {
        bail!(
            "go mod download {module}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let info: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let release_mod = info["GoMod"]
        .as_str()
        .context("go mod download printed no GoMod")?;
    let staging = staging_modules(&fs::read_to_string(release_mod)?);
    if staging.is_empty() {
        bail!("{release_mod} names no staging module: is {KUBERNETES} a Kubernetes release?");
    }
    let published = format!("v0.{}", KUBERNETES.trim_start_matches("v1."));
    let mut go_mod = format!(
        "module ambpf.local/kubernetes-build\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes {KUBERNETES}\n\n"
    );
    for m in &staging {
        go_mod.push_str(&format!("replace {m} => {m} {published}\n"));
    }
    fs::write(src.join("go.mod"), go_mod)?;
    let minor = KUBERNETES.split('.').nth(1).unwrap_or_default();
    // What `hack/lib/version.sh` stamps: servers report it, and kubelet
    // registers the node with it.
    let ldflags = format!(
        "-s -w -X k8s.io/component-base/version.gitVersion={KUBERNETES} \
         -X k8s.io/component-base/version.gitMajor=1 \
         -X k8s.io/component-base/version.gitMinor={minor} \
         -X k8s.io/component-base/version.gitTreeState=clean \
         -X k8s.io/client-go/pkg/version.gitVersion={KUBERNETES}"
    );
    let mut build = go_command(go, &src);
    build
        .args(["build", "-trimpath", "-ldflags", &ldflags, "-o"])
        .arg(dir.join("bin").join(""))
        .args(KUBERNETES_COMMANDS.map(|c| format!("k8s.io/kubernetes/cmd/{c}")));
    run(&mut build)
}

/// Builds the command at the root of `module@version` into `binary`, through a wrapper
/// module beside `binary`'s directory: `go build` of a dependency ignores
/// the `replace` directives of its own `go.mod` (etcd's point at sibling
/// paths), and a wrapper pins the release.
fn build_wrapped(go: &Path, name: &str, module: &str, version: &str, binary: &Path) -> Result<()> {
    let dir = binary
        .parent()
        .and_then(Path::parent)
        .context("a component's binary lives in <dir>/bin")?;
    let src = dir.join("src");
    fs::create_dir_all(&src)?;
    fs::write(
        src.join("go.mod"),
        format!("module ambpf.local/{name}-build\n\ngo 1.26.0\n\nrequire {module} {version}\n"),
    )?;
    let mut build = go_command(go, &src);
    build
        .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
        .arg(binary)
        .arg(module);
    run(&mut build)
}

/// The modules a Kubernetes release's `go.mod` replaces with `./staging/...`.
fn staging_modules(go_mod: &str) -> Vec<String> {
    go_mod
        .lines()
        .filter(|l| l.contains("=> ./staging/"))
        .filter_map(|l| {
            let l = l.trim().trim_start_matches("replace").trim();
            l.split_whitespace().next().map(str::to_owned)
        })
        .collect()
}

pub(super) fn go_command(go: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(go);
    cmd.current_dir(dir)
        // Static binaries: they run on the node as they are, and in images.
        .env("CGO_ENABLED", "0")
        // The wrapper has no go.sum until the first build writes it.
        .env("GOFLAGS", "-mod=mod");
    cmd
}

pub(super) fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_modules_are_read_from_both_replace_forms() {
        let go_mod = "module k8s.io/kubernetes\n\
            replace k8s.io/api => ./staging/src/k8s.io/api\n\
            replace (\n\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n\
            \tgithub.com/x/y => github.com/x/y v1.0.0\n)\n";
        assert_eq!(staging_modules(go_mod), ["k8s.io/api", "k8s.io/client-go"]);
    }
}
