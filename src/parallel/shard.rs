//! Tensor-parallel shares of a layer: which output rows (a column-parallel layer: q, k, v by
//! heads; gate and up by columns) or input columns (a row-parallel layer: the attention output
//! and down projections, whose partial outputs the ranks sum with one all-reduce) a rank holds.
//! Shares are contiguous and equal, in whole units (a head), so every rank's heads meet their
//! own K/V heads under grouped-query attention.

use crate::ops::Linear;
use crate::{Error, Result};
use std::ops::Range;

/// A rank's place in a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub world: usize,
}

impl TpRank {
    pub fn new(rank: usize, world: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidOption(format!("rank {rank} of a tensor-parallel group of {world}")));
        }
        Ok(Self { rank, world })
    }

    /// This rank's share of `n` rows or columns, in whole `unit`s (1, or a head's width):
    /// an error naming `what` unless the units divide evenly over the ranks.
    pub fn share(&self, n: usize, unit: usize, what: &str) -> Result<Range<usize>> {
        if unit == 0 || n % unit != 0 || (n / unit) % self.world != 0 {
            return Err(Error::InvalidOption(format!(
                "tensor parallelism over {} ranks: {what} ({} of {unit}) does not split evenly",
                self.world,
                n / unit.max(1)
            )));
        }
        let per = n / self.world;
        Ok(self.rank * per..(self.rank + 1) * per)
    }

    /// This rank's rows of a fused column-parallel layer whose output stacks `parts` (rows,
    /// unit, name: q | k | v by heads, gate | up by columns): its share of each part, offset
    /// to where the part starts, in part order.
    pub fn fused_rows(&self, parts: &[(usize, usize, &str)]) -> Result<Vec<Range<usize>>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(parts.len());
        for &(rows, unit, what) in parts {
            let r = self.share(rows, unit, what)?;
            out.push(start + r.start..start + r.end);
            start += rows;
        }
        Ok(out)
    }

    /// This rank's K/V heads of `kv_heads` (`heads` query heads): an even share where they
    /// divide by the ranks; where the ranks are a multiple of them instead (more GPUs than K/V
    /// heads, as LLaDA2.0-flash's 4 over 8), the one K/V head its query heads read, a copy of
    /// which every rank of its group of `world / kv_heads` holds (as vLLM replicates them).
    pub fn kv_share(&self, kv_heads: usize, heads: usize) -> Result<Range<usize>> {
        if kv_heads > 0 && kv_heads % self.world == 0 {
            return self.share(kv_heads, 1, "K/V heads");
        }
        if kv_heads > 0 && self.world % kv_heads == 0 && heads % self.world == 0 && heads % kv_heads == 0 {
            let head = self.rank / (self.world / kv_heads);
            return Ok(head..head + 1);
        }
        Err(Error::InvalidOption(format!(
            "tensor parallelism over {} ranks: {kv_heads} K/V heads ({heads} attention heads) neither split evenly over the ranks nor evenly replicate onto them",
            self.world
        )))
    }

    /// How many K/V heads a rank holds ([`TpRank::kv_share`]): its share, or the one copy.
    pub fn kv_heads_per_rank(&self, kv_heads: usize) -> usize {
        if kv_heads % self.world == 0 {
            kv_heads / self.world
        } else {
            1
        }
    }

    /// This rank's share of an attention block: the fused q | k | v projection by whole heads
    /// (column-parallel; its K/V heads as [`TpRank::kv_share`] gives them) and the output
    /// projection over its query heads' columns (row-parallel).
    pub(crate) fn attention(&self, qkv: &Linear, o: &Linear, heads: usize, kv_heads: usize, head_dim: usize) -> Result<(Linear, Linear)> {
        let q = self.share(heads * head_dim, head_dim, "attention heads")?;
        let kv = self.kv_share(kv_heads, heads)?;
        let (k0, v0) = (heads * head_dim, (heads + kv_heads) * head_dim);
        let rows = [q.clone(), k0 + kv.start * head_dim..k0 + kv.end * head_dim, v0 + kv.start * head_dim..v0 + kv.end * head_dim];
        Ok((qkv.output_rows(&rows)?, o.input_columns(q)?))
    }

    /// This rank's rows of an LM head `[rows, hidden]` (vocabulary-parallel): the `rank`-th of
    /// `world` equal contiguous shares of `ceil(rows / world)` rows, the last ones padded with
    /// zero rows, so that every rank gathers logits of the same width
    /// ([`crate::parallel::TpShard::gather_vocab`] trims the padding). A share of a tied
    /// embedding is a view of it, not a copy, unless it needs padding.
    pub(crate) fn vocab_share(&self, head: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        let (rows, hidden) = head.dims2()?;
        let per = rows.div_ceil(self.world);
        let start = (self.rank * per).min(rows);
        let held = ((self.rank + 1) * per).min(rows) - start;
        if held == per {
            return head.narrow(0, start, per);
        }
        let pad = candle_core::Tensor::zeros((per - held, hidden), head.dtype(), head.device())?;
        if held == 0 {
            return Ok(pad);
        }
        candle_core::Tensor::cat(&[&head.narrow(0, start, held)?, &pad], 0)
    }

    /// This rank's share of a SwiGLU MLP of `width` columns: gate | up by columns
    /// (column-parallel), down over those columns (row-parallel).
    pub(crate) fn mlp(&self, gate_up: &Linear, down: &Linear, width: usize) -> Result<(Linear, Linear)> {
        let rows = self.fused_rows(&[(width, 1, "MLP columns"), (width, 1, "MLP columns")])?;
        Ok((gate_up.output_rows(&rows)?, down.input_columns(self.share(width, 1, "MLP columns")?)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::{Communicator, LocalGroup};
    use crate::quant::Quantization;
    use candle_core::{Device, Tensor, D};
    use std::time::Duration;

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn on_ranks<T: Send>(world: usize, f: impl Fn(&dyn Communicator) -> T + Sync) -> Vec<T> {
        let comms = LocalGroup::new(world, Duration::from_secs(20)).unwrap();
        std::thread::scope(|s| comms.iter().map(|c| s.spawn(|| f(c))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect())
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// A SwiGLU MLP split column-parallel (gate and up) then row-parallel (down), summed by one
    /// all-reduce, computes what the whole MLP does — dense and FP8.
    #[test]
    fn a_tensor_parallel_mlp_sums_to_the_whole_one() {
        let (h, w, t) = (32, 48, 5);
        let x = random((t, h), 1);
        for q in [Quantization::None, Quantization::Fp8] {
            let gate_up = Linear::quantized(Tensor::cat(&[random((w, h), 2), random((w, h), 3)], 0).unwrap(), None, q).unwrap();
            let down = Linear::quantized(random((h, w), 4), Some(random((1, h), 5).squeeze(0).unwrap()), q).unwrap();
            let whole = down.forward(&crate::ops::silu_mul(&gate_up.forward(&x).unwrap()).unwrap()).unwrap();
            for world in [2, 4] {
                let got = on_ranks(world, |c| {
                    let tp = TpRank::new(c.rank(), c.world_size()).unwrap();
                    let rows = tp.fused_rows(&[(w, 1, "gate"), (w, 1, "up")]).unwrap();
                    let mine = gate_up.output_rows(&rows).unwrap();
                    let down = down.input_columns(tp.share(w, 1, "down").unwrap()).unwrap();
                    let partial = down.forward(&crate::ops::silu_mul(&mine.forward(&x).unwrap()).unwrap()).unwrap();
                    c.all_reduce_sum(&partial).unwrap()
                });
                for (r, y) in got.iter().enumerate() {
                    assert!(max_diff(y, &whole) < 1e-5, "{q:?} world {world} rank {r}: {}", max_diff(y, &whole));
                    assert_eq!(max_diff(y, &got[0]), 0.0, "every rank holds the same bits");
                }
            }
        }
    }

    /// Causal attention over one sequence from a fused q|k|v projection, head by head, with
    /// grouped K/V heads; `[t, heads × hd]`.
    fn attention(qkv: &Tensor, nh: usize, nkv: usize, hd: usize) -> Tensor {
        let t = qkv.dim(0).unwrap();
        let q = qkv.narrow(1, 0, nh * hd).unwrap();
        let k = qkv.narrow(1, nh * hd, nkv * hd).unwrap();
        let v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).unwrap();
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
        let heads: Vec<Tensor> = (0..nh)
            .map(|head| {
                let kv = head / (nh / nkv);
                let (qh, kh, vh) = (q.narrow(1, head * hd, hd).unwrap(), k.narrow(1, kv * hd, hd).unwrap(), v.narrow(1, kv * hd, hd).unwrap());
                let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap().broadcast_add(&mask).unwrap();
                candle_nn::ops::softmax(&s, D::Minus1).unwrap().matmul(&vh).unwrap()
            })
            .collect();
        Tensor::cat(&heads, 1).unwrap()
    }

    /// Attention split by heads: each rank projects its q heads and their K/V heads, attends,
    /// and applies its columns of the output projection; one all-reduce gives the whole output.
    #[test]
    fn tensor_parallel_attention_by_heads_sums_to_the_whole_one() {
        let (h, nh, nkv, hd, t) = (32, 8, 4, 4, 6);
        let x = random((t, h), 7);
        let qkv = Linear::dense(random(((nh + 2 * nkv) * hd, h), 8), Some(random((1, (nh + 2 * nkv) * hd), 9).squeeze(0).unwrap()));
        let o = Linear::dense(random((h, nh * hd), 10), None);
        let whole = o.forward(&attention(&qkv.forward(&x).unwrap(), nh, nkv, hd)).unwrap();
        for world in [2, 4] {
            let got = on_ranks(world, |c| {
                let tp = TpRank::new(c.rank(), c.world_size()).unwrap();
                let rows = tp.fused_rows(&[(nh * hd, hd, "q heads"), (nkv * hd, hd, "k heads"), (nkv * hd, hd, "v heads")]).unwrap();
                let local = attention(&qkv.output_rows(&rows).unwrap().forward(&x).unwrap(), nh / tp.world, nkv / tp.world, hd);
                let partial = o.input_columns(tp.share(nh * hd, hd, "heads").unwrap()).unwrap().forward(&local).unwrap();
                c.all_reduce_sum(&partial).unwrap()
            });
            for (r, y) in got.iter().enumerate() {
                assert!(max_diff(y, &whole) < 1e-5, "world {world} rank {r}: {}", max_diff(y, &whole));
            }
        }
    }

    /// A head split by vocabulary rows, the last shares padded with zero rows (10 rows over 4
    /// ranks: 3, 3, 3 and 1 + 2 padding; over 16 ranks some hold padding only), gathers to the
    /// whole head's logits on every rank.
    #[test]
    fn a_vocabulary_parallel_head_gathers_the_whole_logits() {
        let (v, h, t) = (10, 8, 3);
        let (head, x) = (random((v, h), 11), random((t, h), 12));
        let whole = x.matmul(&head.t().unwrap()).unwrap();
        for world in [2, 4, 16] {
            let comms = LocalGroup::new(world, Duration::from_secs(20)).unwrap();
            let got: Vec<Tensor> = std::thread::scope(|s| {
                let run = |c: crate::parallel::LocalComm| {
                    let tp = TpRank::new(c.rank(), world).unwrap();
                    let share = tp.vocab_share(&head).unwrap();
                    assert_eq!(share.dims(), [v.div_ceil(world), h], "rank {} of {world}", c.rank());
                    let shard = crate::parallel::TpShard::new(tp, std::sync::Arc::new(c)).unwrap();
                    shard.gather_vocab(&x.matmul(&share.t().unwrap()).unwrap(), v).unwrap()
                };
                let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(move || run(c))).collect();
                handles.into_iter().map(|j| j.join().unwrap()).collect()
            });
            for (r, y) in got.iter().enumerate() {
                assert_eq!(y.dims(), [t, v]);
                assert!(max_diff(y, &whole) < 1e-6, "world {world} rank {r}: {}", max_diff(y, &whole));
            }
        }
    }

    #[test]
    fn shares_that_do_not_divide_are_refused() {
        let tp = TpRank::new(1, 4).unwrap();
        assert_eq!(tp.share(64, 16, "heads").unwrap(), 16..32);
        assert_eq!(tp.fused_rows(&[(8, 1, "gate"), (8, 1, "up")]).unwrap(), vec![2..4, 10..12]);
        // 6 heads over 4 ranks, 2 K/V heads over 4 ranks, a unit that does not divide.
        for (n, unit) in [(96, 16), (32, 16), (30, 4)] {
            assert!(matches!(tp.share(n, unit, "x"), Err(Error::InvalidOption(_))), "{n} / {unit}");
        }
        assert!(TpRank::new(4, 4).is_err() && TpRank::new(0, 0).is_err());
        // K/V heads: split where they divide, one copy each where the ranks are a multiple of
        // them (8 ranks over 4 K/V heads: ranks 2 and 3 hold K/V head 1), refused otherwise.
        assert_eq!(tp.kv_share(8, 32).unwrap(), 2..4);
        let kv = |rank: usize, world: usize, kv: usize, heads: usize| TpRank::new(rank, world).unwrap().kv_share(kv, heads);
        assert_eq!((0..8).map(|r| kv(r, 8, 4, 32).unwrap().start).collect::<Vec<_>>(), vec![0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(TpRank::new(3, 8).unwrap().kv_heads_per_rank(4), 1);
        for (world, kv_heads, heads) in [(2, 3, 6), (8, 3, 24), (8, 4, 4)] {
            assert!(matches!(kv(0, world, kv_heads, heads), Err(Error::InvalidOption(_))), "{kv_heads} K/V heads, {heads} heads over {world}");
        }
    }
}
