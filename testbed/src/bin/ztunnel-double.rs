//! A stand-in for ztunnel on this machine: connects to the node agent's ZDS
//! socket with ztunnel's retry and backoff, starts in-pod proxies for the pods
//! it is handed, and prints what happens as JSON lines on stdout:
//!
//! ```text
//! {"event":"connected","connection":1}
//! {"event":"add","uid":"...","name":"...","namespace":"...","service_account":"...","netns_inode":4026532...}
//! {"event":"snapshot_sent"}
//! {"event":"connection","uid":"...","listener_port":15001,"client":"10.244.0.2:40000","original_dst":"10.244.0.1:80","outcome":"proxied"}
//! {"event":"dns_query","uid":"...","transport":"udp","client":"127.0.0.1:40000","server":"127.0.0.1:15053","name":"example.com","qtype":1,"answer":"10.96.0.53"}
//! ```
//!
//! Exits 0 on SIGTERM or SIGINT, after stopping every proxy.

use std::{
    io::{self, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    time::Duration,
};

use ambpf_testbed::ztunnel::{
    DEFAULT_DNS_ANSWER_V4, DEFAULT_DNS_ANSWER_V6, DEFAULT_SOCKET_PATH, DnsQuery, ProxiedConnection,
    ZtunnelConfig, ZtunnelDouble,
};
use clap::Parser;
use serde::Serialize;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
#[command(
    name = "ztunnel-double",
    about = "A ztunnel test double: ZDS client and in-pod proxies, events as JSON lines"
)]
struct Args {
    /// The node agent's ZDS socket.
    #[arg(long, default_value = DEFAULT_SOCKET_PATH)]
    socket: PathBuf,
    /// Only speak ZDS; start no in-pod proxies.
    #[arg(long)]
    no_proxies: bool,
    /// NACK the Add of this pod uid with `failure to start proxy` (repeatable).
    #[arg(long = "nack", value_name = "UID")]
    nack: Vec<String>,
    /// Wait this many milliseconds before answering each request.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    ack_delay_ms: u64,
    /// The DNS proxy's answer to every A query.
    #[arg(long, value_name = "IPV4", default_value_t = DEFAULT_DNS_ANSWER_V4)]
    dns_answer_v4: Ipv4Addr,
    /// The DNS proxy's answer to every AAAA query.
    #[arg(long, value_name = "IPV6", default_value_t = DEFAULT_DNS_ANSWER_V6)]
    dns_answer_v6: Ipv6Addr,
    /// Forward every DNS query to this resolver (ztunnel's upstream: the
    /// cluster's DNS) and relay its answer, instead of answering it.
    #[arg(long, value_name = "IP:PORT")]
    dns_upstream: Option<SocketAddr>,
}

/// A DNS query answered, tagged like the ZDS events.
#[derive(Serialize)]
#[serde(tag = "event", rename = "dns_query")]
struct DnsQueryLine<'a> {
    #[serde(flatten)]
    query: &'a DnsQuery,
}

/// A proxied connection, tagged like the ZDS events.
#[derive(Serialize)]
#[serde(tag = "event", rename = "connection")]
struct ConnectionLine<'a> {
    #[serde(flatten)]
    connection: &'a ProxiedConnection,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ztunnel-double: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> io::Result<()> {
    let mut config = if args.no_proxies {
        ZtunnelConfig::zds_only()
    } else {
        ZtunnelConfig::default()
    };
    config.nack_uids.extend(args.nack);
    config.ack_delay = Duration::from_millis(args.ack_delay_ms);
    config = config
        .dns_answer_v4(args.dns_answer_v4)
        .dns_answer_v6(args.dns_answer_v6);
    if let Some(upstream) = args.dns_upstream {
        config = config.dns_upstream(upstream);
    }

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let double = ZtunnelDouble::connect_with_retry(&args.socket, config);
    let mut changes = double.subscribe();
    let mut printed = 0;
    loop {
        changes.borrow_and_update();
        print_new(&double, &mut printed)?;
        tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            changed = changes.changed() => if changed.is_err() { break },
        }
    }
    double.shutdown().await;
    Ok(())
}

/// Prints the events after the first `printed`, and the connections and DNS
/// queries recorded since the last call (taken, so a long run stays flat in
/// memory).
fn print_new(double: &ZtunnelDouble, printed: &mut usize) -> io::Result<()> {
    let events = double.inspect(|s| s.events.get(*printed..).unwrap_or_default().to_vec());
    let connections = double.take_proxied();
    let dns_queries = double.take_dns_queries();
    let mut out = io::stdout().lock();
    for event in &events {
        serde_json::to_writer(&mut out, event)?;
        out.write_all(b"\n")?;
    }
    for connection in &connections {
        serde_json::to_writer(&mut out, &ConnectionLine { connection })?;
        out.write_all(b"\n")?;
    }
    for query in &dns_queries {
        serde_json::to_writer(&mut out, &DnsQueryLine { query })?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    *printed += events.len();
    Ok(())
}
