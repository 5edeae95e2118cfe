//! Eviction policies: which masked tokens of a denoising step run past layer 1 (FOCUS, arXiv
//! 2601.23278). The runner scores a request's masked tokens by the attention they receive among
//! themselves at layers 0 and 1 (on the device: `ops::focus_importance`); a policy turns the
//! rise Δ = I₁ − I₀ into a kept set on the host; evicted tokens produce no logits this step and
//! stay masked.

/// One request's step as an eviction policy sees it. Masked tokens are listed in ascending
/// block position; `delta[i]` belongs to `positions[i]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictionInput<'a> {
    pub delta: &'a [f32],
    /// Block offsets of the masked tokens, ascending.
    pub positions: &'a [u32],
    /// Running mean of tokens decoded per decoding step in this block (1 at block start).
    pub avg_decoded: f32,
    /// Rightmost block offset pushed through every layer in this block (−1 at block start).
    pub block_progress: i64,
    /// Tokens the launch runs through layers 0–1, every row's (prefill and commit rows too):
    /// how close it is to compute-bound (a load-aware policy keeps more when it is small).
    pub launch_tokens: usize,
}

/// Decides which masked tokens a step keeps. Unmasked tokens of the processing set are always
/// kept by the runner.
pub trait EvictionPolicy: std::fmt::Debug + Send + Sync {
    fn name(&self) -> String;
    /// `false`: the runner skips scoring (no eviction at all).
    fn scores(&self) -> bool {
        true
    }
    /// Whether each masked token (same order as `input.positions`) is kept. Keep at least one:
    /// a row with none kept is run whole (the step must be able to reveal a token).
    fn keep(&self, input: &EvictionInput) -> Vec<bool>;
}

/// Keep everything (the baseline).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoEviction;

impl EvictionPolicy for NoEviction {
    fn name(&self) -> String {
        "none".into()
    }
    fn scores(&self) -> bool {
        false
    }
    fn keep(&self, input: &EvictionInput) -> Vec<bool> {
        vec![true; input.positions.len()]
    }
}

/// FOCUS: keep the tokens whose importance rose most from layer 0 to layer 1, within a budget
/// tied to how many tokens this block has been decoding per step.
///
/// Evicting pays only when a launch is compute-bound. With `knee` > 0 (tokens) the budget is
/// load-aware: a launch of n < `knee` tokens — one whose time is mostly streaming the weights,
/// where a kept token costs little — scales α by knee / n (at most [`Focus::MAX_BOOST`]×), so
/// fewer decodable tokens are evicted and a step reveals as many as the delayed cache would. The
/// knee is where the model's launches turn compute-bound on the GPU: roughly the time to stream
/// the weights every launch reads over the time of one position's work (LLaDA2.0-mini on the
/// H200: 30.6 GB of experts, 7.3 ms, against ≈ 2.6 µs a position: 2,800 tokens, which made FOCUS
/// faster than the delayed cache at every batch in `docs/BENCHMARKS.md`); 0 is the published
/// rule. With a knee, what a request keeps depends on what shares its launch,
/// so its output can differ from a run alone (batched equals sequential holds for knee 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Focus {
    pub alpha: f32,
    pub knee: usize,
}

impl Default for Focus {
    fn default() -> Self {
        Self { alpha: 1.5, knee: 0 }
    }
}

impl Focus {
    /// The largest factor a small launch scales α by.
    pub const MAX_BOOST: f32 = 4.0;

    pub fn new(alpha: f32) -> crate::Result<Self> {
        if !(alpha >= 1.0 && alpha.is_finite()) {
            return Err(crate::Error::InvalidOption(format!("FOCUS alpha {alpha} must be >= 1")));
        }
        Ok(Self { alpha, knee: 0 })
    }

    /// The load-aware budget: launches of fewer tokens than `knee` keep more (0: off).
    pub fn with_knee(self, knee: usize) -> Self {
        Self { knee, ..self }
    }

    /// α for a launch of `tokens` tokens.
    pub fn alpha_for(&self, tokens: usize) -> f32 {
        if self.knee == 0 || tokens >= self.knee {
            return self.alpha;
        }
        self.alpha * (self.knee as f32 / tokens.max(1) as f32).min(Self::MAX_BOOST)
    }

    /// The budget [`EvictionPolicy::keep`] uses for this input (see [`Focus::budget`]).
    pub fn budget_for(&self, input: &EvictionInput) -> usize {
        Self { alpha: self.alpha_for(input.launch_tokens), knee: 0 }.budget(input.positions.len(), input.avg_decoded)
    }

    /// Budget T = min(m, max(1, ⌈α · max(ā, 1)⌉)) (0 when nothing is masked).
    pub fn budget(&self, masked: usize, avg_decoded: f32) -> usize {
        if masked == 0 {
            return 0;
        }
        let t = (self.alpha * avg_decoded.max(1.0)).ceil().max(1.0) as usize;
        t.min(masked)
    }
}

impl EvictionPolicy for Focus {
    fn name(&self) -> String {
        match self.knee {
            0 => format!("focus(alpha {})", self.alpha),
            k => format!("focus(alpha {}, knee {k} tokens)", self.alpha),
        }
    }

    fn keep(&self, input: &EvictionInput) -> Vec<bool> {
        let m = input.positions.len();
        let t = self.budget_for(input);
        if m <= t {
            return vec![true; m];
        }
        let d = input.delta;
        let mean = d.iter().map(|&x| x as f64).sum::<f64>() / m as f64;
        let var = d.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / m as f64;
        let cut = mean + var.sqrt();
        let above: Vec<bool> = d.iter().map(|&x| x as f64 >= cut).collect();
        let mut keep = if above.iter().filter(|&&k| k).count() >= t {
            above
        } else {
            // Top-T by Δ; ties (and NaN, ranked last) go to the earlier token.
            let key = |i: usize| {
                if d[i].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    d[i]
                }
            };
            let mut order: Vec<usize> = (0..m).collect();
            order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
            let mut k = vec![false; m];
            for &i in &order[..t] {
                k[i] = true;
            }
            k
        };
        enforce_rules(&mut keep, input.positions, input.block_progress);
        keep
    }
}

/// FOCUS's rules after selection, in order: (1) a kept masked token's masked left neighbour
/// (adjacent position) is kept too, one pass over the pre-rule selection; (2) nothing kept →
/// everything kept; (3) every masked token left of the rightmost kept one and right of
/// `block_progress` is kept (deep-layer K/V for positions up to the rightmost kept one must
/// exist, and a position never pushed through in this block has none).
pub fn enforce_rules(keep: &mut [bool], positions: &[u32], block_progress: i64) {
    let m = keep.len();
    let selected = keep.to_vec();
    for i in 0..m.saturating_sub(1) {
        if selected[i + 1] && !selected[i] && positions[i] + 1 == positions[i + 1] {
            keep[i] = true;
        }
    }
    if !keep.iter().any(|&k| k) {
        keep.iter_mut().for_each(|k| *k = true);
        return;
    }
    let r = positions[(0..m).rev().find(|&i| keep[i]).expect("something kept")] as i64;
    for i in 0..m {
        let p = positions[i] as i64;
        if !keep[i] && p < r && p > block_progress {
            keep[i] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(delta: &'a [f32], positions: &'a [u32], avg: f32, progress: i64) -> EvictionInput<'a> {
        EvictionInput { delta, positions, avg_decoded: avg, block_progress: progress, launch_tokens: 1 << 20 }
    }

    #[test]
    fn budget_follows_the_running_mean() {
        let f = Focus::default();
        assert_eq!(f.budget(32, 1.0), 2, "a new block keeps ceil(1.5)");
        assert_eq!(f.budget(32, 0.3), 2);
        assert_eq!(f.budget(32, 3.2), 5);
        assert_eq!(f.budget(3, 3.2), 3);
        assert_eq!(f.budget(0, 3.2), 0);
        assert!(Focus::new(0.5).is_err());
    }

    #[test]
    fn a_small_launch_keeps_more_under_the_load_aware_budget() {
        let f = Focus::default().with_knee(1536);
        assert_eq!((f.alpha_for(1536), f.alpha_for(5000)), (1.5, 1.5), "at and past the knee: the published rule");
        assert_eq!(f.alpha_for(768), 3.0);
        assert_eq!(f.alpha_for(1), 1.5 * Focus::MAX_BOOST, "the boost is capped");
        assert_eq!(Focus::default().alpha_for(1), 1.5, "knee 0: off");
        // Eight masked tokens, one clear outlier, avg 1: T = 2 in a big launch, 6 in a launch of
        // 384 tokens (α 6).
        // Positions two apart and progress past them: the rules add nothing.
        let pos = [0u32, 2, 4, 6, 8, 10, 12, 14];
        let d = [0.0, 0.0, 0.0, 9.0, 0.1, 0.2, 0.3, 0.4];
        let at = |n| f.keep(&EvictionInput { launch_tokens: n, ..input(&d, &pos, 1.0, 14) }).iter().filter(|&&k| k).count();
        assert_eq!((at(4000), at(384)), (2, 6));
    }

    #[test]
    fn mean_plus_sigma_set_when_large_enough_else_top_t() {
        let f = Focus::new(1.0).unwrap();
        // m = 8, T = 2 (avg 2). Δ: two clear outliers at offsets 10, 20 → the μ+σ set.
        let pos = [2, 5, 8, 10, 13, 16, 20, 25];
        let d = [0.0, 0.1, 0.0, 5.0, 0.1, 0.0, 4.0, 0.0];
        let k = f.keep(&input(&d, &pos, 2.0, 30)); // progress beyond all: rule 3 inactive
        assert_eq!(k, vec![false, false, false, true, false, false, true, false]);
        // T = 3 > |μ+σ set| = 2 → top-3, the tie at 0.1 goes to the earlier token (offset 5).
        let k = f.keep(&input(&d, &pos, 3.0, 30));
        assert_eq!(k, vec![false, true, false, true, false, false, true, false]);
    }

    #[test]
    fn rules_fill_left_neighbours_and_the_unprocessed_gap() {
        // Selected: offset 7 only; 6 is masked and adjacent → kept (rule 1); progress 3: the
        // masked 4 and 5 lie left of 7 and right of progress → kept (rule 3); 1 and 2 stay out.
        let pos = [1, 2, 4, 5, 6, 7, 9];
        let mut keep = vec![false, false, false, false, false, true, false];
        enforce_rules(&mut keep, &pos, 3);
        assert_eq!(keep, vec![false, false, true, true, true, true, false]);
        // Rule 1 is one pass over the pre-rule selection: runs grow by one, not transitively.
        let pos = [0, 1, 2, 3];
        let mut keep = vec![false, false, false, true];
        enforce_rules(&mut keep, &pos, 10);
        assert_eq!(keep, vec![false, false, true, true]);
        // Nothing kept → everything.
        let mut none = vec![false; 3];
        enforce_rules(&mut none, &[0, 2, 4], -1);
        assert_eq!(none, vec![true; 3]);
        // First step of a block (progress −1): only a suffix right of the rightmost kept token
        // can be evicted.
        let mut first = vec![false, true, false, false];
        enforce_rules(&mut first, &[0, 3, 6, 9], -1);
        assert_eq!(first, vec![true, true, false, false]);
    }
}
