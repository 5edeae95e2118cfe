//! Executes denoise launches on a diffusion model: packs the rows' tokens at their cache
//! positions, runs every layer (each writes the launch's K/V before attending), and reads back
//! the greedy token and its probability at the rows' readout tokens.

use crate::kv::KvStore;
use crate::models::diffusion::{DiffusionAttention, DiffusionModel};
use crate::ops::{AttnMask, PagedBatch, PagedBatchHost};
use crate::scheduler::{Launch, LaunchResult, RowOutput, Stage};
use candle_core::{DType, Device, Result, Tensor, D};

/// Owns the model and the device KV store; runs one launch at a time.
pub struct DiffusionRunner {
    model: Box<dyn DiffusionModel>,
    kv: KvStore,
    block_size: usize,
    mask: AttnMask,
    /// `[1, vocab]` f32: −∞ at the mask token, 0 elsewhere — a step never "reveals" a mask.
    no_mask_bias: Tensor,
}

/// Device tensors of one denoise launch, before readback.
pub struct DenoiseForward {
    /// `[readouts]` u32 greedy tokens.
    pub tokens: Tensor,
    /// `[readouts]` f32 probability of each greedy token.
    pub confidence: Tensor,
    /// Readouts per launch row.
    pub per_row: Vec<usize>,
}

impl DiffusionRunner {
    /// A KV store of `num_blocks` blocks of `block_size` positions; block-causal models attend
    /// with blocks of `block_length` (the decoding block).
    pub fn new(model: Box<dyn DiffusionModel>, num_blocks: usize, block_size: usize, block_length: usize) -> Result<Self> {
        let s = model.spec();
        let kv = KvStore::new(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, s.dtype, model.device())?;
        let mask = match s.attention {
            DiffusionAttention::BlockCausal => AttnMask::BlockCausal(block_length),
            DiffusionAttention::Bidirectional => AttnMask::Bidirectional,
        };
        let mut bias = vec![0f32; s.vocab_size];
        if let Some(b) = bias.get_mut(s.mask_token_id as usize) {
            *b = f32::NEG_INFINITY;
        }
        let no_mask_bias = Tensor::from_vec(bias, (1, s.vocab_size), model.device())?;
        Ok(Self { model, kv, block_size, mask, no_mask_bias })
    }

    pub fn model(&self) -> &dyn DiffusionModel {
        self.model.as_ref()
    }
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Runs `launch` and reads its results back (one synchronisation per launch).
    pub fn run(&self, launch: &Launch) -> Result<LaunchResult> {
        let fwd = self.forward(launch)?;
        let tokens = fwd.tokens.to_vec1::<u32>()?;
        let conf = fwd.confidence.to_vec1::<f32>()?;
        let mut at = 0;
        let rows = launch
            .rows
            .iter()
            .zip(&fwd.per_row)
            .map(|(row, &n)| {
                let candidates = tokens[at..at + n].iter().copied().zip(conf[at..at + n].iter().copied()).collect();
                at += n;
                RowOutput { request: row.request, token: None, gate_logits: vec![], latent_diff: None, logprob: None, candidates }
            })
            .collect();
        Ok(LaunchResult { rows })
    }

    /// Runs `launch` on the device; results stay there.
    pub fn forward(&self, launch: &Launch) -> Result<DenoiseForward> {
        if launch.stage != Stage::Denoise {
            candle_core::bail!("a diffusion model runs denoise launches, not {:?}", launch.stage);
        }
        let spec = self.model.spec();
        let dev = self.model.device();
        let mut host = PagedBatchHost { cu_q_lens: vec![0], ..Default::default() };
        let (mut ids, mut readout, mut per_row) = (Vec::new(), Vec::new(), Vec::with_capacity(launch.rows.len()));
        for row in &launch.rows {
            let base = ids.len() as u32;
            if let Some(&bad) = row.tokens.iter().find(|&&t| t as usize >= spec.vocab_size) {
                candle_core::bail!("token {bad} outside the vocabulary of {}", spec.vocab_size);
            }
            ids.extend_from_slice(&row.tokens);
            host.write_positions.extend(row.token_positions());
            host.block_tables.push(row.block_tables[0].to_vec());
            host.context_lens.push(row.context_len() as u32);
            host.cu_q_lens.push(ids.len() as u32);
            readout.extend(row.readout.iter().map(|&i| base + i));
            per_row.push(row.readout.len());
        }
        let positions = Tensor::new(host.write_positions.as_slice(), dev)?;
        let batch = PagedBatch::new(host, self.block_size, self.mask, spec.num_kv_heads * spec.head_dim, dev)?;
        let h = self.model.embed(&Tensor::new(ids.as_slice(), dev)?)?;
        let rope = self.model.rope(&positions)?;
        let h = self.model.forward(&h, &rope, &batch, &self.kv)?;
        if readout.is_empty() {
            let empty_u = Tensor::zeros(0, DType::U32, dev)?;
            return Ok(DenoiseForward { tokens: empty_u, confidence: Tensor::zeros(0, DType::F32, dev)?, per_row });
        }
        let h = h.index_select(&Tensor::new(readout.as_slice(), dev)?, 0)?;
        let logits = self.model.head(&h)?.broadcast_add(&self.no_mask_bias)?;
        let (tokens, confidence) = greedy_with_confidence(&logits)?;
        Ok(DenoiseForward { tokens, confidence, per_row })
    }
}

/// Per row of f32 `logits` `[n, vocab]`: the argmax and its softmax probability
/// `1 / Σ exp(l − max)`.
pub fn greedy_with_confidence(logits: &Tensor) -> Result<(Tensor, Tensor)> {
    let tokens = logits.argmax(D::Minus1)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let z = logits.broadcast_sub(&max)?.exp()?.sum(D::Minus1)?;
    Ok((tokens, z.recip()?))
}
