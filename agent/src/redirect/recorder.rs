//! A redirection that only records what it is asked, for tests of what
//! decides (the controller, the pod sources); the real modes are tested in
//! tests/redirect.rs. The netns inode stands in for the cookie.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
};

use super::{
    CheckScope, EnrollError, EnrollOptions, EnrolledPod, PodKey, PodRedirection, RedirectMode,
    Violation,
};
use crate::netns::Netns;

#[derive(Default)]
pub struct Recorder {
    /// What was asked, in order: `enroll <inode> dns=<bool>`, `unenroll <inode>`,
    /// `forget deleted <inode>`.
    pub log: Arc<Mutex<Vec<String>>>,
    /// The netns inodes of the pods enrolled now.
    pub enrolled: Arc<Mutex<BTreeSet<u64>>>,
    /// Netns inodes whose enrolment fails (as a pod with no address does);
    /// shared, so a test can make a pod fail after it was enrolled.
    pub refuse: Arc<Mutex<BTreeSet<u64>>>,
}

impl PodRedirection for Recorder {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Ebpf
    }

    fn enroll(
        &mut self,
        netns: &Netns,
        options: EnrollOptions,
    ) -> Result<EnrolledPod, EnrollError> {
        self.log.lock().unwrap().push(format!(
            "enroll {} dns={}",
            netns.inode(),
            options.dns_capture
        ));
        if self.refuse.lock().unwrap().contains(&netns.inode()) {
            return Err(EnrollError::NoAddress {
                netns: netns.path().to_owned(),
            });
        }
        self.enrolled.lock().unwrap().insert(netns.inode());
        Ok(EnrolledPod {
            netns: netns.path().to_owned(),
            netns_inode: netns.inode(),
            netns_cookie: netns.inode(),
            addresses: vec![],
            interfaces: vec![],
            dns_capture: options.dns_capture,
            conflicts: vec![],
            steps: Default::default(),
        })
    }

    fn forget_deleted(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("forget deleted {}", pod.netns_inode));
        Ok(self.enrolled.lock().unwrap().remove(&pod.netns_cookie))
    }

    fn unenroll(&mut self, pod: PodKey) -> Result<bool, EnrollError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("unenroll {}", pod.netns_inode));
        Ok(self.enrolled.lock().unwrap().remove(&pod.netns_cookie))
    }

    fn enrolled(&mut self) -> Result<Vec<PodKey>, EnrollError> {
        Ok(self
            .enrolled
            .lock()
            .unwrap()
            .iter()
            .map(|&inode| PodKey {
                netns_cookie: inode,
                netns_inode: inode,
            })
            .collect())
    }

    fn check(&mut self, _pods: &[(PodKey, &Netns)], _scope: CheckScope) -> Vec<Violation> {
        Vec::new()
    }

    fn repair(&mut self, _violations: &[Violation]) -> Vec<PodKey> {
        Vec::new()
    }
}
