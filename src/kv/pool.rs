//! A fixed pool of KV blocks with reference counts.

/// Hands out block ids `0..num_blocks`. Reference-counted so a later prefix cache or copy-on-
/// write layout can share blocks; a block returns to the free list when its count drops to 0.
#[derive(Debug, Clone)]
pub struct BlockPool {
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        // Pop from the back: hand out low ids first, which keeps tests readable.
        Self { free: (0..num_blocks as u32).rev().collect(), refs: vec![0; num_blocks] }
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference to a block in use.
    #[cfg(test)]
    pub fn share(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "share of free block {block}");
        *r += 1;
    }

    pub fn release(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "double free of block {block}");
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_roundtrip() {
        let mut p = BlockPool::new(3);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        let c = p.allocate().unwrap();
        assert!(p.allocate().is_none());
        assert_eq!((a, b, c), (0, 1, 2));
        p.share(b);
        p.release(b);
        assert_eq!(p.num_free(), 0);
        p.release(b);
        p.release(a);
        p.release(c);
        assert_eq!(p.num_free(), 3);
    }
}
