//! Model families. A model owns weights only: KV lives in the [`crate::kv::KvStore`] the engine
//! passes in, request state lives in the scheduler, loop state in the engine's runner.

pub mod config;
pub mod diffusion;
pub mod looped;

pub use config::{DreamConfig, EosIds, HuginnConfig, Llada2Config, LladaConfig, ModelConfig, OuroConfig, SdarConfig};
pub use diffusion::{DiffusionAttention, DiffusionModel, DiffusionSpec};
pub use looped::{CoreOut, InitialState, LoopedModel, LoopedSpec, StageInput};
