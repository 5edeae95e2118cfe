//! Executes denoise launches on a diffusion model: packs the rows' tokens at their cache
//! positions, runs every layer (each writes the launch's K/V before attending), and reads back
//! the greedy token and its probability at the rows' readout tokens.

use crate::diffusion::models::{DiffusionAttention, DiffusionModel};
use crate::diffusion::sampling::sampled_readout;
use crate::diffusion::{Confidence, EvictionInput, EvictionPolicy, StepDraw};
use crate::diffusion::{DenoiseLaunch, DenoiseResult, DenoiseRow, DenoiseRowOutput};
use crate::kv::KvStore;
use crate::ops::{compact_rows, importance_of, AttnMask, PagedBatch, PagedBatchHost, RopeAngles};
use candle_core::{DType, Device, Result, Tensor, D};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// After eviction: the final residual stream, the addressing it is packed by, and each row's
/// kept token indices (`None` for rows not scored).
type Evicted = (Tensor, PagedBatchHost, Vec<Option<Vec<u32>>>);

/// Readouts a sampled readout takes at once: it holds a few `[rows, vocab]` f32 temporaries
/// (≈ 150 MB each at 256 rows of a 150k vocabulary).
const SAMPLED_CHUNK: usize = 256;

/// Accumulated wall time per phase of the denoise launches, in first-seen order.
pub type PhaseTimes = Vec<(&'static str, Duration)>;

/// Owns the model and the device KV store; runs one launch at a time.
pub struct DiffusionRunner {
    model: Box<dyn DiffusionModel>,
    kv: KvStore,
    block_size: usize,
    mask: AttnMask,
    /// `[1, vocab]` f32: −∞ at the mask token, 0 elsewhere — a step never "reveals" a mask.
    no_mask_bias: Tensor,
    /// Which masked tokens run past layer 1 (FOCUS); `shadow`: select but run everything.
    eviction: Option<std::sync::Arc<dyn EvictionPolicy>>,
    shadow: bool,
    /// When set, launches synchronise the device at each phase boundary and add the phase's
    /// wall time here (profiling: it costs the host/device overlap within a launch).
    phases: Option<Mutex<PhaseTimes>>,
    num_blocks: usize,
    /// Check each launch before running it (custom diffusion schedulers).
    check_launches: bool,
    /// What the readout's confidence measures.
    confidence: Confidence,
}

/// Marks phase boundaries of one launch (a no-op unless phase timing is on).
struct Lap<'a> {
    clock: Option<(Instant, &'a Mutex<PhaseTimes>)>,
    device: &'a Device,
}

impl Lap<'_> {
    fn mark(&mut self, phase: &'static str) -> Result<()> {
        if let Some((since, acc)) = &mut self.clock {
            self.device.synchronize()?;
            let now = Instant::now();
            let mut acc = acc.lock().expect("phase clock poisoned");
            match acc.iter_mut().find(|(p, _)| *p == phase) {
                Some((_, d)) => *d += now - *since,
                None => acc.push((phase, now - *since)),
            }
            *since = now;
        }
        Ok(())
    }
}

/// Device tensors of one denoise launch, before readback.
pub struct DenoiseForward {
    /// `[readouts]` u32 greedy tokens.
    pub tokens: Tensor,
    /// `[readouts]` f32 probability of each greedy token.
    pub confidence: Tensor,
    /// Readouts per launch row (the kept ones, when tokens were evicted).
    pub per_row: Vec<usize>,
    /// Per launch row, the token indices that ran past layer 1 (rows an eviction policy scored).
    pub kept: Vec<Option<Vec<u32>>>,
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
        Ok(Self {
            model,
            kv,
            block_size,
            mask,
            no_mask_bias,
            eviction: None,
            shadow: false,
            phases: None,
            num_blocks,
            check_launches: false,
            confidence: Confidence::Probability,
        })
    }

    /// What the readout's confidence measures (the unmask policy's [`UnmaskPolicy::confidence`]).
    ///
    /// [`UnmaskPolicy::confidence`]: crate::diffusion::UnmaskPolicy::confidence
    pub fn with_confidence(mut self, confidence: Confidence) -> Self {
        self.confidence = confidence;
        self
    }

    /// Times each phase of every launch (device synchronised between phases); read the totals
    /// with [`DiffusionRunner::phase_times`].
    pub fn with_phase_timing(mut self, on: bool) -> Self {
        self.phases = on.then(|| Mutex::new(Vec::new()));
        self
    }

    /// Wall time per phase over all launches so far (empty unless phase timing is on).
    pub fn phase_times(&self) -> PhaseTimes {
        self.phases.as_ref().map(|p| p.lock().expect("phase clock poisoned").clone()).unwrap_or_default()
    }

    fn lap(&self) -> Lap<'_> {
        Lap { clock: self.phases.as_ref().map(|p| (Instant::now(), p)), device: self.model.device() }
    }

    /// Checks each launch before running it (launches from a custom diffusion scheduler): a
    /// readout index, position, block or token out of range is an error for that launch.
    pub fn with_launch_checks(mut self, on: bool) -> Self {
        self.check_launches = on;
        self
    }

    /// Applies `policy` to denoise steps whose rows carry [`crate::diffusion::EvictRow`]s; with
    /// `shadow` every token still runs and the rows only report what would have been kept.
    /// The ranks of a tensor-parallel group share one policy (a function of its input: every
    /// rank keeps the same tokens).
    pub fn with_eviction(mut self, policy: Option<std::sync::Arc<dyn EvictionPolicy>>, shadow: bool) -> Self {
        self.eviction = policy;
        self.shadow = shadow;
        self
    }

    pub fn model(&self) -> &dyn DiffusionModel {
        self.model.as_ref()
    }
    #[cfg(any(test, feature = "testing"))]
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Runs `launch` and reads its results back (one synchronisation per launch). `draws` holds,
    /// per row, the step's draws of a sampling request (`None` or absent: greedy).
    pub fn run(&self, launch: &DenoiseLaunch, draws: &[Option<StepDraw>]) -> Result<DenoiseResult> {
        let mut lap = self.lap();
        let fwd = self.forward_lapped(launch, draws, &mut lap)?;
        let tokens = fwd.tokens.to_vec1::<u32>()?;
        let conf = fwd.confidence.to_vec1::<f32>()?;
        lap.mark("lm head + readout")?;
        let mut at = 0;
        let rows = launch
            .rows
            .iter()
            .zip(&fwd.per_row)
            .map(|(row, &n)| {
                let candidates = tokens[at..at + n].iter().copied().zip(conf[at..at + n].iter().copied()).collect();
                at += n;
                DenoiseRowOutput::new(row.request, candidates)
            })
            .zip(fwd.kept)
            .map(|(mut out, kept)| {
                out.kept = kept;
                out
            })
            .collect();
        Ok(DenoiseResult { rows, ..Default::default() })
    }

    /// Runs `launch` on the device; results stay there.
    #[cfg(any(test, feature = "testing"))]
    pub fn forward(&self, launch: &DenoiseLaunch) -> Result<DenoiseForward> {
        self.forward_lapped(launch, &[], &mut Lap { clock: None, device: self.model.device() })
    }

    fn forward_lapped(&self, launch: &DenoiseLaunch, draws: &[Option<StepDraw>], lap: &mut Lap) -> Result<DenoiseForward> {
        if self.check_launches {
            let spec = self.model.spec();
            let bounds =
                crate::engine::launch_check::Bounds { num_blocks: self.num_blocks, block_size: self.block_size, bank_rows: 0, vocab_size: spec.vocab_size };
            crate::engine::launch_check::check_denoise(launch, &bounds).map_err(|e| candle_core::Error::Msg(format!("invalid launch: {e}")))?;
        }
        let spec = self.model.spec();
        let dev = self.model.device();
        let mut host = PagedBatchHost::new();
        let mut ids = Vec::new();
        for row in &launch.rows {
            if let Some(&bad) = row.tokens.iter().find(|&&t| t as usize >= spec.vocab_size) {
                candle_core::bail!("token {bad} outside the vocabulary of {}", spec.vocab_size);
            }
            ids.extend_from_slice(&row.tokens);
            host.push_row(&row.block_table, row.context_len(), row.tokens.len(), Some(&row.positions));
        }
        let positions = Tensor::new(host.write_positions.as_slice(), dev)?;
        let rope = self.model.rope(&positions)?;
        let h = self.model.embed(&Tensor::new(ids.as_slice(), dev)?)?;
        lap.mark("embed + rope")?;
        let scored = match &self.eviction {
            Some(p) if spec.num_layers >= 2 && launch.rows.iter().any(|r| r.evict.is_some() && !r.readout.is_empty()) => Some(p.as_ref()),
            _ => None,
        };
        let (h, host, kept) = match scored {
            None => {
                let batch = PagedBatch::new(host.clone(), self.block_size, self.mask, spec.num_kv_heads * spec.head_dim, dev)?;
                let h = self.model.forward(&h, &rope, &batch, &self.kv)?;
                lap.mark("layers")?;
                (h, host, vec![None; launch.rows.len()])
            }
            Some(policy) => self.forward_evicting(launch, policy, h, &rope, host, lap)?,
        };
        // Read out the readout tokens that ran to the end, in row order, each with its draw.
        let (mut readout, mut per_row, mut rows) = (Vec::new(), Vec::with_capacity(launch.rows.len()), Vec::new());
        for (r, row) in launch.rows.iter().enumerate() {
            let base = host.cu_q_lens[r];
            let before = readout.len();
            let draw = draws.get(r).copied().flatten();
            for &i in &row.readout {
                let at = match &kept[r] {
                    Some(k) if !self.shadow => match k.binary_search(&i) {
                        Ok(at) => at as u32,
                        Err(_) => continue,
                    },
                    _ => i,
                };
                readout.push(base + at);
                rows.push(draw.map(|d| d.row(row.positions[i as usize])));
            }
            per_row.push(readout.len() - before);
        }
        if readout.is_empty() {
            let empty_u = Tensor::zeros(0, DType::U32, dev)?;
            return Ok(DenoiseForward { tokens: empty_u, confidence: Tensor::zeros(0, DType::F32, dev)?, per_row, kept });
        }
        let h = h.index_select(&Tensor::new(readout.as_slice(), dev)?, 0)?;
        let (tokens, confidence) = if rows.iter().all(Option::is_none) { self.greedy_readout(&h)? } else { self.mixed_readout(&h, &rows)? };
        Ok(DenoiseForward { tokens, confidence, per_row, kept })
    }

    /// A launch whose readouts sample (`Some` draws) and decode greedily (`None`): each part
    /// read out on its own, so a greedy request's tokens do not depend on its batch, then put
    /// back in readout order.
    fn mixed_readout(&self, h: &Tensor, rows: &[Option<crate::sampling::RowSampling>]) -> Result<(Tensor, Tensor)> {
        let dev = h.device();
        let (sampled, greedy): (Vec<u32>, Vec<u32>) = (0..rows.len() as u32).partition(|&i| rows[i as usize].is_some());
        let draws: Vec<_> = rows.iter().flatten().copied().collect();
        let (mut tokens, mut confidence) = (Vec::new(), Vec::new());
        for (at, draws) in sampled.chunks(SAMPLED_CHUNK).zip(draws.chunks(SAMPLED_CHUNK)) {
            let logits = self.model.head(&h.index_select(&Tensor::new(at, dev)?, 0)?)?.broadcast_add(&self.no_mask_bias)?;
            let (t, c) = sampled_readout(&logits, draws, self.model.spec().sampler, self.confidence)?;
            tokens.push(t);
            confidence.push(c);
        }
        let (mut tokens, mut confidence) = (Tensor::cat(&tokens, 0)?, Tensor::cat(&confidence, 0)?);
        if !greedy.is_empty() {
            let (t, c) = self.greedy_readout(&h.index_select(&Tensor::new(greedy.as_slice(), dev)?, 0)?)?;
            let order: Vec<u32> = sampled.iter().chain(&greedy).copied().collect();
            let mut inverse = vec![0u32; order.len()];
            for (at, &i) in order.iter().enumerate() {
                inverse[i as usize] = at as u32;
            }
            let inverse = Tensor::new(inverse.as_slice(), dev)?;
            tokens = Tensor::cat(&[&tokens, &t.to_dtype(tokens.dtype())?], 0)?.index_select(&inverse, 0)?;
            confidence = Tensor::cat(&[&confidence, &c.to_dtype(candle_core::DType::F32)?], 0)?.index_select(&inverse, 0)?;
        }
        Ok((tokens, confidence))
    }

    fn greedy_readout(&self, h: &Tensor) -> Result<(Tensor, Tensor)> {
        match self.confidence {
            Confidence::Probability => greedy_readout(self.model.as_ref(), h, &self.no_mask_bias),
            kind => readout_with(&self.model.head(h)?.broadcast_add(&self.no_mask_bias)?, kind),
        }
    }

    /// Layers 0 and 1 over every token with the masked tokens scored at both; the policy picks
    /// each scored row's kept tokens; unless in shadow mode, the rest of the network runs on the
    /// kept tokens only (layer-1 K/V were written for all of them first). Returns the final
    /// residual stream, the addressing it is packed by, and each row's kept token indices.
    fn forward_evicting(
        &self,
        launch: &DenoiseLaunch,
        policy: &dyn EvictionPolicy,
        h: Tensor,
        rope: &RopeAngles,
        host: PagedBatchHost,
        lap: &mut Lap,
    ) -> Result<Evicted> {
        let spec = self.model.spec();
        let dev = self.model.device();
        let kv_width = spec.num_kv_heads * spec.head_dim;
        let batch = PagedBatch::new(host.clone(), self.block_size, self.mask, kv_width, dev)?;
        let scored: Vec<usize> = (0..launch.rows.len()).filter(|&r| launch.rows[r].evict.is_some() && !launch.rows[r].readout.is_empty()).collect();
        // Masked tokens of the scored rows, padded to the longest (padding reads token 0).
        let lens: Vec<usize> = scored.iter().map(|&r| launch.rows[r].readout.len()).collect();
        let m = lens.iter().copied().max().unwrap_or(0);
        let mut gather = vec![0u32; scored.len() * m];
        for (i, &r) in scored.iter().enumerate() {
            for (j, &t) in launch.rows[r].readout.iter().enumerate() {
                gather[i * m + j] = host.cu_q_lens[r] + t;
            }
        }
        let gather = Tensor::new(gather.as_slice(), dev)?;
        // Layer 0 over every token, its importance scored on the way.
        let p0 = self.model.project_write(0, &h, rope, &batch, &self.kv)?;
        let imp0 = importance_of(&p0.q, &p0.k, &gather, &lens, m, spec.dtype)?;
        let h = self.model.finish_layer(0, &h, &p0.q, &batch, &self.kv)?;
        // Layer 0's q/k/v are done with: free them before the deeper layers run (peak memory).
        drop(p0);
        // Layer 1 up to its K/V write (for every token), then the rise of the importance.
        let p1 = self.model.project_write(1, &h, rope, &batch, &self.kv)?;
        let imp1 = importance_of(&p1.q, &p1.k, &gather, &lens, m, spec.dtype)?;
        // Each tensor-parallel rank scored its own heads: the sum is the model's, and every rank
        // keeps the same tokens.
        let delta = self.model.sum_over_ranks(&(imp1 - imp0)?)?;
        lap.mark("layers 0-1 + importance")?;
        let kept = self.select(launch, policy, &scored, &delta.to_vec2::<f32>()?)?;
        lap.mark("selection")?;
        if self.shadow {
            let mut h = self.model.finish_layer(1, &h, &p1.q, &batch, &self.kv)?;
            for l in 2..spec.num_layers {
                h = self.model.layer(l, &h, rope, &batch, &self.kv)?;
            }
            lap.mark("layers past 1")?;
            return Ok((h, host, kept));
        }
        // Compact to the kept tokens: each row sees keys up to its rightmost kept one.
        let mut host_k = PagedBatchHost::new();
        let mut index = Vec::new();
        for (r, row) in launch.rows.iter().enumerate() {
            let keep: Vec<u32> = match &kept[r] {
                Some(k) => k.clone(),
                None => (0..row.tokens.len() as u32).collect(),
            };
            let positions: Vec<u32> = keep.iter().map(|&i| row.positions[i as usize]).collect();
            index.extend(keep.iter().map(|&i| host.cu_q_lens[r] + i));
            let context = positions.last().map_or(0, |&p| p as usize + 1);
            host_k.push_row(&host.block_tables[r], context, keep.len(), Some(&positions));
        }
        let [h_k, q_k, cos, sin]: [Tensor; 4] = compact_rows(&[&h, &p1.q, &rope.cos, &rope.sin], &index)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("compact_rows returned the wrong number of tensors".into()))?;
        // The full-width residual and queries are done with once compacted (peak memory).
        drop(h);
        drop(p1);
        let rope_k = RopeAngles { cos, sin };
        let batch_k = PagedBatch::new(host_k.clone(), self.block_size, self.mask, kv_width, dev)?;
        lap.mark("compaction")?;
        let mut h = self.model.finish_layer(1, &h_k, &q_k, &batch_k, &self.kv)?;
        for l in 2..spec.num_layers {
            h = self.model.layer(l, &h, &rope_k, &batch_k, &self.kv)?;
        }
        lap.mark("layers past 1")?;
        Ok((h, host_k, kept))
    }

    /// The policy's kept set per scored row: its unmasked tokens plus the masked ones it keeps,
    /// as ascending token indices.
    fn select(&self, launch: &DenoiseLaunch, policy: &dyn EvictionPolicy, scored: &[usize], delta: &[Vec<f32>]) -> Result<Vec<Option<Vec<u32>>>> {
        let mut kept = vec![None; launch.rows.len()];
        let launch_tokens = launch.rows.iter().map(|r| r.tokens.len()).sum();
        for (i, &r) in scored.iter().enumerate() {
            let row: &DenoiseRow = &launch.rows[r];
            let ev = row.evict.expect("scored rows carry block state");
            let pos = &row.positions;
            let offsets: Vec<u32> = row.readout.iter().map(|&t| pos[t as usize] - ev.block_start).collect();
            let keep = policy.keep(&EvictionInput {
                delta: &delta[i][..row.readout.len()],
                positions: &offsets,
                avg_decoded: ev.avg_decoded(),
                block_progress: ev.block_progress,
                launch_tokens,
            });
            if keep.len() != row.readout.len() {
                candle_core::bail!("eviction policy {} returned {} flags for {} masked tokens", policy.name(), keep.len(), row.readout.len());
            }
            // A step must be able to reveal something: a policy that keeps none of a row's
            // masked tokens is overruled for that row (everything kept).
            if !row.readout.is_empty() && !keep.iter().any(|&k| k) {
                continue;
            }
            let mut keep_token = vec![true; row.tokens.len()];
            for (&t, &k) in row.readout.iter().zip(&keep) {
                keep_token[t as usize] &= k;
            }
            kept[r] = Some((0..row.tokens.len() as u32).filter(|&t| keep_token[t as usize]).collect());
        }
        Ok(kept)
    }
}

/// The final norm and LM head over `h` `[n, hidden]` reduced to each row's greedy token (never
/// the mask token) and its probability. On CUDA one pass over the logits in the model dtype;
/// elsewhere via f32 logits plus `no_mask_bias` (`[1, vocab]`, −∞ at the mask token).
pub fn greedy_readout(model: &dyn DiffusionModel, h: &Tensor, no_mask_bias: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if h.device().is_cuda() {
        let mask = model.spec().mask_token_id;
        return crate::ops::cuda::greedy_confidence(&model.head_native(h)?, Some(mask));
    }
    let logits = model.head(h)?.broadcast_add(no_mask_bias)?;
    greedy_with_confidence(&logits)
}

/// Per row of f32 `logits` `[n, vocab]` (−∞ at the mask token): the argmax and the confidence
/// `kind` of the softmax distribution. Top-2 without a sort: the argmax's probability is
/// replaced by −1 and the maximum taken again.
pub fn readout_with(logits: &Tensor, kind: Confidence) -> Result<(Tensor, Tensor)> {
    if kind == Confidence::Probability {
        return greedy_with_confidence(logits);
    }
    let tokens = logits.argmax(D::Minus1)?;
    let confidence = spread(&candle_nn::ops::softmax_last_dim(logits)?, &tokens, kind)?;
    Ok((tokens, confidence))
}

/// Per row of a distribution `dist` `[n, vocab]` whose most probable tokens are `top` `[n]`: the
/// top-1 minus top-2 probability (`Margin`) or Σ p·ln(p + 1e-10) (`NegEntropy`, also for
/// `Probability`, which callers read off the drawn token instead). Top-2 without a sort: the
/// top token's probability is replaced by −1 and the maximum taken again.
pub(crate) fn spread(dist: &Tensor, top: &Tensor, kind: Confidence) -> Result<Tensor> {
    match kind {
        Confidence::Margin => {
            let vocab = dist.dim(D::Minus1)? as u32;
            let is_top = Tensor::arange(0, vocab, dist.device())?.unsqueeze(0)?.broadcast_eq(&top.unsqueeze(1)?)?;
            let others = is_top.where_cond(&dist.ones_like()?.neg()?, dist)?;
            (dist.max_keepdim(D::Minus1)? - others.max_keepdim(D::Minus1)?)?.squeeze(1)
        }
        _ => (dist * (dist + 1e-10)?.log()?)?.sum(D::Minus1),
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
