//! One request's current block: its tokens, which are still masked, and — with the delayed
//! cache — which are frozen (their K/V kept from an earlier step instead of recomputed).

/// The block being denoised. Offsets are relative to `start`, the block's first absolute position
/// (a multiple of the block length). The prompt's last partial block is the first block, its
/// prompt positions unmasked from the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCanvas {
    start: usize,
    tokens: Vec<u32>,
    masked: Vec<bool>,
    frozen: Vec<bool>,
    /// The step (1-based) that revealed each position; 0 for positions given at the start.
    revealed_at: Vec<u32>,
    steps: usize,
    delayed: bool,
}

impl BlockCanvas {
    /// A block of `len` positions from `start`; the first `fixed.len()` hold known tokens, the
    /// rest `mask_id`.
    pub fn new(start: usize, len: usize, fixed: &[u32], mask_id: u32, delayed_cache: bool) -> Self {
        assert!(fixed.len() < len, "a block with no masked position is not decoded");
        let mut tokens = vec![mask_id; len];
        tokens[..fixed.len()].copy_from_slice(fixed);
        let masked = (0..len).map(|i| i >= fixed.len()).collect();
        Self { start, tokens, masked, frozen: vec![false; len], revealed_at: vec![0; len], steps: 0, delayed: delayed_cache }
    }

    pub fn start(&self) -> usize {
        self.start
    }
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    /// One past the block's last absolute position.
    pub fn end(&self) -> usize {
        self.start + self.len()
    }
    /// Denoising steps run on this block so far.
    pub fn steps(&self) -> usize {
        self.steps
    }
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// The step (1-based) that revealed `offset`; 0 if it was given (prompt) or is masked.
    pub fn revealed_at(&self, offset: usize) -> u32 {
        self.revealed_at[offset]
    }
    pub fn is_masked(&self, offset: usize) -> bool {
        self.masked[offset]
    }
    pub fn num_masked(&self) -> usize {
        self.masked.iter().filter(|&&m| m).count()
    }
    /// Masked positions before the first step (the block minus its prompt tokens).
    pub fn initially_masked(&self) -> usize {
        self.revealed_at.iter().zip(&self.masked).filter(|&(&at, &m)| m || at > 0).count()
    }
    pub fn is_done(&self) -> bool {
        self.num_masked() == 0
    }
    /// Offsets still masked, ascending.
    pub fn masked_offsets(&self) -> Vec<usize> {
        (0..self.len()).filter(|&i| self.masked[i]).collect()
    }

    /// Offsets this step recomputes, ascending: every position on the block's first step or
    /// without the delayed cache, otherwise the unfrozen ones (never empty while a mask is left,
    /// since masked positions are never frozen).
    pub fn processing(&self) -> Vec<usize> {
        (0..self.len()).filter(|&i| self.steps == 0 || !self.delayed || !self.frozen[i]).collect()
    }

    /// Applies one step's reveals `(offset, token)` and advances the delayed cache. Freezing
    /// reads the mask from *before* this step: a token is recomputed once with its real id the
    /// step after it is revealed, and frozen once its right neighbour (or the block end) is
    /// unmasked too.
    pub fn reveal(&mut self, reveals: &[(usize, u32)]) {
        let before = self.masked.clone();
        for &(o, t) in reveals {
            debug_assert!(self.masked[o], "offset {o} revealed twice");
            self.tokens[o] = t;
            self.masked[o] = false;
            self.revealed_at[o] = self.steps as u32 + 1;
        }
        if self.delayed {
            let n = self.len();
            for i in 0..n {
                if !before[i] && (i + 1 == n || !before[i + 1]) {
                    self.frozen[i] = true;
                }
            }
        }
        self.steps += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delayed_cache_freezes_a_token_after_its_right_neighbour() {
        let mut c = BlockCanvas::new(8, 4, &[5], 99, true);
        assert_eq!(c.processing(), vec![0, 1, 2, 3], "first step is a warm-up over the whole block");
        c.reveal(&[(2, 7)]);
        // Before this step only offset 0 was unmasked and its right neighbour (1) was masked.
        assert_eq!(c.processing(), vec![0, 1, 2, 3]);
        c.reveal(&[(1, 6)]);
        // Before: 0 and 2 unmasked; 1, 3 masked → nothing has an unmasked right neighbour.
        assert_eq!(c.processing(), vec![0, 1, 2, 3]);
        c.reveal(&[(3, 8)]);
        // Before: 0, 1, 2 unmasked, 3 masked → 0 (right 1) and 1 (right 2) freeze.
        assert_eq!(c.processing(), vec![2, 3]);
        assert!(c.is_done());
        assert_eq!(c.tokens(), &[5, 6, 7, 8]);
        assert_eq!(c.end(), 12);
    }

    #[test]
    fn without_delayed_cache_every_step_recomputes_the_block() {
        let mut c = BlockCanvas::new(0, 4, &[], 99, false);
        c.reveal(&[(0, 1), (1, 2)]);
        c.reveal(&[(2, 3)]);
        assert_eq!(c.processing(), vec![0, 1, 2, 3]);
        assert_eq!(c.masked_offsets(), vec![3]);
        assert_eq!(c.steps(), 2);
    }
}
