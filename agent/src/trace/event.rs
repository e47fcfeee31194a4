//! Trace records as `ambpf trace` prints them: decoded, named, filtered.

use std::{collections::HashMap, net::SocketAddr};

use ambpf_common::{IpKey, TraceDirection, TraceRecord, Verdict, trace::IPPROTO_TCP};
use serde::Serialize;

use crate::redirect::ebpf::ip_addr;

/// One decoded record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    /// Wall-clock time of the decision, ns since the epoch.
    pub time_ns: u64,
    /// `namespace/name`, when known; else the pod is only its netns cookie.
    pub pod: Option<String>,
    pub netns_cookie: u64,
    pub direction: &'static str,
    pub protocol: &'static str,
    pub src: SocketAddr,
    /// Where the connection went.
    pub dst: SocketAddr,
    /// What the app or the peer asked for (`None`: not known, as when the
    /// original destination is missing).
    pub original_dst: Option<SocketAddr>,
    pub verdict: &'static str,
}

#[derive(Debug, thiserror::Error)]
#[error("trace record with unknown {what} {value}: written by other programs than this ambpf's")]
pub struct UnknownField {
    what: &'static str,
    value: u32,
}

fn socket(ip: IpKey, port_be: u16) -> SocketAddr {
    SocketAddr::new(ip_addr(ip), u16::from_be(port_be))
}

impl TraceEvent {
    /// Decodes `record`; `boot_offset_ns` turns its monotonic time into wall
    /// time, `names` gives pods' names by netns cookie.
    pub fn decode(
        record: &TraceRecord,
        boot_offset_ns: u64,
        names: &HashMap<u64, String>,
    ) -> Result<Self, UnknownField> {
        let verdict = Verdict::from_raw(record.verdict).ok_or(UnknownField {
            what: "verdict",
            value: record.verdict,
        })?;
        let direction = TraceDirection::from_raw(record.direction).ok_or(UnknownField {
            what: "direction",
            value: record.direction.into(),
        })?;
        Ok(Self {
            time_ns: record.timestamp_ns.wrapping_add(boot_offset_ns),
            pod: names.get(&record.netns_cookie).cloned(),
            netns_cookie: record.netns_cookie,
            direction: direction.as_str(),
            protocol: if record.protocol == IPPROTO_TCP {
                "tcp"
            } else {
                "udp"
            },
            src: socket(record.src, record.src_port_be),
            dst: socket(record.dst, record.dst_port_be),
            original_dst: (record.orig_dst != IpKey::default())
                .then(|| socket(record.orig_dst, record.orig_port_be)),
            verdict: verdict.as_str(),
        })
    }

    /// The pod as printed: its name, else its netns cookie.
    pub fn pod_label(&self) -> String {
        self.pod
            .clone()
            .unwrap_or_else(|| format!("netns-cookie:{}", self.netns_cookie))
    }

    /// One line: time (UTC), pod, direction, protocol, tuple, original
    /// destination, verdict.
    pub fn line(&self) -> String {
        let secs = self.time_ns / 1_000_000_000;
        let micros = (self.time_ns % 1_000_000_000) / 1_000;
        let day = secs % 86_400;
        let original = self
            .original_dst
            .map_or_else(|| "?".to_owned(), |a| a.to_string());
        format!(
            "{:02}:{:02}:{:02}.{micros:06} {} {} {} {} -> {} orig {} {}",
            day / 3600,
            day / 60 % 60,
            day % 60,
            self.pod_label(),
            self.direction,
            self.protocol,
            self.src,
            self.dst,
            original,
            self.verdict
        )
    }
}

/// Which records to print; empty lists let everything through.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    /// `namespace/name`, or a netns cookie.
    pub pods: Vec<String>,
    pub direction: Option<TraceDirection>,
    pub verdicts: Vec<Verdict>,
}

impl Filter {
    pub fn matches(&self, event: &TraceEvent) -> bool {
        let pod_ok = self.pods.is_empty()
            || self.pods.iter().any(|p| {
                event.pod.as_deref() == Some(p.as_str()) || *p == event.netns_cookie.to_string()
            });
        let direction_ok = self.direction.is_none_or(|d| d.as_str() == event.direction);
        let verdict_ok =
            self.verdicts.is_empty() || self.verdicts.iter().any(|v| v.as_str() == event.verdict);
        pod_ok && direction_ok && verdict_ok
    }
}

/// Parses a verdict name, naming the valid ones when it is none of them.
pub fn parse_verdict(name: &str) -> Result<Verdict, String> {
    Verdict::ALL
        .into_iter()
        .find(|v| v.as_str() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = Verdict::ALL.iter().map(|v| v.as_str()).collect();
            format!("unknown verdict {name:?}; one of: {}", names.join(", "))
        })
}

/// Parses a direction name.
pub fn parse_direction(name: &str) -> Result<TraceDirection, String> {
    TraceDirection::ALL
        .into_iter()
        .find(|d| d.as_str() == name)
        .ok_or_else(|| format!("unknown direction {name:?}; one of: outbound, inbound"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(verdict: Verdict, direction: TraceDirection) -> TraceRecord {
        TraceRecord {
            timestamp_ns: 5_000_000_000,
            netns_cookie: 4144,
            src: IpKey::v4([10, 244, 1, 2]),
            dst: IpKey::v4([127, 0, 0, 1]),
            orig_dst: IpKey::v4([10, 0, 0, 5]),
            src_port_be: 40000u16.to_be(),
            dst_port_be: 15001u16.to_be(),
            orig_port_be: 9000u16.to_be(),
            protocol: IPPROTO_TCP,
            direction: direction as u8,
            verdict: verdict as u32,
            _pad: 0,
        }
    }

    #[test]
    fn records_decode_with_names_and_wall_time() {
        let names = HashMap::from([(4144, "shop/web-0".to_owned())]);
        let event = TraceEvent::decode(
            &record(Verdict::Captured, TraceDirection::Outbound),
            3_600_000_000_000,
            &names,
        )
        .unwrap();
        assert_eq!(event.pod.as_deref(), Some("shop/web-0"));
        assert_eq!(event.src, "10.244.1.2:40000".parse().unwrap());
        assert_eq!(event.original_dst, Some("10.0.0.5:9000".parse().unwrap()));
        assert_eq!(
            event.line(),
            "01:00:05.000000 shop/web-0 outbound tcp 10.244.1.2:40000 -> 127.0.0.1:15001 \
             orig 10.0.0.5:9000 captured"
        );
        let json = serde_json::to_value(&event).unwrap();
        assert_eq!(json["verdict"], "captured");
        assert_eq!(json["original_dst"], "10.0.0.5:9000");
    }

    #[test]
    fn an_unnamed_pod_is_shown_by_cookie_and_a_missing_original_as_unknown() {
        let mut r = record(Verdict::OrigDstMissing, TraceDirection::Outbound);
        r.orig_dst = IpKey::default();
        let event = TraceEvent::decode(&r, 0, &HashMap::new()).unwrap();
        assert_eq!(event.original_dst, None);
        assert!(
            event.line().contains("netns-cookie:4144 outbound tcp")
                && event.line().contains("orig ? orig_dst_missing"),
            "{}",
            event.line()
        );
    }

    #[test]
    fn records_from_unknown_programs_are_refused() {
        let mut r = record(Verdict::Captured, TraceDirection::Outbound);
        r.verdict = 99;
        let err = TraceEvent::decode(&r, 0, &HashMap::new()).unwrap_err();
        assert!(err.to_string().contains("unknown verdict 99"), "{err}");
        r.verdict = 0;
        r.direction = 7;
        assert!(TraceEvent::decode(&r, 0, &HashMap::new()).is_err());
    }

    #[test]
    fn filters_select_by_pod_direction_and_verdict() {
        let names = HashMap::from([(4144, "shop/web-0".to_owned())]);
        let outbound = TraceEvent::decode(
            &record(Verdict::Captured, TraceDirection::Outbound),
            0,
            &names,
        )
        .unwrap();
        let inbound = TraceEvent::decode(
            &record(Verdict::InboundSteered, TraceDirection::Inbound),
            0,
            &HashMap::new(),
        )
        .unwrap();
        assert!(Filter::default().matches(&outbound));
        let by_name = Filter {
            pods: vec!["shop/web-0".into()],
            ..Filter::default()
        };
        assert!(by_name.matches(&outbound));
        assert!(
            !by_name.matches(&inbound),
            "unnamed: only its cookie matches"
        );
        let by_cookie = Filter {
            pods: vec!["4144".into()],
            ..Filter::default()
        };
        assert!(by_cookie.matches(&inbound));
        let inbound_only = Filter {
            direction: Some(TraceDirection::Inbound),
            ..Filter::default()
        };
        assert!(inbound_only.matches(&inbound) && !inbound_only.matches(&outbound));
        let captured = Filter {
            verdicts: vec![parse_verdict("captured").unwrap()],
            ..Filter::default()
        };
        assert!(captured.matches(&outbound) && !captured.matches(&inbound));
    }

    #[test]
    fn bad_filter_values_name_the_valid_ones() {
        let err = parse_verdict("capturd").unwrap_err();
        assert!(err.contains("captured, dns_captured"), "{err}");
        assert!(
            parse_direction("sideways")
                .unwrap_err()
                .contains("outbound, inbound")
        );
        assert_eq!(parse_direction("inbound"), Ok(TraceDirection::Inbound));
    }
}
