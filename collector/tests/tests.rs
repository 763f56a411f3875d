//! The collector's integration tests, one binary.

// Every shared vector decodes to its normalized events.
mod vectors;
// Helpers: collector config, registrations, waiting on conditions.
mod common;
// Over real ZMQ on loopback: stores, removals, clears, tenants, gaps, restarts, state-dir.
mod zmq_flow;
// Every HTTP endpoint, each bad input, and the tokens, through `app(state).oneshot`.
mod http;
// The binary: --help, bad flags, SIGTERM.
mod cli;
// Hostile engines and state files: caps, slices, files moved aside.
mod hostile;
// The fleet view against the real binary: gateway load reports and engine scrapes.
mod fleet_common;
mod fleet_load;
mod fleet_scrape;
// The alarms (engine_silent, ...) raised by real conditions, and none for a healthy fleet.
mod alarm;
// The truth check (predicted vs engine reuse) and the gateway alarms, against fake engines.
mod truth;
// Text requests: /tokenize and /query with prompt or messages, on the real Qwen3 tokenizer.
mod text;
// /v1/explain: the decision laid out, hand-worked, and its bad input.
mod explain;
