//! The decoder's attention-cache weights, read from an MLX model directory, and their
//! fingerprint.
//!
//! Only the tensors the cache math uses are read. A quantized projection (any format MLX writes,
//! [`crate::quant`]) is unpacked into the elements MLX's kernel forms, with the kernel's way of
//! summing them. The fingerprint hashes exactly those tensors as stored, each quantized module's
//! format and the plan, so two hosts agree on it iff they would compute the same cache.

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
pub(crate) use crate::quant::Quantization;
use crate::quant::{unpack, Accumulate, QuantMode};

/// A projection `y = x·Wᵀ`: `w` row-major `[out, in]`, each element as MLX's kernel forms it
/// (the bf16 weight, or a quantized weight's unpacked element), widened to f32 (exact); `acc`,
/// how MLX sums the products.
#[derive(Clone, Debug)]
pub struct Linear {
    pub out_dim: usize,
    pub in_dim: usize,
    pub w: Vec<f32>,
    pub acc: Accumulate,
    /// How the model stores it: `bf16`, or a quantized format (`affine 4-bit g64`, `mxfp4`, …).
    pub format: String,
}

impl Linear {
    /// A dense bf16 projection (weights already widened).
    pub fn dense(out_dim: usize, in_dim: usize, w: Vec<f32>) -> Self {
        Linear { out_dim, in_dim, w, acc: Accumulate::F32, format: "bf16".into() }
    }

    /// The weight dequantized (`mx.dequantize`), `[out, in]`, each value exact in bf16: what a
    /// plain GEMM multiplies by.
    pub fn dequantized(&self) -> Vec<f32> {
        crate::quant::dequantize(&self.w, &self.acc, self.in_dim)
    }
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
    /// Every projection the cache math reads, with how the model stores it (`bf16`, `mxfp4`,
    /// `affine 4-bit g64`, …), in reading order.
    pub formats: Vec<(String, String)>,
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
        // Which model these weights come from, for the prefill host's doctor to compare with the
        // checkpoint vLLM serves (same weights or different).
        crate::checkpoint::record_decoder_model(dst, &crate::checkpoint::model_fingerprint(src)?, &weights.formats)?;
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
        let mut reader = Reader { store: &store, quant: &quant, hasher: Sha256::new(), record, formats: Vec::new() };
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
        Ok(DecoderWeights { plan, layers, fingerprint, formats: reader.formats })
    }
}

/// The model's safetensors files, memory-mapped, and which file holds which tensor.
pub(crate) struct TensorStore {
    maps: Vec<(PathBuf, Mmap)>,
    index: BTreeMap<String, usize>,
}

impl TensorStore {
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let files = crate::checkpoint::safetensors_files(dir)?;
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
    /// (module, format) of every projection read.
    pub(crate) formats: Vec<(String, String)>,
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

    /// A projection: bf16, or any format MLX quantizes to ([`crate::quant`]).
    pub(crate) fn linear(&mut self, module: &str, out_dim: usize, in_dim: usize) -> Result<Linear> {
        let wname = format!("{module}.weight");
        if self.store.has(&format!("{module}.bias")) {
            return Err(CoreError::weights(format!("{module}.bias"), "biased projections are not supported"));
        }
        let scales_name = format!("{module}.scales");
        let biases_name = format!("{module}.biases");
        let spec = self.quant.for_module(module).cloned();
        let has_scales = self.store.has(&scales_name);
        let Some(spec) = spec.filter(|_| has_scales) else {
            if has_scales {
                return Err(CoreError::weights(&wname, "has scales, but config.json's quantization block gives this module no format"));
            }
            let (dt, shape, bytes) = self.tensor(&wname)?;
            Self::expect_shape(&wname, &shape, &[out_dim, in_dim])?;
            let w = match dt {
                Dtype::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
                // A float16 or float32 projection makes MLX compute this layer's cache in that
                // precision, which oMLX's bf16 blocks do not hold.
                other => {
                    return Err(CoreError::weights(
                        &wname,
                        format!("dtype {other:?}: the decoder would compute this cache in {other:?}; pd-bridge computes bf16 caches (convert with `mlx_lm.convert --dtype bfloat16`)"),
                    ))
                }
            };
            self.formats.push((module.to_string(), "bf16".into()));
            return Ok(Linear::dense(out_dim, in_dim, w));
        };
        let g = spec.group_size;
        if in_dim % g != 0 {
            return Err(CoreError::weights(&wname, format!("{spec}: input width {in_dim} is not a multiple of the group size {g}")));
        }
        let affine = spec.mode == QuantMode::Affine;
        if !affine && self.store.has(&biases_name) {
            return Err(CoreError::weights(&biases_name, format!("{spec} weights carry no biases")));
        }
        let (wd, ws, wbytes) = self.tensor(&wname)?;
        let (sd, ss, sbytes) = self.tensor(&scales_name)?;
        if wd != Dtype::U32 {
            return Err(CoreError::weights(&wname, format!("{spec} weight dtype {wd:?}, expected U32")));
        }
        Self::expect_shape(&wname, &ws, &[out_dim, spec.packed_words(in_dim)]).map_err(|e| with_format(e, &spec))?;
        Self::expect_shape(&scales_name, &ss, &[out_dim, in_dim / g]).map_err(|e| with_format(e, &spec))?;
        let biases = if affine {
            match sd {
                Dtype::BF16 => {}
                Dtype::F16 | Dtype::F32 => {
                    return Err(CoreError::weights(
                        &scales_name,
                        format!("{spec} scales dtype {sd:?}: a model quantized from {sd:?} weights computes in {sd:?}; pd-bridge computes bf16 caches (quantize from the bf16 checkpoint: `mlx_lm.convert --dtype bfloat16 -q`)"),
                    ))
                }
                other => return Err(CoreError::weights(&scales_name, format!("{spec} scales dtype {other:?}, expected BF16"))),
            }
            let (bd, bs, bbytes) = self.tensor(&biases_name)?;
            if bd != Dtype::BF16 {
                return Err(CoreError::weights(&biases_name, format!("{spec} biases dtype {bd:?}, expected BF16 like the scales")));
            }
            Self::expect_shape(&biases_name, &bs, &[out_dim, in_dim / g])?;
            Some(bbytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect::<Vec<_>>())
        } else {
            if sd != Dtype::U8 {
                return Err(CoreError::weights(&scales_name, format!("{spec} scales dtype {sd:?}, expected U8")));
            }
            None
        };
        // The format decides how the stored bytes are read, so it is part of the fingerprint.
        self.hasher.update(format!("{module}\0{spec}\0").as_bytes());
        let (w, acc) = unpack(&spec, &wbytes, &sbytes, biases.as_deref(), out_dim, in_dim);
        self.formats.push((module.to_string(), spec.to_string()));
        Ok(Linear { out_dim, in_dim, w, acc, format: spec.to_string() })
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

/// A shape refusal that also names the format the shape was expected for.
fn with_format(e: CoreError, spec: &crate::quant::QuantSpec) -> CoreError {
    match e {
        CoreError::Weights { tensor, reason } => CoreError::Weights { tensor, reason: format!("{reason} for {spec}") },
        e => e,
    }
}
