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
//! this family yet: its entry in [`super::FAMILIES`] ([`DeepseekV41`]) says so
//! ([`Family::not_bridged`]), and a V4.1 config is refused for bridging when it is read.
//!
//! The folder: `plan.rs` (the config), `weights.rs` (its tensors, read with the shared
//! [`crate::weights`] reader), `numerics.rs` (its float32 arithmetic), `pooler.rs` (the layer
//! state and the builder), `carry.rs` (the carry state and its bytes).

mod carry;
pub mod numerics;
mod plan;
mod pooler;
mod weights;

pub use carry::{V41Carry, V41LayerCarry, V41_CARRY_VERSION};
pub use plan::{V41LayerKind, V41Plan, MODEL_TYPE};
pub use pooler::{V41Array, V41CacheBuilder, V41Data, V41LayerState};
pub use weights::{V41LayerWeights, V41PoolWeights, V41Weights};

use serde_json::{Map, Value};

use super::contract::{Family, LayerMath};
use crate::error::{CoreError, Result};
use crate::format::OmlxFormat;
use crate::geometry::LayerShape;
use crate::plan::ModelPlan;
use crate::pooler::carry::LayerCarry;
use crate::pooler::steps::DecoderSteps;

/// The DeepSeek-V4.1 family: its table entry. Not bridged, so no [`ModelPlan`] is ever of this
/// family and the methods that take one are never called.
pub struct DeepseekV41;

const NEVER: &str = "no ModelPlan is DeepSeek-V4.1's: its configs are refused (not bridged)";

impl Family for DeepseekV41 {
    fn name(&self) -> &'static str {
        MODEL_TYPE
    }

    fn model_types(&self) -> &'static [&'static str] {
        &[MODEL_TYPE]
    }

    fn not_bridged(&self) -> Option<&'static str> {
        Some("DeepSeek-V4.1's cache math is in pd-bridge, but oMLX's block format for it is not")
    }

    /// Never reached ([`Self::not_bridged`] refuses first); refused all the same.
    fn read_plan(&self, _config: &Map<String, Value>) -> Result<ModelPlan> {
        Err(CoreError::config("model_type", NEVER))
    }

    fn layer_shapes(&self, _plan: &ModelPlan) -> Vec<LayerShape> {
        unreachable!("{NEVER}")
    }

    fn segment_bound(&self, _plan: &ModelPlan, _format: OmlxFormat, _block_size: usize) -> (u64, u64) {
        unreachable!("{NEVER}")
    }

    fn new_layer(&self, _plan: &ModelPlan, _layer: usize, _steps: DecoderSteps) -> Box<dyn LayerMath> {
        unreachable!("{NEVER}")
    }

    fn resume_layer(&self, _plan: &ModelPlan, _layer: usize, _steps: DecoderSteps, _carry: &LayerCarry, _position: usize) -> Result<Box<dyn LayerMath>> {
        Err(CoreError::config("model_type", NEVER))
    }
}
