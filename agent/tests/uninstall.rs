//! Privileged: `ambpf uninstall` removes what enrolment made in the pods'
//! namespaces (the reply routing) and every pin, which detaches every link.

use std::process::Command;

use ambpf::{
    bpf::{Dataplane, PinLayout},
    netns::Netns,
    redirect::routing,
};
use ambpf_testbed::{BpffsMount, cluster::Cluster};

#[test]
fn uninstall_removes_routes_links_and_pins() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(1).unwrap();
    let netns = Netns::open(cluster.pods[0].ns.name()).unwrap();
    {
        let mut dataplane = Dataplane::load(pins.clone()).unwrap();
        dataplane.enroll_pod(&netns, true).unwrap();
    }
    assert!(routing::reply_routing_installed(&netns).unwrap());
    assert!(pins.pod_links_dir(netns.inode()).exists());

    let out = Command::new(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pins.root())
        .arg("uninstall")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("removed the reply routing"), "{stdout}");
    assert!(!routing::reply_routing_installed(&netns).unwrap());
    assert!(!pins.root().exists());
}
