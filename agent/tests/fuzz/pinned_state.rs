//! The pinned state `ambpf status` reads back, holding anything: pods and
//! address records with any cookie, inode, flags and addresses, records
//! that point nowhere or at each other. `status --json` lists every pod it
//! holds, `status` and `status --check` print and exit 0 or 1; none panics.

use std::process::{Command, Output};

use ambpf::bpf::{Dataplane, PinLayout};
use ambpf_common::{IpKey, PodConfig, maps};
use ambpf_testbed::BpffsMount;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proptest::prelude::*;
use serde_json::Value;

fn ip_key() -> impl Strategy<Value = IpKey> {
    prop_oneof![
        Just(IpKey::default()),
        any::<[u8; 4]>().prop_map(IpKey::v4),
        any::<[u8; 16]>().prop_map(|addr| IpKey { addr }),
    ]
}

fn pod_config() -> impl Strategy<Value = PodConfig> {
    (
        any::<u64>(),
        prop_oneof![Just(0u64), Just(4026531840), any::<u64>()],
        any::<u32>(),
        any::<u32>(),
        ip_key(),
        ip_key(),
    )
        .prop_map(|(netns_cookie, netns_inode, flags, pad, a, b)| PodConfig {
            netns_cookie,
            netns_inode,
            flags,
            _pad: pad,
            ips: [a, b],
        })
}

fn ambpf(pins: &PinLayout, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pins.root())
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn status_reads_any_pinned_pods_and_addresses_back() {
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    // Creates and pins every map (nothing is attached).
    let dataplane = Dataplane::load(pins.clone()).unwrap();
    let open = |name| MapData::from_pin(pins.map(name)).unwrap();

    let input = (
        prop::collection::btree_map(any::<u64>(), pod_config(), 0..6),
        prop::collection::vec((ip_key(), pod_config()), 0..6),
    );
    // Three processes per case (about 100 ms): an eighth of the cases.
    let mut config = crate::config();
    config.cases = (config.cases / 8).max(1);
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let result = runner.run(&input, |(pods, addresses)| {
        let mut by_netns: BpfHashMap<_, u64, PodConfig> =
            BpfHashMap::try_from(Map::HashMap(open(maps::PODS_BY_NETNS))).unwrap();
        let mut by_ip: BpfHashMap<_, IpKey, PodConfig> =
            BpfHashMap::try_from(Map::HashMap(open(maps::PODS_BY_IP))).unwrap();
        for key in by_netns.keys().collect::<Result<Vec<_>, _>>().unwrap() {
            by_netns.remove(&key).unwrap();
        }
        for key in by_ip.keys().collect::<Result<Vec<_>, _>>().unwrap() {
            by_ip.remove(&key).unwrap();
        }
        for (cookie, pod) in &pods {
            by_netns.insert(cookie, pod, 0).unwrap();
        }
        for (ip, pod) in &addresses {
            by_ip.insert(ip, pod, 0).unwrap();
        }

        let json = ambpf(&pins, &["status", "--json"]);
        prop_assert!(json.status.success(), "{:?}", json);
        let status: Value = serde_json::from_slice(&json.stdout)
            .map_err(|e| TestCaseError::fail(format!("status --json: {e}")))?;
        let mut listed: Vec<u64> = status["pods"]
            .as_array()
            .ok_or_else(|| TestCaseError::fail(format!("no pods in {status}")))?
            .iter()
            .filter_map(|p| p["netns_cookie"].as_u64())
            .collect();
        listed.sort_unstable();
        prop_assert_eq!(listed, pods.keys().copied().collect::<Vec<_>>());

        let text = ambpf(&pins, &["status"]);
        prop_assert!(text.status.success(), "{:?}", text);
        let check = ambpf(&pins, &["status", "--check"]);
        prop_assert!(
            matches!(check.status.code(), Some(0 | 1)),
            "status --check crashed: {:?}",
            check
        );
        // Pods with neither addresses nor a namespace are violations.
        if !pods.is_empty() {
            prop_assert_eq!(check.status.code(), Some(1), "{:?}", check);
        }
        Ok(())
    });
    drop(dataplane);
    if let Err(e) = result {
        panic!("{e}");
    }
}
