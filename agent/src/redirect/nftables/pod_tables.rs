//! Writing a pod's tables: created on the pod's first write, rebuilt
//! after; another tool's tables of the same names refuse the pod, but for
//! Istio's node agent's on a node taken over from it, which are replaced in
//! the same transaction.

use tracing::info;

use super::{
    NftablesError, NftablesRedirection, find_pod_tables, pod_script, rules, rules::delete_tables,
};
use crate::{
    netns::Netns,
    redirect::{
        EnrollError,
        in_pod::{ToolError, keep_open_connections},
    },
};

impl NftablesRedirection {
    /// The pod's tables, in one transaction: created on its first write
    /// (refused when another tool's are there), rebuilt after.
    pub(super) fn write_pod(
        &self,
        netns: &Netns,
        cookie: u64,
        dns: bool,
        known: bool,
    ) -> Result<(), EnrollError> {
        let taken_over = !known && self.taken_over.contains(&cookie);
        if taken_over {
            // The tables without their redirects first: from then on every
            // connection is tracked from its first packet, untranslated.
            self.write_script(netns, &rules::pod_script_with(dns, self.ipv6, false), false)?;
            keep_open_connections(netns)?;
        }
        let known = known || taken_over;
        Ok(self.write_script(netns, &pod_script(dns, self.ipv6), known)?)
    }

    /// Writes `script` (a pod's tables); `known`: the tables are this
    /// agent's already, else they are created, and a table of the same name
    /// without ambpf's comment refuses the pod.
    fn write_script(&self, netns: &Netns, script: &str, known: bool) -> Result<(), NftablesError> {
        if known {
            return self.nft.apply(netns, script);
        }
        let fresh = script.replace("add table ", "create table ");
        match self.nft.apply(netns, &fresh) {
            Err(NftablesError::Run(ToolError::Failed { stderr, .. }))
                if stderr.contains("File exists") => {}
            done => return done,
        }
        // A table is there: ambpf's from an earlier agent, or another's.
        let (_, foreign) = find_pod_tables(&self.nft, netns)?;
        if foreign.is_empty() {
            return self.nft.apply(netns, script);
        }
        if !self.replacing_istio {
            return Err(NftablesError::ForeignTables {
                netns: netns.path().to_owned(),
                tables: foreign,
            });
        }
        // Istio's tables out and ambpf's in at once: no packet sees neither.
        // Connections they redirected keep their NAT in conntrack.
        self.nft
            .apply(netns, &format!("{}{script}", delete_tables(&foreign)))?;
        info!(
            "replaced Istio's node agent's tables ({}) in {} with the nftables mode's, in one \
             transaction",
            foreign.join(", "),
            netns.path().display()
        );
        Ok(())
    }
}
