//! The per-launch attention metadata: where each row's queries sit and which cache blocks hold
//! its keys. Built once per launch (per cache slot) by the engine's runner and shared by every
//! layer that reads that slot.

use candle_core::{DType, Device, Result, Tensor};

/// Which keys a query may attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnMask {
    /// Query `j` of a row with `q_len` queries and `ctx` keys sits at position `ctx - q_len + j`
    /// and sees keys `0..=ctx - q_len + j`.
    Causal,
    /// Every query sees all `ctx` keys of its row.
    Bidirectional,
    /// Query `j` at position `p = ctx - q_len + j` sees the keys before the end of its block of
    /// this many positions, `min(ctx, (p / B + 1) · B)` (SDAR: a whole prompt prefilled in one
    /// row). `BlockCausal(1)` is `Causal`.
    BlockCausal(usize),
}

impl AttnMask {
    /// The kernel's encoding: 0 bidirectional, B block-causal (1 = causal).
    pub fn block(self) -> u32 {
        match self {
            Self::Causal => 1,
            Self::Bidirectional => 0,
            Self::BlockCausal(b) => b.max(1) as u32,
        }
    }

    /// Keys `0..limit` visible to query `j` of a row with `q_len` queries and `ctx` keys.
    pub fn key_limit(self, ctx: usize, q_len: usize, j: usize) -> usize {
        match self.block() {
            0 => ctx,
            b => {
                let b = b as usize;
                ctx.min(((ctx - q_len + j) / b + 1) * b)
            }
        }
    }
}

/// Host copy of a launch's addressing (also used by the CPU attention path).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PagedBatchHost {
    /// Block ids of each row, in position order.
    pub block_tables: Vec<Vec<u32>>,
    /// Keys visible to each row, including the row's new tokens (written before attention).
    pub context_lens: Vec<u32>,
    /// Offsets of each row's queries in the packed token dimension; `len = rows + 1`.
    pub cu_q_lens: Vec<u32>,
    /// Cache position each packed token's K/V is written to. Empty: row `r`'s tokens sit at the
    /// consecutive positions `ctx - q_len .. ctx` (every looped launch). Diffusion steps that
    /// recompute only some positions of a block give them here (the mask still reads `ctx`).
    pub write_positions: Vec<u32>,
}

impl PagedBatchHost {
    /// The addressing of a launch with no rows yet; add them with [`PagedBatchHost::push_row`].
    pub fn new() -> Self {
        Self { cu_q_lens: vec![0], ..Self::default() }
    }

    /// Appends a row of `q_len` tokens that attends through `table` to the keys before
    /// `context_len`. Its tokens' K/V go to `positions` when given (ragged recompute sets; then
    /// every row gives them), else to the `q_len` positions before `context_len`.
    pub fn push_row(&mut self, table: &[u32], context_len: usize, q_len: usize, positions: Option<&[u32]>) {
        if self.cu_q_lens.is_empty() {
            self.cu_q_lens.push(0);
        }
        let end = self.cu_q_lens[self.cu_q_lens.len() - 1] + q_len as u32;
        self.cu_q_lens.push(end);
        self.block_tables.push(table.to_vec());
        self.context_lens.push(context_len as u32);
        if let Some(p) = positions {
            self.write_positions.extend_from_slice(p);
        }
    }

    /// Cache positions of row `r`'s tokens: the given write positions, or else the `q_len`
    /// positions before its context length (fewer when `q_len` exceeds it, which
    /// [`PagedBatch::new`] rejects).
    pub fn row_positions(&self, r: usize) -> impl Iterator<Item = usize> + '_ {
        let (a, b) = (self.cu_q_lens[r] as usize, self.cu_q_lens[r + 1] as usize);
        // One iterator type for both cases (no allocation per row and launch): exactly one of
        // the two parts is non-empty.
        let (implicit, given) = if self.write_positions.is_empty() {
            let ctx = self.context_lens[r] as usize;
            (ctx.saturating_sub(b - a)..ctx, &[][..])
        } else {
            (0..0, &self.write_positions[a..b])
        };
        implicit.chain(given.iter().map(|&p| p as usize))
    }
}

/// Device-side addressing of one launch for one cache slot per row.
#[derive(Debug, Clone)]
pub struct PagedBatch {
    pub host: PagedBatchHost,
    pub block_size: usize,
    pub mask: AttnMask,
    // The four u32 tensors below are views of one packed device buffer (one upload), so they
    // may start at a non-zero offset of their storage.
    /// `[rows, max_blocks]` u32, rows padded with zeros.
    pub block_tables: Tensor,
    /// `[rows]` u32.
    pub context_lens: Tensor,
    /// `[rows + 1]` u32.
    pub cu_q_lens: Tensor,
    /// `[tokens]` u32: flat cache row (`block * block_size + offset`) each new token writes.
    pub slot_mapping: Tensor,
    /// Width of one token's K (or V) row (`kv_heads * head_dim`).
    pub kv_width: usize,
    /// `[tokens, kv_width]` u32 index for `scatter_set`, built on first use (only the candle
    /// KV write needs it; the fused CUDA write reads `slot_mapping`) and shared by every layer.
    write_index: std::cell::OnceCell<Tensor>,
    pub max_q_len: usize,
    pub max_context_len: usize,
}

impl PagedBatch {
    /// Builds the device tensors from the host description. `positions[t]` is the absolute
    /// position of packed token `t`; its K/V go to that position's block of its row.
    pub fn new(host: PagedBatchHost, block_size: usize, mask: AttnMask, kv_width: usize, device: &Device) -> Result<Self> {
        let rows = host.context_lens.len();
        if host.cu_q_lens.len() != rows + 1 || host.block_tables.len() != rows {
            candle_core::bail!("paged batch: {} rows but {} q offsets and {} tables", rows, host.cu_q_lens.len(), host.block_tables.len());
        }
        let max_blocks = host.block_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        if host.cu_q_lens.first() != Some(&0) || host.cu_q_lens.windows(2).any(|w| w[1] < w[0]) {
            candle_core::bail!("paged batch: query offsets {:?} must start at 0 and never decrease", host.cu_q_lens);
        }
        let tokens = *host.cu_q_lens.last().unwrap_or(&0) as usize;
        if !host.write_positions.is_empty() && host.write_positions.len() != tokens {
            candle_core::bail!("paged batch: {} write positions for {tokens} tokens", host.write_positions.len());
        }
        // The four sections are written straight into one packed buffer: one host-to-device
        // copy for all of them (each small copy is a synchronous round trip).
        let ([o_bt, o_cl, o_cu, o_sm], total) = packed_offsets(rows, max_blocks, tokens);
        let mut words = vec![0u32; total];
        words[o_cl..o_cl + rows].copy_from_slice(&host.context_lens);
        words[o_cu..o_cu + rows + 1].copy_from_slice(&host.cu_q_lens);
        let mut max_q_len = 0;
        for r in 0..rows {
            let table = &host.block_tables[r];
            words[o_bt + r * max_blocks..o_bt + r * max_blocks + table.len()].copy_from_slice(table);
            let q_len = (host.cu_q_lens[r + 1] - host.cu_q_lens[r]) as usize;
            let ctx = host.context_lens[r] as usize;
            if q_len > ctx || ctx > table.len() * block_size {
                candle_core::bail!("paged batch row {r}: q_len {q_len}, ctx {ctx}, {} blocks", table.len());
            }
            max_q_len = max_q_len.max(q_len);
            // Token t = cu_q_lens[r] + i of this row writes its K/V at the row's i-th position
            // (the offsets were checked to start at 0 and never decrease, so t < tokens).
            let first = host.cu_q_lens[r] as usize;
            for (i, pos) in host.row_positions(r).enumerate() {
                if pos >= table.len() * block_size {
                    candle_core::bail!("paged batch row {r}: write position {pos} past its {} blocks", table.len());
                }
                words[o_sm + first + i] = table[pos / block_size] * block_size as u32 + (pos % block_size) as u32;
            }
        }
        let max_context_len = host.context_lens.iter().copied().max().unwrap_or(0) as usize;
        let packed = Tensor::from_vec(words, total, device)?;
        let [block_tables, context_lens, cu_q_lens, slot_mapping] = packed_views(&packed, rows, max_blocks, tokens)?;
        Ok(Self {
            kv_width,
            write_index: Default::default(),
            block_tables,
            context_lens,
            cu_q_lens,
            slot_mapping,
            host,
            block_size,
            mask,
            max_q_len,
            max_context_len,
        })
    }

    /// Like [`PagedBatch::new`], but over the preallocated `buffers` instead of fresh tensors:
    /// writes the padded description of `host` into them (one host-to-device copy, see
    /// [`PagedBatchBuffers::write`]) and returns the batch over them. The batch's tensors keep
    /// the buffers' addresses from launch to launch, which a replayed CUDA graph needs.
    /// `max_context_len` is taken as given (at least every row's context; a graph bakes it in).
    #[allow(clippy::too_many_arguments)]
    pub fn fill(
        host: &PagedBatchHost,
        block_size: usize,
        mask: AttnMask,
        kv_width: usize,
        buffers: &PagedBatchBuffers,
        pad_block: u32,
        max_context_len: usize,
    ) -> Result<Self> {
        let padded = buffers.write(host, block_size, pad_block)?;
        Self::from_buffers(padded, block_size, mask, kv_width, buffers, max_context_len)
    }

    /// The batch over `buffers` that already hold `padded` (as returned by
    /// [`PagedBatchBuffers::write`]). Uploads nothing; its one device op (spreading
    /// `slot_mapping` into `write_index`) may run inside a CUDA-graph capture.
    pub fn from_buffers(
        padded: PagedBatchHost,
        block_size: usize,
        mask: AttnMask,
        kv_width: usize,
        buffers: &PagedBatchBuffers,
        max_context_len: usize,
    ) -> Result<Self> {
        let rows = padded.context_lens.len();
        if rows != buffers.rows {
            candle_core::bail!("paged batch: {rows} padded rows for buffers of {}", buffers.rows);
        }
        let max_q_len = padded.cu_q_lens.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        Ok(Self {
            kv_width,
            write_index: Default::default(),
            host: padded,
            block_size,
            mask,
            block_tables: buffers.block_tables.clone(),
            context_lens: buffers.context_lens.clone(),
            cu_q_lens: buffers.cu_q_lens.clone(),
            slot_mapping: buffers.slot_mapping.clone(),
            max_q_len,
            max_context_len,
        })
    }

    /// `slot_mapping` spread over one K (or V) row: the index form `scatter_set` wants.
    pub fn write_index(&self) -> Result<&Tensor> {
        if let Some(t) = self.write_index.get() {
            return Ok(t);
        }
        let tokens = self.slot_mapping.dim(0)?;
        let t = self.slot_mapping.unsqueeze(1)?.broadcast_as((tokens, self.kv_width))?.contiguous()?;
        Ok(self.write_index.get_or_init(|| t))
    }

    pub fn num_rows(&self) -> usize {
        self.host.context_lens.len()
    }

    pub fn num_tokens(&self) -> usize {
        *self.host.cu_q_lens.last().unwrap_or(&0) as usize
    }
}

/// Preallocated device tensors a [`PagedBatch`] is built over in place ([`PagedBatch::fill`]):
/// a fixed number of rows and tokens and a fixed table width. All four are views of one u32
/// buffer, so a launch's addressing goes to the device in one copy.
#[derive(Debug, Clone)]
pub struct PagedBatchBuffers {
    packed: Tensor,
    /// `[rows, max_blocks]`.
    pub block_tables: Tensor,
    /// `[rows]`.
    pub context_lens: Tensor,
    /// `[rows + 1]`.
    pub cu_q_lens: Tensor,
    /// `[tokens]`.
    pub slot_mapping: Tensor,
    rows: usize,
    tokens: usize,
    max_blocks: usize,
}

/// Sections of the packed buffer start on 16-byte boundaries.
fn align4(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// Where the four sections of one packed u32 buffer start, each on a 16-byte boundary — block
/// tables `[rows, max_blocks]`, context lengths `[rows]`, query offsets `[rows + 1]`, slots
/// `[tokens]` — and the buffer's length.
fn packed_offsets(rows: usize, max_blocks: usize, tokens: usize) -> ([usize; 4], usize) {
    let lens = [rows * max_blocks, rows, rows + 1, tokens];
    let mut starts = [0; 4];
    let mut end = 0;
    for (start, len) in starts.iter_mut().zip(lens) {
        *start = end;
        end += align4(len);
    }
    (starts, end)
}

/// The four sections of a packed buffer (see [`packed_offsets`]) as views of it.
fn packed_views(packed: &Tensor, rows: usize, max_blocks: usize, tokens: usize) -> Result<[Tensor; 4]> {
    let ([o_bt, o_cl, o_cu, o_sm], _) = packed_offsets(rows, max_blocks, tokens);
    Ok([
        packed.narrow(0, o_bt, rows * max_blocks)?.reshape((rows, max_blocks))?,
        packed.narrow(0, o_cl, rows)?,
        packed.narrow(0, o_cu, rows + 1)?,
        packed.narrow(0, o_sm, tokens)?,
    ])
}

impl PagedBatchBuffers {
    pub fn new(rows: usize, tokens: usize, max_blocks: usize, device: &Device) -> Result<Self> {
        if rows == 0 || tokens < rows || max_blocks == 0 {
            candle_core::bail!("paged batch buffers: {rows} rows, {tokens} tokens, {max_blocks} blocks");
        }
        let (_, total) = packed_offsets(rows, max_blocks, tokens);
        let packed = Tensor::zeros(total, DType::U32, device)?;
        let [block_tables, context_lens, cu_q_lens, slot_mapping] = packed_views(&packed, rows, max_blocks, tokens)?;
        Ok(Self { block_tables, context_lens, cu_q_lens, slot_mapping, packed, rows, tokens, max_blocks })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Writes `host` padded to the buffers' shape and returns the padded description. Rows past
    /// `host`'s are padding: one query token each, context 1, all in `pad_block` (a block no
    /// request owns, so their K/V writes land there). Each table is cut to `max_blocks` (the
    /// blocks past a row's context are never read) or filled up with `pad_block`.
    pub fn write(&self, host: &PagedBatchHost, block_size: usize, pad_block: u32) -> Result<PagedBatchHost> {
        let rows = host.context_lens.len();
        let real_tokens = *host.cu_q_lens.last().unwrap_or(&0) as usize;
        if host.cu_q_lens.len() != rows + 1 || host.block_tables.len() != rows {
            candle_core::bail!("paged batch: {} rows but {} q offsets and {} tables", rows, host.cu_q_lens.len(), host.block_tables.len());
        }
        if !host.write_positions.is_empty() {
            candle_core::bail!("paged batch buffers: explicit write positions are not supported in padded launches");
        }
        if rows > self.rows || real_tokens + (self.rows - rows) != self.tokens {
            candle_core::bail!("paged batch: {rows} rows / {real_tokens} tokens do not pad to {} rows / {} tokens", self.rows, self.tokens);
        }
        let mb = self.max_blocks;
        let mut padded = PagedBatchHost {
            block_tables: Vec::with_capacity(self.rows),
            context_lens: Vec::with_capacity(self.rows),
            cu_q_lens: host.cu_q_lens.clone(),
            write_positions: Vec::new(),
        };
        let mut words = vec![0u32; self.packed.elem_count()];
        let ([_, o_cl, o_cu, o_sm], _) = packed_offsets(self.rows, mb, self.tokens);
        let mut t = 0;
        for r in 0..self.rows {
            let (table, ctx, q_len) = if r < rows {
                let q_len = (host.cu_q_lens[r + 1] - host.cu_q_lens[r]) as usize;
                (&host.block_tables[r][..host.block_tables[r].len().min(mb)], host.context_lens[r] as usize, q_len)
            } else {
                (&[][..], 1, 1)
            };
            if q_len > ctx || ctx > mb * block_size || (r < rows && ctx > table.len() * block_size) {
                candle_core::bail!("paged batch row {r}: q_len {q_len}, ctx {ctx}, {} blocks (max {mb})", table.len());
            }
            let mut row = vec![pad_block; mb];
            row[..table.len()].copy_from_slice(table);
            for pos in ctx - q_len..ctx {
                words[o_sm + t] = row[pos / block_size] * block_size as u32 + (pos % block_size) as u32;
                t += 1;
            }
            words[r * mb..(r + 1) * mb].copy_from_slice(&row);
            words[o_cl + r] = ctx as u32;
            if r >= rows {
                padded.cu_q_lens.push(padded.cu_q_lens.last().unwrap() + 1);
            }
            padded.block_tables.push(row);
            padded.context_lens.push(ctx as u32);
        }
        words[o_cu..o_cu + self.rows + 1].copy_from_slice(&padded.cu_q_lens);
        write_u32(&self.packed, &words)?;
        Ok(padded)
    }
}

/// Overwrites the contiguous u32 tensor `dst` with `data` in place (on CUDA one asynchronous
/// host-to-device copy on the device's stream; the host data may be dropped on return).
pub fn write_u32(dst: &Tensor, data: &[u32]) -> Result<()> {
    if dst.dtype() != DType::U32 || !dst.is_contiguous() || dst.elem_count() != data.len() {
        candle_core::bail!("write_u32: {:?} {:?} tensor (contiguous: {}) for {} words", dst.dtype(), dst.dims(), dst.is_contiguous(), data.len());
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = dst.device() {
        use candle_core::cuda_backend::cudarc::driver::{result, DevicePtr};
        use candle_core::cuda_backend::WrapErr;
        let (storage, layout) = dst.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*storage else {
            candle_core::bail!("write_u32: not a CUDA tensor");
        };
        let start = layout.start_offset();
        let slice = cs.as_cuda_slice::<u32>()?;
        let view = slice.slice(start..start + data.len());
        let stream = dev.cuda_stream();
        let (ptr, _sync) = view.device_ptr(&stream);
        // SAFETY: `ptr` addresses `data.len()` u32 of `dst`; the copy is ordered on the stream
        // every use of `dst` goes through, and a pageable source is staged before return.
        unsafe { result::memcpy_htod_async(ptr, data, stream.cu_stream()) }.w()?;
        return Ok(());
    }
    let src = Tensor::from_slice(data, dst.shape(), dst.device())?;
    dst.slice_set(&src, 0, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_positions_implicit_given_and_short_context() {
        let mut host = PagedBatchHost::new();
        host.push_row(&[0], 5, 2, None);
        host.push_row(&[1], 3, 1, None);
        assert_eq!(host.row_positions(0).collect::<Vec<_>>(), [3, 4]);
        assert_eq!(host.row_positions(1).collect::<Vec<_>>(), [2]);
        // A row asking for more tokens than its context: no underflow (the batch rejects it).
        host.push_row(&[2], 1, 3, None);
        assert_eq!(host.row_positions(2).collect::<Vec<_>>(), [0]);
        assert!(PagedBatch::new(host, 4, AttnMask::Causal, 8, &Device::Cpu).is_err());

        let mut given = PagedBatchHost::new();
        given.push_row(&[0, 1], 8, 3, Some(&[1, 6, 2]));
        given.push_row(&[2], 2, 1, Some(&[0]));
        assert_eq!(given.row_positions(0).collect::<Vec<_>>(), [1, 6, 2]);
        assert_eq!(given.row_positions(1).collect::<Vec<_>>(), [0]);
        let batch = PagedBatch::new(given, 4, AttnMask::Causal, 8, &Device::Cpu).unwrap();
        // Slots: table[pos / 4] * 4 + pos % 4.
        assert_eq!(batch.slot_mapping.to_vec1::<u32>().unwrap(), [1, 6, 2, 8]);
    }
}
