//! Logging, the log level, the clock and the tick period.
//! proxy_log is allowed during `_initialize`; the clock is the gateway's test clock.

use crate::abi::{status, LogLevel};
use crate::hostcalls::memory::{read_or, write, write_u32};
use crate::hostcalls::register::{hostcall, Imports, R};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(l, "proxy_log", always, |mut c,
                                       level: i32,
                                       ptr: i32,
                                       len: i32|
     -> R {
        let msg = read_or!(&mut c, ptr, len);
        let Some(level) = LogLevel::from_abi(level) else {
            return Ok(status::BAD_ARGUMENT);
        };
        c.data_mut()
            .log(level, String::from_utf8_lossy(&msg).into_owned());
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_get_log_level", |c, ptr: i32| {
        let level = c.data().shared.lock().log_level.unwrap_or(LogLevel::Info);
        if !write_u32(&mut c, ptr, level.to_abi() as u32)? {
            return Ok(status::INVALID_MEMORY_ACCESS);
        }
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_get_current_time_nanoseconds", |c, ptr: i32| {
        let now = c.data().now();
        if !write(&mut c, ptr, &now.to_le_bytes())? {
            return Ok(status::INVALID_MEMORY_ACCESS);
        }
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_set_tick_period_milliseconds", |c, period: i32| {
        let now = c.data().now();
        let s = c.data_mut();
        s.tick_period_ms = period as u32;
        s.next_tick_nanos = (period != 0).then(|| now + period as u32 as u64 * 1_000_000);
        Ok(status::OK)
    })?;
    Ok(())
}
