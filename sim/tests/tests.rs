//! Integration tests of kvroute-sim, one binary.

// Encoded batches against the real engines' vectors in testdata/vectors.
mod vectors;
// The engines' ZMQ event streams decoded by the collector's decoder, and replay.
mod events;
// The HTTP API of a simulated engine.
mod http;
// Trace replay against engines, by URL and through an in-process router.
mod replay;
// The bench's KV-aware policies against a real collector and the oracle.
mod bench;
