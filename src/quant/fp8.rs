//! FP8 (E4M3) weights: quantization with one scale per output channel, the 128 × 128 block
//! scales some checkpoints ship, and dequantization — the reference every FP8 path is checked
//! against (compute in f32 on the dequantized weight).

use candle_core::{DType, Result, Tensor, D};

/// The largest finite E4M3 value: a row's scale maps its largest magnitude here.
pub const E4M3_MAX: f32 = 448.0;

// candle 0.11's CUDA kernels for F8E4M3 (casts, index_select, strided copies) are looked up
// under names its PTX does not have (`cast_f8e4m3_f32` against `cast_f8_e4m3_f32`). On CUDA the
// casts run our kernels (`kernels/fp8.cu`) and the load-time rearrangements run on the host.

/// f32 `t`, already within ±448, rounded to E4M3 (ties to even).
fn to_e4m3(t: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        return crate::ops::cuda::e4m3_from_f32(t);
    }
    t.to_dtype(DType::F8E4M3)
}

/// E4M3 `q` in `dtype`, each row of its last dimension times its f32 scale where `row_scale`
/// (one a row) is given: `dtype(e4m3 · scale)`, the product in f32.
pub(crate) fn e4m3_to(q: &Tensor, row_scale: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::ops::cuda::e4m3_to(q, row_scale, dtype);
    }
    let w = q.to_dtype(DType::F32)?;
    match row_scale {
        Some(s) => w.broadcast_mul(&s.unsqueeze(s.rank())?)?.to_dtype(dtype),
        None => w.to_dtype(dtype),
    }
}

/// `f` (an index_select, a strided copy) applied to E4M3 `data`; on CUDA, on a host copy, the
/// result moved back (load time only).
pub(crate) fn rearranged(data: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if data.device().is_cuda() {
        return f(&data.to_device(&candle_core::Device::Cpu)?)?.to_device(data.device());
    }
    f(data)
}

/// How an FP8 weight `[out, in]` is scaled back: `w ≈ data × scale`.
#[derive(Debug, Clone)]
pub enum Fp8Scale {
    /// One f32 scale per output row: `[out]`.
    PerChannel(Tensor),
    /// One f32 scale per `block.0 × block.1` tile (the last tiles may be partial):
    /// `[ceil(out / block.0), ceil(in / block.1)]`.
    Block { scale: Tensor, block: (usize, usize) },
}

/// A linear layer's weight `[out, in]` in E4M3, with its scales.
#[derive(Debug, Clone)]
pub struct Fp8Weight {
    data: Tensor,
    scale: Fp8Scale,
}

impl Fp8Weight {
    /// Quantizes `w` `[out, in]` with one scale per row: the row's largest magnitude ÷ 448
    /// (1 for an all-zero row), each value divided by it and rounded to the nearest E4M3.
    pub fn quantize(w: &Tensor) -> Result<Self> {
        let w = w.to_dtype(DType::F32)?;
        let amax = w.abs()?.max_keepdim(D::Minus1)?;
        // An all-zero row keeps scale 1: no division by zero, and it dequantizes to zeros.
        let zero = amax.eq(0f64)?;
        let scale = zero.where_cond(&amax.ones_like()?, &(amax / E4M3_MAX as f64)?)?;
        let data = to_e4m3(&w.broadcast_div(&scale)?.clamp(-E4M3_MAX, E4M3_MAX)?)?;
        Ok(Self { data, scale: Fp8Scale::PerChannel(scale.squeeze(1)?) })
    }

    /// An FP8 weight as a checkpoint stores it: `data` `[out, in]` in E4M3 and its scales,
    /// checked against each other.
    pub fn from_parts(data: Tensor, scale: Fp8Scale) -> Result<Self> {
        let (out, inp) = data.dims2()?;
        if data.dtype() != DType::F8E4M3 {
            candle_core::bail!("an FP8 weight is stored as F8E4M3, not {:?}", data.dtype());
        }
        let ok = match &scale {
            Fp8Scale::PerChannel(s) => s.dims() == [out],
            Fp8Scale::Block { scale, block: (bo, bi) } => *bo > 0 && *bi > 0 && scale.dims() == [out.div_ceil(*bo), inp.div_ceil(*bi)],
        };
        if !ok {
            let dims = match &scale {
                Fp8Scale::PerChannel(s) | Fp8Scale::Block { scale: s, .. } => s.dims().to_vec(),
            };
            candle_core::bail!("FP8 scales {dims:?} do not fit a weight of {:?}", data.dims());
        }
        let scale = match scale {
            Fp8Scale::PerChannel(s) => Fp8Scale::PerChannel(s.to_dtype(DType::F32)?),
            Fp8Scale::Block { scale, block } => Fp8Scale::Block { scale: scale.to_dtype(DType::F32)?, block },
        };
        Ok(Self { data, scale })
    }

    /// `[out, in]`.
    pub fn dims(&self) -> (usize, usize) {
        let d = self.data.dims();
        (d[0], d[1])
    }

    /// The same weight on `device`.
    pub fn to_device(&self, device: &candle_core::Device) -> Result<Self> {
        let scale = match &self.scale {
            Fp8Scale::PerChannel(s) => Fp8Scale::PerChannel(s.to_device(device)?),
            Fp8Scale::Block { scale, block } => Fp8Scale::Block { scale: scale.to_device(device)?, block: *block },
        };
        Ok(Self { data: self.data.to_device(device)?, scale })
    }

    /// The E4M3 values.
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    pub fn scale(&self) -> &Fp8Scale {
        &self.scale
    }

    /// The weight the FP8 values stand for, in `dtype`: each value × its scale, in f32.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let w = match &self.scale {
            Fp8Scale::PerChannel(s) => return e4m3_to(&self.data, Some(s), dtype),
            Fp8Scale::Block { scale, block: (bo, bi) } => {
                let w = e4m3_to(&self.data, None, DType::F32)?;
                let (out, inp) = self.dims();
                // Each weight's tile scale, picked per row and per column: no larger than the
                // weight whatever the block (a block may exceed the weight's dimensions).
                let (r, c) = scale.dims2()?;
                if out.div_ceil(*bo) != r || inp.div_ceil(*bi) != c {
                    candle_core::bail!(
                        "FP8 weight [{out}, {inp}] in {bo}×{bi} blocks needs [{}, {}] scales, not [{r}, {c}]",
                        out.div_ceil(*bo),
                        inp.div_ceil(*bi)
                    );
                }
                let tiles = |n: usize, b: usize| Tensor::from_vec((0..n).map(|i| (i / b) as u32).collect::<Vec<_>>(), n, scale.device());
                let s = scale.index_select(&tiles(out, *bo)?, 0)?.index_select(&tiles(inp, *bi)?, 1)?;
                w.mul(&s)?
            }
        };
        w.to_dtype(dtype)
    }

    /// The weights of several layers that read the same input, one after another along the
    /// output rows (q, k and v; gate and up), so they run as one matmul. Block-scaled parts
    /// must hold whole tiles of rows, but for the last.
    pub fn cat_rows(parts: &[Fp8Weight]) -> Result<Self> {
        let data = Tensor::cat(&parts.iter().map(|p| p.data.clone()).collect::<Vec<_>>(), 0)?;
        let scale = match parts.first().map(|p| &p.scale) {
            Some(Fp8Scale::PerChannel(_)) => {
                let scales = parts.iter().map(|p| match &p.scale {
                    Fp8Scale::PerChannel(s) => Ok(s.clone()),
                    Fp8Scale::Block { .. } => candle_core::bail!("cannot join per-channel and block-scaled FP8 weights"),
                });
                Fp8Scale::PerChannel(Tensor::cat(&scales.collect::<Result<Vec<_>>>()?, 0)?)
            }
            Some(Fp8Scale::Block { block, .. }) => {
                let block = *block;
                let last = parts.len() - 1;
                let scales = parts.iter().enumerate().map(|(i, p)| match &p.scale {
                    Fp8Scale::Block { scale, block: b } if *b == block && (i == last || p.dims().0 % block.0 == 0) => Ok(scale.clone()),
                    _ => candle_core::bail!("block-scaled FP8 weights join only with the same blocks over whole tiles of rows"),
                });
                Fp8Scale::Block { scale: Tensor::cat(&scales.collect::<Result<Vec<_>>>()?, 0)?, block }
            }
            None => candle_core::bail!("no FP8 weights to join"),
        };
        Self::from_parts(data, scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_abs(t: &Tensor) -> f32 {
        t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn a_row_quantizes_to_within_e4m3_rounding_of_its_largest_value() {
        let w = Tensor::new(&[[1.0f32, -0.5, 0.3, 0.001], [0.0, 0.0, 0.0, 0.0], [-900.0, 3.0, 1e-3, 448.0]], &Device::Cpu).unwrap();
        let q = Fp8Weight::quantize(&w).unwrap();
        let Fp8Scale::PerChannel(s) = q.scale() else { panic!("per channel") };
        for (got, want) in s.to_vec1::<f32>().unwrap().into_iter().zip([1.0 / 448.0, 1.0, 900.0 / 448.0]) {
            assert!((got - want).abs() <= want * 1e-6, "scale {got}, expected {want}");
        }
        let back = q.dequantize(DType::F32).unwrap();
        // A row's largest value is exact; every value is within half an E4M3 step of it: 2^-4
        // relative for normal values (3 mantissa bits), half the subnormal step 2^-9 below.
        let rows = back.to_vec2::<f32>().unwrap();
        assert!((rows[0][0] - 1.0).abs() < 1e-6 && (rows[2][0] + 900.0).abs() < 1e-3, "{rows:?}");
        assert_eq!(rows[1], vec![0.0; 4]);
        let scales = s.to_vec1::<f32>().unwrap();
        for ((got, want), s) in rows.iter().zip(w.to_vec2::<f32>().unwrap()).zip(scales) {
            for (g, x) in got.iter().zip(&want) {
                assert!((g - x).abs() <= x.abs() / 16.0 + s * 2f32.powi(-10) + 1e-6, "{g} for {x} at scale {s}");
            }
        }
    }

    #[test]
    fn block_scales_multiply_their_tiles_and_partial_edge_tiles() {
        // A 3 × 5 weight in 2 × 2 tiles: scales [2, 3], the last row and column tiles partial.
        let data = Tensor::ones((3, 5), DType::F32, &Device::Cpu).unwrap().to_dtype(DType::F8E4M3).unwrap();
        let scale = Tensor::new(&[[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]], &Device::Cpu).unwrap();
        let w = Fp8Weight::from_parts(data, Fp8Scale::Block { scale, block: (2, 2) }).unwrap();
        let got = w.dequantize(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, vec![vec![1.0, 1.0, 2.0, 2.0, 3.0], vec![1.0, 1.0, 2.0, 2.0, 3.0], vec![4.0, 4.0, 5.0, 5.0, 6.0]]);
        let bad = Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap();
        let data = Tensor::ones((3, 5), DType::F32, &Device::Cpu).unwrap().to_dtype(DType::F8E4M3).unwrap();
        assert!(Fp8Weight::from_parts(data, Fp8Scale::Block { scale: bad, block: (2, 2) }).is_err());
    }

    #[test]
    fn joined_rows_dequantize_as_the_parts() {
        let a = Tensor::new(&[[0.25f32, -3.0], [7.0, 0.5]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[1.5f32, 100.0]], &Device::Cpu).unwrap();
        let (qa, qb) = (Fp8Weight::quantize(&a).unwrap(), Fp8Weight::quantize(&b).unwrap());
        let joined = Fp8Weight::cat_rows(&[qa.clone(), qb.clone()]).unwrap().dequantize(DType::F32).unwrap();
        let parts = Tensor::cat(&[qa.dequantize(DType::F32).unwrap(), qb.dequantize(DType::F32).unwrap()], 0).unwrap();
        assert_eq!(max_abs(&(joined - parts).unwrap()), 0.0);
        // Block-scaled parts join when only the last ends inside a tile.
        let blocks = |rows: usize| {
            let data = Tensor::ones((rows, 2), DType::F32, &Device::Cpu).unwrap().to_dtype(DType::F8E4M3).unwrap();
            let scale = Tensor::ones((rows.div_ceil(2), 1), DType::F32, &Device::Cpu).unwrap();
            Fp8Weight::from_parts(data, Fp8Scale::Block { scale, block: (2, 2) }).unwrap()
        };
        assert_eq!(Fp8Weight::cat_rows(&[blocks(2), blocks(1)]).unwrap().dims(), (3, 2));
        assert!(Fp8Weight::cat_rows(&[blocks(1), blocks(2)]).is_err());
    }
}
