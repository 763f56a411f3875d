//! What the collector's in-process benches share: a two-thread runtime, a JSON POST through
//! the collector's router (`app(state).oneshot`, no sockets), and the p50 / p99 / max line
//! printed after criterion's means. A directory module, so Cargo does not take it for a
//! bench target of its own.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use bytes::Bytes;
use http_body_util::BodyExt;
use kvroute_collector::{app, AppState};
use tower::ServiceExt;

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// POSTs `body` to `path`; the answer's body, asserted 200.
pub async fn post(state: &AppState, path: &str, body: &str) -> Bytes {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let res = app(state.clone()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap().to_bytes()
}

/// Times `run` once per item and prints `label`'s p50 / p99 / max.
pub fn percentiles<T>(label: &str, items: &[T], mut run: impl FnMut(&T)) {
    let mut took: Vec<Duration> = items
        .iter()
        .map(|item| {
            let t = Instant::now();
            run(item);
            t.elapsed()
        })
        .collect();
    took.sort();
    println!(
        "{label}: p50 {:>8.1?}  p99 {:>8.1?}  max {:>8.1?}",
        took[took.len() / 2],
        took[took.len() * 99 / 100],
        took[took.len() - 1]
    );
}
