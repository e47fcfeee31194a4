//! `/metrics` while the `control` snapshot runs: a scraper thread in the
//! node namespace timing each scrape (as Prometheus would see it: connect
//! to the last byte), optionally recording the series the chart's
//! dashboard queries (`cargo xtask plots` draws them); and the filling of
//! the original-destination maps, so that a scrape is measured with full
//! maps as well as with the pods alone.

use std::{
    io::{Read as _, Write as _},
    sync::atomic::{AtomicBool, Ordering},
};

use super::*;

/// Families the dashboard (charts/ambpf/dashboards/ambpf.json) queries;
/// histograms by their buckets. Per-pod series are not among them.
const DASHBOARD_FAMILIES: &[&str] = &[
    "ambpf_pods_enrolled",
    "ambpf_cni_add_duration_seconds_bucket",
    "ambpf_enrol_duration_seconds_bucket",
    "ambpf_kube_event_to_programmed_seconds_bucket",
    "ambpf_zds_adds_acked_total",
    "ambpf_zds_dels_acked_total",
    "ambpf_zds_nacks_total",
    "ambpf_zds_ack_timeouts_total",
    "ambpf_zds_ack_duration_seconds_bucket",
    "ambpf_state_violations_total",
    "ambpf_origdst_misses_total",
    "ambpf_map_entries",
    "ambpf_map_capacity",
    "ambpf_state_check_duration_seconds_bucket",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
];

/// A recorded sample is kept at most this often (the scrapes themselves
/// are more frequent, to time them).
const RECORD_EVERY: Duration = Duration::from_millis(500);

/// One scrape: when it started (since the agent's spawn) and how long the
/// answer took.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Scrape {
    pub(super) at_s: f64,
    pub(super) ms: f64,
    /// Lines of the answer (the per-pod series make most of them).
    pub(super) lines: usize,
}

/// The dashboard's series over one agent's life: series names once, then
/// each kept scrape's values in that order (NaN: absent in that scrape).
#[derive(Clone, Debug, Default, Serialize)]
pub(super) struct ScrapeSeries {
    pub(super) series: Vec<String>,
    pub(super) scrapes: Vec<RecordedScrape>,
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct RecordedScrape {
    pub(super) at_s: f64,
    pub(super) values: Vec<f64>,
}

#[derive(Default)]
struct Recorded {
    scrapes: Vec<Scrape>,
    series: ScrapeSeries,
    refused: usize,
}

/// A thread scraping the agent's `/metrics` every `interval` until stopped.
pub(super) struct Scraper {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<Recorded>>>,
}

impl Scraper {
    pub(super) fn start(
        node: &Path,
        origin: Instant,
        interval: Duration,
        record: bool,
    ) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let paused = Arc::new(AtomicBool::new(false));
        let pausing = paused.clone();
        let node = File::open(node)?;
        let thread = std::thread::Builder::new()
            .name("scraper".to_owned())
            .spawn(move || -> Result<Recorded> {
                nix::sched::setns(node.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
                let mut out = Recorded::default();
                let mut last_kept: Option<Instant> = None;
                while !stopping.load(Ordering::SeqCst) {
                    let started = Instant::now();
                    if pausing.load(Ordering::SeqCst) {
                        std::thread::sleep(interval);
                        continue;
                    }
                    match scrape_once() {
                        Ok(body) => {
                            out.scrapes.push(Scrape {
                                at_s: started.duration_since(origin).as_secs_f64(),
                                ms: ms(started.elapsed()),
                                lines: body.lines().count(),
                            });
                            if record && last_kept.is_none_or(|t| t.elapsed() >= RECORD_EVERY) {
                                last_kept = Some(started);
                                keep(&mut out.series, origin, started, &body);
                            }
                        }
                        // Not listening yet (the agent is starting).
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                            out.refused += 1;
                        }
                        Err(e) => return Err(anyhow::anyhow!("scraping /metrics: {e}")),
                    }
                    std::thread::sleep(interval.saturating_sub(started.elapsed()));
                }
                Ok(out)
            })?;
        Ok(Self {
            stop,
            paused,
            thread: Some(thread),
        })
    }

    /// Stops (`true`) or resumes scraping.
    pub(super) fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    /// The scrapes so far, the recorded series and the refused connections.
    fn finish(mut self) -> Result<Recorded> {
        self.stop.store(true, Ordering::SeqCst);
        let thread = self.thread.take().context("finished twice")?;
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("the scraper panicked"))?
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn scrape_once() -> std::io::Result<String> {
    let mut conn = std::net::TcpStream::connect(AGENT_METRICS)?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")?;
    let mut body = String::new();
    conn.read_to_string(&mut body)?;
    if !body.starts_with("HTTP/1.1 200") {
        return Err(std::io::Error::other(format!(
            "answered {}",
            body.lines().next().unwrap_or("nothing")
        )));
    }
    Ok(body)
}

/// Adds the dashboard's series of `body` to `series`.
fn keep(series: &mut ScrapeSeries, origin: Instant, at: Instant, body: &str) {
    let mut values = vec![f64::NAN; series.series.len()];
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let family = name.split('{').next().unwrap_or(name);
        if !DASHBOARD_FAMILIES.contains(&family) {
            continue;
        }
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        match series.series.iter().position(|s| s == name) {
            Some(i) => values[i] = value,
            None => {
                series.series.push(name.to_owned());
                values.push(value);
                for earlier in &mut series.scrapes {
                    earlier.values.push(f64::NAN);
                }
            }
        }
    }
    series.scrapes.push(RecordedScrape {
        at_s: at.duration_since(origin).as_secs_f64(),
        values,
    });
}

/// What one snapshot's scrapes showed.
#[derive(Clone, Debug, Default, Serialize)]
pub(super) struct ScrapeFigures {
    /// Spawn → the first answered scrape.
    pub(super) first_answer_ms: Option<f64>,
    /// Scrapes started after the first answer and before every pod was at
    /// ztunnel: the endpoint while the pods are enrolled.
    pub(super) during_enrolment_ms: Option<Stats>,
    /// With every pod enrolled (their per-pod series), the maps as the pods
    /// left them.
    pub(super) enrolled_ms: Option<Stats>,
    /// The same with the original-destination maps filled (eBPF mode).
    pub(super) full_maps_ms: Option<Stats>,
    /// Lines of the last answer with every pod enrolled.
    pub(super) lines: usize,
    /// `ambpf_map_entries / ambpf_map_capacity` by map in the last scrape
    /// with full maps (the agent's count, every 15 s).
    pub(super) map_fill_reported: BTreeMap<String, f64>,
    pub(super) refused: usize,
}

/// Splits `scraper`'s scrapes at the phases' instants (since `origin`):
/// `enrolled` (every pod at ztunnel), `filled` (maps filled, if they were)
/// and `end` (the pods' removal began).
pub(super) fn figures(
    scraper: Scraper,
    origin: Instant,
    enrolled: Instant,
    filled: Option<Instant>,
    end: Instant,
) -> Result<(ScrapeFigures, ScrapeSeries)> {
    let recorded = scraper.finish()?;
    let at = |t: Instant| t.duration_since(origin).as_secs_f64();
    let (enrolled, end) = (at(enrolled), at(end));
    let filled = filled.map(at).unwrap_or(end);
    let first = recorded.scrapes.first().map(|s| s.at_s * 1e3 + s.ms);
    let first_done = first.unwrap_or(f64::INFINITY) / 1e3;
    let within = |from: f64, to: f64| {
        let ms: Vec<f64> = recorded
            .scrapes
            .iter()
            .filter(|s| s.at_s >= from && s.at_s < to)
            .map(|s| s.ms)
            .collect();
        Stats::of(&ms)
    };
    let full_maps_ms = (filled < end).then(|| within(filled, end)).flatten();
    let lines = recorded
        .scrapes
        .iter()
        .rfind(|s| s.at_s < end)
        .map_or(0, |s| s.lines);
    let series = &recorded.series;
    let last_before_end = series.scrapes.iter().rfind(|s| s.at_s < end);
    let mut map_fill_reported = BTreeMap::new();
    if let Some(scrape) = last_before_end.filter(|_| full_maps_ms.is_some()) {
        for (i, name) in series.series.iter().enumerate() {
            let Some(map) = name
                .strip_prefix("ambpf_map_entries{map=\"")
                .and_then(|m| m.strip_suffix("\"}"))
            else {
                continue;
            };
            let capacity = format!("ambpf_map_capacity{{map=\"{map}\"}}");
            if let Some(c) = series.series.iter().position(|s| *s == capacity) {
                map_fill_reported.insert(map.to_owned(), scrape.values[i] / scrape.values[c]);
            }
        }
    }
    Ok((
        ScrapeFigures {
            first_answer_ms: first,
            during_enrolment_ms: within(first_done, enrolled),
            enrolled_ms: within(enrolled, filled),
            full_maps_ms,
            lines,
            map_fill_reported,
            refused: recorded.refused,
        },
        recorded.series,
    ))
}

// ---------------------------------------------------------------------------
// Filling the original-destination maps

/// Share of each original-destination map filled with made-up records
/// (keys no connection has) before the full-maps scrapes.
pub(super) const FILL: f64 = 0.9;

/// Fills the agent's two original-destination LRU maps to [`FILL`] of
/// their capacity, through the bpf syscall on their pins; returns the
/// entries written per map.
pub(super) fn fill_orig_maps(pin_root: &Path) -> Result<BTreeMap<String, u64>> {
    let mut written = BTreeMap::new();
    for name in [
        ambpf_common::maps::ORIG_BY_COOKIE,
        ambpf_common::maps::ORIG_BY_TUPLE,
    ] {
        let path = pin_root.join("maps").join(name);
        let map = bpf::obj_get(&path).with_context(|| format!("opening {}", path.display()))?;
        let (key_size, value_size, max_entries) = bpf::map_sizes(&map)?;
        let n = (f64::from(max_entries) * FILL) as u64;
        let mut key = vec![0u8; key_size];
        let value = vec![0u8; value_size];
        // High bytes set: no real cookie or tuple starts like this.
        for i in 0..n {
            let mut k = (i | 0xa5a5 << 48).to_le_bytes().to_vec();
            k.resize(key_size.max(8), 0);
            key.copy_from_slice(&k[..key_size]);
            bpf::update(&map, &key, &value).with_context(|| format!("writing {name}"))?;
        }
        written.insert(name.to_owned(), n);
    }
    Ok(written)
}

/// The three bpf commands the fill needs (the testbed has no BPF library).
mod bpf {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

    use super::*;

    const BPF_MAP_UPDATE_ELEM: i64 = 2;
    const BPF_OBJ_GET: i64 = 7;
    const BPF_OBJ_GET_INFO_BY_FD: i64 = 15;

    fn bpf(cmd: i64, attr: &mut [u64; 16]) -> std::io::Result<i64> {
        // SAFETY: `attr` is a zeroed bpf_attr-sized buffer whose pointers
        // outlive the call.
        let r = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_bpf,
                cmd,
                attr.as_mut_ptr(),
                size_of_val(attr),
            )
        };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    pub(super) fn obj_get(path: &Path) -> Result<OwnedFd> {
        let path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
        let mut attr = [0u64; 16];
        attr[0] = path.as_ptr() as u64;
        let fd = bpf(BPF_OBJ_GET, &mut attr)?;
        // SAFETY: a new fd the kernel gave us.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    /// Key size, value size and max_entries (bpf_map_info's fields 3-5).
    pub(super) fn map_sizes(map: &OwnedFd) -> Result<(usize, usize, u32)> {
        let mut info = [0u32; 8];
        let mut attr = [0u64; 16];
        attr[0] = map.as_raw_fd() as u64 | (size_of_val(&info) as u64) << 32;
        attr[1] = info.as_mut_ptr() as u64;
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        Ok((info[2] as usize, info[3] as usize, info[4]))
    }

    pub(super) fn update(map: &OwnedFd, key: &[u8], value: &[u8]) -> Result<()> {
        let mut attr = [0u64; 16];
        attr[0] = map.as_raw_fd() as u64;
        attr[1] = key.as_ptr() as u64;
        attr[2] = value.as_ptr() as u64;
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr)?;
        Ok(())
    }
}
