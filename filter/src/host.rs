//! Host calls that never panic.
//!
//! The SDK's wrappers panic on any host status they do not expect, and its string getters
//! unwrap UTF-8. These thin declarations of the same ABI 0.2.1 imports return what the host
//! said, and the wrappers below turn every failure into `None` / `false`. Only
//! `dispatch_http_call` goes through the SDK, because its dispatcher must learn the callout
//! token to route the answer back to the right context.

use std::ptr::null_mut;
use std::time::Duration;

use kvroute::mirror::{Store, StoreError};
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};

const OK: u32 = 0;
const CAS_MISMATCH: u32 = 8;

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_continue_stream(stream_type: proxy_wasm::types::StreamType) -> u32;
    fn proxy_define_metric(
        metric_type: MetricType,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

/// Takes ownership of a buffer the host allocated with `proxy_on_memory_allocate`.
///
/// # Safety
/// `ptr` must be null or a host-returned allocation of `size` bytes.
unsafe fn owned(ptr: *mut u8, size: usize) -> Option<Vec<u8>> {
    if ptr.is_null() {
        None
    } else {
        Some(Vec::from_raw_parts(ptr, size, size))
    }
}

pub fn log(level: LogLevel, message: &str) {
    unsafe {
        proxy_log(level, message.as_ptr(), message.len());
    }
}

/// The host clock in milliseconds (0 if the host fails).
pub fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

/// The host clock in nanoseconds (0 if the host fails).
pub fn now_ns() -> u64 {
    let mut t: u64 = 0;
    unsafe {
        if proxy_get_current_time_nanoseconds(&mut t) != OK {
            return 0;
        }
    }
    t
}

pub fn set_tick_period(period: Duration) -> bool {
    let ms = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
    unsafe { proxy_set_tick_period_milliseconds(ms) == OK }
}

pub fn get_buffer(kind: BufferType, start: usize, max: usize) -> Option<Vec<u8>> {
    let mut ptr = null_mut();
    let mut size = 0;
    unsafe {
        if proxy_get_buffer_bytes(kind, start, max, &mut ptr, &mut size) != OK {
            return None;
        }
        owned(ptr, size)
    }
}

/// A header's raw bytes; `None` when absent (or the host fails); an empty value is `Some`.
pub fn get_header(map: MapType, name: &str) -> Option<Vec<u8>> {
    let mut ptr = null_mut();
    let mut size = 0;
    unsafe {
        if proxy_get_header_map_value(map, name.as_ptr(), name.len(), &mut ptr, &mut size) != OK {
            return None;
        }
        Some(owned(ptr, size).unwrap_or_default())
    }
}

/// The whole header map in one host call (`None`: the host failed or sent a malformed map).
pub fn get_headers(map: MapType) -> Option<crate::headers::Headers> {
    let mut ptr = null_mut();
    let mut size = 0;
    let bytes = unsafe {
        if proxy_get_header_map_pairs(map, &mut ptr, &mut size) != OK {
            return None;
        }
        owned(ptr, size).unwrap_or_default()
    };
    crate::headers::Headers::parse(bytes)
}

pub fn set_header(map: MapType, name: &str, value: &[u8]) -> bool {
    unsafe {
        proxy_replace_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
            == OK
    }
}

pub fn remove_header(map: MapType, name: &str) -> bool {
    unsafe { proxy_remove_header_map_value(map, name.as_ptr(), name.len()) == OK }
}

/// A property (metadata, filter state, `plugin_name`, ...), by path segments.
pub fn get_property(path: &[impl AsRef<str>]) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    for (i, p) in path.iter().enumerate() {
        if i > 0 {
            buf.push(0);
        }
        buf.extend_from_slice(p.as_ref().as_bytes());
    }
    let mut ptr = null_mut();
    let mut size = 0;
    unsafe {
        if proxy_get_property(buf.as_ptr(), buf.len(), &mut ptr, &mut size) != OK {
            return None;
        }
        owned(ptr, size)
    }
}

/// Resumes a request the filter paused.
pub fn resume_request() -> bool {
    unsafe { proxy_continue_stream(proxy_wasm::types::StreamType::HttpRequest) == OK }
}

pub fn define_metric(kind: MetricType, name: &str) -> Option<u32> {
    let mut id = 0;
    unsafe { (proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) == OK).then_some(id) }
}

pub fn increment_metric(id: Option<u32>, by: i64) {
    if let Some(id) = id {
        unsafe {
            proxy_increment_metric(id, by);
        }
    }
}

pub fn record_metric(id: Option<u32>, value: u64) {
    if let Some(id) = id {
        unsafe {
            proxy_record_metric(id, value);
        }
    }
}

/// Dispatches an HTTP callout through the SDK (so its dispatcher routes the answer back).
pub fn http_call(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Option<u32> {
    proxy_wasm::hostcalls::dispatch_http_call(cluster, headers, body, vec![], timeout).ok()
}

/// Envoy's shared data.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostStore;

thread_local! {
    /// The counter of shared-data writes refused for a stale CAS token
    /// (`kvroute.cas_mismatches`), set once the VM defined it. Every writer retries or gives
    /// up on a mismatch, so this counts the retries of all of them: the figure that says
    /// whether contention on the shared values grows with Envoy's worker threads.
    static CAS_MISMATCHES: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// Makes [`HostStore`] count CAS mismatches into the metric `id`.
pub fn count_cas_mismatches(id: Option<u32>) {
    CAS_MISMATCHES.with(|c| c.set(id));
}

impl Store for HostStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, u32), StoreError> {
        let mut ptr = null_mut();
        let mut size = 0;
        let mut cas = 0;
        unsafe {
            match proxy_get_shared_data(key.as_ptr(), key.len(), &mut ptr, &mut size, &mut cas) {
                OK => Ok((owned(ptr, size).filter(|v| !v.is_empty()), cas)),
                1 => Ok((None, 0)),
                s => Err(StoreError::Host(s)),
            }
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        unsafe {
            match proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas) {
                OK => Ok(()),
                CAS_MISMATCH => {
                    increment_metric(CAS_MISMATCHES.with(|c| c.get()), 1);
                    Err(StoreError::CasMismatch)
                }
                s => Err(StoreError::Host(s)),
            }
        }
    }
}

/// Higress's override-host import (the `higress` build only: stock Envoy refuses modules
/// importing it).
#[cfg(feature = "higress")]
mod higress {
    #[link(wasm_import_module = "env")]
    extern "C" {
        fn proxy_set_upstream_override_host(address_data: *const u8, address_size: usize) -> u32;
    }

    pub fn set_upstream_override_host(address: &str) -> bool {
        unsafe { proxy_set_upstream_override_host(address.as_ptr(), address.len()) == 0 }
    }

    /// Higress's ABI 0.2.100 marker: with it the Higress host passes `StopIteration` from the
    /// request headers through, so the body keeps arriving while the headers are held.
    #[no_mangle]
    pub extern "C" fn proxy_abi_version_0_2_100() {}
}

#[cfg(feature = "higress")]
pub use higress::set_upstream_override_host;

/// A `log` logger over `proxy_log` that never panics.
struct Logger;

static LOGGER: Logger = Logger;

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

/// Installs the logger and a panic hook that logs at critical level (a panic still aborts the
/// VM; there should be none).
pub fn init_logging() {
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Warn);
    std::panic::set_hook(Box::new(|info| {
        log(LogLevel::Critical, &format!("kvroute panic: {info}"))
    }));
}
