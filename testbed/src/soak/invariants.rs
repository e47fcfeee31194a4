//! The invariants and their bookkeeping.
//!
//! [`Tracker`]: what each pod must come to (held by ztunnel, or gone from
//! it) since when, fed by the driver as it applies events; it times each
//! convergence from the event to the ztunnel double holding the pod (the
//! agent programs a pod's redirection before it hands it to ztunnel) and
//! names a pod that misses the bound. [`Leaks`]: a leftover must be seen in
//! two rounds in a row to count, so a removal in flight during one round is
//! not a leak.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::ztunnel::Workload;

#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub at_s: f64,
    pub kind: &'static str,
    pub detail: String,
}

/// What a pod must come to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Ambient with a live namespace: redirected and held by ztunnel.
    Held,
    /// Not ambient, or deleted: gone from ztunnel and the maps.
    Gone,
    /// Its namespace vanished but its object is still there: either.
    Either,
}

struct Expect {
    label: String,
    inode: u64,
    want: Want,
    since: Instant,
    done: Option<Instant>,
    late: bool,
}

pub struct Tracker {
    start: Instant,
    bound: Duration,
    expects: HashMap<String, Expect>,
    pub enrol_ms: Vec<f64>,
    pub remove_ms: Vec<f64>,
    pub violations: Vec<Violation>,
    /// When each pod was last seen gone from ztunnel as it had to be.
    pub gone_at: HashMap<String, Instant>,
    /// The slowest convergences (to held), slowest first.
    pub slowest: Vec<Slow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Slow {
    pub pod: String,
    pub ms: f64,
    /// When its event happened.
    pub at_s: f64,
}

impl Tracker {
    pub fn new(start: Instant, bound: Duration) -> Self {
        Self {
            start,
            bound,
            expects: HashMap::new(),
            enrol_ms: Vec::new(),
            remove_ms: Vec::new(),
            violations: Vec::new(),
            gone_at: HashMap::new(),
            slowest: Vec::new(),
        }
    }

    pub fn violation(&mut self, kind: &'static str, detail: String) {
        let at_s = self.start.elapsed().as_secs_f64();
        eprintln!("soak: VIOLATION at {at_s:.1} s: {kind}: {detail}");
        self.violations.push(Violation { at_s, kind, detail });
    }

    /// Pod `uid` (netns `inode`) must come to `want`, from `at`. The same
    /// want again changes nothing.
    pub fn want(&mut self, uid: &str, label: &str, inode: u64, want: Want, at: Instant) {
        match self.expects.get(uid) {
            Some(e) if e.want == want && e.inode == inode => return,
            // Never expected in ztunnel: nothing to remove (a pod wrongly
            // enrolled is a leak, found by the check rounds).
            None if want == Want::Gone => return,
            _ => {}
        }
        self.expects.insert(
            uid.to_owned(),
            Expect {
                label: label.to_owned(),
                inode,
                want,
                since: at,
                done: None,
                late: false,
            },
        );
    }

    /// Checks the double's pods against every expectation.
    pub fn observe(&mut self, workloads: &BTreeMap<String, Workload>, now: Instant) {
        let mut finished = Vec::new();
        let mut slow = Vec::new();
        for (uid, e) in &mut self.expects {
            let held = workloads
                .get(uid)
                .is_some_and(|w| w.netns_inode == e.inode && w.proxies_running);
            let met = match e.want {
                Want::Held => held,
                Want::Gone => !workloads.contains_key(uid),
                Want::Either => true,
            };
            match (met, e.done) {
                (true, None) => {
                    e.done = Some(now);
                    let ms = now.saturating_duration_since(e.since).as_secs_f64() * 1e3;
                    match e.want {
                        Want::Held => {
                            self.enrol_ms.push(ms);
                            slow.push(Slow {
                                pod: e.label.clone(),
                                ms,
                                at_s: e.since.saturating_duration_since(self.start).as_secs_f64(),
                            });
                        }
                        Want::Gone => {
                            self.remove_ms.push(ms);
                            finished.push(uid.clone());
                        }
                        Want::Either => {}
                    }
                }
                // Undone later (e.g. ztunnel lost it): the clock restarts.
                (false, Some(_)) => {
                    e.done = None;
                    e.since = now;
                }
                _ => {}
            }
        }
        for uid in finished {
            self.expects.remove(&uid);
            self.gone_at.insert(uid, now);
        }
        if !slow.is_empty() {
            self.slowest.extend(slow);
            self.slowest.sort_by(|a, b| b.ms.total_cmp(&a.ms));
            self.slowest.truncate(5);
        }
    }

    /// Names every pod past the bound (once per expectation).
    pub fn overdue(&mut self, now: Instant) {
        let mut late = Vec::new();
        for (uid, e) in &mut self.expects {
            if e.done.is_none() && !e.late && now.duration_since(e.since) > self.bound {
                e.late = true;
                let what = match e.want {
                    Want::Held => "ambient pod not redirected and held by ztunnel",
                    Want::Gone => "pod not removed from ztunnel",
                    Want::Either => continue,
                };
                late.push(format!(
                    "{what} within {:?}: {} ({uid}, netns {})",
                    self.bound, e.label, e.inode
                ));
            }
        }
        for detail in late {
            self.violation("convergence", detail);
        }
    }

    /// Expectations not yet met.
    pub fn pending(&self) -> usize {
        self.expects
            .values()
            .filter(|e| e.done.is_none() && e.want != Want::Either)
            .count()
    }

    /// Pods held by ztunnel as they must be, and for how long.
    pub fn held_since(&self) -> HashMap<u64, Instant> {
        self.expects
            .values()
            .filter(|e| e.want == Want::Held)
            .filter_map(|e| Some((e.inode, e.done?)))
            .collect()
    }

    /// The pods ztunnel may still hold.
    pub fn accounted_uids(&self) -> HashSet<String> {
        self.expects.keys().cloned().collect()
    }

    /// The netns inodes the agent may still hold state for: pods that must
    /// be held, may be, or are on their way out.
    pub fn accounted_inodes(&self) -> HashSet<u64> {
        self.expects.values().map(|e| e.inode).collect()
    }
}

/// Leftovers seen in consecutive rounds.
#[derive(Default)]
pub struct Leaks {
    last: HashSet<String>,
    reported: HashSet<String>,
}

impl Leaks {
    /// This round's suspects; returns those also seen last round, once each.
    pub fn round(&mut self, suspects: HashSet<String>) -> Vec<String> {
        let confirmed: Vec<String> = suspects
            .iter()
            .filter(|s| self.last.contains(*s) && !self.reported.contains(*s))
            .cloned()
            .collect();
        self.reported.extend(confirmed.iter().cloned());
        self.last = suspects;
        confirmed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(inode: u64) -> Workload {
        Workload {
            name: "p".into(),
            namespace: "n".into(),
            service_account: "s".into(),
            netns_inode: inode,
            proxies_running: true,
        }
    }

    #[test]
    fn convergence_is_timed_and_a_late_pod_is_named_once() {
        let start = Instant::now();
        let mut t = Tracker::new(start, Duration::from_millis(50));
        t.want("a", "ns/a", 7, Want::Held, start);
        t.want("b", "ns/b", 8, Want::Held, start);
        let mut held = BTreeMap::new();
        held.insert("a".to_owned(), workload(7));
        // b is held in another namespace: not what was asked.
        held.insert("b".to_owned(), workload(9));
        t.observe(&held, start + Duration::from_millis(10));
        assert_eq!(t.enrol_ms.len(), 1);
        assert_eq!(t.pending(), 1);
        t.overdue(start + Duration::from_millis(100));
        t.overdue(start + Duration::from_millis(200));
        assert_eq!(t.violations.len(), 1);
        assert!(t.violations[0].detail.contains("ns/b"));
        t.want(
            "a",
            "ns/a",
            7,
            Want::Gone,
            start + Duration::from_millis(300),
        );
        held.remove("a");
        t.observe(&held, start + Duration::from_millis(310));
        assert_eq!(t.remove_ms.len(), 1);
        assert!(!t.accounted_inodes().contains(&7));
    }

    #[test]
    fn a_leak_counts_when_seen_twice_in_a_row() {
        let mut leaks = Leaks::default();
        let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<HashSet<_>>();
        assert!(leaks.round(set(&["x", "y"])).is_empty());
        assert_eq!(leaks.round(set(&["x"])), ["x"]);
        assert!(leaks.round(set(&["x", "y"])).is_empty());
        assert_eq!(leaks.round(set(&["y"])), ["y"]);
    }
}
