//! The controller's side of retiring another mode's capture after a mode
//! change ([`crate::redirect::retire`]), or Istio's node agent's after a
//! takeover ([`crate::redirect::istio_agent`]): after each pass, the pods
//! this agent holds lose the old capture; the rest are judged by the pass.

use std::collections::HashMap;

use crate::{
    netns::Netns,
    redirect::{
        PodKey,
        istio_agent::IstioRetirement,
        retire::{Fate, Retirement},
    },
};

use super::{Controller, Pass};

impl Controller {
    /// Retires `retirement`'s modes from the next pass on, as this agent's
    /// own mode takes each pod over.
    pub fn retire_previous(&mut self, retirement: Retirement) {
        self.retiring = Some(retirement);
    }

    /// Takes Istio's node agent's capture out of each pod from the next
    /// pass on, as this agent holds it.
    pub fn retire_istio_agent(&mut self, retirement: IstioRetirement) {
        self.retiring_istio = Some(retirement);
    }

    /// In the eBPF mode, readies every pod for the rules of Istio's node
    /// agent while one of its pods (`agents`) is on the node.
    pub(super) fn ready_for_istio(&mut self, agents: &std::collections::BTreeSet<String>) {
        if self.redirection.mode() != crate::redirect::RedirectMode::Ebpf {
            return;
        }
        let pods = self
            .enrolled
            .values()
            .map(|e| (e.key.netns_cookie, &e.netns));
        self.istio_arrival.step(agents, pods);
    }

    /// One step of the retirement, after `pass`: the pods this agent holds
    /// lose the old capture; of the others, one the pass wanted but did not
    /// enrol (failed, or its namespace not found) is [`Fate::Pending`], as is
    /// every pod while the source still waits for some pod's namespace; any
    /// other is [`Fate::Unwanted`].
    pub(super) fn retire_step(&mut self, pass: &Pass) {
        if self.retiring.is_none() && self.retiring_istio.is_none() {
            return;
        }
        let held: HashMap<u64, &Netns> = self
            .enrolled
            .values()
            .map(|e| (e.key.netns_cookie, &e.netns))
            .collect();
        let settled = self.source_settled;
        let fate = |key: PodKey| {
            if !settled
                || pass.wanted_cookies.contains(&key.netns_cookie)
                || pass.failed_inodes.contains(&key.netns_inode)
            {
                Fate::Pending
            } else {
                Fate::Unwanted
            }
        };
        if let Some(retiring) = &mut self.retiring
            && retiring.step(&held, &fate)
        {
            self.retiring = None;
        }
        let waiting = !settled || !pass.failed_inodes.is_empty();
        if let Some(istio) = &mut self.retiring_istio
            && istio.step(&held, waiting)
        {
            self.retiring_istio = None;
        }
    }
}
