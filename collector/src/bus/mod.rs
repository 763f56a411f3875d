//! The optional event bus (`--nats URL`, issue 23): NATS JetStream between collectors.
//!
//! Off by default: without `--nats` nothing here runs and the collector reads its engines over
//! ZMQ as it always did. With it, each process has a role (`--nats-role`):
//!
//! - **ingest**: subscribes to the engines' ZMQ as today, applies to its own index, and
//!   publishes every decoded, numbered batch (and the stream events the index must follow:
//!   engine restart, stream expired, connected, disconnected) to the stream, subject
//!   `<prefix>.events.<scope>.<worker>` ([`subject`]) through a bounded outbox
//!   ([`publish`]);
//! - **index**: opens no engine socket; builds its index from the stream through a durable
//!   consumer ([`consume`]) and serves the API and the feed as usual;
//! - **both** (the default): ingest, serving from its own index (it is the source; it does not
//!   read the stream back).
//!
//! Several ingest processes split the engines between them, one reader per engine
//! ([`ownership`], [`owners`]).
//!
//! Registrations reach every process through a second stream that keeps the last message per
//! worker, as a KV bucket does ([`registry`]): a `/register` or `/unregister` on any
//! collector is applied locally and published there by the publisher task in order with the
//! batches, so when a batch is on the event stream its worker's registration is already in
//! the registry; every process watches the registry.
//!
//! The Dynamo reader ([`dynamo`], `--dynamo-namespace`) rides on the same connection: it reads
//! the KV events an NVIDIA Dynamo fleet publishes on NATS Core into this collector's index.
//!
//! Wire format of one stream message: [`wire`]. NATS down (at start or mid-run): the
//! collector keeps serving what it has, `/health` says `degraded` with the reason, the outbox
//! holds up to `--nats-outbox-batches` batches, and the index role catches up from its
//! durable consumer once the server is back.

pub mod consume;
pub mod dynamo;
pub mod handle;
pub mod load;
pub mod owners;
pub mod ownership;
pub mod publish;
pub mod registry;
pub mod settings;
pub mod task;
pub mod wire;

pub(crate) use handle::count;
pub use handle::{subject, token, worker_key, Bus, Outgoing, Route};
pub use settings::{
    BusConfig, BusConfigError, DynamoConfig, DynamoFile, NatsArgs, NatsFile, RecoveryConfig,
    RecoveryMode, Role,
};
pub use wire::Kind;
