//! HTTP callouts (`proxy_http_call`) and the gRPC calls Envoy links.

use crate::abi::{self, status};
use crate::hostcalls::memory::{read_or, write_u32};
use crate::hostcalls::register::{hostcall, Imports};
use crate::model::PendingCall;
use crate::types::{Callout, CalloutId};

/// Links this area's imports.
pub(crate) fn link(l: &mut Imports<'_>) -> wasmtime::Result<()> {
    hostcall!(
        l,
        "proxy_http_call",
        |c,
         uptr: i32,
         ulen: i32,
         hptr: i32,
         hlen: i32,
         bptr: i32,
         blen: i32,
         tptr: i32,
         tlen: i32,
         timeout_ms: i32,
         token_ptr: i32| {
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
        }
    )?;
    // gRPC is linked (Envoy links it) but no gRPC cluster exists here: ParseFailure, what
    // Envoy answers for a service it cannot resolve (and what the SDK expects).
    hostcall!(
        l,
        "proxy_grpc_call",
        |c,
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
         _: i32| Ok(status::PARSE_FAILURE)
    )?;
    hostcall!(
        l,
        "proxy_grpc_stream",
        |c, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| {
            Ok(status::PARSE_FAILURE)
        }
    )?;
    hostcall!(l, "proxy_grpc_send", |c, _: i32, _: i32, _: i32, _: i32| {
        Ok(status::NOT_FOUND)
    })?;
    hostcall!(l, "proxy_grpc_cancel", |c, _: i32| {
        Ok(status::NOT_FOUND)
    })?;
    hostcall!(l, "proxy_grpc_close", |c, _: i32| Ok(status::NOT_FOUND))?;
    Ok(())
}
