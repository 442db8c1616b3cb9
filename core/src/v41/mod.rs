//! DeepSeek-V4.1 (`model_type: deepseek_v41`): the decoder's cache math as mlx-lm 0.32.2's
//! `mlx_lm/models/deepseek_v41.py` computes it, a family of its own beside DeepSeek-V4 and MLA.
//!
//! Its cache differs from V4's: compress ratios are 0, 1 or 2 (no overlap, no `ape`); compressed
//! KV and index keys exist only on `kv_source_layer_ids` (index keys on those also in
//! `index_source_layer_ids`, computed from the compressed latent), and the layers above reuse
//! them, so a consumer layer caches only its window; the compressors run in float32. The state is
//! still a pure function of each layer's attention input.
//!
//! The data path: [`V41Plan`] (config.json) → [`V41Weights`] (tensors, fingerprint) →
//! [`V41CacheBuilder`] (per-layer state, fed chunk by chunk; [`V41Carry`] to resume). There is no
//! oMLX block format for V4.1 here, so nothing downstream of the state (segments, blocks) takes
//! this family yet.

mod carry;
pub mod numerics;
mod plan;
mod pooler;
mod weights;

pub use carry::{V41Carry, V41LayerCarry, V41_CARRY_VERSION};
pub use plan::{V41LayerKind, V41Plan, MODEL_TYPE};
pub use pooler::{V41Array, V41CacheBuilder, V41Data, V41LayerState};
pub use weights::{V41LayerWeights, V41PoolWeights, V41Weights};
