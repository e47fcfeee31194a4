//! The agent as the `redirect`, `enroll` and `storm` suites run it: a pods file,
//! the process, its readiness, and runtimes of their own for the pods' sides.

use super::*;

/// A pods file naming `pods` as (uid, netns path).
pub(crate) fn write_pods_file(path: &Path, pods: &[(String, PathBuf)]) -> Result<()> {
    let pods: Vec<serde_json::Value> = pods
        .iter()
        .enumerate()
        .map(|(i, (uid, netns))| {
            serde_json::json!({
                "uid": uid,
                "name": format!("bench-{i:05}-7d4b9c8f6-x2k4p"),
                "namespace": "ambpf-bench",
                "serviceAccount": "bench-workload",
                "netns": netns,
            })
        })
        .collect();
    bench::write_json(path, &serde_json::json!({ "pods": pods }))
        .with_context(|| format!("writing {}", path.display()))
}

/// The agent in `mode` (iptables or ebpf) in the node's namespace, with a
/// private pin root, its socket programs on `cgroup`.
pub(crate) struct Agent {
    pub(crate) process: ProcessGuard,
    pub(crate) binary: PathBuf,
    pub(crate) pin_root: PathBuf,
    // Dropped after the process (field order): unmounted once it is gone.
    pub(crate) _bpffs: BpffsMount,
}

impl Agent {
    /// Starts the agent with a pods file and waits for its ZDS socket.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start(
        binary: &Path,
        mode: Mode,
        node: &NetnsGuard,
        pods_file: &Path,
        socket: &Path,
        cgroup: &CgroupGuard,
        log: &Path,
    ) -> Result<Self> {
        let source = [std::ffi::OsStr::new("--pods-file"), pods_file.as_os_str()];
        let mut agent = Self::spawn(binary, mode, node, &source, socket, cgroup.path(), log)?;
        wait_for_socket(&mut agent.process, socket, SOCKET_TIMEOUT).await?;
        Ok(agent)
    }

    /// Spawns `ambpf run` in the node's namespace with the pod-source
    /// arguments `source`, on a private bpffs; returns at once.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn spawn(
        binary: &Path,
        mode: Mode,
        node: &NetnsGuard,
        source: &[&std::ffi::OsStr],
        socket: &Path,
        cgroup: &Path,
        log: &Path,
    ) -> Result<Self> {
        let bpffs = BpffsMount::create()?;
        let pin_root = bpffs.path().join("ambpf");
        let mut command = Command::new(binary);
        command
            .arg("--pin-root")
            .arg(&pin_root)
            .arg("run")
            .arg("--redirect-mode")
            .arg(mode.agent_mode())
            .args(source)
            .arg("--zds-socket")
            .arg(socket)
            .arg("--cgroup")
            .arg(cgroup)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        let node_ns = File::open(node.path())?;
        // SAFETY: setns is async-signal-safe, and `node_ns` outlives the spawn.
        unsafe {
            command.pre_exec(move || {
                nix::sched::setns(node_ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
        let process = ProcessGuard::spawn("the agent", command, log)?;
        Ok(Self {
            process,
            binary: binary.to_owned(),
            pin_root,
            _bpffs: bpffs,
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Attaches `ambpf trace --json` to the agent's pins, its records
    /// written to `log`; returns once it reads.
    pub(crate) async fn attach_trace_reader(&self, log: &Path) -> Result<ProcessGuard> {
        let mut command = Command::new(&self.binary);
        command
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["trace", "--json"]);
        let mut reader = ProcessGuard::spawn("the trace reader", command, log)?;
        let deadline = std::time::Instant::now() + READY_TIMEOUT;
        while !std::fs::read_to_string(log)?.contains("reading redirect decisions") {
            reader.check_running()?;
            ensure!(
                std::time::Instant::now() < deadline,
                "the trace reader never attached"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(reader)
    }

    /// Pods in `ambpf status --json` (eBPF mode).
    pub(crate) fn status_pods(&self) -> Result<usize> {
        let out = Command::new(&self.binary)
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["status", "--json"])
            .output()?;
        ensure!(
            out.status.success(),
            "ambpf status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        status["pods"]
            .as_array()
            .map(Vec::len)
            .context("no `pods` array in `ambpf status --json`")
    }

    /// Stops the agent and removes its pins (detaching its programs). Only
    /// the eBPF mode's state: a full uninstall would sweep every namespace
    /// of the machine for iptables rules, and the bench's own go with its
    /// namespaces.
    pub(crate) fn stop(mut self) -> Result<()> {
        self.process.stop()?;
        let out = Command::new(&self.binary)
            .arg("--pin-root")
            .arg(&self.pin_root)
            .args(["uninstall", "--redirect-mode", "ebpf", "--keep-cni"])
            .output()?;
        ensure!(
            out.status.success(),
            "ambpf uninstall: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

/// A runtime that shuts down in the background when dropped (dropping a
/// plain one inside async code panics, e.g. on an error path).
pub(crate) struct OwnRuntime(Option<Runtime>);

impl std::ops::Deref for OwnRuntime {
    type Target = Runtime;

    fn deref(&self) -> &Runtime {
        self.0.as_ref().expect("the runtime lives until dropped")
    }
}

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// A multi-threaded runtime whose threads are named `name` and, with
/// `netns`, enter that network namespace as they start (so sockets they
/// create are that namespace's).
pub(crate) fn named_runtime(
    name: &str,
    workers: usize,
    netns: Option<&Path>,
) -> Result<(OwnRuntime, Arc<AtomicBool>)> {
    let failed = Arc::new(AtomicBool::new(false));
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .worker_threads(workers)
        .thread_name(name)
        .enable_all();
    if let Some(netns) = netns {
        let netns = Arc::new(File::open(netns)?);
        let flag = failed.clone();
        builder.on_thread_start(move || {
            if nix::sched::setns(netns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                flag.store(true, Ordering::SeqCst);
            }
        });
    }
    Ok((OwnRuntime(Some(builder.build()?)), failed))
}

/// The agent in `mode` on a fresh pods file naming `enrolled` (uid, netns),
/// and a ztunnel double connected to it on a runtime of its own: what the
/// traffic suites measure through.
pub(crate) struct Served {
    pub(crate) agent: Agent,
    pub(crate) double: ZtunnelDouble,
    pods_file: PathBuf,
    // Dropped last (field order): the double's tasks run on it.
    runtime: OwnRuntime,
}

impl Served {
    /// Starts both in `work` and waits until the double is ready and runs
    /// every enrolled pod's proxies.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start(
        binary: &Path,
        mode: Mode,
        node: &NetnsGuard,
        enrolled: &[(String, PathBuf)],
        cgroup: &CgroupGuard,
        work: &TempDir,
        run: usize,
    ) -> Result<Self> {
        let pods_file = work.join("pods.json");
        let socket = work.join("ztunnel.sock");
        write_pods_file(&pods_file, enrolled)?;
        let log = work.join(format!("agent-{}-{}.log", mode.name(), run));
        let agent = Agent::start(binary, mode, node, &pods_file, &socket, cgroup, &log).await?;
        let (runtime, _) = named_runtime("ztunnel-rt", 2, None)?;
        let double = {
            let _enter = runtime.enter();
            ZtunnelDouble::connect_with_retry(&socket, ZtunnelConfig::default())
        };
        double
            .wait_until(
                |s| {
                    s.ready
                        && enrolled
                            .iter()
                            .all(|(uid, _)| s.workloads.get(uid).is_some_and(|w| w.proxies_running))
                },
                READY_TIMEOUT,
            )
            .await
            .map_err(|e| anyhow::anyhow!("ztunnel never got ready (or its pods): {e:?}"))?;
        Ok(Self {
            agent,
            double,
            pods_file,
            runtime,
        })
    }

    /// Unenrols every pod (ztunnel gets the Dels), stops the agent and
    /// removes its pins.
    pub(crate) async fn stop(self) -> Result<()> {
        write_pods_file(&self.pods_file, &[])?;
        self.double
            .wait_until(|s| s.workloads.is_empty(), READY_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("the pods were not removed: {e:?}"))?;
        self.double.shutdown().await;
        self.agent.stop()?;
        drop(self.runtime);
        Ok(())
    }
}
