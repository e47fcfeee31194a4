//! The `storm` suite's processes: how a storm is spread over `storm-part`
//! processes within the open-file limit ([`Layout`]), and starting and
//! talking to them ([`Part`]).

use std::net::SocketAddr;

use ambpf_testbed::storm::StormSummary;
use serde::Deserialize;

use super::*;

/// Servers' ports: greeter process `i` listens on `BASE_PORT + 2i` of the
/// remote's IPv4 address and `BASE_PORT + 2i + 1` of its IPv6 one. The
/// clients take the targets in turn, families alternating, so each family
/// carries half of the storm: two families double the source ports a pod
/// has towards ztunnel's one listener per family (where the eBPF mode
/// connects).
const BASE_PORT: u16 = 9101;
/// Descriptors each part process keeps for itself beside its connections
/// (runtime, stdio, listeners).
const FDS_RESERVED: u64 = 1024;
/// A pod's connections to one family's ztunnel listener all come from its
/// one address, so one pod holds at most about 2 × 64,512 (the whole port
/// range of each family); kept well below.
const MAX_CLIENTS_PER_POD: u64 = 100_000;
/// SO_REUSEPORT spreads a pod's connections over its proxy processes by a
/// hash of the 4-tuple, not evenly: each proxy process is sized for this
/// much more than its even share.
const PROXY_IMBALANCE: f64 = 1.5;
/// How a storm is spread over processes, so that none holds more
/// descriptors than its hard open-file limit allows: one client process
/// per pod (a descriptor per connection), a few ztunnel proxy processes per
/// pod (two: accepted and upstream), and greeter processes with two ports
/// each (one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(super) struct Layout {
    pub(super) pods: usize,
    pub(super) proxies_per_pod: usize,
    pub(super) greeters: usize,
}

impl Layout {
    /// `budget`: descriptors one process may use for connections.
    pub(super) fn for_storm(connections: u64, budget: u64) -> Self {
        let budget = budget.max(1);
        let pods = connections.div_ceil(budget.min(MAX_CLIENTS_PER_POD)).max(1);
        let per_pod = connections.div_ceil(pods);
        let proxy_fds = (per_pod * 2) as f64 * PROXY_IMBALANCE;
        let proxies_per_pod = (proxy_fds / budget as f64).ceil().max(1.0) as usize;
        // Each pod takes the ports in turn from the first, so a port may get
        // one more than its even share from every pod.
        let greeters = (connections + pods * 2).div_ceil(budget).max(1);
        Self {
            pods: pods as usize,
            proxies_per_pod,
            greeters: greeters as usize,
        }
    }

    /// Pod `pod`'s share of the connections, as even as possible.
    pub(super) fn clients_of_pod(&self, connections: usize, pod: usize) -> usize {
        connections / self.pods + usize::from(pod < connections % self.pods)
    }
}

/// `count` greeter parts in `remote`, two ports each; and the storm's
/// targets, IPv4 and IPv6 alternating.
pub(super) fn start_greeters(
    remote: &cluster::Pod,
    count: usize,
) -> Result<(Vec<Part>, Vec<SocketAddr>)> {
    let mut greeters = Vec::with_capacity(count);
    let mut targets = Vec::with_capacity(count * 2);
    for i in 0..count {
        let port = u16::try_from(i)
            .ok()
            .and_then(|i| BASE_PORT.checked_add(2 * i))
            .context("too many greeters for the port range")?;
        let pair = [
            SocketAddr::new(remote.addrs.v4.into(), port),
            SocketAddr::new(remote.addrs.v6.into(), port + 1),
        ];
        let mut part_args = vec!["greeters".to_owned()];
        for address in pair {
            part_args.extend(["--address".to_owned(), address.to_string()]);
        }
        greeters.push(Part::spawn(
            &remote.ns,
            format!("greeters {i}"),
            &part_args,
        )?);
        targets.extend(pair);
    }
    Ok((greeters, targets))
}

/// The proxies' counts once they have recorded at least `decided`
/// connections (or after [`READY_TIMEOUT`]).
pub(super) fn proxies_report(proxies: &mut [Part], decided: usize) -> Result<ProxiesReport> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let mut total = ProxiesReport::default();
        for part in proxies.iter_mut() {
            part.send("report")?;
            total += part.receive::<ProxiesReport>()?;
        }
        if total.accepted >= decided || Instant::now() > deadline {
            return Ok(total);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What a `clients` part reports (see `storm-part`).
#[derive(Deserialize)]
pub(super) struct ClientsReport {
    pub(super) summary: StormSummary,
    pub(super) broken: usize,
}

/// What a `proxies` part reports (see `storm-part`).
#[derive(Default, Deserialize)]
pub(super) struct ProxiesReport {
    pub(super) accepted: usize,
    pub(super) refused_self_call: usize,
}

impl std::ops::AddAssign for ProxiesReport {
    fn add_assign(&mut self, other: Self) {
        self.accepted += other.accepted;
        self.refused_self_call += other.refused_self_call;
    }
}

/// Descriptors one part process may use for its connections: its hard
/// open-file limit (inherited from this process; it raises its soft limit
/// to it) less what it keeps for itself.
pub(super) fn fd_budget() -> Result<u64> {
    use nix::sys::resource::{Resource, getrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    ensure!(
        hard > FDS_RESERVED * 2,
        "the open-file hard limit ({hard}) leaves no room for a storm"
    );
    Ok(hard - FDS_RESERVED)
}

/// One `storm-part` process (beside this binary), started in a namespace
/// and spoken to in JSON lines; killed when dropped.
pub(super) struct Part {
    what: String,
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Part {
    pub(super) fn spawn(
        ns: &ambpf_testbed::NetnsGuard,
        what: String,
        args: &[impl AsRef<std::ffi::OsStr>],
    ) -> Result<Self> {
        use std::process::Stdio;
        let binary = std::env::current_exe()?.with_file_name("storm-part");
        let mut child = ns
            .command(&binary)?
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} ({what})", binary.display()))?;
        let stdin = child.stdin.take().context("storm-part's stdin")?;
        let stdout = child.stdout.take().context("storm-part's stdout")?;
        Ok(Self {
            what,
            child,
            stdin,
            stdout: std::io::BufReader::new(stdout),
        })
    }

    pub(super) fn send(&mut self, line: &str) -> Result<()> {
        use std::io::Write as _;
        writeln!(self.stdin, "{line}").with_context(|| format!("telling {} {line}", self.what))
    }

    /// The part's next line; its exit status if it ended instead.
    pub(super) fn receive<T: serde::de::DeserializeOwned>(&mut self) -> Result<T> {
        use std::io::BufRead as _;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("storm part {} ended ({status}) before answering", self.what);
        }
        serde_json::from_str(&line).with_context(|| format!("{}: {line:?}", self.what))
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every process of the layout stays within the budget, with its
    /// imbalance allowance for the proxies.
    fn assert_fits(connections: u64, budget: u64) -> Layout {
        let layout = Layout::for_storm(connections, budget);
        let total: usize = (0..layout.pods)
            .map(|pod| layout.clients_of_pod(connections as usize, pod))
            .sum();
        assert_eq!(total as u64, connections, "{layout:?}");
        let largest_pod = layout.clients_of_pod(connections as usize, 0) as u64;
        assert!(largest_pod <= budget.min(MAX_CLIENTS_PER_POD), "{layout:?}");
        let per_proxy = (largest_pod * 2) as f64 * PROXY_IMBALANCE / layout.proxies_per_pod as f64;
        assert!(per_proxy <= budget as f64, "{layout:?}");
        let per_greeter_port =
            connections.div_ceil(2 * layout.greeters as u64) + layout.pods as u64;
        assert!(2 * per_greeter_port <= budget, "{layout:?}");
        layout
    }

    #[test]
    fn a_small_storm_is_one_process_of_each() {
        let layout = assert_fits(1024, 18_976);
        assert_eq!(
            layout,
            Layout {
                pods: 1,
                proxies_per_pod: 1,
                greeters: 1
            }
        );
    }

    #[test]
    fn storms_past_the_default_capacity_are_spread_within_the_fd_limit() {
        // 20,000 is this machine's hard limit; 1,048,576 the kernel's nr_open.
        for budget in [18_976, 64_512, 1_047_552] {
            for connections in [65_536, 131_072, 262_144] {
                let layout = assert_fits(connections, budget);
                assert!(layout.pods >= 1 && layout.greeters >= 1, "{layout:?}");
            }
        }
        assert_eq!(Layout::for_storm(131_072, 18_976).pods, 7);
    }
}
