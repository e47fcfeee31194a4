//! The ambpf demo: the agent redirecting a throwaway pod into ztunnel.
//!
//! On this machine, in namespaces of its own, it builds a node with one
//! ambient pod and an off-node client (testbed `Cluster`), a private bpffs
//! and a cgroup, and then:
//! 1. starts the real agent (`ambpf run`) in the node's namespace with a
//!    pods file naming the pod, so it loads and attaches its programs,
//!    enrols the pod and serves ZDS;
//! 2. starts the ztunnel test double, which connects over ZDS, receives the
//!    pod's netns and opens ztunnel's listeners inside it;
//! 3. sends traffic: the pod's app to the remote server (captured to 15001),
//!    the remote client to the app (captured to 15006, source kept), printing
//!    for each what the app's and ztunnel's sockets say (getsockname,
//!    getpeername, the address ztunnel accepted on and from, SO_ORIGINAL_DST);
//!    the node to the app (a kubelet probe: not captured; the app's socket
//!    shows the node's address), and a DNS query over UDP to a resolver
//!    address nothing serves (captured to ztunnel's DNS proxy on 15053,
//!    which answers). Every line says whose view it is;
//! 4. prints what ztunnel proxied, `ambpf status` (with the outbound
//!    connection still open, so it shows under the pod) and `bpftool`'s view (the
//!    programs, and the pods map with its BTF field names), holds
//!    so you can look around, then stops and removes everything (also on
//!    Ctrl-C).
//!
//! A machine without what it needs (root, a bpf filesystem, cgroup v2,
//! iproute2, the agent binary) is told in one sentence, before anything is
//! made.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::{fd::AsFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, ExitCode},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ambpf_testbed::{
    BpffsMount, CgroupGuard, NetnsGuard, cgroup2_root,
    cluster::Cluster,
    mounts,
    ztunnel::{ProxiedConnection, ZtunnelConfig, ZtunnelDouble, dns},
};
use clap::Parser;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, kill, sigaction};

type Error = Box<dyn std::error::Error>;

#[derive(Parser)]
#[command(
    name = "ambpf-demo",
    about = "Run ambpf against a throwaway pod on this machine"
)]
struct Args {
    /// The ambpf agent binary.
    #[arg(long, default_value = "target/release/ambpf")]
    agent: PathBuf,
    /// Seconds to keep everything in place after the traffic (Ctrl-C ends early).
    #[arg(long, default_value_t = 5)]
    hold: u64,
}

const POD_UID: &str = "3f0c2a9e-demo-pod-1";
const APP_PORT: u16 = 8080;
const REMOTE_PORT: u16 = 9000;
const PATIENCE: Duration = Duration::from_secs(30);
/// How long the agent may take to serve ZDS: loading the programs takes far
/// longer under an emulated CPU (`cargo xtask kernels`) than on a host.
const AGENT_START: Duration = Duration::from_secs(180);

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: i32) {
    STOP.store(true, Ordering::SeqCst);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    let outcome = match preflight(&args) {
        Ok(()) => run(&args).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambpf-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the demo needs from the machine, each missing piece named with how
/// to get it.
fn preflight(args: &Args) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        let why = "it creates network namespaces, mounts a bpf filesystem and loads BPF programs";
        return Err(format!("run the demo as root (sudo): {why}").into());
    }
    mounts::check_bpffs_support()?;
    cgroup2_root()?;
    if let Err(e) = Command::new("ip").arg("-V").output() {
        return Err(if e.kind() == std::io::ErrorKind::NotFound {
            "the demo needs iproute2's `ip`: install the iproute2 package".into()
        } else {
            format!("cannot run `ip`: {e}").into()
        });
    }
    if !args.agent.is_file() {
        return Err(format!(
            "no agent binary at {}: build it with `cargo build --release -p ambpf` or run the \
             demo with `cargo xtask demo`",
            args.agent.display()
        )
        .into());
    }
    Ok(())
}

async fn run(args: &Args) -> Result<(), Error> {
    let handler = SigAction::new(
        SigHandler::Handler(request_stop),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        sigaction(Signal::SIGINT, &handler)?;
        sigaction(Signal::SIGTERM, &handler)?;
    }

    let bpffs = BpffsMount::create()?;
    let pin_root = bpffs.path().join("ambpf");
    let cgroup = CgroupGuard::create()?;
    // The pod's apps and ztunnel live in this cgroup, as pods do under the
    // node's root cgroup; the agent attaches its socket programs here.
    let _inside = cgroup.enter_process()?;
    let cluster = Cluster::create(1)?;
    let pod = &cluster.pods[0];
    let work = tempdir()?;
    let socket = work.0.join("ztunnel.sock");
    let pods_file = work.0.join("pods.json");
    std::fs::write(
        &pods_file,
        format!(
            r#"{{"pods": [{{"uid": "{POD_UID}", "name": "web-0", "namespace": "shop", "serviceAccount": "web", "netns": "{}"}}]}}"#,
            pod.ns.path().display()
        ),
    )?;
    println!(
        "== node {} | pod {} ({}, {}) | remote {} ({})",
        cluster.node.name(),
        pod.ns.name(),
        pod.addrs.v4,
        pod.addrs.v6,
        cluster.remote.ns.name(),
        cluster.remote.addrs.v4
    );
    println!(
        "== pin root {} (private bpffs), cgroup {}",
        pin_root.display(),
        cgroup.path().display()
    );

    // The agent's log (and the kernel programs' records it forwards) goes to
    // a file, kept after the demo, so the narration stays readable.
    let log_path =
        std::env::temp_dir().join(format!("ambpf-demo-agent-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path)?;
    println!(
        "== agent log: {} (tail -f it in another terminal)",
        log_path.display()
    );
    let mut agent = spawn_agent(
        &args.agent,
        &cluster.node,
        &pin_root,
        &socket,
        &pods_file,
        cgroup.path(),
        pod,
        log,
    )?;
    let result = demo(args, &cluster, &pin_root, &socket, &mut agent).await;
    stop(&mut agent);
    // The demo's pins only (its namespaces, cgroup and bpffs go with it); its
    // output joins the agent's log.
    println!(
        "== cleaning up: stopping the agent, removing the demo's pins, namespaces, cgroup and \
         bpffs mount"
    );
    if let Ok(log) = std::fs::OpenOptions::new().append(true).open(&log_path) {
        let _ = Command::new(&args.agent)
            .arg("--pin-root")
            .arg(&pin_root)
            .args(["uninstall", "--redirect-mode", "ebpf", "--keep-cni"])
            .stdout(log.try_clone()?)
            .stderr(log)
            .status();
    }
    result
}

async fn demo(
    args: &Args,
    cluster: &Cluster,
    pin_root: &Path,
    socket: &Path,
    agent: &mut Child,
) -> Result<(), Error> {
    let pod = &cluster.pods[0];
    // The double is started once the agent serves ZDS: its reconnect backoff
    // would otherwise have grown to seconds while a slow agent loads.
    let started = Instant::now() + AGENT_START;
    while !socket.exists() {
        if let Some(exit) = agent.try_wait()? {
            return Err(format!("the agent exited: {exit}").into());
        }
        if Instant::now() > started || STOP.load(Ordering::SeqCst) {
            return Err(format!("the agent did not serve ZDS within {AGENT_START:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("== starting the ztunnel double on {}", socket.display());
    let ztunnel = ZtunnelDouble::connect_with_retry(socket, ZtunnelConfig::default());
    let deadline = Instant::now() + PATIENCE;
    while !ztunnel
        .inspect(|s| s.ready && s.workloads.get(POD_UID).is_some_and(|w| w.proxies_running))
    {
        if let Some(exit) = agent.try_wait()? {
            return Err(format!("the agent exited: {exit}").into());
        }
        if Instant::now() > deadline || STOP.load(Ordering::SeqCst) {
            return Err("ztunnel did not get the pod within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("== ztunnel has the pod and listens in it on 15001/15006/15008");

    let remote = SocketAddr::new(cluster.remote.addrs.v4.into(), REMOTE_PORT);
    let app = SocketAddr::new(pod.addrs.v4.into(), APP_PORT);
    let remote_server = echo_server(&cluster.remote.ns, remote)?;
    let app_server = echo_server(
        &pod.ns,
        SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), APP_PORT),
    )?;

    // One connection each way, with what each end's sockets say: the same
    // values Istio's iptables rules give (agent/tests/parity.rs checks every
    // one in both modes; docs/parity.md, "Where the modes differ", lists the
    // exceptions).
    println!("== outbound: the pod's app connects to the remote server {remote}");
    let outbound = connect(&pod.ns, remote)?;
    println!("   app      {}", sockets(&outbound));
    let accepted = proxied_from(&ztunnel, outbound.local).await?;
    println!("   ztunnel  {}", ztunnel_view(&accepted));
    println!("            (under Istio's rules: the same addresses on both sides)");
    if let Some((_, peer)) = remote_server.last() {
        println!(
            "   remote   accepted from {peer} (ztunnel's own connection, from the pod's address)"
        );
    }
    println!("== inbound: the remote client connects to the pod's app {app}");
    let inbound = connect(&cluster.remote.ns, app)?;
    println!("   client   {}", sockets(&inbound));
    let accepted = proxied_from(&ztunnel, inbound.local).await?;
    println!("   ztunnel  {}", ztunnel_view(&accepted));
    println!(
        "            (under Istio's rules it accepts on {}:15006 and SO_ORIGINAL_DST says {app}:",
        pod.addrs.v4
    );
    println!("            the same destination)");
    if let Some((local, peer)) = app_server.last() {
        println!(
            "   app      getsockname {local}  getpeername {peer} (ztunnel connected from the client's address)"
        );
    }
    drop(inbound);

    println!("== kubelet probe: the node connects to the pod's app {app}");
    let earlier = app_server.count();
    let probe = connect(&cluster.node, app)?;
    println!("   node     {}", sockets(&probe));
    // The app's own socket: its accept is recorded before it echoes.
    let (local, peer) = app_server
        .nth(earlier)
        .ok_or("the app recorded no connection from the probe")?;
    let note = if peer == probe.local {
        "the node's own address: not captured, no NAT"
    } else {
        "not the node's socket: captured?"
    };
    println!("   app      getsockname {local}  getpeername {peer} ({note})");
    drop(probe);
    // Nothing serves DNS at the remote's address: only the capture answers.
    let resolver = SocketAddr::new(remote.ip(), 53);
    println!("== DNS: the pod's app asks the resolver {resolver} (UDP, A demo.ambpf.test)");
    resolve(&pod.ns, resolver, "demo.ambpf.test")?;
    tokio::time::sleep(Duration::from_millis(300)).await;

    println!(
        "== what ztunnel proxied (the probe is absent: host traffic reaches the app directly)"
    );
    for conn in ztunnel.proxied() {
        println!(
            "   ztunnel  listener {:<5} client {:<22} original destination {:<22} {:?}",
            conn.listener_port, conn.client, conn.original_dst, conn.outcome
        );
    }
    println!("== what ztunnel's DNS proxy answered");
    for query in ztunnel.dns_queries() {
        println!(
            "   ztunnel  {:?} query for {} from {}, received on {}",
            query.transport, query.name, query.client, query.server
        );
    }

    // The outbound connection is still open: status shows it under the pod,
    // read from the kernel's original-destination map.
    println!("== ambpf status (the outbound connection above is still open)");
    run_agent_cli(&args.agent, pin_root, &["status"]);
    drop(outbound);
    match Command::new("bpftool").arg("version").output() {
        Ok(_) => show_bpftool(&args.agent, pin_root)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => println!(
            "== bpftool is not installed, so its view of the programs and maps is left out: \
             install Debian's bpftool package (apt-get install bpftool)"
        ),
        Err(e) => println!("== bpftool's view is left out: cannot run bpftool: {e}"),
    }
    println!("== holding for {} s (Ctrl-C to end)", args.hold);
    let until = Instant::now() + Duration::from_secs(args.hold);
    while Instant::now() < until && !STOP.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ztunnel.shutdown().await;
    Ok(())
}

/// bpftool's view: this demo's programs, and the pods map with its BTF
/// field names.
fn show_bpftool(agent: &Path, pin_root: &Path) -> Result<(), Error> {
    // This demo's programs only: the ids its pins and its pod's filter
    // run (other ambpf agents on the machine have their own).
    let ids = own_program_ids(agent, pin_root);
    println!(
        "== bpftool prog show id <id> (the {} programs of this demo's agent)",
        ids.len()
    );
    for id in ids {
        let out = Command::new("bpftool")
            .args(["prog", "show", "id", &id.to_string()])
            .output()?;
        for line in String::from_utf8_lossy(&out.stdout).lines().take(1) {
            println!("   {line}");
        }
    }
    // The maps carry BTF: entries print with their field names.
    let pods_map = pin_root
        .join("maps")
        .join(ambpf_common::maps::PODS_BY_NETNS);
    println!("== bpftool map dump pinned {}", pods_map.display());
    let out = Command::new("bpftool")
        .args(["map", "dump", "pinned"])
        .arg(&pods_map)
        .output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        println!("   {line}");
    }
    Ok(())
}

/// Starts `ambpf run` inside the node's namespace: the node's addresses are
/// then the host's, as for a DaemonSet pod with host networking.
#[allow(clippy::too_many_arguments)] // each is one of the agent's flags
fn spawn_agent(
    agent: &Path,
    node: &NetnsGuard,
    pin_root: &Path,
    socket: &Path,
    pods_file: &Path,
    cgroup: &Path,
    pod: &ambpf_testbed::cluster::Pod,
    log: std::fs::File,
) -> Result<Child, Error> {
    let node_ns = std::fs::File::open(node.path())?;
    let mut cmd = Command::new(agent);
    cmd.arg("--pin-root")
        .arg(pin_root)
        .arg("run")
        .arg("--pods-file")
        .arg(pods_file)
        .arg("--zds-socket")
        .arg(socket)
        .arg("--cgroup")
        .arg(cgroup)
        .args(["--attach", &format!("{}:eth0", pod.ns.path().display())])
        .stdout(log.try_clone()?)
        .stderr(log)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        );
    // SAFETY: setns is async-signal-safe; the fd outlives the spawn.
    unsafe {
        cmd.pre_exec(move || {
            nix::sched::setns(node_ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)
        });
    }
    cmd.spawn()
        .map_err(|e| format!("starting {}: {e}", agent.display()).into())
}

/// The connections an echo server accepted: its socket's own address and
/// its peer, in accept order.
#[derive(Clone, Default)]
struct Accepted(Arc<Mutex<Vec<(SocketAddr, SocketAddr)>>>);

impl Accepted {
    fn last(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.0.lock().ok()?.last().copied()
    }

    fn count(&self) -> usize {
        self.0.lock().map_or(0, |seen| seen.len())
    }

    fn nth(&self, n: usize) -> Option<(SocketAddr, SocketAddr)> {
        self.0.lock().ok()?.get(n).copied()
    }
}

/// A thread echoing on `addr` inside `ns`, a thread per connection; they
/// end with the process.
fn echo_server(ns: &NetnsGuard, addr: SocketAddr) -> Result<Accepted, Error> {
    let listener = ns.run(|| TcpListener::bind(addr))??;
    let accepted = Accepted::default();
    let record = accepted.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            if let (Ok(local), Ok(peer)) = (conn.local_addr(), conn.peer_addr())
                && let Ok(mut seen) = record.0.lock()
            {
                seen.push((unmap_addr(local), unmap_addr(peer)));
            }
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while let Ok(n @ 1..) = conn.read(&mut buf) {
                    if conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(accepted)
}

/// A connection made from inside `ns` after one request/response, kept
/// open, with what its socket says.
struct Connection {
    _stream: TcpStream,
    /// getsockname()
    local: SocketAddr,
    /// getpeername()
    peer: SocketAddr,
}

fn connect(ns: &NetnsGuard, to: SocketAddr) -> Result<Connection, Error> {
    let connection = ns.run(|| -> std::io::Result<Connection> {
        let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let hello = b"hello through ambpf";
        stream.write_all(hello)?;
        // The echo: the connection works end to end before it is shown.
        stream.read_exact(&mut vec![0u8; hello.len()])?;
        Ok(Connection {
            local: unmap_addr(stream.local_addr()?),
            peer: unmap_addr(stream.peer_addr()?),
            _stream: stream,
        })
    })??;
    Ok(connection)
}

fn sockets(c: &Connection) -> String {
    format!("getsockname {}  getpeername {}", c.local, c.peer)
}

/// ztunnel's record of the connection it accepted from `client`.
async fn proxied_from(
    ztunnel: &ZtunnelDouble,
    client: SocketAddr,
) -> Result<ProxiedConnection, Error> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(conn) = ztunnel.proxied().into_iter().find(|c| c.client == client) {
            return Ok(conn);
        }
        if Instant::now() > deadline {
            return Err(format!("ztunnel accepted no connection from {client}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What ztunnel's accepted socket says.
fn ztunnel_view(c: &ProxiedConnection) -> String {
    let original = match c.so_original_dst {
        Some(dst) => format!("SO_ORIGINAL_DST {dst}"),
        None => format!(
            "SO_ORIGINAL_DST none (nothing was rewritten: the destination is the local {})",
            c.local
        ),
    };
    format!(
        "accepted on {} from {}, {original} -> proxies to {}",
        c.local, c.client, c.original_dst
    )
}

/// One A query over unconnected UDP from inside `ns`, as a stub resolver
/// sends it; prints the answer and where the app saw it come from.
fn resolve(ns: &NetnsGuard, resolver: SocketAddr, name: &str) -> Result<(), Error> {
    let (from, addresses) = ns.run(|| -> Result<_, String> {
        let udp = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
        udp.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let query = dns::encode_query(0x00de, name, dns::TYPE_A)?;
        udp.send_to(&query, resolver).map_err(|e| e.to_string())?;
        let mut buffer = [0u8; 512];
        let (len, from) = udp
            .recv_from(&mut buffer)
            .map_err(|e| format!("no DNS answer from {resolver}: {e}"))?;
        let answer = dns::Response::parse(&buffer[..len])?;
        Ok((from, answer.addresses()))
    })??;
    println!("   app      answer {addresses:?} from {from} (recvfrom)");
    Ok(())
}

fn unmap_addr(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr.ip(), IpAddr::V4),
        v4 => v4,
    };
    SocketAddr::new(ip, addr.port())
}

/// The ids of the programs under `pin_root`, from `ambpf status -o json`.
fn own_program_ids(agent: &Path, pin_root: &Path) -> std::collections::BTreeSet<u64> {
    let Ok(out) = Command::new(agent)
        .arg("--pin-root")
        .arg(pin_root)
        .args(["status", "-o", "json"])
        .output()
    else {
        return Default::default();
    };
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let ids = |list: &serde_json::Value| -> Vec<u64> {
        list.as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l["program_id"].as_u64())
            .collect()
    };
    let mut all: std::collections::BTreeSet<u64> = ids(&status["links"]).into_iter().collect();
    all.extend(ids(&status["tc_links"]));
    for pod in status["pods"].as_array().into_iter().flatten() {
        all.extend(pod["inbound_link"]["program_id"].as_u64());
    }
    all
}

fn run_agent_cli(agent: &Path, pin_root: &Path, args: &[&str]) {
    if let Err(e) = Command::new(agent)
        .arg("--pin-root")
        .arg(pin_root)
        .args(args)
        .status()
    {
        eprintln!("running {} {}: {e}", agent.display(), args.join(" "));
    }
}

fn stop(agent: &mut Child) {
    let _ = kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        Signal::SIGTERM,
    );
    let _ = agent.wait();
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> std::io::Result<TempDir> {
    let dir = std::env::temp_dir().join(format!("ambpf-demo-{}", ambpf_testbed::unique_name("")));
    std::fs::create_dir_all(&dir)?;
    Ok(TempDir(dir))
}
