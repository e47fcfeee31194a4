//! Other owners' eBPF programs, as another dataplane on the node attaches
//! them beside ambpf's: a socket load balancer in the cgroup hooks
//! (Cilium's `bpf_sock.c` in strict mode, Calico's connect-time load
//! balancing), a host-side tc program that delivers packets straight into a
//! pod with `bpf_redirect_peer` (Cilium's host routing), and tc programs
//! that only pass packets on.
//!
//! The programs are a few instructions each, assembled here and loaded with
//! bpf(2): no compiler, no object file. Each program's instruction list
//! says what it does, line by line.

use std::{
    ffi::CString,
    io,
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

use nix::libc;

// enum bpf_cmd
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_LINK_CREATE: libc::c_long = 28;

// enum bpf_prog_type
const PROG_TYPE_SCHED_CLS: u32 = 3;
const PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;

/// enum bpf_attach_type: BPF_TCX_INGRESS, BPF_TCX_EGRESS.
pub const TCX_INGRESS: u32 = 46;
pub const TCX_EGRESS: u32 = 47;

fn bpf(cmd: libc::c_long, attr: &mut [u32; 32]) -> io::Result<i32> {
    // SAFETY: `attr` is a zero-padded bpf_attr prefix of the size given.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128u32) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as i32)
    }
}

fn set_u64(attr: &mut [u32; 32], word: usize, value: u64) {
    attr[word] = value as u32;
    attr[word + 1] = (value >> 32) as u32;
}

/// One `struct bpf_insn`.
type Insn = [u8; 8];

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    let mut raw = [0u8; 8];
    raw[0] = code;
    raw[1] = dst | (src << 4);
    raw[2..4].copy_from_slice(&off.to_ne_bytes());
    raw[4..].copy_from_slice(&imm.to_ne_bytes());
    raw
}

// The opcodes used below (class | size or op | source).
const LDX_W: u8 = 0x61; // rD = *(u32 *)(rS + off)
const STX_W: u8 = 0x63; // *(u32 *)(rD + off) = rS
const STX_H: u8 = 0x6b; // *(u16 *)(rD + off) = rS
const MOV32_IMM: u8 = 0xb4; // wD = imm
const MOV64_IMM: u8 = 0xb7; // rD = imm (sign-extended)
const MOV64_REG: u8 = 0xbf; // rD = rS
const ADD64_IMM: u8 = 0x07; // rD += imm
const JNE32_IMM: u8 = 0x56; // if wD != imm goto +off
const JA: u8 = 0x05; // goto +off
const CALL: u8 = 0x85; // call helper imm
const EXIT: u8 = 0x95;

/// A u32 the way the kernel stores addresses and ports in a context: the
/// network-order bytes read as a native u32.
fn net_word(bytes: [u8; 4]) -> i32 {
    i32::from_ne_bytes(bytes)
}

fn port_word(port: u16) -> i32 {
    // `user_port` holds the port in network order in its low 16 bits.
    i32::from(port.to_be())
}

/// Loads `insns` as a GPL program of `prog_type`, named `name`.
fn load(prog_type: u32, attach_type: u32, name: &str, insns: &[Insn]) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut log = vec![0u8; 64 * 1024];
    let mut attr = [0u32; 32];
    attr[0] = prog_type;
    attr[1] = insns.len() as u32;
    set_u64(&mut attr, 2, insns.as_ptr() as u64);
    set_u64(&mut attr, 4, license.as_ptr() as u64);
    attr[6] = 1; // log_level
    attr[7] = log.len() as u32; // log_size
    set_u64(&mut attr, 8, log.as_mut_ptr() as u64); // log_buf
    // kern_version, prog_flags, then prog_name[16] at word 12.
    let mut prog_name = [0u8; 16];
    let len = name.len().min(15);
    prog_name[..len].copy_from_slice(&name.as_bytes()[..len]);
    for (i, chunk) in prog_name.chunks(4).enumerate() {
        attr[12 + i] = u32::from_ne_bytes(chunk.try_into().expect("4 bytes"));
    }
    attr[17] = attach_type; // expected_attach_type, after prog_ifindex
    match bpf(BPF_PROG_LOAD, &mut attr) {
        // SAFETY: the kernel returned a new program fd that nothing else owns.
        Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        Err(e) => {
            let end = log.iter().position(|b| *b == 0).unwrap_or(0);
            Err(io::Error::new(
                e.kind(),
                format!(
                    "loading {name}: {e}: {}",
                    String::from_utf8_lossy(&log[..end])
                ),
            ))
        }
    }
}

/// BPF_LINK_CREATE of `program` on `target` (a cgroup fd, or an ifindex in
/// the calling thread's namespace) with `attach_type`, appended after the
/// programs already there, as a dataplane that does not order its
/// programs attaches.
pub fn link_create(program: BorrowedFd<'_>, target: u32, attach_type: u32) -> io::Result<OwnedFd> {
    let mut attr = [0u32; 32];
    attr[0] = program.as_raw_fd() as u32;
    attr[1] = target;
    attr[2] = attach_type;
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new link fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether this kernel has TCX links (Linux 6.6 on), tried with a pass-on
/// program on interface `iface` of `ns` and detached at once: an older
/// kernel answers EINVAL for the attach type.
pub fn tcx_supported(ns: &crate::NetnsGuard, iface: &str) -> io::Result<bool> {
    let program = pass_on_program("tcx_probe")?;
    let ifindex = ns.ifindex(iface)?;
    match ns.run(|| link_create(program.as_fd(), ifindex, TCX_INGRESS))? {
        Ok(_link) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether this kernel orders cgroup programs (BPF_F_BEFORE on a cgroup
/// link, Linux 6.17 on), tried with a pass-on connect4 program on
/// `cgroup` and detached at once.
pub fn cgroup_ordering_supported(cgroup: &Path) -> io::Result<bool> {
    const CONNECT4: u32 = 10;
    const F_BEFORE: u32 = 1 << 3;
    let program = load(
        PROG_TYPE_CGROUP_SOCK_ADDR,
        CONNECT4,
        "order_probe",
        &[insn(MOV64_IMM, 0, 0, 0, 1), insn(EXIT, 0, 0, 0, 0)],
    )?;
    let dir = std::fs::File::open(cgroup)?;
    let mut attr = [0u32; 32];
    attr[0] = program.as_raw_fd() as u32;
    attr[1] = dir.as_raw_fd() as u32;
    attr[2] = CONNECT4;
    attr[3] = F_BEFORE;
    match bpf(BPF_LINK_CREATE, &mut attr) {
        Ok(fd) => {
            // SAFETY: the kernel returned a new link fd; closing it detaches.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            Ok(true)
        }
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Pins `fd` at `path` on a bpffs (for `tc ... bpf object-pinned`).
pub fn pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut attr = [0u32; 32];
    set_u64(&mut attr, 0, c_path.as_ptr() as u64);
    attr[2] = fd.as_raw_fd() as u32;
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// The id the kernel gave the program `program`.
pub fn prog_id(program: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = [0u32; 2];
    let mut attr = [0u32; 32];
    attr[0] = program.as_raw_fd() as u32;
    attr[1] = 8;
    set_u64(&mut attr, 2, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info[1])
}

/// The ids of the programs attached to `attach_type` of `target` (a
/// cgroup fd, or an ifindex in the calling thread's namespace for TCX), in
/// the order they run (BPF_PROG_QUERY, at most 64).
pub fn attached_programs(target: u32, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut attr = [0u32; 32];
    attr[0] = target;
    attr[1] = attach_type;
    set_u64(&mut attr, 4, ids.as_mut_ptr() as u64); // prog_ids
    attr[6] = ids.len() as u32; // prog_cnt
    bpf(BPF_PROG_QUERY, &mut attr)?;
    Ok(ids[..attr[6] as usize].to_vec())
}

/// `struct bpf_sock_addr` offsets: `user_ip4`, `user_ip6[4]`, `user_port`.
const USER_IP4: i16 = 4;
const USER_IP6: i16 = 8;
const USER_PORT: i16 = 24;

/// A sock_addr program that rewrites each `(from, to)` of `pairs` (one
/// family): the context's address `from` becomes `to`, every other
/// address is left alone. The connect and sendmsg hooks turn a service
/// address into its backend, the recvmsg and getpeername hooks turn the
/// backend back into the service address.
///
/// ```text
/// for each pair:
///   w2 = ctx->user_ip4 (or each word of user_ip6)
///   if w2 != from.ip goto next pair
///   w2 = ctx->user_port
///   if w2 != from.port goto next pair
///   ctx->user_ip4 (or each word) = to.ip
///   ctx->user_port = to.port
///   goto out
/// out:
///   r0 = 1   (allow)
///   exit
/// ```
fn translate(pairs: &[(SocketAddr, SocketAddr)]) -> Vec<Insn> {
    let words = |addr: SocketAddr| -> Vec<i32> {
        match addr {
            SocketAddr::V4(a) => vec![net_word(a.ip().octets())],
            SocketAddr::V6(a) => a
                .ip()
                .octets()
                .chunks(4)
                .map(|c| net_word(c.try_into().expect("4 bytes")))
                .collect(),
        }
    };
    let fields = |addr: SocketAddr| -> Vec<(i16, i32)> {
        let ip_offset = if addr.is_ipv4() { USER_IP4 } else { USER_IP6 };
        words(addr)
            .into_iter()
            .enumerate()
            .map(|(i, w)| (ip_offset + 4 * i as i16, w))
            .chain([(USER_PORT, port_word(addr.port()))])
            .collect()
    };
    let jump_to = |insns: &mut Vec<Insn>, at: usize, target: usize| {
        insns[at][2..4].copy_from_slice(&((target - at - 1) as i16).to_ne_bytes());
    };
    let mut insns = Vec::new();
    // Indices of the jumps to `out`, patched once its place is known.
    let mut to_out = Vec::new();
    for &(from, to) in pairs {
        let mut to_next = Vec::new();
        for (offset, expected) in fields(from) {
            insns.push(insn(LDX_W, 2, 1, offset, 0));
            to_next.push(insns.len());
            insns.push(insn(JNE32_IMM, 2, 0, 0, expected));
        }
        for (offset, value) in fields(to) {
            // The verifier takes no immediate stores into the context.
            insns.push(insn(MOV32_IMM, 2, 0, 0, value));
            insns.push(insn(STX_W, 1, 2, offset, 0));
        }
        to_out.push(insns.len());
        insns.push(insn(JA, 0, 0, 0, 0));
        let next = insns.len();
        for at in to_next {
            jump_to(&mut insns, at, next);
        }
    }
    let out = insns.len();
    insns.push(insn(MOV64_IMM, 0, 0, 0, 1));
    insns.push(insn(EXIT, 0, 0, 0, 0));
    for at in to_out {
        jump_to(&mut insns, at, out);
    }
    insns
}

/// One service of the [`SocketLb`]: its address (v4 and v6) and backend.
#[derive(Clone, Copy, Debug)]
pub struct Service {
    pub vip: SocketAddr,
    pub backend: SocketAddr,
}

/// A strict socket load balancer: connect4/6 and sendmsg4/6 rewrite a
/// service address to its backend, recvmsg4/6 and getpeername4/6 rewrite
/// the backend back, as Cilium's `bpf_sock.c` does. It keeps no state per
/// socket: any peer that is a backend is answered as its service (unkinder
/// than Cilium's reverse map, which only rewrites sockets it translated).
pub struct SocketLb {
    /// (hook name, attach type, program).
    programs: Vec<(&'static str, u32, OwnedFd)>,
    links: Vec<OwnedFd>,
}

/// `enum bpf_attach_type` of each sock_addr hook, and whether it maps the
/// service to the backend (forward) or back (reverse).
const LB_HOOKS: [(&str, u32, bool, bool); 8] = [
    // (name, attach type, v6, forward)
    ("lb_connect4", 10, false, true),
    ("lb_connect6", 11, true, true),
    ("lb_sendmsg4", 14, false, true),
    ("lb_sendmsg6", 15, true, true),
    ("lb_recvmsg4", 19, false, false),
    ("lb_recvmsg6", 20, true, false),
    ("lb_getpeername4", 29, false, false),
    ("lb_getpeername6", 30, true, false),
];

impl SocketLb {
    /// Loads the programs for `services` (not attached yet).
    pub fn load(services: &[Service]) -> io::Result<Self> {
        let mut programs = Vec::new();
        for (name, attach_type, is_v6, forward) in LB_HOOKS {
            let pairs: Vec<(SocketAddr, SocketAddr)> = services
                .iter()
                .filter(|s| s.vip.is_ipv6() == is_v6 && s.backend.is_ipv6() == is_v6)
                .map(|s| {
                    if forward {
                        (s.vip, s.backend)
                    } else {
                        (s.backend, s.vip)
                    }
                })
                .collect();
            let fd = load(
                PROG_TYPE_CGROUP_SOCK_ADDR,
                attach_type,
                name,
                &translate(&pairs),
            )?;
            programs.push((name, attach_type, fd));
        }
        Ok(Self {
            programs,
            links: Vec::new(),
        })
    }

    /// Attaches every program to the cgroup at `cgroup` through links held
    /// until `self` is dropped, after the programs already there.
    pub fn attach(&mut self, cgroup: &Path) -> io::Result<()> {
        let dir = std::fs::File::open(cgroup)?;
        for (name, attach_type, program) in &self.programs {
            let link = link_create(program.as_fd(), dir.as_raw_fd() as u32, *attach_type)
                .map_err(|e| io::Error::new(e.kind(), format!("attaching {name}: {e}")))?;
            self.links.push(link);
        }
        Ok(())
    }

    /// The id of each program, by name (`lb_connect4`, ...).
    pub fn program_ids(&self) -> io::Result<Vec<(&'static str, u32)>> {
        self.programs
            .iter()
            .map(|(name, _, fd)| Ok((*name, prog_id(fd.as_fd())?)))
            .collect()
    }
}

/// A SCHED_CLS program named `name` that passes every packet on to the
/// next program (`r0 = -1`: TC_ACT_UNSPEC for a clsact filter, TCX_NEXT
/// for a TCX program), as a monitoring tool's does.
pub fn pass_on_program(name: &str) -> io::Result<OwnedFd> {
    load(
        PROG_TYPE_SCHED_CLS,
        0,
        name,
        &[insn(MOV64_IMM, 0, 0, 0, -1), insn(EXIT, 0, 0, 0, 0)],
    )
}

/// Another owner's pass-on programs on `iface` in `ns`, attached as a
/// monitoring tool would: a `clsact` qdisc with a direct-action `cls_bpf`
/// filter each way (priority 10, handles 7 and 8) running `foreign_pass`
/// (pinned at `pin` for `tc`), and a TCX ingress link running
/// `foreign_tcx`, held until dropped.
pub struct PassOnPrograms {
    pub filter_program: OwnedFd,
    pub tcx_program: OwnedFd,
    _tcx_link: OwnedFd,
}

impl PassOnPrograms {
    pub fn attach(ns: &crate::NetnsGuard, iface: &str, pin_at: &Path) -> io::Result<Self> {
        let filter_program = pass_on_program("foreign_pass")?;
        pin(filter_program.as_fd(), pin_at)?;
        let pinned = pin_at
            .to_str()
            .ok_or_else(|| io::Error::other("pin path is not UTF-8"))?;
        let tc = |args: &[&str]| -> io::Result<()> {
            let out = ns.command("tc")?.args(args).output()?;
            if out.status.success() {
                Ok(())
            } else {
                Err(io::Error::other(format!(
                    "tc {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )))
            }
        };
        tc(&["qdisc", "add", "dev", iface, "clsact"])?;
        for (direction, handle) in [("ingress", "7"), ("egress", "8")] {
            tc(&[
                "filter",
                "add",
                "dev",
                iface,
                direction,
                "prio",
                "10",
                "handle",
                handle,
                "bpf",
                "object-pinned",
                pinned,
                "da",
            ])?;
        }
        let tcx_program = pass_on_program("foreign_tcx")?;
        let ifindex = ns.ifindex(iface)?;
        let tcx_link = ns.run(|| link_create(tcx_program.as_fd(), ifindex, TCX_INGRESS))??;
        Ok(Self {
            filter_program,
            tcx_program,
            _tcx_link: tcx_link,
        })
    }
}

/// `struct __sk_buff` offset of `protocol`.
const SKB_PROTOCOL: i16 = 16;
/// Helper ids: bpf_skb_store_bytes, bpf_skb_load_bytes, bpf_redirect_peer.
const SKB_STORE_BYTES: i32 = 9;
const SKB_LOAD_BYTES: i32 = 26;
const REDIRECT_PEER: i32 = 155;

/// A host-side tc ingress program, as Cilium's host routing has on the
/// node's uplink: IPv4 packets to `pod_ip` get `pod_mac` as destination
/// and go straight into the pod's namespace with `bpf_redirect_peer` to
/// the peer of the node-side veth `host_ifindex`, skipping the node's
/// routing and that veth's transmit path. Everything else passes on.
///
/// ```text
///   r6 = ctx
///   w2 = skb->protocol; if w2 != htons(ETH_P_IP) goto pass
///   bpf_skb_load_bytes(ctx, 14 + 16, fp - 16, 4)    (the IPv4 destination)
///   w2 = *(u32 *)(fp - 16); if w2 != pod_ip goto pass
///   *(u32 *)(fp - 8) = pod_mac[0..4]; *(u16 *)(fp - 4) = pod_mac[4..6]
///   bpf_skb_store_bytes(ctx, 0, fp - 8, 6, 0)       (the destination MAC)
///   return bpf_redirect_peer(host_ifindex, 0)
/// pass:
///   return -1   (TCX_NEXT)
/// ```
pub fn redirect_peer_program(
    pod_ip: std::net::Ipv4Addr,
    pod_mac: [u8; 6],
    host_ifindex: u32,
) -> io::Result<OwnedFd> {
    let mut insns = vec![
        insn(MOV64_REG, 6, 1, 0, 0),
        insn(LDX_W, 2, 1, SKB_PROTOCOL, 0),
        insn(JNE32_IMM, 2, 0, 0, port_word(0x0800)), // patched: goto pass
        insn(MOV64_REG, 1, 6, 0, 0),
        insn(MOV64_IMM, 2, 0, 0, 14 + 16),
        insn(MOV64_REG, 3, 10, 0, 0),
        insn(ADD64_IMM, 3, 0, 0, -16),
        insn(MOV64_IMM, 4, 0, 0, 4),
        insn(CALL, 0, 0, 0, SKB_LOAD_BYTES),
        insn(LDX_W, 2, 10, -16, 0),
        insn(JNE32_IMM, 2, 0, 0, net_word(pod_ip.octets())), // patched: goto pass
        insn(
            MOV32_IMM,
            2,
            0,
            0,
            net_word(pod_mac[..4].try_into().expect("4")),
        ),
        insn(STX_W, 10, 2, -8, 0),
        insn(
            MOV32_IMM,
            2,
            0,
            0,
            i32::from(u16::from_ne_bytes([pod_mac[4], pod_mac[5]])),
        ),
        insn(STX_H, 10, 2, -4, 0),
        insn(MOV64_REG, 1, 6, 0, 0),
        insn(MOV64_IMM, 2, 0, 0, 0),
        insn(MOV64_REG, 3, 10, 0, 0),
        insn(ADD64_IMM, 3, 0, 0, -8),
        insn(MOV64_IMM, 4, 0, 0, 6),
        insn(MOV64_IMM, 5, 0, 0, 0),
        insn(CALL, 0, 0, 0, SKB_STORE_BYTES),
        insn(MOV32_IMM, 1, 0, 0, host_ifindex as i32),
        insn(MOV64_IMM, 2, 0, 0, 0),
        insn(CALL, 0, 0, 0, REDIRECT_PEER),
        insn(EXIT, 0, 0, 0, 0),
    ];
    let pass = insns.len();
    insns.push(insn(MOV64_IMM, 0, 0, 0, -1));
    insns.push(insn(EXIT, 0, 0, 0, 0));
    for at in [2, 10] {
        insns[at][2..4].copy_from_slice(&((pass - at - 1) as i16).to_ne_bytes());
    }
    load(PROG_TYPE_SCHED_CLS, 0, "peer_redirect", &insns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_translation_goes_on_to_the_next_pair_when_any_field_differs() {
        let pair = |from: &str, to: &str| (from.parse().unwrap(), to.parse().unwrap());
        let insns = translate(&[
            pair("10.96.0.10:80", "10.245.0.2:9000"),
            pair("10.96.0.10:53", "10.245.0.2:53"),
        ]);
        // A pair: two compares (address, port), two writes, a jump to
        // the end; then r0 and exit.
        let block = 4 + 4 + 1;
        assert_eq!(insns.len(), 2 * block + 2);
        let target = |at: usize| at as i16 + 1 + i16::from_ne_bytes([insns[at][2], insns[at][3]]);
        for at in [1usize, 3] {
            assert_eq!(insns[at][0], JNE32_IMM);
            assert_eq!(target(at), block as i16, "to the second pair");
            assert_eq!(target(block + at), 2 * block as i16, "past the last pair");
        }
        assert_eq!(insns[block - 1][0], JA);
        assert_eq!(target(block - 1), 2 * block as i16);
        let v6 = translate(&[pair("[fd00:96::10]:80", "[fd00:b::2]:9000")]);
        assert_eq!(v6.len(), 2 * 5 + 2 * 5 + 1 + 2);
    }
}
