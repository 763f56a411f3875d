//! The collector's state and every change to it, split by job:
//!
//! - [`types`]: errors, worker records, settings and limits;
//! - `store`: the [`Hub`] and the tables the jobs share (worker table interning to
//!   [`WorkerId`](kvroute::event::WorkerId), block sizes, aliases, the index, the SGLang
//!   re-chunkers, the feed log);
//! - `registry`: registrations, dp-rank siblings, aliases, and their removal;
//! - [`ingest`]: engine batches into the index, in bounded slices, returning what happened;
//! - `query`: `/query`, `/workers`, the feed's replies and snapshots;
//! - [`persist`]: the `--state-dir` state, checked whole on import.

pub mod ingest;
pub mod persist;
mod query;
mod registry;
pub(crate) mod store;
pub mod types;

pub use ingest::{IngestJob, IngestReport, EVENT_TYPES};
pub use persist::{SavedAlias, SavedWorker, StateFile, STATE_VERSION};
pub use store::Hub;
pub use types::{
    EventStream, HandoverReply, HubConfig, HubError, Limit, LimitCounts, Limits, Registered,
    WorkerInfo, WorkerStatus, WorkerView, MAX_NAME_BYTES, MAX_WORKERS,
};

#[cfg(test)]
mod tests;
