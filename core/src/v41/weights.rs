//! DeepSeek-V4.1's cache weights, read from an MLX model directory (mlx-lm's names after its
//! `sanitize`), and their fingerprint.
//!
//! Per layer: the window projection `self_attn.kv_proj` (bf16, or MXFP8 dequantized exactly) and
//! `self_attn.kv_norm` (bf16); on a KV source with a non-zero ratio the compressor
//! (`compressor.kv_proj`, `compressor.gate_proj` for ratio 2, `compressor.kv_norm`: float32, as
//! mlx-lm's `cast_predicate` keeps them); on a pool that is also an index source the indexer's key
//! projection (`indexer.k_proj`, `indexer.k_norm`: float32 or bf16, both computed in float32).
//!
//! The tensor store is this family's own (a few lines beside [`crate::weights`], so the two
//! families' loaders change independently); the MXFP8 decoding is shared.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::bf16;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::plan::V41Plan;
use crate::error::{CoreError, Result};
use crate::weights::{dequantize_mxfp8, Linear};

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

const MISSING: &str = "missing from the model files";

impl V41Weights {
    /// Read `config.json` and the cache tensors from an MLX model directory.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg_path = dir.join("config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| CoreError::io(&cfg_path, e))?;
        let plan = V41Plan::from_config_json(&cfg_text)?;
        let cfg: Value = serde_json::from_str(&cfg_text).map_err(|e| CoreError::config("config.json", e.to_string()))?;
        let store = Store::open(dir)?;
        let mut r = Reader { store: &store, quant: cfg.get("quantization").or_else(|| cfg.get("quantization_config")), hasher: Sha256::new() };
        r.hasher.update(b"pd-bridge weights deepseek_v41 v1\0");
        r.hasher.update(serde_json::to_vec(&plan).expect("plan serializes"));
        let (hidden, head, ihead) = (plan.hidden_size, plan.head_dim, plan.index_head_dim);
        let mut layers = Vec::with_capacity(plan.num_layers);
        for i in 0..plan.num_layers {
            let pre = format!("model.layers.{i}.self_attn");
            let kv_proj = r.linear(&format!("{pre}.kv_proj"), head, hidden)?;
            let kv_norm = r.bf16_vector(&format!("{pre}.kv_norm.weight"), head)?;
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

/// The model's safetensors files, memory-mapped, and which file holds which tensor.
struct Store {
    maps: Vec<(PathBuf, Mmap)>,
    index: BTreeMap<String, usize>,
}

impl Store {
    fn open(dir: &Path) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| CoreError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(CoreError::WeightFile { path: dir.to_path_buf(), reason: "no .safetensors files in the model directory".into() });
        }
        let (mut maps, mut index) = (Vec::new(), BTreeMap::new());
        for path in files {
            let file = File::open(&path).map_err(|e| CoreError::io(&path, e))?;
            // SAFETY: the model files are read-only inputs; nothing in this process writes them.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| CoreError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| CoreError::WeightFile { path: path.clone(), reason: e.to_string() })?;
            for name in st.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Store { maps, index })
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// A tensor's dtype, shape and bytes as stored (borrowed from the mapped file).
    fn get(&self, name: &str) -> Result<Option<StoredTensor<'_>>> {
        let Some(&i) = self.index.get(name) else { return Ok(None) };
        let (path, map) = &self.maps[i];
        let st = SafeTensors::deserialize(map).map_err(|e| CoreError::WeightFile { path: path.clone(), reason: e.to_string() })?;
        let t = st.tensor(name).map_err(|e| CoreError::weights(name, e.to_string()))?;
        Ok(Some((t.dtype(), t.shape().to_vec(), t.data())))
    }
}

type StoredTensor<'a> = (Dtype, Vec<usize>, &'a [u8]);

struct Reader<'a> {
    store: &'a Store,
    quant: Option<&'a Value>,
    hasher: Sha256,
}

impl Reader<'_> {
    /// A tensor as stored, hashed into the fingerprint.
    fn tensor(&mut self, name: &str) -> Result<(Dtype, Vec<usize>, Vec<u8>)> {
        let (dtype, shape, data) = self.store.get(name)?.ok_or_else(|| CoreError::weights(name, MISSING))?;
        self.hasher.update(name.as_bytes());
        self.hasher.update(format!("\0{dtype:?}{shape:?}\0").as_bytes());
        self.hasher.update(data);
        Ok((dtype, shape, data.to_vec()))
    }

    fn shaped(name: &str, shape: &[usize], want: &[usize]) -> Result<()> {
        if shape != want {
            return Err(CoreError::weights(name, format!("shape {shape:?}, expected {want:?}")));
        }
        Ok(())
    }

    fn bf16_vector(&mut self, name: &str, dim: usize) -> Result<Vec<bf16>> {
        let (dt, shape, bytes) = self.tensor(name)?;
        Self::shaped(name, &shape, &[dim])?;
        if dt != Dtype::BF16 {
            return Err(CoreError::weights(name, format!("dtype {dt:?}, expected BF16 (as mlx-lm's converted model stores it)")));
        }
        Ok(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect())
    }

    /// A float32 tensor: the compressor's, which mlx-lm keeps float32. In bf16 the compressor
    /// would compute in another precision (a ratio-1 pool in bf16), so that is refused.
    fn f32_only(&mut self, name: &str, want: &[usize]) -> Result<Vec<f32>> {
        let module = name.trim_end_matches(".weight");
        if self.store.has(&format!("{module}.scales")) {
            return Err(CoreError::weights(name, "quantized; mlx-lm keeps the compressor float32 and so does the cache math"));
        }
        let (dt, shape, bytes) = self.tensor(name)?;
        Self::shaped(name, &shape, want)?;
        if dt != Dtype::F32 {
            return Err(CoreError::weights(name, format!("dtype {dt:?}; mlx-lm keeps the compressor float32 (its cast_predicate), which the cache math follows")));
        }
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// A float32 or bf16 tensor widened exactly (its products are float32 either way).
    fn widened(&mut self, name: &str, want: &[usize]) -> Result<Vec<f32>> {
        let module = name.trim_end_matches(".weight");
        if self.store.has(&format!("{module}.scales")) {
            return Err(CoreError::weights(name, "quantized index-key projections are not supported (float32 or bf16)"));
        }
        let (dt, shape, bytes) = self.tensor(name)?;
        Self::shaped(name, &shape, want)?;
        match dt {
            Dtype::F32 => Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
            Dtype::BF16 => Ok(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()),
            other => Err(CoreError::weights(name, format!("dtype {other:?} is not supported (F32 or BF16)"))),
        }
    }

    /// The window projection: bf16, or MXFP8 (`mx.dequantize`, exact).
    fn linear(&mut self, module: &str, out_dim: usize, in_dim: usize) -> Result<Linear> {
        let wname = format!("{module}.weight");
        if self.store.has(&format!("{module}.bias")) {
            return Err(CoreError::weights(format!("{module}.bias"), "biased projections are not supported"));
        }
        let scales = format!("{module}.scales");
        let w = if self.store.has(&scales) {
            let (mode, bits, group) = self.quant_spec(module).ok_or_else(|| CoreError::weights(&wname, "has scales but config.json has no quantization for it"))?;
            if mode != "mxfp8" || bits != 8 || group != 32 {
                return Err(CoreError::weights(&wname, format!("quantization mode {mode} (bits {bits}, group {group}) is not supported; supported: bf16 and mxfp8")));
            }
            if self.store.has(&format!("{module}.biases")) {
                return Err(CoreError::weights(format!("{module}.biases"), "mxfp8 weights carry no biases"));
            }
            let (wd, ws, wbytes) = self.tensor(&wname)?;
            let (sd, ss, sbytes) = self.tensor(&scales)?;
            if wd != Dtype::U32 || sd != Dtype::U8 {
                return Err(CoreError::weights(&wname, format!("mxfp8 weight {wd:?} with scales {sd:?}, expected U32 and U8")));
            }
            if in_dim % 32 != 0 {
                return Err(CoreError::weights(&wname, format!("input width {in_dim} is not a multiple of the group size 32")));
            }
            Self::shaped(&wname, &ws, &[out_dim, in_dim / 4])?;
            Self::shaped(&scales, &ss, &[out_dim, in_dim / 32])?;
            dequantize_mxfp8(&wbytes, &sbytes, out_dim, in_dim)
        } else {
            let (dt, shape, bytes) = self.tensor(&wname)?;
            Self::shaped(&wname, &shape, &[out_dim, in_dim])?;
            match dt {
                Dtype::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                other => return Err(CoreError::weights(&wname, format!("dtype {other:?} is not supported (bf16 or mxfp8)"))),
            }
        };
        Ok(Linear { out_dim, in_dim, w })
    }

    /// `(mode, bits, group_size)` config.json's `quantization` gives `module` (its own entry,
    /// else the default).
    fn quant_spec(&self, module: &str) -> Option<(String, u64, u64)> {
        let q = self.quant?.as_object()?;
        let spec = |m: &serde_json::Map<String, Value>| -> Option<(String, u64, u64)> {
            Some((m.get("mode").and_then(Value::as_str).unwrap_or("affine").to_string(), m.get("bits")?.as_u64()?, m.get("group_size")?.as_u64()?))
        };
        match q.get(module) {
            Some(Value::Object(m)) => spec(m),
            _ => spec(q),
        }
    }
}
