use std::time::Duration;

use kvroute_host_test::{CalloutReply, Response, StreamState};

use crate::support::*;

/// VM 0 reads a key, VM 1 writes it, VM 0 writes with its stale CAS: VM 0 loses.
#[test]
fn cas_race_between_two_vms() {
    let mut gw = probe("").workers(2);
    gw.cluster_manual("m");
    gw.set_shared_data("n", "0");
    // Worker 0 reads n (and its CAS), then waits on a callout; its body writes with that CAS.
    let a = gw
        .request()
        .worker(0)
        .header("x-cmd", "sget:n;call:m:0")
        .header("x-body-cmd", "scas:n=from-0")
        .body("b")
        .start();
    let b = gw
        .request()
        .worker(1)
        .header("x-cmd", "sset:n=from-1")
        .send();
    assert_eq!(b.header("x-out-sset"), Some("ok"));
    let call = gw.pending_callouts()[0].id;
    gw.reply(call, CalloutReply::Response(Response::ok("")));
    assert_eq!(gw.outcome(a).state, StreamState::Complete);
    assert!(gw.log_contains("out scas=casmismatch"));
    assert_eq!(gw.shared_data("n").unwrap().0, b"from-1");

    // Both see the key missing: no CAS protects an insert, the last writer wins.
    let a = gw
        .request()
        .worker(0)
        .header("x-cmd", "sget:fresh;call:m:0")
        .header("x-body-cmd", "scas:fresh=from-0")
        .body("b")
        .start();
    gw.request()
        .worker(1)
        .header("x-cmd", "sset:fresh=from-1")
        .send();
    let call = gw.pending_callouts()[0].id;
    gw.reply(call, CalloutReply::Response(Response::ok("")));
    assert_eq!(gw.outcome(a).state, StreamState::Complete);
    assert_eq!(gw.shared_data("fresh").unwrap().0, b"from-0");
}

#[test]
fn cas_increments_from_many_vms_all_count() {
    let mut gw = probe("").workers(3);
    for _ in 0..9 {
        gw.request().header("x-cmd", "incr:hits").send();
    }
    assert_eq!(gw.shared_data("hits").unwrap().0, b"9");
}

#[test]
fn ticks_fire_on_every_vm_with_the_test_clock() {
    let mut gw = probe("tick_ms=100").workers(3);
    assert_eq!(gw.tick_period(2), Some(Duration::from_millis(100)));
    gw.advance(Duration::from_millis(99));
    assert_eq!(gw.metric("probe.ticks"), None);
    gw.advance(Duration::from_millis(151));
    assert_eq!(gw.metric("probe.ticks"), Some(6));
    assert_eq!(gw.shared_data("ticks").unwrap().0, b"6");
    let last = String::from_utf8(gw.shared_data("last_tick_nanos").unwrap().0).unwrap();
    assert_eq!(last, (CLOCK_ORIGIN_NANOS + 200_000_000).to_string());
    assert_eq!(gw.now(), Duration::from_millis(250));
}

#[test]
fn shared_queues_notify_the_registering_vm() {
    let mut gw = probe("queue=q").workers(2);
    // Both VMs registered "q"; the last one (worker 1) is told.
    let r = gw
        .request()
        .worker(0)
        .header("x-cmd", "enqueue:q=hello;enqueue:nope=x")
        .send();
    let got: Vec<&[u8]> = r.request_headers.as_ref().unwrap().get_all("x-out-enqueue");
    assert_eq!(got, vec![&b"Ok(())"[..], &b"noqueue"[..]]);
    let item = gw
        .logs()
        .into_iter()
        .find(|l| l.message == "queue item hello")
        .expect("delivered");
    assert_eq!(item.worker, 1);
    assert_eq!(gw.shared_data("queue_last").unwrap().0, b"hello");
    assert!(gw.enqueue("q", "from-test"));
    assert_eq!(gw.shared_data("queue_last").unwrap().0, b"from-test");
    assert_eq!(gw.queue_len("q"), Some(0));
    assert!(!gw.enqueue("other", "x"));
}

#[test]
fn keys_are_counted_and_prefilled() {
    let mut gw = probe("");
    gw.prefill_shared_data((0..1000).map(|i| (format!("k{i}"), vec![1u8; 8])));
    assert_eq!(gw.shared_data_len(), 1000);
    assert_eq!(
        gw.shared_data_bytes(),
        (0..1000).map(|i| format!("k{i}").len() + 8).sum::<usize>()
    );
    assert_eq!(gw.shared_data_keys()[0], "k0");
    let r = gw.request().header("x-cmd", "sget:k999").send();
    assert!(r.header("x-out-sget").unwrap().starts_with("\u{1}"));
}
