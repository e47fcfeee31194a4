//! The `ambpf-cni` plugin against any network configuration and
//! `CNI_ARGS`: `prevResult` of any shape, timeouts that are no durations,
//! arguments half given. It always exits 0 with `prevResult` passed through
//! or 1 with a CNI error (never a panic), and posts to the agent exactly the
//! addresses of `prevResult` that are addresses.

use std::{
    io::{Read as _, Write as _},
    net::IpAddr,
    os::unix::net::UnixListener,
    path::PathBuf,
    process::Command,
    sync::{Arc, Mutex},
};

use ambpf::cni::CmdAdd;
use proptest::prelude::*;
use serde_json::{Value, json};

use crate::cni_endpoint::any_json;

/// An agent double: answers every request `200 enrolled` and keeps the
/// bodies it was posted.
struct Agent {
    dir: PathBuf,
    socket: PathBuf,
    posted: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Agent {
    fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "ambpf-fuzz-plugin-{}",
            ambpf_testbed::unique_name("")
        ));
        std::fs::create_dir(&dir).unwrap();
        let socket = dir.join("agent.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let posted = Arc::new(Mutex::new(Vec::new()));
        let keep = posted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let request = ambpf_read_request(&mut conn);
                keep.lock().unwrap().push(request);
                let body = r#"{"outcome":"enrolled"}"#;
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        Self {
            dir,
            socket,
            posted,
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // The accept thread ends with the process; the socket file goes now.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The body of one request (the plugin sends a content-length).
fn ambpf_read_request(conn: &mut std::os::unix::net::UnixStream) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0);
            if raw.len() >= end + 4 + length {
                return raw[end + 4..end + 4 + length].to_vec();
            }
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return raw,
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A `prevResult` whose `ips` entries are right, wrong or anything.
fn prev_result() -> impl Strategy<Value = Option<Value>> {
    let address = prop_oneof![
        any::<IpAddr>().prop_map(|ip| json!(format!("{ip}/24"))),
        any::<IpAddr>().prop_map(|ip| json!(ip.to_string())),
        any_json(),
    ];
    let entry = prop_oneof![
        4 => address.prop_map(|a| json!({ "address": a, "interface": 0 })),
        1 => any_json(),
    ];
    prop::option::weighted(
        0.9,
        prop_oneof![
            4 => prop::collection::vec(entry, 0..4)
                .prop_map(|ips| json!({ "cniVersion": "1.0.0", "ips": ips })),
            1 => any_json(),
        ],
    )
}

fn cni_args() -> impl Strategy<Value = String> {
    let pair = prop_oneof![
        prop::sample::select(vec![
            "K8S_POD_NAME=web-0",
            "K8S_POD_NAMESPACE=shop",
            "K8S_POD_UID=uid-1",
            "K8S_POD_UID=",
            "IgnoreUnknown=1",
        ])
        .prop_map(str::to_owned),
        "[ -~]{0,16}",
    ];
    prop_oneof![
        4 => Just("K8S_POD_NAME=web-0;K8S_POD_NAMESPACE=shop;K8S_POD_UID=uid-1".to_owned()),
        2 => prop::collection::vec(pair, 0..5).prop_map(|p| p.join(";")),
    ]
}

/// `ambpf-cni` ADD with `stdin` as its network configuration.
fn add(stdin: &[u8], args: &str, netns: &str) -> std::process::Output {
    ambpf_testbed::output_with_stdin(
        Command::new(env!("CARGO_BIN_EXE_ambpf-cni"))
            .env("CNI_COMMAND", "ADD")
            .env("CNI_ARGS", args)
            .env("CNI_NETNS", netns),
        stdin,
    )
    .unwrap()
}

/// Found by the property below: serde_json's default float parsing is not
/// exact, so a number in `prevResult` came out changed in its last digit.
#[test]
fn prev_result_numbers_pass_through_exactly() {
    let agent = Agent::start();
    let prev = r#"{"cniVersion":"1.0.0","podName":-2.1755484156242337e+91,"mtu":0.1}"#;
    let config = format!(
        r#"{{"cniVersion":"1.0.0","name":"k8s","type":"ambpf-cni","agentSocket":{:?},"prevResult":{prev}}}"#,
        agent.socket.to_string_lossy()
    );
    let output = add(
        config.as_bytes(),
        "K8S_POD_NAME=web-0;K8S_POD_NAMESPACE=shop;K8S_POD_UID=uid-1",
        "/run/netns/x",
    );
    assert!(output.status.success(), "{output:?}");
    let printed: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(printed["podName"].as_f64(), Some(-2.1755484156242337e+91));
    assert_eq!(printed["mtu"].as_f64(), Some(0.1));
}

#[test]
fn the_plugin_passes_prev_result_through_or_fails_with_a_cni_error() {
    let agent = Agent::start();
    let socket = agent.socket.to_string_lossy().into_owned();
    let input = (
        prev_result(),
        prop::option::weighted(
            0.3,
            prop_oneof![
                any::<f64>().prop_map(|f| json!(f)),
                Just(json!(1e300)),
                Just(json!(-1)),
                any_json()
            ],
        ),
        cni_args(),
        prop_oneof![4 => Just("/run/netns/x".to_owned()), 1 => Just(String::new())],
        prop::option::weighted(0.05, prop::collection::vec(any::<u8>(), 0..64)),
    );
    let mut runner = proptest::test_runner::TestRunner::new(crate::config());
    let result = runner.run(&input, |(prev, timeout, args, netns, raw)| {
        let mut config = json!({ "cniVersion": "1.0.0", "name": "k8s", "type": "ambpf-cni", "agentSocket": socket });
        if let Some(prev) = &prev {
            config["prevResult"] = prev.clone();
        }
        if let Some(timeout) = timeout {
            config["agentTimeoutSeconds"] = timeout;
        }
        // Mostly the configuration above; now and then bytes of any kind.
        let from_config = raw.is_none();
        let stdin = raw.unwrap_or_else(|| config.to_string().into_bytes());
        agent.posted.lock().unwrap().clear();
        let output = add(&stdin, &args, &netns);
        let said = || format!("{output:?}");
        let printed: Value = serde_json::from_slice(&output.stdout)
            .map_err(|e| TestCaseError::fail(format!("stdout is not JSON ({e}): {}", said())))?;
        match output.status.code() {
            Some(0) if !from_config => {}
            Some(0) => {
                let expected = prev.clone().unwrap_or_else(|| json!({ "cniVersion": "1.0.0" }));
                prop_assert_eq!(&printed, &expected, "{}", said());
            }
            Some(1) => {
                prop_assert!(printed["code"].is_u64() && printed["msg"].is_string(), "{}", said());
            }
            _ => return Err(TestCaseError::fail(format!("the plugin crashed: {}", said()))),
        }
        // What reached the agent: the addresses of prevResult, no more.
        let posted = agent.posted.lock().unwrap().clone();
        if let (Some(body), true) = (posted.first(), from_config) {
            let add: CmdAdd = serde_json::from_slice(body)
                .map_err(|e| TestCaseError::fail(format!("posted a bad body: {e}")))?;
            let expected: Vec<IpAddr> = prev
                .as_ref()
                .and_then(|p| p.get("ips")?.as_array().cloned())
                .unwrap_or_default()
                .iter()
                .filter_map(|e| e.get("address")?.as_str()?.split('/').next()?.parse().ok())
                .collect();
            prop_assert_eq!(add.ips, expected);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
