//! Row movement and readout kernels (`kernels/fused.cu`): in-place row scatter, compaction
//! to kept rows, greedy token with its probability, greedy ids with the non-finite flag.

use super::launch::{check_given, device, for_float, kernel, pair_given, pair_guards, same_device_dtype, view, wrap, Dest, Module};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, DType, Result, Tensor};

/// Copies row `r` of `src` `[rows, ..]` into row `index[r]` of `dst`, in place; `dst` is viewed
/// as rows of `src`'s row width (a paged cache `[blocks, block_size, kv_heads, head_dim]` as
/// `[blocks · block_size, kv_heads · head_dim]`). Indices past `dst`'s rows are skipped.
pub fn scatter_rows(dst: &Tensor, src: &Tensor, index: &Tensor) -> Result<()> {
    const OP: &str = "scatter_rows";
    let dev = device(dst, OP)?;
    let dtype = dst.dtype();
    let src = src.to_dtype(dtype)?.contiguous()?;
    same_device_dtype(OP, dtype, dst, &[("src", &src)])?;
    if !index.device().same_device(dst.device()) || index.dtype() != DType::U32 {
        bail!("{OP} (cuda): index must be u32 on the device of dst");
    }
    if !dst.is_contiguous() || src.rank() == 0 {
        bail!("{OP} (cuda): dst must be contiguous and src have rows, got {:?} / {:?}", dst.dims(), src.dims());
    }
    let rows = src.dim(0)?;
    let width = src.elem_count().checked_div(rows).unwrap_or(0);
    if index.dims() != [rows] || (width > 0 && dst.elem_count() % width != 0) {
        bail!("{OP} (cuda): src {:?} / index {:?} / dst {:?} do not agree", src.dims(), index.dims(), dst.dims());
    }
    if rows == 0 || width == 0 {
        return Ok(());
    }
    if width > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("{OP} (cuda): sizes out of range");
    }
    let dst_rows = dst.elem_count() / width;
    for_float!(dtype, OP, |T, suf| scatter_rows_launch::<T>(&dev, suf, dst, &src, index, rows, width, dst_rows))
}

#[allow(clippy::too_many_arguments)]
fn scatter_rows_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    dst: &Tensor,
    src: &Tensor,
    index: &Tensor,
    rows: usize,
    width: usize,
    dst_rows: usize,
) -> Result<()> {
    const OP: &str = "scatter_rows";
    let (ds, dl) = dst.storage_and_layout();
    let (ss, sl) = src.storage_and_layout();
    let (is, il) = index.storage_and_layout();
    // Written in place under the read lock, ordered by the device's one stream (see
    // `qkv_rope_launch`).
    let dst_v = view::<T>(&ds, dl, OP, "dst", false)?;
    let src_v = view::<T>(&ss, sl, OP, "src", false)?;
    let index_v = view::<u32>(&is, il, OP, "index", false)?;
    let func = kernel!(dev, Module::Fused, &format!("scatter_rows_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let (w, n) = (width as i32, dst_rows as i64);
    let mut b = func.builder();
    b.arg(&dst_v).arg(&src_v).arg(&index_v).arg(&w).arg(&n);
    // SAFETY: argument list matches `scatter_rows_*` in fused.cu; indices are bounded in-kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Rows `index[r]` of `src` `[src_rows, width]` (`index` `[rows]` u32 on the device) copied into
/// `out` `[rows, width]` (contiguous, `src`'s dtype): `index_select` into a given buffer.
pub fn gather_rows_into(src: &Tensor, index: &Tensor, out: &Tensor) -> Result<()> {
    gather_rows_to(src, index, None, out)
}

/// [`gather_rows_into`] times `scale`, rounded as candle's `affine(scale, 0)` over the gathered
/// rows (the scale rounded to the dtype first, then one rounding of the product).
pub fn gather_rows_scaled_into(src: &Tensor, index: &Tensor, scale: f64, out: &Tensor) -> Result<()> {
    gather_rows_to(src, index, Some(scale), out)
}

fn gather_rows_to(src: &Tensor, index: &Tensor, scale: Option<f64>, out: &Tensor) -> Result<()> {
    const OP: &str = "gather_rows";
    let dev = device(src, OP)?;
    let dtype = src.dtype();
    same_device_dtype(OP, dtype, src, &[("out", out)])?;
    if !index.device().same_device(src.device()) || index.dtype() != DType::U32 {
        bail!("{OP} (cuda): index must be u32 on the device of src");
    }
    let (src_rows, width) = src.dims2()?;
    let rows = index.dims1()?;
    if out.dims() != [rows, width] {
        bail!("{OP} (cuda): out {:?} for {rows} rows of {width}", out.dims());
    }
    if rows == 0 || width == 0 {
        return Ok(());
    }
    if width > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("{OP} (cuda): sizes out of range");
    }
    // candle's affine takes its factor in the dtype.
    let scale = scale.map(|s| match dtype {
        DType::BF16 => half::bf16::from_f64(s).to_f32(),
        DType::F16 => half::f16::from_f64(s).to_f32(),
        _ => s as f32,
    });
    let src = src.contiguous()?;
    for_float!(dtype, OP, |T, suf| gather_rows_launch::<T>(&dev, suf, &src, index, scale, out, rows, width, src_rows))
}

#[allow(clippy::too_many_arguments)]
fn gather_rows_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    src: &Tensor,
    index: &Tensor,
    scale: Option<f32>,
    out: &Tensor,
    rows: usize,
    width: usize,
    src_rows: usize,
) -> Result<()> {
    const OP: &str = "gather_rows";
    let (ss, sl) = src.storage_and_layout();
    let (is, il) = index.storage_and_layout();
    let (os, ol) = out.storage_and_layout();
    let src_v = view::<T>(&ss, sl, OP, "src", false)?;
    let index_v = view::<u32>(&is, il, OP, "index", false)?;
    // Written in place under the read lock, ordered by the device's one stream.
    let out_v = view::<T>(&os, ol, OP, "out", false)?;
    let name = if scale.is_some() { "gather_rows_scaled" } else { "gather_rows" };
    let func = kernel!(dev, Module::Fused, &format!("{name}_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let (w, n) = (width as i32, src_rows as i64);
    let mut b = func.builder();
    b.arg(&out_v).arg(&src_v).arg(&index_v).arg(&w).arg(&n);
    if let Some(scale) = &scale {
        b.arg(scale);
    }
    // SAFETY: argument list matches `gather_rows_*` / `gather_rows_scaled_*` in fused.cu; every
    // row of `out` is written.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// `out[r] = bias + Σ_k f32(h[r, k]) · w[k]` (`h` `[rows, k]` float, `w` `[k]` or `[1, k]` and
/// `bias` `[1]` f32, `out` `[rows]` f32, contiguous): a one-output linear layer in f32 over rows
/// of another dtype, the cast folded into the load (an exit gate's logit).
pub fn row_dot_f32_into(h: &Tensor, w: &Tensor, bias: &Tensor, out: &Tensor) -> Result<()> {
    const OP: &str = "row_dot_f32";
    let dev = device(h, OP)?;
    let (rows, k) = h.dims2()?;
    same_device_dtype(OP, DType::F32, w, &[("bias", bias), ("out", out)])?;
    if w.elem_count() != k || bias.elem_count() != 1 || out.dims() != [rows] || k > i32::MAX as usize || rows > u32::MAX as usize / 2 {
        bail!("{OP} (cuda): h {:?}, w {:?}, bias {:?}, out {:?}", h.dims(), w.dims(), bias.dims(), out.dims());
    }
    if rows == 0 {
        return Ok(());
    }
    let (h, w, bias) = (h.contiguous()?, w.contiguous()?, bias.contiguous()?);
    for_float!(h.dtype(), OP, |T, suf| row_dot_launch::<T>(&dev, suf, &h, &w, &bias, out, rows, k))
}

#[allow(clippy::too_many_arguments)]
fn row_dot_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    h: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    out: &Tensor,
    rows: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "row_dot_f32";
    let (hs, hl) = h.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (bs, bl) = bias.storage_and_layout();
    let (os, ol) = out.storage_and_layout();
    let h_v = view::<T>(&hs, hl, OP, "h", false)?;
    let w_v = view::<f32>(&ws, wl, OP, "w", false)?;
    let b_v = view::<f32>(&bs, bl, OP, "bias", false)?;
    // Written in place under the read lock, ordered by the device's one stream.
    let out_v = view::<f32>(&os, ol, OP, "out", false)?;
    let func = kernel!(dev, Module::Fused, &format!("row_dot_f32_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let kk = k as i32;
    let mut b = func.builder();
    b.arg(&out_v).arg(&h_v).arg(&w_v).arg(&b_v).arg(&kk);
    // SAFETY: argument list matches `row_dot_f32_*` in fused.cu; one block writes each row.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// `‖new[r, ..cols] − old[r, ..cols]‖ / ‖new[r, ..cols]‖` per row in f32 (`old`, `new`
/// `[rows, width]` of one float dtype, `cols ≤ width`): a core step's relative latent change over
/// the s half of its state, in one launch. `[rows]` f32.
pub fn latent_change(old: &Tensor, new: &Tensor, cols: usize) -> Result<Tensor> {
    latent_change_to(old, new, cols, None)
}

/// [`latent_change`] written into `out` (`[rows]` f32, contiguous).
pub fn latent_change_into(old: &Tensor, new: &Tensor, cols: usize, out: &Tensor) -> Result<()> {
    latent_change_to(old, new, cols, Some(out)).map(|_| ())
}

fn latent_change_to(old: &Tensor, new: &Tensor, cols: usize, out: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "latent_change";
    let dev = device(new, OP)?;
    same_device_dtype(OP, new.dtype(), new, &[("old", old)])?;
    let (rows, width) = new.dims2()?;
    check_given(OP, "out", new, DType::F32, &[rows], out)?;
    if old.dims() != new.dims() || cols > width || width > i32::MAX as usize || rows > u32::MAX as usize / 2 {
        bail!("{OP} (cuda): old {:?}, new {:?}, {cols} columns", old.dims(), new.dims());
    }
    if rows == 0 {
        return match out {
            Some(o) => Ok(o.clone()),
            None => Tensor::zeros(0, DType::F32, new.device()),
        };
    }
    let (old, new) = (old.contiguous()?, new.contiguous()?);
    for_float!(new.dtype(), OP, |T, suf| latent_change_launch::<T>(&dev, suf, &old, &new, out, (rows, width, cols)))
}

fn latent_change_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    old: &Tensor,
    new: &Tensor,
    given: Option<&Tensor>,
    (rows, width, cols): (usize, usize, usize),
) -> Result<Tensor> {
    const OP: &str = "latent_change";
    let (os, ol) = old.storage_and_layout();
    let (ns, nl) = new.storage_and_layout();
    let old_v = view::<T>(&os, ol, OP, "old", false)?;
    let new_v = view::<T>(&ns, nl, OP, "new", false)?;
    let given_sl = given.map(|t| t.storage_and_layout());
    // SAFETY: one block writes each row's value.
    let mut out = unsafe { Dest::<f32>::new(dev, rows, given_sl.as_ref().map(|(s, l)| (&**s, *l)), OP, "out")? };
    let func = kernel!(dev, Module::Fused, &format!("latent_change_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (c, stride) = (cols as i32, width as i64);
    let mut b = func.builder();
    out.push(&mut b);
    b.arg(&old_v).arg(&new_v).arg(&c).arg(&stride);
    // SAFETY: argument list matches `latent_change_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok(out.finish(dev, rows, given))
}

/// Greedy token `[rows]` u32 and its softmax probability `[rows]` f32 of each row of `logits`
/// `[rows, vocab]`, in one pass over the logits in their own dtype; `exclude` (the mask token)
/// is never chosen and left out of the normaliser.
pub fn greedy_confidence(logits: &Tensor, exclude: Option<u32>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "greedy_confidence";
    let dev = device(logits, OP)?;
    let logits = logits.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if vocab == 0 || vocab > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("{OP} (cuda): logits {:?}", logits.dims());
    }
    let dtype = logits.dtype();
    if rows == 0 {
        return Ok((Tensor::zeros(0, DType::U32, logits.device())?, Tensor::zeros(0, DType::F32, logits.device())?));
    }
    let exclude = exclude.map_or(-1, |e| e as i32);
    for_float!(dtype, OP, |T, suf| greedy_launch::<T>(&dev, suf, &logits, rows, vocab, exclude))
}

fn greedy_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, logits: &Tensor, rows: usize, vocab: usize, exclude: i32) -> Result<(Tensor, Tensor)> {
    const OP: &str = "greedy_confidence";
    let (ls, ll) = logits.storage_and_layout();
    let l_v = view::<T>(&ls, ll, OP, "logits", false)?;
    // SAFETY: the kernel writes one token and one probability per row.
    let mut tokens = unsafe { dev.alloc::<u32>(rows)? };
    let mut conf = unsafe { dev.alloc::<f32>(rows)? };
    let func = kernel!(dev, Module::Fused, &format!("greedy_confidence_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let v = vocab as i32;
    let mut b = func.builder();
    b.arg(&mut tokens).arg(&mut conf).arg(&l_v).arg(&v).arg(&exclude);
    // SAFETY: argument list matches `greedy_confidence_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((wrap(tokens, dev, rows), wrap(conf, dev, rows)))
}

/// Greedy id `[rows]` u32 of each row of `logits` `[rows, width]` (its first maximum; 0 for a
/// row without a finite maximum), and the same ids with `flag` added where the row's f32 sum is
/// not finite: one pass over the logits in their own dtype.
pub fn greedy_flagged(logits: &Tensor, flag: u32) -> Result<(Tensor, Tensor)> {
    greedy_flagged_to(logits, flag, None)
}

/// [`greedy_flagged`] written into `ids` and `flagged` (`[rows]` u32 each).
pub fn greedy_flagged_into(logits: &Tensor, flag: u32, ids: &Tensor, flagged: &Tensor) -> Result<()> {
    greedy_flagged_to(logits, flag, Some((ids, flagged))).map(|_| ())
}

fn greedy_flagged_to(logits: &Tensor, flag: u32, outs: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "greedy_flagged";
    let dev = device(logits, OP)?;
    let logits = logits.contiguous()?;
    let (rows, width) = logits.dims2()?;
    if width == 0 || width > i32::MAX as usize || rows > i32::MAX as usize {
        bail!("{OP} (cuda): logits {:?}", logits.dims());
    }
    check_given(OP, "ids", &logits, DType::U32, &[rows], outs.map(|o| o.0))?;
    check_given(OP, "flagged", &logits, DType::U32, &[rows], outs.map(|o| o.1))?;
    if rows == 0 {
        let none = Tensor::zeros(0, DType::U32, logits.device())?;
        return Ok((none.clone(), none));
    }
    for_float!(logits.dtype(), OP, |T, suf| greedy_flagged_launch::<T>(&dev, suf, &logits, rows, width, flag, outs))
}

fn greedy_flagged_launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    suf: &str,
    logits: &Tensor,
    rows: usize,
    width: usize,
    flag: u32,
    outs: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "greedy_flagged";
    let (ls, ll) = logits.storage_and_layout();
    let l_v = view::<T>(&ls, ll, OP, "logits", false)?;
    let guards = pair_guards(outs);
    let [ids_given, flagged_given] = pair_given(&guards);
    // SAFETY: the kernel writes both ids of every row.
    let mut ids = unsafe { Dest::<u32>::new(dev, rows, ids_given, OP, "ids")? };
    let mut flagged = unsafe { Dest::<u32>::new(dev, rows, flagged_given, OP, "flagged")? };
    let func = kernel!(dev, Module::Fused, &format!("greedy_flagged_{suf}"))?;
    // A block of 1024 threads a row: at decode widths the launch has a block per row only, and
    // each thread's few 16-byte loads are what keeps the logits streaming.
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    let w = width as i32;
    let mut b = func.builder();
    ids.push(&mut b);
    flagged.push(&mut b);
    b.arg(&l_v).arg(&w).arg(&flag);
    // SAFETY: argument list matches `greedy_flagged_*` in fused.cu.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    Ok((ids.finish(dev, rows, outs.map(|o| o.0)), flagged.finish(dev, rows, outs.map(|o| o.1))))
}

/// In each of `tensors` (one shape, dtype and device; contiguous), row `dst[p]` = row `src[p]`
/// in place, rows of `width` elements: one launch for all tensors and pairs. No destination may
/// also be a source or repeat (`ops::copy_rows` checks that, and the indices, before calling);
/// pairs past the rows are skipped.
pub fn copy_rows_in_place(tensors: &[&Tensor], width: usize, src: &[u32], dst: &[u32]) -> Result<()> {
    const OP: &str = "copy_rows_in_place";
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    if src.len() != dst.len() {
        bail!("{OP} (cuda): {} sources for {} destinations", src.len(), dst.len());
    }
    if src.is_empty() {
        return Ok(());
    }
    let dev = device(first, OP)?;
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|t| ("tensor", *t)).collect();
    same_device_dtype(OP, first.dtype(), first, &named)?;
    if tensors.iter().any(|t| t.dims() != first.dims() || !t.is_contiguous()) || width == 0 || first.elem_count() % width != 0 {
        bail!("{OP} (cuda): tensors must be contiguous, of one shape, in rows of {width}");
    }
    if width > i32::MAX as usize || src.len() > i32::MAX as usize || tensors.len() > 65535 {
        bail!("{OP} (cuda): sizes out of range");
    }
    for_float!(first.dtype(), OP, |T, suf| copy_in_place_launch::<T>(&dev, suf, tensors, width, src, dst))
}

fn copy_in_place_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, tensors: &[&Tensor], width: usize, src: &[u32], dst: &[u32]) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    const OP: &str = "copy_rows_in_place";
    let stream = dev.cuda_stream();
    let rows = (tensors[0].elem_count() / width) as i64;
    let storages: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    // Written in place under the read lock, ordered by the device's one stream (see
    // `qkv_rope_launch`).
    let views = storages.iter().map(|(st, l)| view::<T>(st, l, OP, "tensor", false)).collect::<Result<Vec<_>>>()?;
    let (mut bases, mut guards) = (Vec::with_capacity(views.len()), Vec::with_capacity(views.len()));
    for v in &views {
        let (p, g) = v.device_ptr(&stream);
        bases.push(p);
        guards.push(g);
    }
    let bases_d = dev.clone_htod(&bases)?;
    let src_d = dev.clone_htod(src)?;
    let dst_d = dev.clone_htod(dst)?;
    let func = kernel!(dev, Module::Fused, &format!("copy_rows_in_place_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (src.len() as u32, tensors.len() as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let w = width as i32;
    let mut b = func.builder();
    b.arg(&bases_d).arg(&src_d).arg(&dst_d).arg(&w).arg(&rows);
    // SAFETY: argument list matches `copy_rows_in_place_*` in fused.cu; every base addresses a
    // live allocation of `rows` rows of `width`, ordered on the device's one stream; indices are
    // bounded in the kernel.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    drop(guards);
    Ok(())
}

/// Rows `index` of each of up to four `sources` `[T, ..]` of one dtype, in one launch (see
/// `compact_rows_*` in fused.cu). Indices were checked against `T` by the caller.
pub fn compact_rows(sources: &[&Tensor], index: &[u32]) -> Result<Vec<Tensor>> {
    const OP: &str = "compact_rows";
    let Some(first) = sources.first() else {
        return Ok(vec![]);
    };
    if sources.len() > 4 {
        bail!("{OP} (cuda): at most four sources, got {}", sources.len());
    }
    let dtype = first.dtype();
    let dev = device(first, OP)?;
    let srcs = sources.iter().map(|s| s.contiguous()).collect::<Result<Vec<_>>>()?;
    let named: Vec<(&str, &Tensor)> = srcs.iter().map(|s| ("source", s)).collect();
    same_device_dtype(OP, dtype, first, &named)?;
    for_float!(dtype, OP, |T, suf| compact_launch::<T>(&dev, suf, &srcs, index))
}

fn compact_launch<T: CudaDType + DeviceRepr>(dev: &CudaDevice, suf: &str, srcs: &[Tensor], index: &[u32]) -> Result<Vec<Tensor>> {
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    const OP: &str = "compact_rows";
    let rows = srcs[0].dim(0)?;
    let n = index.len();
    let shapes: Vec<Vec<usize>> = srcs.iter().map(|s| std::iter::once(n).chain(s.dims()[1..].iter().copied()).collect()).collect();
    let widths: Vec<usize> = srcs.iter().map(|s| s.elem_count() / rows.max(1)).collect();
    if n == 0 || rows == 0 {
        return shapes.into_iter().map(|s| Tensor::zeros(s, srcs[0].dtype(), srcs[0].device())).collect();
    }
    if n > i32::MAX as usize || widths.iter().any(|&w| w > i32::MAX as usize) {
        bail!("{OP} (cuda): sizes out of range");
    }
    let stream = dev.cuda_stream();
    let idx = dev.clone_htod(index)?;
    // SAFETY: the kernel writes every element of each output ([n, width]).
    let mut outs = widths.iter().map(|&w| unsafe { dev.alloc::<T>(n * w) }).collect::<Result<Vec<_>>>()?;
    let storages: Vec<_> = srcs.iter().map(|s| s.storage_and_layout()).collect();
    let views = storages.iter().map(|(st, l)| view::<T>(st, l, OP, "source", false)).collect::<Result<Vec<_>>>()?;
    // Raw pointers so that unused slots (width 0, never dereferenced) can repeat the first.
    let (mut src_ptrs, mut dst_ptrs, mut syncs_r, mut syncs_w) = (vec![], vec![], vec![], vec![]);
    for v in &views {
        let (p, s) = v.device_ptr(&stream);
        src_ptrs.push(p);
        syncs_r.push(s);
    }
    for o in outs.iter_mut() {
        let (p, s) = o.device_ptr_mut(&stream);
        dst_ptrs.push(p);
        syncs_w.push(s);
    }
    let w: Vec<i32> = (0..4).map(|i| widths.get(i).map_or(0, |&w| w as i32)).collect();
    let sp: Vec<u64> = (0..4).map(|i| *src_ptrs.get(i).unwrap_or(&src_ptrs[0])).collect();
    let dp: Vec<u64> = (0..4).map(|i| *dst_ptrs.get(i).unwrap_or(&dst_ptrs[0])).collect();
    let total_rows = rows as i64;
    let func = kernel!(dev, Module::Fused, &format!("compact_rows_{suf}"))?;
    let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let mut b = func.builder();
    for i in 0..4 {
        b.arg(&dp[i]).arg(&sp[i]).arg(&w[i]);
    }
    b.arg(&idx).arg(&total_rows);
    // SAFETY: argument list matches `compact_rows_*` in fused.cu; pointers address live
    // allocations of the widths passed, ordered on the device's one stream.
    unsafe { b.launch(cfg) }.w()?;
    drop(b);
    drop((syncs_r, syncs_w));
    Ok(outs.into_iter().zip(shapes).map(|(o, s)| wrap(o, dev, s)).collect())
}
