//! How the SIMT paged-attention kernel cuts keys into splits (decode at small widths or long
//! contexts): the host sizes the grid with it, the kernel repeats it on the actual contexts.

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
pub(crate) fn keys_per_block(max_ctx: usize, splits: usize, step: usize) -> usize {
    max_ctx.div_ceil(splits.max(1)).div_ceil(step) * step
}

/// How many of at most `max_splits` key splits to cut a longest context of `max_ctx` keys into
/// (`split_count` in `kernels/paged_attention.cu`, same arithmetic): with `base_blocks` blocks per split and
/// `wave_blocks` running at once, a launch lasts about (waves) × (keys a block walks +
/// `block_cost`, a block's fixed cost in keys), so splitting pays until a further split adds a
/// wave.
pub(crate) fn split_count(max_ctx: usize, max_splits: usize, base_blocks: usize, wave_blocks: usize, step: usize, block_cost: usize) -> usize {
    let wave_blocks = wave_blocks.max(1);
    let mut best = (usize::MAX, 1);
    for s in 1..=max_splits.max(1) {
        let chunk = keys_per_block(max_ctx, s, step);
        if s > 1 && chunk * (s - 1) >= max_ctx {
            break; // the last split would be empty
        }
        let cost = (base_blocks * s).div_ceil(wave_blocks) * (chunk + block_cost);
        if cost < best.0 {
            best = (cost, s);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_one_wave_and_stop_before_an_empty_split() {
        // 2k-token contexts, 256 (row, head) tiles, 792 blocks at once: three splits of 768 keys.
        assert_eq!(split_count(2304, 32, 256, 792, 32, 128), 3);
        assert_eq!(keys_per_block(2304, 3, 32), 768);
        // Enough tiles for several waves: no split.
        assert_eq!(split_count(300, 32, 4096, 792, 32, 128), 1);
        // 1024 tiles of 2304 keys: three splits (four waves of 768 keys) beat one (two waves of
        // 2304) and two (three waves of 1152).
        assert_eq!(split_count(2304, 32, 1024, 792, 32, 128), 3);
        // A short context never yields an empty split, whatever the wave allows.
        for ctx in 1..200 {
            let s = split_count(ctx, 32, 1, 792, 32, 128);
            assert!(keys_per_block(ctx, s, 32) * (s - 1) < ctx, "ctx {ctx}: {s} splits");
        }
        assert_eq!(keys_per_warp_step(128, 2, 1), 8);
        assert_eq!(keys_per_warp_step(128, 4, 1), 4);
        assert_eq!(keys_per_warp_step(64, 2, 8), 8);
    }
}
