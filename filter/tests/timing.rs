//! Timing mode: per-phase histograms turned on by the VM configuration, nothing when off.

use kvroute_host_test::Gateway;
use serde_json::json;

use crate::common::*;

const PHASES: [&str; 10] = [
    "header_intake",
    "body_copy",
    "body_intake",
    "hash",
    "state",
    "lookup",
    "decision",
    "books",
    "header_set",
    "release",
];

const PROBES: [&str; 5] = [
    "call_clock",
    "call_header",
    "call_header_map",
    "call_shared_read",
    "call_header_remove",
];

fn gateway_vm(vm_config: &str) -> Result<Gateway, kvroute_host_test::HostError> {
    Gateway::builder(wasm())
        .config(config(json!({})))
        .vm_config(vm_config)
        .plugin_name(PLUGIN)
        .allow_on_headers_stop_iteration(true)
        .workers(2)
        .build()
}

fn routed_gateway(vm_config: &str) -> (Gateway, Vec<u32>) {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(0, &prompt, "default", "m", None, None);
    let mut gw = gateway_vm(vm_config).unwrap_or_else(|e| panic!("gateway: {e}"));
    feed.attach(&mut gw);
    sync(&mut gw);
    (gw, prompt)
}

#[test]
fn every_phase_of_a_routed_request_gets_one_sample_when_on() {
    let (mut gw, prompt) = routed_gateway(r#"{"timing": true}"#);
    for _ in 0..3 {
        let o = complete(&mut gw, "m", &prompt);
        assert_eq!(best(&o), Some(A), "{}", debug(&o));
    }
    assert_eq!(count(&gw, "routed"), 3);
    for p in PHASES {
        let h = gw
            .histogram(&format!("kvroute.timing.{p}_ns"))
            .unwrap_or_else(|| panic!("histogram of {p} defined"));
        assert_eq!(h.len(), 3, "{p}: one sample per request: {h:?}");
    }
    // A request that fails open is timed as far as it went: intake, no lookup.
    let o = complete(&mut gw, "unknown-model", &prompt);
    assert!(o.continued());
    let n = |p: &str| {
        gw.histogram(&format!("kvroute.timing.{p}_ns"))
            .map(|h| h.len())
    };
    assert_eq!(n("body_copy"), Some(4));
    assert_eq!(n("body_intake"), Some(4));
    assert_eq!(n("hash"), Some(3));
    // The host-call probes: one sample each per request, ns per call, apart from the phases.
    for p in PROBES {
        assert_eq!(n(p), Some(4), "{p}");
    }
    assert!(gw.errors().is_empty(), "{:?}", gw.errors());
}

#[test]
fn the_probes_call_the_host_only_in_timing_mode() {
    // Eight calls of each kind per request in timing mode, none without.
    let (mut gw, prompt) = routed_gateway(r#"{"timing": true}"#);
    complete(&mut gw, "m", &prompt);
    let before = gw.hostcalls();
    assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
    let made = |name: &str| {
        gw.hostcalls().get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
    };
    assert_eq!(
        made("proxy_get_header_map_pairs"),
        1 + 8,
        "the whole map, 8 times more"
    );
    assert!(made("proxy_get_header_map_value") >= 8, ":path 8 times");
    let (off, prompt) = routed_gateway("");
    let mut off = off;
    complete(&mut off, "m", &prompt);
    let before = off.hostcalls();
    complete(&mut off, "m", &prompt);
    let pairs = off
        .hostcalls()
        .get("proxy_get_header_map_pairs")
        .copied()
        .unwrap_or(0)
        - before
            .get("proxy_get_header_map_pairs")
            .copied()
            .unwrap_or(0);
    assert_eq!(pairs, 1, "timing off: no probe");
}

#[test]
fn off_by_default_defines_no_timing_metric() {
    for vm_config in ["", "{}", r#"{"timing": false}"#] {
        let (mut gw, prompt) = routed_gateway(vm_config);
        assert_eq!(best(&complete(&mut gw, "m", &prompt)), Some(A));
        let timing: Vec<_> = gw
            .metrics()
            .into_iter()
            .filter(|(name, _, _)| name.starts_with("kvroute.timing."))
            .collect();
        assert!(timing.is_empty(), "{vm_config:?}: {timing:?}");
    }
}

#[test]
fn a_bad_vm_configuration_refuses_to_start() {
    for bad in [r#"{"timng": true}"#, r#"{"timing": 1}"#, "[", "true"] {
        assert!(gateway_vm(bad).is_err(), "{bad:?} must be refused");
    }
}

#[test]
fn cas_mismatches_are_counted_and_none_happen_without_contention() {
    // The test host runs one callback at a time, so no write can lose a race: the counter
    // is defined and stays 0. Under Envoy's worker threads it counts every retry.
    let (mut gw, prompt) = routed_gateway("");
    for _ in 0..4 {
        complete(&mut gw, "m", &prompt);
    }
    assert_eq!(gw.metric("kvroute.cas_mismatches"), Some(0));
}
