//! The node's certificates and kubeconfigs, made with Debian's `openssl`:
//! one CA signs etcd's and the API server's serving certificates and every
//! client's, as kubeadm lays them out (ECDSA P-256 keys, which every
//! component takes and which are quick to make).

use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, Result};

use super::{Layout, run_checked};

/// One client identity: file stem, common name (the user) and organisation
/// (the group).
pub const CLIENTS: [(&str, &str, Option<&str>); 6] = [
    ("admin", "kubernetes-admin", Some("system:masters")),
    ("apiserver-etcd-client", "kube-apiserver-etcd-client", None),
    (
        "apiserver-kubelet-client",
        "kube-apiserver-kubelet-client",
        Some("system:masters"),
    ),
    ("controller-manager", "system:kube-controller-manager", None),
    ("scheduler", "system:kube-scheduler", None),
    ("kube-proxy", "system:kube-proxy", None),
];

/// Writes everything under `layout.pki()` unless the CA is already there.
pub fn create(layout: &Layout) -> Result<()> {
    let pki = layout.pki();
    if pki.join("ca.crt").exists() {
        return Ok(());
    }
    fs::create_dir_all(&pki)?;
    run_checked(
        openssl(&pki)
            .args(["req", "-x509", "-nodes", "-days", "3650"])
            .args(EC_KEY)
            .args([
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-subj",
                "/CN=ambpf-cluster-ca",
            ])
            .args(["-addext", "basicConstraints=critical,CA:TRUE"])
            .args([
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            ]),
    )?;
    let node_ip = super::NODE_IP;
    let api_service_ip = super::API_SERVICE_IP;
    leaf(
        &pki,
        "etcd-server",
        "/CN=etcd",
        Some("IP:127.0.0.1,DNS:localhost"),
        "serverAuth,clientAuth",
    )?;
    leaf(
        &pki,
        "apiserver",
        "/CN=kube-apiserver",
        Some(&format!(
            "IP:127.0.0.1,IP:{node_ip},IP:{api_service_ip},DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,\
             DNS:kubernetes.default.svc.cluster.local"
        )),
        "serverAuth",
    )?;
    for (stem, user, group) in CLIENTS {
        let subject = match group {
            Some(g) => format!("/O={g}/CN={user}"),
            None => format!("/CN={user}"),
        };
        leaf(&pki, stem, &subject, None, "clientAuth")?;
    }
    let node = super::NODE_NAME;
    leaf(
        &pki,
        "kubelet",
        &format!("/O=system:nodes/CN=system:node:{node}"),
        None,
        "clientAuth",
    )?;
    // Service-account tokens are signed with their own key.
    run_checked(openssl(&pki).args([
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        "sa.key",
    ]))?;
    run_checked(openssl(&pki).args(["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"]))?;
    Ok(())
}

const EC_KEY: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];

fn leaf(pki: &Path, stem: &str, subject: &str, sans: Option<&str>, usage: &str) -> Result<()> {
    let mut cmd = openssl(pki);
    cmd.args([
        "req", "-x509", "-nodes", "-days", "365", "-CA", "ca.crt", "-CAkey", "ca.key",
    ])
    .args(EC_KEY)
    .args([
        "-keyout",
        &format!("{stem}.key"),
        "-out",
        &format!("{stem}.crt"),
    ])
    .args(["-subj", subject])
    .args(["-addext", "basicConstraints=critical,CA:FALSE"])
    .args([
        "-addext",
        "keyUsage=critical,digitalSignature,keyEncipherment",
    ])
    .args(["-addext", &format!("extendedKeyUsage={usage}")]);
    if let Some(sans) = sans {
        cmd.args(["-addext", &format!("subjectAltName={sans}")]);
    }
    run_checked(&mut cmd).with_context(|| format!("issuing {stem}.crt"))
}

fn openssl(dir: &Path) -> Command {
    let mut cmd = Command::new("openssl");
    cmd.current_dir(dir);
    cmd
}

/// A kubeconfig for one of the clients above, or `kubelet`.
pub fn kubeconfig(layout: &Layout, stem: &str, server: &str) -> Result<std::path::PathBuf> {
    let pki = layout.pki();
    let path = layout.state.join("etc").join(format!("{stem}.kubeconfig"));
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: ambpf\n  cluster:\n    \
         certificate-authority: {ca}\n    server: {server}\nusers:\n- name: {stem}\n  user:\n    \
         client-certificate: {crt}\n    client-key: {key}\ncontexts:\n- name: ambpf\n  context:\n    \
         cluster: ambpf\n    user: {stem}\ncurrent-context: ambpf\n",
        ca = pki.join("ca.crt").display(),
        crt = pki.join(format!("{stem}.crt")).display(),
        key = pki.join(format!("{stem}.key")).display(),
    );
    fs::write(&path, text)?;
    Ok(path)
}
