//! Masked-token prediction on held-out text, straight through a block-diffusion model's API:
//! windows of `SEQ` tokens; for every block b and mask ratio r, each token of block b is
//! replaced by the mask token with probability r (seeded), blocks 0..b stay clean as context
//! (block-causal attention), and the masked positions are scored — argmax accuracy and
//! cross-entropy. One launch per window: a clean row that writes the window's K/V, plus one
//! row per (ratio, block) whose pages are the clean pages of the earlier blocks and a private
//! page for its noisy block.

use candle_core::{DType, Device, Tensor};
use ponder::diffusion::models::DiffusionModel;
use ponder::kv::KvStore;
use ponder::ops::{AttnMask, PagedBatch, PagedBatchHost};

pub const SEQ: usize = 256;
pub const RATIOS: [f64; 4] = [0.15, 0.5, 0.85, 1.0];

/// A seeded uniform stream (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Masked tokens scored at one ratio: summed negative log-likelihood, argmax hits, count.
#[derive(Default, Clone, Copy, Debug)]
pub struct MaskedStats {
    pub nll: f64,
    pub correct: u64,
    pub count: u64,
}

/// The masked-token statistics per ratio of [`RATIOS`] over `windows` (each `SEQ` tokens), masks
/// drawn from `seed`; `on_window` is called after each window (progress).
pub fn masked_token_stats(
    model: &dyn DiffusionModel,
    windows: &[&[u32]],
    seed: u64,
    mut on_window: impl FnMut(),
) -> Result<[MaskedStats; RATIOS.len()], Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let spec = model.spec().clone();
    let b = spec.block_length.ok_or("the model's config names no block length")?;
    if SEQ % b != 0 {
        return Err(format!("block length {b} must divide {SEQ}").into());
    }
    let blocks = SEQ / b;
    let kv = KvStore::new(spec.num_layers, blocks * (1 + RATIOS.len()), b, spec.num_kv_heads, spec.head_dim, DType::F32, &dev)?;
    let mut rng = Rng(seed);
    let mut stats = [MaskedStats::default(); RATIOS.len()];
    for w in windows {
        let mut host = PagedBatchHost { cu_q_lens: vec![0], ..Default::default() };
        let (mut toks, mut positions, mut readout, mut truth) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let clean_pages: Vec<u32> = (0..blocks as u32).collect();
        toks.extend_from_slice(w);
        positions.extend(0..SEQ as u32);
        host.block_tables.push(clean_pages.clone());
        host.context_lens.push(SEQ as u32);
        host.cu_q_lens.push(SEQ as u32);
        for (ri, &r) in RATIOS.iter().enumerate() {
            for blk in 0..blocks {
                let masked: Vec<usize> = (0..b).filter(|_| rng.uniform() < r).collect();
                if masked.is_empty() {
                    continue;
                }
                let base = toks.len();
                let lo = blk * b;
                let mut noisy = w[lo..lo + b].to_vec();
                for &i in &masked {
                    noisy[i] = spec.mask_token_id;
                    readout.push((base + i) as u32);
                    truth.push((ri, w[lo + i]));
                }
                toks.extend_from_slice(&noisy);
                positions.extend((lo..lo + b).map(|p| p as u32));
                let mut table = clean_pages[..blk].to_vec();
                table.push((blocks * (1 + ri) + blk) as u32);
                host.block_tables.push(table);
                host.context_lens.push((lo + b) as u32);
                host.cu_q_lens.push(toks.len() as u32);
            }
        }
        host.write_positions = positions.clone();
        let batch = PagedBatch::new(host, b, AttnMask::BlockCausal(b), spec.num_kv_heads * spec.head_dim, &dev)?;
        let h = model.embed(&Tensor::new(toks.as_slice(), &dev)?)?;
        let rope = model.rope(&Tensor::new(positions.as_slice(), &dev)?)?;
        let h = model.forward(&h, &rope, &batch, &kv)?;
        let logits = model.head(&h.index_select(&Tensor::new(readout.as_slice(), &dev)?, 0)?)?.to_vec2::<f32>()?;
        for (row, &(ri, t)) in logits.iter().zip(&truth) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            let argmax = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32);
            let s = &mut stats[ri];
            s.nll += lse - row[t as usize] as f64;
            s.correct += (argmax == Some(t)) as u64;
            s.count += 1;
        }
        on_window();
    }
    Ok(stats)
}
