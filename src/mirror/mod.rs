//! The filter's mirror of the collector's index, in Envoy shared data: a bounded keyspace
//! holding a copy of the index that every VM of the filter reads.
//!
//! Envoy's shared data is one mutex-guarded map per `vm_id` whose keys are never deleted (ABI
//! 0.2.1 has no delete). So the filter keeps a fixed set of keys, whatever the number of
//! blocks, scopes and workers that come and go:
//!
//! | key | what | file |
//! |---|---|---|
//! | `{prefix}/lease` | which VM pulls the feed, until when ([`Lease`]) | `sync.rs` |
//! | `{prefix}/vmseq` | a counter handing each VM a unique id | `sync.rs` |
//! | `{prefix}/active` | the sync state: active generation, epoch, cursor, sync time ([`SyncState`]) | `sync.rs` |
//! | `{prefix}/load` | in-flight requests per worker, with a time-to-live ([`load_get`]) | `load.rs` |
//! | `{prefix}/fleet` | fleet-wide load totals, own last report, engine samples ([`Fleet`]) | `fleet.rs` |
//! | `{prefix}/gateway` | this Envoy's gateway id in load reports, made once | (filter) |
//! | `{prefix}/spec/{shard}` | speculative block holders of recent decisions, sharded by a prompt's first block ([`spec_insert`]) | `speculative.rs` |
//! | `{prefix}/text/{i:x}` | shard `i` of the recorded text prefixes (`text.max_entries / 512` shards) | [`crate::approx`] |
//! | `{prefix}/g{0,1}/meta` | worker slots, block sizes, aliases of a generation ([`Meta`]) | `meta.rs` |
//! | `{prefix}/g{0,1}/b{i:x}` | bucket `i` of a generation's block table ([`BucketRef`]) | `buckets.rs` |
//!
//! `{prefix}` is `kvroute/{plugin name}/v{LAYOUT_VERSION}` ([`Keys`], `keys.rs`), so two
//! plugins (or two layouts after an upgrade) on one `vm_id` never read each other's bytes.
//! The total is `7 + 2 × (1 + buckets)` keys, plus the text shards once text requests come,
//! fixed by configuration.
//!
//! A block lives in bucket `key >> (64 - log2(buckets))` (its [`BlockKey`](crate::scope::BlockKey)
//! is already a hash). Each bucket value carries the *stamp* of the index build it belongs
//! to: a full resync builds a new stamp into the inactive generation, where every bucket still
//! holding an older stamp reads as empty, so nothing has to be cleared first, and switching
//! `active` over swaps the whole index at once.
//!
//! A VM reuses the sync state and the fleet totals it read for a short window ([`Recent`],
//! `recent.rs`).
//!
//! The request path reads the mirror through the views of `views.rs` ([`PrefixView`] over
//! [`BucketView`]); the lease holder writes it with [`apply_page`].
//!
//! Everything here is pure: the shared data is reached through the [`Store`] trait
//! (`store.rs`), which the filter implements over proxy-wasm host calls and tests implement
//! over a map.

mod buckets;
mod fleet;
mod keys;
mod load;
mod meta;
mod recent;
mod speculative;
mod store;
mod sync;
mod views;

pub use crate::router::load::{Counts, Replica};
pub use buckets::{BucketRef, BucketRows};
pub use fleet::{read_fleet, update_fleet, Fleet, FleetWorker};
pub use keys::{bucket_of, Keys, Limits, CAS_RETRIES, LAYOUT_VERSION};
pub use load::{
    drain, learn_rate, load_add, load_clear_stale, load_entries, load_get, load_rate, load_update,
    load_update_seen, rate_sample, Load, LoadDelta, LoadId, RateNote, RATE_SAMPLE_MIN_TOKENS,
};
pub use meta::{Alias, ApplyStats, Meta, WorkerSlot};
pub use recent::Recent;
pub use speculative::{
    spec_current, spec_entry, spec_insert, spec_lookup, spec_own_since, spec_share, stored_depths,
    Insert, PROBE,
};
pub use store::{update_value, MemStore, Store, StoreError};
pub use sync::{
    acquire_lease, apply_page, next_vm_id, read_state, Applied, Build, Lease, SyncError, SyncState,
};
pub use views::{depth_keys, BucketCache, BucketView, Depth, PrefixView};

#[cfg(test)]
mod load_tests;
#[cfg(test)]
mod tests;
