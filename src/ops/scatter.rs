//! In-place row scatter: `dst[index[r]] = src[r]`. The paged K/V write, the loop-state bank
//! write and the last-exited K/V slot copies all are one.

use candle_core::{bail, Result, Tensor};

/// Copies row `r` of `src` `[rows, ..]` into row `index[r]` of `dst`, in place. `dst` is viewed as
/// rows of `src`'s row width (a paged cache `[blocks, block_size, kv_heads, head_dim]` as
/// `[blocks · block_size, kv_heads · head_dim]`); `index` is `[rows]` u32 on `dst`'s device and
/// `src` is cast to `dst`'s dtype. Indices must be below `dst`'s row count (the CUDA kernel
/// skips larger ones, the reference fails). On CUDA one launch, a block per row; elsewhere
/// [`scatter_rows_reference`].
pub fn scatter_rows(dst: &Tensor, src: &Tensor, index: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() && dst.is_contiguous() && super::is_float(dst.dtype()) {
        return super::cuda::scatter_rows(dst, src, index);
    }
    scatter_rows_reference(dst, src, index)
}

/// candle's `scatter_set` over `dst` flattened to rows: the CPU path and the kernel's reference.
/// (On CUDA candle's scatter runs one thread per column through every row in turn: 0.2–0.5 ms
/// for a few hundred rows of a 2048-wide state, hence the kernel.)
pub fn scatter_rows_reference(dst: &Tensor, src: &Tensor, index: &Tensor) -> Result<()> {
    let rows = src.dim(0)?;
    if index.dims() != [rows] {
        bail!("scatter_rows: index {:?} for {rows} rows", index.dims());
    }
    if rows == 0 {
        return Ok(());
    }
    let width = src.elem_count() / rows;
    if width == 0 || dst.elem_count() % width != 0 {
        bail!("scatter_rows: src {:?} rows do not tile dst {:?}", src.dims(), dst.dims());
    }
    let flat = dst.reshape((dst.elem_count() / width, width))?;
    let src = src.reshape((rows, width))?.to_dtype(dst.dtype())?;
    let index = index.unsqueeze(1)?.broadcast_as((rows, width))?.contiguous()?;
    flat.scatter_set(&index, &src, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn writes_rows_in_place_and_rejects_bad_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let dst = Tensor::zeros((2, 2, 3), DType::F32, &dev)?;
        let src = Tensor::arange(1f32, 7., &dev)?.reshape((2, 3))?;
        scatter_rows(&dst, &src, &Tensor::new(&[3u32, 0], &dev)?)?;
        assert_eq!(dst.flatten_all()?.to_vec1::<f32>()?, vec![4., 5., 6., 0., 0., 0., 0., 0., 0., 1., 2., 3.]);
        assert!(scatter_rows(&dst, &src, &Tensor::new(&[0u32], &dev)?).is_err());
        assert!(scatter_rows(&dst, &Tensor::zeros((1, 5), DType::F32, &dev)?, &Tensor::new(&[0u32], &dev)?).is_err());
        Ok(())
    }
}
