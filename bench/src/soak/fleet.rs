//! The well-behaved side of the soak: engines registered over `/register` and publishing
//! stores, removals and clears; a `/query` client; a `/v1/feed` follower.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_sim::publisher::Publisher;

use super::types::{SoakArgs, Tally, BS, MODEL, PREFIXES};

pub(super) async fn register(
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

pub(super) async fn register_endpoint(
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

pub(super) async fn unregister(http: &reqwest::Client, base: &str, instance: &str) {
    let body = serde_json::json!({"instance_id": instance, "model_name": MODEL});
    let _ = http
        .post(format!("{base}/unregister"))
        .json(&body)
        .send()
        .await;
}

/// A prompt: one of the shared system prompts (8 blocks), then `extra` blocks of its own.
pub(super) fn prompt(rng: &mut fastrand::Rng, extra: usize) -> Vec<u32> {
    let p = rng.u32(0..PREFIXES);
    let mut t: Vec<u32> = (0..8 * BS as u32).map(|i| p * 10_000 + i).collect();
    t.extend((0..extra * BS).map(|_| rng.u32(1_000_000..50_000_000)));
    t
}

/// vLLM-style chained block hashes of a prompt's full blocks.
pub(super) fn blocks_of(tokens: &[u32]) -> Vec<StoredBlock> {
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
                block_hash: None,
            }
        })
        .collect()
}

/// One engine: a store per step, evictions past its cache size, a rare clear.
pub(super) async fn engine(
    p: Publisher,
    args: SoakArgs,
    seed: u64,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
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

pub(super) async fn querier(
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
pub(super) async fn feed_follower(
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
