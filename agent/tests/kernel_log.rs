//! Privileged: aya-log records written by the kernel programs reach the
//! agent's `log` logger. A test binary of its own, since it installs the
//! process-wide logger.

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

struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        self.0.lock().unwrap().push(format!("{}", record.args()));
    }
    fn flush(&self) {}
}

static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_log_records_reach_the_agent_log() {
    log::set_logger(&CAPTURE).unwrap();
    log::set_max_level(log::LevelFilter::Trace);

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
        if CAPTURE
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.contains(&expected))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "no kernel log record {expected:?}; got {:?}",
        CAPTURE.0.lock().unwrap()
    );
}
