//! The real `ambpf` agent as a child process in a testbed node namespace,
//! and the helpers the tests that run it share.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use ambpf_testbed::NetnsGuard;

/// How long anything the agent does may take; the tests never assert how
/// fast, only that it happens.
pub const AGENT_PATIENCE: Duration = Duration::from_secs(20);

/// A child process killed (SIGKILL: no chance to clean up) and reaped on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `ambpf run` in `node`'s namespace with a pods file, its socket programs
/// on `cgroup`, metrics on `metrics_listen` (in the node's namespace), not
/// spawned yet.
pub fn agent_command(
    node: &NetnsGuard,
    pins: &Path,
    socket: &Path,
    pods: &Path,
    cgroup: &Path,
    metrics_listen: &str,
) -> Command {
    let mut cmd = node.command(env!("CARGO_BIN_EXE_ambpf")).unwrap();
    cmd.arg("--pin-root")
        .arg(pins)
        .arg("run")
        .arg("--pods-file")
        .arg(pods)
        .arg("--zds-socket")
        .arg(socket)
        .arg("--cgroup")
        .arg(cgroup)
        .args([
            "--health-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            metrics_listen,
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null());
    cmd
}

/// [`agent_command`], spawned.
pub fn spawn_agent(
    node: &NetnsGuard,
    pins: &Path,
    socket: &Path,
    pods: &Path,
    cgroup: &Path,
    metrics_listen: &str,
) -> Proc {
    Proc(
        agent_command(node, pins, socket, pods, cgroup, metrics_listen)
            .spawn()
            .unwrap(),
    )
}

/// An echo server on `addr` inside `ns`, a thread per connection.
pub fn serve_echo(ns: &NetnsGuard, addr: SocketAddr) {
    let listener = ns.run(|| TcpListener::bind(addr)).unwrap().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                let mut buf = [0u8; 256];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

/// Waits until `check` holds, failing the test after [`AGENT_PATIENCE`].
pub async fn wait_for(mut check: impl FnMut() -> bool, what: &str) {
    let deadline = tokio::time::Instant::now() + AGENT_PATIENCE;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
