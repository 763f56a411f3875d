//! The fleet page: `GET /ui/` and its static files, embedded in the binary (no CDN, no build
//! step at run time), and `GET /v1/fleet/overview`, the one JSON the page needs beyond
//! `/workers`, `/v1/load` and `/health`: feed position, the gateways reporting, blocks per
//! tier, each engine's last event, and a few minutes of history for the chart.
//!
//! The static files need no token: they hold no data. Every data fetch of the page carries the
//! read token the user typed, and `/v1/fleet/overview` sits behind `require_read` with the
//! other read endpoints. Nothing here changes the fleet.

mod history;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use kvroute::api::ErrorBody;
use serde::{Deserialize, Serialize};

use crate::hub::Hub;
use crate::metrics::FeedLabels;
use crate::shared::AppState;
pub use history::{History, SampleView, WorkerReading};

/// How often the chart's sampler looks at the fleet.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How much history the chart shows.
pub const HISTORY_SPAN: Duration = Duration::from_secs(10 * 60);
/// Workers with a blocks line in the history (the lowest ids); the totals cover all.
pub const CHART_WORKERS: usize = 32;
/// Largest index whose blocks are split by tier: the split walks every hold under the hub's
/// read lock, which ingest waits behind (35 ms for a million in a debug build, an upper bound:
/// `ui::tests::tier_split_cost`).
pub const MAX_TIER_SCAN_HOLDS: usize = 1 << 20;
/// How long a tier split of a big index is reused while the index changes; a small one (see
/// [`TIER_RESCAN_HOLDS`]) is counted again after every change.
const TIER_CACHE: Duration = Duration::from_secs(5);
/// Up to this many holds, walking the index costs well under a millisecond.
const TIER_RESCAN_HOLDS: usize = 1 << 16;

/// The page's security headers: scripts and the wasm module only from the collector itself
/// (`wasm-unsafe-eval` lets the page compile the hashing module), data only from it, and no
/// framing.
const CSP: &str = "default-src 'none'; script-src 'self' 'wasm-unsafe-eval'; \
    style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

/// Every file of the page, as built into the binary.
const ASSETS: &[Asset] = &[
    Asset {
        path: "index.html",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../ui/index.html"),
    },
    Asset {
        path: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../ui/app.js"),
    },
    Asset {
        path: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../ui/style.css"),
    },
    Asset {
        path: "pkg/kvroute_js.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../ui/pkg/kvroute_js.js"),
    },
    Asset {
        path: "pkg/kvroute_js_bg.wasm",
        content_type: "application/wasm",
        body: include_bytes!("../ui/pkg/kvroute_js_bg.wasm"),
    },
];

/// The page's routes; they need no token.
pub fn page_routes() -> Router<AppState> {
    Router::new()
        // Relative, so the page also works behind a proxy that mounts the collector on a
        // path prefix: its own links and fetches are relative too.
        .route(
            "/ui",
            get(|| async {
                (
                    StatusCode::PERMANENT_REDIRECT,
                    [(header::LOCATION, HeaderValue::from_static("ui/"))],
                )
            }),
        )
        .route("/ui/", get(|| async { asset("index.html") }))
        .route(
            "/ui/{*file}",
            get(|Path(file): Path<String>| async move { asset(&file) }),
        )
}

fn asset(path: &str) -> Response {
    let Some(a) = ASSETS.iter().find(|a| a.path == path) else {
        let error = format!("no file {path:?} in the fleet page");
        return (StatusCode::NOT_FOUND, Json(ErrorBody { error })).into_response();
    };
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(a.content_type),
            ),
            // The files change with the binary: always revalidate.
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            ),
        ],
        a.body,
    )
        .into_response()
}

/// The page's data route, to be put behind the read token. Starts the chart's sampler when
/// called inside a tokio runtime; the sampler stops when the router or the state is dropped.
pub fn data_routes(state: &AppState) -> Router<AppState> {
    let history = Arc::new(Mutex::new(History::new(HISTORY_SPAN, CHART_WORKERS)));
    start_sampler(state, &history);
    Router::new()
        .route("/v1/fleet/overview", get(overview))
        .layer(Extension(Shared {
            history,
            tiers: Arc::new(Mutex::new(None)),
        }))
}

/// What the page's handler keeps between requests.
#[derive(Clone, Debug)]
struct Shared {
    history: Arc<Mutex<History>>,
    tiers: Arc<Mutex<Option<TierSplit>>>,
}

/// A tier split and the index it was counted from.
#[derive(Debug)]
struct TierSplit {
    at: Instant,
    /// The feed's `(epoch, cursor)` then: every change of the index moves the cursor.
    feed: (u64, u64),
    counts: Arc<Vec<[u64; 3]>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn start_sampler(state: &AppState, history: &Arc<Mutex<History>>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (state, history) = (Arc::downgrade(state), Arc::downgrade(history));
    rt.spawn(async move {
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (Some(state), Some(history)) = (state.upgrade(), history.upgrade()) else {
                return;
            };
            let (holds, readings) = {
                let hub = state.read();
                (hub.index.stats().holds as u64, readings(&hub))
            };
            lock(&history).record(holds, &readings, Instant::now());
        }
    });
}

fn readings(hub: &Hub) -> Vec<WorkerReading> {
    hub.workers()
        .map(|w| WorkerReading {
            id: w.id,
            generation: w.generation,
            blocks: hub.index.worker_blocks(w.id) as u64,
            events: w.status.events,
        })
        .collect()
}

/// Blocks of each worker (by worker id) per tier class, GPU, CPU, DISK; `None` when the index
/// is over [`MAX_TIER_SCAN_HOLDS`].
pub fn count_tiers(hub: &Hub) -> Option<Vec<[u64; 3]>> {
    if hub.index.stats().holds > MAX_TIER_SCAN_HOLDS {
        return None;
    }
    let slots = hub
        .workers()
        .map(|w| w.id.0 as usize + 1)
        .max()
        .unwrap_or(0);
    let mut out = vec![[0u64; 3]; slots];
    hub.index.for_each_hold(|w, tier, _| {
        if let Some(c) = out.get_mut(w.0 as usize) {
            c[tier as usize] += 1;
        }
    });
    Some(out)
}

/// `GET /v1/fleet/overview`.
#[derive(Clone, Debug, Serialize)]
pub struct Overview {
    pub feed: FeedView,
    /// Gateways whose last load report is live, by id.
    pub gateways: Vec<GatewayView>,
    pub gateway_timeout_ms: u64,
    pub index: IndexView,
    /// Whether `workers[].tiers` were counted (the index is at most `tiers_limit` holds).
    pub tiers_counted: bool,
    pub tiers_limit: usize,
    pub workers: Vec<WorkerExtra>,
    pub history: HistoryView,
}

/// Where the feed is.
#[derive(Clone, Debug, Serialize)]
pub struct FeedView {
    /// A string: epochs are nanoseconds past 2^53, which a JavaScript number would round.
    pub epoch: String,
    /// The cursor after the last entry: a gateway caught up asks `since` this.
    pub cursor: u64,
    pub log_entries: usize,
    pub deltas_served: u64,
    pub snapshots_served: u64,
    pub bytes_served: u64,
}

/// A gateway reporting its load.
#[derive(Clone, Debug, Serialize)]
pub struct GatewayView {
    pub id: String,
    pub report_age_ms: u64,
}

/// The index's sizes.
#[derive(Clone, Debug, Serialize)]
pub struct IndexView {
    pub blocks: usize,
    pub holds: usize,
    pub scopes: usize,
}

/// What the page shows of a worker beyond `/workers`.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerExtra {
    pub worker_id: u32,
    pub instance_id: String,
    pub dp_rank: u32,
    /// Blocks by tier class (a block's class is the worst tier along its prefix).
    pub tiers: Option<TierCounts>,
    /// Since its event count last grew; `null` when it has not since the collector started
    /// watching.
    pub last_event_age_ms: Option<u64>,
}

/// Blocks per tier class.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct TierCounts {
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
}

/// The chart's samples.
#[derive(Clone, Debug, Serialize)]
pub struct HistoryView {
    pub interval_ms: u64,
    pub span_ms: u64,
    pub samples: Vec<SampleView>,
}

/// `GET /v1/fleet/overview` query string.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct OverviewParams {
    /// `false` leaves `history.samples` empty: the samples are most of the answer, and a page
    /// polling every second or two needs them less often.
    pub history: Option<bool>,
}

async fn overview(
    State(state): State<AppState>,
    Extension(ui): Extension<Shared>,
    params: Result<Query<OverviewParams>, QueryRejection>,
) -> Response {
    let params = match params {
        Ok(Query(p)) => p,
        Err(e) => {
            let error = format!(
                "bad query string (want history=true|false): {}",
                e.body_text()
            );
            return (StatusCode::BAD_REQUEST, Json(ErrorBody { error })).into_response();
        }
    };
    let now = Instant::now();
    let (gateways, gateway_timeout) = {
        let fleet = state.fleet();
        (fleet.gateway_ages(now), fleet.config().gateway_timeout)
    };
    let hub = state.read();
    let stats = hub.index.stats();
    let feed = (hub.feed.epoch(), hub.feed.head(), hub.feed.len());
    let tiers = {
        let mut cache = lock(&ui.tiers);
        let fresh = cache.as_ref().filter(|c| {
            c.feed == (feed.0, feed.1)
                || (stats.holds > TIER_RESCAN_HOLDS
                    && now.saturating_duration_since(c.at) < TIER_CACHE)
        });
        match fresh {
            Some(c) => Some(c.counts.clone()),
            None => {
                let counts = count_tiers(&hub).map(Arc::new);
                *cache = counts.clone().map(|counts| TierSplit {
                    at: now,
                    feed: (feed.0, feed.1),
                    counts,
                });
                counts
            }
        }
    };
    let readings = readings(&hub);
    let names: Vec<(String, u32)> = hub
        .workers()
        .map(|w| (w.reg.instance_id.clone(), w.dp_rank()))
        .collect();
    drop(hub);
    let mut history = lock(&ui.history);
    history.observe(&readings, now);
    let workers = readings
        .iter()
        .zip(names)
        .map(|(r, (instance_id, dp_rank))| WorkerExtra {
            worker_id: r.id.0,
            instance_id,
            dp_rank,
            tiers: tiers
                .as_ref()
                .and_then(|t| t.get(r.id.0 as usize))
                .map(|&[gpu, cpu, disk]| TierCounts { gpu, cpu, disk }),
            last_event_age_ms: history
                .last_event_age(r.id, now)
                .map(|d| d.as_millis() as u64),
        })
        .collect();
    let samples = if params.history.unwrap_or(true) {
        history.samples(now)
    } else {
        Vec::new()
    };
    let span = history.span();
    drop(history);
    let served = |kind| {
        state
            .metrics
            .feed_requests
            .get_or_create(&FeedLabels { kind })
            .get()
    };
    Json(Overview {
        feed: FeedView {
            epoch: feed.0.to_string(),
            cursor: feed.1,
            log_entries: feed.2,
            deltas_served: served("delta"),
            snapshots_served: served("snapshot"),
            bytes_served: state.metrics.feed_bytes.get(),
        },
        gateways: gateways
            .into_iter()
            .map(|(id, age)| GatewayView {
                id: id.as_str().to_owned(),
                report_age_ms: age.as_millis() as u64,
            })
            .collect(),
        gateway_timeout_ms: gateway_timeout.as_millis() as u64,
        index: IndexView {
            blocks: stats.blocks,
            holds: stats.holds,
            scopes: stats.scopes,
        },
        tiers_counted: tiers.is_some(),
        tiers_limit: MAX_TIER_SCAN_HOLDS,
        workers,
        history: HistoryView {
            interval_ms: SAMPLE_EVERY.as_millis() as u64,
            span_ms: span.as_millis() as u64,
            samples,
        },
    })
    .into_response()
}

#[cfg(test)]
mod tests;
