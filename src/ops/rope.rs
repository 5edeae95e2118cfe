//! Rotary position embeddings. cos/sin are computed per launch from the packed positions (one
//! kernel on CUDA, a small op chain elsewhere, shared by every layer), so no table bounded by the
//! context length is kept.

use candle_core::{DType, Device, Result, Tensor};

/// The frequencies of one model's RoPE and the per-launch cos/sin built from them.
#[derive(Debug, Clone)]
pub struct RopeTable {
    inv_freq: Tensor, // [1, head_dim / 2] f32
    dtype: DType,
}

/// cos/sin for the tokens of one launch, `[tokens, head_dim / 2]` each.
#[derive(Debug, Clone)]
pub struct RopeAngles {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f64, dtype: DType, device: &Device) -> Result<Self> {
        Self::partial(head_dim, head_dim, theta, dtype, device)
    }

    /// RoPE over the first `rotary_dim` dims of each head, laid out as full-width split-half
    /// pairs: pair j < rotary_dim / 2 turns at `theta^(-2j / rotary_dim)`, the other pairs not at
    /// all (their angle is 0). The model permutes its q/k dims to match (LLaDA2.0).
    pub fn partial(head_dim: usize, rotary_dim: usize, theta: f64, dtype: DType, device: &Device) -> Result<Self> {
        let inv: Vec<f32> =
            (0..head_dim / 2).map(|i| if 2 * i < rotary_dim { 1.0 / theta.powf(2.0 * i as f64 / rotary_dim as f64) as f32 } else { 0.0 }).collect();
        Ok(Self { inv_freq: Tensor::from_vec(inv, (1, head_dim / 2), device)?, dtype })
    }

    /// Angles for absolute `positions` (`[tokens]` u32), computed in f32 like the reference
    /// implementations, then cast to the model dtype. On CUDA one kernel
    /// (`cuda::rope_angles`: the same bits as [`Self::angles_reference`] there) — every decode
    /// launch computes them, and the composition is six launches.
    pub fn angles(&self, positions: &Tensor) -> Result<RopeAngles> {
        #[cfg(feature = "cuda")]
        if positions.device().is_cuda() && positions.dtype() == DType::U32 && super::is_float(self.dtype) {
            let (cos, sin) = super::cuda::rope_angles(positions, &self.inv_freq, self.dtype)?;
            return Ok(RopeAngles { cos, sin });
        }
        self.angles_reference(positions)
    }

    /// [`Self::angles`] written into `cos` and `sin` (`[T, D/2]`, contiguous; a decode arena's),
    /// returned as the launch's angles.
    pub fn angles_into(&self, positions: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<RopeAngles> {
        #[cfg(feature = "cuda")]
        if positions.device().is_cuda() && positions.dtype() == DType::U32 && super::is_float(self.dtype) {
            super::cuda::rope_angles_into(positions, &self.inv_freq, cos, sin)?;
            return Ok(RopeAngles { cos: cos.clone(), sin: sin.clone() });
        }
        let a = self.angles_reference(positions)?;
        super::into::copy_into(cos, &a.cos)?;
        super::into::copy_into(sin, &a.sin)?;
        Ok(RopeAngles { cos: cos.clone(), sin: sin.clone() })
    }

    /// The composition of candle ops behind [`Self::angles`] (its CPU path).
    pub fn angles_reference(&self, positions: &Tensor) -> Result<RopeAngles> {
        let pos = positions.to_dtype(DType::F32)?.unsqueeze(1)?;
        let freqs = pos.broadcast_mul(&self.inv_freq)?;
        Ok(RopeAngles { cos: freqs.cos()?.to_dtype(self.dtype)?.contiguous()?, sin: freqs.sin()?.to_dtype(self.dtype)?.contiguous()? })
    }
}

impl RopeAngles {
    /// Split-half ("rotate_half", Llama/Ouro) rotation of `x: [tokens, heads, head_dim]`.
    pub fn apply_split_half(&self, x: &Tensor) -> Result<Tensor> {
        let x4 = x.contiguous()?.unsqueeze(0)?;
        candle_nn::rotary_emb::rope_thd(&x4, &self.cos, &self.sin)?.squeeze(0)
    }
}

impl RopeAngles {
    /// Interleaved-pair rotation (dims 2i, 2i+1; Huginn) of `x: [tokens, heads, head_dim]`.
    pub fn apply_interleaved(&self, x: &Tensor) -> Result<Tensor> {
        let bhtd = x.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        candle_nn::rotary_emb::rope_i(&bhtd, &self.cos, &self.sin)?.squeeze(0)?.transpose(0, 1)?.contiguous()
    }
}
