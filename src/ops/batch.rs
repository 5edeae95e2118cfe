//! The per-launch attention metadata: where each row's queries sit and which cache blocks hold
//! its keys. Built once per launch (per cache slot) by the engine's runner and shared by every
//! layer that reads that slot.

use candle_core::{Device, Result, Tensor};

/// Which keys a query may attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnMask {
    /// Query `j` of a row with `q_len` queries and `ctx` keys sits at position `ctx - q_len + j`
    /// and sees keys `0..=ctx - q_len + j`.
    Causal,
    /// Every query sees all `ctx` keys of its row. Block-causal attention (SDAR) is this with
    /// `ctx` ending at the query block's end.
    Bidirectional,
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
}

/// Device-side addressing of one launch for one cache slot per row.
#[derive(Debug, Clone)]
pub struct PagedBatch {
    pub host: PagedBatchHost,
    pub block_size: usize,
    pub mask: AttnMask,
    /// `[rows, max_blocks]` u32, rows padded with zeros.
    pub block_tables: Tensor,
    /// `[rows]` u32.
    pub context_lens: Tensor,
    /// `[rows + 1]` u32.
    pub cu_q_lens: Tensor,
    /// `[tokens]` u32: flat cache row (`block * block_size + offset`) each new token writes.
    pub slot_mapping: Tensor,
    /// `[tokens, kv_width]` u32: `slot_mapping` spread over one K (or V) row, the index form
    /// `scatter_set` wants. Built once per launch, reused by every layer.
    pub write_index: Tensor,
    pub max_q_len: usize,
    pub max_context_len: usize,
}

impl PagedBatch {
    /// Builds the device tensors from the host description. `positions[t]` is the absolute
    /// position of packed token `t`; its K/V go to that position's block of its row.
    pub fn new(
        host: PagedBatchHost,
        block_size: usize,
        mask: AttnMask,
        kv_width: usize,
        device: &Device,
    ) -> Result<Self> {
        let rows = host.context_lens.len();
        if host.cu_q_lens.len() != rows + 1 || host.block_tables.len() != rows {
            candle_core::bail!("paged batch: {} rows but {} q offsets and {} tables", rows, host.cu_q_lens.len(), host.block_tables.len());
        }
        let max_blocks = host.block_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat_tables = vec![0u32; rows * max_blocks];
        let mut slot_mapping = Vec::with_capacity(*host.cu_q_lens.last().unwrap_or(&0) as usize);
        let mut max_q_len = 0;
        for r in 0..rows {
            let table = &host.block_tables[r];
            flat_tables[r * max_blocks..r * max_blocks + table.len()].copy_from_slice(table);
            let q_len = (host.cu_q_lens[r + 1] - host.cu_q_lens[r]) as usize;
            let ctx = host.context_lens[r] as usize;
            if q_len > ctx || ctx > table.len() * block_size {
                candle_core::bail!("paged batch row {r}: q_len {q_len}, ctx {ctx}, {} blocks", table.len());
            }
            max_q_len = max_q_len.max(q_len);
            for pos in ctx - q_len..ctx {
                slot_mapping.push(table[pos / block_size] * block_size as u32 + (pos % block_size) as u32);
            }
        }
        let max_context_len = host.context_lens.iter().copied().max().unwrap_or(0) as usize;
        let tokens = slot_mapping.len();
        let slot_mapping = Tensor::new(slot_mapping.as_slice(), device)?;
        let write_index = slot_mapping.unsqueeze(1)?.broadcast_as((tokens, kv_width))?.contiguous()?;
        Ok(Self {
            write_index,
            block_tables: Tensor::from_vec(flat_tables, (rows, max_blocks), device)?,
            context_lens: Tensor::new(host.context_lens.as_slice(), device)?,
            cu_q_lens: Tensor::new(host.cu_q_lens.as_slice(), device)?,
            slot_mapping,
            host,
            block_size,
            mask,
            max_q_len,
            max_context_len,
        })
    }

    pub fn num_rows(&self) -> usize {
        self.host.context_lens.len()
    }

    pub fn num_tokens(&self) -> usize {
        *self.host.cu_q_lens.last().unwrap_or(&0) as usize
    }
}
