//! kvroute's core for JavaScript: the npm package `@kvroute/core` (built by `make js`).
//!
//! A thin layer of wasm-bindgen bindings over the `kvroute` crate, so a JS gateway, client or
//! the collector's fleet page computes exactly what the filter computes:
//!
//! - [`hash`]: block and sequence hashes of token ids (`Uint32Array` in, `BigUint64Array`
//!   out) under the LoRA / cache-salt seed of `kvroute::hash`;
//! - [`intake`]: token ids from a header value or a JSON body, with the filter's limits, by
//!   `kvroute::intake`;
//! - [`route`]: the routing decision of `kvroute::router::decide` over instances the caller
//!   describes as a plain object.
//!
//! Bad input throws a JS `Error` with a message; nothing here panics on caller data.

pub mod args;
pub mod hash;
pub mod intake;
pub mod route;
