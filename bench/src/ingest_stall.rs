//! `kvroute-bench ingest-stall`: how long a `/query` waits while one engine's huge batch
//! (3.5M blocks by default) goes into the collector's index.
//!
//! In process, on the collector's own [`Shared`] state: a querier thread asks the hub for a
//! small, already-indexed prompt's matches without pause (taking the read lock as the `/query`
//! handler does, so lock waits are in the figure), while [`Shared::apply_batch`] applies the
//! batch on a tokio runtime. Two runs: sliced as the collector does (at most
//! `--slice-blocks` blocks and about 2 ms per hold of the lock) and, as the baseline, the
//! whole batch under one hold of the lock, as before slicing. Then a diagnosis run drives the
//! hub slice by slice and times each hold of the write lock, so the slowest slices can be told
//! apart (a slow slice where the index crosses 7/8 of a power of two is a hash-table resize).
//!
//! Build with `--profile bench` (see `bench/scripts/bench-ingest-stall.sh`); the figures of an
//! unoptimized build mean nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute::api::RegisterRequest;
use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier, WorkerId};
use kvroute_collector::decode::{Batch, DecodeStats};
use kvroute_collector::hub::{IngestJob, Limits, Registered};
use kvroute_collector::{AppState, Config, Shared};

/// Flags of `kvroute-bench ingest-stall`.
#[derive(clap::Args, Debug, Clone)]
pub struct StallArgs {
    /// Blocks in the one huge batch.
    #[arg(long, default_value_t = 3_500_000)]
    blocks: usize,
    /// Most blocks per hold of the index lock in the sliced run (the collector's default).
    #[arg(long, default_value_t = Limits::default().slice_blocks)]
    slice_blocks: usize,
    /// Pause of the querier between queries, in microseconds.
    #[arg(long, default_value_t = 200)]
    query_gap_us: u64,
    /// Slowest slices listed by the diagnosis run.
    #[arg(long, default_value_t = 8)]
    slowest: usize,
}

const MODEL: &str = "stall-model";
const BS: u32 = 4;

/// Query latencies of one run, sorted.
#[derive(Debug)]
struct Run {
    label: String,
    slices: u32,
    batch: Duration,
    lat: Vec<Duration>,
}

impl Run {
    fn pct(&self, q: f64) -> Duration {
        if self.lat.is_empty() {
            return Duration::ZERO;
        }
        self.lat[((self.lat.len() - 1) as f64 * q).round() as usize]
    }
}

fn registration(instance: &str, n: u32) -> RegisterRequest {
    RegisterRequest {
        instance_id: instance.into(),
        // Never dialled: the workers are fed directly, not over ZMQ.
        endpoint: format!("tcp://10.255.0.{n}:5557"),
        replay_endpoint: None,
        model_name: MODEL.into(),
        tenant_id: None,
        block_size: BS,
        dp_rank: None,
        lora_name: None,
        cache_salt: None,
        address: Some(format!("10.255.0.{n}:8000")),
    }
}

fn batch(events: Vec<KvEvent>) -> Batch {
    Batch {
        ts: 0.0,
        dp_rank: None,
        events,
        stats: DecodeStats::default(),
    }
}

/// One store of `n` chained blocks whose engine hashes start at `first_hash`.
fn store(n: usize, first_hash: u64, token_seed: u32) -> KvEvent {
    KvEvent::BlockStored {
        parent: None,
        blocks: (0..n)
            .map(|i| StoredBlock {
                hash: EngineHash(first_hash + i as u64),
                tokens: vec![token_seed.wrapping_add(i as u32); BS as usize],
                block_hash: None,
            })
            .collect(),
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    }
}

/// A collector state with a `good` worker holding a 64-token prompt (returned) and an empty
/// `big` worker to receive the batch.
fn setup(blocks: usize, slice: usize) -> anyhow::Result<(AppState, WorkerId, Vec<u32>)> {
    let state = Shared::new(Config {
        max_blocks_per_worker: blocks + 100,
        limits: Limits {
            slice_blocks: slice,
            ..Limits::default()
        },
        ..Config::default()
    });
    let id = |r| match r {
        Ok(Registered::New(id)) => Ok(id),
        other => Err(anyhow::anyhow!("registration refused: {other:?}")),
    };
    // The hub's own register: no subscriber, the batches are handed over directly.
    let good = id(state.write().register(registration("good", 1)))?;
    let big = id(state.write().register(registration("big", 2)))?;
    let prompt: Vec<u32> = (1..=64).collect();
    let blocks_of_prompt = prompt
        .chunks(BS as usize)
        .enumerate()
        .map(|(i, c)| StoredBlock {
            hash: EngineHash(10 + i as u64),
            tokens: c.to_vec(),
            block_hash: None,
        })
        .collect();
    state.apply_batch_blocking(
        good,
        0,
        batch(vec![KvEvent::BlockStored {
            parent: None,
            blocks: blocks_of_prompt,
            tier: Tier::Gpu,
            lora_name: None,
            cache_salt: None,
        }]),
    );
    Ok((state, big, prompt))
}

fn longest(state: &AppState, prompt: &[u32]) -> u64 {
    state
        .read()
        .query_tokens(prompt, MODEL, None, None, None)
        .ok()
        .and_then(|r| r.instances.get("good").map(|m| m.longest_matched))
        .unwrap_or(0)
}

/// Applies the batch through [`Shared::apply_batch`] (or, `whole`, under one hold of the
/// write lock) while a thread queries.
fn run_once(args: &StallArgs, whole: bool, label: &str) -> anyhow::Result<Run> {
    let (state, big, prompt) = setup(args.blocks, args.slice_blocks)?;
    let done = Arc::new(AtomicBool::new(false));
    let gap = Duration::from_micros(args.query_gap_us);
    let querier = {
        let (state, done, prompt) = (state.clone(), done.clone(), prompt.clone());
        std::thread::spawn(move || {
            let mut lat = Vec::with_capacity(1 << 16);
            let mut wrong = 0u64;
            while !done.load(Ordering::Relaxed) {
                let at = Instant::now();
                let n = longest(&state, &prompt);
                lat.push(at.elapsed());
                wrong += u64::from(n != prompt.len() as u64);
                std::thread::sleep(gap);
            }
            (lat, wrong)
        })
    };
    let b = batch(vec![store(args.blocks, 1 << 40, 7)]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let at = Instant::now();
    let report = if whole {
        // The whole batch under one hold of the write lock: ingest before slicing.
        let mut hub = state.write();
        hub.apply_batch(big, 0, b)
    } else {
        rt.block_on(state.apply_batch(big, 0, b))
    };
    let took = at.elapsed();
    done.store(true, Ordering::Relaxed);
    let (mut lat, wrong) = querier
        .join()
        .map_err(|_| anyhow::anyhow!("the querier panicked"))?;
    anyhow::ensure!(wrong == 0, "{wrong} queries lost the good worker's match");
    anyhow::ensure!(
        state.read().index.worker_blocks(big) == args.blocks,
        "the batch did not go in whole"
    );
    lat.sort_unstable();
    Ok(Run {
        label: label.into(),
        // Holds of the lock, what a reader waits behind.
        slices: if whole { 1 } else { report.slices },
        batch: took,
        lat,
    })
}

/// The slowest holds of the write lock, slice by slice, with the index size at each.
fn diagnose(args: &StallArgs) -> anyhow::Result<Vec<(usize, usize, Duration)>> {
    let (state, big, _) = setup(args.blocks, args.slice_blocks)?;
    let mut job = IngestJob::new(big, 0, batch(vec![store(args.blocks, 1 << 40, 7)]));
    let mut slices = Vec::new();
    let mut i = 0;
    loop {
        let mut hub = state.write();
        let at = Instant::now();
        let done = hub.ingest(&mut job);
        let took = at.elapsed();
        slices.push((i, hub.index.stats().blocks, took));
        drop(hub);
        i += 1;
        if done {
            break;
        }
    }
    slices.sort_by_key(|s| std::cmp::Reverse(s.2));
    slices.truncate(args.slowest);
    Ok(slices)
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// Runs the benchmark and prints a markdown report on stdout.
pub fn run(args: StallArgs) -> anyhow::Result<()> {
    eprintln!("ingest-stall: {} blocks, sliced run", args.blocks);
    let sliced = run_once(
        &args,
        false,
        &format!("sliced, {} blocks per slice", args.slice_blocks),
    )?;
    eprintln!("ingest-stall: baseline run (one slice)");
    let whole = run_once(&args, true, "one hold for the whole batch (baseline)")?;
    eprintln!("ingest-stall: diagnosis run");
    let slow = diagnose(&args)?;

    let mut out = String::new();
    out.push_str(&format!(
        "# /query while one {}-block batch is applied\n\n`kvroute-bench ingest-stall --blocks {}`: one querier thread (a 64-token prompt, {} µs between queries) against the collector's state while `Shared::apply_batch` applies the batch on another thread. {} cores.\n\n",
        args.blocks,
        args.blocks,
        args.query_gap_us,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    ));
    out.push_str("| run | lock holds | batch took | queries | p50 | p99 | max |\n|---|---|---|---|---|---|---|\n");
    for r in [&sliced, &whole] {
        out.push_str(&format!(
            "| {} | {} | {:.2} s | {} | {} | {} | {} |\n",
            r.label,
            r.slices,
            r.batch.as_secs_f64(),
            r.lat.len(),
            ms(r.pct(0.5)),
            ms(r.pct(0.99)),
            ms(r.lat.last().copied().unwrap_or_default()),
        ));
    }
    out.push_str(&format!(
        "\n## The {} slowest slices (write lock held, at most {} blocks per slice)\n\n| slice | index blocks after | held |\n|---|---|---|\n",
        slow.len(),
        args.slice_blocks
    ));
    for (i, blocks, took) in &slow {
        out.push_str(&format!("| {i} | {blocks} | {} |\n", ms(*took)));
    }
    print!("{out}");
    Ok(())
}
