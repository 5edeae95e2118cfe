//! Huginn's latent-difference criterion as the CDB authors serve it: exit when
//! ‖s_r − s_{r−1}‖ / ‖s_r‖ < threshold (per token, no sequence mean).

use super::{ExitGate, GateState, ItemRef, StepBounds, StepSignals};

/// Exit once the state's relative change between two loop steps falls below a threshold.
#[derive(Debug, Clone)]
pub struct LatentDiff {
    threshold: f32,
    bounds: StepBounds,
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
        let bounds = StepBounds::new(min_steps, max_steps)?;
        if !(threshold >= 0.0) {
            return Err(crate::Error::InvalidOption(format!("latent-diff threshold {threshold} must be >= 0")));
        }
        Ok(Self { threshold, bounds })
    }
}

impl ExitGate for LatentDiff {
    fn reads_gate_logit(&self) -> bool {
        false
    }
    fn name(&self) -> String {
        format!("latent-diff({})", self.threshold)
    }
    fn bounds(&self) -> StepBounds {
        self.bounds
    }
    fn decide(&self, _item: ItemRef, step: usize, signal: StepSignals, _state: &mut GateState) -> bool {
        let raw = signal.latent_diff.is_some_and(|d| d < self.threshold);
        self.bounds.apply(raw, step)
    }
}
