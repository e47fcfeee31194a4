//! The agent's processes on the node and what they cost: CPU time from
//! `/proc/<pid>/stat` (clock ticks, `sysconf(_SC_CLK_TCK)`, 100 here),
//! resident memory from `/proc/<pid>/status`. The node shares the machine's
//! PID namespace, so containerd's PIDs are this program's.

use std::{collections::HashMap, fs, time::Instant};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;

use crate::kube::e2e::{Agent, Cluster, SYSTEM_NAMESPACE};

/// Clock-tick counters of `/proc/<pid>/stat`: fields 14-17.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProcStat {
    pub utime: u64,
    pub stime: u64,
    /// Of children it waited for (Istio's agent and ambpf's iptables and
    /// nftables modes run `iptables-restore`/`nft` as children).
    pub cutime: u64,
    pub cstime: u64,
}

impl ProcStat {
    /// The process's own and its reaped children's ticks.
    pub fn total(&self) -> u64 {
        self.utime + self.stime + self.cutime + self.cstime
    }
}

/// utime, stime, cutime, cstime of a `/proc/<pid>/stat` line. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted
/// from its last `)`.
pub fn parse_proc_stat(stat: &str) -> Option<ProcStat> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    // After ')' comes field 3 (state): utime (14) is the 12th from there.
    let mut fields = after_comm.split_whitespace().skip(11);
    let mut next = || fields.next()?.parse::<u64>().ok();
    Some(ProcStat {
        utime: next()?,
        stime: next()?,
        cutime: next()?,
        cstime: next()?,
    })
}

/// `VmRSS` of a `/proc/<pid>/status`, in KiB.
pub fn parse_vm_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// `ctr tasks ls`: `(container id, pid)` of each task.
pub fn parse_ctr_tasks(out: &str) -> HashMap<String, u32> {
    out.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let id = f.next()?;
            let pid = f.next()?.parse().ok()?;
            Some((id.to_owned(), pid))
        })
        .collect()
}

pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as u64 } else { 100 }
}

pub fn read_stat(pid: u32) -> Result<ProcStat> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("/proc/{pid}/stat"))?;
    parse_proc_stat(&stat).with_context(|| format!("unexpected /proc/{pid}/stat: {stat}"))
}

pub fn read_rss_kib(pid: u32) -> Result<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("/proc/{pid}/status"))?;
    parse_vm_rss_kib(&status).with_context(|| format!("no VmRSS in /proc/{pid}/status"))
}

/// The agent's pod's containers' main processes.
#[derive(Clone, Debug, Serialize)]
pub struct AgentProcesses {
    /// The node agent proper ([`Agent::agent_container`]).
    pub agent_pid: u32,
    /// Every container of the pod, `(container, pid)`, the agent's included.
    pub containers: Vec<(String, u32)>,
}

impl AgentProcesses {
    /// The agent's pod on the node: each container's task PID from
    /// containerd (by the container ID in the pod's status), checked
    /// against its command line (ambpf's `agent` runs `ambpf ... run`,
    /// Istio's `install-cni`).
    pub fn find(cluster: &Cluster, agent: Agent) -> Result<Self> {
        let (Some(selector), Some(main)) = (agent.pod_selector(), agent.agent_container()) else {
            bail!("{agent} runs no process");
        };
        let pods = cluster.get_json(&["pods", "-n", SYSTEM_NAMESPACE, "-l", selector])?;
        let pod = pods["items"]
            .as_array()
            .and_then(|p| p.first())
            .with_context(|| format!("no pod of {agent} ({selector})"))?;
        let tasks = parse_ctr_tasks(&cluster.ctr(&["tasks", "ls"])?);
        let mut containers = Vec::new();
        for status in pod["status"]["containerStatuses"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let name = status["name"].as_str().unwrap_or_default();
            let id = status["containerID"].as_str().unwrap_or_default();
            let id = id.split_once("://").map_or(id, |(_, id)| id);
            let pid = *tasks
                .get(id)
                .with_context(|| format!("{agent}'s container {name} ({id}) has no task"))?;
            containers.push((name.to_owned(), pid));
        }
        let agent_pid = containers
            .iter()
            .find(|(name, _)| name == main)
            .map(|(_, pid)| *pid)
            .with_context(|| format!("{agent}'s pod has no container {main}"))?;
        let cmdline = fs::read(format!("/proc/{agent_pid}/cmdline"))?;
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !is_agent_command(agent, &argv) {
            bail!("pid {agent_pid} of {agent}'s {main} runs {argv:?}, not the agent");
        }
        Ok(Self {
            agent_pid,
            containers,
        })
    }

    pub fn agent_stat(&self) -> Result<ProcStat> {
        read_stat(self.agent_pid)
    }

    /// Resident memory: the agent's, and the pod's containers' together.
    pub fn rss_kib(&self) -> Result<(u64, u64)> {
        let mut all = 0;
        for (_, pid) in &self.containers {
            all += read_rss_kib(*pid)?;
        }
        Ok((read_rss_kib(self.agent_pid)?, all))
    }
}

fn is_agent_command(agent: Agent, argv: &[String]) -> bool {
    let program = argv.first().map(|p| p.rsplit('/').next().unwrap_or(p));
    if agent.is_istio() {
        program == Some("install-cni")
    } else {
        program == Some("ambpf") && argv.iter().any(|a| a == "run")
    }
}

/// CPU used between two reads of a [`ProcStat`], as a share of one CPU.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CpuShare {
    pub ticks: u64,
    pub seconds: f64,
    pub cpu_ms: f64,
    pub percent: f64,
}

pub fn cpu_share(
    before: &ProcStat,
    after: &ProcStat,
    elapsed_s: f64,
    ticks_per_second: u64,
) -> CpuShare {
    let ticks = after.total().saturating_sub(before.total());
    let cpu_s = ticks as f64 / ticks_per_second as f64;
    CpuShare {
        ticks,
        seconds: elapsed_s,
        cpu_ms: cpu_s * 1000.0,
        percent: if elapsed_s > 0.0 {
            100.0 * cpu_s / elapsed_s
        } else {
            0.0
        },
    }
}

/// The agent's CPU over `window` with nothing happening on the node.
pub fn idle_cpu(processes: &AgentProcesses, window: std::time::Duration) -> Result<CpuShare> {
    let before = processes.agent_stat()?;
    let started = Instant::now();
    std::thread::sleep(window);
    let after = processes.agent_stat()?;
    Ok(cpu_share(
        &before,
        &after,
        started.elapsed().as_secs_f64(),
        clock_ticks_per_second(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let stat = "4242 (ambpf (run) x) S 1 4242 4242 0 -1 4194560 1234 0 0 0 \
                    150 37 9 4 20 0 12 0 98765 123456789 2048 18446744073709551615";
        assert_eq!(
            parse_proc_stat(stat),
            Some(ProcStat {
                utime: 150,
                stime: 37,
                cutime: 9,
                cstime: 4
            })
        );
        assert_eq!(parse_proc_stat(stat).unwrap().total(), 200);
        assert_eq!(parse_proc_stat("12 (short) S 1 2"), None);
        let mine = fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_proc_stat(&mine).is_some());
    }

    #[test]
    fn rss_is_read_in_kib() {
        let status =
            "Name:\tinstall-cni\nVmPeak:\t  900000 kB\nVmRSS:\t   51234 kB\nRssAnon:\t 40000 kB\n";
        assert_eq!(parse_vm_rss_kib(status), Some(51234));
        assert_eq!(parse_vm_rss_kib("Name:\tkthreadd\n"), None);
    }

    #[test]
    fn ctr_tasks_map_containers_to_pids() {
        let out = "TASK                                                                PID      STATUS    \n\
                   3c1f0d9e2a                                                          12345    RUNNING\n\
                   77aa                                                                678      RUNNING\n";
        let tasks = parse_ctr_tasks(out);
        assert_eq!(tasks.len(), 2);
        assert_eq!(tasks["3c1f0d9e2a"], 12345);
        assert_eq!(tasks["77aa"], 678);
    }

    #[test]
    fn cpu_share_counts_children_and_divides_by_the_window() {
        let before = ProcStat {
            utime: 100,
            stime: 50,
            cutime: 0,
            cstime: 0,
        };
        let after = ProcStat {
            utime: 110,
            stime: 55,
            cutime: 3,
            cstime: 2,
        };
        let share = cpu_share(&before, &after, 30.0, 100);
        assert_eq!(share.ticks, 20);
        assert!((share.cpu_ms - 200.0).abs() < 1e-9);
        assert!((share.percent - 200.0 / 30_000.0 * 100.0).abs() < 1e-9);
    }

    #[test]
    fn the_agent_is_recognised_by_its_command_line() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(is_agent_command(
            Agent::AmbpfEbpf,
            &argv(&[
                "/usr/local/bin/ambpf",
                "--pin-root=/x",
                "run",
                "--redirect-mode=ebpf"
            ])
        ));
        assert!(!is_agent_command(
            Agent::AmbpfEbpf,
            &argv(&["/usr/local/bin/ambpf", "cni-install"])
        ));
        assert!(is_agent_command(
            Agent::IstioNftables,
            &argv(&["install-cni"])
        ));
        assert!(!is_agent_command(Agent::IstioIptables, &argv(&["/pause"])));
    }
}
