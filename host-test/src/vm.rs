//! One VM: a wasmtime store and instance of the module, the `env` and WASI imports it links,
//! and typed handles on the callbacks it exports.
//!
//! Hostcalls run against the *effective context* (the context of the current callback, or
//! the one `proxy_set_effective_context` chose). Effects Envoy applies only after the VM call
//! returns (`proxy_continue_stream`, `proxy_send_local_response`, `proxy_close_stream`: Envoy
//! queues them with `addAfterVmCallAction`) are queued here as [`Deferred`] and applied by the
//! gateway's driver.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use wasmtime::{Caller, Extern, Instance, Linker, Memory, Module, Store, TypedFunc};

use crate::abi::{self, buffer, map, status, LogLevel, MetricKind};
use crate::headers::Headers;
use crate::shared::{Metric, Shared};
use crate::types::{Callout, CalloutId, HostError, LocalResponse, LogEntry};
use crate::Mode;

/// Fuel given to each callback: far more than any sane callback needs, so running out means
/// a runaway loop, reported as a trap instead of hanging the test.
pub(crate) const DEFAULT_FUEL_PER_CALL: u64 = 20_000_000_000;

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

#[derive(Debug, Clone)]
pub(crate) struct PendingCall {
    pub callout: Callout,
    pub deadline_nanos: Option<u64>,
    /// The cluster's handler was asked and chose not to answer.
    pub consulted: bool,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct CallResponse {
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
}

pub(crate) struct HostState {
    pub shared: Shared,
    pub opts: Arc<HostOptions>,
    pub worker: usize,
    memory: Option<Memory>,
    alloc: Option<TypedFunc<i32, i32>>,
    pub root_id: u32,
    pub effective: u32,
    /// Only a few hostcalls are allowed while `_initialize` runs (cpp-host `startVm`).
    restricted: bool,
    pub tick_period_ms: u32,
    pub next_tick_nanos: Option<u64>,
    pub contexts: HashMap<u32, HttpCtx>,
    next_token: u32,
    pub calls: BTreeMap<u32, PendingCall>,
    pub call_response: Option<CallResponse>,
    pub call_data: Option<Vec<u8>>,
    pub deferred: Vec<Deferred>,
    /// `proxy_get_status`: code and message of the last callout failure.
    pub status: (u32, Vec<u8>),
    rng: u64,
    pub last_critical: Option<String>,
    /// Partial lines written to stdout and stderr.
    fd_lines: [Vec<u8>; 2],
    /// Test-clock origin, to report callouts' dispatch times.
    pub clock_origin: u64,
}

type C<'a> = Caller<'a, HostState>;
type R = wasmtime::Result<i32>;

impl HostState {
    fn log(&mut self, level: LogLevel, message: String) {
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

    fn http(&mut self) -> Option<&mut HttpCtx> {
        let id = self.effective;
        self.contexts.get_mut(&id)
    }

    /// The header map of `map_type` for the effective context; `Err(status)` if not available.
    fn map(&mut self, map_type: i32) -> Result<&mut Headers, i32> {
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

    fn buffer(&mut self, buffer_type: i32) -> Option<&mut Vec<u8>> {
        match buffer_type {
            buffer::HTTP_REQUEST_BODY => self.http().map(|c| &mut c.request_body),
            buffer::HTTP_RESPONSE_BODY => self.http().map(|c| &mut c.response_body),
            buffer::HTTP_CALL_RESPONSE_BODY => self.call_response.as_mut().map(|r| &mut r.body),
            buffer::CALL_DATA => self.call_data.as_mut(),
            _ => None,
        }
    }

    fn now(&self) -> u64 {
        self.shared.lock().now_nanos
    }

    fn next_random(&mut self) -> u64 {
        // splitmix64: deterministic per worker so runs repeat exactly.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn property(&self, path: &[String]) -> Option<Vec<u8>> {
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

fn guard(c: &C<'_>, name: &str) -> wasmtime::Result<()> {
    if c.data().restricted {
        wasmtime::bail!("restricted callback during _initialize: {name}");
    }
    Ok(())
}

fn memory(c: &C<'_>) -> wasmtime::Result<Memory> {
    c.data()
        .memory
        .ok_or_else(|| wasmtime::format_err!("module exports no memory"))
}

fn read(c: &mut C<'_>, ptr: i32, len: i32) -> wasmtime::Result<Option<Vec<u8>>> {
    let mem = memory(c)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    Ok(mem
        .data(&*c)
        .get(ptr..ptr.saturating_add(len))
        .map(<[u8]>::to_vec))
}

fn write(c: &mut C<'_>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<bool> {
    let mem = memory(c)?;
    let ptr = ptr as u32 as usize;
    match mem
        .data_mut(&mut *c)
        .get_mut(ptr..ptr.saturating_add(bytes.len()))
    {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(true)
        }
        None => Ok(false),
    }
}

fn write_u32(c: &mut C<'_>, ptr: i32, v: u32) -> wasmtime::Result<bool> {
    write(c, ptr, &v.to_le_bytes())
}

/// Copies `bytes` into memory the module allocates (`proxy_on_memory_allocate`) and writes
/// pointer and size (cpp-host `copyToPointerSize`: an empty value is a null pointer).
fn copy_out(c: &mut C<'_>, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> R {
    let ptr = if bytes.is_empty() {
        0
    } else {
        let alloc = c
            .data()
            .alloc
            .clone()
            .ok_or_else(|| wasmtime::format_err!("module exports no allocator"))?;
        let ptr = alloc.call(&mut *c, bytes.len() as i32)?;
        if ptr == 0 || !write(c, ptr, bytes)? {
            return Ok(status::INVALID_MEMORY_ACCESS);
        }
        ptr
    };
    if !write_u32(c, ptr_ptr, ptr as u32)? || !write_u32(c, size_ptr, bytes.len() as u32)? {
        return Ok(status::INVALID_MEMORY_ACCESS);
    }
    Ok(status::OK)
}

macro_rules! read_or {
    ($c:expr, $ptr:expr, $len:expr) => {
        match read($c, $ptr, $len)? {
            Some(v) => v,
            None => return Ok(status::INVALID_MEMORY_ACCESS),
        }
    };
}

fn split_path(bytes: &[u8]) -> Vec<String> {
    let trimmed = bytes.strip_suffix(&[0]).unwrap_or(bytes);
    trimmed
        .split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// Links every import Envoy (and in Higress mode, Higress) offers a module of ABI 0.2.1.
pub(crate) fn link(linker: &mut Linker<HostState>, mode: Mode) -> wasmtime::Result<()> {
    link_env(linker)?;
    if mode == Mode::Higress {
        link_higress(linker)?;
    }
    for module in abi::WASI_MODULES {
        link_wasi(linker, module)?;
    }
    Ok(())
}

fn link_env(l: &mut Linker<HostState>) -> wasmtime::Result<()> {
    l.func_wrap(
        "env",
        "proxy_log",
        |mut c: C<'_>, level: i32, ptr: i32, len: i32| -> R {
            let msg = read_or!(&mut c, ptr, len);
            let Some(level) = LogLevel::from_abi(level) else {
                return Ok(status::BAD_ARGUMENT);
            };
            c.data_mut()
                .log(level, String::from_utf8_lossy(&msg).into_owned());
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_log_level",
        |mut c: C<'_>, ptr: i32| -> R {
            guard(&c, "proxy_get_log_level")?;
            let level = c.data().shared.lock().log_level.unwrap_or(LogLevel::Info);
            if !write_u32(&mut c, ptr, level.to_abi() as u32)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, ptr: i32| -> R {
            guard(&c, "proxy_get_current_time_nanoseconds")?;
            let now = c.data().now();
            if !write(&mut c, ptr, &now.to_le_bytes())? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, period: i32| -> R {
            guard(&c, "proxy_set_tick_period_milliseconds")?;
            let now = c.data().now();
            let s = c.data_mut();
            s.tick_period_ms = period as u32;
            s.next_tick_nanos = (period != 0).then(|| now + period as u32 as u64 * 1_000_000);
            Ok(status::OK)
        },
    )?;

    // Buffers.
    l.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut c: C<'_>, ty: i32, start: i32, max: i32, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_buffer_bytes")?;
            let (start, max) = (start as u32 as usize, max as u32 as usize);
            let s = c.data_mut();
            let bytes = match ty {
                buffer::VM_CONFIGURATION => s.opts.vm_config.clone(),
                buffer::PLUGIN_CONFIGURATION => s.opts.plugin_config.clone(),
                _ => match s.buffer(ty) {
                    Some(b) => {
                        if start.checked_add(max).is_none() {
                            return Ok(status::BAD_ARGUMENT);
                        }
                        let end = (start + max).min(b.len());
                        b.get(start..end).map(<[u8]>::to_vec).unwrap_or_default()
                    }
                    None => return Ok(status::NOT_FOUND),
                },
            };
            let bytes = if matches!(ty, buffer::VM_CONFIGURATION | buffer::PLUGIN_CONFIGURATION) {
                let end = start.saturating_add(max).min(bytes.len());
                bytes
                    .get(start..end)
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default()
            } else {
                bytes
            };
            copy_out(&mut c, &bytes, ptr_ptr, size_ptr)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_buffer_bytes",
        |mut c: C<'_>, ty: i32, start: i32, length: i32, ptr: i32, size: i32| -> R {
            guard(&c, "proxy_set_buffer_bytes")?;
            let data = read_or!(&mut c, ptr, size);
            let (start, length) = (start as u32 as usize, length as u32 as usize);
            if !matches!(ty, buffer::HTTP_REQUEST_BODY | buffer::HTTP_RESPONSE_BODY) {
                return Ok(status::BAD_ARGUMENT);
            }
            let Some(b) = c.data_mut().buffer(ty) else {
                return Ok(status::NOT_FOUND);
            };
            // Envoy's Buffer::copyFrom: prepend, replace whole, or append; nothing in between.
            if start == 0 {
                if length == 0 {
                    b.splice(0..0, data);
                } else if length >= b.len() {
                    *b = data;
                } else {
                    return Ok(status::BAD_ARGUMENT);
                }
            } else if start >= b.len() {
                b.extend_from_slice(&data);
            } else {
                return Ok(status::BAD_ARGUMENT);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_buffer_status",
        |mut c: C<'_>, ty: i32, len_ptr: i32, flags_ptr: i32| -> R {
            guard(&c, "proxy_get_buffer_status")?;
            let s = c.data_mut();
            let len = match ty {
                buffer::VM_CONFIGURATION => s.opts.vm_config.len(),
                buffer::PLUGIN_CONFIGURATION => s.opts.plugin_config.len(),
                _ => match s.buffer(ty) {
                    Some(b) => b.len(),
                    None => return Ok(status::NOT_FOUND),
                },
            };
            if !write_u32(&mut c, len_ptr, len as u32)? || !write_u32(&mut c, flags_ptr, 0)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;

    // Header maps.
    l.func_wrap(
        "env",
        "proxy_get_header_map_size",
        |mut c: C<'_>, ty: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_header_map_size")?;
            let size = match c.data_mut().map(ty) {
                Ok(m) => abi::serialize_pairs(m.iter_bytes()).len(),
                Err(st) => return Ok(st),
            };
            if !write_u32(&mut c, size_ptr, size as u32)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_header_map_pairs",
        |mut c: C<'_>, ty: i32, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_header_map_pairs")?;
            let bytes = match c.data_mut().map(ty) {
                Ok(m) => abi::serialize_pairs(m.iter_bytes()),
                Err(st) => return Ok(st),
            };
            copy_out(&mut c, &bytes, ptr_ptr, size_ptr)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_header_map_pairs",
        |mut c: C<'_>, ty: i32, ptr: i32, size: i32| -> R {
            guard(&c, "proxy_set_header_map_pairs")?;
            let bytes = read_or!(&mut c, ptr, size);
            let Some(new) = abi::deserialize_pairs(&bytes) else {
                return Ok(status::SERIALIZATION_FAILURE);
            };
            match c.data_mut().map(ty) {
                Ok(m) => {
                    *m = new;
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut c: C<'_>, ty: i32, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_header_map_value")?;
            let key = read_or!(&mut c, kptr, klen);
            let value = match c.data_mut().map(ty) {
                Ok(m) => match m.get_bytes(&key) {
                    Some(v) => v.to_vec(),
                    None => return Ok(status::NOT_FOUND),
                },
                Err(st) => return Ok(st),
            };
            copy_out(&mut c, &value, ptr_ptr, size_ptr)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut c: C<'_>, ty: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32| -> R {
            guard(&c, "proxy_add_header_map_value")?;
            let key = read_or!(&mut c, kptr, klen);
            let value = read_or!(&mut c, vptr, vlen);
            match c.data_mut().map(ty) {
                Ok(m) => {
                    m.add_bytes(&key, &value);
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut c: C<'_>, ty: i32, kptr: i32, klen: i32, vptr: i32, vlen: i32| -> R {
            guard(&c, "proxy_replace_header_map_value")?;
            let key = read_or!(&mut c, kptr, klen);
            let value = read_or!(&mut c, vptr, vlen);
            match c.data_mut().map(ty) {
                Ok(m) => {
                    m.set_bytes(&key, &value);
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut c: C<'_>, ty: i32, kptr: i32, klen: i32| -> R {
            guard(&c, "proxy_remove_header_map_value")?;
            let key = read_or!(&mut c, kptr, klen);
            match c.data_mut().map(ty) {
                Ok(m) => {
                    m.remove_bytes(&key);
                    Ok(status::OK)
                }
                Err(st) => Ok(st),
            }
        },
    )?;

    // Properties.
    l.func_wrap(
        "env",
        "proxy_get_property",
        |mut c: C<'_>, pptr: i32, plen: i32, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_property")?;
            let path = split_path(&read_or!(&mut c, pptr, plen));
            match c.data().property(&path) {
                Some(v) => copy_out(&mut c, &v, ptr_ptr, size_ptr),
                None => Ok(status::NOT_FOUND),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: C<'_>, pptr: i32, plen: i32, vptr: i32, vlen: i32| -> R {
            guard(&c, "proxy_set_property")?;
            let path = split_path(&read_or!(&mut c, pptr, plen));
            let value = read_or!(&mut c, vptr, vlen);
            // Envoy writes filter state of the stream; a root context has no stream.
            match c.data_mut().http() {
                Some(ctx) => {
                    ctx.set_properties.push((path, value));
                    Ok(status::OK)
                }
                None => Ok(status::NOT_FOUND),
            }
        },
    )?;

    // Shared data.
    l.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: C<'_>, kptr: i32, klen: i32, ptr_ptr: i32, size_ptr: i32, cas_ptr: i32| -> R {
            guard(&c, "proxy_get_shared_data")?;
            let key = read_or!(&mut c, kptr, klen);
            let entry = c.data().shared.lock().shared_data.map.get(&key).cloned();
            let Some(entry) = entry else {
                return Ok(status::NOT_FOUND);
            };
            let st = copy_out(&mut c, &entry.value, ptr_ptr, size_ptr)?;
            if st != status::OK {
                return Ok(st);
            }
            if !write_u32(&mut c, cas_ptr, entry.cas)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: C<'_>, kptr: i32, klen: i32, vptr: i32, vlen: i32, cas: i32| -> R {
            guard(&c, "proxy_set_shared_data")?;
            let key = read_or!(&mut c, kptr, klen);
            let value = read_or!(&mut c, vptr, vlen);
            let result = c
                .data()
                .shared
                .lock()
                .shared_data
                .set(&key, &value, cas as u32);
            Ok(if result.is_ok() {
                status::OK
            } else {
                status::CAS_MISMATCH
            })
        },
    )?;

    // Shared queues.
    l.func_wrap(
        "env",
        "proxy_register_shared_queue",
        |mut c: C<'_>, nptr: i32, nlen: i32, id_ptr: i32| -> R {
            guard(&c, "proxy_register_shared_queue")?;
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let s = c.data();
            let token = s
                .shared
                .lock()
                .queues
                .register(&s.opts.vm_id, &name, s.worker, s.root_id);
            if !write_u32(&mut c, id_ptr, token)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_resolve_shared_queue",
        |mut c: C<'_>, vptr: i32, vlen: i32, nptr: i32, nlen: i32, id_ptr: i32| -> R {
            guard(&c, "proxy_resolve_shared_queue")?;
            let vm_id = String::from_utf8_lossy(&read_or!(&mut c, vptr, vlen)).into_owned();
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let token = c.data().shared.lock().queues.resolve(&vm_id, &name);
            let Some(token) = token else {
                return Ok(status::NOT_FOUND);
            };
            if !write_u32(&mut c, id_ptr, token)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_enqueue_shared_queue",
        |mut c: C<'_>, token: i32, ptr: i32, len: i32| -> R {
            guard(&c, "proxy_enqueue_shared_queue")?;
            let value = read_or!(&mut c, ptr, len);
            let mut inner = c.data().shared.lock();
            let Some(q) = inner.queues.by_token.get_mut(&(token as u32)) else {
                return Ok(status::NOT_FOUND);
            };
            q.items.push_back(value);
            let ready = (q.owner_vm, q.owner_root, token as u32);
            inner.queue_ready.push(ready);
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_dequeue_shared_queue",
        |mut c: C<'_>, token: i32, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_dequeue_shared_queue")?;
            let item = {
                let mut inner = c.data().shared.lock();
                let Some(q) = inner.queues.by_token.get_mut(&(token as u32)) else {
                    return Ok(status::NOT_FOUND);
                };
                match q.items.pop_front() {
                    Some(item) => item,
                    None => return Ok(status::EMPTY),
                }
            };
            copy_out(&mut c, &item, ptr_ptr, size_ptr)
        },
    )?;

    // Metrics (process-wide in Envoy: every VM defining a name shares the stat).
    l.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: C<'_>, ty: i32, nptr: i32, nlen: i32, id_ptr: i32| -> R {
            guard(&c, "proxy_define_metric")?;
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let Some(kind) = MetricKind::from_abi(ty) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let id = {
                let mut inner = c.data().shared.lock();
                match inner.metrics.iter().position(|m| m.name == name) {
                    Some(i) if inner.metrics[i].kind == kind => i + 1,
                    Some(_) => return Ok(status::BAD_ARGUMENT),
                    None => {
                        inner.metrics.push(Metric {
                            name,
                            kind,
                            value: 0,
                            samples: Vec::new(),
                        });
                        inner.metrics.len()
                    }
                }
            };
            if !write_u32(&mut c, id_ptr, id as u32)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_increment_metric",
        |c: C<'_>, id: i32, offset: i64| -> R {
            guard(&c, "proxy_increment_metric")?;
            let mut inner = c.data().shared.lock();
            let Some(m) = (id as u32 as usize)
                .checked_sub(1)
                .and_then(|i| inner.metrics.get_mut(i))
            else {
                return Ok(status::NOT_FOUND);
            };
            match m.kind {
                // Envoy counters only go up.
                MetricKind::Counter if offset > 0 => m.value = m.value.wrapping_add(offset as u64),
                MetricKind::Gauge => m.value = m.value.wrapping_add(offset as u64),
                _ => return Ok(status::BAD_ARGUMENT),
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_record_metric",
        |c: C<'_>, id: i32, value: i64| -> R {
            guard(&c, "proxy_record_metric")?;
            let mut inner = c.data().shared.lock();
            let Some(m) = (id as u32 as usize)
                .checked_sub(1)
                .and_then(|i| inner.metrics.get_mut(i))
            else {
                return Ok(status::NOT_FOUND);
            };
            let value = value as u64;
            match m.kind {
                MetricKind::Counter => m.value = m.value.wrapping_add(value),
                MetricKind::Gauge => m.value = value,
                MetricKind::Histogram => m.samples.push(value),
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_metric",
        |mut c: C<'_>, id: i32, ptr: i32| -> R {
            guard(&c, "proxy_get_metric")?;
            let value = {
                let inner = c.data().shared.lock();
                let Some(m) = (id as u32 as usize)
                    .checked_sub(1)
                    .and_then(|i| inner.metrics.get(i))
                else {
                    return Ok(status::NOT_FOUND);
                };
                if m.kind == MetricKind::Histogram {
                    return Ok(status::BAD_ARGUMENT);
                }
                m.value
            };
            if !write(&mut c, ptr, &value.to_le_bytes())? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;

    // Streams.
    l.func_wrap(
        "env",
        "proxy_continue_stream",
        |mut c: C<'_>, stream: i32| -> R {
            guard(&c, "proxy_continue_stream")?;
            if !matches!(stream, abi::stream::REQUEST | abi::stream::RESPONSE) {
                return Ok(status::BAD_ARGUMENT);
            }
            let s = c.data_mut();
            let context = s.effective;
            if s.contexts.contains_key(&context) {
                s.deferred.push(Deferred::Continue { context, stream });
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_close_stream",
        |mut c: C<'_>, stream: i32| -> R {
            guard(&c, "proxy_close_stream")?;
            if !matches!(stream, abi::stream::REQUEST | abi::stream::RESPONSE) {
                return Ok(status::BAD_ARGUMENT);
            }
            let s = c.data_mut();
            let context = s.effective;
            if s.contexts.contains_key(&context) {
                s.deferred.push(Deferred::Close { context });
            }
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_send_local_response",
        |mut c: C<'_>,
         code: i32,
         dptr: i32,
         dlen: i32,
         bptr: i32,
         blen: i32,
         hptr: i32,
         hlen: i32,
         grpc: i32|
         -> R {
            guard(&c, "proxy_send_local_response")?;
            let details = read_or!(&mut c, dptr, dlen);
            let body = read_or!(&mut c, bptr, blen);
            let headers = read_or!(&mut c, hptr, hlen);
            let Some(headers) = abi::deserialize_pairs(&headers) else {
                return Ok(status::SERIALIZATION_FAILURE);
            };
            let s = c.data_mut();
            let context = s.effective;
            if !s.contexts.contains_key(&context) {
                return Ok(status::BAD_ARGUMENT);
            }
            let response = LocalResponse {
                status: code as u32 as u16,
                details: String::from_utf8_lossy(&details).into_owned(),
                headers,
                body,
                grpc_status: grpc,
                from_filter: true,
            };
            s.deferred.push(Deferred::Local { context, response });
            Ok(status::OK)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_status",
        |mut c: C<'_>, code_ptr: i32, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_status")?;
            let (code, msg) = c.data().status.clone();
            if !write_u32(&mut c, code_ptr, code)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            copy_out(&mut c, &msg, ptr_ptr, size_ptr)
        },
    )?;

    // HTTP callouts.
    l.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: C<'_>,
         uptr: i32,
         ulen: i32,
         hptr: i32,
         hlen: i32,
         bptr: i32,
         blen: i32,
         tptr: i32,
         tlen: i32,
         timeout_ms: i32,
         token_ptr: i32|
         -> R {
            guard(&c, "proxy_http_call")?;
            let cluster = String::from_utf8_lossy(&read_or!(&mut c, uptr, ulen)).into_owned();
            let headers = read_or!(&mut c, hptr, hlen);
            let body = read_or!(&mut c, bptr, blen);
            let trailers = read_or!(&mut c, tptr, tlen);
            let (Some(headers), Some(trailers)) = (
                abi::deserialize_pairs(&headers),
                abi::deserialize_pairs(&trailers),
            ) else {
                return Ok(status::SERIALIZATION_FAILURE);
            };
            // Envoy's Context::httpCall: the cluster must exist and these headers are required.
            if !c.data().shared.lock().clusters.contains_key(&cluster)
                || ![":path", ":method", ":authority"]
                    .iter()
                    .all(|h| headers.contains(h))
            {
                return Ok(status::BAD_ARGUMENT);
            }
            let now = c.data().now();
            let s = c.data_mut();
            let mut token = s.next_token;
            loop {
                token = token.wrapping_add(1).max(1);
                if !s.calls.contains_key(&token) {
                    break;
                }
            }
            s.next_token = token;
            let timeout_ms = timeout_ms as u32;
            let timeout =
                (timeout_ms > 0).then(|| std::time::Duration::from_millis(timeout_ms as u64));
            let callout = Callout {
                id: CalloutId {
                    worker: s.worker,
                    token,
                },
                context_id: s.effective,
                cluster,
                headers,
                body,
                trailers,
                timeout,
                dispatched_at: std::time::Duration::from_nanos(now.saturating_sub(s.clock_origin)),
            };
            let deadline_nanos = timeout.map(|t| now + t.as_nanos() as u64);
            s.shared.lock().callouts.push(callout.clone());
            s.calls.insert(
                token,
                PendingCall {
                    callout,
                    deadline_nanos,
                    consulted: false,
                },
            );
            if !write_u32(&mut c, token_ptr, token)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            Ok(status::OK)
        },
    )?;
    // gRPC is linked (Envoy links it) but no gRPC cluster exists here: ParseFailure, what
    // Envoy answers for a service it cannot resolve (and what the SDK expects).
    l.func_wrap(
        "env",
        "proxy_grpc_call",
        |c: C<'_>,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> R {
            guard(&c, "proxy_grpc_call")?;
            Ok(status::PARSE_FAILURE)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_grpc_stream",
        |c: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| -> R {
            guard(&c, "proxy_grpc_stream")?;
            Ok(status::PARSE_FAILURE)
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_grpc_send",
        |c: C<'_>, _: i32, _: i32, _: i32, _: i32| -> R {
            guard(&c, "proxy_grpc_send")?;
            Ok(status::NOT_FOUND)
        },
    )?;
    l.func_wrap("env", "proxy_grpc_cancel", |c: C<'_>, _: i32| -> R {
        guard(&c, "proxy_grpc_cancel")?;
        Ok(status::NOT_FOUND)
    })?;
    l.func_wrap("env", "proxy_grpc_close", |c: C<'_>, _: i32| -> R {
        guard(&c, "proxy_grpc_close")?;
        Ok(status::NOT_FOUND)
    })?;

    // Contexts and foreign functions.
    l.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut c: C<'_>, id: i32| -> R {
            guard(&c, "proxy_set_effective_context")?;
            let s = c.data_mut();
            let id = id as u32;
            if id != s.root_id && !s.contexts.contains_key(&id) {
                return Ok(status::BAD_ARGUMENT);
            }
            s.effective = id;
            Ok(status::OK)
        },
    )?;
    l.func_wrap("env", "proxy_done", |c: C<'_>| -> R {
        guard(&c, "proxy_done")?;
        Ok(status::OK)
    })?;
    l.func_wrap(
        "env",
        "proxy_call_foreign_function",
        |mut c: C<'_>,
         nptr: i32,
         nlen: i32,
         aptr: i32,
         alen: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> R {
            guard(&c, "proxy_call_foreign_function")?;
            let name = String::from_utf8_lossy(&read_or!(&mut c, nptr, nlen)).into_owned();
            let args = read_or!(&mut c, aptr, alen);
            let result = {
                let mut inner = c.data().shared.lock();
                inner.foreign_calls.push((name.clone(), args.clone()));
                match inner.foreign.get_mut(&name) {
                    Some(f) => f(&args),
                    None => return Ok(status::NOT_FOUND),
                }
            };
            match result {
                Ok(bytes) => copy_out(&mut c, &bytes, ptr_ptr, size_ptr),
                Err(st) => Ok(st as i32),
            }
        },
    )?;
    // Linked by cpp-host for emscripten-built modules.
    l.func_wrap("env", "pthread_equal", |_: C<'_>, a: i32, b: i32| -> i32 {
        (a == b) as i32
    })?;
    l.func_wrap(
        "env",
        "emscripten_notify_memory_growth",
        |_: C<'_>, _: i32| {},
    )?;
    Ok(())
}

fn link_higress(l: &mut Linker<HostState>) -> wasmtime::Result<()> {
    l.func_wrap(
        "env",
        "proxy_set_upstream_override_host",
        |mut c: C<'_>, ptr: i32, len: i32| -> R {
            guard(&c, "proxy_set_upstream_override_host")?;
            let host = read_or!(&mut c, ptr, len);
            match c.data_mut().http() {
                Some(ctx) => {
                    ctx.override_host = Some(host);
                    Ok(status::OK)
                }
                None => Ok(status::BAD_ARGUMENT),
            }
        },
    )?;
    l.func_wrap(
        "env",
        "proxy_get_upstream_hosts",
        |mut c: C<'_>, ptr_ptr: i32, size_ptr: i32| -> R {
            guard(&c, "proxy_get_upstream_hosts")?;
            let hosts = c.data().shared.lock().upstream_hosts.clone();
            let bytes =
                abi::serialize_pairs(hosts.iter().map(|(a, i)| (a.as_bytes(), i.as_bytes())));
            copy_out(&mut c, &bytes, ptr_ptr, size_ptr)
        },
    )?;
    Ok(())
}

/// WASI errno values.
mod errno {
    pub const SUCCESS: i32 = 0;
    pub const BADF: i32 = 8;
    pub const INVAL: i32 = 28;
    pub const NOENT: i32 = 44;
    pub const NOSYS: i32 = 52;
}

fn link_wasi(l: &mut Linker<HostState>, m: &str) -> wasmtime::Result<()> {
    // stdout/stderr become log lines at info/error, as Envoy does.
    l.func_wrap(
        m,
        "fd_write",
        |mut c: C<'_>, fd: i32, iovs: i32, iovs_len: i32, nwritten: i32| -> R {
            let mut data = Vec::new();
            for i in 0..iovs_len.max(0) {
                let Some(iov) = read(&mut c, iovs.wrapping_add(i * 8), 8)? else {
                    return Ok(errno::INVAL);
                };
                let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                let Some(bytes) = read(&mut c, ptr, len)? else {
                    return Ok(errno::INVAL);
                };
                data.extend_from_slice(&bytes);
            }
            let level = match fd {
                1 => LogLevel::Info,
                2 => LogLevel::Error,
                _ => return Ok(errno::BADF),
            };
            // Unbuffered stderr arrives in pieces: log whole lines.
            let pending = &mut c.data_mut().fd_lines[(fd - 1) as usize];
            pending.extend_from_slice(&data);
            let mut complete = Vec::new();
            while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=nl).collect();
                complete.push(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
            }
            for line in complete {
                c.data_mut().log(level, line);
            }
            if !write_u32(&mut c, nwritten, data.len() as u32)? {
                return Ok(errno::INVAL);
            }
            Ok(errno::SUCCESS)
        },
    )?;
    l.func_wrap(
        m,
        "fd_read",
        |_: C<'_>, _: i32, _: i32, _: i32, _: i32| -> i32 { errno::NOSYS },
    )?;
    l.func_wrap(
        m,
        "fd_seek",
        |_: C<'_>, _: i32, _: i64, _: i32, _: i32| -> i32 { errno::NOSYS },
    )?;
    l.func_wrap(m, "fd_close", |_: C<'_>, _: i32| -> i32 { errno::NOSYS })?;
    l.func_wrap(m, "fd_fdstat_get", |mut c: C<'_>, fd: i32, ptr: i32| -> R {
        if !(0..=2).contains(&fd) {
            return Ok(errno::BADF);
        }
        // filetype character device (2), no flags, all rights.
        let mut stat = [0u8; 24];
        stat[0] = 2;
        stat[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        stat[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        Ok(if write(&mut c, ptr, &stat)? {
            errno::SUCCESS
        } else {
            errno::INVAL
        })
    })?;
    l.func_wrap(
        m,
        "environ_sizes_get",
        |mut c: C<'_>, count_ptr: i32, size_ptr: i32| -> R {
            let env = c.data().opts.env.clone();
            let size: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
            if !write_u32(&mut c, count_ptr, env.len() as u32)?
                || !write_u32(&mut c, size_ptr, size as u32)?
            {
                return Ok(errno::INVAL);
            }
            Ok(errno::SUCCESS)
        },
    )?;
    l.func_wrap(m, "environ_get", |mut c: C<'_>, ptrs: i32, buf: i32| -> R {
        let env = c.data().opts.env.clone();
        let mut at = buf;
        for (i, (k, v)) in env.iter().enumerate() {
            let entry = format!("{k}={v}\0");
            if !write_u32(&mut c, ptrs + 4 * i as i32, at as u32)?
                || !write(&mut c, at, entry.as_bytes())?
            {
                return Ok(errno::INVAL);
            }
            at += entry.len() as i32;
        }
        Ok(errno::SUCCESS)
    })?;
    l.func_wrap(
        m,
        "args_sizes_get",
        |mut c: C<'_>, count_ptr: i32, size_ptr: i32| -> R {
            if !write_u32(&mut c, count_ptr, 0)? || !write_u32(&mut c, size_ptr, 0)? {
                return Ok(errno::INVAL);
            }
            Ok(errno::SUCCESS)
        },
    )?;
    l.func_wrap(m, "args_get", |_: C<'_>, _: i32, _: i32| -> i32 {
        errno::SUCCESS
    })?;
    // Both clocks follow the test clock.
    l.func_wrap(
        m,
        "clock_time_get",
        |mut c: C<'_>, id: i32, _precision: i64, ptr: i32| -> R {
            if !(0..=1).contains(&id) {
                return Ok(errno::INVAL);
            }
            let now = c.data().now();
            Ok(if write(&mut c, ptr, &now.to_le_bytes())? {
                errno::SUCCESS
            } else {
                errno::INVAL
            })
        },
    )?;
    l.func_wrap(m, "random_get", |mut c: C<'_>, ptr: i32, len: i32| -> R {
        let mut bytes = Vec::with_capacity(len.max(0) as usize);
        while bytes.len() < len.max(0) as usize {
            bytes.extend_from_slice(&c.data_mut().next_random().to_le_bytes());
        }
        bytes.truncate(len.max(0) as usize);
        Ok(if write(&mut c, ptr, &bytes)? {
            errno::SUCCESS
        } else {
            errno::INVAL
        })
    })?;
    l.func_wrap(
        m,
        "proc_exit",
        |_: C<'_>, code: i32| -> wasmtime::Result<()> { wasmtime::bail!("proc_exit({code})") },
    )?;
    l.func_wrap(
        m,
        "path_open",
        |_: C<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i64, _: i64, _: i32, _: i32| -> i32 {
            errno::NOENT
        },
    )?;
    // No preopened directories.
    l.func_wrap(m, "fd_prestat_get", |_: C<'_>, _: i32, _: i32| -> i32 {
        errno::BADF
    })?;
    l.func_wrap(
        m,
        "fd_prestat_dir_name",
        |_: C<'_>, _: i32, _: i32, _: i32| -> i32 { errno::BADF },
    )?;
    Ok(())
}

/// Refuses imports the host does not link, naming the first one, as Envoy's V8 loader does.
pub(crate) fn check_imports(module: &Module, mode: Mode) -> Result<(), HostError> {
    for import in module.imports() {
        let (m, n) = (import.module(), import.name());
        let known = match m {
            "env" => {
                abi::ENV_IMPORTS.contains(&n)
                    || (mode == Mode::Higress && abi::HIGRESS_IMPORTS.contains(&n))
            }
            _ if abi::WASI_MODULES.contains(&m) => abi::WASI_IMPORTS.contains(&n),
            _ => false,
        };
        if !known {
            return Err(HostError::UnknownImport {
                module: m.to_string(),
                name: n.to_string(),
            });
        }
    }
    Ok(())
}

/// ABI version the module declares; `Err` if none the host (in this mode) knows.
pub(crate) fn check_abi(module: &Module, mode: Mode) -> Result<Abi, HostError> {
    let exports: Vec<&str> = module.exports().map(|e| e.name()).collect();
    let has = |n: &str| exports.contains(&n);
    if has("proxy_abi_version_0_2_1") || has("proxy_abi_version_0_2_0") {
        // Higress prefers its own marker when both are exported.
        if mode == Mode::Higress && has("proxy_abi_version_0_2_100") {
            return Ok(Abi::V0_2_100);
        }
        return Ok(Abi::V0_2_1);
    }
    if mode == Mode::Higress && has("proxy_abi_version_0_2_100") {
        return Ok(Abi::V0_2_100);
    }
    Err(HostError::UnknownAbi)
}

/// The ABI version the host runs the module with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Abi {
    V0_2_1,
    /// Higress: a `Pause` from headers lets the body flow (StopIteration passed through).
    V0_2_100,
}

type F1 = TypedFunc<i32, ()>;
type F2 = TypedFunc<(i32, i32), ()>;
type F2R = TypedFunc<(i32, i32), i32>;
type F3R = TypedFunc<(i32, i32, i32), i32>;
type F5 = TypedFunc<(i32, i32, i32, i32, i32), ()>;

#[derive(Default)]
struct Exports {
    initialize: Option<TypedFunc<(), ()>>,
    main: Option<TypedFunc<(i32, i32), i32>>,
    start: Option<TypedFunc<(), ()>>,
    on_context_create: Option<F2>,
    on_vm_start: Option<F2R>,
    on_configure: Option<F2R>,
    on_tick: Option<F1>,
    on_queue_ready: Option<F2>,
    on_request_headers: Option<F3R>,
    on_request_body: Option<F3R>,
    on_request_trailers: Option<F2R>,
    on_response_headers: Option<F3R>,
    on_response_body: Option<F3R>,
    on_response_trailers: Option<F2R>,
    on_http_call_response: Option<F5>,
    on_foreign_function: Option<TypedFunc<(i32, i32, i32), ()>>,
    on_done: Option<TypedFunc<i32, i32>>,
    on_log: Option<F1>,
    on_delete: Option<F1>,
}

/// What one VM call returned, and the fuel it burnt.
pub(crate) struct Called<T> {
    pub value: T,
    pub fuel: u64,
}

pub(crate) struct Vm {
    pub store: Store<HostState>,
    exports: Exports,
    next_context: u32,
}

fn typed<P: wasmtime::WasmParams, Rs: wasmtime::WasmResults>(
    store: &mut Store<HostState>,
    instance: &Instance,
    name: &str,
) -> Result<Option<TypedFunc<P, Rs>>, HostError> {
    match instance.get_export(&mut *store, name) {
        Some(Extern::Func(f)) => f.typed::<P, Rs>(&*store).map(Some).map_err(|e| {
            HostError::Instantiate(format!("export {name} has the wrong signature: {e}"))
        }),
        _ => Ok(None),
    }
}

impl Vm {
    /// Instantiates the module and runs Envoy's start sequence: `_initialize` (then `main`),
    /// root context creation, `proxy_on_vm_start`, `proxy_on_configure`.
    pub fn start(
        module: &Module,
        linker: &Linker<HostState>,
        opts: Arc<HostOptions>,
        shared: Shared,
        worker: usize,
    ) -> Result<Vm, HostError> {
        let clock_origin = crate::gateway::CLOCK_ORIGIN_NANOS;
        let state = HostState {
            shared,
            opts: opts.clone(),
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
            clock_origin,
        };
        let mut store = Store::new(module.engine(), state);
        if opts.fuel {
            store
                .set_fuel(opts.fuel_per_call)
                .map_err(|e| HostError::Instantiate(e.to_string()))?;
        }
        let instance = linker
            .instantiate(&mut store, module)
            .map_err(|e| HostError::Instantiate(format!("{e:?}")))?;
        let memory = instance.get_memory(&mut store, "memory");
        let mut alloc = typed::<i32, i32>(&mut store, &instance, "malloc")?;
        if alloc.is_none() {
            alloc = typed::<i32, i32>(&mut store, &instance, "proxy_on_memory_allocate")?;
        }
        if alloc.is_none() {
            return Err(HostError::Instantiate(
                "Wasm module is missing malloc function.".into(),
            ));
        }
        store.data_mut().memory = memory;
        store.data_mut().alloc = alloc;
        let s = &mut store;
        let i = &instance;
        let exports = Exports {
            initialize: typed(s, i, "_initialize")?,
            main: typed(s, i, "main")?,
            start: typed(s, i, "_start")?,
            on_context_create: typed(s, i, "proxy_on_context_create")?,
            on_vm_start: typed(s, i, "proxy_on_vm_start")?,
            on_configure: typed(s, i, "proxy_on_configure")?,
            on_tick: typed(s, i, "proxy_on_tick")?,
            on_queue_ready: typed(s, i, "proxy_on_queue_ready")?,
            on_request_headers: typed(s, i, "proxy_on_request_headers")?,
            on_request_body: typed(s, i, "proxy_on_request_body")?,
            on_request_trailers: typed(s, i, "proxy_on_request_trailers")?,
            on_response_headers: typed(s, i, "proxy_on_response_headers")?,
            on_response_body: typed(s, i, "proxy_on_response_body")?,
            on_response_trailers: typed(s, i, "proxy_on_response_trailers")?,
            on_http_call_response: typed(s, i, "proxy_on_http_call_response")?,
            on_foreign_function: typed(s, i, "proxy_on_foreign_function")?,
            on_done: typed(s, i, "proxy_on_done")?,
            on_log: typed(s, i, "proxy_on_log")?,
            on_delete: typed(s, i, "proxy_on_delete")?,
        };
        let mut vm = Vm {
            store,
            exports,
            next_context: 2,
        };
        vm.store.data_mut().restricted = true;
        let init = if let Some(f) = vm.exports.initialize.clone() {
            let r = vm.call("_initialize", 0, |s| f.call(s, ()));
            match (r, vm.exports.main.clone()) {
                (Ok(_), Some(main)) => vm.call("main", 0, |s| main.call(s, (0, 0))).map(|_| ()),
                (r, _) => r.map(|_| ()),
            }
        } else if let Some(f) = vm.exports.start.clone() {
            vm.call("_start", 0, |s| f.call(s, ())).map(|_| ())
        } else {
            Ok(())
        };
        vm.store.data_mut().restricted = false;
        init?;
        let root = vm.store.data().root_id as i32;
        if let Some(f) = vm.exports.on_context_create.clone() {
            vm.call("proxy_on_context_create", root as u32, |s| {
                f.call(s, (root, 0))
            })?;
        }
        if let Some(f) = vm.exports.on_vm_start.clone() {
            let n = opts.vm_config.len() as i32;
            if vm
                .call("proxy_on_vm_start", root as u32, |s| f.call(s, (root, n)))?
                .value
                == 0
            {
                return Err(HostError::VmStartFailed);
            }
        }
        if let Some(f) = vm.exports.on_configure.clone() {
            let n = opts.plugin_config.len() as i32;
            if vm
                .call("proxy_on_configure", root as u32, |s| f.call(s, (root, n)))?
                .value
                == 0
            {
                return Err(HostError::ConfigurationRejected);
            }
        }
        Ok(vm)
    }

    /// Runs one export with `effective` as the effective context, measuring fuel.
    fn call<T>(
        &mut self,
        name: &str,
        effective: u32,
        f: impl FnOnce(&mut Store<HostState>) -> wasmtime::Result<T>,
    ) -> Result<Called<T>, HostError> {
        let fuel_on = self.store.data().opts.fuel;
        let budget = self.store.data().opts.fuel_per_call;
        if fuel_on {
            let _ = self.store.set_fuel(budget);
        }
        self.store.data_mut().effective = effective;
        self.store.data_mut().last_critical = None;
        let result = f(&mut self.store);
        let fuel = if fuel_on {
            budget - self.store.get_fuel().unwrap_or(budget)
        } else {
            0
        };
        match result {
            Ok(value) => Ok(Called { value, fuel }),
            Err(e) => {
                let mut message = format!("{e:?}");
                if let Some(panic) = self.store.data_mut().last_critical.take() {
                    message = format!("{panic}\n{message}");
                }
                Err(HostError::Trap {
                    callback: name.to_string(),
                    message,
                })
            }
        }
    }

    pub fn root_id(&self) -> u32 {
        self.store.data().root_id
    }

    /// Creates an HTTP context (`proxy_on_context_create(id, root)`).
    pub fn create_http_context(
        &mut self,
        given: HashMap<Vec<String>, Vec<u8>>,
    ) -> Result<(u32, u64), (u32, HostError)> {
        let id = self.next_context;
        self.next_context += 1;
        self.store.data_mut().contexts.insert(
            id,
            HttpCtx {
                given_properties: given,
                ..HttpCtx::default()
            },
        );
        let root = self.root_id() as i32;
        match self.exports.on_context_create.clone() {
            Some(f) => self
                .call("proxy_on_context_create", id, |s| {
                    f.call(s, (id as i32, root))
                })
                .map(|c| (id, c.fuel))
                .map_err(|e| (id, e)),
            None => Ok((id, 0)),
        }
    }

    /// A header/body/trailer callback; a missing export means `Continue`.
    pub fn on_stream_event(
        &mut self,
        event: StreamEvent,
        ctx: u32,
        a: i32,
        b: i32,
    ) -> Result<Called<i32>, HostError> {
        let ctx_i = ctx as i32;
        let e = &self.exports;
        let (name, f3, f2) = match event {
            StreamEvent::RequestHeaders => (
                "proxy_on_request_headers",
                e.on_request_headers.clone(),
                None,
            ),
            StreamEvent::RequestBody => ("proxy_on_request_body", e.on_request_body.clone(), None),
            StreamEvent::RequestTrailers => (
                "proxy_on_request_trailers",
                None,
                e.on_request_trailers.clone(),
            ),
            StreamEvent::ResponseHeaders => (
                "proxy_on_response_headers",
                e.on_response_headers.clone(),
                None,
            ),
            StreamEvent::ResponseBody => {
                ("proxy_on_response_body", e.on_response_body.clone(), None)
            }
            StreamEvent::ResponseTrailers => (
                "proxy_on_response_trailers",
                None,
                e.on_response_trailers.clone(),
            ),
        };
        if let Some(f) = f3 {
            self.call(name, ctx, |s| f.call(s, (ctx_i, a, b)))
        } else if let Some(f) = f2 {
            self.call(name, ctx, |s| f.call(s, (ctx_i, a)))
        } else {
            Ok(Called { value: 0, fuel: 0 })
        }
    }

    /// `on_log`, `on_done`, `on_delete`, then forgets the context and cancels its callouts.
    pub fn end_context(&mut self, ctx: u32) -> Result<u64, HostError> {
        let c = ctx as i32;
        let mut fuel = 0;
        let mut result = Ok(());
        if let Some(f) = self.exports.on_log.clone() {
            result = self
                .call("proxy_on_log", ctx, |s| f.call(s, c))
                .map(|r| fuel += r.fuel);
        }
        if result.is_ok() {
            if let Some(f) = self.exports.on_done.clone() {
                result = self
                    .call("proxy_on_done", ctx, |s| f.call(s, c))
                    .map(|r| fuel += r.fuel);
            }
        }
        if result.is_ok() {
            if let Some(f) = self.exports.on_delete.clone() {
                result = self
                    .call("proxy_on_delete", ctx, |s| f.call(s, c))
                    .map(|r| fuel += r.fuel);
            }
        }
        let s = self.store.data_mut();
        s.contexts.remove(&ctx);
        // Envoy cancels a context's pending callouts when the stream goes away.
        s.calls.retain(|_, call| call.callout.context_id != ctx);
        result.map(|_| fuel)
    }

    pub fn on_tick(&mut self) -> Result<u64, HostError> {
        let root = self.root_id();
        match self.exports.on_tick.clone() {
            Some(f) => self
                .call("proxy_on_tick", root, |s| f.call(s, root as i32))
                .map(|c| c.fuel),
            None => Ok(0),
        }
    }

    pub fn on_queue_ready(&mut self, root: u32, token: u32) -> Result<u64, HostError> {
        match self.exports.on_queue_ready.clone() {
            Some(f) => self
                .call("proxy_on_queue_ready", root, |s| {
                    f.call(s, (root as i32, token as i32))
                })
                .map(|c| c.fuel),
            None => Ok(0),
        }
    }

    pub fn on_foreign_function(
        &mut self,
        function_id: u32,
        args: Vec<u8>,
    ) -> Result<u64, HostError> {
        let root = self.root_id();
        let n = args.len() as i32;
        self.store.data_mut().call_data = Some(args);
        let r = match self.exports.on_foreign_function.clone() {
            Some(f) => self
                .call("proxy_on_foreign_function", root, |s| {
                    f.call(s, (root as i32, function_id as i32, n))
                })
                .map(|c| c.fuel),
            None => Ok(0),
        };
        self.store.data_mut().call_data = None;
        r
    }

    /// Delivers a callout's answer (`None`: a failure, 0 headers) to the context that made it.
    pub fn on_http_call_response(
        &mut self,
        context: u32,
        token: u32,
        response: Option<CallResponse>,
    ) -> Result<u64, HostError> {
        let (nh, nb, nt) = match &response {
            Some(r) => (
                r.headers.len() as i32,
                r.body.len() as i32,
                r.trailers.len() as i32,
            ),
            None => (0, 0, 0),
        };
        if response.is_none() {
            self.store.data_mut().status = (status::BROKEN_CONNECTION as u32, b"reset".to_vec());
        }
        self.store.data_mut().call_response = Some(response.unwrap_or_default());
        let r = match self.exports.on_http_call_response.clone() {
            Some(f) => self
                .call("proxy_on_http_call_response", context, |s| {
                    f.call(s, (context as i32, token as i32, nh, nb, nt))
                })
                .map(|c| c.fuel),
            None => Ok(0),
        };
        self.store.data_mut().call_response = None;
        r
    }
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
