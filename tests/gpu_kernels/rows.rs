//! Row movement and per-row reductions on the device: K/V writes, scatter / gather / copy /
//! compact of rows, greedy picks with their confidence, FOCUS's importance scores.

use super::*;

/// The paged K/V write (diffusion models write K/V this way) against the candle `scatter_set`
/// reference: scattered explicit positions, rows wider and narrower than a 16-byte vector.
#[test]
fn kv_write_matches_scatter_reference() {
    use ponder::ops::{write_kv, write_kv_reference};
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(kvh, hd) in &[(8usize, 128usize), (2, 64), (3, 5)] {
            let mut rng = StdRng::seed_from_u64((kvh * 131 + hd) as u64);
            let (nb, bs) = (24, 16);
            // Two rows: a ragged recompute set and a contiguous run.
            let positions: Vec<u32> = vec![3, 4, 9, 17, 30, 31, 0, 1, 2, 3, 4, 5, 6];
            let host = PagedBatchHost {
                block_tables: vec![vec![5, 11], vec![2]],
                context_lens: vec![32, 7],
                cu_q_lens: vec![0, 6, 13],
                write_positions: positions.clone(),
            };
            let cache_cpu = rand_tensor(&mut rng, &[nb, bs, kvh, hd], -1.0, 1.0, dt);
            let new_cpu = rand_tensor(&mut rng, &[positions.len(), kvh, hd], -3.0, 3.0, dt);
            let cache_gpu = cache_cpu.to_device(&gpu).unwrap();
            let b_cpu = PagedBatch::new(host.clone(), bs, AttnMask::Bidirectional, kvh * hd, &Device::Cpu).unwrap();
            let b_gpu = PagedBatch::new(host, bs, AttnMask::Bidirectional, kvh * hd, &gpu).unwrap();
            write_kv_reference(&cache_cpu, &new_cpu, &b_cpu).unwrap();
            write_kv(&cache_gpu, &new_cpu.to_device(&gpu).unwrap(), &b_gpu).unwrap();
            let a = cache_gpu.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = cache_cpu.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a, b, "kv_write {dt:?} {kvh}x{hd}: the copy must be exact");
        }
    }
}

/// The row scatter behind loop-state bank writes and K/V slot copies against candle's
/// `scatter_set`: a permutation of rows into a larger bank, widths with and without 16-byte
/// vectors, a source in another dtype (cast on the way).
#[test]
fn scatter_rows_matches_reference() {
    use ponder::ops::{scatter_rows, scatter_rows_reference};
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, width, bank) in &[(379usize, 2048usize, 600usize), (7, 5, 9), (1, 4096, 3)] {
            let mut rng = StdRng::seed_from_u64((rows * 7 + width) as u64);
            let dst_cpu = rand_tensor(&mut rng, &[bank, width], -1.0, 1.0, dt);
            let src_cpu = rand_tensor(&mut rng, &[rows, width], -3.0, 3.0, DType::F32);
            let mut order: Vec<u32> = (0..bank as u32).collect();
            order.shuffle(&mut rng);
            let index_cpu = Tensor::new(&order[..rows], &Device::Cpu).unwrap();
            let dst_gpu = dst_cpu.to_device(&gpu).unwrap();
            scatter_rows_reference(&dst_cpu, &src_cpu, &index_cpu).unwrap();
            scatter_rows(&dst_gpu, &src_cpu.to_device(&gpu).unwrap(), &index_cpu.to_device(&gpu).unwrap()).unwrap();
            let flat = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&dst_gpu), flat(&dst_cpu), "scatter_rows {dt:?} {rows}x{width} into {bank}: the copy must be exact");
        }
    }
    println!("scatter_rows: exact for f32/bf16/f16, widths 2048 / 5 / 4096");
}

/// The decode arena's gather (state-bank rows, embedding rows) into a given buffer against
/// `index_select` on the CPU: repeated and shuffled indices, widths with and without 16-byte
/// vectors, rows of the buffer past the launch left alone.
#[test]
fn gather_rows_into_matches_index_select() {
    use ponder::ops::into::gather_rows_into;
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, width, bank) in &[(379usize, 2048usize, 600usize), (7, 5, 9), (1, 4096, 3)] {
            let mut rng = StdRng::seed_from_u64((rows * 11 + width) as u64);
            let src_cpu = rand_tensor(&mut rng, &[bank, width], -3.0, 3.0, dt);
            let index: Vec<u32> = (0..rows).map(|_| rng.random_range(0..bank as u32)).collect();
            let index_cpu = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
            let want = src_cpu.index_select(&index_cpu, 0).unwrap();
            let buf = Tensor::full(7f32, (rows + 3, width), &gpu).unwrap().to_dtype(dt).unwrap();
            let out = buf.narrow(0, 0, rows).unwrap();
            gather_rows_into(&src_cpu.to_device(&gpu).unwrap(), &index_cpu.to_device(&gpu).unwrap(), &out).unwrap();
            let flat = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&out), flat(&want), "gather_rows {dt:?} {rows}x{width} from {bank}: the copy must be exact");
            assert!(flat(&buf.narrow(0, rows, 3).unwrap()).iter().all(|&v| v == 7.0), "gather_rows {dt:?}: rows past the launch untouched");
        }
    }
    println!("gather_rows_into: exact for f32/bf16/f16, widths 2048 / 5 / 4096");
}

/// Huginn's scaled embedding gather (the arena's prelude) against candle's `index_select` then
/// `affine` on the device, bit for bit, and against its rounding written out on the host: the
/// scale rounded to the dtype, then one rounding of the product (`T(f32(x) · f32(T(scale)))`).
#[test]
fn gather_rows_scaled_into_rounds_as_candles_affine() {
    use ponder::ops::into::gather_rows_scaled_into;
    let gpu = gpu_device();
    let scale = 5280f64.sqrt();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, width, vocab) in &[(61usize, 5280usize, 300usize), (7, 5, 9)] {
            let mut rng = StdRng::seed_from_u64((rows * 13 + width) as u64);
            let mut src_cpu = rand_tensor(&mut rng, &[vocab, width], -0.1, 0.1, dt);
            // A row of negative zeros: the affine's `+ 0` makes them positive.
            src_cpu = src_cpu.slice_assign(&[0..1, 0..width], &Tensor::full(-0f32, (1, width), &Device::Cpu).unwrap().to_dtype(dt).unwrap()).unwrap();
            let mut index: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
            index[0] = 0;
            let index_cpu = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
            let (src, idx) = (src_cpu.to_device(&gpu).unwrap(), index_cpu.to_device(&gpu).unwrap());
            let out = Tensor::zeros((rows, width), dt, &gpu).unwrap();
            gather_rows_scaled_into(&src, &idx, scale, &out).unwrap();
            let bits = |t: &Tensor| {
                t.to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            };
            let candle = (src.index_select(&idx, 0).unwrap() * scale).unwrap();
            assert_eq!(bits(&out), bits(&candle), "gather_rows_scaled {dt:?} {rows}x{width}: candle's affine on the device");
            let s = match dt {
                DType::BF16 => half::bf16::from_f64(scale).to_f32(),
                DType::F16 => half::f16::from_f64(scale).to_f32(),
                _ => scale as f32,
            };
            let host = src_cpu.index_select(&index_cpu, 0).unwrap().to_dtype(DType::F32).unwrap();
            let host = ((host * s as f64).unwrap() + 0.0).unwrap().to_dtype(dt).unwrap();
            assert_eq!(bits(&out), bits(&host), "gather_rows_scaled {dt:?} {rows}x{width}: the host's rounding");
            assert!(bits(&out.narrow(0, 0, 1).unwrap()).iter().all(|&b| b == 0), "{dt:?}: -0 times the scale plus 0 is +0");
        }
    }
    println!("gather_rows_scaled_into: bit for bit with candle's affine and the host's rounding, f32/bf16/f16");
}

/// The last-exited K/V fill: every layer's K and V rows copied in one launch, exactly as the
/// gather-then-scatter reference on the CPU; pairs whose destination is another pair's source
/// take the reference path on the device too.
#[test]
fn copy_rows_matches_reference() {
    use ponder::ops::{copy_rows, copy_rows_reference};
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // (blocks, block size, kv heads, head dim, tensors): Ouro's 24 layers of K and V; odd widths.
        for &(nb, bs, kvh, hd, n) in &[(40usize, 16usize, 16usize, 128usize, 48usize), (9, 4, 3, 5, 3)] {
            let mut rng = StdRng::seed_from_u64((nb * 31 + hd) as u64);
            let cpu: Vec<Tensor> = (0..n).map(|_| rand_tensor(&mut rng, &[nb, bs, kvh, hd], -1.0, 1.0, dt)).collect();
            let dev: Vec<Tensor> = cpu.iter().map(|t| t.to_device(&gpu).unwrap()).collect();
            let mut order: Vec<u32> = (0..(nb * bs) as u32).collect();
            order.shuffle(&mut rng);
            let pairs = (nb * bs / 3).min(100);
            // Distinct pairs; one source fanned out to deeper slots; a destination that is also a
            // source (the reference path on the device).
            for (src, dst) in [(order[..pairs].to_vec(), order[pairs..2 * pairs].to_vec()), (vec![3, 3, 3], vec![7, 11, 20]), (vec![0, 5, 9], vec![5, 9, 1])] {
                copy_rows_reference(&cpu.iter().collect::<Vec<_>>(), kvh * hd, &src, &dst).unwrap();
                copy_rows(&dev.iter().collect::<Vec<_>>(), kvh * hd, &src, &dst).unwrap();
                for (c, d) in cpu.iter().zip(&dev) {
                    assert_eq!(
                        f32_cpu(d).flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        f32_cpu(c).flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "copy_rows {dt:?} {nb}x{bs}x{kvh}x{hd}"
                    );
                }
            }
        }
    }
}

/// FOCUS importance: the batched CUDA kernel against the candle composition on the CPU, ragged
/// rows (1..=32 masked tokens), GQA and MHA.
#[test]
fn focus_importance_matches_reference() {
    use ponder::ops::importance_of;
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(heads, kvh, d) in &[(32usize, 8usize, 128usize), (16, 16, 64), (4, 2, 64)] {
            let mut rng = StdRng::seed_from_u64((heads * 977 + d) as u64);
            let lens = vec![32usize, 1, 7, 16, 3, 32, 29];
            let m = *lens.iter().max().unwrap();
            let tokens = 300;
            let q = rand_tensor(&mut rng, &[tokens, heads, d], -2.0, 2.0, dt);
            let k = rand_tensor(&mut rng, &[tokens, kvh, d], -2.0, 2.0, dt);
            let mut gather = vec![0u32; lens.len() * m];
            for (r, &l) in lens.iter().enumerate() {
                for i in 0..l {
                    gather[r * m + i] = ((r * 41 + i * 7) % tokens) as u32;
                }
            }
            let g_cpu = Tensor::new(gather.as_slice(), &Device::Cpu).unwrap();
            let want = importance_of(&q, &k, &g_cpu, &lens, m, dt).unwrap().to_vec2::<f32>().unwrap();
            let got = importance_of(&q.to_device(&gpu).unwrap(), &k.to_device(&gpu).unwrap(), &g_cpu.to_device(&gpu).unwrap(), &lens, m, dt)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            // bf16: both round the f32 total through bf16; one ulp apart at most (2^-7 relative).
            let tol = if dt == DType::F32 { 1e-4 } else { 8e-3 };
            for (r, (a, b)) in got.iter().zip(&want).enumerate() {
                for j in 0..m {
                    let scale = b[j].abs().max(1.0);
                    assert!((a[j] - b[j]).abs() <= tol * scale, "{dt:?} h{heads}/{kvh} d{d} row {r} token {j}: {} vs {}", a[j], b[j]);
                }
            }
        }
    }
}

/// The one-pass greedy readout against argmax + softmax in f32 on the CPU: a 152k vocabulary,
/// the excluded mask token holding the largest logit, f32, bf16 and f16 logits.
#[test]
fn greedy_confidence_matches_reference() {
    use ponder::engine::internals::greedy_with_confidence;
    let gpu = gpu_device();
    // A vocabulary of a multiple of 8 takes the 16-byte loads; 1001 the scalar loop.
    for (dt, (rows, vocab, mask)) in
        [DType::F32, DType::BF16, DType::F16].into_iter().flat_map(|dt| [(dt, (37usize, 151_936usize, 151_669u32)), (dt, (5, 1001, 7))])
    {
        let mut rng = StdRng::seed_from_u64(5);
        let mut data: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-8.0f32..8.0)).collect();
        for r in 0..rows {
            data[r * vocab + mask as usize] = 100.0; // must never win
            data[r * vocab + (r * 977) % vocab] = 9.0 + r as f32 * 0.25;
        }
        let logits = Tensor::from_vec(data, (rows, vocab), &Device::Cpu).unwrap().to_dtype(dt).unwrap();
        let mut bias = vec![0f32; vocab];
        bias[mask as usize] = f32::NEG_INFINITY;
        let bias = Tensor::from_vec(bias, (1, vocab), &Device::Cpu).unwrap();
        let f32_logits = logits.to_dtype(DType::F32).unwrap().broadcast_add(&bias).unwrap();
        let (want_t, want_c) = greedy_with_confidence(&f32_logits).unwrap();
        let (got_t, got_c) = ponder::ops::cuda::greedy_confidence(&logits.to_device(&gpu).unwrap(), Some(mask)).unwrap();
        let (want_t, want_c) = (want_t.to_vec1::<u32>().unwrap(), want_c.to_vec1::<f32>().unwrap());
        let got_t = got_t.to_device(&Device::Cpu).unwrap().to_vec1::<u32>().unwrap();
        let got_c = got_c.to_device(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        let row_vals = f32_logits.to_vec2::<f32>().unwrap();
        for r in 0..rows {
            assert_ne!(got_t[r], mask, "{dt:?} row {r}: the mask token was chosen");
            // Ties (bf16 has coarse values) may pick another index with the same logit.
            assert_eq!(row_vals[r][got_t[r] as usize], row_vals[r][want_t[r] as usize], "{dt:?} row {r}");
            assert!((got_c[r] - want_c[r]).abs() <= 1e-4 * want_c[r].max(1e-3), "{dt:?} row {r}: {} vs {}", got_c[r], want_c[r]);
        }
    }
}

/// The looped decode's greedy readout in one launch against candle's argmax + `flag_non_finite`
/// on the CPU: the first maximum wins ties (planted), a NaN, an infinity and an all −∞ row are
/// flagged, 16-byte and scalar loads, f32 / bf16 / f16 logits.
#[test]
fn greedy_ids_flagged_matches_reference() {
    use ponder::ops::{greedy_ids_flagged, greedy_ids_flagged_reference, is_non_finite_flag};
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, vocab) in &[(16usize, 49_152usize), (7, 1000), (7, 1001), (5, 4097), (4, 7)] {
            let mut rng = StdRng::seed_from_u64((rows * 131 + vocab) as u64);
            let mut data: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-8.0f32..8.0)).collect();
            for r in 0..rows {
                // Two equal maxima: the lower index must win.
                let (a, b) = ((r * 977 + 3) % vocab, (r * 977 + 3) % vocab / 2);
                data[r * vocab + a] = 20.0;
                data[r * vocab + b] = 20.0;
            }
            let bad_rows = [(1usize, f32::NAN), (2, f32::INFINITY), (3, f32::NEG_INFINITY)];
            for &(r, v) in &bad_rows {
                if v == f32::NEG_INFINITY {
                    data[r * vocab..(r + 1) * vocab].iter_mut().for_each(|x| *x = v);
                } else {
                    data[r * vocab + vocab / 2] = v;
                }
            }
            let logits = Tensor::from_vec(data, (rows, vocab), &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let (want_ids, want_flagged) = greedy_ids_flagged_reference(&logits, vocab).unwrap();
            let (ids, flagged) = greedy_ids_flagged(&logits.to_device(&gpu).unwrap(), vocab).unwrap();
            let host = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_vec1::<u32>().unwrap();
            let (want_ids, want_flagged, ids, flagged) = (host(&want_ids), host(&want_flagged), host(&ids), host(&flagged));
            for r in 0..rows {
                let bad = bad_rows.iter().any(|&(b, _)| b == r);
                assert_eq!(is_non_finite_flag(flagged[r], vocab), bad, "{dt:?} {rows}x{vocab} row {r}: flag");
                assert_eq!(is_non_finite_flag(want_flagged[r], vocab), bad, "{dt:?} {rows}x{vocab} row {r}: the reference's flag");
                if r != 1 {
                    // A NaN row's id is unspecified (candle's CPU argmax returns 0 when the row
                    // starts with NaN, else skips it); +∞ rows give the first +∞, all −∞ rows 0.
                    assert_eq!(ids[r], want_ids[r], "{dt:?} {rows}x{vocab} row {r}: id");
                    assert_eq!(flagged[r], want_flagged[r], "{dt:?} {rows}x{vocab} row {r}: flagged id");
                }
            }
        }
    }
}

/// FOCUS compaction: the one-launch gather of hidden states, queries and RoPE cos/sin against
/// `index_select` on the CPU — exact, rows wider and narrower than a 16-byte vector, repeated
/// and reordered indices, one to four sources.
#[test]
fn compact_rows_matches_index_select() {
    use ponder::ops::{compact_rows, compact_rows_reference};
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let mut rng = StdRng::seed_from_u64(11);
        let rows = 700;
        let h = rand_tensor(&mut rng, &[rows, 4096], -4.0, 4.0, dt);
        let q = rand_tensor(&mut rng, &[rows, 32, 128], -4.0, 4.0, dt);
        let cos = rand_tensor(&mut rng, &[rows, 64], -1.0, 1.0, dt);
        let odd = rand_tensor(&mut rng, &[rows, 3], -1.0, 1.0, dt);
        let mut index: Vec<u32> = (0..rows as u32).filter(|i| i % 3 != 1).collect();
        index.shuffle(&mut rng);
        index.extend([0, 0, rows as u32 - 1]);
        let sets: Vec<Vec<&Tensor>> = vec![vec![&h], vec![&h, &q], vec![&h, &q, &cos, &odd], vec![&odd, &cos]];
        for set in sets {
            let want = compact_rows_reference(&set, &index).unwrap();
            let on_gpu: Vec<Tensor> = set.iter().map(|t| t.to_device(&gpu).unwrap()).collect();
            let refs: Vec<&Tensor> = on_gpu.iter().collect();
            let got = compact_rows(&refs, &index).unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.dims(), w.dims());
                let g = g.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let w = w.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(g, w, "compact_rows {dt:?} {:?}: the copy must be exact", set.iter().map(|t| t.dims().to_vec()).collect::<Vec<_>>());
            }
        }
        let on_gpu = h.to_device(&gpu).unwrap();
        assert!(compact_rows(&[&on_gpu], &[rows as u32]).is_err(), "an index past the rows is refused");
        assert_eq!(compact_rows(&[&on_gpu], &[]).unwrap()[0].dims(), &[0, 4096]);
    }
}
