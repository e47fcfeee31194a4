//! The iptables mode's pods of the records ([`crate::redirect::in_pod::records`]):
//! adopting an earlier agent's pods, and removing them.

use std::{io, net::IpAddr, path::PathBuf};

use tracing::{info, warn};

use super::{IptablesRedirection, PodKey, node::remove_pod_rules};
use crate::{
    netns::Netns,
    redirect::{EnrollError, in_pod::records::PodRecords, podnet},
};

impl IptablesRedirection {
    /// Records each pod this agent enrols under `dir` (and forgets it there
    /// when it is removed), and adopts the pods recorded there by an earlier
    /// agent: they are listed as enrolled until this agent enrols them again
    /// or removes them. Without a usable `dir` the agent runs on, saying
    /// that no record is kept.
    pub fn with_records(mut self, dir: PathBuf) -> Self {
        let (records, adopted) = PodRecords::adopt(dir);
        self.records = records;
        self.adopted = adopted;
        self
    }

    /// Records the enrolled pod `key`, no longer an adopted one.
    pub(super) fn record(&mut self, key: PodKey) {
        self.adopted.remove(&key.netns_cookie);
        if let Some(records) = &self.records {
            records.write(key);
        }
    }

    pub(super) fn forget(&mut self, key: PodKey) {
        if let Some(records) = &self.records {
            records.remove(key);
        }
    }

    /// Forgets a deleted pod as Istio's node agent does: its probe ipset
    /// members go (over netlink), nothing is done inside its namespace,
    /// which dies with the pod (no process is started). A pod an earlier
    /// agent enrolled is removed as [`Self::unenroll_adopted`] does.
    pub(super) fn forget_deleted_pod(&mut self, key: PodKey) -> Result<bool, EnrollError> {
        let cookie = key.netns_cookie;
        let Some(entry) = self.pods.get(&cookie) else {
            return self.unenroll_adopted(key);
        };
        let addresses = entry.addresses.clone();
        self.release_probe_addresses(cookie, &addresses)?;
        if let Some(entry) = self.pods.remove(&cookie) {
            info!(
                "forgot the deleted pod in {} ({key}); its namespace keeps its rules until it goes",
                entry.netns.path().display()
            );
            self.forget(entry.key);
        }
        Ok(true)
    }

    /// Removes a pod an earlier agent enrolled: the probe ipset members that
    /// name it (unless an enrolled pod has claimed the address since), then
    /// everything in its namespace, as Istio's `DeleteInpodRules` does (the
    /// reply path too: this agent's ztunnel never proxied for it). Returns
    /// whether it was such a pod.
    pub(super) fn unenroll_adopted(&mut self, key: PodKey) -> Result<bool, EnrollError> {
        let cookie = key.netns_cookie;
        let Some(pod) = self.adopted.get(&cookie) else {
            return Ok(false);
        };
        let key = pod.key;
        self.release_adopted_members(cookie)?;
        let pod = &self.adopted[&cookie];
        match &pod.netns {
            Some(netns) => {
                if let Err(e) = remove_pod_rules(netns) {
                    let torn_down = podnet::inspect(netns).is_ok_and(|n| n.interfaces.is_empty());
                    if !torn_down {
                        return Err(e);
                    }
                    warn!(
                        "forgetting pod in {} (its network is gone): {e}",
                        netns.path().display()
                    );
                }
                info!(
                    "removed the iptables rules and policy routing of {} ({key}), enrolled by \
                     an earlier agent",
                    netns.path().display()
                );
            }
            None => info!("forgetting the pod with {key}, enrolled by an earlier agent: gone"),
        }
        self.adopted.remove(&cookie);
        self.forget(key);
        Ok(true)
    }

    fn release_adopted_members(&self, cookie: u64) -> Result<(), EnrollError> {
        for family in self.tools.families.keys().copied() {
            let members: Vec<IpAddr> = self
                .probe_members(family)?
                .into_iter()
                .filter(|m| m.netns_cookie == Some(cookie))
                .map(|m| m.address)
                .filter(|ip| self.claims.owner(ip).is_none())
                .collect();
            for ip in members {
                self.probe_set_del(ip)?;
            }
        }
        Ok(())
    }

    /// Whether the pod `cookie` is one an earlier agent enrolled, pending.
    pub(super) fn is_adopted(&self, cookie: u64) -> bool {
        self.adopted.contains_key(&cookie)
    }

    /// The adopted pods' namespaces that are still there.
    pub(super) fn adopted_netns(&self) -> impl Iterator<Item = &Netns> {
        self.adopted.values().filter_map(|pod| pod.netns.as_ref())
    }

    pub(super) fn adopted_keys(&self) -> impl Iterator<Item = PodKey> + '_ {
        self.adopted.values().map(|pod| pod.key)
    }

    /// Removes the records, after an uninstall.
    pub(super) fn remove_records(&self) -> io::Result<()> {
        self.records.as_ref().map_or(Ok(()), PodRecords::remove_all)
    }
}
