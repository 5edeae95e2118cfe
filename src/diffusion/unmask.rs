//! Unmask policies: which of a step's masked candidates become final tokens.

use crate::dist::{draw, mix};
use crate::request::RequestId;
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// A masked position that produced logits this step, with its greedy token and that token's
/// probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Offset in the block.
    pub offset: usize,
    pub token: u32,
    pub confidence: f32,
}

/// Where a step sits, for policies that depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepContext {
    pub request: RequestId,
    /// Index of the block among the request's decoded blocks (0 = the block holding the prompt's
    /// end).
    pub block: usize,
    /// Steps already run on this block.
    pub step: usize,
    /// Masked positions left in the block (candidates may be fewer: FOCUS evicts some).
    pub masked: usize,
    /// Masked positions the block had before its first step.
    pub block_masked: usize,
    pub block_len: usize,
}

/// Decides which candidates of a step to reveal. The scheduler reveals at least one (the most
/// confident) when a policy returns none, and every candidate on a block's last allowed step.
pub trait UnmaskPolicy: std::fmt::Debug + Send + Sync {
    fn name(&self) -> String;
    /// Indices into `candidates` (ordered by offset) to reveal now.
    fn select(&self, ctx: &StepContext, candidates: &[Candidate]) -> Vec<usize>;
    /// Whether a step may reveal nothing (Dream's timestep schedule early on); otherwise the
    /// scheduler reveals the most confident candidate when `select` returns none.
    fn may_reveal_none(&self) -> bool {
        false
    }
    /// The confidence the policy ranks by; the runner computes it for every candidate.
    fn confidence(&self) -> Confidence {
        Confidence::Probability
    }
}

/// What a candidate's `confidence` measures, from the step's distribution over the vocabulary
/// (the mask token excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Confidence {
    /// The greedy token's probability (LLaDA's low-confidence remasking, Dream's `maskgit_plus`).
    #[default]
    Probability,
    /// Top-1 minus top-2 probability (Dream's `topk_margin`).
    Margin,
    /// Σ p·ln(p + 1e-10), the negative entropy (Dream's `entropy`).
    NegEntropy,
}

/// LLaDA's linear schedule (`get_num_transfer_tokens`): a block with M masked positions and S
/// steps reveals ⌊M/S⌋ tokens per step, one more in the first M mod S steps, the most confident
/// first. Pair it with `max_steps_per_block(S)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearSchedule {
    pub steps: usize,
}

impl LinearSchedule {
    pub fn new(steps: usize) -> Result<Self> {
        if steps == 0 {
            return Err(Error::InvalidOption("the linear schedule needs at least 1 step per block".into()));
        }
        Ok(Self { steps })
    }

    /// Tokens to reveal at `step` of a block that started with `masked` masked positions.
    pub fn count(&self, masked: usize, step: usize) -> usize {
        // `steps` is a public field: a literal with 0 (which `new` refuses) counts as 1 step.
        let steps = self.steps.max(1);
        masked / steps + usize::from(step < masked % steps)
    }
}

impl UnmaskPolicy for LinearSchedule {
    fn name(&self) -> String {
        format!("linear({})", self.steps)
    }
    fn select(&self, ctx: &StepContext, candidates: &[Candidate]) -> Vec<usize> {
        by_confidence(candidates).into_iter().take(self.count(ctx.block_masked, ctx.step)).collect()
    }
}

/// Dream's own sampler: over `steps` steps with timesteps t_i = 1 − i·(1 − ε)/steps (ε = 10⁻³,
/// computed in f64), step i reveals ⌊n·(1 − t_{i+1}/t_i)⌋ of the n positions still masked — often
/// none early on — and the last step all of them, ranked by `order`. Pair it with a block that
/// is the whole generation (`DiffusionOptions::dream_sampler` sets both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timesteps {
    pub steps: usize,
    pub order: Confidence,
}

impl Timesteps {
    pub const EPS: f64 = 1e-3;

    pub fn new(steps: usize, order: Confidence) -> Result<Self> {
        if steps == 0 {
            return Err(Error::InvalidOption("Dream's sampler needs at least 1 step".into()));
        }
        Ok(Self { steps, order })
    }

    /// Tokens to reveal at `step` with `masked` positions left.
    pub fn count(&self, masked: usize, step: usize) -> usize {
        if step + 1 >= self.steps {
            return masked;
        }
        let t = |i: usize| 1.0 - i as f64 * (1.0 - Self::EPS) / self.steps as f64;
        ((masked as f64) * (1.0 - t(step + 1) / t(step))).floor() as usize
    }
}

impl UnmaskPolicy for Timesteps {
    fn name(&self) -> String {
        format!("timesteps({}, {:?})", self.steps, self.order)
    }
    fn select(&self, ctx: &StepContext, candidates: &[Candidate]) -> Vec<usize> {
        by_confidence(candidates).into_iter().take(self.count(ctx.masked, ctx.step)).collect()
    }
    fn may_reveal_none(&self) -> bool {
        true
    }
    fn confidence(&self) -> Confidence {
        self.order
    }
}

/// Candidate indices by confidence, highest first; ties (and NaN) go to the earlier offset.
pub fn by_confidence(candidates: &[Candidate]) -> Vec<usize> {
    let key = |c: &Candidate| {
        if c.confidence.is_nan() {
            f32::NEG_INFINITY
        } else {
            c.confidence
        }
    };
    let mut idx: Vec<usize> = (0..candidates.len()).collect();
    idx.sort_by(|&a, &b| key(&candidates[b]).total_cmp(&key(&candidates[a])).then(candidates[a].offset.cmp(&candidates[b].offset)));
    idx
}

/// Reveal every candidate whose confidence is at least `tau`, and always the most confident one
/// (Fast-dLLM / LMDeploy `low_confidence_dynamic`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Threshold {
    pub tau: f32,
}

impl Threshold {
    pub fn new(tau: f32) -> Result<Self> {
        if !(tau > 0.0 && tau <= 1.0) {
            return Err(Error::InvalidOption(format!("unmask threshold {tau} outside (0, 1]")));
        }
        Ok(Self { tau })
    }
}

impl UnmaskPolicy for Threshold {
    fn name(&self) -> String {
        format!("threshold({})", self.tau)
    }
    fn select(&self, _ctx: &StepContext, candidates: &[Candidate]) -> Vec<usize> {
        let order = by_confidence(candidates);
        let mut pick: Vec<usize> = order.iter().copied().filter(|&i| candidates[i].confidence >= self.tau).collect();
        if pick.is_empty() {
            pick.extend(order.first());
        }
        pick
    }
}

/// Reveal the `k` most confident candidates per step (LMDeploy `low_confidence_static`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StaticCount {
    pub per_step: usize,
}

impl StaticCount {
    pub fn new(per_step: usize) -> Result<Self> {
        if per_step == 0 {
            return Err(Error::InvalidOption("static unmasking needs at least 1 token per step".into()));
        }
        Ok(Self { per_step })
    }
}

impl UnmaskPolicy for StaticCount {
    fn name(&self) -> String {
        format!("static({})", self.per_step)
    }
    fn select(&self, _ctx: &StepContext, candidates: &[Candidate]) -> Vec<usize> {
        by_confidence(candidates).into_iter().take(self.per_step).collect()
    }
}

/// Where replayed unmask counts come from.
#[derive(Debug, Clone, PartialEq)]
pub enum UnmaskTrace {
    /// Recorded counts: request id → per block → tokens revealed at each step (steps past a
    /// list's end take its last value; blocks past the end reuse the last block's list).
    Recorded(HashMap<u64, Vec<Vec<usize>>>),
    /// `probs[i]` = P(count = i + 1); a count per (seed, request, block, step) by hashing.
    Seeded { probs: Vec<f64>, seed: u64 },
}

impl UnmaskTrace {
    /// Counts in `1..=max` with mean `mean` (an exponentially tilted distribution, so counts
    /// spread over the range), drawn per (request, block, step) from `seed`.
    pub fn with_mean(mean: f64, max: usize, seed: u64) -> Result<Self> {
        if max == 0 || !(mean >= 1.0 && mean <= max as f64) {
            return Err(Error::InvalidOption(format!("unmask count mean {mean} outside 1..={max}")));
        }
        Ok(Self::Seeded { probs: crate::dist::tilted(1, max, mean), seed })
    }

    /// The seeded trace over `1..=block` whose *realised* mean is `realised` tokens per step: a
    /// step reveals at most the masks left in its block (so the realised mean lies below the
    /// distribution's) and a block's last allowed step (the `block`-th) reveals the rest. The
    /// distribution's mean is found by bisection on a simulation of the same seeded counts over
    /// 256 requests of 8 blocks; a `realised` beyond what counts up to `block` can give takes
    /// the largest mean.
    pub fn with_realised_mean(realised: f64, block: usize, seed: u64) -> Result<Self> {
        if block == 0 || !(realised >= 1.0 && realised <= block as f64) {
            return Err(Error::InvalidOption(format!("realised unmask mean {realised} outside 1..={block}")));
        }
        let simulate = |mean: f64| -> Result<f64> {
            let trace = Self::with_mean(mean, block, seed)?;
            let (mut tokens, mut steps) = (0usize, 0usize);
            for request in 0..256u64 {
                for b in 0..8 {
                    let (mut left, mut step) = (block, 0);
                    while left > 0 {
                        let ctx = StepContext { request: RequestId(request), block: b, step, masked: left, block_masked: block, block_len: block };
                        left -= if step + 1 >= block { left } else { trace.count(&ctx).unwrap_or(1).min(left) };
                        step += 1;
                    }
                    tokens += block;
                    steps += step;
                }
            }
            Ok(tokens as f64 / steps as f64)
        };
        let (mut lo, mut hi) = (1.0, block as f64);
        if simulate(hi)? < realised {
            return Self::with_mean(hi, block, seed);
        }
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if simulate(mid)? < realised {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Self::with_mean(0.5 * (lo + hi), block, seed)
    }

    /// Reads `{"counts": {"<request id>": [[c, ...] per block, ...], ...}}`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        #[derive(serde::Deserialize)]
        struct File {
            counts: HashMap<String, Vec<Vec<usize>>>,
        }
        let bad = |r: String| Error::config(path.display().to_string(), r);
        let f: File = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let mut out = HashMap::new();
        for (k, v) in f.counts {
            let id = k.parse::<u64>().map_err(|_| bad(format!("request id `{k}` is not an integer")))?;
            if v.is_empty() || v.iter().any(|b| b.is_empty() || b.contains(&0)) {
                return Err(bad(format!("request {k}: every block needs a non-empty list of counts >= 1")));
            }
            out.insert(id, v);
        }
        Ok(Self::Recorded(out))
    }

    /// The count for one step, if the trace names one.
    pub fn count(&self, ctx: &StepContext) -> Option<usize> {
        match self {
            Self::Recorded(m) => {
                // Past the end of a list its last entry repeats; an empty list names nothing.
                let blocks = m.get(&ctx.request.0)?;
                let steps = blocks.get(ctx.block).or(blocks.last())?;
                steps.get(ctx.step).or(steps.last()).copied()
            }
            Self::Seeded { probs, seed } => Some(draw(probs, mix(*seed ^ mix(ctx.request.0 ^ mix((ctx.block as u64) << 32 ^ ctx.step as u64))))),
        }
    }

    /// Mean count the trace implies (seeded: exact expectation).
    pub fn expected_mean(&self) -> f64 {
        match self {
            Self::Seeded { probs, .. } => crate::dist::mean_of(probs),
            Self::Recorded(m) => {
                let all: Vec<usize> = m.values().flatten().flatten().copied().collect();
                all.iter().sum::<usize>() as f64 / all.len().max(1) as f64
            }
        }
    }
}

/// Reveal the replayed number of tokens per step, most confident first: decisions that do not
/// depend on the model, so throughput runs with random weights unmask like a real model would.
/// Requests the trace does not name reveal one token per step.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    pub trace: UnmaskTrace,
}

impl Replay {
    pub fn new(trace: UnmaskTrace) -> Self {
        Self { trace }
    }
}

impl UnmaskPolicy for Replay {
    fn name(&self) -> String {
        format!("replay(mean {:.2})", self.trace.expected_mean())
    }
    fn select(&self, ctx: &StepContext, candidates: &[Candidate]) -> Vec<usize> {
        let n = self.trace.count(ctx).unwrap_or(1);
        by_confidence(candidates).into_iter().take(n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(conf: &[f32]) -> Vec<Candidate> {
        conf.iter().enumerate().map(|(i, &c)| Candidate { offset: i * 2, token: i as u32, confidence: c }).collect()
    }
    const CTX: StepContext = StepContext { request: RequestId(3), block: 1, step: 2, masked: 4, block_masked: 8, block_len: 8 };

    #[test]
    fn a_realised_mean_is_what_whole_blocks_reveal_per_step() {
        let block = 32;
        let t = UnmaskTrace::with_realised_mean(3.2, block, 2026).unwrap();
        // Steps capped by the masks left reveal less than the distribution's mean.
        assert!(t.expected_mean() > 3.2, "{}", t.expected_mean());
        // Requests the calibration did not simulate realise the same mean.
        let (mut tokens, mut steps) = (0usize, 0usize);
        for request in 5000..5400u64 {
            for b in 0..4 {
                let (mut left, mut step) = (block, 0);
                while left > 0 {
                    let ctx = StepContext { request: RequestId(request), block: b, step, masked: left, block_masked: block, block_len: block };
                    left -= if step + 1 >= block { left } else { t.count(&ctx).unwrap().min(left) };
                    step += 1;
                }
                tokens += block;
                steps += step;
            }
        }
        let realised = tokens as f64 / steps as f64;
        assert!((realised - 3.2).abs() < 0.1, "realised {realised}");
        assert!(UnmaskTrace::with_realised_mean(0.5, block, 1).is_err());
        assert!(UnmaskTrace::with_realised_mean(33.0, block, 1).is_err());
    }

    #[test]
    fn a_linear_schedule_literal_of_zero_steps_counts_as_one() {
        let l = LinearSchedule { steps: 0 };
        assert_eq!(l.count(5, 0), 5);
        assert!(LinearSchedule::new(0).is_err());
    }

    #[test]
    fn threshold_reveals_all_above_tau_or_the_top_one() {
        let t = Threshold::new(0.8).unwrap();
        assert_eq!(t.select(&CTX, &cands(&[0.5, 0.9, 0.85, 0.1])), vec![1, 2]);
        assert_eq!(t.select(&CTX, &cands(&[0.5, 0.7, 0.7, 0.1])), vec![1], "tie goes to the earlier offset");
        assert_eq!(t.select(&CTX, &cands(&[f32::NAN, 0.1])), vec![1]);
        assert!(Threshold::new(0.0).is_err() && Threshold::new(1.5).is_err());
    }

    #[test]
    fn static_takes_the_k_most_confident() {
        let s = StaticCount::new(2).unwrap();
        assert_eq!(s.select(&CTX, &cands(&[0.5, 0.9, 0.85, 0.95])), vec![3, 1]);
        assert!(StaticCount::new(0).is_err());
    }

    #[test]
    fn seeded_trace_has_the_requested_mean_and_is_deterministic() {
        let t = UnmaskTrace::with_mean(3.2, 32, 7).unwrap();
        assert!((t.expected_mean() - 3.2).abs() < 1e-6);
        let mut sum = 0usize;
        let n = 20_000;
        for i in 0..n {
            let ctx = StepContext { request: RequestId(i as u64 % 97), block: i / 97, step: i % 5, ..CTX };
            let c = t.count(&ctx).unwrap();
            assert!((1..=32).contains(&c));
            assert_eq!(t.count(&ctx), Some(c));
            sum += c;
        }
        let mean = sum as f64 / n as f64;
        assert!((mean - 3.2).abs() < 0.1, "sample mean {mean}");
        assert!(UnmaskTrace::with_mean(0.5, 32, 1).is_err());
    }

    #[test]
    fn recorded_trace_extends_its_last_values() {
        let t = UnmaskTrace::Recorded(HashMap::from([(3, vec![vec![1, 2], vec![4]])]));
        let at = |block, step| t.count(&StepContext { block, step, ..CTX });
        assert_eq!((at(0, 0), at(0, 1), at(0, 9), at(1, 0), at(5, 3)), (Some(1), Some(2), Some(2), Some(4), Some(4)));
        assert_eq!(t.count(&StepContext { request: RequestId(9), ..CTX }), None);
    }

    #[test]
    fn linear_and_timestep_schedules_count_like_their_references() {
        // LLaDA's get_num_transfer_tokens: 10 masks over 4 steps → 3, 3, 2, 2.
        let l = LinearSchedule::new(4).unwrap();
        assert_eq!((0..4).map(|i| l.count(10, i)).collect::<Vec<_>>(), vec![3, 3, 2, 2]);
        assert_eq!((0..4).map(|i| l.count(3, i)).collect::<Vec<_>>(), vec![1, 1, 1, 0]);
        // Dream: 8 masks over 4 steps, t = 1, 0.75025, 0.5005, 0.25075, 0.001.
        let t = Timesteps::new(4, Confidence::Margin).unwrap();
        assert_eq!(t.count(8, 0), 1, "⌊8 · (1 − 0.75025)⌋");
        assert_eq!(t.count(7, 1), 2, "⌊7 · (1 − 0.5005 / 0.75025)⌋");
        assert_eq!(t.count(5, 2), 2, "⌊5 · (1 − 0.25075 / 0.5005)⌋");
        assert_eq!(t.count(3, 3), 3, "the last step reveals the rest");
        assert!(t.may_reveal_none() && t.confidence() == Confidence::Margin);
        assert_eq!(Timesteps::new(512, Confidence::Probability).unwrap().count(256, 0), 0, "early steps may reveal nothing");
    }
}
