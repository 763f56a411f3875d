//! Numbers and wire formats of the proxy-wasm ABI 0.2.1 (and Higress's additions).
//!
//! Status, buffer, map and stream numbers follow the ABI spec and proxy-wasm-cpp-host, the host
//! library Envoy embeds.

use crate::headers::Headers;

/// Return status of a hostcall (`WasmResult` in proxy-wasm-cpp-host).
pub(crate) mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const SERIALIZATION_FAILURE: i32 = 3;
    pub const PARSE_FAILURE: i32 = 4;
    pub const INVALID_MEMORY_ACCESS: i32 = 6;
    pub const EMPTY: i32 = 7;
    pub const CAS_MISMATCH: i32 = 8;
    pub const BROKEN_CONNECTION: i32 = 11;
}

pub(crate) mod buffer {
    pub const HTTP_REQUEST_BODY: i32 = 0;
    pub const HTTP_RESPONSE_BODY: i32 = 1;
    pub const HTTP_CALL_RESPONSE_BODY: i32 = 4;
    pub const VM_CONFIGURATION: i32 = 6;
    pub const PLUGIN_CONFIGURATION: i32 = 7;
    pub const CALL_DATA: i32 = 8;
}

pub(crate) mod map {
    pub const REQUEST_HEADERS: i32 = 0;
    pub const REQUEST_TRAILERS: i32 = 1;
    pub const RESPONSE_HEADERS: i32 = 2;
    pub const RESPONSE_TRAILERS: i32 = 3;
    pub const HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
    pub const HTTP_CALL_RESPONSE_TRAILERS: i32 = 7;
}

pub(crate) mod stream {
    pub const REQUEST: i32 = 0;
    pub const RESPONSE: i32 = 1;
}

/// Log levels of `proxy_log` / `proxy_get_log_level`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    /// 0
    Trace,
    /// 1
    Debug,
    /// 2
    Info,
    /// 3
    Warn,
    /// 4
    Error,
    /// 5
    Critical,
}

impl LogLevel {
    pub(crate) fn from_abi(level: i32) -> Option<LogLevel> {
        Some(match level {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }

    pub(crate) fn to_abi(self) -> i32 {
        self as i32
    }
}

/// Kind of a metric defined with `proxy_define_metric`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// Monotonic counter (ABI 0).
    Counter,
    /// Gauge (ABI 1).
    Gauge,
    /// Histogram (ABI 2): every recorded value is kept.
    Histogram,
}

impl MetricKind {
    pub(crate) fn from_abi(kind: i32) -> Option<MetricKind> {
        Some(match kind {
            0 => MetricKind::Counter,
            1 => MetricKind::Gauge,
            2 => MetricKind::Histogram,
            _ => return None,
        })
    }
}

/// Every `env` import Envoy links for a module of ABI 0.2.1
/// (cpp-host `FOR_ALL_HOST_FUNCTIONS` plus the 0.2.1-specific ones and two emscripten helpers).
pub(crate) const ENV_IMPORTS: &[&str] = &[
    "proxy_log",
    "proxy_get_status",
    "proxy_set_property",
    "proxy_get_property",
    "proxy_send_local_response",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_register_shared_queue",
    "proxy_resolve_shared_queue",
    "proxy_dequeue_shared_queue",
    "proxy_enqueue_shared_queue",
    "proxy_get_header_map_value",
    "proxy_add_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_get_header_map_pairs",
    "proxy_set_header_map_pairs",
    "proxy_get_header_map_size",
    "proxy_get_buffer_status",
    "proxy_get_buffer_bytes",
    "proxy_set_buffer_bytes",
    "proxy_http_call",
    "proxy_grpc_call",
    "proxy_grpc_stream",
    "proxy_grpc_close",
    "proxy_grpc_cancel",
    "proxy_grpc_send",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_current_time_nanoseconds",
    "proxy_define_metric",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_get_metric",
    "proxy_set_effective_context",
    "proxy_done",
    "proxy_call_foreign_function",
    "proxy_continue_stream",
    "proxy_close_stream",
    "proxy_get_log_level",
    "pthread_equal",
    "emscripten_notify_memory_growth",
];

/// Higress's extra `env` imports, linked only in [`crate::Mode::Higress`].
pub(crate) const HIGRESS_IMPORTS: &[&str] = &[
    "proxy_set_upstream_override_host",
    "proxy_get_upstream_hosts",
];

/// WASI preview1 functions cpp-host links (`FOR_ALL_WASI_FUNCTIONS`), under both
/// `wasi_snapshot_preview1` and `wasi_unstable`.
pub(crate) const WASI_IMPORTS: &[&str] = &[
    "fd_write",
    "fd_read",
    "fd_seek",
    "fd_close",
    "fd_fdstat_get",
    "environ_get",
    "environ_sizes_get",
    "args_get",
    "args_sizes_get",
    "clock_time_get",
    "random_get",
    "proc_exit",
    "path_open",
    "fd_prestat_get",
    "fd_prestat_dir_name",
];

pub(crate) const WASI_MODULES: &[&str] = &["wasi_snapshot_preview1", "wasi_unstable"];

/// Serializes pairs the ABI way: `u32 count`, `count × (u32 key_len, u32 value_len)`, then each
/// key and value followed by a NUL byte; all little-endian.
pub(crate) fn serialize_pairs<'a>(
    pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> Vec<u8> {
    let pairs: Vec<(&[u8], &[u8])> = pairs.into_iter().collect();
    let data_len: usize = pairs.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    let mut out = Vec::with_capacity(4 + pairs.len() * 8 + data_len);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in &pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in &pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Parses the ABI pairs serialization. An empty input is an empty map (the SDK sends that).
pub(crate) fn deserialize_pairs(bytes: &[u8]) -> Option<Headers> {
    let mut headers = Headers::new();
    if bytes.is_empty() {
        return Some(headers);
    }
    let read_u32 = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = read_u32(0)?;
    let mut sizes = Vec::with_capacity(count.min(1024));
    let mut at = 4;
    for _ in 0..count {
        sizes.push((read_u32(at)?, read_u32(at + 4)?));
        at += 8;
    }
    for (klen, vlen) in sizes {
        let key = bytes.get(at..at + klen)?;
        at += klen + 1;
        let value = bytes.get(at..at + vlen)?;
        at += vlen + 1;
        headers.add_bytes(key, value);
    }
    if at > bytes.len() {
        return None;
    }
    Some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip() {
        let mut h = Headers::new();
        h.add(":path", "/x");
        h.add("a", "");
        let bytes = serialize_pairs(h.iter_bytes());
        assert_eq!(&bytes[..4], &2u32.to_le_bytes());
        assert_eq!(deserialize_pairs(&bytes).unwrap(), h);
        assert!(deserialize_pairs(&bytes[..bytes.len() - 3]).is_none());
    }
}
