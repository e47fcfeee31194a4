//! How `ambpf status --check` prints [`Programs`].

use super::{Owner, Programs};

/// [`Programs`] as `ambpf status --check` prints them: each hook's
/// programs in run order, ambpf's marked `*`; hooks with no other owner's
/// program are left out.
pub fn render(found: &Programs) -> String {
    let show = |id: Option<u32>, name: &str, owner: Owner| {
        let mark = if owner == Owner::Ambpf { "*" } else { "" };
        let id = id.map_or_else(|| "?".to_owned(), |id| id.to_string());
        format!("{mark}{id} {name}")
    };
    let mut rows = Vec::new();
    let cgroup = found
        .cgroup
        .as_deref()
        .map_or_else(|| "-".to_owned(), |c| c.display().to_string());
    for hooked in &found.cgroup_hooks {
        let shared =
            hooked.effective.iter().any(|p| p.owner == Owner::Other) || !hooked.below.is_empty();
        if !shared {
            continue;
        }
        let programs: Vec<String> = hooked
            .effective
            .iter()
            .map(|p| show(Some(p.id), &p.name, p.owner))
            .collect();
        rows.push(format!(
            "cgroup {cgroup} {:<26} {}",
            hooked.hook,
            programs.join(", ")
        ));
        for (path, programs) in &hooked.below {
            let programs: Vec<String> = programs
                .iter()
                .map(|p| show(Some(p.id), &p.name, p.owner))
                .collect();
            rows.push(format!(
                "  below, first: cgroup {} {}",
                path.display(),
                programs.join(", ")
            ));
        }
    }
    for hooked in &found.interfaces {
        if !hooked.programs.iter().any(|p| p.owner == Owner::Other) {
            continue;
        }
        let programs: Vec<String> = hooked
            .programs
            .iter()
            .map(|p| {
                let at = match (p.priority, p.handle) {
                    (Some(prio), Some(handle)) => format!("prio {prio} handle {handle:#x} "),
                    _ => String::new(),
                };
                format!("{at}{}", show(p.id, &p.name, p.owner))
            })
            .collect();
        rows.push(format!(
            "netns {} {} {:<11} {}",
            hooked.netns_inode,
            hooked.iface,
            hooked.hook,
            programs.join(", ")
        ));
    }
    if rows.is_empty() {
        return "no other owner's program on ambpf's hooks\n".to_owned();
    }
    let mut out = "other owners' programs on ambpf's hooks (in run order, * ambpf's):\n".to_owned();
    for row in rows {
        out += &format!("  {row}\n");
    }
    out
}
