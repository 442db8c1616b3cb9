//! Model families: the decoder's cache math, one folder per family (`v4/`: DeepSeek-V4, `mla/`:
//! DeepSeek-V2/V3-style MLA, `v41/`: DeepSeek-V4.1) behind one trait ([`Family`], with
//! [`LayerMath`] per layer), and the table below with one entry per family. Reading a
//! `config.json` ([`ModelPlan::from_config_json`], here) picks the family by its `model_type` from
//! the table; the pooler, the capture, the segment builder and the block writer and validator
//! reach a family only through these; none of them names one.
//!
//! DeepSeek-V4.1's math is complete (bit-exact against mlx-lm), but oMLX's block format for it is
//! not known here: its entry says so ([`Family::not_bridged`]), so its models are refused when
//! their config is read and never reach a plan, a capture or a block. Its own builder, weights and
//! carry state (`v41::V41CacheBuilder`, ...) serve the parity tests and the decode side's Python.
//!
//! # Adding a family
//!
//! One folder and one table entry:
//!
//! 1. `family/<name>/mod.rs` with a unit struct implementing [`Family`]:
//!    - `name`: its plans' [`ModelPlan::family`];
//!    - `model_types` and `read_plan`: the configs it reads, and their plan;
//!    - `not_bridged`, only while oMLX has no block format for it: why its models are refused;
//!    - `layer_shapes`: its geometry answers, one [`LayerShape`] per layer (a rotating window
//!      alone or with compressor pools, or a plain KV cache); [`crate::geometry`] derives every
//!      array of every block and segment from them, for every oMLX format;
//!    - `segment_bound`: how large one block's segment can get (the wire's frame limit);
//!    - `new_layer` and `resume_layer`: its math, a [`LayerMath`] per layer, from the first token
//!      or continued from the layer's carry state ([`crate::pooler::carry::LayerCarry`]);
//!
//!    and [`LayerMath`] for its layer state (`processed`, `feed`, `snapshot`, `view`: what a block
//!    stores, `take_part`: what a segment ships, `boxed_clone`). The math itself goes beside it
//!    (`math.rs`), as in `v4/` and `mla/`.
//! 2. Its entry in [`FAMILIES`].
//!
//! Outside the folder, because the weights fingerprint hashes them and they are read before any
//! family code runs: the plan's `ModelPlan` variant with its config parser (`plan.rs`) and its
//! weight tensors (`weights.rs`). The compiler names each `match` that needs an arm there, and in
//! the GPU path (`cuda/pooler.rs`, feature `cuda`), which keeps its own kernels per family. A
//! family whose blocks hold another kind of cache than these two also extends the shared
//! vocabulary (`view.rs`, `geometry.rs`, the segment's `LayerKind`, `block/layout.rs`, the carry
//! state): that is a new block format, not only a new family.
//!
//! A family whose blocks oMLX cannot read yet answers `not_bridged` with the reason (as `v41/`
//! does): its configs are refused when read, so it needs no `ModelPlan` variant, no weights in
//! `weights.rs` and no arm anywhere else; its methods that take a plan are never called.

mod contract;
pub mod mla;
pub mod v4;
pub mod v41;

pub use contract::{Family, LayerMath};

use serde_json::Value;

use crate::error::{CoreError, Result};
use crate::format::OmlxFormat;
use crate::geometry::{Geometry, LayerShape};
use crate::plan::{str_field, ModelPlan};

/// Every family: one entry each.
pub static FAMILIES: &[&dyn Family] = &[&v4::DeepseekV4, &mla::Mla, &v41::DeepseekV41];

impl ModelPlan {
    /// Parse a decoder `config.json`'s text: the family whose `model_types` hold its
    /// `model_type` reads it, unless that family is not bridged (then the config is refused
    /// with the family's reason, and the prompt prefills natively).
    pub fn from_config_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| CoreError::config("config.json", format!("not valid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| CoreError::config("config.json", "top level is not an object"))?;
        let model_type = str_field(obj, "model_type")?;
        let Some(family) = FAMILIES.iter().copied().find(|f| f.model_types().contains(&model_type.as_str())) else {
            let supported: Vec<String> = FAMILIES.iter().filter(|f| f.not_bridged().is_none()).flat_map(|f| f.model_types()).map(|t| format!("{t:?}")).collect();
            return Err(CoreError::config("model_type", format!("{model_type:?} is not supported (supported: {})", supported.join(", "))));
        };
        if let Some(why) = family.not_bridged() {
            return Err(CoreError::config("model_type", format!("{model_type:?} is not bridged yet: {why}; the prompt prefills natively")));
        }
        family.read_plan(obj)
    }
}

/// The family that computes `plan`'s decoder.
pub fn of(plan: &ModelPlan) -> &'static dyn Family {
    let name = plan.family();
    FAMILIES.iter().copied().find(|f| f.name() == name).expect("every plan's family is in FAMILIES (see the test below)")
}

/// What each layer of `plan`'s decoder caches.
pub fn layer_shapes(plan: &ModelPlan) -> Vec<LayerShape> {
    of(plan).layer_shapes(plan)
}

/// The block geometry of `plan`'s decoder, for `format`'s blocks of `block_size` tokens.
pub fn geometry(plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> Geometry {
    Geometry::new(format, block_size, layer_shapes(plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_plan_has_its_family() {
        let configs = [
            r#"{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":3,"head_dim":8,"qk_rope_head_dim":4,"index_head_dim":4}"#,
            r#"{"model_type":"deepseek_v3","hidden_size":8,"num_hidden_layers":2,"kv_lora_rank":8,"qk_rope_head_dim":4}"#,
            r#"{"model_type":"kimi_k2","hidden_size":8,"num_hidden_layers":2,"kv_lora_rank":8,"qk_rope_head_dim":4}"#,
        ];
        for c in configs {
            let plan = ModelPlan::from_config_json(c).unwrap();
            assert_eq!(of(&plan).name(), plan.family());
            assert_eq!(layer_shapes(&plan).len(), plan.num_layers());
        }
        let names: std::collections::HashSet<_> = FAMILIES.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), FAMILIES.len(), "one entry per family");
    }
}
