//! Running a netfilter tool (`iptables-restore`, `nft`, ...) inside a pod's
//! or the host's network namespace, and what its failures say.

use std::{
    io::{self, Write},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use crate::netns::{Netns, NetnsError};

/// A netfilter tool that failed, or could not run.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error(
        "the kernel lacks netfilter support that `{command}` needs in {} (a kernel module \
         that is not loaded, or an option built out of this kernel): {stderr}",
        netns.display()
    )]
    MissingKernelSupport {
        command: String,
        netns: PathBuf,
        stderr: String,
    },
    #[error("`{command}` failed in {}: {stderr}", netns.display())]
    Failed {
        command: String,
        netns: PathBuf,
        stderr: String,
    },
    #[error("cannot run `{command}` in {}: {cause}", netns.display())]
    Spawn {
        command: String,
        netns: PathBuf,
        cause: io::Error,
    },
    #[error("keeping a handle on {}: {cause}", netns.display())]
    Keep { netns: PathBuf, cause: NetnsError },
}

/// Where binaries are looked for after `$PATH` (the agent may run with a
/// `$PATH` without the sbin directories).
pub(in crate::redirect) const FALLBACK_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];
/// Looks `name` up in `$PATH`, then in [`FALLBACK_DIRS`].
pub(in crate::redirect) fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(FALLBACK_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            candidate.metadata().is_ok_and(|m| {
                m.is_file()
                    && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            })
        })
}

/// What a command printed, for errors: stderr without the usage hint, with
/// the input line a restore failed on.
fn describe_failure(stderr: &str, input: Option<&str>) -> String {
    let mut text: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Try `"))
        .collect();
    if text.is_empty() {
        text.push("no error output");
    }
    let mut out = text.join("; ");
    // Legacy and nft restores say "Error occurred at line: N"; nft also
    // says "...-restore: line N failed: ...".
    let failed_line = stderr.lines().find_map(|l| {
        let l = l.trim();
        let n = match l.strip_prefix("Error occurred at line: ") {
            Some(n) => n,
            None => l.split_once(": line ")?.1.split_once(" failed")?.0,
        };
        n.trim().parse::<usize>().ok()
    });
    if let (Some(n), Some(input)) = (failed_line, input)
        && let Some(line) = input.lines().nth(n.saturating_sub(1))
    {
        out.push_str(&format!(" (input line {n}: `{line}`)"));
    }
    out
}

/// Whether a tool's complaint means the kernel (or the xtables extensions
/// matching it) lacks something, rather than a bad rule.
fn is_missing_kernel_support(stderr: &str) -> bool {
    const SIGNS: [&str; 9] = [
        "do you need to insmod",
        "missing kernel module",
        "Couldn't load",
        "not supported",
        "you need a kernel",
        "Table does not exist",
        "Cannot open session to kernel",
        "Kernel error received: set type not supported",
        "Could not fetch rule set generation id",
    ];
    SIGNS.iter().any(|sign| stderr.contains(sign))
}

#[cfg(test)]
thread_local! {
    /// Processes [`run_in`] started on this thread, for tests that count
    /// them against Istio's per-pod operations.
    pub(in crate::redirect) static PROCESSES_STARTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs `program args...` inside `netns` (the child process enters it before
/// exec), feeding it `input`; returns its stdout.
pub(in crate::redirect) fn run_in(
    netns: &Netns,
    program: &Path,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, ToolError> {
    let name = program.file_name().map_or_else(
        || program.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let command = std::iter::once(name.as_str())
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let spawn_err = |source| ToolError::Spawn {
        command: command.clone(),
        netns: netns.path().to_owned(),
        cause: source,
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("LC_ALL", "C");
    let fd = netns.file().as_raw_fd();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes one system call and
    // reads errno. `fd` is the namespace file this process holds open for
    // the whole call (`netns` is borrowed), so it is valid in the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
    }
    let mut child = cmd.spawn().map_err(spawn_err)?;
    #[cfg(test)]
    PROCESSES_STARTED.with(|n| n.set(n.get() + 1));
    if let Some(input) = input {
        // Small inputs (a few KiB): the pipe takes them whole, no deadlock
        // with the child's output.
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let written = stdin.write_all(input.as_bytes());
        drop(stdin);
        if let Err(e) = written {
            let _ = child.wait();
            return Err(spawn_err(e));
        }
    }
    let output = child.wait_with_output().map_err(spawn_err)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let mut detail = describe_failure(&stderr, input);
    if let Some(code) = output.status.code() {
        detail = format!("exit status {code}: {detail}");
    }
    let netns = netns.path().to_owned();
    Err(if is_missing_kernel_support(&stderr) {
        ToolError::MissingKernelSupport {
            command,
            netns,
            stderr: detail,
        }
    } else {
        ToolError::Failed {
            command,
            netns,
            stderr: detail,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_name_the_input_line_and_missing_kernel_support() {
        let input = "*nat\n:ISTIO_X - [0:0]\n-A ISTIO_X -j NOPE\nCOMMIT\n";
        let stderr = "iptables-nft-restore v1.8.9 (nf_tables): Chain 'NOPE' does not exist\n\
                      Error occurred at line: 3\n\
                      Try `iptables-nft-restore -h' or 'iptables-nft-restore --help' for more information.\n";
        assert_eq!(
            describe_failure(stderr, Some(input)),
            "iptables-nft-restore v1.8.9 (nf_tables): Chain 'NOPE' does not exist; \
             Error occurred at line: 3 (input line 3: `-A ISTIO_X -j NOPE`)"
        );
        assert!(!is_missing_kernel_support(stderr));
        for missing in [
            "iptables-restore v1.8.9 (legacy): Couldn't load target `CT':No such file or directory",
            "iptables v1.8.9 (legacy): can't initialize iptables table `raw': Table does not exist \
             (do you need to insmod?)",
            "Warning: Extension CONNMARK revision 0 not supported, missing kernel module?",
            "ipset v7.17: Kernel error received: set type not supported",
        ] {
            assert!(is_missing_kernel_support(missing), "{missing}");
        }
    }
}
