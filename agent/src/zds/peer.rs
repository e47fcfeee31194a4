//! Another ZDS server on ztunnel's socket: Istio's node agent, on a node
//! that moves from it to ambpf.
//!
//! Two servers never share the socket. ztunnel holds one connection, to the
//! server it reached; a second server that replaced the socket file would
//! get ztunnel only once that connection drops, and Istio's agent, a Go
//! listener, unlinks the path when it closes, whoever's file it is by then.
//! So while another server listens on the socket, ambpf stands by: it binds
//! nothing there, enrols nothing, and its CNI endpoint admits an ambient
//! pod only once the other agent has captured it (`crate::cni::server`).
//! When that server stops listening, its plugin has left the CNI chain and
//! its pod has left the node, ambpf takes over. Istio's agent, uninstalled,
//! closes its socket as it is signalled, takes its plugin out of the
//! conflist, then deletes its host rules (whose names the rule modes share)
//! and exits; it leaves its capture in every pod. An agent that restarts or
//! upgrades leaves its plugin chained, and is waited for while it comes
//! back. Taking over, ambpf
//! enrols every pod beside the capture left there, serves the socket,
//! ztunnel reconnects and keeps each pod's proxy (same UIDs, same
//! namespaces), and the other agent's capture is retired pod by pod
//! ([`crate::redirect::retire`]).
//!
//! The other server is found without connecting to it (a connection would
//! be a ztunnel to Istio's agent, the newest, which gets its Adds): the
//! socket file's inode against the unix listeners of the node's namespace,
//! over sock_diag ([`crate::sock_diag::unix_listener_on`]). The agent runs
//! in that namespace (hostNetwork), as Istio's does.

use std::{
    io,
    os::unix::fs::{FileTypeExt as _, MetadataExt as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use tracing::{info, warn};

/// The `type` of Istio's CNI plugin in a conflist.
pub const ISTIO_PLUGIN_TYPE: &str = "istio-cni";

/// How often the other server is looked for while ambpf stands by.
pub const STANDBY_POLL: Duration = Duration::from_millis(200);

/// How long a takeover waits for Istio's node agent's stopping pod to leave
/// the node once nothing else of it is there (a kubelet that never
/// confirms the pod's end would otherwise hold the node in standby).
pub const STOPPING_AT_MOST: Duration = Duration::from_secs(60);

/// A server listening on the ZDS socket that is not this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherServer {
    pub socket: PathBuf,
    /// The socket file's inode.
    pub inode: u64,
}

/// Another node agent on the node, which ambpf stands by for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OtherAgent {
    /// It serves ztunnel.
    Serving(OtherServer),
    /// It serves no ztunnel, but its plugin is chained in these conflists:
    /// it restarts, or upgrades, and will serve again.
    Chained(Vec<PathBuf>),
    /// Istio's node agent's pods on the node being deleted (`namespace/name`):
    /// its agent may still be in its shutdown, which deletes its host rules.
    Stopping(Vec<String>),
}

impl std::fmt::Display for OtherAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OtherAgent::Serving(server) => write!(
                f,
                "another node agent serves ztunnel on {} (socket file inode {}; Istio's node \
                 agent, if it runs on this node)",
                server.socket.display(),
                server.inode
            ),
            OtherAgent::Chained(conflists) => write!(
                f,
                "Istio's CNI plugin ({ISTIO_PLUGIN_TYPE}) is chained in {}: its node agent is \
                 installed, and serves ztunnel again once it has restarted",
                conflists
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            OtherAgent::Stopping(pods) => write!(
                f,
                "Istio's node agent's pod {} is stopping: its shutdown deletes its host rules, \
                 so ambpf writes its own only once the pod is gone",
                pods.join(", ")
            ),
        }
    }
}

/// The other node agent ambpf must stand by for: one serving the socket at
/// `socket`; Istio's, whose plugin is chained in a conflist of `conf_dir`
/// (`None`: the agent has no view of the CNI configuration); or Istio's,
/// whose `stopping` pods (the pod source's) are still on the node.
pub fn other_agent(
    socket: &Path,
    conf_dir: Option<&Path>,
    stopping: &[String],
) -> io::Result<Option<OtherAgent>> {
    if let Some(server) = other_server(socket)? {
        return Ok(Some(OtherAgent::Serving(server)));
    }
    let chained = conf_dir.map_or_else(Vec::new, |dir| {
        crate::cni::install::chaining(dir, ISTIO_PLUGIN_TYPE)
    });
    if !chained.is_empty() {
        return Ok(Some(OtherAgent::Chained(chained)));
    }
    Ok((!stopping.is_empty()).then(|| OtherAgent::Stopping(stopping.to_vec())))
}

/// The server listening on the socket file at `path`, if there is one
/// (called before this agent binds it: any listener there is another's).
/// A file that is not a socket, or a socket file nobody listens on, is
/// none.
pub fn other_server(path: &Path) -> io::Result<Option<OtherServer>> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Ok(None);
    }
    Ok(
        crate::sock_diag::unix_listener_on(meta.ino())?.then(|| OtherServer {
            socket: path.to_owned(),
            inode: meta.ino(),
        }),
    )
}

/// Whether the agent stands by, and why: read by the readiness endpoint
/// and the CNI endpoint.
#[derive(Clone, Debug, Default)]
pub struct Standby(Arc<Mutex<Option<String>>>);

impl Standby {
    /// Why the agent stands by, while it does.
    pub fn why(&self) -> Option<String> {
        self.0.lock().expect("standby lock").clone()
    }

    fn set(&self, why: Option<String>) {
        *self.0.lock().expect("standby lock") = why;
    }

    /// Waits while another node agent is on the node ([`other_agent`];
    /// `stopping` reads the pod source's stopping pods of Istio's agent),
    /// standing by; returns whether it stood by. Errors reading the
    /// socket's listeners are retried, each logged: an agent that cannot
    /// be ruled out is waited for. A stopping pod alone is waited for
    /// [`STOPPING_AT_MOST`].
    pub async fn wait_for_others(
        &self,
        path: &Path,
        conf_dir: Option<&Path>,
        stopping: &(dyn Fn() -> Vec<String> + Sync),
    ) -> bool {
        let mut stood_by: Option<OtherAgent> = None;
        let mut last_error = None;
        let mut stopping_since: Option<tokio::time::Instant> = None;
        loop {
            let other = other_agent(path, conf_dir, &stopping());
            match &other {
                Ok(Some(stopping @ OtherAgent::Stopping(_))) => {
                    let since = *stopping_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() >= STOPPING_AT_MOST {
                        warn!(
                            "{stopping}: still there after {} s; taking over, though its end \
                             may yet delete the host rules (the state check writes them again)",
                            STOPPING_AT_MOST.as_secs()
                        );
                        break;
                    }
                }
                _ => stopping_since = None,
            }
            match other {
                Ok(None) => break,
                Ok(Some(other)) => {
                    if stood_by.as_ref() != Some(&other) {
                        warn!(
                            "{other}: ambpf stands by, enrolling nothing and serving no ZDS, \
                             until it stops; then ambpf takes its pods over live"
                        );
                        self.set(Some(format!(
                            "standing by: {other}; ambpf takes its pods over once it stops"
                        )));
                        stood_by = Some(other);
                    }
                    last_error = None;
                }
                Err(e) => {
                    if last_error.as_ref() != Some(&e.to_string()) {
                        warn!(
                            "looking for another ZDS server on {}: {e}; retried every {} ms",
                            path.display(),
                            STANDBY_POLL.as_millis()
                        );
                        self.set(Some(format!(
                            "standing by: cannot tell whether another node agent serves {}: {e}",
                            path.display()
                        )));
                    }
                    last_error = Some(e.to_string());
                }
            }
            tokio::time::sleep(STANDBY_POLL).await;
        }
        if stood_by.is_some() {
            info!(
                "the other node agent is gone (it serves no ztunnel on {}, no plugin of \
                 Istio's is chained, and no pod of Istio's agent is stopping): taking its pods \
                 over",
                path.display()
            );
        }
        self.set(None);
        stood_by.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ambpf-peer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_listening_server_is_found_and_a_stale_file_or_none_is_not() {
        let dir = temp_dir("find");
        let path = dir.join("ztunnel.sock");
        assert_eq!(other_server(&path).unwrap(), None);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let found = other_server(&path).unwrap().expect("a live server");
        assert_eq!(found.inode, std::fs::metadata(&path).unwrap().ino());
        drop(listener);
        assert_eq!(other_server(&path).unwrap(), None, "a stale socket file");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "not a socket").unwrap();
        assert_eq!(other_server(&path).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn standby_lasts_while_the_other_server_listens() {
        let dir = temp_dir("wait");
        let path = dir.join("ztunnel.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let standby = Standby::default();
        let waiting = tokio::spawn({
            let (standby, path) = (standby.clone(), path.clone());
            async move { standby.wait_for_others(&path, None, &Vec::new).await }
        });
        tokio::time::sleep(STANDBY_POLL * 3).await;
        assert!(!waiting.is_finished());
        assert!(standby.why().unwrap().contains("standing by"));
        // Go's listener unlinks its path as it closes.
        drop(listener);
        std::fs::remove_file(&path).unwrap();
        let other = tokio::time::timeout(STANDBY_POLL * 10, waiting)
            .await
            .unwrap()
            .unwrap();
        assert!(other);
        assert_eq!(standby.why(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Istio's agent's pod being deleted, with its socket closed and its
    /// plugin gone, is still in its shutdown: waited for until it is gone.
    #[tokio::test]
    async fn a_stopping_istio_agent_pod_is_waited_for_until_it_is_gone() {
        let dir = temp_dir("stopping");
        let socket = dir.join("ztunnel.sock");
        let pods = Arc::new(Mutex::new(vec!["istio-system/istio-cni-node-x".to_owned()]));
        let standby = Standby::default();
        let waiting = tokio::spawn({
            let (standby, socket, pods) = (standby.clone(), socket.clone(), pods.clone());
            async move {
                let stopping = move || pods.lock().unwrap().clone();
                standby.wait_for_others(&socket, None, &stopping).await
            }
        });
        tokio::time::sleep(STANDBY_POLL * 3).await;
        assert!(!waiting.is_finished());
        assert!(
            standby
                .why()
                .unwrap()
                .contains("istio-cni-node-x is stopping")
        );
        pods.lock().unwrap().clear();
        let stood_by = tokio::time::timeout(STANDBY_POLL * 10, waiting)
            .await
            .unwrap()
            .unwrap();
        assert!(stood_by);
        assert_eq!(standby.why(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A pod whose end the kubelet never confirms holds the node no longer
    /// than [`STOPPING_AT_MOST`].
    #[tokio::test(start_paused = true)]
    async fn a_stopping_pod_alone_is_waited_for_at_most_its_bound() {
        let dir = temp_dir("stopping-bound");
        let socket = dir.join("ztunnel.sock");
        let started = tokio::time::Instant::now();
        let stopping = || vec!["istio-system/istio-cni-node-stuck".to_owned()];
        let stood_by = Standby::default()
            .wait_for_others(&socket, None, &stopping)
            .await;
        assert!(stood_by);
        assert!(started.elapsed() >= STOPPING_AT_MOST);
        assert!(started.elapsed() < STOPPING_AT_MOST + STANDBY_POLL * 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Istio's plugin still chained is an agent that restarts: stood by for
    /// until the plugin leaves the chain, as Istio's uninstall takes it out.
    #[tokio::test]
    async fn a_chained_istio_plugin_is_waited_for() {
        let dir = temp_dir("chained");
        let conflist = dir.join("10-bridge.conflist");
        let with = |types: &[&str]| {
            let plugins: Vec<String> = types
                .iter()
                .map(|t| format!("{{\"type\": \"{t}\"}}"))
                .collect();
            format!(
                "{{\"cniVersion\": \"1.0.0\", \"name\": \"k8s\", \"plugins\": [{}]}}",
                plugins.join(", ")
            )
        };
        std::fs::write(&conflist, with(&["bridge", "istio-cni", "ambpf-cni"])).unwrap();
        let socket = dir.join("ztunnel.sock");
        assert!(matches!(
            other_agent(&socket, Some(&dir), &[]).unwrap(),
            Some(OtherAgent::Chained(lists)) if lists == [conflist.clone()]
        ));
        assert_eq!(other_agent(&socket, None, &[]).unwrap(), None);
        let standby = Standby::default();
        let waiting = tokio::spawn({
            let (standby, socket, dir) = (standby.clone(), socket.clone(), dir.clone());
            async move {
                standby
                    .wait_for_others(&socket, Some(&dir), &Vec::new)
                    .await
            }
        });
        tokio::time::sleep(STANDBY_POLL * 3).await;
        assert!(!waiting.is_finished());
        assert!(standby.why().unwrap().contains("istio-cni"));
        std::fs::write(&conflist, with(&["bridge", "ambpf-cni"])).unwrap();
        let stood_by = tokio::time::timeout(STANDBY_POLL * 10, waiting)
            .await
            .unwrap()
            .unwrap();
        assert!(stood_by);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
