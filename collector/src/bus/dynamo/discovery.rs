//! Where a Dynamo worker's KV query endpoint listens, from Dynamo's file discovery
//! (`--dynamo-discovery-dir`, the directory a deployment gives its workers as `DYN_FILE_KV`).
//!
//! # The record (ai-dynamo 1.6.1; `testdata/dynamo/tcp_request_plane_1.6.1.txt`)
//!
//! Each endpoint instance is one file, `<root>/v1/instances/<key>`, the key
//! `<ns>/<component>/<endpoint>/<instance id, hex>` with every byte outside `[A-Za-z0-9]`
//! written `%XX` ([`super::naming::QueryEndpoint::discovery_file`]). The file is JSON:
//! `{"type": "Endpoint", "namespace", "component", "endpoint", "instance_id": u64,
//! "transport": {"tcp": "<host>:<port>/<endpoint path>"}, "device_type", "request_plane_codec"}`
//! on the TCP request plane; the endpoint path is what a request names on the wire
//! ([`super::tcp`]). A worker keeps its files fresh by touching them and removes them when it
//! stops cleanly; a file left by a worker that died points at a port nobody answers on, and
//! the query fails there like any other.
//!
//! The directory is input from outside: one file is read (named from the event, never
//! listed), at most [`MAX_RECORD`] bytes of it, through `tokio::fs`; a record that does not
//! parse or names another instance is [`Lookup::Malformed`], never a panic.

use std::path::Path;

use serde::Deserialize;
use tokio::io::AsyncReadExt;

use super::naming::QueryEndpoint;

/// Largest record read (1.6.1's are about 300 bytes).
pub const MAX_RECORD: u64 = 64 << 10;

/// What discovery says of one worker's KV query endpoint; each is counted under
/// `kvroute_bus_messages_total{dir="dynamo_discovery",outcome}` by its [`Lookup::outcome`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// On the TCP request plane: `addr` (`host:port`) serves `path`.
    Tcp { addr: String, path: String },
    /// Registered on another transport (the NATS request plane's subject).
    Other,
    /// No record (not this deployment's discovery, or the worker is gone).
    Missing,
    /// A record too large, unreadable, not of the shape above, or of another instance.
    Malformed,
}

impl Lookup {
    /// The `outcome` label of its count.
    pub fn outcome(&self) -> &'static str {
        match self {
            Lookup::Tcp { .. } => "tcp",
            Lookup::Other => "other_transport",
            Lookup::Missing => "missing",
            Lookup::Malformed => "malformed",
        }
    }
}

#[derive(Deserialize)]
struct Record {
    namespace: String,
    component: String,
    endpoint: String,
    instance_id: u64,
    transport: serde_json::Map<String, serde_json::Value>,
}

/// Reads the record of `q` under `root`.
pub async fn lookup(root: &Path, q: &QueryEndpoint) -> Lookup {
    let path = root.join("v1").join("instances").join(q.discovery_file());
    let file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Lookup::Missing,
        Err(_) => return Lookup::Malformed,
    };
    // One byte past the limit tells a record that is too large from one that fits.
    let mut bytes = Vec::new();
    if file
        .take(MAX_RECORD + 1)
        .read_to_end(&mut bytes)
        .await
        .is_err()
        || bytes.len() as u64 > MAX_RECORD
    {
        return Lookup::Malformed;
    }
    parse(&bytes, q)
}

/// One record's bytes, checked against the endpoint it should describe.
pub fn parse(bytes: &[u8], q: &QueryEndpoint) -> Lookup {
    let Ok(r) = serde_json::from_slice::<Record>(bytes) else {
        return Lookup::Malformed;
    };
    if (
        r.namespace.as_str(),
        r.component.as_str(),
        r.endpoint.as_str(),
        r.instance_id,
    ) != (
        q.namespace.as_str(),
        q.component.as_str(),
        q.endpoint.as_str(),
        q.worker_id,
    ) {
        return Lookup::Malformed;
    }
    let Some(tcp) = r.transport.get("tcp") else {
        return if r.transport.len() == 1 {
            Lookup::Other
        } else {
            Lookup::Malformed
        };
    };
    let Some((addr, path)) = tcp.as_str().and_then(|t| t.split_once('/')) else {
        return Lookup::Malformed;
    };
    // The path is sent behind a u16 length ([`super::tcp`]).
    let port_ok = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok || path.is_empty() || path.len() > usize::from(u16::MAX) {
        return Lookup::Malformed;
    }
    Lookup::Tcp {
        addr: addr.to_owned(),
        path: path.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The captured worker's KV query endpoint (testdata/dynamo/README.md).
    fn captured() -> (QueryEndpoint, String) {
        let text = include_str!("../../../../testdata/dynamo/tcp_request_plane_1.6.1.txt");
        let record = text
            .lines()
            .find_map(|l| l.strip_prefix("instance: "))
            .unwrap()
            .to_owned();
        let q = QueryEndpoint {
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "worker_kv_query_source_5d9a76a3846f7".into(),
            worker_id: 14_507_558_946_996_755_466,
        };
        (q, record)
    }

    #[test]
    fn the_captured_record_names_the_workers_tcp_address_and_path() {
        let (q, record) = captured();
        assert_eq!(
            parse(record.as_bytes(), &q),
            Lookup::Tcp {
                addr: "127.0.0.1:42447".into(),
                path: "c95533ff79c81c0a/dynamo/backend/worker_kv_query_source_5d9a76a3846f7".into()
            }
        );
    }

    #[test]
    fn other_records_are_told_apart_and_bad_ones_are_malformed() {
        let (q, record) = captured();
        let v: serde_json::Value = serde_json::from_str(&record).unwrap();
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = v.clone();
            f(&mut v);
            parse(v.to_string().as_bytes(), &q)
        };
        assert_eq!(
            with(&|v| v["transport"] = serde_json::json!({"nats_tcp": "dynamo_backend.x"})),
            Lookup::Other
        );
        for bad in [
            with(&|v| v["instance_id"] = 1.into()),
            with(&|v| v["endpoint"] = "generate".into()),
            with(&|v| v["transport"] = serde_json::json!({"tcp": "127.0.0.1:42447"})),
            with(&|v| v["transport"] = serde_json::json!({"tcp": "127.0.0.1/path"})),
            with(&|v| v["transport"] = serde_json::json!({"tcp": ":1/path"})),
            with(&|v| v["transport"] = serde_json::json!({"tcp": "h:1/"})),
            with(&|v| v["transport"] = serde_json::json!({"tcp": 5})),
            with(&|v| {
                v["transport"] = serde_json::json!({"tcp": format!("h:1/{}", "p".repeat(70_000))})
            }),
            with(&|v| v["transport"] = serde_json::json!({})),
            with(&|v| {
                v.as_object_mut().unwrap().remove("transport");
            }),
            parse(b"", &q),
            parse(b"{\"namespace\":", &q),
            parse(&record.as_bytes()[..100], &q),
        ] {
            assert_eq!(bad, Lookup::Malformed);
        }
    }

    #[tokio::test]
    async fn records_are_read_from_the_named_file_and_bounded() {
        let (q, record) = captured();
        let root = std::env::temp_dir().join(format!("kvroute-discovery-{}", std::process::id()));
        let dir = root.join("v1").join("instances");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(lookup(&root, &q).await, Lookup::Missing);
        std::fs::write(dir.join(q.discovery_file()), &record).unwrap();
        assert!(matches!(lookup(&root, &q).await, Lookup::Tcp { .. }));
        // Padded past the limit (JSON allows the whitespace): refused unparsed.
        let mut big = record.clone().into_bytes();
        big.resize(MAX_RECORD as usize + 1, b' ');
        std::fs::write(dir.join(q.discovery_file()), &big).unwrap();
        assert_eq!(lookup(&root, &q).await, Lookup::Malformed);
        big.truncate(MAX_RECORD as usize);
        std::fs::write(dir.join(q.discovery_file()), &big).unwrap();
        assert!(matches!(lookup(&root, &q).await, Lookup::Tcp { .. }));
        // A directory where the file should be.
        std::fs::remove_file(dir.join(q.discovery_file())).unwrap();
        std::fs::create_dir(dir.join(q.discovery_file())).unwrap();
        assert_eq!(lookup(&root, &q).await, Lookup::Malformed);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
