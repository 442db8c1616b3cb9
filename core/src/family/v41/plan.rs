//! DeepSeek-V4.1's plan: what each layer caches, read from its `config.json` with the defaults
//! and the checks of mlx-lm's `deepseek_v41.ModelArgs` (mlx-lm 0.32.2).

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::{CoreError, Result};
use crate::numerics::{Rope, Yarn};
use crate::plan::{f64_field, usize_field};

/// The `model_type` this plan reads.
pub const MODEL_TYPE: &str = "deepseek_v41";

/// What one V4.1 layer keeps in its `LayerCache`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct V41LayerKind {
    /// The compress ratio (0: the layer attends to its window only).
    pub ratio: usize,
    /// The layer publishes a compressed-KV pool (`compress_kv`, and for ratio 2 the pending
    /// rows): a KV source with a non-zero ratio.
    pub pools: bool,
    /// The layer also publishes the indexer keys (`index_k`): a pool that is an index source.
    pub index_keys: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct V41Plan {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub head_dim: usize,
    pub rope_head_dim: usize,
    pub index_head_dim: usize,
    pub sliding_window: usize,
    pub rope_theta: f32,
    pub compress_rope_theta: f32,
    /// The compressed layers' YaRN (`rope_scaling` with mlx-lm's defaults filled in; factor 1
    /// when there is none). Window-only layers use `rope_theta` with no scaling.
    pub yarn: Yarn,
    pub rms_norm_eps: f32,
    /// One per layer (entries past `num_hidden_layers`, the MTP layers, dropped; missing ones 0).
    pub compress_ratios: Vec<usize>,
    pub kv_source_layer_ids: Vec<usize>,
    pub index_source_layer_ids: Vec<usize>,
}

impl V41Plan {
    /// Parse a `config.json`'s text (top level, or nested under `text_config` as the published
    /// checkpoint has it).
    pub fn from_config_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| CoreError::config("config.json", format!("not valid JSON: {e}")))?;
        let top = v.as_object().ok_or_else(|| CoreError::config("config.json", "top level is not an object"))?;
        match top.get("model_type").and_then(Value::as_str) {
            Some(MODEL_TYPE) => {}
            Some(other) => return Err(CoreError::config("model_type", format!("{other:?} is not {MODEL_TYPE:?}"))),
            None => return Err(CoreError::config("model_type", "missing or not a string")),
        }
        let obj = match top.get("text_config") {
            Some(Value::Object(m)) => m,
            Some(other) => return Err(CoreError::config("text_config", format!("expected an object, got {other}"))),
            None => top,
        };
        plan(obj)
    }

    pub fn layer_kind(&self, layer: usize) -> V41LayerKind {
        let ratio = self.compress_ratios[layer];
        let pools = ratio > 0 && self.kv_source_layer_ids.contains(&layer);
        V41LayerKind { ratio, pools, index_keys: pools && self.index_source_layer_ids.contains(&layer) }
    }

    /// The RoPE a layer rotates with: `rope_theta` without scaling for a window-only layer,
    /// `compress_rope_theta` with the YaRN for a compressed one (mlx-lm's `YarnRoPE` either way,
    /// its attention factor 1).
    pub fn rope(&self, layer: usize) -> Rope {
        if self.compress_ratios[layer] == 0 {
            Rope::mla_yarn(self.rope_head_dim, self.rope_theta, &unscaled())
        } else {
            Rope::mla_yarn(self.rope_head_dim, self.compress_rope_theta, &self.yarn)
        }
    }
}

/// `YarnRoPE`'s defaults, which a window-only layer gets (factor 1: its blend still runs).
fn unscaled() -> Yarn {
    Yarn { factor: 1.0, original_max_position_embeddings: 4096.0, beta_fast: 32.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 0.0 }
}

fn plan(obj: &Map<String, Value>) -> Result<V41Plan> {
    let num_layers = usize_field(obj, "num_hidden_layers", Some(40))?;
    let hidden_size = usize_field(obj, "hidden_size", Some(5120))?;
    let head_dim = usize_field(obj, "head_dim", Some(512))?;
    let rope_head_dim = usize_field(obj, "qk_rope_head_dim", Some(64))?;
    let index_head_dim = usize_field(obj, "index_head_dim", Some(128))?;
    let sliding_window = usize_field(obj, "sliding_window", Some(128))?;
    for (name, dim) in [("head_dim", head_dim), ("index_head_dim", index_head_dim)] {
        if rope_head_dim > dim || rope_head_dim % 2 != 0 {
            return Err(CoreError::config(name, format!("{dim} cannot hold an even qk_rope_head_dim of {rope_head_dim}")));
        }
    }
    if let Some(ids) = obj.get("engram_layer_ids") {
        if !ids_field(ids, "engram_layer_ids")?.is_empty() {
            return Err(CoreError::config(
                "engram_layer_ids",
                format!("{ids}: Engram layers are not supported (mlx-lm's deepseek_v41 refuses them too: it has no n-gram memory)"),
            ));
        }
    }
    let mut compress_ratios = match obj.get("compress_ratios") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => ids_field(v, "compress_ratios")?,
    };
    // mlx-lm: a layer past the list has ratio 0; entries past the layers are the MTP layers'.
    compress_ratios.resize(num_layers, 0);
    if let Some((i, r)) = compress_ratios.iter().enumerate().find(|(_, r)| **r > 2) {
        return Err(CoreError::config(format!("compress_ratios[{i}]"), format!("ratio {r} is not one of DeepSeek-V4.1's 0, 1, 2")));
    }
    let kv_source_layer_ids = match obj.get("kv_source_layer_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => ids_field(v, "kv_source_layer_ids")?,
    };
    let index_source_layer_ids = match obj.get("index_source_layer_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => ids_field(v, "index_source_layer_ids")?,
    };
    let max_pos = f64_field(obj, "max_position_embeddings", Some(1048576.0))?;
    let yarn = match obj.get("rope_scaling") {
        None | Some(Value::Null) => Yarn { original_max_position_embeddings: max_pos, ..unscaled() },
        Some(Value::Object(rs)) => {
            // mlx-lm reads these four keys whatever the scaling type says, and truncates the
            // integer ones with int().
            let num = |k: &str, default: f64| -> Result<f64> {
                match rs.get(k) {
                    None | Some(Value::Null) => Ok(default),
                    Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| CoreError::config(format!("rope_scaling.{k}"), format!("{v} is not a number"))),
                }
            };
            let y = Yarn {
                factor: num("factor", 1.0)?,
                original_max_position_embeddings: num("original_max_position_embeddings", max_pos)?.trunc(),
                beta_fast: num("beta_fast", 32.0)?.trunc(),
                beta_slow: num("beta_slow", 1.0)?.trunc(),
                mscale: 1.0,
                mscale_all_dim: 0.0,
            };
            if y.factor <= 0.0 || y.original_max_position_embeddings <= 0.0 || y.beta_fast <= 0.0 || y.beta_slow <= 0.0 {
                return Err(CoreError::config("rope_scaling", "factor, original_max_position_embeddings, beta_fast and beta_slow must be positive"));
            }
            y
        }
        Some(other) => return Err(CoreError::config("rope_scaling", format!("expected an object, got {other}"))),
    };
    Ok(V41Plan {
        hidden_size,
        num_layers,
        head_dim,
        rope_head_dim,
        index_head_dim,
        sliding_window,
        rope_theta: f64_field(obj, "rope_theta", Some(10000.0))? as f32,
        compress_rope_theta: f64_field(obj, "compress_rope_theta", Some(160000.0))? as f32,
        yarn,
        rms_norm_eps: f64_field(obj, "rms_norm_eps", Some(1e-20))? as f32,
        compress_ratios,
        kv_source_layer_ids,
        index_source_layer_ids,
    })
}

/// A list of non-negative integers (layer ids or ratios).
fn ids_field(v: &Value, k: &str) -> Result<Vec<usize>> {
    let Value::Array(a) = v else { return Err(CoreError::config(k, format!("expected a list, got {v}"))) };
    if a.len() > 1 << 12 {
        return Err(CoreError::config(k, format!("{} entries is more than any model has", a.len())));
    }
    a.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64().filter(|&n| n < 1 << 16).map(|n| n as usize).ok_or_else(|| CoreError::config(format!("{k}[{i}]"), format!("{x} is not a small non-negative integer")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLASH: &str = r#"{"model_type":"deepseek_v41","text_config":{"hidden_size":4096,"num_hidden_layers":40,
        "compress_ratios":[0,0,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,0,0,0],
        "kv_source_layer_ids":[2,8,14,20],"index_source_layer_ids":[2,8,14,20,24,28,32,36],
        "rope_scaling":{"type":"yarn","factor":16,"original_max_position_embeddings":65536,"beta_fast":32,"beta_slow":1}}}"#;

    #[test]
    fn flash_layout_parses() {
        let p = V41Plan::from_config_json(FLASH).unwrap();
        assert_eq!(p.compress_ratios.len(), 40);
        assert_eq!(p.layer_kind(0), V41LayerKind { ratio: 0, pools: false, index_keys: false });
        assert_eq!(p.layer_kind(2), V41LayerKind { ratio: 2, pools: true, index_keys: true });
        assert_eq!(p.layer_kind(3), V41LayerKind { ratio: 2, pools: false, index_keys: false });
        assert_eq!(p.layer_kind(20), V41LayerKind { ratio: 1, pools: true, index_keys: true });
        assert_eq!(p.layer_kind(24), V41LayerKind { ratio: 1, pools: false, index_keys: false });
        assert_eq!(p.rms_norm_eps, 1e-20, "mlx-lm's default");
        assert_eq!(p.yarn.factor, 16.0);
        assert_eq!(p.head_dim, 512);
    }

    #[test]
    fn rejections_name_the_field() {
        let cases = [
            (r#"{"model_type":"deepseek_v4"}"#, "model_type"),
            (r#"{"model_type":"deepseek_v41","engram_layer_ids":[1,14]}"#, "engram_layer_ids"),
            (r#"{"model_type":"deepseek_v41","num_hidden_layers":2,"compress_ratios":[0,4]}"#, "compress_ratios[1]"),
            (r#"{"model_type":"deepseek_v41","kv_source_layer_ids":[-1]}"#, "kv_source_layer_ids[0]"),
            (r#"{"model_type":"deepseek_v41","text_config":[]}"#, "text_config"),
            (r#"{"model_type":"deepseek_v41","rope_scaling":{"factor":"x"}}"#, "rope_scaling.factor"),
        ];
        for (text, field) in cases {
            match V41Plan::from_config_json(text) {
                Err(CoreError::Config { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }
}
