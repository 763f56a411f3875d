//! A collector for the fleet tests, configured by its command line and driven over real HTTP
//! on a loopback port.
//!
//! It runs in-process (as `common.rs` does) rather than as the built binary: the binary's path
//! in the shared target directory is rewritten by every build of the crate, so a spawned
//! binary could be some other build.

use std::time::{Duration, Instant};

use clap::Parser;
use kvroute_collector::config::Cli;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};

/// A running collector; stopped on drop.
pub struct Collector {
    task: tokio::task::JoinHandle<()>,
    pub url: String,
    pub http: Client,
    token: Option<String>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    /// Starts a collector with the flags `args` on a free loopback port and waits for
    /// `/health`.
    pub async fn start(args: &[&str]) -> Collector {
        let mut argv = vec!["kvroute-collector"];
        argv.extend_from_slice(args);
        let config = Cli::try_parse_from(argv)
            .expect("flags parse")
            .into_config()
            .expect("flags are valid");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            kvroute_collector::run(listener, config, std::future::pending())
                .await
                .expect("collector runs");
        });
        let token = args
            .iter()
            .position(|a| *a == "--read-token")
            .map(|i| args[i + 1].to_owned());
        let c = Collector {
            task,
            url: format!("http://{addr}"),
            http: Client::new(),
            token,
        };
        let until = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(r) = c.http.get(format!("{}/health", c.url)).send().await {
                if r.status().is_success() {
                    return c;
                }
            }
            assert!(Instant::now() < until, "collector did not come up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn auth(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// Registers a worker whose engine serves at `address`; returns its worker id.
    pub async fn register(&self, instance: &str, dp_rank: u32, address: &str) -> u32 {
        let r = self
            .http
            .post(format!("{}/register", self.url))
            .json(
                &json!({"instance_id": instance, "endpoint": "tcp://127.0.0.1:1",
                "model_name": "m", "block_size": 4, "dp_rank": dp_rank, "address": address}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        r.json::<Value>().await.unwrap()["worker_id"]
            .as_u64()
            .unwrap() as u32
    }

    /// `POST /v1/load` with a raw body: the status and the JSON answer.
    pub async fn post_load_raw(&self, body: String) -> (StatusCode, Value) {
        let r = self
            .auth(self.http.post(format!("{}/v1/load", self.url)))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        let v = r.json::<Value>().await.expect("every answer is JSON");
        (status, v)
    }

    pub async fn post_load(&self, report: Value) -> (StatusCode, Value) {
        self.post_load_raw(report.to_string()).await
    }

    /// `GET /workers`: the list.
    pub async fn workers(&self) -> Vec<Value> {
        let r = self
            .auth(self.http.get(format!("{}/workers", self.url)))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let v: Value = r.json().await.unwrap();
        v["workers"].as_array().cloned().unwrap_or_default()
    }

    /// `GET /v1/load`.
    pub async fn load(&self) -> Value {
        let r = self
            .auth(self.http.get(format!("{}/v1/load", self.url)))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        r.json().await.unwrap()
    }

    pub async fn epoch(&self) -> u64 {
        self.load().await["epoch"].as_u64().unwrap()
    }

    /// The collector's Prometheus text.
    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// `POST /query` for model "m": the status and how long it took.
    pub async fn query(&self) -> (StatusCode, Duration) {
        let t = Instant::now();
        let r = self
            .auth(self.http.post(format!("{}/query", self.url)))
            .json(&json!({"token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "model_name": "m"}))
            .send()
            .await
            .unwrap();
        (r.status(), t.elapsed())
    }
}

/// The value of a counter line `name{labels} value` (0 when absent).
pub fn counter(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The fleet view's entry of worker `id`.
pub fn worker(view: &Value, id: u32) -> &Value {
    view["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == id)
        .unwrap_or_else(|| panic!("worker {id} in {view}"))
}
