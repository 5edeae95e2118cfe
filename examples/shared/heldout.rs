//! The held-out text the looped quality examples score, and its windows.

/// The held-out text, with a hint at how to build it when it is missing.
pub fn read_heldout(path: &str) -> Result<String, Box<dyn std::error::Error>> {
    std::fs::read_to_string(path).map_err(|e| {
        format!(
            "cannot read the held-out text {path} ({e}). Build the corpus first: \
             `python3 tools/train/make_corpus.py` (writes corpus/train.txt and corpus/heldout.txt from the \
             Rust toolchain's rust-docs component), or pass --heldout FILE"
        )
        .into()
    })
}

/// `n` of the non-overlapping `len`-token windows of `ids`, evenly spaced over them (window
/// i · total / n), with their indices and the number of windows in all.
pub fn evenly_spaced_windows(ids: &[u32], len: usize, n: usize) -> (Vec<&[u32]>, Vec<usize>, usize) {
    let all: Vec<&[u32]> = ids.chunks_exact(len).collect();
    let n = n.min(all.len());
    let picked: Vec<usize> = (0..n).map(|i| i * all.len() / n).collect();
    (picked.iter().map(|&i| all[i]).collect(), picked, all.len())
}
