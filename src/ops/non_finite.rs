//! Non-finite logits, found on the device without reading the logits back: a row whose sum is
//! not finite holds a NaN or an infinity (or values so large their sum overflows — garbage
//! either way). Its sampled id is moved to `vocab + id`, an id no token has, so the flag rides
//! back to the host with the ids the engine reads anyway; the engine then ends that request with
//! an error while the launch's other rows go on.

use candle_core::{DType, Result, Tensor, D};

/// Rows of `logits` (`[rows, vocab]`) with a non-finite sum, as a `[rows]` u8 mask.
pub fn non_finite_rows(logits: &Tensor) -> Result<Tensor> {
    let sum = logits.to_dtype(DType::F32)?.sum(D::Minus1)?;
    // x · 0 is 0 for every finite x and NaN for ±∞ and NaN; NaN ≠ 0.
    (sum * 0.0)?.ne(0f32)
}

/// `ids` (`[rows]` u32) with `vocab` added where the row of `logits` is not finite.
pub fn flag_non_finite(ids: &Tensor, logits: &Tensor, vocab: usize) -> Result<Tensor> {
    let offset = non_finite_rows(logits)?.to_dtype(DType::U32)?.affine(vocab as f64, 0.0)?;
    ids.to_dtype(DType::U32)? + offset
}

/// The greedy ids of `logits` (`[rows, vocab]`: each row's first maximum, u32) and the same ids
/// flagged as [`flag_non_finite`] does — `(ids, flagged)`: the ids feed the next step, the
/// flagged ones go back to the host. On CUDA one launch; elsewhere
/// [`greedy_ids_flagged_reference`].
pub fn greedy_ids_flagged(logits: &Tensor, vocab: usize) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() && super::is_float(logits.dtype()) && logits.rank() == 2 {
        if let Ok(flag) = u32::try_from(vocab) {
            return super::cuda::greedy_flagged(logits, flag);
        }
    }
    greedy_ids_flagged_reference(logits, vocab)
}

/// The greedy ids of `logits` alone (each row's first maximum, u32), the ids
/// [`greedy_ids_flagged`] returns: on CUDA from its one launch (the flag costs no extra pass
/// there), elsewhere candle's argmax without the flag's pass over the row.
pub(crate) fn greedy_ids(logits: &Tensor, vocab: usize) -> Result<Tensor> {
    if logits.device().is_cuda() {
        return Ok(greedy_ids_flagged(logits, vocab)?.0);
    }
    logits.argmax(D::Minus1)?.to_dtype(DType::U32)
}

/// The composition behind [`greedy_ids_flagged`]: candle's argmax, then [`flag_non_finite`].
pub fn greedy_ids_flagged_reference(logits: &Tensor, vocab: usize) -> Result<(Tensor, Tensor)> {
    let ids = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?;
    let flagged = flag_non_finite(&ids, logits, vocab)?;
    Ok((ids, flagged))
}

/// Whether a token id that came back from a launch is [`flag_non_finite`]'s flag.
pub fn is_non_finite_flag(token: u32, vocab: usize) -> bool {
    token as usize >= vocab
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn flags_only_rows_with_nan_or_infinity() {
        let v = 4;
        let rows = [[0.5, 1.0, -2.0, 3.0], [f32::NAN, 1.0, 0.0, 0.0], [0.0, f32::INFINITY, 0.0, 0.0], [0.0, f32::NEG_INFINITY, 1.0, 0.0]];
        let logits = Tensor::new(&rows, &Device::Cpu).unwrap();
        let ids = logits.argmax(D::Minus1).unwrap();
        let flagged: Vec<u32> = flag_non_finite(&ids, &logits, v).unwrap().to_vec1().unwrap();
        let plain: Vec<u32> = ids.to_vec1().unwrap();
        assert_eq!(flagged[0], plain[0]);
        assert!(is_non_finite_flag(flagged[1], v) && is_non_finite_flag(flagged[2], v) && is_non_finite_flag(flagged[3], v));
        assert_eq!(flagged[1] as usize - v, plain[1] as usize, "the flag keeps the id recoverable");
        let (ids, flagged) = greedy_ids_flagged(&logits, v).unwrap();
        assert_eq!(ids.to_vec1::<u32>().unwrap(), plain);
        assert_eq!(greedy_ids(&logits, v).unwrap().to_vec1::<u32>().unwrap(), plain);
        assert_eq!(flagged.to_vec1::<u32>().unwrap(), flag_non_finite(&ids, &logits, v).unwrap().to_vec1::<u32>().unwrap());
        let bf16 = logits.to_dtype(DType::BF16).unwrap();
        let mask: Vec<u8> = non_finite_rows(&bf16).unwrap().to_vec1().unwrap();
        assert_eq!(mask, vec![0, 1, 1, 1]);
    }
}
