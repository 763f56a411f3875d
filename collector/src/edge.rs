//! Per-request limits, applied before routing: URI and header sizes (414, 431), the body read
//! under a deadline and a size cap (408, 413), and the overall request deadline (408), every
//! answer a JSON `{"error": ...}` body.
//!
//! The body is read here, outside the concurrency limit, so a slow upload holds a connection
//! (capped, see [`crate::server`]) but never one of the request-processing slots. hyper keeps
//! its own, larger, bounds as a backstop (about 400 KiB of head): past them it answers 431 or
//! 414 with an empty body and closes.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvroute::api::ErrorBody;

/// Longest path and query string, bytes.
pub const MAX_URI_BYTES: usize = 8 << 10;

/// Most bytes of header names and values in one request.
pub const MAX_HEADER_BYTES: usize = 16 << 10;

/// The limits [`read_request`] and [`deadline`] apply.
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    pub request_timeout: Duration,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: message.into(),
        }),
    )
        .into_response()
}

/// Checks the head's sizes and reads the whole body under the body deadline.
pub async fn read_request(
    State(limits): State<RequestLimits>,
    req: Request,
    next: Next,
) -> Response {
    let uri_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if uri_len > MAX_URI_BYTES {
        return error(
            StatusCode::URI_TOO_LONG,
            format!("URI of {uri_len} bytes; at most {MAX_URI_BYTES}"),
        );
    }
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if header_bytes > MAX_HEADER_BYTES {
        return error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!("headers of {header_bytes} bytes; at most {MAX_HEADER_BYTES}"),
        );
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "request body is too large");
    }
    let (parts, body) = req.into_parts();
    let read = Limited::new(body, limits.max_body_bytes).collect();
    let bytes = match tokio::time::timeout(limits.body_read_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return error(StatusCode::PAYLOAD_TOO_LARGE, "request body is too large");
        }
        Ok(Err(e)) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("cannot read the request body: {e}"),
            );
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body not received within {:?}",
                    limits.body_read_timeout
                ),
            );
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Answers 408 JSON when the handler takes longer than the request deadline.
pub async fn deadline(State(limits): State<RequestLimits>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limits.request_timeout, next.run(req)).await {
        Ok(res) => res,
        Err(_) => error(
            StatusCode::REQUEST_TIMEOUT,
            format!("request not served within {:?}", limits.request_timeout),
        ),
    }
}
