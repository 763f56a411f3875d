//! Stream control: continue, close, local replies (queued as after-call effects), and the status of the last callout.

use crate::abi::{self, status};
use crate::hostcalls::memory::{copy_out, read_or, write_u32};
use crate::hostcalls::register::{hostcall, Imports};
use crate::model::Deferred;
use crate::types::LocalResponse;

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(l, "proxy_continue_stream", |c, stream: i32| {
        if !matches!(stream, abi::stream::REQUEST | abi::stream::RESPONSE) {
            return Ok(status::BAD_ARGUMENT);
        }
        let s = c.data_mut();
        let context = s.effective;
        if s.contexts.contains_key(&context) {
            s.deferred.push(Deferred::Continue { context, stream });
        }
        Ok(status::OK)
    })?;
    hostcall!(l, "proxy_close_stream", |c, stream: i32| {
        if !matches!(stream, abi::stream::REQUEST | abi::stream::RESPONSE) {
            return Ok(status::BAD_ARGUMENT);
        }
        let s = c.data_mut();
        let context = s.effective;
        if s.contexts.contains_key(&context) {
            s.deferred.push(Deferred::Close { context });
        }
        Ok(status::OK)
    })?;
    hostcall!(
        l,
        "proxy_send_local_response",
        |c,
         code: i32,
         dptr: i32,
         dlen: i32,
         bptr: i32,
         blen: i32,
         hptr: i32,
         hlen: i32,
         grpc: i32| {
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
        }
    )?;
    hostcall!(
        l,
        "proxy_get_status",
        |c, code_ptr: i32, ptr_ptr: i32, size_ptr: i32| {
            let (code, msg) = c.data().status.clone();
            if !write_u32(&mut c, code_ptr, code)? {
                return Ok(status::INVALID_MEMORY_ACCESS);
            }
            copy_out(&mut c, &msg, ptr_ptr, size_ptr)
        }
    )?;
    Ok(())
}
