//! Replays a trace: each request is sent at its timestamp divided by `speed`, streamed, and
//! timed. TTFT is the arrival of the first body chunk of the SSE stream (the engine sends its
//! headers at admission and the first token at the end of prefill); latency is the end of the
//! stream. Times are reported in *simulated* seconds (measured × `speed`), matching engines
//! that run `speed` times faster than real time.
//!
//! The engine and its cached tokens come from the `x-kvroute-sim-*` response headers, or,
//! behind a proxy that drops them, from the body (`system_fingerprint` and the final usage
//! chunk's `prompt_tokens_details.cached_tokens`; SGLang `meta_info`).
//!
//! Text variants ([`Api::ChatText`], [`Api::CompletionsPrompt`]) send the texts of a
//! [`Prompts`] made before the replay, so no text is built or tokenized in the timed send.
//!
//! Requests go either to one URL (a router under test: vllm-router, sglang-router, Envoy) or
//! through an in-process [`Route`] that picks an engine per request (the bench's policies).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use crate::engine::{HEADER_CACHED_TOKENS, HEADER_ENGINE, HEADER_REQUEST_DP_RANK};
use crate::tokenizer;
use crate::trace::TraceRecord;

/// Which API the prompts go to, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Api {
    /// `POST /v1/completions` with `prompt` as token ids.
    CompletionsIds,
    /// `POST /v1/completions` with `prompt` as `t<id>` text (sglang-router only routes text).
    CompletionsText,
    /// `POST /v1/chat/completions` with one user message holding [`Prompts::texts`]' text.
    ChatText,
    /// `POST /v1/completions` with `prompt` as [`Prompts::texts`]' text.
    CompletionsPrompt,
}

/// One request's prompt as sent: the API path, the body's `prompt` or `messages` value, and
/// the token ids where the client knows them.
#[derive(Clone, Debug, PartialEq)]
pub struct BodyPrompt {
    pub path: &'static str,
    pub value: Value,
    pub ids: Option<Arc<[u32]>>,
}

/// Prompts prepared before a replay, by trace index: the text of each request and, when a
/// client-side tokenizer made them, its token ids. Shared by every policy of a scenario so
/// each sees the same bytes.
#[derive(Clone, Debug, Default)]
pub struct Prompts {
    /// The request's text (text APIs).
    pub texts: Vec<Arc<str>>,
    /// The request's token ids, sent by [`Api::CompletionsIds`] instead of the trace's own
    /// (empty: the trace's ids).
    pub ids: Vec<Arc<[u32]>>,
}

impl Prompts {
    /// The body's `prompt` or `messages` for request `index` under `api`, and the prompt's
    /// token ids where the client knows them (routers read them; the engine's usage report
    /// gives the count otherwise).
    ///
    /// # Errors
    /// A text API without a text for `index`.
    pub fn body_prompt(
        prompts: Option<&Prompts>,
        api: Api,
        rec: &TraceRecord,
        index: usize,
    ) -> Result<BodyPrompt, String> {
        let ids = || -> Arc<[u32]> {
            prompts
                .and_then(|p| p.ids.get(index).cloned())
                .unwrap_or_else(|| rec.prompt(index).into())
        };
        let text = || {
            prompts
                .and_then(|p| p.texts.get(index).cloned())
                .ok_or_else(|| format!("no text prompt for request {index}"))
        };
        let known = prompts.and_then(|p| p.ids.get(index).cloned());
        let (path, value, ids) = match api {
            Api::CompletionsIds => {
                let t = ids();
                ("/v1/completions", json!(&*t), Some(t))
            }
            Api::CompletionsText => {
                let t = ids();
                ("/v1/completions", json!(tokenizer::decode(&t)), Some(t))
            }
            Api::ChatText => (
                "/v1/chat/completions",
                json!([{"role": "user", "content": &*text()?}]),
                known,
            ),
            // The chat ids (if any) are not this prompt's: leave the count to the engine.
            Api::CompletionsPrompt => ("/v1/completions", json!(&*text()?), None),
        };
        Ok(BodyPrompt { path, value, ids })
    }
}

/// What a [`Route`] is asked.
#[derive(Debug)]
pub struct RouteRequest<'a> {
    pub index: usize,
    pub tokens: &'a [u32],
}

/// Where a [`Route`] sends a request.
#[derive(Clone, Debug, Default)]
pub struct Decision {
    /// Base URL of the engine, e.g. `http://127.0.0.1:8001`.
    pub url: String,
    /// Sent as `x-data-parallel-rank` when set.
    pub dp_rank: Option<u32>,
    /// The router's own index of the engine, handed back in the callbacks.
    pub slot: usize,
    /// Prompt tokens the router expected to be uncached (its prefill-load estimate).
    pub uncached_tokens: usize,
    /// When the router booked it, in the router's own milliseconds (a router learning
    /// prefill rates reads it back at the first token).
    pub booked_at_ms: u64,
    /// The router saw the engine's prefill idle when it booked this request.
    pub idle: bool,
}

/// A boxed future, for the object-safe [`Route`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An in-process routing policy.
pub trait Route: Send + Sync {
    /// Picks the engine of one request.
    fn route<'a>(&'a self, req: RouteRequest<'a>) -> BoxFuture<'a, Decision>;
    /// The request's first token arrived (its prefill is done).
    fn on_first_token(&self, _d: &Decision) {}
    /// The request ended (successfully or not).
    fn on_done(&self, _d: &Decision) {}
}

/// Where requests go.
#[derive(Clone)]
pub enum Target {
    /// Everything to one base URL.
    Url(String),
    /// Through an in-process router.
    Routed(Arc<dyn Route>),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Url(u) => write!(f, "Url({u})"),
            Target::Routed(_) => f.write_str("Routed"),
        }
    }
}

/// Replay settings.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Time compression: trace time / `speed` = wall time. Must equal the engines' `speed`.
    pub speed: f64,
    /// Replay only the first N records.
    pub limit: Option<usize>,
    pub api: Api,
    /// The `model` field.
    pub model: String,
    /// Per-request timeout, wall time.
    pub timeout: Duration,
    /// Caps output tokens per request (the trace's `output_length` otherwise).
    pub max_output_tokens: Option<usize>,
    /// Arrival-rate multiplier: trace gaps are divided by it (in simulated time), so 2.0 sends
    /// the trace at twice its load. Default 1.0.
    pub arrival_scale: f64,
    /// Prepared prompts (text APIs need them; token ids override the trace's when present).
    pub prompts: Option<Arc<Prompts>>,
    /// Send a failed request once more, at once (its result is then the second attempt's,
    /// marked [`RequestResult::retried`]). Default false.
    pub retry_once: bool,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            speed: 1.0,
            limit: None,
            api: Api::CompletionsIds,
            model: "sim-model".to_string(),
            timeout: Duration::from_secs(600),
            max_output_tokens: None,
            arrival_scale: 1.0,
            prompts: None,
            retry_once: false,
        }
    }
}

/// One request's outcome. Times in simulated seconds.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RequestResult {
    pub index: usize,
    /// Scheduled send time from the trace's start.
    pub sent_at_s: f64,
    pub ttft_s: Option<f64>,
    /// TTFT in the engine's model (header `x-kvroute-sim-model-ttft-us`): free of host
    /// overheads multiplied by the speed-up.
    #[serde(default)]
    pub model_ttft_s: Option<f64>,
    pub latency_s: Option<f64>,
    pub engine: Option<String>,
    pub dp_rank: Option<u32>,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub cached_tokens: Option<usize>,
    pub status: u16,
    pub error: Option<String>,
    /// The first attempt failed and this is the second's outcome ([`ReplayConfig::retry_once`]).
    #[serde(default)]
    pub retried: bool,
}

impl RequestResult {
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status == 200
    }
}

/// Summary statistics of a replay. Times in simulated seconds.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub failed: usize,
    /// Cached prompt tokens / prompt tokens, over successful requests.
    pub hit_rate: f64,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub ttft_mean_s: f64,
    /// Quantiles of the engines' model TTFT (see [`RequestResult::model_ttft_s`]).
    pub model_ttft_p50_s: f64,
    pub model_ttft_p90_s: f64,
    pub model_ttft_p99_s: f64,
    pub latency_p50_s: f64,
    pub latency_p90_s: f64,
    /// From the first send to the last completion.
    pub duration_s: f64,
    pub requests_per_s: f64,
    /// Prompt + output tokens per simulated second.
    pub tokens_per_s: f64,
    /// Requests served per engine.
    pub per_engine: BTreeMap<String, usize>,
    /// Busiest engine's requests / mean requests per engine (1.0 = perfectly even).
    pub max_over_mean_load: f64,
}

/// The `p`-quantile (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarizes results; `engines` lists engines that got no request (they count in the mean).
pub fn summarize(results: &[RequestResult], engines: &[String]) -> Summary {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok()).collect();
    let prompt: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: usize = ok.iter().map(|r| r.cached_tokens.unwrap_or(0)).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let mut mttft: Vec<f64> = ok.iter().filter_map(|r| r.model_ttft_s).collect();
    mttft.sort_by(f64::total_cmp);
    let mut lat: Vec<f64> = ok.iter().filter_map(|r| r.latency_s).collect();
    lat.sort_by(f64::total_cmp);
    let start = results
        .iter()
        .map(|r| r.sent_at_s)
        .fold(f64::INFINITY, f64::min);
    let end = ok
        .iter()
        .filter_map(|r| r.latency_s.map(|l| r.sent_at_s + l))
        .fold(0.0, f64::max);
    let duration = if end > start { end - start } else { 0.0 };
    let mut per_engine: BTreeMap<String, usize> = engines.iter().map(|e| (e.clone(), 0)).collect();
    for r in &ok {
        *per_engine
            .entry(r.engine.clone().unwrap_or_else(|| "unknown".into()))
            .or_default() += 1;
    }
    let max = per_engine.values().copied().max().unwrap_or(0) as f64;
    let mean = if per_engine.is_empty() {
        0.0
    } else {
        ok.len() as f64 / per_engine.len() as f64
    };
    let tokens: usize = ok.iter().map(|r| r.prompt_tokens + r.output_tokens).sum();
    Summary {
        requests: results.len(),
        ok: ok.len(),
        failed: results.len() - ok.len(),
        hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        model_ttft_p50_s: quantile(&mttft, 0.5),
        model_ttft_p90_s: quantile(&mttft, 0.9),
        model_ttft_p99_s: quantile(&mttft, 0.99),
        ttft_p50_s: quantile(&ttft, 0.5),
        ttft_p90_s: quantile(&ttft, 0.9),
        ttft_p99_s: quantile(&ttft, 0.99),
        ttft_mean_s: if ttft.is_empty() {
            f64::NAN
        } else {
            ttft.iter().sum::<f64>() / ttft.len() as f64
        },
        latency_p50_s: quantile(&lat, 0.5),
        latency_p90_s: quantile(&lat, 0.9),
        duration_s: duration,
        requests_per_s: if duration > 0.0 {
            ok.len() as f64 / duration
        } else {
            0.0
        },
        tokens_per_s: if duration > 0.0 {
            tokens as f64 / duration
        } else {
            0.0
        },
        per_engine,
        max_over_mean_load: if mean > 0.0 { max / mean } else { 0.0 },
    }
}

/// Replays `trace` against `target`; returns every request's result, in trace order.
/// `progress` is ticked once per finished request.
pub async fn run(
    trace: &[TraceRecord],
    target: Target,
    cfg: &ReplayConfig,
    progress: Option<indicatif::ProgressBar>,
) -> Vec<RequestResult> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .expect("http client");
    let n = cfg.limit.map_or(trace.len(), |l| l.min(trace.len()));
    let speed = cfg.speed.max(1e-9);
    let t0 = trace.first().map_or(0, |r| r.timestamp);
    let start = Instant::now();
    let mut handles = Vec::with_capacity(n);
    for (index, rec) in trace[..n].iter().enumerate() {
        let offset_s =
            (rec.timestamp.saturating_sub(t0)) as f64 / 1000.0 / cfg.arrival_scale.max(1e-9);
        let due = start + Duration::from_secs_f64(offset_s / speed);
        let rec = rec.clone();
        let client = client.clone();
        let target = target.clone();
        let cfg = cfg.clone();
        let progress = progress.clone();
        handles.push(tokio::spawn(async move {
            tokio::time::sleep_until(due.into()).await;
            let mut r = one(index, offset_s, &rec, &client, &target, &cfg).await;
            if cfg.retry_once && !r.ok() {
                r = one(index, offset_s, &rec, &client, &target, &cfg).await;
                r.retried = true;
            }
            if let Some(p) = progress {
                p.inc(1);
            }
            r
        }));
    }
    let mut out = Vec::with_capacity(n);
    for (i, h) in handles.into_iter().enumerate() {
        out.push(h.await.unwrap_or_else(|e| RequestResult {
            index: i,
            sent_at_s: 0.0,
            ttft_s: None,
            model_ttft_s: None,
            latency_s: None,
            engine: None,
            dp_rank: None,
            prompt_tokens: 0,
            output_tokens: 0,
            cached_tokens: None,
            status: 0,
            error: Some(format!("task: {e}")),
            retried: false,
        }));
    }
    out
}

async fn one(
    index: usize,
    offset_s: f64,
    rec: &TraceRecord,
    client: &reqwest::Client,
    target: &Target,
    cfg: &ReplayConfig,
) -> RequestResult {
    let output_tokens = cfg
        .max_output_tokens
        .map_or(rec.output_length, |m| rec.output_length.min(m))
        .max(1);
    let mut result = RequestResult {
        index,
        sent_at_s: offset_s,
        ttft_s: None,
        model_ttft_s: None,
        latency_s: None,
        engine: None,
        dp_rank: None,
        prompt_tokens: 0,
        output_tokens,
        cached_tokens: None,
        status: 0,
        error: None,
        retried: false,
    };
    let BodyPrompt {
        path,
        value: prompt,
        ids: tokens,
    } = match Prompts::body_prompt(cfg.prompts.as_deref(), cfg.api, rec, index) {
        Ok(p) => p,
        Err(e) => {
            result.error = Some(e);
            return result;
        }
    };
    let tokens: Arc<[u32]> = tokens.unwrap_or_else(|| Arc::from(Vec::new()));
    result.prompt_tokens = tokens.len();
    let sent = Instant::now();
    let (base, decision) = match target {
        Target::Url(u) => (u.clone(), None),
        Target::Routed(r) => {
            let d = r
                .route(RouteRequest {
                    index,
                    tokens: &tokens,
                })
                .await;
            (d.url.clone(), Some(d))
        }
    };
    drop(tokens);
    let field = if cfg.api == Api::ChatText {
        "messages"
    } else {
        "prompt"
    };
    let body = json!({"model": cfg.model, field: prompt, "max_tokens": output_tokens, "stream": true,
                      "ignore_eos": true, "temperature": 0.0});
    let mut req = client
        .post(format!("{}{path}", base.trim_end_matches('/')))
        .json(&body);
    if let Some(r) = decision.as_ref().and_then(|d| d.dp_rank) {
        req = req.header(HEADER_REQUEST_DP_RANK, r.to_string());
    }
    let scale = cfg.speed;
    let outcome = tokio::time::timeout(cfg.timeout, async {
        let resp = req.send().await.map_err(|e| format!("send: {e}"))?;
        result.status = resp.status().as_u16();
        let h = resp.headers();
        result.engine = h
            .get(HEADER_ENGINE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        result.cached_tokens = h
            .get(HEADER_CACHED_TOKENS)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse().ok());
        result.dp_rank = h
            .get(crate::engine::HEADER_DP_RANK)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse().ok());
        result.model_ttft_s = h
            .get(crate::engine::HEADER_MODEL_TTFT_US)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse::<u64>().ok())
            .map(|us| us as f64 / 1e6);
        if !resp.status().is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!(
                "status {}: {}",
                result.status,
                text.chars().take(200).collect::<String>()
            ));
        }
        let mut stream = resp.bytes_stream();
        let mut tail: Vec<u8> = Vec::new();
        let mut first = true;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("body: {e}"))?;
            if first && !chunk.is_empty() {
                first = false;
                result.ttft_s = Some(sent.elapsed().as_secs_f64() * scale);
                if let Some(d) = &decision {
                    if let Target::Routed(r) = target {
                        r.on_first_token(d);
                    }
                }
            }
            tail.extend_from_slice(&chunk);
            if tail.len() > 16 * 1024 {
                tail.drain(..tail.len() - 8 * 1024);
            }
        }
        result.latency_s = Some(sent.elapsed().as_secs_f64() * scale);
        parse_tail(&tail, &mut result);
        Ok(())
    })
    .await;
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => result.error = Some(e),
        Err(_) => result.error = Some("timeout".into()),
    }
    if let (Some(d), Target::Routed(r)) = (&decision, target) {
        if result.ttft_s.is_none() {
            r.on_first_token(d);
        }
        r.on_done(d);
    }
    result
}

/// Fills engine and cached tokens from the stream's last data events when headers lacked them.
fn parse_tail(tail: &[u8], result: &mut RequestResult) {
    let text = String::from_utf8_lossy(tail);
    for line in text.lines().rev() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if result.engine.is_none() {
            result.engine = v
                .get("system_fingerprint")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if result.cached_tokens.is_none() {
            result.cached_tokens = v
                .pointer("/usage/prompt_tokens_details/cached_tokens")
                .or_else(|| v.pointer("/meta_info/cached_tokens"))
                .and_then(Value::as_u64)
                .map(|c| c as usize);
        }
        // Text prompts: the client may not know the count; the engine's usage does.
        if result.prompt_tokens == 0 {
            result.prompt_tokens = v
                .pointer("/usage/prompt_tokens")
                .or_else(|| v.pointer("/meta_info/prompt_tokens"))
                .and_then(Value::as_u64)
                .map_or(0, |c| c as usize);
        }
        if result.engine.is_some() && result.cached_tokens.is_some() && result.prompt_tokens > 0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 5.0);
        assert_eq!(quantile(&v, 0.9), 9.0);
        assert_eq!(quantile(&v, 0.99), 10.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn tail_gives_engine_and_cached_tokens() {
        let mut r = RequestResult {
            index: 0,
            sent_at_s: 0.0,
            ttft_s: None,
            model_ttft_s: None,
            latency_s: None,
            engine: None,
            dp_rank: None,
            prompt_tokens: 0,
            output_tokens: 0,
            cached_tokens: None,
            status: 200,
            error: None,
            retried: false,
        };
        let tail = b"data: {\"system_fingerprint\":\"e1\",\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        parse_tail(tail, &mut r);
        assert_eq!(r.engine.as_deref(), Some("e1"));
        assert_eq!(r.cached_tokens, Some(32));
    }

    fn record() -> TraceRecord {
        TraceRecord {
            timestamp: 0,
            input_length: 600,
            output_length: 2,
            hash_ids: vec![1, 2],
        }
    }

    #[test]
    fn bodies_follow_the_api() {
        let rec = record();
        let prompts = Prompts {
            texts: vec![Arc::from(" the cat")],
            ids: vec![Arc::from(vec![7u32, 8, 9])],
        };
        let p = Some(&prompts);
        let b = Prompts::body_prompt(p, Api::ChatText, &rec, 0).unwrap();
        assert_eq!(b.path, "/v1/chat/completions");
        assert_eq!(b.value, json!([{"role": "user", "content": " the cat"}]));
        assert_eq!(b.ids.as_deref(), Some(&[7u32, 8, 9][..]));
        let b = Prompts::body_prompt(p, Api::CompletionsPrompt, &rec, 0).unwrap();
        assert_eq!(
            b,
            BodyPrompt {
                path: "/v1/completions",
                value: json!(" the cat"),
                ids: None
            }
        );
        // Prepared ids replace the trace's; without them the trace's toy ids are sent.
        let b = Prompts::body_prompt(p, Api::CompletionsIds, &rec, 0).unwrap();
        assert_eq!(b.value, json!([7, 8, 9]));
        let b = Prompts::body_prompt(None, Api::CompletionsIds, &rec, 0).unwrap();
        assert_eq!(b.value, json!(rec.prompt(0)));
        assert_eq!(b.ids.map(|i| i.len()), Some(600));
        // A text API without a text is an error result, not a panic.
        assert!(Prompts::body_prompt(p, Api::ChatText, &rec, 1).is_err());
        assert!(Prompts::body_prompt(None, Api::CompletionsPrompt, &rec, 0).is_err());
    }

    #[test]
    fn tail_gives_prompt_tokens_when_the_client_has_none() {
        let mut r = RequestResult {
            index: 0,
            sent_at_s: 0.0,
            ttft_s: None,
            model_ttft_s: None,
            latency_s: None,
            engine: Some("e0".into()),
            dp_rank: None,
            prompt_tokens: 0,
            output_tokens: 0,
            cached_tokens: Some(5),
            status: 200,
            error: None,
            retried: false,
        };
        parse_tail(
            b"data: {\"usage\":{\"prompt_tokens\":1030}}\n\ndata: [DONE]\n\n",
            &mut r,
        );
        assert_eq!(r.prompt_tokens, 1030);
    }

    #[test]
    fn summary_counts_hits_and_load() {
        let mk = |i, eng: &str, cached| RequestResult {
            index: i,
            sent_at_s: i as f64,
            ttft_s: Some(0.1 * (i + 1) as f64),
            model_ttft_s: None,
            latency_s: Some(1.0),
            engine: Some(eng.into()),
            dp_rank: None,
            prompt_tokens: 100,
            output_tokens: 10,
            cached_tokens: Some(cached),
            status: 200,
            error: None,
            retried: false,
        };
        let s = summarize(
            &[mk(0, "a", 0), mk(1, "a", 50), mk(2, "b", 100)],
            &["a".into(), "b".into(), "c".into()],
        );
        assert_eq!(s.ok, 3);
        assert!((s.hit_rate - 0.5).abs() < 1e-9);
        assert_eq!(s.per_engine["c"], 0);
        assert!((s.max_over_mean_load - 2.0).abs() < 1e-9);
    }
}
