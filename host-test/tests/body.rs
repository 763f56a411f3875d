use kvroute_host_test::{CalloutReply, Response, StreamState};

use crate::support::*;

fn body_lines(gw: &kvroute_host_test::Gateway) -> Vec<String> {
    lines(gw, "body ")
}

#[test]
fn pause_from_headers_without_the_knob_stops_the_body_too() {
    let mut gw = probe("");
    gw.cluster_manual("m");
    // The headers callback pauses on a callout; Envoy (StopAllIterationAndWatermark) then
    // holds the body, arriving here in 3-byte chunks, away from the filter.
    let id = gw
        .request()
        .header("x-cmd", "call:m:0")
        .body("abcdefghi")
        .chunk_size(3)
        .start();
    assert!(gw.outcome(id).paused());
    assert!(body_lines(&gw).is_empty(), "{:?}", body_lines(&gw));
    let call = gw.pending_callouts()[0].id;
    assert!(gw.reply(call, CalloutReply::Response(Response::ok("pong"))));
    // On continue, the filter gets what Envoy buffered, as one chunk.
    assert_eq!(body_lines(&gw), vec!["body 9 true"]);
    let r = gw.outcome(id);
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.request_body, b"abcdefghi");
    assert_eq!(
        r.header("x-out-call-body"),
        Some("pong"),
        "headers were held until the call returned"
    );
}

#[test]
fn pause_from_headers_without_the_knob_never_delivers_the_body() {
    let mut gw = probe("");
    let r = gw.request().header("x-body", "buffer").body("abc").send();
    assert!(r.paused());
    assert!(body_lines(&gw).is_empty());
}

#[test]
fn with_the_knob_the_body_flows_and_accumulates_while_paused() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .build()
        .unwrap();
    let r = gw
        .request()
        .header("x-body", "buffer")
        .body("0123456789")
        .chunk_size(4)
        .send();
    assert_eq!(
        body_lines(&gw),
        vec!["body 4 false", "body 8 false", "body 10 true"]
    );
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(
        r.header("x-body-len"),
        Some("10"),
        "the header was set while the headers were held"
    );
    assert_eq!(
        r.header("x-body-sum"),
        Some(
            b"0123456789"
                .iter()
                .map(|b| *b as u32)
                .sum::<u32>()
                .to_string()
                .as_str()
        )
    );
    assert_eq!(r.request_body, b"0123456789");
    assert_eq!(gw.histogram("probe.body_bytes"), Some(vec![10]));
}

#[test]
fn body_continue_before_the_end_lets_the_rest_stream_through() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .build()
        .unwrap();
    let body = vec![b'x'; 10];
    let r = gw
        .request()
        .header("x-body", "continue-at:4")
        .body(body.clone())
        .chunk_size(3)
        .send();
    // 3 (pause) → 6 ≥ 4: continue, which forwards the buffer; accumulation starts again.
    assert_eq!(
        body_lines(&gw),
        vec![
            "body 3 false",
            "body 6 false",
            "body 3 false",
            "body 4 true"
        ]
    );
    assert_eq!(r.request_body, body);
    assert!(r.continued());
}

#[test]
fn buffering_past_the_limit_gets_413() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .build()
        .unwrap();
    let body = vec![b'7'; 3 * 1024 * 1024];
    let r = gw
        .request()
        .header("x-body", "buffer")
        .body(body)
        .chunk_size(512 * 1024)
        .send();
    let local = r.local_response.clone().expect("local reply");
    assert_eq!((local.status, local.from_filter), (413, false));
    assert_eq!(local.details, "request_payload_too_large");
    assert_eq!(r.status(), Some(413));
    assert!(!r.continued());
    // 512 KiB, 1 MiB (at the limit, fine), 1.5 MiB (over): then Envoy answers.
    assert_eq!(body_lines(&gw).len(), 3);
    assert_eq!(
        r.response.unwrap().headers.get("x-probe-saw-status"),
        Some("413")
    );
}

#[test]
fn a_filter_that_gives_up_buffering_avoids_413() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .build()
        .unwrap();
    let body = vec![b'7'; 3 * 1024 * 1024];
    let r = gw
        .request()
        .header("x-body", "continue-at:1000000")
        .body(body.clone())
        .chunk_size(512 * 1024)
        .send();
    assert!(r.local_response.is_none());
    assert_eq!(r.status(), Some(200));
    assert_eq!(r.request_body.len(), body.len());
}

#[test]
fn the_limit_is_configurable_and_inclusive() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .buffer_limit_bytes(1000)
        .build()
        .unwrap();
    let r = gw
        .request()
        .header("x-body", "pause")
        .body(vec![1u8; 1000])
        .send();
    assert!(r.paused() && r.local_response.is_none());
    let r = gw
        .request()
        .header("x-body", "pause")
        .body(vec![1u8; 1001])
        .send();
    assert_eq!(r.status(), Some(413));
}

#[test]
fn the_filter_can_replace_the_body() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .build()
        .unwrap();
    let r = gw
        .request()
        .header("x-body", "replace")
        .body("original body")
        .chunk_size(5)
        .send();
    assert_eq!(r.request_body, b"replaced");
}

#[test]
fn buffer_status_reports_the_buffered_size() {
    let mut gw = probe_builder("")
        .allow_on_headers_stop_iteration(true)
        .build()
        .unwrap();
    let r = gw
        .request()
        .header("x-body", "buffer")
        .header("x-body-cmd", "bodystatus")
        .body("12345")
        .send();
    assert!(
        gw.log_contains("out bodystatus=0:5"),
        "{:?}",
        lines(&gw, "out")
    );
    assert_eq!(r.header("x-out-bodystatus"), Some("0:5"));
}

#[test]
fn response_body_buffering_and_rewriting() {
    let mut gw = probe("");
    let r = gw
        .request()
        .header("x-resp-cmd", "upper")
        .upstream_response(Response::ok("hello world"))
        .send();
    assert_eq!(r.response.unwrap().body, b"HELLO WORLD");
}

#[test]
fn a_paused_response_waits() {
    let mut gw = probe("");
    let r = gw.request().header("x-resp-cmd", "pause").send();
    assert_eq!(r.state, StreamState::ResponsePaused);
    assert!(r.continued());
    assert!(r.response.is_none());
}

#[test]
fn a_local_reply_from_the_response_replaces_it() {
    let mut gw = probe("");
    let r = gw.request().header("x-resp-cmd", "local").send();
    let resp = r.response.unwrap();
    assert_eq!(
        (resp.status, resp.body.as_slice()),
        (502, &b"replaced by filter"[..])
    );
    assert_eq!(r.state, StreamState::Complete);
}
