//! The agent's log output: `tracing` events and spans as text or JSON lines
//! on stderr, filtered by `--log-level` (RUST_LOG syntax; RUST_LOG when the
//! flag is absent, `info` when neither is given).
//!
//! kube-rs logs through `tracing` and reaches the same output; aya-log's
//! forwarded kernel records are `log` records, bridged in by tracing-log.
//!
//! Every line about a pod runs inside a [`pod_span`]: in text it reads
//! `enrol{pod=ns/name uid=.. netns_cookie=..}: message`, in JSON the same
//! fields are under `"span"` (and every enclosing span under `"spans"`).

use std::fmt;

use tracing_subscriber::{EnvFilter, fmt::MakeWriter};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (for log collectors).
    Json,
}

/// The filter when neither `--log-level` nor RUST_LOG is given.
const DEFAULT_FILTER: &str = "info";

/// A filter that does not parse, with where it came from.
#[derive(Debug)]
pub struct FilterError {
    source: &'static str,
    filter: String,
    why: String,
}

impl fmt::Display for FilterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:?} is not a log filter ({}); expected RUST_LOG syntax, e.g. \
             `info,ambpf::zds=debug`",
            self.source, self.filter, self.why
        )
    }
}

impl std::error::Error for FilterError {}

/// Parses a filter strictly: an unknown level or a malformed directive is
/// an error rather than a silently ignored directive.
pub fn parse_filter(filter: &str) -> Result<EnvFilter, String> {
    EnvFilter::builder()
        .with_regex(false)
        .parse(filter)
        .map_err(|e| e.to_string())
}

/// `--log-level`'s clap parser: refuses a bad filter before the agent starts.
pub fn check_filter(filter: &str) -> Result<String, String> {
    parse_filter(filter).map(|_| filter.to_owned())
}

/// The filter in force: `--log-level`, else RUST_LOG, else `info`. Unless
/// it names kube-rs's watcher, that logs errors only: it warns at every
/// retry of a failing watch, which the pod source reports once itself.
pub fn filter(flag: Option<&str>) -> Result<EnvFilter, FilterError> {
    let (source, mut filter) = match (flag, std::env::var("RUST_LOG")) {
        (Some(flag), _) => ("--log-level", flag.to_owned()),
        (None, Ok(env)) if !env.trim().is_empty() => ("RUST_LOG", env),
        _ => ("default", DEFAULT_FILTER.to_owned()),
    };
    let given = filter.clone();
    if !filter.contains(KUBE_WATCHER) {
        filter = format!("{filter},{KUBE_WATCHER}=error");
    }
    parse_filter(&filter).map_err(|why| FilterError {
        source,
        filter: given,
        why,
    })
}

/// kube-rs's watcher, quieted by [`filter`].
const KUBE_WATCHER: &str = "kube_runtime::watcher";

/// Installs the process-wide subscriber (and the `log` bridge) writing to
/// stderr.
pub fn init(format: LogFormat, flag: Option<&str>) -> Result<(), FilterError> {
    init_with_writer(format, filter(flag)?, std::io::stderr);
    Ok(())
}

/// Installs the process-wide subscriber writing to `writer`. A second call
/// in one process is ignored (the first subscriber stays).
pub fn init_with_writer<W>(format: LogFormat, filter: EnvFilter, writer: W)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false);
    // try_init also installs tracing-log's LogTracer, so `log` records
    // (aya-log's) reach the same output.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}

/// The span of one operation on one pod: every line logged inside carries
/// the pod (`namespace/name`), its UID and its netns cookie.
/// `pod_span!("enrol", namespace, name, uid)` leaves the cookie to be
/// recorded once known (`span.record("netns_cookie", cookie)`); a fifth
/// argument gives it at once.
#[macro_export]
macro_rules! pod_span {
    ($op:literal, $namespace:expr, $name:expr, $uid:expr) => {
        $crate::pod_span!($op, $namespace, $name, $uid, ::tracing::field::Empty)
    };
    ($op:literal, $namespace:expr, $name:expr, $uid:expr, $cookie:expr) => {
        ::tracing::info_span!(
            $op,
            pod = %$crate::logging::PodName(&$namespace, &$name),
            uid = %$uid,
            netns_cookie = $cookie,
        )
    };
}

/// `namespace/name`, as the `pod` field shows it.
pub struct PodName<'a, N: fmt::Display + ?Sized, M: fmt::Display + ?Sized>(pub &'a N, pub &'a M);

impl<N: fmt::Display + ?Sized, M: fmt::Display + ?Sized> fmt::Display for PodName<'_, N, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.0, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_strictly() {
        for good in [
            "info",
            "ambpf::zds=debug",
            "warn,ambpf::zds=debug,kube=info",
        ] {
            parse_filter(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for bad in ["ambpf::zds=loud", "ambpf=debug=x", "ambpf[{=info"] {
            assert!(parse_filter(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn kube_rs_watcher_retries_are_quiet_unless_asked_for() {
        let quiet = filter(Some("info")).unwrap().to_string();
        assert!(quiet.contains("kube_runtime::watcher=error"), "{quiet}");
        let asked = filter(Some("info,kube_runtime::watcher=debug"))
            .unwrap()
            .to_string();
        assert!(!asked.contains("watcher=error"), "{asked}");
        let err = filter(Some("ambpf=loud")).unwrap_err().to_string();
        assert!(
            err.contains("ambpf=loud") && !err.contains("watcher"),
            "{err}"
        );
    }
}
