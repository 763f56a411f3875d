//! A simulated LLM engine: vLLM's scheduling and prefix caching reduced to their effect on
//! time to first token, behind an OpenAI-style HTTP API, publishing real-format KV events.
//!
//! One concern: one engine's request lifecycle (admission, prefill, decode, release) and the
//! cache events it publishes, for both engine models; the stepped model's scheduler is in
//! [`stepped`], the HTTP surface in `http`.
//!
//! Two timing models, chosen per engine by [`EngineConfig::engine_model`]: the serial model
//! below (the default, the one the router's defaults were tuned on), and the stepped model
//! of [`stepped`], vLLM V1's scheduler step by step, where decodes share each step's token
//! budget and time with prefill chunks, and a full KV cache preempts. Both keep the same
//! cache, KV events, HTTP API, headers, `/metrics` and `speed`.
//!
//! # Model (serial)
//!
//! - Each data-parallel rank has its own [`KvCache`], waiting queue and KV-event publisher
//!   (ports offset by the rank, as vLLM does).
//! - Admission is FCFS: the head of the waiting queue is admitted when fewer than
//!   `max_running` requests run and its blocks fit (after evicting free cached blocks); else
//!   everything behind it waits, as in vLLM's scheduler.
//! - Prefill is one FCFS server per rank working at `prefill_tokens_per_s` on the *uncached*
//!   prompt tokens (vLLM's chunked prefill works through admitted prompts in order with a
//!   token budget per step, so prompts queue behind each other's compute). The first token
//!   leaves `prefill_overhead` after the prefill ends.
//! - Then one output token every `decode_per_token`; the request's blocks are freed at the
//!   end (or when the client goes away).
//! - Time runs `speed` times faster than real time: every duration is divided by `speed`, so
//!   a trace replayed at `--speed X` against engines at `--speed X` sees the same utilization
//!   as in real time, and measured times multiplied by X are simulated times.
//!
//! # Defaults (one H100 SXM serving Llama-3.1-8B in bf16 with vLLM)
//!
//! - `prefill_tokens_per_s = 20_000`: 8 B parameters cost ~2·8e9 = 1.6e10 FLOP per token; an
//!   H100 SXM gives 989 TFLOP/s dense bf16 (NVIDIA's datasheet); at ~35–40 % MFU, typical of
//!   long-prompt prefill with attention overhead, that is ~20–25 k tokens/s.
//! - `decode_per_token = 8 ms`: decoding reads the 16 GB of weights per step from 3.35 TB/s
//!   HBM3 (datasheet): ≥ 4.8 ms per step; batched decode with KV reads runs ~7–10 ms per token.
//! - `capacity_blocks = 25_000` of 16 tokens (400 k tokens): Llama-3.1-8B keeps 2 · 32 layers ·
//!   8 KV heads · 128 dims · 2 bytes = 128 KiB per token; 80 GB · 0.9 utilization − 16 GB of
//!   weights − ~4 GB of activations leaves ~52 GB, ~400 k tokens (vLLM logs a KV cache of
//!   this order for this model and GPU).
//! - `max_running = 256` (vLLM's `max_num_seqs` default), `prefill_overhead = 15 ms` (one
//!   scheduler step plus sampling and detokenization of the first token).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch, Notify};

use crate::cache::{AdmitError, CacheConfig, CacheEvent, KvCache, RequestId};
use crate::engine_hash::HashScheme;
use crate::publisher::{PublishError, Publisher, PublisherConfig};
use crate::tokenizer;
use crate::wire::{self, EventFormat, Extras};

mod http;
pub mod stepped;

pub use stepped::StepCosts;

/// Response header: prompt tokens served from the prefix cache.
pub const HEADER_CACHED_TOKENS: &str = "x-kvroute-sim-cached-tokens";
/// Response header: the engine (instance id) that served the request.
pub const HEADER_ENGINE: &str = "x-kvroute-sim-engine";
/// Response header: the dp rank that served the request.
pub const HEADER_DP_RANK: &str = "x-kvroute-sim-dp-rank";
/// Response header: time to first token in the engine's model, simulated microseconds
/// ([`Running::model_ttft`]).
pub const HEADER_MODEL_TTFT_US: &str = "x-kvroute-sim-model-ttft-us";
/// Request header honoured by vLLM and SGLang to pick a data-parallel rank.
pub const HEADER_REQUEST_DP_RANK: &str = "x-data-parallel-rank";

/// The timing model of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineModel {
    /// One FCFS prefill server per rank, then a fixed time per output token (module docs).
    #[default]
    Serial,
    /// vLLM V1's scheduler: steps with a token budget shared by decodes and chunked prefill,
    /// step time growing with its work, preemption by recompute ([`stepped`]).
    #[value(name = "vllm", alias = "stepped")]
    Stepped,
}

/// Engine settings. Defaults: see the module docs.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Instance id, reported in [`HEADER_ENGINE`] and `/v1/models`.
    pub name: String,
    /// Timing model (default [`EngineModel::Serial`]). The stepped model uses
    /// `prefill_tokens_per_s`, `max_running`, `max_batched_tokens` (its step budget) and
    /// `step_costs`; `prefill_overhead` and `decode_per_token` are the serial model's only.
    pub engine_model: EngineModel,
    /// Step costs of the stepped model (defaults: [`stepped`]'s module docs).
    pub step_costs: StepCosts,
    /// Served model name.
    pub model: String,
    /// Paged cache per rank.
    pub cache: CacheConfig,
    /// Prefill throughput on uncached tokens, tokens per simulated second.
    pub prefill_tokens_per_s: f64,
    /// Fixed time from the end of prefill to the first token (simulated).
    pub prefill_overhead: Duration,
    /// Time per output token after the first (simulated).
    pub decode_per_token: Duration,
    /// Concurrency limit per rank (vLLM `max_num_seqs`).
    pub max_running: usize,
    /// Time dilation: durations are divided by it. 1.0 = real time.
    pub speed: f64,
    /// Data-parallel ranks, each with its own cache and publisher.
    pub dp_size: u32,
    /// Wire format of the KV events.
    pub event_format: EventFormat,
    /// PUB endpoint of rank 0 (`tcp://host:port`; ranks add their rank to the port, port 0
    /// picks a free port per rank). `None`: no events.
    pub events_endpoint: Option<String>,
    /// Replay ROUTER endpoint of rank 0, offset likewise.
    pub replay_endpoint: Option<String>,
    /// Topic frame of every event message.
    pub topic: String,
    /// Replay buffer, batches.
    pub buffer_steps: usize,
    /// Seed of the engine's block hashes (vLLM's `NONE_HASH`; differs per engine by default,
    /// as vLLM < 0.29's random seed did, so hashes are opaque).
    pub hash_seed: String,
    /// Tokens per SSE chunk when streaming (vLLM `--stream-interval`).
    pub stream_interval_tokens: usize,
    /// Longest prompt + output accepted, tokens.
    pub max_model_len: usize,
    /// Keep every published batch's cache events in memory (tests).
    pub journal: bool,
    /// Tokens one scheduler step computes (vLLM `max_num_batched_tokens`, 8,192): the events
    /// of one admission are published in batches of at most this many tokens' blocks.
    pub max_batched_tokens: usize,
    /// Text prompts and chat messages to ids: the toy words, or a real tokenizer.
    pub tokenizer: tokenizer::TextTokenizer,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: "sim-0".to_string(),
            engine_model: EngineModel::Serial,
            step_costs: StepCosts::default(),
            model: "sim-model".to_string(),
            cache: CacheConfig {
                block_size_tokens: 16,
                capacity_blocks: 25_000,
            },
            prefill_tokens_per_s: 20_000.0,
            prefill_overhead: Duration::from_millis(15),
            decode_per_token: Duration::from_millis(8),
            max_running: 256,
            speed: 1.0,
            dp_size: 1,
            event_format: EventFormat::Vllm033,
            events_endpoint: None,
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 1_000,
            hash_seed: String::new(),
            stream_interval_tokens: 1,
            max_model_len: 131_072,
            journal: false,
            max_batched_tokens: 8192,
            tokenizer: tokenizer::TextTokenizer::Toy,
        }
    }
}

/// Load and cache counters of one rank (also served at `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub cached_blocks: usize,
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests_finished: u64,
    /// Running requests preempted for KV space (stepped model; vLLM `num_preemptions`).
    pub preemptions: u64,
}

struct Pending {
    prompt: Arc<Vec<u32>>,
    hashes: Vec<kvroute::event::EngineHash>,
    output_tokens: usize,
    tx: oneshot::Sender<Result<Admitted, AdmitError>>,
}

struct Admitted {
    request: RequestId,
    cached_tokens: usize,
    first_token_at: Instant,
}

struct RankState {
    cache: KvCache,
    waiting: VecDeque<Pending>,
    prefill_free_at: Instant,
    stats: RankStats,
    journal: Vec<Vec<CacheEvent>>,
    /// The stepped model's scheduler and clients (`None` for the serial model).
    stepped: Option<StepRank>,
}

impl RankState {
    /// Requests queued for admission, either model.
    fn waiting_len(&self) -> usize {
        self.waiting.len() + self.stepped.as_ref().map_or(0, |s| s.sched.waiting())
    }
}

/// A stepped rank: its scheduler, and the client of each request it holds.
struct StepRank {
    sched: stepped::Scheduler,
    /// One per request in `sched` (bounded by it).
    clients: std::collections::HashMap<stepped::Key, Client>,
}

/// The engine's side of a stepped request: where its progress goes.
struct Client {
    progress: watch::Sender<Progress>,
    arrived_at: Instant,
}

/// A stepped request's progress, as its client sees it.
#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    /// Output tokens sampled so far.
    generated: usize,
    /// When the first one was (due at the end of its step).
    first_token_at: Option<Instant>,
    /// Prompt tokens served from the cache at the first admission.
    cached_tokens: usize,
}

struct Rank {
    index: u32,
    state: Mutex<RankState>,
    publisher: Option<Publisher>,
    /// Wakes the stepped model's driver task when work arrives.
    wake: Arc<Notify>,
}

/// A running engine (all its ranks). Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: EngineConfig,
    scheme: HashScheme,
    ranks: Vec<Rank>,
    next: AtomicU64,
    /// Simulated time 0 of the stepped model's clocks.
    epoch: Instant,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Stepped drivers hold no strong reference while idle: wake them to see it is gone.
        for r in &self.ranks {
            r.wake.notify_one();
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.inner.cfg.name)
            .finish()
    }
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("prompt and output ({needed} blocks) exceed the KV cache ({capacity} blocks)")]
    TooLarge { needed: usize, capacity: usize },
    #[error("prompt of {0} tokens plus output exceeds max_model_len")]
    TooLong(usize),
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("engine stopped")]
    Stopped,
}

impl IntoResponse for EngineError {
    fn into_response(self) -> Response {
        let status = match self {
            EngineError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_REQUEST,
        };
        (
            status,
            Json(json!({"error": {"message": self.to_string(), "type": "BadRequestError"}})),
        )
            .into_response()
    }
}

/// A request admitted to a rank: the handle keeps its blocks until dropped.
pub struct Running {
    engine: Engine,
    rank: u32,
    request: RequestId,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// When the first token is due.
    pub first_token_at: Instant,
    /// Output tokens to produce.
    pub output_tokens: usize,
    /// When the engine received the request.
    pub arrived_at: Instant,
    /// Stepped model: the tokens as its steps sample them (dropping it aborts the request).
    progress: Option<watch::Receiver<Progress>>,
}

impl Running {
    /// The rank serving the request.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Time to first token in the engine's model, simulated: queueing for admission and for
    /// the prefill server, prefill, overhead. Unlike a client's measurement it does not scale
    /// up host overheads (HTTP, routers, a busy CPU) by the speed-up.
    pub fn model_ttft(&self) -> Duration {
        self.first_token_at
            .saturating_duration_since(self.arrived_at)
            .mul_f64(self.engine.inner.cfg.speed)
    }

    /// Real time per output token (serial model; the stepped model's steps decide).
    pub fn token_interval(&self) -> Duration {
        self.engine.wall(self.engine.inner.cfg.decode_per_token)
    }

    /// Waits until the first `n` output tokens are out (all of them sooner if `n` is larger).
    pub async fn wait_tokens(&mut self, n: usize) {
        match &mut self.progress {
            None => {
                let due = self.first_token_at
                    + self.token_interval() * (n.min(self.output_tokens).saturating_sub(1)) as u32;
                tokio::time::sleep_until(due.into()).await;
            }
            Some(rx) => {
                let n = n.min(self.output_tokens);
                // An error is a dropped engine: nothing more will come.
                let _ = rx.wait_for(|p| p.generated >= n).await;
            }
        }
    }

    /// The id its output tokens derive from.
    pub(crate) fn id(&self) -> u64 {
        self.request.0
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A stepped request is aborted by its driver when it sees the receiver gone.
        if self.progress.is_none() {
            self.engine
                .finish(self.rank, self.request, self.output_tokens);
        }
    }
}

impl Engine {
    /// Starts the ranks' publishers (if configured) and returns the engine; serve it with
    /// [`Engine::app`].
    ///
    /// # Errors
    /// A publisher socket that cannot bind, or a bad endpoint.
    pub async fn start(cfg: EngineConfig) -> Result<Engine, PublishError> {
        let mut ranks = Vec::new();
        let scheme = match cfg.event_format {
            f if f.is_sglang() => HashScheme::Sglang,
            _ => HashScheme::vllm(if cfg.hash_seed.is_empty() {
                &cfg.name
            } else {
                &cfg.hash_seed
            }),
        };
        let now = Instant::now();
        for r in 0..cfg.dp_size.max(1) {
            let publisher = match &cfg.events_endpoint {
                Some(ep) => {
                    let endpoint =
                        wire::offset_endpoint_port(ep, r).map_err(PublishError::Endpoint)?;
                    let replay_endpoint = match &cfg.replay_endpoint {
                        Some(rep) => Some(
                            wire::offset_endpoint_port(rep, r).map_err(PublishError::Endpoint)?,
                        ),
                        None => None,
                    };
                    Some(
                        Publisher::start(PublisherConfig {
                            format: cfg.event_format,
                            extras: Extras::engine(cfg.event_format),
                            replay_shape: cfg.event_format.replay_shape(),
                            dp_rank: Some(r),
                            topic: cfg.topic.clone(),
                            endpoint,
                            replay_endpoint,
                            buffer_steps: cfg.buffer_steps,
                        })
                        .await?,
                    )
                }
                None => None,
            };
            ranks.push(Rank {
                index: r,
                state: Mutex::new(RankState {
                    cache: KvCache::new(cfg.cache, scheme.clone()),
                    waiting: VecDeque::new(),
                    prefill_free_at: now,
                    stats: RankStats::default(),
                    journal: Vec::new(),
                    stepped: (cfg.engine_model == EngineModel::Stepped).then(|| StepRank {
                        sched: stepped::Scheduler::new(stepped::SchedConfig {
                            budget_tokens: cfg.max_batched_tokens,
                            max_running: cfg.max_running,
                            prefill_tokens_per_s: cfg.prefill_tokens_per_s,
                            costs: cfg.step_costs,
                        }),
                        clients: Default::default(),
                    }),
                }),
                publisher,
                wake: Arc::new(Notify::new()),
            });
        }
        let engine = Engine {
            inner: Arc::new(Inner {
                cfg,
                scheme,
                ranks,
                next: AtomicU64::new(0),
                epoch: now,
            }),
        };
        if engine.inner.cfg.engine_model == EngineModel::Stepped {
            for r in 0..engine.inner.ranks.len() {
                let weak = Arc::downgrade(&engine.inner);
                let wake = engine.inner.ranks[r].wake.clone();
                tokio::spawn(drive(weak, r, wake));
            }
        }
        Ok(engine)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// The bound PUB and replay endpoints of each rank.
    pub fn event_endpoints(&self) -> Vec<(String, Option<String>)> {
        self.inner
            .ranks
            .iter()
            .filter_map(|r| {
                r.publisher
                    .as_ref()
                    .map(|p| (p.endpoint.clone(), p.replay_endpoint.clone()))
            })
            .collect()
    }

    /// The publisher of a rank (tests watch its seq).
    pub fn publisher(&self, rank: u32) -> Option<&Publisher> {
        self.inner
            .ranks
            .get(rank as usize)
            .and_then(|r| r.publisher.as_ref())
    }

    /// Counters of a rank.
    pub fn stats(&self, rank: u32) -> RankStats {
        let r = &self.inner.ranks[rank as usize];
        let st = r.state.lock().expect("rank lock");
        let mut s = st.stats;
        s.running = st.cache.running();
        s.waiting = st.waiting_len();
        if let Some(sr) = &st.stepped {
            s.preemptions = sr.sched.preemptions();
        }
        s.kv_usage =
            st.cache.used_blocks() as f64 / st.cache.config().capacity_blocks.max(1) as f64;
        s.cached_blocks = st.cache.cached_blocks();
        s
    }

    /// Number of ranks.
    pub fn dp_size(&self) -> u32 {
        self.inner.ranks.len() as u32
    }

    /// Prompt tokens each rank would serve from its cache now (the bench's oracle).
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> Vec<usize> {
        // Hash outside the locks: admissions take them too.
        let hashes = self
            .inner
            .scheme
            .hashes(prompt, self.inner.cfg.cache.block_size_tokens);
        self.inner
            .ranks
            .iter()
            .map(|r| {
                r.state
                    .lock()
                    .expect("rank lock")
                    .cache
                    .cached_prefix_tokens_hashed(&hashes, prompt.len())
            })
            .collect()
    }

    /// The cache events of every batch published so far, per rank (with `journal`).
    pub fn journal(&self, rank: u32) -> Vec<Vec<CacheEvent>> {
        self.inner.ranks[rank as usize]
            .state
            .lock()
            .expect("rank lock")
            .journal
            .clone()
    }

    /// The engine hashes a rank currently caches (tests).
    pub fn cached_hashes(&self, rank: u32) -> Vec<kvroute::event::EngineHash> {
        let mut v: Vec<_> = self.inner.ranks[rank as usize]
            .state
            .lock()
            .expect("rank lock")
            .cache
            .cached_hashes()
            .collect();
        v.sort();
        v
    }

    /// Drops every rank's prefix cache (publishing `AllBlocksCleared`), as vLLM's
    /// `/reset_prefix_cache`. Returns false if some rank is busy (nothing is cleared there).
    pub fn reset_prefix_cache(&self) -> bool {
        let mut all = true;
        for rank in &self.inner.ranks {
            let mut st = rank.state.lock().expect("rank lock");
            if st.waiting_len() > 0 {
                all = false;
                continue;
            }
            match st.cache.clear() {
                Some(ev) => {
                    st.stats = RankStats::default();
                    self.publish(rank, &mut st, vec![ev]);
                }
                None => all = false,
            }
        }
        all
    }

    /// Empties every rank's cache without publishing anything and numbers the next event
    /// batch 0, as a restarted process does: subscribers learn of it from the seq alone. The
    /// counters are kept (they span the whole run). Returns false if some rank still runs or
    /// queues requests (nothing is changed there).
    pub fn restart_empty(&self) -> bool {
        let mut all = true;
        for rank in &self.inner.ranks {
            let mut st = rank.state.lock().expect("rank lock");
            if !st.waiting.is_empty() || st.cache.clear().is_none() {
                all = false;
                continue;
            }
            st.prefill_free_at = Instant::now();
            if let Some(p) = &rank.publisher {
                p.resume_seq(0);
            }
        }
        all
    }

    fn wall(&self, sim: Duration) -> Duration {
        sim.div_f64(self.inner.cfg.speed.max(1e-9))
    }

    /// Picks a rank: the requested one if valid, else the least loaded.
    fn pick_rank(&self, requested: Option<u32>) -> u32 {
        if let Some(r) = requested.filter(|&r| (r as usize) < self.inner.ranks.len()) {
            return r;
        }
        let mut best = (usize::MAX, 0u32);
        for rank in &self.inner.ranks {
            let st = rank.state.lock().expect("rank lock");
            let load = st.cache.running() + st.waiting_len();
            if load < best.0 {
                best = (load, rank.index);
            }
        }
        best.1
    }

    /// Submits a request and waits until it is admitted (its prefill scheduled).
    ///
    /// # Errors
    /// The request can never fit, or is longer than `max_model_len`.
    pub async fn submit(
        &self,
        prompt: Vec<u32>,
        output_tokens: usize,
        rank: Option<u32>,
    ) -> Result<Running, EngineError> {
        let arrived_at = Instant::now();
        let cfg = &self.inner.cfg;
        if prompt.len() + output_tokens > cfg.max_model_len {
            return Err(EngineError::TooLong(prompt.len()));
        }
        if prompt.is_empty() {
            return Err(EngineError::BadRequest("empty prompt".into()));
        }
        let output_tokens = output_tokens.max(1);
        let r = self.pick_rank(rank);
        let (tx, rx) = oneshot::channel();
        // Hash outside the lock.
        let hashes = self
            .inner
            .scheme
            .hashes(&prompt, cfg.cache.block_size_tokens);
        if cfg.engine_model == EngineModel::Stepped {
            return self
                .submit_stepped(r, prompt, hashes, output_tokens, arrived_at)
                .await;
        }
        {
            let rank = &self.inner.ranks[r as usize];
            let mut st = rank.state.lock().expect("rank lock");
            st.waiting.push_back(Pending {
                prompt: Arc::new(prompt),
                hashes,
                output_tokens,
                tx,
            });
            self.pump(rank, &mut st);
        }
        match rx.await {
            Ok(Ok(a)) => Ok(Running {
                engine: self.clone(),
                rank: r,
                request: a.request,
                cached_tokens: a.cached_tokens,
                first_token_at: a.first_token_at,
                output_tokens,
                arrived_at,
                progress: None,
            }),
            Ok(Err(AdmitError::TooLarge { needed, capacity })) => {
                Err(EngineError::TooLarge { needed, capacity })
            }
            Ok(Err(AdmitError::NotEnoughFree { .. })) | Err(_) => Err(EngineError::Stopped),
        }
    }

    /// Admits waiting requests in order while they fit.
    fn pump(&self, rank: &Rank, st: &mut RankState) {
        let cfg = &self.inner.cfg;
        while let Some(head) = st.waiting.front() {
            if st.cache.running() >= cfg.max_running {
                break;
            }
            if head.tx.is_closed() {
                st.waiting.pop_front();
                continue;
            }
            match st
                .cache
                .try_admit_hashed(&head.prompt, &head.hashes, head.output_tokens)
            {
                Err(AdmitError::NotEnoughFree { .. }) => break,
                Err(e @ AdmitError::TooLarge { .. }) => {
                    let p = st.waiting.pop_front().expect("head");
                    let _ = p.tx.send(Err(e));
                }
                Ok(adm) => {
                    let p = st.waiting.pop_front().expect("head");
                    let prompt_len = p.prompt.len();
                    let uncached = prompt_len - adm.cached_tokens;
                    let now = Instant::now();
                    let start = st.prefill_free_at.max(now);
                    let prefill = self.wall(Duration::from_secs_f64(
                        uncached as f64 / cfg.prefill_tokens_per_s,
                    ));
                    st.prefill_free_at = start + prefill;
                    let first_token_at = st.prefill_free_at + self.wall(cfg.prefill_overhead);
                    st.stats.prefix_queries_tokens += prompt_len as u64;
                    st.stats.prefix_hits_tokens += adm.cached_tokens as u64;
                    st.stats.prompt_tokens += prompt_len as u64;
                    if !adm.events.is_empty() {
                        self.publish(rank, st, adm.events);
                    }
                    let admitted = Admitted {
                        request: adm.request,
                        cached_tokens: adm.cached_tokens,
                        first_token_at,
                    };
                    if let Err(Ok(a)) = p.tx.send(Ok(admitted)) {
                        // The client left while waiting: release at once.
                        st.cache.finish(a.request);
                    }
                }
            }
        }
    }

    /// Publishes one admission's (or a reset's) changes, one batch per scheduler step.
    fn publish(&self, rank: &Rank, st: &mut RankState, events: Vec<CacheEvent>) {
        let cfg = &self.inner.cfg;
        let step_blocks = cfg.max_batched_tokens / cfg.cache.block_size_tokens.max(1);
        for step in crate::cache::split_steps(events, step_blocks) {
            if let Some(p) = &rank.publisher {
                let wire_events =
                    wire::to_wire(cfg.event_format, cfg.cache.block_size_tokens, &step);
                p.publish_wire(&wire_events);
            }
            if cfg.journal {
                st.journal.push(step);
            }
        }
    }

    fn finish(&self, rank: u32, request: RequestId, output_tokens: usize) {
        let rank = &self.inner.ranks[rank as usize];
        let mut st = rank.state.lock().expect("rank lock");
        st.cache.finish(request);
        st.stats.generation_tokens += output_tokens as u64;
        st.stats.requests_finished += 1;
        self.pump(rank, &mut st);
    }

    fn next_id(&self) -> u64 {
        self.inner.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Simulated time of `t` on the stepped clocks.
    fn sim_time(&self, t: Instant) -> Duration {
        t.saturating_duration_since(self.inner.epoch)
            .mul_f64(self.inner.cfg.speed)
    }

    /// The instant of simulated time `sim`.
    fn wall_time(&self, sim: Duration) -> Instant {
        self.inner.epoch + self.wall(sim)
    }

    /// [`Engine::submit`] on a stepped rank: queues the request and waits for its first token.
    async fn submit_stepped(
        &self,
        r: u32,
        prompt: Vec<u32>,
        hashes: Vec<kvroute::event::EngineHash>,
        output_tokens: usize,
        arrived_at: Instant,
    ) -> Result<Running, EngineError> {
        let rank = &self.inner.ranks[r as usize];
        let key = stepped::Key(self.next_id());
        let (tx, mut rx) = watch::channel(Progress::default());
        {
            let mut st = rank.state.lock().expect("rank lock");
            // The serial model's admission check: a request that can never fit is refused.
            let needed = st.cache.blocks_needed(prompt.len(), output_tokens);
            let capacity = st.cache.config().capacity_blocks;
            if needed > capacity {
                return Err(EngineError::TooLarge { needed, capacity });
            }
            let arrived = self.sim_time(arrived_at);
            let sr = st.stepped.as_mut().expect("a stepped rank");
            sr.sched
                .add(key, Arc::new(prompt), hashes, output_tokens, arrived);
            sr.clients.insert(
                key,
                Client {
                    progress: tx,
                    arrived_at,
                },
            );
        }
        rank.wake.notify_one();
        let first = match rx.wait_for(|p| p.generated >= 1).await {
            Ok(p) => *p,
            Err(_) => return Err(EngineError::Stopped),
        };
        Ok(Running {
            engine: self.clone(),
            rank: r,
            request: RequestId(key.0),
            cached_tokens: first.cached_tokens,
            first_token_at: first.first_token_at.unwrap_or(arrived_at),
            output_tokens,
            arrived_at,
            progress: Some(rx),
        })
    }

    /// Schedules a stepped rank's next step at its clock (`None`: nothing to do). Aborts the
    /// requests whose clients went away, publishes the step's evictions.
    fn begin_step(&self, r: usize) -> Option<stepped::Plan> {
        let rank = &self.inner.ranks[r];
        let mut guard = rank.state.lock().expect("rank lock");
        let st = &mut *guard;
        let sr = st.stepped.as_mut().expect("a stepped rank");
        let gone: Vec<stepped::Key> = sr
            .clients
            .iter()
            .filter(|(_, c)| c.progress.is_closed())
            .map(|(k, _)| *k)
            .collect();
        for k in gone {
            sr.clients.remove(&k);
            sr.sched.abort(k, &mut st.cache);
        }
        if !sr.sched.has_work() {
            return None;
        }
        // The clock runs on from the last step even when the host runs the steps late (the
        // schedule stays exact, only its delivery lags); a rank with nothing running jumps to
        // the next arrival. Skipping ahead instead would insert idle time that never was.
        if sr.sched.running() == 0 {
            if let Some(t) = sr.sched.next_arrival() {
                sr.sched.advance_to(t);
            }
        }
        let plan = sr.sched.schedule(&mut st.cache);
        for a in &plan.admitted {
            st.stats.prefix_queries_tokens += a.prompt_tokens as u64;
            st.stats.prefix_hits_tokens += a.cached_tokens as u64;
            st.stats.prompt_tokens += a.prompt_tokens as u64;
            if let Some(c) = sr.clients.get(&a.key) {
                c.progress
                    .send_modify(|p| p.cached_tokens = a.cached_tokens);
            }
        }
        if !plan.events.is_empty() {
            let events = plan.events.clone();
            self.publish(rank, st, events);
        }
        Some(plan)
    }

    /// Ends a stepped rank's step: publishes the blocks it computed, hands out its tokens.
    fn end_step(&self, r: usize, plan: stepped::Plan) {
        let rank = &self.inner.ranks[r];
        let mut guard = rank.state.lock().expect("rank lock");
        let st = &mut *guard;
        let sr = st.stepped.as_mut().expect("a stepped rank");
        let done = sr.sched.complete(plan, &mut st.cache);
        let at = self.wall_time(done.at);
        let interval = self.inner.cfg.stream_interval_tokens.max(1);
        for s in &done.sampled {
            st.stats.generation_tokens += 1;
            if s.finished {
                st.stats.requests_finished += 1;
            }
            let Some(c) = sr.clients.get(&s.key) else {
                continue;
            };
            // The first token is due when its step ends, but not before the request came.
            let first = at.max(c.arrived_at);
            // Wake the client only at the tokens its stream waits for (the first, every
            // `stream_interval_tokens` after it, the last): waking every stream on every step
            // costs the host more than the steps themselves.
            let due = s.generated == 1 || s.finished || (s.generated - 1) % interval == 0;
            c.progress.send_if_modified(|p| {
                p.generated = s.generated;
                p.first_token_at.get_or_insert(first);
                due
            });
            if s.finished {
                sr.clients.remove(&s.key);
            }
        }
        if !done.events.is_empty() {
            self.publish(rank, st, done.events);
        }
    }
}

/// The driver of stepped rank `r`: schedules a step, sleeps until it ends, completes it;
/// parks on `wake` while there is nothing to do. Ends when the engine is dropped.
async fn drive(weak: std::sync::Weak<Inner>, r: usize, wake: Arc<Notify>) {
    loop {
        let Some(inner) = weak.upgrade() else {
            return;
        };
        let engine = Engine { inner };
        let Some(plan) = engine.begin_step(r) else {
            drop(engine);
            wake.notified().await;
            continue;
        };
        let end = engine.wall_time(plan.start + plan.duration);
        drop(engine);
        tokio::time::sleep_until(end.into()).await;
        let Some(inner) = weak.upgrade() else {
            return;
        };
        Engine { inner }.end_step(r, plan);
    }
}
