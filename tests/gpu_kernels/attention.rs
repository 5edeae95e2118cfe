//! Paged attention: every kernel family (SIMT, its 8-warp builds, the tensor-core and split-K
//! forms, the decode ring) against the CPU reference, on decode, prefill, bidirectional and
//! block-causal launches; which family a launch takes; bad inputs refused.

use super::*;

struct Case {
    name: &'static str,
    /// (q_len, ctx) per row.
    rows: Vec<(usize, usize)>,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    block_size: usize,
    dtype: DType,
    mask: AttnMask,
    /// The launch's bound on the contexts when it is not the longest one (a captured graph's
    /// bucket).
    context_bound: Option<usize>,
}

struct Built {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    host: PagedBatchHost,
}

/// Random queries and a cache whose unused slots hold NaN (a read outside a row's context shows).
fn build(case: &Case, seed: u64) -> Built {
    let mut rng = StdRng::seed_from_u64(seed);
    let bs = case.block_size;
    let need: usize = case.rows.iter().map(|&(_, c)| c.div_ceil(bs)).sum();
    let num_blocks = need + 7;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    let width = case.kv_heads * case.hd;
    let mut kc = vec![f32::NAN; num_blocks * bs * width];
    let mut vc = vec![f32::NAN; num_blocks * bs * width];
    let mut next = 0;
    let mut host = PagedBatchHost { write_positions: Vec::new(), block_tables: vec![], context_lens: vec![], cu_q_lens: vec![0] };
    for &(q_len, ctx) in &case.rows {
        let table: Vec<u32> = ids[next..next + ctx.div_ceil(bs)].to_vec();
        next += table.len();
        for p in 0..ctx {
            let slot = table[p / bs] as usize * bs + p % bs;
            for i in 0..width {
                kc[slot * width + i] = rng.random_range(-1.0f32..1.0);
                vc[slot * width + i] = rng.random_range(-1.0f32..1.0);
            }
        }
        host.block_tables.push(table);
        host.context_lens.push(ctx as u32);
        host.cu_q_lens.push(host.cu_q_lens.last().unwrap() + q_len as u32);
    }
    let tokens = *host.cu_q_lens.last().unwrap() as usize;
    let qd: Vec<f32> = (0..tokens * case.heads * case.hd).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let cpu = Device::Cpu;
    let q = Tensor::from_vec(qd, (tokens, case.heads, case.hd), &cpu).unwrap().to_dtype(case.dtype).unwrap();
    let shape = (num_blocks, bs, case.kv_heads, case.hd);
    let k = Tensor::from_vec(kc, shape, &cpu).unwrap().to_dtype(case.dtype).unwrap();
    let v = Tensor::from_vec(vc, shape, &cpu).unwrap().to_dtype(case.dtype).unwrap();
    Built { q, k, v, host }
}

/// Checks every attention path against the CPU reference on `case`; returns the kernel
/// dispatches of all of them.
fn check(case: Case) -> ponder::ops::KernelCounts {
    let gpu = gpu_device();
    let b = build(&case, 0x5eed ^ case.rows.len() as u64 ^ ((case.hd as u64) << 8));
    let scale = 1.0 / (case.hd as f64).sqrt();
    let width = case.kv_heads * case.hd;
    let cpu_batch = PagedBatch::new(b.host.clone(), case.block_size, case.mask, width, &Device::Cpu).unwrap();
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let reference = paged_attention_reference(&f32_(&b.q), &f32_(&b.k), &f32_(&b.v), &cpu_batch, scale).unwrap();
    let mut gpu_batch = PagedBatch::new(b.host.clone(), case.block_size, case.mask, width, &gpu).unwrap();
    if let Some(bound) = case.context_bound {
        gpu_batch.max_context_len = bound;
    }
    let (q, k, v) = (b.q.to_device(&gpu).unwrap(), b.k.to_device(&gpu).unwrap(), b.v.to_device(&gpu).unwrap());
    let tol = match case.dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    };
    // Default dispatch (pipelined tensor cores for bf16/f16 with many query items), the SIMT
    // kernel, the synchronous-load tensor-core variant (where the tensor-core path applies) and
    // the decode ring (where it applies: one query a row, head dim 128, bf16/f16, sm_90).
    let mut counts = ponder::ops::KernelCounts::default();
    for path in [AttnPath::Default, AttnPath::Simt, AttnPath::Unpipelined, AttnPath::Ring] {
        let (out, c) = with_path_counted(path, || paged_attention(&q, &k, &v, &gpu_batch, scale).unwrap());
        counts += c;
        assert_eq!(out.dims(), reference.dims(), "{}", case.name);
        assert_eq!(out.dtype(), case.dtype);
        let err = rel_err(&out.to_device(&Device::Cpu).unwrap(), &reference);
        println!("{:<40} {:?} {path:<9?} rel err {err:.3e} (tol {tol:.0e})", case.name, case.dtype);
        assert!(err <= tol, "{} ({path:?}): rel err {err} > {tol}", case.name);
    }
    counts
}

/// The SMs of CUDA device 0 (the plans the tests predict depend on them).
pub(crate) fn gpu_sms() -> usize {
    let Device::Cuda(dev) = gpu_device() else { unreachable!() };
    ponder::ops::cuda::sm_count(&dev).unwrap()
}

/// Which paged-attention kernel family a check forces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttnPath {
    /// What the library picks (the tensor-core path runs pipelined).
    Default,
    /// Tensor-core path off.
    Simt,
    /// Tensor-core path with synchronous tile loads.
    Unpipelined,
    /// Decode rows through the bulk-copy ring.
    Ring,
}

impl AttnPath {
    /// The engine option that selects this path.
    pub(crate) fn policy(self) -> ponder::ops::KernelPolicy {
        use ponder::ops::AttentionKernels;
        let attention = match self {
            AttnPath::Default => AttentionKernels::Auto,
            AttnPath::Simt => AttentionKernels::Simt,
            AttnPath::Unpipelined => AttentionKernels::Unpipelined,
            AttnPath::Ring => AttentionKernels::DecodeRing,
        };
        ponder::ops::KernelPolicy { attention, ..Default::default() }
    }
}

/// Runs `f` with the kernels of `path` in force on this thread (ops called directly; an engine
/// runs under its own `kernels` option).
pub(crate) fn with_path<R>(path: AttnPath, f: impl FnOnce() -> R) -> R {
    with_path_counted(path, f).0
}

/// [`with_path`], with the kernel dispatches `f` made.
pub(crate) fn with_path_counted<R>(path: AttnPath, f: impl FnOnce() -> R) -> (R, ponder::ops::KernelCounts) {
    ponder::ops::with_kernels(path.policy(), f)
}

pub(crate) const DECODE_ROWS: &[(usize, usize)] = &[(1, 1), (1, 15), (1, 16), (1, 17), (1, 100), (1, 384), (1, 1000), (1, 2048)];
pub(crate) const MIXED_ROWS: &[(usize, usize)] = &[(37, 37), (1, 200), (0, 5), (128, 300), (1, 1), (0, 0), (64, 700), (3, 3), (200, 1100), (1, 33)];
pub(crate) const DIFFUSION_ROWS: &[(usize, usize)] = &[(32, 64), (32, 96), (1, 50), (32, 200), (16, 17), (32, 600)];

fn case(name: &'static str, rows: &[(usize, usize)], heads: usize, kv: usize, hd: usize, dtype: DType, mask: AttnMask) -> Case {
    Case { name, rows: rows.to_vec(), heads, kv_heads: kv, hd, block_size: 16, dtype, mask, context_bound: None }
}

#[test]
fn decode_mha_d128() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check(case("decode mha 16/16 d128", DECODE_ROWS, 16, 16, 128, dt, AttnMask::Causal));
    }
}

/// Rows of two query items (`paged_attn_*_q2`): one query a row under a GQA group of 2, and two
/// queries a row without GQA.
#[test]
fn two_query_items_a_row() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check(case("decode gqa 16/8 d128", DECODE_ROWS, 16, 8, 128, dt, AttnMask::Causal));
        check(case("two-query rows mha 8/8 d64", &[(2, 40), (2, 300), (1, 17), (2, 2)], 8, 8, 64, dt, AttnMask::Causal));
    }
}

#[test]
fn decode_gqa_d64() {
    for dt in [DType::F32, DType::BF16] {
        check(case("decode gqa 32/8 d64", DECODE_ROWS, 32, 8, 64, dt, AttnMask::Causal));
    }
}

#[test]
fn decode_many_rows() {
    let rows: Vec<(usize, usize)> = (0..96).map(|i| (1, 1 + (i * 37) % 700)).collect();
    for dt in [DType::F32, DType::BF16] {
        check(Case { rows: rows.clone(), ..case("decode 96 rows mha d128", &[], 16, 16, 128, dt, AttnMask::Causal) });
    }
}

/// Longest contexts of 256–511 keys at few rows: the keys split into chunks of 64 (from 256
/// keys on; before, splits started at 512 and chunks were at least 256 keys).
#[test]
fn decode_short_contexts_split() {
    for rows in [vec![(1usize, 256usize); 4], vec![(1, 300), (1, 17), (1, 64), (1, 299)], vec![(1, 511); 3]] {
        for dt in [DType::F32, DType::BF16] {
            check(Case { rows: rows.clone(), ..case("decode short contexts mha d128", &[], 16, 16, 128, dt, AttnMask::Causal) });
        }
    }
}

/// Long contexts at a width where chunks of the context bound would be long (1024 tiles, 2k
/// keys): the kernel cuts the actual longest context itself, with the bound exact and with a
/// graph's bucket (4096) far above it. With contexts of at most 300 under that bucket the grid
/// holds more splits than the kernel uses, so some blocks write empty partials.
#[test]
fn decode_long_contexts_cut_in_kernel() {
    let long: Vec<(usize, usize)> = (0..64).map(|i| (1, 1100 + (i * 97) % 1100)).collect();
    let short: Vec<(usize, usize)> = (0..64).map(|i| (1, 100 + (i * 37) % 200)).collect();
    for (rows, dt, bound) in [(&long, DType::BF16, None), (&long, DType::BF16, Some(4096)), (&long, DType::F32, Some(4096)), (&short, DType::BF16, Some(4096))]
    {
        check(Case { rows: rows.clone(), context_bound: bound, ..case("decode long contexts mha d128", &[], 16, 16, 128, dt, AttnMask::Causal) });
    }
}

/// Decode launches that fill one wave of the SIMT kernel's 8-warp builds evenly walk each row's
/// keys unsplit in one of those builds, against the CPU reference on every path: about two (row,
/// kv head) blocks an SM with contexts up to 2048, about four with contexts up to 512 (the build
/// held to four takes those where the other fits only three: bf16 / f16, and f32 at head dim
/// 64); head dims 64 / 96 / 128, f32 / bf16 / f16, the exact bound and a graph's bucket at or
/// above the contexts; and about one block an SM with contexts up to 512, which the deep 8-warp
/// build (6 key sets a lane) walks. Checks that an 8-warp build ran, and the deep one where one
/// block an SM (the SIMT fold's test checks which launches), under the default plan.
#[test]
fn decode_eight_warp_build() {
    let sms = gpu_sms();
    for (heads, hd, dt, bound) in [
        (16, 128, DType::BF16, None),
        (16, 128, DType::F32, Some(4096)),
        (16, 128, DType::F16, Some(2048)),
        (8, 64, DType::BF16, None),
        (8, 64, DType::F32, Some(4096)),
        (12, 96, DType::F16, Some(4096)),
        (12, 96, DType::F32, None),
    ] {
        // As many rows as put two blocks on each SM, at most, with contexts up to 2048; then four,
        // with contexts and bound up to 512 (the build held to four takes no longer bound); then
        // one (the deep build), with contexts and bound up to 512.
        for (per_sm, longest) in [(2, 2048), (4, 512), (1, 512)] {
            let rows: Vec<(usize, usize)> = (0..per_sm * sms / heads).map(|i| (1, 1 + (i * 389) % longest)).collect();
            let bound = bound.map(|b: usize| b.min(longest));
            let counts = check(Case { rows, context_bound: bound, ..case("decode 8-warp builds mha", &[], heads, heads, hd, dt, AttnMask::Causal) });
            assert!(counts.simt_eight_warp > 0, "{heads} heads d{hd} {dt:?}, {per_sm} an SM: no 8-warp build ran");
            let deep = counts.simt_deep > 0;
            assert_eq!(deep, per_sm == 1, "{heads} heads d{hd} {dt:?}, {per_sm} an SM: the deep build ran {deep}");
        }
    }
}

/// Decode shapes off the common path: rows without a query among decode rows, Huginn's 55
/// heads at head dim 96, a GQA group of eight, and 300 rows (more work than one wave of blocks).
#[test]
fn decode_edge_shapes() {
    let empty_rows = [(1usize, 300usize), (0, 0), (1, 17), (0, 5), (1, 1), (1, 1000), (0, 64)];
    for dt in [DType::F32, DType::BF16] {
        check(case("decode rows without a query mha d128", &empty_rows, 16, 16, 128, dt, AttnMask::Causal));
        check(case("decode mha 55/55 d96", DECODE_ROWS, 55, 55, 96, dt, AttnMask::Causal));
        check(case("decode gqa 32/4 d128", DECODE_ROWS, 32, 4, 128, dt, AttnMask::Causal));
    }
    let rows: Vec<(usize, usize)> = (0..300).map(|i| (1, 1 + (i * 53) % 900)).collect();
    check(Case { rows, ..case("decode 300 rows mha d128", &[], 16, 16, 128, DType::BF16, AttnMask::BlockCausal(32)) });
}

/// Decode rows through the bulk-copy ring (one query a row, head dim 128, bf16 / f16, at most 16
/// heads, block size a multiple of 4, sm_90 builds): one row walked by many blocks, 16 rows of
/// contexts 1–600 (runs that end inside rows), 200 short rows (runs that hold several whole
/// rows), an odd head count (a half-warp idle), a GQA group of four, block sizes 32 and 12 (not a
/// power of two), f16 — each against the CPU reference through `check`, which runs the ring path
/// among the others. The ring must be what `AttentionKernels::DecodeRing` launches there (and only
/// there: a block size of 6, f32 and a prefill row fall back), and launched twice it must give the
/// same bits.
#[test]
fn decode_ring_kernel() {
    let sixteen: Vec<(usize, usize)> = (0..16).map(|i| (1, 1 + (i * 67) % 600)).collect();
    let short: Vec<(usize, usize)> = (0..200).map(|i| (1, 1 + (i * 37) % 41)).collect();
    let cases = [
        (case("ring one row mha 16/16 d128", &[(1, 1000)], 16, 16, 128, DType::BF16, AttnMask::Causal), true),
        (Case { rows: short, ..case("ring 200 short rows mha 16/16 d128", &[], 16, 16, 128, DType::BF16, AttnMask::Causal) }, true),
        (Case { rows: sixteen.clone(), ..case("ring 16 rows mha 16/16 d128", &[], 16, 16, 128, DType::BF16, AttnMask::Causal) }, true),
        (Case { rows: sixteen.clone(), ..case("ring 16 rows mha 16/16 d128", &[], 16, 16, 128, DType::F16, AttnMask::Causal) }, true),
        (case("ring odd heads 15/15 d128", DECODE_ROWS, 15, 15, 128, DType::BF16, AttnMask::Causal), true),
        (case("ring gqa 16/4 d128", DECODE_ROWS, 16, 4, 128, DType::BF16, AttnMask::Causal), true),
        (Case { block_size: 32, ..case("ring block size 32", DECODE_ROWS, 16, 16, 128, DType::BF16, AttnMask::Causal) }, true),
        (Case { block_size: 12, ..case("ring block size 12", DECODE_ROWS, 16, 16, 128, DType::BF16, AttnMask::Causal) }, true),
        (Case { block_size: 6, ..case("no ring: block size 6", DECODE_ROWS, 16, 16, 128, DType::BF16, AttnMask::Causal) }, false),
        (case("no ring: f32", DECODE_ROWS, 16, 16, 128, DType::F32, AttnMask::Causal), false),
        (case("no ring: a prefill row", &[(1, 100), (5, 40)], 16, 16, 128, DType::BF16, AttnMask::Causal), false),
    ];
    let gpu = gpu_device();
    for (c, ring) in cases {
        let b = build(&c, 0x41c3 ^ c.rows.len() as u64);
        let batch = PagedBatch::new(b.host.clone(), c.block_size, c.mask, c.kv_heads * c.hd, &gpu).unwrap();
        let (q, k, v) = (b.q.to_device(&gpu).unwrap(), b.k.to_device(&gpu).unwrap(), b.v.to_device(&gpu).unwrap());
        // A second launch must give the first one's bits (its workspace is fresh, its runs fixed).
        let scale = 1.0 / (c.hd as f64).sqrt();
        let (first, counts) = with_path_counted(AttnPath::Ring, || paged_attention(&q, &k, &v, &batch, scale).unwrap());
        let second = with_path(AttnPath::Ring, || paged_attention(&q, &k, &v, &batch, scale).unwrap());
        assert_eq!(counts.decode_ring, u64::from(ring && cfg!(ponder_bulk_copy)), "{}: decode ring launches", c.name);
        let bits =
            |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&first), bits(&second), "{}: a second launch gave other bits", c.name);
        check(c);
    }
}

#[test]
fn prefill_mixed_causal() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check(case("mixed causal gqa 32/8 d128", MIXED_ROWS, 32, 8, 128, dt, AttnMask::Causal));
        check(case("mixed causal mha 8/8 d64", MIXED_ROWS, 8, 8, 64, dt, AttnMask::Causal));
    }
}

#[test]
fn bidirectional() {
    for dt in [DType::F32, DType::BF16] {
        check(case("diffusion bidir mha 16/16 d128", DIFFUSION_ROWS, 16, 16, 128, dt, AttnMask::Bidirectional));
        check(case("diffusion bidir gqa 32/8 d64", DIFFUSION_ROWS, 32, 8, 64, dt, AttnMask::Bidirectional));
        check(case("mixed bidir gqa 32/8 d128", MIXED_ROWS, 32, 8, 128, dt, AttnMask::Bidirectional));
    }
}

/// Block-causal rows as block diffusion launches them: whole prompts of several 32-blocks in one
/// row (prefill), a block's 32 queries after a long prefix, ragged recompute sets, and block
/// lengths that do not match the cache block size (4, 16, 32).
#[test]
fn block_causal() {
    const PREFILL: &[(usize, usize)] = &[(96, 96), (64, 160), (32, 288), (7, 39), (20, 52), (1, 33), (32, 1024)];
    for dt in [DType::F32, DType::BF16] {
        for b in [4, 16, 32] {
            check(case("block-causal gqa 32/8 d128", PREFILL, 32, 8, 128, dt, AttnMask::BlockCausal(b)));
            check(case("block-causal mha 16/16 d64", DIFFUSION_ROWS, 16, 16, 64, dt, AttnMask::BlockCausal(b)));
        }
        check(case("block-causal(1) == causal", MIXED_ROWS, 32, 8, 128, dt, AttnMask::BlockCausal(1)));
    }
}

#[test]
fn head_dim_96_and_odd_block_size() {
    check(case("mixed causal gqa 12/4 d96", MIXED_ROWS, 12, 4, 96, DType::F32, AttnMask::Causal));
    check(case("mixed causal gqa 12/4 d96", MIXED_ROWS, 12, 4, 96, DType::BF16, AttnMask::Causal));
    check(case("mixed causal gqa 12/4 d96", MIXED_ROWS, 12, 4, 96, DType::F16, AttnMask::Causal));
    let c = case("decode bs12 mha d128", DECODE_ROWS, 8, 8, 128, DType::F32, AttnMask::Causal);
    check(Case { block_size: 12, ..c });
    let c = case("mixed bs12 gqa 32/8 d128", MIXED_ROWS, 32, 8, 128, DType::BF16, AttnMask::Causal);
    check(Case { block_size: 12, ..c });
    let c = case("mixed bs32 gqa 16/2 d128", MIXED_ROWS, 16, 2, 128, DType::BF16, AttnMask::Causal);
    check(Case { block_size: 32, ..c });
}

#[test]
fn rejects_bad_inputs() {
    let gpu = gpu_device();
    let host = PagedBatchHost { write_positions: Vec::new(), block_tables: vec![vec![0]], context_lens: vec![1], cu_q_lens: vec![0, 1] };
    let batch = PagedBatch::new(host, 16, AttnMask::Causal, 4 * 80, &gpu).unwrap();
    let q = Tensor::zeros((1, 4, 80), DType::BF16, &gpu).unwrap();
    let k = Tensor::zeros((1, 16, 4, 80), DType::BF16, &gpu).unwrap();
    assert!(paged_attention(&q, &k, &k, &batch, 1.0).is_err(), "head dim 80");
    let q = Tensor::zeros((1, 4, 64), DType::F32, &gpu).unwrap();
    let k = Tensor::zeros((1, 16, 4, 64), DType::BF16, &gpu).unwrap();
    assert!(paged_attention(&q, &k, &k, &batch, 1.0).is_err(), "dtype mismatch");
    let q = Tensor::zeros((1, 6, 64), DType::BF16, &gpu).unwrap();
    let k = Tensor::zeros((1, 16, 4, 64), DType::BF16, &gpu).unwrap();
    assert!(paged_attention(&q, &k, &k, &batch, 1.0).is_err(), "heads not a multiple");
}

/// Times one launch configuration; prints µs per call and the KV bytes read per second.
fn time_case(name: &str, rows: &[(usize, usize)], heads: usize, kv: usize, hd: usize, mask: AttnMask) {
    let gpu = gpu_device();
    let c = Case { name: "timing", rows: rows.to_vec(), heads, kv_heads: kv, hd, block_size: 16, dtype: DType::BF16, mask, context_bound: None };
    let b = build(&c, 7);
    let batch = PagedBatch::new(b.host.clone(), 16, mask, kv * hd, &gpu).unwrap();
    // NaN in unused slots is fine for timing; the kernel never reads them.
    let (q, k, v) = (b.q.to_device(&gpu).unwrap(), b.k.to_device(&gpu).unwrap(), b.v.to_device(&gpu).unwrap());
    let scale = 1.0 / (hd as f64).sqrt();
    for path in [AttnPath::Default, AttnPath::Simt, AttnPath::Unpipelined] {
        let run = || with_path(path, || paged_attention(&q, &k, &v, &batch, scale).unwrap());
        for _ in 0..20 {
            run();
        }
        gpu.synchronize().unwrap();
        let inner = 20;
        let mut samples = Vec::new();
        for _ in 0..25 {
            let t0 = std::time::Instant::now();
            for _ in 0..inner {
                run();
            }
            gpu.synchronize().unwrap();
            samples.push(t0.elapsed().as_secs_f64() / inner as f64);
        }
        samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = samples[samples.len() / 2];
        let kv_bytes: usize = rows.iter().map(|&(_, ctx)| ctx * kv * hd * 2 * 2).sum();
        println!(
            "TIMING {name:<44} {path:<9?} {:>9.1} us/call  {:>7.1} GB/s KV read ({:.1} MB)",
            med * 1e6,
            kv_bytes as f64 / med / 1e9,
            kv_bytes as f64 / 1e6
        );
    }
}

#[test]
#[ignore]
fn timing() {
    for &(w, ctx) in &[(64usize, 384usize), (256, 384), (16, 2048), (64, 2048), (256, 2048), (128, 128)] {
        let rows = vec![(1, ctx); w];
        time_case(&format!("decode bf16 W={w} ctx={ctx} H=16/16 D=128"), &rows, 16, 16, 128, AttnMask::Causal);
    }
    let rows = vec![(1, 1024); 64];
    time_case("decode bf16 W=64 ctx=1024 H=32/8 D=128", &rows, 32, 8, 128, AttnMask::Causal);
    let rows = vec![(32, 512); 16];
    time_case("diffusion bf16 16x(q32, ctx512) bidir 16/16 D=128", &rows, 16, 16, 128, AttnMask::Bidirectional);
    let rows = vec![(512, 512); 8];
    time_case("prefill bf16 8x512 causal 16/16 D=128", &rows, 16, 16, 128, AttnMask::Causal);
    let rows = vec![(2048, 2048); 2];
    time_case("prefill bf16 2x2048 causal 32/8 D=128", &rows, 32, 8, 128, AttnMask::Causal);
    // SDAR-8B denoising steps at batch 256: whole blocks, and FOCUS's ≈ 13 kept tokens a row.
    let rows = vec![(32, 300); 256];
    time_case("diffusion bf16 256x(q32, ctx300) block-causal(32) 32/8 D=128", &rows, 32, 8, 128, AttnMask::BlockCausal(32));
    let rows = vec![(13, 300); 256];
    time_case("focus bf16 256x(q13, ctx300) block-causal(32) 32/8 D=128", &rows, 32, 8, 128, AttnMask::BlockCausal(32));
    // Huginn-3.5B prefill: 55 heads of 96.
    let rows = vec![(180, 180); 16];
    time_case("prefill bf16 16x180 causal 55/55 D=96", &rows, 55, 55, 96, AttnMask::Causal);
}
