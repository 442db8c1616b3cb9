//! What a model family implements: the one trait the capture, the segment builder, the block
//! writer and validator and the CUDA path's CPU side reach a family through ([`Family`]), and the
//! per-layer state it hands out ([`LayerMath`]). Nothing here names a family; `family/mod.rs`
//! lists them.

use half::bf16;
use serde_json::{Map, Value};

use crate::error::Result;
use crate::format::OmlxFormat;
use crate::geometry::LayerShape;
use crate::plan::ModelPlan;
use crate::pooler::carry::LayerCarry;
use crate::pooler::steps::DecoderSteps;
use crate::segment::BlockPlan;
use crate::view::{LayerView, StateArray};
use crate::weights::LayerWeights;

/// One model family: which configs it reads, what its decoder caches per layer, and the math
/// that computes it. Every method taking a plan is given a plan of this family ([`crate::family::of`] picks the family by
/// [`ModelPlan::family`]).
pub trait Family: Send + Sync {
    /// The [`ModelPlan::family`] name of this family's plans.
    fn name(&self) -> &'static str;

    /// The `model_type`s of the `config.json`s this family reads.
    fn model_types(&self) -> &'static [&'static str];

    /// Why this family's models are not bridged, where they are not (its cache math may exist
    /// while oMLX's block format for it does not): [`ModelPlan::from_config_json`] refuses such a
    /// model with this reason before any plan is made, so no plan, capture or block of the family
    /// exists and its prompts prefill natively. `None` (the default): bridged.
    fn not_bridged(&self) -> Option<&'static str> {
        None
    }

    /// The plan of a `config.json` whose `model_type` is one of [`Self::model_types`] (`config`:
    /// its top-level object), with the defaults and checks of the decoder's model class.
    fn read_plan(&self, config: &Map<String, Value>) -> Result<ModelPlan>;

    /// The geometry answers: what each of the plan's layers caches. Everything a block or a
    /// segment holds at a boundary follows from these ([`crate::geometry`]), for every format.
    fn layer_shapes(&self, plan: &ModelPlan) -> Vec<LayerShape>;

    /// A loose upper bound on one block's segment, `(bf16 values, arrays)`, for the wire's frame
    /// limit ([`crate::wire::FrameLimits::for_plan`]): never below what a real block holds.
    fn segment_bound(&self, plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> (u64, u64);

    /// The math: layer `layer`'s state before its first token, on the decoder's grid `steps`.
    fn new_layer(&self, plan: &ModelPlan, layer: usize, steps: DecoderSteps) -> Box<dyn LayerMath>;

    /// The carry: layer `layer`'s state after `position` tokens (a block boundary), continued
    /// from its carry state there (already checked against the layer's shape).
    fn resume_layer(&self, plan: &ModelPlan, layer: usize, steps: DecoderSteps, carry: &LayerCarry, position: usize) -> Result<Box<dyn LayerMath>>;
}

/// One layer's cache state, fed chunk by chunk: what the pooler holds per layer.
pub trait LayerMath: Send + Sync + std::fmt::Debug {
    /// Tokens folded into the state.
    fn processed(&self) -> usize;

    /// Fold `rows` rows of attention input (`x`, `[rows, hidden]` bf16), the first at token
    /// `start` (the caller checked that the chunk is whole and continues the state), with this
    /// layer's weights `w`.
    fn feed(&mut self, w: &LayerWeights, start: usize, rows: usize, x: &[bf16]) -> Result<()>;

    /// The state as named arrays: what the decoder's cache objects hold for this layer.
    fn snapshot(&self) -> Vec<StateArray>;

    /// The state as the block `[start, end)` stores it (the state has processed `end` tokens).
    fn view(&self, start: usize, end: usize) -> LayerView<'_>;

    /// The streaming capture's part of a segment: copy this layer's arrays (layer `layer` of
    /// `block`'s plan; the state has just reached the block's end) into `body`, and drop what
    /// the state no longer needs (pooled rows handed out, rows nothing reads again).
    fn take_part(&mut self, block: &BlockPlan, layer: usize, body: &mut [bf16]) -> Result<()>;

    /// A copy of the state.
    fn boxed_clone(&self) -> Box<dyn LayerMath>;
}
