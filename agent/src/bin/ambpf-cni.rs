//! `ambpf-cni`: the chained CNI plugin that holds a new pod's network setup
//! until the ambpf agent has captured its traffic.
//!
//! ADD posts the pod (`CNI_ARGS` K8S_POD_NAME, K8S_POD_NAMESPACE,
//! K8S_POD_UID; `CNI_NETNS`; the IPs of `prevResult`) to the agent's unix
//! socket (`agentSocket` in the network configuration) and waits
//! (`agentTimeoutSeconds`, default 30) for its answer. When the agent has
//! enrolled the pod, or answers that it skipped it (not ambient, or deleted
//! meanwhile; the reason goes to stderr, the runtime's log), it prints
//! `prevResult` unchanged, as a chained plugin must, and exits 0; else it
//! prints a CNI error and exits non-zero, so the runtime fails the pod's
//! network setup: code 11 ("try again later") when the agent says a retry
//! may succeed (no ztunnel connected, a NACK, an ack timeout), 101 when not,
//! 100 when the agent cannot be reached. DEL, CHECK, GC and STATUS succeed without contacting the
//! agent; VERSION lists the supported versions.

use std::{
    io::{Read, Write},
    net::IpAddr,
    os::unix::net::UnixStream,
    path::PathBuf,
    time::Duration,
};

use ambpf::cni::{CmdAdd, CmdAddReply, DEFAULT_SOCKET};
use serde_json::{Value, json};

const SUPPORTED: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
const DEFAULT_TIMEOUT: f64 = 30.0;

/// CNI error codes (1-99 are the spec's; 100+ this plugin's).
const INVALID_ENV: u32 = 4;
const DECODE: u32 = 6;
const INVALID_CONFIG: u32 = 7;
/// The spec's "try again later": the agent failed the pod for a reason a
/// new attempt may not meet (no ztunnel connected, a NACK, an ack timeout,
/// the API server unreachable); the runtime retries with a new sandbox.
const TRY_AGAIN_LATER: u32 = 11;
const AGENT_UNREACHABLE: u32 = 100;
/// The agent failed the pod for good (its namespace unusable, its
/// redirection impossible to set up).
const AGENT_REFUSED: u32 = 101;

struct CniError {
    code: u32,
    msg: String,
    details: String,
}

fn error(code: u32, msg: &str, details: impl ToString) -> CniError {
    CniError {
        code,
        msg: msg.to_owned(),
        details: details.to_string(),
    }
}

fn main() {
    // stdout carries the CNI result; log lines go to stderr, the runtime's
    // log, filtered by RUST_LOG (a bad filter falls back to `info`: the
    // plugin must still answer the runtime).
    let filter = ambpf::logging::filter(None)
        .or_else(|_| ambpf::logging::filter(Some("info")))
        .expect("`info` is a valid filter");
    ambpf::logging::init_with_writer(ambpf::logging::LogFormat::Text, filter, std::io::stderr);
    let mut stdin = Vec::new();
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    // VERSION needs no configuration, the rest may carry one.
    if command != "VERSION" {
        let _ = std::io::stdin().read_to_end(&mut stdin);
    }
    let config: Option<Value> = serde_json::from_slice(&stdin).ok();
    let version = config
        .as_ref()
        .and_then(|c| c.get("cniVersion"))
        .and_then(Value::as_str)
        .unwrap_or("1.0.0")
        .to_owned();
    match run(&command, &stdin, config) {
        Ok(Some(output)) => println!("{output}"),
        Ok(None) => {}
        Err(e) => {
            tracing::error!(code = e.code, "ambpf-cni: {}: {}", e.msg, e.details);
            let out = json!({
                "cniVersion": version,
                "code": e.code,
                "msg": e.msg,
                "details": e.details,
            });
            println!("{out}");
            std::process::exit(1);
        }
    }
}

fn run(command: &str, stdin: &[u8], config: Option<Value>) -> Result<Option<Value>, CniError> {
    match command {
        "VERSION" => Ok(Some(json!({
            "cniVersion": SUPPORTED.last(),
            "supportedVersions": SUPPORTED,
        }))),
        "DEL" | "CHECK" | "GC" | "STATUS" => Ok(None),
        "ADD" => {
            let config = config.ok_or_else(|| {
                error(
                    DECODE,
                    "invalid network configuration",
                    String::from_utf8_lossy(stdin),
                )
            })?;
            add(&config).map(Some)
        }
        other => Err(error(INVALID_ENV, "unknown CNI_COMMAND", other)),
    }
}

/// `K8S_POD_NAME=a;K8S_POD_NAMESPACE=b;...` -> the value of `key`.
fn cni_arg(args: &str, key: &str) -> Option<String> {
    args.split(';')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_owned())
}

fn add(config: &Value) -> Result<Value, CniError> {
    let version = config
        .get("cniVersion")
        .and_then(Value::as_str)
        .unwrap_or("1.0.0");
    // A chained plugin passes the previous result through.
    let result = config
        .get("prevResult")
        .cloned()
        .unwrap_or_else(|| json!({ "cniVersion": version }));
    let args = std::env::var("CNI_ARGS").unwrap_or_default();
    let (Some(name), Some(namespace)) = (
        cni_arg(&args, "K8S_POD_NAME"),
        cni_arg(&args, "K8S_POD_NAMESPACE"),
    ) else {
        // Not a Kubernetes pod: nothing to capture.
        return Ok(result);
    };
    let uid = cni_arg(&args, "K8S_POD_UID").unwrap_or_default();
    if uid.is_empty() {
        return Err(error(INVALID_ENV, "CNI_ARGS has no K8S_POD_UID", args));
    }
    let netns = std::env::var("CNI_NETNS").unwrap_or_default();
    if netns.is_empty() {
        return Err(error(INVALID_ENV, "CNI_NETNS is not set", ""));
    }
    let ips = result
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address")?.as_str())
        .filter_map(|cidr| cidr.split('/').next()?.parse::<IpAddr>().ok())
        .collect();
    let socket = config
        .get("agentSocket")
        .and_then(Value::as_str)
        .unwrap_or(DEFAULT_SOCKET);
    let timeout = config
        .get("agentTimeoutSeconds")
        .and_then(Value::as_f64)
        .unwrap_or(DEFAULT_TIMEOUT);
    let timeout = Duration::try_from_secs_f64(timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| error(INVALID_CONFIG, "invalid agentTimeoutSeconds", timeout))?;
    let request = CmdAdd {
        pod_name: name,
        pod_namespace: namespace,
        pod_uid: uid,
        netns,
        ips,
    };
    let span = tracing::info_span!(
        "cni_add",
        pod = %ambpf::logging::PodName(&request.pod_namespace, &request.pod_name),
        uid = %request.pod_uid,
        netns = %request.netns,
    );
    let _entered = span.enter();
    match post(&PathBuf::from(socket), &request, timeout)? {
        CmdAddReply::Enrolled => {}
        // The pod starts without redirection, by the agent's decision.
        CmdAddReply::Skipped { reason } => tracing::info!("ambpf-cni: {reason}"),
    }
    Ok(result)
}

/// `POST /cmdadd`; `Ok` only on a 200.
fn post(socket: &PathBuf, request: &CmdAdd, timeout: Duration) -> Result<CmdAddReply, CniError> {
    let pod = format!("{}/{}", request.pod_namespace, request.pod_name);
    let unreachable = |e: std::io::Error| {
        let msg = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "timed out waiting for the ambpf agent"
            }
            _ => "the ambpf agent is unreachable",
        };
        error(
            AGENT_UNREACHABLE,
            msg,
            format!("pod {pod}: {}: {e}", socket.display()),
        )
    };
    let body = serde_json::to_string(request).expect("the request serializes");
    let mut conn = UnixStream::connect(socket).map_err(unreachable)?;
    conn.set_read_timeout(Some(timeout)).map_err(unreachable)?;
    conn.set_write_timeout(Some(timeout)).map_err(unreachable)?;
    let message = format!(
        "POST /cmdadd HTTP/1.1\r\nhost: ambpf\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(message.as_bytes()).map_err(unreachable)?;
    let mut response = Vec::new();
    conn.read_to_end(&mut response).map_err(unreachable)?;
    let response = String::from_utf8_lossy(&response);
    let status: Option<u16> = response
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok());
    let answer = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.trim())
        .unwrap_or_default();
    match status {
        // An older agent answered 200 with plain text: it enrolled the pod.
        Some(200) => Ok(serde_json::from_str(answer).unwrap_or(CmdAddReply::Enrolled)),
        Some(503) => Err(error(
            TRY_AGAIN_LATER,
            "the ambpf agent could not capture the pod yet",
            answer,
        )),
        Some(code) => Err(error(
            AGENT_REFUSED,
            "the ambpf agent did not capture the pod",
            format!("HTTP {code}: {answer}"),
        )),
        None => Err(error(
            AGENT_UNREACHABLE,
            "the ambpf agent sent no valid answer",
            format!("pod {pod}: {response:?}"),
        )),
    }
}
