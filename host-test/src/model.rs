//! Types the VM side (hostcalls, [`crate::vm`]) and the gateway side (builder, driver) both
//! use. They live here, apart from both, so neither side imports the other's file for them.

use std::collections::HashMap;

use crate::headers::Headers;
use crate::types::{Callout, LocalResponse};

/// The test clock starts at 2026-01-01T00:00:00Z (nanoseconds since the Unix epoch).
pub(crate) const CLOCK_ORIGIN_NANOS: u64 = 1_767_225_600_000_000_000;

/// Fuel given to each callback: far more than any sane callback needs, so running out means
/// a runaway loop, reported as a trap instead of hanging the test.
pub(crate) const DEFAULT_FUEL_PER_CALL: u64 = 20_000_000_000;

/// Which proxy the host imitates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Stock Envoy (≥ 1.35): ABI 0.2.1 imports only.
    #[default]
    Envoy,
    /// Higress: also `proxy_set_upstream_override_host` and `proxy_get_upstream_hosts`, and the
    /// ABI 0.2.100 marker lets a `Pause` from headers keep the body flowing.
    Higress,
}

/// The ABI version the host runs the module with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Abi {
    V0_2_1,
    /// Higress: a `Pause` from headers lets the body flow (StopIteration passed through).
    V0_2_100,
}

/// Load-time settings every VM of a gateway shares.
#[derive(Debug, Clone)]
pub(crate) struct HostOptions {
    pub mode: Mode,
    pub vm_id: String,
    pub root_id: String,
    pub plugin_name: String,
    pub plugin_config: Vec<u8>,
    pub vm_config: Vec<u8>,
    pub env: Vec<(String, String)>,
    pub fuel: bool,
    pub fuel_per_call: u64,
}

/// Per-stream maps and buffers the hostcalls read and write.
#[derive(Debug, Default)]
pub(crate) struct HttpCtx {
    pub request_headers: Option<Headers>,
    pub request_body: Vec<u8>,
    pub request_trailers: Option<Headers>,
    pub response_headers: Option<Headers>,
    pub response_body: Vec<u8>,
    pub response_trailers: Option<Headers>,
    /// Properties given by the test for this request.
    pub given_properties: HashMap<Vec<String>, Vec<u8>>,
    /// Properties the filter set, in order.
    pub set_properties: Vec<(Vec<String>, Vec<u8>)>,
    pub override_host: Option<Vec<u8>>,
}

/// An effect Envoy applies after the VM call returns.
#[derive(Debug, Clone)]
pub(crate) enum Deferred {
    Continue {
        context: u32,
        stream: i32,
    },
    /// Either direction: Envoy resets the whole stream.
    Close {
        context: u32,
    },
    Local {
        context: u32,
        response: LocalResponse,
    },
}

/// A callout dispatched by `proxy_http_call` and not answered yet.
#[derive(Debug, Clone)]
pub(crate) struct PendingCall {
    pub callout: Callout,
    pub deadline_nanos: Option<u64>,
    /// The cluster's handler was asked and chose not to answer.
    pub consulted: bool,
}

/// A callout's answer while `proxy_on_http_call_response` runs.
#[derive(Debug, Clone, Default)]
pub(crate) struct CallResponse {
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
}

/// Which stream callback to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamEvent {
    RequestHeaders,
    RequestBody,
    RequestTrailers,
    ResponseHeaders,
    ResponseBody,
    ResponseTrailers,
}
