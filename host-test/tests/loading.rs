use kvroute_host_test::{built_wasm, Gateway, HostError, Mode, StreamState};

use crate::support::*;

fn module_importing(module: &str, name: &str) -> String {
    format!(
        r#"(module
            (import "{module}" "{name}" (func))
            (memory (export "memory") 1)
            (func (export "proxy_abi_version_0_2_1"))
            (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 1024))"#
    )
}

#[test]
fn unknown_env_import_is_refused_with_its_name() {
    let err = Gateway::load_bytes(module_importing("env", "proxy_nonexistent"), "").unwrap_err();
    assert_eq!(
        err,
        HostError::UnknownImport {
            module: "env".into(),
            name: "proxy_nonexistent".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "Failed to load Wasm module due to a missing import: env.proxy_nonexistent"
    );
}

#[test]
fn wasi_functions_envoy_does_not_link_are_refused() {
    let err = Gateway::load_bytes(
        module_importing("wasi_snapshot_preview1", "sock_accept"),
        "",
    )
    .unwrap_err();
    assert!(
        matches!(err, HostError::UnknownImport { ref name, .. } if name == "sock_accept"),
        "{err}"
    );
    let err = Gateway::load_bytes(module_importing("other", "f"), "").unwrap_err();
    assert!(
        matches!(err, HostError::UnknownImport { ref module, .. } if module == "other"),
        "{err}"
    );
}

#[test]
fn higress_imports_are_unknown_in_envoy_mode_only() {
    let wat = module_importing("env", "proxy_get_upstream_hosts");
    let err = Gateway::load_bytes(&wat, "").unwrap_err();
    assert!(matches!(err, HostError::UnknownImport { .. }), "{err}");
    // Linked in Higress mode, though with this (wrong) signature instantiation fails.
    let err = Gateway::builder_bytes(&wat)
        .mode(Mode::Higress)
        .build()
        .unwrap_err();
    assert!(matches!(err, HostError::Instantiate(_)), "{err}");
}

#[test]
fn a_module_without_abi_marker_is_refused() {
    let wat = r#"(module (memory (export "memory") 1)
        (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 0))"#;
    assert_eq!(
        Gateway::load_bytes(wat, "").unwrap_err(),
        HostError::UnknownAbi
    );
    // Higress's marker alone is not Envoy's.
    let wat = r#"(module (memory (export "memory") 1) (func (export "proxy_abi_version_0_2_100"))
        (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 0))"#;
    assert_eq!(
        Gateway::load_bytes(wat, "").unwrap_err(),
        HostError::UnknownAbi
    );
    assert!(Gateway::builder_bytes(wat).higress().build().is_ok());
}

#[test]
fn only_logging_hostcalls_are_allowed_during_initialize() {
    let wat = r#"(module
        (import "env" "proxy_set_tick_period_milliseconds" (func $tick (param i32) (result i32)))
        (memory (export "memory") 1)
        (func (export "proxy_abi_version_0_2_1"))
        (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 0)
        (func (export "_initialize") (drop (call $tick (i32.const 10)))))"#;
    let err = Gateway::load_bytes(wat, "").unwrap_err();
    match err {
        HostError::Trap { callback, message } => {
            assert_eq!(callback, "_initialize");
            assert!(message.contains("restricted"), "{message}");
        }
        other => panic!("expected a trap, got {other}"),
    }
}

#[test]
fn a_missing_fixture_says_to_run_make_wasm() {
    let err = built_wasm("no_such_fixture").unwrap_err();
    assert!(matches!(err, HostError::MissingFixture { .. }));
    assert!(err.to_string().contains("make wasm"), "{err}");
    assert!(
        err.to_string()
            .contains("wasm32-wasip1/release/no_such_fixture.wasm"),
        "{err}"
    );
}

#[test]
fn a_trap_fails_the_request_and_the_vm_is_recreated() {
    let mut gw = probe_builder("").workers(2).build().unwrap();
    gw.cluster_manual("m");
    gw.set_shared_data("survives", "yes");
    // Another request of the same worker waits for a callout when the VM dies.
    let waiting = gw.request().worker(0).header("x-cmd", "call:m:0").start();
    assert!(gw.outcome(waiting).paused());
    let other_worker = gw.request().worker(1).header("x-cmd", "call:m:0").start();

    let r = gw.request().worker(0).header("x-cmd", "trap").send();
    match r.error() {
        Some(HostError::Trap { callback, message }) => {
            assert_eq!(callback, "proxy_on_request_headers");
            assert!(message.contains("unreachable"), "{message}");
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    assert!(!r.continued());
    assert!(matches!(gw.outcome(waiting).state, StreamState::Failed(_)));
    assert!(
        gw.outcome(other_worker).paused(),
        "the other worker is untouched"
    );
    assert_eq!(gw.restarts(), 1);
    assert_eq!(gw.errors().len(), 1);
    assert!(gw.worker_alive(0));

    // The fresh VM serves requests; shared data lives in the host and survives.
    let r = gw
        .request()
        .worker(0)
        .header("x-cmd", "sget:survives")
        .send();
    assert_eq!(r.state, StreamState::Complete);
    assert!(r.header("x-out-sget").unwrap().starts_with("yes@"));
    assert_eq!(
        lines(&gw, "configured").len(),
        3,
        "worker 0 was configured again"
    );
}

#[test]
fn a_panic_is_reported_with_its_message() {
    let mut gw = probe("");
    let r = gw.request().header("x-cmd", "panic").send();
    let err = r.error().expect("failed").to_string();
    assert!(err.contains("probe panic"), "{err}");
    assert_eq!(gw.request().send().state, StreamState::Complete);
}

#[test]
fn a_runaway_loop_runs_out_of_fuel() {
    let mut gw = probe_builder("").fuel_per_call(5_000_000).build().unwrap();
    let r = gw.request().header("x-cmd", "spin").send();
    let err = r.error().expect("failed").to_string();
    assert!(err.to_lowercase().contains("fuel"), "{err}");
    assert_eq!(gw.request().send().state, StreamState::Complete);
}

#[test]
fn fuel_is_counted_per_request_and_repeats_exactly() {
    let mut gw = probe("");
    // The first request pays one-time costs inside the module (lazy statics, metric ids).
    gw.request().header("x-cmd", "sset:k=v;metric").send();
    let a = gw.request().header("x-cmd", "sset:k=v;metric").send();
    let b = gw.request().header("x-cmd", "sset:k=v;metric").send();
    assert!(a.fuel > 1000, "{}", a.fuel);
    assert_eq!(a.fuel, b.fuel);
    assert!(gw.fuel_total() >= a.fuel + b.fuel);
    let mut off = probe_builder("").fuel(false).build().unwrap();
    assert_eq!(off.request().send().fuel, 0);
}
