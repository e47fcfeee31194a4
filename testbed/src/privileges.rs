//! Dropping privileges on one thread only, to act as a pod's unprivileged
//! process (or one granted a single capability) from inside a test that
//! runs as root.
//!
//! The raw system calls change the calling thread's credentials alone;
//! glibc's `setuid` and friends would change every thread of the process.
//! Use on a thread of its own that ends afterwards, such as the one
//! [`NetnsGuard::run`](crate::NetnsGuard::run) starts.

use std::io;

use nix::libc;

/// `CAP_NET_ADMIN`: SO_MARK, netfilter and routing changes.
pub const CAP_NET_ADMIN: u32 = 12;
/// `CAP_NET_RAW`: raw and packet sockets; SO_MARK too since Linux 5.17.
pub const CAP_NET_RAW: u32 = 13;

/// What the thread keeps.
#[derive(Clone, Copy, Debug)]
pub enum Privileges {
    /// uid and gid 65534 (`nobody`), no capabilities: an ordinary app.
    Nobody,
    /// uid 0 with only these capabilities (effective and permitted).
    Only(&'static [u32]),
}

/// Drops the calling thread's privileges to `privileges`, for good.
pub fn drop_thread_privileges(privileges: Privileges) -> io::Result<()> {
    let check = |ret: libc::c_long, what: &str| {
        if ret == 0 {
            Ok(())
        } else {
            let e = io::Error::last_os_error();
            Err(io::Error::new(e.kind(), format!("{what}: {e}")))
        }
    };
    match privileges {
        Privileges::Nobody => {
            const NOBODY: libc::c_long = 65534;
            // SAFETY: plain system calls on integers.
            unsafe {
                check(
                    libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()),
                    "setgroups",
                )?;
                check(
                    libc::syscall(libc::SYS_setresgid, NOBODY, NOBODY, NOBODY),
                    "setresgid",
                )?;
                // Leaving uid 0 clears the thread's capabilities.
                check(
                    libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY),
                    "setresuid",
                )
            }
        }
        Privileges::Only(caps) => {
            #[repr(C)]
            struct Header {
                version: u32,
                pid: i32,
            }
            #[repr(C)]
            #[derive(Clone, Copy, Default)]
            struct Data {
                effective: u32,
                permitted: u32,
                inheritable: u32,
            }
            const VERSION_3: u32 = 0x2008_0522;
            let mut data = [Data::default(); 2];
            for &cap in caps {
                let word = &mut data[(cap / 32) as usize];
                word.effective |= 1 << (cap % 32);
                word.permitted |= 1 << (cap % 32);
            }
            let mut header = Header {
                version: VERSION_3,
                pid: 0,
            };
            // SAFETY: the header and two data words capset(2) expects.
            unsafe {
                check(
                    libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()),
                    "capset",
                )
            }
        }
    }
}

/// `CAP_SYS_PTRACE`: other processes' namespaces under /proc.
pub const CAP_SYS_PTRACE: u32 = 19;
/// `CAP_SYS_ADMIN`: setns, mounts.
pub const CAP_SYS_ADMIN: u32 = 21;
/// `CAP_BPF`: programs and maps.
pub const CAP_BPF: u32 = 39;

/// The capabilities charts/ambpf grants the agent, in every mode
/// (`agent/tests/chart.rs` checks the chart grants exactly these).
pub const CHART_AGENT_CAPABILITIES: &[u32] = &[
    CAP_BPF,
    CAP_NET_ADMIN,
    CAP_NET_RAW,
    CAP_SYS_ADMIN,
    CAP_SYS_PTRACE,
];

/// A capability's name as Kubernetes spells it (`CAP_` dropped).
pub fn capability_name(cap: u32) -> &'static str {
    match cap {
        CAP_NET_ADMIN => "NET_ADMIN",
        CAP_NET_RAW => "NET_RAW",
        CAP_SYS_PTRACE => "SYS_PTRACE",
        CAP_SYS_ADMIN => "SYS_ADMIN",
        CAP_BPF => "BPF",
        _ => "(unnamed here)",
    }
}

/// Makes `command` run as root with exactly `caps`, as a container granted
/// only those runs: every other capability leaves the bounding set before
/// exec, and the inheritable set is emptied, so exec gives root no more.
pub fn exec_with_only(command: &mut std::process::Command, caps: &'static [u32]) -> io::Result<()> {
    use std::os::unix::process::CommandExt as _;
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")?
        .trim()
        .parse()
        .map_err(io::Error::other)?;
    // SAFETY: prctl and capset are async-signal-safe system calls.
    unsafe {
        command.pre_exec(move || {
            for cap in (0..=last).filter(|c| !caps.contains(c)) {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            drop_thread_privileges(Privileges::Only(caps))
        });
    }
    Ok(())
}
