//! Building a request: [`RequestBuilder`], from [`Gateway::request`].

use std::collections::HashMap;

use crate::gateway::Gateway;
use crate::headers::Headers;
use crate::stream::RequestSpec;
use crate::types::{Outcome, RequestId, Response};

impl Gateway {
    /// Starts a request; finish it with [`RequestBuilder::send`] or [`RequestBuilder::start`].
    pub fn request(&mut self) -> RequestBuilder<'_> {
        RequestBuilder::new(self)
    }
}

/// Builds one request. Defaults: `GET` (`POST` once a body is set), path `/`, authority
/// `localhost`, scheme `http`; a body adds `content-length`; the body arrives as one chunk;
/// round-robin over workers; the upstream answers with [`Gateway::set_upstream`]'s responder.
pub struct RequestBuilder<'g> {
    gw: &'g mut Gateway,
    method: Option<String>,
    path: String,
    authority: String,
    scheme: String,
    headers: Headers,
    body: Option<Vec<u8>>,
    chunk_size: Option<usize>,
    chunks: Option<Vec<Vec<u8>>>,
    trailers: Option<Headers>,
    worker: Option<usize>,
    properties: HashMap<Vec<String>, Vec<u8>>,
    response: Option<Response>,
    hold_response: bool,
}

impl<'g> RequestBuilder<'g> {
    fn new(gw: &'g mut Gateway) -> Self {
        RequestBuilder {
            gw,
            method: None,
            path: "/".into(),
            authority: "localhost".into(),
            scheme: "http".into(),
            headers: Headers::new(),
            body: None,
            chunk_size: None,
            chunks: None,
            trailers: None,
            worker: None,
            properties: HashMap::new(),
            response: None,
            hold_response: false,
        }
    }

    /// `:method`.
    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.into());
        self
    }

    /// `:path`.
    pub fn path(mut self, path: &str) -> Self {
        self.path = path.into();
        self
    }

    /// `:authority`.
    pub fn authority(mut self, authority: &str) -> Self {
        self.authority = authority.into();
        self
    }

    /// Adds a header (name lower-cased).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value);
        self
    }

    /// Adds a header with a byte value (not necessarily UTF-8).
    pub fn header_bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.headers.add_bytes(name.as_bytes(), value);
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    /// Sets a JSON body and `content-type: application/json`.
    ///
    /// # Panics
    /// If `value` does not serialize.
    pub fn json_body<T: serde::Serialize + ?Sized>(mut self, value: &T) -> Self {
        self.body = Some(serde_json::to_vec(value).expect("serializable body"));
        self.headers.set("content-type", "application/json");
        self
    }

    /// Delivers the body in chunks of this many bytes (Envoy delivers what the network gives).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = Some(bytes.max(1));
        self
    }

    /// Delivers the body as exactly these chunks (overrides [`RequestBuilder::body`]).
    pub fn body_chunks(mut self, chunks: Vec<Vec<u8>>) -> Self {
        self.chunks = Some(chunks);
        self
    }

    /// Adds a request trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        self.trailers
            .get_or_insert_with(Headers::new)
            .add(name, value);
        self
    }

    /// Sends to this worker VM instead of round-robin.
    pub fn worker(mut self, worker: usize) -> Self {
        self.worker = Some(worker);
        self
    }

    /// A property of this request only (metadata, filter state set by an earlier filter...).
    pub fn property(mut self, path: &[&str], value: impl AsRef<[u8]>) -> Self {
        self.properties.insert(
            path.iter().map(|s| s.to_string()).collect(),
            value.as_ref().to_vec(),
        );
        self
    }

    /// What the upstream answers to this request.
    pub fn upstream_response(mut self, response: Response) -> Self {
        self.response = Some(response);
        self
    }

    /// Keeps the stream open once the request reached the upstream, until
    /// [`Gateway::respond`] (to observe state held while requests are in flight).
    pub fn hold_response(mut self) -> Self {
        self.hold_response = true;
        self
    }

    fn into_spec(self) -> (&'g mut Gateway, RequestSpec) {
        let chunks = match (self.chunks, &self.body) {
            (Some(c), _) => c,
            (None, Some(b)) => match self.chunk_size {
                Some(n) => b.chunks(n).map(<[u8]>::to_vec).collect(),
                None => vec![b.clone()],
            },
            (None, None) => Vec::new(),
        };
        let has_body = chunks.iter().any(|c| !c.is_empty());
        let mut headers = Headers::new();
        let method = self.method.unwrap_or_else(|| {
            if has_body {
                "POST".into()
            } else {
                "GET".into()
            }
        });
        headers.add(":method", &method);
        headers.add(":scheme", &self.scheme);
        headers.add(":authority", &self.authority);
        headers.add(":path", &self.path);
        for (k, v) in self.headers.iter_bytes() {
            headers.add_bytes(k, v);
        }
        if has_body && !headers.contains("content-length") {
            let len: usize = chunks.iter().map(Vec::len).sum();
            headers.add("content-length", &len.to_string());
        }
        let spec = RequestSpec {
            headers,
            body: chunks,
            trailers: self.trailers,
            worker: self.worker,
            properties: self.properties,
            response: self.response,
            hold_response: self.hold_response,
        };
        (self.gw, spec)
    }

    /// Runs the request as far as it goes (callouts answered by their cluster included) and
    /// returns its outcome. A paused request can go on later: [`Gateway::reply`],
    /// [`Gateway::advance`], then [`Gateway::outcome`].
    pub fn send(self) -> Outcome {
        let (gw, spec) = self.into_spec();
        let id = gw.start_request(spec);
        gw.outcome(id)
    }

    /// Like [`RequestBuilder::send`] but returns the id only.
    pub fn start(self) -> RequestId {
        let (gw, spec) = self.into_spec();
        gw.start_request(spec)
    }
}

impl std::fmt::Debug for RequestBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBuilder")
            .field("path", &self.path)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}
