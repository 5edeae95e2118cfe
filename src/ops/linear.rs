//! Projections `x · wᵀ` of the looped models. At decode widths a projection is a stream of its
//! weights past a few rows, and cuBLAS's kernels for those shapes leave much of the copy
//! bandwidth unused on the small matrices (o_proj, down); so on CUDA, in bf16 / f16 with at most
//! 64 rows, our streaming kernel runs (`ops::cuda::skinny_linear`), and the fused gate/up
//! projection applies SiLU·mul in its epilogue. Everywhere else — and with
//! [`DecodeGemm::Cublas`] — it is candle's matmul, which is also the reference.

use candle_core::{Result, Tensor};

/// Rows the streaming kernel takes (four 16-row MMA tiles).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_ROWS: usize = 64;
// The streaming kernel's block shape; must match `kernels/skinny.cu`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const WARPS: usize = 8;
pub(crate) const CHUNK: usize = 64;
pub(crate) const PAD: usize = 32;
/// Weight chunks in flight per warp, and the bytes of one warp's ring slot (16 rows of 192 bytes).
const NS: usize = 3;
const SLOT: usize = 16 * 192;
/// The warps' rings of one block.
const RING: usize = WARPS * NS * SLOT;
// A split launch's f32 partials (up to 64 rows of the block's columns) go where the rings were.
const _: () = assert!(RING >= 64 * WARPS * 16 * 4);
/// Shared memory of a block, two blocks per SM (228 KB, 1 KB of each reserved).
const BLOCK_SMEM: usize = 112 * 1024;
/// What is left of it for x's k slice (after the rings and the barriers).
pub(crate) const SMEM_MAX: usize = BLOCK_SMEM - RING - 16 - 8 * NS * WARPS;

/// Which GEMM decode-width projections use on CUDA. Both compute the same products up to
/// rounding; the choice exists to compare them (`bench_looped --decode-gemm`, the device tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeGemm {
    /// Our streaming kernel for ≤ 64 rows in bf16 / f16, candle's matmul otherwise.
    #[default]
    Streaming,
    /// candle's matmul (cuBLAS) at every width.
    Cublas,
}

static DECODE_GEMM: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Selects the decode-width GEMM for the whole process.
pub fn set_decode_gemm(g: DecodeGemm) {
    DECODE_GEMM.store(g as u8, std::sync::atomic::Ordering::Relaxed);
}

/// The GEMM selected with [`set_decode_gemm`].
pub fn decode_gemm() -> DecodeGemm {
    match DECODE_GEMM.load(std::sync::atomic::Ordering::Relaxed) {
        1 => DecodeGemm::Cublas,
        _ => DecodeGemm::Streaming,
    }
}

/// `x · wᵀ` for `x` `[.., K]` and `w` `[N, K]` (a `Linear` without bias).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = streaming(x, w, false)? {
        return Ok(y);
    }
    linear_reference(x, w)
}

/// `silu(x · gateᵀ) · (x · upᵀ)` for `w` `[2I, K]`, the gate rows first; output `[.., I]`.
pub fn linear_silu_mul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = streaming(x, w, true)? {
        return Ok(y);
    }
    super::silu_mul(&linear_reference(x, w)?)
}

/// candle's matmul behind [`linear`], rows flattened as `candle_nn::Linear` does.
pub fn linear_reference(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    match x.rank() {
        0 | 1 => candle_core::bail!("linear: x {:?} needs a row dimension", x.dims()),
        2 => x.matmul(&w.t()?),
        _ => {
            let mut dims = x.dims().to_vec();
            let k = dims.pop().expect("rank >= 3");
            let rows: usize = dims.iter().product();
            let y = x.contiguous()?.reshape((rows, k))?.matmul(&w.t()?)?;
            dims.push(w.dim(0)?);
            y.reshape(dims)
        }
    }
}

/// The streaming kernel's result when it takes these shapes on this device.
#[cfg(feature = "cuda")]
fn streaming(x: &Tensor, w: &Tensor, silu_pairs: bool) -> Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.rank() != 2 || decode_gemm() == DecodeGemm::Cublas || !super::cuda::skinny_fits(x, w, silu_pairs) {
        return Ok(None);
    }
    super::cuda::skinny_linear(x, w, silu_pairs).map(Some)
}

/// How a launch splits its work: `groups` column groups × `splits` k slices (a thread-block
/// cluster of `splits` blocks per group) of `chunks_per_split` 64-wide chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyPlan {
    pub m_tiles: usize,
    pub groups: usize,
    pub splits: usize,
    pub chunks_per_split: usize,
}

impl SkinnyPlan {
    /// Cluster sizes the kernel is built for.
    pub const SPLITS: [usize; 4] = [1, 2, 4, 8];

    /// The plan for `m` rows, `out_cols` output columns (`cols_per_group` a block), depth `k`
    /// on `sms` multiprocessors; `None` when x's k slice does not fit shared memory even at the
    /// largest split. It depends on m only through the tile count, so a row's k order — and so
    /// its result — is the same at every m with the same tile count.
    pub fn new(m: usize, out_cols: usize, cols_per_group: usize, k: usize, sms: usize) -> Option<Self> {
        let m_tiles = match m {
            0..=16 => 1,
            17..=32 => 2,
            _ => 4,
        };
        let groups = out_cols.div_ceil(cols_per_group);
        let chunks = k.div_ceil(CHUNK);
        // Blocks resident at once: two per SM (256 threads of 128 registers). Split k as far as
        // all blocks stay resident (a second wave would double the time) and a split keeps two
        // chunks; further when x's slice would not fit shared memory.
        let max_chunks = (SMEM_MAX / (2 * 16 * m_tiles)).saturating_sub(PAD) / CHUNK;
        let resident = 2 * sms;
        let mut splits = 1;
        for s in Self::SPLITS {
            if groups * s <= resident && chunks.div_ceil(s) >= 2 {
                splits = s;
            }
        }
        while chunks.div_ceil(splits) > max_chunks && splits < 8 {
            splits *= 2;
        }
        let chunks_per_split = chunks.div_ceil(splits);
        (chunks_per_split <= max_chunks).then_some(Self { m_tiles, groups, splits, chunks_per_split })
    }

    /// Shared memory of one block: the warps' weight rings (where a split launch's f32
    /// partials go afterwards), x's k slice (16 · m_tiles rows), the ring barriers.
    pub fn smem_bytes(&self) -> usize {
        let x = 16 * self.m_tiles * (self.chunks_per_split * CHUNK + PAD) * 2;
        RING + x.div_ceil(16) * 16 + 8 * NS * WARPS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_for_ouro_shapes_fill_the_gpu_and_fit_shared_memory() {
        // (rows, output columns, columns per group, k)
        for &(m, n, cpg, k) in &[
            (16, 6144, 128, 2048),
            (16, 2048, 128, 2048),
            (16, 5632, 64, 2048),
            (16, 2048, 128, 5632),
            (64, 2048, 128, 2048),
            (64, 49152, 128, 2048),
            (1, 5280, 128, 5280),
        ] {
            let p = SkinnyPlan::new(m, n, cpg, k, 132).expect("a plan");
            assert!(p.smem_bytes() <= BLOCK_SMEM, "{p:?}");
            assert!(SkinnyPlan::SPLITS.contains(&p.splits), "{p:?}");
            assert!(p.splits * p.chunks_per_split >= k.div_ceil(CHUNK), "{p:?}");
            assert!(p.groups * p.splits >= 88, "{p:?} leaves most SMs idle");
        }
        // The plan depends on m only through the tile count.
        assert_eq!(SkinnyPlan::new(1, 2048, 128, 5632, 132), SkinnyPlan::new(16, 2048, 128, 5632, 132));
        // Every block resident at once: QKV in clusters of 4 (192 blocks), o_proj and down of 8
        // (128), gate/up of 2 (176); x of Ouro's down at 64 rows does not fit.
        let splits = |m, n, cpg, k| SkinnyPlan::new(m, n, cpg, k, 132).map(|p| (p.splits, p.groups * p.splits));
        assert_eq!(splits(16, 6144, 128, 2048), Some((4, 192)));
        assert_eq!(splits(16, 2048, 128, 2048), Some((8, 128)));
        assert_eq!(splits(16, 5632, 64, 2048), Some((2, 176)));
        assert_eq!(splits(16, 2048, 128, 5632), Some((8, 128)));
        assert_eq!(SkinnyPlan::new(64, 2048, 128, 5632, 132), None);
    }
}
