//! Privileged: what happens past each map's capacity, with the programs
//! loaded with small capacities and real traffic and enrolments between the
//! test's own namespaces (docs/operations.md, "Map capacities").
//!
//! - Original-destination maps (LRU): connections opened one by one, more
//!   than the capacity, all reach their destination and keep working; a
//!   storm of connections opened faster than ztunnel reads their records
//!   either reaches the right destination or is refused by ztunnel, each
//!   refusal counted (`ambpf_origdst_misses_total`); none is misrouted or
//!   left hanging.
//! - Pods map: the pod past the capacity gets an error naming the map and
//!   the capacity, nothing of it stays installed, and the enrolled pods keep
//!   being served.
//! - Pinned maps of another capacity than asked are adopted with a warning.

use std::{net::SocketAddr, time::Duration};

use ambpf::{
    bpf::{Capacities, Dataplane, PinLayout, capacity},
    netns::Netns,
    redirect::{CheckScope, EbpfRedirection, EnrollOptions, PodRedirection},
    zds::{NetnsSource, Workload, ZdsConfig, ZdsHandle},
};
use ambpf_common::{Miss, maps};
use ambpf_testbed::{
    BpffsMount, CgroupGuard,
    cluster::Cluster,
    storm::{self, Greeters, StormSummary},
    ztunnel::{ConnectionOutcome, ZtunnelConfig, ZtunnelDouble},
};

mod common;
use common::Server;

/// Tests move this process between cgroups: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const PATIENCE: Duration = Duration::from_secs(10);
const ENROLL: EnrollOptions = EnrollOptions { dns_capture: true };
/// How long the ztunnel double waits before asking a connection's original
/// destination: connections opened meanwhile all have their records in the
/// maps at once.
const ZTUNNEL_DELAY: Duration = Duration::from_millis(200);
const GREETER_PORTS: [u16; 4] = [9001, 9002, 9003, 9004];

/// The programs loaded with `capacities`, attached to a cgroup this process
/// is in; the cluster's node addresses are the host's.
fn load(
    cluster: &Cluster,
    bpffs: &BpffsMount,
    cgroup: &CgroupGuard,
    capacities: Capacities,
) -> EbpfRedirection {
    let mut dataplane =
        Dataplane::load_with(PinLayout::new(bpffs.path().join("ambpf")), capacities).unwrap();
    assert_eq!(dataplane.capacities(), capacities);
    assert!(dataplane.capacities_kept().is_empty());
    dataplane
        .serve_node(
            cgroup.path(),
            true,
            &cluster.node_addresses(),
            cluster.node_netns_cookie(),
        )
        .unwrap();
    EbpfRedirection::new(dataplane)
}

/// A ZDS server for `pods` (uid, namespace path), recording ztunnel's
/// process under `pins`, and the ztunnel double serving them, once every
/// pod's proxies run.
async fn ztunnel_for(
    pins: &PinLayout,
    pods: &[(String, std::path::PathBuf)],
    config: ZtunnelConfig,
) -> (ZtunnelDouble, Server) {
    let server = Server::start(ZdsConfig::default());
    server.record_ztunnel_processes(pins.clone());
    for (uid, path) in pods {
        server.handle.upsert(Workload {
            uid: uid.clone(),
            name: uid.clone(),
            namespace: "shop".into(),
            service_account: "app".into(),
            netns: NetnsSource::Path(path.clone()),
            netns_inode: None,
        });
    }
    let ztunnel = ZtunnelDouble::connect_with_retry(server.socket(), config);
    let uids: Vec<String> = pods.iter().map(|(uid, _)| uid.clone()).collect();
    ztunnel
        .wait_until(
            |s| {
                s.ready
                    && uids
                        .iter()
                        .all(|uid| s.workloads.get(uid).is_some_and(|w| w.proxies_running))
            },
            PATIENCE,
        )
        .await
        .unwrap();
    (ztunnel, server)
}

fn misses(pins: &PinLayout, which: Miss) -> u64 {
    capacity::read_misses(pins)
        .unwrap()
        .into_iter()
        .find(|(miss, _)| *miss == which)
        .map_or(0, |(_, n)| n)
}

fn max_entries(pins: &PinLayout, map: &str) -> u32 {
    capacity::pinned_max_entries(&pins.map(map)).unwrap()
}

/// What `/metrics` says, scraped from the agent's registry over these pins.
fn scrape(pins: &PinLayout) -> String {
    let registry = ambpf::observe::registry(ambpf::observe::AgentCollector {
        zds: ZdsHandle::new(ZdsConfig::default()),
        controller: Default::default(),
        pins: Some(pins.clone()),
        cni: None,
    });
    let mut body = String::new();
    prometheus_client::encoding::text::encode(&mut body, &registry).unwrap();
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_redirected_capacity_connections_reach_their_destination_or_are_refused_and_counted()
 {
    const CAPACITY: u32 = 16;
    let _serial = SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(1).unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let capacities = Capacities {
        redirected_connections: CAPACITY,
        ..Capacities::default()
    };
    let mut dataplane = load(&cluster, &bpffs, &cgroup, capacities);
    let pins = dataplane.pins().clone();
    for map in [maps::ORIG_BY_COOKIE, maps::ORIG_BY_TUPLE] {
        assert_eq!(max_entries(&pins, map), CAPACITY, "{map}");
    }
    let pod = &cluster.pods[0];
    dataplane
        .enroll(&Netns::open(pod.ns.name()).unwrap(), ENROLL)
        .unwrap();
    let (ztunnel, _zds) = ztunnel_for(
        &pins,
        &[("pod-1".into(), pod.ns.path())],
        ZtunnelConfig::default().original_dst_delay(ZTUNNEL_DELAY),
    )
    .await;
    let remote = cluster.remote.addrs.v4;
    let targets: Vec<SocketAddr> = GREETER_PORTS
        .iter()
        .map(|port| SocketAddr::new(remote.into(), *port))
        .collect();
    let _greeters = Greeters::start(&cluster.remote.ns, &targets).unwrap();

    // One by one, twice the capacity: ztunnel reads each record before the
    // next connection evicts it, so every one gets through, and stays open.
    let mut long_lived = tokio::task::block_in_place(|| {
        storm::one_by_one(&pod.ns, &targets, 2 * CAPACITY as usize, PATIENCE)
    })
    .unwrap();
    let summary = StormSummary::of(&long_lived);
    assert_eq!(summary.reached, long_lived.len(), "{summary:?}");
    assert_eq!(misses(&pins, Miss::OrigDst), 0);

    // A storm of eight times the capacity, faster than ztunnel reads the
    // records: the oldest are evicted before ztunnel asks for them.
    let proxied_before = ztunnel.proxied().len();
    let peer_misses_before = misses(&pins, Miss::PeerName);
    let storm = tokio::task::block_in_place(|| {
        storm::storm(&pod.ns, &targets, 8 * CAPACITY as usize, PATIENCE)
    })
    .unwrap();
    let summary = StormSummary::of(&storm);
    eprintln!("storm past a capacity of {CAPACITY}: {summary:?}");
    // Never misrouted, never left hanging, never failed at connect.
    assert_eq!(summary.misrouted, 0, "{summary:?}");
    assert_eq!(summary.hung, 0, "{summary:?}");
    assert_eq!(summary.not_connected, 0, "{summary:?}");
    assert!(summary.refused > 0, "nothing was evicted: {summary:?}");
    assert!(summary.reached > 0, "{summary:?}");
    // Each refusal is a counted miss, and one ztunnel refused.
    assert_eq!(misses(&pins, Miss::OrigDst), summary.refused as u64);
    ztunnel
        .wait_until(
            |s| s.proxied.len() >= proxied_before + storm.len(),
            PATIENCE,
        )
        .await
        .unwrap();
    let records = ztunnel.proxied().split_off(proxied_before);
    let refused_by_ztunnel = records
        .iter()
        .filter(|r| r.outcome == ConnectionOutcome::RefusedSelfCall)
        .count();
    assert_eq!(refused_by_ztunnel, summary.refused);
    // What ztunnel proxied went where its client asked.
    for record in records
        .iter()
        .filter(|r| r.outcome == ConnectionOutcome::Proxied)
    {
        let client = storm
            .iter()
            .find(|c| c.local == Some(record.client))
            .unwrap_or_else(|| panic!("proxied a connection the storm did not open: {record:?}"));
        assert_eq!(record.original_dst, client.target, "{record:?}");
    }
    // The apps' getpeername: the destination asked for, or (a counted
    // miss) ztunnel's listener.
    assert_eq!(
        misses(&pins, Miss::PeerName) - peer_misses_before,
        summary.wrong_peer as u64
    );

    // The metric reports the misses.
    let body = scrape(&pins);
    let line = format!(
        "ambpf_origdst_misses_total{{reason=\"so_original_dst\"}} {}",
        summary.refused
    );
    assert!(body.contains(&line), "no {line} in:\n{body}");

    // The connections opened one by one still work, though their records
    // are long evicted: ztunnel needed them only at accept.
    tokio::task::block_in_place(|| {
        for connection in &mut long_lived {
            assert!(connection.echo(), "{} broke", connection.target);
        }
    });

    // Once the storm's connections close, their records go with them, and
    // new connections get through again.
    drop(storm);
    let misses_after_storm = misses(&pins, Miss::OrigDst);
    let after =
        tokio::task::block_in_place(|| storm::one_by_one(&pod.ns, &targets, 4, PATIENCE)).unwrap();
    assert_eq!(StormSummary::of(&after).reached, 4);
    assert_eq!(misses(&pins, Miss::OrigDst), misses_after_storm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_pods_map_refuses_the_next_pod_by_name_and_keeps_serving_the_rest() {
    const CAPACITY: u32 = 2;
    let _serial = SERIAL.lock().await;
    let cgroup = CgroupGuard::create().unwrap();
    let _inside = cgroup.enter_process().unwrap();
    let cluster = Cluster::create(3).unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let capacities = Capacities {
        pods: CAPACITY,
        ..Capacities::default()
    };
    let mut dataplane = load(&cluster, &bpffs, &cgroup, capacities);
    let pins = dataplane.pins().clone();
    assert_eq!(max_entries(&pins, maps::PODS_BY_NETNS), CAPACITY);
    assert_eq!(max_entries(&pins, maps::POD_COUNTERS), CAPACITY);
    assert_eq!(max_entries(&pins, maps::PODS_BY_IP), 2 * CAPACITY);
    let netns: Vec<Netns> = cluster
        .pods
        .iter()
        .map(|p| Netns::open(p.ns.name()).unwrap())
        .collect();
    let first = dataplane.enroll(&netns[0], ENROLL).unwrap();
    dataplane.enroll(&netns[1], ENROLL).unwrap();
    // Enrolling an enrolled pod again still works at capacity.
    dataplane.enroll(&netns[0], ENROLL).unwrap();

    let err = dataplane.enroll(&netns[2], ENROLL).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("is full (2 entries"), "{message}");
    assert!(message.contains("--max-pods"), "{message}");
    assert!(
        message.contains(&netns[2].path().display().to_string()),
        "{message}"
    );
    // Nothing of the refused pod stays: no entries, no steering filter, and
    // the state check finds nothing amiss.
    let enrolled = dataplane.enrolled().unwrap();
    assert_eq!(enrolled.len(), 2);
    let held: Vec<_> = enrolled
        .iter()
        .map(|key| {
            let ns = netns.iter().find(|n| n.inode() == key.netns_inode).unwrap();
            (*key, ns)
        })
        .collect();
    let violations = dataplane.check(&held, CheckScope::Full);
    assert!(violations.is_empty(), "{violations:?}");
    let filters = cluster.pods[2]
        .ns
        .run(|| {
            std::process::Command::new("tc")
                .args(["filter", "show", "dev", "eth0", "ingress"])
                .output()
                .unwrap()
        })
        .unwrap();
    assert!(
        String::from_utf8_lossy(&filters.stdout).trim().is_empty(),
        "steering left on the refused pod: {filters:?}"
    );

    // The enrolled pods are still served: pod 1's connections go through
    // ztunnel to where they were going.
    let (ztunnel, _zds) = ztunnel_for(
        dataplane.pins(),
        &[("pod-1".into(), cluster.pods[0].ns.path())],
        ZtunnelConfig::default(),
    )
    .await;
    let target = SocketAddr::new(cluster.remote.addrs.v4.into(), GREETER_PORTS[0]);
    let _greeters = Greeters::start(&cluster.remote.ns, &[target]).unwrap();
    let reached = tokio::task::block_in_place(|| {
        storm::one_by_one(&cluster.pods[0].ns, &[target], 2, PATIENCE)
    })
    .unwrap();
    assert_eq!(StormSummary::of(&reached).reached, 2);
    ztunnel
        .wait_until(
            |s| {
                s.proxied
                    .iter()
                    .filter(|c| c.listener_port == 15001 && c.original_dst == target)
                    .count()
                    == 2
            },
            PATIENCE,
        )
        .await
        .unwrap();

    // A pod leaving makes room.
    assert!(dataplane.unenroll(first.key()).unwrap());
    dataplane.enroll(&netns[2], ENROLL).unwrap();
}

#[test]
fn pinned_maps_of_another_capacity_are_adopted_with_a_warning() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let made = Capacities {
        pods: 64,
        redirected_connections: 256,
        host_addresses: 32,
    };
    drop(Dataplane::load_with(pins.clone(), made).unwrap());
    assert_eq!(max_entries(&pins, maps::ORIG_BY_TUPLE), 256);

    // A restart asking for other capacities keeps the pinned maps (and
    // their entries) as they are, and says so.
    let asked = Capacities {
        pods: 128,
        redirected_connections: 1024,
        host_addresses: 32,
    };
    let dataplane = Dataplane::load_with(pins.clone(), asked).unwrap();
    assert_eq!(dataplane.capacities(), made);
    let kept: Vec<_> = dataplane
        .capacities_kept()
        .iter()
        .map(|k| (k.name, k.pinned, k.asked, k.flag))
        .collect();
    assert_eq!(
        kept,
        [
            (maps::PODS_BY_NETNS, 64, 128, "--max-pods"),
            (maps::PODS_BY_IP, 128, 256, "--max-pods"),
            (
                maps::ORIG_BY_COOKIE,
                256,
                1024,
                "--max-redirected-connections"
            ),
            (
                maps::ORIG_BY_TUPLE,
                256,
                1024,
                "--max-redirected-connections"
            ),
            (maps::POD_COUNTERS, 64, 128, "--max-pods"),
            (maps::POD_DROPS, 64, 128, "--max-pods"),
            // The sk-lookup path's listener per pod.
            (maps::INBOUND_LISTENERS, 64, 128, "--max-pods"),
        ]
    );
    let warning = dataplane.capacities_kept()[0].to_string();
    assert!(warning.contains("keeping 64"), "{warning}");
    assert!(warning.contains("ambpf uninstall"), "{warning}");
    drop(dataplane);
    assert_eq!(max_entries(&pins, maps::ORIG_BY_TUPLE), 256);

    // Capacities nothing could use are refused before anything is loaded.
    let err = match Dataplane::load_with(
        pins,
        Capacities {
            redirected_connections: 0,
            ..asked
        },
    ) {
        Ok(_) => panic!("a capacity of 0 was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("--max-redirected-connections"), "{err}");
}
