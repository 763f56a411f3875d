use kvroute::feed::Op;
use serde_json::json;

use crate::common::*;

#[test]
fn a_client_sent_destination_header_is_always_removed() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(1, &prompt, "default", "m", None, None);
    let mut gw = gateway(&config(json!({})), 1);
    feed.attach(&mut gw);
    // Not synced yet: unrouted (stale), and still stripped.
    let o = gw
        .request()
        .header(DEST, "6.6.6.6:1")
        .json_body(&json!({"model": "m", "prompt": prompt}))
        .send();
    assert!(o.continued());
    assert_eq!(dest(&o), None);
    sync(&mut gw);
    // Routed: overwritten with the filter's choice, never the client's.
    let o = gw
        .request()
        .header(DEST, "6.6.6.6:1")
        .json_body(&json!({"model": "m", "prompt": prompt}))
        .send();
    assert_eq!(best(&o), Some(B));
    assert!(!dest(&o).unwrap_or("").contains("6.6.6.6"));
    // No tokens, no body: stripped.
    let o = gw.request().header(DEST, "6.6.6.6:1").send();
    assert_eq!(dest(&o), None);
    // The filter reads the header map whole and removes the header only when the client
    // sent it: in any case of its name.
    let o = gw
        .request()
        .header(&DEST.to_ascii_uppercase(), "6.6.6.6:1")
        .send();
    assert_eq!(dest(&o), None);
    assert!(o.header(&DEST.to_ascii_uppercase()).is_none());
    // Bad body: stripped.
    let o = gw
        .request()
        .header(DEST, "6.6.6.6:1")
        .header("content-type", "application/json")
        .body("{oops")
        .send();
    assert_eq!(dest(&o), None);
}

#[test]
fn tenant_b_is_never_routed_by_tenant_a_blocks() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.block_size("ta", "m");
    feed.block_size("tb", "m");
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "ta", "m", None, None);
    // Cold requests deferred: a request of another scope must find no hit at all.
    let mut gw = gateway(&config(json!({"route": {"cold": "defer"}})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    let body = json!({"model": "m", "prompt": prompt});
    let o = gw
        .request()
        .header("x-tenant-id", "ta")
        .json_body(&body)
        .send();
    assert_eq!(best(&o), Some(A));
    let before = count(&gw, "deferred");
    let o = gw
        .request()
        .header("x-tenant-id", "tb")
        .json_body(&body)
        .send();
    assert_fail_open(&gw, &o, "deferred", before);
    // No tenant header: the default tenant, which holds nothing either.
    let o = gw.request().json_body(&body).send();
    assert_fail_open(&gw, &o, "deferred", before + 1);
}

#[test]
fn lora_adapters_and_cache_salts_are_scopes_of_their_own() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    feed.push(Op::Alias {
        tenant: "default".into(),
        served: "sql-lora".into(),
        model: "m".into(),
        lora: Some("sql-lora".into()),
    });
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", Some("sql-lora"), None);
    feed.hold(1, &prompt, "default", "m", None, Some("s1"));
    // Cold requests deferred: a request of another scope must find no hit at all.
    let mut gw = gateway(&config(json!({"route": {"cold": "defer"}})), 1);
    feed.attach(&mut gw);
    sync(&mut gw);
    // The adapter's served name resolves through the alias to (m, sql-lora): a.
    let o = complete(&mut gw, "sql-lora", &prompt);
    assert_eq!(best(&o), Some(A));
    // The base model with salt s1: b; with another salt or none: nothing.
    let o = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": prompt, "cache_salt": "s1"}))
        .send();
    assert_eq!(best(&o), Some(B));
    let before = count(&gw, "deferred");
    let o = gw
        .request()
        .json_body(&json!({"model": "m", "prompt": prompt, "cache_salt": "s2"}))
        .send();
    assert_fail_open(&gw, &o, "deferred", before);
    let o = complete(&mut gw, "m", &prompt);
    assert_fail_open(&gw, &o, "deferred", before + 1);
    // The adapter with a salt is yet another scope.
    let o = gw
        .request()
        .json_body(&json!({"model": "sql-lora", "prompt": prompt, "cache_salt": "s1"}))
        .send();
    assert_fail_open(&gw, &o, "deferred", before + 2);
}
