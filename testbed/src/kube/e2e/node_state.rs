//! What ambpf may change on the node, read before an install and after the
//! uninstall: the CNI configuration and plugins, the pins under the node's
//! bpffs, and the node's policy routing.

use anyhow::Result;

use super::client::Cluster;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// `(file, content)` of `/etc/cni/net.d`.
    pub cni_config: Vec<(String, String)>,
    pub cni_plugins: Vec<String>,
    pub bpf_pins: Vec<String>,
    pub ip_rules: Vec<String>,
}

impl NodeState {
    pub fn read(cluster: &Cluster) -> Result<Self> {
        let lines = |s: String| -> Vec<String> {
            let mut v: Vec<String> = s.lines().map(str::to_owned).collect();
            v.sort();
            v
        };
        let mut cni_config = Vec::new();
        for file in lines(cluster.on_node("ls", &["-1", "/etc/cni/net.d"])?) {
            let content = cluster.on_node("cat", &[&format!("/etc/cni/net.d/{file}")])?;
            cni_config.push((file, content));
        }
        Ok(Self {
            cni_config,
            cni_plugins: lines(cluster.on_node("ls", &["-1", "/opt/cni/bin"])?),
            bpf_pins: lines(cluster.on_node("find", &["/sys/fs/bpf", "-mindepth", "1"])?),
            ip_rules: lines(cluster.on_node("ip", &["rule", "show"])?),
        })
    }

    /// Each difference, named.
    pub fn diff(&self, after: &Self) -> Vec<String> {
        let mut out = Vec::new();
        if self.cni_config != after.cni_config {
            out.push(format!(
                "CNI configuration: {:?} -> {:?}",
                self.cni_config, after.cni_config
            ));
        }
        if self.cni_plugins != after.cni_plugins {
            out.push(format!(
                "CNI plugins: {:?} -> {:?}",
                self.cni_plugins, after.cni_plugins
            ));
        }
        if self.bpf_pins != after.bpf_pins {
            out.push(format!(
                "bpffs: {:?} -> {:?}",
                self.bpf_pins, after.bpf_pins
            ));
        }
        if self.ip_rules != after.ip_rules {
            out.push(format!(
                "ip rules: {:?} -> {:?}",
                self.ip_rules, after.ip_rules
            ));
        }
        out
    }
}
