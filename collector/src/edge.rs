//! Per-request limits, applied before routing: URI and header sizes (414, 431), the body read
//! under a deadline and a size cap (408, 413), and the overall request deadline (408), every
//! answer a JSON `{"error": ...}` body.
//!
//! A body has three limits (issue 23): no gap between bytes longer than the stall timeout, a
//! minimum rate past a one-second grace ([`rate_allowance`]: a body trickled in to hold a
//! connection is cut in about a second, whatever its declared length, while a large body from
//! a fast client may take its time), and the body deadline over all.
//!
//! The body is read here, outside the concurrency limit, so a slow upload holds a connection
//! (capped, see [`crate::server`]) but never one of the request-processing slots. hyper keeps
//! its own, larger, bounds as a backstop (about 400 KiB of head): past them it answers 431 or
//! 414 with an empty body and closes.

use std::sync::Arc;
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

use crate::server::ConnSlot;

/// Longest path and query string, bytes.
pub const MAX_URI_BYTES: usize = 8 << 10;

/// Most bytes of header names and values in one request.
pub const MAX_HEADER_BYTES: usize = 16 << 10;

/// The default longest a request body may go without a byte arriving
/// (`--body-stall-timeout-secs`). A client that trickles one byte and stops would otherwise
/// hold its connection for the whole body deadline (issue 23).
pub const DEFAULT_BODY_STALL_TIMEOUT: Duration = Duration::from_secs(1);

/// The default minimum body rate (`--min-body-bytes-per-sec`), bytes per second: 256 kbit/s,
/// far under any gateway's link, far over a trickle.
pub const DEFAULT_MIN_BODY_BYTES_PER_SEC: u64 = 32 << 10;

/// The start of a body free of the rate rule: a client's first write and a TCP slow start.
pub const BODY_RATE_GRACE: Duration = Duration::from_secs(1);

/// Why a body read ended early.
#[derive(Debug)]
enum BodyError {
    TooLarge,
    Read(Box<dyn std::error::Error + Send + Sync>),
    Stalled,
    TooSlow,
    Deadline,
}

/// How long after its start a body that has delivered `received` bytes may still be read under
/// the rate rule: the grace plus the time `received` bytes take at the minimum rate. So a body
/// is cut when it falls behind `min_rate × (elapsed − grace)`. `None` when the rule is off
/// (`min_rate` 0).
pub fn rate_allowance(received: usize, min_rate_bytes_per_sec: u64) -> Option<Duration> {
    if min_rate_bytes_per_sec == 0 {
        return None;
    }
    Some(BODY_RATE_GRACE + Duration::from_secs_f64(received as f64 / min_rate_bytes_per_sec as f64))
}

/// The next limit of a body read `elapsed` into it with `received` bytes in: how long to wait
/// for the next frame, and what it means when that wait runs out.
fn next_wait(elapsed: Duration, received: usize, limits: &RequestLimits) -> (Duration, BodyError) {
    let mut wait = limits.body_read_timeout.saturating_sub(elapsed);
    let mut cause = BodyError::Deadline;
    if let Some(allowed) = rate_allowance(received, limits.min_body_bytes_per_sec) {
        let left = allowed.saturating_sub(elapsed);
        if left < wait {
            (wait, cause) = (left, BodyError::TooSlow);
        }
    }
    if limits.body_stall_timeout < wait {
        (wait, cause) = (limits.body_stall_timeout, BodyError::Stalled);
    }
    (wait, cause)
}

/// Reads the body frame by frame: each frame within the stall timeout, the whole at the
/// minimum rate and within the body deadline, at most `max_body_bytes`.
async fn read_body(body: Body, limits: RequestLimits) -> Result<Bytes, BodyError> {
    let start = tokio::time::Instant::now();
    let mut body = Limited::new(body, limits.max_body_bytes);
    let mut buf = BytesMut::new();
    loop {
        let (wait, cause) = next_wait(start.elapsed(), buf.len(), &limits);
        let frame = match tokio::time::timeout(wait, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(BodyError::TooLarge);
            }
            Ok(Some(Err(e))) => return Err(BodyError::Read(e)),
            Ok(None) => return Ok(buf.freeze()),
            Err(_) => return Err(cause),
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
    /// The whole body within this, whatever its rate.
    pub body_read_timeout: Duration,
    /// Longest wait for the next bytes of a body.
    pub body_stall_timeout: Duration,
    /// Below this rate past [`BODY_RATE_GRACE`], bytes per second, a body is cut; 0: no rule.
    pub min_body_bytes_per_sec: u64,
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
    let slot = req.extensions().get::<Arc<ConnSlot>>().cloned();
    let (parts, body) = req.into_parts();
    // While the body comes in, the connection waits on its client and may be shed for a
    // newcomer (the accept loop then drops this future with the connection).
    if let Some(slot) = &slot {
        slot.wait_on_client();
    }
    let read = read_body(body, limits).await;
    if slot.as_ref().is_some_and(|slot| !slot.begin_serving()) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "connection shed for another; retry",
        );
    }
    let bytes = match read {
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
                format!("request body stalled for {:?}", limits.body_stall_timeout),
            );
        }
        Err(BodyError::TooSlow) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body slower than {} bytes/s",
                    limits.min_body_bytes_per_sec
                ),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rate: u64) -> RequestLimits {
        RequestLimits {
            max_body_bytes: 4 << 20,
            body_read_timeout: Duration::from_secs(10),
            body_stall_timeout: Duration::from_secs(1),
            min_body_bytes_per_sec: rate,
            request_timeout: Duration::from_secs(10),
        }
    }

    #[test]
    fn the_rate_rule_grows_with_the_bytes_received() {
        assert_eq!(rate_allowance(0, 1000), Some(BODY_RATE_GRACE));
        assert_eq!(
            rate_allowance(2000, 1000),
            Some(BODY_RATE_GRACE + Duration::from_secs(2))
        );
        assert_eq!(rate_allowance(1 << 20, 0), None);
    }

    #[test]
    fn the_nearest_limit_names_the_cut() {
        // A trickle: 10 bytes in after 0.9 s; the rate rule (1 s + 10 ms) binds before the stall.
        let (wait, cause) = next_wait(Duration::from_millis(900), 10, &limits(1000));
        assert_eq!(wait, Duration::from_millis(110));
        assert!(matches!(cause, BodyError::TooSlow), "{cause:?}");
        // A fast body well ahead of the rate: the stall timeout binds.
        let (wait, cause) = next_wait(Duration::from_secs(1), 1 << 20, &limits(1000));
        assert_eq!(wait, Duration::from_secs(1));
        assert!(matches!(cause, BodyError::Stalled), "{cause:?}");
        // Near the end of the body deadline, the deadline binds.
        let (wait, cause) = next_wait(Duration::from_millis(9500), 1 << 20, &limits(1000));
        assert_eq!(wait, Duration::from_millis(500));
        assert!(matches!(cause, BodyError::Deadline), "{cause:?}");
        // Behind the rate already: no wait at all.
        let (wait, cause) = next_wait(Duration::from_secs(5), 10, &limits(1000));
        assert_eq!(wait, Duration::ZERO);
        assert!(matches!(cause, BodyError::TooSlow), "{cause:?}");
        // The rule off: stall, then the deadline.
        let (_, cause) = next_wait(Duration::from_secs(5), 10, &limits(0));
        assert!(matches!(cause, BodyError::Stalled), "{cause:?}");
    }
}
