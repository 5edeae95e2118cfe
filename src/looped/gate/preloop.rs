//! The preloop gate of the CDB authors (`shared/spec/lookahead-gate.md` §3): a linear head
//! `[T, hidden]` over a token's prelude output gives a distribution over depths 1..T before the
//! loop runs; the token runs to the first depth whose cumulative probability reaches q (else
//! T), clamped to the gate's bounds.
//!
//! For Ouro the prelude is the token embedding alone, so the depth is a function of the token
//! id: the engine evaluates the head over the whole vocabulary once when it is built and the gate
//! keeps one depth per token. The model then computes no per-step gate logit and nothing is
//! copied back for the gate; with overlap, a step's verdict is known as soon as the host has the
//! item's input token (one launch after it was sampled), so depth 1 stays reachable.

use super::{ExitGate, GateHead, GateState, ItemRef, StepBounds, StepSignals};
use crate::{Error, Result};
use std::path::Path;

/// Decides a token's depth before it enters the loop, from a head over its input token.
#[derive(Debug)]
pub struct Preloop {
    head: GateHead,
    q: f64,
    bounds: StepBounds,
    /// Depth per token id, filled by [`ExitGate::install_token_table`].
    depths: Vec<u8>,
}

impl Preloop {
    /// The head in `path` (`weight` `[T, hidden]`, `bias` `[T]`) with threshold `q` on its CDF.
    pub fn load(path: &Path, q: f32, min_steps: usize, max_steps: usize) -> Result<Self> {
        Self::new(GateHead::load(path)?, q, min_steps, max_steps)
    }

    /// A head already in memory. Asking for more steps than the head has depths (it was trained
    /// for) is an error.
    pub fn new(head: GateHead, q: f32, min_steps: usize, max_steps: usize) -> Result<Self> {
        let bounds = StepBounds::new(min_steps, max_steps)?;
        if !(q > 0.0 && q <= 1.0) {
            return Err(Error::InvalidOption(format!("preloop threshold {q} must be in (0, 1]")));
        }
        if max_steps > head.rows {
            return Err(Error::InvalidOption(format!("preloop gate asked for up to {max_steps} steps but its head was trained for {}", head.rows)));
        }
        if head.rows > u8::MAX as usize {
            return Err(Error::tensor("preloop head", format!("{} depths, at most {} supported", head.rows, u8::MAX)));
        }
        Ok(Self { head, q: q as f64, bounds, depths: Vec::new() })
    }

    /// The depth the head's logits over depths 1..T pick: softmax, first depth whose CDF
    /// reaches q (else T), clamped to the bounds.
    pub fn depth_from_logits(&self, logits: &[f32]) -> usize {
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, &z| m.max(z as f64));
        let weights: Vec<f64> = logits.iter().map(|&z| (z as f64 - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut cdf = 0.0;
        let picked = weights
            .iter()
            .position(|w| {
                cdf += w / total;
                cdf >= self.q
            })
            .map_or(logits.len(), |i| i + 1);
        self.bounds.clamp(picked)
    }

    /// The depth of `token`, once the table is installed.
    pub fn depth_of(&self, token: u32) -> Option<usize> {
        self.depths.get(token as usize).map(|&d| d as usize)
    }
}

impl ExitGate for Preloop {
    fn name(&self) -> String {
        format!("preloop({})", self.q)
    }
    fn bounds(&self) -> StepBounds {
        self.bounds
    }
    fn decide(&self, item: ItemRef, step: usize, _signals: StepSignals, state: &mut GateState) -> bool {
        // The input token is on the host by the time a step's result is; without one (a custom
        // scheduler that does not say) the item runs to the bounds' maximum.
        self.exit_known(item, step, state).unwrap_or_else(|| self.bounds.apply(false, step))
    }
    fn exit_known(&self, item: ItemRef, step: usize, _state: &GateState) -> Option<bool> {
        let depth = self.depth_of(item.input_token?)?;
        Some(self.bounds.apply(step + 1 >= depth, step))
    }
    fn reads_latent_diff(&self) -> bool {
        false
    }
    fn reads_gate_logit(&self) -> bool {
        false
    }
    fn token_head(&self) -> Option<&GateHead> {
        Some(&self.head)
    }
    fn install_token_table(&mut self, logits: Vec<f32>, vocab: usize) -> Result<()> {
        let rows = self.head.rows;
        if logits.len() != vocab * rows {
            return Err(Error::tensor("preloop table", format!("{} logits for {vocab} tokens x {rows} depths", logits.len())));
        }
        self.depths = logits.chunks_exact(rows).map(|z| self.depth_from_logits(z) as u8).collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestId;

    fn head(rows: usize) -> GateHead {
        GateHead { weight: vec![0.0; rows * 2], bias: vec![0.0; rows], rows, hidden: 2 }
    }

    fn item(token: Option<u32>) -> ItemRef {
        ItemRef { request: RequestId(0), token_index: 1, input_token: token }
    }

    #[test]
    fn first_depth_whose_cdf_reaches_q_clamped_to_the_bounds() {
        let g = Preloop::new(head(4), 0.5, 1, 4).unwrap();
        // pdf ≈ (0.1, 0.2, 0.3, 0.4): CDF 0.1, 0.3, 0.6, 1.0.
        let logits: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4].iter().map(|p| p.ln()).collect();
        assert_eq!(g.depth_from_logits(&logits), 3);
        assert_eq!(Preloop::new(head(4), 0.05, 1, 4).unwrap().depth_from_logits(&logits), 1);
        assert_eq!(Preloop::new(head(4), 0.05, 2, 4).unwrap().depth_from_logits(&logits), 2, "clamped up to min");
        assert_eq!(Preloop::new(head(4), 0.9, 1, 2).unwrap().depth_from_logits(&logits), 2, "clamped down to max");
        assert_eq!(Preloop::new(head(4), 1.0, 1, 4).unwrap().depth_from_logits(&logits), 4);
    }

    #[test]
    fn decides_from_the_input_token_once_the_table_is_installed() {
        let mut g = Preloop::new(head(4), 0.5, 1, 4).unwrap();
        let peaked = |d: usize| (0..4).map(|i| if i + 1 == d { 9.0 } else { 0.0 }).collect::<Vec<f32>>();
        let table: Vec<f32> = [1, 3, 4].iter().flat_map(|&d| peaked(d)).collect();
        g.install_token_table(table, 3).unwrap();
        let mut s = GateState::new();
        let run = |tok: u32, s: &mut GateState| (0..4).find(|&r| g.decide(item(Some(tok)), r, StepSignals::default(), s)).map(|r| r + 1);
        assert_eq!((run(0, &mut s), run(1, &mut s), run(2, &mut s)), (Some(1), Some(3), Some(4)));
        assert_eq!(g.exit_known(item(Some(1)), 1, &s), Some(false));
        assert_eq!(g.exit_known(item(Some(1)), 2, &s), Some(true));
        assert_eq!(g.exit_known(item(None), 0, &s), None, "unknown until the input token is on the host");
        assert!(!g.decide(item(None), 2, StepSignals::default(), &mut s) && g.decide(item(None), 3, StepSignals::default(), &mut s));
        assert!(!g.reads_gate_logit() && !g.reads_latent_diff() && g.token_head().is_some());
        assert!(matches!(g.install_token_table(vec![0.0; 5], 3), Err(Error::BadTensor { .. })));
    }

    #[test]
    fn more_steps_than_trained_is_an_error() {
        assert!(matches!(Preloop::new(head(4), 0.5, 1, 5), Err(Error::InvalidOption(m)) if m.contains("trained for 4")));
        assert!(Preloop::new(head(4), 0.0, 1, 4).is_err());
        assert!(Preloop::new(head(4), 0.5, 0, 4).is_err());
    }
}
