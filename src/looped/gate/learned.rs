//! Exit gates with heads trained by the CDB authors' recipe (`shared/spec/lookahead-gate.md`):
//! a linear head on the normed loop output, stored as safetensors with keys `weight`
//! `[rows, hidden]` and `bias` `[rows]` in f32.
//!
//! The learned lookahead head predicts the stock gate's hazard at the *next* loop step. Served
//! with overlap, its signal from step r is on the host when step r + 1 is scheduled, so the
//! verdict "exit after step r + 1" is known in time and the token leaves where the stock gate
//! would have put it — structurally [`Lookahead`] over [`QExit`], with the model's own gate head
//! replaced by the trained one (the engine installs it when it is built). Initialised from the
//! stock gate, it is exactly today's delayed stock gate.

use super::{ExitGate, GateState, ItemRef, Lookahead, QExit, StepBounds, StepSignals};
use crate::{Error, Result};
use candle_core::{DType, Device};
use std::path::Path;

/// A trained linear gate head: `rows` outputs over a `hidden`-wide input, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct GateHead {
    /// Row-major `[rows, hidden]`.
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub rows: usize,
    pub hidden: usize,
}

impl GateHead {
    /// Reads a head file (keys `weight` `[rows, hidden]`, `bias` `[rows]`, both f32). A missing
    /// file is `Error::Io`; a missing key, another dtype or inconsistent shapes `Error::BadTensor`.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| Error::tensor(path.display().to_string(), e.to_string()))?;
        let get = |key: &str| tensors.get(key).ok_or_else(|| Error::tensor(format!("{}:{key}", path.display()), "missing"));
        let (w, b) = (get("weight")?, get("bias")?);
        for (key, t) in [("weight", w), ("bias", b)] {
            if t.dtype() != DType::F32 {
                return Err(Error::tensor(format!("{}:{key}", path.display()), format!("dtype {:?}, expected F32", t.dtype())));
            }
        }
        let bad = |reason: String| Error::tensor(path.display().to_string(), reason);
        let (rows, hidden) = w.dims2().map_err(|_| bad(format!("weight has shape {:?}, expected [rows, hidden]", w.dims())))?;
        if b.dims() != [rows] {
            return Err(bad(format!("bias has shape {:?}, expected [{rows}]", b.dims())));
        }
        let weight: Vec<f32> = w.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| bad(e.to_string()))?;
        let bias: Vec<f32> = b.to_vec1().map_err(|e| bad(e.to_string()))?;
        if weight.iter().chain(&bias).any(|v| !v.is_finite()) {
            return Err(bad("non-finite values".into()));
        }
        Ok(Self { weight, bias, rows, hidden })
    }
}

/// The trained lookahead gate: Q-exit's cumulative-hazard rule over the head's predicted
/// next-step hazards, each consumed one step after the step that produced it (minimum depth 2).
#[derive(Debug)]
pub struct LearnedLookahead {
    head: GateHead,
    inner: Lookahead<QExit>,
}

impl LearnedLookahead {
    /// The head in `path` with threshold `q` on the stock gate's CDF scale (no recalibration).
    pub fn load(path: &Path, q: f32, min_steps: usize, max_steps: usize) -> Result<Self> {
        Self::new(GateHead::load(path)?, q, min_steps, max_steps)
    }

    /// A head already in memory (one row).
    pub fn new(head: GateHead, q: f32, min_steps: usize, max_steps: usize) -> Result<Self> {
        if head.rows != 1 {
            return Err(Error::tensor("lookahead head", format!("{} rows, expected 1 (a hazard logit)", head.rows)));
        }
        Ok(Self { head, inner: Lookahead::new(QExit::new(q, min_steps, max_steps)?)? })
    }
}

impl ExitGate for LearnedLookahead {
    fn name(&self) -> String {
        format!("learned-{}", self.inner.name())
    }
    fn bounds(&self) -> StepBounds {
        self.inner.bounds()
    }
    fn decide(&self, item: ItemRef, step: usize, signals: StepSignals, state: &mut GateState) -> bool {
        self.inner.decide(item, step, signals, state)
    }
    fn exit_known(&self, item: ItemRef, step: usize, state: &GateState) -> Option<bool> {
        self.inner.exit_known(item, step, state)
    }
    fn reads_latent_diff(&self) -> bool {
        false
    }
    fn gate_head(&self) -> Option<&GateHead> {
        Some(&self.head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;
    use std::collections::HashMap;

    fn write(dir: &Path, name: &str, tensors: &[(&str, Tensor)]) -> std::path::PathBuf {
        let path = dir.join(name);
        let map: HashMap<String, Tensor> = tensors.iter().map(|(k, t)| (k.to_string(), t.clone())).collect();
        candle_core::safetensors::save(&map, &path).unwrap();
        path
    }

    #[test]
    fn heads_load_and_bad_files_are_typed_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let dev = Device::Cpu;
        let w = Tensor::new(&[[0.5f32, -1.0, 2.0]], &dev).unwrap();
        let b = Tensor::new(&[0.25f32], &dev).unwrap();
        let good = write(tmp.path(), "good.safetensors", &[("weight", w.clone()), ("bias", b.clone())]);
        let head = GateHead::load(&good).unwrap();
        assert_eq!((head.rows, head.hidden, head.weight.clone(), head.bias.clone()), (1, 3, vec![0.5, -1.0, 2.0], vec![0.25]));
        let gate = LearnedLookahead::new(head, 0.5, 1, 4).unwrap();
        assert_eq!((gate.min_steps(), gate.max_steps()), (2, 4), "a lookahead needs two steps");
        assert!(gate.gate_head().is_some() && !gate.reads_latent_diff());

        assert!(matches!(GateHead::load(&tmp.path().join("missing.safetensors")), Err(Error::Io { .. })));
        let no_bias = write(tmp.path(), "no_bias.safetensors", &[("weight", w.clone())]);
        assert!(matches!(GateHead::load(&no_bias), Err(Error::BadTensor { reason, .. }) if reason == "missing"));
        let bf16 = write(tmp.path(), "bf16.safetensors", &[("weight", w.to_dtype(DType::BF16).unwrap()), ("bias", b.clone())]);
        assert!(matches!(GateHead::load(&bf16), Err(Error::BadTensor { reason, .. }) if reason.contains("F32")));
        let shapes = write(tmp.path(), "shapes.safetensors", &[("weight", w.clone()), ("bias", Tensor::new(&[0.1f32, 0.2], &dev).unwrap())]);
        assert!(matches!(GateHead::load(&shapes), Err(Error::BadTensor { reason, .. }) if reason.contains("bias")));
        let two_rows = write(
            tmp.path(),
            "two.safetensors",
            &[("weight", Tensor::zeros((2, 3), DType::F32, &dev).unwrap()), ("bias", Tensor::zeros(2, DType::F32, &dev).unwrap())],
        );
        assert!(matches!(LearnedLookahead::load(&two_rows, 0.5, 1, 4), Err(Error::BadTensor { .. })), "a lookahead head has one row");
        std::fs::write(tmp.path().join("junk.safetensors"), b"not a safetensors file").unwrap();
        assert!(matches!(GateHead::load(&tmp.path().join("junk.safetensors")), Err(Error::BadTensor { .. })));
    }
}
