//! Where the agent learns which pods on this node are ambient.
//!
//! Every source feeds the same [`crate::zds::ZdsHandle`], through the
//! controller's watch channel of [`crate::controller::SourcePods`]: the full
//! set of ambient pods, and the pods the source knows are not to be enrolled;
//! everything after the source is shared.
//!
//! - [`local`]: a JSON file, for running without Kubernetes.
//! - [`kube`]: the API server, as Istio's node agent does.

pub mod kube;
pub mod local;
