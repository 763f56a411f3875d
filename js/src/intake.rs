//! Token intake (`kvroute::intake`): token ids from a header value and from a JSON body, read
//! as the filter reads them, with the filter's default limits.

use js_sys::{Object, Reflect};
use kvroute::intake::{self as core, FieldKind, Found};
use serde::Deserialize;
use wasm_bindgen::prelude::*;

use crate::args;

/// Most tokens in a header or metadata value (the filter's limit).
pub const MAX_HEADER_TOKENS: u64 = 1 << 20;

/// The filter's default `max_body_bytes`: larger bodies are not read.
pub const MAX_BODY_BYTES: u64 = 1_000_000;

/// Token ids from a header value (a string, or its bytes): a decimal comma list (`"1, 2, 3"`) or the base64 (standard
/// or URL-safe, padding optional) of the tokens as little-endian `u32`.
///
/// Throws on a malformed value or more than `maxTokens` (default 2^20) tokens.
#[wasm_bindgen(js_name = parseTokenHeader)]
pub fn parse_token_header(
    #[wasm_bindgen(unchecked_param_type = "string | Uint8Array")] value: JsValue,
    max_tokens: Option<f64>,
) -> Result<Vec<u32>, JsError> {
    let max = args::integer_or(max_tokens, MAX_HEADER_TOKENS, "maxTokens", 0, 1 << 32)
        .map_err(args::js)?;
    let value = args::utf8_bytes(&value)
        .ok_or_else(|| JsError::new("token header: expected a string or a Uint8Array"))?;
    let mut out = Vec::new();
    core::parse_token_string(&value, &mut out, usize::try_from(max).unwrap_or(usize::MAX))
        .map_err(|e| JsError::new(&format!("token header: {e}")))?;
    Ok(out)
}

/// The header value of `tokens`: base64 of little-endian `u32`s, standard alphabet, padded.
#[wasm_bindgen(js_name = encodeTokenHeader)]
pub fn encode_token_header(tokens: &[u32]) -> String {
    core::encode_base64_u32(tokens)
}

/// Which body fields to read; every one optional, the filter's defaults otherwise.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BodyOptions {
    /// Fields holding token ids, first present wins (default `prompt`, `prompt_token_ids`,
    /// `input_ids`).
    pub token_fields: Option<Vec<String>>,
    /// The served model's field (default `model`).
    pub model_field: Option<String>,
    /// vLLM's cache salt field (default `cache_salt`).
    pub cache_salt_field: Option<String>,
    /// A tenant field (default none: the filter takes the tenant from a header).
    pub tenant_field: Option<String>,
    /// Bodies larger than this are refused (default 1,000,000); the token limit is half of it.
    pub max_body_bytes: Option<f64>,
}

/// The decode budget fields the filter books load with, first present wins.
const DECODE_FIELDS: [&str; 2] = ["max_completion_tokens", "max_tokens"];

/// Reads a JSON request body (`string` or UTF-8 bytes) in one pass: the token ids of the
/// first token field present, and the model, cache salt, tenant and decode budget.
///
/// Returns `{ tokens: Uint32Array, tokenField, model, cacheSalt, tenant, decodeTokens }`
/// (absent fields are `null`; `tokens` is empty when no token field holds an array). Throws
/// on malformed JSON, a non-object body, a token that is not an integer in `0..2^32`, or a
/// body over `maxBodyBytes`.
#[wasm_bindgen(js_name = readBody, unchecked_return_type = "BodyFields")]
pub fn read_body(
    #[wasm_bindgen(unchecked_param_type = "string | Uint8Array")] body: JsValue,
    #[wasm_bindgen(unchecked_param_type = "BodyOptions | undefined")] options: JsValue,
) -> Result<JsValue, JsError> {
    let opts: BodyOptions = if options.is_undefined() || options.is_null() {
        BodyOptions::default()
    } else {
        args::from_js(&options, "body options")?
    };
    let bytes = args::utf8_bytes(&body)
        .ok_or_else(|| JsError::new("body: expected a string or a Uint8Array"))?;
    let fields = read_body_fields(&bytes, &opts).map_err(args::js)?;
    fields.to_js()
}

/// What [`read_body`] found, before it becomes a JS object.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BodyFields {
    /// Token ids of the first token field present.
    pub tokens: Vec<u32>,
    /// The field they came from.
    pub token_field: Option<String>,
    /// The model name.
    pub model: Option<String>,
    /// The cache salt.
    pub cache_salt: Option<String>,
    /// The tenant.
    pub tenant: Option<String>,
    /// `max_completion_tokens` or `max_tokens`.
    pub decode_tokens: Option<u64>,
}

/// The scan itself, free of JS types so native tests reach it.
pub fn read_body_fields(body: &[u8], opts: &BodyOptions) -> Result<BodyFields, String> {
    let max_body = args::integer_or(
        opts.max_body_bytes,
        MAX_BODY_BYTES,
        "maxBodyBytes",
        1,
        1 << 32,
    )?;
    if body.len() as u64 > max_body {
        return Err(format!(
            "body: {} bytes, more than maxBodyBytes ({max_body})",
            body.len()
        ));
    }
    let token_fields: Vec<String> = opts.token_fields.clone().unwrap_or_else(|| {
        ["prompt", "prompt_token_ids", "input_ids"]
            .map(String::from)
            .to_vec()
    });
    let strs = [
        opts.model_field.clone().or_else(|| Some("model".into())),
        opts.cache_salt_field
            .clone()
            .or_else(|| Some("cache_salt".into())),
        opts.tenant_field.clone(),
    ];
    let mut fields: Vec<(String, FieldKind)> = token_fields
        .iter()
        .map(|f| (f.clone(), FieldKind::Tokens))
        .collect();
    let str_at: Vec<Option<usize>> = strs
        .iter()
        .map(|f| {
            f.as_ref().map(|f| {
                fields.push((f.clone(), FieldKind::Str));
                fields.len() - 1
            })
        })
        .collect();
    let decode_at = fields.len();
    fields.extend(DECODE_FIELDS.map(|f| (f.to_owned(), FieldKind::Uint)));

    let mut tokens = Vec::new();
    let mut found = vec![Found::Absent; fields.len()];
    // The filter's token limit: half the body limit (a token takes two bytes at least).
    let max_tokens = usize::try_from((max_body / 2).max(1)).unwrap_or(usize::MAX);
    core::scan_json(body, &fields, &mut tokens, &mut found, max_tokens)
        .map_err(|e| format!("body: {e}"))?;

    let mut out = BodyFields::default();
    // A field name may be listed twice: the scanner fills its first slot only.
    let slot = |i: usize| {
        let name = &fields[i].0;
        let first = fields.iter().position(|(n, _)| n == name).unwrap_or(i);
        found[first]
    };
    if let Some((i, s, e)) = (0..token_fields.len()).find_map(|i| match slot(i) {
        Found::Tokens { start, end } => Some((i, start, end)),
        _ => None,
    }) {
        out.tokens = tokens.get(s..e).unwrap_or_default().to_vec();
        out.token_field = Some(token_fields[i].clone());
    }
    let string = |at: Option<usize>| {
        match at.map(slot) {
            Some(Found::Str {
                start,
                end,
                escaped,
            }) => {
                let raw = body.get(start..end).unwrap_or_default();
                if escaped {
                    core::unescape(raw)
                } else {
                    std::str::from_utf8(raw).ok().map(str::to_owned)
                }
            }
            _ => None,
        }
        .filter(|s| !s.is_empty())
    };
    out.model = string(str_at[0]);
    out.cache_salt = string(str_at[1]);
    out.tenant = string(str_at[2]);
    out.decode_tokens = (decode_at..fields.len()).find_map(|i| match slot(i) {
        Found::Uint(n) => Some(n),
        _ => None,
    });
    Ok(out)
}

impl BodyFields {
    fn to_js(&self) -> Result<JsValue, JsError> {
        let o = Object::new();
        let opt_str = |s: &Option<String>| s.as_deref().map_or(JsValue::NULL, JsValue::from_str);
        let set = |k: &str, v: JsValue| {
            Reflect::set(&o, &JsValue::from_str(k), &v)
                .map_err(|_| JsError::new("body: could not build the result object"))
        };
        set(
            "tokens",
            js_sys::Uint32Array::from(self.tokens.as_slice()).into(),
        )?;
        set("tokenField", opt_str(&self.token_field))?;
        set("model", opt_str(&self.model))?;
        set("cacheSalt", opt_str(&self.cache_salt))?;
        set("tenant", opt_str(&self.tenant))?;
        // Decode budgets are far below 2^53: a plain number.
        set(
            "decodeTokens",
            self.decode_tokens
                .map_or(JsValue::NULL, |n| JsValue::from_f64(n as f64)),
        )?;
        Ok(o.into())
    }
}

#[wasm_bindgen(typescript_custom_section)]
const BODY_TYPES: &str = r#"
/** Which body fields `readBody` reads; the filter's defaults when absent. */
export interface BodyOptions {
  /** Fields holding token ids, first present wins. Default ["prompt", "prompt_token_ids", "input_ids"]. */
  tokenFields?: string[];
  /** Default "model". */
  modelField?: string;
  /** Default "cache_salt". */
  cacheSaltField?: string;
  /** Default none. */
  tenantField?: string;
  /** Bodies larger than this throw; the token limit is half of it. Default 1000000. */
  maxBodyBytes?: number;
}

/** What `readBody` found; absent fields are null. */
export interface BodyFields {
  tokens: Uint32Array;
  tokenField: string | null;
  model: string | null;
  cacheSalt: string | null;
  tenant: string | null;
  /** max_completion_tokens, else max_tokens. */
  decodeTokens: number | null;
}
"#;
