//! The agent under test: `ambpf run` with the kube source and the CNI
//! endpoint, in the node's namespace, on a bpffs that outlives it, so a
//! SIGKILLed agent's successor adopts what it pinned.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use anyhow::{Context as _, Result, ensure};
use nix::sys::signal::{Signal, kill};
use serde::Serialize;
use serde_json::Value;

use super::Mode;
use crate::{BpffsMount, CgroupGuard, NetnsGuard, bench::ProcessGuard};

pub struct Agent {
    binary: PathBuf,
    mode: Mode,
    pub pin_root: PathBuf,
    pub zds_socket: PathBuf,
    pub cni_socket: PathBuf,
    kubeconfig: PathBuf,
    cgroup: PathBuf,
    node: PathBuf,
    log: PathBuf,
    process: Option<ProcessGuard>,
    /// The running agent's pid (0: none), for the resource sampler.
    pid_cell: Arc<AtomicU32>,
    pub starts: u32,
    // Unmounted once every agent is gone (field order).
    _bpffs: BpffsMount,
}

/// One reading of the agent's resources.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Sample {
    pub at_s: f64,
    pub pid: u32,
    pub fds: usize,
    pub threads: u64,
    pub rss_kib: u64,
}

impl Agent {
    pub fn new(
        binary: &Path,
        mode: Mode,
        node: &NetnsGuard,
        kubeconfig: &Path,
        cgroup: &CgroupGuard,
        dir: &Path,
    ) -> Result<Self> {
        let bpffs = BpffsMount::create()?;
        Ok(Self {
            binary: binary.to_owned(),
            mode,
            pin_root: bpffs.path().join("ambpf"),
            zds_socket: dir.join("ztunnel.sock"),
            cni_socket: dir.join("cni.sock"),
            kubeconfig: kubeconfig.to_owned(),
            cgroup: cgroup.path().to_owned(),
            node: node.path(),
            log: dir.join("agent.log"),
            process: None,
            pid_cell: Arc::new(AtomicU32::new(0)),
            starts: 0,
            _bpffs: bpffs,
        })
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Starts an agent (none may be running); returns at once.
    pub fn start(&mut self) -> Result<()> {
        ensure!(self.process.is_none(), "an agent runs already");
        let mut command = Command::new(&self.binary);
        command
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["run", "--redirect-mode", self.mode.name()])
            .args(["--pod-source", "kube", "--node-name", super::world::NODE])
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cni-socket")
            .arg(&self.cni_socket)
            .arg("--zds-socket")
            .arg(&self.zds_socket)
            .arg("--cgroup")
            .arg(&self.cgroup)
            .args([
                "--health-listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        let node = std::fs::File::open(&self.node)?;
        // SAFETY: setns is async-signal-safe, and `node` outlives the spawn.
        unsafe {
            use std::os::{fd::AsFd as _, unix::process::CommandExt as _};
            command.pre_exec(move || {
                nix::sched::setns(node.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
        self.starts += 1;
        let process = ProcessGuard::spawn("the agent", command, &self.log)?;
        self.pid_cell.store(process.pid(), Ordering::SeqCst);
        self.process = Some(process);
        Ok(())
    }

    /// SIGKILL: no chance to clean up, as in a crash or an OOM kill.
    pub fn kill(&mut self) -> Result<()> {
        self.pid_cell.store(0, Ordering::SeqCst);
        if let Some(mut process) = self.process.take() {
            kill(
                nix::unistd::Pid::from_raw(process.pid() as i32),
                Signal::SIGKILL,
            )?;
            // Reaped by `stop`, which finds it exited.
            process.stop()?;
        }
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ProcessGuard::pid)
    }

    /// An error, with the end of its log, if the agent exited by itself.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(process) = self.process.as_mut() {
            process.check_running()?;
        }
        Ok(())
    }

    /// Whether the agent accepts CNI requests (it serves the endpoint once
    /// its state is loaded).
    pub fn cni_ready(&self) -> bool {
        std::os::unix::net::UnixStream::connect(&self.cni_socket).is_ok()
    }

    /// Where the running agent's pid is kept (0: none).
    pub fn pid_cell(&self) -> Arc<AtomicU32> {
        self.pid_cell.clone()
    }

    /// The network namespaces the agent holds open, by inode.
    pub fn netns_fds(&self) -> Vec<u64> {
        let Some(pid) = self.pid() else {
            return Vec::new();
        };
        crate::bench::open_fds(pid)
            .unwrap_or_default()
            .iter()
            .filter_map(|t| t.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok())
            .collect()
    }

    /// `ambpf status --json` (eBPF mode; works with no agent running).
    pub fn status(&self) -> Result<Value> {
        let out = self.cli(&["status", "--json"])?;
        ensure!(
            out.status.success(),
            "ambpf status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).context("ambpf status --json")
    }

    /// `ambpf status --check`: `None` when the pinned state is consistent,
    /// else what it printed.
    pub fn status_check(&self) -> Result<Option<String>> {
        let out = self.cli(&["status", "--check"])?;
        Ok((!out.status.success()).then(|| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        }))
    }

    fn cli(&self, args: &[&str]) -> Result<std::process::Output> {
        Ok(Command::new(&self.binary)
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(args)
            .output()?)
    }

    /// Stops the agent (SIGTERM) and removes its pins.
    pub fn stop(&mut self) -> Result<()> {
        self.pid_cell.store(0, Ordering::SeqCst);
        if let Some(mut process) = self.process.take() {
            process.stop()?;
        }
        if self.mode == Mode::Ebpf {
            let out = self.cli(&["uninstall", "--redirect-mode", "ebpf", "--keep-cni"])?;
            ensure!(
                out.status.success(),
                "ambpf uninstall: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

/// One reading of process `pid`'s fds, threads and RSS.
pub fn sample(pid: u32, at_s: f64) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |key: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some(Sample {
        at_s,
        pid,
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count(),
        threads: field("Threads")?,
        rss_kib: field("VmRSS")?,
    })
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.process.is_some()
            && let Err(e) = self.stop()
        {
            eprintln!("soak: stopping the agent: {e:#}");
        }
    }
}
