//! What runs for the bystander's sockets: the programs attached to the
//! cgroup its threads are in (`BPF_PROG_QUERY`, effective), and how often
//! each ran (`BPF_OBJ_GET_INFO_BY_FD`'s `run_cnt`, which the kernel counts
//! only while `kernel.bpf_stats_enabled` is on; the suite never turns it on,
//! as it is the whole machine's).

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
};

use nix::libc;
use serde::Serialize;

const BPF_PROG_GET_FD_BY_ID: libc::c_int = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_int = 15;
const BPF_PROG_QUERY: libc::c_int = 16;
/// Every program that runs at the cgroup, its ancestors' included.
const BPF_F_QUERY_EFFECTIVE: u32 = 1;

/// The cgroup hooks a socket's calls can pass (`enum bpf_attach_type`).
const CGROUP_HOOKS: [(u32, &str); 20] = [
    (0, "ingress"),
    (1, "egress"),
    (2, "sock_create"),
    (3, "sock_ops"),
    (8, "bind4"),
    (9, "bind6"),
    (10, "connect4"),
    (11, "connect6"),
    (12, "post_bind4"),
    (13, "post_bind6"),
    (14, "sendmsg4"),
    (15, "sendmsg6"),
    (19, "recvmsg4"),
    (20, "recvmsg6"),
    (21, "getsockopt"),
    (29, "getpeername4"),
    (30, "getpeername6"),
    (31, "getsockname4"),
    (32, "getsockname6"),
    (34, "sock_release"),
];

/// The hook every new TCP connection to an IPv4 peer passes.
pub(super) const CONNECT4: &str = "connect4";

/// `union bpf_attr` for `BPF_PROG_QUERY`, whole.
#[derive(Default)]
#[repr(C)]
struct ProgQuery {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// `union bpf_attr` for `BPF_PROG_GET_FD_BY_ID`.
#[derive(Default)]
#[repr(C)]
struct GetFdById {
    prog_id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `union bpf_attr` for `BPF_OBJ_GET_INFO_BY_FD`.
#[derive(Default)]
#[repr(C)]
struct GetInfo {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// `struct bpf_prog_info` up to `attach_btf_id`, as 8-byte words; the
/// fields read here by their byte offsets.
const PROG_INFO_WORDS: usize = 29;
const INFO_ID: usize = 4;
const INFO_NAME: usize = 64;
const INFO_RUN_TIME_NS: usize = 192;
const INFO_RUN_CNT: usize = 200;

fn sys_bpf<T>(cmd: libc::c_int, attr: &mut T, what: &str) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a #[repr(C)] prefix of `union bpf_attr` for `cmd`,
    // valid for reads and writes of its size; the pointers in it point to
    // buffers that outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if ret < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(ret)
}

/// One program that runs for the cgroup's sockets.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Program {
    pub(super) hook: &'static str,
    pub(super) id: u32,
    pub(super) name: String,
    /// Runs so far (0 while the machine's BPF statistics are off).
    pub(super) run_count: u64,
    pub(super) run_time_ns: u64,
}

/// Whether the kernel counts program runs (`kernel.bpf_stats_enabled`).
pub(super) fn stats_enabled() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").is_ok_and(|v| v.trim() != "0")
}

/// Every program that runs for sockets in `cgroup`, hook by hook.
pub(super) fn attached(cgroup: &Path) -> io::Result<Vec<Program>> {
    let dir = std::fs::File::open(cgroup)
        .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", cgroup.display())))?;
    let mut programs = Vec::new();
    for (attach_type, hook) in CGROUP_HOOKS {
        let mut ids = [0u32; 64];
        let mut query = ProgQuery {
            target_fd: dir.as_raw_fd() as u32,
            attach_type,
            query_flags: BPF_F_QUERY_EFFECTIVE,
            prog_ids: ids.as_mut_ptr() as u64,
            prog_cnt: ids.len() as u32,
            ..Default::default()
        };
        match sys_bpf(BPF_PROG_QUERY, &mut query, "BPF_PROG_QUERY") {
            Ok(_) => {}
            // A hook this kernel does not know has nothing attached.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            Err(e) => return Err(e),
        }
        for &id in &ids[..(query.prog_cnt as usize).min(ids.len())] {
            programs.push(info(hook, id)?);
        }
    }
    Ok(programs)
}

fn info(hook: &'static str, id: u32) -> io::Result<Program> {
    let mut by_id = GetFdById {
        prog_id: id,
        ..Default::default()
    };
    let fd = sys_bpf(BPF_PROG_GET_FD_BY_ID, &mut by_id, "BPF_PROG_GET_FD_BY_ID")?;
    // SAFETY: the kernel just returned this descriptor, owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    let mut words = [0u64; PROG_INFO_WORDS];
    let mut get = GetInfo {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: std::mem::size_of_val(&words) as u32,
        info: words.as_mut_ptr() as u64,
    };
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut get, "BPF_OBJ_GET_INFO_BY_FD")?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let u32_at = |at: usize| u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let read_id = u32_at(INFO_ID);
    if read_id != id {
        return Err(io::Error::other(format!(
            "program {id}: its info names program {read_id}"
        )));
    }
    let name = &bytes[INFO_NAME..INFO_NAME + 16];
    let name = String::from_utf8_lossy(&name[..name.iter().position(|&b| b == 0).unwrap_or(16)]);
    Ok(Program {
        hook,
        id,
        name: name.into_owned(),
        run_count: u64_at(INFO_RUN_CNT),
        run_time_ns: u64_at(INFO_RUN_TIME_NS),
    })
}

/// How often each program of `after` ran since `before` (by id; a program
/// not in `before` counts from zero).
pub(super) fn runs_since(before: &[Program], after: &[Program]) -> Vec<Program> {
    after
        .iter()
        .map(|now| {
            let then = before.iter().find(|p| p.id == now.id && p.hook == now.hook);
            Program {
                run_count: now.run_count - then.map_or(0, |p| p.run_count.min(now.run_count)),
                run_time_ns: now.run_time_ns
                    - then.map_or(0, |p| p.run_time_ns.min(now.run_time_ns)),
                ..now.clone()
            }
        })
        .collect()
}

/// Whether every thread of this process whose name starts with `prefix` is
/// in the cgroup at `cgroup` (a cgroup v2 path under the mount); the names
/// of the threads that are not. A new thread names itself once it runs, so
/// none found is retried for a while.
pub(super) fn threads_outside(cgroup: &Path, prefix: &str) -> io::Result<Vec<String>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        match threads_outside_now(cgroup, prefix) {
            Err(e)
                if e.kind() == io::ErrorKind::NotFound && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

fn threads_outside_now(cgroup: &Path, prefix: &str) -> io::Result<Vec<String>> {
    let root = ambpf_testbed::cgroup2_root()?;
    let relative = Path::new("/").join(cgroup.strip_prefix(&root).map_err(|_| {
        io::Error::other(format!(
            "{} is not under {}",
            cgroup.display(),
            root.display()
        ))
    })?);
    let mut outside = Vec::new();
    let mut found = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let task = task?.path();
        let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
            continue;
        };
        if !comm.starts_with(prefix) {
            continue;
        }
        found += 1;
        let Ok(membership) = std::fs::read_to_string(task.join("cgroup")) else {
            continue;
        };
        let inside = membership
            .lines()
            .filter_map(|l| l.strip_prefix("0::"))
            .any(|path| Path::new(path) == relative);
        if !inside {
            outside.push(format!("{} ({})", comm.trim(), membership.trim()));
        }
    }
    if found == 0 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no thread named {prefix}*"),
        ));
    }
    Ok(outside)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(id: u32, runs: u64) -> Program {
        Program {
            hook: CONNECT4,
            id,
            name: "p".to_owned(),
            run_count: runs,
            run_time_ns: runs * 10,
        }
    }

    #[test]
    fn runs_are_counted_from_the_earlier_reading_of_the_same_program() {
        let before = [program(7, 100)];
        let after = [program(7, 160), program(9, 5)];
        let runs = runs_since(&before, &after);
        assert_eq!(
            runs.iter().map(|p| (p.id, p.run_count)).collect::<Vec<_>>(),
            [(7, 60), (9, 5)]
        );
        assert_eq!(runs[0].run_time_ns, 600);
    }
}
