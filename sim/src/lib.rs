//! kvroute-sim: an engine simulator that behaves like vLLM where routing is concerned, and a
//! trace replayer. It is the engine side of every test and benchmark (the routing comparison
//! lives in the `kvroute-bench` crate); it depends on the core, and on `kvroute-text` for
//! real tokenizers (`--tokenizer`).
//!
//! - [`cache`]: the paged KV cache (prefix reuse, LRU eviction tail first), pure.
//! - [`engine_hash`]: opaque engine block hashes as vLLM and SGLang compute them.
//! - [`wire`]: KV events byte for byte in the formats of vLLM 0.33, vLLM 0.23, SGLang 0.5.23
//!   and SGLang 0.5.18, from the sim's cache changes or the core's `KvEvent`s.
//! - [`publisher`]: ZMQ PUB + replay ROUTER in either reply shape, with the misbehaviours a
//!   collector must survive (lost messages, garbage payloads, restarts on the same ports).
//! - [`engine`]: scheduling and timing models (serial, and vLLM V1's stepped scheduler in
//!   [`engine::stepped`]), OpenAI/SGLang-style HTTP API, `/metrics`.
//! - [`trace`], [`tokenizer`]: Mooncake traces, the deterministic toy tokenizer, and the
//!   engine's choice of it or a real one.
//! - [`replay`]: replays a trace against a URL or through an in-process router, with summary
//!   statistics.
//!
//! It must not be a dependency of the filter: everything here is native (tokio, axum, libzmq).

pub mod cache;
pub mod engine;
pub mod engine_hash;
pub mod publisher;
pub mod replay;
pub mod tokenizer;
pub mod trace;
pub mod wire;
