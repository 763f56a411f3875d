use kvroute_host_test::{Gateway, HostError, Mode, StreamState};

use crate::support::*;

#[test]
fn envoy_refuses_the_higress_build() {
    let err = Gateway::load(fixture("fixture_higress"), "").unwrap_err();
    match &err {
        HostError::UnknownImport { module, name } => {
            assert_eq!(module, "env");
            assert!(
                name == "proxy_set_upstream_override_host" || name == "proxy_get_upstream_hosts",
                "{name}"
            );
        }
        other => panic!("expected an unknown import, got {other}"),
    }
}

#[test]
fn higress_overrides_the_host_and_keeps_the_body_flowing() {
    let mut gw = Gateway::builder(fixture("fixture_higress"))
        .mode(Mode::Higress)
        .workers(2)
        .build()
        .unwrap();
    gw.set_upstream_hosts([
        ("10.0.0.1:8000", r#"{"health_status":"Healthy"}"#),
        ("10.0.0.2:8000", r#"{"health_status":"Healthy"}"#),
    ]);
    // No allow_on_headers_stop_iteration: the 0.2.100 marker is what lets the body through.
    let r = gw.request().body("host=10.0.0.2:8000").chunk_size(5).send();
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(r.header("x-override-status"), Some("0"));
    assert_eq!(r.header("x-upstream-hosts"), Some("2"));
    assert_eq!(lines(&gw, "higress body").len(), 4);
}

#[test]
fn higress_without_the_marker_holds_the_body() {
    let mut gw = probe_builder("").higress().build().unwrap();
    let r = gw.request().header("x-body", "buffer").body("abc").send();
    assert!(r.paused());
    assert!(lines(&gw, "body ").is_empty());
}
