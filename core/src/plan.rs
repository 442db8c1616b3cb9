//! Model plans: what the decoder's per-layer cache is, read from its `config.json`.
//!
//! A plan holds exactly the configuration values the cache math uses (they are part of the
//! weights fingerprint). Defaults are the ones the MLX model classes apply, so a plan built here
//! describes the same model MLX builds from the same file.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::{CoreError, Result};
use crate::numerics::Yarn;

/// The per-layer cache a DeepSeek-V4 layer keeps, chosen by its compress ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum V4LayerKind {
    /// Ratio 0: the rotating window only.
    Window,
    /// Ratio 4: window + overlapped compressor pool + indexer pool.
    Sparse,
    /// Ratio 128 (or any other non-4 ratio MLX accepts): window + simple compressor pool.
    Compressed,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct V4Plan {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub head_dim: usize,
    pub rope_head_dim: usize,
    pub index_head_dim: usize,
    pub sliding_window: usize,
    pub rope_theta: f32,
    pub compress_rope_theta: f32,
    pub yarn: Option<Yarn>,
    pub rms_norm_eps: f32,
    pub compress_ratios: Vec<usize>,
}

impl V4Plan {
    pub fn layer_kind(&self, layer: usize) -> V4LayerKind {
        match self.compress_ratios[layer] {
            0 => V4LayerKind::Window,
            4 => V4LayerKind::Sparse,
            _ => V4LayerKind::Compressed,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MlaPlan {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub kv_lora_rank: usize,
    pub rope_head_dim: usize,
    pub rope_theta: f32,
    pub yarn: Option<Yarn>,
    /// `kv_a_layernorm` is built with eps 1e-6 by mlx-lm whatever the config says.
    pub latent_norm_eps: f32,
}

/// One plan per model family; everything downstream of the math is family-agnostic.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum ModelPlan {
    DeepseekV4(V4Plan),
    Mla(MlaPlan),
}

impl ModelPlan {
    // `from_config_json` (which family reads a config, and whether it is bridged) is in
    // `crate::family`, where the families' table is.

    pub fn num_layers(&self) -> usize {
        match self {
            ModelPlan::DeepseekV4(p) => p.num_layers,
            ModelPlan::Mla(p) => p.num_layers,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            ModelPlan::DeepseekV4(p) => p.hidden_size,
            ModelPlan::Mla(p) => p.hidden_size,
        }
    }

    /// The rotating window every layer keeps, for a family whose layers have one.
    pub fn sliding_window(&self) -> Option<usize> {
        match self {
            ModelPlan::DeepseekV4(p) => Some(p.sliding_window),
            ModelPlan::Mla(_) => None,
        }
    }

    /// The model family's name: its entry in `crate::family::FAMILIES`.
    pub fn family(&self) -> &'static str {
        match self {
            ModelPlan::DeepseekV4(_) => "deepseek_v4",
            ModelPlan::Mla(_) => "mla",
        }
    }
}

pub(crate) fn v4_plan(obj: &Map<String, Value>) -> Result<V4Plan> {
    let num_layers = usize_field(obj, "num_hidden_layers", None)?;
    let hidden_size = usize_field(obj, "hidden_size", None)?;
    let head_dim = usize_field(obj, "head_dim", Some(512))?;
    let rope_head_dim = usize_field(obj, "qk_rope_head_dim", Some(64))?;
    let index_head_dim = usize_field(obj, "index_head_dim", Some(128))?;
    let sliding_window = usize_field(obj, "sliding_window", Some(128))?;
    for (name, dim) in [("head_dim", head_dim), ("index_head_dim", index_head_dim)] {
        if rope_head_dim > dim || rope_head_dim % 2 != 0 || dim % 2 != 0 {
            return Err(CoreError::config(name, format!("{dim} cannot hold an even qk_rope_head_dim of {rope_head_dim}")));
        }
    }
    if sliding_window == 0 {
        return Err(CoreError::config("sliding_window", "must be positive"));
    }
    let mut compress_ratios = match obj.get("compress_ratios") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) if a.is_empty() => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.as_u64().map(|r| r as usize).ok_or_else(|| CoreError::config(format!("compress_ratios[{i}]"), format!("{r} is not a non-negative integer")))
            })
            .collect::<Result<Vec<_>>>()?,
        Some(other) => return Err(CoreError::config("compress_ratios", format!("expected a list, got {other}"))),
    };
    if compress_ratios.is_empty() {
        // MLX's ModelArgs default: [0] + alternating 4/128 + [0].
        let n = num_layers;
        compress_ratios.push(0);
        compress_ratios.extend((0..n.saturating_sub(2)).map(|i| if i % 2 == 1 { 4 } else { 128 }));
        if n >= 2 {
            compress_ratios.push(0);
        }
    }
    // The list may carry extra entries (the MTP draft layer); MLX keeps the first num_layers.
    if compress_ratios.len() < num_layers {
        return Err(CoreError::config("compress_ratios", format!("{} entries for {num_layers} layers", compress_ratios.len())));
    }
    compress_ratios.truncate(num_layers);
    if let Some((i, r)) = compress_ratios.iter().enumerate().find(|(_, r)| ![0, 4, 128].contains(*r)) {
        return Err(CoreError::config(format!("compress_ratios[{i}]"), format!("ratio {r} is not one of 0, 4, 128")));
    }
    Ok(V4Plan {
        hidden_size,
        num_layers,
        head_dim,
        rope_head_dim,
        index_head_dim,
        sliding_window,
        rope_theta: f32_field(obj, "rope_theta", Some(10000.0))?,
        compress_rope_theta: f32_field(obj, "compress_rope_theta", Some(160000.0))?,
        yarn: rope_scaling(obj)?,
        rms_norm_eps: f32_field(obj, "rms_norm_eps", Some(1e-6))?,
        compress_ratios,
    })
}

pub(crate) fn mla_plan(obj: &Map<String, Value>) -> Result<MlaPlan> {
    let rope_head_dim = usize_field(obj, "qk_rope_head_dim", None)?;
    if rope_head_dim == 0 || rope_head_dim % 2 != 0 {
        return Err(CoreError::config("qk_rope_head_dim", format!("{rope_head_dim} is not a positive even number")));
    }
    if obj.get("attention_bias").and_then(Value::as_bool).unwrap_or(false) {
        return Err(CoreError::config("attention_bias", "biased latent projections are not supported"));
    }
    Ok(MlaPlan {
        hidden_size: usize_field(obj, "hidden_size", None)?,
        num_layers: usize_field(obj, "num_hidden_layers", None)?,
        kv_lora_rank: usize_field(obj, "kv_lora_rank", None)?,
        rope_head_dim,
        rope_theta: f32_field(obj, "rope_theta", Some(10000.0))?,
        yarn: rope_scaling(obj)?,
        latent_norm_eps: 1e-6,
    })
}

fn rope_scaling(obj: &Map<String, Value>) -> Result<Option<Yarn>> {
    let rs = match obj.get("rope_scaling") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(other) => return Err(CoreError::config("rope_scaling", format!("expected an object, got {other}"))),
    };
    let kind = rs.get("type").or_else(|| rs.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "yarn" | "deepseek_yarn" => {
            let num = |k: &str, default: Option<f64>| -> Result<f64> {
                match rs.get(k) {
                    Some(v) => v.as_f64().ok_or_else(|| CoreError::config(format!("rope_scaling.{k}"), format!("{v} is not a number"))),
                    None => default.ok_or_else(|| CoreError::config(format!("rope_scaling.{k}"), "missing")),
                }
            };
            let y = Yarn {
                factor: num("factor", None)?,
                original_max_position_embeddings: num("original_max_position_embeddings", Some(4096.0))?,
                beta_fast: num("beta_fast", Some(32.0))?,
                beta_slow: num("beta_slow", Some(1.0))?,
                mscale: num("mscale", Some(1.0))?,
                mscale_all_dim: num("mscale_all_dim", Some(0.0))?,
            };
            if y.factor.is_nan() || y.factor <= 0.0 {
                return Err(CoreError::config("rope_scaling.factor", format!("{} must be positive", y.factor)));
            }
            Ok(Some(y))
        }
        other => Err(CoreError::config("rope_scaling.type", format!("{other:?} is not supported (supported: yarn, deepseek_yarn, default)"))),
    }
}

pub(crate) fn str_field(obj: &Map<String, Value>, k: &str) -> Result<String> {
    match obj.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(CoreError::config(k, format!("expected a string, got {other}"))),
        None => Err(CoreError::config(k, "missing")),
    }
}

/// The largest value a config may give each size (far above any real model's, well below what
/// would make the cache state or a block's layout allocate without bound: a hostile or garbled
/// `config.json` gets a config error, not an out-of-memory abort).
pub(crate) fn size_limit(k: &str) -> u64 {
    match k {
        "num_hidden_layers" => 1 << 12,
        "sliding_window" => 1 << 20,
        _ => 1 << 17,
    }
}

pub(crate) fn usize_field(obj: &Map<String, Value>, k: &str, default: Option<usize>) -> Result<usize> {
    match obj.get(k) {
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 && n <= size_limit(k) => Ok(n as usize),
            Some(n) if n > 0 => Err(CoreError::config(k, format!("{n} is larger than any model this supports (at most {})", size_limit(k)))),
            _ => Err(CoreError::config(k, format!("{v} is not a positive integer"))),
        },
        None => default.ok_or_else(|| CoreError::config(k, "missing")),
    }
}

fn f32_field(obj: &Map<String, Value>, k: &str, default: Option<f32>) -> Result<f32> {
    f64_field(obj, k, default.map(f64::from)).map(|x| x as f32)
}

/// A positive finite number (`default` when absent).
pub(crate) fn f64_field(obj: &Map<String, Value>, k: &str, default: Option<f64>) -> Result<f64> {
    match obj.get(k) {
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(CoreError::config(k, format!("{v} is not a positive number"))),
        },
        None => default.ok_or_else(|| CoreError::config(k, "missing")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: &str = r#"{"model_type":"deepseek_v4","hidden_size":256,"num_hidden_layers":4,
        "head_dim":128,"compress_ratios":[0,4,128,4,0],
        "rope_scaling":{"type":"yarn","factor":16,"original_max_position_embeddings":65536,"beta_fast":32,"beta_slow":1}}"#;

    #[test]
    fn v4_config_parses_and_truncates_ratios() {
        let ModelPlan::DeepseekV4(p) = ModelPlan::from_config_json(V4).unwrap() else { panic!() };
        assert_eq!(p.compress_ratios, vec![0, 4, 128, 4]);
        assert_eq!(p.layer_kind(1), V4LayerKind::Sparse);
        assert_eq!(p.compress_rope_theta, 160000.0);
        assert!(p.yarn.is_some());
    }

    #[test]
    fn rejections_name_the_field() {
        let cases = [
            ("[]", "config.json"),
            (r#"{"hidden_size":1}"#, "model_type"),
            (r#"{"model_type":"llama"}"#, "model_type"),
            (r#"{"model_type":"deepseek_v41","hidden_size":8,"num_hidden_layers":2}"#, "model_type"),
            (r#"{"model_type":"deepseek_v4","hidden_size":256}"#, "num_hidden_layers"),
            (r#"{"model_type":"deepseek_v4","hidden_size":-1,"num_hidden_layers":2}"#, "hidden_size"),
            (r#"{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":2,"compress_ratios":[0,5]}"#, "compress_ratios[1]"),
            (r#"{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":3,"compress_ratios":[0,4]}"#, "compress_ratios"),
            (r#"{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":2,"rope_scaling":{"type":"linear"}}"#, "rope_scaling.type"),
            (r#"{"model_type":"deepseek_v3","hidden_size":8,"num_hidden_layers":2,"kv_lora_rank":8}"#, "qk_rope_head_dim"),
            (r#"{"model_type":"deepseek_v3","hidden_size":8,"num_hidden_layers":4294967295,"kv_lora_rank":8,"qk_rope_head_dim":4}"#, "num_hidden_layers"),
            (r#"{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":2,"sliding_window":4294967295}"#, "sliding_window"),
            (r#"{"model_type":"deepseek_v3","hidden_size":8,"num_hidden_layers":2,"kv_lora_rank":1000000000,"qk_rope_head_dim":4}"#, "kv_lora_rank"),
        ];
        for (text, field) in cases {
            match ModelPlan::from_config_json(text) {
                Err(CoreError::Config { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn deepseek_v41_is_refused_saying_why() {
        let e = ModelPlan::from_config_json(r#"{"model_type":"deepseek_v41","hidden_size":8,"num_hidden_layers":2}"#).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("not bridged yet") && msg.contains("oMLX's block format"), "{msg}");
    }
}
