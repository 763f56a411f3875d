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
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvroute::api::ErrorBody;

/// Longest path and query string, bytes.
pub const MAX_URI_BYTES: usize = 8 << 10;

/// Most bytes of header names and values in one request.
pub const MAX_HEADER_BYTES: usize = 16 << 10;

/// Longest a request body may go without a byte arriving. A client that trickles one byte and
/// stops would otherwise hold its connection slot for the whole body deadline; with 512 slots,
/// 512 such clients starve everyone else (issue 23).
pub const BODY_STALL_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a body read ended early.
enum BodyError {
    TooLarge,
    Read(Box<dyn std::error::Error + Send + Sync>),
    Stalled,
    Deadline,
}

/// Reads the body frame by frame: each frame within [`BODY_STALL_TIMEOUT`], the whole within
/// the body deadline, at most `max_body_bytes`.
async fn read_body(body: Body, limits: RequestLimits) -> Result<Bytes, BodyError> {
    let start = tokio::time::Instant::now();
    let mut body = Limited::new(body, limits.max_body_bytes);
    let mut buf = BytesMut::new();
    loop {
        let left = limits.body_read_timeout.saturating_sub(start.elapsed());
        let wait = left.min(BODY_STALL_TIMEOUT);
        let frame = match tokio::time::timeout(wait, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(BodyError::TooLarge);
            }
            Ok(Some(Err(e))) => return Err(BodyError::Read(e)),
            Ok(None) => return Ok(buf.freeze()),
            Err(_) if wait < BODY_STALL_TIMEOUT => return Err(BodyError::Deadline),
            Err(_) => return Err(BodyError::Stalled),
        };
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
        }
    }
}

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
    let bytes = match read_body(body, limits).await {
        Ok(bytes) => bytes,
        Err(BodyError::TooLarge) => {
            return error(StatusCode::PAYLOAD_TOO_LARGE, "request body is too large");
        }
        Err(BodyError::Read(e)) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("cannot read the request body: {e}"),
            );
        }
        Err(BodyError::Stalled) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("request body stalled for {BODY_STALL_TIMEOUT:?}"),
            );
        }
        Err(BodyError::Deadline) => {
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
