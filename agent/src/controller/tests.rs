use tokio::sync::oneshot;

use ambpf_testbed::NetnsGuard;

use super::*;
use crate::{
    cni::AddError,
    redirect::recorder::Recorder,
    zds::{NetnsSource, ZdsConfig},
};

fn spec(uid: &str, ns: &NetnsGuard, dns: Option<bool>) -> PodSpec {
    PodSpec {
        workload: Workload {
            uid: uid.into(),
            name: uid.into(),
            namespace: "shop".into(),
            service_account: "default".into(),
            netns: NetnsSource::Path(ns.path()),
            netns_inode: None,
        },
        dns_capture: dns,
    }
}

fn inode(ns: &NetnsGuard) -> u64 {
    Netns::open(ns.name()).unwrap().inode()
}

fn controller(recorder: Recorder, node_dns: bool) -> (Controller, ZdsHandle) {
    let zds = ZdsHandle::new(ZdsConfig::default());
    (
        Controller::new(Box::new(recorder), zds.clone(), node_dns),
        zds,
    )
}

#[test]
fn pods_are_enrolled_once_then_handed_to_ztunnel_and_removed_when_gone() {
    let (a, b) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);

    let report = ctl.apply(&[spec("a", &a, None), spec("b", &b, Some(false))]);
    assert_eq!((report.enrolled, report.removed), (2, 0));
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a", "b"]);
    // A second pass with nothing new does nothing.
    assert_eq!(
        ctl.apply(&[spec("a", &a, None), spec("b", &b, Some(false))]),
        PassReport::default()
    );

    let report = ctl.apply(&[spec("b", &b, Some(false))]);
    assert_eq!((report.enrolled, report.removed), (0, 1));
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["b"]);
    assert_eq!(
        *log.lock().unwrap(),
        [
            format!("enroll {} dns=true", inode(&a)),
            format!("enroll {} dns=false", inode(&b)),
            format!("unenroll {}", inode(&a)),
        ]
    );
}

#[test]
fn a_pod_whose_netns_path_dies_with_its_process_stays_enrolled_and_with_ztunnel() {
    let a = NetnsGuard::create("ctl").unwrap();
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    ctl.apply(&[spec("a", &a, None)]);
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

    // The source names the namespace by a process that has just exited
    // (a container restart); the namespace itself lives on.
    let mut gone = spec("a", &a, None);
    gone.workload.netns = NetnsSource::Path("/proc/0/ns/net".into());
    let report = ctl.apply(&[gone]);
    assert_eq!(report, PassReport::default());
    assert_eq!(zds.workloads()["a"].netns, NetnsSource::Path(a.path()));

    // The next pass names the new process: nothing to redo.
    assert_eq!(ctl.apply(&[spec("a", &a, None)]), PassReport::default());
    assert_eq!(
        *log.lock().unwrap(),
        [format!("enroll {} dns=true", inode(&a))],
        "the pod was never removed"
    );
}

#[test]
fn node_dns_setting_overrides_pods_and_a_change_re_enrols() {
    let a = NetnsGuard::create("ctl").unwrap();
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, _zds) = controller(recorder, false);
    ctl.apply(&[spec("a", &a, Some(true))]);
    ctl.node_dns_capture = true;
    ctl.apply(&[spec("a", &a, Some(true))]);
    assert_eq!(
        *log.lock().unwrap(),
        [
            format!("enroll {} dns=false", inode(&a)),
            format!("enroll {} dns=true", inode(&a))
        ]
    );
}

#[test]
fn a_pod_that_cannot_be_enrolled_is_kept_from_ztunnel_and_the_rest_proceed() {
    let (a, b) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    recorder.refuse.lock().unwrap().insert(inode(&a));
    let (mut ctl, zds) = controller(recorder, true);
    let mut missing = spec("gone", &a, None);
    missing.workload.netns = NetnsSource::Path("/run/netns/ambpf-no-such-pod".into());

    let report = ctl.apply(&[spec("a", &a, None), spec("b", &b, None), missing]);
    assert_eq!(report.enrolled, 1);
    assert_eq!(report.failed.keys().collect::<Vec<_>>(), ["a", "gone"]);
    assert!(
        report.failed["gone"].contains("does not exist"),
        "{:?}",
        report.failed
    );
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["b"]);
}

#[test]
fn pods_left_enrolled_by_an_earlier_agent_are_reconciled_not_recreated() {
    let (kept, stale) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    recorder
        .enrolled
        .lock()
        .unwrap()
        .extend([inode(&kept), inode(&stale)]);
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);

    let report = ctl.apply(&[spec("kept", &kept, None)]);
    assert_eq!(report.removed, 1);
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["kept"]);
    let log = log.lock().unwrap();
    assert!(
        log.contains(&format!("unenroll {}", inode(&stale))),
        "{log:?}"
    );
    assert!(
        !log.iter()
            .any(|l| l == &format!("unenroll {}", inode(&kept))),
        "{log:?}"
    );
}

#[test]
fn programmed_pods_are_reported_after_each_pass_that_changes_them() {
    let (a, b) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    recorder.refuse.lock().unwrap().insert(inode(&b));
    let (mut ctl, _zds) = controller(recorder, true);
    let (tx, mut rx) = watch::channel(Arc::default());
    ctl.report_programmed(tx);

    // The first pass reports even an empty set.
    ctl.apply(&[]);
    assert!(rx.has_changed().unwrap());
    assert!(rx.borrow_and_update().programmed.is_empty());

    // Only pods that were enrolled and handed to ztunnel count.
    ctl.apply(&[spec("a", &a, None), spec("b", &b, None)]);
    assert!(rx.has_changed().unwrap());
    let programmed = rx.borrow_and_update().programmed.clone();
    assert_eq!(programmed.iter().collect::<Vec<_>>(), ["a"]);
    ctl.apply(&[spec("a", &a, None), spec("b", &b, None)]);
    assert!(!rx.has_changed().unwrap());

    ctl.apply(&[]);
    assert!(rx.borrow_and_update().programmed.is_empty());
}

#[test]
fn a_cni_pod_ztunnel_did_not_take_is_held_back_until_enrolled_or_dropped() {
    let (first, second) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let (mut ctl, _zds) = controller(Recorder::default(), true);
    let (tx, rx) = watch::channel(Arc::default());
    ctl.report_programmed(tx);
    let held_back = || rx.borrow().held_back.iter().cloned().collect::<Vec<_>>();
    enrolled_by_cni(&mut ctl, vec![spec("a", &first, None)]);
    let (failed, _) = abandon("a", Some(inode(&first)));
    ctl.apply_requests(&SourcePods::default(), vec![failed]);
    assert_eq!(held_back(), ["a"]);
    assert!(rx.borrow().programmed.is_empty());

    // The runtime's retry, with a new sandbox, programs it.
    enrolled_by_cni(&mut ctl, vec![spec("a", &second, None)]);
    assert!(held_back().is_empty());
    assert_eq!(rx.borrow().programmed.iter().collect::<Vec<_>>(), ["a"]);

    // Held back again, then the source learns of the pod and drops it.
    let (failed, _) = abandon("a", None);
    ctl.apply_requests(&SourcePods::default(), vec![failed]);
    assert_eq!(held_back(), ["a"]);
    let mut waiting = SourcePods::default();
    waiting.waiting.insert("a".to_owned());
    let pods = ctl.desired(&waiting);
    ctl.apply(&pods);
    assert_eq!(held_back(), ["a"]);
    let pods = ctl.desired(&SourcePods::default());
    ctl.apply(&pods);
    assert!(held_back().is_empty());
}

fn ambient(pods: Vec<PodSpec>) -> SourcePods {
    SourcePods {
        ambient: pods,
        ..Default::default()
    }
}

/// A source that knows `uids` as not ambient (with a reason each).
fn knows_not_ambient(pods: Vec<PodSpec>, uids: &[&str]) -> SourcePods {
    SourcePods {
        ambient: pods,
        not_ambient: uids
            .iter()
            .map(|uid| ((*uid).to_owned(), "labelled dataplane-mode=none".to_owned()))
            .collect(),
        ..Default::default()
    }
}

type Answer = oneshot::Receiver<Result<CniEnrolled, AddError>>;

fn request(pod: PodSpec) -> (CniRequest, Answer) {
    let (reply, answer) = oneshot::channel();
    (EnrollRequest { pod, reply }.into(), answer)
}

fn abandon(uid: &str, netns_inode: Option<u64>) -> (CniRequest, oneshot::Receiver<()>) {
    let (reply, done) = oneshot::channel();
    let request = AbandonRequest {
        uid: uid.to_owned(),
        netns_inode,
        reply,
    };
    (CniRequest::Abandon(request), done)
}

/// A CNI ADD costs its own pod's enrolment: the other pods wait for the
/// next full pass (one the source wants enrolled, one it no longer wants),
/// while ztunnel's set and the programmed report gain the posted pod.
#[test]
fn a_cni_add_programs_only_its_own_pod_and_the_next_pass_the_rest() {
    let (a, b, c) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    let (tx, mut rx) = watch::channel(Arc::default());
    ctl.report_programmed(tx);
    ctl.apply(&[spec("a", &a, None)]);

    // The source now wants "b" and no longer "a"; "c" is posted.
    let source = SourcePods {
        ambient: vec![spec("b", &b, None)],
        ..SourcePods::default()
    };
    let (req_c, mut ans_c) = request(spec("c", &c, None));
    ctl.apply_requests(&source, vec![req_c]);
    assert_eq!(
        ans_c.try_recv().unwrap(),
        Ok(CniEnrolled {
            netns_inode: inode(&c)
        })
    );
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a", "c"]);
    assert_eq!(zds.workloads()["c"].netns_inode, Some(inode(&c)));
    let programmed = rx.borrow_and_update().programmed.clone();
    assert_eq!(programmed.iter().collect::<Vec<_>>(), ["a", "c"]);
    // Where the runtime put "c" goes to the source, so it need not scan
    // for it; "a" came from the source itself.
    let named_c = RuntimeNetns {
        path: c.path(),
        inode: inode(&c),
    };
    assert_eq!(
        rx.borrow().runtime_netns,
        BTreeMap::from([("c".to_owned(), named_c.clone())])
    );

    let pods = ctl.desired(&source);
    let report = ctl.apply(&pods);
    assert_eq!((report.enrolled, report.removed), (1, 1));
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["b", "c"]);
    let programmed = rx.borrow_and_update().programmed.clone();
    assert_eq!(programmed.iter().collect::<Vec<_>>(), ["b", "c"]);

    // Once the source reports "c" in the same namespace (by another path),
    // the runtime's path is still what names it.
    let held = std::fs::File::open(c.path()).unwrap();
    let mut c_from_source = spec("c", &c, None);
    let other_path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&held));
    c_from_source.workload.netns = NetnsSource::Path(other_path.into());
    let source = SourcePods {
        ambient: vec![spec("b", &b, None), c_from_source],
        ..SourcePods::default()
    };
    let pods = ctl.desired(&source);
    ctl.apply(&pods);
    assert!(!ctl.explicit.contains_key("c"));
    assert_eq!(
        rx.borrow().runtime_netns,
        BTreeMap::from([("c".to_owned(), named_c)])
    );
    assert_eq!(
        *log.lock().unwrap(),
        [
            format!("enroll {} dns=true", inode(&a)),
            format!("enroll {} dns=true", inode(&c)),
            format!("enroll {} dns=true", inode(&b)),
            format!("unenroll {}", inode(&a)),
        ]
    );
}

#[test]
fn a_cni_add_is_enrolled_at_once_and_kept_until_the_source_reports_it() {
    let (a, b) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    recorder.refuse.lock().unwrap().insert(inode(&b));
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);

    let (req_a, mut ans_a) = request(spec("a", &a, None));
    let (req_b, mut ans_b) = request(spec("b", &b, None));
    let mut missing = spec("gone", &a, None);
    missing.workload.netns = NetnsSource::Path("/run/netns/ambpf-no-such-pod".into());
    let (req_gone, mut ans_gone) = request(missing);
    ctl.apply_requests(&SourcePods::default(), vec![req_a, req_b, req_gone]);
    let enrolled_a = CniEnrolled {
        netns_inode: inode(&a),
    };
    assert_eq!(ans_a.try_recv().unwrap(), Ok(enrolled_a));
    let refused_b = ans_b.try_recv().unwrap().unwrap_err();
    assert!(matches!(refused_b, AddError::Enrol(_)), "{refused_b}");
    assert!(!refused_b.is_retryable());
    let gone = ans_gone.try_recv().unwrap().unwrap_err();
    assert!(matches!(gone, AddError::NetnsUnusable(_)), "{gone}");
    assert!(gone.to_string().contains("does not exist"), "{gone}");
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

    // A source pass that does not know "a" yet keeps it.
    let pods = ctl.desired(&SourcePods::default());
    ctl.apply(&pods);
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);
    // Once the source reports it, the source decides.
    let pods = ctl.desired(&ambient(vec![spec("a", &a, None)]));
    assert!(ctl.explicit.is_empty());
    ctl.apply(&pods);
    let pods = ctl.desired(&SourcePods::default());
    ctl.apply(&pods);
    assert!(zds.workloads().is_empty());
    assert_eq!(
        log.lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("enroll"))
            .count(),
        2,
        "a once, b refused: {:?}",
        log.lock().unwrap()
    );
}

/// A pod's sandbox re-created (same UID, a new namespace) while the source
/// still reports the old one: the CNI ADD's namespace is enrolled, answered
/// and handed to ztunnel (by its inode), and stays the pod's until the
/// source names the same namespace.
#[test]
fn a_recreated_sandbox_is_enrolled_and_handed_over_while_the_source_names_the_old_one() {
    let (old, new) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let (mut ctl, zds) = controller(Recorder::default(), true);
    let stale = ambient(vec![spec("a", &old, None)]);
    let pods = ctl.desired(&stale);
    ctl.apply(&pods);
    assert_eq!(zds.workloads()["a"].netns_inode, Some(inode(&old)));

    let (req, mut answer) = request(spec("a", &new, None));
    ctl.apply_requests(&stale, vec![req]);
    let enrolled = CniEnrolled {
        netns_inode: inode(&new),
    };
    assert_eq!(answer.try_recv().unwrap(), Ok(enrolled));
    assert_eq!(zds.workloads()["a"].netns_inode, Some(inode(&new)));
    // The next passes over the stale source keep the new namespace.
    let pods = ctl.desired(&stale);
    ctl.apply(&pods);
    assert_eq!(zds.workloads()["a"].netns_inode, Some(inode(&new)));
    // Once the source names the new one, it decides again.
    let pods = ctl.desired(&ambient(vec![spec("a", &new, None)]));
    assert!(ctl.explicit.is_empty());
    ctl.apply(&pods);
    assert_eq!(zds.workloads()["a"].netns_inode, Some(inode(&new)));
}

/// Pod "a" is still enrolled (never removed) and in ztunnel's set.
fn assert_still_held(zds: &ZdsHandle, log: &std::sync::Mutex<Vec<String>>) {
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);
    let log = log.lock().unwrap();
    assert!(!log.iter().any(|l| l.starts_with("unenroll")), "{log:?}");
}

/// An enrolled pod the source briefly cannot resolve (listed as waiting)
/// keeps its capture and its place with ztunnel.
#[test]
fn a_pod_the_source_briefly_cannot_resolve_keeps_its_capture() {
    let a = NetnsGuard::create("ctl").unwrap();
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    let pods = ctl.desired(&ambient(vec![spec("a", &a, None)]));
    ctl.apply(&pods);
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

    let mut waiting = SourcePods {
        absent_means_deleted: true,
        ..SourcePods::default()
    };
    waiting.waiting.insert("a".to_owned());
    let pods = ctl.desired(&waiting);
    let report = ctl.apply(&pods);
    assert_eq!(report.removed, 0);
    assert_still_held(&zds, &log);
}

/// A pod that fails to be enrolled again (its DNS setting changed) keeps its
/// previous redirection and its place in ztunnel together.
#[test]
fn a_failed_enrolment_again_keeps_the_capture_and_ztunnels_proxy_together() {
    let a = NetnsGuard::create("ctl").unwrap();
    let recorder = Recorder::default();
    let (refuse, log) = (recorder.refuse.clone(), recorder.log.clone());
    let (mut ctl, zds) = controller(recorder, true);
    ctl.apply(&[spec("a", &a, Some(true))]);
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

    refuse.lock().unwrap().insert(inode(&a));
    let report = ctl.apply(&[spec("a", &a, Some(false))]);
    assert!(report.failed.contains_key("a"), "{report:?}");
    assert_eq!(report.removed, 0);
    assert_still_held(&zds, &log);
}

fn enrolled_by_cni(ctl: &mut Controller, pods: Vec<PodSpec>) {
    let (requests, answers): (Vec<_>, Vec<_>) = pods.into_iter().map(request).unzip();
    ctl.apply_requests(&SourcePods::default(), requests);
    for mut answer in answers {
        assert!(answer.try_recv().unwrap().is_ok());
    }
}

#[test]
fn a_cni_pod_the_source_knows_as_not_ambient_is_removed() {
    let (opted_out, other) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    enrolled_by_cni(
        &mut ctl,
        vec![
            spec("opted-out", &opted_out, None),
            spec("other", &other, None),
        ],
    );
    assert_eq!(
        zds.workloads().keys().collect::<Vec<_>>(),
        ["opted-out", "other"]
    );

    // The source now knows "opted-out" and does not enrol it; "other"
    // it has not seen.
    let source = knows_not_ambient(vec![], &["opted-out"]);
    let pods = ctl.desired(&source);
    let report = ctl.apply(&pods);
    assert_eq!(report.removed, 1);
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["other"]);
    assert_eq!(ctl.explicit.keys().collect::<Vec<_>>(), ["other"]);
    assert_eq!(
        log.lock().unwrap().last(),
        Some(&format!("unenroll {}", inode(&opted_out)))
    );
    // Later passes do not bring it back.
    let pods = ctl.desired(&source);
    assert_eq!(ctl.apply(&pods), PassReport::default());
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["other"]);
}

#[test]
fn a_cni_pod_the_source_has_not_seen_or_has_no_netns_for_is_kept() {
    let (unseen, pending, known) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    enrolled_by_cni(
        &mut ctl,
        vec![
            spec("unseen", &unseen, None),
            spec("pending", &pending, None),
        ],
    );

    // "unseen" is not on the source's lists; "pending" is ambient and
    // waiting for its netns to be found. The source knows other pods,
    // ambient and not.
    let mut source = knows_not_ambient(vec![spec("known", &known, None)], &["someone-else"]);
    source.waiting.insert("pending".to_owned());
    for _ in 0..2 {
        let pods = ctl.desired(&source);
        let report = ctl.apply(&pods);
        assert_eq!(report.removed, 0);
        assert_eq!(
            zds.workloads().keys().collect::<Vec<_>>(),
            ["known", "pending", "unseen"]
        );
    }
    assert_eq!(
        ctl.explicit.keys().collect::<Vec<_>>(),
        ["pending", "unseen"]
    );
    assert!(
        !log.lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with("unenroll")),
        "{:?}",
        log.lock().unwrap()
    );

    // "pending" is deleted (its sandbox may still be there): it leaves
    // at once; "unseen", which the source never knew, stays.
    source.waiting.clear();
    let pods = ctl.desired(&source);
    assert_eq!(ctl.apply(&pods).removed, 1);
    assert_eq!(
        zds.workloads().keys().collect::<Vec<_>>(),
        ["known", "unseen"]
    );
    assert_eq!(ctl.explicit.keys().collect::<Vec<_>>(), ["unseen"]);
    assert_eq!(
        log.lock().unwrap().last(),
        Some(&format!("unenroll {}", inode(&pending)))
    );
}

#[test]
fn a_cni_add_of_a_pod_the_source_knows_as_not_ambient_is_refused_with_why() {
    let a = NetnsGuard::create("ctl").unwrap();
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    let (req, mut answer) = request(spec("a", &a, None));
    ctl.apply_requests(&knows_not_ambient(vec![], &["a"]), vec![req]);
    let why = answer.try_recv().unwrap().unwrap_err();
    assert!(why.is_retryable(), "a retried ADD reads the pod afresh");
    assert!(
        why.to_string()
            .contains("not ambient (labelled dataplane-mode=none)"),
        "{why}"
    );
    assert!(zds.workloads().is_empty());
    assert!(ctl.explicit.is_empty());
    assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
}

#[test]
fn an_abandoned_cni_pod_is_removed_unless_a_newer_sandbox_or_the_source_has_it() {
    let (first, second) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, zds) = controller(recorder, true);
    enrolled_by_cni(&mut ctl, vec![spec("a", &first, None)]);

    // The runtime retried with a new sandbox before the first ADD's
    // failure arrived: abandoning the first namespace leaves the second.
    let (retried, mut answer) = request(spec("a", &second, None));
    let (stale, mut stale_done) = abandon("a", Some(inode(&first)));
    ctl.apply_requests(&SourcePods::default(), vec![retried, stale]);
    assert!(answer.try_recv().unwrap().is_ok());
    assert_eq!(stale_done.try_recv(), Ok(()));
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["a"]);

    // Abandoning the current one removes it, in the kernel and in ztunnel.
    let (current, mut done) = abandon("a", Some(inode(&second)));
    ctl.apply_requests(&SourcePods::default(), vec![current]);
    assert_eq!(done.try_recv(), Ok(()));
    assert!(zds.workloads().is_empty());
    assert!(ctl.explicit.is_empty());
    assert_eq!(
        log.lock().unwrap().last().unwrap(),
        &format!("unenroll {}", inode(&second))
    );

    // A pod the source reports stays: the source decides for it.
    enrolled_by_cni(&mut ctl, vec![spec("b", &first, None)]);
    let source = ambient(vec![spec("b", &first, None)]);
    let pods = ctl.desired(&source);
    ctl.apply(&pods);
    let (reported, mut done) = abandon("b", None);
    ctl.apply_requests(&source, vec![reported]);
    assert_eq!(done.try_recv(), Ok(()));
    assert_eq!(zds.workloads().keys().collect::<Vec<_>>(), ["b"]);
}

#[test]
fn a_deleted_pod_is_forgotten_and_one_that_left_the_mesh_unenrolled() {
    let (deleted, opted_out, listed_out) = (
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
        NetnsGuard::create("ctl").unwrap(),
    );
    let recorder = Recorder::default();
    let log = recorder.log.clone();
    let (mut ctl, _zds) = controller(recorder, true);
    let all = vec![
        spec("deleted", &deleted, None),
        spec("opted-out", &opted_out, None),
    ];
    let source = SourcePods {
        ambient: all,
        absent_means_deleted: true,
        ..Default::default()
    };
    let pods = ctl.desired(&source);
    ctl.apply(&pods);
    // The Kubernetes source: "deleted" is in no list any more, "opted-out"
    // is known as not ambient.
    let mut after = SourcePods {
        absent_means_deleted: true,
        ..Default::default()
    };
    after
        .not_ambient
        .insert("opted-out".to_owned(), "labelled none".to_owned());
    let pods = ctl.desired(&after);
    ctl.apply(&pods);
    let removals: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| !l.starts_with("enroll"))
        .cloned()
        .collect();
    assert_eq!(
        removals,
        [
            format!("forget deleted {}", inode(&deleted)),
            format!("unenroll {}", inode(&opted_out)),
        ]
    );

    // A pods file lists only the pods to enrol: one dropped from it may
    // have left the mesh, and is unenrolled.
    let file = SourcePods {
        ambient: vec![spec("listed", &listed_out, None)],
        ..Default::default()
    };
    let pods = ctl.desired(&file);
    ctl.apply(&pods);
    let pods = ctl.desired(&SourcePods::default());
    ctl.apply(&pods);
    assert_eq!(
        log.lock().unwrap().last().unwrap(),
        &format!("unenroll {}", inode(&listed_out))
    );
}
