//! Istio's own CNI node agent, the baseline ambpf is measured against: the
//! `install-cni` agent and the `istio-cni` plugin built from the published
//! `istio.io/istio` module, a single-layer image that holds what Istio's
//! `istio/install-cni` image holds at run time, and Istio's own
//! `manifests/charts/istio-cni` Helm chart.
//!
//! Everything lives in `<cache>/istio-<version>/` (`cache` is the
//! components' cache, `<...>/ambpf/cluster`, as for Kubernetes):
//! `bin/` (the two binaries), `src/` (the wrapper module), `image/` (small
//! files the image needs that are not programs) and `chart/istio-cni/`.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use super::components::{find_go, go_command, run};
use crate::oci;

/// `istio.io/istio` at Istio 1.29.2: the commit the tag `1.29.2` points at
/// (`0c774325b938`, 2026-04-09), which the module proxy resolves the query
/// `istio.io/istio@1.29.2` to. Istio publishes no semver tags for the Go
/// module, only these pseudo-versions. (The proxy answers 403 for this
/// pseudo-version's `.info`, so `go mod download istio.io/istio@<it>`
/// fails in a fresh module cache while `...@1.29.2` works; builds and
/// `go list` in a module that requires it need only `.mod` and `.zip`.)
///
/// Why this one: the brief asked for a 1.28 or 1.29 release. Of the release
/// tags the proxy resolves (1.28.0, 1.29.0, 1.29.2, 1.29.3), only 1.29.2's
/// commit is served (the others answer 403). The other served
/// pseudo-versions are branch heads, not releases: `release-1.29` of
/// 2026-08-28 (`666bf5433196`, VERSION 1.29, past 1.29.6), a `release-1.30`
/// commit of 2026-08-26 (`9739e10eb9d7`) and two `master` commits
/// (1.31-dev: `b01690e6db7d`, and `eed52ebb66ad`, which the package list
/// marks as not an approved release). 1.29 has the native nftables backend
/// (`global.nativeNftables`), added in 1.28.
pub const ISTIO: &str = "v0.0.0-20260409200358-0c774325b938";
/// The Istio release [`ISTIO`] is.
pub const ISTIO_RELEASE: &str = "1.29.2";
/// Its git commit (stamped into the binaries as Istio's build does).
pub const ISTIO_COMMIT: &str = "0c774325b938c4dbda4ea4ad4fb6156e80a12de8";
/// Istio 1.29.2's `go.mod` names `istio.io/api` and `istio.io/client-go` by
/// pseudo-versions (`v1.29.2-0.20260408...-a0e4e1cbfcc5`, `...-7c9b0b769ad1`)
/// that the proxy does not serve; they are the commits of those modules' own
/// `v1.29.2` tags, which it does serve, so the wrapper replaces them by the
/// tags: the same source.
const ISTIO_API_MODULES: [(&str, &str); 2] = [
    ("istio.io/api", "v1.29.2"),
    ("istio.io/client-go", "v1.29.2"),
];

/// The DaemonSet's binaries (Istio's `CNI_BINARIES`), under `bin/`.
pub const ISTIO_CNI_BINARIES: [&str; 2] = ["install-cni", "istio-cni"];
/// The build tags Istio builds them with (`AGENT_TAGS` in Makefile.core.mk).
const AGENT_TAGS: &str = "agent,disable_pgv,grpcnotrace,retrynotrace";

/// The reference the image is imported under; the chart takes it whole as
/// `image=` (a value with a `/` is used as it is, ignoring hub and tag).
pub const ISTIO_CNI_IMAGE: &str = "localhost/ambpf/install-cni:1.29.2";
/// Istio's image has no ENTRYPOINT and `CMD ["/usr/local/bin/install-cni"]`;
/// the chart's container overrides it with `command: ["install-cni"]`,
/// found on `PATH` ([`ISTIO_CNI_ENV`]).
pub const ISTIO_CNI_ENTRYPOINT: &[&str] = &["/usr/local/bin/install-cni"];
/// The image's `ENV` (Dockerfile.install-cni). Its `WORKDIR /opt/cni/bin`
/// does not matter: the agent uses absolute paths only.
pub const ISTIO_CNI_ENV: &[&str] =
    &["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin"];

/// Where the two binaries sit in Istio's image: the agent copies the plugin
/// from `/opt/cni/bin` (its `CNIBinSourceDir`) to the node's
/// `/host/opt/cni/bin`.
pub const ISTIO_CNI_IMAGE_BINARIES: [(&str, &str); 2] = [
    ("install-cni", "/usr/local/bin/install-cni"),
    ("istio-cni", "/opt/cni/bin/istio-cni"),
];

/// Debian's iptables: the agent finds `iptables-legacy`, `iptables-nft` or
/// `iptables` (and their `-save`/`-restore`, and `ip6tables*` with IPv6) on
/// `PATH` and picks the one whose rules the network namespace already has.
/// Each name is a copy of the multi-call program (it dispatches on its
/// name). Plain `iptables` is legacy, as Istio's base image sets it with
/// `update-alternatives`.
const XTABLES: [(&str, &[&str]); 2] = [
    (
        "/usr/sbin/xtables-legacy-multi",
        &[
            "iptables-legacy",
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "ip6tables-legacy",
            "ip6tables-legacy-save",
            "ip6tables-legacy-restore",
            "iptables",
            "iptables-save",
            "iptables-restore",
            "ip6tables",
            "ip6tables-save",
            "ip6tables-restore",
        ],
    ),
    (
        "/usr/sbin/xtables-nft-multi",
        &[
            "iptables-nft",
            "iptables-nft-save",
            "iptables-nft-restore",
            "ip6tables-nft",
            "ip6tables-nft-save",
            "ip6tables-nft-restore",
        ],
    ),
];
/// The native nftables backend runs `nft` (through `sigs.k8s.io/knftables`,
/// which looks it up on `PATH` and runs `nft -f -` and `nft --json list`).
const NFT: &str = "/usr/sbin/nft";
/// iptables' extensions (`-m mark`, `-j CONNMARK`, `-j TPROXY`, ...), which
/// both variants load from here.
const XTABLES_MODULES: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// `<cache>/istio-<version>`.
pub fn istio_dir(cache: &Path) -> PathBuf {
    cache.join(format!("istio-{ISTIO}"))
}

/// Builds `install-cni` and `istio-cni` into `<cache>/istio-<version>/bin/`
/// unless both are there, and returns that directory. Static
/// (`CGO_ENABLED=0`), `-trimpath -ldflags "-s -w"`, with Istio's agent build
/// tags and version stamps. Cold (empty module and build caches) it took
/// 298 s on the 2-core machine, downloads included (about 460 MB of
/// modules); 216 s with the modules already downloaded.
pub fn build_istio_cni(cache: &Path) -> Result<PathBuf> {
    let dir = istio_dir(cache);
    let bin = dir.join("bin");
    if ISTIO_CNI_BINARIES.iter().all(|b| bin.join(b).is_file()) {
        println!(
            "istio {ISTIO_RELEASE} ({ISTIO}): cached in {}",
            dir.display()
        );
        return Ok(bin);
    }
    let go = find_go()?;
    let started = Instant::now();
    let src = write_wrapper(&dir)?;
    let mut build = go_command(&go, &src);
    build
        .args([
            "build",
            "-trimpath",
            "-tags",
            AGENT_TAGS,
            "-ldflags",
            &ldflags(),
            "-o",
        ])
        .arg(bin.join(""))
        .args(ISTIO_CNI_BINARIES.map(|b| format!("istio.io/istio/cni/cmd/{b}")));
    run(&mut build)?;
    println!(
        "istio {ISTIO_RELEASE} ({ISTIO}): built {} in {:.0} s into {}",
        ISTIO_CNI_BINARIES.join(", "),
        started.elapsed().as_secs_f64(),
        bin.display()
    );
    Ok(bin)
}

/// The files of a single-layer image (for [`oci::build`], with
/// [`ISTIO_CNI_ENTRYPOINT`] and [`ISTIO_CNI_ENV`]) that holds what Istio's
/// `install-cni` image holds that matters at run time: the two binaries at
/// Istio's paths; Debian's iptables (legacy and nft, IPv4 and IPv6, with
/// their extensions) and `nft`, each with its shared libraries; an
/// `/etc/nsswitch.conf` (the agent bind-mounts `/dev/null` over it around
/// in-pod iptables calls) and `/run/xtables.lock` (so that `/run` exists for
/// legacy iptables' lock). `bin_dir` is what [`build_istio_cni`] returned;
/// the two small files are written next to it, in `image/`.
pub fn istio_cni_image_files(bin_dir: &Path) -> Result<Vec<(PathBuf, String)>> {
    let mut files = Vec::new();
    for (name, in_image) in ISTIO_CNI_IMAGE_BINARIES {
        let path = bin_dir.join(name);
        if !path.is_file() {
            bail!("{}: build it first (build_istio_cni)", path.display());
        }
        files.push((path, in_image.to_owned()));
    }
    for (multi, names) in XTABLES {
        let multi = Path::new(multi);
        if !multi.is_file() {
            bail!("{} not found: install Debian's iptables", multi.display());
        }
        for name in names {
            files.extend(oci::program_with_libraries(
                multi,
                &format!("/usr/sbin/{name}"),
            )?);
        }
    }
    if !Path::new(NFT).is_file() {
        bail!("{NFT} not found: install Debian's nftables");
    }
    files.extend(oci::program_with_libraries(Path::new(NFT), NFT)?);
    let modules = fs::read_dir(XTABLES_MODULES)
        .with_context(|| format!("{XTABLES_MODULES}: install Debian's iptables"))?;
    for entry in modules {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "so") {
            let in_image = path.display().to_string();
            files.extend(oci::program_with_libraries(&path, &in_image)?);
        }
    }
    let extra = bin_dir.parent().unwrap_or(bin_dir).join("image");
    fs::create_dir_all(&extra)?;
    for (name, content, in_image) in [
        ("nsswitch.conf", NSSWITCH, "/etc/nsswitch.conf"),
        ("xtables.lock", "", "/run/xtables.lock"),
    ] {
        fs::write(extra.join(name), content)?;
        files.push((extra.join(name), in_image.to_owned()));
    }
    files.sort_by(|a, b| a.1.cmp(&b.1));
    files.dedup_by(|a, b| a.1 == b.1);
    Ok(files)
}

/// Debian's default `/etc/nsswitch.conf`.
const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n\
    networks: files\nprotocols: files\nservices: files\nethers: files\nrpc: files\n";

/// Istio's own `manifests/charts/istio-cni` chart from the module, copied
/// out of the (read-only) module cache into
/// `<cache>/istio-<version>/chart/istio-cni`, with its `version` and
/// `appVersion` set to the release (Istio's release sets them; the source
/// says `1.0.0`). Returns that directory, for `helm install istio-cni <dir>
/// -n istio-system`.
///
/// Values to run it in ambient mode on the testbed's node (all top-level
/// in this chart: `cniConfDir`, not `cni.cniConfDir`, which is the
/// istioctl/umbrella spelling) — [`istio_cni_helm_values`] returns them:
///
/// - `ambient.enabled=true`: the agent runs the ambient node agent
///   (`AMBIENT_ENABLED`); without it, it only installs the plugin. (The
///   `ambient` profile also sets it, but with `global.variant=distroless`,
///   which appends `-distroless` to the tag.)
/// - `image=localhost/ambpf/install-cni:1.29.2` ([`ISTIO_CNI_IMAGE`]): a
///   value with a `/` is the whole reference; otherwise the chart builds
///   `<hub>/<image>:<tag>[-<variant>]` from `hub` (or `global.hub`), `image`
///   (default `install-cni`), `tag` (or `global.tag`) and `variant`.
///   `tag=1.29.2` too: the ConfigMap's `CURRENT_AGENT_VERSION` reads it.
/// - `pullPolicy=Never`: the image is imported, no registry is reachable.
/// - `cniConfDir=/etc/cni/net.d`, `cniBinDir=/opt/cni/bin` (the defaults):
///   the agent chains itself into the first conflist there
///   (`chained=true`; `cniConfFileName` names one explicitly).
/// - `ambient.shareHostNetworkNamespace=true`: the pod gets
///   `hostNetwork: true` and the chart leaves out `ALLOW_SWITCH_TO_HOST_NS`,
///   so "the host" is the agent's own network namespace, the node's. With
///   the default (false) the agent enters `/host/proc/1/ns/net`, the netns
///   of PID 1, which on this testbed (its own network and mount
///   namespaces, the machine's PID namespace) is the machine's, not the
///   node's.
/// - `ambient.ipv6=false`: the node is IPv4-only (the default true also
///   programs ip6tables/inet rules for v6).
/// - `ambient.dnsCapture`: default true (redirects DNS to ztunnel's 15053);
///   set as the comparison needs.
/// - `ambient.reconcileIptablesOnStartup`: default true; on start the agent
///   rewrites the in-pod rules of pods already annotated
///   `ambient.istio.io/redirection: enabled`.
/// - backend: `global.nativeNftables=true` selects the native nftables
///   backend (`NATIVE_NFTABLES`; tables `inet istio-ambient-nat`,
///   `-mangle`, `-raw`), false (default) iptables. With iptables,
///   `env.FORCE_IPTABLES_BINARY=legacy|nft` pins the variant instead of the
///   agent's detection. The agent falls back to iptables if the node netns
///   still has the iptables backend's ipset `istio-inpod-probes-v4`.
/// - `global.platform`: unset (it selects a `files/profile-platform-*.yaml`:
///   gke, k3d, k3s, microk8s, minikube, openshift; none applies).
/// - `excludeNamespaces`: default `[kube-system]`. `repair.enabled`: default
///   true (sidecar race repair; harmless in ambient).
/// - `global.logging.level` (default `info`), e.g. `cni-agent:debug`.
///
/// The agent serves ztunnel's ZDS socket at `/var/run/ztunnel/ztunnel.sock`
/// (the chart mounts the node's `/var/run/ztunnel`); `env.ZTUNNEL_UDS_ADDRESS`
/// would move it. It also needs the node's `/proc` (as `/host/proc`),
/// `/var/run/netns` and `/var/run/istio-cni`. In the node's network
/// namespace it listens on :8000 (readiness), :15014 (metrics) and
/// localhost:9876 (ControlZ): the first two are ambpf's agent's ports, and
/// both serve the ZDS socket, so the two never run on the node together.
pub fn istio_cni_chart(cache: &Path) -> Result<PathBuf> {
    let dest = istio_dir(cache).join("chart/istio-cni");
    if dest.join("Chart.yaml").is_file() {
        return Ok(dest);
    }
    let go = find_go()?;
    let module = module_dir(&go, &write_wrapper(&istio_dir(cache))?)?;
    let source = module.join("manifests/charts/istio-cni");
    if !source.join("Chart.yaml").is_file() {
        bail!("{} holds no chart", source.display());
    }
    let tmp = dest.with_extension("partial");
    let _ = fs::remove_dir_all(&tmp);
    copy_tree(&source, &tmp)?;
    let chart_yaml = tmp.join("Chart.yaml");
    let chart = fs::read_to_string(&chart_yaml)?;
    fs::write(&chart_yaml, set_chart_version(&chart, ISTIO_RELEASE))?;
    let _ = fs::remove_dir_all(&dest);
    fs::rename(&tmp, &dest)?;
    Ok(dest)
}

/// The `--set` values of [`istio_cni_chart`]'s doc for the testbed's node,
/// as `(name, value)`; `nftables` picks the backend.
pub fn istio_cni_helm_values(nftables: bool) -> Vec<(&'static str, String)> {
    vec![
        ("ambient.enabled", "true".into()),
        ("ambient.shareHostNetworkNamespace", "true".into()),
        ("ambient.ipv6", "false".into()),
        ("image", ISTIO_CNI_IMAGE.into()),
        ("tag", ISTIO_RELEASE.into()),
        ("pullPolicy", "Never".into()),
        ("cniConfDir", "/etc/cni/net.d".into()),
        ("cniBinDir", "/opt/cni/bin".into()),
        ("global.nativeNftables", nftables.to_string()),
    ]
}

/// The wrapper module: Istio's `go.mod` has no replace directives, but two
/// of its requirements are served only under their tags.
fn wrapper_go_mod() -> String {
    let mut go_mod = format!(
        "module ambpf.local/istio-build\n\ngo 1.26.0\n\nrequire istio.io/istio {ISTIO}\n\n"
    );
    for (module, tag) in ISTIO_API_MODULES {
        go_mod.push_str(&format!("replace {module} => {module} {tag}\n"));
    }
    go_mod
}

/// What Istio's `common/scripts/report_build_info.sh` stamps, and `-s -w`.
fn ldflags() -> String {
    let p = "istio.io/istio/pkg/version";
    format!(
        "-s -w -X {p}.buildVersion={ISTIO_RELEASE} -X {p}.buildGitRevision={ISTIO_COMMIT} \
         -X {p}.buildStatus=Clean -X {p}.buildTag={ISTIO_RELEASE} -X {p}.buildHub=localhost/ambpf"
    )
}

/// Writes the wrapper module into `<dir>/src` and returns that directory.
fn write_wrapper(dir: &Path) -> Result<PathBuf> {
    let src = dir.join("src");
    fs::create_dir_all(&src)?;
    fs::write(src.join("go.mod"), wrapper_go_mod())?;
    Ok(src)
}

/// The module's directory in the module cache, downloading it through the
/// wrapper (`src`). Not `go mod download istio.io/istio@<version>`: the
/// proxy answers 403 for this pseudo-version's `.info` (it serves its
/// `.mod` and `.zip`, which is all a build of a module that requires it,
/// or `go list`, reads).
fn module_dir(go: &Path, src: &Path) -> Result<PathBuf> {
    let out = go_command(go, src)
        .args([
            "list",
            "-f",
            "{{.Module.Dir}}",
            "istio.io/istio/cni/cmd/install-cni",
        ])
        .output()
        .context("go list")?;
    if !out.status.success() {
        bail!(
            "go list istio.io/istio/cni/cmd/install-cni in {}: {}",
            src.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if dir.is_empty() {
        bail!("go list printed no module directory for istio.io/istio");
    }
    Ok(PathBuf::from(dir))
}

/// `version:` and `appVersion:` of a Chart.yaml, set to `version`.
fn set_chart_version(chart: &str, version: &str) -> String {
    let mut out = String::with_capacity(chart.len());
    for line in chart.lines() {
        if line.starts_with("version:") {
            out.push_str(&format!("version: {version}"));
        } else if line.starts_with("appVersion:") {
            out.push_str(&format!("appVersion: {version}"));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// Copies a directory tree of regular files; the copies are writable (the
/// module cache's are not).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from).with_context(|| format!("{}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)
                .with_context(|| format!("{}", entry.path().display()))?;
            let mut perms = fs::metadata(&target)?.permissions();
            #[allow(clippy::permissions_set_readonly_false)]
            perms.set_readonly(false);
            fs::set_permissions(&target, perms)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_a_pseudo_version_of_the_commit() {
        let hash = ISTIO.rsplit('-').next().unwrap();
        assert_eq!(hash.len(), 12);
        assert!(ISTIO_COMMIT.starts_with(hash));
        assert!(ISTIO.starts_with("v0.0.0-20260409"));
    }

    #[test]
    fn the_wrapper_requires_istio_and_replaces_its_api_modules_by_tag() {
        let go_mod = wrapper_go_mod();
        assert!(go_mod.contains(&format!("require istio.io/istio {ISTIO}\n")));
        assert!(go_mod.contains("replace istio.io/api => istio.io/api v1.29.2\n"));
        assert!(go_mod.contains("replace istio.io/client-go => istio.io/client-go v1.29.2\n"));
    }

    #[test]
    fn ldflags_strip_and_stamp_the_release() {
        let flags = ldflags();
        assert!(flags.starts_with("-s -w "));
        assert!(flags.contains("istio.io/istio/pkg/version.buildVersion=1.29.2"));
        assert!(flags.contains(&format!("buildGitRevision={ISTIO_COMMIT}")));
    }

    #[test]
    fn the_chart_version_is_set_to_the_release() {
        let chart = "apiVersion: v2\nname: istio-cni\nversion: 1.0.0\nappVersion: 1.0.0\n\
                     keywords:\n  - istio-cni\n";
        let set = set_chart_version(chart, "1.29.2");
        assert!(set.contains("\nversion: 1.29.2\nappVersion: 1.29.2\n"));
        assert!(set.starts_with("apiVersion: v2\nname: istio-cni\n"));
        assert!(set.ends_with("keywords:\n  - istio-cni\n"));
    }

    #[test]
    fn the_image_puts_the_binaries_where_istio_does() {
        let bin = std::env::temp_dir().join(format!("ambpf-istio-test-{}/bin", std::process::id()));
        fs::create_dir_all(&bin).unwrap();
        for b in ISTIO_CNI_BINARIES {
            fs::write(bin.join(b), b"").unwrap();
        }
        let result = istio_cni_image_files(&bin);
        let have_iptables = Path::new(XTABLES[0].0).is_file()
            && Path::new(XTABLES[1].0).is_file()
            && Path::new(NFT).is_file()
            && Path::new(XTABLES_MODULES).is_dir();
        if have_iptables {
            let files = result.unwrap();
            let in_image: Vec<&str> = files.iter().map(|(_, p)| p.as_str()).collect();
            for p in [
                "/usr/local/bin/install-cni",
                "/opt/cni/bin/istio-cni",
                "/usr/sbin/iptables-nft-restore",
                "/usr/sbin/iptables-legacy-save",
                "/usr/sbin/ip6tables-nft",
                "/usr/sbin/nft",
                "/usr/lib/x86_64-linux-gnu/xtables/libxt_mark.so",
                "/etc/nsswitch.conf",
                "/run/xtables.lock",
            ] {
                assert!(in_image.contains(&p), "{p} missing from {in_image:?}");
            }
            assert!(in_image.iter().any(|p| p.contains("libc.so")));
            // One source per path in the image.
            let mut sorted = in_image.clone();
            sorted.dedup();
            assert_eq!(sorted.len(), in_image.len());
        } else {
            assert!(result.is_err());
        }
        let _ = fs::remove_dir_all(bin.parent().unwrap());
    }

    #[test]
    fn helm_values_select_the_backend() {
        let values = istio_cni_helm_values(true);
        assert!(values.contains(&("global.nativeNftables", "true".into())));
        assert!(values.contains(&("ambient.enabled", "true".into())));
        let values = istio_cni_helm_values(false);
        assert!(values.contains(&("global.nativeNftables", "false".into())));
    }
}
