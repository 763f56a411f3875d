//! JSON bodies of the HTTP API (DESIGN.md, "HTTP API of the collector"). Field names follow
//! the indexer RFC discussed by Mooncake, Dynamo and llm-d; unknown fields are ignored, as
//! Dynamo's indexer does.
//!
//! These are the collector's own definitions: the core's `kvroute::api` had no types when this
//! was written. They are plain serde structs, so switching is a rename.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

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
    pub model_name: String,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_string_or_number"
    )]
    pub tenant_id: Option<String>,
    /// Tokens per block; at least 1.
    pub block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    pub instance_id: String,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, deserialize_with = "opt_string_or_number")]
    pub tenant_id: Option<String>,
    /// Only this rank; all of the instance's ranks when absent.
    #[serde(default)]
    pub dp_rank: Option<u32>,
}

/// `POST /query`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct QueryRequest {
    pub token_ids: Vec<u32>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, deserialize_with = "opt_string_or_number")]
    pub tenant_id: Option<String>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    pub cache_salt: Option<String>,
}

/// `POST /query_by_hash`: local block hashes (Dynamo) or sequence hashes, each a u64, an i64
/// or a decimal string of either.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct QueryByHashRequest {
    #[serde(default, deserialize_with = "opt_hashes")]
    pub block_hashes: Option<Vec<u64>>,
    #[serde(default, deserialize_with = "opt_hashes")]
    pub seq_hashes: Option<Vec<u64>>,
    #[serde(alias = "model", alias = "modelname")]
    pub model_name: String,
    #[serde(default, deserialize_with = "opt_string_or_number")]
    pub tenant_id: Option<String>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default, alias = "additionalsalt", alias = "additional_salt")]
    pub cache_salt: Option<String>,
}

/// One instance's match in a [`QueryResponse`], in tokens.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq, Default)]
pub struct InstanceMatch {
    pub address: String,
    pub longest_matched: u64,
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
    /// Each dp rank's best, in tokens, keyed by the rank in decimal.
    pub dp: BTreeMap<String, u64>,
}

/// The answer of `/query` and `/query_by_hash`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq, Default)]
pub struct QueryResponse {
    pub block_size: u32,
    pub query_blocks: u64,
    pub instances: BTreeMap<String, InstanceMatch>,
}

/// Every 4xx/5xx body.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub error: String,
}

fn string_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    // Through a `Value`, so that syntax errors stay syntax errors.
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Ok(s),
        serde_json::Value::Number(n) if n.is_u64() || n.is_i64() => Ok(n.to_string()),
        _ => Err(serde::de::Error::custom("expected a string or an integer")),
    }
}

fn opt_string_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(deserialize_with = "string_or_number")] String);
    Ok(Option::<W>::deserialize(d)?.map(|w| w.0))
}

/// A hash as JSON gives it: u64, i64 (its two's-complement bits) or a decimal string of either.
fn opt_hashes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum H {
        U(u64),
        I(i64),
        S(String),
    }
    let Some(raw) = Option::<Vec<serde_json::Value>>::deserialize(d)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(raw.len());
    for (i, v) in raw.into_iter().enumerate() {
        let bad = || {
            serde::de::Error::custom(format!(
                "hash #{i} is not a u64, an i64 or a decimal string of one"
            ))
        };
        let h: H = serde_json::from_value(v).map_err(|_| bad())?;
        out.push(match h {
            H::U(u) => u,
            H::I(i) => i as u64,
            H::S(s) => match s.trim().parse::<u64>() {
                Ok(u) => u,
                Err(_) => s.trim().parse::<i64>().map_err(|_| bad())? as u64,
            },
        });
    }
    Ok(Some(out))
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
