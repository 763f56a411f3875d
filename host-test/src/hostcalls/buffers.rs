//! Buffers: bodies, configurations, callout bodies and foreign-call data.

use crate::abi::{buffer, status};
use crate::hostcalls::memory::{copy_out, read_or, write_u32};
use crate::hostcalls::register::{hostcall, Imports};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(
        l,
        "proxy_get_buffer_bytes",
        |c, ty: i32, start: i32, max: i32, ptr_ptr: i32, size_ptr: i32| {
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
        }
    )?;
    hostcall!(
        l,
        "proxy_set_buffer_bytes",
        |c, ty: i32, start: i32, length: i32, ptr: i32, size: i32| {
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
        }
    )?;
    hostcall!(
        l,
        "proxy_get_buffer_status",
        |c, ty: i32, len_ptr: i32, flags_ptr: i32| {
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
        }
    )?;
    Ok(())
}
