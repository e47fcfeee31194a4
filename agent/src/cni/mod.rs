//! Pod-start race protection: the CNI plugin and the agent's endpoint for it.
//!
//! The `ambpf-cni` binary is chained after the node's network plugin. On
//! ADD it posts the new pod to the agent (`POST /cmdadd` over a unix socket)
//! and fails the pod's network setup unless the agent answers that the pod's
//! redirection is in place and ztunnel has it, so an ambient pod never runs
//! unprotected (Istio's CNI plugin does the same).
//!
//! Which pods are ambient: the agent enrols **every** pod the plugin posts.
//! Selecting ambient pods is the plugin configuration's job (chain the plugin
//! only where ambient pods run, e.g. via the installer's target conflist);
//! the agent does not yet check the pod's labels from its informer. A posted
//! pod stays enrolled until the pod source reports it (and from then on the
//! source decides) or its netns disappears.
//!
//! - [`server`]: the agent's endpoint, handing each request to the
//!   [`Controller`](crate::controller::Controller).
//! - [`install`]: puts the plugin into the node's CNI configuration and keeps
//!   it there.

pub mod install;
pub mod server;

use serde::{Deserialize, Serialize};

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
