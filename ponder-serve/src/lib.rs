//! An OpenAI-compatible HTTP server over a Ponder engine: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both streamed or not), `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus). The
//! engine runs on its own thread ([`ponder::EngineHandle`]); requests reach it from the async
//! handlers and their events come back on per-request channels.

pub mod api;
mod error;
pub mod load;
mod logprobs;
mod metrics;
pub mod params;
mod routes;

pub use error::ApiError;
pub use params::Defaults;
pub use routes::{router, AppState, Limits};
