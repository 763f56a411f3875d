//! kvroute-sim: an engine simulator that behaves like vLLM where routing is concerned, a trace
//! replayer, and the routing-quality benchmark.
//!
//! - [`cache`]: the paged KV cache (prefix reuse, LRU eviction tail first), pure.
//! - [`engine_hash`]: opaque engine block hashes as vLLM and SGLang compute them.
//! - [`wire`]: KV events byte for byte in the formats of vLLM 0.33, vLLM 0.23 and SGLang 0.5.23.
//! - [`publisher`]: ZMQ PUB + replay ROUTER.
//! - [`engine`]: scheduling and timing model, OpenAI/SGLang-style HTTP API, `/metrics`.
//! - [`trace`], [`tokenizer`]: Mooncake traces and the deterministic toy tokenizer.
//! - [`replay`]: replays a trace against a URL or through an in-process router, with summary
//!   statistics.
//! - [`bench`]: the routing comparison (round-robin, least-request, kvroute, oracle, peers).
//!
//! It must not be a dependency of the filter: everything here is native (tokio, axum, zeromq).

pub mod bench;
pub mod cache;
pub mod engine;
pub mod engine_hash;
pub mod publisher;
pub mod replay;
pub mod tokenizer;
pub mod trace;
pub mod wire;
