//! Integration tests of kvroute-bench, one binary: where the simulator's engine side meets the
//! collector.

// The simulated engines' ZMQ event streams decoded by the collector's decoder, and replay.
mod events;
// The routing bench's KV-aware policies against a real collector and the oracle.
mod routing;
// The extra routing scenarios end to end on a few requests, in-process policies only.
mod scenarios;
