//! Where the agent learns which pods on this node are ambient.
//!
//! Every source feeds the same [`crate::zds::ZdsHandle`]; everything after
//! the source is shared.

pub mod local;
