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
    /// Read the KV events an NVIDIA Dynamo deployment publishes on this NATS server (event plane on NATS Core): the Dynamo namespace [default: off; needs --nats, --dynamo-model, --dynamo-block-size and --dynamo-address].
    #[arg(long, value_name = "NS")]
    pub dynamo_namespace: Option<String>,
    /// Dynamo component whose workers publish the events (e.g. backend) [default: every component of the namespace].
    #[arg(long, value_name = "NAME")]
    pub dynamo_component: Option<String>,
    /// The whole NATS subject to subscribe to instead of the derived ones (another Dynamo version's naming) [default: namespace.NS.component.C.endpoint.*.kv-events and namespace.NS.component.C.kv-events].
    #[arg(long, value_name = "SUBJECT")]
    pub dynamo_subject: Option<String>,
    /// Model the Dynamo workers serve: they are registered under it on their first event.
    #[arg(long, value_name = "NAME")]
    pub dynamo_model: Option<String>,
    /// Tokens per KV block of the Dynamo workers (their --block-size / kv_block_size).
    #[arg(long, value_name = "TOKENS")]
    pub dynamo_block_size: Option<u32>,
    /// Tenant the Dynamo workers are registered under [default: default].
    #[arg(long, value_name = "NAME")]
    pub dynamo_tenant: Option<String>,
    /// Where the gateway sends a request routed to a Dynamo worker (ip:port, e.g. the Dynamo frontend); /query names the workers by their Dynamo worker ids.
    #[arg(long, value_name = "IP:PORT")]
    pub dynamo_address: Option<String>,
    /// Largest Dynamo event message, bytes: larger ones are counted and skipped before decoding [default: 1048576].
    #[arg(long, value_name = "BYTES")]
    pub dynamo_max_message_bytes: Option<usize>,
    /// Most Dynamo workers (worker id, dp rank) registered at once; past it the one heard from least recently is unregistered [default: 1024].
    #[arg(long, value_name = "N")]
    pub dynamo_max_workers: Option<usize>,
    /// On a jump in a Dynamo worker's event ids (or a first event past id 1), ask the worker's KV query endpoint for what was missed: over the NATS request plane, or the plane its --dynamo-discovery-dir record names (nats); only workers found in --dynamo-discovery-dir, on the plane their record names (tcp, Dynamo's default TCP request plane); or clear its blocks (off) [default: nats].
    #[arg(long, value_name = "MODE")]
    pub dynamo_recovery: Option<RecoveryMode>,
    /// Root of the Dynamo deployment's file discovery (its workers' DYN_FILE_KV): where a worker's KV query endpoint is looked up (its TCP address) [default: none; required by --dynamo-recovery tcp].
    #[arg(long, value_name = "PATH")]
    pub dynamo_discovery_dir: Option<std::path::PathBuf>,
    /// The Dynamo deployment's etcd discovery (its workers' ETCD_ENDPOINTS), http://host:port: where a worker's KV query endpoint is looked up through etcd's JSON gateway, instead of --dynamo-discovery-dir [default: none; --dynamo-recovery tcp needs this or --dynamo-discovery-dir].
    #[arg(long, value_name = "URL")]
    pub dynamo_discovery_etcd: Option<String>,
    /// Where the workers' answers to a KV query connect back to (TCP; a port of 0 picks one) [default: the local address that reaches the NATS server, port 0].
    #[arg(long, value_name = "IP:PORT")]
    pub dynamo_recovery_listen: Option<String>,
    /// A KV query's whole time budget, request to last byte, milliseconds; past it the worker's blocks are cleared [default: 3000].
    #[arg(long, value_name = "MS")]
    pub dynamo_recovery_timeout_ms: Option<u64>,
    /// Largest answer to one KV query, bytes: past it the answer is dropped and the worker's blocks cleared [default: 67108864].
    #[arg(long, value_name = "BYTES")]
    pub dynamo_recovery_max_bytes: Option<usize>,
}

/// `--dynamo-recovery`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryMode {
    /// The worker's KV query endpoint on the NATS request plane, or on the plane its
    /// discovery record names.
    #[default]
    Nats,
    /// The plane the worker's discovery record names (`--dynamo-discovery-dir`); no record,
    /// no query.
    Tcp,
    /// No query: a gap clears the worker's blocks.
    Off,
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
    /// `[nats.dynamo]`: the `--dynamo-*` settings without the prefix.
    pub dynamo: Option<DynamoFile>,
}

/// The `[nats.dynamo]` table of the `--config` file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamoFile {
    pub namespace: Option<String>,
    pub component: Option<String>,
    pub subject: Option<String>,
    pub model: Option<String>,
    pub block_size: Option<u32>,
    pub tenant: Option<String>,
    pub address: Option<String>,
    pub max_message_bytes: Option<usize>,
    pub max_workers: Option<usize>,
    pub recovery: Option<RecoveryMode>,
    pub recovery_listen: Option<String>,
    pub recovery_timeout_ms: Option<u64>,
    pub recovery_max_bytes: Option<usize>,
    pub discovery_dir: Option<std::path::PathBuf>,
    pub discovery_etcd: Option<String>,
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
    /// The Dynamo reader (`--dynamo-namespace`), when it is on.
    pub dynamo: Option<DynamoConfig>,
}

/// The Dynamo reader's settings, validated ([`super::dynamo`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DynamoConfig {
    /// NATS subjects subscribed to (may hold `*` wildcards).
    pub subjects: Vec<String>,
    /// Model the workers are registered under.
    pub model: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Tenant the workers are registered under (`None`: the default tenant).
    pub tenant: Option<String>,
    /// Serving address given to every Dynamo worker, `ip:port`.
    pub address: std::net::SocketAddr,
    /// Largest message decoded, bytes.
    pub max_message_bytes: usize,
    /// Most Dynamo workers registered at once.
    pub max_workers: usize,
    /// The KV query on a gap; `None`: `--dynamo-recovery off`.
    pub recovery: Option<RecoveryConfig>,
}

/// `--dynamo-recovery nats|tcp` ([`super::dynamo::recovery`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RecoveryConfig {
    /// Where the answers connect back to; `None`: the local address toward the NATS server.
    pub listen: Option<std::net::SocketAddr>,
    /// One query's whole time budget.
    pub timeout: Duration,
    /// Largest answer, bytes.
    pub max_bytes: usize,
    /// Dynamo's file discovery root (`--dynamo-discovery-dir`), where a worker's request
    /// plane is looked up; `None`: every worker is asked over NATS (unless `discovery_etcd`).
    pub discovery_dir: Option<std::path::PathBuf>,
    /// Dynamo's etcd discovery (`--dynamo-discovery-etcd`, `http://host:port`, no trailing
    /// `/`), where a worker's request plane is looked up instead; never with `discovery_dir`.
    pub discovery_etcd: Option<String>,
    /// A worker without a usable discovery record is asked over NATS (`nats`), or not at all
    /// (`tcp`).
    pub nats_fallback: bool,
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
        let err = |flag, msg: &str| BusConfigError {
            flag,
            msg: msg.to_owned(),
        };
        let dynamo = DynamoFile::merge(&self, f.dynamo.clone().unwrap_or_default());
        let Some(url) = self.nats.or(f.url) else {
            if dynamo.namespace.is_some() || dynamo.subject.is_some() {
                return Err(err(
                    "dynamo-namespace",
                    "needs --nats URL (the NATS server the Dynamo workers publish on)",
                ));
            }
            return Ok(None);
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
            dynamo: dynamo.validate()?,
        }))
    }
}

/// `--dynamo-discovery-etcd`: an `http://host[:port][/path]` URL (the client has no TLS),
/// without its trailing `/`.
fn etcd_url(u: &str) -> Result<String, BusConfigError> {
    let bad = |msg: &str| BusConfigError {
        flag: "dynamo-discovery-etcd",
        msg: msg.into(),
    };
    let url = reqwest::Url::parse(u).map_err(|_| bad("not a URL (http://host:port)"))?;
    if url.scheme() != "http" {
        return Err(bad("an http:// URL (no TLS here)"));
    }
    if url.host_str().is_none_or(str::is_empty)
        || url.query().is_some()
        || url.fragment().is_some()
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return Err(bad("http://host:port, without user, query or fragment"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

impl DynamoFile {
    /// The `--dynamo-*` flags over the `[nats.dynamo]` table.
    fn merge(a: &NatsArgs, f: DynamoFile) -> DynamoFile {
        DynamoFile {
            namespace: a.dynamo_namespace.clone().or(f.namespace),
            component: a.dynamo_component.clone().or(f.component),
            subject: a.dynamo_subject.clone().or(f.subject),
            model: a.dynamo_model.clone().or(f.model),
            block_size: a.dynamo_block_size.or(f.block_size),
            tenant: a.dynamo_tenant.clone().or(f.tenant),
            address: a.dynamo_address.clone().or(f.address),
            max_message_bytes: a.dynamo_max_message_bytes.or(f.max_message_bytes),
            max_workers: a.dynamo_max_workers.or(f.max_workers),
            recovery: a.dynamo_recovery.or(f.recovery),
            recovery_listen: a.dynamo_recovery_listen.clone().or(f.recovery_listen),
            recovery_timeout_ms: a.dynamo_recovery_timeout_ms.or(f.recovery_timeout_ms),
            recovery_max_bytes: a.dynamo_recovery_max_bytes.or(f.recovery_max_bytes),
            discovery_dir: a.dynamo_discovery_dir.clone().or(f.discovery_dir),
            discovery_etcd: a.dynamo_discovery_etcd.clone().or(f.discovery_etcd),
        }
    }

    /// The reader's settings; `None` when neither a namespace nor a subject is set.
    fn validate(self) -> Result<Option<DynamoConfig>, BusConfigError> {
        let err = |flag, msg: String| BusConfigError { flag, msg };
        let subjects = match (self.subject, &self.namespace) {
            (Some(s), _) => {
                if s.is_empty()
                    || s.split('.').any(|t| t.is_empty())
                    || s.bytes().any(|b| b.is_ascii_whitespace())
                {
                    return Err(err(
                        "dynamo-subject",
                        "a NATS subject: non-empty tokens split by '.'".into(),
                    ));
                }
                vec![s]
            }
            (None, Some(ns)) => super::dynamo::naming::subjects(ns, self.component.as_deref())
                .map_err(|m| err("dynamo-namespace", m.into()))?,
            (None, None) => return Ok(None),
        };
        let model = self
            .model
            .filter(|m| !m.is_empty())
            .ok_or_else(|| err("dynamo-model", "required with --dynamo-namespace".into()))?;
        let block_size = match self.block_size {
            Some(n) if n >= 1 => n,
            Some(_) => return Err(err("dynamo-block-size", "must be at least 1".into())),
            None => {
                return Err(err(
                    "dynamo-block-size",
                    "required with --dynamo-namespace (the workers' kv block size)".into(),
                ))
            }
        };
        let address = self
            .address
            .ok_or_else(|| {
                err(
                    "dynamo-address",
                    "required with --dynamo-namespace: the ip:port a request routed to a Dynamo worker goes to".into(),
                )
            })?
            .parse::<std::net::SocketAddr>()
            .map_err(|_| err("dynamo-address", "must be an ip:port literal".into()))?;
        let max_message_bytes = self.max_message_bytes.unwrap_or(1 << 20);
        if !(1024..=i32::MAX as usize).contains(&max_message_bytes) {
            return Err(err(
                "dynamo-max-message-bytes",
                "must be 1 KiB to 2 GiB".into(),
            ));
        }
        let max_workers = self.max_workers.unwrap_or(1024);
        if !(1..=crate::hub::MAX_WORKERS).contains(&max_workers) {
            return Err(err(
                "dynamo-max-workers",
                format!("must be 1 to {}", crate::hub::MAX_WORKERS),
            ));
        }
        let mode = self.recovery.unwrap_or_default();
        if mode == RecoveryMode::Tcp
            && self.discovery_dir.is_none()
            && self.discovery_etcd.is_none()
        {
            return Err(err(
                "dynamo-discovery-dir",
                "required with --dynamo-recovery tcp (or --dynamo-discovery-etcd): the workers' file discovery root (DYN_FILE_KV)"
                    .into(),
            ));
        }
        if self.discovery_dir.is_some() && self.discovery_etcd.is_some() {
            return Err(err(
                "dynamo-discovery-etcd",
                "not with --dynamo-discovery-dir: a deployment has one discovery".into(),
            ));
        }
        let discovery_etcd = self.discovery_etcd.map(|u| etcd_url(&u)).transpose()?;
        if self
            .discovery_dir
            .as_ref()
            .is_some_and(|d| d.as_os_str().is_empty())
        {
            return Err(err("dynamo-discovery-dir", "an empty path".into()));
        }
        let recovery = match mode {
            RecoveryMode::Off => None,
            RecoveryMode::Nats | RecoveryMode::Tcp => {
                let listen = self
                    .recovery_listen
                    .map(|l| l.parse::<std::net::SocketAddr>())
                    .transpose()
                    .map_err(|_| {
                        err(
                            "dynamo-recovery-listen",
                            "must be an ip:port literal".into(),
                        )
                    })?;
                let ms = self.recovery_timeout_ms.unwrap_or(3000);
                if !(10..=600_000).contains(&ms) {
                    return Err(err(
                        "dynamo-recovery-timeout-ms",
                        "must be 10 to 600000".into(),
                    ));
                }
                let max_bytes = self.recovery_max_bytes.unwrap_or(64 << 20);
                if !(4096..=1 << 31).contains(&max_bytes) {
                    return Err(err(
                        "dynamo-recovery-max-bytes",
                        "must be 4 KiB to 2 GiB".into(),
                    ));
                }
                Some(RecoveryConfig {
                    listen,
                    timeout: Duration::from_millis(ms),
                    max_bytes,
                    discovery_dir: self.discovery_dir,
                    discovery_etcd,
                    nats_fallback: mode == RecoveryMode::Nats,
                })
            }
        };
        Ok(Some(DynamoConfig {
            subjects,
            model,
            block_size,
            tenant: self.tenant.filter(|t| !t.is_empty()),
            address,
            max_message_bytes,
            max_workers,
            recovery,
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

    #[test]
    fn the_dynamo_reader_needs_nats_a_model_a_block_size_and_an_address() {
        let full = NatsArgs {
            nats: Some("nats://127.0.0.1:4222".into()),
            dynamo_namespace: Some("dynamo".into()),
            dynamo_model: Some("llama".into()),
            dynamo_block_size: Some(16),
            dynamo_address: Some("10.0.0.1:8000".into()),
            ..NatsArgs::default()
        };
        let d = full
            .clone()
            .into_config(None, 1)
            .unwrap()
            .unwrap()
            .dynamo
            .unwrap();
        assert_eq!(
            d.subjects,
            [
                "namespace.dynamo.component.*.endpoint.*.kv-events",
                "namespace.dynamo.component.*.kv-events"
            ]
        );
        assert_eq!((d.block_size, d.max_workers), (16, 1024));
        // The KV query is on by default, its answers back to the address toward NATS.
        assert_eq!(
            d.recovery,
            Some(RecoveryConfig {
                listen: None,
                timeout: Duration::from_secs(3),
                max_bytes: 64 << 20,
                discovery_dir: None,
                discovery_etcd: None,
                nats_fallback: true,
            })
        );
        // The TCP request plane needs the discovery root, and takes it from the table too.
        let no_dir = NatsArgs {
            dynamo_recovery: Some(RecoveryMode::Tcp),
            ..full.clone()
        };
        assert_eq!(
            no_dir.into_config(None, 1).unwrap_err().flag,
            "dynamo-discovery-dir"
        );
        let tcp = NatsArgs {
            dynamo_recovery: Some(RecoveryMode::Tcp),
            dynamo_discovery_dir: Some("/run/dynamo".into()),
            ..full.clone()
        };
        let r = tcp
            .into_config(None, 1)
            .unwrap()
            .unwrap()
            .dynamo
            .unwrap()
            .recovery;
        assert_eq!(
            r.map(|r| (r.discovery_dir, r.nats_fallback)),
            Some((Some("/run/dynamo".into()), false))
        );
        let file: crate::config::FileConfig = toml::from_str(
            "[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.dynamo]\nnamespace = \"d\"\nmodel = \"m\"\nblock_size = 16\naddress = \"127.0.0.1:1\"\nrecovery = \"tcp\"\ndiscovery_dir = \"/d\"\n",
        )
        .unwrap();
        let r = NatsArgs::default()
            .into_config(file.nats, 1)
            .unwrap()
            .unwrap()
            .dynamo
            .unwrap()
            .recovery
            .unwrap();
        assert_eq!(r.discovery_dir, Some("/d".into()));
        // Or etcd discovery (the flag or the table), an http:// URL, never with the root.
        let etcd = |u: &str| NatsArgs {
            dynamo_recovery: Some(RecoveryMode::Tcp),
            dynamo_discovery_etcd: Some(u.into()),
            ..full.clone()
        };
        let r = etcd("http://127.0.0.1:2379/")
            .into_config(None, 1)
            .unwrap()
            .unwrap()
            .dynamo
            .unwrap()
            .recovery
            .unwrap();
        assert_eq!(
            (
                r.discovery_etcd.as_deref(),
                r.discovery_dir,
                r.nats_fallback
            ),
            (Some("http://127.0.0.1:2379"), None, false)
        );
        for bad in [
            "127.0.0.1:2379",
            "https://etcd:2379",
            "http://",
            "http://h:1/?q",
            "x",
        ] {
            assert_eq!(
                etcd(bad).into_config(None, 1).unwrap_err().flag,
                "dynamo-discovery-etcd",
                "{bad}"
            );
        }
        let both = NatsArgs {
            dynamo_discovery_dir: Some("/d".into()),
            ..etcd("http://127.0.0.1:2379")
        };
        assert_eq!(
            both.into_config(None, 1).unwrap_err().flag,
            "dynamo-discovery-etcd"
        );
        let file: crate::config::FileConfig = toml::from_str(
            "[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.dynamo]\nnamespace = \"d\"\nmodel = \"m\"\nblock_size = 16\naddress = \"127.0.0.1:1\"\nrecovery = \"tcp\"\ndiscovery_etcd = \"http://etcd:2379\"\n",
        )
        .unwrap();
        let r = NatsArgs::default()
            .into_config(file.nats, 1)
            .unwrap()
            .unwrap()
            .dynamo
            .unwrap()
            .recovery
            .unwrap();
        assert_eq!(r.discovery_etcd.as_deref(), Some("http://etcd:2379"));
        assert_eq!(d.address.to_string(), "10.0.0.1:8000");
        let flag = |a: NatsArgs| a.into_config(None, 1).unwrap_err().flag;
        assert_eq!(
            flag(NatsArgs {
                nats: None,
                ..full.clone()
            }),
            "dynamo-namespace"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_model: None,
                ..full.clone()
            }),
            "dynamo-model"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_block_size: Some(0),
                ..full.clone()
            }),
            "dynamo-block-size"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_address: Some("frontend:8000".into()),
                ..full.clone()
            }),
            "dynamo-address"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_subject: Some("a..b".into()),
                ..full.clone()
            }),
            "dynamo-subject"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_recovery_listen: Some("localhost:1".into()),
                ..full.clone()
            }),
            "dynamo-recovery-listen"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_recovery_timeout_ms: Some(0),
                ..full.clone()
            }),
            "dynamo-recovery-timeout-ms"
        );
        assert_eq!(
            flag(NatsArgs {
                dynamo_recovery_max_bytes: Some(100),
                ..full.clone()
            }),
            "dynamo-recovery-max-bytes"
        );
        // The [nats.dynamo] table, a flag over it, and a subject of another release.
        let file: crate::config::FileConfig = toml::from_str(
            "[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.dynamo]\nsubject = \"namespace.dynamo.component.backend.kv_events\"\nmodel = \"m\"\nblock_size = 32\naddress = \"127.0.0.1:1\"\nrecovery = \"off\"\n",
        )
        .unwrap();
        let flags = NatsArgs {
            dynamo_block_size: Some(64),
            ..NatsArgs::default()
        };
        let d = flags
            .into_config(file.nats, 1)
            .unwrap()
            .unwrap()
            .dynamo
            .unwrap();
        assert_eq!(d.subjects, ["namespace.dynamo.component.backend.kv_events"]);
        assert_eq!((d.block_size, d.recovery), (64, None));
        // Without a namespace or subject the reader is off.
        let off = NatsArgs {
            dynamo_namespace: None,
            ..full
        };
        assert_eq!(off.into_config(None, 1).unwrap().unwrap().dynamo, None);
    }
}
