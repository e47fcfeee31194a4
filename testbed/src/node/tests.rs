//! Privileged: containerd starts, runs a kubelet-style pod through the real
//! CNI plugins, and leaves nothing behind.

use super::*;

fn snapshot_host() -> (Vec<PathBuf>, Vec<String>) {
    let shims = fs::read_dir(SHIM_SOCKET_DIR)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let out = Command::new("ip").args(["-br", "link"]).output().unwrap();
    let links = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().next().unwrap_or_default().to_owned())
        .collect();
    (shims, links)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_style_pod_starts_on_the_bridge_and_everything_goes_on_drop() {
    if let Some(why) = super::containers_cannot_start() {
        eprintln!("skipped: {why}");
        return;
    }
    let host_before = snapshot_host();
    let node = Node::start(NodeConfig::default()).unwrap();
    let (dir, cgroup, netns) = (node.dir.clone(), node.cgroup_v2(), node.netns.path());
    let cri = node.cri().await.unwrap();
    let version = cri.version().await.unwrap();
    assert_eq!(version.runtime_name, "containerd");
    assert!(
        cri.images()
            .await
            .unwrap()
            .contains(&image::IMAGE.to_owned())
    );

    let pod = PodSpec::new("shop", "web");
    let running = cri
        .start_pod(&pod, &["/bin/busybox", "sleep", "600"])
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.log()));
    assert!(running.ip.starts_with("10.88.0."), "{running:?}");
    // The bridge is the node's, not the host's.
    let bridge = Command::new("ip")
        .args(["-n", node.netns.name(), "-br", "addr", "show", "cni0"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&bridge.stdout).contains("10.88.0.1/24"));
    // The sandbox and the app run in kubelet's cgroup for the pod, in cgroup v2.
    let pod_cgroup = cgroup.join(format!("kubepods/besteffort/pod{}", pod.uid));
    let containers: Vec<String> = fs::read_dir(&pod_cgroup)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(containers.contains(&running.sandbox_id), "{containers:?}");
    assert!(containers.contains(&running.container_id), "{containers:?}");
    // Its network namespace is a path this (host mount namespace) process sees.
    assert_eq!(fs::read_dir(node.netns_dir()).unwrap().count(), 1);

    // A second pod while the first runs; removed through CRI: nothing of it stays.
    let other = PodSpec::new("shop", "db");
    let second = cri
        .start_pod(&other, &["/bin/busybox", "sleep", "600"])
        .await
        .unwrap();
    cri.remove_pod(&second.sandbox_id).await.unwrap();
    assert_eq!(
        cri.sandboxes().await.unwrap(),
        std::slice::from_ref(&running.sandbox_id)
    );
    assert_eq!(fs::read_dir(node.netns_dir()).unwrap().count(), 1);
    // libcni cached the running pod's results on the host, outside the node
    // (the removed pod's went with its DEL).
    let mut cached: Vec<String> = node
        .cni_cache_entries()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    cached.sort();
    let id = &running.sandbox_id;
    assert_eq!(
        cached,
        [
            format!("{}-{id}-eth0", node.network_name()),
            format!("cni-loopback-{id}-lo")
        ]
    );
    let cached = node.cni_cache_entries();

    drop(cri);
    drop(node); // with a pod still running
    assert!(!dir.exists(), "{} left", dir.display());
    assert!(!cgroup.exists(), "{} left", cgroup.display());
    assert!(!netns.exists(), "{} left", netns.display());
    for hierarchy in fs::read_dir(CGROUP_ROOT).unwrap().flatten() {
        let left = hierarchy.path().join(cgroup.file_name().unwrap());
        assert!(!left.exists(), "{} left", left.display());
    }
    assert!(mounts_below(&dir).is_empty());
    for entry in cached {
        assert!(!entry.exists(), "{} left", entry.display());
    }
    assert_eq!(snapshot_host(), host_before);
}
