//! `kvroute-bench collector`: the collector's system benchmarks, printed as a markdown report,
//! with NVIDIA Dynamo's standalone indexer (`python -m dynamo.indexer`) side by side when
//! `--dynamo PYTHON` names a Python that has `ai-dynamo-runtime==1.6.1`.
//!
//! - **ingest**: the simulator's publishers (`kvroute_sim::publisher`) send pre-encoded vLLM
//!   0.33 batches over real ZMQ on loopback; the time from the first send until the index holds
//!   every block gives blocks/s. The collector runs on a tokio runtime with ONE worker thread;
//!   the publishers on another.
//! - **query**: an index of 100,000 blocks over 8 workers (worker `w` holds the first
//!   `(w+1)·64` blocks of a 512-block prompt, the rest filler) is queried with that 8,192-token
//!   prompt by a closed-loop HTTP/1.1 keep-alive load generator (this binary, on its own
//!   runtime): sequential, then N concurrent connections. req/s, p50, p99.
//! - **rss**: resident memory per million (block, holder) entries.
//!
//! Everything runs on this machine's loopback; every loop is bounded in count and time.

use std::time::{Duration, Instant};

use kvroute::api::RegisterRequest;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_collector::{Config, Shared};
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{self, EventFormat, Extras};

use crate::dynamo::{dynamo_longest, dynamo_register, start_dynamo};
use crate::loadgen::{load, QueryStats};

/// Flags of `kvroute-bench collector`.
#[derive(clap::Args, Debug, Clone)]
pub struct CollectorArgs {
    /// Python with ai-dynamo-runtime 1.6.1, to run Dynamo's indexer side by side.
    #[arg(long)]
    dynamo: Option<String>,
    /// Blocks ingested per run.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Concurrent connections of each /query load phase, after a sequential one.
    #[arg(long, value_delimiter = ',', default_value = "4,16,64")]
    concurrency: Vec<usize>,
    /// Seconds of each /query load phase.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Entries for the RSS measurement.
    #[arg(long, default_value_t = 2_000_000)]
    rss_entries: usize,
}

const BS: usize = 16;
const MODEL: &str = "bench-model";

/// vLLM 0.33 batches with only the mandatory fields, as the published figures were made.
const FORMAT: EventFormat = EventFormat::Vllm033;
const EXTRAS: Extras = Extras {
    vllm_group_fields: false,
};

fn encode(events: &[KvEvent]) -> Vec<u8> {
    wire::encode_events(FORMAT, EXTRAS, 1.0, events, Some(0))
}

/// `n` publishers on loopback, started from `rt` (each sends on threads of its own).
fn start_publishers(rt: &tokio::runtime::Runtime, n: usize) -> Result<Vec<Publisher>, String> {
    rt.block_on(async {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let p = Publisher::start(PublisherConfig::loopback(FORMAT))
                .await
                .map_err(|e| e.to_string())?;
            out.push(p);
        }
        Ok(out)
    })
}

/// Publishes every publisher's batches in order, and waits until they are all on the wire.
fn publish_all(rt: &tokio::runtime::Runtime, pubs: &[Publisher], batches: Vec<Vec<Vec<u8>>>) {
    rt.block_on(async {
        let mut last = Vec::new();
        for (p, bs) in pubs.iter().zip(batches) {
            let mut seq = None;
            for b in bs {
                seq = Some(p.publish(b));
            }
            last.push((p.published(), seq));
        }
        for (mut watch, seq) in last {
            let _ = watch.wait_for(|sent| *sent >= seq).await;
        }
    });
}

/// Runs every benchmark and prints the markdown report.
pub fn run(args: CollectorArgs) {
    let mut report = String::new();
    report.push_str("# kvroute-collector benchmarks\n\n");
    report.push_str(&format!(
        "Machine: {} cores, `{}`. Command: `bash bench/scripts/bench-collector.sh` (creates `collector/.venv-bench` with `ai-dynamo-runtime==1.6.1`, builds with `--profile bench`, runs `kvroute-bench collector --dynamo collector/.venv-bench/bin/python`, writes `collector/BENCH.md`).\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned()))
            .unwrap_or_default()
    ));

    let load_before = loadavg();
    let rss = rss_per_million(args.rss_entries);
    eprintln!("rss: {rss:.1} MiB per million entries");

    let mut rows = Vec::new();
    for publishers in [1usize, 16] {
        let ours = ingest_ours(publishers, args.blocks);
        eprintln!("ingest ours {publishers}: {ours:?}");
        let theirs = args
            .dynamo
            .as_deref()
            .map(|py| ingest_dynamo(py, publishers, args.blocks));
        eprintln!("ingest dynamo {publishers}: {theirs:?}");
        rows.push((publishers, ours, theirs));
    }
    let q_ours = query_ours(&args);
    eprintln!("query ours: {q_ours:?}");
    let q_theirs = args.dynamo.as_deref().map(|py| query_dynamo(py, &args));
    eprintln!("query dynamo: {q_theirs:?}");

    report.push_str("## Ingest through real ZMQ sockets (vLLM 0.33 map events, 16-token blocks, 1,024 blocks per batch)\n\n");
    report.push_str("| publishers | blocks | kvroute-collector (1 runtime thread) | Dynamo indexer `--threads 1` |\n|---|---|---|---|\n");
    for (p, ours, theirs) in &rows {
        report.push_str(&format!(
            "| {p} | {} | {} | {} |\n",
            args.blocks,
            fmt_ingest(ours),
            theirs.as_ref().map_or("not run".into(), fmt_ingest)
        ));
    }
    report.push_str(&format!(
        "\n## /query, 8,192 tokens, index of 100,000 blocks over 8 workers\n\nLoad: this binary's closed-loop HTTP/1.1 keep-alive clients on the same 2 cores as the server, {:.0} s per phase.\n\n",
        args.seconds
    ));
    report.push_str("| server | connections | req/s | p50 | p99 |\n|---|---|---|---|---|\n");
    report.push_str(&fmt_query("kvroute-collector", &q_ours));
    if let Some(q) = &q_theirs {
        report.push_str(&fmt_query("Dynamo indexer `--threads 1`", q));
    }
    report.push_str(
        "\n## Memory\n\n| server | RSS per million (block, holder) entries |\n|---|---|\n",
    );
    report.push_str(&format!("| kvroute-collector | {rss:.1} MiB |\n"));
    for (p, _, theirs) in &rows {
        if let Some(Ok(t)) = theirs {
            if let Some(r) = t.rss_mib_per_million {
                report.push_str(&format!(
                    "| Dynamo indexer ({p} publishers run) | {r:.1} MiB |\n"
                ));
            }
        }
    }
    report.push_str(&format!(
        "\nMemory is the resident-set growth while the index is built (kvroute: {} entries, 8 workers, every block held by 2; \
         Dynamo: the growth of the indexer process over the ingest run, 1 holder per block). \
         kvroute's feed log (bounded, 1M entries by default, ~32 bytes each) is not included.\n\n\
         Load average of the shared machine (1/5/15 min) before the run: {load_before}; after: {}. \
         Other jobs were running: figures are indicative, run again on a quiet machine to compare.\n",
        args.rss_entries,
        loadavg()
    ));
    println!("{report}");
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[derive(Debug, Clone)]
struct Ingest {
    blocks: usize,
    secs: f64,
    gaps: u64,
    rss_mib_per_million: Option<f64>,
}

fn fmt_ingest(r: &Result<Ingest, String>) -> String {
    match r {
        Ok(i) => format!(
            "{:.2} M blocks/s ({:.2} s{})",
            i.blocks as f64 / i.secs / 1e6,
            i.secs,
            if i.gaps > 0 {
                format!(", {} gaps repaired", i.gaps)
            } else {
                String::new()
            }
        ),
        Err(e) => format!("failed: {e}"),
    }
}

fn fmt_query(name: &str, q: &Result<QueryStats, String>) -> String {
    match q {
        Ok(phases) => phases
            .iter()
            .map(|p| {
                format!(
                    "| {name} | {}{} | {:.0} | {:.0} µs | {:.0} µs |\n",
                    p.conns,
                    if p.errors > 0 {
                        format!(" ({} errors)", p.errors)
                    } else {
                        String::new()
                    },
                    p.rps,
                    p.p50_us,
                    p.p99_us
                )
            })
            .collect(),
        Err(e) => format!("| {name} | failed: {e} | | | |\n"),
    }
}

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime")
}

fn rss_bytes(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".into(),
    };
    let s = std::fs::read_to_string(path).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Tokens of chain `chain`, block `i`: the first block names the chain, the rest repeat (the
/// sequence hashes still differ through the chaining).
fn chain_tokens(chain: usize, blocks: usize) -> Vec<u32> {
    let mut t: Vec<u32> = (0..blocks * BS).map(|i| (i % 100) as u32).collect();
    t[0] = (chain % 30_000) as u32 + 1000;
    t[1] = (chain / 30_000) as u32 + 1000;
    t
}

fn chain_event(chain: usize, blocks: usize) -> KvEvent {
    let tokens = chain_tokens(chain, blocks);
    KvEvent::BlockStored {
        parent: None,
        blocks: tokens
            .chunks(BS)
            .enumerate()
            .map(|(i, t)| StoredBlock {
                hash: engine_hash(chain as u64, i as u64),
                tokens: t.to_vec(),
                block_hash: None,
            })
            .collect(),
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    }
}

/// An engine hash as vLLM and SGLang make them: uniformly distributed (sha256-derived).
fn engine_hash(chain: u64, i: u64) -> EngineHash {
    // splitmix64 of (chain, i).
    let mut z = (chain << 20 | i).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    EngineHash(z ^ (z >> 31))
}

/// Pre-encoded payloads: per publisher, batches of 16 chains of 64 blocks (1,024 blocks).
fn payloads(publishers: usize, blocks: usize) -> Vec<Vec<Vec<u8>>> {
    const CHAIN: usize = 64;
    const PER_BATCH: usize = 16;
    let chains = blocks / CHAIN;
    let mut out = vec![Vec::new(); publishers];
    let mut chain = 0;
    let per_pub = chains / publishers;
    for (p, batches) in out.iter_mut().enumerate() {
        let mut left = per_pub + usize::from(p < chains % publishers);
        while left > 0 {
            let n = left.min(PER_BATCH);
            let events: Vec<KvEvent> = (0..n).map(|i| chain_event(chain + i, CHAIN)).collect();
            chain += n;
            left -= n;
            batches.push(encode(&events));
        }
    }
    out
}

fn reg(i: usize, p: &Publisher) -> RegisterRequest {
    RegisterRequest {
        instance_id: (i + 1).to_string(),
        endpoint: p.endpoint.clone(),
        replay_endpoint: p.replay_endpoint.clone(),
        model_name: MODEL.into(),
        tenant_id: None,
        block_size: BS as u32,
        dp_rank: Some(0),
        lora_name: None,
        cache_salt: None,
        address: Some(format!("127.0.0.1:{}", 18000 + i)),
    }
}

fn ingest_ours(publishers: usize, blocks: usize) -> Result<Ingest, String> {
    let payloads = payloads(publishers, blocks);
    let total_blocks: usize = blocks / 64 * 64;
    let server = runtime(1);
    let client = runtime(1);
    let pubs = start_publishers(&client, publishers)?;
    let config = Config {
        max_blocks_per_worker: 1 << 24,
        feed_log_entries: 1 << 16,
        ..Config::default()
    };
    let state = server.block_on(async {
        let state = Shared::new(config);
        for (i, p) in pubs.iter().enumerate() {
            state.register(reg(i, p)).map_err(|e| e.to_string())?;
        }
        let ok = state
            .wait_until(Duration::from_secs(10), |h| {
                h.workers()
                    .all(|w| w.status.connected && w.status.replays > 0)
            })
            .await;
        if !ok {
            return Err("publishers did not connect".to_string());
        }
        Ok(state)
    })?;
    // Let the subscriptions land before timing.
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    publish_all(&client, &pubs, payloads);
    let done = server.block_on(state.wait_until(Duration::from_secs(120), |h| {
        h.index.stats().holds >= total_blocks
    }));
    let secs = started.elapsed().as_secs_f64();
    let gaps = state.read().workers().map(|w| w.status.gaps).sum();
    state.stop_subscribers();
    if !done {
        return Err(format!(
            "only {} of {total_blocks} blocks after 120 s",
            state.read().index.stats().holds
        ));
    }
    drop(server);
    client.block_on(async {
        for p in pubs {
            p.close().await;
        }
    });
    Ok(Ingest {
        blocks: total_blocks,
        secs,
        gaps,
        rss_mib_per_million: None,
    })
}

fn ingest_dynamo(python: &str, publishers: usize, blocks: usize) -> Result<Ingest, String> {
    let d = start_dynamo(python)?;
    let base_rss = rss_bytes(Some(d.child.id()));
    let payloads = payloads(publishers, blocks);
    let total_blocks = blocks / 64 * 64;
    // The last chain of each publisher: matched in full means everything before it was applied.
    let chains = blocks / 64;
    let per_pub = chains / publishers;
    let mut last_chain = Vec::new();
    let mut c = 0;
    for p in 0..publishers {
        c += per_pub + usize::from(p < chains % publishers);
        last_chain.push(c - 1);
    }
    let client = runtime(1);
    let pubs = start_publishers(&client, publishers)?;
    for (i, p) in pubs.iter().enumerate() {
        dynamo_register(&d, i, p, MODEL, BS)?;
    }
    // Dynamo's subscriber loses what is published in its first ~1.5 s (runnable_peers.md).
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    publish_all(&client, &pubs, payloads);
    let until = Instant::now() + Duration::from_secs(300);
    for (i, &chain) in last_chain.iter().enumerate() {
        let tokens = chain_tokens(chain, 64);
        while dynamo_longest(&d, &tokens, i, MODEL) < (64 * BS) as u64 {
            if Instant::now() > until {
                return Err(format!("publisher {i}: last chain not indexed after 300 s"));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let rss = rss_bytes(Some(d.child.id()));
    let rss_mib_per_million = match (base_rss, rss) {
        (Some(a), Some(b)) => {
            Some((b.saturating_sub(a)) as f64 / (1 << 20) as f64 / (total_blocks as f64 / 1e6))
        }
        _ => None,
    };
    client.block_on(async {
        for p in pubs {
            p.close().await;
        }
    });
    Ok(Ingest {
        blocks: total_blocks,
        secs,
        gaps: 0,
        rss_mib_per_million,
    })
}

/// Events of the /query index: worker w holds the first (w+1)·64 blocks of the 512-block
/// prompt, plus filler chains up to 12,500 blocks.
fn query_index_batches() -> (Vec<u32>, Vec<Vec<Vec<u8>>>) {
    let prompt: Vec<u32> = (0..512 * BS as u32).map(|i| i * 7 % 50_000).collect();
    let mut out = Vec::new();
    for w in 0..8usize {
        let mut batches = Vec::new();
        let depth = (w + 1) * 64;
        let ev = KvEvent::BlockStored {
            parent: None,
            blocks: prompt[..depth * BS]
                .chunks(BS)
                .enumerate()
                .map(|(i, t)| StoredBlock {
                    hash: engine_hash(1 << 40, i as u64),
                    tokens: t.to_vec(),
                    block_hash: None,
                })
                .collect(),
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        };
        batches.push(encode(&[ev]));
        let mut left = 12_500 - depth;
        let mut chain = w * 1000;
        while left > 0 {
            let n = left.min(64);
            let events = vec![chain_event(chain, n)];
            chain += 1;
            left -= n;
            batches.push(encode(&events));
        }
        out.push(batches);
    }
    (prompt, out)
}

fn query_ours(args: &CollectorArgs) -> Result<QueryStats, String> {
    let (prompt, batches) = query_index_batches();
    // HTTP serving may use both cores, as Dynamo's server does.
    let server = runtime(2);
    let client = runtime(1);
    let pubs = start_publishers(&client, 8)?;
    let (state, addr) = server.block_on(async {
        let state = Shared::new(Config::default());
        for (i, p) in pubs.iter().enumerate() {
            state.register(reg(i, p)).map_err(|e| e.to_string())?;
        }
        state
            .wait_until(Duration::from_secs(10), |h| {
                h.workers().all(|w| w.status.replays > 0)
            })
            .await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let s = state.clone();
        tokio::spawn(
            async move { kvroute_collector::serve(listener, s, std::future::pending()).await },
        );
        Ok::<_, String>((state, addr))
    })?;
    std::thread::sleep(Duration::from_millis(300));
    publish_all(&client, &pubs, batches);
    let ok = server.block_on(state.wait_until(Duration::from_secs(60), |h| {
        h.index.stats().holds >= 100_000
    }));
    if !ok {
        return Err(format!(
            "index has {} holds",
            state.read().index.stats().holds
        ));
    }
    // Where a request's server time goes, without the network.
    let body = serde_json::json!({"token_ids": prompt, "model_name": MODEL}).to_string();
    let t = Instant::now();
    for _ in 0..1000 {
        std::hint::black_box(kvroute_collector::fastjson::parse_query(
            std::hint::black_box(body.as_bytes()),
        ));
    }
    let parse_us = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    for _ in 0..1000 {
        let _ = std::hint::black_box(state.read().query_tokens(&prompt, MODEL, None, None, None));
    }
    let query_us = t.elapsed().as_secs_f64() * 1e3;
    eprintln!("server work per /query: body scan {parse_us:.1} µs, hash + match {query_us:.1} µs");
    let stats = load(addr, &prompt, MODEL, &args.concurrency, args.seconds);
    // Check the answer is right.
    let check = server
        .block_on(async { state.read().query_tokens(&prompt, MODEL, None, None, None) })
        .map_err(|e| e.to_string())?;
    if check.instances.get("8").map(|m| m.longest_matched) != Some(8192) {
        return Err("wrong match for worker 8".into());
    }
    state.stop_subscribers();
    stats
}

fn query_dynamo(python: &str, args: &CollectorArgs) -> Result<QueryStats, String> {
    let d = start_dynamo(python)?;
    let (prompt, batches) = query_index_batches();
    let client = runtime(1);
    let pubs = start_publishers(&client, 8)?;
    for (i, p) in pubs.iter().enumerate() {
        dynamo_register(&d, i, p, MODEL, BS)?;
    }
    std::thread::sleep(Duration::from_secs(2));
    publish_all(&client, &pubs, batches);
    let until = Instant::now() + Duration::from_secs(120);
    while dynamo_longest(&d, &prompt, 7, MODEL) < 8192 {
        if Instant::now() > until {
            return Err("Dynamo did not index the prompt".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Filler last: wait a little for the rest of the events.
    std::thread::sleep(Duration::from_secs(1));
    load(d.addr, &prompt, MODEL, &args.concurrency, args.seconds)
}

/// RSS per million (block, holder) entries: 8 workers share half their blocks.
fn rss_per_million(entries: usize) -> f64 {
    let rt = runtime(1);
    rt.block_on(async {
        let state = Shared::new(Config {
            max_blocks_per_worker: 1 << 24,
            feed_log_entries: 1,
            ..Config::default()
        });
        let mut ids = Vec::new();
        for i in 0..8 {
            let r = RegisterRequest {
                instance_id: format!("w{i}"),
                endpoint: "tcp://127.0.0.1:1".into(),
                replay_endpoint: None,
                model_name: MODEL.into(),
                tenant_id: None,
                block_size: BS as u32,
                dp_rank: None,
                lora_name: None,
                cache_salt: None,
                address: Some("127.0.0.1:1".into()),
            };
            // Registered in the hub only: no subscriber needed.
            match state.write().register(r) {
                Ok(kvroute_collector::hub::Registered::New(id)) => ids.push(id),
                other => panic!("register: {other:?}"),
            }
        }
        let before = rss_bytes(None).unwrap_or(0);
        let per_worker = entries / 8;
        let mut chain = 0;
        for (w, &id) in ids.iter().enumerate() {
            let mut done = 0;
            let mut seq = 0;
            while done < per_worker {
                // Workers pair up on the same chains: every block has 2 holders.
                let c = chain + (w / 2) * 1_000_000;
                let events: Vec<KvEvent> = (0..16).map(|i| chain_event(c + i, 64)).collect();
                let batch = kvroute_collector::decode::decode(&encode(&events)).expect("decode");
                state.apply_batch_blocking(id, seq, batch);
                seq += 1;
                chain += 16;
                done += 16 * 64;
            }
            chain = 0;
        }
        let holds = state.read().index.stats().holds;
        let after = rss_bytes(None).unwrap_or(0);
        eprintln!(
            "rss: {holds} holds, {} blocks",
            state.read().index.stats().blocks
        );
        (after.saturating_sub(before)) as f64 / (1 << 20) as f64 / (holds as f64 / 1e6)
    })
}
