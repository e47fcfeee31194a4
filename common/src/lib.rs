//! Types shared by the ambpf kernel programs (`ebpf/`) and the agent (`agent/`).
//!
//! Everything here is `#[repr(C)]` with explicit padding so that the kernel and
//! userspace agree on the layout byte for byte. Names of programs and maps are
//! kept here too: they are what `bpftool prog show` / `bpftool map show` print,
//! and the kernel truncates object names to 15 bytes, which the tests below
//! enforce.
#![no_std]

pub mod trace;
pub use trace::{TraceDirection, TraceGate, TraceRecord, Verdict};

/// Program names as the kernel knows them (the eBPF function symbols).
pub mod programs {
    /// TC program counting packets that enter an interface (TCX ingress).
    pub const IFACE_COUNT_INGRESS: &str = "ambpf_cnt_in";
    /// TC program counting packets that leave an interface (TCX egress).
    pub const IFACE_COUNT_EGRESS: &str = "ambpf_cnt_out";

    /// TC ingress on each enrolled pod's interfaces: steers inbound TCP SYNs
    /// to ztunnel's 15006 listener (`bpf_sk_assign`, TPROXY-style).
    pub const POD_INGRESS: &str = "ambpf_pod_in";
    /// sk_lookup in each enrolled pod's netns, where the kernel's TC
    /// `bpf_sk_assign` refuses SO_REUSEPORT listeners (before 6.5): assigns
    /// the SYNs [`POD_INGRESS`] steered to ztunnel's inbound listener.
    pub const INBOUND_LOOKUP: &str = "ambpf_inbound";
    /// cgroup connect4/connect6: outbound TCP to 15001, DNS to 15053.
    pub const CONNECT4: &str = "ambpf_connect4";
    pub const CONNECT6: &str = "ambpf_connect6";
    /// cgroup sendmsg4/6: unconnected UDP DNS queries to 15053.
    pub const SENDMSG4: &str = "ambpf_sendmsg4";
    pub const SENDMSG6: &str = "ambpf_sendmsg6";
    /// cgroup recvmsg4/6: DNS answers appear to come from the resolver asked.
    pub const RECVMSG4: &str = "ambpf_recvmsg4";
    pub const RECVMSG6: &str = "ambpf_recvmsg6";
    /// cgroup getpeername4/6: the app sees the peer it connected to.
    pub const GETPEERNAME4: &str = "ambpf_peername4";
    pub const GETPEERNAME6: &str = "ambpf_peername6";
    /// cgroup getsockopt: answers SO_ORIGINAL_DST for ztunnel's 15001.
    pub const GETSOCKOPT: &str = "ambpf_origdst";
    /// cgroup sock_ops: records redirected connections' tuples, and marks
    /// ztunnel's connections to local apps so that replies return to it.
    pub const SOCK_OPS: &str = "ambpf_sockops";
    /// cgroup sock_create: tags the raw sockets opened in enrolled pods.
    pub const RAW_SOCK_CREATE: &str = "ambpf_rawsock";
    /// cgroup_skb egress: drops TCP that a tagged raw socket sends around
    /// the capture.
    pub const RAW_EGRESS: &str = "ambpf_rawguard";

    /// TC programs, in load order.
    pub const TC: &[&str] = &[IFACE_COUNT_INGRESS, IFACE_COUNT_EGRESS, POD_INGRESS];
    /// Global of [`POD_INGRESS`]: non-zero to hand SYNs to
    /// [`INBOUND_LOOKUP`] instead of assigning them itself.
    pub const INBOUND_VIA_SK_LOOKUP: &str = "INBOUND_VIA_SK_LOOKUP";
    /// Set by the agent at load where the kernel lets cgroup sock_addr
    /// programs call `bpf_get_current_pid_tgid`: ztunnel's mark exempts a
    /// socket there only on ztunnel's process.
    pub const ZTUNNEL_PROCESS_IN_SOCK_ADDR: &str = "ZTUNNEL_PROCESS_IN_SOCK_ADDR";
    /// The same for sock_ops programs (Linux 6.10 on): ztunnel's listener is
    /// filed, and its connections to the app marked, only on its process.
    pub const ZTUNNEL_PROCESS_IN_SOCK_OPS: &str = "ZTUNNEL_PROCESS_IN_SOCK_OPS";
    /// cgroup sock_addr programs, in load order.
    pub const SOCK_ADDR: &[&str] = &[
        CONNECT4,
        CONNECT6,
        SENDMSG4,
        SENDMSG6,
        RECVMSG4,
        RECVMSG6,
        GETPEERNAME4,
        GETPEERNAME6,
    ];
    /// The raw-socket guard: optional, loaded only where the kernel has
    /// what it needs.
    pub const RAW_GUARD: &[&str] = &[RAW_SOCK_CREATE, RAW_EGRESS];
    /// Every program in the object.
    pub const ALL: &[&str] = &[
        IFACE_COUNT_INGRESS,
        IFACE_COUNT_EGRESS,
        POD_INGRESS,
        INBOUND_LOOKUP,
        CONNECT4,
        CONNECT6,
        SENDMSG4,
        SENDMSG6,
        RECVMSG4,
        RECVMSG6,
        GETPEERNAME4,
        GETPEERNAME6,
        GETSOCKOPT,
        SOCK_OPS,
        RAW_SOCK_CREATE,
        RAW_EGRESS,
    ];
}

/// Map names as the kernel knows them; also the file names of their pins.
pub mod maps {
    /// Per-CPU packet and byte counters, keyed by [`crate::IfaceStatsKey`].
    pub const IFACE_STATS: &str = "ambpf_if_stats";
    /// The ring buffer aya-log-ebpf writes log records to (name fixed by aya-log).
    pub const AYA_LOGS: &str = "AYA_LOGS";

    /// Enrolled pods by netns cookie ([`crate::PodConfig`]): what socket
    /// programs consult.
    pub const PODS_BY_NETNS: &str = "ambpf_pods";
    /// Enrolled pods' addresses ([`crate::IpKey`] -> [`crate::PodConfig`]):
    /// what packet programs consult (an skb carries no reliable netns).
    pub const PODS_BY_IP: &str = "ambpf_pod_ips";
    /// This node's own addresses: traffic from them is the host's (kubelet
    /// probes) and reaches apps directly, as Istio's 169.254.7.127 SNAT does.
    pub const HOST_ADDRS: &str = "ambpf_host_ips";
    /// Capacity of [`HOST_ADDRS`]: generous, since a node can hold many
    /// addresses (e.g. kube-proxy's IPVS dummy interface has every service IP).
    pub const HOST_ADDRS_MAX: u32 = 16 * 1024;
    /// Node-wide settings, one [`crate::NodeConfig`] at index 0.
    pub const NODE_CONFIG: &str = "ambpf_node_cfg";
    /// Original destinations by the redirected socket's cookie (LRU).
    pub const ORIG_BY_COOKIE: &str = "ambpf_orig_ck";
    /// Original destinations by the tuple ztunnel's accepted socket sees (LRU).
    pub const ORIG_BY_TUPLE: &str = "ambpf_orig_tpl";
    /// Per-CPU event counters, indexed by [`crate::Counter`].
    pub const COUNTERS: &str = "ambpf_counters";
    /// Per-CPU counters of each enrolled pod, by netns cookie
    /// ([`crate::PodCounters`]); the agent adds the entry at enrolment and
    /// deletes it with the pod.
    pub const POD_COUNTERS: &str = "ambpf_pod_cnt";
    /// Per-CPU counts of each enrolled pod's refused inbound connections, by
    /// netns cookie ([`crate::PodDrops`]), kept as [`POD_COUNTERS`] is. A map
    /// of its own, so that the pinned [`POD_COUNTERS`] keeps its layout and
    /// an agent upgraded over it adopts it.
    pub const POD_DROPS: &str = "ambpf_pod_drops";
    /// Trace records ([`crate::TraceRecord`]), a ring buffer read by
    /// `ambpf trace`.
    pub const TRACE_RING: &str = "ambpf_trace";
    /// One [`crate::TraceGate`]: records are written only while a reader
    /// holds its lease.
    pub const TRACE_GATE: &str = "ambpf_trace_on";
    /// Per-CPU count of trace records the ring buffer had no room for.
    pub const TRACE_LOST: &str = "ambpf_trc_lost";
    /// Per-CPU counts of original-destination records found missing,
    /// indexed by [`crate::Miss`]: what a full (LRU) map cost.
    pub const MISSES: &str = "ambpf_misses";
    /// Slots of [`MISSES`]: room for reasons to come without changing the
    /// pinned map's shape.
    pub const MISS_SLOTS: u32 = 8;

    /// Default capacity of [`PODS_BY_NETNS`] and [`POD_COUNTERS`] (pods one
    /// node can run, with headroom); [`PODS_BY_IP`] holds twice as many (a
    /// pod has at most one address of each family).
    pub const DEFAULT_MAX_PODS: u32 = 4096;
    /// Default capacity of [`ORIG_BY_COOKIE`] and [`ORIG_BY_TUPLE`]:
    /// redirected connections remembered at once (LRU).
    pub const DEFAULT_MAX_REDIRECTED: u32 = 65536;

    /// Socket-local storage on the raw sockets opened in enrolled pods: the
    /// pod's netns cookie. Pinned so that a restarted agent's guard still
    /// knows the sockets tagged before.
    pub const RAW_SOCKS: &str = "ambpf_raw_socks";

    /// ztunnel's inbound listeners: its 15006 listener in each pod's
    /// namespace (a SOCKHASH keyed by netns cookie), filed by `sock_ops`
    /// when ztunnel calls `listen()`; the socket leaves the map when it
    /// closes.
    pub const INBOUND_LISTENERS: &str = "ambpf_in_lsn";
    /// The sk_lookup path's steered SYNs: [`crate::SteeredSynKey`] -> the
    /// pod's netns cookie, the key of its listener in [`INBOUND_LISTENERS`]
    /// (LRU). Only earlier agents' tc filters write it.
    pub const INBOUND_SYNS: &str = "ambpf_in_syns";
    /// Capacity of [`INBOUND_SYNS`]: SYNs between the steering program and
    /// the socket lookup, a moment each.
    pub const INBOUND_SYNS_MAX: u32 = 16 * 1024;

    /// Connections opened on this node rather than from outside it
    /// ([`crate::LocalConnKey`] -> [`crate::LocalConn`], LRU), filed by
    /// `sock_ops` at `connect()`: by the node's own namespace (kubelet's
    /// probes) and inside an enrolled pod to its own addresses (ztunnel's
    /// connections to the app, the app's calls to itself). They are the only
    /// connections a pod's inbound capture lets reach its apps directly, as
    /// Istio's rules exempt only the host's own sockets (`--socket-exists`)
    /// and never see what a pod sends itself.
    pub const LOCAL_CONNS: &str = "ambpf_own_conns";
    /// Capacity of [`LOCAL_CONNS`]: a record is needed until the listener
    /// lookup of its SYN, a moment after `connect()`; a wide margin.
    pub const LOCAL_CONNS_MAX: u32 = 16 * 1024;
    /// The node's network namespace: its cookie at index 0 (0: not set, and
    /// no connection is filed as the node's).
    pub const NODE_NETNS: &str = "ambpf_node_ns";
    /// Per-CPU counts of inbound connections refused, indexed by
    /// [`crate::InboundRefusal`].
    pub const INBOUND_REFUSED: &str = "ambpf_refusals";
    /// Slots of [`INBOUND_REFUSED`], with room for reasons to come.
    pub const INBOUND_REFUSED_SLOTS: u32 = 8;

    /// ztunnel's processes: thread-group id (in the host's PID namespace)
    /// -> its start time (clock ticks after boot, `/proc/<pid>/stat`), for
    /// the agent to tell a live ztunnel from a reused PID. Taken from the
    /// ZDS peer's credentials. Only a socket of one of these processes that
    /// carries ztunnel's mark is exempt from capture, never the mark alone,
    /// which CAP_NET_RAW may set on Linux 5.17 and later.
    pub const ZTUNNEL_PROCS: &str = "ambpf_zt_procs";
    /// Capacity of [`ZTUNNEL_PROCS`]: ztunnel and its replacement during an
    /// update, and their children (ztunnel has none; a process that hands
    /// its proxies to children may have many), with room.
    pub const ZTUNNEL_PROCS_MAX: u32 = 1024;

    /// Maps the agent pins under `<pin root>/maps/`. `AYA_LOGS` is not pinned: it
    /// belongs to the agent process that drains it.
    pub const PINNED: &[&str] = &[
        IFACE_STATS,
        PODS_BY_NETNS,
        PODS_BY_IP,
        HOST_ADDRS,
        NODE_CONFIG,
        ORIG_BY_COOKIE,
        ORIG_BY_TUPLE,
        COUNTERS,
        POD_COUNTERS,
        POD_DROPS,
        TRACE_RING,
        TRACE_GATE,
        TRACE_LOST,
        MISSES,
        RAW_SOCKS,
        INBOUND_LISTENERS,
        INBOUND_SYNS,
        LOCAL_CONNS,
        NODE_NETNS,
        INBOUND_REFUSED,
        ZTUNNEL_PROCS,
    ];
}

/// What ztunnel expects (see ztunnel's in-pod mode).
pub mod ztunnel {
    /// SO_MARK on every socket ztunnel opens in a pod: never redirected.
    pub const MARK: u32 = 0x539;
    /// Mark of connections ztunnel made to a local app, whose replies must be
    /// routed back to ztunnel (Istio's connmark 0x111, same mask).
    pub const REPLY_MARK: u32 = 0x111;
    pub const MARK_MASK: u32 = 0xfff;
    /// Policy routing table holding `local default dev lo`.
    pub const REPLY_ROUTE_TABLE: u32 = 100;
    pub const OUTBOUND_PORT: u16 = 15001;
    pub const INBOUND_PORT: u16 = 15006;
    pub const HBONE_PORT: u16 = 15008;
    pub const DNS_PORT: u16 = 15053;
}

/// An address of either family, IPv4 as `::ffff:a.b.c.d` (network order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IpKey {
    pub addr: [u8; 16],
}

impl IpKey {
    pub const fn v4(octets: [u8; 4]) -> Self {
        let [a, b, c, d] = octets;
        Self {
            addr: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d],
        }
    }

    pub const fn v6(octets: [u8; 16]) -> Self {
        Self { addr: octets }
    }

    pub const fn is_v4(&self) -> bool {
        let a = &self.addr;
        a[0] == 0
            && a[1] == 0
            && a[2] == 0
            && a[3] == 0
            && a[4] == 0
            && a[5] == 0
            && a[6] == 0
            && a[7] == 0
            && a[8] == 0
            && a[9] == 0
            && a[10] == 0xff
            && a[11] == 0xff
    }
}

/// Per-pod settings, written by the agent at enrolment.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodConfig {
    /// The pod's netns cookie (`SO_NETNS_COOKIE`).
    pub netns_cookie: u64,
    /// The netns inode, to find the pod again when its namespace is gone.
    pub netns_inode: u64,
    /// [`pod_flags`] bits.
    pub flags: u32,
    pub _pad: u32,
    /// The pod's addresses; unused slots are all-zero.
    pub ips: [IpKey; 2],
}

pub mod pod_flags {
    /// Redirect the pod's DNS (port 53) to ztunnel's DNS proxy.
    pub const DNS_CAPTURE: u32 = 1 << 0;
    /// An earlier agent created the `clsact` qdisc its steering filter sat
    /// on (removed with the filter when nothing else uses it).
    pub const STEERING_QDISC_CREATED: u32 = 1 << 1;
    /// Enrolled with its sk_lookup link and no tc steering: an entry without
    /// it is an earlier agent's, whose filters go when the pod is enrolled
    /// again.
    pub const INBOUND_LINK: u32 = 1 << 2;
    /// Outbound connections go to ztunnel's listener on the pod's own
    /// address rather than on loopback: the pod was captured by Istio's
    /// REDIRECT rules before (another mode, or Istio's node agent), whose
    /// conntrack entries hold `127.0.0.1:15001 -> podIP:port` as reply
    /// tuples for a while after their connections close; while the rules'
    /// nat hooks stay (for the connections they still translate), a new
    /// connection of the same tuple would have its source port changed by
    /// NAT, and ztunnel would find no original destination for it.
    pub const OUTBOUND_VIA_POD_ADDRESS: u32 = 1 << 3;
}

/// Node-wide settings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// DNS capture for the whole node; a pod's flag can only narrow it.
    pub dns_capture: u32,
    pub _pad: u32,
}

/// A socket address as the programs store it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockAddr {
    pub ip: IpKey,
    /// Network byte order, as in `sockaddr_in`.
    pub port_be: u16,
    pub _pad: [u8; 6],
}

/// The connection as ztunnel's accepted socket sees it: key of
/// [`maps::ORIG_BY_TUPLE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TupleKey {
    pub netns_cookie: u64,
    /// The accepted socket's local address (ztunnel's listener).
    pub local: SockAddr,
    /// Its peer (the app's socket).
    pub peer: SockAddr,
}

/// A SYN an earlier agent's tc filter steered to the pod's sk_lookup
/// program: key of [`maps::INBOUND_SYNS`]. Its layout is [`TupleKey`]'s, so
/// that the pinned map keeps its shape across upgrades.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SteeredSynKey {
    /// Always 0 (where [`TupleKey`] has the netns cookie).
    pub _zero: u64,
    /// The SYN's destination: the original destination.
    pub dst: SockAddr,
    /// Its source: the client.
    pub src: SockAddr,
}

/// A connection opened on this node: key of [`maps::LOCAL_CONNS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LocalConnKey {
    /// The address and port connected to (the pod's side).
    pub dst: SockAddr,
    /// The connecting socket's own address and port.
    pub src: SockAddr,
}

/// Who opened a connection of [`maps::LOCAL_CONNS`].
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalConn {
    /// The node's own namespace (kubelet's probes).
    Node = 1,
    /// The pod itself, to one of its own addresses.
    SamePod = 2,
}

/// Why an inbound connection to an enrolled pod was refused: indexes of
/// [`maps::INBOUND_REFUSED`]. (No ztunnel listener is counted in
/// [`Counter::InboundNoListener`].)
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboundRefusal {
    /// To a local address that none of the enrolled pods was enrolled with.
    UnknownAddress = 0,
}

impl InboundRefusal {
    pub const ALL: [InboundRefusal; 1] = [InboundRefusal::UnknownAddress];

    pub const fn name(self) -> &'static str {
        match self {
            InboundRefusal::UnknownAddress => "unknown_address",
        }
    }
}

/// Indexes of [`maps::COUNTERS`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    OutboundRedirected = 0,
    InboundRedirected = 1,
    DnsRedirected = 2,
    ProbeBypassed = 3,
    OriginalDstAnswered = 4,
    ReplyMarked = 5,
    /// SYNs to an enrolled pod with no ztunnel listener to take them (also
    /// counted for the pod, [`PodDrops::inbound_no_listener`]).
    InboundNoListener = 6,
    /// TCP segments from raw sockets in enrolled pods, dropped: Istio's nat
    /// rules would have sent them to ztunnel, the socket hooks never see them.
    RawTcpDropped = 7,
}

impl Counter {
    pub const COUNT: u32 = 8;
    pub const ALL: [Counter; 8] = [
        Counter::OutboundRedirected,
        Counter::InboundRedirected,
        Counter::DnsRedirected,
        Counter::ProbeBypassed,
        Counter::OriginalDstAnswered,
        Counter::ReplyMarked,
        Counter::InboundNoListener,
        Counter::RawTcpDropped,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Counter::OutboundRedirected => "outbound_redirected",
            Counter::InboundRedirected => "inbound_redirected",
            Counter::DnsRedirected => "dns_redirected",
            Counter::ProbeBypassed => "probe_bypassed",
            Counter::OriginalDstAnswered => "original_dst_answered",
            Counter::ReplyMarked => "reply_marked",
            Counter::InboundNoListener => "inbound_no_listener",
            Counter::RawTcpDropped => "raw_tcp_dropped",
        }
    }
}

/// Indexes of [`maps::MISSES`]: a redirected connection whose original
/// destination was not there when asked for (its record evicted from the
/// full LRU map, or never stored).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Miss {
    /// ztunnel asked `SO_ORIGINAL_DST` (IPv4 first, as ztunnel does) on its
    /// outbound listener in an enrolled pod and no record answered: ztunnel
    /// refuses the connection (its local address is its own listener).
    OrigDst = 0,
    /// The record could not be stored at `connect()`: the connect is
    /// refused (EPERM) rather than sent to ztunnel without it.
    NotStored = 1,
    /// An app's `getpeername()` on a redirected socket found no record: it
    /// sees ztunnel's listener as its peer.
    PeerName = 2,
}

impl Miss {
    pub const ALL: [Miss; 3] = [Miss::OrigDst, Miss::NotStored, Miss::PeerName];

    pub const fn name(self) -> &'static str {
        match self {
            Miss::OrigDst => "so_original_dst",
            Miss::NotStored => "not_stored",
            Miss::PeerName => "getpeername",
        }
    }
}

/// Value of [`maps::POD_COUNTERS`], one per CPU: what the programs did for
/// one pod.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCounters {
    /// Outbound TCP connections sent to ztunnel's 15001.
    pub outbound_redirected: u64,
    /// Inbound connections (SYNs) handed to ztunnel's 15006.
    pub inbound_redirected: u64,
    /// DNS sent to ztunnel's DNS proxy: unconnected UDP queries, and
    /// connections (TCP, connected UDP).
    pub dns_redirected: u64,
    /// Inbound connections from the node's own addresses let through.
    pub probes_bypassed: u64,
}

impl PodCounters {
    /// Adds another CPU's share.
    pub fn accumulate(&mut self, other: &PodCounters) {
        self.outbound_redirected = self
            .outbound_redirected
            .wrapping_add(other.outbound_redirected);
        self.inbound_redirected = self
            .inbound_redirected
            .wrapping_add(other.inbound_redirected);
        self.dns_redirected = self.dns_redirected.wrapping_add(other.dns_redirected);
        self.probes_bypassed = self.probes_bypassed.wrapping_add(other.probes_bypassed);
    }
}

/// Value of [`maps::POD_DROPS`], one per CPU: the inbound connections the
/// pod's sk_lookup program refused. A refusal for a local address no pod was
/// enrolled with names no pod (the lookup carries no namespace) and is
/// counted node-wide only ([`InboundRefusal::UnknownAddress`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodDrops {
    /// Refused for want of ztunnel's 15006 listener in the pod.
    pub inbound_no_listener: u64,
    /// Room for reasons to come without a new layout.
    pub _spare: [u64; 3],
}

impl PodDrops {
    /// Adds another CPU's share.
    pub fn accumulate(&mut self, other: &PodDrops) {
        self.inbound_no_listener = self
            .inbound_no_listener
            .wrapping_add(other.inbound_no_listener);
    }
}

/// Kernel object names are at most `BPF_OBJ_NAME_LEN - 1` bytes.
pub const BPF_OBJ_NAME_MAX: usize = 15;

/// Which way a packet crossed an interface, as seen by the TC hook.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    Ingress = 0,
    Egress = 1,
}

impl Direction {
    pub const fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// Key of [`maps::IFACE_STATS`]: one interface and direction.
///
/// The ifindex is only unique within a network namespace. A TC program cannot
/// learn the namespace of the device it runs on (`bpf_get_netns_cookie` on an
/// skb reports the *socket's* namespace, or the initial one when there is no
/// socket, as on ingress), so counters of same-numbered devices in different
/// namespaces add up; attach them to devices with distinct ifindexes (host-side
/// veths) when that matters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IfaceStatsKey {
    pub ifindex: u32,
    /// A [`Direction`] as u32 (an enum is not a valid `Pod`).
    pub direction: u32,
}

/// Value of [`maps::IFACE_STATS`], one per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfaceStats {
    pub packets: u64,
    pub bytes: u64,
}

impl IfaceStats {
    /// Adds another CPU's share.
    pub fn accumulate(&mut self, other: &IfaceStats) {
        self.packets = self.packets.wrapping_add(other.packets);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }
}

#[cfg(feature = "user")]
mod user {
    /// `aya::Pod` for map keys and values, which aya copies to and from the
    /// kernel as bytes.
    macro_rules! pod {
        ($($t:ident),* $(,)?) => {$(
            // SAFETY: every type named here is a #[repr(C)] struct of integers
            // (and arrays of them) with its padding spelt out as fields, so any
            // byte pattern is a valid value and no byte is uninitialised;
            // `layouts_have_no_implicit_padding` checks the sizes.
            unsafe impl aya::Pod for super::$t {}
        )*};
    }
    pod!(
        IfaceStatsKey,
        IfaceStats,
        IpKey,
        PodConfig,
        NodeConfig,
        SockAddr,
        TupleKey,
        SteeredSynKey,
        LocalConnKey,
        PodCounters,
        PodDrops,
        TraceRecord,
        TraceGate,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn names_fit_the_kernel_limit() {
        for name in programs::ALL.iter().chain(maps::PINNED) {
            assert!(
                name.len() <= BPF_OBJ_NAME_MAX,
                "{name} would be truncated by the kernel"
            );
        }
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<IfaceStatsKey>(), 8);
        assert_eq!(size_of::<IfaceStats>(), 16);
        assert_eq!(size_of::<IpKey>(), 16);
        assert_eq!(size_of::<PodConfig>(), 24 + 32);
        assert_eq!(size_of::<SockAddr>(), 24);
        assert_eq!(size_of::<TupleKey>(), 8 + 48);
        assert_eq!(size_of::<SteeredSynKey>(), size_of::<TupleKey>());
        assert_eq!(size_of::<PodDrops>(), 32);
        assert_eq!(size_of::<LocalConnKey>(), 48);
        assert_eq!(size_of::<PodCounters>(), 32);
    }

    #[test]
    fn ipv4_keys_are_v4_mapped() {
        let key = IpKey::v4([10, 0, 0, 1]);
        assert!(key.is_v4());
        assert_eq!(&key.addr[10..], &[0xff, 0xff, 10, 0, 0, 1]);
        assert!(!IpKey::v6([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]).is_v4());
    }

    #[test]
    fn counters_are_indexed_in_order() {
        for (i, counter) in Counter::ALL.iter().enumerate() {
            assert_eq!(*counter as u32, i as u32);
        }
        assert_eq!(Counter::ALL.len() as u32, Counter::COUNT);
    }

    #[test]
    fn misses_fit_their_map() {
        for (i, miss) in Miss::ALL.iter().enumerate() {
            assert_eq!(*miss as u32, i as u32);
        }
        assert!(Miss::ALL.len() as u32 <= maps::MISS_SLOTS);
    }

    #[test]
    fn stats_accumulate_across_cpus() {
        let mut total = IfaceStats::default();
        total.accumulate(&IfaceStats {
            packets: 2,
            bytes: 100,
        });
        total.accumulate(&IfaceStats {
            packets: 3,
            bytes: 60,
        });
        assert_eq!(
            total,
            IfaceStats {
                packets: 5,
                bytes: 160
            }
        );
    }
}
