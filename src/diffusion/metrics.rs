//! What a diffusion engine counts beside the common metrics: the rows its denoise launches
//! carried and what FOCUS kept.

use super::{DenoiseLaunch, DenoiseResult};
use std::time::Duration;

/// Row counts of denoise launches. A *step* is one request's denoising step over its block.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DenoiseStats {
    pub steps: u64,
    /// Tokens the steps ran through every layer (the recomputed positions; with the delayed
    /// cache fewer than the block).
    pub step_tokens: u64,
    /// Masked tokens whose logits the steps read out.
    pub readouts: u64,
    /// Prompt prefill and clean-K/V rows (no readout), and their tokens.
    pub other_rows: u64,
    pub other_tokens: u64,
    /// Steps an eviction policy scored, their tokens, and the tokens kept past layer 1.
    pub scored_steps: u64,
    pub scored_tokens: u64,
    pub kept_tokens: u64,
    /// `(tokens revealed under an eviction policy, of them in the step's kept set)`.
    pub revealed: u64,
    pub revealed_kept: u64,
    /// Wall time per phase of the denoise launches (embedding, layers, FOCUS selection and
    /// compaction, LM head + readout), when `DiffusionOptions::time_denoise_phases` is on.
    pub phases: Vec<(&'static str, Duration)>,
}

impl DenoiseStats {
    /// Mean tokens a request's step runs through the network (through layer 1 when evicting).
    pub fn tokens_per_step(&self) -> f64 {
        self.step_tokens as f64 / self.steps.max(1) as f64
    }
    /// Mean tokens a scored step kept past layer 1 (FOCUS's "kept per step").
    pub fn kept_per_step(&self) -> f64 {
        self.kept_tokens as f64 / self.scored_steps.max(1) as f64
    }
    /// Share of scored steps' tokens that skipped layers ≥ 1.
    pub fn eviction_ratio(&self) -> f64 {
        1.0 - self.kept_tokens as f64 / self.scored_tokens.max(1) as f64
    }
    /// Share of revealed tokens that were in their step's kept set: 1 by construction when
    /// evicting; in shadow mode FOCUS's recall of the tokens the baseline decodes.
    pub fn recall(&self) -> Option<f64> {
        (self.revealed > 0).then(|| self.revealed_kept as f64 / self.revealed as f64)
    }
}

impl DenoiseStats {
    pub(crate) fn record(&mut self, launch: &DenoiseLaunch, result: &DenoiseResult) {
        let d = self;
        for (row, out) in launch.rows.iter().zip(&result.rows) {
            if row.readout.is_empty() {
                d.other_rows += 1;
                d.other_tokens += row.tokens.len() as u64;
            } else {
                d.steps += 1;
                d.step_tokens += row.tokens.len() as u64;
                d.readouts += row.readout.len() as u64;
            }
            if let Some(k) = &out.kept {
                d.scored_steps += 1;
                d.scored_tokens += row.tokens.len() as u64;
                d.kept_tokens += k.len() as u64;
            }
        }
    }
}
