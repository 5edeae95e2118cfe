//! Errors as OpenAI returns them: a status and `{"error": {message, type, param, code}}`.

use crate::api::{ErrorBody, ErrorDetail};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ponder::{Error, InvalidRequest};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 for the client's request, naming the field at fault where there is one.
    pub fn bad(message: String, param: Option<&str>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message, kind: "invalid_request_error", param: param.map(str::to_string), code: None }
    }

    pub fn model_not_found(asked: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// A 429: the server holds as many requests as it takes; the client may retry in a second.
    pub fn busy(in_flight: usize) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is full ({in_flight} requests running or waiting); retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("server_busy"),
        }
    }

    /// The request ran past the server's time limit.
    pub fn timeout() -> Self {
        Self {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: "the request ran past the server's time limit".into(),
            kind: "server_error",
            param: None,
            code: Some("timeout"),
        }
    }

    /// A client error the router answers before any handler: no such endpoint, a method it does
    /// not take, a body over the server's limit.
    pub fn router(status: StatusCode) -> Self {
        let message = match status {
            StatusCode::NOT_FOUND => "no such endpoint: this server serves /v1/completions, /v1/chat/completions, /v1/models, /metrics and /health".into(),
            StatusCode::METHOD_NOT_ALLOWED => "this endpoint does not take that method".into(),
            StatusCode::PAYLOAD_TOO_LARGE => "the request body is larger than this server takes".into(),
            s => s.canonical_reason().unwrap_or("the request was refused").to_string(),
        };
        Self { status, message, kind: "invalid_request_error", param: None, code: None }
    }

    pub fn unavailable(message: String) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, message, kind: "server_error", param: None, code: None }
    }

    /// An engine error for one request: the client's fault (400) where the request is what the
    /// engine refused, the server's (500 / 503) otherwise. A request over the context window
    /// names the prompt where the prompt alone fills it, else the output's bound.
    pub fn from_engine(e: Error, prompt_field: &str, limit_field: &str) -> Self {
        let bad = |param: &str, code| Self { code, ..Self::bad(e.to_string(), Some(param)) };
        match &e {
            Error::InvalidRequest { reason: InvalidRequest::TooLong { prompt_tokens, max_context, .. }, .. } => {
                bad(if prompt_tokens >= max_context { prompt_field } else { limit_field }, Some("context_length_exceeded"))
            }
            Error::InvalidRequest { reason: InvalidRequest::BadSampling(_), .. } => bad("temperature", None),
            Error::InvalidRequest { reason: InvalidRequest::Logprobs(_), .. } => bad("logprobs", None),
            Error::InvalidRequest { .. } | Error::Tokenizer(_) | Error::ChatTemplate(_) => bad(prompt_field, None),
            Error::KvExhausted { .. } => bad(limit_field, Some("context_length_exceeded")),
            Error::EngineStopped => Self::unavailable(e.to_string()),
            _ => Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: e.to_string(), kind: "server_error", param: None, code: None },
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody { error: ErrorDetail { message: self.message.clone(), kind: self.kind, param: self.param.clone(), code: self.code } }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}
