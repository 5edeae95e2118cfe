//! Mixture-of-experts layers as ops: the routing rule ([`RouterArch`]), routing ([`route`]: the
//! chosen experts and their weights per token) and the routed experts' weighted sum
//! ([`moe_experts`]) over experts stacked in one tensor each ([`StackedExperts`]). On CUDA
//! routing is a kernel, and in bf16 / f16 so are grouping by expert, the two grouped GEMMs and
//! the combine (`kernels/moe.cu`). Elsewhere, and in f32, the composition of candle ops here runs,
//! which is also the kernels' reference: routing on the host over the f32 router logits, then each
//! chosen expert once over the tokens routed to it, summed in f32.

use candle_core::{DType, Device, Result, Tensor};

pub use super::policy::MoeKernels;

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
        let kept = if g == 1 { e } else { kg.saturating_mul(e / g.max(1)) };
        let ok = e > 0 && k > 0 && g > 0 && e % g == 0 && (g == 1 || (e / g >= 2 && kg >= 1 && kg <= g)) && k <= kept;
        (!ok).then(|| format!("router of {e} experts in {g} groups ({kg} kept) cannot choose {k} per token (groups need two experts or more)"))
    }

    /// The chosen experts of one token and their weights, best first. `logits` are the router's
    /// f32 outputs over the experts; `bias` (if any) is added to the scores for the choice only.
    /// Routes nothing for shapes [`RouterArch::shape_error`] refuses or slices shorter than the
    /// experts.
    pub fn route(&self, logits: &[f32], bias: Option<&[f32]>) -> Vec<(usize, f32)> {
        if self.shape_error().is_some() || logits.len() < self.num_experts || bias.is_some_and(|b| b.len() < self.num_experts) {
            return Vec::new();
        }
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

/// Every expert's SwiGLU weights stacked in one tensor each: `gate_up` `[experts, 2 × width,
/// hidden]` (each expert's gate rows, then its up rows) and `down` `[experts, hidden, width]`.
/// Where the grouped kernels serve the device and dtype, the gate and up rows are kept
/// interleaved in chunks of 16, the layout their SwiGLU epilogue reads. Stored in FP8, both are
/// E4M3 with an f32 scale per expert row (`[experts, 2 × width]`, `[experts, hidden]`), and an
/// expert's matmuls run as any FP8 layer's (`ops::fp8_matmul`).
#[derive(Debug, Clone)]
pub struct StackedExperts {
    gate_up: Tensor,
    down: Tensor,
    width: usize,
    /// `gate_up` is in the kernels' interleaved layout.
    kernel_layout: bool,
    /// FP8 storage: the scales of `gate_up`'s and `down`'s rows.
    fp8: Option<(Tensor, Tensor)>,
}

/// Gate and up rows alternate in chunks of this many in the kernels' layout.
const CHUNK: usize = 16;

impl StackedExperts {
    /// Stacks `gate_up` `[experts, 2 × width, hidden]` (gate rows, then up rows) and `down`
    /// `[experts, hidden, width]`.
    pub fn new(gate_up: Tensor, down: Tensor) -> Result<Self> {
        let (_, _, h, width) = Self::shapes(&gate_up, &down)?;
        let kernel_layout = kernels_serve(gate_up.device(), gate_up.dtype(), width, h);
        let gate_up = if kernel_layout { interleaved(&gate_up, width)? } else { gate_up.contiguous()? };
        Ok(Self { gate_up, down: down.contiguous()?, width, kernel_layout, fp8: None })
    }

    /// [`StackedExperts::new`] stored as `q` says: in FP8, every expert row in E4M3 with its own
    /// scale (quantized like any linear layer's rows). Where the grouped W8A8 kernels serve,
    /// gate and up rows are interleaved first, as for the 16-bit kernels (a row's scale does not
    /// depend on where the row sits).
    pub fn quantized(gate_up: Tensor, down: Tensor, q: crate::quant::Quantization) -> Result<Self> {
        if q == crate::quant::Quantization::None {
            return Self::new(gate_up, down);
        }
        let (e, two_w, h, width) = Self::shapes(&gate_up, &down)?;
        // The FP8 tiles load 16 values of a row at a time; their MMAs need sm_89 or later.
        let kernel_layout = kernels_serve(gate_up.device(), gate_up.dtype(), width, h) && h % 16 == 0 && fp8_kernels_serve(gate_up.device());
        let gate_up = if kernel_layout { interleaved(&gate_up, width)? } else { gate_up };
        let rows = |w: &Tensor, r: usize, c: usize| -> Result<(Tensor, Tensor)> {
            let q = crate::quant::Fp8Weight::quantize(&w.reshape((e * r, c))?)?;
            let crate::quant::Fp8Scale::PerChannel(s) = q.scale() else { unreachable!("quantize scales per row") };
            Ok((q.data().reshape((e, r, c))?, s.reshape((e, r))?))
        };
        let (gu, gu_scale) = rows(&gate_up, two_w, h)?;
        let (d, d_scale) = rows(&down, h, width)?;
        Ok(Self { gate_up: gu, down: d, width, kernel_layout, fp8: Some((gu_scale, d_scale)) })
    }

    /// `(experts, 2 × width, hidden, width)` of stacks that agree.
    fn shapes(gate_up: &Tensor, down: &Tensor) -> Result<(usize, usize, usize, usize)> {
        let (e, two_w, h) = gate_up.dims3()?;
        let width = two_w / 2;
        if e == 0 || two_w % 2 != 0 || down.dims() != [e, h, width] {
            candle_core::bail!("stacked experts: gate_up {:?} and down {:?} do not agree", gate_up.dims(), down.dims());
        }
        Ok((e, two_w, h, width))
    }

    pub fn num_experts(&self) -> usize {
        self.down.dims()[0]
    }

    /// Bytes the experts' weights occupy.
    pub fn bytes(&self) -> u64 {
        crate::ops::bytes_of(&self.gate_up)
            + crate::ops::bytes_of(&self.down)
            + self.fp8.as_ref().map_or(0, |(a, b)| crate::ops::bytes_of(a) + crate::ops::bytes_of(b))
    }

    /// Whether these experts are laid out for the grouped kernels, which then run every launch
    /// of 16-bit experts and, in FP8, the launches whose activations the policy quantizes.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub fn on_kernels(&self) -> bool {
        self.kernel_layout
    }

    /// Expert `e`'s SwiGLU MLP over its tokens `x` `[rows, hidden]`, a part of a layer's
    /// launch of `launch_rows` tokens. Stored in FP8, its two matmuls run as the engine's FP8
    /// policy says for the launch (`ops::fp8_matmul`: the dequantized weight, the weight-only
    /// kernel at a few rows, or W8A8).
    fn expert_mlp(&self, e: usize, x: &Tensor, launch_rows: usize) -> Result<Tensor> {
        use crate::quant::{Fp8Scale, Fp8Weight};
        if let Some((gu_scale, d_scale)) = &self.fp8 {
            let gate_up = Fp8Weight::from_parts(self.gate_up.get(e)?, Fp8Scale::PerChannel(gu_scale.get(e)?))?;
            let down = Fp8Weight::from_parts(self.down.get(e)?, Fp8Scale::PerChannel(d_scale.get(e)?))?;
            let mut y = super::linear::fp8_matmul_for(x, &gate_up, None, launch_rows)?;
            if self.kernel_layout {
                // The product's columns come interleaved as the rows were: gate chunks, then up.
                let rows = y.dim(0)?;
                y = y.reshape((rows, self.width / CHUNK, 2, CHUNK))?.transpose(1, 2)?.contiguous()?.reshape((rows, 2 * self.width))?;
            }
            return super::linear::fp8_matmul_for(&super::silu_mul(&y)?, &down, None, launch_rows);
        }
        let (gate_up, down) = self.expert(e)?;
        super::silu_mul(&x.matmul(&gate_up.t()?)?)?.matmul(&down.t()?)
    }

    /// Expert `e`'s dense `(gate_up [2 × width, hidden], down [hidden, width])`, gate rows first.
    fn expert(&self, e: usize) -> Result<(Tensor, Tensor)> {
        let mut gate_up = self.gate_up.get(e)?;
        if self.kernel_layout {
            let h = gate_up.dim(1)?;
            gate_up = gate_up.reshape((self.width / CHUNK, 2, CHUNK, h))?.transpose(0, 1)?.contiguous()?.reshape((2 * self.width, h))?;
        }
        Ok((gate_up, self.down.get(e)?))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn kernel_weights(&self) -> (&Tensor, &Tensor) {
        (&self.gate_up, &self.down)
    }

    /// The f32 scales of `gate_up`'s and `down`'s rows, `[experts, rows]`, stored in FP8.
    #[cfg(feature = "cuda")]
    pub(crate) fn fp8_scales(&self) -> Option<(&Tensor, &Tensor)> {
        self.fp8.as_ref().map(|(a, b)| (a, b))
    }

    /// Whether a launch of `tokens` tokens runs on the grouped kernels: the 16-bit ones in the
    /// experts' dtype, or in FP8 the W8A8 ones where the policy quantizes the launch's
    /// activations (otherwise each expert runs as any FP8 layer, e.g. weight-only at decode).
    #[cfg(feature = "cuda")]
    fn grouped(&self, x: &Tensor) -> bool {
        let tokens = x.dims().first().copied().unwrap_or(0);
        self.kernel_layout
            && x.device().is_cuda()
            && match self.fp8 {
                None => x.dtype() == self.gate_up.dtype(),
                Some(_) => matches!(x.dtype(), DType::BF16 | DType::F16) && crate::ops::policy::current().fp8_quantizes_activations(tokens),
            }
    }
}

/// `gate_up` `[experts, 2 × width, hidden]` (gate rows, then up rows) in the grouped kernels'
/// layout: chunk c of gate's rows, then chunk c of up's, for every chunk.
fn interleaved(gate_up: &Tensor, width: usize) -> Result<Tensor> {
    let (e, two_w, h) = gate_up.dims3()?;
    gate_up.reshape((e, 2, width / CHUNK, CHUNK, h))?.transpose(1, 2)?.contiguous()?.reshape((e, two_w, h))
}

/// Whether `device` runs the grouped FP8 kernels.
fn fp8_kernels_serve(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    return super::cuda::fp8_experts_serve(device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Whether the grouped kernels run experts of this shape on `device` in `dtype`.
fn kernels_serve(device: &Device, dtype: DType, width: usize, hidden: usize) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && width % CHUNK == 0 && hidden % 8 == 0 && hidden <= 8192
}

/// A router's weights `[experts, hidden]` in f32 (routing runs in f32 whatever the model
/// dtype), with, where the device kernel uses them, the same weights split into three bf16
/// parts `[experts, 3 · hidden]` (hi, mid, lo side by side: hi + mid + lo carries the f32
/// mantissa, and a bf16 × bf16 product is exact in f32).
#[derive(Debug, Clone)]
pub struct RouterWeights {
    weight: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    split: Option<Tensor>,
}

impl RouterWeights {
    /// Bytes of the router's weight as the checkpoint gives it (f32; the split copy kept for
    /// the device kernel is a working copy, not counted).
    pub fn bytes(&self) -> u64 {
        crate::ops::bytes_of(&self.weight)
    }

    pub fn new(weight: Tensor) -> Result<Self> {
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        let (e, h) = weight.dims2()?;
        let split = (cfg!(feature = "cuda") && weight.device().is_cuda() && h > 0 && h % 64 == 0 && e > 0 && e % 8 == 0)
            .then(|| -> Result<Tensor> {
                let hi = weight.to_dtype(DType::BF16)?;
                let rest = (&weight - hi.to_dtype(DType::F32)?)?;
                let mid = rest.to_dtype(DType::BF16)?;
                let lo = (rest - mid.to_dtype(DType::F32)?)?.to_dtype(DType::BF16)?;
                Tensor::cat(&[hi, mid, lo], 1)
            })
            .transpose()?;
        Ok(Self { weight, split })
    }

    /// The f32 logits `[tokens, experts]` of `x` `[tokens, hidden]`.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(split) = self.split.as_ref().filter(|_| x.device().is_cuda() && x.dtype() == DType::BF16) {
            return super::cuda::router_logits(x, split);
        }
        self.logits_reference(x)
    }

    /// [`RouterWeights::logits`] as an f32 matmul (its CPU path and reference).
    pub fn logits_reference(&self, x: &Tensor) -> Result<Tensor> {
        x.to_dtype(DType::F32)?.matmul(&self.weight.t()?)
    }
}

/// The chosen experts `[tokens, top_k]` u32 (best first) and their weights `[tokens, top_k]`
/// f32 of each token, from the f32 router `logits` `[tokens, experts]` and the optional
/// selection-only bias `[experts]` f32. Both on the device of `logits`.
pub fn route(logits: &Tensor, bias: Option<&Tensor>, arch: &RouterArch) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return super::cuda::moe_route(logits, bias, arch);
    }
    route_reference(logits, bias, arch)
}

/// [`route`] on the host with [`RouterArch::route`] (its CPU path and reference).
pub fn route_reference(logits: &Tensor, bias: Option<&Tensor>, arch: &RouterArch) -> Result<(Tensor, Tensor)> {
    let (t, e) = logits.dims2()?;
    if let Some(reason) = arch.shape_error() {
        candle_core::bail!("route: {reason}");
    }
    if e != arch.num_experts {
        candle_core::bail!("route: {e} logits per token for {} experts", arch.num_experts);
    }
    let bias = bias.map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>()).transpose()?;
    if bias.as_ref().is_some_and(|b| b.len() != e) {
        candle_core::bail!("route: expert bias of another length than {e}");
    }
    let (mut ids, mut weights) = (Vec::with_capacity(t * arch.top_k), Vec::with_capacity(t * arch.top_k));
    for z in logits.to_dtype(DType::F32)?.to_vec2::<f32>()? {
        for (e, w) in arch.route(&z, bias.as_deref()) {
            ids.push(e as u32);
            weights.push(w);
        }
    }
    let dev = logits.device();
    Ok((Tensor::from_vec(ids, (t, arch.top_k), dev)?, Tensor::from_vec(weights, (t, arch.top_k), dev)?))
}

/// `Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) (+ shared[t])` for every token of `x`
/// `[tokens, hidden]`, summed in f32 and cast to `x`'s dtype once; `ids` / `weights` as
/// [`route`] returns them, `shared` `[tokens, hidden]` (the shared experts' output) added to the
/// f32 sum before the cast.
/// An id past the experts (the device router's "none chosen" for NaN scores) contributes
/// nothing on CUDA and is an error in the composition. With `residual` `[tokens, hidden]` the
/// result is `residual + ` that (the pre-norm block's residual add, one pass fewer on CUDA).
pub fn moe_experts(x: &Tensor, ids: &Tensor, weights: &Tensor, experts: &StackedExperts, shared: Option<&Tensor>, residual: Option<&Tensor>) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if experts.grouped(x) {
        return super::cuda::moe_experts(x, ids, weights, experts, shared, residual);
    }
    moe_experts_reference(x, ids, weights, experts, shared, residual)
}

/// [`moe_experts`] on one rank of an expert-parallel group, which holds experts
/// `first..first + experts.num_experts()` of the model: routes to those experts count (with
/// their weights), routes to other ranks' experts contribute nothing here (their ranks add
/// them). `ids` are the model's expert ids.
pub fn moe_experts_local(
    x: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    experts: &StackedExperts,
    first: u32,
    shared: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if experts.grouped(x) {
        // The kernels skip an id past the experts: another rank's experts are mapped there.
        let n = experts.num_experts() as f64;
        let shifted = (ids.to_dtype(DType::F32)? - first as f64)?;
        let mine = shifted.ge(0.0)?.mul(&shifted.lt(n)?)?;
        let local = mine.where_cond(&shifted, &shifted.ones_like()?.affine(0.0, n)?)?.to_dtype(DType::U32)?;
        return super::cuda::moe_experts(x, &local, weights, experts, shared, residual);
    }
    experts_composed(x, ids, weights, experts, Some(first), shared, residual)
}

/// The composition of candle ops behind [`moe_experts`] (its CPU path and reference): each
/// chosen expert once over its tokens, their weighted outputs scattered into the tokens' rows
/// with one f32 `index_add`.
pub fn moe_experts_reference(
    x: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    experts: &StackedExperts,
    shared: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    experts_composed(x, ids, weights, experts, None, shared, residual)
}

/// The composition; with `first` (expert parallelism) the experts are the model's
/// `first..first + n` and routes to any other expert are skipped.
fn experts_composed(
    x: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    experts: &StackedExperts,
    first: Option<u32>,
    shared: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (t, h) = x.dims2()?;
    let n = experts.num_experts();
    let ids = ids.to_vec2::<u32>()?;
    let ws = weights.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    if ids.len() != t || ws.len() != t {
        candle_core::bail!("moe_experts: routes for {} / {} tokens, not {t}", ids.len(), ws.len());
    }
    let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n];
    for (tok, (ids, ws)) in ids.iter().zip(&ws).enumerate() {
        for (&e, &w) in ids.iter().zip(ws) {
            let e = match first {
                None => e,
                Some(first) if e >= first && e - first < n as u32 => e - first,
                Some(_) => continue,
            };
            let Some(slot) = by_expert.get_mut(e as usize) else {
                candle_core::bail!("moe_experts: expert {e} of {n}");
            };
            slot.0.push(tok as u32);
            slot.1.push(w);
        }
    }
    let (mut rows, mut row_weights, mut parts) = (Vec::new(), Vec::new(), Vec::new());
    for (e, (toks, ws)) in by_expert.into_iter().enumerate().filter(|(_, (toks, _))| !toks.is_empty()) {
        let xe = x.index_select(&Tensor::new(toks.as_slice(), x.device())?, 0)?;
        let y = experts.expert_mlp(e, &xe, t)?;
        parts.push(y.to_dtype(DType::F32)?);
        rows.extend(toks);
        row_weights.extend(ws);
    }
    let mut out = Tensor::zeros((t, h), DType::F32, x.device())?;
    if !parts.is_empty() {
        let k = rows.len();
        let y = Tensor::cat(&parts, 0)?.broadcast_mul(&Tensor::from_vec(row_weights, (k, 1), x.device())?)?;
        out = out.index_add(&Tensor::from_vec(rows, k, x.device())?, &y, 0)?;
    }
    // The shared experts join the f32 sum before the one cast back (the released LLaDA2.0 code
    // casts the routed sum first: equal in f32, closer to exact in bf16).
    if let Some(shared) = shared {
        out = (out + shared.to_dtype(DType::F32)?)?;
    }
    let out = out.to_dtype(x.dtype())?;
    match residual {
        Some(r) => r + out,
        None => Ok(out),
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
        for bad in [
            llada2(8, 2, 16, 4),
            llada2(9, 2, 4, 2),
            llada2(8, 5, 4, 2),
            llada2(8, 0, 4, 2),
            llada2(8, 2, 0, 1),
            llada2(8, 2, 4, 5),
            llada2(8, 2, 2, usize::MAX),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_shapes_and_non_finite_logits_route_without_panicking() {
        let r = llada2(8, 2, 4, 2);
        assert!(r.route(&[0.0; 7], None).is_empty(), "fewer logits than experts");
        assert!(r.route(&[0.0; 8], Some(&[0.0; 3])).is_empty(), "a short bias");
        assert!(llada2(8, 2, 16, 4).route(&[0.0; 8], None).is_empty(), "more groups than experts");
        let nan = r.route(&[f32::NAN; 8], None);
        assert_eq!(nan.len(), 2);
        let logits = Tensor::new(&[[0f32; 8]], &Device::Cpu).unwrap();
        assert!(route_reference(&logits, None, &llada2(8, 2, 16, 4)).is_err());
        assert!(route_reference(&logits, None, &llada2(16, 2, 4, 2)).is_err(), "8 logits for 16 experts");
        let (ids, w) = route_reference(&logits, None, &r).unwrap();
        assert_eq!((ids.dims(), w.dims()), ([1, 2].as_slice(), [1, 2].as_slice()));
    }

    #[test]
    fn softmax_routing_without_groups() {
        let r = RouterArch { num_experts: 3, top_k: 1, n_group: 1, topk_group: 1, scoring: Scoring::Softmax, norm_topk: false, scale: 1.0 };
        let got = r.route(&[0.0, 0.0, (2.0f32).ln()], None);
        assert_eq!(got[0].0, 2);
        assert!((got[0].1 - 0.5).abs() < 1e-6);
    }

    /// FP8 experts stored in the grouped kernels' interleaved layout (gate and up rows in
    /// chunks) compose to exactly what the plain layout gives, under every FP8 policy and on
    /// both sides of the W8A8 choice (which is the launch's, not each expert's).
    #[test]
    fn fp8_experts_in_the_kernels_layout_compose_as_in_the_plain_one() {
        use crate::ops::policy::{with_kernels, Fp8Kernels, KernelPolicy};
        use crate::quant::Quantization;
        let dev = Device::Cpu;
        // Eight experts, top 2: about 10 of 40 tokens an expert, under the 16 of `by-shape`.
        let (e, w, h) = (8, 32, 48);
        let gate_up = Tensor::randn(0f32, 0.2, (e, 2 * w, h), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let down = Tensor::randn(0f32, 0.2, (e, h, w), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let plain = StackedExperts::quantized(gate_up.clone(), down.clone(), Quantization::Fp8).unwrap();
        assert!(!plain.kernel_layout, "no grouped kernels on the CPU");
        let mut laid = StackedExperts::quantized(interleaved(&gate_up, w).unwrap(), down, Quantization::Fp8).unwrap();
        laid.kernel_layout = true;
        let arch = RouterArch { num_experts: e, top_k: 2, n_group: 1, topk_group: 1, scoring: Scoring::Softmax, norm_topk: true, scale: 1.0 };
        for tokens in [3, 40] {
            let x = Tensor::randn(0f32, 1.0, (tokens, h), &dev).unwrap().to_dtype(DType::BF16).unwrap();
            let logits = Tensor::randn(0f32, 1.0, (tokens, e), &dev).unwrap();
            let (ids, weights) = route_reference(&logits, None, &arch).unwrap();
            let max_diff = |a: &Tensor, b: &Tensor| {
                (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
            };
            let mut by_policy = Vec::new();
            for fp8 in [Fp8Kernels::Dequantize, Fp8Kernels::W8A8, Fp8Kernels::ByShape] {
                let policy = KernelPolicy { fp8, ..Default::default() };
                let run = |s: &StackedExperts| with_kernels(policy, || moe_experts_reference(&x, &ids, &weights, s, None, None).unwrap()).0;
                let (a, b) = (run(&plain), run(&laid));
                assert_eq!(max_diff(&a, &b), 0.0, "{tokens} tokens, {fp8:?}");
                by_policy.push(a);
            }
            // By shape, the launch decides for every expert: more tokens than the policy's weight-only
            // rows quantize the
            // activations of every expert (even one with a few of them), as W8A8 does; a few
            // tokens quantize none (weight-only, dequantizing on the CPU).
            let (dequantize, w8a8, by_shape) = (&by_policy[0], &by_policy[1], &by_policy[2]);
            let same_as = if tokens > crate::ops::policy::FP8_WEIGHT_ONLY_ROWS { w8a8 } else { dequantize };
            assert_eq!(max_diff(by_shape, same_as), 0.0, "{tokens} tokens by shape");
            assert!(max_diff(w8a8, dequantize) > 0.0, "{tokens} tokens: W8A8 quantizes the activations");
        }
    }
}
