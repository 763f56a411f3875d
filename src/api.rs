//! Serde types of the collector's JSON API (DESIGN.md, "HTTP API of the collector"). Field
//! names follow the indexer RFC discussed by Mooncake, Dynamo and llm-d; the aliases other
//! indexers accept are accepted too.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

/// `POST /register`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    #[serde(deserialize_with = "string_or_number")]
    pub instance_id: String,
    /// The engine's ZMQ PUB address, `tcp://host:port`.
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    pub block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// A LoRA adapter this instance serves under its own name: published as an alias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(
        default,
        alias = "additionalsalt",
        alias = "additional_salt",
        skip_serializing_if = "Option::is_none"
    )]
    pub cache_salt: Option<String>,
    /// The engine's serving `ip:port`, where the gateway sends requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

/// `POST /unregister`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnregisterRequest {
    #[serde(deserialize_with = "string_or_number")]
    pub instance_id: String,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// Absent: every dp rank of the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
}

/// `POST /query`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryRequest {
    pub token_ids: Vec<u32>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

/// `POST /query_by_hash`: Dynamo-style local block hashes, or sequence hashes; each as a u64,
/// an i64 (cast to u64) or a decimal string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryByHashRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_hashes: Option<Vec<HashValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_hashes: Option<Vec<HashValue>>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

/// The answer of `/query` and `/query_by_hash`. Counts are tokens (blocks × block size).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct QueryResponse {
    pub block_size: u32,
    pub query_blocks: u32,
    pub instances: BTreeMap<String, InstanceMatch>,
}

/// One instance's match. Tiers are cumulative (`gpu ≤ cpu ≤ disk`), `longest_matched` is the
/// best over dp ranks and tiers, `dp` each rank's best.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct InstanceMatch {
    pub address: String,
    pub longest_matched: u64,
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
    pub dp: BTreeMap<String, u64>,
}

/// One registration in `GET /workers`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub worker_id: u32,
    pub instance_id: String,
    pub dp_rank: u32,
    pub tenant_id: String,
    pub model_name: String,
    pub block_size: u32,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub address: String,
    pub lora_name: Option<String>,
    pub connected: bool,
    pub last_seq: Option<u64>,
    pub events: u64,
    pub blocks: u64,
    pub gaps: u64,
}

/// Every error: a 4xx status with this body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

impl ErrorBody {
    pub fn new(error: impl fmt::Display) -> Self {
        ErrorBody {
            error: error.to_string(),
        }
    }
}

/// A 64-bit hash given as u64, i64 or a decimal string of either.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct HashValue(pub u64);

impl<'de> Deserialize<'de> for HashValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HashValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a 64-bit hash as an integer or a decimal string")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HashValue, E> {
                Ok(HashValue(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HashValue, E> {
                Ok(HashValue(v as u64))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HashValue, E> {
                v.parse::<u64>()
                    .or_else(|_| v.parse::<i64>().map(|i| i as u64))
                    .map(HashValue)
                    .map_err(|_| E::custom(format!("{v:?} is not a decimal 64-bit hash")))
            }
        }
        d.deserialize_any(V)
    }
}

/// Instance ids are strings; some registrars send numbers.
fn string_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = String;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string or an integer")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
            Ok(v.to_string())
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
            Ok(v.to_owned())
        }
    }
    d.deserialize_any(V)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_accepts_the_aliases() {
        let r: RegisterRequest = serde_json::from_str(
            r#"{"instance_id": 7, "endpoint": "tcp://10.0.0.5:5557", "modelname": "m", "block_size": 16, "additionalsalt": "s"}"#,
        )
        .unwrap();
        assert_eq!(
            (
                r.instance_id.as_str(),
                r.model_name.as_str(),
                r.cache_salt.as_deref()
            ),
            ("7", "m", Some("s"))
        );
        let r: RegisterRequest = serde_json::from_str(
            r#"{"instance_id": "a", "endpoint": "e", "model": "m", "block_size": 16}"#,
        )
        .unwrap();
        assert_eq!(r.model_name, "m");
        assert!(serde_json::from_str::<RegisterRequest>(
            r#"{"instance_id": "a", "endpoint": "e", "model": "m", "block_size": "16"}"#
        )
        .is_err());
        assert!(serde_json::from_str::<RegisterRequest>(
            r#"{"instance_id": "a", "endpoint": "e", "model": "m", "block_size": 16, "x": 1}"#
        )
        .is_err());
    }

    #[test]
    fn hashes_come_in_three_shapes() {
        let q: QueryByHashRequest = serde_json::from_str(
            r#"{"block_hashes": [1, -1, "18446744073709551615", "-2"], "model_name": "m"}"#,
        )
        .unwrap();
        let got: Vec<u64> = q.block_hashes.unwrap().into_iter().map(|h| h.0).collect();
        assert_eq!(got, vec![1, u64::MAX, u64::MAX, u64::MAX - 1]);
        assert!(serde_json::from_str::<QueryByHashRequest>(
            r#"{"seq_hashes": ["x"], "model_name": "m"}"#
        )
        .is_err());
    }
}
