//! A new exit gate written against the public API: exit as soon as one step's own hazard
//! λ_r = sigmoid(z_r) reaches a threshold (Ouro's Q-exit looks at the accumulated CDF instead).
//!
//!     cargo run --release --example custom_gate -- [THRESHOLD]
//!
//! Runs the shipped tiny model with continuous depth batching and prints the realised mean depth.

use ponder::looped::gate::{ExitGate, GateState, ItemRef, StepBounds, StepSignals};
use ponder::{EngineBuilder, GenerationParams, KvLayoutKind, SchedulerKind};

/// Exit when the step's hazard reaches `threshold`, within `bounds`.
#[derive(Debug, Clone)]
pub struct HazardThreshold {
    pub threshold: f32,
    pub bounds: StepBounds,
}

impl ExitGate for HazardThreshold {
    fn name(&self) -> String {
        format!("hazard>={}", self.threshold)
    }
    fn bounds(&self) -> StepBounds {
        self.bounds
    }
    fn decide(&self, _item: ItemRef, step: usize, signals: StepSignals, _state: &mut GateState) -> bool {
        let hazard = signals.logit.map_or(0.0, |z| 1.0 / (1.0 + (-z).exp()));
        self.bounds.apply(hazard >= self.threshold, step)
    }
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let threshold = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(0.5);
    let gate = HazardThreshold { threshold, bounds: StepBounds::new(1, 4)? };
    let mut engine = EngineBuilder::new(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-ouro"))
        .looped(|o| o.scheduler(SchedulerKind::Depth { refill: true }).kv_layout(KvLayoutKind::Shared).exit_gate(gate))
        .max_num_seqs(4)
        .build()?;
    let prompts = ["Ownership", "Traits and generics", "Error handling with Result", "Closures"];
    for out in engine.generate(prompts, &GenerationParams::greedy(24))? {
        println!("{}", out?.text.trim());
    }
    let m = engine.metrics().looped().expect("a looped engine");
    println!("hazard threshold {threshold}: mean depth {:.2}, depth histogram {:?}", m.mean_depth(), m.depth_histogram);
    Ok(())
}
