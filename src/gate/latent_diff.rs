//! Huginn's latent-difference criterion as the CDB authors serve it: exit when
//! ‖s_r − s_{r−1}‖ / ‖s_r‖ < threshold (per token, no sequence mean).

use super::{bounded, check_bounds, ExitGate, GateState, ItemRef, StepSignals};

#[derive(Debug, Clone)]
pub struct LatentDiff {
    threshold: f32,
    min_steps: usize,
    max_steps: usize,
}

impl LatentDiff {
    /// The thresholds the CDB paper sweeps for Huginn (0.28 is its throughput setting).
    pub const PAPER_THRESHOLDS: [f32; 3] = [0.28, 0.16, 0.10];

    /// Huginn as the CDB authors serve it: threshold 0.28, any depth in `1..=max_steps`.
    pub fn cdb_default(max_steps: usize) -> crate::Result<Self> {
        Self::new(Self::PAPER_THRESHOLDS[0], 1, max_steps)
    }

    /// `threshold` ≥ 0; 0 never exits early. The CDB paper sweeps 0.28 / 0.16 / 0.10.
    pub fn new(threshold: f32, min_steps: usize, max_steps: usize) -> crate::Result<Self> {
        check_bounds(min_steps, max_steps)?;
        if !(threshold >= 0.0) {
            return Err(crate::Error::InvalidOption(format!("latent-diff threshold {threshold} must be >= 0")));
        }
        Ok(Self { threshold, min_steps, max_steps })
    }
}

impl ExitGate for LatentDiff {
    fn name(&self) -> String {
        format!("latent-diff({})", self.threshold)
    }
    fn min_steps(&self) -> usize {
        self.min_steps
    }
    fn max_steps(&self) -> usize {
        self.max_steps
    }
    fn decide(&self, _item: ItemRef, step: usize, signal: StepSignals, _state: &mut GateState) -> bool {
        let raw = signal.latent_diff.is_some_and(|d| d < self.threshold);
        bounded(raw, step, self.min_steps, self.max_steps)
    }
}
