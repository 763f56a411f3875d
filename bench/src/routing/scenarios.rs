//! The scenarios beyond the trace's even split ([`super::args::EXTRA_SCENARIOS`], run only
//! when `--scenarios` names them): each on a fleet of its own, with its workload, client
//! behaviour and extra table columns.
//!
//! | scenario | fleet | workload | client |
//! |---|---|---|---|
//! | `uneven` | `--engines` | the trace | two gateways taking 80/20 and 95/5 of it ([`super::split`]) |
//! | `heterogeneous` | engine 0 at `--slow-engine-speed` of the others' prefill and decode rates | the trace | one gateway |
//! | `no-events` | no KV events: every engine registered at a closed port | the trace | one gateway |
//! | `decode-heavy` | `--engines` | the trace, outputs stretched to `--decode-ratio` × the prefill time ([`super::workload::decode_heavy`]) | one gateway |
//! | `failure` | engine 0 dies at 30 % and returns empty at 60 % ([`super::failure`]) | the trace | one gateway; a failed request is sent once more |
//! | `scale` | `--scale-engines` | the trace at `--scale-utilization` of the fleet's prefill ([`super::workload::rate_for_utilization`]) | two gateways, alternating |
//! | `shared-prefix` | `--engines` | groups sharing a system prompt, rates stepping up ([`super::workload::shared_prefix`]) | one gateway |

use kvroute_sim::trace::TraceRecord;

use super::args::BenchArgs;
use super::fleet::FleetSpec;
use super::report::Column;
use super::workload::{self, EngineRates, SharedPrefixShape};

/// The engine the `failure` scenario kills (engine 0 of its fleet).
pub const FAILED_ENGINE: &str = "engine-0";

/// How one extra scenario runs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub fleet: FleetSpec,
    pub records: Vec<TraceRecord>,
    /// Arrival-rate multiplier of its replay.
    pub rate_scale: f64,
    /// The client sends a failed request once more.
    pub retry_once: bool,
    /// Engine 0 fails and restarts during each run.
    pub failure: bool,
    /// A line for the scenario's table: what was changed, by how much.
    pub note: String,
}

/// The extra columns of `scenario`'s table (none for the default scenarios).
pub fn columns(scenario: &str) -> &'static [Column] {
    match scenario {
        "uneven" | "heterogeneous" | "decode-heavy" | "shared-prefix" => &[Column::EngineRequests],
        "no-events" => &[
            Column::EngineRequests,
            Column::Outcome("routed"),
            Column::Outcome("routed_cold"),
            Column::Outcome("no_match"),
        ],
        "failure" => &[Column::EngineRequests, Column::Retried(FAILED_ENGINE)],
        _ => &[],
    }
}

/// The plan of extra scenario `scenario` on the whole trace `full` (each scenario cuts its
/// slice: the first `--limit` requests), or `None` for a name that is not one.
pub fn plan(scenario: &str, a: &BenchArgs, full: &[TraceRecord]) -> Option<Plan> {
    let trace = &full[..a.limit.map_or(full.len(), |l| l.min(full.len()))];
    let even = FleetSpec::even(a);
    let base = Plan {
        fleet: even.clone(),
        records: trace.to_vec(),
        rate_scale: a.rate_scale,
        retry_once: false,
        failure: false,
        note: String::new(),
    };
    let rates = EngineRates {
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        decode_s_per_token: a.decode_ms_per_token / 1000.0,
    };
    Some(match scenario {
        "uneven" => Plan {
            note: "Two gateways sharing the collector; `kvroute-2gw-80-20` sends 80 % of the requests to the first, `kvroute-2gw-95-5` 95 %, interleaved (smooth weighted round-robin). The other policies are one router each.".into(),
            ..base
        },
        "heterogeneous" => Plan {
            fleet: FleetSpec {
                engine0_speed: a.slow_engine_speed,
                ..even
            },
            note: format!(
                "engine-0 runs at {}× the others' prefill rate and decode speed ({:.0} tokens/s, {:.1} ms per output token).",
                a.slow_engine_speed,
                a.prefill_tokens_per_s * a.slow_engine_speed,
                a.decode_ms_per_token / a.slow_engine_speed.max(1e-6)
            ),
            ..base
        },
        "no-events" => Plan {
            fleet: FleetSpec {
                events: false,
                ..even
            },
            note: "No engine publishes KV events; the collector and vllm-router are given a closed port as each engine's event endpoint. The filter columns are its request outcomes (`kvroute.requests.*`).".into(),
            ..base
        },
        "decode-heavy" => {
            let (records, factor) = workload::decode_heavy(trace, rates, a.decode_ratio);
            Plan {
                note: format!(
                    "Outputs ×{factor:.2} (mean {:.0} tokens): decode time {:.1}× the prefill time (the trace's own: {:.1}×).",
                    records.iter().map(|r| r.output_length).sum::<usize>() as f64
                        / records.len().max(1) as f64,
                    workload::decode_over_prefill(&records, rates),
                    workload::decode_over_prefill(trace, rates),
                ),
                records,
                ..base
            }
        }
        "failure" => Plan {
            retry_once: true,
            failure: true,
            note: format!(
                "{FAILED_ENGINE} is cut off at {:.0} % of the replay (connections dropped, port closed) and returns at {:.0} % with an empty cache and its KV-event seq restarted at 0. The client sends a failed request once more, at once; `retried` counts those, `then ok off {FAILED_ENGINE}` the retries that succeeded on another engine.",
                super::failure::KILL_AT * 100.0,
                super::failure::RESTART_AT * 100.0
            ),
            ..base
        },
        "scale" => {
            let fleet = FleetSpec {
                engines: a.scale_engines,
                ..even
            };
            // As many requests per engine as the other scenarios give theirs: a run as long.
            let n = a.limit.map_or(full.len(), |l| {
                (l * a.scale_engines / a.engines.max(1)).min(full.len())
            });
            let records = full[..n].to_vec();
            let capacity = a.prefill_tokens_per_s * a.scale_engines as f64;
            let rate_scale =
                workload::rate_for_utilization(&records, capacity, a.scale_utilization);
            Plan {
                fleet,
                records,
                rate_scale,
                note: format!(
                    "{} engines behind two gateways (alternating); the first {n} requests, arrivals ×{rate_scale:.2} for {:.0} % of the fleet's prefill capacity, every prompt token counted.",
                    a.scale_engines,
                    a.scale_utilization * 100.0
                ),
                ..base
            }
        }
        "shared-prefix" => {
            let shape = shared_prefix_shape(a);
            Plan {
                records: workload::shared_prefix(&shape),
                note: format!(
                    "{} groups × {} users: a {}-token system prompt per group, a {}-token question per user, {} output tokens; {} requests in {} stages of Poisson arrivals at {} requests/s.",
                    shape.groups,
                    shape.users_per_group,
                    shape.system_tokens,
                    shape.question_tokens,
                    shape.output_tokens,
                    shape.requests,
                    shape.stage_rates.len(),
                    shape.stage_rates
                        .iter()
                        .map(|r| format!("{r:.1}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                ..base
            }
        }
        _ => return None,
    })
}

/// llm-d's capacity workload (150 groups × 5 users, 6,000-token system prompts, 1,200-token
/// questions, 1,000 output tokens), scaled to this fleet: enough groups that their prompts
/// outgrow one engine's cache but not the fleet's, and stages whose prefill would ask half,
/// once, 1.5 and twice the fleet's prefill capacity were nothing cached: a router keeping each
/// group's system prompt where it is cached stays below capacity to the end, one that does
/// not saturates in the last stages.
pub fn shared_prefix_shape(a: &BenchArgs) -> SharedPrefixShape {
    let (system_tokens, question_tokens, users_per_group) = (6144, 1536, 5);
    let capacity = a.prefill_tokens_per_s * a.engines as f64;
    let full = capacity / (system_tokens + question_tokens) as f64;
    // llm-d's ~73 % KV fill of the fleet: each group's system prompt and its users' questions
    // count once, so a router that scatters a group caches its prompt several times over and
    // evicts, and the groups' prompts outgrow any one engine's cache.
    let fleet_kv_tokens = (a.engines * a.capacity_blocks * a.block_size) as f64;
    let group_tokens = (system_tokens + users_per_group * question_tokens) as f64;
    let groups = ((0.73 * fleet_kv_tokens / group_tokens).round() as usize).max(1);
    SharedPrefixShape {
        groups,
        users_per_group,
        system_tokens,
        question_tokens,
        output_tokens: 1000,
        requests: a.shared_prefix_requests.or(a.limit).unwrap_or(800),
        stage_rates: [0.5, 1.0, 1.5, 2.0].iter().map(|f| f * full).collect(),
        seed: a.seed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn args(extra: &[&str]) -> BenchArgs {
        Wrap::parse_from(["bench"].iter().chain(extra)).a
    }

    fn trace() -> Vec<TraceRecord> {
        (0..10)
            .map(|i| TraceRecord {
                timestamp: i * 1000,
                input_length: 4000,
                output_length: 20,
                hash_ids: vec![i],
            })
            .collect()
    }

    #[test]
    fn the_heterogeneous_fleet_slows_engine_0_only() {
        let a = args(&["--slow-engine-speed", "0.5"]);
        let p = plan("heterogeneous", &a, &trace()).unwrap();
        let rates = p.fleet.rates(&a);
        assert_eq!(rates.len(), 4);
        assert_eq!(rates[0].0, 10_000.0);
        assert_eq!(rates[0].1, std::time::Duration::from_millis(16));
        for r in &rates[1..] {
            assert_eq!(*r, (20_000.0, std::time::Duration::from_millis(8)));
        }
        assert!(p.fleet.events && !p.failure);
        // Every other scenario keeps the even rates.
        for s in ["uneven", "no-events", "decode-heavy", "failure", "scale"] {
            let p = plan(s, &a, &trace()).unwrap();
            assert!(p.fleet.rates(&a).iter().all(|r| r.0 == 20_000.0), "{s}");
        }
    }

    #[test]
    fn the_shared_prefix_groups_outgrow_one_engine_and_fill_73_percent_of_the_fleet() {
        let a = args(&[]);
        let s = shared_prefix_shape(&a);
        let engine = (a.capacity_blocks * a.block_size) as f64;
        let group = (s.system_tokens + s.users_per_group * s.question_tokens) as f64;
        let fill = s.groups as f64 * group / (engine * a.engines as f64);
        assert!((fill - 0.73).abs() < 0.01, "{fill}");
        // The system prompts alone do not fit one engine; with the questions, not two.
        assert!(
            s.groups as f64 * s.system_tokens as f64 > engine,
            "{}",
            s.groups
        );
        assert!(s.groups as f64 * group > 2.0 * engine, "{}", s.groups);
        // A fleet of twice the cache gets twice the groups.
        let big = shared_prefix_shape(&args(&["--capacity-blocks", "50000"]));
        assert!(big.groups.abs_diff(2 * s.groups) <= 1);
    }

    #[test]
    fn each_extra_scenario_changes_what_it_names() {
        let a = args(&[]);
        let t = trace();
        let no_events = plan("no-events", &a, &t).unwrap();
        assert!(!no_events.fleet.events);
        assert_eq!(no_events.records, t);
        let failure = plan("failure", &a, &t).unwrap();
        assert!(failure.failure && failure.retry_once);
        let scale = plan("scale", &a, &t).unwrap();
        assert_eq!(scale.fleet.engines, 16);
        let cut = args(&["--limit", "2"]);
        assert_eq!(
            plan("scale", &cut, &t).unwrap().records.len(),
            8,
            "4× the engines, 4× the requests"
        );
        assert_eq!(plan("failure", &cut, &t).unwrap().records.len(), 2);
        // 4,000 tokens/s asked of 320,000 tokens/s at 60 %: 48× the trace's rate.
        let per_s = 10.0 * 4000.0 / 9.0;
        assert!((scale.rate_scale - 0.6 * 320_000.0 / per_s).abs() < 1e-6);
        let heavy = plan("decode-heavy", &a, &t).unwrap();
        assert!(
            (workload::decode_over_prefill(
                &heavy.records,
                EngineRates {
                    prefill_tokens_per_s: 20_000.0,
                    decode_s_per_token: 0.008,
                }
            ) - 10.0)
                .abs()
                < 0.05
        );
        assert!(plan("trace", &a, &t).is_none());
        for (s, _) in super::super::args::EXTRA_SCENARIOS {
            assert!(plan(s, &a, &t).is_some(), "{s}");
        }
        assert_eq!(columns("trace"), &[]);
        assert!(columns("failure").contains(&Column::Retried(FAILED_ENGINE)));
    }
}
