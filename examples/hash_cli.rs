//! The hashing contract natively, for cross-checks and a like-for-like speed figure.
//!
//! - `hash_cli`: reads one JSON case a line on stdin,
//!   `{"tokens": [..], "block_size": 16, "lora_name": "a" | null, "cache_salt": "s" | null}`,
//!   and prints one line per case, `{"block_hashes": ["…"], "sequence_hashes": ["…"]}` (u64
//!   as decimal strings, which JavaScript reads without losing bits), or `{"error": "…"}`.
//!   The JavaScript package's tests (`js/test/`) compare its own hashes with these.
//! - `hash_cli --bench`: sequence hashes of an 8,192-token prompt in blocks of 16, the loop
//!   `js/bench.mjs` times in Node; prints prompts per second.
//!
//! Run: `make test-js` / `make bench-js`, or `cargo run -p kvroute --example hash_cli`.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use kvroute::hash;
use serde_json::{json, Value};

fn main() {
    if std::env::args().any(|a| a == "--bench") {
        bench();
        return;
    }
    let stdin = std::io::stdin().lock();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for (n, line) in stdin.lines().enumerate() {
        let line = line.unwrap_or_else(|e| fail(&format!("stdin line {}: {e}", n + 1)));
        if line.trim().is_empty() {
            continue;
        }
        let answer = match serde_json::from_str::<Value>(&line) {
            Ok(case) => answer(&case),
            Err(e) => json!({ "error": format!("line {}: {e}", n + 1) }),
        };
        writeln!(out, "{answer}").unwrap_or_else(|e| fail(&format!("stdout: {e}")));
    }
    out.flush()
        .unwrap_or_else(|e| fail(&format!("stdout: {e}")));
}

fn answer(case: &Value) -> Value {
    let tokens: Option<Vec<u32>> = case["tokens"].as_array().and_then(|a| {
        a.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    });
    let (Some(tokens), Some(block_size)) = (tokens, case["block_size"].as_u64()) else {
        return json!({ "error": "a case needs tokens (u32 array) and block_size" });
    };
    let seed = hash::seed(case["lora_name"].as_str(), case["cache_salt"].as_str());
    let size = usize::try_from(block_size).unwrap_or(usize::MAX);
    let strings = |v: Vec<u64>| v.iter().map(u64::to_string).collect::<Vec<_>>();
    match (
        hash::block_hashes(&tokens, size, seed),
        hash::sequence_hashes(&tokens, size, seed),
    ) {
        (Ok(blocks), Ok(seqs)) => json!({
            "block_hashes": strings(blocks.into_iter().map(|b| b.0).collect()),
            "sequence_hashes": strings(seqs.into_iter().map(|s| s.0).collect()),
        }),
        (Err(e), _) | (_, Err(e)) => json!({ "error": e.to_string() }),
    }
}

/// The same prompt and block size as `js/bench.mjs`: best of 5 one-second rounds.
fn bench() {
    const TOKENS: u32 = 8192;
    const BLOCK: usize = 16;
    let prompt: Vec<u32> = (0..TOKENS)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(1))
        .collect();
    let mut out = Vec::new();
    let mut best = 0.0f64;
    for _ in 0..5 {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < Duration::from_secs(1) {
            for _ in 0..100 {
                hash::sequence_hashes_into(std::hint::black_box(&prompt), BLOCK, 1337, &mut out)
                    .unwrap_or_else(|e| fail(&e.to_string()));
                n += 1;
            }
        }
        best = best.max(n as f64 / start.elapsed().as_secs_f64());
    }
    println!(
        "native: sequence hashes of {TOKENS} tokens (block {BLOCK}): {best:.0} prompts/s, {:.2} µs each",
        1e6 / best
    );
}

fn fail(msg: &str) -> ! {
    eprintln!("hash_cli: {msg}");
    std::process::exit(1)
}
