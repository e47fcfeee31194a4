//! The few bpf(2) commands aya 0.14 does not expose for every program
//! type: creating a cgroup link for any program, replacing a link's program
//! atomically, pinning/opening link objects, and creating a map that no
//! program uses (the agent's own records).

use std::{
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

// enum bpf_cmd
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_PROG_LOAD: libc::c_long = 5;

/// enum bpf_prog_type: a TC classifier.
pub const PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;

/// enum bpf_attach_type values of the cgroup hooks ambpf uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CgroupHook {
    InetEgress = 1,
    InetSockCreate = 2,
    SockOps = 3,
    Inet4Connect = 10,
    Inet6Connect = 11,
    Udp4Sendmsg = 14,
    Udp6Sendmsg = 15,
    Udp4Recvmsg = 19,
    Udp6Recvmsg = 20,
    Getsockopt = 21,
    Inet4Getpeername = 29,
    Inet6Getpeername = 30,
}

impl CgroupHook {
    /// The hooks that rewrite what the app is told (the peer's address,
    /// the sender of a datagram, a socket option) rather than where a
    /// connection goes: ambpf's answer must come after other owners'
    /// programs there, as its redirection must come before them elsewhere.
    pub const fn answers_the_app(self) -> bool {
        matches!(
            self,
            CgroupHook::Inet4Getpeername
                | CgroupHook::Inet6Getpeername
                | CgroupHook::Udp4Recvmsg
                | CgroupHook::Udp6Recvmsg
                | CgroupHook::Getsockopt
        )
    }

    /// The kernel's name of the attach type, as bpftool prints it.
    pub const fn name(self) -> &'static str {
        match self {
            CgroupHook::InetEgress => "cgroup_inet_egress",
            CgroupHook::InetSockCreate => "cgroup_inet_sock_create",
            CgroupHook::SockOps => "cgroup_sock_ops",
            CgroupHook::Inet4Connect => "cgroup_inet4_connect",
            CgroupHook::Inet6Connect => "cgroup_inet6_connect",
            CgroupHook::Udp4Sendmsg => "cgroup_udp4_sendmsg",
            CgroupHook::Udp6Sendmsg => "cgroup_udp6_sendmsg",
            CgroupHook::Udp4Recvmsg => "cgroup_udp4_recvmsg",
            CgroupHook::Udp6Recvmsg => "cgroup_udp6_recvmsg",
            CgroupHook::Getsockopt => "cgroup_getsockopt",
            CgroupHook::Inet4Getpeername => "cgroup_inet4_getpeername",
            CgroupHook::Inet6Getpeername => "cgroup_inet6_getpeername",
        }
    }
}

/// The largest bpf_attr prefix used here; the kernel accepts a shorter
/// attr as long as the unused tail is zero.
#[repr(C)]
#[derive(Default)]
struct Attr {
    words: [u32; 32],
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, zero-padded bpf_attr prefix of the given size.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut Attr,
            size_of::<Attr>() as u32,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// BPF_LINK_CREATE of `program` on the cgroup `cgroup`, after the programs
/// already on the hook. Cgroup links always attach alongside other
/// programs: other agents' cgroup programs keep running beside ours.
pub fn cgroup_link_create(
    program: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    hook: CgroupHook,
) -> io::Result<OwnedFd> {
    cgroup_link_create_with(program, cgroup, hook, 0)
}

fn cgroup_link_create_with(
    program: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    hook: CgroupHook,
    flags: u32,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    attr.words[0] = program.as_raw_fd() as u32; // prog_fd
    attr.words[1] = cgroup.as_raw_fd() as u32; // target_fd
    attr.words[2] = hook as u32; // attach_type
    attr.words[3] = flags; // cgroup.relative_fd (word 4) 0: relative to all
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new link fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_F_BEFORE (link_create flags): attach ahead of the program named
/// by the relative fd or id, or of every program when none is named.
const F_BEFORE: u32 = 1 << 3;

/// [`cgroup_link_create`] ahead of every program already attached to the
/// hook of `cgroup`, so that ours runs first there. Kernels without
/// ordered cgroup attachment (the mprog API for cgroups, Linux 6.17) refuse
/// the flag with `EINVAL`.
pub fn cgroup_link_create_first(
    program: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    hook: CgroupHook,
) -> io::Result<OwnedFd> {
    cgroup_link_create_with(program, cgroup, hook, F_BEFORE)
}

/// BPF_F_QUERY_EFFECTIVE: every program that runs for the cgroup, its
/// ancestors' included, in the order they run.
pub const F_QUERY_EFFECTIVE: u32 = 1;

/// BPF_PROG_QUERY: the ids of the programs on `attach_type` of `target` (a
/// cgroup fd, or an ifindex of the calling thread's namespace for TCX), in
/// the order they run.
pub fn prog_query(target: u32, attach_type: u32, query_flags: u32) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    loop {
        let mut attr = Attr::default();
        attr.words[0] = target; // target_fd / target_ifindex
        attr.words[1] = attach_type;
        attr.words[2] = query_flags;
        let ptr = ids.as_mut_ptr() as u64;
        attr.words[4] = ptr as u32; // prog_ids (u64 at byte 16)
        attr.words[5] = (ptr >> 32) as u32;
        attr.words[6] = ids.len() as u32; // prog_cnt: in, the room; out, the count
        match bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => {
                ids.truncate(attr.words[6] as usize);
                return Ok(ids);
            }
            // More programs than room: the kernel said how many.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                ids = vec![0; attr.words[6] as usize + 16];
            }
            Err(e) => return Err(e),
        }
    }
}

/// What `BPF_OBJ_GET_INFO_BY_FD` tells of a program found by id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgInfo {
    pub prog_type: u32,
    /// The name given at load (at most 15 bytes).
    pub name: String,
}

/// The type and name of the program with id `id`.
pub fn prog_info_by_id(id: u32) -> io::Result<ProgInfo> {
    let mut attr = Attr::default();
    attr.words[0] = id; // prog_id
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: the kernel returned a new program fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // struct bpf_prog_info: type at byte 0, name[16] at byte 64.
    let mut info = [0u8; 80];
    let mut attr = Attr::default();
    attr.words[0] = fd.as_raw_fd() as u32; // bpf_fd
    attr.words[1] = info.len() as u32; // info_len
    let ptr = info.as_mut_ptr() as u64;
    attr.words[2] = ptr as u32;
    attr.words[3] = (ptr >> 32) as u32;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let name = &info[64..80];
    let len = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    Ok(ProgInfo {
        prog_type: u32::from_ne_bytes(info[..4].try_into().expect("4 bytes")),
        name: String::from_utf8_lossy(&name[..len]).into_owned(),
    })
}

/// enum bpf_map_type: a hash map.
pub const MAP_TYPE_HASH: u32 = 1;

/// BPF_MAP_CREATE of a map without BTF; `name` is at most 15 bytes of
/// `[A-Za-z0-9_.]`, as the kernel requires.
pub fn map_create(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    attr.words[0] = map_type;
    attr.words[1] = key_size;
    attr.words[2] = value_size;
    attr.words[3] = max_entries;
    // map_flags, inner_map_fd, numa_node: 0; map_name[16] at byte 28.
    let mut name_bytes = [0u8; 16];
    let len = name.len().min(15);
    name_bytes[..len].copy_from_slice(&name.as_bytes()[..len]);
    for (i, chunk) in name_bytes.chunks(4).enumerate() {
        attr.words[7 + i] = u32::from_ne_bytes(chunk.try_into().expect("4-byte chunk"));
    }
    let fd = bpf(BPF_MAP_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new map fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_MAP_GET_NEXT_KEY: the key after `key` (the first with `None`) into
/// `next`; false at the end (or on any error: a walk of any key type, for
/// counting entries).
pub fn map_next_key(map: std::os::fd::RawFd, key: Option<&[u8]>, next: &mut [u8]) -> bool {
    let mut attr = Attr::default();
    attr.words[0] = map as u32; // map_fd, then 4 bytes of padding
    let key_ptr = key.map_or(0, |k| k.as_ptr() as u64);
    attr.words[2] = key_ptr as u32;
    attr.words[3] = (key_ptr >> 32) as u32;
    let next_ptr = next.as_mut_ptr() as u64;
    attr.words[4] = next_ptr as u32;
    attr.words[5] = (next_ptr >> 32) as u32;
    bpf(BPF_MAP_GET_NEXT_KEY, &mut attr).is_ok()
}

/// BPF_LINK_CREATE of `program` on `target` (an fd or an ifindex, as the
/// attach type wants) with `attach_type`.
pub fn link_create(program: BorrowedFd<'_>, target: u32, attach_type: u32) -> io::Result<OwnedFd> {
    let mut attr = Attr::default();
    attr.words[0] = program.as_raw_fd() as u32; // prog_fd
    attr.words[1] = target; // target_fd / target_ifindex
    attr.words[2] = attach_type;
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new link fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_LINK_UPDATE: `link` runs `program` from now on, with no gap.
pub fn link_update(link: BorrowedFd<'_>, program: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = Attr::default();
    attr.words[0] = link.as_raw_fd() as u32; // link_fd
    attr.words[1] = program.as_raw_fd() as u32; // new_prog_fd
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

fn path_attr(path: &Path) -> io::Result<(CString, Attr)> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pin path contains NUL"))?;
    let mut attr = Attr::default();
    let ptr = c_path.as_ptr() as u64;
    attr.words[0] = ptr as u32; // pathname (u64, little-endian halves)
    attr.words[1] = (ptr >> 32) as u32;
    Ok((c_path, attr))
}

/// BPF_OBJ_PIN of any bpf object fd at `path` (on bpffs).
pub fn obj_pin(fd: impl AsFd, path: &Path) -> io::Result<()> {
    let (_c_path, mut attr) = path_attr(path)?;
    attr.words[2] = fd.as_fd().as_raw_fd() as u32; // bpf_fd
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// BPF_OBJ_GET: opens the bpf object pinned at `path`.
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let (_c_path, mut attr) = path_attr(path)?;
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The interface a TCX link is attached to: `Some(ifindex)`, or `None` once
/// the interface is gone and the link defunct (the kernel reports ifindex
/// 0, and refuses to update the link's program with `ENOLINK`).
pub fn tcx_link_ifindex(link: BorrowedFd<'_>) -> io::Result<Option<u32>> {
    // struct bpf_link_info: type, id, prog_id, then a u64-aligned union
    // whose tcx member starts with the ifindex (offset 16).
    let mut info = [0u32; 6];
    let mut attr = Attr::default();
    attr.words[0] = link.as_raw_fd() as u32; // bpf_fd
    attr.words[1] = size_of_val(&info) as u32; // info_len
    let ptr = info.as_mut_ptr() as u64;
    attr.words[2] = ptr as u32; // info (u64, little-endian halves)
    attr.words[3] = (ptr >> 32) as u32;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(Some(info[4]).filter(|ifindex| *ifindex != 0))
}

/// What `BPF_OBJ_GET_INFO_BY_FD` tells of a link.
pub struct LinkInfo {
    pub prog_id: u32,
    /// The first word of the link's type-specific part: a TCX link's
    /// ifindex, a netns link's namespace inode (0 once it is gone).
    pub target: u32,
}

/// The program `link` runs and what it is attached to.
pub fn link_info(link: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    // struct bpf_link_info: type, id, prog_id, then a u64-aligned union.
    let mut info = [0u32; 6];
    let mut attr = Attr::default();
    attr.words[0] = link.as_raw_fd() as u32; // bpf_fd
    attr.words[1] = size_of_val(&info) as u32; // info_len
    let ptr = info.as_mut_ptr() as u64;
    attr.words[2] = ptr as u32; // info (u64, little-endian halves)
    attr.words[3] = (ptr >> 32) as u32;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(LinkInfo {
        prog_id: info[2],
        target: info[4],
    })
}

/// Loads a two-instruction program of `prog_type` that returns `verdict`
/// (`r0 = verdict; exit`): a stand-in whose behaviour does not matter, for
/// probing what the kernel accepts and for tests of attachment plumbing.
pub fn load_minimal_program(prog_type: u32, verdict: i32) -> io::Result<OwnedFd> {
    load_minimal_program_for(prog_type, 0, verdict)
}

/// [`load_minimal_program`] for an `expected_attach_type` (the hooks of
/// cgroup socket-address programs are told apart by it at load).
pub fn load_minimal_program_for(
    prog_type: u32,
    expected_attach_type: u32,
    verdict: i32,
) -> io::Result<OwnedFd> {
    // struct bpf_insn: code, dst_reg:4 | src_reg:4, off (i16), imm (i32).
    let insn = |code: u8, imm: i32| {
        let mut raw = [0u8; 8];
        raw[0] = code;
        raw[4..].copy_from_slice(&imm.to_ne_bytes());
        raw
    };
    const MOV64_IMM_R0: u8 = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K
    const EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT
    load_program_for(
        prog_type,
        expected_attach_type,
        &[insn(MOV64_IMM_R0, verdict), insn(EXIT, 0)],
    )
}

/// Loads `program` (`struct bpf_insn`s) as a GPL program of `prog_type`.
pub fn load_program(prog_type: u32, program: &[[u8; 8]]) -> io::Result<OwnedFd> {
    load_program_for(prog_type, 0, program)
}

fn load_program_for(
    prog_type: u32,
    expected_attach_type: u32,
    program: &[[u8; 8]],
) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let mut attr = Attr::default();
    attr.words[0] = prog_type;
    attr.words[1] = program.len() as u32; // insn_cnt
    let insns = program.as_ptr() as u64;
    attr.words[2] = insns as u32;
    attr.words[3] = (insns >> 32) as u32;
    let license = license.as_ptr() as u64;
    attr.words[4] = license as u32;
    attr.words[5] = (license >> 32) as u32;
    attr.words[17] = expected_attach_type; // after prog_name[16], prog_ifindex
    let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
    // SAFETY: the kernel returned a new program fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The id of the program `program` (BPF_OBJ_GET_INFO_BY_FD: `struct
/// bpf_prog_info` starts with its type, then its id).
pub fn prog_id(program: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = [0u32; 2];
    let mut attr = Attr::default();
    attr.words[0] = program.as_raw_fd() as u32; // bpf_fd
    attr.words[1] = size_of_val(&info) as u32; // info_len
    let ptr = info.as_mut_ptr() as u64;
    attr.words[2] = ptr as u32;
    attr.words[3] = (ptr >> 32) as u32;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info[1])
}
