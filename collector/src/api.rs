//! The HTTP API (ARCHITECTURE.md, "HTTP API of the collector"), as `fn app(state) -> Router` with no
//! sockets inside.
//!
//! Every error is a 4xx (or 5xx) with `{"error": "..."}` naming the problem: bodies are read as
//! bytes and parsed here, so malformed JSON, wrong types, oversized bodies and bad query
//! strings all get the same JSON shape. Admin endpoints (`/register`, `/unregister`) require
//! `Authorization: Bearer <admin token>` and read endpoints (`/query*`, `/tokenize`, `/workers`,
//! `/v1/feed`, `/v1/load`, `/v1/explain`, `/v1/fleet/overview`) the read token, when the collector has one.
//! `/health`, `/metrics` and the fleet page's static files (`/ui/`) are open.

use std::time::{Duration, Instant};

use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use kvroute::feed::{StreamMark, LOAD_EXCLUDES_HEADER, REPLICA_HEADER};
use serde::Deserialize;

use crate::edge;
use crate::fleet::GatewayId;
use crate::hub::{HandoverReply, Registered};
use crate::metrics::{EndpointLabels, FeedLabels};
use crate::reply::json;
pub use crate::reply::ApiError;
use crate::shared::AppState;
use crate::text::{TextQueryRequest, TokenizeRequest, TokenizeResponse};
use kvroute::api::{QueryByHashRequest, QueryRequest, RegisterRequest, UnregisterRequest};

/// Longest a request may take before it is answered 408 (a feed snapshot of millions of blocks
/// is the slowest thing the API does).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Content type of `/v1/feed` pages.
pub const FEED_CONTENT_TYPE: &str = "application/x-kvroute-feed";

/// Builds the router over a collector state.
pub fn app(state: AppState) -> Router {
    let limits = edge::RequestLimits {
        max_body_bytes: state.config.max_body_bytes,
        body_read_timeout: state.config.body_read_timeout,
        body_stall_timeout: state.config.body_stall_timeout,
        min_body_bytes_per_sec: state.config.min_body_bytes_per_sec,
        request_timeout: REQUEST_TIMEOUT,
    };
    let admin = Router::new()
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin));
    let read = Router::new()
        .route("/workers", get(workers))
        .route("/query", post(query))
        .route("/query_by_hash", post(query_by_hash))
        .route("/tokenize", post(tokenize))
        .route("/v1/explain", post(crate::explain::explain))
        .route("/v1/feed", get(feed))
        .route(
            "/v1/load",
            get(crate::fleet_api::get_load).post(crate::fleet_api::post_load),
        )
        .merge(crate::ui::data_routes(&state))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_read));
    let open = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(crate::ui::page_routes());
    Router::new()
        .merge(admin)
        .merge(read)
        .merge(open)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(limits, edge::deadline))
        .layer(middleware::from_fn(log_server_errors))
        .layer(tower::limit::ConcurrencyLimitLayer::new(
            state.config.max_concurrent_requests,
        ))
        // Outermost: a slow upload must not hold a request slot.
        .layer(middleware::from_fn_with_state(limits, edge::read_request))
        .with_state(state)
}

/// Logs each 5xx once; 4xx are the client's business.
async fn log_server_errors(req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    let res = next.run(req).await;
    if res.status().is_server_error() {
        tracing::error!(path, status = res.status().as_u16(), "request failed");
    }
    res
}

fn bearer_ok(headers: &HeaderMap, token: &str) -> bool {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(given) = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
    else {
        return false;
    };
    // Constant time in the token's length.
    given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match &state.config.admin_token {
        Some(t) if !bearer_ok(req.headers(), t) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "admin endpoint: missing or wrong bearer token",
        )
        .into_response(),
        _ => next.run(req).await,
    }
}

async fn require_read(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match &state.config.read_token {
        Some(t) if !bearer_ok(req.headers(), t) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "read endpoint: missing or wrong bearer token",
        )
        .into_response(),
        _ => next.run(req).await,
    }
}

async fn register(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: RegisterRequest = json(body)?;
    let outcome = state.register(req)?;
    let (Registered::New(id) | Registered::Same(id)) = outcome;
    let view = state
        .read()
        .worker_views()
        .into_iter()
        .find(|w| w.worker_id == id.0);
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

async fn unregister(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: UnregisterRequest = json(body)?;
    let removed = state.unregister(&req)?;
    Ok(Json(serde_json::json!({ "removed": removed })).into_response())
}

async fn workers(State(state): State<AppState>) -> Response {
    let views = state.read().worker_views();
    Json(serde_json::json!({ "workers": views })).into_response()
}

async fn query(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: QueryRequest = match body {
        Ok(bytes) => match crate::fastjson::parse_query(&bytes) {
            Some(q) => q,
            // Text goes through its own parse: the token-id fast path stays as it is.
            None if crate::text::is_text_query(&bytes) => {
                return query_text(state, bytes, started).await
            }
            None => json(Ok(bytes))?,
        },
        Err(rej) => json(Err(rej))?,
    };
    // The read lock ends with this statement, before the alarms' lock is taken.
    let res = state.read().query_tokens(
        &req.token_ids,
        &req.model_name,
        req.tenant_id.as_deref(),
        req.lora_name.as_deref(),
        req.cache_salt.as_deref(),
    );
    let res = res.inspect_err(|e| crate::health::note_query_error(&state, &req.model_name, e))?;
    let out = Json(res).into_response();
    observe(&state, "query", started.elapsed());
    Ok(out)
}

/// `/query` with `prompt` or `messages`: tokenized with the model's tokenizer, then answered
/// exactly as the token-id query of those ids.
async fn query_text(state: AppState, bytes: Bytes, started: Instant) -> Result<Response, ApiError> {
    let req: TextQueryRequest = json(Ok(bytes))?;
    if req.token_ids.is_some() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "give exactly one of token_ids, prompt, messages",
        ));
    }
    let input = crate::text::text_input(req.prompt, req.messages, req.add_generation_prompt)
        .map_err(|msg| ApiError::new(StatusCode::BAD_REQUEST, msg))?;
    let ids = state
        .tokenizers
        .encode(&req.model_name, input, "query", &state.metrics)
        .await?;
    let tenant = req.tenant_id.map(crate::text::StringOrNumber::into_string);
    // The read lock ends with this statement, before the alarms' lock is taken.
    let res = state.read().query_tokens(
        &ids,
        &req.model_name,
        tenant.as_deref(),
        req.lora_name.as_deref(),
        req.cache_salt.as_deref(),
    );
    let res = res.inspect_err(|e| crate::health::note_query_error(&state, &req.model_name, e))?;
    let out = Json(res).into_response();
    observe(&state, "query_text", started.elapsed());
    Ok(out)
}

/// `POST /tokenize`: the ids the model's engine computes for a prompt or chat messages.
async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = json(body)?;
    let input = crate::text::text_input(req.prompt, req.messages, req.add_generation_prompt)
        .map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "give exactly one of prompt, messages",
            )
        })?;
    let token_ids = state
        .tokenizers
        .encode(&req.model, input, "tokenize", &state.metrics)
        .await?;
    Ok(Json(TokenizeResponse {
        model: req.model,
        count: token_ids.len(),
        token_ids,
    })
    .into_response())
}

async fn query_by_hash(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: QueryByHashRequest = json(body)?;
    let res = state.read().query_hashes(
        req.block_hashes.as_deref(),
        req.seq_hashes.as_deref(),
        &req.model_name,
        req.tenant_id.as_deref(),
        req.lora_name.as_deref(),
        req.cache_salt.as_deref(),
    )?;
    let out = Json(res).into_response();
    observe(&state, "query_by_hash", started.elapsed());
    Ok(out)
}

fn observe(state: &AppState, endpoint: &'static str, took: Duration) {
    state
        .metrics
        .query_seconds
        .get_or_create(&EndpointLabels { endpoint })
        .observe(took.as_secs_f64());
}

/// `GET /v1/feed` query string.
#[derive(Debug, Deserialize)]
pub struct FeedParams {
    /// The newest page version the reader takes (absent: 2).
    pub v: Option<u8>,
    pub epoch: Option<u64>,
    pub since: Option<u64>,
    /// The reader's position in stream terms (version 3; see `kvroute::feed`'s "Handover").
    pub stream: Option<u64>,
    pub seq: Option<u64>,
    /// The reading gateway's id (as in its `/v1/load` reports): its own report is left out of
    /// the page's load totals, and the answer says so in [`LOAD_EXCLUDES_HEADER`].
    pub gateway: Option<String>,
}

async fn feed(
    State(state): State<AppState>,
    params: Result<Query<FeedParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(p) = params.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "bad query string (want v=U8&epoch=U64&since=U64&stream=U64&seq=U64&gateway=ID): {}",
                e.body_text()
            ),
        )
    })?;
    let v3 = p.v.is_some_and(|v| v >= 3);
    let at = match (p.stream, p.seq) {
        (Some(stream), Some(seq)) if v3 && stream != 0 => Some(StreamMark { stream, seq }),
        _ => None,
    };
    let handover = match (p.epoch, p.since, at) {
        (Some(epoch), Some(since), Some(at)) => {
            state.read().feed_handover(epoch, since, at, Instant::now())
        }
        _ => None,
    };
    // The page's position in stream terms: a handover and a wait carry the reader's own.
    let (bytes, kind, mark) = match handover {
        Some(HandoverReply::Taken(b)) => (b, "handover", at),
        Some(HandoverReply::Wait(b)) => (b, "wait", at),
        None => {
            let (b, kind) = feed_page(&state, p.epoch, p.since)?;
            let mark = v3
                .then(|| state.read().feed.mark_at(page_cursor(&b)))
                .flatten();
            (b, kind, mark)
        }
    };
    let reader = match p.gateway.as_deref().map(GatewayId::new) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(e)) => return Err(ApiError::new(StatusCode::BAD_REQUEST, e.to_string())),
    };
    // Other gateways' decisions only for a reader that names itself and reads version 4.
    let holds = p.v.is_some_and(|v| v >= 4);
    let bytes = with_served_ops(&state, bytes, reader.as_ref(), holds, mark);
    state
        .metrics
        .feed_requests
        .get_or_create(&FeedLabels { kind })
        .inc();
    state.metrics.feed_bytes.inc_by(bytes.len() as u64);
    let mut resp = (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(FEED_CONTENT_TYPE),
        )],
        bytes,
    )
        .into_response();
    if let Some(r) = reader {
        let (index, count) = state.fleet().replica_of(&r, Instant::now());
        if let Ok(v) = HeaderValue::from_str(&format!("{index}/{count}")) {
            resp.headers_mut().insert(REPLICA_HEADER, v);
        }
        if let Ok(v) = HeaderValue::from_str(r.as_str()) {
            resp.headers_mut().insert(LOAD_EXCLUDES_HEADER, v);
        }
    }
    Ok(resp)
}

/// The page with the fleet's load appended (feed op `Load`, one per worker with a report or
/// a sample), computed now: cached pages stay shared, the load is always current.
/// The page from the log: deltas, or a snapshot (built first when none is ready). Its kind
/// for the metrics.
fn feed_page(
    state: &AppState,
    epoch: Option<u64>,
    since: Option<u64>,
) -> Result<(Bytes, &'static str), ApiError> {
    if let Some(b) = state.read().feed_reply(epoch, since) {
        let kind = if b
            .get(5)
            .is_some_and(|f| f & kvroute::feed::Page::RESET != 0)
        {
            "snapshot"
        } else {
            "delta"
        };
        return Ok((b, kind));
    }
    let mut hub = state.write();
    // Another request may have built it meanwhile.
    let b = match hub.feed_reply(epoch, since) {
        Some(b) => b,
        None => {
            hub.build_snapshot();
            hub.feed_reply(epoch, since).ok_or_else(|| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "feed snapshot unavailable",
                )
            })?
        }
    };
    Ok((b, "snapshot"))
}

/// An encoded page's cursor (header: magic 4, version 1, flags 1, epoch 8, cursor 8).
fn page_cursor(page: &[u8]) -> u64 {
    page.get(14..22)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// Appends what is computed when a page is served: the fleet's load, with `holds` the other
/// gateways' decisions the reader has not been handed yet, and, for version-3 readers on a
/// stream, the page's stream position.
fn with_served_ops(
    state: &AppState,
    page: Bytes,
    reader: Option<&GatewayId>,
    holds: bool,
    mark: Option<StreamMark>,
) -> Bytes {
    let now = Instant::now();
    let mut fleet = state.fleet();
    let mut ops: Vec<kvroute::feed::Op> = fleet
        .totals_for(now, reader)
        .into_iter()
        .map(|t| kvroute::feed::Op::Load {
            worker: t.worker,
            requests: t.load.requests,
            prefill_tokens: t.load.prefill_tokens,
            decode_tokens: t.load.decode_tokens,
            engine: t.engine.map(|e| kvroute::feed::EngineSample {
                load: e.sample.load,
                age_ms: e.age.as_millis().min(u32::MAX.into()) as u32,
                stale: e.stale,
            }),
        })
        .collect();
    if let Some(reader) = reader.filter(|_| holds) {
        let held = fleet.holds_for(reader, now);
        state.metrics.feed_held.inc_by(held.len() as u64);
        ops.extend(held.into_iter().map(|h| kvroute::feed::Op::Held {
            worker: h.worker,
            shard: h.shard,
            key: kvroute::scope::BlockKey(h.key),
            blocks: h.blocks,
            ttl_ms: h.ttl_ms,
        }));
    }
    drop(fleet);
    ops.extend(mark.map(kvroute::feed::Op::Stream));
    if ops.is_empty() {
        return page;
    }
    kvroute::feed::Page::append_ops(&page, &ops).map_or(page, Bytes::from)
}

async fn health(State(state): State<AppState>) -> Response {
    let hub = state.read();
    let workers = hub.workers().count();
    let connected = hub.workers().filter(|w| w.status.connected).count();
    let epoch = hub.feed.epoch();
    drop(hub);
    // Degraded still answers 200: the collector serves; the reasons say what is wrong.
    let mut problems = state.problems();
    let alarms = crate::health::evaluate_alarms(&state);
    problems.extend(alarms.iter().map(|a| a.reason.clone()));
    let status = if problems.is_empty() {
        "ok"
    } else {
        "degraded"
    };
    let alarms: Vec<_> = alarms
        .iter()
        .map(|a| serde_json::json!({ "alarm": a.kind.as_str(), "subject": a.subject, "reason": a.reason, "causes": a.causes }))
        .collect();
    let mut body = serde_json::json!({ "status": status, "reasons": problems, "alarms": alarms, "workers": workers, "connected": connected, "epoch": epoch });
    // An ingest process that splits the engines: how many share them (itself included; absent
    // until it has listened long enough to decide) and how many it reads.
    if let Some(bus) = state.bus.as_ref().filter(|b| b.splits_engines()) {
        body["ingest"] = serde_json::json!({
            "members": bus.ownership.members().map(|m| m.len()),
            "reads": state.reading(),
        });
    }
    Json(body).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    state.read().update_gauges(&state.metrics);
    // Also refreshes the ingest lag gauge.
    state.problems();
    crate::health::evaluate_alarms(&state);
    let gateways = state.fleet().gateways(Instant::now());
    state.metrics.fleet_gateways.set(gateways as i64);
    let body = state.metrics.encode();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        body,
    )
        .into_response()
}
