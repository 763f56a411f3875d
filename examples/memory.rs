//! Bytes of memory per (block, holder) entry in the index, measured with a counting
//! allocator (live heap bytes after building, minus before). Run: `make bench`, or
//! `cargo run --profile bench -p kvroute --example memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier, WorkerId};
use kvroute::index::{Index, IndexConfig};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const BLOCK: usize = 16;

/// `workers` workers each hold `chains` chains of 32 blocks; with `shared`, every worker holds
/// the same chains (one block, many holders), otherwise each its own.
fn build(workers: u32, chains: u32, shared: bool) -> (Index, usize) {
    let mut index = Index::new(IndexConfig::default());
    let mut changes = Vec::new();
    for w in 0..workers {
        index.add_worker(WorkerId(w), "default", "m", BLOCK as u32);
        for c in 0..chains {
            let salt = if shared { c } else { c + w * chains };
            let blocks = (0..32u32)
                .map(|i| StoredBlock {
                    hash: EngineHash(((c as u64) << 8) | i as u64),
                    tokens: (0..BLOCK as u32)
                        .map(|t| t ^ (salt << 9) ^ (i << 4))
                        .collect(),
                    block_hash: None,
                })
                .collect();
            let event = KvEvent::BlockStored {
                parent: None,
                blocks,
                tier: Tier::Gpu,
                lora_name: None,
                cache_salt: None,
            };
            index.apply(WorkerId(w), &event, &mut changes);
            changes.clear();
        }
    }
    let holds = index.stats().holds;
    (index, holds)
}

fn main() {
    println!("| layout | (block, holder) entries | bytes per entry |");
    println!("|---|---:|---:|");
    for (name, workers, chains, shared) in [
        ("1 holder per block", 1u32, 32_768u32, false),
        ("16 workers, distinct blocks", 16, 2_048, false),
        ("16 workers, same blocks", 16, 2_048, true),
    ] {
        let before = LIVE.load(Ordering::Relaxed);
        let (index, holds) = build(workers, chains, shared);
        let after = LIVE.load(Ordering::Relaxed);
        println!(
            "| {name} | {holds} | {:.1} |",
            (after - before) as f64 / holds as f64
        );
        drop(index);
    }
}
