//! A node with pods and an off-node client, each in its own namespace, for
//! traffic tests of the redirection.
//!
//! ```text
//!   pod i (eth0 10.244.i.2, fd00:a:i::2) ── vpod<i> (10.244.i.1, fd00:a:i::1) ┐
//!                                                                     node (forwards)
//!   remote (eth0 10.245.0.2, fd00:b::2) ── vremote (10.245.0.1, fd00:b::1)   ┘
//! ```
//! Every namespace routes through the node, so a pod reaches the remote
//! client and other pods via the node, as on a real node.
//!
//! The neighbour entries of the pods' links (the pod's gateway in the pod,
//! the pod's addresses on the node) are permanent, as the MACs are fixed
//! ([`pod_macs`]). The kernel's neighbour tables are shared by every
//! namespace, and their `gc_thresh3` (1,024 by default, settable only from
//! the host's namespace) caps the entries that are not permanent (Linux
//! 4.19 on): learnt entries would overflow it at about 500 pods with traffic.
//!
//! A node's IPAM hands a deleted pod's addresses to the next pod. The
//! `recycle_pod*` methods do that to pod i: a new network namespace gets the
//! same addresses, the same node-side `vpod<i+1>` and routes, and an `eth0`
//! at the same interface index (a CNI plugin creates it inside the fresh
//! namespace, so every pod's `eth0` has the same index), while the old
//! namespace is deleted, kept without network, or deleted so that the new
//! one gets its nsfs inode number.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use crate::{Addrs, Link, NetnsGuard};

mod pod_link;
pub use pod_link::PodLinkKind;

#[derive(Debug)]
pub struct Pod {
    pub ns: NetnsGuard,
    pub addrs: Addrs,
}

impl Pod {
    pub fn ips(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.addrs.v4), IpAddr::V6(self.addrs.v6)]
    }
}

#[derive(Debug)]
pub struct Cluster {
    // Field order is drop order: leaves before the node (and `Drop` deletes
    // the pods' namespaces first, all at once).
    pub pods: Vec<Pod>,
    pub remote: Pod,
    pub node: NetnsGuard,
    _links: Vec<Link>,
}

/// The most pods a cluster holds: what [`pod_addrs`] can number.
pub const MAX_PODS: usize = 2559;

/// Pod `n`'s (1-based, at most [`MAX_PODS`]) addresses and its gateway's (the
/// node side): `10.244.n.0/24` for the first 255, then `10.246.0.0/16`
/// onwards, 256 pods a block (10.245/16 is the remote client's).
fn pod_addrs(n: u16) -> (Addrs, Addrs) {
    assert!((1..=MAX_PODS as u16).contains(&n), "pod number {n}");
    let block = (n >> 8) as u8;
    let second = if block == 0 { 244 } else { 245 + block };
    let third = (n & 0xff) as u8;
    let pod = Addrs {
        v4: Ipv4Addr::new(10, second, third, 2),
        v6: Ipv6Addr::new(0xfd00, 0xa, n, 0, 0, 0, 0, 2),
    };
    let gw = Addrs {
        v4: Ipv4Addr::new(10, second, third, 1),
        v6: Ipv6Addr::new(0xfd00, 0xa, n, 0, 0, 0, 0, 1),
    };
    (pod, gw)
}

/// A fixed MAC, locally administered.
#[derive(Clone, Copy, Debug)]
struct Mac([u8; 6]);

impl Mac {
    /// The IPv6 link-local address the kernel gives the device (EUI-64).
    fn link_local(self) -> Ipv6Addr {
        let [a, b, c, d, e, f] = self.0;
        Ipv6Addr::from([
            0xfe,
            0x80,
            0,
            0,
            0,
            0,
            0,
            0,
            a ^ 0x02,
            b,
            c,
            0xff,
            0xfe,
            d,
            e,
            f,
        ])
    }
}

impl std::fmt::Display for Mac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// Pod `n`'s MACs: its `eth0`'s and the node side's (`vpod<n>`).
fn pod_macs(n: u16) -> (Mac, Mac) {
    let [high, low] = n.to_be_bytes();
    (
        Mac([0x02, 0xa0, 0, 0, high, low]),
        Mac([0x02, 0xa1, 0, 0, high, low]),
    )
}

const REMOTE: Addrs = Addrs {
    v4: Ipv4Addr::new(10, 245, 0, 2),
    v6: Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, 2),
};
const REMOTE_GW: Addrs = Addrs {
    v4: Ipv4Addr::new(10, 245, 0, 1),
    v6: Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, 1),
};

impl Cluster {
    /// A node with `pods` pods (at most [`MAX_PODS`]) and one remote client.
    ///
    /// Pods are made in bulk, a few `ip` processes for all of them plus one
    /// per pod, so a thousand pods take seconds, not minutes.
    pub fn create(pods: u16) -> io::Result<Self> {
        if usize::from(pods) > MAX_PODS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{pods} pods: a cluster holds at most {MAX_PODS}"),
            ));
        }
        let node = NetnsGuard::create("node")?;
        for sysctl in [
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
            // No duplicate address detection on the pods' link-local
            // addresses made at link up: while tentative (about 2 s) they
            // hold up neighbour discovery for the traffic the node forwards.
            "net.ipv6.conf.default.accept_dad=0",
        ] {
            node.sysctl(sysctl)?;
        }
        let mut links = Vec::new();
        let remote_ns = NetnsGuard::create("remote")?;
        links.push(Link::veth(
            &remote_ns, "eth0", REMOTE, &node, "vremote", REMOTE_GW,
        )?);
        route_via(&remote_ns, REMOTE_GW)?;
        let remote = Pod {
            ns: remote_ns,
            addrs: REMOTE,
        };

        let mut cluster = Self {
            pods: Vec::new(),
            remote,
            node,
            _links: links,
        };
        for (i, ns) in NetnsGuard::create_many("pod", pods.into())?
            .into_iter()
            .enumerate()
        {
            let (addrs, _) = pod_addrs(i as u16 + 1);
            cluster.pods.push(Pod { ns, addrs });
        }
        let numbered: Vec<(u16, &NetnsGuard)> = cluster
            .pods
            .iter()
            .enumerate()
            .map(|(i, pod)| (i as u16 + 1, &pod.ns))
            .collect();
        cluster.connect_pods(&numbered)?;
        Ok(cluster)
    }

    /// Joins each `(n, ns)` to the node as pod `n` (1-based), as a CNI
    /// plugin does: `eth0` made inside the pod's namespace (so it has the
    /// same interface index in every pod) with the pod's addresses, its peer
    /// `vpod<n>` on the node, default routes through it, and the permanent
    /// neighbour entries of both ends.
    fn connect_pods(&self, pods: &[(u16, &NetnsGuard)]) -> io::Result<()> {
        let mut links = Vec::new();
        let mut node_side = Vec::new();
        for &(n, ns) in pods {
            ns.sysctl("net.ipv6.conf.default.accept_dad=0")?;
            let (addrs, gw) = pod_addrs(n);
            let (pod_mac, node_mac) = pod_macs(n);
            links.push(format!(
                "link add eth0 netns {} address {pod_mac} type veth peer name vpod{n} \
                 address {node_mac} netns {}",
                ns.name(),
                self.node.name()
            ));
            node_side.extend([
                format!("addr add {}/24 dev vpod{n}", gw.v4),
                format!("addr add {}/64 dev vpod{n} nodad", gw.v6),
                format!("link set vpod{n} up"),
            ]);
            node_side.extend(permanent_neighbours(&addrs, pod_mac, &format!("vpod{n}")));
        }
        crate::ip_batch(None, &links)?;
        crate::ip_batch(Some(self.node.name()), &node_side)?;
        for &(n, ns) in pods {
            let (addrs, gw) = pod_addrs(n);
            let (_, node_mac) = pod_macs(n);
            let mut commands = vec![
                "link set lo up".to_owned(),
                format!("addr add {}/24 dev eth0", addrs.v4),
                format!("addr add {}/64 dev eth0 nodad", addrs.v6),
                "link set eth0 up".to_owned(),
            ];
            commands.extend(permanent_neighbours(&gw, node_mac, "eth0"));
            commands.extend([
                format!("route add default via {}", gw.v4),
                format!("route add default via {}", gw.v6),
            ]);
            crate::ip_batch(Some(ns.name()), &commands)?;
        }
        Ok(())
    }

    /// Pod `i` (0-based) as `connect_pods` numbers it.
    fn pod_number(&self, i: usize) -> io::Result<u16> {
        if i >= self.pods.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("no pod {i}"),
            ));
        }
        Ok(i as u16 + 1)
    }

    /// Removes pod `i`'s network, as a runtime tearing down its sandbox
    /// does: deleting `vpod<i+1>` deletes its peer `eth0` and the routes
    /// with them, and frees the addresses (one address cannot be routed to
    /// two veths). Returns the pod's number, for `connect_pods`.
    fn tear_down_network(&self, i: usize) -> io::Result<u16> {
        let n = self.pod_number(i)?;
        self.node.ip(&["link", "del", &format!("vpod{n}")])?;
        Ok(n)
    }

    /// Gives pod `i`'s addresses to a new pod, as a node's IPAM does once
    /// the old pod is deleted: the old namespace is deleted and `pods[i]` is
    /// a new namespace with the same addresses, `eth0` index, node-side veth
    /// and routes.
    pub fn recycle_pod(&mut self, i: usize) -> io::Result<()> {
        drop(self.recycle_pod_keeping_old(i)?);
        Ok(())
    }

    /// [`Cluster::recycle_pod`], but the old namespace lives on without
    /// network (only `lo`): the pod's sandbox network was torn down and the
    /// new pod got its addresses, but nobody has deleted the old pod yet.
    /// Returns the old namespace; dropping it deletes it.
    pub fn recycle_pod_keeping_old(&mut self, i: usize) -> io::Result<NetnsGuard> {
        let n = self.tear_down_network(i)?;
        let ns = NetnsGuard::create("pod")?;
        self.connect_pods(&[(n, &ns)])?;
        Ok(std::mem::replace(&mut self.pods[i].ns, ns))
    }

    /// [`Cluster::recycle_pod`] where the new namespace gets the old one's
    /// nsfs inode number, as the kernel hands it out again once the old
    /// namespace is freed.
    ///
    /// The kernel frees a network namespace's number asynchronously, in its
    /// cleanup work, once nothing holds the namespace (no fd, socket or
    /// process in it: the caller must have closed theirs). Numbers come from
    /// one allocator, lowest free first, shared by every kind of namespace
    /// and by /proc entries: a network namespace takes one for itself, then
    /// dozens for its /proc/net entries. So this waits until the old number
    /// is the lowest free one, occupying lower free numbers with UTS
    /// namespaces (one number each) meanwhile, and only then creates the
    /// network namespace, retrying if the number went elsewhere, for at most
    /// `within`. When the number did not come back in time (still held, or
    /// taken by a namespace or /proc entry made elsewhere), `pods[i]` is
    /// recycled into a namespace with another number and this returns an
    /// error saying so.
    pub fn recycle_pod_reusing_inode(&mut self, i: usize, within: Duration) -> io::Result<()> {
        let n = self.tear_down_network(i)?;
        let old = self.pods[i].ns.inode()?;
        // Until the new namespace is in place, pods[i] holds one made while
        // the old still lives, which therefore has another number.
        let placeholder = NetnsGuard::create_bare("pod")?;
        drop(std::mem::replace(&mut self.pods[i].ns, placeholder));

        let deadline = Instant::now() + within;
        let mut fillers = Vec::new();
        let mut reused = None;
        while reused.is_none() && Instant::now() < deadline {
            let probe = UtsNamespace::create()?;
            match probe.inode.cmp(&old) {
                std::cmp::Ordering::Less => fillers.push(probe),
                std::cmp::Ordering::Greater => {
                    // The old namespace is not freed yet.
                    drop(probe);
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::cmp::Ordering::Equal => {
                    drop(probe);
                    let ns = NetnsGuard::create_bare("pod")?;
                    if ns.inode()? == old {
                        reused = Some(ns);
                    }
                }
            }
        }
        drop(fillers);
        let reused_inode = reused.is_some();
        let ns = match reused {
            Some(ns) => ns,
            None => NetnsGuard::create_bare("pod")?,
        };
        self.connect_pods(&[(n, &ns)])?;
        drop(std::mem::replace(&mut self.pods[i].ns, ns));
        if !reused_inode {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "netns inode {old} of pod {i} was not handed out again within \
                     {within:?} (pod {i} is now in a namespace with inode {}): is \
                     the old namespace still held open?",
                    self.pods[i].ns.inode()?
                ),
            ));
        }
        Ok(())
    }

    /// Moves pod `i` to other addresses on its `eth0`, in the same subnets
    /// (`.3` and `::3` for `.2` and `::2`, and so on), as a pod's network
    /// changed under a live namespace: the new addresses are added before
    /// the old ones go, so the routes through the node stay.
    pub fn readdress_pod(&mut self, i: usize) -> io::Result<()> {
        let n = self.pod_number(i)?;
        let (_, gw) = pod_addrs(n);
        let (pod_mac, _) = pod_macs(n);
        let pod = &mut self.pods[i];
        // The new IPv4 address is a secondary of the old one's subnet: kept
        // (promoted) when the old one goes, rather than deleted with it.
        pod.ns.sysctl("net.ipv4.conf.eth0.promote_secondaries=1")?;
        let old = pod.addrs;
        let [a, b, c, d] = old.v4.octets();
        let mut v6 = old.v6.segments();
        v6[7] = v6[7].wrapping_add(1);
        let new = Addrs {
            v4: Ipv4Addr::new(a, b, c, d.wrapping_add(1)),
            v6: Ipv6Addr::from(v6),
        };
        crate::ip_batch(
            Some(pod.ns.name()),
            &[
                format!("addr add {}/24 dev eth0", new.v4),
                format!("addr add {}/64 dev eth0 nodad", new.v6),
                format!("addr del {}/24 dev eth0", old.v4),
                format!("addr del {}/64 dev eth0", old.v6),
                format!("route replace default via {}", gw.v4),
                format!("route replace default via {}", gw.v6),
            ],
        )?;
        let device = format!("vpod{n}");
        let mut node_side = permanent_neighbours(&new, pod_mac, &device);
        node_side.extend([
            format!("neigh del {} dev {device}", old.v4),
            format!("neigh del {} dev {device}", old.v6),
        ]);
        crate::ip_batch(Some(self.node.name()), &node_side)?;
        pod.addrs = new;
        Ok(())
    }

    /// Pod `i`'s (0-based) link to the node, as an L2 neighbour sees it:
    /// `(node-side device, node-side MAC, pod's MAC, pod's link-local
    /// address, node side's link-local address)`.
    pub fn pod_link(&self, i: usize) -> io::Result<(String, String, String, Ipv6Addr, Ipv6Addr)> {
        let n = self.pod_number(i)?;
        let (pod_mac, node_mac) = pod_macs(n);
        Ok((
            format!("vpod{n}"),
            node_mac.to_string(),
            pod_mac.to_string(),
            pod_mac.link_local(),
            node_mac.link_local(),
        ))
    }

    /// The node namespace's cookie: where the node's own connections (its
    /// probes) come from.
    pub fn node_netns_cookie(&self) -> u64 {
        self.node.cookie().expect("the node namespace's cookie")
    }

    /// The node's own addresses (what a node agent sees in the host netns).
    pub fn node_addresses(&self) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = vec![IpAddr::V4(REMOTE_GW.v4), IpAddr::V6(REMOTE_GW.v6)];
        for n in 1..=self.pods.len() as u16 {
            let (_, gw) = pod_addrs(n);
            out.extend([IpAddr::V4(gw.v4), IpAddr::V6(gw.v6)]);
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // One `ip` process for every pod namespace (their veths go with them).
        NetnsGuard::delete_many(
            std::mem::take(&mut self.pods)
                .into_iter()
                .map(|p| p.ns)
                .collect(),
        );
    }
}

/// A UTS namespace held open: the cheapest way to take one nsfs inode
/// number. Dropping it frees the number.
struct UtsNamespace {
    _fd: std::fs::File,
    inode: u64,
}

impl UtsNamespace {
    fn create() -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt as _;
        // Made by a thread of its own, which leaves it behind when it ends.
        let fd = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUTS)?;
            std::fs::File::open("/proc/thread-self/ns/uts")
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let inode = fd.metadata()?.ino();
        Ok(Self { _fd: fd, inode })
    }
}

/// `ip` commands: `addrs` and the link-local address of `mac` at `mac` on
/// `device`, permanently (the link-local one would be learnt from the
/// other end's router solicitations and neighbour discovery).
fn permanent_neighbours(addrs: &Addrs, mac: Mac, device: &str) -> Vec<String> {
    [
        IpAddr::V4(addrs.v4),
        IpAddr::V6(addrs.v6),
        IpAddr::V6(mac.link_local()),
    ]
    .map(|ip| format!("neigh replace {ip} lladdr {mac} dev {device} nud permanent"))
    .to_vec()
}

fn route_via(ns: &NetnsGuard, gw: Addrs) -> io::Result<()> {
    ns.ip(&["route", "add", "default", "via", &gw.v4.to_string()])?;
    ns.ip(&["-6", "route", "add", "default", "via", &gw.v6.to_string()])
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpListener, TcpStream};

    use super::*;

    const PATIENCE: Duration = Duration::from_secs(10);

    /// The remote client reaches pod `i` at each of its addresses, through
    /// the node, and the pod's replies find their way back.
    pub(super) fn assert_reachable(cluster: &Cluster, i: usize) {
        let pod = &cluster.pods[i];
        let listener = pod
            .ns
            .run(|| TcpListener::bind("[::]:7000"))
            .unwrap()
            .unwrap();
        for (ip, from) in pod.ips().into_iter().zip(cluster.remote.ips()) {
            let to = SocketAddr::new(ip, 7000);
            cluster
                .remote
                .ns
                .run(|| TcpStream::connect_timeout(&to, PATIENCE))
                .unwrap()
                .unwrap_or_else(|e| panic!("connecting to pod {i} at {to}: {e}"));
            let (_, peer) = listener.accept().unwrap();
            let peer = match peer.ip() {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer.ip(), IpAddr::V4),
                v4 => v4,
            };
            assert_eq!(peer, from);
        }
    }

    /// `ip neigh show` lines in `ns` for the devices named `prefix...`.
    fn neighbours(ns: &NetnsGuard, prefix: &str) -> Vec<String> {
        let out = std::process::Command::new("ip")
            .args(["-n", ns.name(), "neigh", "show"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter(|line| line.contains(&format!(" dev {prefix}")))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn pod_traffic_learns_no_neighbour_entries() {
        let mut cluster = Cluster::create(2).unwrap();
        cluster.readdress_pod(1).unwrap();
        for i in 0..2 {
            assert_reachable(&cluster, i);
        }
        let node = neighbours(&cluster.node, "vpod");
        // Each pod's three addresses, the readdressed pod's old ones gone.
        assert_eq!(node.len(), 6, "{node:?}");
        let pods = cluster
            .pods
            .iter()
            .flat_map(|pod| neighbours(&pod.ns, "eth0"));
        for entry in node.iter().cloned().chain(pods) {
            assert!(
                entry.trim_end().ends_with("PERMANENT"),
                "a learnt entry: {entry}"
            );
        }
    }

    #[test]
    fn a_recycled_pod_has_the_old_addresses_eth0_and_routes_in_a_new_namespace() {
        let mut cluster = Cluster::create(2).unwrap();
        let old = cluster.pods[0].ns.path();
        let ifindex = cluster.pods[0].ns.ifindex("eth0").unwrap();
        cluster.recycle_pod(0).unwrap();
        assert!(!old.exists(), "{} left behind", old.display());
        let new = &cluster.pods[0];
        assert_ne!(new.ns.path(), old);
        assert_eq!(new.ns.ifindex("eth0").unwrap(), ifindex);
        assert_reachable(&cluster, 0);
        // The neighbour is untouched.
        assert_reachable(&cluster, 1);
    }

    #[test]
    fn the_old_namespace_can_live_on_without_network() {
        let mut cluster = Cluster::create(1).unwrap();
        let old = cluster.recycle_pod_keeping_old(0).unwrap();
        assert!(old.path().exists());
        assert!(old.ifindex("eth0").is_err(), "the old pod kept its eth0");
        assert_ne!(old.inode().unwrap(), cluster.pods[0].ns.inode().unwrap());
        assert_reachable(&cluster, 0);
        // The new pod can be recycled in turn.
        let older = cluster.recycle_pod_keeping_old(0).unwrap();
        assert_reachable(&cluster, 0);
        let paths = [old.path(), older.path()];
        drop((old, older));
        for path in paths {
            assert!(!path.exists(), "{} left behind", path.display());
        }
    }

    #[test]
    fn the_new_namespace_can_get_the_old_ones_inode_number() {
        let mut cluster = Cluster::create(1).unwrap();
        let old = cluster.pods[0].ns.inode().unwrap();
        let old_path = cluster.pods[0].ns.path();
        cluster.recycle_pod_reusing_inode(0, PATIENCE).unwrap();
        assert_eq!(cluster.pods[0].ns.inode().unwrap(), old);
        assert_ne!(cluster.pods[0].ns.path(), old_path);
        assert_reachable(&cluster, 0);
    }

    #[test]
    fn an_inode_number_still_held_is_not_reused_and_the_error_says_so() {
        let mut cluster = Cluster::create(1).unwrap();
        let old = cluster.pods[0].ns.inode().unwrap();
        let held = std::fs::File::open(cluster.pods[0].ns.path()).unwrap();
        let error = cluster
            .recycle_pod_reusing_inode(0, Duration::from_millis(300))
            .unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(
            error.to_string().contains(&format!(
                "netns inode {old} of pod 0 was not handed out again"
            )),
            "{error}"
        );
        // The pod was recycled all the same, into another number.
        assert_ne!(cluster.pods[0].ns.inode().unwrap(), old);
        assert_reachable(&cluster, 0);
        drop(held);
    }
}
