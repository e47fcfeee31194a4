//! The few `bpf(2)` commands the suite needs, each with the prefix of
//! `union bpf_attr` it uses (the kernel zero-extends a shorter attr).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

use nix::libc;

const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_PROG_DETACH: libc::c_int = 9;
#[cfg(test)]
const BPF_PROG_QUERY: libc::c_int = 16;
const BPF_LINK_CREATE: libc::c_int = 28;
const BPF_LINK_UPDATE: libc::c_int = 29;

const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_SK_LOOKUP: u32 = 30;

/// `enum bpf_attach_type`.
pub const SK_LOOKUP: u32 = 36;
pub const TCX_INGRESS: u32 = 46;

const BPF_F_REPLACE: u32 = 1 << 2;

/// `TC_ACT_UNSPEC`: carry on as if no program ran.
const TC_ACT_UNSPEC: i32 = -1;
/// `SK_PASS`: the usual socket lookup goes on.
const SK_PASS: i32 = 1;

/// `struct bpf_insn`: opcode, registers (dst in the low nibble), offset,
/// immediate.
#[repr(C)]
struct Insn(u8, u8, i16, i32);

/// `r0 = ret; exit` (BPF_ALU64 | BPF_MOV | BPF_K, then BPF_JMP | BPF_EXIT).
const fn return_(ret: i32) -> [Insn; 2] {
    [Insn(0xb7, 0, 0, ret), Insn(0x95, 0, 0, 0)]
}

#[derive(Clone, Copy, Debug)]
pub enum Program {
    /// `return TC_ACT_UNSPEC`.
    SchedCls,
    /// `return SK_PASS`, expected attach type `BPF_SK_LOOKUP`.
    SkLookup,
}

#[derive(Default)]
#[repr(C)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[derive(Default)]
#[repr(C)]
struct LinkCreate {
    prog_fd: u32,
    /// An interface index (TCX) or a netns fd (sk_lookup).
    target: u32,
    attach_type: u32,
    flags: u32,
    /// TCX only: `relative_fd`, padding, `expected_revision`.
    relative_fd: u32,
    _pad: u32,
    expected_revision: u64,
}

#[derive(Default)]
#[repr(C)]
struct LinkUpdate {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// `BPF_PROG_ATTACH` and `BPF_PROG_DETACH`.
#[derive(Default)]
#[repr(C)]
struct ProgAttach {
    target_ifindex: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
    relative_fd: u32,
    expected_revision: u64,
}

/// `BPF_PROG_QUERY`, whole: the kernel writes `revision`, at its end,
/// whatever size it is told.
#[cfg(test)]
#[derive(Default)]
#[repr(C)]
struct ProgQuery {
    target: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    count: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// `bpf(cmd, attr)`, the error named after `what`.
fn sys_bpf<T>(
    cmd: libc::c_int,
    attr: &mut T,
    what: impl Fn() -> String,
) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a #[repr(C)] prefix of `union bpf_attr` for `cmd`
    // without padding, valid for reads and writes of its size, which is
    // what the kernel is told.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{}: {e}", what())));
    }
    Ok(rc)
}

fn owned(fd: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this new descriptor to us alone.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

fn fd(fd: BorrowedFd) -> u32 {
    fd.as_raw_fd() as u32
}

/// Loads `program` named `name` (at most 15 bytes), license GPL.
pub fn load(program: Program, name: &str) -> io::Result<OwnedFd> {
    let (prog_type, expected_attach_type, insns) = match program {
        Program::SchedCls => (BPF_PROG_TYPE_SCHED_CLS, 0, return_(TC_ACT_UNSPEC)),
        Program::SkLookup => (BPF_PROG_TYPE_SK_LOOKUP, SK_LOOKUP, return_(SK_PASS)),
    };
    let mut attr = ProgLoad {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: c"GPL".as_ptr() as u64,
        expected_attach_type,
        ..Default::default()
    };
    let len = name.len().min(15);
    attr.prog_name[..len].copy_from_slice(&name.as_bytes()[..len]);
    sys_bpf(BPF_PROG_LOAD, &mut attr, || {
        format!("BPF_PROG_LOAD {program:?}")
    })
    .map(owned)
}

/// `BPF_LINK_CREATE` of `prog` at `target` (an interface index in the
/// calling thread's namespace, or a netns fd).
pub fn link_create(prog: BorrowedFd, target: u32, attach_type: u32) -> io::Result<OwnedFd> {
    let mut attr = LinkCreate {
        prog_fd: fd(prog),
        target,
        attach_type,
        ..Default::default()
    };
    sys_bpf(BPF_LINK_CREATE, &mut attr, || {
        format!("BPF_LINK_CREATE attach type {attach_type} at {target}")
    })
    .map(owned)
}

/// `BPF_LINK_UPDATE`: `link` runs `prog` from now on.
pub fn link_update(link: BorrowedFd, prog: BorrowedFd) -> io::Result<()> {
    let mut attr = LinkUpdate {
        link_fd: fd(link),
        new_prog_fd: fd(prog),
        ..Default::default()
    };
    sys_bpf(BPF_LINK_UPDATE, &mut attr, || "BPF_LINK_UPDATE".to_owned()).map(drop)
}

/// `BPF_PROG_ATTACH` to TCX ingress of `ifindex` (in the calling thread's
/// namespace), in place of `replace` if given.
pub fn prog_attach(ifindex: u32, prog: BorrowedFd, replace: Option<BorrowedFd>) -> io::Result<()> {
    let mut attr = ProgAttach {
        target_ifindex: ifindex,
        attach_bpf_fd: fd(prog),
        attach_type: TCX_INGRESS,
        attach_flags: if replace.is_some() { BPF_F_REPLACE } else { 0 },
        replace_bpf_fd: replace.map_or(0, fd),
        ..Default::default()
    };
    sys_bpf(BPF_PROG_ATTACH, &mut attr, || {
        format!("BPF_PROG_ATTACH tcx at {ifindex}")
    })
    .map(drop)
}

/// `BPF_PROG_DETACH` of `prog` from TCX ingress of `ifindex`.
pub fn prog_detach(ifindex: u32, prog: BorrowedFd) -> io::Result<()> {
    let mut attr = ProgAttach {
        target_ifindex: ifindex,
        attach_bpf_fd: fd(prog),
        attach_type: TCX_INGRESS,
        ..Default::default()
    };
    sys_bpf(BPF_PROG_DETACH, &mut attr, || {
        format!("BPF_PROG_DETACH tcx at {ifindex}")
    })
    .map(drop)
}

/// How many programs run at `target` for `attach_type` (`BPF_PROG_QUERY`).
#[cfg(test)]
pub fn attached_count(target: u32, attach_type: u32) -> io::Result<u32> {
    let mut attr = ProgQuery {
        target,
        attach_type,
        ..Default::default()
    };
    sys_bpf(BPF_PROG_QUERY, &mut attr, || "BPF_PROG_QUERY".to_owned())?;
    Ok(attr.count)
}
