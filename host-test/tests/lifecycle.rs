use kvroute_host_test::{Gateway, HostError, Response, StreamState};

use crate::support::*;

#[test]
fn callbacks_run_in_envoy_order() {
    let mut gw = probe("");
    let r = gw.request().path("/x").send();
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.context_id, 2, "root context is 1");
    assert_eq!(
        context_log(&gw, 0, 2),
        vec![
            "request_headers 4 true",
            "response_headers 1 true",
            "on_log 2",
            "on_done 2",
            "drop 2"
        ]
    );
    assert_eq!(r.status(), Some(200));
    assert_eq!(
        r.response.unwrap().headers.get("x-probe-saw-status"),
        Some("200")
    );
}

#[test]
fn vm_start_and_configure_get_their_configuration() {
    let gw = probe_builder("a=b").vm_config("vm-cfg").build().unwrap();
    assert!(gw.log_contains("vm_start 1 vm-cfg"));
    assert!(gw.log_contains("configured a=b"));
}

#[test]
fn a_false_on_configure_is_a_configuration_error() {
    let err = probe_builder("reject").build().unwrap_err();
    assert_eq!(err, HostError::ConfigurationRejected);
}

#[test]
fn every_worker_starts_and_requests_go_round_robin() {
    let mut gw = probe("").workers(3);
    assert_eq!(gw.worker_count(), 3);
    assert_eq!(lines(&gw, "configured").len(), 3);
    let workers: Vec<usize> = (0..4).map(|_| gw.request().send().worker).collect();
    assert_eq!(workers, vec![0, 1, 2, 0]);
    assert_eq!(gw.request().worker(2).send().worker, 2);
    assert_eq!(
        gw.metric("probe.requests"),
        Some(5),
        "stats are process-wide"
    );
}

#[test]
fn request_trailers_are_delivered_and_forwarded() {
    let mut gw = probe("");
    let r = gw.request().body("abc").trailer("x-trailer", "t").send();
    let log = context_log(&gw, 0, r.context_id);
    assert_eq!(
        &log[..3],
        &["request_headers 5 false", "body 3 false", "trailers 1 t"]
    );
    assert_eq!(r.request_body, b"abc");
    let trailers = r.request_trailers.unwrap();
    assert_eq!(trailers.get("x-trailer-seen"), Some("1"));
}

#[test]
fn a_held_response_keeps_the_stream_open() {
    let mut gw = probe("");
    let id = gw.request().hold_response().start();
    let r = gw.outcome(id);
    assert_eq!(r.state, StreamState::AwaitingResponse);
    assert!(r.continued());
    assert!(!gw.log_contains("on_log"));
    assert!(gw.respond(id, Response::new(201).body("made")));
    let r = gw.outcome(id);
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.response.unwrap().body, b"made");
    assert!(gw.log_contains("on_log 2"));
    assert!(!gw.respond(id, Response::new(200)));
}

#[test]
fn the_upstream_sees_the_request_as_it_left_the_filter() {
    let mut gw = probe("");
    gw.set_upstream(|req| Response::ok(req.headers.get("x-a").unwrap_or("none").to_string()));
    let r = gw.request().header("x-cmd", "set:x-a=from-filter").send();
    assert_eq!(r.response.unwrap().body, b"from-filter");
}

#[test]
fn a_client_reset_ends_the_stream() {
    let mut gw = probe("");
    let id = gw.request().header("x-cmd", "pause").start();
    assert!(gw.outcome(id).paused());
    gw.reset(id);
    assert_eq!(gw.outcome(id).state, StreamState::Reset);
    assert!(gw.log_contains("on_done 2"));
}

#[test]
fn load_accepts_a_path() {
    let gw = Gateway::load(fixture("fixture_probe"), "").unwrap();
    assert_eq!(gw.worker_count(), 1);
}
