//! From a request body to the engine's terms: the fields checked (unknown, unsupported, out of
//! range: a 400 naming the field), the prompt and the generation parameters built.

use crate::api::{ChatRequest, Common, CompletionPrompt, CompletionRequest, CHAT_FIELDS, CHAT_REQUIRED, COMMON_FIELDS, COMPLETION_FIELDS, COMPLETION_REQUIRED};
use crate::error::ApiError;
use ponder::{Chat, ChatMessage, GenerationParams, Prompt, SamplingParams, MAX_TOP_LOGPROBS};
use serde::de::DeserializeOwned;

/// OpenAI's bound on `stop` sequences.
const MAX_STOP: usize = 4;
/// OpenAI's bound on the completions API's `logprobs` (alternatives per token).
const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// A request the engine can take: its prompt, parameters and how to answer.
pub struct Parsed {
    pub prompt: Prompt,
    pub params: GenerationParams,
    pub stream: bool,
    pub include_usage: bool,
    /// The field that bounds the output, as the client named it (`max_tokens` or
    /// `max_completion_tokens`): what an error about the length names.
    pub limit_field: &'static str,
}

/// Reads a body as the endpoint's own fields `T` (`own`, of which `required` must be present)
/// and the shared ones, refusing any other field and naming the field a type error is in.
fn read<T: DeserializeOwned>(body: &[u8], own: &[&str], required: &[&str]) -> Result<(T, Common), ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}"), None))?;
    let serde_json::Value::Object(object) = value else {
        return Err(ApiError::bad("the body must be a JSON object".into(), None));
    };
    if let Some(key) = object.keys().find(|k| !own.contains(&k.as_str()) && !COMMON_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::bad(format!("Unrecognized request argument supplied: {key}"), Some(key)));
    }
    if let Some(field) = required.iter().find(|f| !object.contains_key(**f)) {
        return Err(ApiError::bad(format!("`{field}` is required"), Some(field)));
    }
    let (shared, own): (serde_json::Map<_, _>, serde_json::Map<_, _>) = object.into_iter().partition(|(k, _)| COMMON_FIELDS.contains(&k.as_str()));
    Ok((typed(own)?, typed(shared)?))
}

/// `fields` as `T`, a type error naming the field it is in.
fn typed<T: DeserializeOwned>(fields: serde_json::Map<String, serde_json::Value>) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(serde_json::Value::Object(fields)).map_err(|e| {
        let path = e.path().to_string();
        ApiError::bad(format!("invalid `{path}`: {}", e.inner()), Some(&path))
    })
}

/// A field the server does not implement, given a value other than its neutral one.
fn unsupported(field: &str, set: bool) -> Result<(), ApiError> {
    if set {
        return Err(ApiError::bad(format!("`{field}` is not supported by this server"), Some(field)));
    }
    Ok(())
}

fn positive(field: &str, value: Option<u64>, default: u64) -> Result<usize, ApiError> {
    match value {
        Some(0) => Err(ApiError::bad(format!("`{field}` must be at least 1"), Some(field))),
        Some(n) => usize::try_from(n).map_err(|_| ApiError::bad(format!("`{field}` is too large"), Some(field))),
        None => Ok(default as usize),
    }
}

/// What a request that leaves a field out gets.
#[derive(Debug, Clone)]
pub struct Defaults {
    /// The model id clients name (`GET /v1/models`).
    pub model: String,
    /// Chat completions without `max_completion_tokens` / `max_tokens`.
    pub max_tokens: u64,
    /// Requests without `temperature` (OpenAI's is 1; the diffusion releases decode greedily: 0).
    pub temperature: f32,
}

/// The fields both endpoints share, checked, into the engine's parameters.
fn common(c: Common, max_new_tokens: usize, d: &Defaults) -> Result<(GenerationParams, bool, bool), ApiError> {
    unsupported("n", c.n.is_some_and(|n| n != 1))?;
    unsupported("presence_penalty", c.presence_penalty.is_some_and(|p| p != 0.0))?;
    unsupported("frequency_penalty", c.frequency_penalty.is_some_and(|p| p != 0.0))?;
    if c.stream_options.is_some() && !c.stream {
        return Err(ApiError::bad("`stream_options` is only allowed with `stream: true`".into(), Some("stream_options")));
    }
    if let Some(t) = c.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
        return Err(ApiError::bad(format!("`temperature` must be within [0, 2], not {t}"), Some("temperature")));
    }
    if let Some(p) = c.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(ApiError::bad(format!("`top_p` must be within (0, 1], not {p}"), Some("top_p")));
    }
    if c.top_k == Some(0) {
        return Err(ApiError::bad("`top_k` must be at least 1".into(), Some("top_k")));
    }
    let stop = c.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(ApiError::bad(format!("`stop` takes at most {MAX_STOP} non-empty strings"), Some("stop")));
    }
    let sampling = SamplingParams { temperature: c.temperature.unwrap_or(d.temperature), top_k: c.top_k, top_p: c.top_p, seed: c.seed };
    let params = GenerationParams { max_new_tokens, sampling, stop, ignore_eos: c.ignore_eos, forced_tokens: Vec::new(), logprobs: None };
    let include_usage = c.stream_options.is_some_and(|o| o.include_usage);
    Ok((params, c.stream, include_usage))
}

/// `POST /v1/completions`: `max_tokens` defaults to 16, as OpenAI's does.
pub fn completion(body: &[u8], d: &Defaults) -> Result<Parsed, ApiError> {
    let (r, c): (CompletionRequest, Common) = read(body, &COMPLETION_FIELDS, &COMPLETION_REQUIRED)?;
    check_model(&r.model, &d.model)?;
    if let Some(n) = r.logprobs.filter(|&n| n > MAX_COMPLETION_LOGPROBS) {
        return Err(ApiError::bad(format!("`logprobs` must be within [0, {MAX_COMPLETION_LOGPROBS}], not {n}"), Some("logprobs")));
    }
    unsupported("echo", r.echo == Some(true))?;
    unsupported("suffix", r.suffix.as_deref().is_some_and(|s| !s.is_empty()))?;
    unsupported("best_of", r.best_of.is_some_and(|n| n != 1))?;
    unsupported("logit_bias", r.logit_bias.as_ref().is_some_and(not_empty))?;
    let prompt = match r.prompt {
        CompletionPrompt::Text(t) => Prompt::Text(t),
        CompletionPrompt::Ids(ids) => Prompt::Ids(ids),
        CompletionPrompt::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        CompletionPrompt::Texts(_) => return Err(ApiError::bad("one prompt per request (`prompt` as a list holds exactly one)".into(), Some("prompt"))),
    };
    let (mut params, stream, include_usage) = common(c, positive("max_tokens", r.max_tokens, 16)?, d)?;
    params.logprobs = r.logprobs.map(|n| n as usize);
    Ok(Parsed { prompt, params, stream, include_usage, limit_field: "max_tokens" })
}

/// `POST /v1/chat/completions`: the conversation through the model's chat template;
/// `max_completion_tokens` (or the older `max_tokens`) defaults to [`Defaults::max_tokens`].
pub fn chat(body: &[u8], d: &Defaults) -> Result<Parsed, ApiError> {
    let (r, c): (ChatRequest, Common) = read(body, &CHAT_FIELDS, &CHAT_REQUIRED)?;
    check_model(&r.model, &d.model)?;
    if let Some(n) = r.top_logprobs {
        if r.logprobs != Some(true) {
            return Err(ApiError::bad("`top_logprobs` needs `logprobs: true`".into(), Some("top_logprobs")));
        }
        if n as usize > MAX_TOP_LOGPROBS {
            return Err(ApiError::bad(format!("`top_logprobs` must be within [0, {MAX_TOP_LOGPROBS}], not {n}"), Some("top_logprobs")));
        }
    }
    unsupported("logit_bias", r.logit_bias.as_ref().is_some_and(not_empty))?;
    unsupported("tools", r.tools.as_ref().is_some_and(not_empty))?;
    unsupported("response_format", r.response_format.as_ref().is_some_and(|f| f.get("type").and_then(|t| t.as_str()) != Some("text")))?;
    if r.messages.is_empty() {
        return Err(ApiError::bad("`messages` must hold at least one message".into(), Some("messages")));
    }
    if let Some((i, m)) = r.messages.iter().enumerate().find(|(_, m)| !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant")) {
        return Err(ApiError::bad(format!("unknown role `{}`", m.role), Some(&format!("messages[{i}].role"))));
    }
    let limit = r.max_completion_tokens.or(r.max_tokens);
    // The field the client used; OpenAI's current name where it used neither.
    let field = if r.max_tokens.is_some() && r.max_completion_tokens.is_none() { "max_tokens" } else { "max_completion_tokens" };
    let (mut params, stream, include_usage) = common(c, positive(field, limit, d.max_tokens)?, d)?;
    params.logprobs = (r.logprobs == Some(true)).then(|| r.top_logprobs.unwrap_or(0) as usize);
    // OpenAI's `developer` role is the system prompt of newer models.
    let role = |r: &str| if r == "developer" { "system".to_string() } else { r.to_string() };
    let chat = Chat::new(r.messages.into_iter().map(|m| ChatMessage::new(role(&m.role), m.content)).collect());
    Ok(Parsed { prompt: Prompt::Chat(chat), params, stream, include_usage, limit_field: field })
}

fn not_empty(v: &serde_json::Value) -> bool {
    !(v.is_null() || v.as_object().is_some_and(|o| o.is_empty()) || v.as_array().is_some_and(|a| a.is_empty()))
}

fn check_model(asked: &str, served: &str) -> Result<(), ApiError> {
    if asked != served {
        return Err(ApiError::model_not_found(asked, served));
    }
    Ok(())
}
