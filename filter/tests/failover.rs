//! Feed failover: the lease holder pulls from `collector.cluster` until it fails
//! `FAILOVER_AFTER` (2) times in a row, then from the next of `collector.failover_clusters`;
//! the index it holds keeps serving meanwhile, and load reports follow the feed.

use serde_json::json;

use crate::common::*;

const STANDBY: &str = "kvroute_collector_standby";

/// Two collectors over the same engines whose indexes differ (the primary has the prompt on
/// `a`, the standby on `b`), so the answer says whose index routed it. The standby's epoch is
/// its own, as two collectors that do not share an event stream have.
fn two_collectors(
    extra: serde_json::Value,
) -> (
    kvroute_host_test::Gateway,
    FakeCollector,
    FakeCollector,
    Vec<u32>,
) {
    let prompt = tokens(0, 64);
    let primary = FakeCollector::new();
    let standby = FakeCollector::new();
    standby.restart(false);
    for (f, holder) in [(&primary, 0), (&standby, 1)] {
        two_instances(f);
        f.hold(holder, &prompt, "default", "m", None, None);
    }
    let mut gw = gateway(&config(extra), 1);
    primary.attach(&mut gw);
    standby.attach_as(&mut gw, STANDBY);
    sync(&mut gw);
    (gw, primary, standby, prompt)
}

#[test]
fn the_feed_moves_to_the_standby_when_the_primary_fails_and_routing_goes_on() {
    // No speculative holders: the test tells the indexes apart by who holds the prompt.
    let (mut gw, primary, standby, prompt) = two_collectors(json!({
        "collector": {"cluster": CLUSTER, "failover_clusters": [STANDBY]},
        "route": {"speculative_ttl_ms": 0},
    }));
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
    assert_eq!(
        standby.pulls(),
        0,
        "the standby is not pulled while the primary answers"
    );
    assert_eq!(gw.metric("kvroute.collector_failovers").unwrap_or(0), 0);

    primary.set_down(true);
    // One failed pull is not enough: a lone reset must not move the feed.
    gw.advance(std::time::Duration::from_millis(SYNC_MS));
    assert_eq!(gw.metric("kvroute.collector_failovers").unwrap_or(0), 0);
    // Meanwhile the index already held still routes.
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
    for _ in 0..3 {
        sync(&mut gw);
    }
    assert_eq!(gw.metric("kvroute.collector_failovers"), Some(1));
    assert!(standby.pulls() > 0);
    // The standby's epoch differs: its snapshot was switched in whole.
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(B));
    assert_eq!(count(&gw, "stale_index"), 0);
    // Load reports follow the feed: the totals come back in the standby's pages.
    let before = standby.reports().len();
    sync(&mut gw);
    assert!(
        standby.reports().len() > before,
        "reports go to the standby"
    );

    // The primary back: the feed stays where it is (no flapping) until the standby fails.
    primary.set_down(false);
    let pulls = primary.pulls();
    for _ in 0..3 {
        sync(&mut gw);
    }
    assert_eq!(primary.pulls(), pulls);
    standby.set_down(true);
    for _ in 0..3 {
        sync(&mut gw);
    }
    assert_eq!(gw.metric("kvroute.collector_failovers"), Some(2));
    assert_eq!(
        gw.metric("kvroute.resyncs"),
        Some(3),
        "each move switched a snapshot in"
    );
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
}

#[test]
fn without_failover_clusters_the_feed_stays_on_its_one_collector() {
    let (mut gw, primary, standby, prompt) = two_collectors(json!({}));
    primary.set_down(true);
    for _ in 0..5 {
        sync(&mut gw);
    }
    assert_eq!(standby.pulls(), 0);
    assert_eq!(gw.metric("kvroute.collector_failovers").unwrap_or(0), 0);
    // The index held keeps serving until it is stale.
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
}
