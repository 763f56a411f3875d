use kvroute_host_test::{LogLevel, StreamState};

use crate::support::*;

#[test]
fn header_map_calls() {
    let mut gw = probe("");
    let r = gw
        .request()
        .header("x-a", "1")
        .header("x-d", "gone")
        .header("x-cmd", "pairs;get:x-a;get:x-missing;set:x-b=2;set:x-a=one;add:x-c=3;add:x-c=4;remove:x-d;mapsize")
        .send();
    assert!(r.continued());
    let h = r.request_headers.as_ref().unwrap();
    assert_eq!(
        h.get("x-out-pairs"),
        Some("7::method,:scheme,:authority,:path,x-a,x-d,x-cmd")
    );
    assert_eq!(h.get_all("x-out-get"), vec![&b"1"[..], &b"none"[..]]);
    assert_eq!(h.get("x-b"), Some("2"));
    assert_eq!(h.get_all("x-a"), vec![&b"one"[..]]);
    assert_eq!(h.get_all("x-c"), vec![&b"3"[..], &b"4"[..]]);
    assert!(!h.contains("x-d"));
    let mapsize = h.get("x-out-mapsize").unwrap();
    assert!(
        mapsize.starts_with("0:") && mapsize[2..].parse::<usize>().unwrap() > 50,
        "{mapsize}"
    );
}

#[test]
fn set_header_map_pairs_replaces_the_map() {
    let mut gw = probe("");
    let r = gw
        .request()
        .header("x-drop-me", "1")
        .header("x-keep", "2")
        .header("x-cmd", "setpairs")
        .send();
    let h = r.request_headers.unwrap();
    assert!(!h.contains("x-drop-me"));
    assert_eq!(h.get("x-keep"), Some("2"));
    assert_eq!(h.get("x-setpairs"), Some("1"));
    assert_eq!(h.get(":path"), Some("/"));
}

#[test]
fn non_utf8_header_values_pass_as_bytes() {
    let mut gw = probe("");
    let r = gw
        .request()
        .header_bytes("x-bin", &[0xff, 0xfe])
        .header("x-cmd", "get:x-bin")
        .send();
    assert_eq!(r.header("x-out-get"), Some("\u{fffd}\u{fffd}"));
    assert_eq!(
        r.request_headers.unwrap().get_bytes(b"x-bin"),
        Some(&[0xff, 0xfe][..])
    );
}

#[test]
fn shared_data_calls_follow_envoy() {
    let mut gw = probe("");
    let r = gw
        .request()
        .header("x-cmd", "sget:k;sset:k=v;sget:k;srm:k;sget:k")
        .send();
    let h = r.request_headers.unwrap();
    let gets: Vec<String> = h
        .get_all("x-out-sget")
        .iter()
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    assert_eq!(gets[0], "none");
    assert!(gets[1].starts_with("v@"), "{gets:?}");
    assert!(
        gets[2].starts_with("empty@"),
        "removing stores an empty value: {gets:?}"
    );
    assert_eq!(h.get("x-out-srm"), Some("ok"));
    // The key stays: Envoy never deletes shared data.
    assert_eq!(gw.shared_data_len(), 1);
    assert_eq!(gw.shared_data("k").unwrap().0, b"");
}

#[test]
fn cas_is_checked_only_when_the_key_exists() {
    let mut gw = probe("");
    // a's CAS is stale for a (a was written again) and irrelevant for the missing b.
    let r = gw
        .request()
        .header("x-cmd", "sset:a=1;sget:a;sset:a=2;scas:a=3;scas:b=4")
        .send();
    assert_eq!(
        r.request_headers.unwrap().get_all("x-out-scas"),
        vec![&b"casmismatch"[..], &b"ok"[..]]
    );
    assert_eq!(gw.shared_data("a").unwrap().0, b"2");
    assert_eq!(gw.shared_data("b").unwrap().0, b"4");
    // CAS values are one global counter, never 0.
    let (cas_a, cas_b) = (
        gw.shared_data("a").unwrap().1,
        gw.shared_data("b").unwrap().1,
    );
    assert!(cas_a > 0 && cas_b > cas_a);
}

#[test]
fn logs_are_captured_per_level() {
    let mut gw = probe("");
    let r = gw
        .request()
        .header("x-cmd", "log;loglevel;stdout;stderr")
        .send();
    for (level, msg) in [
        (LogLevel::Trace, "lvl-trace"),
        (LogLevel::Debug, "lvl-debug"),
        (LogLevel::Info, "lvl-info"),
        (LogLevel::Warn, "lvl-warn"),
        (LogLevel::Error, "lvl-error"),
        (LogLevel::Critical, "lvl-critical"),
    ] {
        assert_eq!(
            gw.logs_at(level).iter().filter(|m| *m == msg).count(),
            1,
            "{msg}"
        );
    }
    assert_eq!(r.header("x-out-loglevel"), Some("Ok(Info)"));
    // WASI stdout is info, stderr error, as Envoy logs them.
    assert!(gw
        .logs_at(LogLevel::Info)
        .contains(&"hello stdout 2".to_string()));
    assert!(gw
        .logs_at(LogLevel::Error)
        .contains(&"hello stderr 2".to_string()));
    let entry = gw
        .logs()
        .into_iter()
        .find(|l| l.message == "lvl-warn")
        .unwrap();
    assert_eq!((entry.worker, entry.context_id), (0, 2));
}

#[test]
fn metrics_define_increment_record_and_read_back() {
    let mut gw = probe("");
    let r = gw.request().header("x-cmd", "metric").send();
    // Counters only go up; a histogram has no single value.
    assert_eq!(
        r.header("x-out-metric"),
        Some("Ok(2)|Err(BadArgument)|Err(BadArgument)")
    );
    assert_eq!(gw.metric("probe.cmd"), Some(2));
    assert_eq!(gw.metric("probe.gauge"), Some(3));
    assert_eq!(gw.histogram("probe.hist"), Some(vec![7]));
    gw.request().header("x-cmd", "metric").send();
    assert_eq!(gw.metric("probe.cmd"), Some(4));
    assert_eq!(gw.histogram("probe.hist"), Some(vec![7, 7]));
    assert!(gw
        .metrics()
        .iter()
        .any(|(n, _, v)| n == "probe.requests" && *v == 2));
}

#[test]
fn time_follows_the_test_clock() {
    let mut gw = probe("");
    let r = gw.request().header("x-cmd", "time").send();
    assert_eq!(
        r.header("x-out-time"),
        Some(format!("{CLOCK_ORIGIN_NANOS}|{CLOCK_ORIGIN_NANOS}").as_str())
    );
    gw.advance(std::time::Duration::from_millis(1500));
    let r = gw.request().header("x-cmd", "time").send();
    let t = CLOCK_ORIGIN_NANOS + 1_500_000_000;
    assert_eq!(r.header("x-out-time"), Some(format!("{t}|{t}").as_str()));
    assert_eq!(gw.now(), std::time::Duration::from_millis(1500));
}

#[test]
fn properties_set_by_the_test_and_by_the_filter() {
    let mut gw = probe_builder("").vm_id("vm-x").build().unwrap();
    gw.set_property(&["route_name"], "r1");
    let r = gw
        .request()
        .path("/p?q")
        .property(&["metadata", "filter_metadata", "envoy.lb", "k"], "v")
        .header("x-cmd", "prop:route_name;prop:metadata/filter_metadata/envoy.lb/k;prop:plugin_vm_id;prop:request/path;prop:nope;setprop:a/b=1")
        .send();
    let got: Vec<String> = r
        .request_headers
        .as_ref()
        .unwrap()
        .get_all("x-out-prop")
        .iter()
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    assert_eq!(got, vec!["r1", "v", "vm-x", "/p?q", "none"]);
    assert_eq!(r.header("x-out-setprop"), Some("1"));
    assert_eq!(r.property(&["a", "b"]), Some(&b"1"[..]));
    // Request properties are per request.
    let r = gw
        .request()
        .header("x-cmd", "prop:metadata/filter_metadata/envoy.lb/k")
        .send();
    assert_eq!(r.header("x-out-prop"), Some("none"));
}

#[test]
fn foreign_functions() {
    let mut gw = probe("");
    gw.foreign_function("echo", |args| Ok([b"got:", args].concat()));
    gw.foreign_function("fails", |_| Err(2));
    let r = gw
        .request()
        .header("x-cmd", "foreign:echo=hi;foreign:nope=x;foreign:fails=y")
        .send();
    let got: Vec<&[u8]> = r.request_headers.as_ref().unwrap().get_all("x-out-foreign");
    assert_eq!(
        got,
        vec![
            &b"got:hi"[..],
            &b"err:NotFound"[..],
            &b"err:BadArgument"[..]
        ]
    );
    assert_eq!(gw.foreign_calls()[0], ("echo".to_string(), b"hi".to_vec()));
    gw.call_on_foreign_function(0, 7, b"args").unwrap();
}

#[test]
fn effective_context_grpc_status_env_and_random() {
    let mut gw = probe_builder("")
        .env("PROBE_ENV", "from-env")
        .build()
        .unwrap();
    let r = gw
        .request()
        .header(
            "x-cmd",
            "effective;grpc:c;status;env:PROBE_ENV;env:NOPE;random",
        )
        .send();
    assert_eq!(
        r.header("x-out-effective"),
        Some("Ok(())|Ok(())|Err(BadArgument)")
    );
    assert_eq!(
        r.header("x-out-grpc"),
        Some("Err(ParseFailure)"),
        "no gRPC cluster exists"
    );
    assert_eq!(r.header("x-out-status"), Some("Ok((0, None))"));
    let env: Vec<&[u8]> = r.request_headers.as_ref().unwrap().get_all("x-out-env");
    assert_eq!(env, vec![&b"from-env"[..], &b"none"[..]]);
    // WASI random is seeded: another gateway gets the same value.
    let mut again = probe("");
    let r2 = again.request().header("x-cmd", "random").send();
    assert_eq!(r.header("x-out-random"), r2.header("x-out-random"));
}

#[test]
fn local_response_ends_the_request_and_passes_the_response_callbacks() {
    let mut gw = probe("");
    let r = gw.request().header("x-cmd", "local:403").send();
    assert!(!r.continued());
    let local = r.local_response.clone().unwrap();
    assert_eq!((local.status, local.from_filter), (403, true));
    let resp = r.response.unwrap();
    assert_eq!(resp.status, 403);
    assert_eq!(resp.body, b"local body");
    assert_eq!(resp.headers.get("x-local"), Some("1"));
    assert_eq!(resp.headers.get("x-probe-saw-status"), Some("403"));
    assert_eq!(r.state, StreamState::Complete);
}

#[test]
fn close_stream_resets_and_continue_during_the_callback_resumes() {
    let mut gw = probe("");
    let r = gw.request().header("x-cmd", "close").send();
    assert_eq!(r.state, StreamState::Reset);
    assert!(!r.continued());
    let r = gw.request().header("x-cmd", "resume-now").send();
    assert_eq!(r.state, StreamState::Complete);
    assert!(r.continued());
}

#[test]
fn grpc_stubs_and_done() {
    let mut gw = probe("");
    let r = gw.request().header("x-cmd", "grpc-other:c").send();
    assert_eq!(
        r.header("x-out-grpc-other"),
        Some("Err(ParseFailure)|Err(NotFound)|Err(NotFound)|Err(NotFound)|Ok(())")
    );
}

#[test]
fn response_trailers_pass_the_filter() {
    let mut gw = probe("");
    let upstream = kvroute_host_test::Response::ok("body").trailer("grpc-status", "0");
    let r = gw.request().upstream_response(upstream).send();
    let trailers = r.response.unwrap().trailers.unwrap();
    assert_eq!(trailers.get("grpc-status"), Some("0"));
    assert_eq!(trailers.get("x-probe-trailer"), Some("seen"));
    assert!(gw.log_contains("response_trailers 1"));
}
