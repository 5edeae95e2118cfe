//! The endpoints: a request is parsed, handed to the engine thread, and its events come back as
//! one JSON answer or as server-sent events. A client that goes away drops its event channel;
//! the forwarding thread then drops the request's stream, and the engine aborts the request (its
//! KV freed) at its next token.

use crate::api::*;
use crate::error::ApiError;
use crate::logprobs::Renderer;
use crate::params::{self, Defaults, Parsed};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use ponder::{EngineHandle, Event, FinishReason, RequestStream};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What every handler shares: the engine thread, the defaults of omitted fields and the bound on
/// requests held at once.
pub struct AppState {
    pub engine: EngineHandle,
    pub defaults: Defaults,
    pub limits: Limits,
    /// Renders tokens for log-probabilities (a copy of the engine's).
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// Requests submitted and not finished.
    in_flight: AtomicUsize,
}

/// How much the server takes on.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests running or waiting at most (`max_num_seqs` + the waiting queue's bound); one
    /// more is a 429.
    pub max_in_flight: usize,
    /// A request still generating after this long is ended (and aborted in the engine): a 504,
    /// or an error event on a stream.
    pub request_timeout: Option<Duration>,
}

impl AppState {
    pub fn new(engine: EngineHandle, defaults: Defaults, limits: Limits) -> Self {
        let tokenizer = engine.tokenizer().cloned().map(Arc::new);
        Self { engine, defaults, limits, tokenizer, in_flight: AtomicUsize::new(0) }
    }
}

/// One request's place in [`AppState::in_flight`], given back when it is dropped.
struct Slot(Arc<AppState>);

impl Slot {
    fn take(s: &Arc<AppState>) -> Result<Self, ApiError> {
        let held = s.in_flight.fetch_add(1, Ordering::AcqRel);
        if held >= s.limits.max_in_flight {
            s.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::busy(held));
        }
        Ok(Self(s.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The server's routes over `state`; `max_body_bytes` bounds a request body.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .fallback(|| async { ApiError::router(axum::http::StatusCode::NOT_FOUND) })
        .layer(tower_http::limit::RequestBodyLimitLayer::new(max_body_bytes))
        .layer(axum::middleware::map_response(json_errors))
        .with_state(state)
}

/// The client errors the router and its layers answer themselves — no such route, a method the
/// route does not take, a body over the limit (refused by its length, or while it is read) —
/// as OpenAI's error object, as every handler's own error is; their headers (`Allow`) kept.
async fn json_errors(r: Response) -> Response {
    let json = r.headers().get(axum::http::header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !r.status().is_client_error() || json {
        return r;
    }
    let (parts, _) = r.into_parts();
    let mut answer = ApiError::router(parts.status).into_response();
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_TYPE && name != axum::http::header::CONTENT_LENGTH {
            answer.headers_mut().insert(name, value.clone());
        }
    }
    answer
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let state = s.clone();
    match tokio::task::spawn_blocking(move || state.engine.metrics()).await {
        Ok(Ok(m)) => ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render(&m)).into_response(),
        _ => ApiError::unavailable("the engine stopped".into()).into_response(),
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: vec![Model { id: s.defaults.model.clone(), object: "model", created: 0, owned_by: "ponder" }] })
}

/// Which endpoint a request came through: what its answers look like.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    match params::completion(&body, &s.defaults) {
        Ok(p) => run(s, p, Kind::Completion).await.unwrap_or_else(IntoResponse::into_response),
        Err(e) => e.into_response(),
    }
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    match params::chat(&body, &s.defaults) {
        Ok(p) => run(s, p, Kind::Chat).await.unwrap_or_else(IntoResponse::into_response),
        Err(e) => e.into_response(),
    }
}

/// One of a request's events as the handler sees it.
enum Step {
    /// A generated token's text (`token`), or text held back until the request ended.
    Text {
        text: String,
        token: bool,
        compute: Option<ponder::TokenCompute>,
        /// The token and its log-probabilities, when the request asked for them.
        logprob: Option<(u32, ponder::TokenLogprob)>,
    },
    Done(FinishReason),
}

/// What the engine said when it took a request.
struct Admitted {
    id: u64,
    prompt_tokens: usize,
    steps: mpsc::UnboundedReceiver<Step>,
    /// When the request times out (`Limits::request_timeout`).
    deadline: Option<Instant>,
}

impl Admitted {
    /// The next step, or `None` when the engine stopped; `Err` past the deadline (dropping the
    /// receiver then aborts the request).
    async fn next(&mut self) -> Result<Option<Step>, ApiError> {
        match self.deadline {
            None => Ok(self.steps.recv().await),
            Some(at) => tokio::time::timeout_at(at, self.steps.recv()).await.map_err(|_| ApiError::timeout()),
        }
    }
}

/// Submits the request and forwards its events from the engine thread into a channel the async
/// side reads. The forwarder ends when the request finishes or the receiver is dropped (the
/// client went away): dropping the request's stream then makes the engine abort it.
async fn submit(s: &Arc<AppState>, p: Parsed, kind: Kind) -> Result<Admitted, ApiError> {
    let slot = Slot::take(s)?;
    let state = s.clone();
    let prompt_field = match kind {
        Kind::Completion => "prompt",
        Kind::Chat => "messages",
    };
    let limit_field = p.limit_field;
    let stream = tokio::task::spawn_blocking(move || state.engine.submit(p.prompt, p.params))
        .await
        .map_err(|e| ApiError::unavailable(format!("the engine thread is gone: {e}")))?
        .map_err(|e| ApiError::from_engine(e, prompt_field, limit_field))?;
    let (tx, steps) = mpsc::unbounded_channel();
    let (id, prompt_tokens) = (stream.id.0, stream.prompt_tokens);
    tokio::task::spawn_blocking(move || {
        forward(stream, tx);
        drop(slot);
    });
    let deadline = s.limits.request_timeout.map(|t| Instant::now() + t);
    Ok(Admitted { id, prompt_tokens, steps, deadline })
}

fn forward(stream: RequestStream, tx: mpsc::UnboundedSender<Step>) {
    for ev in stream {
        let (step, done) = match ev {
            Event::Token { token: id, text, compute, logprob, .. } => (Step::Text { text, token: true, compute, logprob: logprob.map(|lp| (id, lp)) }, false),
            Event::Finished { reason, text, .. } => {
                if !text.is_empty() && tx.send(Step::Text { text, token: false, compute: None, logprob: None }).is_err() {
                    return;
                }
                (Step::Done(reason), true)
            }
        };
        if tx.send(step).is_err() || done {
            return;
        }
    }
}

fn finish_reason(r: &FinishReason) -> Result<&'static str, ApiError> {
    match r {
        FinishReason::Eos | FinishReason::Stop(_) | FinishReason::Aborted => Ok("stop"),
        FinishReason::Length => Ok("length"),
        FinishReason::Error(m) => {
            Err(ApiError { status: axum::http::StatusCode::INTERNAL_SERVER_ERROR, message: m.clone(), kind: "server_error", param: None, code: None })
        }
    }
}

async fn run(s: Arc<AppState>, p: Parsed, kind: Kind) -> Result<Response, ApiError> {
    let (stream, include_usage, logprobs) = (p.stream, p.include_usage, p.params.logprobs.is_some());
    let a = submit(&s, p, kind).await?;
    let ids = Ids { id: a.id, model: s.defaults.model.clone(), created: now(), kind };
    let mut render = logprobs.then(|| Renderer::new(s.tokenizer.clone()));
    if stream {
        return Ok(axum::response::Sse::new(sse(ids, a, include_usage, render)).keep_alive(KeepAlive::default()).into_response());
    }
    let mut a = a;
    let (mut text, mut info, mut tokens, mut lps) = (String::new(), PonderInfo::default(), 0, Vec::new());
    let reason = loop {
        match a.next().await? {
            Some(Step::Text { text: t, token, compute, logprob }) => {
                text += &t;
                tokens += token as usize;
                info.push(compute);
                lps.extend(logprob);
            }
            Some(Step::Done(r)) => break finish_reason(&r)?,
            None => return Err(ApiError::unavailable("the engine stopped before the request finished".into())),
        }
    };
    let usage = Usage::new(a.prompt_tokens, tokens);
    Ok(match kind {
        Kind::Completion => Json(Completion {
            id: ids.name(),
            object: "text_completion",
            created: ids.created,
            model: ids.model,
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs: render.as_mut().map(|r| r.completion(&lps)),
                finish_reason: Some(reason),
                ponder: info,
            }],
            usage: Some(usage),
        })
        .into_response(),
        Kind::Chat => Json(ChatCompletion {
            id: ids.name(),
            object: "chat.completion",
            created: ids.created,
            model: ids.model,
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage { role: "assistant", content: text },
                logprobs: render.as_ref().map(|r| r.chat(&lps)),
                finish_reason: reason,
                ponder: info,
            }],
            usage,
        })
        .into_response(),
    })
}

/// One chunk's log-probabilities, in its API's shape.
enum Logprobs {
    Completion(crate::api::CompletionLogprobs),
    Chat(crate::api::ChatLogprobs),
}

/// What every answer of one request repeats.
#[derive(Clone)]
struct Ids {
    id: u64,
    model: String,
    created: u64,
    kind: Kind,
}

impl Ids {
    fn name(&self) -> String {
        match self.kind {
            Kind::Completion => format!("cmpl-{}", self.id),
            Kind::Chat => format!("chatcmpl-{}", self.id),
        }
    }

    /// One stream event: a piece of text, a finish reason, or (with no choice) the usage,
    /// serialised straight from its struct.
    fn chunk(&self, text: Option<String>, first: bool, finish: Option<&'static str>, info: PonderInfo, usage: Option<Usage>, lps: Option<Logprobs>) -> Sse {
        let no_choice = usage.is_some();
        let value = match self.kind {
            Kind::Completion => serde_json::to_string(&Completion {
                id: self.name(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: if no_choice {
                    vec![]
                } else {
                    let logprobs = match lps {
                        Some(Logprobs::Completion(l)) => Some(l),
                        _ => None,
                    };
                    vec![CompletionChoice { index: 0, text: text.unwrap_or_default(), logprobs, finish_reason: finish, ponder: info }]
                },
                usage,
            }),
            Kind::Chat => serde_json::to_string(&ChatChunk {
                id: self.name(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: if no_choice {
                    vec![]
                } else {
                    vec![ChatChunkChoice {
                        index: 0,
                        delta: Delta { role: first.then_some("assistant"), content: text },
                        logprobs: match lps {
                            Some(Logprobs::Chat(l)) => Some(l),
                            _ => None,
                        },
                        finish_reason: finish,
                        ponder: info,
                    }]
                },
                usage,
            }),
        };
        Sse::default().data(value.unwrap_or_default())
    }
}

/// The request's events as server-sent events: a chunk per token, one with the finish reason,
/// the usage when asked for, then `[DONE]`. An engine error ends the stream with an error object.
fn sse(ids: Ids, a: Admitted, include_usage: bool, render: Option<Renderer>) -> impl Stream<Item = Result<Sse, Infallible>> {
    struct S {
        ids: Ids,
        a: Admitted,
        tokens: usize,
        first: bool,
        include_usage: bool,
        render: Option<Renderer>,
        tail: Vec<Sse>,
        over: bool,
    }
    let state = S { ids, a, tokens: 0, first: true, include_usage, render, tail: Vec::new(), over: false };
    stream::unfold(state, |mut s| async move {
        if let Some(ev) = s.tail.pop() {
            return Some((Ok(ev), s));
        }
        if s.over {
            return None;
        }
        let error = |e: ApiError| Sse::default().data(serde_json::to_string(&e.body()).unwrap_or_default());
        let next = match s.a.next().await {
            Ok(next) => next,
            Err(e) => {
                s.over = true;
                s.tail.push(Sse::default().data("[DONE]"));
                return Some((Ok(error(e)), s));
            }
        };
        let ev = match next {
            Some(Step::Text { text, token, compute, logprob }) => {
                s.tokens += token as usize;
                let mut info = PonderInfo::default();
                info.push(compute);
                let kind = s.ids.kind;
                let lps = match (&mut s.render, logprob) {
                    (Some(r), Some(lp)) => Some(match kind {
                        Kind::Completion => Logprobs::Completion(r.completion(std::slice::from_ref(&lp))),
                        Kind::Chat => Logprobs::Chat(r.chat(std::slice::from_ref(&lp))),
                    }),
                    _ => None,
                };
                let ev = s.ids.chunk(Some(text), s.first, None, info, None, lps);
                s.first = false;
                ev
            }
            Some(Step::Done(reason)) => {
                s.over = true;
                s.tail.push(Sse::default().data("[DONE]"));
                match finish_reason(&reason) {
                    Ok(r) => {
                        if s.include_usage {
                            s.tail.push(s.ids.chunk(None, false, None, PonderInfo::default(), Some(Usage::new(s.a.prompt_tokens, s.tokens)), None));
                        }
                        s.ids.chunk(None, s.first, Some(r), PonderInfo::default(), None, None)
                    }
                    Err(e) => error(e),
                }
            }
            None => {
                s.over = true;
                error(ApiError::unavailable("the engine stopped before the request finished".into()))
            }
        };
        Some((Ok(ev), s))
    })
}
