//! Pod-start race protection: the CNI plugin and the agent's endpoint for it.
//!
//! The `ambpf-cni` binary is chained after the node's network plugin. On
//! ADD it posts the new pod to the agent (`POST /cmdadd` over a unix socket)
//! and fails the pod's network setup unless the agent answers that the pod's
//! redirection is in place and ztunnel has it, or that the pod is not to be
//! enrolled, so an ambient pod never runs unprotected (Istio's CNI plugin
//! does the same).
//!
//! Which pods are enrolled ([`selection`]): with the Kubernetes pod source,
//! the ambient ones, by the pod and its namespace read from the API server;
//! without it, every pod the plugin posts. An enrolled pod stays so until
//! the pod source reports it (and from then on the source decides) or its
//! netns disappears.
//!
//! - [`server`]: the agent's endpoint, handing each pod to be enrolled to the
//!   [`Controller`](crate::controller::Controller).
//! - [`selection`]: which posted pods are enrolled.
//! - [`install`]: puts the plugin into the node's CNI configuration and keeps
//!   it there (woken by [`conf_dir_watch`]); takes it out again.
//! - [`shutdown`]: whether the plugin stays when the installer stops (an
//!   upgrade) or goes with it (an uninstall).

mod conf_dir_watch;
pub mod install;
pub mod selection;
pub mod server;
pub mod shutdown;

use prometheus_client::metrics::counter::Counter;

use serde::{Deserialize, Serialize};

/// What the endpoint answered, for metrics (registered as they are,
/// [`CniStats::register`]); the time it took goes to
/// `ambpf_cni_add_duration_seconds`.
#[derive(Debug, Default)]
pub struct CniStats {
    /// Pods enrolled before their ADD was answered.
    pub enrolled: Counter,
    /// Pods let start without enrolment (not ambient, or deleted meanwhile).
    pub skipped: Counter,
    /// ADDs failed by the agent: enrolment failed or timed out, ztunnel did
    /// not take the pod, the API server could not say whether the pod is
    /// ambient, shutting down.
    pub refused: Counter,
    /// Requests that were not a valid ADD.
    pub invalid: Counter,
}

/// Where the agent's time answering one ADD goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddPhase {
    /// Whether to enrol the pod: the selection (watch caches, or the API
    /// server when they lack the pod).
    Decide,
    /// Waiting for the controller and its enrolment of the pod (redirection
    /// in place, ztunnel's desired set updated).
    Enrol,
    /// Waiting for the newest ztunnel connection to ack the pod's Add
    /// (ztunnel's time to start the pod's proxy, mostly).
    Ztunnel,
    /// From the request read to the answer ready: the three above and the
    /// rest.
    Answer,
}

impl AddPhase {
    pub const ALL: [AddPhase; 4] = [
        AddPhase::Decide,
        AddPhase::Enrol,
        AddPhase::Ztunnel,
        AddPhase::Answer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AddPhase::Decide => "decide",
            AddPhase::Enrol => "enrol",
            AddPhase::Ztunnel => "ztunnel",
            AddPhase::Answer => "answer",
        }
    }
}

impl CniStats {
    /// Counts one answer: a reply, or an error status.
    pub fn count(&self, answer: Result<&CmdAddReply, u16>) {
        let counter = match answer {
            Ok(CmdAddReply::Enrolled) => &self.enrolled,
            Ok(CmdAddReply::Skipped { .. }) => &self.skipped,
            Err(status) if (400..500).contains(&status) => &self.invalid,
            Err(_) => &self.refused,
        };
        counter.inc();
    }

    /// Observes `took` in `phase`'s histogram.
    pub fn time(&self, phase: AddPhase, took: std::time::Duration) {
        crate::metrics::histograms().observe_cni_add(phase.name(), took);
    }

    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        for (name, help, counter) in [
            (
                "cni_adds_enrolled",
                "Pods enrolled before their CNI ADD was answered",
                &self.enrolled,
            ),
            (
                "cni_adds_skipped",
                "CNI ADDs let through without enrolment (pod not ambient or gone)",
                &self.skipped,
            ),
            (
                "cni_adds_refused",
                "CNI ADDs failed by the agent (the pod's network setup fails and is retried)",
                &self.refused,
            ),
            (
                "cni_requests_invalid",
                "Requests to the CNI endpoint that were not a valid ADD",
                &self.invalid,
            ),
        ] {
            registry.register(name, help, counter.clone());
        }
    }
}

/// Why the agent failed a pod's ADD, and whether the runtime should retry
/// it (Istio's node agent types its errors the same way: its
/// `ErrNonRetryableAdd`). A retryable failure is answered `503`, the rest
/// `500`; the plugin reports them with distinct CNI codes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    /// The pod's network namespace cannot be opened: the sandbox is gone.
    #[error("its network namespace cannot be opened: {0}")]
    NetnsUnusable(String),
    /// Its redirection could not be set up (no address, a netlink error).
    #[error("its redirection could not be set up: {0}")]
    Enrol(String),
    /// The pod source says the pod is not ambient; a retried ADD reads the
    /// pod afresh.
    #[error("the pod source knows it as not ambient ({0})")]
    NotAmbient(String),
    /// The API server could not say whether the pod is ambient.
    #[error("cannot tell whether the pod is ambient: {0}")]
    Undecided(String),
    /// Its redirection was in place, but ztunnel did not take the pod; the
    /// redirection was removed again.
    #[error("ztunnel did not take the pod: {0}")]
    Ztunnel(#[from] crate::zds::NotHeld),
    #[error("the agent did not finish within {0:?}")]
    Timeout(std::time::Duration),
    #[error("the agent is shutting down")]
    ShuttingDown,
    /// Another node agent serves ztunnel and has not captured the pod.
    #[error("{0}")]
    StandingBy(String),
}

impl AddError {
    /// Whether a new attempt (the runtime's next sandbox) may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, AddError::NetnsUnusable(_) | AddError::Enrol(_))
    }

    /// The HTTP status the endpoint answers it with.
    pub fn status(&self) -> u16 {
        if self.is_retryable() { 503 } else { 500 }
    }
}

/// Where the agent listens for the plugin.
pub const DEFAULT_SOCKET: &str = "/var/run/ambpf/pluginevent.sock";

/// The plugin's `type` in the conflist, and its binary's name.
pub const PLUGIN_TYPE: &str = "ambpf-cni";

/// The body of `POST /cmdadd`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CmdAdd {
    pub pod_name: String,
    pub pod_namespace: String,
    pub pod_uid: String,
    /// The pod's netns path (`CNI_NETNS`).
    pub netns: String,
    /// The pod's addresses, from the previous plugin's result.
    #[serde(default)]
    pub ips: Vec<std::net::IpAddr>,
}

/// The body of a `200` answer to `POST /cmdadd`. (An agent older than this
/// answered `enrolled` as plain text; the plugin reads anything it cannot
/// parse in a `200` as [`CmdAddReply::Enrolled`].)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "camelCase")]
pub enum CmdAddReply {
    /// The pod's redirection is in place and ztunnel has it.
    Enrolled,
    /// The pod is not enrolled, and should start anyway: it is not ambient,
    /// or it was deleted meanwhile.
    Skipped { reason: String },
}
