//! The decoder's attention-cache weights, read from an MLX model directory, and their
//! fingerprint.
//!
//! Only the tensors the cache math uses are read. Quantized projections are dequantized exactly
//! as `mx.dequantize` does (MXFP8: an e4m3 element times a shared power-of-two scale, exact in
//! f32 and in bf16). The fingerprint hashes exactly those tensors as stored plus the plan, so two
//! hosts agree on it iff they would compute the same cache.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::bf16;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{CoreError, Result};
use crate::plan::{ModelPlan, V4LayerKind};

/// A projection `y = x·Wᵀ`, `w` row-major `[out, in]`, widened to f32 (exact).
#[derive(Clone, Debug)]
pub struct Linear {
    pub out_dim: usize,
    pub in_dim: usize,
    pub w: Vec<f32>,
}

/// A compressor's weights (the pooled KV or the indexer's).
#[derive(Clone, Debug)]
pub struct CompressorWeights {
    pub wkv: Linear,
    pub wgate: Linear,
    /// `[ratio, out_dim]`, widened to f32 (exact) from the float32 or bf16 the model stores.
    pub ape: Vec<f32>,
    pub norm: Vec<bf16>,
}

#[derive(Clone, Debug)]
pub struct V4LayerWeights {
    pub wkv: Linear,
    pub kv_norm: Vec<bf16>,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<CompressorWeights>,
}

#[derive(Clone, Debug)]
pub struct MlaLayerWeights {
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + rope_head_dim, hidden]`.
    pub kv_a: Linear,
    pub kv_a_norm: Vec<bf16>,
}

#[derive(Clone, Debug)]
pub enum LayerWeights {
    V4(V4LayerWeights),
    Mla(MlaLayerWeights),
}

/// Everything the cache math needs from a model directory.
#[derive(Clone, Debug)]
pub struct DecoderWeights {
    pub plan: ModelPlan,
    pub layers: Vec<LayerWeights>,
    /// `sha256:<hex>` over the plan and every tensor read, as stored.
    pub fingerprint: String,
}

impl DecoderWeights {
    /// Read `config.json` and the attention-cache tensors from an MLX model directory.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        Self::read(dir.as_ref(), None)
    }

    /// Write the attention-cache tensors of the MLX model in `src` — exactly the tensors the
    /// cache math reads, byte for byte — with its `config.json` into `dst`, for the prefill host.
    /// Returns the fingerprint, which the exported directory reproduces (checked).
    pub fn export(src: impl AsRef<Path>, dst: impl AsRef<Path>) -> Result<String> {
        let (src, dst) = (src.as_ref(), dst.as_ref());
        let mut tensors = Vec::new();
        let weights = Self::read(src, Some(&mut tensors))?;
        std::fs::create_dir_all(dst).map_err(|e| CoreError::io(dst, e))?;
        let cfg_src = src.join("config.json");
        let cfg_dst = dst.join("config.json");
        std::fs::copy(&cfg_src, &cfg_dst).map_err(|e| CoreError::io(&cfg_src, e))?;
        let views = tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).map(|v| (name.clone(), v)).map_err(|e| CoreError::weights(name, e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let file = dst.join("attention-cache.safetensors");
        let meta = std::collections::HashMap::from([("format".to_string(), "mlx".to_string()), ("pd_bridge_fingerprint".to_string(), weights.fingerprint.clone())]);
        safetensors::serialize_to_file(views, Some(meta), &file).map_err(|e| CoreError::WeightFile { path: file.clone(), reason: e.to_string() })?;
        let again = Self::load(dst)?;
        if again.fingerprint != weights.fingerprint {
            return Err(CoreError::WeightFile { path: file, reason: format!("exported weights fingerprint {} differs from the source's {}", again.fingerprint, weights.fingerprint) });
        }
        let fp_path = dst.join("pd-bridge-fingerprint.txt");
        std::fs::write(&fp_path, format!("{}\n", weights.fingerprint)).map_err(|e| CoreError::io(&fp_path, e))?;
        Ok(weights.fingerprint)
    }

    /// `record`: when given, every tensor read is also kept there as stored.
    fn read(dir: &Path, record: Option<&mut Vec<RecordedTensor>>) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| CoreError::io(&cfg_path, e))?;
        let plan = ModelPlan::from_config_json(&cfg_text)?;
        let cfg: Value = serde_json::from_str(&cfg_text).map_err(|e| CoreError::config("config.json", e.to_string()))?;
        let quant = Quantization::from_config(&cfg)?;
        let store = TensorStore::open(dir)?;
        let mut reader = Reader { store: &store, quant: &quant, hasher: Sha256::new(), record };
        reader.hasher.update(b"pd-bridge weights v1\0");
        reader.hasher.update(serde_json::to_vec(&plan).expect("plan serializes"));

        let mut layers = Vec::with_capacity(plan.num_layers());
        match &plan {
            ModelPlan::DeepseekV4(p) => {
                for i in 0..p.num_layers {
                    let pre = format!("model.layers.{i}.attn");
                    let wkv = reader.linear(&format!("{pre}.wkv"), p.head_dim, p.hidden_size)?;
                    let kv_norm = reader.norm(&format!("{pre}.kv_norm.weight"), p.head_dim)?;
                    let ratio = p.compress_ratios[i];
                    let kind = p.layer_kind(i);
                    // The config decides which pools a layer has; the weights must agree, as MLX's
                    // strict load demands (no missing and no extra parameters).
                    let needed = |e: CoreError| match e {
                        CoreError::Weights { tensor, reason } if reason == MISSING => {
                            CoreError::weights(tensor, format!("{reason} (compress_ratios[{i}] is {ratio}, so layer {i} pools)"))
                        }
                        e => e,
                    };
                    let compressor = match kind {
                        V4LayerKind::Window => None,
                        _ => Some(reader.compressor(&format!("{pre}.compressor"), ratio, p.head_dim, p.hidden_size).map_err(needed)?),
                    };
                    let indexer = match kind {
                        V4LayerKind::Sparse => {
                            Some(reader.compressor(&format!("{pre}.indexer.compressor"), ratio, p.index_head_dim, p.hidden_size).map_err(needed)?)
                        }
                        _ => None,
                    };
                    let absent: &[&str] = match kind {
                        V4LayerKind::Window => &["compressor", "indexer"],
                        V4LayerKind::Compressed => &["indexer"],
                        V4LayerKind::Sparse => &[],
                    };
                    for part in absent {
                        if let Some(name) = store.first_under(&format!("{pre}.{part}.")) {
                            return Err(CoreError::weights(
                                name,
                                format!("present, but compress_ratios[{i}] is {ratio}, which gives layer {i} no {part}; MLX refuses weights its model does not have"),
                            ));
                        }
                    }
                    layers.push(LayerWeights::V4(V4LayerWeights { wkv, kv_norm, compressor, indexer }));
                }
            }
            ModelPlan::Mla(p) => {
                for i in 0..p.num_layers {
                    let pre = format!("model.layers.{i}.self_attn");
                    let kv_a = reader.linear(&format!("{pre}.kv_a_proj_with_mqa"), p.kv_lora_rank + p.rope_head_dim, p.hidden_size)?;
                    let kv_a_norm = reader.norm(&format!("{pre}.kv_a_layernorm.weight"), p.kv_lora_rank)?;
                    layers.push(LayerWeights::Mla(MlaLayerWeights { kv_a, kv_a_norm }));
                }
            }
        }
        let digest = reader.hasher.finalize();
        let fingerprint = format!("sha256:{}", digest.iter().map(|b| format!("{b:02x}")).collect::<String>());
        tracing::debug!(dir = %dir.display(), %fingerprint, "decoder weights loaded");
        Ok(DecoderWeights { plan, layers, fingerprint })
    }
}

/// How a quantized weight is stored, from `config.json`'s `quantization` block.
#[derive(Clone, Debug, PartialEq)]
struct QuantSpec {
    mode: String,
    group_size: u64,
    bits: u64,
}

pub(crate) struct Quantization {
    default: Option<QuantSpec>,
    per_module: BTreeMap<String, QuantSpec>,
}

impl Quantization {
    pub(crate) fn from_config(cfg: &Value) -> Result<Self> {
        let q = match cfg.get("quantization").or_else(|| cfg.get("quantization_config")) {
            None | Some(Value::Null) => return Ok(Quantization { default: None, per_module: BTreeMap::new() }),
            Some(Value::Object(m)) => m,
            Some(other) => return Err(CoreError::config("quantization", format!("expected an object, got {other}"))),
        };
        let spec = |field: &str, m: &serde_json::Map<String, Value>| -> Result<Option<QuantSpec>> {
            if !m.contains_key("bits") && !m.contains_key("group_size") {
                return Ok(None);
            }
            let num = |k: &str| m.get(k).and_then(Value::as_u64).ok_or_else(|| CoreError::config(format!("{field}.{k}"), "missing or not an integer"));
            Ok(Some(QuantSpec {
                mode: m.get("mode").and_then(Value::as_str).unwrap_or("affine").to_string(),
                group_size: num("group_size")?,
                bits: num("bits")?,
            }))
        };
        let default = spec("quantization", q)?;
        let mut per_module = BTreeMap::new();
        for (k, v) in q {
            if let Value::Object(m) = v {
                if let Some(s) = spec(&format!("quantization.{k}"), m)? {
                    per_module.insert(k.clone(), s);
                }
            }
        }
        Ok(Quantization { default, per_module })
    }

    fn for_module(&self, module: &str) -> Option<&QuantSpec> {
        self.per_module.get(module).or(self.default.as_ref())
    }
}

/// The model's safetensors files, memory-mapped, and which file holds which tensor.
pub(crate) struct TensorStore {
    maps: Vec<(PathBuf, Mmap)>,
    index: BTreeMap<String, usize>,
}

impl TensorStore {
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| CoreError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(CoreError::WeightFile { path: dir.to_path_buf(), reason: "no .safetensors files in the model directory".into() });
        }
        let mut maps = Vec::new();
        let mut index = BTreeMap::new();
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
        Ok(TensorStore { maps, index })
    }

    /// The first tensor name (in sorted order) that starts with `prefix`.
    fn first_under(&self, prefix: &str) -> Option<&str> {
        use std::ops::Bound;
        let (name, _) = self.index.range::<str, _>((Bound::Included(prefix), Bound::Unbounded)).next()?;
        name.starts_with(prefix).then_some(name.as_str())
    }

    /// Whether the model files hold `name`.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn get(&self, name: &str) -> Result<Option<safetensors::tensor::TensorView<'_>>> {
        let Some(&i) = self.index.get(name) else { return Ok(None) };
        let (path, map) = &self.maps[i];
        let st = SafeTensors::deserialize(map).map_err(|e| CoreError::WeightFile { path: path.clone(), reason: e.to_string() })?;
        st.tensor(name).map(Some).map_err(|e| CoreError::weights(name, e.to_string()))
    }
}

pub(crate) const MISSING: &str = "missing from the model files";

/// A tensor as stored: name, dtype, shape, little-endian bytes.
type RecordedTensor = (String, Dtype, Vec<usize>, Vec<u8>);

pub(crate) struct Reader<'a> {
    pub(crate) store: &'a TensorStore,
    pub(crate) quant: &'a Quantization,
    pub(crate) hasher: Sha256,
    pub(crate) record: Option<&'a mut Vec<RecordedTensor>>,
}

impl Reader<'_> {
    /// A tensor as stored, hashed into the fingerprint (and recorded, when recording).
    pub(crate) fn tensor(&mut self, name: &str) -> Result<(Dtype, Vec<usize>, Vec<u8>)> {
        let t = self.store.get(name)?.ok_or_else(|| CoreError::weights(name, MISSING))?;
        let (dtype, shape, data) = (t.dtype(), t.shape().to_vec(), t.data().to_vec());
        self.hasher.update(name.as_bytes());
        self.hasher.update(format!("\0{dtype:?}{shape:?}\0").as_bytes());
        self.hasher.update(&data);
        if let Some(rec) = self.record.as_deref_mut() {
            rec.push((name.to_string(), dtype, shape.clone(), data.clone()));
        }
        Ok((dtype, shape, data))
    }

    pub(crate) fn expect_shape(name: &str, shape: &[usize], want: &[usize]) -> Result<()> {
        if shape != want {
            return Err(CoreError::weights(name, format!("shape {shape:?}, expected {want:?}")));
        }
        Ok(())
    }

    /// A projection: bf16, or MXFP8 (`mx.dequantize`, exact).
    pub(crate) fn linear(&mut self, module: &str, out_dim: usize, in_dim: usize) -> Result<Linear> {
        let wname = format!("{module}.weight");
        if self.store.get(&format!("{module}.bias"))?.is_some() {
            return Err(CoreError::weights(format!("{module}.bias"), "biased projections are not supported"));
        }
        let scales_name = format!("{module}.scales");
        let w = if self.store.get(&scales_name)?.is_some() {
            let spec = self.quant.for_module(module).cloned().ok_or_else(|| {
                CoreError::weights(&wname, "has scales but config.json has no quantization block")
            })?;
            if spec.mode != "mxfp8" || spec.bits != 8 || spec.group_size != 32 {
                return Err(CoreError::weights(
                    &wname,
                    format!("quantization mode {} (bits {}, group {}) is not supported; supported: bf16 and mxfp8", spec.mode, spec.bits, spec.group_size),
                ));
            }
            if self.store.get(&format!("{module}.biases"))?.is_some() {
                return Err(CoreError::weights(format!("{module}.biases"), "mxfp8 weights carry no biases"));
            }
            let (wd, ws, wbytes) = self.tensor(&wname)?;
            let (sd, ss, sbytes) = self.tensor(&scales_name)?;
            if wd != Dtype::U32 {
                return Err(CoreError::weights(&wname, format!("mxfp8 weight dtype {wd:?}, expected U32")));
            }
            if sd != Dtype::U8 {
                return Err(CoreError::weights(&scales_name, format!("mxfp8 scales dtype {sd:?}, expected U8")));
            }
            if in_dim % 32 != 0 {
                return Err(CoreError::weights(&wname, format!("input width {in_dim} is not a multiple of the group size 32")));
            }
            Self::expect_shape(&wname, &ws, &[out_dim, in_dim / 4])?;
            Self::expect_shape(&scales_name, &ss, &[out_dim, in_dim / 32])?;
            dequantize_mxfp8(&wbytes, &sbytes, out_dim, in_dim)
        } else {
            let (dt, shape, bytes) = self.tensor(&wname)?;
            Self::expect_shape(&wname, &shape, &[out_dim, in_dim])?;
            match dt {
                Dtype::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                other => return Err(CoreError::weights(&wname, format!("dtype {other:?} is not supported (bf16 or mxfp8)"))),
            }
        };
        Ok(Linear { out_dim, in_dim, w })
    }

    pub(crate) fn norm(&mut self, name: &str, dim: usize) -> Result<Vec<bf16>> {
        let (dt, shape, bytes) = self.tensor(name)?;
        Self::expect_shape(name, &shape, &[dim])?;
        if dt != Dtype::BF16 {
            return Err(CoreError::weights(name, format!("dtype {dt:?}, expected BF16 (as oMLX loads it)")));
        }
        Ok(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect())
    }

    fn compressor(&mut self, pre: &str, ratio: usize, head_dim: usize, hidden: usize) -> Result<CompressorWeights> {
        let out_dim = if ratio == 4 { 2 * head_dim } else { head_dim };
        let wkv = self.linear(&format!("{pre}.wkv"), out_dim, hidden)?;
        let wgate = self.linear(&format!("{pre}.wgate"), out_dim, hidden)?;
        let ape_name = format!("{pre}.ape");
        let (dt, shape, bytes) = self.tensor(&ape_name)?;
        Self::expect_shape(&ape_name, &shape, &[ratio, out_dim])?;
        // oMLX keeps `ape` in the dtype it was stored in: float32 as the model initialises it,
        // or bf16 where a converter cast it. Its two uses then compute the same either way once
        // a bf16 `ape` is widened exactly to f32: the simple pool adds it to an f32 gate (MLX
        // promotes bf16 + f32 to f32, the widening exact) and the overlap pool casts it to the
        // gate's bf16 first (a no-op on bf16). The fingerprint hashes the bytes as stored, dtype
        // included, so an f32 and a bf16 `ape` of equal values still fingerprint differently.
        let ape = match dt {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => return Err(CoreError::weights(&ape_name, format!("dtype {other:?} is not supported (F32 or BF16, as oMLX loads it)"))),
        };
        let norm = self.norm(&format!("{pre}.norm.weight"), head_dim)?;
        Ok(CompressorWeights { wkv, wgate, ape, norm })
    }
}

/// OCP MX e4m3 element → f32 (no infinities; 0x7f/0xff are NaN).
fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// E8M0 shared scale → 2^(s-127); 0xff is NaN.
fn e8m0_to_f32(s: u8) -> f32 {
    if s == 0xff {
        f32::NAN
    } else {
        f32::from_bits(if s == 0 { 0x0040_0000 } else { (s as u32) << 23 })
    }
}

/// `mx.dequantize(w, scales, mode="mxfp8")`: element k of a row is byte k of the packed
/// little-endian u32 words, scaled by its 32-element group's E8M0 scale.
pub fn dequantize_mxfp8(packed: &[u8], scales: &[u8], out_dim: usize, in_dim: usize) -> Vec<f32> {
    let groups = in_dim / 32;
    let mut w = Vec::with_capacity(out_dim * in_dim);
    for r in 0..out_dim {
        for c in 0..in_dim {
            let q = packed[r * in_dim + c];
            w.push(e4m3_to_f32(q) * e8m0_to_f32(scales[r * groups + c / 32]));
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // max normal
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // min subnormal
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
    }
}
