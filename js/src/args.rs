//! Checks on numbers arriving from JavaScript. A JS number is a double: wasm-bindgen would
//! silently wrap `-1` or truncate `1.5` into an integer parameter, so integer arguments are
//! taken as `f64` and checked here instead.

use wasm_bindgen::{JsCast, JsError, JsValue};

/// `value` as an integer in `min..=max`, or an error naming `what`.
pub fn integer(value: f64, what: &str, min: u64, max: u64) -> Result<u64, String> {
    // Every u64 up to 2^53 is exact in a double; larger bounds are not used here.
    if value.fract() == 0.0 && value >= min as f64 && value <= max as f64 {
        Ok(value as u64)
    } else {
        Err(format!(
            "{what} must be an integer from {min} to {max}, got {value}"
        ))
    }
}

/// An optional integer argument, `default` when absent.
pub fn integer_or(
    value: Option<f64>,
    default: u64,
    what: &str,
    min: u64,
    max: u64,
) -> Result<u64, String> {
    value.map_or(Ok(default), |v| integer(v, what, min, max))
}

/// A message for JavaScript: thrown as an `Error` with it.
pub fn js(message: String) -> JsError {
    JsError::new(&message)
}

/// Reads a caller's plain object (or a JSON string of one) into `T`. The object goes
/// through `JSON.stringify` so one serde path reads both forms, and errors name the field
/// (`instances[1].load.requests: invalid type …`).
pub fn from_js<T: serde::de::DeserializeOwned>(value: &JsValue, what: &str) -> Result<T, JsError> {
    let text = match value.as_string() {
        Some(text) => text,
        None => js_sys::JSON::stringify(value)
            .map_err(|e| {
                let why = js_sys::Error::from(e).message();
                JsError::new(&format!("{what}: not a JSON value: {why}"))
            })?
            .as_string()
            .ok_or_else(|| JsError::new(&format!("{what}: missing")))?,
    };
    from_json(&text).map_err(|e| JsError::new(&format!("{what}: {e}")))
}

/// `T` from JSON text, the error naming the path of the field at fault.
pub fn from_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("{path}: {}", e.into_inner())
        }
    })?;
    de.end().map_err(|e| e.to_string())?;
    Ok(value)
}

#[wasm_bindgen::prelude::wasm_bindgen]
extern "C" {
    /// The platform's UTF-8 encoder (a global in browsers, Node, Deno and Bun).
    type TextEncoder;
    #[wasm_bindgen::prelude::wasm_bindgen(constructor)]
    fn new() -> TextEncoder;
    #[wasm_bindgen::prelude::wasm_bindgen(method)]
    fn encode(this: &TextEncoder, text: &JsValue) -> js_sys::Uint8Array;
}

thread_local! {
    static ENCODER: TextEncoder = TextEncoder::new();
}

/// The UTF-8 bytes of a JS string or a `Uint8Array`; `None` for anything else.
///
/// A `&str` parameter would be copied in by wasm-bindgen's glue one UTF-16 unit at a time in
/// a JS loop: for a 44 KB token header that loop cost 5x the parse itself. `TextEncoder`
/// encodes natively, then one block copy brings the bytes into wasm memory.
pub fn utf8_bytes(value: &JsValue) -> Option<Vec<u8>> {
    if value.is_string() {
        Some(ENCODER.with(|e| e.encode(value)).to_vec())
    } else if value.is_instance_of::<js_sys::Uint8Array>() {
        Some(js_sys::Uint8Array::from(value.clone()).to_vec())
    } else {
        None
    }
}
