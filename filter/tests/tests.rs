//! Acceptance tests of the kvroute filter: the real `kvroute_filter.wasm` (built by
//! `make wasm`, never by the tests) driven by the host-test crate.

/// The artifacts: imports, exports, size; the Higress build in Higress mode; configuration
/// errors naming the key.
mod artifacts;
/// Bad input fails open with the right counter and no trap.
mod bad_input;
/// The module, a gateway, a fake collector.
mod common;
/// `/v1/explain` decides as the filter does (a property over random fleets); remote mode's
/// unknown models reach the `no_model` alarm.
mod explain;
/// The feed moving to the next collector when the one it pulls from fails.
mod failover;
/// A routed request's hostcalls against a budget.
mod hostcalls;
/// The shared-data keyspace stays fixed while a million blocks churn.
mod keyspace;
/// Fleet-wide load reports and totals, engine samples, speculative holders.
mod load;
/// Remote mode: `/query` per request, timeouts and errors.
mod remote;
/// `index.reuse_ms`: the sync state read once per window per worker, and only then.
mod reuse;
/// Routing from every intake source; load, ties, dp ranks, runner-up, load release.
mod routing;
/// Client headers, tenants, LoRA adapters and cache salts kept apart.
mod scopes;
/// Local mode against the real collector: sync, epoch change, outage, recovery, lease.
mod sync;
/// Text requests: exact through the collector's `/query`, approximate from recorded prefixes.
mod text;
/// Timing mode (per-phase histograms, off by default) and the CAS mismatch counter.
mod timing;
