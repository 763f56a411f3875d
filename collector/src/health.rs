//! The collector's health as `/health`, `/metrics` and `/v1/explain` report it: every alarm
//! evaluated over the app state (the fleet's load and truth readings, the registry), with the
//! gauges updated on the way. Its own module so the endpoints that read it and the alarm
//! rules (`alarm.rs`, plain data in, alarms out) stay apart.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::alarm::{Alarm, EngineObservation};
use crate::hub::HubError;
use crate::metrics::AlarmLabels;
use crate::shared::AppState;

/// Evaluates every alarm of `state` now and updates their gauges.
pub fn evaluate_alarms(state: &AppState) -> Vec<Alarm> {
    let now = Instant::now();
    let (totals, routed) = {
        let fleet = state.fleet();
        (fleet.totals(now), fleet.truth().routed_totals())
    };
    // An ingest process that splits the engines hears only the ones it reads: the others'
    // silence here says nothing of them (their reader and the index replicas judge them).
    let read_here = state
        .bus
        .as_ref()
        .filter(|b| b.splits_engines())
        .map(|_| state.read_set());
    let engines: Vec<EngineObservation> = {
        let hub = state.read();
        hub.workers()
            .filter(|w| read_here.as_ref().is_none_or(|r| r.contains(&w.id)))
            .map(|w| EngineObservation {
                worker: w.id,
                subject: format!("{}/{}", w.reg.instance_id, w.dp_rank()),
                events: w.status.events,
                requests: totals
                    .binary_search_by_key(&w.id, |t| t.worker)
                    .map_or(0, |i| totals[i].load.requests),
                routed: routed.get(&w.id).copied(),
            })
            .collect()
    };
    let extra = alarm_inputs(state, now);
    let before = state.alarms.raised_keys();
    let alarms = state
        .alarms
        .evaluate_all(&engines, state.config.alarm_silent, &extra, now);
    // A cleared alarm's series is dropped, not left at 0 forever: subjects come and go.
    for (kind, subject) in before {
        state.metrics.alarm.remove(&AlarmLabels {
            alarm: kind.as_str(),
            subject,
        });
    }
    for a in &alarms {
        state
            .metrics
            .alarm
            .get_or_create(&AlarmLabels {
                alarm: a.kind.as_str(),
                subject: a.subject.clone(),
            })
            .set(1);
    }
    state.metrics.alarms_raised.set(alarms.len() as i64);
    alarms
}

/// The `no_model` alarm's source name for `/query` calls: a remote-mode filter asks `/query`
/// per request and learns an unknown model only as that call's 404, so its load reports never
/// name it; the collector counts it itself.
pub const QUERY_SOURCE: &str = "/query";

/// A sequence that only grows, process-wide: the `no_model` memory keeps a cumulative count
/// per (source, model) and asks only whether it grew, and every next value of this grew past
/// every earlier one, whatever the model.
static QUERY_NO_MODEL: AtomicU64 = AtomicU64::new(0);

/// Counts a `/query` for a model no engine is registered for, when `err` says that is why it
/// failed: the `no_model` alarm for `model` is raised (source [`QUERY_SOURCE`]).
pub fn note_query_error(state: &AppState, model: &str, err: &HubError) {
    if let HubError::NotFound(_) = err {
        let n = QUERY_NO_MODEL.fetch_add(1, Ordering::Relaxed) + 1;
        state.alarms.note_no_model(
            QUERY_SOURCE,
            &BTreeMap::from([(model.to_owned(), n)]),
            Instant::now(),
        );
    }
}

/// The truth check's readings with what the registry knows of each worker, the gateway
/// checks' expectations; sets the truth gauges on the way.
fn alarm_inputs(state: &AppState, now: Instant) -> crate::alarm::Extra {
    use crate::metrics::{ModelLabels, WorkerLabels};
    let readings = state.fleet().truth().readings(now);
    let hub = state.read();
    let truth: Vec<crate::alarm::TruthObservation> = readings
        .into_iter()
        .filter_map(|reading| {
            let w = hub.worker(reading.worker)?;
            Some(crate::alarm::TruthObservation {
                subject: format!("{}/{}", w.reg.instance_id, w.dp_rank()),
                tenant: w.tenant().to_owned(),
                model: w.reg.model_name.clone(),
                block_size: w.reg.block_size,
                lora: w.reg.lora_name.as_deref().is_some_and(|l| !l.is_empty()),
                salt: w.reg.cache_salt.as_deref().is_some_and(|l| !l.is_empty()),
                reading,
            })
        })
        .collect();
    let labels = hub
        .workers()
        .map(|w| (w.id, WorkerLabels::new(&w.reg.instance_id, w.dp_rank())))
        .collect::<std::collections::HashMap<_, _>>();
    drop(hub);
    let m = &state.metrics;
    m.truth_predicted_tokens.clear();
    m.truth_engine_tokens.clear();
    m.truth_ratio.clear();
    m.truth_model_ratio.clear();
    let mut scopes: std::collections::BTreeMap<(&str, &str), (u64, u64)> = Default::default();
    for o in &truth {
        let r = &o.reading;
        let Some(l) = labels.get(&r.worker) else {
            continue;
        };
        m.truth_predicted_tokens
            .get_or_create(l)
            .set(r.predicted_tokens.min(i64::MAX as u64) as i64);
        if let Some(e) = r.engine_tokens {
            m.truth_engine_tokens
                .get_or_create(l)
                .set(e.min(i64::MAX as u64) as i64);
            let s = scopes.entry((&o.tenant, &o.model)).or_default();
            s.0 += r.predicted_tokens;
            s.1 += e;
        }
        if let Some(ratio) = r.ratio() {
            m.truth_ratio.get_or_create(l).set(ratio);
        }
    }
    for ((tenant, model), (p, e)) in scopes {
        if e > 0 {
            m.truth_model_ratio
                .get_or_create(&ModelLabels {
                    tenant: tenant.to_owned(),
                    model: model.to_owned(),
                })
                .set(p as f64 / e as f64);
        }
    }
    crate::alarm::Extra {
        truth,
        truth_config: state.config.truth,
        expected: Some(crate::alarm::Expected {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            contract: kvroute::hash::contract(),
            stale_after: state.config.alarm_gateway_stale,
        }),
    }
}
