//! Every item runs exactly `depth` steps.

use super::{ExitGate, GateState, ItemRef, StepBounds, StepSignals};

/// Every item runs the same number of loop steps (full depth by default: the CB baseline).
#[derive(Debug, Clone)]
pub struct FixedDepth {
    depth: StepBounds,
}

impl FixedDepth {
    pub fn new(depth: usize) -> crate::Result<Self> {
        Ok(Self { depth: StepBounds::exactly(depth)? })
    }
}

impl ExitGate for FixedDepth {
    fn reads_gate_logit(&self) -> bool {
        false
    }
    fn name(&self) -> String {
        format!("fixed({})", self.depth.max())
    }
    fn bounds(&self) -> StepBounds {
        self.depth
    }
    fn decide(&self, _item: ItemRef, step: usize, _signal: StepSignals, _state: &mut GateState) -> bool {
        self.depth.apply(true, step)
    }
    fn exit_known(&self, _item: ItemRef, step: usize, _state: &GateState) -> Option<bool> {
        Some(self.depth.apply(true, step))
    }
    fn reads_latent_diff(&self) -> bool {
        false
    }
}
