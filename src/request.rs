//! Request-facing types: ids, parameters, events, outputs.

use crate::chat::{Chat, ChatMessage};
use crate::sampling::SamplingParams;

/// Identifies a request within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A request as a scheduler sees it: validated, encoded, its KV need known to fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

/// A prompt as text (encoded with the model's tokenizer), as token ids, or as a conversation
/// (rendered with the model's chat template, then encoded).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Chat(Chat),
}

impl From<Chat> for Prompt {
    fn from(c: Chat) -> Self {
        Self::Chat(c)
    }
}
impl From<Vec<ChatMessage>> for Prompt {
    fn from(messages: Vec<ChatMessage>) -> Self {
        Self::Chat(Chat::new(messages))
    }
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Self::Text(s.to_string())
    }
}
impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Self::Text(s)
    }
}
impl From<&String> for Prompt {
    fn from(s: &String) -> Self {
        Self::Text(s.clone())
    }
}
impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Self {
        Self::Ids(ids)
    }
}
impl From<&[u32]> for Prompt {
    fn from(ids: &[u32]) -> Self {
        Self::Ids(ids.to_vec())
    }
}

/// How to generate for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Keep generating past the model's eos tokens.
    pub ignore_eos: bool,
    /// Teacher forcing: the first `forced_tokens.len()` tokens are these instead of samples,
    /// and each comes with its log-probability under the model (scoring, perplexity). The
    /// model still runs as it would when generating, exit gates included.
    pub forced_tokens: Vec<u32>,
    /// Report each generated token's log-probability under the model (its untempered, uncut
    /// distribution) and this many most likely alternatives (at most [`MAX_TOP_LOGPROBS`]);
    /// `None`: none. Looped models only.
    pub logprobs: Option<usize>,
}

/// The most alternatives a token's log-probabilities list ([`GenerationParams::logprobs`]).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Default for GenerationParams {
    fn default() -> Self {
        Self { max_new_tokens: 64, sampling: SamplingParams::default(), stop: Vec::new(), ignore_eos: false, forced_tokens: Vec::new(), logprobs: None }
    }
}

/// A generated token's log-probability under the model and, when asked, the most likely tokens
/// at its position with theirs (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl GenerationParams {
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self { max_new_tokens, ..Self::default() }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an eos token (not included in the output).
    Eos,
    /// A stop string appeared (not included in the output).
    Stop(String),
    /// `max_new_tokens` reached.
    Length,
    /// Aborted by the caller.
    Aborted,
    /// The engine failed while running the request's launch.
    Error(String),
}

/// What [`crate::Engine::step`] reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token and the text it completes (may be empty while a multi-byte character or a
    /// possible stop string is still pending).
    Token {
        id: RequestId,
        token: u32,
        text: String,
        /// Forced tokens and requests that ask for log-probabilities
        /// ([`GenerationParams::logprobs`]).
        logprob: Option<TokenLogprob>,
        /// The compute this token took, in its model family's terms; `None` where the
        /// scheduler does not say.
        compute: Option<TokenCompute>,
    },
    /// The request is done; the event carries any text held back until now.
    Finished { id: RequestId, reason: FinishReason, text: String },
}

/// The compute one generated token took, in its model family's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCompute {
    /// Looped models: the loop steps the token ran (a first token runs every step).
    LoopSteps(u32),
    /// Diffusion models: the denoising step, 1-based within its block, that revealed the token.
    DenoiseStep(u32),
}

impl Event {
    pub fn id(&self) -> RequestId {
        match self {
            Self::Token { id, .. } | Self::Finished { id, .. } => *id,
        }
    }
}

/// A finished request, as returned by [`crate::Engine::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub id: RequestId,
    pub prompt_tokens: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Log-probabilities of the forced tokens, or of every token when the request asked for
    /// them ([`GenerationParams::logprobs`]); empty otherwise.
    pub logprobs: Vec<f32>,
    /// The most likely alternatives at each position of `logprobs` (empty lists when none were
    /// asked).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

impl Output {
    /// An empty output that [`Output::push`] fills from the request's events.
    pub fn new(id: RequestId, prompt_tokens: usize) -> Self {
        Self { id, prompt_tokens, token_ids: vec![], text: String::new(), finish_reason: FinishReason::Aborted, logprobs: vec![], top_logprobs: vec![] }
    }

    /// Adds one of the request's events; returns true once it is finished.
    pub fn push(&mut self, event: Event) -> bool {
        match event {
            Event::Token { token, text, logprob, .. } => {
                self.token_ids.push(token);
                self.text.push_str(&text);
                if let Some(lp) = logprob {
                    self.logprobs.push(lp.logprob);
                    self.top_logprobs.push(lp.top);
                }
                false
            }
            Event::Finished { reason, text, .. } => {
                self.text.push_str(&text);
                self.finish_reason = reason;
                true
            }
        }
    }
}
