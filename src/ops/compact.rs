//! Compaction of a launch's per-token tensors to a subset of its tokens: FOCUS keeps some
//! tokens past layer 1 and runs the rest of the network on their rows only.

use candle_core::{bail, Result, Tensor};

/// Rows `index` of each of `sources` (each `[T, ..]`, the same `T`), in index order. On CUDA
/// one launch copies up to four sources of one dtype (hidden states, queries, RoPE cos and sin);
/// elsewhere it is [`compact_rows_reference`]. An index `>= T` is an error.
pub fn compact_rows(sources: &[&Tensor], index: &[u32]) -> Result<Vec<Tensor>> {
    let Some(first) = sources.first() else {
        return Ok(vec![]);
    };
    let rows = first.dim(0)?;
    for s in sources {
        if s.rank() == 0 || s.dim(0)? != rows || !s.device().same_device(first.device()) {
            bail!("compact_rows: sources must share their first dim ({rows}) and device, got {:?}", s.dims());
        }
    }
    if let Some(&bad) = index.iter().find(|&&i| i as usize >= rows) {
        bail!("compact_rows: index {bad} outside {rows} rows");
    }
    #[cfg(feature = "cuda")]
    if first.device().is_cuda() && sources.len() <= 4 && super::is_float(first.dtype()) && sources.iter().all(|s| s.dtype() == first.dtype()) {
        return super::cuda::compact_rows(sources, index);
    }
    compact_rows_reference(sources, index)
}

/// `index_select` of each source: the CPU path and the reference the kernel is tested against.
pub fn compact_rows_reference(sources: &[&Tensor], index: &[u32]) -> Result<Vec<Tensor>> {
    let Some(first) = sources.first() else {
        return Ok(vec![]);
    };
    let idx = Tensor::new(index, first.device())?;
    sources.iter().map(|s| s.index_select(&idx, 0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn picks_rows_in_index_order() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 12., &dev)?.reshape((4, 3))?;
        let b = Tensor::arange(0u32, 8, &dev)?.to_dtype(DType::F32)?.reshape((4, 1, 2))?;
        let out = compact_rows(&[&a, &b], &[3, 0, 3])?;
        assert_eq!(out[0].to_vec2::<f32>()?, vec![vec![9., 10., 11.], vec![0., 1., 2.], vec![9., 10., 11.]]);
        assert_eq!(out[1].dims(), &[3, 1, 2]);
        assert_eq!(out[1].flatten_all()?.to_vec1::<f32>()?, vec![6., 7., 0., 1., 6., 7.]);
        Ok(())
    }

    #[test]
    fn rejects_bad_index_and_mismatched_rows() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
        let b = Tensor::zeros((5, 3), DType::F32, &dev).unwrap();
        assert!(compact_rows(&[&a], &[4]).is_err());
        assert!(compact_rows(&[&a, &b], &[0]).is_err());
        assert!(compact_rows(&[], &[0]).unwrap().is_empty());
    }
}
