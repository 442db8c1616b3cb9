//! DeepSeek-V4.1's cache weights, read from an MLX model directory (mlx-lm's names after its
//! `sanitize`), and their fingerprint.
//!
//! Per layer: the window projection `self_attn.kv_proj` (bf16, or MXFP8 dequantized exactly) and
//! `self_attn.kv_norm` (bf16); on a KV source with a non-zero ratio the compressor
//! (`compressor.kv_proj`, `compressor.gate_proj` for ratio 2, `compressor.kv_norm`: float32, as
//! mlx-lm's `cast_predicate` keeps them); on a pool that is also an index source the indexer's key
//! projection (`indexer.k_proj`, `indexer.k_norm`: float32 or bf16, both computed in float32).
//!
//! The tensor store, the quantization table, the fingerprint's hashing and the projection loader
//! are [`crate::weights`]' (one reader for every family); the float32 compressor tensors are read
//! by the two methods below.

use std::path::Path;

use half::bf16;
use safetensors::tensor::Dtype;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::plan::V41Plan;
use crate::error::{CoreError, Result};
use crate::weights::{Linear, Quantization, Reader, TensorStore, MISSING};

/// A pool's weights (a KV source with a non-zero ratio).
#[derive(Clone, Debug)]
pub struct V41PoolWeights {
    /// `compressor.kv_proj`, `[head_dim, hidden]` float32.
    pub kv_proj: Vec<f32>,
    /// `compressor.gate_proj` (ratio 2 only), `[head_dim, hidden]` float32.
    pub gate_proj: Option<Vec<f32>>,
    /// `compressor.kv_norm`, float32.
    pub kv_norm: Vec<f32>,
    /// `indexer.k_proj` `[index_head_dim, head_dim]` and `indexer.k_norm`, widened to float32
    /// (exact), where the layer is also an index source.
    pub index: Option<(Vec<f32>, Vec<f32>)>,
}

#[derive(Clone, Debug)]
pub struct V41LayerWeights {
    /// `self_attn.kv_proj`: `[head_dim, hidden]`.
    pub kv_proj: Linear,
    pub kv_norm: Vec<bf16>,
    pub pools: Option<V41PoolWeights>,
}

/// Everything DeepSeek-V4.1's cache math needs from a model directory.
#[derive(Clone, Debug)]
pub struct V41Weights {
    pub plan: V41Plan,
    pub layers: Vec<V41LayerWeights>,
    /// `sha256:<hex>` over the plan and every tensor read, as stored.
    pub fingerprint: String,
}

impl V41Weights {
    /// Read `config.json` and the cache tensors from an MLX model directory.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg_path = dir.join("config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| CoreError::io(&cfg_path, e))?;
        let plan = V41Plan::from_config_json(&cfg_text)?;
        let cfg: Value = serde_json::from_str(&cfg_text).map_err(|e| CoreError::config("config.json", e.to_string()))?;
        let quant = Quantization::from_config(&cfg)?;
        let store = TensorStore::open(dir)?;
        let mut r = Reader { store: &store, quant: &quant, hasher: Sha256::new(), record: None, formats: Vec::new() };
        r.hasher.update(b"pd-bridge weights deepseek_v41 v1\0");
        r.hasher.update(serde_json::to_vec(&plan).expect("plan serializes"));
        let (hidden, head, ihead) = (plan.hidden_size, plan.head_dim, plan.index_head_dim);
        let mut layers = Vec::with_capacity(plan.num_layers);
        for i in 0..plan.num_layers {
            let pre = format!("model.layers.{i}.self_attn");
            let kv_proj = r.linear(&format!("{pre}.kv_proj"), head, hidden)?;
            let kv_norm = r.norm(&format!("{pre}.kv_norm.weight"), head)?;
            let kind = plan.layer_kind(i);
            let pools = if kind.pools {
                let why = |e: CoreError| match e {
                    CoreError::Weights { tensor, reason } if reason == MISSING => CoreError::weights(
                        tensor,
                        format!("{reason} (layer {i} is a KV source with compress ratio {}, so it compresses)", kind.ratio),
                    ),
                    e => e,
                };
                let cpre = format!("{pre}.compressor");
                let kv_proj = r.f32_only(&format!("{cpre}.kv_proj.weight"), &[head, hidden]).map_err(why)?;
                let gate_proj = if kind.ratio > 1 { Some(r.f32_only(&format!("{cpre}.gate_proj.weight"), &[head, hidden]).map_err(why)?) } else { None };
                let kv_norm = r.f32_only(&format!("{cpre}.kv_norm.weight"), &[head]).map_err(why)?;
                let index = if kind.index_keys {
                    let k = r.widened(&format!("{pre}.indexer.k_proj.weight"), &[ihead, head]).map_err(why)?;
                    let n = r.widened(&format!("{pre}.indexer.k_norm.weight"), &[ihead]).map_err(why)?;
                    Some((k, n))
                } else {
                    None
                };
                Some(V41PoolWeights { kv_proj, gate_proj, kv_norm, index })
            } else {
                None
            };
            layers.push(V41LayerWeights { kv_proj, kv_norm, pools });
        }
        let digest = r.hasher.finalize();
        let fingerprint = format!("sha256:{}", digest.iter().map(|b| format!("{b:02x}")).collect::<String>());
        tracing::debug!(dir = %dir.display(), %fingerprint, "deepseek_v41 weights loaded");
        Ok(V41Weights { plan, layers, fingerprint })
    }
}

/// DeepSeek-V4.1's own tensors: the compressor's float32 ones.
impl Reader<'_> {
    /// `name` as stored, unquantized (`quantized`: why a quantized one is refused), of shape `want`.
    fn unquantized(&mut self, name: &str, want: &[usize], quantized: &str) -> Result<(Dtype, Vec<u8>)> {
        let module = name.trim_end_matches(".weight");
        if self.store.has(&format!("{module}.scales")) {
            return Err(CoreError::weights(name, quantized));
        }
        let (dt, shape, bytes) = self.tensor(name)?;
        Self::expect_shape(name, &shape, want)?;
        Ok((dt, bytes))
    }

    /// A float32 tensor: the compressor's, which mlx-lm keeps float32. In bf16 the compressor
    /// would compute in another precision (a ratio-1 pool in bf16), so that is refused.
    fn f32_only(&mut self, name: &str, want: &[usize]) -> Result<Vec<f32>> {
        let (dt, bytes) = self.unquantized(name, want, "quantized; mlx-lm keeps the compressor float32 and so does the cache math")?;
        if dt != Dtype::F32 {
            return Err(CoreError::weights(name, format!("dtype {dt:?}; mlx-lm keeps the compressor float32 (its cast_predicate), which the cache math follows")));
        }
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// A float32 or bf16 tensor widened exactly (its products are float32 either way).
    fn widened(&mut self, name: &str, want: &[usize]) -> Result<Vec<f32>> {
        let (dt, bytes) = self.unquantized(name, want, "quantized index-key projections are not supported (float32 or bf16)")?;
        match dt {
            Dtype::F32 => Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
            Dtype::BF16 => Ok(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()),
            other => Err(CoreError::weights(name, format!("dtype {other:?} is not supported (F32 or BF16)"))),
        }
    }
}
