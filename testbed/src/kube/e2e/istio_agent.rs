//! Istio's own CNI node agent (1.29.2, from its own `istio-cni` chart,
//! [`crate::kube::istio`]) on the node in place of ambpf's, and [`Agent`]:
//! which node agent runs, for the cluster benchmarks.
//!
//! For the benchmarks and the rule comparison the two agents never run
//! together: one is uninstalled (and its pods gone) before the other is
//! installed. The migration scenarios run both, as a node moving from one
//! to the other does ([`super::migration`]).

use std::{fmt, path::Path, str::FromStr};

use anyhow::{Result, bail};

use super::client::{Cluster, SYSTEM_NAMESPACE};
use crate::kube::istio::{istio_cni_chart, istio_cni_helm_values};

/// Istio's chart's release name, as Istio's docs install it.
pub const ISTIO_CNI_RELEASE: &str = "istio-cni";
/// The chart's DaemonSet (`{{ template "name" . }}-node`).
pub const ISTIO_CNI_DAEMONSET: &str = "istio-cni-node";
/// Its pods' label.
pub const ISTIO_CNI_SELECTOR: &str = "k8s-app=istio-cni-node";
/// ambpf's pods' label.
pub const AMBPF_SELECTOR: &str = "app.kubernetes.io/name=ambpf";

impl Cluster {
    /// `helm install istio-cni <Istio's chart> -n istio-system` with
    /// [`istio_cni_helm_values`] (`nftables` picks the backend), `--wait`,
    /// then the DaemonSet's rollout. Fails if ambpf's release is installed:
    /// uninstall it first.
    pub fn install_istio_cni(&self, nftables: bool) -> Result<()> {
        self.install_istio_cni_with(nftables, &[])
    }

    /// [`Cluster::install_istio_cni`] with `overrides` in place of the
    /// values of the same name (or added).
    pub fn install_istio_cni_with(
        &self,
        nftables: bool,
        overrides: &[(&'static str, &str)],
    ) -> Result<()> {
        if self.release_installed()? {
            bail!(
                "ambpf's release is installed: uninstall it before Istio's agent, whose \
                 pods must be its own alone"
            );
        }
        self.install_istio_cni_beside_ambpf(nftables, overrides)
    }

    /// [`Cluster::install_istio_cni_with`] whether ambpf's release is
    /// installed or not: a node moving from ambpf to Istio's agent.
    pub fn install_istio_cni_beside_ambpf(
        &self,
        nftables: bool,
        overrides: &[(&'static str, &str)],
    ) -> Result<()> {
        let chart = istio_cni_chart(self.components.cache())?;
        let mut cmd = self.helm();
        cmd.args(["install", ISTIO_CNI_RELEASE]).arg(&chart).args([
            "-n",
            SYSTEM_NAMESPACE,
            "--create-namespace",
        ]);
        let values = istio_cni_helm_values(nftables)
            .into_iter()
            .filter(|(name, _)| !overrides.iter().any(|(o, _)| o == name))
            .chain(
                overrides
                    .iter()
                    .map(|(name, value)| (*name, (*value).to_owned())),
            );
        for (name, value) in values {
            cmd.args(["--set", &format!("{name}={value}")]);
        }
        let out = cmd.args(["--wait", "--timeout", "120s"]).output()?;
        if !out.status.success() {
            bail!(
                "helm install {ISTIO_CNI_RELEASE}: {}\n{}",
                String::from_utf8_lossy(&out.stderr).trim(),
                self.istio_cni_diagnostics()
            );
        }
        self.daemonset_rolled_out(ISTIO_CNI_DAEMONSET, std::time::Duration::from_secs(120))
    }

    /// `helm uninstall istio-cni --wait`, then waits until its pods are gone
    /// (their shutdown removes the plugin from the CNI configuration).
    pub fn uninstall_istio_cni(&self) -> Result<()> {
        self.uninstall_release(ISTIO_CNI_RELEASE, ISTIO_CNI_SELECTOR)
    }

    pub fn istio_cni_installed(&self) -> Result<bool> {
        self.release_exists(ISTIO_CNI_RELEASE)
    }

    /// Status, events and logs of Istio's agent's pods, for a failure's
    /// message.
    pub fn istio_cni_diagnostics(&self) -> String {
        self.pods_diagnostics(ISTIO_CNI_SELECTOR)
    }
}

/// The node agent a benchmark runs: ambpf (its chart, one redirect mode),
/// Istio's own (its chart, one backend), or none (no capture at all).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Agent {
    AmbpfEbpf,
    AmbpfIptables,
    AmbpfNftables,
    IstioIptables,
    IstioNftables,
    None,
}

impl Agent {
    pub const ALL: [Agent; 6] = [
        Agent::AmbpfEbpf,
        Agent::AmbpfIptables,
        Agent::AmbpfNftables,
        Agent::IstioIptables,
        Agent::IstioNftables,
        Agent::None,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Agent::AmbpfEbpf => "ambpf-ebpf",
            Agent::AmbpfIptables => "ambpf-iptables",
            Agent::AmbpfNftables => "ambpf-nftables",
            Agent::IstioIptables => "istio-iptables",
            Agent::IstioNftables => "istio-nftables",
            Agent::None => "none",
        }
    }

    /// ambpf's `redirectMode`, for ambpf's agents.
    pub fn ambpf_mode(self) -> Option<&'static str> {
        match self {
            Agent::AmbpfEbpf => Some("ebpf"),
            Agent::AmbpfIptables => Some("iptables"),
            Agent::AmbpfNftables => Some("nftables"),
            _ => None,
        }
    }

    pub fn is_istio(self) -> bool {
        matches!(self, Agent::IstioIptables | Agent::IstioNftables)
    }

    /// Whether pods of an ambient namespace are captured (all but `none`).
    pub fn captures(self) -> bool {
        self != Agent::None
    }

    /// The label of the agent's pods in `istio-system`.
    pub fn pod_selector(self) -> Option<&'static str> {
        if self.ambpf_mode().is_some() {
            Some(AMBPF_SELECTOR)
        } else if self.is_istio() {
            Some(ISTIO_CNI_SELECTOR)
        } else {
            None
        }
    }

    /// The container that runs the node agent proper: ambpf's `agent`
    /// (`ambpf ... run`; its pod also runs `cni-installer`), Istio's
    /// `install-cni` (which does both jobs in one process).
    pub fn agent_container(self) -> Option<&'static str> {
        if self.ambpf_mode().is_some() {
            Some("agent")
        } else if self.is_istio() {
            Some("install-cni")
        } else {
            None
        }
    }

    /// Installs the agent and waits until its DaemonSet is Ready; `chart` is
    /// ambpf's (Istio's comes from the components' cache).
    pub fn install(self, cluster: &Cluster, chart: &Path) -> Result<()> {
        match self {
            Agent::AmbpfEbpf | Agent::AmbpfIptables | Agent::AmbpfNftables => {
                let mode = self.ambpf_mode().unwrap_or("ebpf");
                cluster.helm_install(chart, mode).map(drop)
            }
            Agent::IstioIptables => cluster.install_istio_cni(false),
            Agent::IstioNftables => cluster.install_istio_cni(true),
            Agent::None => Ok(()),
        }
    }

    /// Whether the agent's release is installed (`none`: never).
    pub fn installed(self, cluster: &Cluster) -> Result<bool> {
        if self.ambpf_mode().is_some() {
            cluster.release_installed()
        } else if self.is_istio() {
            cluster.istio_cni_installed()
        } else {
            Ok(false)
        }
    }

    /// Uninstalls the agent and waits until its pods are gone.
    pub fn uninstall(self, cluster: &Cluster) -> Result<()> {
        match self {
            Agent::AmbpfEbpf | Agent::AmbpfIptables | Agent::AmbpfNftables => {
                cluster.helm_uninstall()
            }
            Agent::IstioIptables | Agent::IstioNftables => cluster.uninstall_istio_cni(),
            Agent::None => Ok(()),
        }
    }
}

impl fmt::Display for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Agent {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match Agent::ALL.into_iter().find(|a| a.name() == s) {
            Some(agent) => Ok(agent),
            None => bail!("no agent {s:?}: {}", Agent::ALL.map(Agent::name).join(", ")),
        }
    }
}

impl serde::Serialize for Agent {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Agent;

    #[test]
    fn agents_parse_from_their_names() {
        for agent in Agent::ALL {
            assert_eq!(agent.name().parse::<Agent>().unwrap(), agent);
        }
        assert!("istio".parse::<Agent>().is_err());
    }

    #[test]
    fn each_capturing_agent_has_its_pods_and_container() {
        for agent in Agent::ALL {
            assert_eq!(agent.pod_selector().is_some(), agent.captures(), "{agent}");
            assert_eq!(
                agent.agent_container().is_some(),
                agent.captures(),
                "{agent}"
            );
        }
        assert_eq!(Agent::AmbpfNftables.ambpf_mode(), Some("nftables"));
        assert!(Agent::IstioNftables.is_istio() && !Agent::AmbpfEbpf.is_istio());
        assert_eq!(
            serde_json::to_string(&Agent::IstioIptables).unwrap(),
            "\"istio-iptables\""
        );
    }
}
