//! Whether `bpf_sk_assign` from TC accepts an SO_REUSEPORT listener.
//!
//! ztunnel opens its in-pod listeners with SO_REUSEPORT (so that a new
//! ztunnel can take over), and before Linux 6.5 (commit 9c02bec95954, "bpf,
//! net: Support SO_REUSEPORT sockets with bpf_sk_assign") the helper refuses
//! such sockets with `ESOCKTNOSUPPORT`: every inbound SYN the steering
//! program hands to ztunnel is then dropped. The helper exists on those
//! kernels, so only trying it tells: in a private network namespace on a
//! thread of its own, a small classifier on the loopback's ingress assigns
//! SYNs to port `PORT` to the reuseport listener on that port, and passes
//! them only if the kernel took the assignment. Where it does not, inbound
//! capture takes the sk_lookup path ([`super::inbound`]).

use std::{
    io::{self, Read as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::fd::{AsFd as _, AsRawFd as _},
    time::Duration,
};

use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkFlags, LinkMessage},
};

use super::sys;
use crate::redirect::{rtnl::Rtnl, steering};

const PORT: u16 = 15006;
const LOOPBACK_IFINDEX: u32 = 1;
/// A SYN on the loopback is answered at once; on a kernel that refuses the
/// assignment it is dropped and the connect waits for its retry.
const ANSWERED_WITHIN: Duration = Duration::from_millis(1500);

/// `Ok(true)` when the kernel assigns SO_REUSEPORT listeners from TC. Asked
/// once per process: the kernel's answer does not change, and a kernel that
/// refuses costs the probe its timeout.
pub fn probe() -> Result<bool, String> {
    static ANSWER: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    ANSWER.get_or_init(ask).clone()
}

fn ask() -> Result<bool, String> {
    std::thread::spawn(|| -> Result<bool, String> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("a private network namespace: {e}"))?;
        in_private_netns().map_err(|e| e.to_string())
    })
    .join()
    .map_err(|_| "the probe's thread panicked".to_owned())?
}

fn in_private_netns() -> io::Result<bool> {
    let mut rtnl = Rtnl::open().map_err(io::Error::other)?;
    let mut lo = LinkMessage::default();
    lo.header.index = LOOPBACK_IFINDEX;
    lo.header.flags = LinkFlags::Up;
    lo.header.change_mask = LinkFlags::Up;
    rtnl.execute(RouteNetlinkMessage::SetLink(lo), 0)
        .map_err(io::Error::other)?;
    use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, SockaddrIn};
    let listener = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::setsockopt(&listener, socket::sockopt::ReusePort, &true)?;
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, PORT));
    let SocketAddr::V4(v4) = address else {
        unreachable!("an IPv4 address")
    };
    socket::bind(listener.as_raw_fd(), &SockaddrIn::from(v4))?;
    socket::listen(&listener, Backlog::new(8)?)?;
    let program = sys::load_program(sys::PROG_TYPE_SCHED_CLS, &program())?;
    steering::attach(&mut rtnl, LOOPBACK_IFINDEX, program.as_fd(), "ambpf_probe")
        .map_err(io::Error::other)?;
    match TcpStream::connect_timeout(&address, ANSWERED_WITHIN) {
        Ok(mut stream) => {
            // Connected: the SYN was assigned and passed.
            let _ = stream.set_nonblocking(true);
            let _ = stream.read(&mut [0; 1]);
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(false),
        Err(e) => Err(e),
    }
}

/// The classifier, as `struct bpf_insn`s:
///
/// ```text
///     r6 = skb                              ; LD_ABS reads through r6
///     r0 = be16 at 36; if r0 != PORT goto pass   ; Ethernet + IPv4 + dport
///     r0 = u8 at 47;   if r0 != SYN goto pass    ; TCP flags
///     tuple on the stack: 127.0.0.1 -> 127.0.0.1:PORT
///     r0 = bpf_sk_lookup_tcp(skb, tuple, 12, BPF_F_CURRENT_NETNS, 0)
///     if r0 == 0 goto pass
///     r8 = bpf_sk_assign(skb, r0, 0); bpf_sk_release(r0)
///     if r8 != 0: return TC_ACT_SHOT
/// pass:
///     return TC_ACT_OK
/// ```
fn program() -> Vec<[u8; 8]> {
    const LOOPBACK_BE: i32 = i32::from_ne_bytes([127, 0, 0, 1]);
    const SK_LOOKUP_TCP: i32 = 84;
    const SK_RELEASE: i32 = 86;
    const SK_ASSIGN: i32 = 124;
    const TC_ACT_SHOT: i32 = 2;
    // Source port 0, then the destination port in network order.
    let ports = i32::from_ne_bytes([0, 0, (PORT >> 8) as u8, PORT as u8]);
    let i = |code: u8, dst: u8, src: u8, off: i16, imm: i32| {
        let mut raw = [0u8; 8];
        raw[0] = code;
        raw[1] = dst | (src << 4);
        raw[2..4].copy_from_slice(&off.to_ne_bytes());
        raw[4..].copy_from_slice(&imm.to_ne_bytes());
        raw
    };
    const MOV_REG: u8 = 0xbf;
    const MOV_IMM: u8 = 0xb7;
    const ADD_IMM: u8 = 0x07;
    const LD_ABS_H: u8 = 0x28;
    const LD_ABS_B: u8 = 0x30;
    const ST_W: u8 = 0x62;
    const JNE_IMM: u8 = 0x55;
    const JEQ_IMM: u8 = 0x15;
    const CALL: u8 = 0x85;
    const EXIT: u8 = 0x95;
    vec![
        i(MOV_REG, 6, 1, 0, 0),                // 0
        i(LD_ABS_H, 0, 0, 0, 36),              // 1
        i(JNE_IMM, 0, 0, 22, i32::from(PORT)), // 2 -> 25
        i(LD_ABS_B, 0, 0, 0, 47),              // 3
        i(JNE_IMM, 0, 0, 20, 0x02),            // 4 -> 25
        i(ST_W, 10, 0, -16, LOOPBACK_BE),      // 5
        i(ST_W, 10, 0, -12, LOOPBACK_BE),      // 6
        i(ST_W, 10, 0, -8, ports),             // 7
        i(MOV_REG, 1, 6, 0, 0),                // 8
        i(MOV_REG, 2, 10, 0, 0),               // 9
        i(ADD_IMM, 2, 0, 0, -16),              // 10
        i(MOV_IMM, 3, 0, 0, 12),               // 11
        i(MOV_IMM, 4, 0, 0, -1),               // 12: BPF_F_CURRENT_NETNS
        i(MOV_IMM, 5, 0, 0, 0),                // 13
        i(CALL, 0, 0, 0, SK_LOOKUP_TCP),       // 14
        i(JEQ_IMM, 0, 0, 9, 0),                // 15 -> 25
        i(MOV_REG, 7, 0, 0, 0),                // 16
        i(MOV_REG, 1, 6, 0, 0),                // 17
        i(MOV_REG, 2, 7, 0, 0),                // 18
        i(MOV_IMM, 3, 0, 0, 0),                // 19
        i(CALL, 0, 0, 0, SK_ASSIGN),           // 20
        i(MOV_REG, 8, 0, 0, 0),                // 21
        i(MOV_REG, 1, 7, 0, 0),                // 22
        i(CALL, 0, 0, 0, SK_RELEASE),          // 23
        i(JNE_IMM, 8, 0, 2, 0),                // 24 -> 27
        i(MOV_IMM, 0, 0, 0, 0),                // 25: pass
        i(EXIT, 0, 0, 0, 0),                   // 26
        i(MOV_IMM, 0, 0, 0, TC_ACT_SHOT),      // 27
        i(EXIT, 0, 0, 0, 0),                   // 28
    ]
}
