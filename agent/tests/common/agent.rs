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

/// `ambpf status --check` on the pins at `pins`: whether it passed, and
/// what it printed (stdout, then stderr).
pub fn status_check(pins: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pins)
        .args(["status", "--check"])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
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

/// `nft -j <args>` in the network namespace at `netns`, parsed: how the
/// tests read the nftables mode's state, with nft's own reader rather than
/// the agent's.
pub fn nft_json(netns: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["nft", "-j"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "nft -j {args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The `inet` tables of the namespace at `netns`.
pub fn nft_tables(netns: &Path) -> Vec<String> {
    let listing = nft_json(netns, &["list", "tables", "inet"]);
    listing["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["table"]["name"].as_str().map(str::to_owned))
        .collect()
}

/// The members of the host probe set `set` (`istio-inpod-probes-v4`/`-v6`
/// of `inet istio-ambient-nat`) in the namespace at `netns`, each with its
/// comment (the netns cookie of the pod that owns it); none without the
/// table.
pub fn nft_probe_members(netns: &Path, set: &str) -> Vec<(String, Option<String>)> {
    if !nft_tables(netns).iter().any(|t| t == "istio-ambient-nat") {
        return Vec::new();
    }
    let listing = nft_json(netns, &["list", "set", "inet", "istio-ambient-nat", set]);
    let mut out = Vec::new();
    for object in listing["nftables"].as_array().unwrap() {
        for elem in object["set"]["elem"].as_array().into_iter().flatten() {
            // `{"elem": {"val": ..., "comment": ...}}` with a comment.
            let (val, comment) = match elem.get("elem") {
                Some(inner) => (&inner["val"], inner["comment"].as_str()),
                None => (elem, None),
            };
            out.push((val.as_str().unwrap().to_owned(), comment.map(str::to_owned)));
        }
    }
    out
}
