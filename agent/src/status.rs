//! `ambpf status`: what ambpf has pinned ([`inspect::read_status`]), as a
//! table (`-o wide` adds identifiers), JSON or YAML, in the habit of
//! `kubectl get -o`. Every section is printed, `(none)` when empty.

use std::fmt::{self, Write as _};

use crate::bpf::{PinLayout, inspect};

/// How `status` prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Tables for people.
    #[default]
    Text,
    /// Tables with ids, UIDs, cookies and pin paths.
    Wide,
    Json,
    Yaml,
}

/// Prints the status of `pins`; fails, saying why, where there is no ambpf
/// state to show. A warning about the pinned programs' build goes to stderr.
pub fn print(pins: &PinLayout, output: Output) -> anyhow::Result<()> {
    let status = inspect::read_status(pins)?;
    if let Some(warning) = &status.build.warning {
        eprintln!("warning: {warning}");
    }
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&status)?),
        Output::Yaml => print!("{}", serde_yaml_ng::to_string(&status)?),
        Output::Text => print!("{}", render(&status, false)?),
        Output::Wide => print!("{}", render(&status, true)?),
    }
    Ok(())
}

/// The tables.
pub fn render(status: &inspect::Status, wide: bool) -> Result<String, fmt::Error> {
    let mut out = String::new();
    let f = &mut out;
    writeln!(f, "pin root: {}", status.pin_root.display())?;
    let build = &status.build;
    match (&build.pinned_object_sha256, &build.warning) {
        (_, Some(warning)) => writeln!(f, "programs: WARNING: {warning}")?,
        (Some(digest), None) => writeln!(
            f,
            "programs: BPF object sha256 {}, this ambpf's ({})",
            short(digest, wide),
            build.this_binary.version
        )?,
        (None, None) => {}
    }
    let inbound = match status.inbound {
        crate::bpf::InboundPath::TcAssign => {
            "an earlier agent's tc filters on the pods' interfaces (the agent moves them to \
             sk_lookup links when it starts)"
        }
        crate::bpf::InboundPath::SkLookup => "bpf_sk_assign in each pod's sk_lookup link",
    };
    writeln!(f, "inbound: {}, {inbound}", status.inbound)?;

    let pods: Vec<String> = status
        .pods
        .iter()
        .flat_map(|p| std::iter::once(pod_row(p, wide)).chain(redirected_rows(&p.redirected, wide)))
        .collect();
    section(f, "enrolled pods", &pods)?;
    if !status.redirected_without_pod.is_empty() {
        let rows: Vec<String> = status
            .redirected_without_pod
            .iter()
            .map(|r| {
                format!(
                    "netns cookie {}: {}",
                    r.netns_cookie,
                    redirected_row(&r.connection)
                )
            })
            .collect();
        section(
            f,
            "redirected connections of pods no longer enrolled",
            &rows,
        )?;
    }

    let maps: Vec<String> = status
        .maps
        .iter()
        .map(|m| {
            let mut row = format!("{:<18} {:>7} / {:<7}", m.name, m.entries, m.max_entries);
            if wide {
                row += &format!(" id {:<6} {}", m.id, m.pin.display());
            }
            row
        })
        .collect();
    section(f, "maps (entries / capacity)", &maps)?;

    let links: Vec<String> = status
        .links
        .iter()
        .map(|l| {
            let pin = l.pin.strip_prefix(&status.pin_root).unwrap_or(&l.pin);
            let mut row = format!("{:<48} {}", pin.display(), l.program_name);
            if wide {
                row += &format!(" (link {}, prog {})", l.link_id, l.program_id);
            }
            row
        })
        .collect();
    section(f, "program links", &links)?;

    let tc_links: Vec<String> = status
        .tc_links
        .iter()
        .map(|l| {
            let mut row = format!(
                "netns {:<11} ifindex {:<4} {:<8} {}",
                l.netns_inode, l.ifindex, l.direction, l.program_name
            );
            if wide {
                row += &format!(" (link {}, prog {})", l.link_id, l.program_id);
            }
            row
        })
        .collect();
    section(f, "interface counter links (TCX)", &tc_links)?;

    let counters: Vec<String> = status
        .counters
        .iter()
        .map(|(name, value)| format!("{name:<24} {value:>10}"))
        .collect();
    section(f, "redirection counters", &counters)?;

    let iface_stats: Vec<String> = status
        .iface_stats
        .iter()
        .map(|s| {
            format!(
                "ifindex {:<4} {:<8} {:>10} packets {:>12} bytes",
                s.ifindex, s.direction, s.packets, s.bytes
            )
        })
        .collect();
    section(f, "interface counters", &iface_stats)?;
    Ok(out)
}

/// One pod: who it is, its addresses, DNS capture and inbound capture
/// (`-o wide` adds UID, netns cookie and inode, the link's program id).
fn pod_row(p: &inspect::EnrolledPodEntry, wide: bool) -> String {
    let who = p.pod.as_ref().map_or_else(
        || "(unnamed)".to_owned(),
        |pod| format!("{}/{}", pod.namespace, pod.name),
    );
    let addresses: Vec<String> = p.addresses.iter().map(ToString::to_string).collect();
    let inbound = match (&p.inbound_link, wide) {
        (None, _) => "inbound: NOT CAPTURED (no sk_lookup link)".to_owned(),
        (Some(link), _) if !link.in_pod_netns => {
            "inbound: NOT CAPTURED (its link is in another namespace)".to_owned()
        }
        (Some(link), true) => format!("inbound: link prog {}", link.program_id),
        (Some(_), false) => "inbound: captured".to_owned(),
    };
    let dns = if p.dns_capture { "dns on " } else { "dns off" };
    let mut row = format!("{who:<32} {:<32} {dns} {inbound}", addresses.join(" "));
    if let Some(counters) = &p.counters {
        let counts: Vec<String> = counters
            .named()
            .iter()
            .map(|(name, value)| format!("{name} {value}"))
            .collect();
        row += &format!("  [{}]", counts.join(", "));
    }
    if wide {
        let uid = p.pod.as_ref().map_or("-", |pod| pod.uid.as_str());
        row += &format!(
            "  uid {uid} netns cookie {} inode {}",
            p.netns_cookie, p.netns_inode
        );
    }
    row
}

/// Open redirected connections shown under a pod without `-o wide`.
const REDIRECTED_SHOWN: usize = 5;

/// A pod's open redirected connections, one row each under its own row
/// (the first [`REDIRECTED_SHOWN`] unless wide).
fn redirected_rows(
    connections: &[crate::bpf::redirected::RedirectedConnection],
    wide: bool,
) -> Vec<String> {
    let shown = if wide {
        connections.len()
    } else {
        connections.len().min(REDIRECTED_SHOWN)
    };
    let mut rows: Vec<String> = connections[..shown]
        .iter()
        .map(|c| format!("  {}", redirected_row(c)))
        .collect();
    if shown < connections.len() {
        rows.push(format!(
            "  ... {} more redirected connections (-o wide shows all)",
            connections.len() - shown
        ));
    }
    rows
}

/// What the app and ztunnel each see of one redirected connection.
fn redirected_row(c: &crate::bpf::redirected::RedirectedConnection) -> String {
    format!(
        "redirected: app {} -> {} | ztunnel accepted it on {} from {}, SO_ORIGINAL_DST {}",
        c.app, c.original_destination, c.ztunnel, c.app, c.original_destination
    )
}

fn section(f: &mut String, title: &str, rows: &[String]) -> fmt::Result {
    writeln!(f, "{title}:")?;
    if rows.is_empty() {
        writeln!(f, "  (none)")?;
    }
    for row in rows {
        writeln!(f, "  {}", row.trim_end())?;
    }
    Ok(())
}

/// A digest cut to 12 characters unless wide, as `docker images` does.
fn short(digest: &str, wide: bool) -> &str {
    if wide {
        digest
    } else {
        &digest[..digest.len().min(12)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::{inspect::*, pod_names::PodIdentity, redirected::RedirectedConnection};

    fn status() -> Status {
        Status {
            pin_root: "/sys/fs/bpf/ambpf".into(),
            build: PinnedBuild {
                pinned_object_sha256: Some(crate::build_info::current().bpf_object_sha256.clone()),
                this_binary: crate::build_info::current().clone(),
                warning: None,
            },
            inbound: crate::bpf::InboundPath::SkLookup,
            pods: vec![EnrolledPodEntry {
                pod: Some(PodIdentity {
                    namespace: "shop".into(),
                    name: "web-0".into(),
                    uid: "6f1c".into(),
                }),
                netns_cookie: 4144,
                netns_inode: 4026532318,
                addresses: vec!["10.244.1.2".parse().unwrap()],
                dns_capture: true,
                steering_qdisc_created: false,
                inbound_link: Some(InboundLinkEntry {
                    program_id: 77,
                    in_pod_netns: true,
                }),
                counters: None,
                redirected: vec![RedirectedConnection {
                    app: "10.244.1.2:40312".parse().unwrap(),
                    ztunnel: "10.244.1.2:15001".parse().unwrap(),
                    original_destination: "10.245.0.2:9000".parse().unwrap(),
                }],
            }],
            maps: vec![],
            tc_links: vec![],
            links: vec![],
            counters: vec![("outbound_redirected", 3)],
            iface_stats: vec![],
            redirected_without_pod: vec![],
        }
    }

    #[test]
    fn every_section_shows_and_an_empty_one_says_none() {
        let text = render(&status(), false).unwrap();
        for title in [
            "enrolled pods:",
            "maps (entries / capacity):",
            "program links:",
            "interface counter links (TCX):",
            "redirection counters:",
            "interface counters:",
        ] {
            assert_eq!(text.matches(title).count(), 1, "{title} in\n{text}");
        }
        assert_eq!(text.matches("(none)").count(), 4, "{text}");
        assert!(text.contains("shop/web-0"), "{text}");
        assert!(text.contains("inbound: captured"), "{text}");
        assert!(text.contains("\ninbound: sk-lookup, "), "{text}");
        assert!(!text.contains("4144"), "the cookie is for -o wide:\n{text}");
        assert!(
            text.contains(
                "redirected: app 10.244.1.2:40312 -> 10.245.0.2:9000 | ztunnel accepted it on \
                 10.244.1.2:15001 from 10.244.1.2:40312, SO_ORIGINAL_DST 10.245.0.2:9000"
            ),
            "{text}"
        );
        assert!(!text.contains("no longer enrolled"), "{text}");
    }

    #[test]
    fn only_a_pods_first_redirected_connections_show_unless_wide() {
        let mut status = status();
        let one = status.pods[0].redirected[0];
        status.pods[0].redirected = (0..8)
            .map(|i| RedirectedConnection {
                app: std::net::SocketAddr::new(one.app.ip(), 40000 + i),
                ..one
            })
            .collect();
        let text = render(&status, false).unwrap();
        assert_eq!(
            text.matches("redirected: app").count(),
            REDIRECTED_SHOWN,
            "{text}"
        );
        assert!(text.contains("... 3 more redirected connections"), "{text}");
        let wide = render(&status, true).unwrap();
        assert_eq!(wide.matches("redirected: app").count(), 8, "{wide}");
    }

    #[test]
    fn wide_adds_identifiers() {
        let text = render(&status(), true).unwrap();
        assert!(
            text.contains("uid 6f1c netns cookie 4144 inode 4026532318"),
            "{text}"
        );
        assert!(text.contains("inbound: link prog 77"), "{text}");
    }

    #[test]
    fn json_gives_counters_as_an_object_and_pods_by_name() {
        let json = serde_json::to_value(status()).unwrap();
        assert_eq!(json["counters"]["outbound_redirected"], 3, "{json}");
        assert_eq!(json["pods"][0]["pod"]["namespace"], "shop", "{json}");
        assert_eq!(json["pods"][0]["pod"]["uid"], "6f1c", "{json}");
        let redirected = &json["pods"][0]["redirected"][0];
        assert_eq!(redirected["app"], "10.244.1.2:40312", "{json}");
        assert_eq!(redirected["ztunnel"], "10.244.1.2:15001", "{json}");
        assert_eq!(redirected["original_destination"], "10.245.0.2:9000");
        let yaml: serde_json::Value =
            serde_yaml_ng::from_str(&serde_yaml_ng::to_string(&status()).unwrap()).unwrap();
        assert_eq!(yaml["pods"][0]["pod"]["name"], "web-0");
    }
}
