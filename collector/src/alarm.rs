//! Alarms for the failures that make no error: routing runs, and the cache hit rate is far
//! below what it should be (issue 21). Each alarm is a `kvroute_alarm{alarm, subject}` gauge
//! (1 raised, 0 clear), a "degraded" reason of `/health` (still HTTP 200), a banner on the
//! fleet page (which reads `/health`) and one `warn!` line when it is raised, one `info!`
//! when it clears: one log line per occurrence window, however often it is evaluated.
//!
//! Alarms are evaluated when `/health` or `/metrics` is read, not by a task of their own: a
//! collector nobody watches has nobody to alarm. Between two reads the state is what the last
//! read saw.
//!
//! # Alarms
//! - `engine_silent`: a registered engine that gateways report in-flight requests for, and
//!   that sent no KV event for `--alarm-silent-secs` of that traffic: it is routed with an
//!   empty cache (events off, a wrong endpoint, a firewall).
//! - `no_model`: a gateway's `no_model` count for a model name (the optional `no_model` map
//!   of its `POST /v1/load` report) grew within the last [`NO_MODEL_WINDOW`]: requests name a
//!   model no engine is registered for (an alias, a typo, the served name differs).
//! - `hash_mismatch`: the truth check ([`crate::truth`]) over its window: the tokens kvroute
//!   predicted as cached on an engine and the tokens the engine says it reused differ by more
//!   than `--hash-mismatch-factor` (above `--hash-mismatch-min-tokens`); or the engine's own
//!   block size (`vllm:cache_config_info`) is not the registered one. The reason names the
//!   likely causes ([`likely_causes`]), the evidence first.
//! - `gateway_stale`: a gateway that reported stopped for `--alarm-gateway-stale-secs` (until
//!   ten times that, when it is forgotten), or reports a feed lag that long. One restarted
//!   (a new id of its node reporting since, [`replaced`]) is forgotten at once instead.
//! - `gateway_mismatch`: a gateway's filter version or hashing contract is not the
//!   collector's (fields `version` and `contract` of its reports; absent fields are not
//!   judged).
//! - `text_approximate`: a gateway's text requests fall to approximate mode (its reported
//!   `text` counters: at least [`TEXT_MIN_APPROX`] approximate decisions within
//!   [`NO_MODEL_WINDOW`], a tenth of its text requests or more): no tokenizer for the model,
//!   or a slow or failing `/tokenize`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvroute::event::WorkerId;
use tracing::{info, warn};

/// Most subjects (workers) tracked for `engine_silent`; the worker table is bounded lower
/// (4096 slots), so this is never the binding limit. Over it, the oldest is forgotten.
const MAX_TRACKED: usize = 8192;
/// A `no_model` alarm stays raised this long after the count last grew.
pub const NO_MODEL_WINDOW: Duration = Duration::from_secs(60);
/// Longest model name kept from a report; longer ones are cut (at a char boundary).
const MAX_MODEL_BYTES: usize = 256;
/// Model names kept per report; the rest are ignored.
const MAX_MODELS_PER_REPORT: usize = 64;

/// Fewest approximate text decisions within the window for `text_approximate`.
pub const TEXT_MIN_APPROX: u64 = 10;
/// Longest version or contract string kept from a gateway's report, bytes.
const MAX_FACT_BYTES: usize = 64;
/// Most gateways remembered for the gateway alarms; over it the one silent longest goes.
const MAX_GATEWAYS: usize = 256;

/// Which alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum AlarmKind {
    /// An engine serves traffic and sends no KV events.
    EngineSilent,
    /// Requests name a model no engine is registered for.
    NoModel,
    /// kvroute's predicted reuse and the engine's reported reuse disagree.
    HashMismatch,
    /// A gateway stopped reporting, or its feed lags.
    GatewayStale,
    /// A gateway's filter version or hashing contract differs from the collector's.
    GatewayMismatch,
    /// A gateway's text requests fall to approximate mode.
    TextApproximate,
}

impl AlarmKind {
    /// Every alarm, in label order.
    pub const ALL: [AlarmKind; 6] = [
        AlarmKind::EngineSilent,
        AlarmKind::NoModel,
        AlarmKind::HashMismatch,
        AlarmKind::GatewayStale,
        AlarmKind::GatewayMismatch,
        AlarmKind::TextApproximate,
    ];

    /// The `alarm` label and the name `/health` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            AlarmKind::EngineSilent => "engine_silent",
            AlarmKind::NoModel => "no_model",
            AlarmKind::HashMismatch => "hash_mismatch",
            AlarmKind::GatewayStale => "gateway_stale",
            AlarmKind::GatewayMismatch => "gateway_mismatch",
            AlarmKind::TextApproximate => "text_approximate",
        }
    }
}

/// A likely cause of a `hash_mismatch`, as `/health` and `/v1/explain` name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Cause {
    /// The registered block size is not the engine's.
    BlockSize,
    /// The engine's prefix caching is off.
    PrefixCachingOff,
    /// Text requests tokenized (tokenizer or chat template) otherwise than the engine does.
    Tokenizer,
    /// Requests name the model otherwise than the engines' events do (an alias, a LoRA's
    /// served name mapped to the wrong base).
    ModelName,
    /// A LoRA adapter in requests or events the other side does not carry.
    Lora,
    /// A cache salt in requests or in the engine's blocks the other side does not carry.
    Salt,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::BlockSize => "block_size",
            Cause::PrefixCachingOff => "prefix_caching_off",
            Cause::Tokenizer => "tokenizer",
            Cause::ModelName => "model_name",
            Cause::Lora => "lora",
            Cause::Salt => "salt",
        }
    }

    /// One line on what to check.
    pub fn hint(self) -> &'static str {
        match self {
            Cause::BlockSize => "the registered block_size differs from the engine's --block-size",
            Cause::PrefixCachingOff => "the engine runs without --enable-prefix-caching",
            Cause::Tokenizer => "text requests are tokenized with another tokenizer or chat template than the engine's (--tokenizer MODEL=DIR)",
            Cause::ModelName => "requests name the model by another name than the registration's model_name (an alias, a LoRA's served name)",
            Cause::Lora => "a LoRA adapter in requests or in the engine's events that the other side does not carry",
            Cause::Salt => "a cache_salt in requests or in the engine's blocks that the other side does not carry",
        }
    }
}

/// One engine's truth-check reading with what the registry knows of it.
#[derive(Clone, Debug)]
pub struct TruthObservation {
    pub subject: String,
    pub tenant: String,
    pub model: String,
    /// The registration's block size.
    pub block_size: u32,
    /// The registration names a LoRA or a cache salt.
    pub lora: bool,
    pub salt: bool,
    pub reading: crate::truth::Reading,
}

/// The likely causes of a truth-check disagreement on `o`, the ones with evidence first:
/// `over` is kvroute predicting more reuse than the engine reports; `text_seen` says text
/// requests were decided recently; `no_model` that requests name unregistered models.
pub fn likely_causes(o: &TruthObservation, over: Option<bool>, text_seen: bool) -> Vec<Cause> {
    let r = &o.reading;
    if r.engine_block_size.is_some_and(|b| b != o.block_size) {
        return vec![Cause::BlockSize];
    }
    if r.prefix_caching == Some(false) {
        return vec![Cause::PrefixCachingOff];
    }
    let mut out = Vec::new();
    if text_seen {
        out.push(Cause::Tokenizer);
    }
    match over {
        // The engine reuses less than kvroute predicts: it keys blocks by something the
        // events do not show (a salt, an adapter), or requests land under the wrong scope.
        Some(true) => out.extend([Cause::Salt, Cause::Lora, Cause::ModelName]),
        // The engine reuses more: requests hash otherwise than the engine's blocks.
        _ => {
            if o.lora {
                out.push(Cause::Lora);
            }
            if o.salt {
                out.push(Cause::Salt);
            }
            out.extend([Cause::ModelName, Cause::Lora, Cause::Salt]);
            if r.engine_block_size.is_none() {
                out.push(Cause::BlockSize);
            }
        }
    }
    let mut seen = Vec::with_capacity(out.len());
    out.retain(|c| {
        let fresh = !seen.contains(c);
        seen.push(*c);
        fresh
    });
    out
}

/// What a gateway's reports say about itself (`POST /v1/load`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatewayFacts {
    /// Its filter's version (`None`: an older filter that does not say).
    pub version: Option<String>,
    /// Its hashing contract (`None`: not said).
    pub contract: Option<String>,
    /// How far behind the collector its feed is, ms.
    pub feed_lag_ms: Option<u64>,
    /// Its text counters, cumulative.
    pub text: Option<TextCounts>,
}

/// A gateway's text-path counters (the filter's `kvroute.text.*`), cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct TextCounts {
    #[serde(default)]
    pub exact: u64,
    #[serde(default)]
    pub approx: u64,
    #[serde(default)]
    pub no_tokenizer: u64,
    #[serde(default)]
    pub exact_errors: u64,
}

/// The collector's side of the gateway checks.
#[derive(Clone, Debug)]
pub struct Expected {
    pub version: String,
    pub contract: String,
    /// `gateway_stale` threshold.
    pub stale_after: Duration,
}

#[derive(Debug)]
struct GatewaySeen {
    /// When this collector first heard from it.
    first: Instant,
    /// Whether it was taken as another gateway's restart: it stands for that one only.
    successor: bool,
    last: Instant,
    facts: GatewayFacts,
    /// Text counters as of each report within the window, oldest first.
    text: std::collections::VecDeque<(Instant, TextCounts)>,
}

/// The inputs of one evaluation beyond the engines.
#[derive(Clone, Debug, Default)]
pub struct Extra {
    pub truth: Vec<TruthObservation>,
    pub truth_config: crate::truth::TruthConfig,
    pub expected: Option<Expected>,
}

/// One raised alarm.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Alarm {
    pub kind: AlarmKind,
    /// What it is about: `instance/dp` for an engine.
    pub subject: String,
    /// The `/health` line: what is wrong and the likely causes.
    pub reason: String,
    /// The likely causes by name, the evidence first (`block_size`, `model_name`, `lora`,
    /// `salt`, `tokenizer`, `events_off`, `filter_version`, ...).
    pub causes: Vec<&'static str>,
}

/// What one engine was last seen doing.
#[derive(Clone, Copy, Debug)]
struct Seen {
    events: u64,
    /// Since when it has been sent traffic without a KV event following.
    silent_since: Option<Instant>,
    /// When traffic for it was last seen (requests in flight, or newly routed ones).
    last_traffic: Option<Instant>,
    /// The gateways' cumulative prompt tokens routed to it, when they report them.
    routed: Option<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    /// By worker; bounded by [`MAX_TRACKED`], and workers gone are dropped at each evaluation.
    seen: HashMap<WorkerId, Seen>,
    /// The alarms raised at the last evaluation, by (kind, subject).
    raised: BTreeMap<(AlarmKind, String), Alarm>,
    /// By (gateway, model): the last count reported and when it last grew. Bounded by
    /// [`MAX_TRACKED`]: over it, new pairs are not tracked.
    no_model: HashMap<(String, String), (u64, Option<Instant>)>,
    /// By gateway id; bounded by [`MAX_GATEWAYS`].
    gateways: HashMap<String, GatewaySeen>,
}

/// The alarms' memory between evaluations.
#[derive(Debug, Default)]
pub struct Alarms {
    inner: Mutex<Inner>,
}

/// The inputs of one evaluation, read from the hub and the fleet.
#[derive(Clone, Debug)]
pub struct EngineObservation {
    pub worker: WorkerId,
    pub subject: String,
    /// Events applied since registration.
    pub events: u64,
    /// In-flight requests the gateways report for it.
    pub requests: u64,
    /// The prompt tokens gateways routed to it since the collector started (the truth
    /// check's counts; `None` when no gateway reports them).
    pub routed: Option<u64>,
}

impl Alarms {
    /// The alarms raised at the last evaluation, as `(kind, subject)`.
    pub fn raised_keys(&self) -> Vec<(AlarmKind, String)> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.raised.keys().cloned().collect()
    }

    /// Takes a gateway's cumulative `no_model` counts by model name, reported at `now`.
    pub fn note_no_model(&self, gateway: &str, counts: &BTreeMap<String, u64>, now: Instant) {
        if counts.is_empty() {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (model, &count) in counts.iter().take(MAX_MODELS_PER_REPORT) {
            let mut end = model.len().min(MAX_MODEL_BYTES);
            while !model.is_char_boundary(end) {
                end -= 1;
            }
            let key = (gateway.to_owned(), model[..end].to_owned());
            let len = inner.no_model.len();
            match inner.no_model.get_mut(&key) {
                Some((last, grew)) => {
                    if count > *last {
                        *grew = Some(now);
                    }
                    *last = count;
                }
                None if len < MAX_TRACKED => {
                    let grew = (count > 0).then_some(now);
                    inner.no_model.insert(key, (count, grew));
                }
                None => {}
            }
        }
    }

    /// Takes what a gateway's report says of itself, at `now`. Its version and contract are
    /// cut to [`MAX_FACT_BYTES`]: they end up in `/health` lines.
    pub fn note_gateway(&self, gateway: &str, mut facts: GatewayFacts, now: Instant) {
        for f in [&mut facts.version, &mut facts.contract]
            .into_iter()
            .flatten()
        {
            let mut end = f.len().min(MAX_FACT_BYTES);
            while !f.is_char_boundary(end) {
                end -= 1;
            }
            f.truncate(end);
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if !inner.gateways.contains_key(gateway) && inner.gateways.len() >= MAX_GATEWAYS {
            let oldest = inner
                .gateways
                .iter()
                .min_by_key(|(_, g)| g.last)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                inner.gateways.remove(&k);
            }
        }
        let g = inner
            .gateways
            .entry(gateway.to_owned())
            .or_insert_with(|| GatewaySeen {
                first: now,
                successor: false,
                last: now,
                facts: GatewayFacts::default(),
                text: Default::default(),
            });
        g.last = now;
        if let Some(t) = facts.text {
            // Keep one sample older than the window, to measure the whole window from.
            while g.text.len() >= 2
                && g.text
                    .get(1)
                    .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= NO_MODEL_WINDOW)
            {
                g.text.pop_front();
            }
            if g.text.len() >= 256 {
                g.text.pop_front();
            }
            g.text.push_back((now, t));
        }
        g.facts = facts;
    }

    /// Whether any gateway decided text requests within the window (a tokenizer is then a
    /// possible cause of a truth-check disagreement).
    pub fn text_seen(&self, now: Instant) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.gateways.values().any(|g| {
            let (first, last) = (g.text.front(), g.text.back());
            matches!((first, last), (Some((_, a)), Some((at, b)))
                if now.saturating_duration_since(*at) < NO_MODEL_WINDOW
                    && b.exact + b.approx > a.exact + a.approx)
        })
    }

    /// Evaluates `engines` at `now` against `silent_after`; returns the alarms raised, sorted,
    /// and logs each change.
    pub fn evaluate(
        &self,
        engines: &[EngineObservation],
        silent_after: Duration,
        now: Instant,
    ) -> Vec<Alarm> {
        self.evaluate_all(engines, silent_after, &Extra::default(), now)
    }

    /// [`Alarms::evaluate`] with every other alarm's inputs.
    pub fn evaluate_all(
        &self,
        engines: &[EngineObservation],
        silent_after: Duration,
        extra: &Extra,
        now: Instant,
    ) -> Vec<Alarm> {
        let text_seen = self.text_seen(now);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut raised = BTreeMap::new();
        let mut seen = HashMap::with_capacity(engines.len().min(MAX_TRACKED));
        for e in engines.iter().take(MAX_TRACKED) {
            let prev = inner.seen.get(&e.worker).copied();
            // Traffic: requests newly routed to it when the gateways say so (a decoding
            // engine stores no new prompt blocks, so in-flight requests alone are not a
            // reason to expect events), else requests in flight.
            let routed_grew = match (prev.and_then(|p| p.routed), e.routed) {
                (Some(a), Some(b)) => Some(b > a),
                (None, Some(b)) => Some(b > 0 && prev.is_some()),
                _ => None,
            };
            let traffic = routed_grew.unwrap_or(false) || e.requests > 0;
            let last_traffic = if traffic {
                Some(now)
            } else {
                prev.and_then(|p| p.last_traffic)
            };
            let silent_since = match prev {
                // An event came: the window closes (and opens again on traffic in the
                // fallback, where in-flight requests are all there is to go on).
                Some(p) if p.events != e.events => {
                    (routed_grew.is_none() && e.requests > 0).then_some(now)
                }
                // Without routed counts, the window lasts while requests are in flight.
                Some(_) if routed_grew.is_none() && e.requests == 0 => None,
                Some(p) => p
                    .silent_since
                    .or(routed_grew.unwrap_or(e.requests > 0).then_some(now)),
                None => (e.requests > 0).then_some(now),
            };
            seen.insert(
                e.worker,
                Seen {
                    events: e.events,
                    silent_since,
                    last_traffic,
                    routed: e.routed,
                },
            );
            let silent = silent_since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
            let recent = last_traffic.is_some_and(|t| {
                now.saturating_duration_since(t) < silent_after.max(Duration::from_secs(1))
            });
            if silent_since.is_some() && (e.requests > 0 || recent) && silent >= silent_after {
                let a = Alarm {
                    kind: AlarmKind::EngineSilent,
                    subject: e.subject.clone(),
                    reason: format!(
                        "engine_silent: {} is sent requests ({} in flight) and sent no KV event for {:.0} s; it is routed with an empty cache (KV events off? --kv-events-config, the registered endpoint, a firewall)",
                        e.subject,
                        e.requests,
                        silent.as_secs_f64()
                    ),
                    causes: vec!["events_off"],
                };
                raised.insert((a.kind, a.subject.clone()), a);
            }
        }
        let mut no_model: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for ((gateway, model), (_, grew)) in &inner.no_model {
            if grew.is_some_and(|t| now.saturating_duration_since(t) < NO_MODEL_WINDOW) {
                no_model.entry(model).or_default().push(gateway);
            }
        }
        for (model, mut gateways) in no_model {
            gateways.sort_unstable();
            let a = Alarm {
                kind: AlarmKind::NoModel,
                subject: model.to_owned(),
                reason: format!(
                    "no_model: requests for model {model:?} (gateways {}) found no engine registered for it in the last {} s (an alias or typo in requests, or engines registered under another model_name)",
                    gateways.join(", "),
                    NO_MODEL_WINDOW.as_secs()
                ),
                causes: vec!["model_name"],
            };
            raised.insert((a.kind, a.subject.clone()), a);
        }
        for o in &extra.truth {
            if let Some(a) = hash_mismatch(o, &extra.truth_config, text_seen) {
                raised.insert((a.kind, a.subject.clone()), a);
            }
        }
        if let Some(exp) = &extra.expected {
            let forget = exp.stale_after.saturating_mul(10);
            inner
                .gateways
                .retain(|_, g| now.saturating_duration_since(g.last) < forget);
            for (old, new) in replaced(&inner.gateways, exp.stale_after, now) {
                info!(gateway = %old, successor = %new, "gateway restarted: its old id is forgotten");
                inner.gateways.remove(&old);
                if let Some(g) = inner.gateways.get_mut(&new) {
                    g.successor = true;
                }
            }
            for (id, g) in &inner.gateways {
                for a in gateway_alarms(id, g, exp, now) {
                    raised.insert((a.kind, a.subject.clone()), a);
                }
            }
        }
        for (key, a) in &raised {
            if !inner.raised.contains_key(key) {
                warn!(alarm = key.0.as_str(), subject = %key.1, reason = %a.reason, "alarm raised");
            }
        }
        for key in inner.raised.keys() {
            if !raised.contains_key(key) {
                info!(alarm = key.0.as_str(), subject = %key.1, "alarm cleared");
            }
        }
        inner.seen = seen;
        let out = raised.values().cloned().collect();
        inner.raised = raised;
        out
    }
}

fn hash_mismatch(
    o: &TruthObservation,
    cfg: &crate::truth::TruthConfig,
    text_seen: bool,
) -> Option<Alarm> {
    let r = &o.reading;
    let wrong_size = r.engine_block_size.filter(|b| *b != o.block_size);
    let over = r.mismatch(cfg);
    if over.is_none() && wrong_size.is_none() {
        return None;
    }
    let causes = likely_causes(o, over, text_seen);
    let names: Vec<String> = causes
        .iter()
        .map(|c| match (c, wrong_size) {
            (Cause::BlockSize, Some(b)) => {
                format!("block_size (registered {}, the engine's {b})", o.block_size)
            }
            _ => c.as_str().to_owned(),
        })
        .collect();
    let what = match (over, r.engine_tokens) {
        (Some(_), Some(e)) => format!(
            "kvroute predicted {} cached tokens on {} over the last {} s, the engine reports {e} reused on those requests",
            r.predicted_tokens,
            o.subject,
            cfg.window.as_secs()
        ),
        _ => format!(
            "{} ({}/{}) is registered with block_size {} and the engine's is {}",
            o.subject,
            o.tenant,
            o.model,
            o.block_size,
            wrong_size.unwrap_or(0)
        ),
    };
    Some(Alarm {
        kind: AlarmKind::HashMismatch,
        subject: o.subject.clone(),
        reason: format!(
            "hash_mismatch: {what}; likely causes: {} ({})",
            names.join(", "),
            causes.first().map_or("", |c| c.hint())
        ),
        causes: causes.iter().map(|c| c.as_str()).collect(),
    })
}

/// The node a gateway id names: the filter makes its id as the Envoy node id, `-` and 16 hex
/// digits drawn at start, so a restarted Envoy reports under a new id of the same node. `None`
/// for any other id (configured by the operator, and then kept across restarts).
fn node_of(id: &str) -> Option<&str> {
    let (node, suffix) = id.rsplit_once('-')?;
    (suffix.len() == 16 && suffix.bytes().all(|b| b.is_ascii_hexdigit())).then_some(node)
}

/// Silent gateways that were restarted, each with its successor: `(old, new)`. A gateway
/// silent past `stale_after` was restarted when a gateway of the same node began reporting
/// after its last report; each successor stands for one predecessor, the one that fell silent
/// first, across evaluations too. Replicas that share a node id (Envoy's default is none, then every id is `envoy-…`)
/// keep their alarms: a live sibling that was reporting before one fell silent is no successor.
fn replaced(
    gateways: &HashMap<String, GatewaySeen>,
    stale_after: Duration,
    now: Instant,
) -> Vec<(String, String)> {
    let mut silent: Vec<(&str, &GatewaySeen)> = gateways
        .iter()
        .filter(|(id, g)| {
            node_of(id).is_some() && now.saturating_duration_since(g.last) >= stale_after
        })
        .map(|(id, g)| (id.as_str(), g))
        .collect();
    silent.sort_by_key(|(id, g)| (g.last, *id));
    let mut successors: Vec<(&str, &GatewaySeen)> = gateways
        .iter()
        .filter(|(id, g)| !g.successor && node_of(id).is_some())
        .map(|(id, g)| (id.as_str(), g))
        .collect();
    successors.sort_by_key(|(id, g)| (g.first, *id));
    let mut taken = vec![false; successors.len()];
    let mut out = Vec::new();
    for (old, g) in silent {
        let found = successors.iter().enumerate().position(|(i, (new, n))| {
            !taken[i] && *new != old && node_of(new) == node_of(old) && n.first > g.last
        });
        if let Some(i) = found {
            taken[i] = true;
            out.push((old.to_owned(), successors[i].0.to_owned()));
        }
    }
    out
}

fn gateway_alarms(id: &str, g: &GatewaySeen, exp: &Expected, now: Instant) -> Vec<Alarm> {
    let mut out = Vec::new();
    let age = now.saturating_duration_since(g.last);
    let lag = g.facts.feed_lag_ms.map(Duration::from_millis);
    if age >= exp.stale_after {
        out.push(Alarm {
            kind: AlarmKind::GatewayStale,
            subject: id.to_owned(),
            reason: format!(
                "gateway_stale: gateway {id} sent no load report for {:.0} s (Envoy down, the filter's lease holder stuck, the collector unreachable from it); it is forgotten after {:.0} s",
                age.as_secs_f64(),
                exp.stale_after.saturating_mul(10).as_secs_f64()
            ),
            causes: vec!["reports_stopped"],
        });
    } else if let Some(lag) = lag.filter(|l| *l >= exp.stale_after) {
        out.push(Alarm {
            kind: AlarmKind::GatewayStale,
            subject: id.to_owned(),
            reason: format!(
                "gateway_stale: gateway {id} routes on a feed {:.0} s old (feed pulls failing or too slow: kvroute.feed_errors, the filter's feed_timeout)",
                lag.as_secs_f64()
            ),
            causes: vec!["feed_lag"],
        });
    }
    let mut differs = Vec::new();
    if let Some(v) = g.facts.version.as_deref().filter(|v| *v != exp.version) {
        differs.push(format!("filter version {v}, collector {}", exp.version));
    }
    if let Some(c) = g.facts.contract.as_deref().filter(|c| *c != exp.contract) {
        differs.push(format!("hashing contract {c}, collector {}", exp.contract));
    }
    if !differs.is_empty() {
        out.push(Alarm {
            kind: AlarmKind::GatewayMismatch,
            subject: id.to_owned(),
            reason: format!(
                "gateway_mismatch: gateway {id} runs {}; deploy the filter built with this collector",
                differs.join("; ")
            ),
            causes: [
                g.facts.version.as_deref().filter(|v| *v != exp.version).map(|_| "filter_version"),
                g.facts.contract.as_deref().filter(|c| *c != exp.contract).map(|_| "contract"),
            ]
            .into_iter()
            .flatten()
            .collect(),
        });
    }
    if let (Some((_, a)), Some((at, b))) = (g.text.front(), g.text.back()) {
        let approx = b.approx.saturating_sub(a.approx);
        let total = approx + b.exact.saturating_sub(a.exact);
        if now.saturating_duration_since(*at) < NO_MODEL_WINDOW
            && approx >= TEXT_MIN_APPROX
            && approx.saturating_mul(10) >= total
        {
            let no_tok = b.no_tokenizer.saturating_sub(a.no_tokenizer);
            let errors = b.exact_errors.saturating_sub(a.exact_errors);
            let why = if no_tok > 0 {
                "the collector has no tokenizer for the model (--tokenizer MODEL=DIR)"
            } else if errors > 0 {
                "the collector's tokenizing callout fails or times out (slow /tokenize, the filter's text timeout)"
            } else {
                "no tokenizer, or a slow or failing tokenizing callout"
            };
            out.push(Alarm {
                kind: AlarmKind::TextApproximate,
                subject: id.to_owned(),
                reason: format!(
                    "text_approximate: gateway {id} decided {approx} of {total} text requests in approximate mode in the last {} s ({no_tok} no tokenizer, {errors} callout errors): {why}",
                    NO_MODEL_WINDOW.as_secs()
                ),
                causes: vec!["tokenizer"],
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(events: u64, requests: u64) -> Vec<EngineObservation> {
        vec![EngineObservation {
            worker: WorkerId(1),
            subject: "a/0".into(),
            events,
            requests,
            routed: None,
        }]
    }

    #[test]
    fn silent_engine_alarms_only_after_the_window_of_traffic() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let n = Duration::from_secs(60);
        assert!(alarms.evaluate(&obs(0, 3), n, t0).is_empty());
        assert!(alarms.evaluate(&obs(0, 3), n, t0 + n / 2).is_empty());
        let raised = alarms.evaluate(&obs(0, 3), n, t0 + n);
        assert_eq!(raised.len(), 1);
        assert_eq!(raised[0].kind, AlarmKind::EngineSilent);
        // An event clears it and restarts the window.
        assert!(alarms.evaluate(&obs(1, 3), n, t0 + 2 * n).is_empty());
        assert!(alarms
            .evaluate(&obs(1, 3), n, t0 + 2 * n + n / 2)
            .is_empty());
    }

    #[test]
    fn with_routed_counts_only_new_requests_open_the_window() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let n = Duration::from_secs(10);
        let o = |events: u64, requests: u64, routed: u64| {
            vec![EngineObservation {
                worker: WorkerId(1),
                subject: "a/0".into(),
                events,
                requests,
                routed: Some(routed),
            }]
        };
        // A healthy engine: each routing is followed by an event; long decodes in flight
        // with nothing newly routed are no reason to expect one.
        assert!(alarms.evaluate(&o(0, 0, 0), n, t0).is_empty());
        assert!(alarms.evaluate(&o(1, 2, 100), n, t0 + n).is_empty());
        assert!(alarms.evaluate(&o(1, 2, 100), n, t0 + 3 * n).is_empty());
        // Requests routed, no event since: raised once the window passes.
        assert!(alarms.evaluate(&o(1, 2, 200), n, t0 + 4 * n).is_empty());
        assert!(alarms.evaluate(&o(1, 0, 300), n, t0 + 5 * n).len() == 1);
        // Traffic stops altogether: it clears.
        assert!(alarms.evaluate(&o(1, 0, 300), n, t0 + 7 * n).is_empty());
    }

    #[test]
    fn no_model_raises_while_the_count_grows_and_clears_after_the_window() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let counts = |n: u64| BTreeMap::from([("alias".to_owned(), n)]);
        alarms.note_no_model("gw", &counts(0), t0);
        assert!(alarms.evaluate(&[], Duration::MAX, t0).is_empty());
        alarms.note_no_model("gw", &counts(2), t0);
        let raised = alarms.evaluate(&[], Duration::MAX, t0);
        assert_eq!(raised[0].kind, AlarmKind::NoModel);
        assert_eq!(raised[0].subject, "alias");
        alarms.note_no_model("gw", &counts(2), t0 + NO_MODEL_WINDOW);
        assert!(alarms
            .evaluate(&[], Duration::MAX, t0 + NO_MODEL_WINDOW)
            .is_empty());
    }

    fn truth_obs(predicted: u64, engine: u64, engine_bs: Option<u32>) -> TruthObservation {
        TruthObservation {
            subject: "e/0".into(),
            tenant: "default".into(),
            model: "m".into(),
            block_size: 16,
            lora: false,
            salt: true,
            reading: crate::truth::Reading {
                worker: WorkerId(1),
                predicted_tokens: predicted,
                routed_tokens: 100_000,
                engine_rate: Some(engine as f64 / 100_000.0),
                engine_tokens: Some(engine),
                engine_block_size: engine_bs,
                prefix_caching: Some(true),
                held: Duration::from_secs(3600),
            },
        }
    }

    #[test]
    fn likely_causes_put_the_evidence_first() {
        let under = truth_obs(0, 50_000, None);
        assert_eq!(
            likely_causes(&under, Some(false), true),
            [
                Cause::Tokenizer,
                Cause::Salt,
                Cause::ModelName,
                Cause::Lora,
                Cause::BlockSize
            ]
        );
        let over = truth_obs(50_000, 0, Some(16));
        assert_eq!(
            likely_causes(&over, Some(true), false),
            [Cause::Salt, Cause::Lora, Cause::ModelName]
        );
        let wrong = truth_obs(0, 0, Some(32));
        assert_eq!(likely_causes(&wrong, None, true), [Cause::BlockSize]);
    }

    #[test]
    fn hash_mismatch_raises_off_the_factor_and_clears_within_it() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let extra = |p, e| Extra {
            truth: vec![truth_obs(p, e, Some(16))],
            ..Extra::default()
        };
        let raised = alarms.evaluate_all(&[], Duration::MAX, &extra(1000, 50_000), t0);
        assert_eq!(raised.len(), 1);
        assert_eq!(raised[0].kind, AlarmKind::HashMismatch);
        assert!(
            raised[0].reason.contains("likely causes: salt"),
            "{}",
            raised[0].reason
        );
        assert!(alarms
            .evaluate_all(&[], Duration::MAX, &extra(40_000, 50_000), t0)
            .is_empty());
        // Under the volume floor nothing is judged, however far apart.
        assert!(alarms
            .evaluate_all(&[], Duration::MAX, &extra(0, 4000), t0)
            .is_empty());
    }

    /// Gateways are expected to run version 1.0 with contract `c`, stale after 30 s.
    fn expecting_1_0_stale_after_30s() -> Extra {
        Extra {
            expected: Some(Expected {
                version: "1.0".into(),
                contract: "c".into(),
                stale_after: Duration::from_secs(30),
            }),
            ..Extra::default()
        }
    }

    #[test]
    fn gateway_facts_are_bounded_and_judged_only_when_given() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let exp = expecting_1_0_stale_after_30s();
        alarms.note_gateway("old", GatewayFacts::default(), t0);
        alarms.note_gateway(
            "long",
            GatewayFacts {
                version: Some("é".repeat(1000)),
                ..GatewayFacts::default()
            },
            t0,
        );
        let raised = alarms.evaluate_all(&[], Duration::MAX, &exp, t0);
        assert_eq!(raised.len(), 1, "{raised:?}");
        assert_eq!(raised[0].kind, AlarmKind::GatewayMismatch);
        assert_eq!(raised[0].subject, "long");
        assert!(raised[0].reason.len() < 400, "{}", raised[0].reason);
        // Past the stale threshold both are stale; past ten times it, forgotten.
        let later = t0 + Duration::from_secs(31);
        let stale = alarms.evaluate_all(&[], Duration::MAX, &exp, later);
        assert_eq!(
            stale
                .iter()
                .filter(|a| a.kind == AlarmKind::GatewayStale)
                .count(),
            2
        );
        let gone = t0 + Duration::from_secs(301);
        assert!(alarms
            .evaluate_all(&[], Duration::MAX, &exp, gone)
            .is_empty());
    }

    #[test]
    fn a_restarted_gateway_is_not_stale_but_a_dead_replica_is() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let exp = expecting_1_0_stale_after_30s();
        let stale = |at: Instant| -> Vec<String> {
            alarms
                .evaluate_all(&[], Duration::MAX, &exp, at)
                .into_iter()
                .filter(|a| a.kind == AlarmKind::GatewayStale)
                .map(|a| a.subject)
                .collect()
        };
        let report = |id: &str, at: Instant| alarms.note_gateway(id, GatewayFacts::default(), at);
        // Gateway "gw-a" restarts at 10 s (its new id appears at 12 s); two replicas that
        // share Envoy's default node ("envoy") report from the start and one dies at 10 s;
        // an operator-configured id stops at 10 s.
        let (a_old, a_new) = ("gw-a-00000000000000aa", "gw-a-00000000000000bb");
        let (e1, e2) = ("envoy-0000000000000001", "envoy-0000000000000002");
        for s in 0..=10 {
            let at = t0 + Duration::from_secs(s);
            for id in [a_old, e1, e2, "edge-1"] {
                report(id, at);
            }
        }
        for s in 12..=60 {
            let at = t0 + Duration::from_secs(s);
            report(a_new, at);
            report(e2, at);
        }
        let late = t0 + Duration::from_secs(60);
        assert_eq!(stale(late), vec!["edge-1".to_owned(), e1.to_owned()]);
        // A second restart of the same node is found again, and a successor stands for one
        // predecessor only.
        let (b1, b2, b3) = (
            "gw-b-0000000000000001",
            "gw-b-0000000000000002",
            "gw-b-0000000000000003",
        );
        report(b1, late);
        report(b2, late);
        let later = late + Duration::from_secs(5);
        report(b3, later);
        for s in 6..=40 {
            let at = late + Duration::from_secs(s);
            report(b3, at);
            report(a_new, at);
            report(e2, at);
        }
        for end in [40, 41, 45].map(|s| late + Duration::from_secs(s)) {
            let left = stale(end);
            assert!(
                left.contains(&b1.to_owned()) != left.contains(&b2.to_owned()),
                "one of b1 and b2 restarted as b3, the other is stale: {left:?}"
            );
            assert!(!left.contains(&a_old.to_owned()), "{left:?}");
        }
    }

    #[test]
    fn node_ids_are_read_only_from_made_ids() {
        assert_eq!(node_of("envoy-00ff00ff00ff00ff"), Some("envoy"));
        assert_eq!(
            node_of("sidecar~10.0.0.1~pod-1.ns-abcdef0123456789"),
            Some("sidecar~10.0.0.1~pod-1.ns")
        );
        assert_eq!(node_of("edge-1"), None);
        assert_eq!(node_of("gw-0123456789abcdeg"), None);
        assert_eq!(node_of("0123456789abcdef"), None);
    }

    #[test]
    fn idle_engine_without_events_raises_nothing() {
        let alarms = Alarms::default();
        let t0 = Instant::now();
        let n = Duration::from_secs(60);
        assert!(alarms.evaluate(&obs(0, 0), n, t0).is_empty());
        assert!(alarms.evaluate(&obs(0, 0), n, t0 + 10 * n).is_empty());
        // Traffic starts: the window starts with it, not at registration.
        assert!(alarms.evaluate(&obs(0, 1), n, t0 + 10 * n).is_empty());
        assert_eq!(alarms.evaluate(&obs(0, 1), n, t0 + 11 * n).len(), 1);
    }
}
