//! The projection's epilogues: q / k rotated and K / V written to the paged cache in one launch
//! (`qkv_rope_write`, Huginn's biased interleaved form, the QK-norm form), and the same folded
//! into decode attention (`qkv_rope_attention`), against the compositions they replace.

use super::*;

/// A paged batch of `rows` (q_len, ctx) over shuffled blocks of `bs` slots, `spare` blocks more
/// than the rows use: its host side, the rows' new positions, and the block count.
fn shuffled_paged_rows(rng: &mut StdRng, rows: &[(usize, usize)], bs: usize, spare: usize) -> (PagedBatchHost, Vec<u32>, usize) {
    let num_blocks = rows.iter().map(|&(_, c)| c.div_ceil(bs)).sum::<usize>() + spare;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let mut host = PagedBatchHost { write_positions: Vec::new(), block_tables: vec![], context_lens: vec![], cu_q_lens: vec![0] };
    let (mut next, mut positions) = (0, vec![]);
    for &(q_len, ctx) in rows {
        host.block_tables.push(ids[next..next + ctx.div_ceil(bs)].to_vec());
        next += ctx.div_ceil(bs);
        host.context_lens.push(ctx as u32);
        host.cu_q_lens.push(host.cu_q_lens.last().unwrap() + q_len as u32);
        positions.extend((ctx - q_len..ctx).map(|p| p as u32));
    }
    (host, positions, num_blocks)
}

/// One qkv_rope_write case: rows of (q_len, ctx); caches pre-filled with random values.
fn check_qkv_rope_write(name: &str, rows: &[(usize, usize)], heads: usize, kv_heads: usize, hd: usize, bs: usize, dtype: DType) {
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(0xf05ed ^ (heads * 131 + hd) as u64);
    let (host, positions, num_blocks) = shuffled_paged_rows(&mut rng, rows, bs, 5);
    let tokens = positions.len();
    let width = (heads + 2 * kv_heads) * hd;
    let kvw = kv_heads * hd;
    let qkv = rand_tensor(&mut rng, &[tokens, width], -2.0, 2.0, dtype);
    let cache_shape = [num_blocks, bs, kv_heads, hd];
    let k0 = rand_tensor(&mut rng, &cache_shape, -1.0, 1.0, dtype);
    let v0 = rand_tensor(&mut rng, &cache_shape, -1.0, 1.0, dtype);
    let pos = Tensor::new(positions.as_slice(), &Device::Cpu).unwrap();
    let angles = RopeTable::new(hd, 1_000_000.0, dtype, &Device::Cpu).unwrap().angles(&pos).unwrap();

    // Reference: the CPU composition in f32 on the same values.
    let cpu_batch = PagedBatch::new(host.clone(), bs, AttnMask::Causal, kvw, &Device::Cpu).unwrap();
    let ref_angles = RopeAngles { cos: angles.cos.to_dtype(DType::F32).unwrap(), sin: angles.sin.to_dtype(DType::F32).unwrap() };
    let (k_ref, v_ref) = (f32_cpu(&k0).copy().unwrap(), f32_cpu(&v0).copy().unwrap());
    let q_ref = fused::qkv_rope_write(&f32_cpu(&qkv), &ref_angles, &k_ref, &v_ref, &cpu_batch, heads, kv_heads, hd).unwrap();

    let gpu_batch = PagedBatch::new(host.clone(), bs, AttnMask::Causal, kvw, &gpu).unwrap();
    let g_angles = RopeAngles { cos: angles.cos.to_device(&gpu).unwrap(), sin: angles.sin.to_device(&gpu).unwrap() };
    let (kg, vg) = (k0.to_device(&gpu).unwrap(), v0.to_device(&gpu).unwrap());
    let qg = fused::qkv_rope_write(&qkv.to_device(&gpu).unwrap(), &g_angles, &kg, &vg, &gpu_batch, heads, kv_heads, hd).unwrap();
    assert_eq!(qg.dims(), &[tokens, heads, hd]);
    assert_eq!(qg.dtype(), dtype);
    assert!(qg.is_contiguous());
    let tol = tol_of(dtype);
    let q_err = rel_err(&f32_cpu(&qg), &q_ref);

    // Written rows vs the reference; every other row bit-identical to before.
    let slots: Vec<u32> = cpu_batch.slot_mapping.to_vec1().unwrap();
    let written: std::collections::HashSet<usize> = slots.iter().map(|&s| s as usize).collect();
    let flat = |t: &Tensor| -> Vec<f32> { f32_cpu(t).flatten_all().unwrap().to_vec1().unwrap() };
    let (kg_h, vg_h, k0_h, v0_h) = (flat(&kg), flat(&vg), flat(&k0), flat(&v0));
    let (kr_h, vr_h) = (flat(&k_ref), flat(&v_ref));
    let idx = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
    let rows_of = |t: &Tensor| t.reshape((num_blocks * bs, kvw)).unwrap().index_select(&idx, 0).unwrap();
    let k_err = rel_err(&rows_of(&f32_cpu(&kg)), &rows_of(&k_ref));
    let v_err = rel_err(&rows_of(&f32_cpu(&vg)), &rows_of(&v_ref));
    let mut untouched_bad = 0usize;
    for row in 0..num_blocks * bs {
        let r = row * kvw..(row + 1) * kvw;
        if written.contains(&row) {
            // v is a copy: exact. (The reference rows are the same f32 values.)
            assert_eq!(vg_h[r.clone()], vr_h[r.clone()], "{name}: v row {row}");
            assert_ne!(kr_h[r.clone()], k0_h[r.clone()], "{name}: reference k row {row} unchanged");
        } else {
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            if !same(&kg_h[r.clone()], &k0_h[r.clone()]) || !same(&vg_h[r.clone()], &v0_h[r.clone()]) {
                untouched_bad += 1;
            }
        }
    }
    println!(
        "{name:<40} {dtype:?} q rel err {q_err:.3e}, k rows {k_err:.3e}, v rows {v_err:.1e}, {} rows written, {} untouched rows changed (tol {tol:.0e})",
        written.len(),
        untouched_bad
    );
    assert_eq!(untouched_bad, 0, "{name}: rows outside slot_mapping changed");
    assert!(q_err <= tol && k_err <= tol, "{name}: q {q_err}, k {k_err} > {tol}");
    assert_eq!(v_err, 0.0);
}

#[test]
fn fused_qkv_rope_write() {
    let decode: Vec<(usize, usize)> = (0..64).map(|i| (1, 1 + (i * 53) % 400)).collect();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check_qkv_rope_write("qkv_rope decode 64 rows 16/16 d128", &decode, 16, 16, 128, 16, dt);
        check_qkv_rope_write("qkv_rope mixed gqa 32/8 d128", MIXED_ROWS, 32, 8, 128, 16, dt);
        check_qkv_rope_write("qkv_rope mixed gqa 12/4 d96 bs12", MIXED_ROWS, 12, 4, 96, 12, dt);
        check_qkv_rope_write("qkv_rope diffusion 8/2 d64 bs32", DIFFUSION_ROWS, 8, 2, 64, 32, dt);
    }
}

/// `qkv_bias_rope_i_write` (Huginn's interleaved RoPE after a learned q/k bias, one launch)
/// against the composition it replaces run on the same device: q and the K cache within the
/// dtype's rounding (the kernel rounds each op as the CPU's `rope_i` does; candle's CUDA `rope_i`
/// rounds a last bit differently in about a fifth of the values on the H100), the V cache bit
/// for bit, rows outside the slots untouched; with and without the bias, MHA and GQA, decode and
/// mixed rows.
#[test]
fn fused_qkv_bias_rope_i_write_matches_the_composition() {
    use ponder::ops::fused::{qkv_bias_rope_i_write, qkv_bias_rope_i_write_reference};
    let gpu = gpu_device();
    let decode: Vec<(usize, usize)> = (0..40).map(|i| (1, 1 + (i * 53) % 300)).collect();
    // (name, rows of (q_len, ctx), heads, kv heads, head dim, block size)
    type Case<'a> = (&'a str, &'a [(usize, usize)], usize, usize, usize, usize);
    let cases: [Case; 3] = [
        ("decode 40 rows 16/16 d96", &decode, 16, 16, 96, 16),
        ("mixed gqa 12/4 d64 bs12", MIXED_ROWS, 12, 4, 64, 12),
        ("mixed 8/8 d128", MIXED_ROWS, 8, 8, 128, 16),
    ];
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (name, rows, heads, kv_heads, hd, bs) in cases {
            for with_bias in [true, false] {
                let mut rng = StdRng::seed_from_u64(0xb1a5 ^ (heads * 131 + hd) as u64);
                let (host, positions, num_blocks) = shuffled_paged_rows(&mut rng, rows, bs, 3);
                let tokens = positions.len();
                let kvw = kv_heads * hd;
                let to = |t: Tensor| t.to_device(&gpu).unwrap();
                let qkv = to(rand_tensor(&mut rng, &[tokens, (heads + 2 * kv_heads) * hd], -2.0, 2.0, dtype));
                let bias = with_bias
                    .then(|| (to(rand_tensor(&mut rng, &[heads, hd], -0.5, 0.5, dtype)), to(rand_tensor(&mut rng, &[kv_heads, hd], -0.5, 0.5, dtype))));
                let cache = [num_blocks, bs, kv_heads, hd];
                let (k0, v0) = (rand_tensor(&mut rng, &cache, -1.0, 1.0, dtype), rand_tensor(&mut rng, &cache, -1.0, 1.0, dtype));
                let pos = Tensor::new(positions.as_slice(), &gpu).unwrap();
                let angles = RopeTable::new(hd, 10_000.0, dtype, &gpu).unwrap().angles(&pos).unwrap();
                let batch = PagedBatch::new(host, bs, AttnMask::Causal, kvw, &gpu).unwrap();
                let bias_ref = bias.as_ref().map(|(q, k)| (q, k));
                let (kk, vk) = (to(k0.clone()), to(v0.clone()));
                let qk = qkv_bias_rope_i_write(&qkv, bias_ref, &angles, &kk, &vk, &batch, heads, kv_heads, hd).unwrap();
                let (kr, vr) = (to(k0.clone()), to(v0.clone()));
                let qr = qkv_bias_rope_i_write_reference(&qkv, bias_ref, &angles, &kr, &vr, &batch, heads, kv_heads, hd).unwrap();
                assert_eq!(qk.dims(), [tokens, heads, hd]);
                let flat = |t: &Tensor| -> Vec<f32> { f32_cpu(t).flatten_all().unwrap().to_vec1().unwrap() };
                let label = format!("{name} {dtype:?} bias {with_bias}");
                for (what, got, want) in [("q", &qk, &qr), ("k cache", &kk, &kr), ("v cache", &vk, &vr)] {
                    let (g, w) = (flat(got), flat(want));
                    if what == "v cache" {
                        let differ = g.iter().zip(&w).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                        assert_eq!(differ, 0, "{label}: {what} differs from the composition in {differ} of {} values", g.len());
                    } else {
                        let err = rel_err(&f32_cpu(got), &f32_cpu(want));
                        assert!(err <= tol_of(dtype), "{label}: {what} relative error {err:e}");
                    }
                }
                // The composition writes only the slots' rows: the caches elsewhere are as before.
                let slots: std::collections::HashSet<u32> = batch.slot_mapping.to_device(&Device::Cpu).unwrap().to_vec1::<u32>().unwrap().into_iter().collect();
                let (kg, k0f) = (flat(&kk), flat(&k0));
                for row in (0..num_blocks * bs).filter(|r| !slots.contains(&(*r as u32))) {
                    let r = row * kvw..(row + 1) * kvw;
                    assert!(kg[r.clone()].iter().zip(&k0f[r]).all(|(a, b)| a.to_bits() == b.to_bits()), "{label}: k row {row} outside the slots changed");
                }
            }
        }
    }
}

/// `qkv_rope_attention` on the device: the decode ring with qkv_rope_write folded in against the
/// two ops in turn (on the ring) — both caches bit for bit, the attention output within 4e-3
/// relative, about one rounding step of bf16 (it may round differently where a row's newest key
/// scores highest; a wrong key or rotation is off by far more) — for the ring's
/// shapes: one row walked by many blocks, 16 rows of contexts 1–600 (rows cut between
/// blocks), 200 short rows (last stages holding only the newest key), GQA, an odd head count,
/// block size 12, f16; each through the folded kernel.
#[test]
fn fused_qkv_rope_attention() {
    let sixteen: Vec<usize> = (0..16).map(|i| 1 + (i * 67) % 600).collect();
    let short: Vec<usize> = (0..200).map(|i| 1 + (i * 37) % 41).collect();
    let cases: Vec<Fold> = vec![
        ("one row 16/16", vec![1000], 16, 16, 128, 16, DType::BF16),
        ("16 rows 16/16", sixteen.clone(), 16, 16, 128, 16, DType::BF16),
        ("200 short rows 16/16", short, 16, 16, 128, 16, DType::BF16),
        ("16 rows gqa 16/4", sixteen.clone(), 16, 4, 128, 16, DType::BF16),
        ("16 rows odd heads 15/15", sixteen.clone(), 15, 15, 128, 16, DType::BF16),
        ("16 rows block size 12", sixteen.clone(), 16, 16, 128, 12, DType::BF16),
        ("16 rows f16", sixteen, 16, 16, 128, 16, DType::F16),
    ];
    for case in cases {
        let (fused, _) = check_qkv_rope_attention(AttnPath::Ring, &case, 4e-3);
        assert_eq!(fused.decode_ring_rope, u64::from(cfg!(ponder_bulk_copy)), "{}: folded ring launches", case.0);
    }
}

/// `qkv_rope_attention` on the SIMT path (the ring off): for MHA decode launches the one-query
/// kernel with qkv_rope_write folded in, against `qkv_rope_write` then the SIMT kernel — caches
/// and output bit for bit (the fold cuts the keys as the two launches do and rotates with the
/// same arithmetic) — at head dims 64 / 96 / 128, bf16 and f16, contexts cut into splits by the
/// host and (long ones) in the kernel or walked unsplit by the 8-warp builds (16, 24 and 32 rows
/// of 16 heads, 22 of 12 on the H200; 6 and 8 rows of 16 and 11 of 12 by the deep build; which
/// launches took them is checked), one row and 200, block size 12; GQA and f32 launches are not
/// folded and run the two ops.
#[test]
fn fused_qkv_rope_attention_simt() {
    let sixteen: Vec<usize> = (0..16).map(|i| 1 + (i * 67) % 600).collect();
    let long: Vec<usize> = (0..16).map(|i| 1500 + (i * 389) % 2600).collect();
    let short: Vec<usize> = (0..200).map(|i| 1 + (i * 37) % 41).collect();
    let cases: Vec<Fold> = vec![
        ("one row 16/16 d128", vec![1000], 16, 16, 128, 16, DType::BF16),
        ("16 rows 16/16 d128", sixteen.clone(), 16, 16, 128, 16, DType::BF16),
        ("16 long rows 16/16 d128", long.clone(), 16, 16, 128, 16, DType::BF16),
        ("10 long rows 16/16 d128", long[..10].to_vec(), 16, 16, 128, 16, DType::BF16),
        ("24 rows 16/16 d128", (0..24).map(|i| 1 + (i * 67) % 600).collect(), 16, 16, 128, 16, DType::BF16),
        ("32 rows 16/16 d128", (0..32).map(|i| 1 + (i * 67) % 500).collect(), 16, 16, 128, 16, DType::BF16),
        ("32 rows of 600 keys 16/16 d128", (0..32).map(|i| 1 + (i * 67) % 600).collect(), 16, 16, 128, 16, DType::BF16),
        ("200 short rows 16/16 d128", short, 16, 16, 128, 16, DType::BF16),
        ("8 rows 16/16 d128", (0..8).map(|i| 1 + (i * 67) % 500).collect(), 16, 16, 128, 16, DType::BF16),
        ("6 rows 16/16 d128 f16", (0..6).map(|i| 200 + (i * 67) % 300).collect(), 16, 16, 128, 16, DType::F16),
        ("11 rows 12/12 d96", (0..11).map(|i| 1 + (i * 89) % 480).collect(), 12, 12, 96, 16, DType::BF16),
        ("8 rows past 512 keys 16/16 d128", (0..8).map(|i| 100 + (i * 67) % 600).collect(), 16, 16, 128, 16, DType::BF16),
        ("16 rows 8/8 d64", sixteen.clone(), 8, 8, 64, 16, DType::BF16),
        ("16 rows 12/12 d96 f16", sixteen.clone(), 12, 12, 96, 16, DType::F16),
        ("22 rows 12/12 d96 f16", (0..22).map(|i| 1 + (i * 89) % 900).collect(), 12, 12, 96, 16, DType::F16),
        ("16 rows block size 12 d128", sixteen.clone(), 16, 16, 128, 12, DType::BF16),
        ("16 rows gqa 16/4 (not folded)", sixteen.clone(), 16, 4, 128, 16, DType::BF16),
        ("16 rows f32 (not folded)", sixteen, 16, 16, 128, 16, DType::F32),
    ];
    let sms = gpu_sms();
    for case in cases {
        let (fused, reference) = check_qkv_rope_attention(AttnPath::Simt, &case, 0.0);
        let want = u64::from(case.2 == case.3 && case.6 != DType::F32);
        assert_eq!(fused.simt_rope, want, "{}: folded SIMT launches", case.0);
        // Which cases an 8-warp build walks unsplit (both sides of the check run the same plan).
        let eight = fused.simt_eight_warp + reference.simt_eight_warp;
        let blocks = case.1.len() * case.3;
        let longest = case.1.iter().max().copied().unwrap_or(0);
        let eligible = case.2 == case.3 && longest >= 256;
        let even = blocks as f64 / (sms * blocks.div_ceil(sms)) as f64 >= 0.9;
        // (The build held to four blocks an SM fits four by its launch bounds: every even wave up
        // to four blocks an SM takes one of the two, within their context bounds.)
        let deep = eligible && blocks <= sms && blocks as f64 >= 0.6 * sms as f64 && longest <= 512;
        let wave = eligible && blocks > sms && even && (blocks <= 3 * sms && longest <= 4096 || blocks <= 4 * sms && longest <= 512);
        assert_eq!(eight, if deep || wave { 2 } else { 0 }, "{}: 8-warp launches", case.0);
        assert_eq!(fused.simt_deep + reference.simt_deep, if deep { 2 } else { 0 }, "{}: deep 8-warp launches", case.0);
    }
}

/// (name, each row's context, heads, kv heads, head dim, block size, dtype)
type Fold = (&'static str, Vec<usize>, usize, usize, usize, usize, DType);

/// Runs `qkv_rope_attention` on `path` against `qkv_rope_write` then `paged_attention` on the same
/// path: both caches bit for bit, the output within `tol` relative (0: bit for bit). Returns the
/// kernel dispatches of the fused call and of the two-launch reference.
fn check_qkv_rope_attention(path: AttnPath, case: &Fold, tol: f32) -> (ponder::ops::KernelCounts, ponder::ops::KernelCounts) {
    let gpu = gpu_device();
    let (name, ctxs, heads, kv_heads, hd, bs, dtype) = case.clone();
    let mut rng = StdRng::seed_from_u64(0x2f01d ^ (ctxs.len() * 131 + heads * 7 + hd) as u64);
    let num_blocks = ctxs.iter().map(|c| c.div_ceil(bs)).sum::<usize>() + 5;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    let mut host = PagedBatchHost { write_positions: Vec::new(), block_tables: vec![], context_lens: vec![], cu_q_lens: vec![0] };
    let mut next = 0;
    for &ctx in &ctxs {
        host.block_tables.push(ids[next..next + ctx.div_ceil(bs)].to_vec());
        next += ctx.div_ceil(bs);
        host.context_lens.push(ctx as u32);
        host.cu_q_lens.push(host.cu_q_lens.last().unwrap() + 1);
    }
    let positions: Vec<u32> = ctxs.iter().map(|&c| c as u32 - 1).collect();
    let tokens = ctxs.len();
    let qkv = rand_tensor(&mut rng, &[tokens, (heads + 2 * kv_heads) * hd], -2.0, 2.0, dtype).to_device(&gpu).unwrap();
    let cache_shape = [num_blocks, bs, kv_heads, hd];
    let k0 = rand_tensor(&mut rng, &cache_shape, -1.0, 1.0, dtype);
    let v0 = rand_tensor(&mut rng, &cache_shape, -1.0, 1.0, dtype);
    let pos = Tensor::new(positions.as_slice(), &Device::Cpu).unwrap();
    let a = RopeTable::new(hd, 1_000_000.0, dtype, &Device::Cpu).unwrap().angles(&pos).unwrap();
    let angles = RopeAngles { cos: a.cos.to_device(&gpu).unwrap(), sin: a.sin.to_device(&gpu).unwrap() };
    let batch = PagedBatch::new(host, bs, AttnMask::Causal, kv_heads * hd, &gpu).unwrap();
    let scale = 1.0 / (hd as f64).sqrt();
    let (k1, v1) = (k0.to_device(&gpu).unwrap(), v0.to_device(&gpu).unwrap());
    let (want, reference_counts) = with_path_counted(path, || {
        let q = fused::qkv_rope_write(&qkv, &angles, &k1, &v1, &batch, heads, kv_heads, hd).unwrap();
        paged_attention(&q, &k1, &v1, &batch, scale).unwrap()
    });
    let (k2, v2) = (k0.to_device(&gpu).unwrap(), v0.to_device(&gpu).unwrap());
    let (got, fused_counts) = with_path_counted(path, || fused::qkv_rope_attention(&qkv, &angles, &k2, &v2, &batch, heads, kv_heads, hd, scale).unwrap());
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    for (what, x, y) in [("k cache", &k1, &k2), ("v cache", &v1, &v2)] {
        let (x, y) = (bits(x), bits(y));
        let differ = x.iter().zip(&y).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{name} {dtype:?}: {what} differs from qkv_rope_write's in {differ} values");
    }
    let (g, w) = (bits(&got), bits(&want));
    let differ = g.iter().zip(&w).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    let err = rel_err(&f32_cpu(&got), &f32_cpu(&want));
    println!(
        "qkv_rope_attention {name} {dtype:?}: {:?}, output rel err {err:.2e} ({differ} values differ) against qkv_rope_write + paged_attention",
        fused_counts
    );
    if tol == 0.0 {
        assert_eq!(differ, 0, "{name} {dtype:?}: output differs in {differ} values (rel err {err})");
    } else {
        assert!(err <= tol, "{name} {dtype:?}: output rel err {err}");
    }
    (fused_counts, reference_counts)
}

/// The diffusion models' fused projection (split, per-head q/k RMSNorm, split-half RoPE, K/V
/// write, k and v returned) against the candle composition on the CPU in the same dtype: with
/// and without the q/k norm, GQA and MHA, head dims 64, 128, 192 and 256 (2, 4, 6 and 8 elements
/// per lane), explicit scattered positions.
/// Cache rows nobody writes must stay bit-identical.
#[test]
fn fused_qkv_norm_rope_write() {
    use ponder::ops::{qkv_norm_rope_write, RopeTable};
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(heads, kvh, hd, norm) in &[(32usize, 8usize, 128usize, true), (32, 8, 128, false), (4, 4, 64, true), (4, 2, 256, true), (2, 1, 192, false)] {
            let mut rng = StdRng::seed_from_u64((heads * 7 + hd + norm as usize) as u64);
            let (nb, bs) = (12, 16);
            let positions: Vec<u32> = vec![3, 4, 9, 17, 30, 31, 0, 1, 2, 3, 4, 5, 6, 40, 41];
            let host = PagedBatchHost {
                block_tables: vec![vec![5, 11], vec![2, 7, 9]],
                context_lens: vec![32, 42],
                cu_q_lens: vec![0, 6, 15],
                write_positions: positions.clone(),
            };
            let t = positions.len();
            let qkv = rand_tensor(&mut rng, &[t, (heads + 2 * kvh) * hd], -3.0, 3.0, dt);
            let qn = rand_tensor(&mut rng, &[hd], 0.5, 1.5, dt);
            let kn = rand_tensor(&mut rng, &[hd], 0.5, 1.5, dt);
            let k0 = rand_tensor(&mut rng, &[nb, bs, kvh, hd], -1.0, 1.0, dt);
            let v0 = rand_tensor(&mut rng, &[nb, bs, kvh, hd], -1.0, 1.0, dt);
            let pos = Tensor::new(positions.as_slice(), &Device::Cpu).unwrap();
            let angles = RopeTable::new(hd, 1_000_000.0, dt, &Device::Cpu).unwrap().angles(&pos).unwrap();
            let b_cpu = PagedBatch::new(host.clone(), bs, AttnMask::BlockCausal(32), kvh * hd, &Device::Cpu).unwrap();
            let (kc, vc) = (k0.copy().unwrap(), v0.copy().unwrap());
            let nw = norm.then_some((&qn, &kn));
            let (q_ref, k_ref, v_ref) = qkv_norm_rope_write(&qkv, nw, 1e-6, &angles, &kc, &vc, &b_cpu, heads, kvh, hd).unwrap();

            let g = |x: &Tensor| x.to_device(&gpu).unwrap();
            let b_gpu = PagedBatch::new(host, bs, AttnMask::BlockCausal(32), kvh * hd, &gpu).unwrap();
            let (kg, vg) = (g(&k0), g(&v0));
            let g_angles = RopeAngles { cos: g(&angles.cos), sin: g(&angles.sin) };
            let (qn_g, kn_g) = (g(&qn), g(&kn));
            let nw_g = norm.then_some((&qn_g, &kn_g));
            let (q, k, v) = qkv_norm_rope_write(&g(&qkv), nw_g, 1e-6, &g_angles, &kg, &vg, &b_gpu, heads, kvh, hd).unwrap();
            let name = format!("{dt:?} {heads}/{kvh} d{hd} norm {norm}");
            assert_eq!(q.dims(), &[t, heads, hd], "{name}");
            // Same dtype, same rounding points: a bf16 ulp at most where f32 sums differ in order.
            let tol = tol_of(dt);
            for (what, a, b) in [("q", &q, &q_ref), ("k", &k, &k_ref), ("k cache", &kg, &kc)] {
                let e = rel_err(&f32_cpu(a), &f32_cpu(b));
                assert!(e <= tol, "{name}: {what} rel err {e} > {tol}");
            }
            for (what, a, b) in [("v", &v, &v_ref), ("v cache", &vg, &vc)] {
                let (a, b) = (f32_cpu(a).flatten_all().unwrap().to_vec1::<f32>().unwrap(), f32_cpu(b).flatten_all().unwrap().to_vec1::<f32>().unwrap());
                assert_eq!(a, b, "{name}: {what} is a copy");
            }
            // Untouched cache rows: the reference leaves them as k0, so the caches compare above
            // already cover them; check one row nobody writes explicitly.
            let row = |c: &Tensor| f32_cpu(c).get(0).unwrap().get(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(row(&kg), row(&k0), "{name}: block 0 is nobody's");
        }
    }
}
