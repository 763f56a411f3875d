use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use kvroute_host_test::{CalloutReply, Response, StreamState};

use crate::support::*;

#[test]
fn a_closure_answers_and_the_request_resumes() {
    let mut gw = probe("");
    gw.cluster("c", |call| {
        CalloutReply::Response(Response::ok(format!(
            "pong:{}",
            String::from_utf8_lossy(&call.body)
        )))
    });
    let r = gw.request().header("x-cmd", "call:c:100:/v1/q").send();
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.header("x-out-call-status"), Some("200"));
    assert_eq!(r.header("x-out-call-body"), Some("pong:ping"));
    let calls = gw.callouts();
    assert_eq!(calls.len(), 1);
    let c = &calls[0];
    assert_eq!(
        (c.cluster.as_str(), c.method(), c.path()),
        ("c", "POST", "/v1/q")
    );
    assert_eq!(c.headers.get("x-from"), Some("probe"));
    assert_eq!(c.timeout, Some(Duration::from_millis(100)));
    assert_eq!(c.context_id, r.context_id);
    assert!(gw.pending_callouts().is_empty());
}

#[test]
fn unknown_clusters_and_missing_pseudo_headers_are_bad_arguments() {
    let mut gw = probe("");
    gw.cluster("c", |_| CalloutReply::Response(Response::ok("")));
    let r = gw
        .request()
        .header("x-cmd", "call:nope:100;badcall:c")
        .send();
    assert_eq!(r.header("x-out-call"), Some("err:BadArgument"));
    assert_eq!(r.header("x-out-badcall"), Some("Err(BadArgument)"));
    assert!(gw.callouts().is_empty());
}

#[test]
fn manual_callouts_wait_for_the_test() {
    let mut gw = probe("");
    gw.cluster_manual("m");
    let id = gw.request().header("x-cmd", "call:m:0").start();
    assert!(gw.outcome(id).paused());
    let pending = gw.pending_callouts();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].timeout, None);
    gw.advance(Duration::from_secs(3600));
    assert!(gw.outcome(id).paused(), "no timeout, no answer");
    let reply = Response::new(201)
        .header("x-a", "b")
        .body("late")
        .trailer("t", "1");
    assert!(gw.reply(pending[0].id, CalloutReply::Response(reply)));
    let r = gw.outcome(id);
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.header("x-out-call-status"), Some("201"));
    assert_eq!(r.header("x-out-call-headers"), Some("2"));
    assert!(gw.log_contains("call response 1 201 2 4 1"));
    assert!(
        !gw.reply(pending[0].id, CalloutReply::Reset),
        "already answered"
    );
}

#[test]
fn a_callout_times_out_on_the_test_clock() {
    let mut gw = probe("");
    gw.cluster_manual("m");
    let id = gw.request().header("x-cmd", "call:m:100").start();
    gw.advance(Duration::from_millis(99));
    assert!(gw.outcome(id).paused());
    gw.advance(Duration::from_millis(1));
    let r = gw.outcome(id);
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(r.header("x-out-call-status"), Some("504"));
    assert_eq!(
        r.header("x-out-call-body"),
        Some("upstream request timeout")
    );
}

#[test]
fn a_closure_can_leave_a_callout_to_its_timeout() {
    let mut gw = probe("");
    gw.cluster("slow", |_| CalloutReply::NoReply);
    let id = gw.request().header("x-cmd", "call:slow:20").start();
    assert!(gw.outcome(id).paused());
    gw.advance(Duration::from_millis(20));
    assert_eq!(gw.outcome(id).header("x-out-call-status"), Some("504"));
}

#[test]
fn a_reset_is_a_failed_call() {
    let mut gw = probe("");
    gw.cluster("c", |_| CalloutReply::Reset);
    let r = gw.request().header("x-cmd", "call:c:100").send();
    assert_eq!(r.header("x-out-call-status"), Some("none"));
    assert_eq!(r.header("x-out-call-headers"), Some("0"));
    assert_eq!(
        r.header("x-out-call-grpc-status"),
        Some("(11, Some(\"reset\"))")
    );
}

#[test]
fn callouts_of_a_finished_stream_are_cancelled() {
    let mut gw = probe("");
    gw.cluster_manual("m");
    let r = gw.request().header("x-cmd", "call-nopause:m:0").send();
    assert_eq!(r.state, StreamState::Complete);
    assert_eq!(gw.callouts().len(), 1);
    assert!(gw.pending_callouts().is_empty());
}

#[test]
fn forwarded_to_a_loopback_server() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut request_line = String::new();
        reader.read_line(&mut request_line).unwrap();
        let mut len = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line.trim().is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        reader.read_exact(&mut body).unwrap();
        tx.send((request_line, body)).unwrap();
        let mut stream = stream;
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-server: yes\r\n\r\nhello")
            .unwrap();
    });
    let mut gw = probe("");
    gw.cluster_forward("up", addr);
    let r = gw
        .request()
        .header("x-cmd", "call:up:5000:/v1/feed?since=3")
        .send();
    server.join().unwrap();
    let (request_line, body) = rx.recv().unwrap();
    assert_eq!(request_line.trim_end(), "POST /v1/feed?since=3 HTTP/1.1");
    assert_eq!(body, b"ping");
    assert_eq!(r.header("x-out-call-status"), Some("200"));
    assert_eq!(r.header("x-out-call-body"), Some("hello"));
}

#[test]
fn forwarding_to_a_closed_port_is_a_503() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut gw = probe("");
    gw.cluster_forward("down", port);
    let r = gw.request().header("x-cmd", "call:down:1000").send();
    assert_eq!(r.header("x-out-call-status"), Some("503"));
}

#[test]
fn a_silent_server_times_out_as_504() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut gw = probe("");
    gw.cluster_forward("silent", listener.local_addr().unwrap());
    // The kernel accepts the connection; nobody answers within the callout's 30 ms.
    let r = gw.request().header("x-cmd", "call:silent:30").send();
    assert_eq!(r.header("x-out-call-status"), Some("504"));
    drop(listener);
}

#[test]
fn the_root_context_calls_out_on_ticks() {
    let mut gw = probe("tick_ms=100;tick_call=c");
    gw.cluster("c", |call| {
        assert_eq!(call.path(), "/tick");
        CalloutReply::Response(Response::ok("tickpong"))
    });
    gw.advance(Duration::from_millis(100));
    assert_eq!(gw.shared_data("tick_call").unwrap().0, b"200:1:tickpong");
    assert_eq!(gw.callouts()[0].dispatched_at, Duration::from_millis(100));
}

#[test]
fn a_root_callout_times_out_too() {
    let mut gw = probe("tick_ms=1000;tick_call=m");
    gw.cluster_manual("m");
    gw.advance(Duration::from_millis(1000));
    assert_eq!(gw.pending_callouts().len(), 1);
    gw.advance(Duration::from_millis(50));
    assert_eq!(
        gw.shared_data("tick_call").unwrap().0,
        b"504:3:upstream request timeout"
    );
}
