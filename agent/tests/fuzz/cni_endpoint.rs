//! The CNI endpoint (`POST /cmdadd` over a unix socket) against arbitrary
//! bytes and against requests that are almost right: HTTP framing (request
//! line, headers, content-length, how the bytes arrive), the JSON body and
//! its addresses. Whatever comes, the endpoint answers with a well-formed
//! HTTP response or closes, never panics, and answers the next request.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use ambpf::{
    cni::{AddError, CniStats, selection::PodSelection, server},
    controller::{CniEnrolled, CniRequest},
    zds::{ZdsConfig, ZdsHandle},
};
use proptest::prelude::*;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::{agent_panics, agent_runtime};

/// The agent's endpoint with a controller double that enrols every pod but
/// those with uid `refuse`, and no ztunnel: an enrolled pod's ADD is
/// answered 503 (retry later); its socket directory goes with it.
struct Endpoint {
    socket: PathBuf,
    dir: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Endpoint {
    fn start() -> Self {
        let runtime = agent_runtime();
        let dir =
            std::env::temp_dir().join(format!("ambpf-fuzz-cni-{}", ambpf_testbed::unique_name("")));
        let socket = dir.join("pluginevent.sock");
        runtime.block_on(async {
            let listener = server::bind(&socket).unwrap();
            let (tx, mut rx) = mpsc::channel::<CniRequest>(16);
            tokio::spawn(async move {
                while let Some(request) = rx.recv().await {
                    match request {
                        CniRequest::Enroll(request) => {
                            let result = match request.pod.workload.uid.as_str() {
                                "refuse" => Err(AddError::Enrol(
                                    "refused by the controller double".to_owned(),
                                )),
                                _ => Ok(CniEnrolled { netns_inode: 1 }),
                            };
                            let _ = request.reply.send(result);
                        }
                        CniRequest::Abandon(request) => {
                            let _ = request.reply.send(());
                        }
                    }
                }
            });
            // No ztunnel connects: an enrolled pod's ADD fails, retryably.
            let (running, shutdown) = tokio::sync::watch::channel(false);
            let endpoint = server::Endpoint {
                controller: tx,
                zds: ZdsHandle::new(ZdsConfig::default()),
                selection: PodSelection::Every,
                stats: Arc::new(CniStats::default()),
                shutdown,
                standby: Default::default(),
            };
            tokio::spawn(async move {
                server::serve(listener, endpoint).await;
                drop(running);
            });
        });
        Self {
            socket,
            dir,
            runtime: Some(runtime),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What came back: the status code and the body, checked for framing.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: String,
}

/// Sends `chunks` one write each, closes the sending side, and reads the
/// whole answer (the endpoint closes after one).
fn exchange(endpoint: &Endpoint, chunks: &[Vec<u8>]) -> Result<Option<Answer>, TestCaseError> {
    let mut conn = UnixStream::connect(&endpoint.socket).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    for chunk in chunks {
        // The endpoint may answer and close before it has read everything.
        if conn.write_all(chunk).is_err() {
            break;
        }
    }
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let mut raw = Vec::new();
    match conn.read_to_end(&mut raw) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => return Err(TestCaseError::fail(format!("no answer: {e}"))),
    }
    if raw.is_empty() {
        return Ok(None);
    }
    let text = String::from_utf8(raw).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| TestCaseError::fail(format!("no end of head: {text:?}")))?;
    let status: u16 = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| TestCaseError::fail(format!("bad status line: {head:?}")))?;
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|n| n.parse::<usize>().ok());
    prop_assert_eq!(length, Some(body.len()), "content-length of {:?}", text);
    prop_assert!(
        [200, 400, 404, 405, 500, 503].contains(&status),
        "status {} in {:?}",
        status,
        text
    );
    Ok(Some(Answer {
        status,
        body: body.to_owned(),
    }))
}

fn request(method: &str, path: &str, headers: &[(String, String)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    for (name, value) in headers {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

fn cmd_add_body(uid: &str) -> Vec<u8> {
    json!({
        "podName": "web-0", "podNamespace": "shop", "podUid": uid,
        "netns": "/run/netns/fuzz", "ips": ["10.244.1.5", "fd00::5"]
    })
    .to_string()
    .into_bytes()
}

/// After any input, a well-formed ADD is still enrolled (and, with no
/// ztunnel to hold it, answered 503), and no task of the endpoint has
/// panicked.
fn still_serving(endpoint: &Endpoint, panics_before: usize) -> Result<(), TestCaseError> {
    let body = cmd_add_body("after");
    let headers = [("content-length".to_owned(), body.len().to_string())];
    let answer = exchange(endpoint, &[request("POST", "/cmdadd", &headers, &body)])?;
    let answer = answer.ok_or_else(|| TestCaseError::fail("no answer to a good request"))?;
    prop_assert_eq!(answer.status, 503, "{:?}", answer);
    prop_assert!(answer.body.contains("no ztunnel"), "{:?}", answer);
    prop_assert_eq!(
        agent_panics(),
        panics_before,
        "a task of the endpoint panicked"
    );
    Ok(())
}

/// Splits `bytes` at the given fractions, as a slow or fragmenting client
/// would send it.
fn split(bytes: Vec<u8>, cuts: &[f64]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|c| (c * bytes.len() as f64) as usize)
        .collect();
    points.sort_unstable();
    let mut out = Vec::new();
    let mut start = 0;
    for point in points.into_iter().chain([bytes.len()]) {
        if point > start {
            out.push(bytes[start..point].to_vec());
            start = point;
        }
    }
    out
}

/// A JSON value of any shape, up to a small depth.
pub fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "10.244.1.5",
            "fd00::5",
            "10.244.1.5/24",
            "::ffff:10.0.0.1",
            "999.1.1.1",
            "",
            "/run/netns/x",
            "ambient",
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "podName",
                    "podNamespace",
                    "podUid",
                    "netns",
                    "ips",
                    "x",
                ])
                .prop_map(str::to_owned),
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A body that is a CmdAdd with each field right, wrong or missing.
fn cmd_add_like() -> impl Strategy<Value = Vec<u8>> {
    let field = || prop_oneof![any_json(), ".{0,20}".prop_map(Value::from)];
    (
        field(),
        field(),
        prop_oneof![Just(json!("refuse")), Just(json!("ok")), field()],
        field(),
        prop_oneof![
            prop::collection::vec(
                prop_oneof![
                    any::<std::net::IpAddr>().prop_map(|ip| json!(ip.to_string())),
                    any_json()
                ],
                0..4
            )
            .prop_map(Value::from),
            any_json()
        ],
    )
        .prop_map(|(name, namespace, uid, netns, ips)| {
            json!({"podName": name, "podNamespace": namespace, "podUid": uid, "netns": netns, "ips": ips})
                .to_string()
                .into_bytes()
        })
}

/// A content-length that matches, lies, or is no number at all.
fn content_length(actual: usize) -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        4 => Just(Some(actual.to_string())),
        1 => Just(None),
        1 => (0usize..200_000).prop_map(|n| Some(n.to_string())),
        1 => prop::sample::select(vec![
            "-1", "18446744073709551616", "99999999999999999999999", " 12 ", "0x10", "", "1e3",
        ])
        .prop_map(|s| Some(s.to_owned())),
    ]
}

/// Runs `property` on `strategy`'s inputs against one endpoint.
fn check<S: Strategy>(
    strategy: S,
    property: impl Fn(&Endpoint, S::Value) -> Result<(), TestCaseError>,
) {
    let endpoint = Endpoint::start();
    let mut runner = proptest::test_runner::TestRunner::new(crate::config());
    let result = runner.run(&strategy, |input| {
        let panics = agent_panics();
        property(&endpoint, input)?;
        still_serving(&endpoint, panics)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn arbitrary_bytes_get_an_answer_or_a_close() {
    let input = (
        prop::collection::vec(any::<u8>(), 0..4096),
        prop::collection::vec(0.0f64..1.0, 0..4),
    );
    check(input, |endpoint, (bytes, cuts)| {
        if let Some(answer) = exchange(endpoint, &split(bytes, &cuts))? {
            prop_assert_ne!(answer.status, 200, "{:?}", answer);
        }
        Ok(())
    });
}

#[test]
fn almost_right_requests_are_answered_as_what_they_are() {
    let input = (
        prop_oneof![4 => Just("POST".to_owned()), 1 => "[A-Z]{1,7}"],
        prop_oneof![
            4 => Just("/cmdadd".to_owned()),
            1 => Just("/cmdadd?x=1".to_owned()),
            1 => "/[a-z?=/]{0,10}"
        ],
        prop_oneof![
            3 => cmd_add_like(),
            1 => any_json().prop_map(|v| v.to_string().into_bytes()),
            1 => prop::collection::vec(any::<u8>(), 0..512),
        ]
        .prop_flat_map(|body| {
            let actual = body.len();
            (Just(body), content_length(actual))
        }),
        prop::collection::vec(("[a-zA-Z-]{1,16}", "[ -~]{0,40}"), 0..4),
        prop::collection::vec(0.0f64..1.0, 0..4),
    );
    check(
        input,
        |endpoint, (method, path, (body, length), extra, cuts)| {
            let mut headers: Vec<(String, String)> = extra;
            let ours = headers.len();
            if let Some(length) = &length {
                headers.push(("Content-Length".to_owned(), length.clone()));
            }
            let sent = split(request(&method, &path, &headers, &body), &cuts);
            let answer = exchange(endpoint, &sent)?
                .ok_or_else(|| TestCaseError::fail("a request got no answer"))?;

            // Only one content-length, and the body's: the request is what it says.
            let framed = length.as_deref() == Some(body.len().to_string().as_str())
                && !headers[..ours]
                    .iter()
                    .any(|(name, _)| name.eq_ignore_ascii_case("content-length"));
            let parsed: Option<ambpf::cni::CmdAdd> = serde_json::from_slice(&body).ok();
            let to_cmdadd = path.split('?').next() == Some("/cmdadd");
            let expected = match (framed, to_cmdadd, method == "POST", parsed) {
                (false, ..) => None,
                (true, false, ..) => Some(404),
                (true, true, false, _) => Some(405),
                (true, true, true, None) => Some(400),
                (true, true, true, Some(add)) if add.pod_uid.is_empty() || add.netns.is_empty() => {
                    Some(400)
                }
                (true, true, true, Some(add)) if add.pod_uid == "refuse" => Some(500),
                (true, true, true, Some(_)) => Some(503),
            };
            if let Some(status) = expected {
                prop_assert_eq!(answer.status, status, "{:?}", answer);
            }
            Ok(())
        },
    );
}

/// A body larger than the endpoint takes is refused without being read
/// whole, however large the client says it is.
#[test]
fn oversized_requests_are_refused() {
    let endpoint = Endpoint::start();
    let panics = agent_panics();
    for length in ["70000", "18446744073709551615"] {
        let headers = [("content-length".to_owned(), length.to_owned())];
        let answer = exchange(&endpoint, &[request("POST", "/cmdadd", &headers, b"{}")])
            .unwrap()
            .unwrap();
        assert_eq!(answer.status, 400, "{answer:?}");
        assert!(answer.body.contains("too large"), "{answer:?}");
    }
    let head = vec![b'x'; 100 * 1024];
    let answer = exchange(&endpoint, &[head]).unwrap().unwrap();
    assert_eq!(answer.status, 400, "{answer:?}");
    still_serving(&endpoint, panics).unwrap();
}
