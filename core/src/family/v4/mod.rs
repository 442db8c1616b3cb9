//! DeepSeek-V4 (`model_type` `deepseek_v4`): its geometry answers and its carry (here), and its
//! math (`math.rs`: the rotating window, the compressor pools and the indexer pool of one layer,
//! following oMLX's MLX model operation by operation), behind [`Family`] and [`LayerMath`].

mod math;

pub use math::V4LayerState;

use half::bf16;
use serde_json::{Map, Value};

use super::contract::{Family, LayerMath};
use crate::error::{CarryField, CoreError, Result};
use crate::format::{OmlxFormat, Overlap};
use crate::geometry::LayerShape;
use crate::plan::{ModelPlan, V4LayerKind, V4Plan};
use crate::pooler::carry::LayerCarry;
use crate::pooler::steps::DecoderSteps;
use crate::segment::{ArraySource, BlockPlan};
use crate::view::{LayerView, StateArray};
use crate::weights::LayerWeights;

/// The DeepSeek-V4 family.
pub struct DeepseekV4;

/// `plan` as this family's ([`crate::family::of`] hands each family its own plans only).
fn own(plan: &ModelPlan) -> &V4Plan {
    match plan {
        ModelPlan::DeepseekV4(p) => p,
        _ => unreachable!("family::of picks the plan's own family"),
    }
}

impl Family for DeepseekV4 {
    fn name(&self) -> &'static str {
        "deepseek_v4"
    }

    fn model_types(&self) -> &'static [&'static str] {
        &["deepseek_v4"]
    }

    fn read_plan(&self, config: &Map<String, Value>) -> Result<ModelPlan> {
        Ok(ModelPlan::DeepseekV4(crate::plan::v4_plan(config)?))
    }

    /// Every layer is a rotating window of `sliding_window` rows, `head_dim` wide; a compressed
    /// layer (ratio 128) adds the compressor's pool, a sparse one (ratio 4) the indexer's too.
    fn layer_shapes(&self, plan: &ModelPlan) -> Vec<LayerShape> {
        let p = own(plan);
        (0..p.num_layers)
            .map(|i| {
                let pool_heads = match p.layer_kind(i) {
                    V4LayerKind::Window => vec![],
                    V4LayerKind::Compressed => vec![p.head_dim],
                    V4LayerKind::Sparse => vec![p.head_dim, p.index_head_dim],
                };
                LayerShape::Windowed { sliding_window: p.sliding_window, ratio: p.compress_ratios[i], head_dim: p.head_dim, pool_heads }
            })
            .collect()
    }

    /// Per layer the window (at most `sliding_window + block_size` rows: a raw rotating buffer
    /// holds up to `max_size + L - 1`), and per pool (two on ratio-4 layers, one on other
    /// compressed layers) the kv/gate remainders (under `2 * ratio` rows of at most twice the
    /// widest head: the ratio-4 overlap doubles the width), the same again for the carried
    /// overlap, and the pooled rows new in this block (`block_size / ratio`, plus one either side).
    fn segment_bound(&self, plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> (u64, u64) {
        let p = own(plan);
        let bs = block_size as u64;
        let head = p.head_dim as u64;
        let widest = p.head_dim.max(p.index_head_dim) as u64;
        let per_pool_arrays = if format.overlap() == Overlap::Carried { 5 } else { 3 };
        let mut elements = 0u64;
        let mut arrays = 0u64;
        for layer in 0..p.num_layers {
            elements += (p.sliding_window as u64 + bs) * head;
            arrays += 1;
            let ratio = p.compress_ratios[layer] as u64;
            let pools = match p.layer_kind(layer) {
                V4LayerKind::Window => 0,
                V4LayerKind::Sparse => 2,
                V4LayerKind::Compressed => 1,
            };
            let remainder = 2 * ratio * 2 * widest;
            let pooled = (bs / ratio.max(1) + 2) * widest;
            elements += pools * (4 * remainder + pooled);
            arrays += pools * per_pool_arrays;
        }
        (elements, arrays)
    }

    fn new_layer(&self, plan: &ModelPlan, layer: usize, steps: DecoderSteps) -> Box<dyn LayerMath> {
        Box::new(V4LayerState::new(own(plan), layer, steps))
    }

    /// The window rows, and per pool the remainder rows, the previous ratio-4 window where the
    /// decoder carries it, and the count of pooled rows before the boundary.
    fn resume_layer(&self, plan: &ModelPlan, layer: usize, steps: DecoderSteps, carry: &LayerCarry, position: usize) -> Result<Box<dyn LayerMath>> {
        match carry {
            LayerCarry::V4(c) => Ok(Box::new(V4LayerState::resume(own(plan), layer, steps, c, position))),
            LayerCarry::Kv => Err(CoreError::Carry { what: CarryField::Plan, reason: format!("layer {layer}: a KV layer's carry, the model's layer is a DeepSeek-V4 layer") }),
        }
    }
}

impl LayerMath for V4LayerState {
    fn processed(&self) -> usize {
        V4LayerState::processed(self)
    }

    fn feed(&mut self, w: &LayerWeights, start: usize, rows: usize, x: &[bf16]) -> Result<()> {
        let LayerWeights::V4(w) = w else {
            return Err(CoreError::weights("layer", "not a DeepSeek-V4 layer's weights"));
        };
        V4LayerState::feed(self, w, start, rows, x);
        Ok(())
    }

    fn snapshot(&self) -> Vec<StateArray> {
        V4LayerState::snapshot(self)
    }

    /// Not sliceable: every block holds the state at its end, whatever its start.
    fn view(&self, _start: usize, _end: usize) -> LayerView<'_> {
        LayerView::V4(self.block_view())
    }

    /// The window and the remainders as the state holds them, and only the pooled rows produced
    /// since the previous boundary (they are handed out and dropped here).
    fn take_part(&mut self, block: &BlockPlan, layer: usize, body: &mut [bf16]) -> Result<()> {
        let deltas = self.drain_pools();
        let v = self.block_view();
        block.fill_layer(layer, body, |src| match *src {
            ArraySource::Window { .. } => Some(v.window.data),
            ArraySource::Remainder { pool, gate } => v.pools.get(pool).map(|p| p[gate as usize].data),
            ArraySource::Pooled { pool, r0, .. } => deltas.get(pool).filter(|d| d.0 == r0).map(|d| d.2.as_slice()),
            ArraySource::Prev { pool, gate } => v.prev.get(pool).copied().flatten().map(|p| p[gate as usize].data),
            _ => None,
        })
    }

    fn boxed_clone(&self) -> Box<dyn LayerMath> {
        Box::new(self.clone())
    }
}
