//! Other owners' programs on the hooks ambpf uses ([`crate::bpf::foreign`]):
//! the cgroup's, and those on the enrolled pods' interfaces, which are read
//! inside each pod's namespace.

use tracing::warn;

use super::foreign_iface::iface_hooks;
use crate::bpf::{
    PinLayout,
    foreign::{Programs, iface_warnings, own_tcx_programs, scan_cgroup},
};

/// Every program on the hooks ambpf uses under `pins`: its cgroup's, and
/// those of the enrolled pods' interfaces.
pub fn scan(pins: &PinLayout) -> Programs {
    let mut found = scan_cgroup(pins);
    let own_tcx = own_tcx_programs(pins);
    let pods = match super::read_pinned_pods(pins) {
        Ok(pinned) => pinned.pods,
        Err(e) => {
            found.unreadable.push(e.to_string());
            Vec::new()
        }
    };
    for (_, netns) in super::locate_pods(&pods, &[]) {
        let Some(netns) = netns else { continue };
        match netns.run(|| iface_hooks(netns.inode(), &own_tcx)) {
            Ok(Ok(hooks)) => found.interfaces.extend(hooks),
            Ok(Err(e)) => found.unreadable.push(format!(
                "the interfaces of netns {}: {e}",
                netns.path().display()
            )),
            Err(e) => found.unreadable.push(e.to_string()),
        }
    }
    found.interfaces.sort_by_key(|h| (h.netns_inode, h.ifindex));
    found.warnings.extend(iface_warnings(&found.interfaces));
    found
}

/// Logs [`scan`]'s warnings (the agent, at each full state check).
pub fn log_warnings(pins: &PinLayout) {
    let found = scan(pins);
    for warning in &found.warnings {
        warn!("other eBPF programs: {warning}");
    }
    for what in &found.unreadable {
        warn!("listing other eBPF programs: {what}");
    }
}
