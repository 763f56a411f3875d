//! kvroute core: the contracts every part of kvroute shares, as plain functions and data.
//! No I/O, no async, no clock and no randomness of its own; it builds for native targets and
//! for `wasm32-wasip1`, where the filter uses it.
//!
//! # Data path
//!
//! 1. `collector/src/zmq.rs`: receive raw batches `[topic, seq, msgpack]` from each engine.
//! 2. `collector/src/decode.rs`: msgpack → [`event::KvEvent`].
//! 3. [`index::Index::apply`]: events → prefix index, emitting [`index::Change`]s.
//! 4. [`feed::Page::encode`]: changes → the binary feed the collector serves at `/v1/feed`.
//! 5. filter, the VM holding the sync lease: [`feed::Page::decode`] → deltas applied to the
//!    bounded shared-data buckets, a full resync switched in whole by generation.
//! 6. filter, per request: [`hash::sequence_hashes_into`] → [`scope::ScopeId::key`] →
//!    [`lookup::longest_matches`] over the shared-data view → [`select::pick`] → the
//!    destination header.

pub mod api;
pub mod codec;
pub mod event;
pub mod feed;
pub mod hash;
pub mod index;
pub mod intake;
pub mod lookup;
pub mod mirror;
pub mod route;
pub mod scope;
pub mod select;

/// The mirror's former name, kept so code written against `kvroute::bucket` still builds.
pub use mirror as bucket;
