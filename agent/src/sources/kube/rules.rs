//! Which pods are ambient: Istio's enrolment rules, as pure functions.
//!
//! A pod is ambient when its namespace or the pod itself carries
//! `istio.io/dataplane-mode=ambient`, unless
//! - its namespace is excluded (by default `kube-system`),
//! - the pod says `istio.io/dataplane-mode=none`,
//! - it has an Istio sidecar (a container named `istio-proxy`, or the
//!   injector's `sidecar.istio.io/status` annotation),
//! - it runs in the host's network namespace (`hostNetwork`),
//! - it has finished (phase `Succeeded` or `Failed`).
//!
//! As in Istio, a pod that is being deleted stays ambient until it is gone.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::pod::WatchedPod;

/// The label, on a pod or its namespace, that enrols it.
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
pub const DATAPLANE_MODE_AMBIENT: &str = "ambient";
/// On a pod: never enrol it, whatever its namespace says.
pub const DATAPLANE_MODE_NONE: &str = "none";
/// Set by Istio's sidecar injector on pods it injected.
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";
/// The injected sidecar's container name.
pub const SIDECAR_CONTAINER: &str = "istio-proxy";
/// A pod's own DNS capture choice (`"false"` opts out of the node's default).
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";
/// The enrolment state recorded on the pod, as Istio's node agent does
/// (see [`Redirection`]).
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
pub const REDIRECTION_ENABLED: &str = "enabled";
pub const REDIRECTION_PENDING: &str = "pending";
/// The namespaces excluded when none are configured.
pub const DEFAULT_EXCLUDED_NAMESPACES: &[&str] = &["kube-system"];

/// Why a pod is not ambient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NotAmbient {
    /// Neither the pod nor its namespace asks for ambient.
    NotLabelled,
    ExcludedNamespace,
    /// `istio.io/dataplane-mode=none` on the pod.
    OptedOut,
    Sidecar,
    HostNetwork,
    /// Phase `Succeeded` or `Failed`.
    Terminal,
}

impl fmt::Display for NotAmbient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NotAmbient::NotLabelled => {
                "neither the pod nor its namespace is labelled istio.io/dataplane-mode=ambient"
            }
            NotAmbient::ExcludedNamespace => "its namespace is excluded",
            NotAmbient::OptedOut => "the pod is labelled istio.io/dataplane-mode=none",
            NotAmbient::Sidecar => "it has an Istio sidecar",
            NotAmbient::HostNetwork => "it uses the host network",
            NotAmbient::Terminal => "it has terminated",
        })
    }
}

fn mode(labels: Option<&BTreeMap<String, String>>) -> Option<&str> {
    labels
        .and_then(|l| l.get(DATAPLANE_MODE_LABEL))
        .map(String::as_str)
}

/// The label of the pods of Istio's CNI node agent (its chart's
/// `k8s-app: istio-cni-node`).
pub const ISTIO_NODE_AGENT_LABEL: (&str, &str) = ("k8s-app", "istio-cni-node");

/// A pod of Istio's node agent on the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IstioNodeAgent {
    Running,
    /// Being deleted: its agent may still run its shutdown, which deletes
    /// its host rules (the rule modes' own names).
    Stopping,
}

/// Whether `pod` is one of Istio's node agent's, and whether it is being
/// deleted.
pub fn istio_node_agent(pod: &WatchedPod) -> Option<IstioNodeAgent> {
    let (key, value) = ISTIO_NODE_AGENT_LABEL;
    let labelled = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(key))
        .is_some_and(|v| v == value);
    let state = match pod.metadata.deletion_timestamp {
        None => IstioNodeAgent::Running,
        Some(_) => IstioNodeAgent::Stopping,
    };
    labelled.then_some(state)
}

/// Whether `pod` is ambient, given its namespace's labels (`None` when the
/// namespace is not known, which counts as unlabelled) and the excluded
/// namespaces.
pub fn ambient(
    pod: &WatchedPod,
    namespace_labels: Option<&BTreeMap<String, String>>,
    excluded_namespaces: &BTreeSet<String>,
) -> Result<(), NotAmbient> {
    let meta = &pod.metadata;
    if meta
        .namespace
        .as_ref()
        .is_some_and(|ns| excluded_namespaces.contains(ns))
    {
        return Err(NotAmbient::ExcludedNamespace);
    }
    let pod_mode = mode(meta.labels.as_ref());
    if pod_mode != Some(DATAPLANE_MODE_AMBIENT)
        && mode(namespace_labels) != Some(DATAPLANE_MODE_AMBIENT)
    {
        return Err(NotAmbient::NotLabelled);
    }
    if pod_mode == Some(DATAPLANE_MODE_NONE) {
        return Err(NotAmbient::OptedOut);
    }
    if has_sidecar(pod) {
        return Err(NotAmbient::Sidecar);
    }
    if pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) {
        return Err(NotAmbient::HostNetwork);
    }
    if matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    ) {
        return Err(NotAmbient::Terminal);
    }
    Ok(())
}

/// An Istio sidecar: the injector's status annotation, or a container (or a
/// native sidecar, an init container) named `istio-proxy`.
pub fn has_sidecar(pod: &WatchedPod) -> bool {
    if pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(SIDECAR_STATUS_ANNOTATION))
    {
        return true;
    }
    pod.spec.as_ref().is_some_and(|spec| {
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .any(|c| c.name == SIDECAR_CONTAINER)
    })
}

/// The pod's service account (`spec.serviceAccountName`; unset or empty is
/// `default`, as the API server fills it in).
pub fn service_account(pod: &WatchedPod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

/// The pod's DNS capture choice from [`DNS_CAPTURE_ANNOTATION`]: `None` when
/// absent or not a boolean (Go's `strconv.ParseBool` spellings, as Istio
/// reads it), so the node's setting applies.
pub fn dns_capture(pod: &WatchedPod) -> Option<bool> {
    let value = pod
        .metadata
        .annotations
        .as_ref()?
        .get(DNS_CAPTURE_ANNOTATION)?;
    parse_bool(value)
}

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// The pod's IPs: `status.podIPs`, else `status.podIP`; unparsable entries
/// are left out.
pub fn pod_ips(pod: &WatchedPod) -> Vec<IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    match status.pod_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().filter_map(|ip| ip.ip.parse().ok()).collect(),
        _ => status
            .pod_ip
            .iter()
            .filter_map(|ip| ip.parse().ok())
            .collect(),
    }
}

/// The values of [`REDIRECTION_ANNOTATION`] the agent writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redirection {
    /// The redirection is in place and ztunnel acked the pod.
    Enabled,
    /// The redirection is in place but ztunnel has not taken the pod (none
    /// connected, or it refused the pod); enrolment is not complete.
    Pending,
}

impl Redirection {
    pub fn as_str(self) -> &'static str {
        match self {
            Redirection::Enabled => REDIRECTION_ENABLED,
            Redirection::Pending => REDIRECTION_PENDING,
        }
    }
}

impl fmt::Display for Redirection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The pod's [`REDIRECTION_ANNOTATION`], when it holds a value the agent
/// writes (`None` for any other value, which is not the agent's).
pub fn redirection_annotation(meta: &ObjectMeta) -> Option<Redirection> {
    match meta
        .annotations
        .as_ref()?
        .get(REDIRECTION_ANNOTATION)?
        .as_str()
    {
        REDIRECTION_ENABLED => Some(Redirection::Enabled),
        REDIRECTION_PENDING => Some(Redirection::Pending),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use crate::sources::kube::pod::{NamedContainer, PodIp, WatchedPodSpec, WatchedPodStatus};

    use super::*;

    #[test]
    fn istios_node_agent_is_told_running_or_stopping() {
        let (key, value) = ISTIO_NODE_AGENT_LABEL;
        let mut agent = pod("istio-system", &[(key, value)]);
        assert_eq!(istio_node_agent(&agent), Some(IstioNodeAgent::Running));
        agent.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        assert_eq!(istio_node_agent(&agent), Some(IstioNodeAgent::Stopping));
        assert_eq!(
            istio_node_agent(&pod("istio-system", &[(key, "ztunnel")])),
            None
        );
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn pod(namespace: &str, pod_labels: &[(&str, &str)]) -> WatchedPod {
        WatchedPod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                namespace: Some(namespace.into()),
                labels: Some(labels(pod_labels)),
                ..Default::default()
            },
            spec: Some(WatchedPodSpec {
                containers: vec![NamedContainer { name: "web".into() }],
                ..Default::default()
            }),
            status: Some(WatchedPodStatus {
                phase: Some("Running".into()),
                ..Default::default()
            }),
        }
    }

    fn excluded() -> BTreeSet<String> {
        DEFAULT_EXCLUDED_NAMESPACES
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }

    const AMBIENT: &[(&str, &str)] = &[(DATAPLANE_MODE_LABEL, DATAPLANE_MODE_AMBIENT)];
    const NONE: &[(&str, &str)] = &[(DATAPLANE_MODE_LABEL, DATAPLANE_MODE_NONE)];

    #[test]
    fn the_namespace_label_or_the_pod_label_enrols() {
        let ns = labels(AMBIENT);
        let plain = labels(&[("team", "shop")]);
        assert_eq!(ambient(&pod("shop", &[]), Some(&ns), &excluded()), Ok(()));
        assert_eq!(
            ambient(&pod("shop", AMBIENT), Some(&plain), &excluded()),
            Ok(())
        );
        assert_eq!(ambient(&pod("shop", AMBIENT), None, &excluded()), Ok(()));
        assert_eq!(
            ambient(&pod("shop", &[]), Some(&plain), &excluded()),
            Err(NotAmbient::NotLabelled)
        );
        assert_eq!(
            ambient(&pod("shop", &[]), None, &excluded()),
            Err(NotAmbient::NotLabelled)
        );
        // Other values of the label do not enrol.
        let other = labels(&[(DATAPLANE_MODE_LABEL, "sidecar")]);
        assert_eq!(
            ambient(&pod("shop", &[]), Some(&other), &excluded()),
            Err(NotAmbient::NotLabelled)
        );
        assert_eq!(
            ambient(
                &pod("shop", &[(DATAPLANE_MODE_LABEL, "Ambient")]),
                None,
                &excluded()
            ),
            Err(NotAmbient::NotLabelled)
        );
    }

    #[test]
    fn a_pod_labelled_none_opts_out_of_an_ambient_namespace() {
        let ns = labels(AMBIENT);
        assert_eq!(
            ambient(&pod("shop", NONE), Some(&ns), &excluded()),
            Err(NotAmbient::OptedOut)
        );
        // Without an ambient namespace it was never in.
        assert_eq!(
            ambient(&pod("shop", NONE), None, &excluded()),
            Err(NotAmbient::NotLabelled)
        );
    }

    #[test]
    fn host_network_pods_never_enrol() {
        let mut p = pod("shop", AMBIENT);
        p.spec.as_mut().unwrap().host_network = Some(true);
        assert_eq!(ambient(&p, None, &excluded()), Err(NotAmbient::HostNetwork));
        p.spec.as_mut().unwrap().host_network = Some(false);
        assert_eq!(ambient(&p, None, &excluded()), Ok(()));
    }

    #[test]
    fn pods_with_a_sidecar_never_enrol() {
        let ns = labels(AMBIENT);
        let mut by_container = pod("shop", &[]);
        by_container
            .spec
            .as_mut()
            .unwrap()
            .containers
            .push(NamedContainer {
                name: SIDECAR_CONTAINER.into(),
            });
        assert_eq!(
            ambient(&by_container, Some(&ns), &excluded()),
            Err(NotAmbient::Sidecar)
        );

        let mut native = pod("shop", &[]);
        native.spec.as_mut().unwrap().init_containers = Some(vec![NamedContainer {
            name: SIDECAR_CONTAINER.into(),
        }]);
        assert_eq!(
            ambient(&native, Some(&ns), &excluded()),
            Err(NotAmbient::Sidecar)
        );

        let mut by_annotation = pod("shop", AMBIENT);
        by_annotation.metadata.annotations = Some(labels(&[(
            SIDECAR_STATUS_ANNOTATION,
            r#"{"containers":["istio-proxy"]}"#,
        )]));
        assert_eq!(
            ambient(&by_annotation, None, &excluded()),
            Err(NotAmbient::Sidecar)
        );
    }

    #[test]
    fn terminal_pods_leave_and_terminating_ones_stay() {
        for (phase, expected) in [
            ("Succeeded", Err(NotAmbient::Terminal)),
            ("Failed", Err(NotAmbient::Terminal)),
            ("Pending", Ok(())),
            ("Running", Ok(())),
            ("Unknown", Ok(())),
        ] {
            let mut p = pod("shop", AMBIENT);
            p.status.as_mut().unwrap().phase = Some(phase.into());
            assert_eq!(ambient(&p, None, &excluded()), expected, "{phase}");
        }
        let mut deleting = pod("shop", AMBIENT);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(ambient(&deleting, None, &excluded()), Ok(()));
        let mut no_status = pod("shop", AMBIENT);
        no_status.status = None;
        assert_eq!(ambient(&no_status, None, &excluded()), Ok(()));
    }

    #[test]
    fn excluded_namespaces_win_over_labels() {
        let ns = labels(AMBIENT);
        assert_eq!(
            ambient(&pod("kube-system", AMBIENT), Some(&ns), &excluded()),
            Err(NotAmbient::ExcludedNamespace)
        );
        let custom: BTreeSet<String> = ["infra".to_owned()].into();
        assert_eq!(
            ambient(&pod("infra", AMBIENT), Some(&ns), &custom),
            Err(NotAmbient::ExcludedNamespace)
        );
        assert_eq!(
            ambient(&pod("kube-system", AMBIENT), Some(&ns), &custom),
            Ok(())
        );
        assert_eq!(
            ambient(&pod("kube-system", AMBIENT), Some(&ns), &BTreeSet::new()),
            Ok(())
        );
    }

    #[test]
    fn dns_capture_follows_the_annotation_as_go_parses_booleans() {
        let mut p = pod("shop", AMBIENT);
        assert_eq!(dns_capture(&p), None);
        for (value, expected) in [
            ("false", Some(false)),
            ("False", Some(false)),
            ("0", Some(false)),
            ("true", Some(true)),
            ("1", Some(true)),
            ("no", None),
            ("", None),
        ] {
            p.metadata.annotations = Some(labels(&[(DNS_CAPTURE_ANNOTATION, value)]));
            assert_eq!(dns_capture(&p), expected, "{value:?}");
        }
    }

    #[test]
    fn pod_ips_prefer_the_list_and_fall_back_to_the_single_ip() {
        let mut p = pod("shop", AMBIENT);
        assert!(pod_ips(&p).is_empty());
        let status = p.status.as_mut().unwrap();
        status.pod_ip = Some("10.0.0.5".into());
        assert_eq!(pod_ips(&p), ["10.0.0.5".parse::<IpAddr>().unwrap()]);
        let status = p.status.as_mut().unwrap();
        status.pod_ips = Some(vec![
            PodIp {
                ip: "10.0.0.5".into(),
            },
            PodIp {
                ip: "fd00::5".into(),
            },
            PodIp {
                ip: "garbage".into(),
            },
        ]);
        assert_eq!(
            pod_ips(&p),
            [
                "10.0.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
    }

    #[test]
    fn the_service_account_defaults_as_the_api_server_fills_it_in() {
        let mut p = pod("shop", AMBIENT);
        assert_eq!(service_account(&p), "default");
        p.spec.as_mut().unwrap().service_account_name = Some(String::new());
        assert_eq!(service_account(&p), "default");
        p.spec.as_mut().unwrap().service_account_name = Some("web".into());
        assert_eq!(service_account(&p), "web");
    }

    #[test]
    fn the_redirection_annotation_is_read_exactly() {
        let mut p = pod("shop", AMBIENT);
        assert_eq!(redirection_annotation(&p.metadata), None);
        for (value, expected) in [
            ("pending", Some(Redirection::Pending)),
            ("enabled", Some(Redirection::Enabled)),
            ("Enabled", None),
            ("disabled", None),
            ("", None),
        ] {
            p.metadata.annotations = Some(labels(&[(REDIRECTION_ANNOTATION, value)]));
            assert_eq!(redirection_annotation(&p.metadata), expected, "{value:?}");
        }
        // Another annotation's value does not count.
        p.metadata.annotations = Some(labels(&[("example.com/redirection", "enabled")]));
        assert_eq!(redirection_annotation(&p.metadata), None);
        assert_eq!(Redirection::Enabled.as_str(), "enabled");
        assert_eq!(Redirection::Pending.to_string(), "pending");
    }
}
