//! What a routed request costs in crossings into the host, counted: a budget. In Envoy's V8 a
//! call that hands the VM a value costs ~1.4 µs, one that does not ~0.5 µs (timing mode's
//! probes, README), a visible share of the filter's CPU (issue 22); this test makes adding one a
//! deliberate change.

use std::collections::BTreeMap;

use kvroute_host_test::Gateway;
use serde_json::json;

use crate::common::*;

/// The hostcalls `f` makes, by import name.
fn crossings(gw: &mut Gateway, f: impl FnOnce(&mut Gateway)) -> BTreeMap<&'static str, u64> {
    let before = gw.hostcalls();
    f(gw);
    gw.hostcalls()
        .into_iter()
        .map(|(k, v)| (k, v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

fn on_worker_0(gw: &mut Gateway, prompt: &[u32]) -> kvroute_host_test::Outcome {
    gw.request()
        .worker(0)
        .header("content-type", "application/json")
        .json_body(&json!({"model": "m", "prompt": prompt}))
        .send()
}

#[test]
fn a_routed_request_stays_within_its_hostcall_budget() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 8192);
    feed.hold(0, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 2);
    feed.attach(&mut gw);
    sync(&mut gw);
    // The first request on a VM reads the worker table and the buckets it bisects.
    let first = crossings(&mut gw, |gw| {
        assert_eq!(best(&on_worker_0(gw, &prompt)), Some(A));
    });
    let reads = first["proxy_get_shared_data"];
    assert!(reads > 5, "the first request reads the buckets: {first:?}");
    // 512 blocks: the bisection reads O(log2 512) buckets, not one per block.
    assert!(reads <= 5 + 2 + 2 * 10, "{first:?}");
    // Warm: the same prompt again, in the same millisecond. Per request: the speculative
    // holders and the load table read (the buckets and the worker table come from the VM's
    // cache while the index is unchanged, the sync state and the fleet totals from its read
    // of the last `index.reuse_ms`); the booking written (the speculative entries of the
    // first request still name the same worker with most of their time to live: not
    // rewritten), then the release (one read, one write: the answer is not streamed).
    let warm = crossings(&mut gw, |gw| {
        assert_eq!(best(&on_worker_0(gw, &prompt)), Some(A));
    });
    let budget: BTreeMap<&str, u64> = [
        ("proxy_get_buffer_bytes", 1),
        // The decision's clock and the release's.
        ("proxy_get_current_time_nanoseconds", 2),
        // The request's headers, whole: content-type, x-token-ids, x-tenant-id, the
        // content-length and the client's destination header (absent: nothing to remove)
        // are looked up in the VM.
        ("proxy_get_header_map_pairs", 1),
        // The response's content-length.
        ("proxy_get_header_map_value", 1),
        ("proxy_get_shared_data", 3),
        ("proxy_increment_metric", 1),
        ("proxy_record_metric", 2),
        // The destination and its runner-up headers.
        ("proxy_replace_header_map_value", 2),
        ("proxy_set_shared_data", 2),
    ]
    .into_iter()
    .collect();
    assert_eq!(warm, budget, "a warm routed request's hostcalls");
    // Past the window the sync state and the fleet totals are read again: two reads more.
    gw.advance(std::time::Duration::from_millis(2));
    let later = crossings(&mut gw, |gw| {
        assert_eq!(best(&on_worker_0(gw, &prompt)), Some(A));
    });
    assert_eq!(later["proxy_get_shared_data"], 5, "{later:?}");
    // Past half the speculative entries' time to live (2 s by default), the decision
    // writes them again.
    gw.advance(std::time::Duration::from_millis(1100));
    let refreshed = crossings(&mut gw, |gw| {
        assert_eq!(best(&on_worker_0(gw, &prompt)), Some(A));
    });
    assert_eq!(refreshed["proxy_set_shared_data"], 3, "{refreshed:?}");
    // A client's destination header costs its removal.
    let sent = crossings(&mut gw, |gw| {
        let o = gw
            .request()
            .worker(0)
            .header(DEST, "6.6.6.6:1")
            .header("content-type", "application/json")
            .json_body(&json!({"model": "m", "prompt": prompt}))
            .send();
        assert_eq!(best(&o), Some(A));
    });
    assert_eq!(
        sent.get("proxy_remove_header_map_value"),
        Some(&1),
        "{sent:?}"
    );
    assert!(gw.errors().is_empty(), "{:?}", gw.errors());
}
