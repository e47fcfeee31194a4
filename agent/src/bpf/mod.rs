//! The kernel side as the agent sees it: loading the embedded object once,
//! pinning its maps, attaching programs, and reading their state back.

pub mod capacity;
pub mod cgroup;
pub mod compat;
pub mod features;
pub mod foreign;
pub mod inbound;
pub mod inspect;
pub mod keys;
pub mod listener_adoption;
pub mod node;
pub mod object;
pub mod pins;
pub mod pod_counters;
pub mod pod_names;
pub mod redirected;
pub mod sys;
pub mod tc;
pub mod ztunnel_procs;

use ambpf_common::maps;
use aya::{
    Ebpf, EbpfLoader,
    programs::{Program, SchedClassifier, SkLookup},
};
use tracing::{debug, warn};

pub use capacity::Capacities;
pub use inbound::{InboundAssign, InboundPath};
pub use node::{MapWriteError, NodeSetupError};
pub use pins::{DEFAULT_PIN_ROOT, PinLayout};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    ObjectMissing(&'static str),
    #[error(transparent)]
    Kernel(#[from] features::KernelError),
    #[error("{0}")]
    InboundChoice(String),
    #[error(transparent)]
    Pins(#[from] pins::PinError),
    #[error(transparent)]
    PinnedMap(#[from] compat::CompatError),
    #[error(transparent)]
    Capacity(#[from] capacity::CapacityError),
    #[error("loading the ambpf BPF object: {0}")]
    Object(#[from] aya::EbpfError),
    #[error("BPF program {name} is missing from the object")]
    ProgramMissing { name: &'static str },
    #[error("loading BPF program {name} into the kernel: {reason}")]
    Program { name: String, reason: String },
}

/// The loaded programs and maps. Programs are loaded once per agent process;
/// maps named in [`maps::PINNED`] are shared through their pins, so a new
/// agent (restart, upgrade, a one-shot CLI command) adopts the state a
/// previous one left instead of starting empty.
pub struct Dataplane {
    ebpf: Ebpf,
    pins: PinLayout,
    /// The maps' capacities in effect (pinned maps keep theirs).
    capacities: Capacities,
    /// Pinned maps adopted with another capacity than asked.
    capacities_kept: Vec<compat::CapacityKept>,
    /// The raw-socket guard's programs are loaded (the kernel has what they
    /// need).
    raw_guard: bool,
    /// How steered SYNs reach ztunnel's listener.
    inbound: InboundPath,
}

/// Pins the steering program (replacing an earlier agent's pin), so that
/// `status` and the state check can tell which tc filters run this agent's
/// program.
fn pin_steering_program(ebpf: &mut Ebpf, pins: &PinLayout) -> Result<(), LoadError> {
    let name = ambpf_common::programs::POD_INGRESS;
    let path = pins.program(name);
    let pin_err = |reason: String| LoadError::Program {
        name: name.to_owned(),
        reason: format!("pinning at {}: {reason}", path.display()),
    };
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(pin_err(e.to_string())),
    }
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| pin_err("not a classifier".into()))?;
    program.pin(&path).map_err(|e| pin_err(e.to_string()))
}

/// Pins the sk_lookup program while its path is in use, and removes the
/// pin otherwise ([`inbound`]).
fn pin_inbound_program(
    ebpf: &mut Ebpf,
    pins: &PinLayout,
    path: InboundPath,
) -> Result<(), LoadError> {
    let name = ambpf_common::programs::INBOUND_LOOKUP;
    let pin = pins.program(name);
    let pin_err = |reason: String| LoadError::Program {
        name: name.to_owned(),
        reason: format!("pinning at {}: {reason}", pin.display()),
    };
    match std::fs::remove_file(&pin) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(pin_err(e.to_string())),
    }
    if path != InboundPath::SkLookup {
        return Ok(());
    }
    let program: &mut SkLookup = ebpf
        .program_mut(name)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| pin_err("not an sk_lookup program".into()))?;
    program.pin(&pin).map_err(|e| pin_err(e.to_string()))
}

/// The id of the steering program pinned under `pins`, if any.
pub fn pinned_steering_program(pins: &PinLayout) -> Option<u32> {
    use std::os::fd::AsFd as _;
    let fd = sys::obj_get(&pins.program(ambpf_common::programs::POD_INGRESS)).ok()?;
    sys::prog_id(fd.as_fd()).ok()
}

impl Dataplane {
    /// Checks the kernel and the pin root, then loads every program, with
    /// the maps' default capacities.
    pub fn load(pins: PinLayout) -> Result<Self, LoadError> {
        Self::load_with(pins, Capacities::default())
    }

    /// As [`Self::load`], creating the maps not pinned yet with
    /// `capacities`; pinned maps of another capacity are adopted as they
    /// are, with a warning ([`compat`]).
    pub fn load_with(pins: PinLayout, capacities: Capacities) -> Result<Self, LoadError> {
        let choice = InboundAssign::from_env().map_err(LoadError::InboundChoice)?;
        Self::load_inbound(pins, capacities, choice)
    }

    /// As [`Self::load_with`], on the inbound path `choice` picks
    /// ([`inbound::choose`]).
    pub fn load_inbound(
        pins: PinLayout,
        capacities: Capacities,
        choice: InboundAssign,
    ) -> Result<Self, LoadError> {
        if let Some(why) = object::missing_reason() {
            return Err(LoadError::ObjectMissing(why));
        }
        capacities.validate()?;
        let inbound = match (features::check_kernel(), inbound::choose(choice, &pins)) {
            (Ok(()), Ok(path)) => path,
            (Err(features::KernelError(mut missing)), Err(features::KernelError(more))) => {
                missing.extend(more);
                return Err(features::KernelError(missing).into());
            }
            (Err(e), _) | (_, Err(e)) => return Err(e.into()),
        };
        debug!("inbound path: {inbound}");
        pins.prepare()?;
        let (capacities, capacities_kept) =
            compat::check_pinned_maps(object::OBJECT, &pins, capacities)?;
        for kept in &capacities_kept {
            warn!("{kept}");
        }

        let map_pins: Vec<_> = maps::PINNED
            .iter()
            .map(|name| (*name, pins.map(name)))
            .collect();
        let raw_guard = match features::raw_guard_supported() {
            Ok(()) => true,
            Err(e) => {
                warn!(
                    "running without the raw-socket guard: {e}; TCP sent through raw sockets \
                     in pods (CAP_NET_RAW) leaves them uncaptured"
                );
                false
            }
        };
        let mut loader = EbpfLoader::new();
        let via_sk_lookup = u8::from(inbound == InboundPath::SkLookup);
        loader.override_global(
            ambpf_common::programs::INBOUND_VIA_SK_LOOKUP,
            &via_sk_lookup,
            true,
        );
        // ztunnel's sockets told by their process where the kernel allows.
        let by_process = |feature: &features::Feature| match feature.check() {
            Ok(()) => 1u8,
            Err(e) => {
                warn!("{e}: ztunnel's mark alone exempts a socket there, as under Istio's rules");
                0
            }
        };
        let (sock_addr, sock_ops) = (
            by_process(&features::ZTUNNEL_PROCESS_IN_SOCK_ADDR),
            by_process(&features::ZTUNNEL_PROCESS_IN_SOCK_OPS),
        );
        loader.override_global(
            ambpf_common::programs::ZTUNNEL_PROCESS_IN_SOCK_ADDR,
            &sock_addr,
            true,
        );
        loader.override_global(
            ambpf_common::programs::ZTUNNEL_PROCESS_IN_SOCK_OPS,
            &sock_ops,
            true,
        );
        for (name, path) in &map_pins {
            loader.map_pin_path(name, path.as_path());
        }
        capacities.apply(&mut loader);
        if !raw_guard {
            // Its socket-storage map, too, is what such a kernel lacks.
            loader.allow_unsupported_maps();
        }
        let mut ebpf = loader.load(object::OBJECT)?;
        for name in ambpf_common::programs::ALL {
            if ebpf.program(name).is_none() {
                return Err(LoadError::ProgramMissing { name });
            }
        }
        for (name, program) in ebpf.programs_mut() {
            if !raw_guard && ambpf_common::programs::RAW_GUARD.contains(&name) {
                continue;
            }
            let loaded = match program {
                Program::SchedClassifier(p) => p.load(),
                Program::CgroupSockAddr(p) => p.load(),
                Program::CgroupSockopt(p) => p.load(),
                Program::SockOps(p) => p.load(),
                Program::CgroupSkb(p) => p.load(),
                Program::CgroupSock(p) => p.load(),
                Program::SkLookup(p) => p.load(),
                other => {
                    return Err(LoadError::Program {
                        name: name.to_owned(),
                        reason: format!("unexpected program type {:?}", other.prog_type()),
                    });
                }
            };
            // The verifier log says which instruction a kernel refused and why.
            loaded.map_err(|e| LoadError::Program {
                name: name.to_owned(),
                reason: crate::error_chain(&e),
            })?;
            debug!("loaded BPF program {name}");
        }
        pin_steering_program(&mut ebpf, &pins)?;
        pin_inbound_program(&mut ebpf, &pins, inbound)?;
        crate::build_info::record_loaded(&pins).map_err(|source| pins::PinError::Io {
            path: pins.root().join("object"),
            cause: source,
        })?;
        Ok(Self {
            ebpf,
            pins,
            capacities,
            capacities_kept,
            raw_guard,
            inbound,
        })
    }

    /// How steered SYNs reach ztunnel's listener.
    pub fn inbound(&self) -> InboundPath {
        self.inbound
    }

    /// The maps' capacities in effect.
    pub fn capacities(&self) -> Capacities {
        self.capacities
    }

    /// Pinned maps adopted with another capacity than asked.
    pub fn capacities_kept(&self) -> &[compat::CapacityKept] {
        &self.capacities_kept
    }

    /// Whether the raw-socket guard is loaded (and attached with the socket
    /// programs).
    pub fn raw_guard(&self) -> bool {
        self.raw_guard
    }

    pub fn pins(&self) -> &PinLayout {
        &self.pins
    }

    pub(crate) fn program_mut(&mut self, name: &'static str) -> &mut Program {
        self.ebpf
            .program_mut(name)
            .unwrap_or_else(|| unreachable!("{name} checked at load"))
    }

    pub(crate) fn map_mut(&mut self, name: &'static str) -> &mut aya::maps::Map {
        self.ebpf
            .map_mut(name)
            .unwrap_or_else(|| unreachable!("{name} is in the object"))
    }

    pub(crate) fn classifier(&mut self, name: &'static str) -> &mut SchedClassifier {
        // Every name in programs::ALL was loaded as a classifier by `load`.
        self.ebpf
            .program_mut(name)
            .and_then(|p| p.try_into().ok())
            .unwrap_or_else(|| unreachable!("{name} loaded as a classifier"))
    }

    /// Starts forwarding the kernel programs' aya-log records to this
    /// process's `log` logger. Needs a tokio runtime. Without a log map in the
    /// object (no program logs), this is a no-op.
    pub fn forward_kernel_logs(&mut self) -> std::io::Result<()> {
        let logger = match aya_log::EbpfLogger::init(&mut self.ebpf) {
            Ok(logger) => logger,
            Err(aya_log::Error::MapNotFound) => return Ok(()),
            Err(e) => {
                warn!("kernel log records will not be shown: {e}");
                return Ok(());
            }
        };
        // SAFETY: the logger owns its ring buffer fd and keeps it open for as
        // long as the AsyncFd holds it; flushing never closes or replaces it.
        let mut logger = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
        }?;
        tokio::spawn(async move {
            loop {
                let Ok(mut guard) = logger.readable_mut().await else {
                    return;
                };
                guard.get_inner_mut().flush();
                guard.clear_ready();
            }
        });
        Ok(())
    }
}
