//! Privileged: aya-log records written by the kernel programs (`log`
//! records) reach the agent's `tracing` output through its log bridge, as
//! JSON lines. A test binary of its own, since it installs the process-wide
//! subscriber.

use std::{
    net::{SocketAddr, UdpSocket},
    sync::Mutex,
    time::Duration,
};

use ambpf::{
    bpf::{Dataplane, PinLayout},
    netns::Netns,
};
use ambpf_testbed::{BpffsMount, PodAndNode};

/// Every byte the subscriber writes.
struct Capture(Mutex<Vec<u8>>);

impl std::io::Write for &'static Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

fn lines() -> Vec<String> {
    String::from_utf8_lossy(&CAPTURE.0.lock().unwrap())
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_log_records_reach_the_agent_log() {
    ambpf::logging::init_with_writer(
        ambpf::logging::LogFormat::Json,
        ambpf::logging::parse_filter("trace").unwrap(),
        || &CAPTURE,
    );

    let bpffs = BpffsMount::create().unwrap();
    let pn = PodAndNode::create().unwrap();
    let mut dataplane = Dataplane::load(PinLayout::new(bpffs.path().join("ambpf"))).unwrap();
    dataplane.forward_kernel_logs().unwrap();
    let attachment = dataplane
        .attach_iface_counters(&Netns::open(pn.pod.name()).unwrap(), "eth0")
        .unwrap();

    pn.pod
        .run(|| {
            let s = UdpSocket::bind(SocketAddr::from((PodAndNode::POD.v4, 0))).unwrap();
            s.send_to(b"hello", SocketAddr::from((PodAndNode::NODE.v4, 9)))
                .unwrap();
        })
        .unwrap();

    let expected = format!("first packet on ifindex {} egress", attachment.ifindex);
    for _ in 0..100 {
        // A JSON line whose message is the kernel's record.
        if lines().iter().any(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("message")?.as_str().map(|m| m.contains(&expected)))
                .unwrap_or(false)
        }) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no kernel log record {expected:?}; got {:?}", lines());
}
