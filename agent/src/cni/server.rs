//! The agent's CNI endpoint: `POST /cmdadd` over a unix socket.
//!
//! Served by the agent's small HTTP/1.1 responder ([`crate::http`]), one
//! request per connection, as the health endpoint is. Each posted pod is first checked against
//! the [`PodSelection`]; a pod to enrol is handed to the controller, which
//! stays the only owner of the redirection. Then, as Istio's node agent
//! does, the endpoint waits until the newest ztunnel connection has acked
//! the pod's Add ([`ZdsHandle::wait_until_held`]): ztunnel acks once the
//! pod's proxy runs, so the pod's first connection finds it listening.
//!
//! The answer is 200 with a [`CmdAddReply`] once ztunnel holds the pod, or
//! at once when the pod is skipped; else an [`AddError`]'s status (503 when
//! a retry may succeed, 500 when not) with the reason as the body. A pod
//! ztunnel did not take is abandoned first: its redirection is removed
//! before the answer, so the failed sandbox leaves nothing behind.

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{
    io::AsyncWriteExt,
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot, watch},
    task::JoinSet,
};
use tracing::{Instrument as _, debug, info, warn};

use super::{
    AddError, AddPhase, CmdAdd, CmdAddReply, CniStats,
    selection::{PodSelection, Verdict},
};
use crate::{
    controller::{AbandonRequest, CniEnrolled, CniRequest, EnrollRequest},
    zds::ZdsHandle,
};

/// Largest request accepted (head and body).
const MAX_REQUEST: usize = 64 * 1024;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one ADD may take in all, enrolment and ztunnel's ack: under the
/// plugin's default `agentTimeoutSeconds` (30), so that the agent answers,
/// and cleans up, before the plugin gives up.
pub const ADD_BUDGET: Duration = Duration::from_secs(25);

/// What the endpoint answers ADDs with.
#[derive(Clone)]
pub struct Endpoint {
    /// The controller, the only owner of the redirection.
    pub controller: mpsc::Sender<CniRequest>,
    /// ztunnel's answers, awaited before an ADD succeeds.
    pub zds: ZdsHandle,
    pub selection: PodSelection,
    pub stats: Arc<CniStats>,
    /// Turns `true` when the agent shuts down: ADDs in flight are answered
    /// (503, the agent is shutting down) after their pod is abandoned, and
    /// [`serve`] returns once they are.
    pub shutdown: watch::Receiver<bool>,
    /// Set while another node agent serves ztunnel ([`crate::zds::peer`]).
    pub standby: crate::zds::peer::Standby,
}

pub use crate::unix_socket::SocketFileError as BindError;

/// Binds the endpoint at `path`: owner-only, a stale socket replaced, a live
/// one left alone (see [`crate::unix_socket`]).
pub fn bind(path: &Path) -> Result<UnixListener, BindError> {
    crate::unix_socket::bind_owner_only(
        path,
        |path| std::os::unix::net::UnixStream::connect(path).is_ok(),
        |temp| UnixListener::bind(temp),
    )
}

/// Serves requests from `listener`, handing the pods the endpoint's
/// selection enrols to its controller, until the controller is gone.
pub async fn serve(listener: UnixListener, endpoint: Endpoint) {
    info!(
        "CNI endpoint ready; enrolling {}",
        match endpoint.selection {
            PodSelection::Every => "every pod the plugin posts",
            PodSelection::Ambient(_) => "the ambient pods the plugin posts",
        }
    );
    let mut shutdown = endpoint.shutdown.clone();
    let mut in_flight = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutting_down(&mut shutdown) => break,
            Some(_) = in_flight.join_next() => continue,
        };
        let conn = match accepted {
            Ok((conn, _)) => conn,
            Err(e) => {
                warn!("CNI accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if endpoint.controller.is_closed() {
            return;
        }
        in_flight.spawn(handle(conn, endpoint.clone()));
    }
    // Each ADD in flight answers (and cleans up after itself) first.
    in_flight.join_all().await;
}

async fn handle(mut conn: UnixStream, endpoint: Endpoint) {
    let stats = &endpoint.stats;
    let read = crate::http::read_request(&mut conn, MAX_REQUEST);
    let answer = match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(Ok(request)) => {
            let started = Instant::now();
            let answer = respond(&request, &endpoint).await;
            // Invalid requests (4xx) are not ADDs answered.
            if !matches!(&answer, Err((status, _)) if *status < 500) {
                stats.time(AddPhase::Answer, started.elapsed());
            }
            answer
        }
        Ok(Err(e)) => Err((400, format!("{e}\n"))),
        Err(_) => {
            debug!("CNI: dropped a slow request");
            return;
        }
    };
    stats.count(answer.as_ref().map_err(|(status, _)| *status));
    let (status, content_type, body) = match answer {
        Ok(reply) => (
            200,
            "application/json",
            serde_json::to_string(&reply).expect("the reply serializes"),
        ),
        Err((status, text)) => (status, "text/plain", text),
    };
    let response = crate::http::response(status, content_type, &body);
    let _ = conn.write_all(response.as_bytes()).await;
    let _ = conn.shutdown().await;
}

/// The reply to a request, or an error status and its text.
type Answer = Result<CmdAddReply, (u16, String)>;

async fn respond(request: &crate::http::Request, endpoint: &Endpoint) -> Answer {
    let (method, path, body) = (&request.method, &request.path, &request.body);
    if path != "/cmdadd" {
        return Err((404, "not found\n".to_owned()));
    }
    if method != "POST" {
        return Err((405, "only POST\n".to_owned()));
    }
    let add: CmdAdd = match serde_json::from_slice(body) {
        Ok(add) => add,
        Err(e) => return Err((400, format!("invalid request: {e}\n"))),
    };
    if add.pod_uid.is_empty() || add.netns.is_empty() {
        return Err((400, "podUid and netns are required\n".to_owned()));
    }
    let pod = format!("{}/{} ({})", add.pod_namespace, add.pod_name, add.pod_uid);
    let deadline = tokio::time::Instant::now() + ADD_BUDGET;
    let span = crate::pod_span!("cni_add", add.pod_namespace, add.pod_name, add.pod_uid);
    match add_pod(&add, &pod, endpoint, deadline)
        .instrument(span.clone())
        .await
    {
        Ok(reply) => Ok(reply),
        Err(e) => {
            span.in_scope(|| warn!("CNI add of pod {pod} failed: {e}"));
            Err((e.status(), format!("pod {pod} not enrolled: {e}\n")))
        }
    }
}

/// Decides, enrols, and waits for ztunnel: Istio's `AddPodToMesh`.
async fn add_pod(
    add: &CmdAdd,
    pod: &str,
    endpoint: &Endpoint,
    deadline: tokio::time::Instant,
) -> Result<CmdAddReply, AddError> {
    let stats = &endpoint.stats;
    let deciding = Instant::now();
    let verdict = endpoint.selection.select(add).await;
    stats.time(AddPhase::Decide, deciding.elapsed());
    let spec = match verdict {
        Ok(Verdict::Enroll(spec)) => spec,
        Ok(Verdict::Skip(why)) => {
            let reason = format!("pod {pod} not enrolled: {why}");
            info!("CNI add: {reason}");
            return Ok(CmdAddReply::Skipped { reason });
        }
        Err(e) => return Err(AddError::Undecided(e.to_string())),
    };
    if let Some(why) = endpoint.standby.why() {
        return admit_while_standing_by(add, pod, why).await;
    }
    let uid = spec.workload.uid.clone();

    let enrolling = Instant::now();
    // Before ztunnel can be told: which connection gets the Add.
    let hold = endpoint.zds.hold_wait();
    let (reply, answer) = oneshot::channel();
    let request = EnrollRequest { pod: spec, reply };
    if endpoint.controller.send(request.into()).await.is_err() {
        return Err(AddError::ShuttingDown);
    }
    let mut shutdown = endpoint.shutdown.clone();
    let answer = tokio::select! {
        answer = tokio::time::timeout_at(deadline, answer) => answer,
        () = shutting_down(&mut shutdown) => {
            abandon(endpoint, &uid, None).await;
            return Err(AddError::ShuttingDown);
        }
    };
    let enrolled_in = enrolling.elapsed();
    stats.time(AddPhase::Enrol, enrolled_in);
    let CniEnrolled { netns_inode } = match answer {
        Ok(Ok(result)) => result?,
        Ok(Err(_)) => return Err(AddError::ShuttingDown),
        // The controller may still enrol it: abandoned below, as a failure
        // after enrolment is.
        Err(_) => {
            abandon(endpoint, &uid, None).await;
            return Err(AddError::Timeout(ADD_BUDGET));
        }
    };

    let waiting = Instant::now();
    let bound = deadline.saturating_duration_since(tokio::time::Instant::now());
    let held = tokio::select! {
        held = endpoint.zds.wait_until_held(hold, &uid, netns_inode, bound) => held.map_err(AddError::from),
        () = shutting_down(&mut shutdown) => Err(AddError::ShuttingDown),
    };
    let waited = waiting.elapsed();
    stats.time(AddPhase::Ztunnel, waited);
    if let Err(e) = held {
        abandon(endpoint, &uid, Some(netns_inode)).await;
        return Err(e);
    }
    info!(
        "CNI add: pod {pod} enrolled in {:.2} ms, held by ztunnel {:.2} ms later",
        enrolled_in.as_secs_f64() * 1e3,
        waited.as_secs_f64() * 1e3
    );
    Ok(CmdAddReply::Enrolled)
}

/// An ambient pod's ADD while another node agent serves ztunnel: the pod
/// starts once that agent has captured it (its plugin, earlier in the
/// chain, has written its rules: Istio's plugin fails the ADD until they
/// are in place and ztunnel holds the pod), and ambpf takes it over with
/// the rest; a pod without that capture is refused, retryably, and never
/// runs uncaptured.
async fn admit_while_standing_by(
    add: &CmdAdd,
    pod: &str,
    why: String,
) -> Result<CmdAddReply, AddError> {
    let netns_path = add.netns.clone();
    let found = tokio::task::spawn_blocking(move || {
        let netns = crate::netns::Netns::open(&netns_path).map_err(|e| e.to_string())?;
        let host = crate::netns::Netns::open("/proc/self/ns/net").map_err(|e| e.to_string())?;
        let nft = crate::redirect::check::mixed::node_nft(&host);
        crate::redirect::istio_agent::find(&netns, nft.as_ref(), None)
    })
    .await
    .map_err(|e| AddError::StandingBy(format!("{why}; reading the pod's rules: {e}")))?
    .map_err(|e| AddError::StandingBy(format!("{why}; reading the pod's rules: {e}")))?;
    if found.is_empty() {
        return Err(AddError::StandingBy(format!(
            "{why}; that agent has not captured it"
        )));
    }
    let reason = format!(
        "pod {pod} not enrolled by ambpf yet: another node agent serves ztunnel and has \
         captured it ({found}); ambpf takes it over when that agent stops"
    );
    info!("CNI add: {reason}");
    Ok(CmdAddReply::Skipped { reason })
}

/// Has the controller remove the redirection of a pod whose ADD fails after
/// its enrolment (`netns_inode`: the namespace enrolled; `None`: unknown, as
/// after a timeout, when the namespace the CNI posted is the one), and
/// waits until it is done or the agent is shutting down.
async fn abandon(endpoint: &Endpoint, uid: &str, netns_inode: Option<u64>) {
    let (reply, done) = oneshot::channel();
    let request = AbandonRequest {
        uid: uid.to_owned(),
        netns_inode,
        reply,
    };
    if endpoint
        .controller
        .send(CniRequest::Abandon(request))
        .await
        .is_ok()
    {
        let _ = tokio::time::timeout(ABANDON_TIMEOUT, done).await;
    }
}

/// Returns once the agent shuts down (never, if the sender is gone
/// without).
async fn shutting_down(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|&down| down).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How long an abandoned pod's removal may take before the ADD is answered
/// anyway (the controller's next pass removes it then).
const ABANDON_TIMEOUT: Duration = Duration::from_secs(4);

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt as _;

    use std::fs;

    use super::*;
    use std::os::unix::fs::MetadataExt;

    async fn post(path: &Path, request: &str) -> String {
        let mut conn = UnixStream::connect(path).await.unwrap();
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        conn.read_to_string(&mut response).await.unwrap();
        response
    }

    #[tokio::test]
    async fn requests_reach_the_controller_and_a_pod_ztunnel_lacks_is_abandoned() {
        let dir = std::env::temp_dir().join(format!("ambpf-cni-srv-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("pluginevent.sock");
        drop(bind(&path).unwrap()); // stale
        let listener = bind(&path).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let (tx, mut rx) = mpsc::channel(4);
        let stats = Arc::new(CniStats::default());
        // No ztunnel ever connects to this one.
        let zds = ZdsHandle::new(crate::zds::ZdsConfig::default());
        let (_running, shutdown) = watch::channel(false);
        let endpoint = Endpoint {
            controller: tx,
            zds,
            selection: PodSelection::Every,
            stats: stats.clone(),
            shutdown,
            standby: Default::default(),
        };
        let server = tokio::spawn(serve(listener, endpoint));
        // A controller double: enrols uid "ok", refuses the rest; records
        // the pods abandoned.
        let (abandoned_tx, mut abandoned) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(request) = rx.recv().await {
                match request {
                    CniRequest::Enroll(request) => {
                        let result = if request.pod.workload.uid == "ok" {
                            let netns = request.pod.workload.netns.path();
                            assert_eq!(netns, Path::new("/run/netns/x"));
                            Ok(CniEnrolled { netns_inode: 7 })
                        } else {
                            Err(AddError::Enrol("no address".to_owned()))
                        };
                        request.reply.send(result).unwrap();
                    }
                    CniRequest::Abandon(request) => {
                        abandoned_tx
                            .send((request.uid.clone(), request.netns_inode))
                            .unwrap();
                        request.reply.send(()).unwrap();
                    }
                }
            }
        });
        let body = |uid: &str| {
            format!(
                r#"{{"podName":"a","podNamespace":"shop","podUid":"{uid}","netns":"/run/netns/x","ips":["10.0.0.5"]}}"#
            )
        };
        let request = |body: String| {
            format!(
                "POST /cmdadd HTTP/1.1\r\nhost: ambpf\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        // Enrolled, but no ztunnel holds it: a retryable failure, and the
        // controller is told to take the redirection away before the answer.
        let unheld = post(&path, &request(body("ok"))).await;
        assert!(unheld.starts_with("HTTP/1.1 503"), "{unheld}");
        assert!(unheld.contains("no ztunnel is connected"), "{unheld}");
        assert_eq!(abandoned.try_recv(), Ok(("ok".to_owned(), Some(7))));
        let refused = post(&path, &request(body("bad"))).await;
        assert!(refused.starts_with("HTTP/1.1 500"), "{refused}");
        assert!(refused.contains("no address"), "{refused}");
        // The cause is said once.
        assert_eq!(refused.matches("no address").count(), 1, "{refused}");
        assert!(abandoned.try_recv().is_err(), "nothing enrolled to abandon");
        let garbage = post(&path, &request("{".to_owned())).await;
        assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
        let get = post(&path, "GET /cmdadd HTTP/1.1\r\n\r\n").await;
        assert!(get.starts_with("HTTP/1.1 405"), "{get}");
        let get = |c: &prometheus_client::metrics::counter::Counter| c.get();
        assert_eq!(
            [
                &stats.enrolled,
                &stats.skipped,
                &stats.refused,
                &stats.invalid
            ]
            .map(get),
            [0, 0, 2, 2]
        );
        server.abort();
        fs::remove_dir_all(&dir).unwrap();
    }
}
