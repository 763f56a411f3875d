//! Public value types of the host: requests' outcomes, responses, callouts, logs, errors.

use std::time::Duration;

use crate::abi::LogLevel;
use crate::headers::Headers;

/// Everything that can go wrong loading or running a module.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The `.wasm` file could not be read.
    #[error("cannot read wasm module {path}: {reason}")]
    Read {
        /// Path given.
        path: String,
        /// I/O error.
        reason: String,
    },
    /// A module expected in the build output (filter or fixture) was not built.
    #[error("wasm module {path} is missing: run `make wasm` first (it builds the filter and the host-test fixtures for wasm32-wasip1)")]
    MissingFixture {
        /// Expected path.
        path: String,
    },
    /// wasmtime rejected the module (bad bytes, bad wat, unsupported feature).
    #[error("invalid wasm module: {0}")]
    Compile(String),
    /// The module imports a function the host does not link: Envoy's V8 loader refuses it too.
    #[error("Failed to load Wasm module due to a missing import: {module}.{name}")]
    UnknownImport {
        /// Import module (`env`, `wasi_snapshot_preview1`, ...).
        module: String,
        /// Import name.
        name: String,
    },
    /// The module exports no known ABI version marker (`proxy_abi_version_0_2_1`, ...).
    #[error("Missing or unknown Proxy-Wasm ABI version")]
    UnknownAbi,
    /// Instantiation failed (an import with the wrong signature, a start function trap, ...).
    #[error("cannot instantiate module: {0}")]
    Instantiate(String),
    /// `proxy_on_vm_start` returned false.
    #[error("proxy_on_vm_start returned false")]
    VmStartFailed,
    /// `proxy_on_configure` returned false: Envoy rejects the configuration.
    #[error("proxy_on_configure returned false: configuration rejected")]
    ConfigurationRejected,
    /// A trap (including a Rust panic, which aborts) inside the module.
    #[error("wasm trap in {callback}: {message}")]
    Trap {
        /// The callback that trapped (`proxy_on_request_headers`, ...).
        callback: String,
        /// wasmtime's message, plus the last critical log line (a panic message) if any.
        message: String,
    },
    /// A benchmarked request did not complete (it paused or was reset).
    #[error("request {request} did not complete: {state}")]
    Incomplete {
        /// Index of the request in the run.
        request: u64,
        /// Where it stopped.
        state: String,
    },
    /// The VM failed earlier and could not be recreated.
    #[error("VM {0} is failed")]
    VmFailed(usize),
}

/// A log line captured from `proxy_log` or from WASI stdout (info) / stderr (error).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// Worker VM index.
    pub worker: usize,
    /// Effective context id when logged.
    pub context_id: u32,
    /// Level.
    pub level: LogLevel,
    /// Message (lossy UTF-8).
    pub message: String,
}

/// An HTTP response: from the upstream, from a callout, or a local reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, without `:status` (the host adds it where the ABI wants it).
    pub headers: Headers,
    /// Body.
    pub body: Vec<u8>,
    /// Trailers, if any.
    pub trailers: Option<Headers>,
}

impl Response {
    /// A response with this status, no header, no body.
    pub fn new(status: u16) -> Self {
        Response {
            status,
            headers: Headers::new(),
            body: Vec::new(),
            trailers: None,
        }
    }

    /// `200 OK` with this body.
    pub fn ok(body: impl Into<Vec<u8>>) -> Self {
        Self::new(200).body(body)
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value);
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    /// Sets a JSON body and `content-type: application/json`.
    pub fn json<T: serde::Serialize + ?Sized>(self, value: &T) -> Self {
        let body = serde_json::to_vec(value).expect("serializable value");
        self.header("content-type", "application/json").body(body)
    }

    /// Adds a trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        self.trailers
            .get_or_insert_with(Headers::new)
            .add(name, value);
        self
    }

    /// Body as lossy UTF-8.
    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Headers with `:status` first, as the ABI's maps carry them.
    pub(crate) fn headers_with_status(&self) -> Headers {
        let mut h = Headers::new();
        h.add(":status", &self.status.to_string());
        for (k, v) in self.headers.iter_bytes() {
            h.add_bytes(k, v);
        }
        h
    }
}

/// A `proxy_send_local_response` call (or Envoy's own local reply, such as the 413).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalResponse {
    /// Status code.
    pub status: u16,
    /// Status code details (`request_payload_too_large` for the host's 413).
    pub details: String,
    /// Headers the filter asked for.
    pub headers: Headers,
    /// Body.
    pub body: Vec<u8>,
    /// gRPC status, `-1` for none.
    pub grpc_status: i32,
    /// Whether the filter sent it (false: the host did, e.g. 413 over the buffer limit).
    pub from_filter: bool,
}

/// Identifies a request (stream) sent through a [`crate::Gateway`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// Identifies a callout: the worker VM that made it and its token there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CalloutId {
    /// Worker VM index.
    pub worker: usize,
    /// Token returned to the module.
    pub token: u32,
}

/// A `proxy_http_call` made by the module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Callout {
    /// Id to reply with.
    pub id: CalloutId,
    /// Context that made the call (the one `on_http_call_response` is delivered to).
    pub context_id: u32,
    /// Cluster name.
    pub cluster: String,
    /// Headers, pseudo-headers included.
    pub headers: Headers,
    /// Body.
    pub body: Vec<u8>,
    /// Trailers.
    pub trailers: Headers,
    /// Timeout asked for; `None` for 0 (no timeout).
    pub timeout: Option<Duration>,
    /// Test-clock time of the dispatch, since the clock's start.
    pub dispatched_at: Duration,
}

impl Callout {
    /// `:path`.
    pub fn path(&self) -> &str {
        self.headers.get(":path").unwrap_or("")
    }

    /// `:method`.
    pub fn method(&self) -> &str {
        self.headers.get(":method").unwrap_or("")
    }
}

/// How a callout is answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CalloutReply {
    /// A response: `on_http_call_response` gets its headers, body and trailers.
    Response(Response),
    /// A failure (Envoy's `onFailure`, e.g. a reset): `on_http_call_response` with 0 headers,
    /// 0 body, 0 trailers; `proxy_get_status` then gives BrokenConnection (11) and "reset".
    Reset,
    /// No answer: the call stays pending until its timeout fires on the test clock (Envoy then
    /// answers `504` with body `upstream request timeout`), or forever if it has none.
    NoReply,
}

/// Answers callouts of one cluster.
pub type CalloutHandler = Box<dyn FnMut(&Callout) -> CalloutReply + Send>;

/// A foreign function: arguments in, result bytes or an ABI status out.
pub type ForeignFn = Box<dyn FnMut(&[u8]) -> Result<Vec<u8>, u32> + Send>;

/// Where a request stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamState {
    /// The filter holds the request (paused at headers, body or trailers, or waiting for a
    /// callout); nothing more happens until it continues (`proxy_continue_stream`).
    RequestPaused,
    /// The request went upstream whole; the test holds the upstream response
    /// ([`crate::RequestBuilder::hold_response`]) and answers with [`crate::Gateway::respond`].
    AwaitingResponse,
    /// The filter holds the response.
    ResponsePaused,
    /// The stream finished: a response reached the client and `on_log`, `on_done`,
    /// `on_delete` ran.
    Complete,
    /// The filter (or the host) reset the stream (`proxy_close_stream`).
    Reset,
    /// The module trapped or panicked; the VM was recreated (see the crate docs).
    Failed(HostError),
}

/// What happened to one request, as far as it went.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Request id.
    pub id: RequestId,
    /// Worker VM that handled it.
    pub worker: usize,
    /// HTTP context id in that VM.
    pub context_id: u32,
    /// Where it stands.
    pub state: StreamState,
    /// Request headers as they left the filter for the upstream; `None` if they did not.
    pub request_headers: Option<Headers>,
    /// Request body that went upstream.
    pub request_body: Vec<u8>,
    /// Request trailers that went upstream.
    pub request_trailers: Option<Headers>,
    /// Local reply sent by the filter (or by the host: 413), if any.
    pub local_response: Option<LocalResponse>,
    /// What the client received, after the filter's response callbacks.
    pub response: Option<Response>,
    /// Higress: the last `proxy_set_upstream_override_host` of this stream.
    pub override_host: Option<String>,
    /// Properties the filter set (`proxy_set_property`; Envoy keeps them as filter state
    /// `wasm.<path>`), by path.
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
    /// Fuel (≈ wasm instructions) the stream's callbacks consumed, when fuel is on.
    pub fuel: u64,
}

impl Outcome {
    /// The request headers reached the upstream (the filter let the request through).
    pub fn continued(&self) -> bool {
        self.request_headers.is_some()
    }

    /// The filter holds the request.
    pub fn paused(&self) -> bool {
        self.state == StreamState::RequestPaused
    }

    /// First value of an upstream request header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.request_headers.as_ref().and_then(|h| h.get(name))
    }

    /// Status the client received, if the stream got that far.
    pub fn status(&self) -> Option<u16> {
        self.response.as_ref().map(|r| r.status)
    }

    /// The error, if the module trapped.
    pub fn error(&self) -> Option<&HostError> {
        match &self.state {
            StreamState::Failed(e) => Some(e),
            _ => None,
        }
    }

    /// A property the filter set.
    pub fn property(&self, path: &[&str]) -> Option<&[u8]> {
        self.properties
            .iter()
            .rev()
            .find(|(p, _)| p.iter().map(String::as_str).eq(path.iter().copied()))
            .map(|(_, v)| v.as_slice())
    }
}
