//! Inbound capture: an sk_lookup program attached to each enrolled pod's
//! network namespace (a netns link, pinned at
//! `links/pods/<netns cookie>/inbound`), which assigns every TCP listener
//! lookup there to ztunnel's inbound listener ([`crate::bpf`]'s
//! `ambpf_inbound`). The kernel runs it after reassembly and after parsing
//! every header itself, so no packet shape escapes it.
//!
//! Agents before this one could also take a `tc-assign` path: a TC filter
//! on each pod interface parsed SYNs and assigned them. It passed on what
//! it could not parse (IPv4 fragments among them), so it is gone; an
//! earlier agent's state on it is recognised (no sk_lookup program pinned)
//! and its filters removed when the pods are enrolled again.

use std::{
    io,
    os::fd::{AsFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};

use super::{
    PinLayout,
    features::{Feature, KernelError},
    sys,
};

/// `--inbound-assign`: kept for the flag's compatibility; `sk-lookup` is
/// the only path, which `auto` takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InboundAssign {
    #[default]
    Auto,
    SkLookup,
}

impl InboundAssign {
    /// The environment variable that sets the choice where no flag does.
    pub const ENV: &'static str = "AMBPF_INBOUND_ASSIGN";

    /// The choice `AMBPF_INBOUND_ASSIGN` names (`auto` when unset or empty).
    pub fn from_env() -> Result<Self, String> {
        use clap::ValueEnum as _;
        match std::env::var(Self::ENV) {
            Ok(value) if !value.is_empty() => {
                Self::from_str(&value, true).map_err(|e| format!("{}={value}: {e}", Self::ENV))
            }
            _ => Ok(Self::Auto),
        }
    }
}

/// The inbound path in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InboundPath {
    TcAssign,
    SkLookup,
}

impl std::fmt::Display for InboundPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InboundPath::TcAssign => "tc-assign",
            InboundPath::SkLookup => "sk-lookup",
        })
    }
}

/// Inbound capture's needs. Filing a listener into a SOCKHASH from
/// `sock_ops` at `listen()` (4.18) is not probed: every kernel with these
/// has it.
pub const SK_LOOKUP: &[Feature] = &[
    Feature {
        name: "sk_lookup programs (inbound capture)",
        since: "5.9",
        probe: || is_program_supported(ProgramType::SkLookup).map_err(|e| e.to_string()),
    },
    Feature {
        name: "bpf_sk_assign in sk_lookup programs",
        since: "5.9",
        probe: || {
            is_helper_supported(ProgramType::SkLookup, BpfHelper::BPF_FUNC_sk_assign)
                .map_err(|e| e.to_string())
        },
    },
    Feature {
        name: "SOCKHASH maps (the sk_lookup path's listeners)",
        since: "4.18",
        probe: || is_map_supported(MapType::SockHash).map_err(|e| e.to_string()),
    },
];

/// The path for `choice` on this kernel; names what the kernel lacks for
/// it.
pub fn choose(choice: InboundAssign, _pins: &PinLayout) -> Result<InboundPath, KernelError> {
    let (InboundAssign::Auto | InboundAssign::SkLookup) = choice;
    let missing: Vec<_> = SK_LOOKUP.iter().filter_map(|f| f.check().err()).collect();
    if missing.is_empty() {
        Ok(InboundPath::SkLookup)
    } else {
        Err(KernelError(missing))
    }
}

/// The id of the sk_lookup program pinned under `pins`: `Some` while the
/// sk_lookup path is in use.
pub fn pinned_program(pins: &PinLayout) -> Option<u32> {
    let fd = sys::obj_get(&pins.program(ambpf_common::programs::INBOUND_LOOKUP)).ok()?;
    sys::prog_id(fd.as_fd()).ok()
}

/// The path in use under `pins` (as [`pinned_program`] tells).
pub fn pinned_path(pins: &PinLayout) -> InboundPath {
    match pinned_program(pins) {
        Some(_) => InboundPath::SkLookup,
        None => InboundPath::TcAssign,
    }
}

/// Where the sk_lookup link of the pod with `netns_cookie` is pinned.
pub fn link_pin(pins: &PinLayout, netns_cookie: u64) -> PathBuf {
    pins.pod_links_dir(netns_cookie).join("inbound")
}

const BPF_SK_LOOKUP: u32 = 36;

/// Attaches `program` to the namespace `netns` (of inode `netns_inode`)
/// and pins the link at `pin`; where a link into that namespace is pinned
/// there already, makes it run `program` (in one step, so no SYN goes
/// unassigned during an upgrade).
pub fn attach_link(
    pin: &Path,
    program: BorrowedFd<'_>,
    netns: BorrowedFd<'_>,
    netns_inode: u64,
) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    match sys::obj_get(pin) {
        Ok(link) => {
            let attached = sys::link_info(link.as_fd())?.target;
            if u64::from(attached) == netns_inode & u64::from(u32::MAX) {
                return sys::link_update(link.as_fd(), program);
            }
            // Attached elsewhere (or to a namespace gone): replaced.
            std::fs::remove_file(pin)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = pin.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let link = sys::link_create(program, netns.as_raw_fd() as u32, BPF_SK_LOOKUP)?;
    sys::obj_pin(link.as_fd(), pin)
}

/// Removes the pod's pinned link (which detaches it) and its directory.
pub fn remove_link(pins: &PinLayout, netns_cookie: u64) -> io::Result<()> {
    match std::fs::remove_dir_all(pins.pod_links_dir(netns_cookie)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The pinned link at `pin`: the program it runs and the inode of the
/// namespace it is attached to (`None` once that namespace is gone; the
/// kernel reports the inode's low 32 bits).
pub fn link_info(pin: &Path) -> io::Result<(u32, Option<u32>)> {
    let link = sys::obj_get(pin)?;
    let info = sys::link_info(link.as_fd())?;
    Ok((info.prog_id, Some(info.target).filter(|ino| *ino != 0)))
}

impl super::Dataplane {
    /// Attaches (or updates) the sk_lookup link of the pod in `netns`, whose
    /// netns cookie is `cookie` ([`attach_link`]).
    pub fn attach_inbound_link(
        &mut self,
        netns: &crate::netns::Netns,
        cookie: u64,
    ) -> io::Result<()> {
        let pin = link_pin(self.pins(), cookie);
        let program: &mut aya::programs::SkLookup = self
            .program_mut(ambpf_common::programs::INBOUND_LOOKUP)
            .try_into()
            .map_err(io::Error::other)?;
        let program = program.fd().map_err(io::Error::other)?;
        attach_link(&pin, program.as_fd(), netns.file().as_fd(), netns.inode())
    }
}
