//! Runs the real `ambpf-cni` binary as a container runtime does, for the
//! CNI test binaries.

#![allow(dead_code)] // each test binary uses a different subset

use std::{
    path::Path,
    process::{Command, Output},
};

use ambpf::cni;
use serde_json::{Value, json};

/// The previous plugin's result, as a bridge/ptp plugin would report it.
pub fn prev_result(ip: &str) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [{ "name": "eth0", "sandbox": "/var/run/netns/x" }],
        "ips": [{ "address": format!("{ip}/24"), "gateway": "10.244.1.1", "interface": 0 }],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dns": {}
    })
}

/// The kubelet's `CNI_ARGS` for a pod.
pub fn k8s_args(namespace: &str, name: &str, uid: &str) -> String {
    format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID={uid}"
    )
}

pub fn plugin_for(
    command: &str,
    netns: &Path,
    cni_args: &str,
    socket: &Path,
    prev: &Value,
) -> Output {
    let config = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": cni::PLUGIN_TYPE,
        "agentSocket": socket,
        "agentTimeoutSeconds": 30,
        "prevResult": prev,
    });
    ambpf_testbed::output_with_stdin(
        Command::new(env!("CARGO_BIN_EXE_ambpf-cni"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", "c0ffee")
            .env("CNI_NETNS", netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/opt/cni/bin")
            .env("CNI_ARGS", cni_args),
        config.to_string().as_bytes(),
    )
    .unwrap()
}

pub fn stdout_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {:?}, stderr {:?}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}
