//! The bus settings: the `--nats*` flags, the `[nats]` table of the config file, and their
//! validated form.

use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Deserialize;

/// What one collector does on the bus.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Engines' ZMQ in, the stream out.
    Ingest,
    /// The stream in (durable consumer), no engine socket.
    Index,
    /// Ingest and serve from its own index.
    #[default]
    Both,
}

impl Role {
    /// Opens the engines' ZMQ sockets.
    pub fn ingests(self) -> bool {
        matches!(self, Role::Ingest | Role::Both)
    }
}

/// The bus flags (flattened into the collector's command line).
#[derive(Clone, Debug, Default, Args)]
pub struct NatsArgs {
    /// NATS server URL (nats://HOST:PORT); turns the JetStream event bus on [default: off].
    #[arg(long, value_name = "URL")]
    pub nats: Option<String>,
    /// ingest: engines' ZMQ → stream; index: stream → index (durable consumer); both [default: both].
    #[arg(long, value_name = "ROLE")]
    pub nats_role: Option<Role>,
    /// JetStream stream name [default: KVROUTE_EVENTS].
    #[arg(long, value_name = "NAME")]
    pub nats_stream: Option<String>,
    /// First token of every subject [default: kvroute].
    #[arg(long, value_name = "TOKEN")]
    pub nats_subject_prefix: Option<String>,
    /// Durable consumer of this index replica; one per replica [default: kvroute-index-<listen port>].
    #[arg(long, value_name = "NAME")]
    pub nats_durable: Option<String>,
    /// JetStream stream holding the registrations, the last one per worker [default: KVROUTE_REGISTRY].
    #[arg(long, value_name = "NAME")]
    pub nats_registry_stream: Option<String>,
    /// Stream limit: messages older than this are dropped, seconds [default: 86400].
    #[arg(long, value_name = "SECS")]
    pub nats_max_age_secs: Option<f64>,
    /// Stream limit: oldest messages dropped past this size, bytes [default: 1073741824].
    #[arg(long, value_name = "BYTES")]
    pub nats_max_bytes: Option<i64>,
    /// Largest stream message, bytes: the stream refuses larger ones, the ingest side counts and skips them, the index side skips them before decoding [default: 1048576, and at most the server's max_payload].
    #[arg(long, value_name = "BYTES")]
    pub nats_max_message_bytes: Option<usize>,
    /// Batches the ingest side holds while NATS is slow or down; past it they are dropped and counted [default: 65536].
    #[arg(long, value_name = "N")]
    pub nats_outbox_batches: Option<usize>,
}

/// The `[nats]` table of the `--config` file: the same settings.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsFile {
    pub url: Option<String>,
    pub role: Option<Role>,
    pub stream: Option<String>,
    pub subject_prefix: Option<String>,
    pub durable: Option<String>,
    pub registry_stream: Option<String>,
    pub max_age_secs: Option<f64>,
    pub max_bytes: Option<i64>,
    pub max_message_bytes: Option<usize>,
    pub outbox_batches: Option<usize>,
}

/// The bus settings, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct BusConfig {
    /// Server URL.
    pub url: String,
    pub role: Role,
    /// Stream name.
    pub stream: String,
    /// First subject token.
    pub subject_prefix: String,
    /// This replica's durable consumer.
    pub durable: String,
    /// Stream of the registrations (last value per worker, like a KV bucket).
    pub registry_stream: String,
    /// Stream `max_age`.
    pub max_age: Duration,
    /// Stream `max_bytes`.
    pub max_bytes: i64,
    /// Stream `max_msg_size`, and the receive-side limit.
    pub max_message_bytes: usize,
    /// Outbox capacity, batches.
    pub outbox_batches: usize,
}

/// Why the bus settings were refused; names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {msg}")]
pub struct BusConfigError {
    pub flag: &'static str,
    pub msg: String,
}

impl NatsArgs {
    /// Merges the flags over the file's `[nats]` table; `None` when no URL is set.
    ///
    /// # Errors
    /// A setting out of range or a name NATS would refuse, naming the flag.
    pub fn into_config(
        self,
        file: Option<NatsFile>,
        listen_port: u16,
    ) -> Result<Option<BusConfig>, BusConfigError> {
        let f = file.unwrap_or_default();
        let Some(url) = self.nats.or(f.url) else {
            return Ok(None);
        };
        let err = |flag, msg: &str| BusConfigError {
            flag,
            msg: msg.to_owned(),
        };
        let name = |flag: &'static str, v: Option<String>, default: String| {
            let v = v.unwrap_or(default);
            if v.is_empty()
                || !v
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(err(flag, "use letters, digits, '-' and '_' only"));
            }
            Ok(v)
        };
        let max_age_secs = self
            .nats_max_age_secs
            .or(f.max_age_secs)
            .unwrap_or(86_400.0);
        if !(1.0..1e9).contains(&max_age_secs) {
            return Err(err("nats-max-age-secs", "must be 1 s or more"));
        }
        let max_bytes = self.nats_max_bytes.or(f.max_bytes).unwrap_or(1 << 30);
        if max_bytes < 1 << 20 {
            return Err(err("nats-max-bytes", "must be at least 1 MiB"));
        }
        let max_message_bytes = self
            .nats_max_message_bytes
            .or(f.max_message_bytes)
            .unwrap_or(1 << 20);
        if !(1024..=i32::MAX as usize).contains(&max_message_bytes) {
            return Err(err("nats-max-message-bytes", "must be 1 KiB to 2 GiB"));
        }
        let outbox_batches = self
            .nats_outbox_batches
            .or(f.outbox_batches)
            .unwrap_or(65_536);
        if outbox_batches == 0 {
            return Err(err("nats-outbox-batches", "must be at least 1"));
        }
        Ok(Some(BusConfig {
            url,
            role: self.nats_role.or(f.role).unwrap_or_default(),
            stream: name(
                "nats-stream",
                self.nats_stream.or(f.stream),
                "KVROUTE_EVENTS".into(),
            )?,
            subject_prefix: name(
                "nats-subject-prefix",
                self.nats_subject_prefix.or(f.subject_prefix),
                "kvroute".into(),
            )?,
            durable: name(
                "nats-durable",
                self.nats_durable.or(f.durable),
                format!("kvroute-index-{listen_port}"),
            )?,
            registry_stream: name(
                "nats-registry-stream",
                self.nats_registry_stream.or(f.registry_stream),
                "KVROUTE_REGISTRY".into(),
            )?,
            max_age: Duration::from_secs_f64(max_age_secs),
            max_bytes,
            max_message_bytes,
            outbox_batches,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_file_takes_a_nats_table_and_flags_win() {
        let file: crate::config::FileConfig = toml::from_str(
            "[nats]\nurl = \"nats://127.0.0.1:4222\"\nrole = \"index\"\ndurable = \"r1\"\nmax_age_secs = 60.0\n",
        )
        .unwrap();
        let flags = NatsArgs {
            nats_durable: Some("r2".into()),
            ..NatsArgs::default()
        };
        let c = flags.into_config(file.nats, 9090).unwrap().unwrap();
        assert_eq!(c.url, "nats://127.0.0.1:4222");
        assert_eq!(c.role, Role::Index);
        assert_eq!(c.durable, "r2");
        assert_eq!(c.max_age, Duration::from_secs(60));
        assert!(
            toml::from_str::<crate::config::FileConfig>("[nats]\nurl = \"x\"\nbogus = 1\n")
                .is_err()
        );
    }

    #[test]
    fn settings_name_the_flag() {
        let args = NatsArgs {
            nats: Some("nats://127.0.0.1:4222".into()),
            ..NatsArgs::default()
        };
        let c = args.clone().into_config(None, 9090).unwrap().unwrap();
        assert_eq!(c.role, Role::Both);
        assert_eq!(c.durable, "kvroute-index-9090");
        assert_eq!(NatsArgs::default().into_config(None, 1).unwrap(), None);
        let bad = NatsArgs {
            nats_stream: Some("a.b".into()),
            ..args.clone()
        };
        assert_eq!(bad.into_config(None, 1).unwrap_err().flag, "nats-stream");
        let bad = NatsArgs {
            nats_max_message_bytes: Some(10),
            ..args
        };
        assert_eq!(
            bad.into_config(None, 1).unwrap_err().flag,
            "nats-max-message-bytes"
        );
    }
}
