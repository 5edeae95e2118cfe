//! How the SIMT paged-attention kernel cuts a row's keys into splits (decode at small widths or
//! long contexts), and which of its builds runs: the host plans the grid here; where the
//! plan leaves the cut to the kernel, the kernel repeats `split_count` on the actual contexts.
//!
//! Measured on the H200: chunks of the context bound (a
//! captured graph's bucket: the next power of two) were fastest while they stay short (≤ 256
//! keys at W 16 / 64: the full first chunks run first and the short last ones fill in), but at
//! 2k-token contexts they were long and uneven (2048 + 256 keys at W 64), and cutting the
//! actual longest context evenly took 10 % off that decode step. Where one wave of an 8-warp
//! build holds every (row, kv head) block and spreads two or more of them evenly over each SM,
//! walking each row's keys unsplit beat the split plan (Ouro-1.4B shapes: 13 % a
//! launch at W 16 and context 260, 25 % at 1024, 3 % at 2176; a CB step 3.8 % shorter at W 16):
//! no combine launch, and 8 warps walk a row's keys in half the 4-warp builds' steps. Where the
//! blocks fill most SMs once (W 5–8 of 16 heads), an 8-warp build with 6 key sets a lane walks
//! them unsplit (15–17 % a launch at context 260). Bounds past what was measured keep the split
//! plan.

use super::MAX_ATTENTION_SPLITS as MAX_SPLITS;
/// Longest chunk of the context bound the plan keeps; longer ones are cut from the actual
/// context in the kernel (measured: 256 kept its lead, 832 and 2048 lost).
const BOUND_CHUNK_MAX_KEYS: usize = 512;
/// Keys per block up to which the one-query kernel runs its build held to 7 blocks an SM
/// (72 registers on the H200, 80 for 6): faster on blocks of ≤ 260 keys, slower on ≥ 410.
const OCC7_MAX_KEYS: usize = 384;
/// Granularity of chunks of the context bound (keys).
const BOUND_CHUNK_STEP: usize = 64;

/// Least share of the SMs' block slots in use (blocks ÷ (SMs × most blocks an SM gets)) at which
/// a one-wave launch of more blocks than SMs runs an 8-warp build unsplit: below it some SMs
/// walk more rows than others (W 9 on 132 SMs: 144 blocks), and splitting balances them.
const EIGHT_WARPS_MIN_EVENNESS: f64 = 0.9;
/// Longest context bound (keys) up to which a launch runs an 8-warp build unsplit: measured in
/// the CB step up to the 2k-token prompt's bucket (4096), in the probe up to 2176 keys, where the
/// gain had shrunk to 3 %; longer bounds keep the split plan until measured.
const EIGHT_WARPS_MAX_KEYS: usize = 4096;
/// The same for the build held to four blocks an SM: measured in the step at CB prompt 128's
/// bucket (512) only; alone at 2176 keys (two blocks an SM) it was 24 % slower than the split
/// plan (it spills a few registers; the 3-an-SM build does not).
const EIGHT_WARPS_DENSE_MAX_KEYS: usize = 512;
/// Least share of the SMs a launch of at most one block an SM must fill for the deep 8-warp build
/// to walk it unsplit (measured at 80, 96 and 128 blocks on 132 SMs; fewer are left to the split
/// plan, which spreads a row's keys over the idle SMs).
const DEEP_MIN_SM_SHARE: f64 = 0.6;
/// Longest context bound (keys) up to which the deep build walks such a launch unsplit: measured
/// at context 260 (bound 512); at 8192 keys it was 32 % slower than the split plan (W 8).
const DEEP_MAX_KEYS: usize = 512;

/// Which build of the SIMT kernel runs a launch (the kernel name's suffix and its block size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SimtBuild {
    /// 4 warps a block, as many blocks an SM as registers allow (6 on the H200).
    Plain,
    /// 4 warps, held to 7 blocks an SM (one query item a block).
    SevenBlocks,
    /// 8 warps, at least 3 blocks an SM (`__launch_bounds__`; f32 at head dim 96 / 128 fits 4 on
    /// the H200), one query item a block, for unsplit one-wave launches.
    EightWarps,
    /// 8 warps held to 4 blocks an SM (a few registers spill), for unsplit one-wave launches the
    /// 3-an-SM build does not hold.
    EightWarpsDense,
    /// 8 warps of 6 key sets a lane (more K/V loads in flight a warp), held to 2 blocks an SM, for
    /// unsplit launches of at most one block an SM.
    EightWarpsDeep,
}

pub(crate) use super::policy::SimtDeep as DeepUse;

impl SimtBuild {
    /// The kernel name's suffix (`paged_attn_*_q1{suffix}`).
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            SimtBuild::Plain => "",
            SimtBuild::SevenBlocks => "_o7",
            SimtBuild::EightWarps => "_w8",
            SimtBuild::EightWarpsDense => "_w8o4",
            SimtBuild::EightWarpsDeep => "_w8k6",
        }
    }

    /// Warps a block (`NW`, or `W8_WARPS` in the .cu file).
    pub(crate) fn warps(self) -> usize {
        match self {
            SimtBuild::Plain | SimtBuild::SevenBlocks => 4,
            SimtBuild::EightWarps | SimtBuild::EightWarpsDense | SimtBuild::EightWarpsDeep => 8,
        }
    }
}

/// How one launch splits its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    /// Key splits in the grid (1: no split, no merge launch).
    pub splits: usize,
    pub cut: Cut,
    pub build: SimtBuild,
}

/// Where the split boundaries come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// One split: every block walks all its keys.
    Whole,
    /// Chunks of this many keys of the context bound.
    Chunks(usize),
    /// The kernel cuts the actual longest context, for a wave of this many blocks at once.
    InKernel { wave_blocks: usize },
}

/// The plan for a launch of `base_blocks` (row tile, kv head) blocks whose contexts are at most
/// `max_ctx` keys, on `sms` SMs; `step` = keys of one block step of the 4-warp builds;
/// `one_query` when the one-item builds exist (one query item a block); `wave(build)` = blocks
/// of that build that run at once (asked only where the plan would split); `deep` = where the
/// deep 8-warp build may run.
pub(crate) fn plan<E>(
    max_ctx: usize,
    base_blocks: usize,
    sms: usize,
    step: usize,
    one_query: bool,
    deep: DeepUse,
    wave: impl Fn(SimtBuild) -> Result<usize, E>,
) -> Result<SplitPlan, E> {
    // A graph's bound is a power of two above the contexts it serves: judge keys by ¾ of it.
    let typical = max_ctx - max_ctx / 4;
    let four_warps = |keys: usize| if one_query && keys <= OCC7_MAX_KEYS { SimtBuild::SevenBlocks } else { SimtBuild::Plain };
    let sms = sms.max(1);
    let target = 8 * sms;
    let mut splits = 1;
    if base_blocks < target && max_ctx >= 256 {
        splits = target.div_ceil(base_blocks.max(1)).min(max_ctx / BOUND_CHUNK_STEP).clamp(1, MAX_SPLITS);
    }
    if splits == 1 {
        return Ok(SplitPlan { splits: 1, cut: Cut::Whole, build: four_warps(typical) });
    }
    let whole = |build| Ok(SplitPlan { splits: 1, cut: Cut::Whole, build });
    let sm_share = base_blocks as f64 / sms as f64;
    if one_query && deep != DeepUse::Never && base_blocks <= sms && sm_share >= DEEP_MIN_SM_SHARE && max_ctx <= DEEP_MAX_KEYS {
        return whole(SimtBuild::EightWarpsDeep);
    }
    let evenness = base_blocks as f64 / (sms * base_blocks.div_ceil(sms)) as f64;
    if one_query && base_blocks > sms && evenness >= EIGHT_WARPS_MIN_EVENNESS {
        for (build, max_keys) in [(SimtBuild::EightWarps, EIGHT_WARPS_MAX_KEYS), (SimtBuild::EightWarpsDense, EIGHT_WARPS_DENSE_MAX_KEYS)] {
            if max_ctx <= max_keys && base_blocks <= wave(build)? {
                if deep == DeepUse::UpToTwoAnSm && base_blocks <= wave(SimtBuild::EightWarpsDeep)? {
                    return whole(SimtBuild::EightWarpsDeep);
                }
                return whole(build);
            }
        }
    }
    let chunk = keys_per_block(max_ctx, splits, BOUND_CHUNK_STEP);
    if chunk <= BOUND_CHUNK_MAX_KEYS {
        return Ok(SplitPlan { splits: max_ctx.div_ceil(chunk), cut: Cut::Chunks(chunk), build: four_warps(chunk.min(typical)) });
    }
    let mut wave_blocks = wave(SimtBuild::Plain)?;
    let mut splits = split_count(max_ctx, MAX_SPLITS, base_blocks, wave_blocks, step);
    let build = four_warps(keys_per_block(typical, splits, step));
    if build == SimtBuild::SevenBlocks {
        wave_blocks = wave(build)?;
        splits = split_count(max_ctx, MAX_SPLITS, base_blocks, wave_blocks, step);
    }
    let cut = if splits == 1 { Cut::Whole } else { Cut::InKernel { wave_blocks } };
    Ok(SplitPlan { splits, cut, build })
}

/// Keys one warp of the SIMT kernel walks per step (`KT` in the .cu file) for head dim `hd`,
/// element size `elem` and `nq` query items a block.
pub(crate) fn keys_per_warp_step(hd: usize, elem: usize, nq: usize) -> usize {
    let active = hd / (16 / elem);
    let lanes_per_key = match active {
        0..=4 => 4,
        5..=8 => 8,
        9..=16 => 16,
        _ => 32,
    };
    let unroll = if nq >= 8 { 2 } else { 4 };
    (32 / lanes_per_key) * unroll
}

/// Keys a block walks when `max_ctx` keys are cut into `splits` chunks of whole steps.
fn keys_per_block(max_ctx: usize, splits: usize, step: usize) -> usize {
    max_ctx.div_ceil(splits.max(1)).div_ceil(step) * step
}

/// How many of at most `max_splits` key splits to cut a longest context of `max_ctx` keys into
/// (`split_count` in `kernels/paged_attention.cu`, same arithmetic): with `base_blocks` blocks
/// per split and `wave_blocks` running at once, a launch lasts about (waves) × (keys a block
/// walks + one step of fixed cost), so splitting pays until a further split adds a wave.
fn split_count(max_ctx: usize, max_splits: usize, base_blocks: usize, wave_blocks: usize, step: usize) -> usize {
    let wave_blocks = wave_blocks.max(1);
    let mut best = (usize::MAX, 1);
    for s in 1..=max_splits.max(1) {
        let chunk = keys_per_block(max_ctx, s, step);
        if s > 1 && chunk * (s - 1) >= max_ctx {
            break; // the last split would be empty
        }
        let cost = (base_blocks * s).div_ceil(wave_blocks) * (chunk + step);
        if cost < best.0 {
            best = (cost, s);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H200's 132 SMs, 6 / 7 / 3 / 4 / 2 blocks an SM for the five builds (bf16).
    fn h200(build: SimtBuild) -> usize {
        132 * match build {
            SimtBuild::Plain => 6,
            SimtBuild::SevenBlocks => 7,
            SimtBuild::EightWarps => 3,
            SimtBuild::EightWarpsDense => 4,
            SimtBuild::EightWarpsDeep => 2,
        }
    }

    fn plan(max_ctx: usize, base_blocks: usize, sms: usize, step: usize, one_query: bool, wave: fn(SimtBuild) -> usize) -> SplitPlan {
        plan_deep(max_ctx, base_blocks, sms, step, one_query, DeepUse::OneBlockAnSm, wave)
    }

    fn plan_deep(max_ctx: usize, base_blocks: usize, sms: usize, step: usize, one_query: bool, deep: DeepUse, wave: fn(SimtBuild) -> usize) -> SplitPlan {
        super::plan(max_ctx, base_blocks, sms, step, one_query, deep, |b| Ok::<_, ()>(wave(b))).unwrap()
    }

    const WHOLE_8: SplitPlan = SplitPlan { splits: 1, cut: Cut::Whole, build: SimtBuild::EightWarps };
    const WHOLE_8_DENSE: SplitPlan = SplitPlan { splits: 1, cut: Cut::Whole, build: SimtBuild::EightWarpsDense };
    const WHOLE_8_DEEP: SplitPlan = SplitPlan { splits: 1, cut: Cut::Whole, build: SimtBuild::EightWarpsDeep };

    #[test]
    fn short_contexts_keep_chunks_of_the_bound() {
        // W 64 (1024 tiles), bucket 512: two chunks of 256, the 7-block build.
        assert_eq!(plan(512, 1024, 132, 32, true, h200), SplitPlan { splits: 2, cut: Cut::Chunks(256), build: SimtBuild::SevenBlocks });
        // W 12 (192 tiles, 73 % of two blocks an SM), bucket 256: four chunks of 64.
        assert_eq!(plan(256, 192, 132, 32, true, h200), SplitPlan { splits: 4, cut: Cut::Chunks(64), build: SimtBuild::SevenBlocks });
        // W 256: no split; ¾ of the bucket is 384 keys, still the 7-block build.
        assert_eq!(plan(512, 4096, 132, 32, true, h200), SplitPlan { splits: 1, cut: Cut::Whole, build: SimtBuild::SevenBlocks });
        // No one-item builds for several query items a block.
        assert_eq!(plan(512, 4096, 132, 32, false, h200).build, SimtBuild::Plain);
        assert_eq!(plan(256, 256, 132, 32, false, h200), SplitPlan { splits: 4, cut: Cut::Chunks(64), build: SimtBuild::Plain });
        // Below 256 keys of bound: never split, and the 4-warp builds.
        assert_eq!(plan(200, 16, 132, 32, true, h200), SplitPlan { splits: 1, cut: Cut::Whole, build: SimtBuild::SevenBlocks });
        assert_eq!(plan(128, 256, 132, 32, true, h200).build, SimtBuild::SevenBlocks);
    }

    #[test]
    fn one_even_wave_of_the_eight_warp_build_walks_rows_unsplit() {
        // W 16 / 24 (256 / 384 tiles): two / three blocks on nearly every SM, at bounds up to
        // the 2k-token prompt's bucket; past it, the split plan.
        for bound in [256, 512, 1024, 4096] {
            assert_eq!(plan(bound, 256, 132, 32, true, h200), WHOLE_8, "bound {bound}");
            assert_eq!(plan(bound, 384, 132, 32, true, h200), WHOLE_8, "bound {bound}");
        }
        for bound in [8192, 16384] {
            let p = plan(bound, 256, 132, 32, true, h200);
            assert!(p.splits > 1 && matches!(p.cut, Cut::InKernel { .. }), "bound {bound}: {p:?}");
        }
        // W 32 (512 tiles): four blocks an SM, the build held to four — at bounds up to 512.
        assert_eq!(plan(256, 512, 132, 32, true, h200), WHOLE_8_DENSE);
        assert_eq!(plan(512, 512, 132, 32, true, h200), WHOLE_8_DENSE);
        assert!(plan(1024, 512, 132, 32, true, h200).splits > 1);
        // Uneven (W 9: 12 SMs would walk two rows, 120 one) or past one wave (W 48): split.
        for tiles in [144, 768] {
            let p = plan(512, tiles, 132, 32, true, h200);
            assert!(p.splits > 1 && p.build == SimtBuild::SevenBlocks, "{tiles}: {p:?}");
        }
        // Several query items a block (GQA): never.
        assert_eq!(plan(512, 256, 132, 32, false, h200).build, SimtBuild::Plain);
    }

    #[test]
    fn one_block_an_sm_on_most_sms_runs_the_deep_build_unsplit() {
        // W 5 / 6 / 8 of 16 heads (80 / 96 / 128 tiles, measured) and 132 tiles, bounds ≤ 512.
        for tiles in [80, 96, 128, 132] {
            for bound in [256, 512] {
                assert_eq!(plan(bound, tiles, 132, 32, true, h200), WHOLE_8_DEEP, "{tiles} tiles, bound {bound}");
            }
            // Longer bounds (8192 keys at W 8: 32 % slower unsplit), GQA and the switch: split.
            for p in
                [plan(1024, tiles, 132, 32, true, h200), plan(512, tiles, 132, 32, false, h200), plan_deep(512, tiles, 132, 32, true, DeepUse::Never, h200)]
            {
                assert!(p.splits > 1 && p.build != SimtBuild::EightWarpsDeep, "{tiles}: {p:?}");
            }
        }
        // Under 60 % of the SMs (W 4: 64 tiles) the split plan spreads rows over the idle SMs.
        assert!(plan(512, 64, 132, 32, true, h200).splits > 1);
        // Bounds below 256 keys never split, so never take it.
        assert_eq!(plan(200, 128, 132, 32, true, h200).build, SimtBuild::SevenBlocks);
        // The switch's wide use: where an 8-warp build would run and two blocks an SM hold it.
        assert_eq!(plan_deep(512, 256, 132, 32, true, DeepUse::UpToTwoAnSm, h200), WHOLE_8_DEEP);
        assert_eq!(plan_deep(4096, 256, 132, 32, true, DeepUse::UpToTwoAnSm, h200), WHOLE_8_DEEP);
        assert_eq!(plan_deep(512, 384, 132, 32, true, DeepUse::UpToTwoAnSm, h200), WHOLE_8);
        assert_eq!(plan_deep(512, 256, 132, 32, true, DeepUse::Never, h200), WHOLE_8);
    }

    #[test]
    fn builds_name_kernels_and_block_sizes_the_cu_file_defines() {
        let cu = include_str!("kernels/paged_attention.cu");
        // The one-item builds' table: each build's suffix under launch bounds of its warps, with
        // the warps (and key sets) it passes to the kernel.
        let table = &cu[cu.find("#define PA_Q1_BUILDS(BUILD, NAME, T, D)").expect("the builds' table")..];
        let table = &table[..table.find("\n\n").unwrap()];
        for (build, bounds, warps, key_sets) in [
            (SimtBuild::Plain, "__launch_bounds__(NTHREADS)", "NW", "0"),
            (SimtBuild::SevenBlocks, "__launch_bounds__(NTHREADS, 7)", "NW", "0"),
            (SimtBuild::EightWarps, "__launch_bounds__(W8_WARPS * 32, 3)", "W8_WARPS", "0"),
            (SimtBuild::EightWarpsDense, "__launch_bounds__(W8_WARPS * 32, 4)", "W8_WARPS", "0"),
            (SimtBuild::EightWarpsDeep, "__launch_bounds__(W8_WARPS * 32, 2)", "W8_WARPS", "W8K6_KEY_SETS"),
        ] {
            let row = format!("BUILD(NAME, T, D, {}, {bounds}, {warps}, {key_sets})", build.suffix());
            assert!(table.contains(&row), "{build:?}: no `{row}` in the builds' table");
        }
        assert_eq!(table.matches("BUILD(NAME").count(), 5, "a build the plan does not know");
        // Both forms of every build, named as the launcher names them.
        assert!(cu.contains("paged_attn_##NAME##_d##D##_q1##SUF(PA_ARGS(T))"));
        assert!(cu.contains("paged_attn_rope_##NAME##_d##D##_q1##SUF(PA_ROPE_ARGS(T))"));
        assert!(cu.contains("PA_Q1_BUILDS(PA_Q1_PLAIN, NAME, T, D)"));
        for d in [64, 96, 128] {
            assert!(cu.contains(&format!("PA_Q1_BUILDS(PA_Q1_ROPE, NAME, T, {d})")));
        }
        assert!(cu.contains("#define NW 4\n") && SimtBuild::Plain.warps() == 4);
        assert_eq!(SimtBuild::SevenBlocks.warps(), SimtBuild::Plain.warps());
        assert!(cu.contains("#define W8_WARPS 8\n") && SimtBuild::EightWarps.warps() == 8);
        assert_eq!(SimtBuild::EightWarpsDense.warps(), SimtBuild::EightWarps.warps());
        assert_eq!(SimtBuild::EightWarpsDeep.warps(), SimtBuild::EightWarps.warps());
        assert!(cu.contains("#define W8K6_KEY_SETS 6\n") && SimtBuild::EightWarpsDeep.suffix() == "_w8k6");
    }

    #[test]
    fn long_contexts_are_cut_in_the_kernel() {
        // 2k prompts, bucket 4096: chunks of the bound would be 704 (W 12) and 2048 (W 64) keys.
        let w12 = plan(4096, 192, 132, 32, true, h200);
        assert_eq!((w12.cut, w12.build), (Cut::InKernel { wave_blocks: h200(SimtBuild::Plain) }, SimtBuild::Plain));
        assert!(w12.splits >= 3, "{w12:?}");
        let w64 = plan(4096, 1024, 132, 32, true, h200);
        assert!(matches!(w64.cut, Cut::InKernel { .. }), "{w64:?}");
        assert!(w64.splits >= 3, "{w64:?}");
        // What the kernel does with the actual longest context (2304 keys).
        assert_eq!(split_count(2304, w12.splits, 192, h200(SimtBuild::Plain), 32), 4);
        assert_eq!(split_count(2304, w64.splits, 1024, h200(SimtBuild::Plain), 32), 3);
        // Short actual contexts under that bucket use fewer splits than the grid holds.
        assert!(split_count(300, w64.splits, 1024, h200(SimtBuild::Plain), 32) < w64.splits);
    }

    #[test]
    fn splits_fill_waves_and_stop_before_an_empty_split() {
        assert_eq!(split_count(2304, 32, 256, 792, 32), 3);
        assert_eq!(keys_per_block(2304, 3, 32), 768);
        assert_eq!(split_count(300, 32, 4096, 792, 32), 1);
        for ctx in 1..200 {
            let s = split_count(ctx, 32, 1, 792, 32);
            assert!(keys_per_block(ctx, s, 32) * (s - 1) < ctx, "ctx {ctx}: {s} splits");
        }
        assert_eq!(keys_per_warp_step(128, 2, 1), 8);
        assert_eq!(keys_per_warp_step(128, 4, 1), 4);
        assert_eq!(keys_per_warp_step(64, 2, 8), 8);
    }

    /// Whatever the launch, a plan covers every key of the bound with no empty split, runs an
    /// 8-warp build only unsplit on one-query launches of a wave it fits, and gives the kernel a
    /// wave to cut for only where it splits.
    #[test]
    fn every_plan_covers_the_keys_and_fits_its_build() {
        for sms in [1, 16, 78, 132] {
            let fits = |b: SimtBuild| sms * h200(b) / 132;
            for base in (1..=5 * sms).step_by(sms.div_ceil(40)) {
                for max_ctx in [1, 100, 255, 256, 300, 512, 513, 1000, 4096, 4097, 9000] {
                    for one_query in [true, false] {
                        for deep in [DeepUse::Never, DeepUse::OneBlockAnSm, DeepUse::UpToTwoAnSm] {
                            let p = super::plan(max_ctx, base, sms, 32, one_query, deep, |b| Ok::<_, ()>(fits(b))).unwrap();
                            let at = format!("{sms} SMs, {base} blocks, bound {max_ctx}, one query {one_query}, {deep:?}: {p:?}");
                            assert!(p.splits >= 1 && p.splits <= MAX_SPLITS, "{at}");
                            match p.cut {
                                Cut::Whole => assert_eq!(p.splits, 1, "{at}"),
                                Cut::Chunks(c) => assert!(c * p.splits >= max_ctx && c * (p.splits - 1) < max_ctx, "{at}"),
                                Cut::InKernel { wave_blocks } => assert!(p.splits > 1 && wave_blocks >= 1, "{at}"),
                            }
                            if p.build.warps() == 8 {
                                assert!(one_query && p.splits == 1 && base <= fits(p.build), "{at}");
                            }
                            if !one_query {
                                assert_eq!(p.build, SimtBuild::Plain, "{at}");
                            }
                            if p.build == SimtBuild::EightWarpsDeep {
                                assert!(deep != DeepUse::Never && (base <= sms || deep == DeepUse::UpToTwoAnSm), "{at}");
                            }
                        }
                    }
                }
            }
        }
    }
}
