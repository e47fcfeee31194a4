//! Faults at random moments, each bracketed by the connection check: every
//! live pod gets its long-lived connections before the fault, and after it
//! (once every pod has converged) each must still echo.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{Soak, conns::PodConns};
use crate::ztunnel::ZtunnelDouble;

/// How long a fault waits for the agent or ztunnel to come back.
const PATIENCE: Duration = Duration::from_secs(30);
/// How long a proxied connection's record may trail its echo (it comes from
/// the double's proxy process).
const RECORD_PATIENCE: Duration = Duration::from_secs(5);

impl Soak<'_> {
    pub(super) async fn fault(&mut self) -> Result<()> {
        self.open_conns().await;
        let kind = self.rng.weighted(&[3, 2, 2, 2, 2, 2]);
        let name = match kind {
            0 => self.agent_kill().await?,
            1 => self.agent_kill_mid_enrolment().await?,
            2 => self.agent_kill_mid_snapshot().await?,
            3 => self.ztunnel_double_restart().await?,
            4 => self.ztunnel_takeover().await?,
            _ => self.api_outage().await?,
        };
        eprintln!("soak: {:.1} s: {name}", self.elapsed_s());
        *self.faults.entry(name).or_default() += 1;
        self.settle().await;
        self.check_conns().await;
        Ok(())
    }

    /// Opens connections for every live pod that has none and is settled
    /// (held by ztunnel, or not ambient and not in it).
    pub(super) async fn open_conns(&mut self) {
        self.settle().await;
        let remote_ip = self.world.cluster.remote.ips()[0];
        let held = self.tracker().held_since();
        let double = self.double();
        for slot in 0..self.world.slots.len() {
            let Some(pod) = self.world.slots[slot].pod.as_ref() else {
                continue;
            };
            if pod.conns.is_some() || !pod.listed {
                continue;
            }
            let redirected = held.contains_key(&pod.netns_inode);
            let label = super::events::label(pod.namespace, &pod.name);
            let pod_ip = self.world.cluster.pods[slot].ips()[0];
            let opened = PodConns::open(
                &self.world.cluster.pods[slot].ns,
                pod_ip,
                &self.world.cluster.remote.ns,
                remote_ip,
                redirected,
            )
            .await;
            match opened {
                Ok(mut conns) => {
                    conns.generation = self.double_generation;
                    self.conn_stats.opened += 1;
                    if redirected {
                        // Both went through ztunnel: it recorded them (its
                        // proxy process reports records as they are made,
                        // so they may trail the echo a little).
                        let through = |s: &crate::ztunnel::ZtunnelState| {
                            let went = |port: u16, listener: u16| {
                                s.proxied
                                    .iter()
                                    .any(|p| p.client.port() == port && p.listener_port == listener)
                            };
                            (
                                went(conns.outbound_port, crate::ztunnel::OUTBOUND_PORT),
                                went(conns.inbound_port, crate::ztunnel::INBOUND_PLAINTEXT_PORT),
                            )
                        };
                        let _ = double
                            .wait_until(|s| through(s) == (true, true), RECORD_PATIENCE)
                            .await;
                        let (outbound, inbound) = double.inspect(through);
                        for (went, what) in [(outbound, "outbound"), (inbound, "inbound")] {
                            if !went {
                                self.violation(
                                    "redirect",
                                    format!(
                                        "{label}: ambient and held by ztunnel, but its {what} connection did not go through ztunnel"
                                    ),
                                );
                            }
                        }
                    }
                    if let Some(pod) = self.world.slots[slot].pod.as_mut() {
                        pod.conns = Some(conns);
                    }
                }
                Err(e) => self.violation(
                    "traffic",
                    format!("{label}: cannot open its connections: {e:#}"),
                ),
            }
        }
        // Long runs keep the double's records flat.
        double.take_proxied();
    }

    /// Every live pod's connections must still echo.
    pub(super) async fn check_conns(&mut self) {
        self.conn_round += 1;
        let round = self.conn_round;
        let mut failed = Vec::new();
        let double = self.double();
        for slot in &mut self.world.slots {
            let Some(pod) = slot.pod.as_mut() else {
                continue;
            };
            let Some(conns) = pod.conns.as_mut() else {
                continue;
            };
            match conns.check(round).await {
                Ok(()) => self.conn_stats.echoed += 1,
                Err(e) => {
                    failed.push(format!(
                        "{} ({}): {e:#}; ztunnel's last events for it: {}",
                        super::events::label(pod.namespace, &pod.name),
                        if conns.redirected {
                            "through ztunnel"
                        } else {
                            "direct"
                        },
                        super::checks::ztunnel_history(&double, &pod.uid)
                    ));
                    pod.conns = None;
                }
            }
        }
        *self.checks.entry("connections echo").or_default() += 1;
        self.conn_stats.reset += failed.len() as u64;
        for detail in failed {
            self.violation("connection reset", detail);
        }
    }

    async fn restart_agent(&mut self) -> Result<()> {
        self.agent.start()?;
        let deadline = Instant::now() + PATIENCE;
        while !self.agent.cni_ready() {
            self.agent.check_running()?;
            anyhow::ensure!(
                Instant::now() < deadline,
                "the restarted agent served no CNI endpoint within {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// SIGKILL at a random moment; events go on while it is down.
    async fn agent_kill(&mut self) -> Result<&'static str> {
        self.agent.kill()?;
        for _ in 0..self.rng.below(3) {
            self.random_event().await?;
        }
        tokio::time::sleep(self.rng.millis(0, 1000)).await;
        self.restart_agent().await?;
        Ok("agent SIGKILL + restart")
    }

    /// SIGKILL right after a burst of new ambient pods (or a namespace
    /// turning ambient): while it enrols them.
    async fn agent_kill_mid_enrolment(&mut self) -> Result<&'static str> {
        let off: Vec<usize> = (0..self.world.ns_ambient.len())
            .filter(|&i| !self.world.ns_ambient[i])
            .collect();
        if !off.is_empty() && self.rng.chance(0.3) {
            let i = off[self.rng.below(off.len())];
            let at = Instant::now();
            self.world.set_namespace_ambient(i, true);
            for slot in &mut self.world.slots {
                if let Some(pod) = slot.pod.as_mut().filter(|p| p.namespace == i) {
                    pod.conns = None;
                }
            }
            self.refresh_wants(at);
            *self.events.entry("relabel namespace").or_default() += 1;
        } else {
            for _ in 0..5 {
                self.create_pod(false).await?;
            }
        }
        tokio::time::sleep(self.rng.millis(0, 40)).await;
        self.agent.kill()?;
        tokio::time::sleep(self.rng.millis(100, 500)).await;
        self.restart_agent().await?;
        Ok("agent SIGKILL mid-enrolment")
    }

    /// SIGKILL, restart, and SIGKILL again once the new agent has sent
    /// ztunnel part of its snapshot.
    async fn agent_kill_mid_snapshot(&mut self) -> Result<&'static str> {
        self.agent.kill()?;
        let double = self.double();
        let connections = double.inspect(|s| s.connections.len());
        self.restart_agent().await?;
        // A snapshot of a few pods takes a millisecond or two: watched from
        // a thread of its own, spinning, which kills the agent the moment
        // the double has some of it.
        let pid = self.agent.pid().unwrap_or(0);
        let hit = tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + PATIENCE;
            while Instant::now() < deadline {
                let (partial, done) = double.inspect(|s| match s.connections.get(connections..) {
                    Some([.., c]) => (!c.added.is_empty() && !c.snapshot_sent, c.snapshot_sent),
                    _ => (false, false),
                });
                if partial {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    return true;
                }
                if done {
                    return false;
                }
                std::thread::yield_now();
            }
            false
        })
        .await?;
        self.agent.kill()?;
        if hit {
            self.mid_snapshot_hits += 1;
        }
        self.restart_agent().await?;
        Ok("agent SIGKILL mid-snapshot")
    }

    /// ztunnel's connection breaks twice in a row (the second while the
    /// agent replays its snapshot); its proxies keep running.
    async fn ztunnel_double_restart(&mut self) -> Result<&'static str> {
        let double = self.double();
        for _ in 0..2 {
            let before = double.inspect(|s| s.connections.len());
            double.disconnect();
            double
                .wait_until(|s| s.connections.len() > before && s.connected, PATIENCE)
                .await
                .map_err(|e| anyhow::anyhow!("ztunnel did not reconnect: {e}"))?;
        }
        Ok("ztunnel double restart")
    }

    /// A new ztunnel connects and takes over; the old one drains: the
    /// connections it proxied end with it (closed here, not counted as
    /// resets), then it stops.
    async fn ztunnel_takeover(&mut self) -> Result<&'static str> {
        let new = ZtunnelDouble::connect_with_retry(&self.agent.zds_socket, self.cfg.ztunnel());
        new.wait_until(|s| s.ready, PATIENCE)
            .await
            .map_err(|e| anyhow::anyhow!("the new ztunnel never got ready: {e}"))
            .context("ztunnel takeover")?;
        let old = std::mem::replace(
            &mut *self.double.lock().unwrap_or_else(|p| p.into_inner()),
            Arc::new(new),
        );
        let old_generation = self.double_generation;
        self.double_generation += 1;
        for slot in &mut self.world.slots {
            if let Some(pod) = slot.pod.as_mut()
                && pod
                    .conns
                    .as_ref()
                    .is_some_and(|c| c.redirected && c.generation == old_generation)
            {
                pod.conns = None;
                self.conn_stats.ended_with_ztunnel += 1;
            }
        }
        // The observer may hold a clone for a moment; the last one stops it.
        drop(old);
        Ok("ztunnel takeover")
    }

    /// The API server goes away; pods change meanwhile; it comes back with
    /// every version the agent knows compacted (410: list again).
    async fn api_outage(&mut self) -> Result<&'static str> {
        self.world.api.shutdown().await;
        self.api_down = true;
        let until = Instant::now() + self.rng.millis(1000, 4000);
        while Instant::now() < until {
            self.random_event().await?;
            tokio::time::sleep(self.rng.millis(100, 500)).await;
        }
        self.world.api.expire();
        self.world.api.restart().await?;
        self.api_down = false;
        Ok("API server outage + 410")
    }
}
