//! Trace records: one per redirect decision, written by the kernel programs
//! into [`crate::maps::TRACE_RING`] while a reader holds the
//! [`crate::maps::TRACE_GATE`] lease, and read by `ambpf trace`.

/// One redirect decision.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceRecord {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) at the decision.
    pub timestamp_ns: u64,
    /// The pod's netns cookie.
    pub netns_cookie: u64,
    /// The connection's source. Outbound at `connect()` its port is often
    /// not chosen yet (0).
    pub src: crate::IpKey,
    /// Where the connection goes after the decision (ztunnel's listener
    /// when captured; the original destination when not).
    pub dst: crate::IpKey,
    /// The destination the app or the peer asked for.
    pub orig_dst: crate::IpKey,
    /// Ports in network order, as in `sockaddr_in`.
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub orig_port_be: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub protocol: u8,
    /// A [`TraceDirection`].
    pub direction: u8,
    /// A [`Verdict`].
    pub verdict: u32,
    pub _pad: u32,
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Which way the decided connection goes, seen from the pod.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceDirection {
    Outbound = 0,
    Inbound = 1,
}

impl TraceDirection {
    pub const ALL: [TraceDirection; 2] = [TraceDirection::Outbound, TraceDirection::Inbound];

    pub const fn as_str(self) -> &'static str {
        match self {
            TraceDirection::Outbound => "outbound",
            TraceDirection::Inbound => "inbound",
        }
    }

    pub fn from_raw(raw: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|d| *d as u8 == raw)
    }
}

/// What a program decided, and why.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Outbound TCP sent to ztunnel's 15001.
    Captured = 0,
    /// DNS (port 53) sent to ztunnel's DNS proxy on 15053.
    DnsCaptured = 1,
    /// Not captured: the destination is loopback.
    ExemptLoopback = 2,
    /// Not captured: the destination is one of the pod's own addresses.
    ExemptOwnAddress = 3,
    /// Not captured: the socket is ztunnel's (SO_MARK 0x539).
    ExemptZtunnel = 4,
    /// Not captured: connected UDP to a port other than DNS.
    ExemptNotTcp = 5,
    /// Not captured: DNS with DNS capture off (node or pod).
    ExemptDnsOff = 6,
    /// Inbound SYN handed to ztunnel's 15006 listener.
    InboundSteered = 7,
    /// Inbound SYN from the node's own addresses (kubelet probes): to the app.
    ProbeBypassed = 8,
    /// Inbound SYN to 15008 (HBONE): straight to ztunnel's listener.
    Hbone = 9,
    /// Inbound SYN dropped: no ztunnel listener on 15006 (the client retries).
    NoListener = 10,
    /// ztunnel asked SO_ORIGINAL_DST for a connection ambpf has no record of.
    OrigDstMissing = 11,
    /// Outbound TCP from a raw socket in the pod, dropped.
    RawTcpDropped = 12,
    /// Inbound TCP to a local address of an enrolled pod that is none of
    /// the addresses it was enrolled with (a link-local or added address):
    /// refused, since no record tells which pod's ztunnel should take it.
    UnknownAddress = 13,
}

impl Verdict {
    pub const ALL: [Verdict; 14] = [
        Verdict::Captured,
        Verdict::DnsCaptured,
        Verdict::ExemptLoopback,
        Verdict::ExemptOwnAddress,
        Verdict::ExemptZtunnel,
        Verdict::ExemptNotTcp,
        Verdict::ExemptDnsOff,
        Verdict::InboundSteered,
        Verdict::ProbeBypassed,
        Verdict::Hbone,
        Verdict::NoListener,
        Verdict::OrigDstMissing,
        Verdict::RawTcpDropped,
        Verdict::UnknownAddress,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Captured => "captured",
            Verdict::DnsCaptured => "dns_captured",
            Verdict::ExemptLoopback => "exempt_loopback",
            Verdict::ExemptOwnAddress => "exempt_own_address",
            Verdict::ExemptZtunnel => "exempt_ztunnel",
            Verdict::ExemptNotTcp => "exempt_not_tcp",
            Verdict::ExemptDnsOff => "exempt_dns_off",
            Verdict::InboundSteered => "inbound_steered",
            Verdict::ProbeBypassed => "probe_bypassed",
            Verdict::Hbone => "hbone",
            Verdict::NoListener => "no_listener",
            Verdict::OrigDstMissing => "orig_dst_missing",
            Verdict::RawTcpDropped => "raw_tcp_dropped",
            Verdict::UnknownAddress => "unknown_address",
        }
    }

    pub fn from_raw(raw: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|v| *v as u32 == raw)
    }
}

/// Value of [`crate::maps::TRACE_GATE`] (one entry): the programs write
/// records only while `until_ns` is in the future. A reader renews it every
/// second; one that dies stops emission when its lease runs out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceGate {
    /// CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`) until which records are
    /// written; 0: no reader.
    pub until_ns: u64,
    /// The reader holding the lease (a ring buffer has one consumer).
    pub reader_pid: u32,
    pub _pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_layout_has_no_implicit_padding() {
        assert_eq!(
            core::mem::size_of::<TraceRecord>(),
            8 + 8 + 48 + 6 + 2 + 4 + 4
        );
        assert_eq!(core::mem::size_of::<TraceGate>(), 16);
    }

    #[test]
    fn verdicts_and_directions_round_trip() {
        for (i, verdict) in Verdict::ALL.iter().enumerate() {
            assert_eq!(*verdict as u32, i as u32);
            assert_eq!(Verdict::from_raw(i as u32), Some(*verdict));
        }
        assert_eq!(Verdict::from_raw(Verdict::ALL.len() as u32), None);
        for direction in TraceDirection::ALL {
            assert_eq!(TraceDirection::from_raw(direction as u8), Some(direction));
        }
        assert_eq!(TraceDirection::from_raw(2), None);
    }
}
