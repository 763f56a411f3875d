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

/// Which alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum AlarmKind {
    /// An engine serves traffic and sends no KV events.
    EngineSilent,
    /// Requests name a model no engine is registered for.
    NoModel,
}

impl AlarmKind {
    /// The `alarm` label and the name `/health` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            AlarmKind::EngineSilent => "engine_silent",
            AlarmKind::NoModel => "no_model",
        }
    }
}

/// One raised alarm.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Alarm {
    pub kind: AlarmKind,
    /// What it is about: `instance/dp` for an engine.
    pub subject: String,
    /// The `/health` line: what is wrong and the likely causes.
    pub reason: String,
}

/// What one engine was last seen doing.
#[derive(Clone, Copy, Debug)]
struct Seen {
    events: u64,
    /// Since when it has served traffic without a new event.
    silent_since: Instant,
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

    /// Evaluates `engines` at `now` against `silent_after`; returns the alarms raised, sorted,
    /// and logs each change.
    pub fn evaluate(
        &self,
        engines: &[EngineObservation],
        silent_after: Duration,
        now: Instant,
    ) -> Vec<Alarm> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut raised = BTreeMap::new();
        let mut seen = HashMap::with_capacity(engines.len().min(MAX_TRACKED));
        for e in engines.iter().take(MAX_TRACKED) {
            let prev = inner.seen.get(&e.worker).copied();
            let silent_since = match prev {
                // Still silent and still serving: the window goes on.
                Some(p) if p.events == e.events && e.requests > 0 => p.silent_since,
                _ => now,
            };
            seen.insert(
                e.worker,
                Seen {
                    events: e.events,
                    silent_since,
                },
            );
            let silent = now.saturating_duration_since(silent_since);
            if e.requests > 0 && silent >= silent_after {
                let a = Alarm {
                    kind: AlarmKind::EngineSilent,
                    subject: e.subject.clone(),
                    reason: format!(
                        "engine_silent: {} serves {} requests and sent no KV event for {:.0} s; it is routed with an empty cache (KV events off? --kv-events-config, the registered endpoint, a firewall)",
                        e.subject,
                        e.requests,
                        silent.as_secs_f64()
                    ),
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
            };
            raised.insert((a.kind, a.subject.clone()), a);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(events: u64, requests: u64) -> Vec<EngineObservation> {
        vec![EngineObservation {
            worker: WorkerId(1),
            subject: "a/0".into(),
            events,
            requests,
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
