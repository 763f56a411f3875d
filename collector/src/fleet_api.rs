//! `POST /v1/load` (a gateway's in-flight load report) and `GET /v1/load` (the fleet view), the
//! HTTP side of [`crate::fleet`]. Both answer the fleet view, so a gateway learns the sums in
//! the round trip of its report.
//!
//! Lock order: the fleet's mutex, then the hub's lock, here and in `Shared::unregister`, so a
//! report validated against the worker table cannot land after its worker was removed.

use std::collections::HashSet;
use std::time::Instant;

use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvroute::api::ErrorBody;
use kvroute::event::WorkerId;
use serde::{Deserialize, Serialize};

use crate::fleet::{Fleet, LoadError, LoadReport};
use crate::metrics::ReasonLabels;
use crate::shared::AppState;

/// The fleet view.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FleetView {
    /// The feed epoch the worker ids belong to.
    pub epoch: u64,
    /// Gateways whose last report is live.
    pub gateways: usize,
    /// Every worker of the table, by worker id.
    pub workers: Vec<WorkerLoadView>,
}

/// One worker of the [`FleetView`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct WorkerLoadView {
    pub worker: u32,
    pub instance_id: String,
    pub dp_rank: u32,
    pub requests: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// The engine's own figures; `null` when never scraped.
    pub engine: Option<EngineView>,
}

/// An engine sample as the API shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EngineView {
    pub waiting: u64,
    pub running: u64,
    pub kv_usage: f64,
    pub age_ms: u64,
    /// Older than `--engine-stale-secs`: the engine stopped answering.
    pub stale: bool,
}

fn view(fleet: &Fleet, epoch: u64, table: &[(WorkerId, String, u32)], now: Instant) -> FleetView {
    let totals = fleet.totals(now);
    let workers = table
        .iter()
        .map(|(id, instance, dp)| {
            let t = totals
                .binary_search_by_key(id, |t| t.worker)
                .ok()
                .map(|i| &totals[i]);
            let load = t.map(|t| t.load).unwrap_or_default();
            WorkerLoadView {
                worker: id.0,
                instance_id: instance.clone(),
                dp_rank: *dp,
                requests: load.requests,
                prefill_tokens: load.prefill_tokens,
                decode_tokens: load.decode_tokens,
                engine: t.and_then(|t| t.engine).map(|e| EngineView {
                    waiting: e.sample.load.waiting.into(),
                    running: e.sample.load.running.into(),
                    kv_usage: e.sample.load.kv_usage(),
                    age_ms: e.age.as_millis() as u64,
                    stale: e.stale,
                }),
            }
        })
        .collect();
    FleetView {
        epoch,
        gateways: fleet.gateways(now),
        workers,
    }
}

/// The epoch and the worker table, by worker id.
fn table(state: &AppState) -> (u64, Vec<(WorkerId, String, u32)>) {
    let hub = state.read();
    let mut t: Vec<_> = hub
        .workers()
        .map(|w| (w.id, w.reg.instance_id.clone(), w.dp_rank()))
        .collect();
    t.sort_by_key(|w| w.0);
    (hub.feed.epoch(), t)
}

fn refuse(state: &AppState, reason: &'static str, status: StatusCode, error: String) -> Response {
    state
        .metrics
        .load_refused
        .get_or_create(&ReasonLabels { reason })
        .inc();
    (status, Json(ErrorBody { error })).into_response()
}

/// `GET /v1/load`.
pub async fn get_load(State(state): State<AppState>) -> Response {
    let now = Instant::now();
    let mut fleet = state.fleet();
    let expired = fleet.expire(now);
    state.metrics.gateways_expired.inc_by(expired as u64);
    let (epoch, table) = table(&state);
    Json(view(&fleet, epoch, &table, now)).into_response()
}

/// `POST /v1/load`.
pub async fn post_load(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(rej) => {
            let status = rej.status();
            return refuse(
                &state,
                "body",
                status,
                format!("cannot read the request body: {}", rej.body_text()),
            );
        }
    };
    let report: LoadReport = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            let reason = match e.classify() {
                serde_json::error::Category::Data => "invalid",
                _ => "malformed",
            };
            return refuse(
                &state,
                reason,
                StatusCode::BAD_REQUEST,
                format!("{reason} load report: {e}"),
            );
        }
    };
    let now = Instant::now();
    let mut fleet = state.fleet();
    let expired = fleet.expire(now);
    state.metrics.gateways_expired.inc_by(expired as u64);
    let (epoch, table) = table(&state);
    let known: HashSet<WorkerId> = table.iter().map(|w| w.0).collect();
    let result = fleet.report(&report, epoch, |w| known.contains(&w), table.len(), now);
    match result {
        Ok(()) => {
            state.metrics.load_reports.inc();
            state
                .alarms
                .note_no_model(&report.gateway, &report.no_model, now);
            state.alarms.note_gateway(
                &report.gateway,
                crate::alarm::GatewayFacts {
                    version: report.version.clone(),
                    contract: report.contract.clone(),
                    feed_lag_ms: report.feed_lag_ms,
                    text: report.text,
                },
                now,
            );
            // With --nats: every other collector sums it too.
            crate::bus::load::fan_out(&state, &report, &table);
            Json(view(&fleet, epoch, &table, now)).into_response()
        }
        Err(e) => {
            drop(fleet);
            let status = match e {
                LoadError::Epoch { .. } => StatusCode::CONFLICT,
                LoadError::TooManyGateways { .. } => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::BAD_REQUEST,
            };
            refuse(&state, e.reason(), status, e.to_string())
        }
    }
}
