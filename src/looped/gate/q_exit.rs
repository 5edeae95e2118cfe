//! Ouro's Q-exit, incrementally: λ_r = sigmoid(z_r); CDF += λ_r·survival; survival *= 1 − λ_r;
//! exit at the first step whose CDF reaches q.

use super::{ExitGate, GateState, ItemRef, StepBounds, StepSignals};

/// Ouro's exit rule: leave at the first step whose exit CDF reaches `q`.
#[derive(Debug, Clone)]
pub struct QExit {
    q: f32,
    bounds: StepBounds,
}

impl QExit {
    /// `q` in (0, 1]; lower exits earlier, 1.0 ≈ always full depth.
    pub fn new(q: f32, min_steps: usize, max_steps: usize) -> crate::Result<Self> {
        let bounds = StepBounds::new(min_steps, max_steps)?;
        if !(q > 0.0 && q <= 1.0) {
            return Err(crate::Error::InvalidOption(format!("q-exit threshold {q} must be in (0, 1]")));
        }
        Ok(Self { q, bounds })
    }
}

impl ExitGate for QExit {
    fn name(&self) -> String {
        format!("q-exit({})", self.q)
    }
    fn bounds(&self) -> StepBounds {
        self.bounds
    }
    fn decide(&self, _item: ItemRef, step: usize, signal: StepSignals, state: &mut GateState) -> bool {
        let Some(z) = signal.logit else {
            return self.bounds.apply(false, step);
        };
        let hazard = 1.0 / (1.0 + (-z).exp());
        state.cdf += hazard * state.survival;
        state.survival *= 1.0 - hazard;
        self.bounds.apply(state.cdf >= self.q, step)
    }
    fn reads_latent_diff(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestId;

    fn item() -> ItemRef {
        ItemRef { request: RequestId(0), token_index: 0, input_token: None }
    }

    #[test]
    fn matches_the_exit_pdf() {
        // λ = 0.5 each step: CDF 0.5, 0.75, 0.875, 1.0 (last step takes the rest).
        let g = QExit::new(0.7, 1, 4).unwrap();
        let mut s = GateState::new();
        assert!(!g.decide(item(), 0, StepSignals::logit(0.0), &mut s));
        assert!(g.decide(item(), 1, StepSignals::logit(0.0), &mut s));
        assert!((s.cdf - 0.75).abs() < 1e-6);
        // min_steps holds an early exit back; max_steps forces one.
        let g = QExit::new(0.1, 3, 4).unwrap();
        let mut s = GateState::new();
        assert!(!g.decide(item(), 0, StepSignals::logit(5.0), &mut s));
        assert!(!g.decide(item(), 1, StepSignals::logit(5.0), &mut s));
        assert!(g.decide(item(), 2, StepSignals::logit(5.0), &mut s));
        let g = QExit::new(1.0, 1, 4).unwrap();
        let mut s = GateState::new();
        let exits: Vec<bool> = (0..4).map(|r| g.decide(item(), r, StepSignals::logit(-9.0), &mut s)).collect();
        assert_eq!(exits, vec![false, false, false, true]);
        assert!(QExit::new(0.0, 1, 4).is_err());
        assert!(QExit::new(0.5, 5, 4).is_err());
    }
}
