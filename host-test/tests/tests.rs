//! Tests of the host itself, driven through the fixture plugins of `host-test/fixtures/`
//! (built for wasm32-wasip1 by `make wasm`; a missing one fails with a message saying so).

/// Loading fixtures and small helpers.
mod support;

/// Import checking, ABI markers, traps and panics, fuel.
mod loading;

/// Callback order, VM start and configuration, workers.
mod lifecycle;

/// Every hostcall, through the probe fixture.
mod abi;

/// Envoy's body delivery, the request buffer limit, the response path.
mod body;

/// `proxy_http_call`: closures, manual replies, timeouts, forwarding to a loopback server.
mod callouts;

/// Shared data, CAS races between VMs, queues, ticks on every VM.
mod shared;

/// Higress mode.
mod higress;

/// The project's filter (`kvroute_filter.wasm` and its Higress twin) runs in this host.
mod real_filter;
