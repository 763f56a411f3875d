//! Per-request cost of the real `kvroute_filter.wasm` in the host-test crate's wasmtime host.
//!
//! Dimensions: prompt sizes 1k / 8k / 32k tokens (block size 16); a 1M-block index
//! (16 single-rank instances, 16384 buckets) built natively with the filter's own layout code
//! and loaded into the host's shared data; index sizes 1k / 32k / 1M blocks for the read count.
//!
//! What is measured, per request, wall time (mean over `N` requests after a warm-up):
//! - `baseline`: a request with no tokens (host and filter overhead of a request);
//! - `intake/header_base64`: tokens in `x-token-ids`, model in `x-model`; the model names a
//!   model the index lacks, so the filter stops right after intake + the staleness check;
//!   the host's own cost of carrying a header that size (measured with a header the filter
//!   does not read) is subtracted, and reported;
//! - `intake/body_json`: the same tokens as a JSON body (`prompt` array, plus a chat-like
//!   `messages` field to skip); throughput = body bytes / (time − the host's cost of the same
//!   body sent as `text/plain`, which the filter does not buffer);
//! - `route/header_base64`: the full path: intake, hashing, bisection over the buckets, load
//!   read, pick, headers, load update; `lookup+decision` = route − the header-intake request.
//!
//! Run: `make wasm && cargo bench -p kvroute-filter --bench benches` (env `KVROUTE_BENCH_N`
//! sets the requests per case, default 300).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kvroute::event::{Tier, WorkerId};
use kvroute::feed::{Op, Page};
use kvroute::hash;
use kvroute::intake::encode_base64_u32;
use kvroute::mirror::{self, Keys, Limits, MemStore, Store};
use kvroute::scope::{BlockKey, ScopeId};
use kvroute_host_test::{bench, built_wasm, CalloutReply, Gateway, Response};

const BS: usize = 16;
const WORKERS: u32 = 16;

fn keys_of(tokens: &[u32]) -> Vec<BlockKey> {
    let seqs = hash::sequence_hashes(tokens, BS, hash::seed(None, None)).unwrap();
    let scope = ScopeId::of("default", "m", None, None);
    seqs.into_iter().map(|s| scope.key(s)).collect()
}

/// A shared-data image of an index of `total` blocks over [`WORKERS`] instances in which
/// worker `w` holds the first `(w % distinct + 1) / distinct` of the 32k-token prompt's blocks
/// (so `distinct` distinct match lengths), and random chains fill the rest.
fn index_image(total: usize, prompt: &[u32], distinct: usize) -> Vec<(String, Vec<u8>)> {
    fleet_image(total, prompt, distinct, WORKERS)
}

/// [`index_image`] over `workers` single-rank instances.
fn fleet_image(
    total: usize,
    prompt: &[u32],
    distinct: usize,
    workers: u32,
) -> Vec<(String, Vec<u8>)> {
    let store = MemStore::new();
    let keys = Keys::new("kvroute");
    let limits = Limits {
        buckets_log2: 14,
        max_workers: 256,
        max_bucket_keys: 4096,
        max_models: 64,
    };
    let mut ops = vec![Op::BlockSize {
        tenant: "default".into(),
        model: "m".into(),
        block_size: BS as u32,
    }];
    for w in 0..workers {
        ops.push(Op::Worker {
            id: WorkerId(w),
            live: true,
            dp_rank: 0,
            instance_id: format!("i{w}"),
            address: format!("10.0.0.{}:8000", w + 1),
            tenant: "default".into(),
            model: "m".into(),
        });
    }
    let pk = keys_of(prompt);
    let mut placed = 0usize;
    for w in 0..workers {
        let n = pk.len() * (w as usize % distinct + 1) / distinct;
        ops.push(Op::Blocks {
            worker: WorkerId(w),
            tier: Tier::Gpu,
            added: true,
            keys: pk[..n].to_vec(),
        });
        placed += n;
    }
    let mut x = 0x1234_5678_9abc_def0u64;
    let per = total.saturating_sub(placed) / workers as usize;
    for w in 0..workers {
        let ks: Vec<BlockKey> = (0..per)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                BlockKey(x)
            })
            .collect();
        ops.push(Op::Blocks {
            worker: WorkerId(w),
            tier: Tier::Gpu,
            added: true,
            keys: ks,
        });
    }
    let page = Page {
        flags: Page::RESET,
        epoch: 1,
        cursor: 1,
        ops,
    };
    mirror::apply_page(&store, &keys, &limits, &page, 0).unwrap();
    store
        .keys()
        .into_iter()
        .filter_map(|k| store.get(&k).ok().and_then(|(v, _)| v).map(|v| (k, v)))
        .collect()
}

fn gateway(image: &[(String, Vec<u8>)]) -> Gateway {
    gateway_with(image, false, "")
}

/// A gateway on `image`; `extra`: more top-level keys of the filter's JSON config (`"k": v,`).
fn gateway_with(image: &[(String, Vec<u8>)], with_fuel: bool, extra: &str) -> Gateway {
    // `KVROUTE_BENCH_WASM=<path>`: another build of the filter (a before/after in one run).
    let wasm = match std::env::var_os("KVROUTE_BENCH_WASM") {
        Some(p) => PathBuf::from(p),
        None => built_wasm("kvroute_filter").unwrap_or_else(|e| panic!("{e}: run make wasm")),
    };
    gateway_of(wasm, image, with_fuel, extra)
}

/// [`gateway_with`] of the filter at `wasm`.
fn gateway_of(wasm: PathBuf, image: &[(String, Vec<u8>)], with_fuel: bool, extra: &str) -> Gateway {
    let config = format!(
        r#"{{{extra}"collector":{{"cluster":"kvroute_collector"}},"index":{{"stale_after_ms":3600000}}}}"#
    );
    let mut gw = Gateway::builder(wasm)
        .config(&config)
        .plugin_name("kvroute")
        .allow_on_headers_stop_iteration(true)
        .fuel(with_fuel)
        .build()
        .unwrap();
    gw.prefill_shared_data(image.iter().map(|(k, v)| (k.clone(), v.clone())));
    // The image's sync time is 0 (the epoch); the host clock starts in 2026: fix the state.
    let keys = Keys::new("kvroute");
    let (mut state, _) = mirror::SyncState::decode(&gw.shared_data(keys.active()).unwrap().0)
        .map(|s| (s, 0))
        .unwrap();
    state.synced_at_ms = gw.now_nanos() / 1_000_000;
    gw.set_shared_data(keys.active(), state.encode());
    // The collector answers nothing new: the index stays as loaded.
    gw.cluster("kvroute_collector", |_| {
        CalloutReply::Response(Response::new(503))
    });
    gw
}

fn measure(
    gw: &mut Gateway,
    n: u64,
    mut make: impl FnMut(kvroute_host_test::RequestBuilder<'_>) -> kvroute_host_test::RequestBuilder<'_>,
) -> Duration {
    // Warm-up, then the best mean of 5 batches: the machine is shared, and other processes
    // only ever add time.
    bench::run(gw, n / 5 + 1, |_, r| make(r)).unwrap();
    (0..5)
        .map(|_| {
            bench::run(gw, n / 5 + 1, |_, r| make(r))
                .unwrap()
                .wall_per_request()
        })
        .min()
        .unwrap_or_default()
}

/// Fuel (wasm operators executed) per request: machine-independent.
fn fuel(
    gw: &mut Gateway,
    mut make: impl FnMut(kvroute_host_test::RequestBuilder<'_>) -> kvroute_host_test::RequestBuilder<'_>,
) -> u64 {
    bench::run(gw, 2, |_, r| make(r)).unwrap();
    bench::run(gw, 10, |_, r| make(r))
        .unwrap()
        .fuel_per_request()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Rounds of the interleaved bookkeeping measurement.
const ROUNDS: usize = 30;

/// A one-block request for `model` of a prompt no request had before (none is a hit, not
/// even a speculative one), answered with a body (so the booked prefill is released at its
/// first bytes, as in real traffic).
fn cold_request<'g>(
    r: kvroute_host_test::RequestBuilder<'g>,
    model: &str,
) -> kvroute_host_test::RequestBuilder<'g> {
    static NEXT: AtomicU32 = AtomicU32::new(1_000_000);
    let first = NEXT.fetch_add(16, Ordering::Relaxed);
    let tokens: Vec<u32> = (first..first + 16).collect();
    r.header("x-token-ids", &encode_base64_u32(&tokens))
        .header("x-model", model)
        .upstream_response(Response::ok("{\"choices\":[]}"))
}

/// The decision's bookkeeping (issue 10: the load picture read, the booking, its two
/// releases, the speculative entry), on a one-block prompt nobody holds. Four requests of it,
/// measured in interleaved rounds (the best batch of each, so drift hits all alike):
/// - `unrouted`: for a model with no instances (intake and the staleness check only);
/// - `deferred`: the filter configured to leave cold requests to Envoy (`route.cold: defer`):
///   the lookup, the speculative lookup and the load picture, but no decision and no books;
/// - `booked`: decided, headers set, booked, released at the first body bytes and at the end,
///   remembered as a speculative entry;
/// - `unbooked`: the same with `kvroute_filter_unbooked.wasm` (`make wasm-unbooked`: the
///   filter built with its books cut out), when it is built.
///
/// `booked − deferred` holds the decision, the headers, the books and the speculative entry;
/// `booked − unbooked` is the books alone: the booking and its two releases. Fuel (wasm
/// operators, exact) is given beside each.
fn bookkeeping_lines(image: &[(String, Vec<u8>)], n: u64) {
    let filter = built_wasm("kvroute_filter").unwrap_or_else(|e| panic!("{e}: run make wasm"));
    let unbooked_wasm = built_wasm("kvroute_filter_unbooked").ok();
    if unbooked_wasm.is_none() {
        println!("bookkeeping: no kvroute_filter_unbooked.wasm (make wasm-unbooked): the books are not priced apart");
    }
    for (label, extra) in [
        ("", ""),
        (" (speculative entries off)", r#""speculative_ttl_ms":0,"#),
    ] {
        let decide_cfg = format!(r#""route":{{{extra}"cold":"decide"}},"#);
        let defer_cfg = format!(r#""route":{{{extra}"cold":"defer"}},"#);
        // The same configuration runs at different speeds in different wasmtime instances
        // (up to 1.7× apart here, steadily): three of each, the quickest counts.
        let three = |wasm: &PathBuf, cfg: &str| -> Vec<Gateway> {
            (0..3)
                .map(|_| gateway_of(wasm.clone(), image, false, cfg))
                .collect()
        };
        let mut decide = three(&filter, &decide_cfg);
        let mut defer = three(&filter, &defer_cfg);
        let mut unbooked = unbooked_wasm
            .as_ref()
            .map_or_else(Vec::new, |w| three(w, &decide_cfg));
        for gw in decide
            .iter_mut()
            .chain(defer.iter_mut())
            .chain(unbooked.iter_mut())
        {
            bench::run(gw, n / 5 + 1, |_, r| cold_request(r, "m")).unwrap();
        }
        let mut best = [Duration::MAX; 4];
        let batch = n / 20 + 1;
        let time = |gw: &mut Gateway, model: &str| {
            bench::run(gw, batch, |_, r| cold_request(r, model))
                .unwrap()
                .wall_per_request()
        };
        for _ in 0..ROUNDS {
            for (i, (a, b)) in decide.iter_mut().zip(defer.iter_mut()).enumerate() {
                let mut times = vec![time(a, "absent"), time(b, "m"), time(a, "m")];
                if let Some(c) = unbooked.get_mut(i) {
                    times.push(time(c, "m"));
                }
                for (best, t) in best.iter_mut().zip(times) {
                    *best = (*best).min(t);
                }
            }
        }
        drop((decide, defer, unbooked));
        let fuels = {
            let mut decide = gateway_of(filter.clone(), image, true, &decide_cfg);
            let mut defer = gateway_of(filter.clone(), image, true, &defer_cfg);
            let mut f = vec![
                fuel(&mut decide, |r| cold_request(r, "absent")),
                fuel(&mut defer, |r| cold_request(r, "m")),
                fuel(&mut decide, |r| cold_request(r, "m")),
            ];
            if let Some(w) = &unbooked_wasm {
                let mut c = gateway_of(w.clone(), image, true, &decide_cfg);
                f.push(fuel(&mut c, |r| cold_request(r, "m")));
            }
            f
        };
        let [u, d, b, x] = best;
        println!(
            "bookkeeping{label}: unrouted {:.1} us ({} fuel), deferred {:.1} us ({} fuel), booked {:.1} us ({} fuel); booked - unrouted {:.1} us, booked - deferred {:.1} us ({} fuel)",
            us(u), fuels[0], us(d), fuels[1], us(b), fuels[2],
            us(b.saturating_sub(u)), us(b.saturating_sub(d)),
            fuels[2].saturating_sub(fuels[1]),
        );
        if let Some(&fx) = fuels.get(3) {
            println!(
                "bookkeeping{label}, the books apart: unbooked {:.1} us ({fx} fuel); booked - unbooked {:.1} us ({} fuel)",
                us(x), us(b.saturating_sub(x)), fuels[2].saturating_sub(fx),
            );
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: u64 = std::env::var("KVROUTE_BENCH_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    // `KVROUTE_BENCH_ONLY=bookkeeping`: the bookkeeping lines alone; `=fleet`: the fleet-size
    // table alone.
    let only = std::env::var("KVROUTE_BENCH_ONLY").unwrap_or_default();
    let only_bookkeeping = only == "bookkeeping";
    let prompt: Vec<u32> = (0..32_768u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 100_000)
        .collect();
    if only == "fleet" {
        fleet_lines(&prompt, n);
        return;
    }
    for distinct in [2usize, 16] {
        println!(
            "\n1M-block index, 16 instances, {distinct} distinct match lengths of the prompt:"
        );
        let image = index_image(1_000_000, &prompt, distinct);
        if only_bookkeeping {
            bookkeeping_lines(&image, n);
            continue;
        }
        let mut gw = gateway(&image);
        println!(
            "shared-data keys: {}, bytes: {}",
            gw.shared_data_len(),
            gw.shared_data_bytes()
        );
        let base = measure(&mut gw, n, |r| r.header("x-other", "1"));
        println!("baseline (no tokens): {:.1} us/request", us(base));
        bookkeeping_lines(&image, n);
        println!("| tokens | intake header b64 (us) | intake body JSON (us) | body MB/s | route (us) | lookup+decision (us) | bucket reads/request | host cost of the header / body (us) |");
        println!("|---|---|---|---|---|---|---|---|");
        for size in [1024usize, 8192, 32768] {
            let toks = &prompt[..size];
            let b64 = encode_base64_u32(toks);
            let body = serde_json::to_vec(&serde_json::json!({
            "model": "absent",
            "messages": [{"role": "user", "content": "Summarize the following document, please. ".repeat(8)}],
            "prompt": toks,
            "max_tokens": 16,
        }))
        .unwrap();
            let hdr = measure(&mut gw, n, |r| {
                r.header("x-token-ids", &b64).header("x-model", "absent")
            });
            let js = measure(&mut gw, n, |r| {
                r.header("content-type", "application/json")
                    .body(body.clone())
            });
            // The host's own cost of carrying a header / body this size (the filter never reads
            // `x-junk`, and does not buffer a `text/plain` body).
            let junk_hdr = measure(&mut gw, n, |r| {
                r.header("x-junk", &b64).header("x-model", "absent")
            });
            let junk_body = measure(&mut gw, n, |r| {
                r.header("content-type", "text/plain").body(body.clone())
            });
            let reads_before = gw
                .histogram("kvroute.lookup_reads")
                .unwrap_or_default()
                .len();
            let route = measure(&mut gw, n, |r| {
                r.header("x-token-ids", &b64).header("x-model", "m")
            });
            let reads = gw.histogram("kvroute.lookup_reads").unwrap_or_default();
            let new = &reads[reads_before.min(reads.len())..];
            let mean_reads = new.iter().sum::<u64>() as f64 / new.len().max(1) as f64;
            let body_time = js.saturating_sub(junk_body).as_secs_f64();
            let mbps = body.len() as f64 / body_time.max(1e-9) / 1e6;
            println!(
            "| {size} | {:.1} | {:.1} ({} B) | {:.0} | {:.1} | {:.1} | {:.1} (+2: state, load) | {:.1} / {:.1} |",
            us(hdr.saturating_sub(junk_hdr)),
            us(js.saturating_sub(junk_body)),
            body.len(),
            mbps,
            us(route.saturating_sub(junk_hdr)),
            us(route.saturating_sub(hdr)),
            mean_reads,
            us(junk_hdr.saturating_sub(base)),
            us(junk_body.saturating_sub(base)),
        );
        }
    }
    if only_bookkeeping {
        return;
    }
    // Fuel per request (wasm operators), 2 distinct lengths.
    println!("\n| tokens | fuel: baseline | header intake | body intake | route (header) |");
    println!("|---|---|---|---|---|");
    let image = index_image(1_000_000, &prompt, 2);
    let mut gw = gateway_with(&image, true, "");
    let f_base = fuel(&mut gw, |r| r.header("x-other", "1"));
    for size in [1024usize, 8192, 32768] {
        let toks = &prompt[..size];
        let b64 = encode_base64_u32(toks);
        let body =
            serde_json::to_vec(&serde_json::json!({"model": "absent", "prompt": toks})).unwrap();
        let f_hdr = fuel(&mut gw, |r| {
            r.header("x-token-ids", &b64).header("x-model", "absent")
        });
        let f_body = fuel(&mut gw, |r| {
            r.header("content-type", "application/json")
                .body(body.clone())
        });
        let f_route = fuel(&mut gw, |r| {
            r.header("x-token-ids", &b64).header("x-model", "m")
        });
        println!("| {size} | {f_base} | {f_hdr} | {f_body} | {f_route} |");
    }
    // Text requests (chat messages, no token ids): the exact path on a canned `/query` answer
    // (the callout's round trip is not fuel), then approximate mode (the collector said 404
    // once; the model is then known to have no tokenizer and no callout is made).
    println!("\n| text chars (≈ tokens) | fuel: exact (answer parsed, routed, prefixes recorded) | approximate (table lookup, decision, record) |");
    println!("|---|---|---|");
    let answer = serde_json::json!({"block_size": BS, "query_blocks": 64, "instances":
        (0..WORKERS).map(|w| (format!("i{w}"), serde_json::json!({"address": format!("10.0.0.{}:8000", w + 1),
            "longest_matched": 16 * w, "gpu": 16 * w, "cpu": 16 * w, "disk": 16 * w, "dp": {"0": 16 * w}})))
            .collect::<serde_json::Map<_, _>>()})
    .to_string();
    let chats: Vec<(usize, Vec<u8>)> = [4096usize, 32_768, 131_072]
        .into_iter()
        .map(|chars| {
            let doc: String = "The quick brown fox jumps over the lazy dog; "
                .chars()
                .cycle()
                .take(chars)
                .collect();
            let body = serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": doc},
                {"role": "user", "content": "What does the fox do?"}]});
            (chars, serde_json::to_vec(&body).unwrap())
        })
        .collect();
    let mut exact = Vec::new();
    gw.cluster("kvroute_collector", move |c| {
        if c.path() == "/query" {
            CalloutReply::Response(Response::ok(answer.clone()))
        } else {
            CalloutReply::Response(Response::new(503))
        }
    });
    for (_, body) in &chats {
        exact.push(fuel(&mut gw, |r| {
            r.header("content-type", "application/json")
                .body(body.clone())
        }));
    }
    gw.cluster("kvroute_collector", |_| {
        CalloutReply::Response(Response::new(404).body("{}"))
    });
    for ((chars, body), f_exact) in chats.iter().zip(exact) {
        let f_approx = fuel(&mut gw, |r| {
            r.header("content-type", "application/json")
                .body(body.clone())
        });
        println!("| {chars} (≈ {}) | {f_exact} | {f_approx} |", chars / 4);
    }
    // Reads per request against the index size, for an 8k-token prompt.
    println!("\n| index blocks (4 distinct lengths) | bucket reads/request (8k tokens) |");
    println!("|---|---|");
    for total in [1_000usize, 32_000, 1_000_000] {
        let image = index_image(total, &prompt, 4);
        let mut gw = gateway(&image);
        let b64 = encode_base64_u32(&prompt[..8192]);
        measure(&mut gw, 20, |r| {
            r.header("x-token-ids", &b64).header("x-model", "m")
        });
        let reads = gw.histogram("kvroute.lookup_reads").unwrap_or_default();
        let mean = reads.iter().sum::<u64>() as f64 / reads.len().max(1) as f64;
        println!("| {total} | {mean:.1} |");
    }
    fleet_lines(&prompt, n);
}

/// The decision's cost against the fleet's size (issue 20: at 16 engines at most 1.5× that at
/// 4): an 8k-token prompt with 4 distinct match lengths over the fleet, and a cold one-block
/// prompt that every instance ties on, in a 1M-block index of 4, 16 and 64 instances.
/// `lookup+decision` is the routed request less the same header read for a model the index
/// lacks (intake alone). Fuel is exact; wall time is the best batch on a shared machine.
fn fleet_lines(prompt: &[u32], n: u64) {
    println!("\n| instances | lookup+decision, 8k tokens (us) | fuel | cold 1-block request (us) | fuel |");
    println!("|---|---|---|---|---|");
    let b64 = encode_base64_u32(&prompt[..8192]);
    let mut base: Option<(u64, u64)> = None;
    for workers in [4u32, 16, 64] {
        let image = fleet_image(1_000_000, prompt, 4, workers);
        let mut gw = gateway(&image);
        let intake = measure(&mut gw, n, |r| {
            r.header("x-token-ids", &b64).header("x-model", "absent")
        });
        let route = measure(&mut gw, n, |r| {
            r.header("x-token-ids", &b64).header("x-model", "m")
        });
        let cold = measure(&mut gw, n, |r| cold_request(r, "m"));
        let mut gw = gateway_with(&image, true, "");
        let f_intake = fuel(&mut gw, |r| {
            r.header("x-token-ids", &b64).header("x-model", "absent")
        });
        let f_route = fuel(&mut gw, |r| {
            r.header("x-token-ids", &b64).header("x-model", "m")
        });
        let f_cold = fuel(&mut gw, |r| cold_request(r, "m"));
        let f_decide = f_route.saturating_sub(f_intake);
        let (b_decide, b_cold) = *base.get_or_insert((f_decide, f_cold));
        println!(
            "| {workers} | {:.1} | {f_decide} ({:.2}× 4) | {:.1} | {f_cold} ({:.2}× 4) |",
            us(route.saturating_sub(intake)),
            f_decide as f64 / b_decide.max(1) as f64,
            us(cold),
            f_cold as f64 / b_cold.max(1) as f64,
        );
    }
}
