//! What the looped models' decode arenas share (`LoopedModel::install_decode_arena`): the dense
//! weights their bodies multiply by, buffers used in turn, the RoPE angles' buffers, and the
//! split-k partials' and attention workspace's sizes.

use crate::ops::{Linear, LinearWeight, RopeAngles, RopeTable};
use candle_core::{DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Most k slices a decode projection is split into (`ops::split_k`) and the widest launch split:
/// the partials' buffer holds that many (a forced plan beyond it allocates its own).
const SPLITS: usize = 4;
const SPLIT_ROWS: usize = 64;

/// The weight of a dense layer without bias (what an arena body multiplies by).
pub(super) fn dense(l: &Linear) -> Option<&Tensor> {
    match (l.stored(), l.bias()) {
        (LinearWeight::Dense(w), None) => Some(w),
        _ => None,
    }
}

/// [`dense`], for an arena body (installed only over dense layers).
pub(super) fn weight(l: &Linear) -> Result<&Tensor> {
    dense(l).ok_or_else(|| candle_core::Error::Msg("decode arena: a layer that is not dense".into()))
}

/// The launch's rows (`x`'s first dim) where an arena of `rows` rows holds them.
pub(super) fn rows_within(rows: usize, x: &Tensor) -> Option<usize> {
    let t = x.dim(0).ok()?;
    (t <= rows).then_some(t)
}

/// Two of a thing used in turn: a stage's output stays valid through the next stage of its kind,
/// so that one can read it.
#[derive(Debug)]
pub(super) struct Turns<T> {
    items: [T; 2],
    turn: AtomicUsize,
}

impl<T> Turns<T> {
    pub(super) fn new(items: [T; 2]) -> Self {
        Self { items, turn: AtomicUsize::new(0) }
    }

    /// The one whose turn it is; the other's next time.
    pub(super) fn next(&self) -> &T {
        &self.items[self.turn.fetch_add(1, Ordering::Relaxed) % 2]
    }

    #[cfg(test)]
    pub(super) fn both(&self) -> &[T; 2] {
        &self.items
    }
}

/// A launch's RoPE angles (`[rows, head_dim / 2]` cos and sin), two pairs used in turn: a
/// re-entering coda prepares its successors' while its own are alive.
pub(super) type RopeBuffers = Turns<(Tensor, Tensor)>;

pub(super) fn rope_buffers(rows: usize, head_dim: usize, dtype: DType, dev: &Device) -> Result<RopeBuffers> {
    let buf = || Tensor::zeros((rows, head_dim / 2), dtype, dev);
    Ok(Turns::new([(buf()?, buf()?), (buf()?, buf()?)]))
}

impl RopeBuffers {
    /// The angles of `positions` (`t` of them) in the next pair.
    pub(super) fn angles(&self, table: &RopeTable, positions: &Tensor, t: usize) -> Result<RopeAngles> {
        let (cos, sin) = self.next();
        table.angles_into(positions, &cos.narrow(0, 0, t)?, &sin.narrow(0, 0, t)?)
    }
}

/// The split-k partials' buffer (f32) for projections to `cols` columns over up to `rows` rows.
pub(super) fn partials(rows: usize, cols: usize, dev: &Device) -> Result<Tensor> {
    Tensor::zeros(SPLITS * rows.min(SPLIT_ROWS) * cols, DType::F32, dev)
}

/// Bytes of [`partials`] and of the attention workspace (`ops::into::AttentionScratch`: the decode
/// ring's partials for every block of its grid, one an SM, 1024 SMs bounding any device, and
/// row, or the SIMT kernel's most key splits of every row, whichever is more) and of an f32 value
/// a row (the exit gate's logit).
pub(super) fn workspace_bytes(rows: usize, cols: usize, heads: usize, head_dim: usize) -> u64 {
    let parts = (SPLITS * rows.min(SPLIT_ROWS) * cols * 4 + rows * 4) as u64;
    let slots = (1024 + rows).max(crate::ops::MAX_ATTENTION_SPLITS * rows);
    parts + (slots * heads * (head_dim + 2) * 4 + 1024 * 16) as u64
}
