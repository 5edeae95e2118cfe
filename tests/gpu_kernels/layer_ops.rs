//! A layer's small fused ops against their compositions: residual add + RMSNorm (allocating and
//! into arena buffers), split-K partial products and the norms that sum them, SiLU·mul, RoPE
//! angles, the f32 linear, the looped models' latent-change and gate-logit ops.

use super::*;

#[test]
fn fused_add_rms_norm() {
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // Widths that are a multiple of the 16-byte vector take the register-cached vector path; 2050 the scalar one.
        for &(rows, cols) in &[(1usize, 2048usize), (64, 2048), (257, 2048), (33, 1000), (5, 40), (3, 6000), (9, 2050)] {
            let mut rng = StdRng::seed_from_u64((rows * 7919 + cols) as u64);
            let res = rand_tensor(&mut rng, &[rows, cols], -4.0, 4.0, dt);
            let x = rand_tensor(&mut rng, &[rows, cols], -30.0, 30.0, dt);
            let wx = rand_tensor(&mut rng, &[cols], 0.2, 2.0, dt);
            let wn = rand_tensor(&mut rng, &[cols], 0.2, 2.0, dt);
            let eps = 1e-6;
            let (h_ref, n_ref) = fused::add_rms_norm(&f32_cpu(&res), &f32_cpu(&x), &f32_cpu(&wx), &f32_cpu(&wn), eps).unwrap();
            let g = |t: &Tensor| t.to_device(&gpu).unwrap();
            let (h, n) = fused::add_rms_norm(&g(&res), &g(&x), &g(&wx), &g(&wn), eps).unwrap();
            assert_eq!(h.dims(), &[rows, cols]);
            assert_eq!((h.dtype(), n.dtype()), (dt, dt));
            let (eh, en) = (rel_err(&f32_cpu(&h), &h_ref), rel_err(&f32_cpu(&n), &n_ref));
            let tol = tol_of(dt);
            println!("add_rms_norm {rows}x{cols:<5} {dt:?} h rel err {eh:.3e}, norm rel err {en:.3e} (tol {tol:.0e})");
            assert!(eh <= tol && en <= tol, "add_rms_norm {rows}x{cols} {dt:?}: {eh} {en}");
        }
    }
}

#[test]
fn fused_rms_norm_and_residual_add() {
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // Widths of whole 16-byte vectors take the vector path (16384: two vectors per thread in
        // bf16, four in f32); 2050 and 1001 the scalar one.
        for &(rows, cols) in &[(1usize, 2048usize), (8192, 2048), (257, 4096), (33, 1000), (5, 40), (3, 6000), (2, 16384), (9, 2050), (4, 1001), (64, 128)] {
            let mut rng = StdRng::seed_from_u64((rows * 104_729 + cols) as u64);
            let res = rand_tensor(&mut rng, &[rows, cols], -4.0, 4.0, dt);
            let x = rand_tensor(&mut rng, &[rows, cols], -30.0, 30.0, dt);
            let w = rand_tensor(&mut rng, &[cols], 0.2, 2.0, dt);
            let eps = 1e-6;
            let g = |t: &Tensor| t.to_device(&gpu).unwrap();
            let tol = tol_of(dt);
            let n_ref = ponder::ops::rms_norm_reference(&f32_cpu(&x), &f32_cpu(&w), eps).unwrap();
            let n = ponder::ops::rms_norm(&g(&x), &g(&w), eps).unwrap();
            assert_eq!((n.dims(), n.dtype()), (&[rows, cols][..], dt));
            let en = rel_err(&f32_cpu(&n), &n_ref);
            let (h_ref, m_ref) = fused::residual_add_rms_norm(&f32_cpu(&res), &f32_cpu(&x), &f32_cpu(&w), eps).unwrap();
            let (h, m) = fused::residual_add_rms_norm(&g(&res), &g(&x), &g(&w), eps).unwrap();
            let (eh, em) = (rel_err(&f32_cpu(&h), &h_ref), rel_err(&f32_cpu(&m), &m_ref));
            // The plain residual add (no norm after it), vector and scalar paths alike.
            let s = fused::residual_add(&g(&res), &g(&x)).unwrap();
            assert_eq!((s.dims(), s.dtype()), (&[rows, cols][..], dt));
            let es = rel_err(&f32_cpu(&s), &fused::residual_add(&f32_cpu(&res), &f32_cpu(&x)).unwrap());
            println!("rms_norm {rows}x{cols:<5} {dt:?} rel err {en:.3e}; residual add h {eh:.3e}, norm {em:.3e}; plain add {es:.3e} (tol {tol:.0e})");
            assert!(en <= tol && eh <= tol && em <= tol && es <= tol, "rms_norm {rows}x{cols} {dt:?}: {en} {eh} {em} {es}");
        }
    }
    // Rank 3 (per-head q/k norms) and a non-contiguous input.
    let mut rng = StdRng::seed_from_u64(99);
    let x = rand_tensor(&mut rng, &[7, 16, 128], -3.0, 3.0, DType::BF16);
    let w = rand_tensor(&mut rng, &[128], 0.5, 1.5, DType::BF16);
    let n = ponder::ops::rms_norm(&x.to_device(&gpu).unwrap().transpose(0, 1).unwrap(), &w.to_device(&gpu).unwrap(), 1e-6).unwrap();
    let n_ref = ponder::ops::rms_norm_reference(&f32_cpu(&x).transpose(0, 1).unwrap().contiguous().unwrap(), &f32_cpu(&w), 1e-6).unwrap();
    assert!(rel_err(&f32_cpu(&n), &n_ref) <= tol_of(DType::BF16));
}

/// Split-K projections: the strided-batched partial products against the CPU's per-slice f32
/// products; the norms that sum them against the plain norm kernels fed the same sum (bit for
/// bit: the arithmetic after the sum is the same) and against the CPU composition; the plan; and
/// the projection + norm op end to end against the unsplit CPU ops.
#[test]
fn split_k_partials_and_their_norms() {
    use ponder::ops::split_k;
    let gpu = gpu_device();
    let g = |t: &Tensor| t.to_device(&gpu).unwrap();
    let values = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let eps = 1e-6;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        // (rows, n, k, splits): Ouro's o_proj and down at decode widths, small cases, and a
        // width off the 16-byte vector (98: the norms' scalar path).
        for &(rows, n, k, splits) in &[(16usize, 2048usize, 2048usize, 4usize), (64, 2048, 5632, 4), (1, 256, 512, 8), (3, 98, 64, 2), (5, 40, 96, 3)] {
            let mut rng = StdRng::seed_from_u64((rows * 31 + n * 7 + k) as u64);
            let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dt);
            let w = rand_tensor(&mut rng, &[n, k], -0.1, 0.1, dt);
            let parts_ref = split_k::linear_partials_reference(&x, &w, splits).unwrap();
            let parts = split_k::linear_partials(&g(&x), &g(&w), splits).unwrap();
            assert_eq!((parts.dims(), parts.dtype()), (&[splits, rows, n][..], DType::F32));
            let ep = rel_err(&f32_cpu(&parts), &parts_ref);
            let res = rand_tensor(&mut rng, &[rows, n], -4.0, 4.0, dt);
            let wx = rand_tensor(&mut rng, &[n], 0.2, 2.0, dt);
            let wn = rand_tensor(&mut rng, &[n], 0.2, 2.0, dt);
            // The norms read the CPU's partials, so only the norm kernels are compared here.
            let (h, m) = split_k::add_rms_norm_partials(&g(&res), &g(&parts_ref), &g(&wx), &g(&wn), eps).unwrap();
            let (hp, mp) = split_k::residual_add_rms_norm_partials(&g(&res), &g(&parts_ref), &g(&wx), eps).unwrap();
            assert_eq!((h.dims(), h.dtype(), m.dtype()), (&[rows, n][..], dt, dt));
            let x_sum = g(&split_k::sum_partials(&parts_ref, dt).unwrap());
            let (h0, m0) = fused::add_rms_norm(&g(&res), &x_sum, &g(&wx), &g(&wn), eps).unwrap();
            let (hp0, mp0) = fused::residual_add_rms_norm(&g(&res), &x_sum, &g(&wx), eps).unwrap();
            assert!(
                values(&h) == values(&h0) && values(&m) == values(&m0),
                "sandwich norm of partials differs from the plain kernel on their sum: {rows}x{n}/{splits} {dt:?}"
            );
            assert!(
                values(&hp) == values(&hp0) && values(&mp) == values(&mp0),
                "pre-norm of partials differs from the plain kernel on their sum: {rows}x{n}/{splits} {dt:?}"
            );
            let (h_ref, m_ref) = split_k::add_rms_norm_partials(&res, &parts_ref, &wx, &wn, eps).unwrap();
            let (eh, em) = (rel_err(&f32_cpu(&h), &f32_cpu(&h_ref)), rel_err(&f32_cpu(&m), &f32_cpu(&m_ref)));
            let (_, mp_ref) = split_k::residual_add_rms_norm_partials(&res, &parts_ref, &wx, eps).unwrap();
            let emp = rel_err(&f32_cpu(&mp), &f32_cpu(&mp_ref));
            let tol = tol_of(dt);
            println!("split-K {rows}x{n}x{k}/{splits} {dt:?}: partials rel err {ep:.3e}; against the CPU: sandwich h {eh:.3e} n {em:.3e}, pre-norm n {emp:.3e} (tol {tol:.0e})");
            assert!(ep <= 1e-4, "partials {rows}x{n}x{k}/{splits} {dt:?}: {ep}");
            assert!(eh <= tol && em <= tol && emp <= tol, "norms of partials {rows}x{n}x{k} {dt:?}: {eh} {em} {emp}");
        }
    }
    // Partials one float off 16-byte alignment: the kernel's scalar path at a vector width.
    let mut rng = StdRng::seed_from_u64(77);
    let parts = rand_tensor(&mut rng, &[2 * 5 * 64], -3.0, 3.0, DType::F32);
    let shifted = g(&Tensor::cat(&[Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(), parts.clone()], 0).unwrap());
    let shifted = shifted.narrow(0, 1, 2 * 5 * 64).unwrap().reshape((2, 5, 64)).unwrap();
    let parts = parts.reshape((2, 5, 64)).unwrap();
    let res = rand_tensor(&mut rng, &[5, 64], -4.0, 4.0, DType::BF16);
    let wx = rand_tensor(&mut rng, &[64], 0.2, 2.0, DType::BF16);
    let wn = rand_tensor(&mut rng, &[64], 0.2, 2.0, DType::BF16);
    let (h, m) = split_k::add_rms_norm_partials(&g(&res), &shifted, &g(&wx), &g(&wn), eps).unwrap();
    let (h_ref, m_ref) = split_k::add_rms_norm_partials(&g(&res), &g(&parts), &g(&wx), &g(&wn), eps).unwrap();
    let (eh, em) = (rel_err(&f32_cpu(&h), &f32_cpu(&h_ref)), rel_err(&f32_cpu(&m), &f32_cpu(&m_ref)));
    assert!(eh <= 1e-3 && em <= 1e-3, "unaligned partials: {eh} {em}");
    // The plan: at 16 rows, enough slices for 64-column tiles to cover the SMs (at most 4, each
    // slice of 5632 a whole number of 8-element vectors); on the H200 (132 SMs) o_proj / down's
    // 2048 columns split in 4, Huginn's 5280 run whole.
    let x = rand_tensor(&mut rng, &[16, 5632], -1.0, 1.0, DType::BF16);
    let w = rand_tensor(&mut rng, &[2048, 5632], -0.05, 0.05, DType::BF16);
    let sms = gpu_sms();
    let expect = |tiles: usize| (2..=(sms / tiles).min(4)).rev().find(|s| 5632 % (s * 8) == 0);
    assert_eq!(split_k::split_k_plan(&g(&x), 2048), expect(32));
    assert_eq!(split_k::split_k_plan(&g(&x), 5280), expect(83));
    if sms == 132 {
        assert_eq!((split_k::split_k_plan(&g(&x), 2048), split_k::split_k_plan(&g(&x), 5280)), (Some(4), None));
    }
    assert_eq!(split_k::split_k_plan(&g(&x.to_dtype(DType::F32).unwrap()), 2048), None, "f32 runs whole");
    assert_eq!(split_k::split_k_plan(&g(&x.repeat((5, 1)).unwrap()), 2048), None, "80 rows run whole");
    // The engine option forces a count (or none) on its thread.
    let forced = |split_k| ponder::ops::with_kernels(ponder::ops::KernelPolicy { split_k, ..Default::default() }, || split_k::split_k_plan(&g(&x), 2048)).0;
    assert_eq!(forced(ponder::ops::policy::SplitK::Forced { slices: 2, max_rows: 64 }), Some(2));
    assert_eq!(forced(ponder::ops::policy::SplitK::Forced { slices: 1, max_rows: 64 }), None);
    assert_eq!(forced(ponder::ops::policy::SplitK::Forced { slices: 4, max_rows: 8 }), None, "16 rows past the forced row limit");
    // End to end: the op a decode step runs (split on the device at 16 rows of bf16) against the
    // unsplit composition on the CPU.
    let res = rand_tensor(&mut rng, &[16, 2048], -4.0, 4.0, DType::BF16);
    let wx = rand_tensor(&mut rng, &[2048], 0.2, 2.0, DType::BF16);
    let wn = rand_tensor(&mut rng, &[2048], 0.2, 2.0, DType::BF16);
    let (h_ref, n_ref) = ponder::ops::linear_add_rms_norm(&f32_cpu(&res), &f32_cpu(&x), &f32_cpu(&w), &f32_cpu(&wx), &f32_cpu(&wn), eps).unwrap();
    let (h, n) = ponder::ops::linear_add_rms_norm(&g(&res), &g(&x), &g(&w), &g(&wx), &g(&wn), eps).unwrap();
    let (eh, en) = (rel_err(&f32_cpu(&h), &h_ref), rel_err(&f32_cpu(&n), &n_ref));
    let (_, m_ref) = ponder::ops::linear_residual_add_rms_norm(&f32_cpu(&res), &f32_cpu(&x), &f32_cpu(&w), &f32_cpu(&wx), eps).unwrap();
    let (_, m) = ponder::ops::linear_residual_add_rms_norm(&g(&res), &g(&x), &g(&w), &g(&wx), eps).unwrap();
    let em = rel_err(&f32_cpu(&m), &m_ref);
    println!("split-K projection + norm, 16x2048x5632 bf16: sandwich h {eh:.3e} n {en:.3e}; pre-norm n {em:.3e}");
    assert!(eh <= 1e-2 && en <= 1e-2 && em <= 1e-2, "{eh} {en} {em}");
}

#[test]
fn fused_silu_mul() {
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, inter) in &[(1usize, 5632usize), (64, 5632), (256, 5632), (7, 77)] {
            let mut rng = StdRng::seed_from_u64((rows * 31 + inter) as u64);
            let gu = rand_tensor(&mut rng, &[rows, 2 * inter], -8.0, 8.0, dt);
            let r = fused::silu_mul(&f32_cpu(&gu)).unwrap();
            let o = fused::silu_mul(&gu.to_device(&gpu).unwrap()).unwrap();
            assert_eq!(o.dims(), &[rows, inter]);
            assert_eq!(o.dtype(), dt);
            let e = rel_err(&f32_cpu(&o), &r);
            let tol = tol_of(dt);
            println!("silu_mul {rows}x{inter:<5} {dt:?} rel err {e:.3e} (tol {tol:.0e})");
            assert!(e <= tol, "silu_mul {rows}x{inter} {dt:?}: {e}");
        }
    }
}

/// RoPE angles in one launch (`RopeTable::angles` on CUDA): the same bits as the candle
/// composition run on the device (full and partial rotary, every float dtype, positions up to
/// 2^20, positions as a view into a larger buffer as the graphs pass them), and within float
/// rounding of the composition on the CPU.
#[test]
fn rope_angles_match_the_composition() {
    use ponder::ops::RopeTable;
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(0x2a9e);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(tokens, hd, rotary) in &[(1usize, 128usize, 128usize), (77, 128, 128), (300, 64, 64), (40, 128, 64), (5, 96, 96)] {
            // Three leading values: the positions start at an offset of their buffer.
            let mut pos: Vec<u32> = (0..tokens + 3).map(|_| rng.random_range(0..40_000u32)).collect();
            if tokens > 2 {
                (pos[3], pos[4]) = (0, 1 << 20);
            }
            let p = Tensor::new(pos.as_slice(), &gpu).unwrap().narrow(0, 3, tokens).unwrap();
            let pos = &pos[3..];
            let table = RopeTable::partial(hd, rotary, 1_000_000.0, dt, &gpu).unwrap();
            let got = table.angles(&p).unwrap();
            // The kernel itself (`angles` must not have fallen back to the composition).
            let inv: Vec<f32> = (0..hd / 2).map(|i| if 2 * i < rotary { 1.0 / 1e6f64.powf(2.0 * i as f64 / rotary as f64) as f32 } else { 0.0 }).collect();
            let (kcos, ksin) = ponder::ops::cuda::rope_angles(&p, &Tensor::from_vec(inv, (1, hd / 2), &gpu).unwrap(), dt).unwrap();
            for (what, g, k) in [("cos", &got.cos, &kcos), ("sin", &got.sin, &ksin)] {
                assert_eq!((g.dims(), k.dims()), (&[tokens, hd / 2][..], &[tokens, hd / 2][..]), "{what} {dt:?}");
                assert_eq!((g.dtype(), k.dtype()), (dt, dt));
            }
            let bits =
                |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.cos), bits(&kcos), "rope angles {tokens}x{hd} {dt:?}: cos of `angles` against the kernel called directly");
            assert_eq!(bits(&got.sin), bits(&ksin), "rope angles {tokens}x{hd} {dt:?}: sin of `angles` against the kernel called directly");
            let want = table.angles_reference(&p).unwrap();
            for (what, g, w) in [("cos", &got.cos, &want.cos), ("sin", &got.sin, &want.sin)] {
                let differ = bits(g).iter().zip(bits(w)).filter(|(a, b)| **a != *b).count();
                assert_eq!(differ, 0, "rope angles {tokens}x{hd} (rotary {rotary}) {dt:?}: {what} differs from the composition in {differ} values");
            }
            let cpu = RopeTable::partial(hd, rotary, 1_000_000.0, dt, &Device::Cpu).unwrap().angles(&Tensor::new(pos, &Device::Cpu).unwrap()).unwrap();
            let e = rel_err(&f32_cpu(&got.cos), &f32_cpu(&cpu.cos)).max(rel_err(&f32_cpu(&got.sin), &f32_cpu(&cpu.sin)));
            println!("rope angles {tokens}x{hd} (rotary {rotary}) {dt:?}: bit-identical to the composition on the device; rel err {e:.2e} against the CPU");
            assert!(e <= tol_of(dt), "rope angles {tokens}x{hd} {dt:?} against the CPU: {e}");
        }
    }
}

/// The heads' f32 logits: one GEMM storing f32, within 1e-5 of the f32 product on the CPU (the
/// product in the weights' dtype then cast — the heads before — is printed beside it).
#[test]
fn linear_f32_matches_the_f32_product() {
    let gpu = gpu_device();
    for dt in [DType::BF16, DType::F16, DType::F32] {
        for &(rows, k, n) in &[(1usize, 2048usize, 49152usize), (37, 2048, 4096), (256, 512, 1000)] {
            let mut rng = StdRng::seed_from_u64((rows * 7 + n) as u64);
            let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dt);
            let w = rand_tensor(&mut rng, &[n, k], -0.05, 0.05, dt);
            let (xg, wg) = (x.to_device(&gpu).unwrap(), w.to_device(&gpu).unwrap());
            let got = ponder::ops::linear_f32(&xg, &wg).unwrap();
            assert_eq!(got.dims(), &[rows, n]);
            assert_eq!(got.dtype(), DType::F32);
            let exact = f32_cpu(&x).matmul(&f32_cpu(&w).t().unwrap()).unwrap();
            let e = rel_err(&f32_cpu(&got), &exact);
            let old = xg.matmul(&wg.t().unwrap()).unwrap().to_dtype(DType::F32).unwrap();
            let e_old = rel_err(&f32_cpu(&old), &exact);
            println!("linear_f32 {rows}x{k}x{n} {dt:?}: rel err {e:.2e} against the f32 product (the product in {dt:?} then cast: {e_old:.2e})");
            assert!(e <= 1e-5, "linear_f32 {rows}x{k}x{n} {dt:?}: {e}");
        }
    }
}

/// µs per call of each fused op vs its candle composition on the GPU (bf16, Ouro-1.4B shapes).
#[test]
#[ignore]
fn fused_timing() {
    let gpu = gpu_device();
    let time = |f: &dyn Fn()| {
        for _ in 0..20 {
            f();
        }
        gpu.synchronize().unwrap();
        let mut s = vec![];
        for _ in 0..15 {
            let t0 = std::time::Instant::now();
            for _ in 0..50 {
                f();
            }
            gpu.synchronize().unwrap();
            s.push(t0.elapsed().as_secs_f64() / 50.0 * 1e6);
        }
        s.sort_by(|a, b| a.partial_cmp(b).unwrap());
        s[s.len() / 2]
    };
    let dt = DType::BF16;
    let (h, kvh, hd, c, inter, bs) = (16usize, 16usize, 128usize, 2048usize, 5632usize, 16usize);
    for w in [16usize, 64, 256] {
        let mut rng = StdRng::seed_from_u64(w as u64);
        let g = |t: Tensor| t.to_device(&gpu).unwrap();
        // qkv_rope_write: W decode rows at ctx 384.
        let rows: Vec<(usize, usize)> = vec![(1, 384); w];
        let nb = w * 384 / bs + 4;
        let host = PagedBatchHost {
            write_positions: Vec::new(),
            block_tables: (0..w).map(|r| ((r * 24) as u32..(r * 24 + 24) as u32).collect()).collect(),
            context_lens: vec![384; w],
            cu_q_lens: (0..=w as u32).collect(),
        };
        let batch = PagedBatch::new(host, bs, AttnMask::Causal, kvh * hd, &gpu).unwrap();
        let qkv = g(rand_tensor(&mut rng, &[w, (h + 2 * kvh) * hd], -1.0, 1.0, dt));
        let kc = Tensor::zeros((nb, bs, kvh, hd), dt, &gpu).unwrap();
        let vc = kc.zeros_like().unwrap();
        let pos = Tensor::new(vec![383u32; rows.len()].as_slice(), &gpu).unwrap();
        let angles = RopeTable::new(hd, 1e6, dt, &gpu).unwrap().angles(&pos).unwrap();
        let fq = time(&|| {
            fused::qkv_rope_write(&qkv, &angles, &kc, &vc, &batch, h, kvh, hd).unwrap();
        });
        let rq = time(&|| {
            fused::qkv_rope_write_reference(&qkv, &angles, &kc, &vc, &batch, h, kvh, hd).unwrap();
        });
        let res = g(rand_tensor(&mut rng, &[w, c], -1.0, 1.0, dt));
        let x = g(rand_tensor(&mut rng, &[w, c], -1.0, 1.0, dt));
        let wx = g(rand_tensor(&mut rng, &[c], 0.5, 1.5, dt));
        let fa = time(&|| {
            fused::add_rms_norm(&res, &x, &wx, &wx, 1e-6).unwrap();
        });
        let ra = time(&|| {
            fused::add_rms_norm_reference(&res, &x, &wx, &wx, 1e-6).unwrap();
        });
        let gu = g(rand_tensor(&mut rng, &[w, 2 * inter], -1.0, 1.0, dt));
        let fs = time(&|| {
            fused::silu_mul(&gu).unwrap();
        });
        let rs = time(&|| {
            fused::silu_mul_reference(&gu).unwrap();
        });
        println!(
            "TIMING fused W={w:<4} qkv_rope_write {fq:6.1} us (composition {rq:6.1}) | add_rms_norm {fa:6.1} us ({ra:6.1}) | silu_mul {fs:6.1} us ({rs:6.1})"
        );
    }
}

/// The pre-norm residual step into given buffers (Huginn's arena) against the allocating op on
/// the device, bit for bit, and against the CPU reference within the dtype's tolerance.
#[test]
fn residual_add_rms_norm_into_matches_the_allocating_op() {
    use ponder::ops::into::residual_add_rms_norm_into;
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, cols) in &[(37usize, 5280usize), (3, 96)] {
            let mut rng = StdRng::seed_from_u64((rows + cols) as u64);
            let r = rand_tensor(&mut rng, &[rows, cols], -2.0, 2.0, dt);
            let x = rand_tensor(&mut rng, &[rows, cols], -2.0, 2.0, dt);
            let w = rand_tensor(&mut rng, &[cols], 0.5, 1.5, dt);
            let (rg, xg, wg) = (r.to_device(&gpu).unwrap(), x.to_device(&gpu).unwrap(), w.to_device(&gpu).unwrap());
            let (h, n) = (Tensor::zeros((rows, cols), dt, &gpu).unwrap(), Tensor::zeros((rows, cols), dt, &gpu).unwrap());
            residual_add_rms_norm_into(&rg, &xg, &wg, 1e-6, &h, &n).unwrap();
            let (hw, nw) = ponder::ops::residual_add_rms_norm(&rg, &xg, &wg, 1e-6).unwrap();
            let flat = |t: &Tensor| f32_cpu(t).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&h), flat(&hw), "{dt:?} {rows}x{cols}: h");
            assert_eq!(flat(&n), flat(&nw), "{dt:?} {rows}x{cols}: n");
            let (_, nr) = ponder::ops::fused::residual_add_rms_norm_reference(&r, &x, &w, 1e-6).unwrap();
            let err = (f32_cpu(&n) - f32_cpu(&nr)).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(err <= 4.0 * tol_of(dt), "{dt:?} {rows}x{cols}: {err} from the CPU reference");
        }
    }
}

/// Huginn's post-norm step and the next norm in one launch (`post_norm_*`, and over split-k
/// partials `post_norm_parts_*`) give bit for bit what the two launches they replace give — the
/// pre-norm residual step, its norm taken as the stream, then `rms_norm` — on the vector path
/// (widths a multiple of 16 bytes) and the scalar one (99 columns), and stay within the dtype's
/// rounding of candle's CPU composition.
#[test]
fn post_norm_into_matches_the_two_norms_it_replaces() {
    use ponder::ops::into::{linear_norm_into, post_norm_into, NormAfter};
    let gpu = gpu_device();
    let flat = |t: &Tensor| f32_cpu(t).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, cols) in &[(37usize, 5280usize), (3, 96), (5, 99)] {
            let mut rng = StdRng::seed_from_u64((rows * 7 + cols) as u64);
            let r = rand_tensor(&mut rng, &[rows, cols], -2.0, 2.0, dt);
            let x = rand_tensor(&mut rng, &[rows, cols], -2.0, 2.0, dt);
            let w = rand_tensor(&mut rng, &[cols], 0.5, 1.5, dt);
            let w2 = rand_tensor(&mut rng, &[cols], 0.5, 1.5, dt);
            let g = |t: &Tensor| t.to_device(&gpu).unwrap();
            let (rg, xg, wg, w2g) = (g(&r), g(&x), g(&w), g(&w2));
            let (h, n) = (Tensor::zeros((rows, cols), dt, &gpu).unwrap(), Tensor::zeros((rows, cols), dt, &gpu).unwrap());
            post_norm_into(&rg, &xg, (&wg, &w2g), 1e-6, &h, &n).unwrap();
            let (_, hw) = ponder::ops::residual_add_rms_norm(&rg, &xg, &wg, 1e-6).unwrap();
            let nw = ponder::ops::rms_norm(&hw, &w2g, 1e-6).unwrap();
            assert_eq!(flat(&h), flat(&hw), "{dt:?} {rows}x{cols}: h");
            assert_eq!(flat(&n), flat(&nw), "{dt:?} {rows}x{cols}: n");
            let (_, hr) = ponder::ops::fused::residual_add_rms_norm_reference(&r, &x, &w, 1e-6).unwrap();
            let nr = ponder::ops::rms_norm_reference(&hr, &w2, 1e-6).unwrap();
            for (name, got, want) in [("h", &h, &hr), ("n", &n, &nr)] {
                let err = (f32_cpu(got) - f32_cpu(want)).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(err <= 8.0 * tol_of(dt), "{dt:?} {rows}x{cols}: {name} {err} from the CPU reference");
            }
        }
    }
    // Over a projection at decode widths (Huginn's o_proj), split over k (forced: the planned
    // policy runs 5280 columns whole) as the plain body splits it under the same policy: the
    // partials' form against the split projection's pre-norm step and a norm.
    let four = ponder::kernels::KernelPolicy { split_k: ponder::kernels::SplitK::Forced { slices: 4, max_rows: 64 }, ..Default::default() };
    for dt in [DType::BF16, DType::F16] {
        for rows in [1usize, 16, 64] {
            let (k, cols) = (5280usize, 5280usize);
            let mut rng = StdRng::seed_from_u64((rows * 11 + k) as u64);
            let g = |t: Tensor| t.to_device(&gpu).unwrap();
            let r = g(rand_tensor(&mut rng, &[rows, cols], -2.0, 2.0, dt));
            let x = g(rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dt));
            let wt = g(rand_tensor(&mut rng, &[cols, k], -0.02, 0.02, dt));
            let w = g(rand_tensor(&mut rng, &[cols], 0.5, 1.5, dt));
            let w2 = g(rand_tensor(&mut rng, &[cols], 0.5, 1.5, dt));
            let proj = Tensor::zeros((rows, cols), dt, &gpu).unwrap();
            let parts = Tensor::zeros(8 * rows * cols, DType::F32, &gpu).unwrap();
            let (h, n) = (Tensor::zeros((rows, cols), dt, &gpu).unwrap(), Tensor::zeros((rows, cols), dt, &gpu).unwrap());
            let (nw, hw) = ponder::ops::with_kernels(four, || {
                assert_eq!(ponder::ops::split_k::split_k_plan(&x, cols), Some(4), "{dt:?} {rows} rows: the projection splits");
                linear_norm_into(&r, &x, &wt, NormAfter::PostNorm { w: &w, w_next: &w2 }, 1e-6, (&proj, &parts), &h, &n).unwrap();
                let (_, hw) = ponder::ops::linear_residual_add_rms_norm(&r, &x, &wt, &w, 1e-6).unwrap();
                (ponder::ops::rms_norm(&hw, &w2, 1e-6).unwrap(), hw)
            })
            .0;
            assert_eq!(flat(&h), flat(&hw), "{dt:?} {rows} rows over k {k}: h");
            assert_eq!(flat(&n), flat(&nw), "{dt:?} {rows} rows over k {k}: n");
        }
    }
    println!("post_norm_into: equal to the two launches it replaces (vector and scalar paths, whole and split-k)");
}

/// A core step's relative latent change in one launch against the f32 composition on the CPU:
/// bf16 / f16 / f32 states `[rows, 2h]` read over their s half, one row to a launch's width,
/// an odd width, through `ops::fused::latent_change` and into a given buffer (rows past the
/// launch untouched); within f32 summation-order rounding.
#[test]
fn latent_change_matches_the_f32_composition() {
    use ponder::ops::fused::{latent_change, latent_change_reference};
    use ponder::ops::into::latent_change_into;
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, h) in &[(1usize, 5280usize), (37, 2048), (5, 99)] {
            let mut rng = StdRng::seed_from_u64((rows * 17 + h) as u64);
            let old = rand_tensor(&mut rng, &[rows, 2 * h], -2.0, 2.0, dt);
            // The new state near the old one, as consecutive core steps are.
            let step = rand_tensor(&mut rng, &[rows, 2 * h], -0.05, 0.05, dt);
            let new = (old.to_dtype(DType::F32).unwrap() + step.to_dtype(DType::F32).unwrap()).unwrap().to_dtype(dt).unwrap();
            let want: Vec<f32> = latent_change_reference(&old, &new, h).unwrap().to_vec1().unwrap();
            let (og, ng) = (old.to_device(&gpu).unwrap(), new.to_device(&gpu).unwrap());
            let got: Vec<f32> = latent_change(&og, &ng, h).unwrap().to_device(&Device::Cpu).unwrap().to_vec1().unwrap();
            let buf = Tensor::full(7f32, rows + 2, &gpu).unwrap();
            latent_change_into(&og, &ng, h, &buf.narrow(0, 0, rows).unwrap()).unwrap();
            let into: Vec<f32> = buf.to_device(&Device::Cpu).unwrap().to_vec1().unwrap();
            assert_eq!(&into[..rows], &got[..], "{dt:?} [{rows}, {h}]: the two entry points");
            assert_eq!(&into[rows..], &[7.0, 7.0], "{dt:?} [{rows}, {h}]: rows past the launch untouched");
            for (r, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!(*e > 0.0 && (g - e).abs() <= 1e-5 * e, "{dt:?} [{rows}, {h}] row {r}: {g} vs {e}");
            }
        }
    }
    println!("latent_change: within 1e-5 of the f32 composition for f32/bf16/f16");
}

/// The arena's exit-gate logit (one launch, the cast folded into the load) against the gate's
/// f32 linear layer over the cast rows on the CPU: within f32 summation-order rounding.
#[test]
fn gate_logit_into_matches_the_f32_linear() {
    use ponder::ops::into::gate_logit_into;
    let gpu = gpu_device();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for &(rows, k) in &[(1usize, 2048usize), (37, 2048), (5, 100)] {
            let mut rng = StdRng::seed_from_u64((rows * 13 + k) as u64);
            let h = rand_tensor(&mut rng, &[rows, k], -2.0, 2.0, dt);
            let w = rand_tensor(&mut rng, &[1, k], -0.1, 0.1, DType::F32);
            let b = rand_tensor(&mut rng, &[1], -1.0, 1.0, DType::F32);
            let want = Tensor::zeros(rows, DType::F32, &Device::Cpu).unwrap();
            gate_logit_into(&h, &w, &b, &want).unwrap();
            let got = Tensor::zeros(rows + 2, DType::F32, &gpu).unwrap();
            let (hg, wg, bg) = (h.to_device(&gpu).unwrap(), w.to_device(&gpu).unwrap(), b.to_device(&gpu).unwrap());
            gate_logit_into(&hg, &wg, &bg, &got.narrow(0, 0, rows).unwrap()).unwrap();
            let got: Vec<f32> = got.to_device(&Device::Cpu).unwrap().to_vec1().unwrap();
            let want: Vec<f32> = want.to_vec1().unwrap();
            for (r, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 1e-5 * (1.0 + e.abs()), "gate logit {dt:?} [{rows}, {k}] row {r}: {g} vs {e}");
            }
            assert_eq!(&got[rows..], &[0.0, 0.0], "rows past the launch untouched");
        }
    }
    println!("gate_logit_into: within 1e-5 of the f32 linear for f32/bf16/f16");
}
