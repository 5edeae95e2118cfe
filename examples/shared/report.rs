//! Helpers the quality examples share for writing their reports into `docs/QUALITY.md`.

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
