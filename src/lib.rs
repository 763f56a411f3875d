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
//! 5. filter, the VM holding the sync lease: [`feed::Page::decode`] →
//!    [`mirror::apply_page`]: deltas applied to the bounded shared-data buckets, a full
//!    resync switched in whole by generation.
//! 6. filter, per request: [`mirror::PrefixView`] (hashes the prompt lazily through
//!    [`hash::SeqHashes`] and [`scope::ScopeId::key`]) → [`lookup::longest_matches`]
//!    over the shared-data buckets → [`router::Roster::contenders`] (dp ranks folded, model
//!    eligibility, in-flight load from [`mirror::load_get`]) → [`router::decide`] → the
//!    destination header, and [`mirror::load_update`] books the load until the request ends.
//!    Remote mode asks the collector instead and feeds its answer to
//!    [`router::remote_contenders`] → the same [`router::decide`].
//! 7. filter, a text request (no token ids; a `prompt` string or chat `messages` found by
//!    [`intake::scan_json`]): the collector tokenizes it (`/query` with the text, answered
//!    like a token query → the same decision); without a tokenizer or an answer,
//!    [`approx`] cuts the canonical text into character blocks, chain-hashes them, and the
//!    engines recorded for the longest prefix ([`approx::TextTable::lookup`]) feed
//!    [`router::Roster::contenders`] → the same [`router::decide`].

#![warn(missing_docs)]

pub mod api;
pub mod approx;
pub mod codec;
pub mod engine;
pub mod event;
pub mod feed;
pub mod hash;
pub mod index;
pub mod intake;
pub mod lookup;
pub mod mirror;
pub mod router;
pub mod scope;
pub mod select;
