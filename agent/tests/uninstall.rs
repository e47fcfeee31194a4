//! Privileged: `ambpf uninstall` removes everything ambpf made: the eBPF
//! pods' reply routing and every pin (which detaches every link), the
//! iptables mode's in-pod rules in every namespace that has them plus the
//! host's probe rules and ipsets, the nftables mode's tables (in the pods
//! and on the host), and the redirection annotation on the node's pods.
//!
//! The command runs as a subprocess, as on a node, but in a world of the
//! test's own ([`uninstall_on`]): the test's node namespace is its host, and
//! in a mount and PID namespace of its own it sees only the test's
//! namespaces, so its node-wide sweep never reaches anything outside the
//! test (other tests' namespaces, the real host's rules).

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::Mutex,
};

use ambpf::{
    bpf::{Dataplane, PinLayout},
    netns::Netns,
    redirect::{
        EbpfRedirection, EnrollOptions, PodRedirection,
        iptables::{self, Family, IptablesBackend, IptablesRedirection},
        nftables::{self, NftablesRedirection},
        routing,
    },
    sources::kube::rules::REDIRECTION_ANNOTATION,
};
use ambpf_common::{PodConfig, maps};
use ambpf_testbed::{BpffsMount, CgroupGuard, NetnsGuard, apiserver::ApiServer, cluster::Cluster};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use serde_json::{Value, json};

/// The host-side rules and ipsets are per node namespace and each test has
/// its own, but uninstall sweeps namespaces: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn create(prefix: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("{prefix}-{}", ambpf_testbed::unique_name("")));
        std::fs::create_dir(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds the test's world, then execs the command given after the script's
/// arguments: `$1` a staging directory, `$2` the namespaces to show under
/// /run/netns, `$3` those to show only through a process each (a pod whose
/// namespace has no name, as a container's).
const ISOLATE: &str = r#"
set -eu
stage=$1 named=$2 held=$3
shift 3
for ns in $named; do
    touch "$stage/$ns"
    mount --bind "/run/netns/$ns" "$stage/$ns"
done
for ns in $held; do
    nsenter --net="/run/netns/$ns" sleep 600 &
    want=$(stat -L -c %i "/run/netns/$ns")
    until [ "$(stat -L -c %i /proc/$!/ns/net)" = "$want" ]; do sleep 0.01; done
done
mount -t tmpfs ambpf-test /run/netns
for ns in $named; do
    touch "/run/netns/$ns"
    mount --bind "$stage/$ns" "/run/netns/$ns"
done
exec "$@"
"#;

/// Runs `ambpf --pin-root <pin_root> uninstall <args>` with `node` as its
/// host namespace, seeing only `named` (under /run/netns) and `held`
/// (through a process each) besides. The mount and PID namespaces it runs
/// in, and every mount and process in them, end with it.
fn uninstall_on(
    node: &NetnsGuard,
    named: &[&NetnsGuard],
    held: &[&NetnsGuard],
    pin_root: &Path,
    args: &[&str],
) -> Output {
    let stage = TempDir::create("ambpf-uninstall-stage");
    let names = |list: &[&NetnsGuard]| {
        list.iter()
            .map(|ns| ns.name().to_owned())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let out = Command::new("nsenter")
        .arg(format!("--net={}", node.path().display()))
        .args([
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
            "--mount-proc",
            "sh",
            "-c",
            ISOLATE,
            "isolate",
        ])
        .arg(&stage.0)
        .arg(names(named))
        .arg(names(held))
        .arg(env!("CARGO_BIN_EXE_ambpf"))
        .arg("--pin-root")
        .arg(pin_root)
        .arg("uninstall")
        .args(args)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("NODE_NAME")
        // The host's own CNI configuration is not the test's: without
        // --cni-conf-dir/--cni-bin-dir it looks where nothing is.
        .env("AMBPF_CNI_CONF_DIR", stage.0.join("no-cni-conf"))
        .env("AMBPF_CNI_BIN_DIR", stage.0.join("no-cni-bin"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    eprintln!(
        "--- ambpf uninstall {args:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn open(ns: &NetnsGuard) -> Netns {
    Netns::open(ns.name()).unwrap()
}

/// Every rule of `ns` (both backends, where present, and both families),
/// without packet counters.
fn all_rules(ns: &NetnsGuard) -> Vec<String> {
    let mut out = Vec::new();
    for backend in ["nft", "legacy"] {
        for tool in ["iptables", "ip6tables"] {
            let save = ns
                .run(|| Command::new(format!("{tool}-{backend}-save")).output())
                .unwrap();
            let Ok(save) = save else { continue };
            out.extend(
                String::from_utf8_lossy(&save.stdout)
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .map(|l| match l.split_once(" [") {
                        Some((chain, _)) if l.starts_with(':') => chain.to_owned(),
                        _ => l.to_owned(),
                    })
                    .map(|l| format!("{tool}-{backend}: {l}")),
            );
        }
    }
    out
}

fn istio_lines(ns: &NetnsGuard) -> Vec<String> {
    all_rules(ns)
        .into_iter()
        .filter(|l| l.contains("ISTIO_"))
        .collect()
}

fn ipsets(ns: &NetnsGuard) -> String {
    let out = ns
        .run(|| Command::new("ipset").args(["list", "-name"]).output())
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Writes `rules` into `ns` with the given backend's `iptables-restore`.
fn restore(ns: &NetnsGuard, backend: IptablesBackend, rules: &str) {
    let out = ns
        .run(|| {
            ambpf_testbed::output_with_stdin(
                Command::new(format!("iptables-{backend}-restore")).arg("--noflush"),
                rules.as_bytes(),
            )
        })
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn ebpf_pods_lose_their_steering_routes_and_pins() {
    let _serial = serial();
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(2).unwrap();
    let (pod, half_removed) = (&cluster.pods[0].ns, &cluster.pods[1].ns);
    let netns = open(pod);
    let cgroup = CgroupGuard::create().unwrap();
    {
        let mut dataplane = Dataplane::load(pins.clone()).unwrap();
        dataplane.attach_cgroup(cgroup.path()).unwrap();
        let mut dataplane = EbpfRedirection::new(dataplane);
        dataplane.enroll_pod(&netns, true).unwrap();
        // An agent that died while removing this pod: its map entry is
        // gone, its steering filter is not.
        let half = dataplane.enroll_pod(&open(half_removed), true).unwrap();
        let data = MapData::from_pin(pins.map(maps::PODS_BY_NETNS)).unwrap();
        let mut pods: BpfHashMap<_, u64, PodConfig> =
            BpfHashMap::try_from(Map::HashMap(data)).unwrap();
        pods.remove(&half.netns_cookie).unwrap();
    }
    assert!(routing::reply_routing_installed(&netns).unwrap());
    // The socket programs and the raw-socket guard are on the cgroup.
    let attached = cgroup_programs(&cgroup);
    for program in ["ambpf_connect4", "ambpf_rawsock", "ambpf_rawguard"] {
        assert!(attached.contains(program), "{program}: {attached}");
    }
    for ns in [pod, half_removed] {
        assert!(
            ambpf_testbed::sk_lookup_linked(ns.inode().unwrap()).unwrap(),
            "inbound capture in {}",
            ns.name()
        );
    }

    let out = uninstall_on(&cluster.node, &[pod, half_removed], &[], pins.root(), &[]);
    assert!(out.status.success(), "{}", stdout(&out));
    let text = stdout(&out);
    for said in [
        format!(
            "removed the steering and reply routing of {}",
            pod.path().display()
        ),
        format!("removed {}", pins.root().display()),
    ] {
        assert!(text.contains(&said), "{said}: {text}");
    }
    assert!(!routing::reply_routing_installed(&netns).unwrap());
    // The links go with the pin root, the half-removed pod's too; nothing
    // was ever attached to the pods' interfaces.
    for ns in [pod, half_removed] {
        assert!(
            !ambpf_testbed::sk_lookup_linked(ns.inode().unwrap()).unwrap(),
            "inbound capture left in {}",
            ns.name()
        );
        assert!(!tc_filters(ns).contains("ambpf_pod_in"), "{}", ns.name());
    }
    let qdiscs = ns_output(pod, &["tc", "qdisc", "show", "dev", "eth0"]);
    assert!(!qdiscs.contains("clsact"), "a clsact in the pod: {qdiscs}");
    assert!(!pins.root().exists());
    let attached = cgroup_programs(&cgroup);
    assert!(
        !attached.contains("ambpf_"),
        "left on the cgroup: {attached}"
    );

    let again = uninstall_on(&cluster.node, &[pod], &[], pins.root(), &[]);
    assert!(again.status.success());
    assert!(stdout(&again).contains("nothing pinned under"));
}

/// What `bpftool cgroup show` lists on `cgroup`.
fn cgroup_programs(cgroup: &CgroupGuard) -> String {
    let out = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(cgroup.path())
        .output()
        .expect("bpftool must be installed (apt install bpftool)");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ns_output(ns: &NetnsGuard, command: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .args(command)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn tc_filters(ns: &NetnsGuard) -> String {
    ns_output(ns, &["tc", "filter", "show", "dev", "eth0", "ingress"])
}

/// Pods enrolled in iptables mode by an agent that is gone (its memory of
/// them with it): found by their rules, in named namespaces and in one only
/// a process holds, and cleaned with the host; a neighbour and an Istio
/// sidecar's namespace keep everything.
#[test]
fn iptables_pods_are_found_and_cleaned_without_the_agent() {
    let _serial = serial();
    let bpffs = BpffsMount::create().unwrap();
    let pin_root = bpffs.path().join("ambpf");
    let cluster = Cluster::create(4).unwrap();
    let [named_pod, held_pod, unenrolled_pod, neighbour] =
        [0, 1, 2, 3].map(|i| &cluster.pods[i].ns);
    let sidecar = NetnsGuard::create("sidecar").unwrap();

    let backend = {
        let mut agent =
            IptablesRedirection::new(open(&cluster.node), IptablesBackend::Auto).unwrap();
        let options = EnrollOptions { dns_capture: true };
        let keys = [named_pod, held_pod, unenrolled_pod]
            .map(|pod| agent.enroll(&open(pod), options).unwrap().key());
        // Opted out, as Istio's node agent does: nothing stays in it.
        assert!(agent.unenroll(keys[2]).unwrap());
        // The agent goes without removing anything, as a crashed one does.
        agent.backend()
    };
    for pod in [named_pod, held_pod] {
        assert!(!istio_lines(pod).is_empty());
        assert!(routing::reply_routing_status(&open(pod)).unwrap().ipv4.rule);
    }
    assert!(istio_lines(unenrolled_pod).is_empty());
    assert!(ipsets(&cluster.node).contains(iptables::PROBE_IPSET_V4));

    // Rules that are not ambpf's: the neighbour's own, and a sidecar's.
    restore(
        neighbour,
        backend,
        "*nat\n-A OUTPUT -p tcp --dport 9 -j REDIRECT --to-ports 10\nCOMMIT\n",
    );
    restore(
        &sidecar,
        backend,
        "*nat\n:ISTIO_INBOUND - [0:0]\n:ISTIO_OUTPUT - [0:0]\n\
         -A PREROUTING -p tcp -j ISTIO_INBOUND\n-A OUTPUT -p tcp -j ISTIO_OUTPUT\n\
         -A ISTIO_INBOUND -p tcp -j REDIRECT --to-ports 15006\n\
         -A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN\nCOMMIT\n",
    );
    let neighbour_before = all_rules(neighbour);
    let sidecar_before = all_rules(&sidecar);
    assert!(neighbour_before.iter().any(|l| l.contains("--dport 9")));

    let named = [named_pod, unenrolled_pod, neighbour, &sidecar];
    let out = uninstall_on(&cluster.node, &named, &[held_pod], &pin_root, &[]);
    assert!(out.status.success());
    let text = stdout(&out);
    let line = format!(
        "removed the iptables rules and reply routing of {}",
        named_pod.path().display()
    );
    assert!(text.contains(&line), "{text}");
    assert!(
        !text.contains(&unenrolled_pod.path().display().to_string()),
        "{text}"
    );
    // The held pod is known by its process only.
    assert!(
        text.lines().any(|l| l
            .starts_with("removed the iptables rules and reply routing of /proc/")
            && l.ends_with("/ns/net")),
        "{text}"
    );
    assert_eq!(
        text.matches("removed the iptables rules").count(),
        2,
        "{text}"
    );
    assert!(text.contains("removed the host probe rules"), "{text}");
    assert!(
        text.contains(&format!(
            "left {}: its Istio chains are not ambpf's",
            sidecar.path().display()
        )),
        "{text}"
    );
    assert!(text.contains("nothing pinned under"), "{text}");

    for pod in [named_pod, held_pod, unenrolled_pod] {
        assert_eq!(istio_lines(pod), Vec::<String>::new(), "{}", pod.name());
        let status = routing::reply_routing_status(&open(pod)).unwrap();
        assert!(!status.ipv4.rule && !status.ipv4.route, "{status:?}");
        for family in Family::ALL {
            let saved = iptables::saved_rules(&open(pod), backend, family).unwrap();
            assert!(!saved.has_istio_chains());
        }
    }
    assert_eq!(istio_lines(&cluster.node), Vec::<String>::new());
    assert_eq!(ipsets(&cluster.node), "");
    assert_eq!(all_rules(neighbour), neighbour_before);
    assert_eq!(all_rules(&sidecar), sidecar_before);

    // Again: nothing left to remove, and it says so by saying nothing of it.
    let again = uninstall_on(&cluster.node, &named, &[held_pod], &pin_root, &[]);
    assert!(again.status.success());
    let text = stdout(&again);
    assert!(!text.contains("removed the"), "{text}");
    assert_eq!(all_rules(&sidecar), sidecar_before);
}

/// `--redirect-mode ebpf` leaves every iptables rule in place.
#[test]
fn the_ebpf_mode_alone_leaves_iptables_rules() {
    let _serial = serial();
    let bpffs = BpffsMount::create().unwrap();
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0].ns;
    let mut agent = IptablesRedirection::new(open(&cluster.node), IptablesBackend::Auto).unwrap();
    agent
        .enroll(&open(pod), EnrollOptions { dns_capture: false })
        .unwrap();
    let before = (all_rules(pod), all_rules(&cluster.node));

    let pin_root = bpffs.path().join("ambpf");
    let out = uninstall_on(
        &cluster.node,
        &[pod],
        &[],
        &pin_root,
        &["--redirect-mode", "ebpf"],
    );
    assert!(out.status.success());
    assert!(!stdout(&out).contains("iptables"), "{}", stdout(&out));
    assert_eq!((all_rules(pod), all_rules(&cluster.node)), before);
    agent.uninstall().unwrap();
    assert!(istio_lines(pod).is_empty());
}

/// `ns`'s nftables ruleset, without packet counters.
fn nft_ruleset(ns: &NetnsGuard) -> String {
    let out = ns
        .run(|| Command::new("nft").args(["list", "ruleset"]).output())
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| match l.find("counter packets") {
            Some(at) => l[..at].trim_end().to_owned(),
            None => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Under the nft backend, a host that had no `nat` table gets none back
/// from uninstall (iptables-nft alone would leave an empty one with its
/// POSTROUTING base chain); a host whose `nat` tables were there first
/// keeps them as they were, empty or not.
#[test]
fn an_nft_host_is_left_with_the_nat_tables_it_had() {
    let _serial = serial();
    let bpffs = BpffsMount::create().unwrap();
    let pin_root = bpffs.path().join("ambpf");
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0].ns;
    let node = &cluster.node;
    let enroll_and_uninstall = || {
        let mut agent = IptablesRedirection::new(open(node), IptablesBackend::Nft).unwrap();
        agent
            .enroll(&open(pod), EnrollOptions { dns_capture: true })
            .unwrap();
        assert!(nft_ruleset(node).contains("ISTIO_POSTRT"));
        // As a crashed agent: nothing removed until uninstall.
        drop(agent);
        let out = uninstall_on(node, &[pod], &[], &pin_root, &[]);
        assert!(out.status.success());
        assert!(stdout(&out).contains("removed the host probe rules"));
    };

    assert!(
        !nft_ruleset(node).contains("table"),
        "{}",
        nft_ruleset(node)
    );
    enroll_and_uninstall();
    assert_eq!(nft_ruleset(node), "", "the host had no table");
    assert!(istio_lines(pod).is_empty());

    // Someone else's nat tables: an empty one (IPv4, as iptables-nft
    // leaves it) and one with a rule (IPv6).
    restore(
        node,
        IptablesBackend::Nft,
        "*nat\n-A POSTROUTING -j ACCEPT\nCOMMIT\n",
    );
    restore(
        node,
        IptablesBackend::Nft,
        "*nat\n-D POSTROUTING -j ACCEPT\nCOMMIT\n",
    );
    let out = node
        .run(|| {
            ambpf_testbed::output_with_stdin(
                Command::new("ip6tables-nft-restore").arg("--noflush"),
                b"*nat\n-A POSTROUTING -d fd00:dead::1/128 -j ACCEPT\nCOMMIT\n",
            )
        })
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let before = nft_ruleset(node);
    assert!(before.contains("table ip nat") && before.contains("table ip6 nat"));
    enroll_and_uninstall();
    assert_eq!(nft_ruleset(node), before);
}

/// Writes `script` into `ns` with `nft -f -`.
fn nft_apply(ns: &NetnsGuard, script: &str) {
    let out = ns
        .run(|| {
            ambpf_testbed::output_with_stdin(
                Command::new("nft").args(["-f", "-"]),
                script.as_bytes(),
            )
        })
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// The `inet` tables of `ns`.
fn nft_tables(ns: &NetnsGuard) -> Vec<String> {
    let out = ns
        .run(|| {
            Command::new("nft")
                .args(["-j", "list", "tables", "inet"])
                .output()
        })
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    listing["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["table"]["name"].as_str().map(str::to_owned))
        .collect()
}

/// Pods enrolled in nftables mode by an agent that is gone: found by their
/// tables' comment, in named namespaces and in one only a process holds,
/// and cleaned with the host table and the records; a neighbour's own
/// table and Istio's tables of the same names (no ambpf comment) stay.
#[test]
fn nftables_pods_are_found_and_cleaned_without_the_agent() {
    let _serial = serial();
    let bpffs = BpffsMount::create().unwrap();
    let pin_root = bpffs.path().join("ambpf");
    let records = PinLayout::new(pin_root.clone()).nftables_pods_dir();
    let cluster = Cluster::create(4).unwrap();
    let [named_pod, held_pod, unenrolled_pod, neighbour] =
        [0, 1, 2, 3].map(|i| &cluster.pods[i].ns);
    let istio = NetnsGuard::create("istio").unwrap();
    {
        let agent = NftablesRedirection::new(open(&cluster.node)).unwrap();
        let mut agent = agent.with_records(records.clone());
        let options = EnrollOptions { dns_capture: true };
        let keys = [named_pod, held_pod, unenrolled_pod]
            .map(|pod| agent.enroll(&open(pod), options).unwrap().key());
        // Opted out, as Istio's node agent does: nothing stays in it.
        assert!(agent.unenroll(keys[2]).unwrap());
        // The agent goes without removing anything, as a crashed one does.
    }
    for pod in [named_pod, held_pod] {
        assert!(nft_tables(pod).contains(&nftables::MANGLE_TABLE.to_owned()));
        assert!(routing::reply_routing_status(&open(pod)).unwrap().ipv4.rule);
    }
    assert_eq!(nft_tables(unenrolled_pod), Vec::<String>::new());
    assert_eq!(nft_tables(&cluster.node), [nftables::NAT_TABLE]);
    assert!(records.read_dir().unwrap().next().is_some());

    nft_apply(
        neighbour,
        "table inet neighbour-fw {\n chain output {\n type filter hook output priority 0;\n \
         tcp dport 9 drop\n }\n}\n",
    );
    // Istio's own node agent's table: the same name, not ambpf's comment.
    nft_apply(
        &istio,
        "table inet istio-ambient-nat {\n chain output {\n type nat hook output priority -100;\n \
         tcp dport 80 redirect to :15001\n }\n}\n",
    );
    let neighbour_before = nft_ruleset(neighbour);
    let istio_before = nft_ruleset(&istio);

    let named = [named_pod, unenrolled_pod, neighbour, &istio];
    let out = uninstall_on(&cluster.node, &named, &[held_pod], &pin_root, &[]);
    assert!(out.status.success());
    let text = stdout(&out);
    let all = "istio-ambient-nat, istio-ambient-mangle, istio-ambient-raw";
    let line = format!(
        "removed the nftables tables ({all}) and reply routing of {}",
        named_pod.path().display()
    );
    assert!(text.contains(&line), "{text}");
    assert!(
        !text.contains(&unenrolled_pod.path().display().to_string()),
        "{text}"
    );
    // The held pod is known by its process only.
    assert!(
        text.lines().any(|l| l.starts_with(&format!(
            "removed the nftables tables ({all}) and reply routing of /proc/"
        )) && l.ends_with("/ns/net")),
        "{text}"
    );
    assert_eq!(
        text.matches("removed the nftables tables").count(),
        2,
        "{text}"
    );
    assert!(
        text.contains("removed the host's nftables table inet istio-ambient-nat"),
        "{text}"
    );
    for pod in [named_pod, held_pod, unenrolled_pod] {
        assert_eq!(nft_tables(pod), Vec::<String>::new(), "{}", pod.name());
        let status = routing::reply_routing_status(&open(pod)).unwrap();
        assert!(!status.ipv4.rule && !status.ipv4.route, "{status:?}");
    }
    assert_eq!(nft_tables(&cluster.node), Vec::<String>::new());
    assert!(!records.exists(), "the records stay");
    assert_eq!(nft_ruleset(neighbour), neighbour_before);
    assert_eq!(nft_ruleset(&istio), istio_before);

    // Again: nothing left to remove.
    let again = uninstall_on(&cluster.node, &named, &[held_pod], &pin_root, &[]);
    assert!(again.status.success());
    let text = stdout(&again);
    assert!(!text.contains("removed the"), "{text}");
    assert_eq!(nft_ruleset(&istio), istio_before);
}

#[test]
fn a_clean_node_uninstalls_cleanly() {
    let _serial = serial();
    let node = NetnsGuard::create("node").unwrap();
    let bystander = NetnsGuard::create("other").unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let pin_root = bpffs.path().join("ambpf");
    for _ in 0..2 {
        let out = uninstall_on(&node, &[&bystander], &[], &pin_root, &[]);
        assert!(out.status.success());
        let text = stdout(&out);
        assert!(
            text.contains(&format!("nothing pinned under {}", pin_root.display())),
            "{text}"
        );
        assert!(text.contains("no Kubernetes access configured"), "{text}");
        assert!(!text.contains("removed"), "{text}");
    }
}

/// A node cleaned by hand: `ambpf-cni` comes out of the CNI configuration
/// and its binary goes, so pods start on the node again; the network's own
/// plugins and other files stay as they were.
#[test]
fn the_cni_plugin_is_unchained_so_pods_start_again() {
    use ambpf::cni::install::{InstallConfig, install_once};
    let _serial = serial();
    let node = NetnsGuard::create("node").unwrap();
    let work = TempDir::create("ambpf-uninstall-cni");
    let (conf_dir, bin_dir) = (work.0.join("net.d"), work.0.join("bin"));
    std::fs::create_dir(&conf_dir).unwrap();
    let network = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [
            { "type": "ptp", "ipam": { "type": "host-local", "subnet": "10.244.1.0/24" } },
            { "type": "portmap", "capabilities": { "portMappings": true } }
        ]
    });
    let conflist = conf_dir.join("10-ptp.conflist");
    std::fs::write(&conflist, network.to_string()).unwrap();
    let other = conf_dir.join("99-other.conflist");
    let other_text = "{\"name\": \"other\", \"plugins\": [{\"type\": \"bridge\"}]}\n";
    std::fs::write(&other, other_text).unwrap();
    install_once(&InstallConfig {
        conf_dir: conf_dir.clone(),
        bin_dir: bin_dir.clone(),
        plugin_binary: Some(PathBuf::from(env!("CARGO_BIN_EXE_ambpf-cni"))),
        agent_socket: PathBuf::from("/var/run/ambpf/pluginevent.sock"),
        agent_timeout_seconds: None,
    })
    .unwrap();
    let binary = bin_dir.join("ambpf-cni");
    let chained = |path: &Path| {
        let list: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        list["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["type"] == "ambpf-cni")
    };
    assert!(chained(&conflist) && binary.exists());

    let args = [
        "--redirect-mode",
        "ebpf",
        "--cni-conf-dir",
        conf_dir.to_str().unwrap(),
        "--cni-bin-dir",
        bin_dir.to_str().unwrap(),
    ];
    let pin_root = work.0.join("no-pins");
    // --keep-cni: an agent's own state only (the demo's and benches' way).
    let keep: Vec<&str> = args.iter().copied().chain(["--keep-cni"]).collect();
    let kept = uninstall_on(&node, &[], &[], &pin_root, &keep);
    assert!(kept.status.success());
    assert!(
        stdout(&kept).contains("ambpf-cni left chained"),
        "{}",
        stdout(&kept)
    );
    assert!(chained(&conflist) && binary.exists());

    let out = uninstall_on(&node, &[], &[], &pin_root, &args);
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(
        text.contains(&format!("un-chained ambpf-cni from {}", conflist.display())),
        "{text}"
    );
    assert!(
        text.contains(&format!("removed {}", binary.display())),
        "{text}"
    );
    let left: Value = serde_json::from_slice(&std::fs::read(&conflist).unwrap()).unwrap();
    assert_eq!(left, network);
    assert!(!binary.exists());
    assert_eq!(std::fs::read_to_string(&other).unwrap(), other_text);

    let again = uninstall_on(&node, &[], &[], &pin_root, &args);
    assert!(again.status.success());
    let text = stdout(&again);
    assert!(
        text.contains(&format!(
            "ambpf-cni is not chained in {}",
            conf_dir.display()
        )),
        "{text}"
    );
    assert!(
        !text.contains("removed") && !text.contains("un-chained"),
        "{text}"
    );

    // --keep-cni where the plugin is not chained says so.
    let kept = uninstall_on(&node, &[], &[], &pin_root, &keep);
    assert!(kept.status.success());
    let text = stdout(&kept);
    assert!(
        text.contains(&format!(
            "ambpf-cni is not chained in {}",
            conf_dir.display()
        )) && !text.contains("left chained"),
        "{text}"
    );
}

/// A pin root at the bpffs mount point is refused, as `run` refuses it:
/// removing it whole would take other programs' pins along.
#[test]
fn a_pin_root_at_the_bpffs_mount_point_is_refused() {
    let _serial = serial();
    let node = NetnsGuard::create("node").unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let others = bpffs.path().join("someone-else");
    std::fs::create_dir(&others).unwrap();
    let out = uninstall_on(&node, &[], &[], bpffs.path(), &["--redirect-mode", "ebpf"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "{} is the root of a mounted filesystem",
            bpffs.path().display()
        )),
        "{stderr}"
    );
    assert!(stdout(&out).is_empty(), "nothing is done: {}", stdout(&out));
    assert!(others.exists());
}

// ---------------------------------------------------------------------------
// Annotations

const NODE: &str = "node-1";

fn pod_object(name: &str, node: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "shop",
            "uid": format!("uid-{name}"),
            "annotations": annotations,
        },
        "spec": { "nodeName": node, "containers": [{ "name": "app" }] },
    })
}

fn annotations_of(server: &ApiServer, name: &str) -> Value {
    server.object("pods", "shop", name).unwrap()["metadata"]["annotations"].clone()
}

/// A kubeconfig for the test API server (plain HTTP, no credentials).
fn kubeconfig(dir: &Path, server: &ApiServer) -> PathBuf {
    let path = dir.join("kubeconfig");
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
         users:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context:\n    \
         cluster: test\n    user: test\ncurrent-context: test\n",
        server.url()
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn the_nodes_pods_lose_the_redirection_annotation_through_the_api() {
    let _serial = serial();
    let node = NetnsGuard::create("node").unwrap();
    let bpffs = BpffsMount::create().unwrap();
    let pin_root = bpffs.path().join("ambpf");
    let work = TempDir::create("ambpf-uninstall-kube");
    // The API server listens on the node namespace's loopback, where the
    // command runs.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = node
        .run(|| runtime.block_on(ApiServer::start()))
        .unwrap()
        .unwrap();
    let enabled = json!({ REDIRECTION_ANNOTATION: "enabled" });
    server.apply("pods", pod_object("web-0", NODE, enabled.clone()));
    server.apply(
        "pods",
        pod_object(
            "web-1",
            NODE,
            json!({ REDIRECTION_ANNOTATION: "pending", "team": "shop" }),
        ),
    );
    server.apply("pods", pod_object("db-0", NODE, json!({ "team": "shop" })));
    server.apply("pods", pod_object("elsewhere", "node-2", enabled.clone()));
    let kubeconfig = kubeconfig(&work.0, &server);
    let args = [
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--node-name",
        NODE,
    ];

    // Patches refused: each pod is tried and reported, the rest still runs,
    // and the command fails.
    server.deny("patch", "pods/status");
    let out = uninstall_on(&node, &[], &[], &pin_root, &args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for pod in ["shop/web-0", "shop/web-1"] {
        assert!(
            stderr.contains(&format!(
                "pod {pod}: RBAC denies the agent `patch` on pods/status"
            )),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains("uninstall incomplete: 2 step(s) failed"),
        "{stderr}"
    );
    assert!(stdout(&out).contains("nothing pinned under"));
    assert_eq!(annotations_of(&server, "web-0"), enabled);

    server.allow("patch", "pods/status");
    let out = uninstall_on(&node, &[], &[], &pin_root, &args);
    assert!(out.status.success());
    let text = stdout(&out);
    for pod in ["shop/web-0", "shop/web-1"] {
        assert!(
            text.contains(&format!("removed {REDIRECTION_ANNOTATION} from pod {pod}")),
            "{text}"
        );
    }
    assert!(
        annotations_of(&server, "web-0")
            .get(REDIRECTION_ANNOTATION)
            .is_none()
    );
    assert_eq!(annotations_of(&server, "web-1"), json!({ "team": "shop" }));
    assert_eq!(annotations_of(&server, "db-0"), json!({ "team": "shop" }));
    assert_eq!(annotations_of(&server, "elsewhere"), enabled);
    let patched: Vec<String> = server.patches().into_iter().map(|p| p.name).collect();
    assert_eq!(patched, ["web-0", "web-1"]);
    for patch in server.patches() {
        assert_eq!(patch.resource, "pods/status");
        assert_eq!(patch.content_type, "application/merge-patch+json");
        assert_eq!(
            patch.body,
            json!({ "metadata": { "annotations": { REDIRECTION_ANNOTATION: null } } })
        );
    }

    let again = uninstall_on(&node, &[], &[], &pin_root, &args);
    assert!(again.status.success());
    assert!(
        stdout(&again).contains(&format!("no pod of node {NODE} carries")),
        "{}",
        stdout(&again)
    );
    assert_eq!(server.patches().len(), 2);

    // Kubernetes configured without a node name: an error, the rest done.
    let out = uninstall_on(
        &node,
        &[],
        &[],
        &pin_root,
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("node name is not set"));
    assert!(stdout(&out).contains("nothing pinned under"));
    drop(server);
}

/// Another dataplane's programs beside ambpf's (a socket load balancer on
/// the cgroup's hooks, a `clsact` filter each way and a TCX ingress program
/// on the pod's `eth0`): uninstall takes ambpf's and leaves each of the
/// others attached with the same program.
#[test]
fn other_owners_programs_are_left_attached() {
    use std::os::fd::AsFd;

    use ambpf_testbed::foreign_programs::{self, PassOnPrograms, Service, SocketLb, TCX_INGRESS};

    let _serial = serial();
    let bpffs = BpffsMount::create().unwrap();
    let pins = PinLayout::new(bpffs.path().join("ambpf"));
    let cluster = Cluster::create(1).unwrap();
    let pod = &cluster.pods[0].ns;
    let cgroup = CgroupGuard::create().unwrap();
    let service = |vip: &str, backend: &str| Service {
        vip: vip.parse().unwrap(),
        backend: backend.parse().unwrap(),
    };
    let mut lb = SocketLb::load(&[
        service("10.96.0.10:80", "10.245.0.2:9000"),
        service("[fd00:96::10]:80", "[fd00:b::2]:9000"),
    ])
    .unwrap();
    lb.attach(cgroup.path()).unwrap();
    let eth0 = pod.ifindex("eth0").unwrap();
    let tc_programs =
        PassOnPrograms::attach(pod, "eth0", &bpffs.path().join("foreign_pass")).unwrap();
    let pass_id = foreign_programs::prog_id(tc_programs.filter_program.as_fd()).unwrap();
    let others = || {
        let filters =
            |direction: &str| ns_output(pod, &["tc", "filter", "show", "dev", "eth0", direction]);
        let tcx = pod
            .run(|| foreign_programs::attached_programs(eth0, TCX_INGRESS))
            .unwrap()
            .unwrap();
        (
            cgroup_programs(&cgroup)
                .lines()
                .filter(|l| l.contains("lb_"))
                .map(str::to_owned)
                .collect::<Vec<_>>(),
            ["ingress", "egress"].map(|d| {
                filters(d)
                    .lines()
                    .filter(|l| l.contains("foreign_pass"))
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            }),
            tcx,
        )
    };
    let before = others();
    assert_eq!(before.0.len(), 8, "{before:?}");
    for direction in &before.1 {
        assert!(
            direction.len() == 1 && direction[0].contains(&format!("id {pass_id} ")),
            "{before:?}"
        );
    }
    let tcx_id = foreign_programs::prog_id(tc_programs.tcx_program.as_fd()).unwrap();
    assert_eq!(before.2, [tcx_id]);
    {
        let mut dataplane = Dataplane::load(pins.clone()).unwrap();
        dataplane.attach_cgroup(cgroup.path()).unwrap();
        let mut dataplane = EbpfRedirection::new(dataplane);
        dataplane.enroll_pod(&open(pod), true).unwrap();
    }
    assert!(ambpf_testbed::sk_lookup_linked(pod.inode().unwrap()).unwrap());

    let out = uninstall_on(&cluster.node, &[pod], &[], pins.root(), &[]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(!ambpf_testbed::sk_lookup_linked(pod.inode().unwrap()).unwrap());
    assert!(!cgroup_programs(&cgroup).contains("ambpf_"));
    assert_eq!(others(), before, "other owners' programs after uninstall");
}
