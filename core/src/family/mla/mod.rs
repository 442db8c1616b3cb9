//! DeepSeek-V2/V3-style MLA (`model_type` `deepseek_v3`, `kimi_k2`): its geometry answers and its
//! carry (here), and its math (`math.rs`: per token the normalised latent and the rotated shared
//! key), behind [`Family`] and [`LayerMath`].

mod math;

pub use math::MlaLayerState;

use half::bf16;
use serde_json::{Map, Value};

use super::contract::{Family, LayerMath};
use crate::error::{CarryField, CoreError, Result};
use crate::format::OmlxFormat;
use crate::geometry::LayerShape;
use crate::plan::{MlaPlan, ModelPlan};
use crate::pooler::carry::LayerCarry;
use crate::pooler::steps::DecoderSteps;
use crate::segment::{ArraySource, BlockPlan};
use crate::view::{LayerView, StateArray};
use crate::weights::LayerWeights;

/// The MLA family.
pub struct Mla;

/// `plan` as this family's ([`crate::family::of`] hands each family its own plans only).
fn own(plan: &ModelPlan) -> &MlaPlan {
    match plan {
        ModelPlan::Mla(p) => p,
        _ => unreachable!("family::of picks the plan's own family"),
    }
}

impl Family for Mla {
    fn name(&self) -> &'static str {
        "mla"
    }

    fn model_types(&self) -> &'static [&'static str] {
        &["deepseek_v3", "kimi_k2"]
    }

    fn read_plan(&self, config: &Map<String, Value>) -> Result<ModelPlan> {
        Ok(ModelPlan::Mla(crate::plan::mla_plan(config)?))
    }

    /// Every layer is a plain KV cache: keys the latent (`kv_lora_rank` wide), values the
    /// rotated key (`qk_rope_head_dim` wide).
    fn layer_shapes(&self, plan: &ModelPlan) -> Vec<LayerShape> {
        let p = own(plan);
        (0..p.num_layers).map(|_| LayerShape::Kv { keys: p.kv_lora_rank, values: p.rope_head_dim }).collect()
    }

    /// The block's latent and rotated-key rows.
    fn segment_bound(&self, plan: &ModelPlan, _format: OmlxFormat, block_size: usize) -> (u64, u64) {
        let p = own(plan);
        (p.num_layers as u64 * block_size as u64 * (p.kv_lora_rank + p.rope_head_dim) as u64, 2 * p.num_layers as u64)
    }

    fn new_layer(&self, plan: &ModelPlan, _layer: usize, _steps: DecoderSteps) -> Box<dyn LayerMath> {
        Box::new(MlaLayerState::new(own(plan)))
    }

    /// Nothing crosses a block boundary but the position: a token's latent depends on that
    /// token alone.
    fn resume_layer(&self, plan: &ModelPlan, layer: usize, _steps: DecoderSteps, carry: &LayerCarry, position: usize) -> Result<Box<dyn LayerMath>> {
        match carry {
            LayerCarry::Kv => Ok(Box::new(MlaLayerState::resume(own(plan), position))),
            LayerCarry::V4(_) => Err(CoreError::Carry { what: CarryField::Plan, reason: format!("layer {layer}: a DeepSeek-V4 layer's carry, the model's layer is a KV layer") }),
        }
    }
}

impl LayerMath for MlaLayerState {
    fn processed(&self) -> usize {
        MlaLayerState::processed(self)
    }

    fn feed(&mut self, w: &LayerWeights, start: usize, rows: usize, x: &[bf16]) -> Result<()> {
        let LayerWeights::Mla(w) = w else {
            return Err(CoreError::weights("layer", "not an MLA layer's weights"));
        };
        MlaLayerState::feed(self, w, start, rows, x);
        Ok(())
    }

    fn snapshot(&self) -> Vec<StateArray> {
        MlaLayerState::snapshot(self)
    }

    /// Sliceable: the block's own tokens' latent and rotated-key rows.
    fn view(&self, start: usize, end: usize) -> LayerView<'_> {
        let (latent, k_pe) = self.rows(start, end);
        LayerView::Kv(latent, k_pe)
    }

    /// The block's rows, then every row before its end is dropped (nothing reads them again).
    fn take_part(&mut self, block: &BlockPlan, layer: usize, body: &mut [bf16]) -> Result<()> {
        let (k, v) = self.rows(block.start, block.end);
        block.fill_layer(layer, body, |src| match src {
            ArraySource::Latent { .. } => Some(k.data),
            ArraySource::RopeKey { .. } => Some(v.data),
            _ => None,
        })?;
        self.drop_before(block.end);
        Ok(())
    }

    fn boxed_clone(&self) -> Box<dyn LayerMath> {
        Box::new(self.clone())
    }
}
