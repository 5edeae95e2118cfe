//! CUDA kernels against the CPU reference. Needs a GPU: build with `--features cuda`, run on the
//! device machine (`--include-ignored --nocapture --test-threads=1` also prints the timings).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use ponder::ops::{
    paged_attention, paged_attention_reference, AttnMask, PagedBatch, PagedBatchHost,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

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
    let mut host = PagedBatchHost {
        block_tables: vec![],
        context_lens: vec![],
        cu_q_lens: vec![0],
    };
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
        host.cu_q_lens
            .push(host.cu_q_lens.last().unwrap() + q_len as u32);
    }
    let tokens = *host.cu_q_lens.last().unwrap() as usize;
    let qd: Vec<f32> = (0..tokens * case.heads * case.hd)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let cpu = Device::Cpu;
    let q = Tensor::from_vec(qd, (tokens, case.heads, case.hd), &cpu)
        .unwrap()
        .to_dtype(case.dtype)
        .unwrap();
    let shape = (num_blocks, bs, case.kv_heads, case.hd);
    let k = Tensor::from_vec(kc, shape, &cpu)
        .unwrap()
        .to_dtype(case.dtype)
        .unwrap();
    let v = Tensor::from_vec(vc, shape, &cpu)
        .unwrap()
        .to_dtype(case.dtype)
        .unwrap();
    Built { q, k, v, host }
}

fn rel_err(out: &Tensor, reference: &Tensor) -> f32 {
    let o = out
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let r = reference
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
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

fn check(case: Case) {
    let gpu = Device::new_cuda(0).unwrap();
    let b = build(
        &case,
        0x5eed ^ case.rows.len() as u64 ^ ((case.hd as u64) << 8),
    );
    let scale = 1.0 / (case.hd as f64).sqrt();
    let width = case.kv_heads * case.hd;
    let cpu_batch = PagedBatch::new(
        b.host.clone(),
        case.block_size,
        case.mask,
        width,
        &Device::Cpu,
    )
    .unwrap();
    let f32_ = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let reference =
        paged_attention_reference(&f32_(&b.q), &f32_(&b.k), &f32_(&b.v), &cpu_batch, scale)
            .unwrap();
    let gpu_batch =
        PagedBatch::new(b.host.clone(), case.block_size, case.mask, width, &gpu).unwrap();
    let (q, k, v) = (
        b.q.to_device(&gpu).unwrap(),
        b.k.to_device(&gpu).unwrap(),
        b.v.to_device(&gpu).unwrap(),
    );
    let tol = match case.dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    };
    // Default dispatch (tensor cores for bf16/f16 with many query items), then the SIMT kernel.
    for simt in [false, true] {
        let out = with_simt(simt, || {
            paged_attention(&q, &k, &v, &gpu_batch, scale).unwrap()
        });
        assert_eq!(out.dims(), reference.dims(), "{}", case.name);
        assert_eq!(out.dtype(), case.dtype);
        let err = rel_err(&out.to_device(&Device::Cpu).unwrap(), &reference);
        let path = if simt { "simt" } else { "default" };
        println!(
            "{:<40} {:?} {path:<7} rel err {err:.3e} (tol {tol:.0e})",
            case.name, case.dtype
        );
        assert!(err <= tol, "{} ({path}): rel err {err} > {tol}", case.name);
    }
}

static ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` with the tensor-core path switched off (`PONDER_PA_MMA=0`) when `simt`.
fn with_simt<R>(simt: bool, f: impl FnOnce() -> R) -> R {
    let _g = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if simt {
        std::env::set_var("PONDER_PA_MMA", "0");
    } else {
        std::env::remove_var("PONDER_PA_MMA");
    }
    let r = f();
    std::env::remove_var("PONDER_PA_MMA");
    r
}

const DECODE_ROWS: &[(usize, usize)] = &[
    (1, 1),
    (1, 15),
    (1, 16),
    (1, 17),
    (1, 100),
    (1, 384),
    (1, 1000),
    (1, 2048),
];
const MIXED_ROWS: &[(usize, usize)] = &[
    (37, 37),
    (1, 200),
    (0, 5),
    (128, 300),
    (1, 1),
    (0, 0),
    (64, 700),
    (3, 3),
    (200, 1100),
    (1, 33),
];
const DIFFUSION_ROWS: &[(usize, usize)] =
    &[(32, 64), (32, 96), (1, 50), (32, 200), (16, 17), (32, 600)];

fn case(
    name: &'static str,
    rows: &[(usize, usize)],
    heads: usize,
    kv: usize,
    hd: usize,
    dtype: DType,
    mask: AttnMask,
) -> Case {
    Case {
        name,
        rows: rows.to_vec(),
        heads,
        kv_heads: kv,
        hd,
        block_size: 16,
        dtype,
        mask,
    }
}

#[test]
fn decode_mha_d128() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check(case(
            "decode mha 16/16 d128",
            DECODE_ROWS,
            16,
            16,
            128,
            dt,
            AttnMask::Causal,
        ));
    }
}

#[test]
fn decode_gqa_d64() {
    for dt in [DType::F32, DType::BF16] {
        check(case(
            "decode gqa 32/8 d64",
            DECODE_ROWS,
            32,
            8,
            64,
            dt,
            AttnMask::Causal,
        ));
    }
}

#[test]
fn decode_many_rows() {
    let rows: Vec<(usize, usize)> = (0..96).map(|i| (1, 1 + (i * 37) % 700)).collect();
    for dt in [DType::F32, DType::BF16] {
        check(Case {
            rows: rows.clone(),
            ..case(
                "decode 96 rows mha d128",
                &[],
                16,
                16,
                128,
                dt,
                AttnMask::Causal,
            )
        });
    }
}

#[test]
fn prefill_mixed_causal() {
    for dt in [DType::F32, DType::BF16, DType::F16] {
        check(case(
            "mixed causal gqa 32/8 d128",
            MIXED_ROWS,
            32,
            8,
            128,
            dt,
            AttnMask::Causal,
        ));
        check(case(
            "mixed causal mha 8/8 d64",
            MIXED_ROWS,
            8,
            8,
            64,
            dt,
            AttnMask::Causal,
        ));
    }
}

#[test]
fn bidirectional() {
    for dt in [DType::F32, DType::BF16] {
        check(case(
            "diffusion bidir mha 16/16 d128",
            DIFFUSION_ROWS,
            16,
            16,
            128,
            dt,
            AttnMask::Bidirectional,
        ));
        check(case(
            "diffusion bidir gqa 32/8 d64",
            DIFFUSION_ROWS,
            32,
            8,
            64,
            dt,
            AttnMask::Bidirectional,
        ));
        check(case(
            "mixed bidir gqa 32/8 d128",
            MIXED_ROWS,
            32,
            8,
            128,
            dt,
            AttnMask::Bidirectional,
        ));
    }
}

#[test]
fn head_dim_96_and_odd_block_size() {
    check(case(
        "mixed causal gqa 12/4 d96",
        MIXED_ROWS,
        12,
        4,
        96,
        DType::F32,
        AttnMask::Causal,
    ));
    check(case(
        "mixed causal gqa 12/4 d96",
        MIXED_ROWS,
        12,
        4,
        96,
        DType::BF16,
        AttnMask::Causal,
    ));
    let c = case(
        "decode bs12 mha d128",
        DECODE_ROWS,
        8,
        8,
        128,
        DType::F32,
        AttnMask::Causal,
    );
    check(Case {
        block_size: 12,
        ..c
    });
    let c = case(
        "mixed bs12 gqa 32/8 d128",
        MIXED_ROWS,
        32,
        8,
        128,
        DType::BF16,
        AttnMask::Causal,
    );
    check(Case {
        block_size: 12,
        ..c
    });
    let c = case(
        "mixed bs32 gqa 16/2 d128",
        MIXED_ROWS,
        16,
        2,
        128,
        DType::BF16,
        AttnMask::Causal,
    );
    check(Case {
        block_size: 32,
        ..c
    });
}

#[test]
fn rejects_bad_inputs() {
    let gpu = Device::new_cuda(0).unwrap();
    let host = PagedBatchHost {
        block_tables: vec![vec![0]],
        context_lens: vec![1],
        cu_q_lens: vec![0, 1],
    };
    let batch = PagedBatch::new(host, 16, AttnMask::Causal, 4 * 80, &gpu).unwrap();
    let q = Tensor::zeros((1, 4, 80), DType::BF16, &gpu).unwrap();
    let k = Tensor::zeros((1, 16, 4, 80), DType::BF16, &gpu).unwrap();
    assert!(
        paged_attention(&q, &k, &k, &batch, 1.0).is_err(),
        "head dim 80"
    );
    let q = Tensor::zeros((1, 4, 64), DType::F32, &gpu).unwrap();
    let k = Tensor::zeros((1, 16, 4, 64), DType::BF16, &gpu).unwrap();
    assert!(
        paged_attention(&q, &k, &k, &batch, 1.0).is_err(),
        "dtype mismatch"
    );
    let q = Tensor::zeros((1, 6, 64), DType::BF16, &gpu).unwrap();
    let k = Tensor::zeros((1, 16, 4, 64), DType::BF16, &gpu).unwrap();
    assert!(
        paged_attention(&q, &k, &k, &batch, 1.0).is_err(),
        "heads not a multiple"
    );
}

/// Times one launch configuration; prints µs per call and the KV bytes read per second.
fn time_case(
    name: &str,
    rows: &[(usize, usize)],
    heads: usize,
    kv: usize,
    hd: usize,
    mask: AttnMask,
) {
    let gpu = Device::new_cuda(0).unwrap();
    let c = Case {
        name: "timing",
        rows: rows.to_vec(),
        heads,
        kv_heads: kv,
        hd,
        block_size: 16,
        dtype: DType::BF16,
        mask,
    };
    let b = build(&c, 7);
    let batch = PagedBatch::new(b.host.clone(), 16, mask, kv * hd, &gpu).unwrap();
    // NaN in unused slots is fine for timing; the kernel never reads them.
    let (q, k, v) = (
        b.q.to_device(&gpu).unwrap(),
        b.k.to_device(&gpu).unwrap(),
        b.v.to_device(&gpu).unwrap(),
    );
    let scale = 1.0 / (hd as f64).sqrt();
    for simt in [false, true] {
        let run = || with_simt(simt, || paged_attention(&q, &k, &v, &batch, scale).unwrap());
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
        let path = if simt { "simt" } else { "default" };
        println!(
            "TIMING {name:<44} {path:<7} {:>9.1} us/call  {:>7.1} GB/s KV read ({:.1} MB)",
            med * 1e6,
            kv_bytes as f64 / med / 1e9,
            kv_bytes as f64 / 1e6
        );
    }
}

#[test]
#[ignore]
fn timing() {
    for &(w, ctx) in &[
        (64usize, 384usize),
        (256, 384),
        (16, 2048),
        (64, 2048),
        (256, 2048),
        (128, 128),
    ] {
        let rows = vec![(1, ctx); w];
        time_case(
            &format!("decode bf16 W={w} ctx={ctx} H=16/16 D=128"),
            &rows,
            16,
            16,
            128,
            AttnMask::Causal,
        );
    }
    let rows = vec![(1, 1024); 64];
    time_case(
        "decode bf16 W=64 ctx=1024 H=32/8 D=128",
        &rows,
        32,
        8,
        128,
        AttnMask::Causal,
    );
    let rows = vec![(32, 512); 16];
    time_case(
        "diffusion bf16 16x(q32, ctx512) bidir 16/16 D=128",
        &rows,
        16,
        16,
        128,
        AttnMask::Bidirectional,
    );
    let rows = vec![(512, 512); 8];
    time_case(
        "prefill bf16 8x512 causal 16/16 D=128",
        &rows,
        16,
        16,
        128,
        AttnMask::Causal,
    );
    let rows = vec![(2048, 2048); 2];
    time_case(
        "prefill bf16 2x2048 causal 32/8 D=128",
        &rows,
        32,
        8,
        128,
        AttnMask::Causal,
    );
}
