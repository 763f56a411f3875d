//! `kvroute-bench soak`: the real `kvroute-collector` binary under a steady fleet and hostile
//! peers for `--minutes`, its memory sampled every second (issue 11).
//!
//! - **fleet**: `--engines` simulated vLLM engines (`kvroute_sim::publisher`, real ZMQ on
//!   loopback), registered over `/register`. Each stores prompts that share system-prompt
//!   prefixes, removes its oldest blocks past `--engine-blocks` (an engine's cache is bounded,
//!   so the index should be too) and now and then clears everything.
//! - **readers**: `/query` with prompts from the same prefixes, a `/v1/feed` follower, and
//!   `/health`, `/query` probes each second.
//! - **hostile peers**, one at a time at random intervals: a ZMQ PUB whose frame header
//!   claims 2^62 bytes, one sending a frame over `--max-zmq-message-bytes`, an alias flood
//!   (a fresh `lora_name` per event), a dp-rank flood, half-sent HTTP headers, slow bodies,
//!   bad `/v1/load` reports. Each flooding engine unregisters when done.
//!
//! At the end: peak RSS, the least-squares slope of RSS over the second half (KiB/min), what
//! `/metrics` says was refused, and whether the process stayed up and kept answering. JSON and
//! markdown go to `--out` (`bench-out/soak/`).

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{self, EventFormat, WireEvent};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Flags of `kvroute-bench soak`.
#[derive(clap::Args, Debug, Clone)]
pub struct SoakArgs {
    /// Length of the run.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Simulated engines publishing valid events.
    #[arg(long, default_value_t = 64)]
    engines: usize,
    /// The collector binary [default: $CARGO_TARGET_DIR/native/kvroute-collector].
    #[arg(long)]
    collector: Option<PathBuf>,
    /// Where soak.json and soak.md go.
    #[arg(long, default_value = "bench-out/soak")]
    out: PathBuf,
    /// Blocks one engine's cache holds; past it the engine evicts its oldest.
    #[arg(long, default_value_t = 8192)]
    engine_blocks: usize,
    /// Mean interval between one engine's batches, milliseconds.
    #[arg(long, default_value_t = 250)]
    batch_ms: u64,
    /// `/query` requests per second (one client).
    #[arg(long, default_value_t = 50)]
    query_rate: u64,
    /// The collector's `--max-zmq-message-bytes`.
    #[arg(long, default_value_t = 1 << 20)]
    max_zmq_message_bytes: usize,
    /// Mean seconds between hostile peers.
    #[arg(long, default_value_t = 6.0)]
    hostile_every: f64,
    /// Seed of the workload's randomness.
    #[arg(long, default_value_t = 11)]
    seed: u64,
}

const MODEL: &str = "soak-model";
const BS: usize = 16;
/// System prompts the fleet's prompts start with, so queries find shared prefixes.
const PREFIXES: u32 = 64;

/// One second's sample.
#[derive(Clone, Debug, Serialize)]
struct Sample {
    t: f64,
    rss_kib: u64,
    health: u16,
    query: u16,
}

/// What the clients saw, counted as they go.
#[derive(Default)]
struct Tally {
    batches: AtomicU64,
    stores: AtomicU64,
    removals: AtomicU64,
    clears: AtomicU64,
    queries_ok: AtomicU64,
    queries_failed: AtomicU64,
    queries_matched: AtomicU64,
    feed_pages: AtomicU64,
    feed_failed: AtomicU64,
    feed_resets: AtomicU64,
    query_us: Mutex<Vec<u32>>,
    hostile: Mutex<Vec<(f64, &'static str, String)>>,
}

#[derive(Debug, Serialize)]
struct Report {
    minutes: f64,
    engines: usize,
    cores: usize,
    collector_alive_at_end: bool,
    samples: usize,
    peak_rss_kib: u64,
    end_rss_kib: u64,
    slope_second_half_kib_per_min: f64,
    health_failures: usize,
    query_probe_failures: usize,
    batches: u64,
    stores: u64,
    removals: u64,
    clears: u64,
    queries_ok: u64,
    queries_failed: u64,
    queries_matched: u64,
    query_p50_ms: f64,
    query_p99_ms: f64,
    feed_pages: u64,
    feed_failed: u64,
    feed_resets: u64,
    hostile_runs: Vec<(String, usize)>,
    /// (seconds since start, kind, what it saw) of every hostile peer.
    hostile_log: Vec<(f64, &'static str, String)>,
    refused: Vec<(String, f64)>,
    rss: Vec<Sample>,
}

/// Runs the soak; writes the report files and prints the markdown.
pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(soak(args))
}

fn collector_bin(args: &SoakArgs) -> PathBuf {
    args.collector.clone().unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        PathBuf::from(dir).join("native/kvroute-collector")
    })
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn soak(args: SoakArgs) -> anyhow::Result<()> {
    let bin = collector_bin(&args);
    let addr = format!("127.0.0.1:{}", free_port()?);
    let base = format!("http://{addr}");
    // Short header and body timeouts so the half-sent requests are cut within the run; no
    // engine scrapes (the engines' HTTP addresses are made up).
    let mut child = tokio::process::Command::new(&bin)
        .args(["--listen", &addr, "--default-serving-port", "8000"])
        .args([
            "--max-zmq-message-bytes",
            &args.max_zmq_message_bytes.to_string(),
        ])
        .args([
            "--header-read-timeout-secs",
            "2",
            "--body-read-timeout-secs",
            "2",
        ])
        .args(["--scrape-interval-secs", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id().context("collector pid")?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let up = Instant::now() + Duration::from_secs(20);
    while !http
        .get(format!("{base}/health"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        anyhow::ensure!(Instant::now() < up, "the collector did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "soak: collector pid {pid} on {addr}, {} engines, {} min",
        args.engines, args.minutes
    );

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for e in 0..args.engines {
        let p = Publisher::start(PublisherConfig::loopback(EventFormat::Vllm033))
            .await
            .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
        register(&http, &base, &format!("engine-{e}"), &p, e as u32).await?;
        tasks.push(tokio::spawn(engine(
            p,
            args.clone(),
            args.seed ^ ((e as u64 + 1) * 0x9e37_79b9),
            tally.clone(),
            stop.clone(),
        )));
    }
    tasks.push(tokio::spawn(querier(
        http.clone(),
        base.clone(),
        args.clone(),
        tally.clone(),
        stop.clone(),
    )));
    tasks.push(tokio::spawn(feed_follower(
        http.clone(),
        base.clone(),
        tally.clone(),
        stop.clone(),
    )));
    tasks.push(tokio::spawn(hostile(
        http.clone(),
        base.clone(),
        addr.clone(),
        args.clone(),
        tally.clone(),
        stop.clone(),
        start,
    )));

    let mut samples = Vec::new();
    let until = start + Duration::from_secs_f64(args.minutes * 60.0);
    let mut alive = true;
    let probe_prompt = prompt(&mut fastrand::Rng::with_seed(args.seed), 8);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < until {
        tick.tick().await;
        if child.try_wait()?.is_some() {
            alive = false;
            eprintln!("soak: the collector exited");
            break;
        }
        let health = status(http.get(format!("{base}/health")).send().await);
        let query = status(
            http.post(format!("{base}/query"))
                .json(&serde_json::json!({"token_ids": probe_prompt, "model_name": MODEL}))
                .send()
                .await,
        );
        let rss_kib = rss_kib(pid).unwrap_or(0);
        let t = start.elapsed().as_secs_f64();
        if samples.len() % 60 == 0 {
            eprintln!("soak: {t:.0} s, RSS {rss_kib} KiB, health {health}, query {query}");
        }
        samples.push(Sample {
            t,
            rss_kib,
            health,
            query,
        });
    }
    stop.store(true, Ordering::Relaxed);
    let metrics = match http.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    alive &= child.try_wait()?.is_none();
    for t in tasks {
        t.abort();
    }
    let _ = child.kill().await;

    let report = summarize(&args, &tally, samples, &metrics, alive);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let md = markdown(&report);
    std::fs::write(
        args.out.join("soak.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    std::fs::write(args.out.join("soak.md"), &md)?;
    print!("{md}");
    anyhow::ensure!(
        report.collector_alive_at_end,
        "the collector did not stay up"
    );
    Ok(())
}

fn status(r: reqwest::Result<reqwest::Response>) -> u16 {
    r.map_or(0, |r| r.status().as_u16())
}

/// Resident set size from /proc/<pid>/status, KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

async fn register(
    http: &reqwest::Client,
    base: &str,
    instance: &str,
    p: &Publisher,
    n: u32,
) -> anyhow::Result<()> {
    register_endpoint(
        http,
        base,
        instance,
        &p.endpoint,
        p.replay_endpoint.as_deref(),
        n,
    )
    .await
}

async fn register_endpoint(
    http: &reqwest::Client,
    base: &str,
    instance: &str,
    endpoint: &str,
    replay: Option<&str>,
    n: u32,
) -> anyhow::Result<()> {
    let body = serde_json::json!({
        "instance_id": instance,
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "model_name": MODEL,
        "block_size": BS,
        "address": format!("10.{}.{}.{}:8000", n >> 16 & 255, n >> 8 & 255, n & 255),
    });
    let r = http
        .post(format!("{base}/register"))
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(
        r.status().is_success(),
        "register {instance}: {}",
        r.status()
    );
    Ok(())
}

async fn unregister(http: &reqwest::Client, base: &str, instance: &str) {
    let body = serde_json::json!({"instance_id": instance, "model_name": MODEL});
    let _ = http
        .post(format!("{base}/unregister"))
        .json(&body)
        .send()
        .await;
}

/// A prompt: one of the shared system prompts (8 blocks), then `extra` blocks of its own.
fn prompt(rng: &mut fastrand::Rng, extra: usize) -> Vec<u32> {
    let p = rng.u32(0..PREFIXES);
    let mut t: Vec<u32> = (0..8 * BS as u32).map(|i| p * 10_000 + i).collect();
    t.extend((0..extra * BS).map(|_| rng.u32(1_000_000..50_000_000)));
    t
}

/// vLLM-style chained block hashes of a prompt's full blocks.
fn blocks_of(tokens: &[u32]) -> Vec<StoredBlock> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(BS)
        .map(|c| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (parent, c).hash(&mut h);
            parent = h.finish();
            StoredBlock {
                hash: EngineHash(parent),
                tokens: c.to_vec(),
            }
        })
        .collect()
}

/// One engine: a store per step, evictions past its cache size, a rare clear.
async fn engine(p: Publisher, args: SoakArgs, seed: u64, tally: Arc<Tally>, stop: Arc<AtomicBool>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut held: VecDeque<u64> = VecDeque::new();
    let mut seen = std::collections::HashSet::new();
    while !stop.load(Ordering::Relaxed) {
        let gap = args.batch_ms / 2 + rng.u64(0..=args.batch_ms);
        tokio::time::sleep(Duration::from_millis(gap)).await;
        let mut events = Vec::new();
        // About one clear per engine per 20 minutes at the default rate.
        if rng.u32(0..4800) == 0 {
            events.push(KvEvent::AllBlocksCleared);
            held.clear();
            seen.clear();
            tally.clears.fetch_add(1, Ordering::Relaxed);
        } else {
            let extra = rng.usize(1..40);
            let blocks: Vec<StoredBlock> = blocks_of(&prompt(&mut rng, extra))
                .into_iter()
                .filter(|b| seen.insert(b.hash.0))
                .collect();
            held.extend(blocks.iter().map(|b| b.hash.0));
            tally
                .stores
                .fetch_add(blocks.len() as u64, Ordering::Relaxed);
            // The engine re-announces only new blocks; a prompt all cached stores nothing.
            if !blocks.is_empty() {
                events.push(KvEvent::BlockStored {
                    parent: None,
                    blocks,
                    tier: Tier::Gpu,
                    lora_name: None,
                    cache_salt: None,
                });
            }
            let over = held.len().saturating_sub(args.engine_blocks);
            if over > 0 {
                let hashes: Vec<EngineHash> = held
                    .drain(..over)
                    .inspect(|h| {
                        seen.remove(h);
                    })
                    .map(EngineHash)
                    .collect();
                tally
                    .removals
                    .fetch_add(hashes.len() as u64, Ordering::Relaxed);
                events.push(KvEvent::BlockRemoved {
                    hashes,
                    tier: Tier::Gpu,
                });
            }
        }
        p.publish_events(&events);
        tally.batches.fetch_add(1, Ordering::Relaxed);
    }
}

async fn querier(
    http: reqwest::Client,
    base: String,
    args: SoakArgs,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = fastrand::Rng::with_seed(args.seed ^ 0x51);
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / args.query_rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let extra = rng.usize(0..32);
        let body = serde_json::json!({"token_ids": prompt(&mut rng, extra), "model_name": MODEL});
        let at = Instant::now();
        let r = http.post(format!("{base}/query")).json(&body).send().await;
        let ok = match r {
            Ok(r) if r.status().is_success() => r.json::<serde_json::Value>().await.ok(),
            _ => None,
        };
        let us = at.elapsed().as_micros().min(u32::MAX as u128) as u32;
        match ok {
            Some(v) => {
                tally.queries_ok.fetch_add(1, Ordering::Relaxed);
                let matched = v["instances"]
                    .as_object()
                    .is_some_and(|m| m.values().any(|i| i["longest_matched"].as_u64() > Some(0)));
                tally
                    .queries_matched
                    .fetch_add(u64::from(matched), Ordering::Relaxed);
                if let Ok(mut l) = tally.query_us.lock() {
                    l.push(us);
                }
            }
            None => {
                tally.queries_failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Follows `/v1/feed` as a gateway would: epoch and cursor from each page.
async fn feed_follower(
    http: reqwest::Client,
    base: String,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
    let mut at: Option<(u64, u64)> = None;
    while !stop.load(Ordering::Relaxed) {
        let url = match at {
            Some((e, c)) => format!("{base}/v1/feed?epoch={e}&since={c}"),
            None => format!("{base}/v1/feed"),
        };
        let page = match http.get(url).send().await {
            Ok(r) if r.status().is_success() => r.bytes().await.ok(),
            _ => None,
        };
        match page.as_deref().map(kvroute::feed::Page::decode) {
            Some(Ok(p)) => {
                tally.feed_pages.fetch_add(1, Ordering::Relaxed);
                tally
                    .feed_resets
                    .fetch_add(u64::from(p.is_reset()), Ordering::Relaxed);
                at = Some((p.epoch, p.cursor));
                if p.has_more() {
                    continue;
                }
            }
            _ => {
                tally.feed_failed.fetch_add(1, Ordering::Relaxed);
                at = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

const KINDS: [&str; 7] = [
    "zmq_header_2^62",
    "zmq_oversized_frame",
    "alias_flood",
    "dp_rank_flood",
    "half_sent_headers",
    "slow_bodies",
    "bad_load_reports",
];

/// One hostile peer after another, at random intervals, until stopped.
#[allow(clippy::too_many_arguments)]
async fn hostile(
    http: reqwest::Client,
    base: String,
    addr: String,
    args: SoakArgs,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
    start: Instant,
) {
    let mut rng = fastrand::Rng::with_seed(args.seed ^ 0xbad);
    let mut n = 0u32;
    while !stop.load(Ordering::Relaxed) {
        let wait = args.hostile_every * (0.5 + rng.f64());
        tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        let kind = KINDS[rng.usize(0..KINDS.len())];
        n += 1;
        let name = format!("hostile-{n}");
        let outcome = match kind {
            "zmq_header_2^62" => zmq_attack(&http, &base, &name, n, 1 << 62, 0).await,
            "zmq_oversized_frame" => {
                let len = 2 * args.max_zmq_message_bytes;
                zmq_attack(&http, &base, &name, n, len as u64, len).await
            }
            "alias_flood" => flood(&http, &base, &name, n, &mut rng, false).await,
            "dp_rank_flood" => flood(&http, &base, &name, n, &mut rng, true).await,
            "half_sent_headers" => half_sent(&addr, false).await,
            "slow_bodies" => half_sent(&addr, true).await,
            _ => bad_loads(&http, &base).await,
        };
        let note = match outcome {
            Ok(s) => s,
            Err(e) => format!("error: {e:#}"),
        };
        if let Ok(mut h) = tally.hostile.lock() {
            h.push((start.elapsed().as_secs_f64(), kind, note));
        }
    }
}

/// The ZMTP 3.0 greeting (NULL mechanism) and READY as a PUB.
fn zmtp_hello() -> (Vec<u8>, Vec<u8>) {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut ready = vec![0x04, body.len() as u8];
    ready.extend_from_slice(&body);
    (g, ready)
}

/// A fake PUB registered as an engine: each connection of the collector gets a long-frame
/// header claiming `claim` bytes followed by `send` bytes. Unregistered after 3 s.
async fn zmq_attack(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    n: u32,
    claim: u64,
    send: usize,
) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("tcp://{}", listener.local_addr()?);
    let server = tokio::spawn(async move {
        let mut conns = 0u32;
        while let Ok((mut s, _)) = listener.accept().await {
            conns += 1;
            tokio::spawn(async move {
                let (greeting, ready) = zmtp_hello();
                let mut peer = [0u8; 64];
                if s.write_all(&greeting).await.is_err() || s.read_exact(&mut peer).await.is_err() {
                    return;
                }
                let _ = s.write_all(&ready).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut frame = vec![0x02u8];
                frame.extend_from_slice(&claim.to_be_bytes());
                frame.resize(frame.len() + send, 0xab);
                let _ = s.write_all(&frame).await;
                // Drain until the collector hangs up, at most 5 s.
                let mut sink = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    while s.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                })
                .await;
            });
            let _ = conns;
        }
    });
    register_endpoint(http, base, name, &endpoint, None, 0x10000 + n).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    unregister(http, base, name).await;
    server.abort();
    Ok(format!("claim {claim} bytes, sent {send}"))
}

/// An engine that floods fresh LoRA names (or dp ranks), 400 events, then unregisters.
async fn flood(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    n: u32,
    rng: &mut fastrand::Rng,
    dp: bool,
) -> anyhow::Result<String> {
    let p = Publisher::start(PublisherConfig::loopback(EventFormat::Vllm033))
        .await
        .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
    register(http, base, name, &p, 0x20000 + n).await?;
    // Let the collector subscribe before the flood: PUB drops what comes before.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let salt = rng.u64(..);
    for i in 0..400u64 {
        let blocks = blocks_of(&prompt(rng, 1));
        let lora = (!dp).then(|| format!("lora-{salt:x}-{i}"));
        let ev = KvEvent::BlockStored {
            parent: None,
            blocks,
            tier: Tier::Gpu,
            lora_name: lora,
            cache_salt: None,
        };
        if dp {
            let c = p.config();
            let wire: Vec<WireEvent> = [ev].iter().map(WireEvent::from).collect();
            p.publish(wire::encode_batch(
                c.format,
                c.extras,
                1.0,
                &wire,
                Some(1 + i as u32),
            ));
        } else {
            p.publish_events(&[ev]);
        }
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    unregister(http, base, name).await;
    p.close().await;
    Ok("400 events".into())
}

/// 40 connections that send half a request (headers, or headers and a trickle of body) and
/// hold it for 6 s; the collector's timeouts should cut them.
async fn half_sent(addr: &str, body: bool) -> anyhow::Result<String> {
    let mut conns = Vec::new();
    for _ in 0..40 {
        let addr = addr.to_owned();
        conns.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(&addr).await.ok()?;
            let head: &[u8] = if body {
                b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"token_ids\":["
            } else {
                b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-le"
            };
            s.write_all(head).await.ok()?;
            let mut buf = [0u8; 512];
            let cut = tokio::time::timeout(Duration::from_secs(6), async {
                loop {
                    if body && s.write_all(b"1,").await.is_err() {
                        return true;
                    }
                    match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => return true,
                        Ok(Ok(_)) => {}
                        Err(_) => {}
                    }
                }
            })
            .await
            .unwrap_or(false);
            Some(cut)
        }));
    }
    let mut cut = 0;
    for c in conns {
        if let Ok(Some(true)) = c.await {
            cut += 1;
        }
    }
    Ok(format!("{cut} of 40 cut by the collector"))
}

/// Load reports that must all be refused with a 4xx.
async fn bad_loads(http: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let bodies: [(&str, String); 5] = [
        ("not json", "{\"gateway\":".into()),
        (
            "empty gateway",
            r#"{"gateway":"","epoch":0,"workers":[]}"#.into(),
        ),
        (
            "wrong epoch",
            r#"{"gateway":"g","epoch":999999999,"workers":[]}"#.into(),
        ),
        (
            "unknown worker",
            r#"{"gateway":"g","epoch":0,"workers":[{"worker":4000000}]}"#.into(),
        ),
        (
            "too many entries",
            serde_json::json!({"gateway": "g", "epoch": 0,
                "workers": (0..5000).map(|w| serde_json::json!({"worker": w})).collect::<Vec<_>>()})
            .to_string(),
        ),
    ];
    // The refusals past the epoch check need the current epoch: a feed page names it.
    let epoch = match http.get(format!("{base}/v1/feed")).send().await {
        Ok(r) => kvroute::feed::Page::decode(&r.bytes().await?).map_or(0, |p| p.epoch),
        Err(_) => 0,
    };
    let mut out = Vec::new();
    for (what, b) in bodies {
        let b = b.replace("\"epoch\":0", &format!("\"epoch\":{epoch}"));
        let r = http
            .post(format!("{base}/v1/load"))
            .header("content-type", "application/json")
            .body(b)
            .send()
            .await?;
        out.push(format!("{what}: {}", r.status().as_u16()));
    }
    Ok(out.join(", "))
}

/// Slope of the least-squares line through (t, y), per unit of t.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

/// Counters of what the collector refused, summed over instances, from `/metrics`.
fn refused(metrics: &str) -> Vec<(String, f64)> {
    const NAMES: [&str; 6] = [
        "kvroute_limited_total",
        "kvroute_zmq_protocol_errors_total",
        "kvroute_http_connections_refused_total",
        "kvroute_load_reports_refused_total",
        "kvroute_skipped_total",
        "kvroute_decode_errors_total",
    ];
    let mut out: Vec<(String, f64)> = Vec::new();
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some(name) = NAMES.iter().find(|n| line.starts_with(*n)) else {
            continue;
        };
        let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        // Keep the reason label; instances are summed.
        let reason = line
            .split("reason=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .map(|r| format!("{{reason=\"{r}\"}}"))
            .unwrap_or_default();
        let key = format!("{name}{reason}");
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, s)) => *s += v,
            None => out.push((key, v)),
        }
    }
    out
}

fn summarize(
    args: &SoakArgs,
    tally: &Tally,
    rss: Vec<Sample>,
    metrics: &str,
    alive: bool,
) -> Report {
    let half = rss.len() / 2;
    let second: Vec<(f64, f64)> = rss[half..]
        .iter()
        .map(|s| (s.t / 60.0, s.rss_kib as f64))
        .collect();
    let mut lat = tally.query_us.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_unstable();
    let pct = |q: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * q) as usize)
            .map_or(0.0, |&us| us as f64 / 1e3)
    };
    let hostile = tally.hostile.lock().map(|h| h.clone()).unwrap_or_default();
    let hostile_runs = KINDS
        .iter()
        .map(|k| (k.to_string(), hostile.iter().filter(|h| h.1 == *k).count()))
        .collect();
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Report {
        minutes: rss.last().map_or(0.0, |s| s.t / 60.0),
        engines: args.engines,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        collector_alive_at_end: alive,
        samples: rss.len(),
        peak_rss_kib: rss.iter().map(|s| s.rss_kib).max().unwrap_or(0),
        end_rss_kib: rss.last().map_or(0, |s| s.rss_kib),
        slope_second_half_kib_per_min: slope(&second),
        health_failures: rss.iter().filter(|s| s.health != 200).count(),
        query_probe_failures: rss.iter().filter(|s| s.query != 200).count(),
        batches: get(&tally.batches),
        stores: get(&tally.stores),
        removals: get(&tally.removals),
        clears: get(&tally.clears),
        queries_ok: get(&tally.queries_ok),
        queries_failed: get(&tally.queries_failed),
        queries_matched: get(&tally.queries_matched),
        query_p50_ms: pct(0.5),
        query_p99_ms: pct(0.99),
        feed_pages: get(&tally.feed_pages),
        feed_failed: get(&tally.feed_failed),
        feed_resets: get(&tally.feed_resets),
        hostile_runs,
        hostile_log: hostile,
        refused: refused(metrics),
        rss,
    }
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# Collector soak\n\n`kvroute-bench soak --engines {}`: {:.1} minutes, {} cores shared with the load generators. Collector {} at the end.\n\n",
        r.engines,
        r.minutes,
        r.cores,
        if r.collector_alive_at_end { "up" } else { "NOT up" }
    );
    s.push_str(&format!(
        "| figure | value |\n|---|---|\n| peak RSS | {:.1} MiB |\n| RSS at the end | {:.1} MiB |\n| RSS slope, second half (least squares) | {:.1} KiB/min |\n| /health probes not 200 | {} of {} |\n| /query probes not 200 | {} of {} |\n| engine batches / blocks stored / removed / clears | {} / {} / {} / {} |\n| /query load: ok / failed / with a match | {} / {} / {} |\n| /query load latency p50 / p99 (client side, HTTP) | {:.2} ms / {:.2} ms |\n| /v1/feed pages / failed / resets | {} / {} / {} |\n",
        r.peak_rss_kib as f64 / 1024.0,
        r.end_rss_kib as f64 / 1024.0,
        r.slope_second_half_kib_per_min,
        r.health_failures,
        r.samples,
        r.query_probe_failures,
        r.samples,
        r.batches,
        r.stores,
        r.removals,
        r.clears,
        r.queries_ok,
        r.queries_failed,
        r.queries_matched,
        r.query_p50_ms,
        r.query_p99_ms,
        r.feed_pages,
        r.feed_failed,
        r.feed_resets,
    ));
    s.push_str("\n## Hostile peers run\n\n| kind | times |\n|---|---|\n");
    for (k, n) in &r.hostile_runs {
        s.push_str(&format!("| {k} | {n} |\n"));
    }
    s.push_str("\n## Refused, from /metrics at the end\n\n| counter | value |\n|---|---|\n");
    for (k, v) in &r.refused {
        s.push_str(&format!("| `{k}` | {v} |\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_is_its_gradient() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 7.0)).collect();
        assert!((slope(&pts) - 3.0).abs() < 1e-9);
        assert_eq!(slope(&pts[..1]), 0.0);
    }

    #[test]
    fn refused_sums_instances_and_keeps_reasons() {
        let m = "# HELP x\nkvroute_limited_total{reason=\"alias_taken\"} 3\nkvroute_zmq_protocol_errors_total{instance=\"a\",dp=\"\"} 2\nkvroute_zmq_protocol_errors_total{instance=\"b\",dp=\"\"} 5\nkvroute_events_total{instance=\"a\"} 9\n";
        let r = refused(m);
        assert_eq!(
            r,
            vec![
                (
                    "kvroute_limited_total{reason=\"alias_taken\"}".to_string(),
                    3.0
                ),
                ("kvroute_zmq_protocol_errors_total".to_string(), 7.0),
            ]
        );
    }
}
