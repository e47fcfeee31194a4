//! `ambpf-node`: the testbed's containerd node (`ambpf_testbed::node`) for
//! manual use, usually through `cargo xtask node`. Starts containerd with its
//! CRI plugin, the real CNI plugins and the busybox image in a network
//! namespace and cgroup of its own, prints where everything is, and removes
//! it all on Ctrl-C (SIGINT or SIGTERM).

use ambpf_testbed::node::{Node, NodeConfig, image::IMAGE};
use anyhow::{Context as _, Result};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ambpf-node",
    about = "A containerd node in a box, until Ctrl-C"
)]
struct Cli {
    /// The pods' subnet (host-local IPAM, inside the node's namespace).
    #[arg(long, default_value = "10.88.0.0/24")]
    pod_subnet: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let node = Node::start(NodeConfig {
        pod_subnet: cli.pod_subnet,
    })
    .context("starting the node")?;
    let version = node.cri().await?.version().await?;
    println!(
        "{} {} (CRI {}) is up:",
        version.runtime_name, version.runtime_version, version.runtime_api_version
    );
    println!("  CRI socket      {}", node.socket().display());
    println!("  CNI conf dir    {}", node.cni_conf_dir().display());
    println!("  CNI bin dir     {}", node.cni_bin_dir().display());
    println!("  network netns   /run/netns/{}", node.netns.name());
    println!(
        "  pods' cgroups   {}/kubepods/...",
        node.cgroup_v2().display()
    );
    println!("  image           {IMAGE}");
    println!(
        "Chain ambpf: ambpf cni-install --conf-dir {} --bin-dir {} --agent-socket <agent's --cni-socket>",
        node.cni_conf_dir().display(),
        node.cni_bin_dir().display()
    );
    println!(
        "Run the agent in the node's namespace: ip netns exec {} ambpf run --cgroup {} --cni-socket ...",
        node.netns.name(),
        node.cgroup_v2().display()
    );
    println!("Ctrl-C removes everything.");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    drop(node);
    println!("removed");
    Ok(())
}
