//! The diffusion family's launches: every layer over each row's tokens — a prompt prefill, a
//! finished block's clean K/V write, or a denoising step over a block's recomputed positions —
//! with the greedy token and its probability read out at the rows' masked tokens.

use crate::kv::BlockTable;
use crate::request::RequestId;
use crate::scheduler::Requests;

/// One row of a denoise launch: one request's tokens at ascending cache positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenoiseRow {
    pub request: RequestId,
    pub tokens: Vec<u32>,
    /// Cache position of each token, ascending. The row sees the keys before
    /// `positions.last() + 1`.
    pub positions: Vec<u32>,
    /// Indices into `tokens` whose logits are read out (greedy token and its probability come
    /// back in [`DenoiseRowOutput::candidates`], in this order): the row's masked tokens (or,
    /// for shifted-logit models, their left neighbours). Empty for prefill and commit rows.
    pub readout: Vec<u32>,
    /// The request's block table (one slot: every layer shares it).
    pub block_table: BlockTable,
    /// Steps under an eviction policy: the request's block state it needs.
    pub evict: Option<EvictRow>,
    /// Keys the row attends to when that is more than `positions.last() + 1`: a dual-cache step
    /// runs only its block but reads the cached masked suffix after it too.
    pub context: Option<u32>,
}

impl DenoiseRow {
    /// `tokens` at `positions` (ascending), reading out `readout`.
    pub fn new(request: RequestId, tokens: Vec<u32>, positions: Vec<u32>, readout: Vec<u32>, block_table: BlockTable) -> Self {
        Self { request, tokens, positions, readout, block_table, evict: None, context: None }
    }

    /// `tokens` at consecutive positions from `start` (prefill and commit rows).
    pub fn run(request: RequestId, tokens: Vec<u32>, start: usize, block_table: BlockTable) -> Self {
        let positions = (start..start + tokens.len()).map(|p| p as u32).collect();
        Self::new(request, tokens, positions, Vec::new(), block_table)
    }

    /// Keys the row attends to: one past its last position, or `context` where set.
    pub fn context_len(&self) -> usize {
        let own = self.positions.last().map_or(0, |&p| p as usize + 1);
        self.context.map_or(own, |c| own.max(c as usize))
    }
}

/// What an eviction policy (FOCUS) needs of a request's step besides its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictRow {
    /// Absolute position of the block's first token.
    pub block_start: u32,
    /// Tokens decoded in this block so far and the steps that decoded at least one: ā is their
    /// ratio (1 before any).
    pub decoded: u32,
    pub decoding_steps: u32,
    /// Rightmost block offset pushed through every layer in this block (−1 at block start).
    pub block_progress: i64,
}

impl EvictRow {
    pub fn avg_decoded(&self) -> f32 {
        if self.decoding_steps == 0 {
            1.0
        } else {
            self.decoded as f32 / self.decoding_steps as f32
        }
    }
}

/// One engine tick's work for a diffusion model.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DenoiseLaunch {
    pub rows: Vec<DenoiseRow>,
}

impl DenoiseLaunch {
    pub fn num_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// What came back for one row of a denoise launch.
#[derive(Debug, Clone, PartialEq)]
pub struct DenoiseRowOutput {
    pub request: RequestId,
    /// `(greedy token, its probability)` at each of the row's `readout` tokens — or, when
    /// `kept` is given and shorter, at each readout token that was kept.
    pub candidates: Vec<(u32, f32)>,
    /// Rows under an eviction policy: indices into the row's `tokens` that ran past layer 1
    /// (in shadow mode: that would have).
    pub kept: Option<Vec<u32>>,
}

impl DenoiseRowOutput {
    pub fn new(request: RequestId, candidates: Vec<(u32, f32)>) -> Self {
        Self { request, candidates, kept: None }
    }
}

/// Host values of a finished denoise launch, row-aligned with [`DenoiseLaunch::rows`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DenoiseResult {
    pub rows: Vec<DenoiseRowOutput>,
    /// Requests a row of which read non-finite logits (NaN or infinity): those rows carry no
    /// candidates, and the engine ends the requests with an error.
    pub non_finite: Vec<RequestId>,
}

/// Tokens that became final for one request, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted {
    pub request: RequestId,
    pub tokens: Vec<u32>,
    /// The denoising step (1-based, within its block) that revealed each token; empty when the
    /// scheduler does not track it.
    pub steps: Vec<u32>,
}

impl Emitted {
    pub fn new(request: RequestId, tokens: Vec<u32>) -> Self {
        Self { request, tokens, steps: Vec::new() }
    }
}

/// A scheduling policy for diffusion models: `schedule`, `complete` and `finished`. The engine
/// core owns the requests and their KV ([`Requests`]) and lends them to each call.
pub trait DiffusionScheduler: Send {
    /// The next launch, or `None` when there is nothing to run. Admits waiting requests through
    /// `requests`.
    fn schedule(&mut self, requests: &mut Requests) -> Option<DenoiseLaunch>;
    /// Records the outcome of `launch` and returns the tokens that became final, per request,
    /// in order: a diffusion scheduler decides which tokens are revealed (the unmask policy),
    /// and a token streams once every position before it is final. A request listed in
    /// [`DenoiseResult::non_finite`] is ended by the engine.
    fn complete(&mut self, requests: &mut Requests, launch: &DenoiseLaunch, result: &DenoiseResult) -> Vec<Emitted>;
    /// Forgets a request that ended (finished, aborted or failed). Its KV blocks are already
    /// free; a launch scheduled after this must not name it.
    fn finished(&mut self, id: RequestId);
    fn name(&self) -> &'static str {
        "custom"
    }
    /// Cache positions a request of `prompt_len` prompt tokens and `max_new_tokens` needs at
    /// most: what admission reserves, checked against the pool and the context when the request
    /// is added (the built-in scheduler: [`super::DiffusionConfig::kv_positions`]).
    fn kv_positions(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        prompt_len + max_new_tokens
    }
    /// Under an eviction policy: `(tokens revealed, of them in the step's kept set)` so far —
    /// FOCUS's recall of decodable tokens in shadow mode.
    fn revealed_in_kept(&self) -> Option<(u64, u64)> {
        None
    }
}
