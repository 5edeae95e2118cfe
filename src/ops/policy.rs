//! Which kernels a launch runs, chosen per engine ([`crate::EngineBuilder::kernels`]), and how
//! many launches each choice took.
//!
//! The ops the models are written with take tensors, not an engine, so the engine puts its
//! [`KernelPolicy`] in force on the thread that runs its launch ([`with_kernels`]) and the ops
//! read it there ([`current`]); the kernels they dispatch are counted on the same thread and
//! handed back with the result. Two engines, or two tests, on two threads never see each
//! other's choices or counts. Outside any [`with_kernels`] the defaults apply. The defaults are
//! the fastest measured on the H100 / H200; the other settings exist for A/B runs and for the
//! device tests, which check each path against the CPU reference.

use std::cell::Cell;

/// Which paged-attention kernels run a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernels {
    /// SIMT kernels for few query items per row; tensor-core kernels with pipelined tile loads
    /// (cp.async double buffering) for many, in bf16 / f16; decode launches wide enough for the
    /// bulk-copy ring kernel (see [`crate::kernels::DecodeRing`]) through it.
    #[default]
    Auto,
    /// As `Auto`, with the tensor-core kernels loading tiles synchronously and no ring.
    Unpipelined,
    /// SIMT kernels only.
    Simt,
    /// As `Auto`, with every decode launch the bulk-copy ring kernel takes through it, whatever
    /// its width: one query a row, head dim 128, bf16 / f16, at most 16 heads, a block size that
    /// is a multiple of 4, not so large a GQA group that the tensor-core kernel takes the launch,
    /// on sm_90 builds and devices.
    DecodeRing,
}

/// When [`AttentionKernels::Auto`] sends a decode launch through the bulk-copy ring kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeRing {
    /// From 64 rows on; with `qkv_rope_write` folded in from 32, except 32-row launches under a
    /// context bound of at most 512 keys, which the SIMT kernel's fold keeps (faster there on
    /// the H200).
    #[default]
    ByWidth,
    /// Never.
    Never,
    /// At every width (as [`AttentionKernels::DecodeRing`]).
    Always,
}

/// Where the SIMT decode kernel's deep 8-warp build (6 key sets a lane, 2 blocks an SM) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SimtDeep {
    /// Never.
    Never,
    /// Unsplit launches of at most one block an SM that fill at least 60 % of the SMs under
    /// bounds up to 512 keys.
    #[default]
    OneBlockAnSm,
    /// Also in place of the other 8-warp builds wherever two blocks an SM hold the launch.
    UpToTwoAnSm,
}

/// How decode projections that feed a norm are cut over k (`ops::split_k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitK {
    /// As many slices as make the output tiles cover the SMs (at most 4), up to 64 rows (the
    /// FP8 plan: up to 16).
    #[default]
    Planned,
    /// Up to `slices` slices (0 or 1: never split) up to `max_rows` rows.
    Forced { slices: usize, max_rows: usize },
}

/// Which MoE GEMM kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeKernels {
    /// Hopper's persistent warpgroup-MMA kernels where the device and the build have them
    /// (sm_90a): 128-row expert tiles and the router's logits; `mma.sync` kernels elsewhere.
    #[default]
    Auto,
    /// The `mma.sync` kernels other GPUs run, on every device: how a Hopper card checks the path
    /// that Ampere and Ada users get.
    MmaSync,
}

/// How FP8 linear layers multiply. The choice also sets the numerics: under [`Fp8Kernels::W8A8`]
/// and [`Fp8Kernels::ByShape`]'s many-row launches the activations are quantized too, and the
/// CPU computes that quantization as well (quantize, dequantize, f32 matmul: the reference the
/// device's FP8 GEMM is checked against), so a policy gives the same tokens on either device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Kernels {
    /// Dequantize the weight to the activations' dtype and run the dense matmul (the reference
    /// path; the default until the kernels are measured on the device).
    #[default]
    Dequantize,
    /// The weight-only kernel for launches of at most [`KernelPolicy::fp8_weight_only_rows`]
    /// rows (decode), reading a byte a weight; dequantize elsewhere.
    WeightOnly,
    /// Every launch W8A8: each row of the activations quantized to E4M3 with its own scale,
    /// multiplied on the FP8 tensor cores (cuBLASLt), both scales applied in the epilogue.
    W8A8,
    /// Weight-only up to [`KernelPolicy::fp8_weight_only_rows`] rows, where the bytes are the
    /// cost; W8A8 above, where the tensor cores' FP8 peak is.
    ByShape,
}

/// Most rows a weight-only FP8 launch can take: the tensor-core kernel's four m16 tiles
/// (`FP8_MMA_MAX_ROWS` in `kernels/fp8.cu`; the SIMT kernel takes 16).
pub const FP8_WEIGHT_ONLY_MAX_ROWS: usize = 64;

/// [`KernelPolicy::fp8_weight_only_rows`]' default: where by-shape changes to W8A8. Measured on
/// the H100 in Ouro-1.4B decode: weight-only 1.06× W8A8 at 32 rows, W8A8 1.21× weight-only at 64
/// (`docs/bench/fp8/h100_weight_only_rows_ab_47aa5b1.json`).
pub const FP8_WEIGHT_ONLY_ROWS: usize = 32;

/// The kernel choices of one engine. `KernelPolicy::default()` is what serving should use; the
/// rest is for measuring one choice against another and for the device tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelPolicy {
    pub attention: AttentionKernels,
    pub decode_ring: DecodeRing,
    /// Fold `qkv_rope_write` into the one-query SIMT decode kernel (MHA, bf16 / f16).
    pub fold_simt: bool,
    pub simt_deep: SimtDeep,
    pub split_k: SplitK,
    pub moe: MoeKernels,
    pub fp8: Fp8Kernels,
    /// Weight-only FP8 launches in bf16 / f16 on the tensor cores (`mma.sync`); off: the SIMT
    /// kernel, one warp an output column (f32 launches always take it).
    pub fp8_mma: bool,
    /// The tensor-core weight-only kernel with each warp's weights streamed through shared
    /// memory, several chunks in flight while it multiplies (`fp8_linear_mma_pipe_*`; string
    /// `fp8-pipe=on|off`). Off: 1.00–1.03× the plain kernel's CB decode step at W 1–64 on an
    /// H100 (`docs/bench/fp8/h100_pipe_ab_e0fa080.json`), so loads in flight are not what
    /// bounds it.
    pub fp8_pipeline: bool,
    /// Most rows a launch runs weight-only under `Fp8Kernels::WeightOnly` and
    /// `Fp8Kernels::ByShape` (1 ..= 64, the kernel's most; string `fp8-rows=N`). Above
    /// it `ByShape` runs W8A8 and `WeightOnly` dequantizes. The SIMT kernel takes at most 16
    /// rows; a wider launch that cannot take the tensor-core kernel dequantizes, with the same
    /// numerics as weight-only. 32 by default (`FP8_WEIGHT_ONLY_ROWS`: measured).
    pub fp8_weight_only_rows: usize,
    /// How weight-only FP8 projections that feed a norm are cut over k (`ops::split_k`'s
    /// partials, each slice a grid row of the tensor-core kernel; string
    /// `fp8-split-k=planned|S|S:R`, `1` never). `Planned` (the default) cuts launches of up to
    /// 16 rows so that the kernel's 16-column blocks fill every SM twice: Ouro-1.4B's
    /// 2048-column o_proj and down in 2 slices on 132 SMs, where the whole product runs one
    /// block an SM; the H200's CB step with FP8 weight-only 1.04× / 1.05× at W 1 / 16
    /// (`docs/bench/fp8/h200_split_k_39be911.json`).
    pub fp8_split_k: SplitK,
    /// Run the looped models' decode core steps on a preallocated arena (`ops::into`): every
    /// activation in a buffer sized when the engine is built, so a captured decode graph holds
    /// kernels and cuBLAS calls only, no memory nodes (string `arena=on|off`; default off until
    /// it is measured faster on the device). Layers the arena body does not cover (FP8 or
    /// biased weights, tensor-parallel ranks) run the plain body.
    pub decode_arena: bool,
}

impl Default for KernelPolicy {
    fn default() -> Self {
        Self {
            attention: AttentionKernels::Auto,
            decode_ring: DecodeRing::ByWidth,
            fold_simt: true,
            simt_deep: SimtDeep::OneBlockAnSm,
            split_k: SplitK::Planned,
            moe: MoeKernels::Auto,
            fp8: Fp8Kernels::Dequantize,
            fp8_mma: true,
            fp8_pipeline: false,
            fp8_weight_only_rows: FP8_WEIGHT_ONLY_ROWS,
            fp8_split_k: SplitK::Planned,
            decode_arena: false,
        }
    }
}

impl KernelPolicy {
    /// Whether a launch of `rows` rows runs the FP8 weight-only kernel (where it serves the
    /// shape).
    pub fn fp8_weight_only(&self, rows: usize) -> bool {
        matches!(self.fp8, Fp8Kernels::WeightOnly | Fp8Kernels::ByShape) && rows <= self.fp8_weight_only_rows
    }

    /// Whether a launch of `rows` rows through FP8 weights quantizes its activations (W8A8), on
    /// every device.
    pub fn fp8_quantizes_activations(&self, rows: usize) -> bool {
        match self.fp8 {
            Fp8Kernels::W8A8 => true,
            Fp8Kernels::ByShape => rows > self.fp8_weight_only_rows,
            Fp8Kernels::Dequantize | Fp8Kernels::WeightOnly => false,
        }
    }
}

/// Most slices [`SplitK::Forced`] may ask for.
pub const MAX_FORCED_SPLITS: usize = 64;

impl std::str::FromStr for KernelPolicy {
    type Err = crate::Error;

    /// Parses `key=value` pairs separated by commas over the defaults, as benchmark and server
    /// flags take them: `attention=auto|unpipelined|simt|ring`, `ring=by-width|never|always`,
    /// `fold-simt=on|off`, `simt-deep=never|one|two`, `split-k=planned|S|S:R` (up to S slices up
    /// to R rows, 64 by default), `moe=auto|mma-sync`, `fp8=dequantize|weight-only|w8a8|by-shape`,
    /// `fp8-mma=on|off`, `fp8-pipe=on|off`, `fp8-rows=N` (1 ..= 64), `fp8-split-k=planned|S|S:R`,
    /// `arena=on|off`. An empty string is the default.
    fn from_str(s: &str) -> crate::Result<Self> {
        let mut p = Self::default();
        let bad = |what: String| crate::Error::InvalidOption(format!("kernel policy: {what}"));
        for pair in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| bad(format!("`{pair}` is not key=value")))?;
            let unknown = || bad(format!("unknown value `{value}` for `{key}`"));
            match key.trim() {
                "attention" => {
                    p.attention = match value {
                        "auto" => AttentionKernels::Auto,
                        "unpipelined" => AttentionKernels::Unpipelined,
                        "simt" => AttentionKernels::Simt,
                        "ring" => AttentionKernels::DecodeRing,
                        _ => return Err(unknown()),
                    }
                }
                "ring" => {
                    p.decode_ring = match value {
                        "by-width" => DecodeRing::ByWidth,
                        "never" => DecodeRing::Never,
                        "always" => DecodeRing::Always,
                        _ => return Err(unknown()),
                    }
                }
                "fold-simt" => {
                    p.fold_simt = match value {
                        "on" => true,
                        "off" => false,
                        _ => return Err(unknown()),
                    }
                }
                "simt-deep" => {
                    p.simt_deep = match value {
                        "never" => SimtDeep::Never,
                        "one" => SimtDeep::OneBlockAnSm,
                        "two" => SimtDeep::UpToTwoAnSm,
                        _ => return Err(unknown()),
                    }
                }
                "split-k" => p.split_k = split_k(key, value)?,
                "fp8-split-k" => p.fp8_split_k = split_k(key, value)?,
                "moe" => {
                    p.moe = match value {
                        "auto" => MoeKernels::Auto,
                        "mma-sync" => MoeKernels::MmaSync,
                        _ => return Err(unknown()),
                    }
                }
                "fp8" => {
                    p.fp8 = match value {
                        "dequantize" => Fp8Kernels::Dequantize,
                        "weight-only" => Fp8Kernels::WeightOnly,
                        "w8a8" => Fp8Kernels::W8A8,
                        "by-shape" => Fp8Kernels::ByShape,
                        _ => return Err(unknown()),
                    }
                }
                "arena" => {
                    p.decode_arena = match value {
                        "on" => true,
                        "off" => false,
                        _ => return Err(unknown()),
                    }
                }
                "fp8-rows" => {
                    let rows: usize = value.trim().parse().map_err(|_| unknown())?;
                    if !(1..=FP8_WEIGHT_ONLY_MAX_ROWS).contains(&rows) {
                        return Err(bad(format!("fp8-rows={rows}: the weight-only kernel takes 1 ..= {FP8_WEIGHT_ONLY_MAX_ROWS} rows")));
                    }
                    p.fp8_weight_only_rows = rows;
                }
                "fp8-mma" => {
                    p.fp8_mma = match value {
                        "on" => true,
                        "off" => false,
                        _ => return Err(unknown()),
                    }
                }
                "fp8-pipe" => {
                    p.fp8_pipeline = match value {
                        "on" => true,
                        "off" => false,
                        _ => return Err(unknown()),
                    }
                }
                other => return Err(bad(format!("unknown key `{other}`"))),
            }
        }
        Ok(p)
    }
}

/// A `split-k` value: `planned`, or `S` / `S:R` (up to S slices up to R rows, 64 by default).
fn split_k(key: &str, value: &str) -> crate::Result<SplitK> {
    if value == "planned" {
        return Ok(SplitK::Planned);
    }
    let bad = |what: String| crate::Error::InvalidOption(format!("kernel policy: {what}"));
    let (s, r) = value.split_once(':').unwrap_or((value, "64"));
    let (Ok(slices), Ok(max_rows)) = (s.trim().parse::<usize>(), r.trim().parse::<usize>()) else {
        return Err(bad(format!("unknown value `{value}` for `{key}`")));
    };
    if slices > MAX_FORCED_SPLITS {
        return Err(bad(format!("{key} asks for {slices} slices; at most {MAX_FORCED_SPLITS}")));
    }
    Ok(SplitK::Forced { slices, max_rows })
}

/// How many host-side dispatches (eager launches and CUDA-graph captures; a replayed graph
/// dispatches nothing) chose each kernel that a policy steers. The device tests read them to
/// check that a path really ran; the engine adds them to its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelCounts {
    /// Paged-attention launches through the bulk-copy decode ring.
    pub decode_ring: u64,
    /// Of those, the ones with `qkv_rope_write` folded in.
    pub decode_ring_rope: u64,
    /// Decode launches of the one-query SIMT kernel with `qkv_rope_write` folded in.
    pub simt_rope: u64,
    /// Decode launches of one of the SIMT kernel's 8-warp builds (rows unsplit).
    pub simt_eight_warp: u64,
    /// Of those, the deep build's.
    pub simt_deep: u64,
    /// FP8 linear layers through the weight-only kernel.
    pub fp8_weight_only: u64,
    /// Of those, the ones through its pipelined tensor-core form.
    pub fp8_weight_only_pipelined: u64,
    /// Of those, the ones cut over k (`KernelPolicy::fp8_split_k`).
    pub fp8_split_k: u64,
    /// FP8 linear layers through the W8A8 GEMM (cuBLASLt on the FP8 tensor cores).
    pub fp8_w8a8: u64,
    /// Looped core steps run on the decode arena.
    pub arena_steps: u64,
}

impl std::ops::AddAssign for KernelCounts {
    fn add_assign(&mut self, o: Self) {
        self.decode_ring += o.decode_ring;
        self.decode_ring_rope += o.decode_ring_rope;
        self.simt_rope += o.simt_rope;
        self.simt_eight_warp += o.simt_eight_warp;
        self.simt_deep += o.simt_deep;
        self.fp8_weight_only += o.fp8_weight_only;
        self.fp8_weight_only_pipelined += o.fp8_weight_only_pipelined;
        self.fp8_split_k += o.fp8_split_k;
        self.fp8_w8a8 += o.fp8_w8a8;
        self.arena_steps += o.arena_steps;
    }
}

thread_local! {
    static POLICY: Cell<KernelPolicy> = Cell::new(KernelPolicy::default());
    static COUNTS: Cell<KernelCounts> = Cell::new(KernelCounts::default());
}

/// Runs `f` with `policy` in force on this thread; returns its result and the dispatches it
/// made. Nests: the outer policy and counts are back in force afterwards (the inner dispatches
/// are counted in the outer counts too), even if `f` panics.
pub fn with_kernels<R>(policy: KernelPolicy, f: impl FnOnce() -> R) -> (R, KernelCounts) {
    struct Restore(KernelPolicy, KernelCounts);
    impl Drop for Restore {
        fn drop(&mut self) {
            let inner = COUNTS.with(Cell::get);
            let mut outer = self.1;
            outer += inner;
            POLICY.with(|p| p.set(self.0));
            COUNTS.with(|c| c.set(outer));
        }
    }
    let restore = Restore(POLICY.with(|p| p.replace(policy)), COUNTS.with(|c| c.replace(KernelCounts::default())));
    let out = f();
    let counts = COUNTS.with(Cell::get);
    drop(restore);
    (out, counts)
}

/// The policy in force on this thread.
pub fn current() -> KernelPolicy {
    POLICY.with(Cell::get)
}

/// Counts one dispatch on this thread.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn count(f: impl FnOnce(&mut KernelCounts)) {
    COUNTS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_from_flags_and_refuse_what_they_do_not_know() {
        assert_eq!("".parse::<KernelPolicy>().unwrap(), KernelPolicy::default());
        let p: KernelPolicy =
            "attention=simt, ring=never,fold-simt=off,simt-deep=two,split-k=2:16,moe=mma-sync,fp8=weight-only,fp8-mma=off,fp8-pipe=on,fp8-rows=48,fp8-split-k=1,arena=on"
                .parse()
                .unwrap();
        assert_eq!(
            p,
            KernelPolicy {
                attention: AttentionKernels::Simt,
                decode_ring: DecodeRing::Never,
                fold_simt: false,
                simt_deep: SimtDeep::UpToTwoAnSm,
                split_k: SplitK::Forced { slices: 2, max_rows: 16 },
                moe: MoeKernels::MmaSync,
                fp8: Fp8Kernels::WeightOnly,
                fp8_mma: false,
                fp8_pipeline: true,
                fp8_weight_only_rows: 48,
                fp8_split_k: SplitK::Forced { slices: 1, max_rows: 64 },
                decode_arena: true,
            }
        );
        assert_eq!("fp8-split-k=4:16".parse::<KernelPolicy>().unwrap().fp8_split_k, SplitK::Forced { slices: 4, max_rows: 16 });
        assert!("fp8-split-k=65".parse::<KernelPolicy>().is_err() && "fp8-split-k=x".parse::<KernelPolicy>().is_err());
        assert_eq!("split-k=4".parse::<KernelPolicy>().unwrap().split_k, SplitK::Forced { slices: 4, max_rows: 64 });
        assert_eq!("fp8=w8a8".parse::<KernelPolicy>().unwrap().fp8, Fp8Kernels::W8A8);
        assert_eq!("fp8=by-shape".parse::<KernelPolicy>().unwrap().fp8, Fp8Kernels::ByShape);
        // Where a launch changes from weight-only to W8A8 under by-shape: the policy's row limit.
        let wide: KernelPolicy = "fp8=by-shape,fp8-rows=64".parse().unwrap();
        assert!(wide.fp8_weight_only(64) && !wide.fp8_quantizes_activations(64) && wide.fp8_quantizes_activations(65));
        let default = KernelPolicy { fp8: Fp8Kernels::ByShape, ..KernelPolicy::default() };
        assert!(default.fp8_weight_only(32) && default.fp8_quantizes_activations(33) && !default.fp8_weight_only(33));
        for bad in [
            "ring",
            "ring=sometimes",
            "fp8=int4",
            "colour=red",
            "split-k=65",
            "split-k=x:3",
            "fold-simt=yes",
            "fp8-mma=yes",
            "arena=1",
            "fp8-rows=0",
            "fp8-rows=65",
            "fp8-rows=x",
        ] {
            assert!(matches!(bad.parse::<KernelPolicy>(), Err(crate::Error::InvalidOption(_))), "{bad}");
        }
    }

    #[test]
    fn a_policy_is_in_force_only_inside_its_scope_and_on_its_thread() {
        let simt = KernelPolicy { attention: AttentionKernels::Simt, ..KernelPolicy::default() };
        let ring = KernelPolicy { attention: AttentionKernels::DecodeRing, ..KernelPolicy::default() };
        let ((inner, other_thread), outer_counts) = with_kernels(simt, || {
            count(|c| c.decode_ring += 1);
            let (seen, inner_counts) = with_kernels(ring, || {
                count(|c| c.simt_rope += 2);
                current().attention
            });
            assert_eq!(inner_counts, KernelCounts { simt_rope: 2, ..Default::default() });
            assert_eq!(current().attention, AttentionKernels::Simt, "the outer policy is back");
            (seen, std::thread::spawn(|| current().attention).join().unwrap())
        });
        assert_eq!(inner, AttentionKernels::DecodeRing);
        assert_eq!(other_thread, AttentionKernels::Auto, "another thread keeps the default");
        assert_eq!(outer_counts, KernelCounts { decode_ring: 1, simt_rope: 2, ..Default::default() });
        assert_eq!(current(), KernelPolicy::default());
        let caught = std::panic::catch_unwind(|| with_kernels(simt, || panic!("inside")));
        assert!(caught.is_err());
        assert_eq!(current(), KernelPolicy::default(), "restored after a panic");
    }
}
