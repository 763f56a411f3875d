//! `index.reuse_ms`: a worker reuses the sync state it read for a short window instead of
//! reading it for every request. Shown through what a request does when the state in shared
//! data changes under it (here made stale, so that the change is visible as `stale_index`).

use std::time::Duration;

use kvroute::mirror::SyncState;
use serde_json::json;

use crate::common::*;

/// A synced gateway of two workers with one cached prompt, and the prompt.
fn synced(extra: serde_json::Value) -> (FakeCollector, kvroute_host_test::Gateway, Vec<u32>) {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(extra), 2);
    feed.attach(&mut gw);
    sync(&mut gw);
    (feed, gw, prompt)
}

fn on(gw: &mut kvroute_host_test::Gateway, worker: usize, prompt: &[u32]) -> Option<String> {
    let o = gw
        .request()
        .worker(worker)
        .header("content-type", "application/json")
        .json_body(&json!({"model": "m", "prompt": prompt}))
        .send();
    best(&o).map(str::to_owned)
}

/// Rewrites the sync state as last synced at the epoch: every reader now finds it stale.
fn age_the_state(gw: &mut kvroute_host_test::Gateway) {
    let k = keys();
    let (bytes, _) = gw.shared_data(k.active()).expect("a state");
    let state = SyncState {
        synced_at_ms: 0,
        ..SyncState::decode(&bytes).expect("a state")
    };
    gw.set_shared_data(k.active(), state.encode());
}

#[test]
fn a_worker_reuses_the_state_it_read_within_the_window_only() {
    let (_feed, mut gw, prompt) = synced(json!({}));
    assert_eq!(on(&mut gw, 0, &prompt).as_deref(), Some(A));
    let stale = count(&gw, "stale_index");
    age_the_state(&mut gw);
    // Worker 0 read the state this millisecond: it decides on that read.
    assert_eq!(on(&mut gw, 0, &prompt).as_deref(), Some(A));
    assert_eq!(count(&gw, "stale_index"), stale);
    // Worker 1 has read nothing yet: it reads the aged state and fails open.
    assert_eq!(on(&mut gw, 1, &prompt), None);
    assert_eq!(count(&gw, "stale_index"), stale + 1);
    // 2 ms on (no tick in between), worker 0 reads again.
    gw.advance(Duration::from_millis(2));
    assert_eq!(on(&mut gw, 0, &prompt), None);
    assert_eq!(count(&gw, "stale_index"), stale + 2);
}

#[test]
fn a_window_of_zero_reads_the_state_for_every_request() {
    let (_feed, mut gw, prompt) = synced(json!({"index": {"reuse_ms": 0}}));
    assert_eq!(on(&mut gw, 0, &prompt).as_deref(), Some(A));
    age_the_state(&mut gw);
    assert_eq!(on(&mut gw, 0, &prompt), None);
}
