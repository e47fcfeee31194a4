//! The `control` measurements: churn (pods one at a time with the agent
//! running) and snapshot (pods present before the agent starts).

use super::*;

/// Waits (polling every millisecond, waking early on the double's changes)
/// until `done` holds; a hang after `timeout` is an error.
pub(super) async fn until(
    what: &str,
    timeout: Duration,
    agent: &mut Agent,
    double: Option<&ZtunnelDouble>,
    mut done: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut changes = double.map(ZtunnelDouble::subscribe);
    loop {
        if let Some(changes) = changes.as_mut() {
            changes.borrow_and_update();
        }
        if done() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{what}: not within {timeout:?}; the end of the agent's log:\n{}",
                agent.process.log_tail(20)
            );
        }
        agent.process.check_running()?;
        if let Some(stopped) = double.and_then(ZtunnelDouble::stopped) {
            bail!("{what}: the ztunnel double stopped: {stopped}");
        }
        match changes.as_mut() {
            Some(changes) => {
                let _ = tokio::time::timeout(Duration::from_millis(1), changes.changed()).await;
            }
            None => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}

pub(super) async fn connect_double(agent: &mut Agent, socket: &Path) -> Result<ZtunnelDouble> {
    until("the ZDS socket", TIMEOUT, agent, None, || {
        socket_exists(socket)
    })
    .await?;
    // ZDS only: starting in-pod proxies is ztunnel's cost, the same in both
    // modes, and would hide the agent's.
    let double = ZtunnelDouble::connect_with_retry(socket, ZtunnelConfig::zds_only());
    double
        .wait_until(|s| s.ready, TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("ztunnel not ready: {e:?}"))?;
    Ok(double)
}

pub(super) fn socket_exists(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

// ---------------------------------------------------------------------------
// Measurements

pub(super) async fn churn(
    env: &Env<'_>,
    pods: &[BenchPod],
    mode: Mode,
    run: usize,
) -> Result<Churn> {
    let socket = env.work.join(format!("churn-{}-{run}.sock", mode.name()));
    let log = env
        .work
        .join(format!("agent-churn-{}-{run}.log", mode.name()));
    let mut agent = spawn_kube_agent(env, mode, &socket, &log)?;
    let double = connect_double(&mut agent, &socket).await?;
    let pid = agent.pid();

    let mut add_ms = Vec::new();
    let mut annotate_ms = Vec::new();
    let cpu_before = bench::on_cpu(pid)?;
    for pod in pods {
        let patches_before = env.server.patches().len();
        let applied = Instant::now();
        env.server.apply("pods", pod.object());
        let (mut added, mut annotated) = (None, None);
        until(
            &format!("{} enrolled", pod.name),
            TIMEOUT,
            &mut agent,
            Some(&double),
            || {
                if added.is_none() && double.inspect(|s| s.workloads.contains_key(&pod.uid)) {
                    added = Some(applied.elapsed());
                }
                if annotated.is_none()
                    && annotated_since(env.server, patches_before).contains(&pod.name)
                {
                    annotated = Some(applied.elapsed());
                }
                added.is_some() && annotated.is_some()
            },
        )
        .await?;
        add_ms.extend(added.map(ms));
        annotate_ms.extend(annotated.map(ms));
    }
    let create_cpu = bench::on_cpu(pid)?.saturating_sub(cpu_before);
    let status_pods = match mode {
        Mode::Ebpf => Some(agent.status_pods()?),
        _ => None,
    };
    if let Some(listed) = status_pods {
        ensure!(
            listed == pods.len(),
            "ambpf status lists {listed} pods, not {}",
            pods.len()
        );
    }

    let mut del_ms = Vec::new();
    let cpu_before = bench::on_cpu(pid)?;
    for pod in pods {
        let deleted = Instant::now();
        env.server
            .delete("pods", &pod.namespace, &pod.name)
            .context("the pod was not in the API server")?;
        let mut gone = None;
        until(
            &format!("{} removed", pod.name),
            TIMEOUT,
            &mut agent,
            Some(&double),
            || {
                if double.inspect(|s| !s.workloads.contains_key(&pod.uid)) {
                    gone = Some(deleted.elapsed());
                }
                gone.is_some()
            },
        )
        .await?;
        del_ms.extend(gone.map(ms));
    }
    let delete_cpu = bench::on_cpu(pid)?.saturating_sub(cpu_before);
    let memory_after = bench::memory(pid)?;
    double.shutdown().await;
    agent.stop()?;
    Ok(Churn {
        mode,
        run,
        add_ms,
        annotate_ms,
        del_ms,
        create_cpu_ms: ms(create_cpu),
        delete_cpu_ms: ms(delete_cpu),
        memory_after,
        status_pods,
    })
}

pub(super) async fn snapshot(
    env: &Env<'_>,
    pods: &[BenchPod],
    mode: Mode,
    run: usize,
    idle_secs: u64,
) -> Result<(Snapshot, ScrapeSeries)> {
    let n = pods.len();
    let patches_before = env.server.patches().len();
    for pod in pods {
        env.server.apply("pods", pod.object());
    }
    let socket = env
        .work
        .join(format!("snapshot-{}-{run}.sock", mode.name()));
    let log = env
        .work
        .join(format!("agent-snapshot-{}-{run}.log", mode.name()));
    let spawned = Instant::now();
    let mut agent = spawn_kube_agent(env, mode, &socket, &log)?;
    let pid = agent.pid();
    let scraper = Scraper::start(
        &env.cluster.node.path(),
        spawned,
        SCRAPE_INTERVAL,
        mode == Mode::Ebpf,
    )?;
    until("the ZDS socket", timeout_for(n), &mut agent, None, || {
        socket_exists(&socket)
    })
    .await?;
    let programmed = spawned.elapsed();
    let double = ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::zds_only());
    let mut names: std::collections::HashSet<String> = Default::default();
    let (mut at_ztunnel, mut annotated) = (None, None);
    until(
        "every pod",
        timeout_for(n),
        &mut agent,
        Some(&double),
        || {
            if at_ztunnel.is_none() && double.inspect(|s| s.ready && s.workloads.len() == n) {
                at_ztunnel = Some(spawned.elapsed());
            }
            if annotated.is_none() {
                names.extend(annotated_since(env.server, patches_before));
                if names.len() == n {
                    annotated = Some(spawned.elapsed());
                }
            }
            at_ztunnel.is_some() && annotated.is_some()
        },
    )
    .await?;
    let enrolled = Instant::now();
    let agent_cpu = bench::cpu_time(pid)?.total();
    let memory = bench::memory(pid)?;
    if mode == Mode::Ebpf {
        let listed = agent.status_pods()?;
        ensure!(listed == n, "ambpf status lists {listed} pods, not {n}");
    }
    let idle = match idle_secs {
        0 => None,
        secs => {
            scraper.pause(true);
            let idle = idle(pid, secs).await?;
            scraper.pause(false);
            Some(idle)
        }
    };
    // Scrapes with every pod's series; then (eBPF) with full maps, for
    // longer than the agent's count of their entries takes to come round.
    tokio::time::sleep(SCRAPE_ENROLLED).await;
    let filled = match mode {
        Mode::Ebpf => {
            fill_orig_maps(&agent.pin_root)?;
            let filled = Instant::now();
            tokio::time::sleep(SCRAPE_FULL_MAPS).await;
            Some(filled)
        }
        _ => None,
    };
    let removing = Instant::now();
    // Remove them through the API before stopping (iptables rules stay in
    // the pods' namespaces otherwise).
    for pod in pods {
        env.server.delete("pods", &pod.namespace, &pod.name);
    }
    until(
        "every pod removed",
        timeout_for(n),
        &mut agent,
        Some(&double),
        || double.inspect(|s| s.workloads.is_empty()),
    )
    .await?;
    let (scrapes, series) = figures(scraper, spawned, enrolled, filled, removing)?;
    double.shutdown().await;
    agent.stop()?;
    Ok((
        Snapshot {
            mode,
            run,
            pods: n,
            programmed_ms: ms(programmed),
            ztunnel_ms: at_ztunnel.map_or(f64::NAN, ms),
            annotated_ms: annotated.map_or(f64::NAN, ms),
            agent_cpu_ms: ms(agent_cpu),
            memory,
            scrapes,
            idle,
        },
        series,
    ))
}

/// The agent holding every pod with nothing changing: its CPU and RSS,
/// second by second.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Idle {
    /// CPU time per second of wall clock (1.0: one CPU), each second.
    pub(super) cpu_share: Vec<f64>,
    /// RSS at the end of each second.
    pub(super) rss_kib: Vec<u64>,
}

/// Samples the idle agent `pid` once a second for `secs` seconds.
async fn idle(pid: u32, secs: u64) -> Result<Idle> {
    let mut out = Idle {
        cpu_share: Vec::new(),
        rss_kib: Vec::new(),
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let (mut cpu_before, mut at) = (bench::on_cpu(pid)?, Instant::now());
    for _ in 0..secs {
        tick.tick().await;
        let (cpu, now) = (bench::on_cpu(pid)?, Instant::now());
        out.cpu_share
            .push(cpu.saturating_sub(cpu_before).as_secs_f64() / (now - at).as_secs_f64());
        out.rss_kib.push(bench::memory(pid)?.vm_rss_kib);
        (cpu_before, at) = (cpu, now);
    }
    Ok(out)
}
