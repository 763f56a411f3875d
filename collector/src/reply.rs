//! The API's error answers: [`ApiError`] (a status and `{"error": ...}`), what each lower
//! error maps to, and [`json`], the body parse that names what is wrong.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use kvroute::api::ErrorBody;
use serde::de::DeserializeOwned;

use crate::hub::HubError;
use crate::text::TokenizeError;

/// An error answer: a status and a message for `{"error": ...}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(ErrorBody {
                error: self.message,
            }),
        )
            .into_response()
    }
}

impl From<HubError> for ApiError {
    fn from(e: HubError) -> ApiError {
        let status = match &e {
            HubError::BadRequest(_) => StatusCode::BAD_REQUEST,
            HubError::Conflict(_) => StatusCode::CONFLICT,
            HubError::NotFound(_) => StatusCode::NOT_FOUND,
            HubError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        };
        ApiError::new(status, e.to_string())
    }
}

impl From<TokenizeError> for ApiError {
    fn from(e: TokenizeError) -> ApiError {
        let status = match &e {
            TokenizeError::NoTokenizer(_) => StatusCode::NOT_FOUND,
            TokenizeError::Text(t) if t.is_too_large() => StatusCode::PAYLOAD_TOO_LARGE,
            TokenizeError::Text(_) => StatusCode::UNPROCESSABLE_ENTITY,
            TokenizeError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            TokenizeError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

/// Parses a JSON body, naming what is wrong with it.
pub fn json<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|rej| {
        let status = rej.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(status, "request body is too large")
        } else {
            ApiError::new(
                status,
                format!("cannot read the request body: {}", rej.body_text()),
            )
        }
    })?;
    serde_json::from_slice(&body).map_err(|e| {
        use serde_json::error::Category;
        let what = match e.classify() {
            Category::Syntax | Category::Eof => "malformed JSON",
            Category::Data => "invalid request",
            Category::Io => "cannot read the request body",
        };
        ApiError::new(StatusCode::BAD_REQUEST, format!("{what}: {e}"))
    })
}
