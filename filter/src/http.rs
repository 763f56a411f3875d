//! The HTTP context: intake, decision, output, load release. Text requests (no token ids)
//! take the path of `http/text.rs`.

mod remote;
mod resolve;
mod text;

use std::borrow::Cow;
use std::rc::Rc;

use kvroute::hash;
use kvroute::intake::{self, Found, IntakeError};
use kvroute::lookup::{longest_matches, WalkStats};
use kvroute::mirror::{self, depth_keys, BucketView, PrefixView};
use kvroute::router::{self, Booked, Field, Picture, Verdict};
use kvroute::scope::ScopeId;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::books;
use crate::config::{millis, Config, Mode, DECODE_FIELDS};
use crate::headers::Headers;
use crate::host::{self, HostStore};
use crate::outcome::Outcome;
use crate::text_config::{MESSAGES_FIELD, PROMPT_FIELD};
use crate::timing::{Phase as Timed, Stopwatch};
use crate::vm::{Scratch, VmRef};

/// The destination header when no configuration is loaded.
const DEFAULT_DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Headers,
    WaitingBody,
    WaitingCallout,
    Done,
}

/// A value being resolved through its sources: `Pending(i)` waits for the body at source `i`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Res<T> {
    Pending(usize),
    Done(Option<T>),
}

/// Where the tokens are: a header / metadata value parsed into `Scratch::str_tokens`, or a
/// range of `Scratch::body_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tok {
    Str,
    Body(usize, usize),
}

struct BodyCtx<'a> {
    bytes: &'a [u8],
    found: &'a [Found],
}

/// A request's text, as found in its body.
#[derive(Clone, Copy, Debug)]
enum Text<'a> {
    /// A completions prompt: the raw bytes between the quotes, with escapes or not, and the
    /// whole JSON string (quotes included), passed on verbatim to the collector.
    Prompt {
        raw: &'a [u8],
        escaped: bool,
        json: &'a [u8],
    },
    /// Chat messages: the array's raw JSON.
    Messages { json: &'a [u8] },
}

impl<'a> BodyCtx<'a> {
    /// The body's text: its `prompt` string, else its `messages` array.
    fn text(&self, cfg: &Config) -> Option<Text<'a>> {
        let (bytes, found) = (self.bytes, self.found);
        let field = |name| cfg.body_field(name).and_then(|i| found.get(i));
        if let Some(Found::Str {
            start,
            end,
            escaped,
        }) = field(PROMPT_FIELD)
        {
            return Some(Text::Prompt {
                raw: bytes.get(*start..*end)?,
                escaped: *escaped,
                json: bytes.get(start.checked_sub(1)?..end + 1)?,
            });
        }
        match field(MESSAGES_FIELD) {
            Some(Found::Raw { start, end }) => Some(Text::Messages {
                json: bytes.get(*start..*end)?,
            }),
            _ => None,
        }
    }
}

/// Which text path decided a request (shown in the debug header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TextPath {
    Exact,
    Approx,
}

impl TextPath {
    fn as_str(self) -> &'static str {
        match self {
            TextPath::Exact => "exact",
            TextPath::Approx => "approx",
        }
    }
}

/// A text request's scope, kept while its `/query` callout is out.
#[derive(Clone, Debug, Default)]
struct TextScope {
    served: String,
    tenant: String,
    salt: Option<String>,
}

pub(crate) struct Http {
    vm: Option<VmRef>,
    cfg: Option<Rc<Config>>,
    id: u32,
    phase: Phase,
    body_possible: bool,
    wrong_content_type: bool,
    tokens: Res<Tok>,
    model: Res<String>,
    tenant: Res<String>,
    salt: Res<String>,
    outcome: Option<Outcome>,
    /// Load taken at routing: prefill released at the first response bytes, the rest in
    /// `on_log` (both at once when the first bytes end the response).
    routed: Option<Booked>,
    /// The booking was released (its request's timings are complete).
    released: bool,
    /// The routed response's content-length, when it has one.
    response_length: Option<u64>,
    /// The decision saw no prefill ahead on the chosen engine (a rate sample when booked).
    engine_idle: bool,
    /// The body's `max_completion_tokens` / `max_tokens`, when it has one.
    decode_budget: Option<u64>,
    callout: Option<u32>,
    query_tokens: u32,
    matched_tokens: u32,
    reads: u32,
    /// A text request: its scope, chain hashes, and the path that decided it.
    text: Option<TextScope>,
    text_hashes: Vec<kvroute::approx::TextHash>,
    text_path: Option<TextPath>,
    /// The decision in short for the debug header (winner, its cost, the runner-up and its
    /// cost), kept only when the header is configured.
    explained: Option<String>,
    /// Per-phase times of this request (timing mode only, `crate::timing`).
    clock: Stopwatch,
    /// The request's headers, read whole once, until the decision (`None`: read one by one).
    headers: Option<Headers>,
}

impl Http {
    pub fn new(vm: VmRef, id: u32) -> Http {
        Http {
            vm: Some(vm),
            phase: Phase::Headers,
            tokens: Res::Pending(0),
            model: Res::Pending(0),
            tenant: Res::Pending(0),
            salt: Res::Pending(0),
            ..Http::new_empty(id)
        }
    }

    pub fn passthrough(id: u32) -> Http {
        let mut h = Http::new_empty(id);
        h.phase = Phase::Done;
        h
    }

    fn new_empty(id: u32) -> Http {
        Http {
            vm: None,
            cfg: None,
            id,
            phase: Phase::Done,
            body_possible: false,
            wrong_content_type: false,
            tokens: Res::Done(None),
            model: Res::Done(None),
            tenant: Res::Done(None),
            salt: Res::Done(None),
            outcome: None,
            routed: None,
            released: false,
            response_length: None,
            engine_idle: false,
            decode_budget: None,
            callout: None,
            query_tokens: 0,
            matched_tokens: 0,
            reads: 0,
            text: None,
            text_hashes: Vec::new(),
            text_path: None,
            explained: None,
            clock: Stopwatch::default(),
            headers: None,
        }
    }

    /// A request header, from the map read whole when there is one.
    fn request_header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        match &self.headers {
            Some(h) => h.get(name).map(Cow::Borrowed),
            None => host::get_header(MapType::HttpRequestHeaders, name).map(Cow::Owned),
        }
    }

    fn finish(&mut self, vm: &VmRef, outcome: Outcome) {
        self.phase = Phase::Done;
        self.headers = None;
        self.outcome = Some(outcome);
        vm.timing.flush(&mut self.clock);
        vm.metrics.count(outcome);
        log::debug!("kvroute[{}]: {}", self.id, outcome.as_str());
    }

    /// Everything is known: decide and write the headers. Returns the action for the
    /// current callback.
    fn decide(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        scratch: &mut Scratch,
        body: Option<&BodyCtx<'_>>,
    ) -> Action {
        let tokens: &[u32] = match self.tokens {
            Res::Done(Some(Tok::Str)) => &scratch.str_tokens,
            Res::Done(Some(Tok::Body(s, e))) => scratch.body_tokens.get(s..e).unwrap_or_default(),
            _ => &[],
        };
        let text = body
            .filter(|_| tokens.is_empty() && cfg.text.enabled())
            .and_then(|b| b.text(cfg));
        if let Some(text) = text {
            let Res::Done(Some(served)) = self.model.clone() else {
                self.finish(vm, Outcome::NoModel);
                return Action::Continue;
            };
            let scope = TextScope {
                served,
                tenant: match &self.tenant {
                    Res::Done(Some(t)) => t.clone(),
                    _ => kvroute::scope::DEFAULT_TENANT.to_owned(),
                },
                salt: match &self.salt {
                    Res::Done(s) => s.clone(),
                    _ => None,
                },
            };
            return self.decide_text(vm, cfg, scratch, text, scope);
        }
        if tokens.is_empty() {
            let o = if self.wrong_content_type {
                Outcome::BadBody
            } else {
                Outcome::NoTokens
            };
            self.finish(vm, o);
            return Action::Continue;
        }
        let Res::Done(Some(served)) = self.model.clone() else {
            self.finish(vm, Outcome::NoModel);
            return Action::Continue;
        };
        let tenant = match &self.tenant {
            Res::Done(Some(t)) => t.clone(),
            _ => kvroute::scope::DEFAULT_TENANT.to_owned(),
        };
        let salt = match &self.salt {
            Res::Done(s) => s.clone(),
            _ => None,
        };
        self.query_tokens = tokens.len().min(u32::MAX as usize) as u32;
        match cfg.mode {
            Mode::Local => self.decide_local(vm, cfg, scratch, &served, &tenant, salt.as_deref()),
            Mode::Remote => self.call_remote(vm, cfg, scratch, &served, &tenant, salt.as_deref()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn decide_local(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        scratch: &mut Scratch,
        served: &str,
        tenant: &str,
        salt: Option<&str>,
    ) -> Action {
        let store = HostStore;
        let now = host::now_ms();
        let state = match vm.state(now) {
            Ok(s) if !s.is_stale(now, millis(cfg.stale_after)) => s,
            _ => {
                self.finish(vm, Outcome::StaleIndex);
                return Action::Continue;
            }
        };
        let Ok(mut cache_guard) = vm.cache.try_borrow_mut() else {
            self.finish(vm, Outcome::NoMatch);
            return Action::Continue;
        };
        cache_guard.refresh(&store, &vm.keys, &state);
        let cache = &mut *cache_guard;
        let (model, lora) = cache.meta.resolve(tenant, served);
        let Some(block_size) = cache.meta.block_size(tenant, model) else {
            crate::report::note_no_model(served);
            self.finish(vm, Outcome::NoMatch);
            return Action::Continue;
        };
        let seed = hash::seed(lora, salt);
        let scope = ScopeId::of(tenant, model, lora, salt);
        vm.timing.lap(&mut self.clock, Timed::State);
        let Scratch {
            body_tokens,
            str_tokens,
            seqs,
            depths,
            ..
        } = scratch;
        let tokens: &[u32] = match self.tokens {
            Res::Done(Some(Tok::Str)) => str_tokens,
            Res::Done(Some(Tok::Body(s, e))) => body_tokens.get(s..e).unwrap_or_default(),
            _ => &[],
        };
        // Buckets this VM read under the same sync state are not read again; the cache is
        // lent to the view and put back below.
        let mut buckets = std::mem::take(&mut cache.buckets);
        // Sequence hashes are computed lazily, as deep as the bisection looks, and block
        // keys only for the depths it reads (see `PrefixView`).
        let view = PrefixView::new(
            BucketView::with_cache(
                &store,
                &vm.keys,
                &state,
                cfg.limits.buckets_log2,
                &mut buckets,
            ),
            tokens,
            block_size as usize,
            seed,
            scope,
            std::mem::take(seqs),
        );
        let query_blocks = view.blocks();
        // Timing mode hashes the whole prompt here, so that hashing and the bisection are
        // timed apart (the state and meta reads above are the `state` phase).
        vm.timing.lap(&mut self.clock, Timed::Lookup);
        if vm.timing.on() {
            if let Some(last) = query_blocks.checked_sub(1) {
                let _ = view.key_at(mirror::Depth(last as u32));
            }
            vm.timing.lap(&mut self.clock, Timed::Hash);
        }
        depth_keys(query_blocks, depths);
        let mut stats = WalkStats::default();
        let mut matches = if query_blocks == 0 {
            Vec::new()
        } else {
            longest_matches(&view, depths, &mut stats)
        };
        let spec = !cfg.speculative_ttl.is_zero() && query_blocks > 0;
        let spec_read = if spec {
            books::speculative_matches(vm, &view, query_blocks as u32, now, &mut matches)
        } else {
            None
        };
        vm.timing.lap(&mut self.clock, Timed::Lookup);
        let picture = books::picture(vm, cfg, now);
        let query = router::Query {
            blocks: query_blocks as u32,
            block_size,
        };
        let field = Field::Roster {
            roster: &cache.roster,
            matches: &matches,
            tenant,
            model,
        };
        let verdict = match vm.rng.try_borrow_mut() {
            Ok(mut rng) => router::route(field, query, &picture, &cfg.policy, &mut *rng).verdict,
            Err(_) => Verdict::NoMatch,
        };
        drop(cache_guard);
        vm.timing.lap(&mut self.clock, Timed::Decision);
        if let (true, Verdict::Route { target, .. }) = (spec, &verdict) {
            if let Some(slot) = target.slot() {
                books::remember(vm, cfg, &view, spec_read, query_blocks as u32, slot, now);
            }
        }
        vm.timing.lap(&mut self.clock, Timed::Books);
        let reads = view.reads();
        *seqs = view.into_seqs();
        if let Ok(mut cache) = vm.cache.try_borrow_mut() {
            cache.buckets = buckets;
        }
        self.reads = reads + 2;
        host::record_metric(vm.metrics.lookup_reads, reads as u64);
        self.conclude(vm, cfg, picture, verdict, block_size);
        Action::Continue
    }

    /// Acts on the decision: the headers and the books of a routed request, else the
    /// outcome that says why not.
    fn conclude(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        picture: Picture,
        verdict: Verdict,
        block_size: u32,
    ) {
        let (decision, target) = match verdict {
            Verdict::Route { decision, target } => (decision, target),
            Verdict::Deferred => return self.finish(vm, Outcome::Deferred),
            Verdict::NoMatch => return self.finish(vm, Outcome::NoMatch),
        };
        self.engine_idle = decision.queued_prefill_tokens == 0;
        if cfg.debug_header.is_some() {
            self.explained = Some(router::summary(&decision, &target));
        }
        let matched_blocks = decision.matched_blocks;
        let best = target.address.as_str();
        let value = match &target.runner_up {
            Some(r) => format!("{best},{r}"),
            None => best.to_owned(),
        };
        host::set_header(
            MapType::HttpRequestHeaders,
            &cfg.destination_header,
            value.as_bytes(),
        );
        if let Some(rank) = target.dp_rank {
            host::set_header(
                MapType::HttpRequestHeaders,
                &cfg.dp_rank_header,
                rank.to_string().as_bytes(),
            );
        }
        #[cfg(feature = "higress")]
        host::set_upstream_override_host(best);
        vm.timing.lap(&mut self.clock, Timed::HeaderSet);
        let matched =
            (matched_blocks as u64 * block_size as u64).min(self.query_tokens as u64) as u32;
        self.matched_tokens = matched;
        books::note_routed(target.load_id, self.query_tokens, matched);
        let prefill = self.query_tokens - matched;
        let decode = self
            .decode_budget
            .unwrap_or(cfg.default_decode_tokens.into())
            .min(u32::MAX.into()) as u32;
        self.routed = books::book(
            vm,
            cfg,
            picture,
            target.load_id,
            prefill,
            decode,
            self.engine_idle,
        );
        vm.timing.lap(&mut self.clock, Timed::Books);
        if self.query_tokens > 0 {
            host::record_metric(
                vm.metrics.matched_ratio_pct,
                matched as u64 * 100 / self.query_tokens as u64,
            );
        }
        self.finish(
            vm,
            if matched_blocks == 0 {
                Outcome::RoutedCold
            } else {
                Outcome::Routed
            },
        );
    }

    fn config(&self) -> Option<(VmRef, Rc<Config>)> {
        Some((self.vm.clone()?, self.cfg.clone()?))
    }
}

fn is_json(content_type: &[u8]) -> bool {
    let ct = content_type.to_ascii_lowercase();
    ct.windows(4).any(|w| w == b"json")
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if self.callout != Some(token_id) || self.phase != Phase::WaitingCallout {
            return;
        }
        self.callout = None;
        if let Some((vm, cfg)) = self.config() {
            vm.timing.restart(&mut self.clock);
            if self.text.is_some() {
                self.on_text_answer(&vm, &cfg, num_headers, body_size);
            } else {
                self.on_query_response(&vm, &cfg, num_headers, body_size);
            }
        }
        self.phase = Phase::Done;
        host::resume_request();
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            // No configuration (yet): still never let a client choose the upstream.
            host::remove_header(MapType::HttpRequestHeaders, DEFAULT_DESTINATION_HEADER);
            return Action::Continue;
        };
        self.clock = vm.timing.start();
        let cfg = crate::rules::select_config(&vm);
        self.cfg = Some(cfg.clone());
        if cfg!(feature = "bench-floor") {
            host::remove_header(MapType::HttpRequestHeaders, &cfg.destination_header);
            self.phase = Phase::WaitingBody;
            return if end_of_stream {
                Action::Continue
            } else {
                Action::Pause
            };
        }
        // One host call for every header this request asks about.
        self.headers = host::get_headers(MapType::HttpRequestHeaders);
        // Never let a client choose the upstream, routed or not. A map read whole shows
        // whether the client sent the header; unread, it is removed blind.
        if self
            .headers
            .as_ref()
            .is_none_or(|h| h.contains(&cfg.destination_header))
        {
            host::remove_header(MapType::HttpRequestHeaders, &cfg.destination_header);
        }
        if self.phase != Phase::Headers {
            self.headers = None;
            return Action::Continue;
        }
        let ct_ok = self
            .request_header("content-type")
            .is_none_or(|ct| is_json(&ct));
        let body_sources = cfg.needs_body() && !end_of_stream;
        self.body_possible = body_sources && ct_ok;
        self.wrong_content_type = body_sources && !ct_ok;
        let Ok(mut scratch) = vm.scratch.try_borrow_mut() else {
            return Action::Continue;
        };
        let resolved = self.resolve(None, &cfg, &mut scratch);
        vm.timing.lap(&mut self.clock, Timed::HeaderIntake);
        // Timing mode only: the price of single host calls, apart from every phase.
        vm.timing.probe(&mut self.clock, vm.keys.active());
        match resolved {
            Err(o) => {
                self.finish(&vm, o);
                Action::Continue
            }
            Ok(true) => {
                let too_large = self
                    .request_header("content-length")
                    .and_then(|v| {
                        std::str::from_utf8(&v)
                            .ok()
                            .and_then(|s| s.trim().parse::<u64>().ok())
                    })
                    .is_some_and(|n| n > cfg.max_body_bytes);
                if too_large {
                    self.finish(&vm, Outcome::TooLarge);
                    return Action::Continue;
                }
                self.phase = Phase::WaitingBody;
                Action::Pause
            }
            Ok(false) => self.decide(&vm, &cfg, &mut scratch, None),
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.phase != Phase::WaitingBody {
            return if self.phase == Phase::WaitingCallout {
                Action::Pause
            } else {
                Action::Continue
            };
        }
        let Some((vm, cfg)) = self.config() else {
            return Action::Continue;
        };
        if body_size as u64 > cfg.max_body_bytes {
            self.finish(&vm, Outcome::TooLarge);
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.body_end(&vm, &cfg, body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.phase == Phase::WaitingCallout {
            return Action::Pause;
        }
        if self.phase != Phase::WaitingBody {
            return Action::Continue;
        }
        let Some((vm, cfg)) = self.config() else {
            return Action::Continue;
        };
        // Trailers end the body: everything buffered is the body.
        let size =
            host::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX).map_or(0, |b| b.len());
        if size as u64 > cfg.max_body_bytes {
            self.finish(&vm, Outcome::TooLarge);
            return Action::Continue;
        }
        self.body_end(&vm, &cfg, size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some(b) = self.routed.as_mut() {
            // Envoy's HTTP/1 codec ends a response with an empty last chunk, so a body that
            // arrives whole is known whole only by its length.
            self.response_length = host::get_header(MapType::HttpResponseHeaders, "content-length")
                .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse().ok());
            // The status is read only when the answer could teach the prefill rate: one host
            // call less on every other routed response.
            if b.may_teach_rate()
                && host::get_header(MapType::HttpResponseHeaders, ":status")
                    .is_none_or(|v| v.first() != Some(&b'2'))
            {
                b.answered_in_error();
            }
        }
        if let Some((_, cfg)) = self.config() {
            if let Some(name) = &cfg.debug_header {
                let outcome = self.outcome.map_or("none", Outcome::as_str);
                let mut v = format!(
                    "outcome={outcome}; matched_tokens={}; query_tokens={}; reads={}",
                    self.matched_tokens, self.query_tokens, self.reads
                );
                if let Some(p) = self.text_path {
                    v.push_str("; text=");
                    v.push_str(p.as_str());
                }
                if let Some(e) = &self.explained {
                    v.push_str("; ");
                    v.push_str(e);
                }
                host::set_header(MapType::HttpResponseHeaders, name, v.as_bytes());
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // The first response bytes mean the prefill is done (the first token is out). A
        // response whose first bytes are also its last (not streamed: the stream ends, or
        // its content-length has arrived) is released whole here: one write of the load
        // table instead of two.
        if let Some((vm, cfg)) = self.config() {
            if let Some(mut b) = self.routed.filter(|b| b.prefill_open) {
                vm.timing.restart(&mut self.clock);
                let whole =
                    end_of_stream || self.response_length.is_some_and(|n| body_size as u64 >= n);
                if whole {
                    books::release_whole(&vm, &cfg, b);
                    self.routed = None;
                    self.released = true;
                } else {
                    books::release_prefill(&vm, &cfg, &mut b);
                    self.routed = Some(b);
                }
                vm.timing.lap(&mut self.clock, Timed::Release);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some((vm, cfg)) = self.config() else {
            return;
        };
        if let Some(b) = self.routed.take() {
            vm.timing.restart(&mut self.clock);
            books::release(&vm, &cfg, b);
            vm.timing.lap(&mut self.clock, Timed::Release);
            self.released = true;
        }
        if self.released {
            vm.timing.flush(&mut self.clock);
        }
    }
}

impl Http {
    fn body_end(&mut self, vm: &VmRef, cfg: &Rc<Config>, size: usize) -> Action {
        // The time since the headers was spent waiting for the body, not running.
        vm.timing.restart(&mut self.clock);
        let body = host::get_buffer(BufferType::HttpRequestBody, 0, size).unwrap_or_default();
        vm.timing.lap(&mut self.clock, Timed::BodyCopy);
        if cfg!(feature = "bench-floor") {
            self.phase = Phase::Done;
            return Action::Continue;
        }
        let Ok(mut scratch) = vm.scratch.try_borrow_mut() else {
            return Action::Continue;
        };
        let scratch = &mut *scratch;
        scratch.found.clear();
        scratch.found.resize(cfg.body_fields.len(), Found::Absent);
        let max_tokens = (cfg.max_body_bytes as usize / 2).max(1);
        let scanned = intake::scan_json(
            &body,
            &cfg.body_fields,
            &mut scratch.body_tokens,
            &mut scratch.found,
            max_tokens,
        );
        let found = std::mem::take(&mut scratch.found);
        if scanned.is_ok() {
            self.decode_budget = DECODE_FIELDS.iter().find_map(|f| {
                match cfg.body_field(f).and_then(|i| found.get(i)) {
                    Some(Found::Uint(n)) => Some(*n),
                    _ => None,
                }
            });
        }
        let ctx = BodyCtx {
            bytes: &body,
            found: &found,
        };
        let result = match scanned {
            Ok(()) => self.resolve(Some(&ctx), cfg, scratch),
            Err(IntakeError::Empty) => {
                // No body after all: the remaining body sources have nothing.
                self.body_possible = false;
                self.resolve(None, cfg, scratch)
            }
            Err(e) => {
                log::debug!("kvroute[{}]: bad body: {e}", self.id);
                Err(Outcome::BadBody)
            }
        };
        vm.timing.lap(&mut self.clock, Timed::BodyIntake);
        let action = match result {
            Err(o) => {
                self.finish(vm, o);
                Action::Continue
            }
            Ok(_) => self.decide(vm, cfg, scratch, scanned.is_ok().then_some(&ctx)),
        };
        scratch.found = found;
        action
    }
}
