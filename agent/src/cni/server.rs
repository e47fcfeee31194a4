//! The agent's CNI endpoint: `POST /cmdadd` over a unix socket.
//!
//! Served by the agent's small HTTP/1.1 responder ([`crate::http`]), one
//! request per connection, as the health endpoint is. Each posted pod is first checked against
//! the [`PodSelection`]; a pod to enrol is handed to the controller, which
//! stays the only owner of the redirection. The answer is 200 with a
//! [`CmdAddReply`] once the pod's redirection is in place and ztunnel's
//! desired set has it, or at once when the pod is skipped; else an error
//! status with the reason as the body (503 when the API server could not
//! say whether the pod is ambient).

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use log::{debug, info, warn};
use tokio::{
    io::AsyncWriteExt,
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};

use super::{
    AddPhase, CmdAdd, CmdAddReply, CniStats,
    selection::{PodSelection, Verdict},
};
use crate::controller::EnrollRequest;

/// Largest request accepted (head and body).
const MAX_REQUEST: usize = 64 * 1024;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the controller may take to answer one request.
pub const ENROLL_TIMEOUT: Duration = Duration::from_secs(30);

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

/// Serves requests from `listener`, handing the pods `selection` enrols to
/// the controller through `controller`, until the controller is gone.
pub async fn serve(
    listener: UnixListener,
    controller: mpsc::Sender<EnrollRequest>,
    selection: PodSelection,
    stats: Arc<CniStats>,
) {
    info!(
        "CNI endpoint ready; enrolling {}",
        match selection {
            PodSelection::Every => "every pod the plugin posts",
            PodSelection::Ambient(_) => "the ambient pods the plugin posts",
        }
    );
    loop {
        let conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            Err(e) => {
                warn!("CNI accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if controller.is_closed() {
            return;
        }
        tokio::spawn(handle(
            conn,
            controller.clone(),
            selection.clone(),
            stats.clone(),
        ));
    }
}

async fn handle(
    mut conn: UnixStream,
    controller: mpsc::Sender<EnrollRequest>,
    selection: PodSelection,
    stats: Arc<CniStats>,
) {
    let read = crate::http::read_request(&mut conn, MAX_REQUEST);
    let answer = match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(Ok(request)) => {
            let started = Instant::now();
            let answer = respond(&request, &controller, &selection, &stats).await;
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

async fn respond(
    request: &crate::http::Request,
    controller: &mpsc::Sender<EnrollRequest>,
    selection: &PodSelection,
    stats: &CniStats,
) -> Answer {
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
    let deciding = Instant::now();
    let verdict = selection.select(&add).await;
    stats.time(AddPhase::Decide, deciding.elapsed());
    let spec = match verdict {
        Ok(Verdict::Enroll(spec)) => spec,
        Ok(Verdict::Skip(why)) => {
            let reason = format!("pod {pod} not enrolled: {why}");
            info!("CNI add: {reason}");
            return Ok(CmdAddReply::Skipped { reason });
        }
        Err(e) => {
            let text = format!("cannot tell whether pod {pod} is ambient: {e}");
            warn!("CNI add refused: {text}");
            return Err((503, format!("{text}\n")));
        }
    };
    let enrolling = Instant::now();
    let (reply, answer) = oneshot::channel();
    let request = EnrollRequest { pod: spec, reply };
    if controller.send(request).await.is_err() {
        return Err((503, "the agent is shutting down\n".to_owned()));
    }
    let answer = tokio::time::timeout(ENROLL_TIMEOUT, answer).await;
    let enrolled_in = enrolling.elapsed();
    stats.time(AddPhase::Enrol, enrolled_in);
    match answer {
        Ok(Ok(Ok(()))) => {
            info!(
                "CNI add: pod {pod} enrolled in {:.2} ms",
                enrolled_in.as_secs_f64() * 1e3
            );
            Ok(CmdAddReply::Enrolled)
        }
        Ok(Ok(Err(why))) => Err((500, format!("pod {pod} not enrolled: {why}\n"))),
        Ok(Err(_)) => Err((503, "the agent is shutting down\n".to_owned())),
        Err(_) => Err((503, format!("pod {pod}: enrolment timed out\n"))),
    }
}

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
    async fn requests_reach_the_controller_and_its_answer_comes_back() {
        let dir = std::env::temp_dir().join(format!("ambpf-cni-srv-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("pluginevent.sock");
        drop(bind(&path).unwrap()); // stale
        let listener = bind(&path).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let (tx, mut rx) = mpsc::channel(4);
        let stats = Arc::new(CniStats::default());
        let server = tokio::spawn(serve(listener, tx, PodSelection::Every, stats.clone()));
        // A controller double: accepts uid "ok", refuses the rest.
        tokio::spawn(async move {
            while let Some(request) = rx.recv().await {
                let result = if request.pod.workload.uid == "ok" {
                    assert_eq!(request.pod.workload.netns.path(), Path::new("/run/netns/x"));
                    Ok(())
                } else {
                    Err("no address".to_owned())
                };
                request.reply.send(result).unwrap();
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
        let ok = post(&path, &request(body("ok"))).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.ends_with("\r\n\r\n{\"outcome\":\"enrolled\"}"), "{ok}");
        let refused = post(&path, &request(body("bad"))).await;
        assert!(refused.starts_with("HTTP/1.1 500"), "{refused}");
        assert!(refused.contains("no address"), "{refused}");
        let garbage = post(&path, &request("{".to_owned())).await;
        assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
        let get = post(&path, "GET /cmdadd HTTP/1.1\r\n\r\n").await;
        assert!(get.starts_with("HTTP/1.1 405"), "{get}");
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            [
                &stats.enrolled,
                &stats.skipped,
                &stats.refused,
                &stats.invalid
            ]
            .map(get),
            [1, 0, 1, 2]
        );
        server.abort();
        fs::remove_dir_all(&dir).unwrap();
    }
}
