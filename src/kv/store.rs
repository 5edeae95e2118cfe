//! Device memory of the KV cache: one K and one V tensor per physical attention layer, each
//! `[num_blocks, block_size, kv_heads, head_dim]`, addressed by the pool's block ids.

use candle_core::{DType, Device, Result, Tensor};

#[derive(Debug)]
pub struct KvStore {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl KvStore {
    pub fn new(num_layers: usize, num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        let shape = (num_blocks, block_size, kv_heads, head_dim);
        let mk = || Tensor::zeros(shape, dtype, device);
        let k = (0..num_layers).map(|_| mk()).collect::<Result<_>>()?;
        let v = (0..num_layers).map(|_| mk()).collect::<Result<_>>()?;
        Ok(Self { k, v })
    }

    pub fn k(&self, layer: usize) -> &Tensor {
        &self.k[layer]
    }
    pub fn v(&self, layer: usize) -> &Tensor {
        &self.v[layer]
    }
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes of one block across all layers (K and V).
    pub fn bytes_per_block(num_layers: usize, block_size: usize, kv_heads: usize, head_dim: usize, dtype: DType) -> usize {
        2 * num_layers * block_size * kv_heads * head_dim * dtype.size_in_bytes()
    }
}
