//! A linear layer `y = x Wᵀ (+ b)` whose weight is stored dense or in FP8. Every model's
//! projections and MLPs are one of these, so quantizing a model changes what it stores, not
//! the code that runs it.
//!
//! An FP8 layer multiplies as the engine's [`Fp8Kernels`] policy says. Dequantizing the weight
//! to the activations' dtype (each value times its scale, in f32) and running the dense matmul
//! is the reference of the weight-only kernel and what runs where no kernel serves the shape.
//! Under W8A8 the activations are quantized a row at a time as well; on the CPU (and wherever
//! the FP8 GEMM does not serve a shape) that is computed as quantize, dequantize, f32 matmul:
//! the reference of the GEMM, so the policy, not the device, decides the numerics.

#[cfg(feature = "cuda")]
use crate::ops::policy::count;
use crate::ops::policy::{current, Fp8Kernels};
use crate::quant::{Fp8Weight, Quantization};
use candle_core::{DType, Module, Result, Tensor};
use std::borrow::Cow;

/// Dynamic shared memory of the pipelined weight-only FP8 kernel (`fp8_linear_mma_pipe_*`):
/// `PIPE_SMEM_BYTES` in `kernels/fp8.cu` (48 KB, the most a launch gets without opting in), its
/// 8 warps' rings of 1 KB chunks and a tile's partial sums after them. A test holds the two equal.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const FP8_PIPE_SMEM_BYTES: u32 = 8 * 6 * 1024;

/// A linear layer's weight `[out, in]`.
#[derive(Debug, Clone)]
pub enum LinearWeight {
    Dense(Tensor),
    Fp8(Fp8Weight),
}

/// A linear layer: weight `[out, in]`, optional bias `[out]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Tensor>,
    /// The dtype an FP8 weight dequantizes to when handed out whole ([`Linear::weight`]).
    dtype: DType,
}

impl Linear {
    /// A dense layer: the weight as given.
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        let dtype = weight.dtype();
        Self { weight: LinearWeight::Dense(weight), bias, dtype }
    }

    /// `weight` stored as `q` says; an FP8 layer dequantizes to `weight`'s dtype.
    pub fn quantized(weight: Tensor, bias: Option<Tensor>, q: Quantization) -> Result<Self> {
        match q {
            Quantization::None => Ok(Self::dense(weight, bias)),
            Quantization::Fp8 => {
                let dtype = weight.dtype();
                Self::fp8(Fp8Weight::quantize(&weight)?, bias, dtype)
            }
        }
    }

    /// A layer over an FP8 weight (a checkpoint stored in FP8), computing in `dtype`. On CUDA
    /// the device's FP8 GEMM state is made here, at load, before any graph is captured.
    pub fn fp8(weight: Fp8Weight, bias: Option<Tensor>, dtype: DType) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = weight.data().device() {
            super::cuda::prepare_fp8_gemm(dev)?;
        }
        Ok(Self { weight: LinearWeight::Fp8(weight), bias, dtype })
    }

    pub fn stored(&self) -> &LinearWeight {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The weight `[out, in]` in the layer's compute dtype: the dense tensor itself, or the
    /// FP8 weight dequantized (a new tensor each call), for the fused ops that take a weight.
    pub fn weight(&self) -> Result<Cow<'_, Tensor>> {
        match &self.weight {
            LinearWeight::Dense(w) => Ok(Cow::Borrowed(w)),
            LinearWeight::Fp8(w) => Ok(Cow::Owned(w.dequantize(self.dtype)?)),
        }
    }

    /// Bytes the weight occupies (what a step that multiplies by it reads).
    pub fn weight_bytes(&self) -> u64 {
        match &self.weight {
            LinearWeight::Dense(w) => bytes_of(w),
            LinearWeight::Fp8(w) => {
                let (out, inp) = w.dims();
                let scales = match w.scale() {
                    crate::quant::Fp8Scale::PerChannel(s) | crate::quant::Fp8Scale::Block { scale: s, .. } => s.elem_count() * 4,
                };
                (out * inp + scales) as u64
            }
        }
    }

    /// The layer over the weight rows `rows` (in that order), stored the same way: a dense
    /// weight's rows picked, an FP8 weight's rows with their scales (block-scaled rows only
    /// within their own tile of rows, so every row keeps its scale). The bias is not permuted.
    pub fn select_rows(&self, rows: &[u32]) -> Result<Self> {
        let dev = match &self.weight {
            LinearWeight::Dense(w) => w.device().clone(),
            LinearWeight::Fp8(w) => w.data().device().clone(),
        };
        let idx = Tensor::from_vec(rows.to_vec(), rows.len(), &dev)?;
        let weight = match &self.weight {
            LinearWeight::Dense(w) => LinearWeight::Dense(w.index_select(&idx, 0)?),
            LinearWeight::Fp8(w) => {
                let data = crate::quant::fp8::rearranged(w.data(), |d| d.index_select(&idx.to_device(d.device())?, 0))?;
                let scale = match w.scale() {
                    crate::quant::Fp8Scale::PerChannel(s) => crate::quant::Fp8Scale::PerChannel(s.index_select(&idx, 0)?),
                    crate::quant::Fp8Scale::Block { scale, block } => {
                        if rows.iter().enumerate().any(|(i, &r)| r as usize / block.0 != i / block.0) {
                            candle_core::bail!("a row permutation across {}-row scale tiles of an FP8 weight", block.0);
                        }
                        crate::quant::Fp8Scale::Block { scale: scale.clone(), block: *block }
                    }
                };
                LinearWeight::Fp8(Fp8Weight::from_parts(data, scale)?)
            }
        };
        Ok(Self { weight, bias: self.bias.clone(), dtype: self.dtype })
    }

    /// The layer over the output rows in `ranges`, in that order (a rank's share of a
    /// column-parallel layer: its heads of q, k and v; its columns of gate and up). The bias
    /// follows its rows; an FP8 weight keeps each row's scale, and block scales need ranges on
    /// whole tiles.
    pub fn output_rows(&self, ranges: &[std::ops::Range<usize>]) -> Result<Self> {
        let pick = |t: &Tensor| -> Result<Tensor> { Tensor::cat(&ranges.iter().map(|r| t.narrow(0, r.start, r.len())).collect::<Result<Vec<_>>>()?, 0) };
        let weight = match &self.weight {
            LinearWeight::Dense(w) => LinearWeight::Dense(pick(w)?),
            LinearWeight::Fp8(w) => {
                let scale = match w.scale() {
                    crate::quant::Fp8Scale::PerChannel(s) => crate::quant::Fp8Scale::PerChannel(pick(s)?),
                    crate::quant::Fp8Scale::Block { scale, block } => {
                        let last = ranges.len().saturating_sub(1);
                        if ranges.iter().enumerate().any(|(i, r)| r.start % block.0 != 0 || (r.end % block.0 != 0 && !(i == last && r.end == w.dims().0))) {
                            candle_core::bail!("output rows {ranges:?} cut {}-row scale tiles", block.0);
                        }
                        let tiles: Vec<_> = ranges.iter().map(|r| r.start / block.0..r.end.div_ceil(block.0)).collect();
                        let s = Tensor::cat(&tiles.iter().map(|t| scale.narrow(0, t.start, t.len())).collect::<Result<Vec<_>>>()?, 0)?;
                        crate::quant::Fp8Scale::Block { scale: s, block: *block }
                    }
                };
                LinearWeight::Fp8(Fp8Weight::from_parts(pick(w.data())?.contiguous()?, scale)?)
            }
        };
        let bias = self.bias.as_ref().map(pick).transpose()?;
        Ok(Self { weight, bias, dtype: self.dtype })
    }

    /// The layer over the input columns `range` (a rank's share of a row-parallel layer,
    /// whose partial outputs the ranks sum). The bias, added once to the sum, stays with the
    /// first share. Block scales need the range on whole tiles.
    pub fn input_columns(&self, range: std::ops::Range<usize>) -> Result<Self> {
        let weight = match &self.weight {
            LinearWeight::Dense(w) => LinearWeight::Dense(w.narrow(1, range.start, range.len())?.contiguous()?),
            LinearWeight::Fp8(w) => {
                let data = crate::quant::fp8::rearranged(w.data(), |d| d.narrow(1, range.start, range.len())?.contiguous())?;
                let scale = match w.scale() {
                    crate::quant::Fp8Scale::PerChannel(s) => crate::quant::Fp8Scale::PerChannel(s.clone()),
                    crate::quant::Fp8Scale::Block { scale, block } => {
                        if range.start % block.1 != 0 || (range.end % block.1 != 0 && range.end != w.dims().1) {
                            candle_core::bail!("input columns {range:?} cut {}-column scale tiles", block.1);
                        }
                        let (a, b) = (range.start / block.1, range.end.div_ceil(block.1));
                        crate::quant::Fp8Scale::Block { scale: scale.narrow(1, a, b - a)?, block: *block }
                    }
                };
                LinearWeight::Fp8(Fp8Weight::from_parts(data, scale)?)
            }
        };
        let bias = if range.start == 0 { self.bias.clone() } else { None };
        Ok(Self { weight, bias, dtype: self.dtype })
    }

    /// Bytes the layer occupies: its weight as stored and its bias.
    pub fn bytes(&self) -> u64 {
        self.weight_bytes() + self.bias.as_ref().map_or(0, bytes_of)
    }

    /// `x Wᵀ (+ b)`; an FP8 weight multiplies as the policy says ([`fp8_matmul`]).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.weight {
            LinearWeight::Dense(w) => candle_nn::Linear::new(w.clone(), self.bias.clone()).forward(x),
            LinearWeight::Fp8(w) => fp8_matmul(x, w, self.bias.as_ref()),
        }
    }
}

impl Linear {
    /// `add_rms_norm(residual, x Wᵀ, w_x, w_next)`: a projection (no bias) feeding a sandwich
    /// norm (Ouro). Dense, or FP8 under the dequantizing policy: split over k where that pays
    /// (`ops::split_k`); FP8 under an FP8 kernel policy: the weight-only kernel's k slices where
    /// `KernelPolicy::fp8_split_k` cuts them, else [`fp8_matmul`], then the norm.
    pub fn add_rms_norm(&self, residual: &Tensor, x: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
        if let Some(w) = self.fp8_kernels() {
            if let Some(parts) = fp8_partials(x, w)?.filter(|_| residual.rank() == 2) {
                return super::split_k::add_rms_norm_partials(residual, &parts, w_x, w_next, eps);
            }
            return super::add_rms_norm(residual, &fp8_matmul(x, w, None)?, w_x, w_next, eps);
        }
        super::linear_add_rms_norm(residual, x, &*self.weight()?, w_x, w_next, eps)
    }

    /// `residual_add_rms_norm(residual, x Wᵀ, w)`: a projection (no bias) added to the residual
    /// stream before the next norm (Huginn), as [`Linear::add_rms_norm`] chooses.
    pub fn residual_add_rms_norm(&self, residual: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
        if let Some(fp8) = self.fp8_kernels() {
            if let Some(parts) = fp8_partials(x, fp8)?.filter(|_| residual.rank() == 2) {
                return super::split_k::residual_add_rms_norm_partials(residual, &parts, w, eps);
            }
            return super::residual_add_rms_norm(residual, &fp8_matmul(x, fp8, None)?, w, eps);
        }
        super::linear_residual_add_rms_norm(residual, x, &*self.weight()?, w, eps)
    }

    /// The FP8 weight, where the policy multiplies FP8 layers with something other than the
    /// dequantized dense matmul.
    fn fp8_kernels(&self) -> Option<&Fp8Weight> {
        match &self.weight {
            LinearWeight::Fp8(w) if current().fp8 != Fp8Kernels::Dequantize => Some(w),
            _ => None,
        }
    }
}

/// `x Wᵀ (+ b)` for an FP8 weight, as the engine's policy says for a launch of this many rows:
/// the weight-only kernel (CUDA, few rows), W8A8 (the FP8 GEMM on CUDA where it serves the
/// shape, its reference elsewhere), or the dense matmul over the dequantized weight.
pub fn fp8_matmul(x: &Tensor, w: &Fp8Weight, bias: Option<&Tensor>) -> Result<Tensor> {
    let rows = x.elem_count() / w.dims().1.max(1);
    fp8_matmul_for(x, w, bias, rows)
}

/// [`fp8_matmul`] as the policy says for a launch of `launch_rows` rows, of which `x` is a part:
/// an expert's tokens are a part of its MoE layer's launch, and the layer's W8A8-or-not choice
/// is made once for all its experts, as the grouped kernels make it.
pub(crate) fn fp8_matmul_for(x: &Tensor, w: &Fp8Weight, bias: Option<&Tensor>, launch_rows: usize) -> Result<Tensor> {
    let policy = current();
    // The quantization is the launch's; the kernel that serves an unquantized part is its own.
    let rows = x.elem_count() / w.dims().1.max(1);
    let quantize = policy.fp8_quantizes_activations(launch_rows);
    if policy.fp8_weight_only(rows) && !quantize {
        #[cfg(feature = "cuda")]
        if let Some(y) = fp8_weight_only(x, w, bias)? {
            return Ok(y);
        }
    }
    if quantize {
        #[cfg(feature = "cuda")]
        if let Some(y) = fp8_w8a8(x, w, bias)? {
            return Ok(y);
        }
        return w8a8_reference(x, w, bias);
    }
    candle_nn::Linear::new(w.dequantize(x.dtype())?, bias.cloned()).forward(x)
}

/// The W8A8 product as its definition: each row of `x` quantized to E4M3 with its own scale
/// ([`Fp8Weight::quantize`]), both operands dequantized, multiplied in f32, rounded to `x`'s
/// dtype; the bias added after. What the CPU computes under W8A8 and what the FP8 GEMM is
/// checked against.
pub fn w8a8_reference(x: &Tensor, w: &Fp8Weight, bias: Option<&Tensor>) -> Result<Tensor> {
    let (n, k) = w.dims();
    let dims = x.dims().to_vec();
    if dims.last() != Some(&k) {
        candle_core::bail!("w8a8: x {dims:?} against a weight [{n}, {k}]");
    }
    let rows = x.elem_count() / k.max(1);
    let xq = Fp8Weight::quantize(&x.reshape((rows, k))?)?;
    let y = xq.dequantize(DType::F32)?.matmul(&w.dequantize(DType::F32)?.t()?)?.to_dtype(x.dtype())?;
    shaped_like(y, bias, x, n)
}

/// A product `[rows, n]` of `x`'s rows with the bias added after its rounding (as candle's
/// Linear adds it), in `x`'s shape with `n` for its last dimension.
fn shaped_like(y: Tensor, bias: Option<&Tensor>, x: &Tensor, n: usize) -> Result<Tensor> {
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    y.reshape(dims)
}

/// `x Wᵀ (+ b)` through the weight-only FP8 kernel where the launch fits it (CUDA, at most 64
/// rows on the tensor-core kernel and 16 on the SIMT one, k a multiple of 16, a scale per output
/// row, or block scales on the tensor-core kernel); `None` where it does not.
#[cfg(feature = "cuda")]
fn fp8_weight_only(x: &Tensor, w: &Fp8Weight, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    let mma = current().fp8_mma;
    let Some((scale, rows)) = weight_only_fit(x, w, mma) else { return Ok(None) };
    let (n, k) = w.dims();
    let y = super::cuda::fp8_linear(&x.reshape((rows, k))?, w.data(), scale, bias, mma)?;
    count(|c| c.fp8_weight_only += 1);
    // The kernel adds the bias itself.
    Ok(Some(shaped_like(y, None, x, n)?))
}

/// Where the weight-only kernel takes `x Wᵀ`: the weight's scales as the kernel reads them, and
/// `x`'s rows.
#[cfg(feature = "cuda")]
fn weight_only_fit<'w>(x: &Tensor, w: &'w Fp8Weight, mma: bool) -> Option<(super::cuda::WeightScale<'w>, usize)> {
    use super::cuda::WeightScale;
    use crate::quant::Fp8Scale;
    let (n, k) = w.dims();
    let scale = match w.scale() {
        Fp8Scale::PerChannel(s) => WeightScale::Rows(s),
        // Block scales on the tensor-core kernel only, whose lanes take 16 columns of one block.
        Fp8Scale::Block { scale, block } if mma && block.1 % 16 == 0 && matches!(x.dtype(), DType::BF16 | DType::F16) => {
            WeightScale::Blocks { scale, block: *block }
        }
        Fp8Scale::Block { .. } => return None,
    };
    let rows = x.elem_count() / k.max(1);
    let fits = x.device().is_cuda()
        && x.rank() >= 1
        && x.dims().last() == Some(&k)
        && k % 16 == 0
        && n > 0
        && (1..=super::cuda::fp8_linear_max_rows(x.dtype(), mma)).contains(&rows)
        && matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32)
        // The kernel's 16-byte loads: a contiguous view must start on a 16-byte boundary (one
        // that is not contiguous is copied, which starts on one).
        && (!x.is_contiguous() || (x.layout().start_offset() * x.dtype().size_in_bytes()) % 16 == 0);
    fits.then_some((scale, rows))
}

/// A weight-only FP8 projection that feeds a norm, as the k slices' f32 partials
/// (`[slices, rows, n]`) where the policy splits it (`KernelPolicy::fp8_split_k`,
/// [`super::split_k::fp8_split_k_plan`]); `None` where it runs whole.
fn fp8_partials(x: &Tensor, w: &Fp8Weight) -> Result<Option<Tensor>> {
    let policy = current();
    let rows = x.elem_count() / w.dims().1.max(1);
    // The partials' norm takes `[rows, n]` operands, as the dense split does.
    if x.rank() != 2 || !(policy.fp8_mma && policy.fp8_weight_only(rows) && !policy.fp8_quantizes_activations(rows)) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    if let Some((scale, rows)) = weight_only_fit(x, w, true) {
        let (n, k) = w.dims();
        let x = x.reshape((rows, k))?;
        if let Some(splits) = super::split_k::fp8_split_k_plan(&x, n) {
            count(|c| {
                c.fp8_weight_only += 1;
                c.fp8_split_k += 1;
            });
            return super::cuda::fp8_linear_partials(&x, w.data(), scale, splits, None).map(Some);
        }
    }
    Ok(None)
}

/// `x Wᵀ (+ b)` through the W8A8 GEMM where it serves the launch (CUDA on sm_90 or later with
/// cuBLASLt 12.9 or later, a float dtype, a scale per output row, n and k multiples of 16);
/// `None` where it does not.
#[cfg(feature = "cuda")]
fn fp8_w8a8(x: &Tensor, w: &Fp8Weight, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    use crate::quant::Fp8Scale;
    let (n, k) = w.dims();
    let Fp8Scale::PerChannel(scale) = w.scale() else { return Ok(None) };
    let rows = x.elem_count() / k.max(1);
    if !(x.device().is_cuda() && x.rank() >= 1 && x.dims().last() == Some(&k) && super::cuda::fp8_gemm_serves(x.dtype(), rows, n, k)) {
        return Ok(None);
    }
    let Some(y) = super::cuda::fp8_w8a8_linear(&x.reshape((rows, k))?, w.data(), scale)? else { return Ok(None) };
    count(|c| c.fp8_w8a8 += 1);
    Ok(Some(shaped_like(y, bias, x, n)?))
}

/// Bytes a tensor occupies.
pub fn bytes_of(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launcher's shared memory for the pipelined kernel is what the kernel's constants
    /// make it (a smaller launch would let the rings overrun), and within the 48 KB a launch
    /// gets without opting in.
    #[test]
    fn the_pipelined_fp8_kernel_gets_the_shared_memory_it_uses() {
        let cu = include_str!("kernels/fp8.cu");
        let constant = |name: &str| -> u32 {
            let decl = format!("constexpr int {name} = ");
            let at = cu.find(&decl).unwrap_or_else(|| panic!("{name} in fp8.cu"));
            let rest = &cu[at + decl.len()..];
            rest[..rest.find(';').unwrap()].trim().parse().unwrap_or_else(|_| panic!("{name} is a literal"))
        };
        assert!(cu.contains("constexpr int PIPE_CHUNK_BYTES = MMA_TILES * 32 * 16;"));
        assert!(cu.contains("constexpr int PIPE_SMEM_BYTES = MMA_WARPS * PIPE_STAGES * PIPE_CHUNK_BYTES;"));
        let bytes = constant("MMA_WARPS") * constant("PIPE_STAGES") * constant("MMA_TILES") * 32 * 16;
        assert_eq!(FP8_PIPE_SMEM_BYTES, bytes);
        const { assert!(FP8_PIPE_SMEM_BYTES <= 48 * 1024) };
    }
    use candle_core::Device;

    #[test]
    fn an_fp8_layer_computes_with_its_dequantized_weight() {
        let dev = Device::Cpu;
        let w = Tensor::new(&[[0.3f32, -1.7, 2.5], [0.01, 0.9, -0.4]], &dev).unwrap();
        let b = Tensor::new(&[0.5f32, -0.25], &dev).unwrap();
        let x = Tensor::new(&[[1.0f32, 2.0, 3.0], [-1.0, 0.5, 0.0]], &dev).unwrap();
        let q = Linear::quantized(w.clone(), Some(b.clone()), Quantization::Fp8).unwrap();
        let deq = q.weight().unwrap().into_owned();
        assert_ne!(deq.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap(), "rounded to E4M3");
        let want = Linear::dense(deq, Some(b.clone())).forward(&x).unwrap();
        assert_eq!(q.forward(&x).unwrap().to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
        // Dense stays as given; FP8 stores a byte a value and a scale a row.
        let d = Linear::quantized(w.clone(), None, Quantization::None).unwrap();
        assert_eq!(d.weight().unwrap().to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        assert_eq!((d.weight_bytes(), q.weight_bytes()), (24, 6 + 8));
    }

    /// A deterministic `[rows, cols]` f32 tensor with values of several magnitudes.
    fn wave(rows: usize, cols: usize, phase: f32) -> Tensor {
        let v: Vec<f32> = (0..rows * cols).map(|i| ((i as f32 * 0.37 + phase).sin() * (1.0 + (i % 7) as f32)).powi(3)).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    #[test]
    fn w8a8_quantizes_each_row_of_the_activations_where_the_policy_says() {
        use crate::ops::{with_kernels, KernelPolicy};
        let (n, k) = (24, 48);
        let layer = Linear::quantized(wave(n, k, 0.3), None, Quantization::Fp8).unwrap();
        let LinearWeight::Fp8(w) = layer.stored() else { panic!("fp8") };
        let wd = w.dequantize(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let policy = |fp8| KernelPolicy { fp8, ..Default::default() };
        for rows in [1, 16, 17, 40] {
            let x = wave(rows, k, 1.1);
            // The definition, by hand: a row's scale is its largest magnitude times f32(1/448);
            // each value divided by it, rounded to E4M3, multiplied back; f32 sums.
            let want: Vec<Vec<f32>> = x
                .to_vec2::<f32>()
                .unwrap()
                .iter()
                .map(|row| {
                    let m = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let s = m * (1.0 / 448.0f64) as f32;
                    let scaled: Vec<f32> = row.iter().map(|v| (v / s).clamp(-448.0, 448.0)).collect();
                    let e4m3 = Tensor::new(scaled, &Device::Cpu).unwrap().to_dtype(DType::F8E4M3).unwrap().to_dtype(DType::F32).unwrap();
                    let q: Vec<f32> = e4m3.to_vec1::<f32>().unwrap().iter().map(|v| v * s).collect();
                    wd.iter().map(|wr| q.iter().zip(wr).map(|(a, b)| a * b).sum()).collect()
                })
                .collect();
            let dense = Linear::dense(w.dequantize(DType::F32).unwrap(), None).forward(&x).unwrap();
            let close = |t: &Tensor, what: &str| {
                for (gr, wr) in t.to_vec2::<f32>().unwrap().iter().zip(&want) {
                    for (g, e) in gr.iter().zip(wr) {
                        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{rows} rows, {what}: {g} vs {e}");
                    }
                }
            };
            let (w8a8, counts) = with_kernels(policy(Fp8Kernels::W8A8), || layer.forward(&x).unwrap());
            close(&w8a8, "w8a8");
            assert_eq!(counts.fp8_w8a8, 0, "no FP8 GEMM on the CPU: the reference ran");
            assert!((&w8a8 - &dense).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0, "{rows} rows: activations rounded");
            // By shape: the weight-only numerics (the dequantized weight) up to the policy's rows, W8A8 above.
            let (by_shape, _) = with_kernels(policy(Fp8Kernels::ByShape), || layer.forward(&x).unwrap());
            let expected = if rows <= crate::ops::policy::FP8_WEIGHT_ONLY_ROWS { &dense } else { &w8a8 };
            assert_eq!(by_shape.to_vec2::<f32>().unwrap(), expected.to_vec2::<f32>().unwrap(), "{rows} rows by shape");
            let (weight_only, _) = with_kernels(policy(Fp8Kernels::WeightOnly), || layer.forward(&x).unwrap());
            assert_eq!(weight_only.to_vec2::<f32>().unwrap(), dense.to_vec2::<f32>().unwrap(), "{rows} rows weight-only on the CPU");
            // The fused norm takes the same product.
            let (res, wn) = (wave(rows, n, 2.0), Tensor::ones(n, DType::F32, &Device::Cpu).unwrap());
            let ((h, _), _) = with_kernels(policy(Fp8Kernels::W8A8), || layer.add_rms_norm(&res, &x, &wn, &wn, 1e-6).unwrap());
            let (h_want, _) = crate::ops::add_rms_norm(&res, &w8a8, &wn, &wn, 1e-6).unwrap();
            assert_eq!(h.to_vec2::<f32>().unwrap(), h_want.to_vec2::<f32>().unwrap(), "{rows} rows add_rms_norm");
        }
    }
}
