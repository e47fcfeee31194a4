//! The cluster's DNS: CoreDNS ([`super::components`] builds it) as kubeadm
//! deploys it, in `kube-system` behind the `kube-dns` Service at the
//! kubelet's `clusterDNS` address, so pods resolve Service names.
//!
//! Its image holds the one static binary, built here and imported into the
//! node's containerd like the node's other images ([`super::images`]).

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::{Components, DNS_SERVICE_IP, Layout, components::COREDNS, images, in_node, kubectl};
use crate::oci;

const MANIFEST: &str = include_str!("../../manifests/coredns.yaml");
/// The name every cluster answers for the API server's Service.
const API_SERVICE_NAME: &str = "kubernetes.default.svc.cluster.local";

/// The image's reference in the node's containerd.
pub fn image() -> String {
    format!("localhost/ambpf/coredns:{COREDNS}")
}

/// The manifest with the image and the Service's address filled in.
fn manifest() -> String {
    MANIFEST
        .replace("COREDNS_IMAGE", &image())
        .replace("DNS_SERVICE_IP", DNS_SERVICE_IP)
}

/// Imports CoreDNS's image, applies its manifest and waits until the
/// `kube-dns` Service answers for the API server's name through
/// kube-proxy's rules.
pub fn deploy(layout: &Layout, components: &Components) -> Result<()> {
    let started = Instant::now();
    let reference = image();
    let archive = oci::build(
        &layout.state.join("images/coredns"),
        &oci::ImageSpec {
            reference: &reference,
            // Static (CGO off): the binary is the whole image.
            files: &[(components.coredns(), "/coredns".into())],
            links: &[],
            entrypoint: &["/coredns"],
            env: &[],
        },
    )?;
    images::import(layout, &archive, None)?;
    super::kubectl_apply(layout, components, &manifest())?;
    kubectl(
        layout,
        components,
        &[
            "rollout",
            "status",
            "-n",
            "kube-system",
            "deployment/coredns",
            "--timeout=120s",
        ],
    )
    .context("CoreDNS not Ready")?;
    let api_service: IpAddr = super::API_SERVICE_IP.parse()?;
    super::wait_for(layout, "kube-proxy", Duration::from_secs(30), || {
        lookup(layout, API_SERVICE_NAME).is_ok_and(|a| a.contains(&api_service))
    })
    .with_context(|| format!("{DNS_SERVICE_IP} does not resolve {API_SERVICE_NAME}"))?;
    println!(
        "CoreDNS {COREDNS} answering at {DNS_SERVICE_IP} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The IPv4 addresses the cluster's DNS gives `name`, asked from the node
/// (busybox's `nslookup`, A only).
fn lookup(layout: &Layout, name: &str) -> Result<Vec<IpAddr>> {
    let out = in_node(layout, "busybox")
        .args(["nslookup", "-type=a", name, DNS_SERVICE_IP])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "nslookup {name}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(nslookup_addresses(&stdout))
}

/// The addresses busybox's `nslookup` printed for the name asked, not the
/// server's own (which it prints first, before the `Name:` line).
pub fn nslookup_addresses(output: &str) -> Vec<IpAddr> {
    output
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("Name:"))
        .filter(|l| l.trim_start().starts_with("Address"))
        .flat_map(|l| l.split_whitespace().filter_map(|w| w.parse().ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifest_names_the_image_and_the_kubelets_cluster_dns() {
        let manifest = manifest();
        assert!(manifest.contains(&format!("image: {}", image())));
        assert!(manifest.contains(&format!("clusterIP: {DNS_SERVICE_IP}\n")));
        assert!(!manifest.contains("COREDNS_IMAGE") && !manifest.contains("clusterIP: DNS_"));
        // No forward: the pod's resolv.conf is the node's, which names the
        // Service itself.
        assert!(
            !manifest
                .lines()
                .any(|l| l.trim_start().starts_with("forward"))
        );
    }

    #[test]
    fn nslookup_addresses_are_the_names_not_the_servers() {
        let current = "Server:\t\t10.96.0.10\nAddress:\t10.96.0.10:53\n\n\
            Name:\tweb.e2e.svc.cluster.local\nAddress: 10.96.31.7\n\n";
        assert_eq!(
            nslookup_addresses(current),
            ["10.96.31.7".parse::<IpAddr>().unwrap()]
        );
        let older = "Server:    10.96.0.10\nAddress 1: 10.96.0.10 kube-dns.kube-system.svc.cluster.local\n\n\
            Name:      kubernetes.default\nAddress 1: 10.96.0.1 kubernetes.default.svc.cluster.local\n";
        assert_eq!(
            nslookup_addresses(older),
            ["10.96.0.1".parse::<IpAddr>().unwrap()]
        );
        let failed = "Server:\t\t10.96.0.10\nAddress:\t10.96.0.10:53\n\n\
            ** server can't find nowhere.cluster.local: NXDOMAIN\n";
        assert!(nslookup_addresses(failed).is_empty());
    }
}
