//! The ambpf demo: runs the agent against a throwaway pod on this machine.
//!
//! Creates a pod network namespace joined to a node namespace by a veth and a
//! private bpffs mount, starts `ambpf run` attached to the pod's eth0, sends
//! traffic, and prints what the agent loaded and counted. It holds for a while
//! so `bpftool prog show` / `bpftool map show` can be run alongside, then stops
//! the agent, uninstalls, and removes everything it created (also on Ctrl-C).

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use ambpf_testbed::{BpffsMount, PodAndNode};
use clap::Parser;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, kill, sigaction};

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

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: i32) {
    STOP.store(true, Ordering::SeqCst);
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
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
    let pn = PodAndNode::create()?;
    println!(
        "== pod namespace {} (eth0 {} / {})",
        pn.pod.name(),
        PodAndNode::POD.v4,
        PodAndNode::POD.v6
    );
    println!(
        "== node namespace {} (veth-pod {})",
        pn.node.name(),
        PodAndNode::NODE.v4
    );
    println!("== pin root {} (private bpffs)", pin_root.display());

    let mut agent = Command::new(&args.agent)
        .arg("--pin-root")
        .arg(&pin_root)
        .args(["run", "--attach", &format!("{}:eth0", pn.pod.name())])
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .spawn()
        .map_err(|e| format!("starting {}: {e}", args.agent.display()))?;
    let result = demo(&args, &pn, &pin_root, &mut agent);
    stop(&mut agent);
    status(&args.agent, &pin_root, &["uninstall"]);
    result
}

fn demo(
    args: &Args,
    pn: &PodAndNode,
    pin_root: &Path,
    agent: &mut Child,
) -> Result<(), Box<dyn std::error::Error>> {
    wait_for_links(pin_root, agent)?;
    println!("== agent attached; sending traffic from the pod to the node");
    send_traffic(pn)?;
    // Give the agent a moment to print the kernel's log records.
    std::thread::sleep(Duration::from_millis(300));

    println!("== ambpf status");
    status(&args.agent, pin_root, &["status"]);
    if Command::new("bpftool").arg("version").output().is_ok() {
        for what in [
            ["prog", "show", "name", "ambpf_cnt_in"],
            ["prog", "show", "name", "ambpf_cnt_out"],
            ["map", "show", "name", "ambpf_if_stats"],
        ] {
            println!("== bpftool {}", what.join(" "));
            let _ = Command::new("bpftool").args(what).status();
        }
    }
    println!("== holding for {} s (Ctrl-C to end)", args.hold);
    let until = Instant::now() + Duration::from_secs(args.hold);
    while Instant::now() < until && !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Waits until the agent has pinned both links of the pod's eth0.
fn wait_for_links(pin_root: &Path, agent: &mut Child) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(exit) = agent.try_wait()? {
            return Err(format!("the agent exited early: {exit}").into());
        }
        let links = std::fs::read_dir(pin_root.join("links/tc"))
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|ns| std::fs::read_dir(ns.path()).into_iter().flatten().flatten())
            .count();
        if links == 2 {
            return Ok(());
        }
        if Instant::now() > deadline || STOP.load(Ordering::SeqCst) {
            return Err("the agent did not attach within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Five UDP datagrams and one TCP echo exchange, pod to node.
fn send_traffic(pn: &PodAndNode) -> Result<(), Box<dyn std::error::Error>> {
    let node = SocketAddr::from((PodAndNode::NODE.v4, 0));
    let (udp, tcp) = pn
        .node
        .run(|| Ok::<_, std::io::Error>((UdpSocket::bind(node)?, TcpListener::bind(node)?)))??;
    let (udp_to, tcp_to) = (udp.local_addr()?, tcp.local_addr()?);
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut conn, _) = tcp.accept()?;
        let mut buf = [0u8; 64];
        let n = conn.read(&mut buf)?;
        conn.write_all(&buf[..n])
    });
    pn.pod.run(|| -> std::io::Result<()> {
        let s = UdpSocket::bind(SocketAddr::from((PodAndNode::POD.v4, 0)))?;
        for _ in 0..5 {
            s.send_to(b"ambpf demo", udp_to)?;
        }
        let mut conn = TcpStream::connect_timeout(&tcp_to, Duration::from_secs(5))?;
        conn.write_all(b"hello through ambpf")?;
        let mut buf = [0u8; 64];
        let n = conn.read(&mut buf)?;
        println!("   tcp echo: {:?}", String::from_utf8_lossy(&buf[..n]));
        Ok(())
    })??;
    echo.join().map_err(|_| "echo thread panicked")??;
    Ok(())
}

fn status(agent: &Path, pin_root: &Path, args: &[&str]) {
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
