//! Checks a launch from a custom scheduler before any of it reaches the model. A malformed
//! launch — a missing block table, a position past the end of its table, a block, state row,
//! token id or readout index out of range — would otherwise index out of bounds on the host or
//! read and write outside the KV cache on the device. The built-in schedulers are covered by
//! the conformance suites and skip this.

use crate::diffusion::{DenoiseLaunch, DenoiseRow};

use crate::looped::{LoopedLaunch, LoopedRow, Stage};

/// What a launch may address (`bank_rows` is 0 for diffusion runners).
pub(crate) struct Bounds {
    pub num_blocks: usize,
    pub block_size: usize,
    /// State-bank rows available to requests (0: the runner has no bank).
    pub bank_rows: usize,
    pub vocab_size: usize,
}

/// `Err(reason)` for the first thing in `launch` the runner cannot run.
pub(crate) fn check_looped(launch: &LoopedLaunch, b: &Bounds) -> Result<(), String> {
    if launch.rows.is_empty() {
        return Err("no rows".into());
    }
    let cache_rows = b.num_blocks * b.block_size;
    if let Some(c) = launch.kv_copies.iter().find(|c| c.src as usize >= cache_rows || c.dst as usize >= cache_rows) {
        return Err(format!("K/V copy {} → {} outside the {cache_rows} cache positions", c.src, c.dst));
    }
    let full_depth = matches!(launch.stage, Stage::Prefill | Stage::FullDepthDecode);
    if full_depth && launch.step_slots.is_empty() {
        return Err(format!("a {} launch with no loop steps (`step_slots`)", launch.stage.name()));
    }
    for (i, row) in launch.rows.iter().enumerate() {
        check_looped_row(launch, row, b).map_err(|e| format!("row {i} (request {}): {e}", row.request.0))?;
    }
    Ok(())
}

fn check_looped_row(launch: &LoopedLaunch, row: &LoopedRow, b: &Bounds) -> Result<(), String> {
    check_tokens(&row.tokens, b)?;
    // Positions each table must cover: the row's tokens, and the successor's after a re-entry.
    let end = row.start_pos + row.tokens.len() + usize::from(launch.reenter && row.sample);
    let tables: &[usize] = match launch.stage {
        Stage::Prefill | Stage::FullDepthDecode => &launch.step_slots,
        Stage::CoreStep => std::slice::from_ref(&row.slot),
        Stage::Coda => &[0],
    };
    let reads_bank = launch.stage == Stage::CoreStep || launch.stage == Stage::Coda || launch.reenter;
    if reads_bank && row.state as usize >= b.bank_rows {
        return Err(format!("state row {} outside the state bank of {} rows", row.state, b.bank_rows));
    }
    if matches!(launch.stage, Stage::CoreStep | Stage::Coda) && row.tokens.len() != 1 {
        return Err(format!("{} rows carry one token, not {}", launch.stage.name(), row.tokens.len()));
    }
    for &slot in tables {
        let Some(table) = row.block_tables.get(slot) else {
            return Err(format!("no block table for slot {slot} ({} given)", row.block_tables.len()));
        };
        check_table(table, end, b).map_err(|e| format!("slot {slot}: {e}"))?;
    }
    Ok(())
}

/// Tokens present and inside the vocabulary.
fn check_tokens(tokens: &[u32], b: &Bounds) -> Result<(), String> {
    if tokens.is_empty() {
        return Err("no tokens".into());
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= b.vocab_size) {
        return Err(format!("token {t} outside the vocabulary of {}", b.vocab_size));
    }
    Ok(())
}

/// A block table that covers positions `0..end` with blocks of the pool.
fn check_table(table: &[u32], end: usize, b: &Bounds) -> Result<(), String> {
    let blocks = end.div_ceil(b.block_size);
    if table.len() < blocks {
        return Err(format!("the table covers {} positions, the row needs {end}", table.len() * b.block_size));
    }
    if let Some(&blk) = table[..blocks].iter().find(|&&blk| blk as usize >= b.num_blocks) {
        return Err(format!("block {blk} outside the pool of {} blocks", b.num_blocks));
    }
    Ok(())
}

/// The diffusion runner's counterpart: rows address cache positions through their block table
/// and read out token indices.
pub(crate) fn check_denoise(launch: &DenoiseLaunch, b: &Bounds) -> Result<(), String> {
    if launch.rows.is_empty() {
        return Err("no rows".into());
    }
    for (i, row) in launch.rows.iter().enumerate() {
        check_denoise_row(row, b).map_err(|e| format!("row {i} (request {}): {e}", row.request.0))?;
    }
    Ok(())
}

fn check_denoise_row(row: &DenoiseRow, b: &Bounds) -> Result<(), String> {
    check_tokens(&row.tokens, b)?;
    if row.positions.len() != row.tokens.len() || row.positions.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("{} positions for {} tokens, or not ascending", row.positions.len(), row.tokens.len()));
    }
    if let Some(&r) = row.readout.iter().find(|&&r| r as usize >= row.tokens.len()) {
        return Err(format!("readout index {r} past the row's {} tokens", row.tokens.len()));
    }
    check_table(&row.block_table, row.context_len(), b)
}
