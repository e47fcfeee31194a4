//! The in-pod proxies of one ztunnel double, in a process of their own
//! (`ZtunnelConfig::proxy_process`): the double's ZDS client asks over stdin
//! to start and stop pods' proxies, and every proxied connection and DNS
//! query is reported back on stdout, as JSON lines. Runs until stdin closes,
//! then stops every pod's proxies.

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    process::ExitCode,
    time::Duration,
};

use ambpf_testbed::ztunnel::{
    DEFAULT_DNS_ANSWER_V4, DEFAULT_DNS_ANSWER_V6, ZtunnelConfig, serve_proxy_process,
};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ztunnel-proxies",
    about = "A ztunnel double's in-pod proxies, driven by the double over stdin"
)]
struct Args {
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
    /// Wait this long after accepting a connection before asking its
    /// original destination.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    original_dst_delay_ms: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut config = ZtunnelConfig::default()
        .dns_answer_v4(args.dns_answer_v4)
        .dns_answer_v6(args.dns_answer_v6)
        .original_dst_delay(Duration::from_millis(args.original_dst_delay_ms));
    if let Some(upstream) = args.dns_upstream {
        config = config.dns_upstream(upstream);
    }
    let served = ambpf_testbed::bench::raise_fd_limit().and_then(|_| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(serve_proxy_process(config))
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ztunnel-proxies: {e}");
            ExitCode::FAILURE
        }
    }
}
