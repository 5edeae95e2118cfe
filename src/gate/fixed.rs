//! Every item runs exactly `depth` steps.

use super::{check_bounds, ExitGate, GateState, ItemRef, StepSignals};

#[derive(Debug, Clone)]
pub struct FixedDepth {
    depth: usize,
}

impl FixedDepth {
    pub fn new(depth: usize) -> crate::Result<Self> {
        check_bounds(depth, depth)?;
        Ok(Self { depth })
    }
}

impl ExitGate for FixedDepth {
    fn name(&self) -> String {
        format!("fixed({})", self.depth)
    }
    fn min_steps(&self) -> usize {
        self.depth
    }
    fn max_steps(&self) -> usize {
        self.depth
    }
    fn decide(&self, _item: ItemRef, step: usize, _signal: StepSignals, _state: &mut GateState) -> bool {
        step + 1 >= self.depth
    }
    fn exit_known(&self, _item: ItemRef, step: usize, _state: &GateState) -> Option<bool> {
        Some(step + 1 >= self.depth)
    }
    fn reads_latent_diff(&self) -> bool {
        false
    }
}
