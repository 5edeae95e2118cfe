//! One-step-ahead consumption: the signal of step r decides whether step r+2 runs, so the host
//! has a whole launch of slack to build the next batch (CDB §1.4). Minimum depth 2.

use super::{ExitGate, GateState, ItemRef, StepBounds, StepSignals};

/// Wraps a gate so that its verdict is consumed one step late: the next launch can be built
/// while the current one runs.
#[derive(Debug)]
pub struct Lookahead<G> {
    inner: G,
    /// The inner gate's, with at least two steps.
    bounds: StepBounds,
}

impl<G: ExitGate> Lookahead<G> {
    pub fn new(inner: G) -> crate::Result<Self> {
        if inner.max_steps() < 2 {
            return Err(crate::Error::InvalidOption("lookahead needs max_steps >= 2".into()));
        }
        // The engine installs heads of the gate it is given, not of a wrapped one.
        if inner.gate_head().is_some() || inner.token_head().is_some() {
            return Err(crate::Error::InvalidOption(format!(
                "{} already decides ahead; wrapping it in Lookahead would leave its trained head uninstalled",
                inner.name()
            )));
        }
        let bounds = StepBounds::new(inner.min_steps().max(2), inner.max_steps())?;
        Ok(Self { inner, bounds })
    }
}

impl<G: ExitGate> ExitGate for Lookahead<G> {
    fn name(&self) -> String {
        format!("lookahead({})", self.inner.name())
    }
    fn bounds(&self) -> StepBounds {
        self.bounds
    }
    fn decide(&self, item: ItemRef, step: usize, signal: StepSignals, state: &mut GateState) -> bool {
        // The verdict on step r-1's signal takes effect now, after step r.
        let exit_now = self.exit_known(item, step, state).expect("always known");
        state.pending_exit = self.inner.decide(item, step, signal, state);
        exit_now
    }
    fn exit_known(&self, _item: ItemRef, step: usize, state: &GateState) -> Option<bool> {
        Some(self.bounds.apply(state.pending_exit, step))
    }
    fn reads_latent_diff(&self) -> bool {
        self.inner.reads_latent_diff()
    }
    fn reads_gate_logit(&self) -> bool {
        self.inner.reads_gate_logit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::looped::gate::QExit;
    use crate::request::RequestId;

    #[test]
    fn only_the_latent_difference_gate_reads_the_latent_change() {
        use crate::looped::gate::{DepthTrace, FixedDepth, LatentDiff, Replay};
        assert!(!QExit::new(0.5, 1, 4).unwrap().reads_latent_diff());
        assert!(!FixedDepth::new(3).unwrap().reads_latent_diff());
        assert!(!Replay::new(DepthTrace::with_mean(2.5, 1, 4, 1).unwrap(), 1, 4).unwrap().reads_latent_diff());
        assert!(LatentDiff::new(0.1, 1, 4).unwrap().reads_latent_diff());
        assert!(Lookahead::new(LatentDiff::new(0.1, 1, 4).unwrap()).unwrap().reads_latent_diff());
        assert!(!Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap().reads_latent_diff());
    }

    #[test]
    fn exits_one_step_late_never_before_two() {
        let item = ItemRef { request: RequestId(0), token_index: 0, input_token: None };
        let run = |gate: &dyn ExitGate, logits: &[f32]| {
            let mut s = GateState::new();
            (0..logits.len()).find(|&r| gate.decide(item, r, StepSignals::logit(logits[r]), &mut s)).map(|r| r + 1)
        };
        let plain = QExit::new(0.5, 1, 4).unwrap();
        let la = Lookahead::new(QExit::new(0.5, 1, 4).unwrap()).unwrap();
        assert_eq!(run(&plain, &[9.0, 9.0, 9.0, 9.0]), Some(1));
        assert_eq!(run(&la, &[9.0, 9.0, 9.0, 9.0]), Some(2));
        assert_eq!(run(&plain, &[-9.0, 9.0, 9.0, 9.0]), Some(2));
        assert_eq!(run(&la, &[-9.0, 9.0, 9.0, 9.0]), Some(3));
        assert_eq!(run(&la, &[-9.0, -9.0, -9.0, -9.0]), Some(4));
    }
}
