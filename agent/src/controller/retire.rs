//! The controller's side of retiring another mode's capture after a mode
//! change ([`crate::redirect::retire`]): after each pass, the pods this
//! agent holds lose the old capture; the rest are judged by the pass.

use std::collections::HashMap;

use crate::{
    netns::Netns,
    redirect::{
        PodKey,
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

    /// One step of the retirement, after `pass`: the pods this agent holds
    /// lose the old capture; of the others, one the pass wanted but did not
    /// enrol (failed, or its namespace not found) is [`Fate::Pending`], as is
    /// every pod while the source still waits for some pod's namespace; any
    /// other is [`Fate::Unwanted`].
    pub(super) fn retire_step(&mut self, pass: &Pass) {
        let Some(retiring) = &mut self.retiring else {
            return;
        };
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
        if retiring.step(&held, &fate) {
            self.retiring = None;
        }
    }
}
