//! Helpers the quality examples share: the held-out text and its windows, and writing their
//! reports into `docs/QUALITY.md`.

/// `path` relative to the crate root when it lies under it.
pub fn shown(path: &str, root: &str) -> String {
    path.strip_prefix(root).map(|p| p.trim_start_matches('/').to_string()).unwrap_or_else(|| path.to_string())
}

/// Replaces the text between the markers in `path` (markers kept); appends the marked section
/// when the file has no markers, and creates the file when it is missing.
pub fn splice(path: &str, begin: &str, end: &str, body: &str) -> std::io::Result<()> {
    let section = format!("{begin}\n{body}{end}");
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let new = match (old.find(begin), old.find(end)) {
        (Some(a), Some(b)) if a < b => format!("{}{section}{}", &old[..a], &old[b + end.len()..]),
        _ if old.trim().is_empty() => format!("# Quality\n\n{section}\n"),
        _ => format!("{}\n\n{section}\n", old.trim_end()),
    };
    std::fs::write(path, new)
}

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
