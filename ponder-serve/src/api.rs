//! The OpenAI wire format: what clients send and what they get back, as the OpenAI API reference
//! defines it. A request's fields are checked against [`COMPLETION_FIELDS`] / [`CHAT_FIELDS`]
//! and [`COMMON_FIELDS`] before it is read, so a parameter the server does not know is a 400
//! naming it rather than a silent default. The shared fields ([`Common`]) are read apart from
//! the endpoint's own, not flattened into them: serde reads a flattened struct through a buffer,
//! and a type error in it would lose the field's name.

use serde::{Deserialize, Serialize};

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `prompt`: text, or token ids (one prompt per request).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Ids(Vec<u32>),
    /// A batch of one text prompt (`["…"]`), as some clients send it.
    Texts(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and stopping fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Extension: keep only the `k` most probable tokens.
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Extension: keep generating past the model's end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Accepted and not used (OpenAI's end-user identifier).
    pub user: Option<String>,
}

/// The fields [`Common`] reads.
pub const COMMON_FIELDS: [&str; 12] =
    ["temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty", "user"];
/// A completion request's own fields (beside [`COMMON_FIELDS`]).
pub const COMPLETION_FIELDS: [&str; 8] = ["model", "prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of", "logit_bias"];
/// What a completion request must carry.
pub const COMPLETION_REQUIRED: [&str; 2] = ["model", "prompt"];
/// A chat completion request's own fields (beside [`COMMON_FIELDS`]).
pub const CHAT_FIELDS: [&str; 9] =
    ["model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias", "tools", "response_format"];
/// What a chat completion request must carry.
pub const CHAT_REQUIRED: [&str; 2] = ["model", "messages"];

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: CompletionPrompt,
    pub max_tokens: Option<u64>,
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    pub logit_bias: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub logit_bias: Option<serde_json::Value>,
    pub tools: Option<serde_json::Value>,
    pub response_format: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// Per choice and chunk: what the model family computed for its tokens (namespaced, so a stock
/// client ignores it). Looped models: the loop steps each token ran; diffusion models: the
/// denoising step (1-based within its block) that revealed it.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct PonderInfo {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub loop_steps: Vec<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub denoise_steps: Vec<u32>,
}

impl PonderInfo {
    pub fn push(&mut self, compute: Option<ponder::TokenCompute>) {
        match compute {
            Some(ponder::TokenCompute::LoopSteps(n)) => self.loop_steps.push(n),
            Some(ponder::TokenCompute::DenoiseStep(n)) => self.denoise_steps.push(n),
            None => {}
        }
    }
    pub fn is_empty(&self) -> bool {
        self.loop_steps.is_empty() && self.denoise_steps.is_empty()
    }
}

/// The completions API's log-probabilities: parallel lists over the choice's tokens.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, its most likely alternatives, text to log-probability.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    pub text_offset: Vec<usize>,
}

/// The chat API's log-probabilities: one object per token.
#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "PonderInfo::is_empty")]
    pub ponder: PonderInfo,
}

/// A `text_completion` object, or one chunk of its stream.
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    #[serde(skip_serializing_if = "PonderInfo::is_empty")]
    pub ponder: PonderInfo,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "PonderInfo::is_empty")]
    pub ponder: PonderInfo,
}

/// A `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

/// OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}
