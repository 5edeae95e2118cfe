//! What runs a diffusion engine's launches: one [`DiffusionRunner`], or one per tensor-parallel
//! rank.
//!
//! Ranks get the same launch and the same draws. Every layer ends with an all-reduce that leaves
//! the same hidden states on every rank, and FOCUS's importance is summed over the ranks' heads
//! before the (shared, stateless) eviction policy reads it, so every rank keeps the same tokens
//! and reads out the same candidates; rank 0's result is the launch's, and ranks that answer
//! differently are an error.

use super::launch::{DenoiseLaunch, DenoiseResult};
use super::models::DiffusionSpec;
use super::runner::{DiffusionRunner, PhaseTimes};
use super::StepDraw;
use crate::parallel::{RankJob, Ranks};
use crate::Result;
use std::sync::Arc;

pub(crate) enum DiffusionExecutor {
    One(DiffusionRunner),
    Ranks { ranks: Ranks<DiffusionRunner>, spec: DiffusionSpec, phases: PhaseTimes },
}

impl DiffusionExecutor {
    /// Rank 0's spec (every rank's but for its share of the heads).
    pub(crate) fn spec(&self) -> &DiffusionSpec {
        match self {
            Self::One(r) => r.model().spec(),
            Self::Ranks { spec, .. } => spec,
        }
    }

    /// Runs `launch` on every rank and reads its results back.
    pub(crate) fn run(&mut self, launch: &DenoiseLaunch, draws: &[Option<StepDraw>]) -> Result<DenoiseResult> {
        match self {
            Self::One(r) => Ok(r.run(launch, draws)?),
            Self::Ranks { ranks, phases, .. } => {
                let (launch, draws) = (Arc::new(launch.clone()), Arc::new(draws.to_vec()));
                // The engine's kernel policy (in force on this thread) on every rank's too.
                let policy = crate::ops::policy::current();
                let job: RankJob<DiffusionRunner, (DenoiseResult, PhaseTimes, crate::ops::KernelCounts)> = Arc::new(move |_, runner: &mut DiffusionRunner| {
                    let (result, kernels) = crate::ops::with_kernels(policy, || runner.run(&launch, &draws));
                    Ok((result?, runner.phase_times(), kernels))
                });
                let pending = ranks.run(job);
                let mut answers = ranks.wait(pending)?;
                if let Some(rank) = answers.iter().position(|(r, ..)| !same_answer(r, &answers[0].0)) {
                    return Err(crate::Error::Collective {
                        collective: "launch",
                        rank,
                        world: answers.len(),
                        reason: format!("ranks 0 and {rank} disagree on a denoise launch's candidates or kept tokens"),
                    });
                }
                let (result, times, kernels) = answers.swap_remove(0);
                crate::ops::policy::count(|c| *c += kernels);
                *phases = times;
                Ok(result)
            }
        }
    }

    /// Accumulated phase times (rank 0's).
    pub(crate) fn phase_times(&self) -> PhaseTimes {
        match self {
            Self::One(r) => r.phase_times(),
            Self::Ranks { phases, .. } => phases.clone(),
        }
    }
}

/// Whether two ranks answered a launch alike: the same candidates (confidences compared by their
/// bits, so a non-finite one compares equal to itself) and the same kept tokens.
fn same_answer(a: &DenoiseResult, b: &DenoiseResult) -> bool {
    let bits = |c: &[(u32, f32)]| c.iter().map(|&(t, p)| (t, p.to_bits())).collect::<Vec<_>>();
    a.non_finite == b.non_finite
        && a.rows.len() == b.rows.len()
        && a.rows.iter().zip(&b.rows).all(|(x, y)| x.request == y.request && x.kept == y.kept && bits(&x.candidates) == bits(&y.candidates))
}
