//! The state one VM's hostcalls work on: its memory and allocator, its contexts, the
//! callouts and effects it queued, and a handle on the state every VM of the gateway shares.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use wasmtime::{Memory, TypedFunc};

use crate::abi::{buffer, map, status, LogLevel};
use crate::headers::Headers;
use crate::model::{CallResponse, Deferred, HostOptions, HttpCtx, PendingCall, CLOCK_ORIGIN_NANOS};
use crate::shared::Shared;
use crate::types::LogEntry;

/// The wasmtime store data of one VM.
pub(crate) struct HostState {
    pub shared: Shared,
    pub opts: Arc<HostOptions>,
    pub worker: usize,
    pub memory: Option<Memory>,
    pub alloc: Option<TypedFunc<i32, i32>>,
    pub root_id: u32,
    pub effective: u32,
    /// Only a few hostcalls are allowed while `_initialize` runs (cpp-host `startVm`).
    pub restricted: bool,
    pub tick_period_ms: u32,
    pub next_tick_nanos: Option<u64>,
    pub contexts: HashMap<u32, HttpCtx>,
    pub next_token: u32,
    pub calls: BTreeMap<u32, PendingCall>,
    pub call_response: Option<CallResponse>,
    pub call_data: Option<Vec<u8>>,
    pub deferred: Vec<Deferred>,
    /// `proxy_get_status`: code and message of the last callout failure.
    pub status: (u32, Vec<u8>),
    rng: u64,
    pub last_critical: Option<String>,
    /// Partial lines written to stdout and stderr.
    pub fd_lines: [Vec<u8>; 2],
    /// Test-clock origin, to report callouts' dispatch times.
    pub clock_origin: u64,
    /// Restricted hostcalls made by this VM, by import name (a data-path filter is judged
    /// by how often it crosses into the host: a crossing costs one to a few microseconds in
    /// V8). A short list found by the name's address, so counting adds next to nothing to
    /// what the benches time.
    pub hostcalls: Vec<(&'static str, u64)>,
}

impl HostState {
    /// A VM's state before its module is instantiated: no memory, no contexts, the root
    /// context id 1, and a random generator seeded by the worker index.
    pub(crate) fn new(opts: Arc<HostOptions>, shared: Shared, worker: usize) -> HostState {
        HostState {
            shared,
            opts,
            worker,
            memory: None,
            alloc: None,
            root_id: 1,
            effective: 0,
            restricted: false,
            tick_period_ms: 0,
            next_tick_nanos: None,
            contexts: HashMap::new(),
            next_token: 0,
            calls: BTreeMap::new(),
            call_response: None,
            call_data: None,
            deferred: Vec::new(),
            status: (0, Vec::new()),
            rng: 0x5eed_0000 + worker as u64,
            last_critical: None,
            fd_lines: Default::default(),
            clock_origin: CLOCK_ORIGIN_NANOS,
            hostcalls: Vec::new(),
        }
    }

    pub(crate) fn log(&mut self, level: LogLevel, message: String) {
        if level == LogLevel::Critical {
            self.last_critical = Some(message.clone());
        }
        let entry = LogEntry {
            worker: self.worker,
            context_id: self.effective,
            level,
            message,
        };
        self.shared.lock().logs.push(entry);
    }

    pub(crate) fn http(&mut self) -> Option<&mut HttpCtx> {
        let id = self.effective;
        self.contexts.get_mut(&id)
    }

    /// The header map of `map_type` for the effective context; `Err(status)` if not available.
    pub(crate) fn map(&mut self, map_type: i32) -> Result<&mut Headers, i32> {
        let slot = match map_type {
            map::HTTP_CALL_RESPONSE_HEADERS => {
                return self
                    .call_response
                    .as_mut()
                    .map(|r| &mut r.headers)
                    .ok_or(status::BAD_ARGUMENT)
            }
            map::HTTP_CALL_RESPONSE_TRAILERS => {
                return self
                    .call_response
                    .as_mut()
                    .map(|r| &mut r.trailers)
                    .ok_or(status::BAD_ARGUMENT)
            }
            _ => {
                let ctx = self.http().ok_or(status::BAD_ARGUMENT)?;
                match map_type {
                    map::REQUEST_HEADERS => &mut ctx.request_headers,
                    map::REQUEST_TRAILERS => &mut ctx.request_trailers,
                    map::RESPONSE_HEADERS => &mut ctx.response_headers,
                    map::RESPONSE_TRAILERS => &mut ctx.response_trailers,
                    _ => return Err(status::BAD_ARGUMENT),
                }
            }
        };
        slot.as_mut().ok_or(status::BAD_ARGUMENT)
    }

    pub(crate) fn buffer(&mut self, buffer_type: i32) -> Option<&mut Vec<u8>> {
        match buffer_type {
            buffer::HTTP_REQUEST_BODY => self.http().map(|c| &mut c.request_body),
            buffer::HTTP_RESPONSE_BODY => self.http().map(|c| &mut c.response_body),
            buffer::HTTP_CALL_RESPONSE_BODY => self.call_response.as_mut().map(|r| &mut r.body),
            buffer::CALL_DATA => self.call_data.as_mut(),
            _ => None,
        }
    }

    pub(crate) fn now(&self) -> u64 {
        self.shared.lock().now_nanos
    }

    pub(crate) fn next_random(&mut self) -> u64 {
        // splitmix64: deterministic per worker so runs repeat exactly.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn property(&self, path: &[String]) -> Option<Vec<u8>> {
        if let Some(ctx) = self.contexts.get(&self.effective) {
            if let Some((_, v)) = ctx.set_properties.iter().rev().find(|(p, _)| p == path) {
                return Some(v.clone());
            }
            if let Some(v) = ctx.given_properties.get(path) {
                return Some(v.clone());
            }
            if let Some(h) = &ctx.request_headers {
                let p: Vec<&str> = path.iter().map(String::as_str).collect();
                let from_header = match p.as_slice() {
                    ["request", "path"] => h.get_bytes(b":path"),
                    ["request", "method"] => h.get_bytes(b":method"),
                    ["request", "host"] => h.get_bytes(b":authority"),
                    ["request", "scheme"] => h.get_bytes(b":scheme"),
                    ["request", "headers", name] => h.get_bytes(name.as_bytes()),
                    _ => None,
                };
                if let Some(v) = from_header {
                    return Some(v.to_vec());
                }
            }
        }
        if let Some(v) = self.shared.lock().properties.get(path) {
            return Some(v.clone());
        }
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        match p.as_slice() {
            ["plugin_name"] => Some(self.opts.plugin_name.clone().into_bytes()),
            ["plugin_root_id"] => Some(self.opts.root_id.clone().into_bytes()),
            ["plugin_vm_id"] => Some(self.opts.vm_id.clone().into_bytes()),
            _ => None,
        }
    }
}
