//! A live request's generation state, as the core keeps it and a family half reads it (each
//! sampling row's seeded uniform and forced token).

use super::detok::Detokenizer;
use crate::diffusion::StepDraw;
use crate::request::GenerationParams;
use crate::sampling::{RowSampling, Sampler};
use std::time::Instant;

/// A live request's generation state.
pub(crate) struct Live {
    pub(super) params: GenerationParams,
    /// Sampling rows issued so far (the next forced token's index; may run ahead of
    /// `generated` when launches overlap).
    pub(super) issued: usize,
    pub(super) sampler: Sampler,
    pub(super) generated: Vec<u32>,
    pub(super) detok: Detokenizer,
    /// When the request was admitted, and when its last token event went out.
    pub(super) arrived: Instant,
    pub(super) last_token: Option<Instant>,
}

impl Live {
    /// The sampling settings of the request's next sampled row (its seeded uniform, and the
    /// forced token when teacher forcing).
    pub(crate) fn next_sampling_row(&mut self) -> RowSampling {
        let mut row = self.sampler.next_row();
        row.forced = self.params.forced_tokens.get(self.issued).copied();
        row.logprobs = self.params.logprobs;
        self.issued += 1;
        row
    }

    /// The draws of the request's next denoising step; `None` when it decodes greedily.
    pub(crate) fn next_step_draw(&mut self) -> Option<StepDraw> {
        let s = self.sampler.params();
        if s.is_greedy() {
            return None;
        }
        let draw = StepDraw { temperature: s.temperature, top_k: s.top_k, top_p: s.top_p, key: self.sampler.key(), step: self.issued as u64 };
        self.issued += 1;
        Some(draw)
    }
}
