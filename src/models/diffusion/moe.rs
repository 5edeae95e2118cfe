//! Mixture-of-experts MLP layers: a router picks `top_k` experts per token, their SwiGLU outputs
//! are summed with the router's weights (in f32), and shared experts are added with weight 1.
//!
//! Two router layouts: LLaDA2.0's (Ling-2.0: sigmoid scores, an expert bias that only *selects*,
//! group-limited choice, renormalised weights × a scaling factor) and Qwen3-MoE's (softmax
//! scores, no groups, no bias). This file is the CPU composition, which is also the reference of
//! any device kernel: routing runs on the host over the f32 router logits, then each chosen
//! expert runs once over the tokens routed to it.

use crate::ops;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::Linear;

/// How router logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    Sigmoid,
    Softmax,
}

/// The routing rule of one checkpoint family.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterArch {
    pub num_experts: usize,
    pub top_k: usize,
    /// Expert groups; the `topk_group` groups with the largest sum of their two best (biased)
    /// scores are the only ones experts are chosen from. One group: no limit.
    pub n_group: usize,
    pub topk_group: usize,
    pub scoring: Scoring,
    /// Divide the chosen experts' scores by their sum.
    pub norm_topk: bool,
    /// Multiplies the weights (after the normalisation).
    pub scale: f64,
}

impl RouterArch {
    /// The shape rules routing relies on: groups of at least two experts that divide them,
    /// and enough experts in the kept groups for `top_k`.
    pub fn validate(&self) -> crate::Result<()> {
        self.shape_error().map_or(Ok(()), |reason| Err(crate::Error::InvalidOption(reason)))
    }

    /// Why routing cannot serve these shapes, if it cannot (the one copy of the rule, which the
    /// configs' validation reports as theirs).
    pub fn shape_error(&self) -> Option<String> {
        let (e, g, kg, k) = (self.num_experts, self.n_group, self.topk_group, self.top_k);
        let kept = if g == 1 { e } else { kg * (e / g.max(1)) };
        let ok = e > 0 && k > 0 && g > 0 && e % g == 0 && (g == 1 || (e / g >= 2 && kg >= 1 && kg <= g)) && k <= kept;
        (!ok).then(|| format!("router of {e} experts in {g} groups ({kg} kept) cannot choose {k} per token (groups need two experts or more)"))
    }

    /// The chosen experts of one token and their weights, best first. `logits` are the router's
    /// f32 outputs over the experts; `bias` (if any) is added to the scores for the choice only.
    pub fn route(&self, logits: &[f32], bias: Option<&[f32]>) -> Vec<(usize, f32)> {
        let scores: Vec<f32> = match self.scoring {
            Scoring::Sigmoid => logits.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect(),
            Scoring::Softmax => {
                let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = logits.iter().map(|&z| (z - m).exp()).collect();
                let total: f32 = e.iter().sum();
                e.iter().map(|v| v / total).collect()
            }
        };
        let choice: Vec<f32> = match bias {
            Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => scores.clone(),
        };
        let mut allowed = vec![true; self.num_experts];
        if self.n_group > 1 {
            let per = self.num_experts / self.n_group;
            let group_score = |g: usize| {
                let mut top = [f32::NEG_INFINITY; 2];
                for &v in &choice[g * per..(g + 1) * per] {
                    if v > top[0] {
                        top = [v, top[0]];
                    } else if v > top[1] {
                        top[1] = v;
                    }
                }
                top[0] + top[1]
            };
            let mut groups: Vec<(usize, f32)> = (0..self.n_group).map(|g| (g, group_score(g))).collect();
            groups.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let kept: Vec<usize> = groups.iter().take(self.topk_group).map(|g| g.0).collect();
            for (e, ok) in allowed.iter_mut().enumerate() {
                *ok = kept.contains(&(e / per));
            }
        }
        let mut order: Vec<usize> = (0..self.num_experts).filter(|&e| allowed[e]).collect();
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        order.truncate(self.top_k);
        let total: f32 = order.iter().map(|&e| scores[e]).sum();
        let norm = if self.norm_topk { total + 1e-20 } else { 1.0 };
        order.into_iter().map(|e| (e, scores[e] / norm * self.scale as f32)).collect()
    }
}

/// One SwiGLU expert: gate and up stacked on the output dim (the layout [`ops::silu_mul`]
/// takes), then down.
#[derive(Debug, Clone)]
pub(crate) struct Expert {
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
}

impl Expert {
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down.forward(&ops::silu_mul(&self.gate_up.forward(x)?)?)
    }
}

/// A loaded MoE layer.
#[derive(Debug, Clone)]
pub(crate) struct Moe {
    pub(crate) arch: RouterArch,
    /// `[experts, hidden]` f32: the router runs in f32 whatever the model dtype.
    pub(crate) router: Tensor,
    /// Selection bias per expert (LLaDA2.0's `expert_bias`), f32, on the host.
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) experts: Vec<Expert>,
    pub(crate) shared: Option<Expert>,
}

impl Moe {
    /// Chosen experts and weights of each token of `x` `[tokens, hidden]`.
    pub(crate) fn routes(&self, x: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let logits: Vec<Vec<f32>> = x.to_dtype(DType::F32)?.matmul(&self.router.t()?)?.to_vec2()?;
        Ok(logits.iter().map(|z| self.arch.route(z, self.bias.as_deref())).collect())
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, h) = x.dims2()?;
        let routes = self.routes(x)?;
        // Tokens (and their weights) per expert, so each chosen expert runs once.
        let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (tok, r) in routes.iter().enumerate() {
            for &(e, w) in r {
                by_expert[e].0.push(tok as u32);
                by_expert[e].1.push(w);
            }
        }
        // Each expert's weighted outputs, then one scatter-add of them all into the tokens' rows.
        let (mut rows, mut weights, mut parts) = (Vec::new(), Vec::new(), Vec::new());
        for (e, (toks, ws)) in by_expert.into_iter().enumerate().filter(|(_, (toks, _))| !toks.is_empty()) {
            let idx = Tensor::new(toks.as_slice(), x.device())?;
            parts.push(self.experts[e].forward(&x.index_select(&idx, 0)?)?.to_dtype(DType::F32)?);
            rows.extend(toks);
            weights.extend(ws);
        }
        let mut out = Tensor::zeros((t, h), DType::F32, x.device())?;
        if !parts.is_empty() {
            let n = rows.len();
            let y = Tensor::cat(&parts, 0)?.broadcast_mul(&Tensor::from_vec(weights, (n, 1), x.device())?)?;
            out = out.index_add(&Tensor::from_vec(rows, n, x.device())?, &y, 0)?;
        }
        // The shared expert joins the f32 sum before the one cast back (the released code casts
        // the routed sum first and adds in the model dtype: equal in f32, closer to exact in bf16).
        if let Some(shared) = &self.shared {
            out = (out + shared.forward(x)?.to_dtype(DType::F32)?)?;
        }
        out.to_dtype(x.dtype())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llada2(e: usize, k: usize, g: usize, kg: usize) -> RouterArch {
        RouterArch { num_experts: e, top_k: k, n_group: g, topk_group: kg, scoring: Scoring::Sigmoid, norm_topk: true, scale: 2.5 }
    }

    #[test]
    fn the_bias_selects_but_does_not_weigh() {
        let r = llada2(4, 2, 1, 1);
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let plain = r.route(&logits, None);
        assert_eq!(plain.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2, 1]);
        let s = |z: f32| 1.0 / (1.0 + (-z).exp());
        let total = s(2.0) + s(1.0);
        assert!((plain[0].1 - s(2.0) / total * 2.5).abs() < 1e-6);
        // A bias that lifts expert 3 above the rest: chosen, weighted by its unbiased score.
        let biased = r.route(&logits, Some(&[0.0, 0.0, 0.0, 5.0]));
        assert_eq!(biased.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 2]);
        let total = s(-1.0) + s(2.0);
        assert!((biased[0].1 - s(-1.0) / total * 2.5).abs() < 1e-6);
        assert!((biased.iter().map(|p| p.1).sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn groups_are_ranked_by_their_best_two() {
        // Two groups of three; group 0 has the single best expert, group 1 the better pair.
        let r = llada2(6, 2, 2, 1);
        let logits = [4.0f32, -4.0, -4.0, 1.0, 1.0, -4.0];
        let got: Vec<usize> = r.route(&logits, None).iter().map(|p| p.0).collect();
        assert_eq!(got, vec![3, 4]);
        let all = llada2(6, 2, 2, 2);
        assert_eq!(all.route(&logits, None).iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 3]);
    }

    #[test]
    fn shapes_routing_cannot_serve_are_refused() {
        assert!(llada2(256, 8, 8, 4).validate().is_ok());
        assert!(llada2(8, 2, 1, 4).validate().is_ok(), "one group: topk_group does not limit");
        for bad in [llada2(8, 2, 16, 4), llada2(9, 2, 4, 2), llada2(8, 5, 4, 2), llada2(8, 0, 4, 2), llada2(8, 2, 0, 1), llada2(8, 2, 4, 5)] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn softmax_routing_without_groups() {
        let r = RouterArch { num_experts: 3, top_k: 1, n_group: 1, topk_group: 1, scoring: Scoring::Softmax, norm_topk: false, scale: 1.0 };
        let got = r.route(&[0.0, 0.0, (2.0f32).ln()], None);
        assert_eq!(got[0].0, 2);
        assert!((got[0].1 - 0.5).abs() < 1e-6);
    }
}
