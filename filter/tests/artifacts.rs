use serde_json::json;

use crate::common::*;

/// Every import of ABI 0.2.1 Envoy links (module `env`).
const ENVOY_ENV: &[&str] = &[
    "proxy_log",
    "proxy_get_log_level",
    "proxy_get_current_time_nanoseconds",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_buffer_bytes",
    "proxy_set_buffer_bytes",
    "proxy_get_buffer_status",
    "proxy_get_header_map_size",
    "proxy_get_header_map_pairs",
    "proxy_set_header_map_pairs",
    "proxy_get_header_map_value",
    "proxy_add_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_continue_stream",
    "proxy_close_stream",
    "proxy_get_status",
    "proxy_send_local_response",
    "proxy_http_call",
    "proxy_grpc_call",
    "proxy_grpc_stream",
    "proxy_grpc_send",
    "proxy_grpc_cancel",
    "proxy_grpc_close",
    "proxy_set_shared_data",
    "proxy_get_shared_data",
    "proxy_register_shared_queue",
    "proxy_resolve_shared_queue",
    "proxy_enqueue_shared_queue",
    "proxy_dequeue_shared_queue",
    "proxy_define_metric",
    "proxy_record_metric",
    "proxy_increment_metric",
    "proxy_get_metric",
    "proxy_get_property",
    "proxy_set_property",
    "proxy_call_foreign_function",
    "proxy_done",
    "proxy_set_effective_context",
];

/// The WASI preview1 functions proxy-wasm-cpp-host links.
const ENVOY_WASI: &[&str] = &[
    "fd_write",
    "fd_read",
    "fd_seek",
    "fd_close",
    "fd_fdstat_get",
    "fd_prestat_get",
    "fd_prestat_dir_name",
    "environ_get",
    "environ_sizes_get",
    "args_get",
    "args_sizes_get",
    "clock_time_get",
    "random_get",
    "proc_exit",
    "sched_yield",
    "poll_oneoff",
    "path_open",
];

struct Module {
    imports: Vec<(String, String)>,
    exports: Vec<String>,
    size: usize,
}

fn inspect(path: &std::path::Path) -> Module {
    let bytes = std::fs::read(path).expect("read module");
    let mut m = Module {
        imports: Vec::new(),
        exports: Vec::new(),
        size: bytes.len(),
    };
    for payload in wasmparser::Parser::new(0).parse_all(&bytes) {
        match payload.expect("valid module") {
            wasmparser::Payload::ImportSection(s) => {
                for imp in s.into_imports() {
                    let imp = imp.expect("import");
                    m.imports.push((imp.module.to_owned(), imp.name.to_owned()));
                }
            }
            wasmparser::Payload::ExportSection(s) => {
                for e in s {
                    m.exports.push(e.expect("export").name.to_owned());
                }
            }
            _ => {}
        }
    }
    m
}

#[test]
fn the_stock_module_imports_only_what_envoy_provides() {
    let m = inspect(&wasm());
    eprintln!(
        "kvroute_filter.wasm: {} bytes ({} KiB), {} imports",
        m.size,
        m.size / 1024,
        m.imports.len()
    );
    for (module, name) in &m.imports {
        let ok = match module.as_str() {
            "env" => ENVOY_ENV.contains(&name.as_str()),
            "wasi_snapshot_preview1" => ENVOY_WASI.contains(&name.as_str()),
            _ => false,
        };
        assert!(ok, "import {module}.{name} is not one Envoy links");
    }
    assert!(m.exports.iter().any(|e| e == "proxy_abi_version_0_2_1"));
    assert!(
        !m.exports.iter().any(|e| e == "proxy_abi_version_0_2_100"),
        "no Higress marker in the stock build"
    );
    assert!(m.size < 1 << 20, "module size {} bytes", m.size);
    // And the host, which refuses unknown imports as Envoy's V8 loader does, loads it.
    gateway(&config(json!({})), 1);
}

#[test]
fn the_higress_module_declares_the_override_import_and_marker() {
    let m = inspect(&wasm_higress());
    eprintln!("kvroute_filter_higress.wasm: {} bytes", m.size);
    assert!(m
        .imports
        .iter()
        .any(|(md, n)| md == "env" && n == "proxy_set_upstream_override_host"));
    assert!(m.exports.iter().any(|e| e == "proxy_abi_version_0_2_100"));
    // Stock Envoy refuses it.
    let err = kvroute_host_test::Gateway::builder(wasm_higress())
        .config(config(json!({})))
        .build()
        .err();
    assert!(
        matches!(
            err,
            Some(kvroute_host_test::HostError::UnknownImport { .. })
        ),
        "{err:?}"
    );
}

#[test]
fn the_higress_module_routes_in_higress_mode_with_rules() {
    let feed = FakeCollector::new();
    two_instances(&feed);
    let prompt = tokens(0, 64);
    feed.hold(1, &prompt, "default", "m", None, None);
    // Higress's wrapper: global keys plus rules; the rule for route `chat` reads the model
    // from a header only.
    let cfg = json!({
        "collector": {"cluster": CLUSTER},
        "random_seed": 1,
        "_internal_": {"ignored": true},
        "_rules_": [
            {"_match_route_": ["chat"], "model": {"sources": ["header:x-model"]}},
            {"_match_domain_": ["*.example.com"], "tokens": {"sources": ["header:x-token-ids"]}},
        ],
    })
    .to_string();
    let mut gw = gateway_higress(&cfg);
    feed.attach(&mut gw);
    sync(&mut gw);
    // Global config: model from the body.
    let o = complete(&mut gw, "m", &prompt);
    assert_eq!(best(&o), Some(B));
    assert_eq!(
        o.override_host.as_deref(),
        Some(B),
        "Higress's override host is set"
    );
    // Route `chat`: the rule's config (model from the header only).
    let o = gw
        .request()
        .property(&["route_name"], "chat")
        .header("x-model", "m")
        .json_body(&json!({"model": "nope", "prompt": prompt}))
        .send();
    assert_eq!(best(&o), Some(B));
    let o = gw
        .request()
        .property(&["route_name"], "chat")
        .json_body(&json!({"model": "m", "prompt": prompt}))
        .send();
    assert_eq!(
        dest(&o),
        None,
        "the rule takes the model from the header only"
    );
    assert!(gw.errors().is_empty());
}

#[test]
fn configuration_errors_name_the_key() {
    let cases = [
        (
            json!({"collector": {"cluster": CLUSTER}, "bogus": 1}).to_string(),
            "bogus",
        ),
        (
            json!({"collector": {"cluster": CLUSTER, "query_timeout": 5}}).to_string(),
            "query_timeout",
        ),
        (
            json!({"collector": {"cluster": CLUSTER}, "index": {"sync_interval_ms": "fast"}})
                .to_string(),
            "index.sync_interval_ms",
        ),
        (
            json!({"collector": {"cluster": CLUSTER}, "index": {"mode": "psychic"}}).to_string(),
            "index.mode",
        ),
        (
            json!({"collector": {"cluster": CLUSTER}, "index": {"buckets": 1000}}).to_string(),
            "index.buckets",
        ),
        (
            json!({"collector": {"cluster": CLUSTER}, "tokens": {"sources": ["cookie:x"]}})
                .to_string(),
            "tokens.sources[0]",
        ),
        (
            json!({"collector": {"cluster": CLUSTER}, "max_body_bytes": -1}).to_string(),
            "max_body_bytes",
        ),
        (json!({"index": {}}).to_string(), "collector"),
        (
            json!({"collector": {"cluster": CLUSTER}, "_rules_": []}).to_string(),
            "_rules_",
        ),
    ];
    for (cfg, key) in cases {
        let gw = kvroute_host_test::Gateway::builder(wasm())
            .config(&cfg)
            .build();
        let Err(e) = gw else {
            panic!("accepted: {cfg}")
        };
        assert!(
            matches!(e, kvroute_host_test::HostError::ConfigurationRejected),
            "{e}"
        );
        // The log line names the key; the host keeps logs of failed builds only in the error,
        // so check through a successful parse path too.
        let msg = kvroute_filter::parse(cfg.as_bytes())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(msg.contains(key), "`{msg}` names `{key}`");
    }
}

#[test]
fn the_design_example_configuration_is_accepted() {
    let cfg = r#"{
      "collector": {"cluster": "kvroute_collector", "authority": "kvroute-collector",
                    "query_timeout_ms": 20, "feed_timeout_ms": 1000},
      "index": {"mode": "local", "sync_interval_ms": 100, "stale_after_ms": 5000},
      "tokens": {"sources": ["header:x-token-ids", "body:prompt", "body:prompt_token_ids", "body:input_ids"]},
      "model": {"sources": ["body:model", "header:x-model"]},
      "tenant": {"sources": ["header:x-tenant-id"], "default": "default"},
      "cache_salt": {"sources": ["body:cache_salt"]},
      "max_body_bytes": 1000000,
      "destination_header": "x-gateway-destination-endpoint"
    }"#;
    let gw = kvroute_host_test::Gateway::builder(wasm())
        .config(cfg)
        .build()
        .expect("accepted");
    assert_eq!(
        gw.tick_period(0),
        Some(std::time::Duration::from_millis(100))
    );
}

/// Validates the module at `path` as a runtime without wasm SIMD would.
fn validate_without_simd(path: &std::path::Path) -> Result<(), String> {
    use wasmparser::{Validator, WasmFeatures};
    let bytes = std::fs::read(path).expect("read module");
    let features = WasmFeatures::default() - WasmFeatures::SIMD - WasmFeatures::RELAXED_SIMD;
    Validator::new_with_features(features)
        .validate_all(&bytes)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn the_stock_module_uses_simd_and_the_scalar_module_runs_without_it() {
    // The stock build's token scanner compares 16 bytes at a time (.cargo/config.toml turns
    // SIMD on): a runtime without SIMD refuses it, and takes kvroute_filter_scalar.wasm.
    let err = validate_without_simd(&wasm()).expect_err("the stock module has no SIMD");
    assert!(err.contains("SIMD"), "{err}");
    validate_without_simd(&wasm_scalar()).expect("the scalar module validates without SIMD");
}

#[test]
fn the_scalar_module_reads_and_refuses_bodies_as_the_stock_module_does() {
    let prompt = tokens(100_000, 8192);
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    // Python's separators (`, `), the body the window path reads 64 bytes at a time.
    let body = format!(r#"{{"model": "m", "prompt": [{}]}}"#, ids.join(", "));
    let mut odd = ids.clone();
    odd[5000] = "1.5".into();
    let bad = format!(r#"{{"model": "m", "prompt": [{}]}}"#, odd.join(", "));
    for module in [wasm(), wasm_scalar()] {
        let feed = FakeCollector::new();
        two_instances(&feed);
        feed.hold(1, &prompt, "default", "m", None, None);
        let mut gw = kvroute_host_test::Gateway::builder(&module)
            .config(config(json!({})))
            .plugin_name(PLUGIN)
            .allow_on_headers_stop_iteration(true)
            .build()
            .unwrap_or_else(|e| panic!("{}: {e}", module.display()));
        feed.attach(&mut gw);
        sync(&mut gw);
        let send = |gw: &mut kvroute_host_test::Gateway, body: &str| {
            gw.request()
                .header("content-type", "application/json")
                .body(body.as_bytes().to_vec())
                .send()
        };
        let o = send(&mut gw, &body);
        assert_eq!(best(&o), Some(B), "{}: {}", module.display(), debug(&o));
        let o = send(&mut gw, &bad);
        assert_fail_open(&gw, &o, "bad_body", 0);
    }
}
