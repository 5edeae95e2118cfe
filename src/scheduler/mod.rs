//! Schedulers decide what runs next; they never touch tensors.
//!
//! A scheduler holds request state and KV bookkeeping and returns a [`Launch`]: plain data
//! naming the stage, the rows, their tokens and positions and the block tables to use. The
//! engine runs it and hands back a [`LaunchResult`] of small per-row host values. A scheduler
//! is therefore testable with no model, and a researcher can write one in another crate.

mod continuous;

pub use continuous::ContinuousBatching;

use crate::engine::RequestId;
use crate::kv::KvManager;

/// A request as the scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

/// Which stage of the model a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stage {
    /// Prompt tokens through prelude + every loop step + coda of the last token (full depth).
    Prefill,
    /// One new token per row through prelude + every loop step + coda (the CB baseline).
    FullDepthDecode,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::FullDepthDecode => "decode",
        }
    }
}

/// One row of a launch: one request's tokens at consecutive positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRow {
    pub request: RequestId,
    /// Input token ids (the prompt for a prefill, the last sampled token for a decode).
    pub tokens: Vec<u32>,
    /// Absolute position of `tokens[0]`.
    pub start_pos: usize,
    /// The request's block tables, indexed by cache slot; each covers `start_pos + tokens.len()`.
    pub block_tables: Vec<Vec<u32>>,
    /// Whether the row's last token is read out and a next token sampled.
    pub sample: bool,
}

/// One engine tick's work: a homogeneous stage over a batch of rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub stage: Stage,
    /// Cache slot of each loop step the launch runs (`step_slots.len()` steps).
    pub step_slots: Vec<usize>,
    pub rows: Vec<LaunchRow>,
}

impl Launch {
    pub fn num_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// What came back for one row of a launch.
#[derive(Debug, Clone, PartialEq)]
pub struct RowOutput {
    pub request: RequestId,
    /// Sampled next token, for rows with `sample`.
    pub token: Option<u32>,
    /// Exit-gate logit of the row's last token after each loop step that ran.
    pub gate_logits: Vec<f32>,
}

/// Host values of a finished launch, row-aligned with [`Launch::rows`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LaunchResult {
    pub rows: Vec<RowOutput>,
}

/// Limits every built-in scheduler honours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Most requests resident (decoding) at once: the decode width W.
    pub max_num_seqs: usize,
    /// Most prompt tokens in one prefill launch.
    pub max_num_batched_tokens: usize,
}

impl Default for SchedulerLimits {
    fn default() -> Self {
        Self { max_num_seqs: 64, max_num_batched_tokens: 8192 }
    }
}

/// A scheduling policy. See the module docs.
pub trait Scheduler: Send {
    fn name(&self) -> &'static str;
    /// Queues a validated request. Its prompt and `max_new_tokens` fit the KV pool.
    fn add(&mut self, request: SchedRequest);
    /// The next launch, or `None` when there is nothing to run.
    fn schedule(&mut self) -> Option<Launch>;
    /// Records the outcome of `launch` (sampled tokens extend their requests).
    fn complete(&mut self, launch: &Launch, result: &LaunchResult);
    /// Forgets a request (finished or aborted) and frees its KV blocks. Unknown ids are ignored.
    fn finish(&mut self, id: RequestId);
    fn num_waiting(&self) -> usize;
    fn num_running(&self) -> usize;
    fn kv(&self) -> &KvManager;
    /// Requests preempted so far (their KV freed and recomputed later).
    fn num_preemptions(&self) -> usize {
        0
    }
}
