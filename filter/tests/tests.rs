//! Acceptance tests of the kvroute filter: the real `kvroute_filter.wasm` (built by
//! `make wasm`, never by the tests) driven by the host-test crate.

/// The module, a gateway, a fake collector.
mod common;
/// Configuration: defaults, unknown keys and wrong types refused with the key named.
mod config;
/// Routing from every intake source; load, ties, dp ranks, runner-up, load release.
mod routing;
/// Client headers, tenants, LoRA adapters and cache salts kept apart.
mod scopes;
/// Bad input fails open with the right counter and no trap.
mod bad_input;
/// Local mode against the real collector: sync, epoch change, outage, recovery, lease.
mod sync;
/// Remote mode: `/query` per request, timeouts and errors.
mod remote;
/// The shared-data keyspace stays fixed while a million blocks churn.
mod keyspace;
/// What the stock and Higress modules import and export; the Higress build in Higress mode.
mod artifacts;
