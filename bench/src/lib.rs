//! kvroute-bench: the system benchmarks, which need every other part at once.
//!
//! - [`routing`]: the routing comparison (round-robin, least-request, kvroute, oracle and the
//!   PyPI peers) on one Mooncake trace and a fleet of simulated engines, with a real collector.
//! - [`collector`]: the collector's ingest, `/query` and memory figures, with NVIDIA Dynamo's
//!   indexer side by side; [`loadgen`] is its HTTP load generator, [`dynamo`] runs the peer.
//!
//! - [`ingest_stall`]: `/query` latency while one huge batch is applied; [`soak`]: the
//!   collector binary under a fleet and hostile peers for minutes, its RSS sampled.
//!
//! The engine side of both is `kvroute-sim`; nothing here is used in production.

pub mod collector;
pub mod dynamo;
pub mod ingest_stall;
pub mod loadgen;
pub mod routing;
pub mod soak;
