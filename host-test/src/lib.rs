//! # kvroute-host-test
//!
//! A [wasmtime] host of the proxy-wasm ABI 0.2.1 that loads a `.wasm` filter (kvroute's, or a
//! fixture) and drives it the way Envoy does, so the filter can be tested and benchmarked
//! without Envoy. It must not depend on anything of the filter: it only speaks the ABI.
//!
//! ```no_run
//! use kvroute_host_test::{built_wasm, Gateway, Response, CalloutReply};
//! let mut gw = Gateway::builder(built_wasm("kvroute_filter")?)
//!     .config(r#"{"collector":{"cluster":"kvroute_collector"}}"#)
//!     .allow_on_headers_stop_iteration(true) // as the shipped envoy.yaml
//!     .workers(2)
//!     .build()?;
//! gw.cluster("kvroute_collector", |call| CalloutReply::Response(Response::ok("{}")));
//! gw.advance(std::time::Duration::from_millis(100)); // ticks fire on every VM
//! let r = gw.request()
//!     .header("x-tenant-id", "a")
//!     .json_body(&serde_json::json!({"model": "m", "prompt": [1, 2, 3]}))
//!     .send();
//! assert!(r.continued());
//! println!("{:?} {:?}", r.header("x-gateway-destination-endpoint"), gw.metric("kvroute.requests"));
//! # Ok::<(), kvroute_host_test::HostError>(())
//! ```
//!
//! # API at a glance
//!
//! - Load: [`Gateway::load`]`(path, config)`, or [`Gateway::builder`] with `.config()`,
//!   `.workers(n)`, `.allow_on_headers_stop_iteration(true)`, `.higress()`,
//!   `.buffer_limit_bytes()`, `.vm_id()`, `.property()`, `.fuel(false)`, then `.build()`;
//!   modules of this workspace by name: [`built_wasm`]`("kvroute_filter")`.
//! - Requests: [`Gateway::request`] → [`RequestBuilder`] (`.header()`, `.json_body()`,
//!   `.body()`, `.chunk_size()`, `.trailer()`, `.worker(i)`, `.property()`,
//!   `.upstream_response()`, `.hold_response()`) → `.send()` → [`Outcome`] (`continued()`,
//!   `paused()`, `header()`, `request_headers`, `local_response`, `response`, `status()`,
//!   `override_host`, `fuel`, `error()`), or `.start()` → [`RequestId`], later
//!   [`Gateway::outcome`]; [`Gateway::respond`], [`Gateway::reset`].
//! - Callouts: [`Gateway::cluster`] / [`Gateway::cluster_forward`] /
//!   [`Gateway::cluster_manual`], [`Gateway::pending_callouts`], [`Gateway::reply`],
//!   [`Gateway::callouts`].
//! - Time: [`Gateway::advance`], [`Gateway::now`], [`Gateway::tick_period`].
//! - State: [`Gateway::shared_data`], [`Gateway::set_shared_data`],
//!   [`Gateway::prefill_shared_data`], [`Gateway::shared_data_len`] (key count),
//!   [`Gateway::shared_data_bytes`], [`Gateway::enqueue`], [`Gateway::metric`],
//!   [`Gateway::histogram`], [`Gateway::logs`], [`Gateway::log_contains`],
//!   [`Gateway::set_property`], [`Gateway::foreign_function`],
//!   [`Gateway::set_upstream_hosts`], [`Gateway::errors`], [`Gateway::restarts`].
//! - Benchmarks: [`bench::run`] → [`bench::BenchRun`] (wall time and fuel).
//!
//! # What it models
//!
//! - **Loading** ([`Gateway::load`], [`Gateway::builder`]): links every `env.proxy_*` import
//!   of ABI 0.2.1 and the 15 WASI preview1 functions proxy-wasm-cpp-host links (under
//!   `wasi_snapshot_preview1` and `wasi_unstable`). Any other import is refused with
//!   [`HostError::UnknownImport`] naming it, as Envoy's V8 loader does. A module must export an
//!   ABI marker (`proxy_abi_version_0_2_1`, or `_0_2_0`). Compiled modules are cached per path.
//! - **Lifecycle**: `_initialize` (then `main` if exported; only logging, clock, random,
//!   environment hostcalls are allowed meanwhile), root context 1, `proxy_on_vm_start`,
//!   `proxy_on_configure` (false → [`HostError::ConfigurationRejected`]); per request an HTTP
//!   context: request headers, body, trailers, then the response ones, then `proxy_on_log`,
//!   `proxy_on_done`, `proxy_on_delete`.
//! - **Envoy's filter manager** for one filter before the router: `Continue` from any callback
//!   lets everything received so far go on. `Pause` from headers, with
//!   [`GatewayBuilder::allow_on_headers_stop_iteration`] off (Envoy's default), is
//!   StopAllIterationAndWatermark: no body callback until the filter continues, then the body
//!   arrives buffered as one chunk; with it on (or in Higress mode with the ABI 0.2.100 marker)
//!   the body keeps flowing. `Pause` from the body buffers it: the next body callback sees the
//!   accumulated size, and past [`GatewayBuilder::buffer_limit_bytes`] (1 MiB) the client gets
//!   Envoy's `413 Payload Too Large` (a local reply, which the filter's response callbacks
//!   see). `proxy_continue_stream`, `proxy_send_local_response` and `proxy_close_stream` act
//!   after the callback returns, as Envoy's after-VM-call actions do. A local reply sent
//!   during the response phase replaces the response without another pass through the filter.
//! - **Workers**: [`GatewayBuilder::workers`] VMs of one `vm_id` (Envoy: one per worker
//!   thread). Shared data, shared queues and metrics are shared by all; requests go
//!   round-robin or to [`RequestBuilder::worker`]; ticks fire on every VM.
//! - **Shared data** with proxy-wasm-cpp-host's semantics: the CAS is checked only when the key
//!   exists, a "remove" stores an empty value, keys are never deleted
//!   ([`Gateway::shared_data_len`] counts them all).
//! - **Callouts** (`proxy_http_call`): the cluster must be declared
//!   ([`Gateway::cluster`] with a closure, [`Gateway::cluster_forward`] to a loopback HTTP
//!   server, or [`Gateway::cluster_manual`]), else `BadArgument`; `:method`, `:path`,
//!   `:authority` are required, as in Envoy. A closure's or the forwarder's answer is delivered
//!   right after the dispatching callback returns. Manual callouts wait for
//!   [`Gateway::reply`]. A callout with a timeout that is still pending when the test clock
//!   passes its deadline gets what Envoy's router sends: `504` with body
//!   `upstream request timeout`. [`CalloutReply::Reset`] is a failure (0 headers). gRPC
//!   hostcalls are linked but no gRPC cluster exists (`ParseFailure`).
//! - **Time**: one test clock, starting at 2026-01-01T00:00:00Z, read by
//!   `proxy_get_current_time_nanoseconds` and WASI `clock_time_get`; it moves only with
//!   [`Gateway::advance`], which fires ticks and callout timeouts in time order. WASI
//!   `random_get` is seeded per worker, so runs repeat exactly.
//! - **Properties**: test-set ones ([`Gateway::set_property`], [`RequestBuilder::property`]),
//!   `plugin_name`, `plugin_root_id`, `plugin_vm_id`, `request.path|method|host|scheme` and
//!   `request.headers.<name>`; what the filter sets is readable back and reported in
//!   [`Outcome::properties`] (Envoy: filter state `wasm.<path>`).
//! - **Logs**: every `proxy_log` line and WASI stdout (info) / stderr (error), with worker and
//!   context ([`Gateway::logs`]). **Metrics**: counters, gauges, histograms ([`Gateway::metric`]).
//!   **Foreign functions**: [`Gateway::foreign_function`]; unknown names get `NotFound`.
//! - **Higress** ([`Mode::Higress`]): `proxy_set_upstream_override_host` (recorded in
//!   [`Outcome::override_host`]) and `proxy_get_upstream_hosts`
//!   ([`Gateway::set_upstream_hosts`]) are linked; in Envoy mode they are unknown imports.
//! - **Traps and panics**: a trap (a Rust panic aborts, so it traps after the SDK's panic hook
//!   logged it at critical level) fails every open stream of that VM with
//!   [`StreamState::Failed`] (the panic message is in the error), is listed in
//!   [`Gateway::errors`], and the host **recreates the VM** (fresh instance, start and
//!   configure again; shared data survives, as it lives in the host), like Envoy's
//!   `failure_policy: FAIL_RELOAD`. If recreation fails, the worker stays dead and its requests
//!   fail with [`HostError::VmFailed`]. Each callback has a large fuel budget, so a runaway loop
//!   traps instead of hanging.
//! - **Fuel**: with fuel on (default), [`Outcome::fuel`] counts the wasm operators a request's
//!   callbacks executed: a machine-independent cost. See [`bench`].
//!
//! Not modelled: gRPC, network (L4) filters, Envoy's response buffer limit, per-route config
//! reloads, request headers Envoy itself adds (`x-request-id`, `x-forwarded-proto`).
//!
//! # Built modules
//!
//! Tests find modules with [`built_wasm`]: `<target>/wasm32-wasip1/release/<name>.wasm`,
//! where `<target>` is `$CARGO_TARGET_DIR` when set, else `<workspace>/target`. Tests never
//! build wasm themselves: `make wasm` does; a missing module is an error saying so.

#![warn(missing_docs, missing_debug_implementations)]

mod abi;
pub mod bench;
mod builder;
mod driver;
mod gateway;
mod headers;
mod hostcalls;
mod http;
mod model;
mod request;
mod runtime;
mod shared;
mod state;
mod stream;
mod types;
mod vm;

pub use abi::{LogLevel, MetricKind};
pub use builder::{built_wasm, wasm_path, GatewayBuilder, DEFAULT_BUFFER_LIMIT_BYTES};
pub use gateway::{Gateway, UpstreamRequest, MAX_FINISHED_REQUESTS};
pub use headers::Headers;
pub use model::Mode;
pub use request::RequestBuilder;
pub use types::{
    Callout, CalloutHandler, CalloutId, CalloutReply, ForeignFn, HostError, LocalResponse,
    LogEntry, Outcome, RequestId, Response, StreamState,
};
