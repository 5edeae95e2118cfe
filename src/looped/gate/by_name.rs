//! Ouro's exit gates by name, built for a checkpoint directory: what a command line or a server
//! flag asks for.

use super::{ExitGate, LearnedLookahead, Lookahead, Preloop, QExit};
use crate::config::ModelConfig;
use crate::loader::ModelDir;
use crate::{Error, Result};
use std::path::Path;

/// The exit gate `name` at exit threshold `q` for the Ouro checkpoint in `dir`, and whether it
/// serves with overlap (its verdict is known a step ahead): `stock` (Ouro's Q-exit),
/// `delayed` (the stock gate consumed a step late), `lookahead` and `preloop` (the trained heads
/// `lookahead_exit_gate.safetensors` / `preloop_exit_gate.safetensors` beside the weights).
pub fn ouro_gate(dir: &Path, name: &str, q: f32) -> Result<(Box<dyn ExitGate>, bool)> {
    let ModelConfig::Ouro(config) = ModelDir::open(dir)?.config else {
        return Err(Error::InvalidOption(format!("exit gate `{name}` needs an Ouro checkpoint")));
    };
    let steps = config.total_ut_steps;
    let head = |file: &str| {
        let path = dir.join(file);
        match path.exists() {
            true => Ok(path),
            false => Err(Error::InvalidOption(format!("{} is missing: train it with tools/train/train_gate.py", path.display()))),
        }
    };
    Ok(match name {
        "stock" => (Box::new(QExit::new(q, 1, steps)?), false),
        "delayed" => (Box::new(Lookahead::new(QExit::new(q, 1, steps)?)?), true),
        "lookahead" => (Box::new(LearnedLookahead::load(&head("lookahead_exit_gate.safetensors")?, q, 1, steps)?), true),
        "preloop" => (Box::new(Preloop::load(&head("preloop_exit_gate.safetensors")?, q, 1, steps)?), true),
        other => return Err(Error::InvalidOption(format!("unknown exit gate `{other}`: stock, delayed, lookahead or preloop"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates_by_name_for_the_shipped_ouro_and_refusals() {
        let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
        let ouro = assets.join("tiny-ouro");
        let (stock, overlap) = ouro_gate(&ouro, "stock", 0.5).unwrap();
        assert_eq!((stock.max_steps(), overlap), (4, false));
        assert!(ouro_gate(&ouro, "delayed", 0.5).unwrap().1, "the delayed gate serves with overlap");
        assert!(matches!(ouro_gate(&ouro, "sideways", 0.5), Err(Error::InvalidOption(m)) if m.contains("unknown exit gate")));
        assert!(matches!(ouro_gate(&ouro, "stock", 2.0), Err(Error::InvalidOption(_))), "q outside (0, 1]");
        assert!(matches!(ouro_gate(&assets.join("tiny-sdar"), "stock", 0.5), Err(Error::InvalidOption(m)) if m.contains("Ouro")));
    }
}
