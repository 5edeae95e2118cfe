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

/// In each of `tensors` (one shape, dtype and device, contiguous, viewed as rows of `width`
/// elements), row `dst[p]` becomes a copy of row `src[p]`, every source read before any
/// destination is written: the last-exited K/V fill, every layer's K and V at once. Every index
/// must address a row and no row may be a destination twice (an error before anything is
/// written). On CUDA, when no destination is also a source, one launch for all tensors;
/// otherwise [`copy_rows_reference`].
pub fn copy_rows(tensors: &[&Tensor], width: usize, src: &[u32], dst: &[u32]) -> Result<()> {
    check_copy_rows(tensors, width, src, dst)?;
    #[cfg(feature = "cuda")]
    if let Some(first) = tensors.first() {
        let sources: std::collections::HashSet<u32> = src.iter().copied().collect();
        if first.device().is_cuda() && super::is_float(first.dtype()) && !dst.iter().any(|d| sources.contains(d)) {
            return super::cuda::copy_rows_in_place(tensors, width, src, dst);
        }
    }
    gather_then_scatter(tensors, width, src, dst)
}

/// What [`copy_rows`] takes, checked on the host before anything is written.
fn check_copy_rows(tensors: &[&Tensor], width: usize, src: &[u32], dst: &[u32]) -> Result<()> {
    if src.len() != dst.len() {
        bail!("copy_rows: {} sources for {} destinations", src.len(), dst.len());
    }
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    if width == 0 || first.elem_count() % width != 0 {
        bail!("copy_rows: {:?} is not rows of {width}", first.dims());
    }
    for t in tensors {
        if t.dims() != first.dims() || t.dtype() != first.dtype() || !t.device().same_device(first.device()) || !t.is_contiguous() {
            bail!(
                "copy_rows: tensors must share one shape, dtype and device and be contiguous ({:?} {:?} vs {:?} {:?})",
                t.dims(),
                t.dtype(),
                first.dims(),
                first.dtype()
            );
        }
    }
    let rows = first.elem_count() / width;
    if let Some(&i) = src.iter().chain(dst).find(|&&i| i as usize >= rows) {
        bail!("copy_rows: row {i} past the {rows} rows");
    }
    let mut seen = std::collections::HashSet::with_capacity(dst.len());
    if let Some(&d) = dst.iter().find(|&&d| !seen.insert(d)) {
        bail!("copy_rows: row {d} is a destination twice");
    }
    Ok(())
}

/// [`copy_rows`] as candle ops: per tensor, gather the source rows, then [`scatter_rows`] them.
/// The device tests' reference (nothing in the library calls it).
#[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
pub fn copy_rows_reference(tensors: &[&Tensor], width: usize, src: &[u32], dst: &[u32]) -> Result<()> {
    check_copy_rows(tensors, width, src, dst)?;
    gather_then_scatter(tensors, width, src, dst)
}

/// The body of [`copy_rows_reference`], on arguments [`check_copy_rows`] accepted.
fn gather_then_scatter(tensors: &[&Tensor], width: usize, src: &[u32], dst: &[u32]) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    if src.is_empty() {
        return Ok(());
    }
    let src = Tensor::new(src, first.device())?;
    let dst = Tensor::new(dst, first.device())?;
    for t in tensors {
        let rows = t.reshape((t.elem_count() / width, width))?.index_select(&src, 0)?;
        scatter_rows(t, &rows, &dst)?;
    }
    Ok(())
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

    #[test]
    fn copies_rows_in_every_tensor_reading_all_sources_first() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 12., &dev)?.reshape((4, 3))?;
        let b = Tensor::arange(100f32, 112., &dev)?.reshape((4, 3))?;
        // Row 0 -> 2 and row 2 -> 3: row 3 gets row 2 as it was before the launch.
        copy_rows(&[&a, &b], 3, &[0, 2], &[2, 3])?;
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, vec![0., 1., 2., 3., 4., 5., 0., 1., 2., 6., 7., 8.]);
        assert_eq!(b.flatten_all()?.to_vec1::<f32>()?, vec![100., 101., 102., 103., 104., 105., 100., 101., 102., 106., 107., 108.]);
        // One source fanned out to several destinations (an exit slot to the deeper slots).
        copy_rows(&[&a], 3, &[1, 1], &[0, 3])?;
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, vec![3., 4., 5., 3., 4., 5., 0., 1., 2., 3., 4., 5.]);
        // Refused before anything is written: unequal lists, rows that do not tile, a row past
        // the end, a destination twice, tensors of different shapes.
        let before = a.flatten_all()?.to_vec1::<f32>()?;
        assert!(copy_rows(&[&a], 3, &[0], &[]).is_err());
        assert!(copy_rows(&[&a], 5, &[0], &[1]).is_err());
        assert!(copy_rows(&[&a, &b], 3, &[0, 4], &[1, 2]).is_err());
        assert!(copy_rows(&[&a], 3, &[0, 1], &[2, 2]).is_err());
        assert!(copy_rows(&[&a, &a.narrow(0, 0, 2)?], 3, &[0], &[1]).is_err());
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, before);
        Ok(())
    }
}
