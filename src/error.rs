//! The crate's one error type.

use crate::request::RequestId;

/// Everything that can go wrong in Ponder. Errors about one request carry its id, so a caller
/// serving many requests can route the error; other requests are not affected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor or device operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// Reading a file of the model directory failed.
    #[error("{path}: {source}")]
    Io { path: std::path::PathBuf, source: std::io::Error },

    /// `config.json` (or another JSON file) could not be parsed or holds an invalid value.
    #[error("bad config {path}: {reason}")]
    BadConfig { path: String, reason: String },

    /// The model directory names a `model_type` this crate does not implement.
    #[error("unsupported model_type `{0}`")]
    UnsupportedModel(String),

    /// A checkpoint tensor is missing, truncated or has the wrong shape or dtype.
    #[error("bad checkpoint tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },

    /// The tokenizer could not be loaded or failed to encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A chat prompt could not be rendered: the model has no chat template, or its template
    /// does not compile or fails on this conversation.
    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// An engine option is invalid (zero block size, unknown layout for this model, …).
    #[error("invalid engine option: {0}")]
    InvalidOption(String),

    /// Options of one model family were given for a checkpoint of the other (looped options
    /// for a diffusion model, or the reverse).
    #[error("{options} options given, but `{model_type}` is a {family} model")]
    WrongFamily { options: &'static str, model_type: String, family: &'static str },

    /// A request was rejected before it started; the reason says why.
    #[error("request {id} rejected: {reason}")]
    InvalidRequest { id: RequestId, reason: InvalidRequest },

    /// The KV cache cannot hold this request even when it runs alone.
    #[error("request {id}: KV cache exhausted (needs {needed_blocks} blocks, pool has {total_blocks})")]
    KvExhausted { id: RequestId, needed_blocks: usize, total_blocks: usize },

    /// No request with this id is known to the engine (finished, aborted or never added).
    #[error("unknown request {0}")]
    UnknownRequest(RequestId),

    /// The scheduler returned no launch while requests were still unfinished (a scheduler bug;
    /// without this error the engine would spin forever).
    #[error("scheduler `{scheduler}` stalled with {unfinished} unfinished request(s)")]
    SchedulerStalled { scheduler: String, unfinished: usize },

    /// What an engine would allocate at build and use while it runs (the KV pool, the looped
    /// scheduler's state bank, one launch's workspace) exceeds the memory its device has free.
    /// Raised at build, before anything is allocated, so that a configuration the device cannot
    /// hold never fails its requests one launch at a time.
    #[error("{what} need {:.2} GiB but {device} has {:.2} GiB free; {hint}", *.needed as f64 / (1u64 << 30) as f64, *.available as f64 / (1u64 << 30) as f64)]
    DeviceMemory { what: String, needed: u64, available: u64, device: String, hint: String },

    /// A request of a run that needs every request served ended with an error
    /// ([`crate::FinishReason::Error`]) or with fewer tokens than it asked for.
    #[error("request {id} failed: {reason}")]
    RequestFailed { id: RequestId, reason: String },

    /// A collective between the ranks of a parallel engine failed: a rank gave up (its own
    /// error, passed to every rank), did not arrive within the timeout, or sent a tensor that
    /// does not match the others'. Every rank's launch ends with it; none waits forever.
    #[error("collective {collective} on rank {rank} of {world}: {reason}")]
    Collective { collective: &'static str, rank: usize, world: usize, reason: String },

    /// The engine thread behind an [`crate::EngineHandle`] has stopped.
    #[error("engine thread stopped")]
    EngineStopped,

    /// Downloading `repo` from the Hugging Face hub failed (the `hub` feature:
    /// `ModelDir::from_hub`); [`HubError`] says why. A repository that downloads but is no
    /// checkpoint (no `config.json`, no weights) is the error [`crate::loader::ModelDir::open`]
    /// gives for it, not this one.
    #[error("hub repo `{repo}`: {reason}")]
    Hub { repo: String, reason: HubError },
}

/// Why a download from the Hugging Face hub failed ([`Error::Hub`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HubError {
    /// The hub has no such repository. (The hub answers alike for a private repository the
    /// token does not open.)
    RepoNotFound,
    /// The repository has no such branch, tag or commit.
    RevisionNotFound(String),
    /// The repository lists this file, but the hub does not serve it.
    FileNotFound(String),
    /// The hub asks for a token, or refuses the one given (401 / 403).
    Unauthorized(String),
    /// Anything else — the network, an unexpected answer, the cache directory; the message
    /// says what.
    Other(String),
}

impl std::fmt::Display for HubError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RepoNotFound => write!(f, "repository not found"),
            Self::RevisionNotFound(r) => write!(f, "revision `{r}` not found"),
            Self::FileNotFound(file) => write!(f, "`{file}` is listed but not served"),
            Self::Unauthorized(s) => write!(f, "unauthorized: {s}"),
            Self::Other(s) => write!(f, "{s}"),
        }
    }
}

/// Why a request was rejected at admission.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidRequest {
    EmptyPrompt,
    /// Prompt plus `max_new_tokens` exceed the model's context window.
    TooLong {
        prompt_tokens: usize,
        max_new_tokens: usize,
        max_context: usize,
    },
    /// A prompt token id is outside the vocabulary.
    UnknownToken {
        token: u32,
        vocab_size: usize,
    },
    /// A sampling parameter is out of range (temperature < 0, top_p outside (0, 1], top_k = 0 …).
    BadSampling(String),
    /// Log-probabilities were asked that the model does not give (diffusion models) or beyond
    /// [`crate::MAX_TOP_LOGPROBS`] alternatives.
    Logprobs(String),
}

impl std::fmt::Display for InvalidRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EmptyPrompt => write!(f, "empty prompt"),
            Self::TooLong { prompt_tokens, max_new_tokens, max_context } => {
                write!(f, "prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceed the context window of {max_context}")
            }
            Self::UnknownToken { token, vocab_size } => {
                write!(f, "token id {token} is outside the vocabulary of {vocab_size}")
            }
            Self::BadSampling(s) => write!(f, "bad sampling parameters: {s}"),
            Self::Logprobs(s) => write!(f, "log-probabilities: {s}"),
        }
    }
}

/// The crate's result: its one [`Error`] type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn config(path: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::BadConfig { path: path.into(), reason: reason.into() }
    }
    pub(crate) fn tensor(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::BadTensor { name: name.into(), reason: reason.into() }
    }
}
