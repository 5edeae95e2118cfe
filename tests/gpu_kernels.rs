//! CUDA kernels against the CPU reference. Needs a GPU: build with `--features cuda`, run on the
//! device machine (tests run in parallel: kernel choices and dispatch counts hold per thread);
//! `--include-ignored --nocapture` also prints the timings.
#![cfg(feature = "cuda")]

#[path = "gpu_kernels/agreement.rs"]
mod agreement;

use candle_core::{DType, Device, Tensor};
use ponder::ops::{paged_attention, paged_attention_reference, AttnMask, PagedBatch, PagedBatchHost};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// A CUDA device of its own (stream, cuBLAS handle, loaded modules) for one test, kept alive
/// until the process exits. Dropping a device destroys its cuBLAS handle, which synchronises the
/// whole GPU context; a context-wide synchronisation while another test's thread captures a CUDA
/// graph on its own stream is refused by the driver and invalidates that capture (the parallel
/// suite failed and crashed that way). Tests therefore never drop a device mid-run.
fn gpu_device() -> Device {
    static KEPT: std::sync::Mutex<Vec<Device>> = std::sync::Mutex::new(Vec::new());
    let device = Device::new_cuda(0).unwrap();
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(device.clone());
    device
}

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

fn rel_err(out: &Tensor, reference: &Tensor) -> f32 {
    let o = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let r = reference.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(o.len(), r.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (a, b) in o.iter().zip(&r) {
        let d = (*a as f64) - (*b as f64);
        num += if d.is_nan() { f64::INFINITY } else { d * d };
        den += (*b as f64) * (*b as f64);
    }
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
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
fn gpu_sms() -> usize {
    let Device::Cuda(dev) = gpu_device() else { unreachable!() };
    ponder::ops::cuda::sm_count(&dev).unwrap()
}

/// Which paged-attention kernel family a check forces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttnPath {
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
    fn policy(self) -> ponder::ops::KernelPolicy {
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
fn with_path<R>(path: AttnPath, f: impl FnOnce() -> R) -> R {
    with_path_counted(path, f).0
}

/// [`with_path`], with the kernel dispatches `f` made.
fn with_path_counted<R>(path: AttnPath, f: impl FnOnce() -> R) -> (R, ponder::ops::KernelCounts) {
    ponder::ops::with_kernels(path.policy(), f)
}

const DECODE_ROWS: &[(usize, usize)] = &[(1, 1), (1, 15), (1, 16), (1, 17), (1, 100), (1, 384), (1, 1000), (1, 2048)];
const MIXED_ROWS: &[(usize, usize)] = &[(37, 37), (1, 200), (0, 5), (128, 300), (1, 1), (0, 0), (64, 700), (3, 3), (200, 1100), (1, 33)];
const DIFFUSION_ROWS: &[(usize, usize)] = &[(32, 64), (32, 96), (1, 50), (32, 200), (16, 17), (32, 600)];

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

// ---------------------------------------------------------------------------------------------
// Fused per-layer ops (`ponder::ops::fused`): CUDA kernel vs the candle composition on the CPU,
// the reference run in f32 on the same (dtype-rounded) values.

use ponder::ops::{fused, RopeAngles, RopeTable};

fn rand_tensor(rng: &mut StdRng, shape: &[usize], lo: f32, hi: f32, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let d: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(d, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn f32_cpu(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
}

fn tol_of(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

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

// ---------------------------------------------------------------------------------------------
// CUDA graphs: the engine with graph replay gives the same greedy tokens as without.

fn graph_test_config() -> ponder::looped::models::OuroConfig {
    let mut cfg = ponder::testing::tiny_ouro_config(512);
    cfg.hidden_size = 256;
    cfg.intermediate_size = 512;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = Some(2);
    cfg.head_dim = Some(64);
    cfg.max_position_embeddings = 2048;
    cfg
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Graphs {
    /// The eager path.
    Off,
    /// The graph path without capture: padded static buffers, bucketed context, run eagerly.
    BodiesOnly,
    /// Captured and replayed.
    On,
}

/// A Huginn small enough for the test and wide enough for the attention kernels (head dim 64).
fn graph_test_huginn() -> ponder::looped::models::HuginnConfig {
    let mut cfg = ponder::testing::tiny_huginn_config(512);
    cfg.n_embd = 256;
    cfg.intermediate_size = 512;
    cfg.n_heads = 4;
    cfg.num_key_value_heads = Some(4);
    cfg.head_dim = Some(64);
    cfg.block_size = 2048;
    cfg.max_steps = 4;
    cfg
}

/// [`graph_test_huginn`] with random bf16 weights (seed 5) on `gpu`, its head tied.
fn graph_test_huginn_model(gpu: &Device) -> ponder::looped::models::Huginn {
    graph_test_huginn_model_of(gpu, graph_test_huginn())
}

/// A Huginn of config `cfg` with random bf16 weights (seed 5) on `gpu`, its head tied.
fn graph_test_huginn_model_of(gpu: &Device, cfg: ponder::looped::models::HuginnConfig) -> ponder::looped::models::Huginn {
    let mut t = ponder::testing::random_tensors(&ponder::testing::huginn_tensor_manifest(&cfg), 5, DType::F32, gpu).unwrap();
    let wte = t["transformer.wte.weight"].clone();
    t.insert("lm_head.weight".into(), wte);
    ponder::looped::models::Huginn::load(&cfg, &ponder::loader::Weights::from_map(t, DType::BF16, gpu)).unwrap()
}

/// Runs `prompts` (all queued at once) to completion, greedy, in one of the [`Graphs`] modes,
/// on the tiny Ouro (or Huginn: prelude and a coda with their own attention blocks).
#[allow(clippy::too_many_arguments)]
fn graph_engine_run(
    gpu: &Device,
    huginn: bool,
    sched: ponder::SchedulerKind,
    layout: ponder::KvLayoutKind,
    width: usize,
    graphs: Graphs,
    prompts: &[Vec<u32>],
    new_tokens: &[usize],
) -> Vec<Vec<u32>> {
    use ponder::looped::models::Ouro;
    let model: Box<dyn ponder::looped::models::LoopedModel> = if huginn {
        Box::new(graph_test_huginn_model(gpu))
    } else {
        let cfg = graph_test_config();
        let weights = ponder::testing::random_ouro_weights(&cfg, 5, DType::BF16, gpu).unwrap();
        Box::new(Ouro::load(&cfg, &weights).unwrap())
    };
    engine_run(model, sched, layout, width, graphs, prompts, new_tokens)
}

/// Runs `prompts` (all queued at once) to completion on `model`, greedy, in one of the
/// [`Graphs`] modes; the depth schedulers exit by a replayed depth trace.
fn engine_run(
    model: Box<dyn ponder::looped::models::LoopedModel>,
    sched: ponder::SchedulerKind,
    layout: ponder::KvLayoutKind,
    width: usize,
    graphs: Graphs,
    prompts: &[Vec<u32>],
    new_tokens: &[usize],
) -> Vec<Vec<u32>> {
    engine_run_with(model, sched, layout, width, graphs, prompts, new_tokens, Default::default()).0
}

/// [`engine_run`] under the kernel policy `kernels`; also returns the engine's metrics.
#[allow(clippy::too_many_arguments)]
fn engine_run_with(
    model: Box<dyn ponder::looped::models::LoopedModel>,
    sched: ponder::SchedulerKind,
    layout: ponder::KvLayoutKind,
    width: usize,
    graphs: Graphs,
    prompts: &[Vec<u32>],
    new_tokens: &[usize],
    kernels: ponder::kernels::KernelPolicy,
) -> (Vec<Vec<u32>>, ponder::EngineMetrics) {
    use ponder::looped::gate::{DepthTrace, Replay};
    let mut b = ponder::EngineBuilder::from_model(model, None, vec![])
        .kernels(kernels)
        .looped(|o| o.scheduler(sched).kv_layout(layout))
        .max_num_seqs(width)
        .max_num_batched_tokens(2048)
        .kv_capacity_tokens(64 * 1024)
        .looped(|o| o.cuda_graphs(graphs != Graphs::Off).graph_capture(graphs != Graphs::BodiesOnly));
    if sched != ponder::SchedulerKind::Continuous {
        let trace = DepthTrace::with_mean(2.5, 1, 4, 9).unwrap();
        b = b.looped(|o| o.exit_gate(Replay::new(trace, 1, 4).unwrap()));
    }
    let mut engine = b.build().unwrap();
    let ids: Vec<_> = prompts
        .iter()
        .zip(new_tokens)
        .map(|(p, &n)| {
            let params = ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(n) };
            engine.add_request(p.clone(), params).unwrap()
        })
        .collect();
    let mut got: std::collections::HashMap<ponder::RequestId, Vec<u32>> = Default::default();
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if let ponder::Event::Token { id, token, .. } = ev {
                got.entry(id).or_default().push(token);
            }
        }
    }
    let tokens = ids.iter().map(|id| got.remove(id).unwrap_or_default()).collect();
    let metrics = engine.metrics().clone();
    keep(engine);
    (tokens, metrics)
}

/// The decode arena (`KernelPolicy::decode_arena`): the same greedy tokens as the plain body —
/// the same kernels and cuBLAS calls, only the output pointers are the arena's. Where the folded
/// decode attention takes the launch (MHA, like Ouro-1.4B: the SIMT fold at head dim 64 with its
/// key splits in the arena's workspace, the ring at 128 under `ring=always`), or for a GQA model
/// its two launches with q in the arena, a graph — CB's full-depth decode, depth batching's core
/// steps and re-entering codas — holds no memory node at all (the plain body's graphs of the GQA
/// case hold 1120 on an H100). The GQA case's 40-row launches cut their keys into more splits
/// than the ring has partials: the workspace is sized for the SIMT plan's most. Huginn's arena
/// body (interleaved RoPE after a q/k bias, then paged attention with q in the arena; the
/// prelude's scaled gather; the `[s | e]` halves by strided copies) leaves none either.
#[test]
fn decode_arena_matches_the_plain_body_with_fewer_memory_nodes() {
    use ponder::looped::models::Ouro;
    use ponder::{KvLayoutKind, SchedulerKind};
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(78);
    let n = 29;
    let prompts = random_prompts(&mut rng, n, 6, 240..300, 1..80);
    let new_tokens: Vec<usize> = (0..n).map(|_| rng.random_range(3..40)).collect();
    // (name, head dim, kv heads of 4 query heads (0: Huginn), policy, scheduler, layout, width,
    // no memory node)
    let cases = [
        ("cb depth-indexed W40", 64, 4, "", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40, true),
        ("cb shared W7", 64, 4, "", SchedulerKind::Continuous, KvLayoutKind::Shared, 7, true),
        ("cdb-refill shared W13", 64, 4, "", SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13, true),
        ("cb d128 ring W40", 128, 4, "ring=always", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40, true),
        ("cb gqa W40", 64, 2, "", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40, true),
        // Huginn: the prelude and the re-entering coda (attention blocks of their own) too.
        ("huginn cb shared W7", 64, 0, "", SchedulerKind::Continuous, KvLayoutKind::Shared, 7, true),
        ("huginn cdb-refill shared W13", 64, 0, "", SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13, true),
        // Huginn-0125's head dim (96) and the layout its benchmark runs, at 16 rows.
        ("huginn cb depth-indexed d96 W16", 96, 0, "", SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 16, true),
    ];
    for (name, head_dim, kv_heads, policy, sched, layout, width, none_left) in cases {
        let mut cfg = graph_test_config();
        cfg.head_dim = Some(head_dim);
        cfg.num_key_value_heads = Some(kv_heads.max(1));
        let weights = ponder::testing::random_ouro_weights(&cfg, 5, DType::BF16, &gpu).unwrap();
        let plain_policy: ponder::kernels::KernelPolicy = policy.parse().unwrap();
        let arena_policy = ponder::kernels::KernelPolicy { decode_arena: true, ..plain_policy };
        let model = || -> Box<dyn ponder::looped::models::LoopedModel> {
            match kv_heads {
                0 => {
                    let mut h = graph_test_huginn();
                    (h.head_dim, h.n_embd) = (Some(head_dim), h.n_heads * head_dim);
                    Box::new(graph_test_huginn_model_of(&gpu, h))
                }
                _ => Box::new(Ouro::load(&cfg, &weights).unwrap()),
            }
        };
        let run = |kernels| engine_run_with(model(), sched, layout, width, Graphs::On, &prompts, &new_tokens, kernels);
        let (plain, pm) = run(plain_policy);
        let (arena, am) = run(arena_policy);
        let (pl, al) = (pm.looped().unwrap(), am.looped().unwrap());
        let (pn, an) = (pl.graph_nodes, al.graph_nodes);
        println!(
            "decode arena {name}: {} core steps on it; graphs {} / {}: memory nodes {} -> {}, kernels {} -> {}, copies {} -> {}; rings {} / {}",
            am.kernels.arena_steps,
            pl.graph_captures,
            al.graph_captures,
            pn.memory,
            an.memory,
            pn.kernels,
            an.kernels,
            pn.copies,
            an.copies,
            pm.kernels.decode_ring,
            am.kernels.decode_ring
        );
        assert!(am.kernels.arena_steps > 0 && pm.kernels.arena_steps == 0, "{name}: the arena ran only where asked");
        if head_dim == 128 {
            assert!(am.kernels.decode_ring > 0, "{name}: the ring took decode launches");
        }
        assert_eq!(differing_requests(name, &plain, &arena, &prompts, &new_tokens), 0, "{name}: the arena changed tokens");
        assert!(al.graph_captures > 0 && an.memory < pn.memory, "{name}: memory nodes {} with the arena, {} without", an.memory, pn.memory);
        if none_left {
            assert_eq!(an.memory, 0, "{name}: a graph on the arena allocates nothing");
        }
    }
}

/// cuBLAS's own workspace under capture: products that pick a split-k algorithm at decode rows
/// (Huginn-0125's 17 920-deep MLP projection and 10 560-deep adapter) allocate it with
/// `cudaMallocAsync` unless one is set on the handle; `Graph::capture` sets one, so a graph of
/// them holds kernels only, and replays give the eager products' values.
#[test]
fn cublas_products_captured_hold_no_memory_node() {
    use ponder::engine::internals::{GemmWorkspace, Graph};
    let gpu = gpu_device();
    let workspace = std::sync::Arc::new(GemmWorkspace::new(&gpu).unwrap());
    // (rows, n, k): Huginn's mlp_proj, adapter, proj and qkv, Ouro's down and qkv.
    for (rows, n, k) in [(16, 5280, 17920), (16, 5280, 10560), (64, 5280, 17920), (16, 5280, 5280), (16, 15840, 5280), (16, 2048, 5632), (64, 6144, 2048)] {
        let x = Tensor::randn(0f32, 1.0, (rows, k), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
        let w = Tensor::randn(0f32, 0.02, (n, k), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
        let out = Tensor::zeros((rows, n), DType::BF16, &gpu).unwrap();
        let run = || ponder::ops::into::linear_into(&x, &w, &out);
        Graph::warm_up(&gpu, run).unwrap();
        let eager = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        out.zeros_like().and_then(|z| out.slice_set(&z, 0, 0)).unwrap();
        let graph = Graph::capture(&gpu, &workspace, run).unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let nodes = graph.nodes().unwrap();
        let replay = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = eager.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = eager.iter().zip(&replay).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "linear [{rows}, {k}] x [{n}, {k}]^T captured: {} kernels, {} memory nodes; max |eager - replay| {diff:.3e} (max |eager| {scale:.3e})",
            nodes.kernels, nodes.memory
        );
        assert_eq!(nodes.memory, 0, "[{rows}, {k}] x [{n}, {k}]: cuBLAS allocated under capture");
        assert!(diff <= 1e-2 * scale, "[{rows}, {k}] x [{n}, {k}]: the replay differs from the eager product by {diff}");
    }
}

/// `n` random prompts over a 512-token vocabulary: every `long_every`-th from `long`, the rest
/// from `short` tokens.
fn random_prompts(rng: &mut StdRng, n: usize, long_every: usize, long: std::ops::Range<usize>, short: std::ops::Range<usize>) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = if i % long_every == 0 { rng.random_range(long.clone()) } else { rng.random_range(short.clone()) };
            (0..len).map(|_| rng.random_range(0..512u32)).collect()
        })
        .collect()
}

/// How many requests' greedy tokens differ between two runs (each must have its full length);
/// prints where each one first differs.
fn differing_requests(name: &str, a: &[Vec<u32>], b: &[Vec<u32>], prompts: &[Vec<u32>], new_tokens: &[usize]) -> usize {
    let mut bad = 0;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), new_tokens[i], "{name}: request {i} length (first run)");
        assert_eq!(y.len(), new_tokens[i], "{name}: request {i} length (second run)");
        if x != y {
            bad += 1;
            let first = x.iter().zip(y).position(|(p, q)| p != q);
            println!("{name}: request {i} (prompt {}) differs at {first:?} of {}", prompts[i].len(), x.len());
        }
    }
    bad
}

#[test]
fn cuda_graphs_match_eager() {
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(77);
    // 37 requests: prompts 1..300 tokens (context buckets 256 and 512), 3..60 new tokens, so
    // the decode width walks down through many row buckets, mostly with padding.
    let n = 37;
    let prompts = random_prompts(&mut rng, n, 6, 240..300, 1..80);
    let new_tokens: Vec<usize> = (0..n).map(|_| rng.random_range(3..60)).collect();
    use ponder::{KvLayoutKind, SchedulerKind};
    let cases = [
        ("cb depth-indexed W40", false, SchedulerKind::Continuous, KvLayoutKind::DepthIndexed, 40),
        ("cb shared W7", false, SchedulerKind::Continuous, KvLayoutKind::Shared, 7),
        ("cdb-refill shared W40", false, SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 40),
        ("cdb-refill shared W13", false, SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13),
        // Huginn's coda (attention blocks writing KV) is captured per (rows, context) too.
        ("huginn cdb-refill shared W13", true, SchedulerKind::Depth { refill: true }, KvLayoutKind::Shared, 13),
        ("huginn cb shared W7", true, SchedulerKind::Continuous, KvLayoutKind::Shared, 7),
    ];
    // Replay must reproduce the graph bodies run eagerly bit for bit. Against the plain eager
    // path, bf16 results may differ slightly: padding changes the gemm row count and the context
    // bucket changes the attention key split, so near-ties can flip a greedy token late in a
    // sequence (first device run: 34/37 identical for CB depth-indexed W40). That comparison is
    // reported and only loosely bounded.
    for (name, huginn, sched, layout, width) in cases {
        let t = std::time::Instant::now();
        let eager = graph_engine_run(&gpu, huginn, sched, layout, width, Graphs::Off, &prompts, &new_tokens);
        let t_eager = t.elapsed();
        let bodies = graph_engine_run(&gpu, huginn, sched, layout, width, Graphs::BodiesOnly, &prompts, &new_tokens);
        let t = std::time::Instant::now();
        let graphs = graph_engine_run(&gpu, huginn, sched, layout, width, Graphs::On, &prompts, &new_tokens);
        let t_graphs = t.elapsed();
        for (i, (a, b)) in bodies.iter().zip(&graphs).enumerate() {
            assert_eq!(a, b, "{name}: request {i}: replay differs from the graph body run eagerly");
        }
        let bad = differing_requests(name, &eager, &graphs, &prompts, &new_tokens);
        println!(
            "cuda graphs {name}: {n} requests, {} tokens; replay == bodies {n}/{n}; identical to eager {}/{n}; eager {:.2}s, graphs {:.2}s",
            new_tokens.iter().sum::<usize>(),
            n - bad,
            t_eager.as_secs_f64(),
            t_graphs.as_secs_f64()
        );
        assert!(bad * 4 <= n, "{name}: {bad}/{n} requests differ from the eager path");
    }
}

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

/// Diagnostic for the Huginn full-depth graph (its engine-level replay differed from its body
/// run eagerly, so the runner does not capture it): the model's stages captured directly in a
/// graph against the same calls run eagerly on the same static inputs — prelude alone, one core
/// step, coda + head, and the whole full-depth chain. Prints the largest difference of each;
/// requires the chain's logits to agree to bf16 rounding (a real capture bug shows as large,
/// structured differences; a different GEMM algorithm under capture as rounding-level ones).
#[test]
fn huginn_stage_graphs_match_eager_numerically() {
    use ponder::engine::internals::{GemmWorkspace, Graph};
    use ponder::kv::KvStore;
    use ponder::looped::models::Huginn;
    use ponder::looped::models::LoopedModel;
    let gpu = gpu_device();
    let cfg = graph_test_huginn();
    let mut t = ponder::testing::random_tensors(&ponder::testing::huginn_tensor_manifest(&cfg), 5, DType::F32, &gpu).unwrap();
    let wte = t["transformer.wte.weight"].clone();
    t.insert("lm_head.weight".into(), wte);
    let model = Huginn::load(&cfg, &ponder::loader::Weights::from_map(t, DType::BF16, &gpu)).unwrap();
    let s = model.spec().clone();
    let bs = 16;
    let positions: Vec<u32> = vec![17, 40, 3, 100, 250, 0, 63];
    let mut next = 0u32;
    let tables: Vec<Vec<u32>> = positions
        .iter()
        .map(|&p| {
            let n = (p as usize + 1).div_ceil(bs) as u32;
            let tb = (next..next + n).collect();
            next += n;
            tb
        })
        .collect();
    let kv = KvStore::new(s.num_kv_layers, next as usize + 1, bs, s.num_kv_heads, s.head_dim, DType::BF16, &gpu).unwrap();
    let host = PagedBatchHost {
        block_tables: tables,
        context_lens: positions.iter().map(|&p| p + 1).collect(),
        cu_q_lens: (0..=positions.len() as u32).collect(),
        write_positions: vec![],
    };
    let batch = PagedBatch::new(host, bs, AttnMask::Causal, s.num_kv_heads * s.head_dim, &gpu).unwrap();
    let ids = Tensor::new(&[5u32, 77, 300, 12, 9, 400, 1][..], &gpu).unwrap();
    let pos = Tensor::new(positions.as_slice(), &gpu).unwrap();
    type Stage<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;
    let prelude = || -> candle_core::Result<Tensor> { model.prelude(&ids, &model.prepare(&pos)?, &batch, &kv) };
    let h0 = prelude().unwrap();
    let stages: Vec<(&str, Stage)> = vec![
        ("prelude", Box::new(prelude)),
        ("core step", Box::new(|| Ok(model.core_step(&h0, &model.prepare(&pos)?, &batch, &kv)?.hidden))),
        ("coda + head", Box::new(|| model.head(&model.coda(&h0, &model.prepare(&pos)?, &batch, &kv)?))),
        (
            "full depth (prelude, 4 core steps, coda, head)",
            Box::new(|| {
                let input = model.prepare(&pos)?;
                let mut h = model.prelude(&ids, &input, &batch, &kv)?;
                for _ in 0..4 {
                    h = model.core_step(&h, &input, &batch, &kv)?.hidden;
                }
                model.head(&model.coda(&h, &input, &batch, &kv)?)
            }),
        ),
    ];
    let max_abs = |a: &Tensor, b: &Tensor| -> f32 {
        (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    };
    let workspace = std::sync::Arc::new(GemmWorkspace::new(&gpu).unwrap());
    for (name, run) in &stages {
        // Each stage rewrites the same K/V rows with the same values, so runs are repeatable.
        let eager = Graph::warm_up(&gpu, run).unwrap();
        let again = run().unwrap();
        let out = eager.zeros_like().unwrap();
        let graph = Graph::capture(&gpu, &workspace, || {
            let y = run()?;
            out.slice_set(&y, 0, 0)
        })
        .unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let scale = eager.to_dtype(DType::F32).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap().max(1e-6);
        let (d_again, d_graph) = (max_abs(&eager, &again), max_abs(&eager, &out));
        println!("huginn {name}: max |eager − eager| {d_again:.3e}, max |eager − replay| {d_graph:.3e} (max |eager| {scale:.3e})");
        assert_eq!(d_again, 0.0, "{name}: eager runs are not repeatable");
        assert!(d_graph <= 0.05 * scale, "{name}: replay differs from eager by {d_graph} (scale {scale})");
    }
}

/// `EngineBuilder::time_device`: every launch gets a device-side span, spans are positive and,
/// summed, no longer than the run's wall time (overlap on: spans of consecutive launches do not
/// overlap on one stream).
#[test]
fn device_spans_cover_every_launch() {
    use ponder::looped::gate::{DepthTrace, Replay};
    let gpu = gpu_device();
    let cfg = graph_test_config();
    let weights = ponder::testing::random_ouro_weights(&cfg, 5, DType::BF16, &gpu).unwrap();
    let model = ponder::looped::models::Ouro::load(&cfg, &weights).unwrap();
    let mut engine = ponder::EngineBuilder::from_model(Box::new(model), None, vec![])
        .looped(|o| {
            o.scheduler(ponder::SchedulerKind::Depth { refill: true })
                .exit_gate(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 9).unwrap(), 1, 4).unwrap())
                .kv_layout(ponder::KvLayoutKind::LastExited)
        })
        .max_num_seqs(16)
        .kv_capacity_tokens(64 * 1024)
        .looped(|o| o.time_device(true))
        .build()
        .unwrap();
    engine.set_overlap(true).unwrap();
    let start = std::time::Instant::now();
    for i in 0..24u32 {
        let prompt: Vec<u32> = (0..(5 + i * 7) % 90 + 1).map(|t| (t * 31 + i) % 512).collect();
        engine.add_request(prompt, ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(12) }).unwrap();
    }
    while engine.has_work() {
        engine.step().unwrap();
    }
    let wall = start.elapsed();
    let m = engine.metrics();
    let mut total = std::time::Duration::ZERO;
    for (stage, s) in &m.stages {
        println!(
            "device spans {stage}: {} launches, {:.2} ms device, {:.2} ms launch wall",
            s.launches,
            s.device_time.as_secs_f64() * 1e3,
            s.time.as_secs_f64() * 1e3
        );
        assert_eq!(s.device_timed, s.launches, "{stage}: every launch has a span");
        assert!(s.device_time > std::time::Duration::ZERO, "{stage}: spans are positive");
        total += s.device_time;
    }
    assert!(total <= wall, "spans {total:?} exceed the wall time {wall:?}");
    keep(engine);
}

/// The tiny Ouro of the graph tests on the GPU, with the embedding row of `poison` (if any) set
/// to NaN: a request whose prompt holds that token meets non-finite logits.
fn ouro_on_gpu(gpu: &Device, dtype: DType, poison: Option<usize>) -> Box<dyn ponder::looped::models::LoopedModel> {
    let cfg = graph_test_config();
    let mut t = ponder::testing::random_tensors(&ponder::testing::ouro_tensor_manifest(&cfg), 5, DType::F32, gpu).unwrap();
    if let Some(token) = poison {
        let e = t["model.embed_tokens.weight"].to_device(&Device::Cpu).unwrap();
        let (v, h) = e.dims2().unwrap();
        let mut rows: Vec<f32> = e.flatten_all().unwrap().to_vec1().unwrap();
        rows[token * h..(token + 1) * h].fill(f32::NAN);
        t.insert("model.embed_tokens.weight".into(), Tensor::from_vec(rows, (v, h), gpu).unwrap());
    }
    Box::new(ponder::looped::models::Ouro::load(&cfg, &ponder::loader::Weights::from_map(t, dtype, gpu)).unwrap())
}

/// The non-finite flag on the device equals the CPU's, for f32 and bf16 logits.
#[test]
fn non_finite_flag_matches_cpu() {
    let gpu = gpu_device();
    let v = 512;
    let mut rows = vec![0.25f32; 6 * v];
    rows[v + 3] = f32::NAN;
    rows[2 * v + 511] = f32::INFINITY;
    rows[4 * v] = f32::NEG_INFINITY;
    rows[5 * v + 7] = 9.0;
    for dtype in [DType::F32, DType::BF16] {
        let cpu = Tensor::from_vec(rows.clone(), (6, v), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let want: Vec<u32> = ponder::ops::flag_non_finite(&cpu.argmax(1).unwrap(), &cpu, v).unwrap().to_vec1().unwrap();
        let dev = cpu.to_device(&gpu).unwrap();
        let got: Vec<u32> = ponder::ops::flag_non_finite(&dev.argmax(1).unwrap(), &dev, v).unwrap().to_vec1().unwrap();
        let mask: Vec<u8> = ponder::ops::non_finite_rows(&dev).unwrap().to_vec1().unwrap();
        assert_eq!(mask, vec![0, 1, 1, 0, 1, 0], "{dtype:?}");
        assert_eq!(
            got.iter().map(|&t| t as usize >= v).collect::<Vec<_>>(),
            want.iter().map(|&t| t as usize >= v).collect::<Vec<_>>(),
            "{dtype:?}: {got:?} vs {want:?}"
        );
        assert_eq!(got[5], 7, "{dtype:?}");
    }
}

/// Non-finite logits on the device: the flag rides back with the greedy ids (eager path, CB's
/// decode graphs, depth batching's re-entering coda graphs). The embedding row of the bad
/// request's first generated token is set to NaN, so its prefill is clean and its first decode
/// step (eager, or inside a captured graph) meets NaN; the request ends with an error after that
/// one token, the one beside it generates what it generates on the clean weights.
#[test]
fn non_finite_logits_fail_their_request_on_the_device() {
    use ponder::looped::gate::{DepthTrace, Replay};
    let gpu = gpu_device();
    let (bad, good) = (vec![3u32, 7, 11, 9, 40], vec![4u32, 8, 12, 10, 2, 99]);
    for (sched, layout) in [
        (ponder::SchedulerKind::Continuous, ponder::KvLayoutKind::DepthIndexed),
        (ponder::SchedulerKind::Depth { refill: true }, ponder::KvLayoutKind::LastExited),
    ] {
        for graphs in [false, true] {
            let run = |poison: Option<usize>| {
                let mut b = ponder::EngineBuilder::from_model(ouro_on_gpu(&gpu, DType::BF16, poison), None, vec![])
                    .looped(|o| o.scheduler(sched).kv_layout(layout).cuda_graphs(graphs))
                    .max_num_seqs(4)
                    .kv_capacity_tokens(16 * 1024);
                if sched != ponder::SchedulerKind::Continuous {
                    b = b.looped(|o| o.exit_gate(Replay::new(DepthTrace::with_mean(2.5, 1, 4, 9).unwrap(), 1, 4).unwrap()));
                }
                let mut e = b.build().unwrap();
                let params = ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(12) };
                let outs: Vec<ponder::Output> = e.generate([bad.clone(), good.clone()], &params).unwrap().into_iter().map(|o| o.unwrap()).collect();
                assert_eq!(e.requests().kv().num_used_blocks(), 0);
                keep(e);
                outs
            };
            let label = format!("{sched:?} × {layout:?} × graphs={graphs}");
            let clean = run(None);
            let first = clean[0].token_ids[0];
            let used: Vec<u32> = bad.iter().chain(&good).chain(&clean[1].token_ids).copied().collect();
            assert!(!used.contains(&first), "{label}: pick prompts whose other tokens avoid the poisoned one ({first})");
            let outs = run(Some(first as usize));
            assert!(
                matches!(&outs[0].finish_reason, ponder::FinishReason::Error(m) if m.contains("non-finite")),
                "{label}: {:?} after {:?}",
                outs[0].finish_reason,
                outs[0].token_ids
            );
            assert_eq!(outs[0].token_ids, vec![first], "{label}: the clean prefill's token, then the error");
            assert_eq!(outs[1].token_ids, clean[1].token_ids, "{label}: the other request goes on");
        }
    }
}

/// Chunked prefill on the device: prompts of up to 300 tokens prefilled in chunks of 16
/// (the kernel's queries then sit past cached keys) give the tokens a single prefill gives (f32).
#[test]
fn chunked_prefill_matches_unchunked_on_the_device() {
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(78);
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| (0..[300, 17, 129, 64][i % 4]).map(|_| rng.random_range(0..512u32)).collect()).collect();
    let run = |budget: usize| {
        let mut e = ponder::EngineBuilder::from_model(ouro_on_gpu(&gpu, DType::F32, None), None, vec![])
            .dtype(DType::F32)
            .max_num_seqs(4)
            .max_num_batched_tokens(budget)
            .kv_capacity_tokens(32 * 1024)
            .build()
            .unwrap();
        let params = ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(4) };
        let out: Vec<Vec<u32>> = e.generate(prompts.clone(), &params).unwrap().into_iter().map(|o| o.unwrap().token_ids).collect();
        let launches = e.metrics().stages["prefill"].launches;
        keep(e);
        (out, launches)
    };
    let (whole, whole_launches) = run(8192);
    let (chunked, chunked_launches) = run(16);
    assert!(chunked_launches >= 2 * 300 / 16, "prefill launches: {chunked_launches} chunked, {whole_launches} whole");
    assert_eq!(chunked, whole);
}

/// Diagnosis aid (run with `--ignored`): where a NaN embedding row stops propagating.
#[test]
#[ignore]
fn debug_nan_propagation() {
    let gpu = gpu_device();
    for (dev, dtype) in [(Device::Cpu, DType::F32), (gpu.clone(), DType::F32), (gpu.clone(), DType::BF16)] {
        let model = ouro_on_gpu(&dev, dtype, Some(11));
        let mut e = ponder::EngineBuilder::from_model(model, None, vec![]).max_num_seqs(4).kv_capacity_tokens(16 * 1024).build().unwrap();
        let prompts = vec![vec![11u32], vec![3, 11], vec![11, 3], vec![3, 7, 11, 9, 40]];
        let params = ponder::GenerationParams { ignore_eos: true, ..ponder::GenerationParams::greedy(3) };
        for (p, o) in prompts.iter().zip(e.generate(prompts.clone(), &params).unwrap()) {
            let o = o.unwrap();
            println!("{dev:?} {dtype:?} prompt {p:?}: {:?} {:?}", o.finish_reason, o.token_ids);
        }
    }
}

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

// Mixture-of-experts kernels (`ponder::ops::moe`): routing on the device against the host rule,
// the grouped experts against the candle composition.

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

/// The shipped tiny checkpoint `name` on `device` in f32. The binary runs where it was built or
/// from the repository root of another machine (the device's copy of the tree).
fn tiny_on(name: &str, device: &Device, max_num_seqs: usize) -> ponder::Engine {
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
    let dir = if built.exists() { built } else { std::path::PathBuf::from("assets") }.join(name);
    ponder::EngineBuilder::new(dir).device(device.clone()).dtype(DType::F32).max_num_seqs(max_num_seqs).build().unwrap()
}

/// Keeps a GPU engine to process exit: freeing its pool and graphs synchronises the context,
/// which would invalidate another test's graph capture (see [`gpu_device`]).
fn keep(engine: ponder::Engine) {
    static KEPT: std::sync::Mutex<Vec<ponder::Engine>> = std::sync::Mutex::new(Vec::new());
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(engine);
}

/// Diffusion sampling (tempered, cut, inverse-CDF draws by bisection in candle ops) on the GPU:
/// a seeded request decodes the same tokens batched as alone, and as on the CPU.
#[test]
fn sampled_diffusion_decoding_on_the_gpu_matches_the_cpu() {
    let gpu = gpu_device();
    let prompts = ["fn main() {", "The borrow checker", "Ownership is"];
    let params = |i: usize| ponder::GenerationParams {
        sampling: ponder::SamplingParams { temperature: 0.7, top_k: Some(20), top_p: Some(0.9), seed: Some(11 + i as u64) },
        ignore_eos: true,
        ..ponder::GenerationParams::greedy(20)
    };
    let decode = |device: &Device, width: usize| -> Vec<Vec<u32>> {
        let mut e = tiny_on("tiny-sdar", device, width);
        if width == 1 {
            let out = prompts.iter().enumerate().map(|(i, p)| e.generate([*p], &params(i)).unwrap().remove(0).unwrap().token_ids).collect();
            keep(e);
            return out;
        }
        let ids: Vec<_> = prompts.iter().enumerate().map(|(i, p)| e.add_request(*p, params(i)).unwrap()).collect();
        let mut out: std::collections::HashMap<_, Vec<u32>> = Default::default();
        while e.has_work() {
            for ev in e.step().unwrap() {
                if let ponder::Event::Token { id, token, .. } = ev {
                    out.entry(id).or_default().push(token);
                }
            }
        }
        keep(e);
        ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect()
    };
    let alone = decode(&gpu, 1);
    assert_eq!(decode(&gpu, 3), alone, "batched on the GPU");
    assert_eq!(decode(&Device::Cpu, 1), alone, "the CPU's draws");
}

/// Log-probabilities on the GPU (log-softmax and the top-n rounds of argmax over the device's
/// logits) equal the CPU's for the same greedy request.
#[test]
fn logprobs_on_the_gpu_match_the_cpu() {
    let gpu = gpu_device();
    let params = ponder::GenerationParams { logprobs: Some(4), ..ponder::GenerationParams::greedy(12) };
    let run = |device: &Device| {
        let mut e = tiny_on("tiny-ouro", device, 2);
        let out = e.generate(["Ownership in Rust"], &params).unwrap().remove(0).unwrap();
        keep(e);
        out
    };
    let (g, c) = (run(&gpu), run(&Device::Cpu));
    assert_eq!(g.token_ids, c.token_ids);
    assert_eq!(g.logprobs.len(), 12);
    for (i, ((lg, lc), (tg, tc))) in g.logprobs.iter().zip(&c.logprobs).zip(g.top_logprobs.iter().zip(&c.top_logprobs)).enumerate() {
        assert!((lg - lc).abs() < 1e-3, "token {i}: {lg} vs {lc}");
        assert_eq!(tg.iter().map(|t| t.0).collect::<Vec<_>>(), tc.iter().map(|t| t.0).collect::<Vec<_>>(), "token {i}");
        assert_eq!(tg[0], (g.token_ids[i], *lg), "token {i}: the greedy token heads its alternatives");
    }
}

/// FP8 weights on the GPU: quantizing at load on the device, then the dequantizing path and the
/// weight-only kernel decode the tiny Ouro and the tiny SDAR as on the CPU, log-probabilities
/// within 1e-3; under W8A8 the GPU's FP8 GEMM stays close to the CPU's W8A8 (teacher-forced
/// log-probabilities for the Ouro, most greedy tokens for the SDAR).
#[test]
fn fp8_weights_on_the_gpu_match_the_cpu() {
    let gpu = gpu_device();
    for name in ["tiny-ouro", "tiny-sdar"] {
        let looped = name == "tiny-ouro";
        let params = ponder::GenerationParams { logprobs: looped.then_some(0), ..ponder::GenerationParams::greedy(16) };
        let run_with = |device: &Device, kernels: &str, params: &ponder::GenerationParams| {
            let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
            let dir = if built.exists() { built } else { std::path::PathBuf::from("assets") }.join(name);
            let mut e = ponder::EngineBuilder::new(dir)
                .device(device.clone())
                .dtype(DType::F32)
                .quantization(ponder::quant::Quantization::Fp8)
                .kernels(kernels.parse().unwrap())
                .max_num_seqs(2)
                .build()
                .unwrap();
            let out = e.generate(["Ownership in Rust"], params).unwrap().remove(0).unwrap();
            let used = e.metrics().kernels;
            keep(e);
            (out, used)
        };
        let run = |device: &Device, kernels: &str| run_with(device, kernels, &params);
        let (c, _) = run(&Device::Cpu, "");
        // The dequantizing path, then the weight-only kernel (decode launches of one row).
        for kernels in ["fp8=dequantize", "fp8=weight-only"] {
            let (g, counts) = run(&gpu, kernels);
            let used = counts.fp8_weight_only;
            assert_eq!(used > 0, kernels == "fp8=weight-only", "{name} {kernels}: {used} weight-only launches");
            assert_eq!(g.token_ids, c.token_ids, "{name} {kernels}");
            for (i, (lg, lc)) in g.logprobs.iter().zip(&c.logprobs).enumerate() {
                assert!((lg - lc).abs() < 1e-3, "{name} {kernels} token {i}: {lg} vs {lc}");
            }
        }
        // W8A8 quantizes the activations too: the GPU's FP8 GEMM (every launch; captured in the
        // looped model's decode graphs) against the CPU computing the same quantization. The
        // tensor cores' accumulation (about 1e-4 relative) moves an activation across an E4M3
        // rounding boundary now and then, a change of up to 1/16 of it, so the two drift apart
        // over a generation (on an H200 the tiny Ouro's greedy tokens parted at the tenth):
        // compared on the CPU's tokens, teacher-forced, their log-probabilities stay close.
        // A diffusion model takes no forced tokens: its greedy tokens are compared, most alike.
        let (c8, _) = run(&Device::Cpu, "fp8=w8a8");
        if !looped {
            let (g8, counts) = run(&gpu, "fp8=w8a8");
            assert!(counts.fp8_w8a8 > 0 && counts.fp8_weight_only == 0, "{name}: {counts:?}");
            let same = g8.token_ids.iter().zip(&c8.token_ids).filter(|(a, b)| a == b).count();
            println!("{name} w8a8: {same} of {} greedy tokens as on the CPU", c8.token_ids.len());
            assert!(4 * same >= 3 * c8.token_ids.len(), "{name} w8a8: {:?} against {:?}", g8.token_ids, c8.token_ids);
            continue;
        }
        let forced = ponder::GenerationParams { forced_tokens: c8.token_ids.clone(), ignore_eos: true, ..params.clone() };
        let (g8, counts) = run_with(&gpu, "fp8=w8a8", &forced);
        assert!(counts.fp8_w8a8 > 0 && counts.fp8_weight_only == 0, "{name}: {counts:?}");
        assert_eq!(g8.token_ids, c8.token_ids, "{name} w8a8: forced");
        // The scale of the comparison: how far quantizing the activations at all moves these
        // log-probabilities on the CPU (W8A8 against the dequantized weights, same tokens). The
        // tiny model sits close to E4M3 rounding boundaries: on an H100 the GPU was 0.135 (max)
        // from the CPU's W8A8 at the first token, about as far as W8A8 is from the dequantized
        // path there (0.131 on this CPU; the device machine's own CPU differed from it by 0.018).
        // A wrong scale or a broken GEMM lands well past 1.5× that.
        let (cd, _) = run_with(&Device::Cpu, "fp8=dequantize", &forced);
        let stats = |a: &[f32], b: &[f32]| {
            let d: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).abs()).collect();
            (d.iter().fold(0f32, |m, &v| m.max(v)), d.iter().sum::<f32>() / d.len().max(1) as f32)
        };
        let (max, mean) = stats(&g8.logprobs, &c8.logprobs);
        let (q_max, q_mean) = stats(&cd.logprobs, &c8.logprobs);
        println!("{name} w8a8: GPU against CPU, forced log p max diff {max:.4} mean {mean:.4}; W8A8 against dequantized on the CPU {q_max:.4} / {q_mean:.4}");
        assert!(
            max <= 0.1f32.max(1.5 * q_max) && mean <= 0.02f32.max(1.5 * q_mean),
            "{name} w8a8: log-probabilities {:?} against {:?} (dequantized {:?})",
            g8.logprobs,
            c8.logprobs,
            cd.logprobs
        );
    }
}

/// FP8 weights quantized on the device are the CPU's bit for bit (values and scales), and
/// dequantize to the CPU's values in every float dtype, per-channel and block-scaled; rows
/// picked and columns cut from an FP8 weight on the device are the CPU's.
#[test]
fn fp8_weights_on_the_device_are_the_cpus_bit_for_bit() {
    use ponder::ops::Linear;
    use ponder::quant::{Fp8Scale, Fp8Weight};
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(85);
    let mut w = rand_tensor(&mut rng, &[96, 300], -2.0, 2.0, DType::F32);
    w = w.slice_assign(&[7..8, 0..300], &Tensor::zeros((1, 300), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let f32s = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (cpu, dev) = (Fp8Weight::quantize(&w).unwrap(), Fp8Weight::quantize(&w.to_device(&gpu).unwrap()).unwrap());
    assert_eq!(f32s(dev.data()), f32s(cpu.data()), "E4M3 values");
    let (Fp8Scale::PerChannel(a), Fp8Scale::PerChannel(b)) = (cpu.scale(), dev.scale()) else { unreachable!() };
    assert_eq!(f32s(b), f32s(a), "scales");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        assert_eq!(f32s(&dev.dequantize(dtype).unwrap()), f32s(&cpu.dequantize(dtype).unwrap()), "{dtype:?} dequantized");
    }
    let blocks = Tensor::from_vec((0..3 * 3).map(|i| 0.01 + i as f32 * 0.003).collect::<Vec<_>>(), (3, 3), &Device::Cpu).unwrap();
    let block = Fp8Weight::from_parts(cpu.data().clone(), Fp8Scale::Block { scale: blocks, block: (32, 128) }).unwrap();
    assert_eq!(f32s(&block.to_device(&gpu).unwrap().dequantize(DType::BF16).unwrap()), f32s(&block.dequantize(DType::BF16).unwrap()), "block-scaled");
    // Rows picked (the rotary permutation some checkpoints need) and columns cut (a rank's
    // share of a row-parallel layer) on the device.
    let (lc, lg) = (Linear::fp8(cpu.clone(), None, DType::F32).unwrap(), Linear::fp8(dev.clone(), None, DType::F32).unwrap());
    let rows: Vec<u32> = (0..96).rev().collect();
    let both = |a: &Linear, b: &Linear| assert_eq!(f32s(&b.weight().unwrap()), f32s(&a.weight().unwrap()));
    both(&lc.select_rows(&rows).unwrap(), &lg.select_rows(&rows).unwrap());
    both(&lc.input_columns(100..200).unwrap(), &lg.input_columns(100..200).unwrap());
}

/// The W8A8 FP8 GEMM (cuBLASLt on the FP8 tensor cores, per-row and per-channel scales in its
/// epilogue) and the per-row quantization of the activations it multiplies: the quantization
/// bit for bit the CPU's; the product within f32 summation order of the CPU's reference
/// (quantize, dequantize, f32 matmul) at decode, prefill and denoising shapes, bf16, f16 and
/// f32, with and without a bias; shapes it does not take (n or k off 16) run the reference on
/// the device, under the same policy.
#[test]
fn fp8_w8a8_gemm_matches_its_reference() {
    use ponder::ops::{Fp8Kernels, KernelPolicy, Linear};
    use ponder::quant::{Fp8Scale, Fp8Weight};
    let gpu = gpu_device();
    let policy = KernelPolicy { fp8: Fp8Kernels::W8A8, ..Default::default() };
    let mut rng = StdRng::seed_from_u64(83);
    // Activation quantization: rows of mixed magnitudes, an all-zero row, every float dtype.
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let mut x = rand_tensor(&mut rng, &[9, 4100], -3.0, 3.0, DType::F32);
        x = x.slice_assign(&[2..3, 0..4100], &Tensor::zeros((1, 4100), DType::F32, &Device::Cpu).unwrap()).unwrap();
        x = x.slice_assign(&[5..6, 0..4100], &(x.narrow(0, 5, 1).unwrap() * 1e-3).unwrap()).unwrap();
        let x = x.to_dtype(dtype).unwrap();
        let want = Fp8Weight::quantize(&x).unwrap();
        let (q, scale) = ponder::ops::cuda::quantize_rows(&x.to_device(&gpu).unwrap()).unwrap();
        let Fp8Scale::PerChannel(want_scale) = want.scale() else { unreachable!() };
        assert_eq!(scale.to_vec1::<f32>().unwrap(), want_scale.to_vec1::<f32>().unwrap(), "{dtype:?} scales");
        let bytes = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bytes(&q.to_device(&Device::Cpu).unwrap()), bytes(want.data()), "{dtype:?} E4M3 values");
    }
    // The quantized activations are exact on both sides (checked above); what is left is the
    // output's rounding and the FP8 tensor cores' accumulation, which keeps fewer bits than f32
    // between cuBLASLt's promotions (1.1e-4 measured at k 512 on an H100).
    let shapes = [(17, 256, 512), (64, 4096, 4096), (256, 1536, 2048), (1000, 512, 1024), (3, 96, 160)];
    let reference = |x: &Tensor, q: &Fp8Weight, bias: Option<&Tensor>, _: DType| {
        ponder::ops::w8a8_reference(&x.to_dtype(DType::F32).unwrap(), q, bias.map(|b| b.to_dtype(DType::F32).unwrap()).as_ref()).unwrap()
    };
    fp8_layer_against(&gpu, &mut rng, policy, &shapes, 5e-4, reference, |c| c.fp8_w8a8);
    // Shapes the GEMM does not take run the reference on the device, under the same policy.
    for (n, k) in [(40, 64), (32, 40)] {
        let q = Fp8Weight::quantize(&rand_tensor(&mut rng, &[n, k], -0.5, 0.5, DType::F32)).unwrap();
        let layer = Linear::fp8(q.to_device(&gpu).unwrap(), None, DType::BF16).unwrap();
        let x = rand_tensor(&mut rng, &[33, k], -1.0, 1.0, DType::BF16);
        let (got, counts) = ponder::ops::with_kernels(policy, || layer.forward(&x.to_device(&gpu).unwrap()).unwrap());
        assert_eq!(counts.fp8_w8a8, 0, "[{n}, {k}]");
        let want = ponder::ops::w8a8_reference(&x, &q, None).unwrap();
        assert!(rel_err(&got.to_device(&Device::Cpu).unwrap(), &want) <= 1e-2, "[{n}, {k}] on the reference");
    }
}

/// An FP8 layer on the GPU under `policy` against `reference` on the CPU at each `(rows, n, k)`,
/// in bf16, f16 and f32 (within `f32_tol` in f32, 1e-2 in the 16-bit dtypes), with and without
/// a bias; the path `ran` counts runs once a forward.
fn fp8_layer_against(
    gpu: &Device,
    rng: &mut StdRng,
    policy: ponder::ops::KernelPolicy,
    shapes: &[(usize, usize, usize)],
    f32_tol: f32,
    reference: impl Fn(&Tensor, &ponder::quant::Fp8Weight, Option<&Tensor>, DType) -> Tensor,
    ran: impl Fn(&ponder::ops::KernelCounts) -> u64,
) {
    for &(rows, n, k) in shapes {
        let q = ponder::quant::Fp8Weight::quantize(&rand_tensor(rng, &[n, k], -0.5, 0.5, DType::F32)).unwrap();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for with_bias in [false, true] {
                let x = rand_tensor(rng, &[rows, k], -1.0, 1.0, dtype);
                let bias = with_bias.then(|| rand_tensor(rng, &[n], -0.5, 0.5, dtype));
                let want = reference(&x, &q, bias.as_ref(), dtype);
                let on_gpu = ponder::ops::Linear::fp8(q.to_device(gpu).unwrap(), bias.as_ref().map(|b| b.to_device(gpu).unwrap()), dtype).unwrap();
                let (got, counts) = ponder::ops::with_kernels(policy, || on_gpu.forward(&x.to_device(gpu).unwrap()).unwrap());
                assert_eq!(ran(&counts), 1, "[{rows}, {n}, {k}] {dtype:?}: the FP8 path ran");
                let err = rel_err(&got.to_device(&Device::Cpu).unwrap(), &want);
                let tol = if dtype == DType::F32 { f32_tol } else { 1e-2 };
                assert!(err <= tol, "[{rows}, {n}, {k}] {dtype:?} bias {with_bias}: relative error {err:e}");
            }
        }
    }
}

/// The weight-only FP8 kernels (decode widths), tensor-core and SIMT, against the dequantizing
/// path on the CPU: bf16, f16 and f32 activations, 1 to 16 rows, with and without a bias, widths
/// off the kernels' strides, per-row and block scales; 17 to 64 rows on the tensor-core kernel's
/// two and four m16 tiles where the policy allows them; past the policy's rows, past the SIMT
/// kernel's 16 (f32), and k off the 16-weight vector go the dequantizing way. The tensor-core
/// kernel in both its forms: plain, and with the weights streamed through shared memory
/// (`fp8-pipe=on`).
#[test]
fn fp8_weight_only_kernel_matches_the_dequantized_matmul() {
    for pipe in [false, true] {
        fp8_weight_only_check(pipe);
    }
}

/// The weight-only FP8 kernel's k slices (`fp8_linear_partials`): each slice against its CPU
/// composition (the dequantized weight times x over the same run of 64-wide chunks, in f32), per
/// row and block scales, 1 to 64 rows, uneven runs (k off the chunk), written into a given buffer
/// as into a new one; summed they round to the whole kernel's product. Through a norm-fed layer
/// (`Linear::add_rms_norm` and `residual_add_rms_norm`) under `fp8-split-k`, the split path runs
/// where the plan cuts (and not where it does not) and gives the whole path's values.
#[test]
fn fp8_weight_only_partials_match_their_cpu_composition() {
    use ponder::ops::cuda::{fp8_linear, fp8_linear_partials, WeightScale};
    use ponder::ops::split_k::fp8_linear_partials_reference;
    use ponder::ops::{KernelPolicy, Linear};
    use ponder::quant::{Fp8Scale, Fp8Weight};
    let gpu = gpu_device();
    let mut rng = StdRng::seed_from_u64(82);
    // (rows, n, k, splits, block scales)
    let cases = [
        (16, 2048, 2048, 2, None),
        (16, 2048, 5632, 4, None),
        (1, 200, 1040, 3, None),
        (33, 96, 4112, 5, None),
        (64, 2048, 2048, 4, None),
        (9, 300, 1040, 2, Some((128, 128))),
        (16, 77, 4112, 7, Some((7, 32))),
        // 5 chunks in 4 slices: runs of 2, 2, 1 and none (a slice of zeros).
        (16, 96, 320, 4, None),
    ];
    for (rows, n, k, splits, block) in cases {
        let dense = rand_tensor(&mut rng, &[n, k], -0.5, 0.5, DType::F32);
        let q = match block {
            None => Fp8Weight::quantize(&dense).unwrap(),
            Some(block) => {
                let data = Fp8Weight::quantize(&dense).unwrap().data().clone();
                let scale = rand_tensor(&mut rng, &[n.div_ceil(block.0), k.div_ceil(block.1)], 0.001, 0.01, DType::F32);
                Fp8Weight::from_parts(data, Fp8Scale::Block { scale, block }).unwrap()
            }
        };
        for dtype in [DType::BF16, DType::F16] {
            let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dtype);
            let want = fp8_linear_partials_reference(&x, &q, splits).unwrap();
            let (xg, qg) = (x.to_device(&gpu).unwrap(), q.to_device(&gpu).unwrap());
            let scale = match qg.scale() {
                Fp8Scale::PerChannel(s) => WeightScale::Rows(s),
                Fp8Scale::Block { scale, block } => WeightScale::Blocks { scale, block: *block },
            };
            let got = fp8_linear_partials(&xg, qg.data(), scale, splits, None).unwrap();
            let given = Tensor::full(f32::NAN, (splits, rows, n), &gpu).unwrap();
            fp8_linear_partials(&xg, qg.data(), scale, splits, Some(&given)).unwrap();
            let name = format!("[{rows}, {n}, {k}] in {splits} slices, {block:?}, {dtype:?}");
            assert_eq!(got.dims(), [splits, rows, n], "{name}");
            let got_cpu = got.to_device(&Device::Cpu).unwrap();
            assert_eq!(rel_err(&given.to_device(&Device::Cpu).unwrap(), &got_cpu), 0.0, "{name}: the given buffer holds the same values");
            // A row's scale multiplies the f32 sum; a block's multiplies each weight as it is
            // converted, rounded to x's dtype there (the f32 composition keeps it exact).
            let tol = if block.is_some() { 1e-2 } else { 1e-4 };
            for i in 0..splits {
                let err = rel_err(&got_cpu.get(i).unwrap(), &want.get(i).unwrap());
                assert!(err <= tol, "{name}: slice {i} relative error {err:e}");
            }
            // Summed and rounded, the whole kernel's product.
            let whole = fp8_linear(&xg, qg.data(), scale, None, true).unwrap().to_dtype(DType::F32).unwrap();
            let summed = got.sum(0).unwrap().to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let err = rel_err(&summed.to_device(&Device::Cpu).unwrap(), &whole.to_device(&Device::Cpu).unwrap());
            assert!(err <= 1e-2, "{name}: summed against the whole product, relative error {err:e}");
            assert!(fp8_linear_partials(&xg, qg.data(), scale, k.div_ceil(64) + 1, None).is_err(), "{name}: more slices than chunks");
        }
    }
    // A norm-fed FP8 layer under the policy: split where the plan cuts (planned: by this card's
    // SM count; Ouro's o_proj at 16 rows on 128 or more, never at 64 rows), whole where it does not.
    for (rows, n, k, split_k) in
        [(16, 2048, 2048, "planned"), (16, 2048, 2048, "4"), (16, 2048, 2048, "1"), (16, 5280, 5280, "planned"), (64, 2048, 2048, "planned")]
    {
        let q = Fp8Weight::quantize(&rand_tensor(&mut rng, &[n, k], -0.5, 0.5, DType::F32)).unwrap().to_device(&gpu).unwrap();
        let layer = Linear::fp8(q, None, DType::BF16).unwrap();
        let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, DType::BF16).to_device(&gpu).unwrap();
        let residual = rand_tensor(&mut rng, &[rows, n], -1.0, 1.0, DType::BF16).to_device(&gpu).unwrap();
        let (w1, w2) = (
            rand_tensor(&mut rng, &[n], 0.5, 1.5, DType::BF16).to_device(&gpu).unwrap(),
            rand_tensor(&mut rng, &[n], 0.5, 1.5, DType::BF16).to_device(&gpu).unwrap(),
        );
        let whole_policy: KernelPolicy = "fp8=weight-only,fp8-rows=64,fp8-split-k=1".parse().unwrap();
        let policy: KernelPolicy = format!("fp8=weight-only,fp8-rows=64,fp8-split-k={split_k}").parse().unwrap();
        let splits = ponder::ops::with_kernels(policy, || ponder::ops::split_k::fp8_split_k_plan(&x, n)).0.is_some();
        let expected = match (split_k, rows, n) {
            ("4", ..) => true,
            ("planned", 16, 2048) => ponder::ops::cuda::sm_count(gpu.as_cuda_device().unwrap()).unwrap() >= 128,
            _ => false,
        };
        assert_eq!(splits, expected, "[{rows}, {n}, {k}] fp8-split-k={split_k}: the plan");
        for pre_norm in [false, true] {
            let run = |p| {
                ponder::ops::with_kernels(p, || match pre_norm {
                    false => layer.add_rms_norm(&residual, &x, &w1, &w2, 1e-6).unwrap(),
                    true => layer.residual_add_rms_norm(&residual, &x, &w1, 1e-6).unwrap(),
                })
            };
            let ((h0, n0), _) = run(whole_policy);
            let ((h1, n1), counts) = run(policy);
            let name = format!("[{rows}, {n}, {k}] fp8-split-k={split_k}, pre-norm {pre_norm}");
            assert_eq!(counts.fp8_weight_only, 1, "{name}: the weight-only kernel ran once");
            assert_eq!(counts.fp8_split_k > 0, splits, "{name}: split {splits}");
            for (a, b, what) in [(&h0, &h1, "h"), (&n0, &n1, "n")] {
                let err = rel_err(&b.to_device(&Device::Cpu).unwrap(), &a.to_device(&Device::Cpu).unwrap());
                assert!(err <= 1e-2, "{name}: {what} relative error {err:e} against the whole product");
            }
        }
    }
}

fn fp8_weight_only_check(pipe: bool) {
    use ponder::ops::{Fp8Kernels, KernelPolicy, Linear};
    use ponder::quant::Fp8Weight;
    let gpu = gpu_device();
    let policy = KernelPolicy { fp8: Fp8Kernels::WeightOnly, fp8_pipeline: pipe, ..Default::default() };
    let mut rng = StdRng::seed_from_u64(81);
    // The dequantizing path on the CPU (the default policy there).
    let reference = |x: &Tensor, q: &Fp8Weight, bias: Option<&Tensor>, dtype: DType| Linear::fp8(q.clone(), bias.cloned(), dtype).unwrap().forward(x).unwrap();
    // The tensor-core kernel (bf16 / f16) and the SIMT one: rows on either side of the m16
    // tile's halves, n off its 16 columns, k off its 64-wide chunks and its 8 warps' stride.
    // 12 000 columns are 750 tiles of 16: more than the GPU holds blocks at once, so the
    // persistent pipelined blocks each take several tiles (their rings running across tile ends).
    let shapes = [(1, 200, 64), (5, 1024, 2048), (9, 333, 5632), (16, 96, 4112), (3, 7, 16), (16, 2048, 2048), (16, 12000, 1040)];
    for fp8_mma in [true, false] {
        let policy = KernelPolicy { fp8_mma, ..policy };
        fp8_layer_against(&gpu, &mut rng, policy, &shapes, 1e-5, reference, |c| c.fp8_weight_only);
    }
    // Block-scaled weights (a scale per tile, DeepSeek's 128 × 128 and a smaller, uneven tile) on
    // the tensor-core kernel, each weight dequantized by its tile's scale as the reference does.
    for (rows, n, k, block) in [(4, 300, 1040, (128, 128)), (16, 96, 4112, (128, 128)), (9, 77, 96, (7, 32)), (16, 9000, 1040, (128, 128))] {
        let data = Fp8Weight::quantize(&rand_tensor(&mut rng, &[n, k], -0.5, 0.5, DType::F32)).unwrap().data().clone();
        let scale = rand_tensor(&mut rng, &[n.div_ceil(block.0), k.div_ceil(block.1)], 0.001, 0.01, DType::F32);
        let q = Fp8Weight::from_parts(data, ponder::quant::Fp8Scale::Block { scale, block }).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dtype);
            let want = reference(&x, &q, None, dtype);
            let layer = Linear::fp8(q.to_device(&gpu).unwrap(), None, dtype).unwrap();
            let (got, counts) = ponder::ops::with_kernels(policy, || layer.forward(&x.to_device(&gpu).unwrap()).unwrap());
            assert_eq!(counts.fp8_weight_only, 1, "[{rows}, {n}, {k}] {block:?} {dtype:?}: the kernel ran");
            assert_eq!(counts.fp8_weight_only_pipelined, u64::from(pipe), "[{rows}, {n}, {k}] {block:?} {dtype:?}: pipelined {pipe}");
            let err = rel_err(&got.to_device(&Device::Cpu).unwrap(), &want);
            assert!(err <= 1e-2, "[{rows}, {n}, {k}] {block:?} {dtype:?}: relative error {err:e}");
        }
    }
    // Wider launches on the tensor-core kernel's m16 tiles (bf16 / f16), rows on either side of
    // each tile's halves, with block scales at the widest.
    let wide = KernelPolicy { fp8_weight_only_rows: 64, ..policy };
    for (rows, n, k) in [(17, 200, 64), (24, 333, 5632), (32, 1024, 2048), (41, 96, 4112), (64, 2048, 2048), (40, 9000, 1040)] {
        let q = Fp8Weight::quantize(&rand_tensor(&mut rng, &[n, k], -0.5, 0.5, DType::F32)).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dtype);
            let bias = (rows % 2 == 1).then(|| rand_tensor(&mut rng, &[n], -0.5, 0.5, dtype));
            let want = reference(&x, &q, bias.as_ref(), dtype);
            let layer = Linear::fp8(q.to_device(&gpu).unwrap(), bias.as_ref().map(|b| b.to_device(&gpu).unwrap()), dtype).unwrap();
            let (got, counts) = ponder::ops::with_kernels(wide, || layer.forward(&x.to_device(&gpu).unwrap()).unwrap());
            assert_eq!(counts.fp8_weight_only, 1, "[{rows}, {n}, {k}] {dtype:?}: the kernel ran");
            assert_eq!(counts.fp8_weight_only_pipelined, u64::from(pipe), "[{rows}, {n}, {k}] {dtype:?}: pipelined {pipe}");
            let err = rel_err(&got.to_device(&Device::Cpu).unwrap(), &want);
            assert!(err <= 1e-2, "[{rows}, {n}, {k}] {dtype:?}: relative error {err:e}");
        }
    }
    // Shapes the kernel does not take run the dequantizing path: past the policy's rows (16 set,
    // 32 by default, 64 at most), k off the 16-weight vector, past the SIMT kernel's 16 rows.
    let narrow = KernelPolicy { fp8_weight_only_rows: 16, ..policy };
    let shapes =
        [(17, 64, DType::BF16, narrow), (33, 64, DType::BF16, policy), (2, 40, DType::BF16, policy), (65, 64, DType::BF16, wide), (20, 64, DType::F32, wide)];
    for (rows, k, dtype, policy) in shapes {
        let q = Fp8Weight::quantize(&rand_tensor(&mut rng, &[32, k], -0.5, 0.5, DType::F32)).unwrap();
        let layer = Linear::fp8(q.to_device(&gpu).unwrap(), None, dtype).unwrap();
        let x = rand_tensor(&mut rng, &[rows, k], -1.0, 1.0, dtype).to_device(&gpu).unwrap();
        let (_, counts) = ponder::ops::with_kernels(policy, || layer.forward(&x).unwrap());
        assert_eq!(counts.fp8_weight_only, 0, "{rows} rows, k {k}, {dtype:?}");
    }
}
