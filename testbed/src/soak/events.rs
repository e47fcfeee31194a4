//! Pod events: what a cluster does to pods on a node, chosen at random.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde_json::json;

use super::{
    Soak,
    invariants::Want,
    world::{NAMESPACES, PodLabel, namespace_name},
};

impl Soak<'_> {
    /// One random event (weights: mostly creations and deletions).
    pub(super) async fn random_event(&mut self) -> Result<()> {
        let free = self.world.slots.iter().filter(|s| s.is_free()).count();
        let live: Vec<usize> = (0..self.world.slots.len())
            .filter(|&i| self.world.slots[i].pod.is_some())
            .collect();
        // Keep the node between a quarter and all of its slots busy.
        let create = if free == 0 { 0 } else { 30 };
        let delete = if live.len() * 4 <= self.world.slots.len() {
            0
        } else {
            25
        };
        match self.rng.weighted(&[create, delete, 10, 12, 5, 12]) {
            0 => self.create_pod(true).await,
            1 => {
                let slot = live[self.rng.below(live.len())];
                let vanish_first = self.rng.chance(0.4);
                self.delete_pod(slot, vanish_first)
            }
            2 => {
                let slot = live[self.rng.below(live.len())];
                self.relabel_pod(slot);
                Ok(())
            }
            3 if !live.is_empty() => {
                let slot = live[self.rng.below(live.len())];
                self.restart_container(slot)
            }
            4 => {
                self.relabel_namespace();
                Ok(())
            }
            _ => {
                // Nothing changes: a quiet moment.
                Ok(())
            }
        }
    }

    /// What every pod must come to now; `at` is when its event happened.
    pub(super) fn refresh_wants(&mut self, at: Instant) {
        let mut wants = Vec::new();
        let ns_ambient = self.world.ns_ambient;
        let looks_ambient: Vec<bool> = self
            .world
            .slots
            .iter()
            .map(|slot| {
                slot.pod
                    .as_ref()
                    .is_some_and(|p| self.world.may_look_ambient(p))
            })
            .collect();
        for (slot, looks_ambient) in self.world.slots.iter_mut().zip(looks_ambient) {
            if let Some(pod) = &mut slot.pod {
                let known = pod.listed || pod.cni_added;
                let want = if known && super::world::is_ambient(&ns_ambient, pod) {
                    pod.ever_ambient = true;
                    Want::Held
                } else {
                    pod.ever_ambient |= known && looks_ambient;
                    Want::Gone
                };
                wants.push((
                    pod.uid.clone(),
                    label(pod.namespace, &pod.name),
                    pod.netns_inode,
                    want,
                ));
            }
            if let Some(ghost) = &slot.ghost {
                wants.push((
                    ghost.uid.clone(),
                    label(ghost.namespace, &ghost.name),
                    ghost.netns_inode,
                    Want::Either,
                ));
            }
        }
        let mut tracker = self.tracker();
        for (uid, label, inode, want) in wants {
            tracker.want(&uid, &label, inode, want, at);
        }
    }

    /// Creates a pod in a free slot: its object with IPs at once (the kube
    /// source enrols it), or, when `cni` allows and the dice say so, Pending
    /// first, CNI ADD through `ambpf-cni` (the agent enrols it before
    /// answering), then Running with its IPs.
    pub(super) async fn create_pod(&mut self, cni: bool) -> Result<()> {
        let Some(slot) = (0..self.world.slots.len()).find(|&i| {
            // Not always the first free slot: spread over the node.
            self.world.slots[i].is_free()
        }) else {
            return Ok(());
        };
        let free: Vec<usize> = (0..self.world.slots.len())
            .filter(|&i| self.world.slots[i].is_free())
            .collect();
        let slot = free
            .get(self.rng.below(free.len()))
            .copied()
            .unwrap_or(slot);
        let namespace = self.rng.below(NAMESPACES);
        let label = match self.rng.weighted(&[70, 15, 15]) {
            0 => PodLabel::Inherit,
            1 => PodLabel::Ambient,
            _ => PodLabel::OptOut,
        };
        let mut pod = self.world.new_pod(slot, namespace, label)?;
        let via_cni = cni && !self.api_down && self.agent.pid().is_some() && self.rng.chance(0.5);
        let at = Instant::now();
        if via_cni {
            self.world.apply_pod(slot, &pod);
            let netns = self.world.netns_path(slot);
            let [v4, v6] = self.world.cluster.pods[slot].ips();
            // As a runtime does, a retryable failure (CNI code 11: no
            // ztunnel connected yet after an agent restart, a NACK) is
            // retried; the agent left nothing of the failed attempt.
            let deadline = Instant::now() + CNI_RETRY_BOUND;
            let output = loop {
                let output = cni_add(
                    &self.cfg.cni_plugin,
                    &self.agent.cni_socket,
                    &netns,
                    &namespace_name(namespace),
                    &pod.name,
                    &pod.uid,
                    &[v4.to_string(), v6.to_string()],
                )
                .await?;
                if output.status.success() || !is_retryable(&output) || Instant::now() > deadline {
                    break output;
                }
                *self.events.entry("CNI ADD retried (code 11)").or_default() += 1;
                tokio::time::sleep(CNI_RETRY_DELAY).await;
            };
            *self.events.entry("create (CNI ADD)").or_default() += 1;
            if !output.status.success() {
                self.violation(
                    "cni",
                    format!(
                        "CNI ADD of {} failed ({}): {} {}",
                        label_of(&pod),
                        output.status,
                        String::from_utf8_lossy(&output.stdout),
                        String::from_utf8_lossy(&output.stderr)
                    ),
                );
            } else if self.world.is_ambient(&pod) {
                // Enrolled before ADD returns: held by ztunnel by now.
                pod.cni_added = true;
            }
        } else {
            *self.events.entry("create").or_default() += 1;
        }
        pod.listed = true;
        self.world.apply_pod(slot, &pod);
        self.world.slots[slot].pod = Some(pod);
        self.refresh_wants(at);
        Ok(())
    }

    /// Deletes the pod in `slot`: the object first, then its sandbox; or,
    /// with `vanish_first`, its namespace goes first and the object some
    /// time later.
    pub(super) fn delete_pod(&mut self, slot: usize, vanish_first: bool) -> Result<()> {
        let Some(pod) = self.world.slots[slot].pod.take() else {
            return Ok(());
        };
        let at = Instant::now();
        let (uid, name, namespace, inode) = (
            pod.uid.clone(),
            pod.name.clone(),
            pod.namespace,
            pod.netns_inode,
        );
        if vanish_first {
            drop(pod);
            self.world.recycle(slot)?;
            self.world.slots[slot].ghost = Some(super::world::Ghost {
                uid,
                name,
                namespace,
                netns_inode: inode,
            });
            let when = Instant::now() + self.rng.millis(200, 3000);
            self.ghost_deletes.push((slot, when));
            *self.events.entry("delete (netns gone first)").or_default() += 1;
            self.refresh_wants(at);
        } else {
            self.world.delete_object(namespace, &name);
            self.tracker()
                .want(&uid, &label(namespace, &name), inode, Want::Gone, at);
            drop(pod);
            self.world.recycle(slot)?;
            *self.events.entry("delete").or_default() += 1;
        }
        Ok(())
    }

    /// Deletes the objects of pods whose namespace vanished, when due (all
    /// of them with `all`).
    pub(super) fn due_ghost_deletes(&mut self, all: bool) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.ghost_deletes)
            .into_iter()
            .partition(|&(_, when)| all || when <= now);
        self.ghost_deletes = later;
        for (slot, _) in due {
            if let Some(ghost) = self.world.slots[slot].ghost.take() {
                self.world.delete_object(ghost.namespace, &ghost.name);
                self.tracker().want(
                    &ghost.uid,
                    &label(ghost.namespace, &ghost.name),
                    ghost.netns_inode,
                    Want::Gone,
                    now,
                );
            }
        }
    }

    /// The pod's own label changes: opt out, opt in, or back to its
    /// namespace's choice. Its connections are closed (its redirection
    /// changes on purpose).
    pub(super) fn relabel_pod(&mut self, slot: usize) {
        let at = Instant::now();
        let next = self.rng.below(2);
        let Some(pod) = self.world.slots[slot].pod.as_mut() else {
            return;
        };
        let others: Vec<PodLabel> = [PodLabel::Inherit, PodLabel::Ambient, PodLabel::OptOut]
            .into_iter()
            .filter(|l| *l != pod.label)
            .collect();
        pod.label = others[next];
        pod.conns = None;
        let pod = self.world.slots[slot].pod.as_ref().expect("checked above");
        self.world.apply_pod(slot, pod);
        *self.events.entry("relabel pod").or_default() += 1;
        self.refresh_wants(at);
    }

    /// A namespace's ambient label toggles.
    pub(super) fn relabel_namespace(&mut self) {
        let at = Instant::now();
        let i = self.rng.below(NAMESPACES);
        let ambient = !self.world.ns_ambient[i];
        self.world.set_namespace_ambient(i, ambient);
        for slot in &mut self.world.slots {
            if let Some(pod) = slot.pod.as_mut().filter(|p| p.namespace == i) {
                pod.conns = None;
            }
        }
        *self.events.entry("relabel namespace").or_default() += 1;
        self.refresh_wants(at);
    }

    /// The pod's process is replaced; its namespace stays.
    pub(super) fn restart_container(&mut self, slot: usize) -> Result<()> {
        let netns = self.world.netns_path(slot);
        if let Some(pod) = self.world.slots[slot].pod.as_mut() {
            pod.restart_process(&netns)?;
            *self.events.entry("container restart").or_default() += 1;
        }
        Ok(())
    }
}

pub(super) fn label(namespace: usize, name: &str) -> String {
    format!("{}/{name}", namespace_name(namespace))
}

fn label_of(pod: &super::world::Pod) -> String {
    label(pod.namespace, &pod.name)
}

/// How long a pod's retryable CNI ADD failures are retried, as kubelet
/// retries RunPodSandbox, before one counts as a violation.
const CNI_RETRY_BOUND: Duration = Duration::from_secs(15);
const CNI_RETRY_DELAY: Duration = Duration::from_millis(200);

/// Whether the plugin's CNI error says a new attempt may succeed (code 11,
/// "try again later").
fn is_retryable(output: &std::process::Output) -> bool {
    serde_json::from_slice::<serde_json::Value>(&output.stdout)
        .is_ok_and(|error| error["code"] == 11)
}

/// Runs `ambpf-cni` ADD for a pod as a container runtime does.
async fn cni_add(
    plugin: &Path,
    socket: &Path,
    netns: &Path,
    namespace: &str,
    name: &str,
    uid: &str,
    ips: &[String; 2],
) -> Result<std::process::Output> {
    let config = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "ambpf-cni",
        "agentSocket": socket,
        "agentTimeoutSeconds": 20,
        "prevResult": {
            "cniVersion": "1.0.0",
            "interfaces": [{ "name": "eth0", "sandbox": netns }],
            "ips": [
                { "address": format!("{}/24", ips[0]), "interface": 0 },
                { "address": format!("{}/64", ips[1]), "interface": 0 },
            ],
            "routes": [{ "dst": "0.0.0.0/0" }, { "dst": "::/0" }],
            "dns": {}
        },
    });
    let mut command = Command::new(plugin);
    command
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", format!("soak-{uid}"))
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .env(
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID=soak;K8S_POD_UID={uid}"
            ),
        );
    let input = config.to_string();
    let output = tokio::task::spawn_blocking(move || {
        crate::output_with_stdin(&mut command, input.as_bytes())
    })
    .await??;
    Ok(output)
}
