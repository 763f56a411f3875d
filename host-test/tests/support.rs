use std::path::PathBuf;

use kvroute_host_test::{built_wasm, Gateway, GatewayBuilder, LogLevel};

/// A fixture module, or a panic telling to run `make wasm`.
pub fn fixture(name: &str) -> PathBuf {
    built_wasm(name).unwrap_or_else(|e| panic!("{e}"))
}

pub fn probe_builder(config: &str) -> GatewayBuilder {
    Gateway::builder(fixture("fixture_probe")).config(config)
}

pub fn probe(config: &str) -> Gateway {
    probe_builder(config).build().expect("probe loads")
}

/// Info lines of one context, in order.
pub fn context_log(gw: &Gateway, worker: usize, context_id: u32) -> Vec<String> {
    gw.logs()
        .into_iter()
        .filter(|l| l.worker == worker && l.context_id == context_id && l.level == LogLevel::Info)
        .map(|l| l.message)
        .collect()
}

/// Lines starting with `prefix`, in order.
pub fn lines(gw: &Gateway, prefix: &str) -> Vec<String> {
    gw.logs()
        .into_iter()
        .map(|l| l.message)
        .filter(|m| m.starts_with(prefix))
        .collect()
}

pub const CLOCK_ORIGIN_NANOS: u64 = 1_767_225_600_000_000_000;
