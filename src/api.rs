//! Serde types of the collector's JSON API (ARCHITECTURE.md, "HTTP API of the collector"), shared by
//! the collector (server), the filter's remote mode and the simulator's benchmark (clients).
//! Field names follow the indexer RFC discussed by Mooncake, Dynamo and llm-d, with the
//! aliases other indexers accept; unknown fields are ignored, as Dynamo's indexer does, so
//! its clients (which send `routing_group` and the like) work unchanged.

use std::collections::BTreeMap;

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

/// `POST /register`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct RegisterRequest {
    /// The engine instance; a string, or a number as Dynamo's workers send.
    #[serde(deserialize_with = "string_or_number")]
    pub instance_id: String,
    /// The engine's ZMQ PUB address, `tcp://host:port`.
    pub endpoint: String,
    /// The engine's replay ROUTER address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    #[serde(alias = "model", alias = "modelname")]
    /// The model the engine serves.
    pub model_name: String,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_string_or_number"
    )]
    /// Tenant (`default` when absent).
    pub tenant_id: Option<String>,
    /// Tokens per block; at least 1.
    pub block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Data-parallel rank of the worker, if the engine has several.
    pub dp_rank: Option<u32>,
    /// A LoRA adapter the worker serves under its own name (published as an alias).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// Salt of the worker's blocks when its events carry none (Dynamo's `additional_salt`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        alias = "additionalsalt",
        alias = "additional_salt"
    )]
    pub cache_salt: Option<String>,
    /// The engine's serving `ip:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

/// `POST /unregister`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct UnregisterRequest {
    #[serde(deserialize_with = "string_or_number")]
    /// The engine instance.
    pub instance_id: String,
    #[serde(alias = "model", alias = "modelname")]
    /// The model it served.
    pub model_name: String,
    #[serde(default, deserialize_with = "opt_string_or_number")]
    /// Tenant (`default` when absent).
    pub tenant_id: Option<String>,
    /// Only this rank; all of the instance's ranks when absent.
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

/// `POST /query`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct QueryRequest {
    /// The prompt's token ids.
    pub token_ids: Vec<u32>,
    #[serde(alias = "model", alias = "modelname")]
    /// The model name the client sent.
    pub model_name: String,
    #[serde(default, deserialize_with = "opt_string_or_number")]
    /// Tenant (`default` when absent).
    pub tenant_id: Option<String>,
    #[serde(default)]
    /// LoRA adapter, if any.
    pub lora_name: Option<String>,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    /// Cache salt, if any.
    pub cache_salt: Option<String>,
}

/// `POST /query_by_hash`: local block hashes (Dynamo) or sequence hashes, each a u64, an i64
/// or a decimal string of either.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct QueryByHashRequest {
    #[serde(default, deserialize_with = "opt_hashes")]
    /// Block hashes of the prompt (give these or `seq_hashes`).
    pub block_hashes: Option<Vec<u64>>,
    #[serde(default, deserialize_with = "opt_hashes")]
    /// Sequence hashes of the prompt.
    pub seq_hashes: Option<Vec<u64>>,
    #[serde(alias = "model", alias = "modelname")]
    /// The model name the client sent.
    pub model_name: String,
    #[serde(default, deserialize_with = "opt_string_or_number")]
    /// Tenant (`default` when absent).
    pub tenant_id: Option<String>,
    #[serde(default)]
    /// LoRA adapter, if any.
    pub lora_name: Option<String>,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    /// Cache salt, if any.
    pub cache_salt: Option<String>,
}

/// One instance's match in a [`QueryResponse`], in tokens.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq, Default)]
pub struct InstanceMatch {
    /// Where the instance takes requests (`host:port`).
    pub address: String,
    /// Longest match over all tiers, in tokens.
    pub longest_matched: u64,
    /// Tokens matched in GPU memory.
    pub gpu: u64,
    /// Tokens matched in GPU or CPU memory.
    pub cpu: u64,
    /// Tokens matched in any tier.
    pub disk: u64,
    /// Each dp rank's best, in tokens, keyed by the rank in decimal.
    pub dp: BTreeMap<String, u64>,
}

/// The answer of `/query` and `/query_by_hash`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq, Default)]
pub struct QueryResponse {
    /// Tokens per block of the model.
    pub block_size: u32,
    /// Full blocks of the query.
    pub query_blocks: u32,
    /// Each instance holding a match, by instance id.
    pub instances: BTreeMap<String, InstanceMatch>,
}

/// Every 4xx/5xx body.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: String,
}

impl ErrorBody {
    /// A body saying `error`.
    pub fn new(error: impl std::fmt::Display) -> Self {
        ErrorBody {
            error: error.to_string(),
        }
    }
}

/// A string, or an integer given where a string is meant (Dynamo's workers send numeric ids).
struct StringOrNumber;

impl Visitor<'_> for StringOrNumber {
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

fn string_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_any(StringOrNumber)
}

fn opt_string_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(deserialize_with = "string_or_number")] String);
    Ok(Option::<W>::deserialize(d)?.map(|w| w.0))
}

/// A hash as JSON gives it: u64, i64 (its two's-complement bits) or a decimal string of either.
struct Hash64;

impl Visitor<'_> for Hash64 {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a u64, an i64 or a decimal string of one")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        Ok(v as u64)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        let v = v.trim();
        v.parse::<u64>()
            .or_else(|_| v.parse::<i64>().map(|i| i as u64))
            .map_err(|_| {
                E::custom(format!(
                    "{v:?} is not a u64, an i64 or a decimal string of one"
                ))
            })
    }
}

fn opt_hashes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
    #[derive(Deserialize)]
    struct H(#[serde(deserialize_with = "hash64")] u64);
    fn hash64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(Hash64)
    }
    Ok(Option::<Vec<H>>::deserialize(d)?.map(|v| v.into_iter().map(|h| h.0).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_accepts_aliases_and_numeric_ids() {
        let r: RegisterRequest = serde_json::from_str(
            r#"{"instance_id":7,"endpoint":"tcp://10.0.0.1:5557","modelname":"m","block_size":16,"additionalsalt":"s","extra":1}"#,
        )
        .unwrap();
        assert_eq!(r.instance_id, "7");
        assert_eq!(r.model_name, "m");
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
    }

    #[test]
    fn hashes_come_as_u64_i64_or_strings() {
        let q: QueryByHashRequest = serde_json::from_str(
            r#"{"block_hashes":[1,-1,"18446744073709551615","-2"],"model":"m"}"#,
        )
        .unwrap();
        assert_eq!(
            q.block_hashes.unwrap(),
            vec![1, u64::MAX, u64::MAX, u64::MAX - 1]
        );
        assert!(
            serde_json::from_str::<QueryByHashRequest>(r#"{"seq_hashes":["x"],"model":"m"}"#)
                .is_err()
        );
    }
}
