//! The node's CNI configuration in another installer's hands: the conflist
//! rewritten without ambpf's entry, then rewritten in a loop while ambpf
//! re-chains. ambpf must re-chain within seconds, log it once, keep the
//! other installer's change and end with its entry exactly once; a new
//! ambient pod must then start captured, a plain one not (the ztunnel
//! double's log).

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use serde_json::{Value, json};

use super::bad_input::{agent_pod, lines_with, log_of};
use super::client::{Cluster, Release};
use super::eventually;
use super::scenarios::{client_pod, ensure_web, outbound_proxied, pod_phase};

/// The plugin type ambpf chains.
const PLUGIN_TYPE: &str = "ambpf-cni";
/// A key another installer's version of the conflist carries.
const GENERATION_KEY: &str = "ambpf-e2e-generation";

/// The node's conflist, as another installer rewrites it: ambpf's entry
/// dropped, `generation` set.
fn without_ambpf(conflist: &Value, generation: &str) -> Result<String> {
    let mut list = conflist.clone();
    list["plugins"]
        .as_array_mut()
        .context("no plugins")?
        .retain(|p| p["type"] != PLUGIN_TYPE);
    list[GENERATION_KEY] = json!("GENERATION");
    Ok(serde_json::to_string_pretty(&list)?.replace("\"GENERATION\"", generation))
}

/// ambpf's entries in the conflist and its generation, if it parses.
fn chained(cluster: &Cluster, path: &str) -> Result<(usize, Value)> {
    let list: Value = serde_json::from_str(&cluster.on_node("cat", &[path])?)
        .with_context(|| format!("{path} is not JSON"))?;
    let ours = list["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["type"] == PLUGIN_TYPE)
        .count();
    Ok((ours, list[GENERATION_KEY].clone()))
}

/// Runs `script` with `sh` on the node, `input` on its stdin.
fn sh_on_node(cluster: &Cluster, script: &str, input: &[u8]) -> Result<()> {
    let mut cmd = crate::kube::in_node(&cluster.layout, "sh");
    cmd.args(["-c", script]);
    let out = crate::output_with_stdin(&mut cmd, input)?;
    ensure!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Replaces `path` on the node with `bytes`, atomically (as installers do).
fn replace_on_node(cluster: &Cluster, path: &str, bytes: &[u8]) -> Result<()> {
    sh_on_node(
        cluster,
        &format!("cat > '{path}.e2e-tmp' && mv '{path}.e2e-tmp' '{path}'"),
        bytes,
    )
}

/// The conflist rewritten by another installer without ambpf's entry:
/// re-chained within seconds, logged once, the other installer's change
/// kept; then a racing installer rewriting it 100 times: it ends valid,
/// with ambpf's entry once and the racer's last change; a new ambient pod
/// then starts captured, a plain one not.
pub fn conflist_rewritten(cluster: &Cluster, release: &Release) -> Result<String> {
    let conf_dir = "/etc/cni/net.d";
    let name = cluster
        .on_node("ls", &["-1", conf_dir])?
        .lines()
        .filter(|f| f.ends_with(".conflist"))
        .min()
        .map(str::to_owned)
        .context("no conflist on the node")?;
    let path = format!("{conf_dir}/{name}");
    let original = cluster.on_node("cat", &[&path])?;
    let conflist: Value = serde_json::from_str(&original)?;
    let result = rewrite_and_race(cluster, release, &path, &conflist);
    replace_on_node(cluster, &path, original.as_bytes())?;
    result
}

fn rewrite_and_race(
    cluster: &Cluster,
    release: &Release,
    path: &str,
    conflist: &Value,
) -> Result<String> {
    let (agent, _) = agent_pod(cluster)?;
    let logged = |cluster: &Cluster| -> Result<usize> {
        Ok(lines_with(
            &log_of(cluster, &agent, "cni-installer", false)?,
            &["re-chained ambpf-cni into"],
        ))
    };
    let logged_before = logged(cluster)?;
    let rewritten_at = Instant::now();
    replace_on_node(cluster, path, without_ambpf(conflist, "1")?.as_bytes())?;
    eventually("ambpf re-chained", Duration::from_secs(30), || {
        let (ours, generation) = chained(cluster, path)?;
        ensure!(ours <= 1, "ambpf chained {ours} times");
        ensure!(generation == 1, "the other installer's change was lost");
        Ok((ours == 1).then_some(()))
    })?;
    let rechained_in = rewritten_at.elapsed();
    // The log is read once the line had time to be written.
    std::thread::sleep(Duration::from_secs(2));
    let lines = logged(cluster)? - logged_before;
    ensure!(lines == 1, "the re-chaining was logged {lines} times");

    // Another installer rewriting the file every 50 ms, from its template.
    const RACES: u32 = 100;
    sh_on_node(
        cluster,
        &format!(
            "cat > /run/ambpf-e2e-conflist && i=0 && while [ $i -lt {RACES} ]; do \
             i=$((i+1)); sed \"s/GENERATION/$i/\" /run/ambpf-e2e-conflist > '{path}.racer' && \
             mv '{path}.racer' '{path}'; sleep 0.05; done; rm -f /run/ambpf-e2e-conflist"
        ),
        without_ambpf(conflist, "GENERATION")?.as_bytes(),
    )?;
    eventually(
        "ambpf chained after the race",
        Duration::from_secs(30),
        || {
            let (ours, generation) = chained(cluster, path)?;
            ensure!(ours <= 1, "ambpf chained {ours} times");
            ensure!(
                generation == RACES,
                "the racing installer's last change was lost: generation {generation}"
            );
            Ok((ours == 1).then_some(()))
        },
    )?;

    // The chain works: a new ambient pod's first connection is captured.
    let ambient = format!("e2e-{}-conflist", release.mode);
    let plain = format!("{ambient}-plain");
    ensure_web(cluster, &ambient, true)?;
    ensure_web(cluster, &plain, false)?;
    for (namespace, captured) in [(&ambient, true), (&plain, false)] {
        let pod = client_pod(cluster, namespace)?;
        eventually(
            &format!("{namespace}/{pod} done"),
            Duration::from_secs(90),
            || Ok((pod_phase(cluster, namespace, &pod)? == "Succeeded").then_some(())),
        )?;
        let uid = cluster.get_json(&["pod", "-n", namespace, &pod])?["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        ensure!(
            outbound_proxied(cluster, &uid)? == captured,
            "{namespace}/{pod}: captured is not {captured}"
        );
    }
    cluster.kubectl(&["delete", "namespace", &ambient, &plain, "--wait=false"])?;
    Ok(format!(
        "re-chained {:.1} s after a rewrite, logged once; after {RACES} racing rewrites ambpf's \
         entry once and the racer's last change kept; new ambient pod captured, plain one not",
        rechained_in.as_secs_f64()
    ))
}
