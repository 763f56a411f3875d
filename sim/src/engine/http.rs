//! The engine's HTTP API: OpenAI-style `/v1/completions` and `/v1/chat/completions`,
//! SGLang-style `/generate`, `/tokenize`, `/v1/models`, `/health`, `/metrics` and
//! `/reset_prefix_cache`. Text goes through the engine's [`tokenizer::TextTokenizer`]. A child of
//! [`super`] so the handlers reach the engine's private state without widening it.

use super::*;

impl Engine {
    /// The HTTP API (no sockets inside).
    pub fn app(&self) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/generate", post(generate))
            .route("/tokenize", post(tokenize))
            .route("/v1/models", get(models))
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/metrics", get(metrics))
            .route("/reset_prefix_cache", post(reset_prefix_cache))
            .with_state(self.clone())
    }
}

/// A prompt as OpenAI completions accept it: text, token ids, or a one-element batch of either.
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    TextBatch(Vec<String>),
    IdsBatch(Vec<Vec<u32>>),
}

impl Prompt {
    async fn into_tokens(self, engine: &Engine) -> Result<Vec<u32>, EngineError> {
        match self {
            Prompt::Text(t) => encode_text(engine, TextInput::Prompt(t)).await,
            Prompt::Ids(ids) => Ok(ids),
            Prompt::TextBatch(mut v) if v.len() == 1 => {
                encode_text(engine, TextInput::Prompt(v.remove(0))).await
            }
            Prompt::IdsBatch(mut v) if v.len() == 1 => Ok(v.remove(0)),
            _ => Err(EngineError::BadRequest(
                "batched prompts are not supported".into(),
            )),
        }
    }
}

/// Text to tokenize: a prompt, or chat messages through the template.
enum TextInput {
    Prompt(String),
    Chat {
        messages: Value,
        add_generation_prompt: bool,
    },
}

/// Ids of `input` with the engine's tokenizer. A real tokenizer runs on the blocking pool: a
/// long prompt is milliseconds of CPU the runtime's threads must not spend.
async fn encode_text(engine: &Engine, input: TextInput) -> Result<Vec<u32>, EngineError> {
    let tokenizer = engine.inner.cfg.tokenizer.clone();
    let run = move || match input {
        TextInput::Prompt(text) => tokenizer.encode(&text),
        TextInput::Chat {
            messages,
            add_generation_prompt,
        } => tokenizer.encode_chat(&messages, add_generation_prompt),
    };
    let result = if engine.inner.cfg.tokenizer.is_real() {
        tokio::task::spawn_blocking(run)
            .await
            .map_err(|e| EngineError::BadRequest(format!("tokenizer: {e}")))?
    } else {
        run()
    };
    result.map_err(|e| EngineError::BadRequest(e.to_string()))
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: Prompt,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
}

/// OpenAI chat completions (the fields the simulator uses; others are ignored).
#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Value,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    /// vLLM's extra parameter; true by default.
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

#[derive(Deserialize)]
struct GenerateRequest {
    #[serde(default)]
    input_ids: Option<Vec<u32>>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    sampling_params: Option<SamplingParams>,
    #[serde(default)]
    stream: bool,
}

#[derive(Deserialize, Default)]
struct SamplingParams {
    #[serde(default)]
    max_new_tokens: Option<usize>,
}

/// vLLM's `/tokenize`: a prompt, or chat messages.
#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

fn requested_rank(headers: &HeaderMap) -> Option<u32> {
    headers
        .get(HEADER_REQUEST_DP_RANK)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse().ok())
}

fn output_token(id: u64, i: usize) -> u32 {
    ((id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 40)
        as u32
        % tokenizer::VOCAB_SIZE
}

fn sim_headers(engine: &Engine, run: &Running, resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(
        HEADER_CACHED_TOKENS,
        HeaderValue::from(run.cached_tokens as u64),
    );
    if let Ok(v) = HeaderValue::from_str(&engine.inner.cfg.name) {
        h.insert(HEADER_ENGINE, v);
    }
    h.insert(HEADER_DP_RANK, HeaderValue::from(run.rank));
    h.insert(
        HEADER_MODEL_TTFT_US,
        HeaderValue::from(run.model_ttft().as_micros() as u64),
    );
}

/// Streams `chunk(i, tokens)` SSE events: the first at `first_token_at`, then one per
/// `stream_interval_tokens` tokens, then `data: [DONE]`. The `Running` handle lives in the
/// stream, so the blocks are freed when it ends or the client goes away.
fn sse_stream<F>(engine: Engine, run: Running, chunk: F) -> Body
where
    F: Fn(usize, &[u32], bool) -> Value + Send + 'static,
{
    let interval = engine.inner.cfg.stream_interval_tokens.max(1);
    let id = engine.next_id();
    let total = run.output_tokens;
    struct St<F> {
        run: Option<Running>,
        sent: usize,
        chunk: F,
        done: bool,
    }
    let st = St {
        run: Some(run),
        sent: 0,
        chunk,
        done: false,
    };
    let stream = futures_util::stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        if st.sent >= total {
            st.done = true;
            st.run.take();
            return Some((
                Ok::<_, Infallible>(Bytes::from_static(b"data: [DONE]\n\n")),
                st,
            ));
        }
        let n = if st.sent == 0 {
            1
        } else {
            interval.min(total - st.sent)
        };
        if let Some(run) = st.run.as_mut() {
            run.wait_tokens(st.sent + n).await;
        }
        let toks: Vec<u32> = (st.sent..st.sent + n)
            .map(|i| output_token(id, i))
            .collect();
        st.sent += n;
        let last = st.sent >= total;
        let v = (st.chunk)(st.sent, &toks, last);
        let mut line = Vec::with_capacity(64);
        line.extend_from_slice(b"data: ");
        line.extend_from_slice(v.to_string().as_bytes());
        line.extend_from_slice(b"\n\n");
        Some((Ok(Bytes::from(line)), st))
    });
    Body::from_stream(stream)
}

/// A streaming response: the simulator's headers, then [`sse_stream`]'s events.
fn sse_response<F>(engine: &Engine, run: Running, chunk: F) -> Response
where
    F: Fn(usize, &[u32], bool) -> Value + Send + 'static,
{
    let mut resp = Response::new(Body::empty());
    sim_headers(engine, &run, &mut resp);
    *resp.body_mut() = sse_stream(engine.clone(), run, chunk);
    let h = resp.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    resp
}

/// OpenAI's `usage` object, with vLLM's cached-token detail.
fn usage(prompt_tokens: usize, completion_tokens: usize, cached: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Waits for every token of a non-streaming request.
async fn run_to_end(run: &mut Running) -> Vec<u32> {
    run.wait_tokens(run.output_tokens).await;
    let id = run.id();
    (0..run.output_tokens)
        .map(|i| output_token(id, i))
        .collect()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn completions(
    State(engine): State<Engine>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, EngineError> {
    let req: CompletionRequest =
        serde_json::from_slice(&body).map_err(|e| EngineError::BadRequest(e.to_string()))?;
    let prompt = req.prompt.into_tokens(&engine).await?;
    let prompt_len = prompt.len();
    let model = req.model.unwrap_or_else(|| engine.inner.cfg.model.clone());
    let mut run = engine
        .submit(
            prompt,
            req.max_tokens.unwrap_or(16),
            requested_rank(&headers),
        )
        .await?;
    let id = format!("cmpl-{}-{}", engine.inner.cfg.name, engine.next_id());
    let created = now_secs();
    let cached = run.cached_tokens;
    let fingerprint = engine.inner.cfg.name.clone();
    if req.stream {
        let out_total = run.output_tokens;
        return Ok(sse_response(&engine, run, move |_sent, toks, last| {
            json!({
                "id": id, "object": "text_completion", "created": created, "model": model, "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "text": format!(" {}", tokenizer::decode(toks)), "logprobs": null,
                             "finish_reason": if last { Value::from("length") } else { Value::Null }}],
                "usage": if last { usage(prompt_len, out_total, cached) } else { Value::Null },
            })
        }));
    }
    let toks = run_to_end(&mut run).await;
    let out = toks.len();
    let mut resp = Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model, "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "text": format!(" {}", tokenizer::decode(&toks)), "logprobs": null, "finish_reason": "length"}],
        "usage": usage(prompt_len, out, cached),
    }))
    .into_response();
    sim_headers(&engine, &run, &mut resp);
    Ok(resp)
}

async fn chat_completions(
    State(engine): State<Engine>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, EngineError> {
    let req: ChatRequest =
        serde_json::from_slice(&body).map_err(|e| EngineError::BadRequest(e.to_string()))?;
    let prompt = encode_text(
        &engine,
        TextInput::Chat {
            messages: req.messages,
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
        },
    )
    .await?;
    let prompt_len = prompt.len();
    let model = req.model.unwrap_or_else(|| engine.inner.cfg.model.clone());
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(16);
    let mut run = engine
        .submit(prompt, max_tokens, requested_rank(&headers))
        .await?;
    let id = format!("chatcmpl-{}-{}", engine.inner.cfg.name, engine.next_id());
    let created = now_secs();
    let cached = run.cached_tokens;
    let fingerprint = engine.inner.cfg.name.clone();
    if req.stream {
        let out_total = run.output_tokens;
        return Ok(sse_response(&engine, run, move |sent, toks, last| {
            // The first chunk carries the role, as OpenAI's and vLLM's do.
            let delta = if sent == toks.len() {
                json!({"role": "assistant", "content": format!(" {}", tokenizer::decode(toks))})
            } else {
                json!({"content": format!(" {}", tokenizer::decode(toks))})
            };
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model, "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "delta": delta, "logprobs": null,
                             "finish_reason": if last { Value::from("length") } else { Value::Null }}],
                "usage": if last { usage(prompt_len, out_total, cached) } else { Value::Null },
            })
        }));
    }
    let toks = run_to_end(&mut run).await;
    let out = toks.len();
    let mut resp = Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!(" {}", tokenizer::decode(&toks))},
                     "logprobs": null, "finish_reason": "length"}],
        "usage": usage(prompt_len, out, cached),
    }))
    .into_response();
    sim_headers(&engine, &run, &mut resp);
    Ok(resp)
}

async fn generate(
    State(engine): State<Engine>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, EngineError> {
    let req: GenerateRequest =
        serde_json::from_slice(&body).map_err(|e| EngineError::BadRequest(e.to_string()))?;
    let prompt = match (req.input_ids, req.text) {
        (Some(ids), _) => ids,
        (None, Some(text)) => encode_text(&engine, TextInput::Prompt(text)).await?,
        (None, None) => return Err(EngineError::BadRequest("input_ids or text required".into())),
    };
    let prompt_len = prompt.len();
    let max_new = req
        .sampling_params
        .unwrap_or_default()
        .max_new_tokens
        .unwrap_or(128);
    let mut run = engine
        .submit(prompt, max_new, requested_rank(&headers))
        .await?;
    let rid = format!("{}-{}", engine.inner.cfg.name, engine.next_id());
    let engine_name = engine.inner.cfg.name.clone();
    let cached = run.cached_tokens;
    if req.stream {
        let mut resp = Response::new(Body::empty());
        sim_headers(&engine, &run, &mut resp);
        let body = sse_stream(engine.clone(), run, move |sent, toks, last| {
            json!({
                "text": format!(" {}", tokenizer::decode(toks)), "output_ids": toks,
                "meta_info": {"id": rid, "prompt_tokens": prompt_len, "completion_tokens": sent, "cached_tokens": cached, "engine": engine_name,
                              "finish_reason": if last { json!({"type": "length", "length": sent}) } else { Value::Null }},
            })
        });
        *resp.body_mut() = body;
        resp.headers_mut().insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        return Ok(resp);
    }
    let toks = run_to_end(&mut run).await;
    let n = toks.len();
    let mut resp = Json(json!({
        "text": format!(" {}", tokenizer::decode(&toks)), "output_ids": toks,
        "meta_info": {"id": rid, "prompt_tokens": prompt_len, "completion_tokens": n, "cached_tokens": cached,
                      "finish_reason": {"type": "length", "length": n}},
    }))
    .into_response();
    sim_headers(&engine, &run, &mut resp);
    Ok(resp)
}

async fn tokenize(State(engine): State<Engine>, body: Bytes) -> Result<Response, EngineError> {
    let req: TokenizeRequest =
        serde_json::from_slice(&body).map_err(|e| EngineError::BadRequest(e.to_string()))?;
    let input = match (req.prompt, req.messages) {
        (Some(_), Some(_)) => {
            return Err(EngineError::BadRequest(
                "give prompt or messages, not both".into(),
            ))
        }
        (_, Some(messages)) => TextInput::Chat {
            messages,
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
        },
        (prompt, None) => TextInput::Prompt(prompt.unwrap_or_default()),
    };
    let tokens = encode_text(&engine, input).await?;
    Ok(Json(json!({"count": tokens.len(), "max_model_len": engine.inner.cfg.max_model_len, "tokens": tokens, "token_strs": null}))
        .into_response())
}

async fn models(State(engine): State<Engine>) -> Json<Value> {
    let cfg = &engine.inner.cfg;
    Json(
        json!({"object": "list", "data": [{"id": cfg.model, "object": "model", "created": now_secs(),
        "owned_by": "kvroute-sim", "root": cfg.model, "parent": null, "max_model_len": cfg.max_model_len}]}),
    )
}

async fn reset_prefix_cache(State(engine): State<Engine>) -> StatusCode {
    if engine.reset_prefix_cache() {
        StatusCode::OK
    } else {
        StatusCode::CONFLICT
    }
}

/// Prometheus text in vLLM's metric names, one series per dp rank (`engine` label); an engine
/// publishing SGLang events serves SGLang's queue and cache gauges instead (`dp_rank` label), as
/// a real SGLang server would, with its `sglang:cache_hit_rate`. The counters keep vLLM's names,
/// which the benchmarks read. vLLM engines also serve `vllm:cache_config_info` (block size).
fn render_metrics(engine: &Engine) -> String {
    use std::fmt::Write;
    let cfg = &engine.inner.cfg;
    let stats: Vec<RankStats> = (0..engine.dp_size()).map(|r| engine.stats(r)).collect();
    let sglang = cfg.event_format.is_sglang();
    let mut out = String::new();
    let mut info = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(&RankStats) -> String| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        // SGLang labels its series by dp rank, vLLM by engine index.
        let label = if name.starts_with("sglang:") {
            "dp_rank"
        } else {
            "engine"
        };
        for (r, s) in stats.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}{{{label}=\"{r}\",model_name=\"{}\"}} {}",
                cfg.model,
                value(s)
            );
        }
    };
    let (running, waiting, kv_usage) = if sglang {
        (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
        )
    } else {
        (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        )
    };
    family(
        running,
        "gauge",
        "Number of requests in model execution batches.",
        &|s| s.running.to_string(),
    );
    family(
        waiting,
        "gauge",
        "Number of requests waiting to be processed.",
        &|s| s.waiting.to_string(),
    );
    family(
        kv_usage,
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|s| format!("{:.6}", s.kv_usage),
    );
    family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|s| s.prefix_queries_tokens.to_string(),
    );
    family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|s| s.prefix_hits_tokens.to_string(),
    );
    family(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &|s| s.prompt_tokens.to_string(),
    );
    family(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &|s| s.generation_tokens.to_string(),
    );
    family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &|s| s.requests_finished.to_string(),
    );
    family(
        "kvroute_sim:cached_blocks",
        "gauge",
        "Blocks in the prefix cache.",
        &|s| s.cached_blocks.to_string(),
    );
    if sglang {
        // SGLang's only reuse figure: a gauge, the share of the prompt tokens of recent
        // requests that were cached (here since start, from the same counters).
        family(
            "sglang:cache_hit_rate",
            "gauge",
            "The prefix cache hit rate.",
            &|s| {
                let rate = if s.prefix_queries_tokens == 0 {
                    0.0
                } else {
                    s.prefix_hits_tokens as f64 / s.prefix_queries_tokens as f64
                };
                format!("{rate:.6}")
            },
        );
    } else {
        // vLLM's cache config as an info gauge (value 1), one series per engine index, with
        // the labels a router checks its registration against and sizes its index by.
        let _ = writeln!(
            info,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge"
        );
        for r in 0..stats.len() {
            let _ = writeln!(
                info,
                "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"{r}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"}} 1.0",
                cfg.cache.block_size_tokens, cfg.cache.capacity_blocks
            );
        }
    }
    if cfg.engine_model == EngineModel::Stepped {
        family(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            &|s| s.preemptions.to_string(),
        );
    }
    out.push_str(&info);
    out
}

async fn metrics(State(engine): State<Engine>) -> Response {
    let mut resp = render_metrics(&engine).into_response();
    resp.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}
