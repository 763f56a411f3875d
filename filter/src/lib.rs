//! kvroute's proxy-wasm HTTP filter: token ids in, longest cached prefix found, upstream
//! chosen, inside Envoy (`kvroute_filter.wasm`) and Higress (`kvroute_filter_higress.wasm`,
//! cargo feature `higress`).
//!
//! Glue only: every decision is a call into the core (`kvroute`): token intake
//! ([`kvroute::intake`]), the shared-data layout and its sync ([`kvroute::mirror`]), hashing,
//! the longest-match walk ([`kvroute::lookup`]) and the decision ([`kvroute::route`]).
//!
//! # Request path
//!
//! 1. Request headers, read whole in one host call ([`headers`]): remove any client-sent
//!    destination header; read the configured header / metadata sources in order. If a body source comes first for some value and the
//!    request has a JSON body, pause (this needs `allow_on_headers_stop_iteration: true` in
//!    Envoy ≥ 1.35, or the ABI 0.2.100 marker in Higress) and buffer the body up to
//!    `max_body_bytes` (past it: continue unrouted, `too_large`).
//! 2. At the end of the body, scan it once for the needed fields.
//! 3. Local mode: a lazily hashed `mirror::PrefixView` → bisection over the shared-data
//!    buckets (`lookup::longest_matches`) → `route::Roster::contenders` with in-flight load
//!    → `route::decide` → headers; remote mode: a `/query` callout, then
//!    `route::remote_contenders` → the same `route::decide`.
//!    Every request of a model with live instances is decided, cold ones by load alone
//!    (`route.cold`); the decision reads this Envoy's books, the fleet's totals and the
//!    engines' samples (`books.rs`), and speculative holders of recent decisions.
//!    A request without token ids but with a `prompt` string or chat `messages` takes the
//!    text path (`http/text.rs`): the collector tokenizes and matches it (`/query` with the
//!    text, the one per-request callout of local mode), or, without a tokenizer or an
//!    answer, approximate mode routes it on the filter's own record of where each text
//!    prefix went ([`kvroute::approx`]); both end in the same `route::decide` and books.
//! 4. The first response body bytes release the request's prefill tokens; `on_log` releases
//!    the rest (the request and its decode budget), whatever the outcome.
//!
//! Every failure fails open: the request continues without the route header and a counter
//! says why. Nothing here panics: host calls go through [`host`], which never unwraps.
//!
//! # Sync (local mode)
//!
//! On each tick one VM holds the lease in shared data and pulls `/v1/feed` from the
//! collector cluster; [`kvroute::mirror::apply_page`] writes the pages into the bounded
//! keyspace. Pages marked `MORE` are pulled at once until `max_blocks_per_tick` block holds
//! were applied in this tick. Any VM takes over a lapsed lease.

#[cfg(target_arch = "wasm32")]
mod books;
mod config;
// Used by the wasm request path; natively only its tests run.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
mod headers;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod http;
mod outcome;
#[cfg(target_arch = "wasm32")]
mod report;
#[cfg(target_arch = "wasm32")]
mod root;
#[cfg(target_arch = "wasm32")]
mod rules;
mod text_config;
#[cfg(target_arch = "wasm32")]
mod timing;
#[cfg(target_arch = "wasm32")]
mod vm;

pub use config::{domain_matches, parse, parse_plugin, Config, ConfigError, Mode, Plugin, Source};
pub use outcome::Outcome;

// The proxy-wasm glue exists only in the wasm build; natively this crate is its pure parts
// (the configuration parser), which the tests use to check error messages.
#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    host::init_logging();
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(root::Root::new()) });
}}
