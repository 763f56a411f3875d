//! The extra routing scenarios end to end in process, on ~30 trace requests, with the
//! in-process policies only (no Envoy, no peers): each writes its directory, its table holds
//! its columns, and the failure scenario's client retries what the dead engine failed.

use std::path::{Path, PathBuf};

use clap::Parser;
use kvroute_bench::routing::{self, BenchArgs};
use kvroute_sim::replay::RequestResult;

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    a: BenchArgs,
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kvroute-bench-scenarios-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn args(out: &Path, scenarios: &str, speed: &str) -> BenchArgs {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/traces/mooncake_synthetic_trace.jsonl");
    Wrap::parse_from([
        "bench",
        "--trace",
        trace.to_str().unwrap(),
        "--limit",
        "30",
        "--speed",
        speed,
        "--scenarios",
        scenarios,
        "--policies",
        "round-robin,least-request",
        // Never installed by a test: the shipped path is skipped, not started.
        "--envoy",
        "/nonexistent/envoy",
        "--scale-engines",
        "6",
        "--out",
        out.to_str().unwrap(),
    ])
    .a
}

fn requests(out: &Path, scenario: &str, policy: &str) -> Vec<RequestResult> {
    let text = std::fs::read_to_string(out.join(scenario).join(format!("{policy}.jsonl")))
        .unwrap_or_else(|e| panic!("{scenario}/{policy}: {e}"));
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            RequestResult {
                engine: v["engine"].as_str().map(String::from),
                status: v["status"].as_u64().unwrap_or(0) as u16,
                error: v["error"].as_str().map(String::from),
                retried: v["retried"].as_bool().unwrap_or(false),
                output_tokens: v["output_tokens"].as_u64().unwrap_or(0) as usize,
                ..RequestResult::default()
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_extra_scenario_runs_and_tables_its_columns() {
    let out = out_dir("all");
    let a = args(
        &out,
        "uneven,heterogeneous,no-events,decode-heavy,scale,shared-prefix",
        "20",
    );
    routing::main(a).await.unwrap();
    let summary = std::fs::read_to_string(out.join("results.md")).unwrap();
    for s in [
        "uneven",
        "heterogeneous",
        "no-events",
        "decode-heavy",
        "scale",
        "shared-prefix",
    ] {
        assert!(summary.contains(&format!("### {s}\n")), "{s}");
        // `scale` replays as many requests per engine as the others: 30 × 6 / 4.
        let n = if s == "scale" { 45 } else { 30 };
        for p in ["round-robin", "least-request"] {
            let rs = requests(&out, s, p);
            assert_eq!(rs.len(), n, "{s}/{p}");
            assert!(rs.iter().all(|r| r.ok()), "{s}/{p}: {rs:?}");
        }
    }
    let no_events = std::fs::read_to_string(out.join("no-events/results.md")).unwrap();
    assert!(no_events.contains("filter: routed_cold"));
    // The scale fleet has its own engine count, every one of them serving.
    let scale = requests(&out, "scale", "round-robin");
    let mut engines: Vec<&str> = scale.iter().filter_map(|r| r.engine.as_deref()).collect();
    engines.sort_unstable();
    engines.dedup();
    assert_eq!(engines.len(), 6, "{engines:?}");
    // Decode-heavy requests carry the stretched outputs.
    let plain: usize = requests(&out, "uneven", "round-robin")
        .iter()
        .map(|r| r.output_tokens)
        .sum();
    let heavy: usize = requests(&out, "decode-heavy", "round-robin")
        .iter()
        .map(|r| r.output_tokens)
        .sum();
    assert!(heavy > 2 * plain, "{heavy} vs {plain}");
    let _ = std::fs::remove_dir_all(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failed_engines_requests_are_retried_once() {
    let out = out_dir("failure");
    // Slow enough that the kill (30 %) comes well before the requests of the down window.
    routing::main(args(&out, "failure", "4")).await.unwrap();
    let rs = requests(&out, "failure", "round-robin");
    assert_eq!(rs.len(), 30);
    // Round-robin knows nothing of health: its share of the down window reaches the dead
    // engine, fails, and is sent once more, to the next engine in turn.
    let retried: Vec<&RequestResult> = rs.iter().filter(|r| r.retried).collect();
    assert!(!retried.is_empty(), "{rs:?}");
    assert!(retried
        .iter()
        .any(|r| r.ok() && r.engine.as_deref() != Some("engine-0")));
    // Before the kill and after the restart, engine 0 serves.
    assert!(rs
        .iter()
        .any(|r| r.ok() && r.engine.as_deref() == Some("engine-0")));
    let table = std::fs::read_to_string(out.join("failure/results.md")).unwrap();
    assert!(table.contains("retried (then ok off engine-0)"), "{table}");
    let _ = std::fs::remove_dir_all(&out);
}
