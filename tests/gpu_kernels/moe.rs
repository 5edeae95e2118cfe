//! Mixture-of-experts on the device: the routing rule, router logits, the grouped expert GEMMs
//! (bf16 and FP8) against the CPU composition, expert parallelism over the kernels.

use super::*;

/// The MoE diffusion families on the device (f32): every position's logits of the parity
/// fixtures' canvases against the float64 references (`tests/parity_llada2.rs` on the CPU) —
/// partial RoPE through the fused kernels, the f32 router and the expert composition.
/// Both MoE families at head dim 64 (the tiny fixtures' 16 is not a head dim the CUDA attention
/// takes): the CUDA model in f32 (device routing, composed experts) equals the CPU model, which
/// `tests/parity_llada2.rs` holds to the float64 references; in bf16 the grouped kernels run
/// every MoE layer and stay within bf16 rounding of the CPU f32 logits.
#[test]
fn moe_diffusion_models_on_the_device_match_the_cpu() {
    use ponder::testing::{tiny_llada2_config, tiny_sdar_moe_config, write_random_llada2, write_random_sdar};
    let gpu = gpu_device();
    let tmp = tempfile::tempdir().unwrap();
    let llada2 = ponder::diffusion::models::Llada2Config {
        hidden_size: 256,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(64),
        num_experts: 16,
        num_experts_per_tok: 4,
        n_group: 4,
        topk_group: 2,
        moe_intermediate_size: 32,
        ..tiny_llada2_config(97)
    };
    let sdar_moe = ponder::diffusion::models::SdarConfig {
        hidden_size: 256,
        head_dim: Some(64),
        num_experts: Some(16),
        num_experts_per_tok: Some(4),
        moe_intermediate_size: Some(32),
        ..tiny_sdar_moe_config(97)
    };
    write_random_llada2(&tmp.path().join("llada2"), &llada2, 5).unwrap();
    write_random_sdar(&tmp.path().join("sdar_moe"), &sdar_moe, 5).unwrap();
    let ids: Vec<u32> = vec![3, 17, 42, 8, 96, 96, 96, 96, 11, 96, 5, 96];
    for family in ["llada2", "sdar_moe"] {
        let dir = ponder::loader::ModelDir::open(tmp.path().join(family)).unwrap();
        let cpu = ponder::diffusion::models::load(&dir.config, &dir.weights(DType::F32, &Device::Cpu).unwrap()).unwrap();
        let want = ponder::testing::canvas_logits(&cpu, &ids, 4).unwrap();
        // bf16: a near-tie in the router may choose another expert for a token than f32 does,
        // so each position gets a looser bound than the mean over positions.
        for (dtype, tol, mean_tol) in [(DType::F32, 1e-4, 1e-4), (DType::BF16, 0.1, 3e-2)] {
            let model = ponder::diffusion::models::load(&dir.config, &dir.weights(dtype, &gpu).unwrap()).unwrap();
            let got = ponder::testing::canvas_logits(&model, &ids, 4).unwrap();
            let mut total = 0.0;
            for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
                let w: Vec<f64> = w.iter().map(|&v| v as f64).collect();
                let err = ponder::testing::relative_error(g, &w);
                assert!(err <= tol, "{family} {dtype:?} position {pos}: relative error {err:e} against the CPU");
                total += err;
            }
            let mean = total / ids.len() as f64;
            assert!(mean <= mean_tol, "{family} {dtype:?}: mean relative error {mean:e} against the CPU");
        }
    }
}

fn llada2_router(e: usize, k: usize, g: usize, kg: usize) -> ponder::ops::moe::RouterArch {
    use ponder::ops::moe::{RouterArch, Scoring};
    RouterArch { num_experts: e, top_k: k, n_group: g, topk_group: kg, scoring: Scoring::Sigmoid, norm_topk: true, scale: 2.5 }
}

#[test]
fn moe_routing_on_the_device_chooses_as_the_host_rule() {
    use ponder::ops::moe::{route, route_reference, RouterArch, Scoring};
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(0x0e0e);
    let qwen = |norm_topk| RouterArch { num_experts: 128, top_k: 8, n_group: 1, topk_group: 1, scoring: Scoring::Softmax, norm_topk, scale: 1.0 };
    let cases: Vec<(&str, RouterArch, bool)> = vec![
        ("llada2 (256 experts, 8 groups keep 4, biased)", llada2_router(256, 8, 8, 4), true),
        ("llada2 without bias", llada2_router(256, 8, 8, 4), false),
        ("sigmoid, one group", llada2_router(64, 6, 1, 1), true),
        ("qwen3-moe softmax, renormalised", qwen(true), false),
        ("qwen3-moe softmax, raw", qwen(false), false),
        ("odd expert count, groups of 3", llada2_router(24, 4, 8, 3), true),
        // Shapes the register-resident router cannot hold: the shared-memory one.
        ("groups of 100 (no whole-lane split)", llada2_router(200, 8, 2, 1), true),
        ("512 experts, softmax", RouterArch { num_experts: 512, ..qwen(true) }, false),
        ("top 40 of 64", llada2_router(64, 40, 1, 1), true),
        // One to seven experts a lane (`moe_route_reg_p1`, `_p5`, `_p6`, `_p7`).
        ("16 experts, one a lane", llada2_router(16, 4, 1, 1), true),
        ("160 experts, five a lane", llada2_router(160, 8, 1, 1), true),
        ("192 experts softmax, six a lane", RouterArch { num_experts: 192, ..qwen(true) }, false),
        ("224 experts, seven a lane", llada2_router(224, 8, 1, 1), false),
    ];
    for (name, arch, with_bias) in cases {
        let e = arch.num_experts;
        for tokens in [1usize, 37, 300] {
            // Logits on a coarse grid, so that equal scores (ties broken by expert index) occur.
            let z: Vec<f32> = (0..tokens * e).map(|_| rng.random_range(-16i32..16) as f32 / 8.0).collect();
            let logits = Tensor::from_vec(z, (tokens, e), &Device::Cpu).unwrap();
            let bias =
                with_bias.then(|| Tensor::from_vec((0..e).map(|_| rng.random_range(-8i32..8) as f32 / 64.0).collect::<Vec<_>>(), e, &Device::Cpu).unwrap());
            let (want_ids, want_w) = route_reference(&logits, bias.as_ref(), &arch).unwrap();
            let bias_gpu = bias.as_ref().map(|b| b.to_device(&gpu).unwrap());
            let (got_ids, got_w) = route(&logits.to_device(&gpu).unwrap(), bias_gpu.as_ref(), &arch).unwrap();
            assert!(got_ids.device().is_cuda());
            assert_eq!(got_ids.to_vec2::<u32>().unwrap(), want_ids.to_vec2::<u32>().unwrap(), "{name}, {tokens} tokens: chosen experts");
            let (g, w) = (got_w.to_vec2::<f32>().unwrap(), want_w.to_vec2::<f32>().unwrap());
            let worst = g.iter().flatten().zip(w.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-6, "{name}, {tokens} tokens: weights differ by {worst:e}");
        }
    }
}

/// Runs `f` under each MoE GEMM selection: Hopper's kernels (what the H200 runs) and the
/// `mma.sync` kernels other GPUs run (in force on this thread only).
fn for_each_moe_kernels(mut f: impl FnMut(ponder::ops::moe::MoeKernels)) {
    use ponder::ops::moe::MoeKernels;
    for k in [MoeKernels::Auto, MoeKernels::MmaSync] {
        ponder::ops::with_kernels(ponder::ops::KernelPolicy { moe: k, ..Default::default() }, || f(k));
    }
}

#[test]
fn router_logits_from_split_weights_have_f32_accuracy() {
    for_each_moe_kernels(router_logits_check);
}

fn router_logits_check(kernels: ponder::ops::moe::MoeKernels) {
    use ponder::ops::moe::RouterWeights;
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(0x5917);
    // One token (many k slices), a few hundred (some), thousands (one or two), odd widths.
    for (tokens, e, h) in [(1usize, 256usize, 2048usize), (300, 256, 2048), (2177, 128, 512), (2049, 64, 4096), (37, 8, 128)] {
        let w = rand_tensor(&mut rng, &[e, h], -0.1, 0.1, DType::F32);
        let x = rand_tensor(&mut rng, &[tokens, h], -3.0, 3.0, DType::BF16);
        let want = RouterWeights::new(w.clone()).unwrap().logits(&x).unwrap().to_vec2::<f32>().unwrap();
        let router = RouterWeights::new(w.to_device(&gpu).unwrap()).unwrap();
        let got = router.logits(&x.to_device(&gpu).unwrap()).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let got = got.to_vec2::<f32>().unwrap();
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            let scale = w.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-6);
            let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
            // f32 summation-order noise reaches ~1e-5 of the largest logit here (2048-4096 terms);
            // bf16 weights would be ~4e-3.
            assert!(worst <= 5e-5, "{kernels:?} {tokens}x{h} -> {e}, token {t}: split-weight logits off by {worst:e} of the row's largest");
        }
    }
}

/// A non-finite hidden state reaches the router as NaN logits: routing must not fail or touch
/// memory outside its buffers, and the experts must skip what it could not choose.
#[test]
fn moe_routing_survives_non_finite_logits() {
    use ponder::ops::moe::{moe_experts, route, StackedExperts};
    let gpu = gpu_device();
    let (e, k, w, h) = (8, 2, 16, 64);
    let mut z = vec![f32::NAN; 3 * e];
    z[e + 3] = 1.0; // token 1: one finite logit for two choices
    z[2 * e..].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32); // token 2: all finite
    let logits = Tensor::from_vec(z, (3, e), &gpu).unwrap();
    for arch in [llada2_router(e, k, 4, 2), llada2_router(e, k, 1, 1)] {
        let (ids, weights) = route(&logits, None, &arch).unwrap();
        let ids = ids.to_vec2::<u32>().unwrap();
        assert_eq!(ids[0], [u32::MAX, u32::MAX], "all-NaN token chooses nothing");
        assert_eq!(ids[1][1], u32::MAX, "one finite logit fills one choice");
        assert!(ids[2].iter().all(|&i| (i as usize) < e));
        let mut rng = StdRng::seed_from_u64(7);
        let experts = StackedExperts::new(
            rand_tensor(&mut rng, &[e, 2 * w, h], -0.1, 0.1, DType::BF16).to_device(&gpu).unwrap(),
            rand_tensor(&mut rng, &[e, h, w], -0.1, 0.1, DType::BF16).to_device(&gpu).unwrap(),
        )
        .unwrap();
        let x = rand_tensor(&mut rng, &[3, h], -1.0, 1.0, DType::BF16).to_device(&gpu).unwrap();
        let ids = Tensor::new(ids, &gpu).unwrap();
        let out = moe_experts(&x, &ids, &weights, &experts, None, None).unwrap();
        let out = f32_cpu(&out).to_vec2::<f32>().unwrap();
        assert!(out[0].iter().all(|&v| v == 0.0), "no expert: no contribution");
    }
}

/// One grouped-MoE test case: x `[tokens, h]`, gate_up `[e, 2w, h]` and down `[e, h, w]` of
/// the experts' scale, with `with_shared` a shared expert's output and a residual stream (of
/// the experts' scale too, so that a tolerance still measures the experts), and the top-`k`
/// routes of random logits.
struct MoeCase {
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    shared: Option<Tensor>,
    residual: Option<Tensor>,
    ids: Tensor,
    weights: Tensor,
}

fn moe_case(seed: u64, (tokens, e, k, w, h): (usize, usize, usize, usize, usize), with_shared: bool, dtype: DType) -> MoeCase {
    let mut rng = StdRng::seed_from_u64(seed);
    let scale = 1.0 / (h as f32).sqrt();
    let x = rand_tensor(&mut rng, &[tokens, h], -1.0, 1.0, dtype);
    let gate_up = rand_tensor(&mut rng, &[e, 2 * w, h], -2.0 * scale, 2.0 * scale, dtype);
    let down = rand_tensor(&mut rng, &[e, h, w], -2.0 / (w as f32).sqrt(), 2.0 / (w as f32).sqrt(), dtype);
    let shared = with_shared.then(|| rand_tensor(&mut rng, &[tokens, h], -0.5, 0.5, dtype));
    let residual = with_shared.then(|| rand_tensor(&mut rng, &[tokens, h], -0.5, 0.5, dtype));
    let logits = rand_tensor(&mut rng, &[tokens, e], -3.0, 3.0, DType::F32);
    let (ids, weights) = ponder::ops::moe::route_reference(&logits, None, &llada2_router(e, k, 1, 1)).unwrap();
    MoeCase { x, gate_up, down, shared, residual, ids, weights }
}

#[test]
fn grouped_moe_kernels_match_the_composition() {
    for_each_moe_kernels(grouped_moe_check);
}

fn grouped_moe_check(kernels: ponder::ops::moe::MoeKernels) {
    use ponder::ops::moe::{moe_experts, moe_experts_reference, StackedExperts};
    let gpu = gpu_device();
    // (name, tokens, experts, top_k, width, hidden, shared): few rows per expert (64-row tiles,
    // some experts idle) and many (128-row tiles: Hopper's warpgroup kernels, or the `mma.sync`
    // ones under `MoeKernels::MmaSync`), with and without a shared expert.
    let cases = [
        ("decode-like: 5 tokens, 64 experts, top 8", 5, 64, 8, 64, 256, true),
        ("FOCUS-like: 200 tokens, 64 experts, top 8", 200, 64, 8, 128, 512, false),
        ("baseline-like: 1500 tokens, 16 experts, top 4 (128-row tiles)", 1500, 16, 4, 64, 256, true),
        ("LLaDA2.0-mini widths: 96 tokens, 32 experts, top 8", 96, 32, 8, 512, 2048, true),
        ("LLaDA2.0-mini widths, 128-row tiles: 700 tokens, 32 experts, top 8", 700, 32, 8, 512, 2048, true),
        // Widths off the tiles: k tails (hidden 200, width 48) and N tails, at both tile heights.
        ("tails, 64-row tiles: hidden 200, width 48", 300, 8, 2, 48, 200, true),
        ("tails, 128-row tiles: hidden 200, width 48", 1000, 8, 2, 48, 200, false),
        // The Hopper GEMM with a k tail (down: k 144).
        ("k tail, 128-row tiles: hidden 512, width 144", 900, 8, 2, 144, 512, true),
        // Short experts: about one 128-row tile each (100 rows on average), some two.
        ("short experts, 128-row tiles: 700 tokens, 7 experts, top 1", 700, 7, 1, 64, 256, false),
        // More row tiles than SMs: each CTA of the persistent kernels takes several.
        ("many row tiles: 5000 tokens, 16 experts, top 4", 5000, 16, 4, 64, 256, true),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (name, tokens, e, k, w, h, with_shared) in cases {
            let MoeCase { x, gate_up, down, shared, residual, ids, weights } = moe_case((tokens * 7919 + e) as u64, (tokens, e, k, w, h), with_shared, dtype);

            let cpu = StackedExperts::new(f32_cpu(&gate_up), f32_cpu(&down)).unwrap();
            let want =
                moe_experts_reference(&f32_cpu(&x), &ids, &weights, &cpu, shared.as_ref().map(f32_cpu).as_ref(), residual.as_ref().map(f32_cpu).as_ref())
                    .unwrap();
            let on_gpu = StackedExperts::new(gate_up.to_device(&gpu).unwrap(), down.to_device(&gpu).unwrap()).unwrap();
            assert!(on_gpu.on_kernels(), "{name}: {dtype:?} experts should run on the grouped kernels");
            let to = |t: &Tensor| t.to_device(&gpu).unwrap();
            let got = moe_experts(&to(&x), &to(&ids), &to(&weights), &on_gpu, shared.as_ref().map(to).as_ref(), residual.as_ref().map(to).as_ref()).unwrap();
            assert_eq!(got.dims(), [tokens, h]);
            let (got, want) = (f32_cpu(&got).flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt() / norm;
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let peak = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(err <= 1e-2 && worst <= 0.05 * peak, "{kernels:?} {name} {dtype:?}: relative error {err:e}, worst {worst:e} of peak {peak:e}");
            // The stacked layout itself is also the composition's: the device composition on the
            // kernels' interleaved weights equals the kernels too.
            let composed =
                moe_experts_reference(&to(&x), &to(&ids), &to(&weights), &on_gpu, shared.as_ref().map(to).as_ref(), residual.as_ref().map(to).as_ref())
                    .unwrap();
            let composed = f32_cpu(&composed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let err2 = got.iter().zip(&composed).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt() / norm;
            assert!(err2 <= 1e-2, "{kernels:?} {name} {dtype:?}: kernels vs the device composition {err2:e}");
        }
    }
}

/// FP8 experts on the grouped W8A8 kernels (E4M3 tokens and weights, a scale per row of each)
/// against the per-expert W8A8 composition on the CPU, from the same bf16 / f16 weights
/// quantized on either device (bit for bit the same bytes and scales); and the device's own
/// composition on the interleaved FP8 layout against the same. Widths off the 128-column FP8
/// k tiles and the 128-column n tiles, both tile heights; Hopper's warpgroup kernels and the
/// `mma.sync` ones. The bound holds only where both sides round the SwiGLU activations alike
/// before re-quantizing them (silu in f32, then the dtype): candle's CPU silu in bf16 rounds
/// three times, and that alone moves this composition by 1.3–1.6 % in bf16.
#[test]
fn grouped_fp8_moe_kernels_match_the_w8a8_composition() {
    use ponder::ops::moe::MoeKernels;
    for moe in [MoeKernels::Auto, MoeKernels::MmaSync] {
        grouped_fp8_moe_check(ponder::ops::KernelPolicy { fp8: ponder::ops::Fp8Kernels::W8A8, moe, ..Default::default() });
    }
}

fn grouped_fp8_moe_check(policy: ponder::ops::KernelPolicy) {
    use ponder::ops::moe::{moe_experts, moe_experts_reference, StackedExperts};
    use ponder::ops::with_kernels;
    use ponder::quant::Quantization;
    let gpu = gpu_device();
    // (name, tokens, experts, top_k, width, hidden, shared)
    let cases = [
        ("FOCUS-like: 200 tokens, 64 experts, top 8", 200, 64, 8, 128, 512, false),
        ("LLaDA2.0-mini widths: 96 tokens, 32 experts, top 8", 96, 32, 8, 512, 2048, true),
        ("LLaDA2.0-mini widths, 128-row tiles: 700 tokens, 32 experts, top 8", 700, 32, 8, 512, 2048, true),
        ("tails, 64-row tiles: hidden 208, width 48", 300, 8, 2, 48, 208, true),
        ("tails, 128-row tiles: hidden 208, width 48", 1000, 8, 2, 48, 208, false),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (name, tokens, e, k, w, h, with_shared) in cases {
            // (The residual add is the 16-bit test's; the FP8 one measures the experts alone.)
            let MoeCase { x, gate_up, down, shared, ids, weights, .. } = moe_case((tokens * 7907 + e) as u64, (tokens, e, k, w, h), with_shared, dtype);

            let cpu = StackedExperts::quantized(gate_up.clone(), down.clone(), Quantization::Fp8).unwrap();
            let (want, _) = with_kernels(policy, || moe_experts_reference(&x, &ids, &weights, &cpu, shared.as_ref(), None).unwrap());
            let on_gpu = StackedExperts::quantized(gate_up.to_device(&gpu).unwrap(), down.to_device(&gpu).unwrap(), Quantization::Fp8).unwrap();
            assert!(on_gpu.on_kernels(), "{name}: {dtype:?} FP8 experts should take the kernels' layout");
            let to = |t: &Tensor| t.to_device(&gpu).unwrap();
            let (got, counts) =
                with_kernels(policy, || moe_experts(&to(&x), &to(&ids), &to(&weights), &on_gpu, shared.as_ref().map(to).as_ref(), None).unwrap());
            assert_eq!(counts.fp8_w8a8, 2, "{:?} {name} {dtype:?}: the grouped W8A8 GEMMs ran", policy.moe);
            let (composed, _) =
                with_kernels(policy, || moe_experts_reference(&to(&x), &to(&ids), &to(&weights), &on_gpu, shared.as_ref().map(to).as_ref(), None).unwrap());
            let want = f32_cpu(&want).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
            // Which grouped kernel ran (the launch picks its tile height by rows per expert).
            let kernel = match (tokens * k / e >= 96, policy.moe) {
                (true, ponder::ops::moe::MoeKernels::Auto) => "128-row tiles (wgmma on Hopper)",
                (true, _) => "128-row tiles (mma.sync)",
                (false, _) => "64-row tiles (mma.sync)",
            };
            for (what, t) in [("kernels", &got), ("device composition", &composed)] {
                let t = f32_cpu(t).flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let err = t.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt() / norm;
                println!("{:?} {name} {dtype:?}, {kernel}: {what} against the CPU's W8A8 composition: relative error {err:e}", policy.moe);
                assert!(err <= 1e-2, "{:?} {name} {dtype:?}, {kernel}: {what} against the CPU's W8A8 composition: relative error {err:e}", policy.moe);
            }
        }
    }
}

/// Expert parallelism on the kernels: a rank's experts (ids mapped to its range, others skipped
/// by the kernels) against the CPU composition over the same range; the ranks' parts sum to the
/// whole layer's output.
#[test]
fn expert_parallel_moe_on_the_kernels_matches_the_composition() {
    use ponder::ops::moe::{moe_experts_local, moe_experts_reference, route_reference, StackedExperts};
    let gpu = gpu_device();
    let (tokens, e, k, w, h, ranks) = (300, 16, 4, 64, 256, 4);
    let mut rng = StdRng::seed_from_u64(54);
    let dtype = DType::BF16;
    let x = rand_tensor(&mut rng, &[tokens, h], -1.0, 1.0, dtype);
    let gate_up = rand_tensor(&mut rng, &[e, 2 * w, h], -0.1, 0.1, dtype);
    let down = rand_tensor(&mut rng, &[e, h, w], -0.2, 0.2, dtype);
    let logits = rand_tensor(&mut rng, &[tokens, e], -3.0, 3.0, DType::F32);
    let (ids, weights) = route_reference(&logits, None, &llada2_router(e, k, 1, 1)).unwrap();
    let whole = moe_experts_reference(&f32_cpu(&x), &ids, &weights, &StackedExperts::new(f32_cpu(&gate_up), f32_cpu(&down)).unwrap(), None, None).unwrap();
    let to = |t: &Tensor| t.to_device(&gpu).unwrap();
    let per = e / ranks;
    let mut sum = Tensor::zeros((tokens, h), DType::F32, &Device::Cpu).unwrap();
    for r in 0..ranks {
        let first = r * per;
        let (gu, dn) = (gate_up.narrow(0, first, per).unwrap(), down.narrow(0, first, per).unwrap());
        let cpu = StackedExperts::new(f32_cpu(&gu), f32_cpu(&dn)).unwrap();
        let want = moe_experts_local(&f32_cpu(&x), &ids, &weights, &cpu, first as u32, None, None).unwrap();
        let on_gpu = StackedExperts::new(to(&gu), to(&dn)).unwrap();
        assert!(on_gpu.on_kernels());
        let got = f32_cpu(&moe_experts_local(&to(&x), &to(&ids), &to(&weights), &on_gpu, first as u32, None, None).unwrap());
        let err = rel_err(&got, &want);
        assert!(err <= 1e-2, "rank {r}: kernels against the composition {err:e}");
        sum = (sum + got).unwrap();
    }
    let err = rel_err(&sum, &whole);
    assert!(err <= 1e-2, "the ranks' parts against the whole layer {err:e}");
}

/// Device time of one MoE layer's parts at LLaDA2.0-mini widths (hidden 2048, 256 experts of
/// width 512, 8 per token): the router logits (split-weight kernel, and as an f32 matmul), routing, and the grouped experts (grouping,
/// both GEMMs, combine), with the experts' rate in TFLOP/s (6 · hidden · width per pair).
#[test]
#[ignore]
fn moe_timing() {
    use ponder::ops::moe::{moe_experts, route, StackedExperts};
    let gpu = gpu_device();
    let (e, k, w, h) = (256, 8, 512, 2048);
    let arch = llada2_router(e, k, 8, 4);
    let gate_up = Tensor::randn(0f32, 0.02, (e, 2 * w, h), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
    let down = Tensor::randn(0f32, 0.02, (e, h, w), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
    let experts = StackedExperts::new(gate_up, down).unwrap();
    let router = ponder::ops::moe::RouterWeights::new(Tensor::randn(0f32, 0.02, (e, h), &gpu).unwrap()).unwrap();
    let time = |f: &mut dyn FnMut()| {
        f();
        gpu.synchronize().unwrap();
        let t = std::time::Instant::now();
        for _ in 0..10 {
            f();
        }
        gpu.synchronize().unwrap();
        t.elapsed().as_secs_f64() * 1e3 / 10.0
    };
    for tokens in [256usize, 1024, 4096, 8192] {
        let x = Tensor::randn(0f32, 1.0, (tokens, h), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
        let logits = router.logits(&x).unwrap();
        let (ids, weights) = route(&logits, None, &arch).unwrap();
        let router_ms = time(&mut || {
            router.logits(&x).unwrap();
        });
        let sgemm_ms = time(&mut || {
            router.logits_reference(&x).unwrap();
        });
        let route_ms = time(&mut || {
            route(&logits, None, &arch).unwrap();
        });
        let experts_ms = time(&mut || {
            moe_experts(&x, &ids, &weights, &experts, None, None).unwrap();
        });
        let tflops = (tokens * k * 6 * h * w) as f64 / (experts_ms * 1e-3) / 1e12;
        println!("moe {tokens:5} tokens: router {router_ms:.3} ms (f32 matmul {sgemm_ms:.3} ms) · route {route_ms:.3} ms · experts {experts_ms:.3} ms ({tflops:.0} TFLOP/s)");
    }
}
