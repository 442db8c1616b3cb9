//! The decoder's own weights as a checkpoint the GPU host loads (`pd-bridge export-checkpoint`):
//! the same-weights route.
//!
//! vLLM cannot run MLX's quantized formats, so every quantized module is written dequantized to
//! bf16, element for element as `mx.dequantize` forms it (affine: `bf16(bf16(scale·q) + bias)`;
//! the FP formats: the element times its group scale, exact), under Hugging Face's names:
//! mlx-lm's stacked experts (`mlp.switch_mlp.*`) are split back into `mlp.experts.{e}.*`, and
//! its split of `kv_b_proj` (`embed_q`, `[H, rank, nope]`, and `unembed_out`, `[H, v, rank]`)
//! is joined back into `kv_b_proj` (`[H·(nope + v), rank]`). The
//! config loses its quantization block and gains `pd_bridge_source`: the source model's
//! [`model_fingerprint`] and the digest of what was written, so the prefill host can say it
//! runs the decoder's own weights (and a later edit of the checkpoint is noticed).
//!
//! DeepSeek-V3-style MLA only: vLLM's DeepSeek-V4 checkpoint layout is not the one MLX's
//! conversion keeps, and mapping it back is not done.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{CoreError, Result};
use crate::plan::ModelPlan;
use crate::quant::{dequantize, unpack, QuantMode, Quantization};

/// The config key an exported checkpoint carries its provenance under.
pub const SOURCE_KEY: &str = "pd_bridge_source";

/// What [`export_checkpoint`] wrote.
#[derive(Clone, Debug)]
pub struct ExportedCheckpoint {
    /// The source model's [`model_fingerprint`], which the checkpoint now reports as its own.
    pub model_fingerprint: String,
    /// Modules written dequantized, with the format they were stored in.
    pub dequantized: Vec<(String, String)>,
    pub tensors: usize,
}

/// A model directory's identity, its weights only: sha256 over every tensor of its safetensors
/// files, in name order, each tensor's name, dtype, shape and first 4 KiB of data. Memory-mapped,
/// so a model of hundreds of GB costs one page per tensor; any retraining or conversion changes
/// it, while a renamed config key or an added tokenizer does not. An exported checkpoint whose
/// recorded digest still matches reports its source's.
pub fn model_fingerprint(dir: &Path) -> Result<String> {
    let own = own_digest(dir)?;
    let cfg_path = dir.join("config.json");
    let cfg: Value = match std::fs::read_to_string(&cfg_path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| CoreError::config("config.json", e.to_string()))?,
        Err(_) => Value::Null,
    };
    if let Some(src) = cfg.get(SOURCE_KEY) {
        let recorded = src.get("checkpoint_digest").and_then(Value::as_str);
        let source = src.get("model_fingerprint").and_then(Value::as_str);
        if let (Some(recorded), Some(source)) = (recorded, source) {
            if recorded == own {
                return Ok(source.to_string());
            }
        }
    }
    Ok(own)
}

fn own_digest(dir: &Path) -> Result<String> {
    let mut maps = Vec::new();
    for path in safetensors_files(dir)? {
        let file = std::fs::File::open(&path).map_err(|e| CoreError::io(&path, e))?;
        // SAFETY: read-only inputs; nothing in this process writes them.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| CoreError::io(&path, e))?;
        maps.push((path, map));
    }
    let mut all = Vec::new();
    for (path, map) in &maps {
        let st = SafeTensors::deserialize(map).map_err(|e| CoreError::WeightFile { path: path.clone(), reason: e.to_string() })?;
        for (name, t) in st.tensors() {
            let head = t.data()[..t.data().len().min(4096)].to_vec();
            all.push((name, format!("{:?}{:?}", t.dtype(), t.shape()), head));
        }
    }
    all.sort();
    let mut h = Sha256::new();
    h.update(b"pd-bridge model v1\0");
    for (name, meta, head) in all {
        h.update(format!("{name}\0{meta}\0").as_bytes());
        h.update(&head);
    }
    Ok(format!("sha256:{}", hex(&h.finalize())))
}

/// The file `pd-bridge export-weights` writes beside the cache weights: the decoder model's
/// [`model_fingerprint`] and each cache projection's format.
pub const DECODER_MODEL_FILE: &str = "pd-bridge-model.json";

pub(crate) fn record_decoder_model(weights_dir: &Path, fingerprint: &str, formats: &[(String, String)]) -> Result<()> {
    write_json(&weights_dir.join(DECODER_MODEL_FILE), &serde_json::json!({"model_fingerprint": fingerprint, "formats": formats}))
}

/// What an exported weights directory says of the decoder model it came from: its fingerprint,
/// or None for an export that predates the record.
pub fn decoder_model_of(weights_dir: &Path) -> Result<Option<String>> {
    let p = weights_dir.join(DECODER_MODEL_FILE);
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CoreError::io(&p, e)),
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| CoreError::config(DECODER_MODEL_FILE, e.to_string()))?;
    Ok(v.get("model_fingerprint").and_then(Value::as_str).map(str::to_string))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// A model directory's safetensors files, sorted (every shard; an index adds nothing to them).
pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| CoreError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(CoreError::WeightFile { path: dir.to_path_buf(), reason: "no .safetensors files in the model directory".into() });
    }
    Ok(files)
}

/// Files a model directory carries beside its weights that the GPU host's loader reads.
const SIDE_FILES: [&str; 6] = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja", "tokenizer.model"];

/// Write the MLX model in `src` as a bf16 Hugging Face checkpoint in `dst` (see the module doc).
pub fn export_checkpoint(src: &Path, dst: &Path) -> Result<ExportedCheckpoint> {
    let cfg_path = src.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| CoreError::io(&cfg_path, e))?;
    let plan = ModelPlan::from_config_json(&text)?;
    if !matches!(plan, ModelPlan::Mla(_)) {
        return Err(CoreError::config(
            "model_type",
            format!("{}: export-checkpoint writes DeepSeek-V3-style MLA models; vLLM's {} checkpoint layout is not mapped from MLX's", plan.family(), plan.family()),
        ));
    }
    let cfg: Value = serde_json::from_str(&text).map_err(|e| CoreError::config("config.json", e.to_string()))?;
    let quant = Quantization::from_config(&cfg)?;
    let source_fp = model_fingerprint(src)?;
    if dst.exists() {
        return Err(CoreError::io(dst, std::io::Error::new(std::io::ErrorKind::AlreadyExists, "the output directory exists; export-checkpoint does not overwrite")));
    }
    std::fs::create_dir_all(dst).map_err(|e| CoreError::io(dst, e))?;

    let files = safetensors_files(src)?;
    let n = files.len();
    let mut dequantized = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut tensors = 0;
    let mut kv_b_parts: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    for (i, path) in files.iter().enumerate() {
        let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| CoreError::WeightFile { path: path.clone(), reason: e.to_string() })?;
        let mut out = Vec::new();
        for t in convert_file(&st, &quant, &mut dequantized)? {
            let part = [(".embed_q.weight", 0), (".unembed_out.weight", 1)].into_iter().find_map(|(s, k)| t.0.strip_suffix(s).map(|p| (p.to_string(), k)));
            let Some((prefix, k)) = part else {
                out.push(t);
                continue;
            };
            let slot = kv_b_parts.entry(prefix.clone()).or_default();
            if k == 0 { slot.0 = Some(t) } else { slot.1 = Some(t) }
            if let (Some(_), Some(_)) = slot {
                let (Some(q), Some(o)) = kv_b_parts.remove(&prefix).expect("just filled") else { unreachable!() };
                out.push(join_kv_b(&prefix, &q, &o)?);
            }
        }
        let shard = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        let views = out
            .iter()
            .map(|(name, dt, shape, data)| TensorView::new(*dt, shape.clone(), data).map(|v| (name.clone(), v)).map_err(|e| CoreError::weights(name, e.to_string())))
            .collect::<Result<Vec<_>>>()?;
        for (name, ..) in &out {
            weight_map.insert(name.clone(), shard.clone());
        }
        tensors += out.len();
        let file = dst.join(&shard);
        safetensors::serialize_to_file(views, Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())])), &file)
            .map_err(|e| CoreError::WeightFile { path: file.clone(), reason: e.to_string() })?;
    }
    if let Some((prefix, _)) = kv_b_parts.into_iter().next() {
        return Err(CoreError::weights(format!("{prefix}.embed_q"), "embed_q and unembed_out come in pairs (mlx-lm's split of kv_b_proj); one is missing"));
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    write_json(&dst.join("model.safetensors.index.json"), &index)?;
    for f in SIDE_FILES {
        let p = src.join(f);
        if p.exists() {
            std::fs::copy(&p, dst.join(f)).map_err(|e| CoreError::io(&p, e))?;
        }
    }
    let mut out_cfg = cfg.clone();
    if let Value::Object(m) = &mut out_cfg {
        m.remove("quantization");
        m.remove("quantization_config");
        m.insert("torch_dtype".into(), "bfloat16".into());
        m.remove(SOURCE_KEY);
    }
    write_json(&dst.join("config.json"), &out_cfg)?;
    // The digest of what was just written, recorded beside the source's identity.
    let digest = own_digest(dst)?;
    if let Value::Object(m) = &mut out_cfg {
        m.insert(SOURCE_KEY.into(), serde_json::json!({"model_fingerprint": source_fp, "checkpoint_digest": digest, "dequantized_modules": dequantized.len()}));
    }
    write_json(&dst.join("config.json"), &out_cfg)?;
    Ok(ExportedCheckpoint { model_fingerprint: source_fp, dequantized, tensors })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(v).expect("json serializes")).map_err(|e| CoreError::io(path, e))
}

type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// `kv_b_proj` from mlx-lm's two halves: per head, `embed_q[h]ᵀ` (`[nope, rank]`) then
/// `unembed_out[h]` (`[v, rank]`).
fn join_kv_b(prefix: &str, q: &Tensor, o: &Tensor) -> Result<Tensor> {
    let name = format!("{prefix}.kv_b_proj.weight");
    let (&[h, rank, nope], &[h2, v, rank2]) = (q.2.as_slice(), o.2.as_slice()) else {
        return Err(CoreError::weights(&name, format!("embed_q {:?} and unembed_out {:?} are not [H, rank, nope] and [H, v, rank]", q.2, o.2)));
    };
    if h != h2 || rank != rank2 || q.1 != Dtype::BF16 || o.1 != Dtype::BF16 {
        return Err(CoreError::weights(&name, format!("embed_q {:?} {:?} and unembed_out {:?} {:?} do not fit together", q.1, q.2, o.1, o.2)));
    }
    let at = |t: &Tensor, i: usize| [t.3[2 * i], t.3[2 * i + 1]];
    let mut data = Vec::with_capacity(h * (nope + v) * rank * 2);
    for head in 0..h {
        for n in 0..nope {
            for r in 0..rank {
                data.extend(at(q, (head * rank + r) * nope + n));
            }
        }
        for vi in 0..v {
            for r in 0..rank {
                data.extend(at(o, (head * v + vi) * rank + r));
            }
        }
    }
    Ok((name, Dtype::BF16, vec![h * (nope + v), rank], data))
}

/// One safetensors file's tensors, quantized modules dequantized and stacked experts split.
fn convert_file(st: &SafeTensors<'_>, quant: &Quantization, dequantized: &mut Vec<(String, String)>) -> Result<Vec<Tensor>> {
    let names: std::collections::BTreeSet<String> = st.names().into_iter().map(str::to_string).collect();
    let mut out = Vec::new();
    for name in &names {
        let t = st.tensor(name).map_err(|e| CoreError::weights(name, e.to_string()))?;
        let module = name.rsplit_once('.').map_or(name.as_str(), |(m, _)| m);
        let quantized = names.contains(&format!("{module}.scales"));
        if quantized && (name.ends_with(".scales") || name.ends_with(".biases")) {
            continue; // consumed with the module's weight
        }
        let (dtype, shape, data) = if quantized && name.ends_with(".weight") {
            let spec = quant
                .for_module(module)
                .ok_or_else(|| CoreError::weights(name, "has scales, but config.json's quantization block gives this module no format"))?
                .clone();
            let scales = st.tensor(&format!("{module}.scales")).map_err(|e| CoreError::weights(module, e.to_string()))?;
            let biases = if spec.mode == QuantMode::Affine {
                let b = st.tensor(&format!("{module}.biases")).map_err(|e| CoreError::weights(format!("{module}.biases"), e.to_string()))?;
                if b.dtype() != Dtype::BF16 || scales.dtype() != Dtype::BF16 {
                    return Err(CoreError::weights(module, format!("{spec} scales/biases {:?}/{:?}; export-checkpoint writes bf16 from bf16 scales", scales.dtype(), b.dtype())));
                }
                Some(b.data().chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>())
            } else {
                None
            };
            // [.., out, packed] → rows of `in` elements; stacked experts are [E, out, packed].
            let wshape = t.shape().to_vec();
            let packed_cols = *wshape.last().ok_or_else(|| CoreError::weights(name, "a scalar weight"))?;
            let in_dim = packed_cols * 32 / spec.bits as usize;
            let rows: usize = wshape[..wshape.len() - 1].iter().product();
            if t.dtype() != Dtype::U32 || scales.shape().iter().product::<usize>() != rows * (in_dim / spec.group_size) {
                return Err(CoreError::weights(name, format!("{spec}: weight {:?} {:?} and scales {:?} do not fit", t.dtype(), wshape, scales.shape())));
            }
            let (w, acc) = unpack(&spec, t.data(), scales.data(), biases.as_deref(), rows, in_dim);
            let values = dequantize(&w, &acc, in_dim);
            dequantized.push((module.to_string(), spec.to_string()));
            let mut shape = wshape.clone();
            *shape.last_mut().expect("non-empty") = in_dim;
            (Dtype::BF16, shape, values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect::<Vec<u8>>())
        } else {
            (t.dtype(), t.shape().to_vec(), t.data().to_vec())
        };
        // mlx-lm stacks the routed experts (`mlp.switch_mlp.{proj}`, [E, out, in]); Hugging Face
        // keeps one tensor per expert.
        if let Some((pre, proj)) = name.strip_suffix(".weight").and_then(|m| m.split_once(".switch_mlp.")) {
            let e = shape[0];
            let per = data.len() / e;
            for k in 0..e {
                out.push((format!("{pre}.experts.{k}.{proj}.weight"), dtype, shape[1..].to_vec(), data[k * per..(k + 1) * per].to_vec()));
            }
        } else {
            out.push((name.clone(), dtype, shape, data));
        }
    }
    Ok(out)
}
