//! Tiny random decoder model directories for the core's own tests.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

/// xorshift64*: deterministic, dependency-free randomness for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Roughly normal (sum of uniforms).
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32).sum::<f32>() - 2.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn bf16_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| bf16::from_f32(x).to_le_bytes()).collect()
}

pub fn random_rows(rng: &mut Rng, rows: usize, width: usize) -> Vec<bf16> {
    (0..rows * width).map(|_| bf16::from_f32(rng.normal())).collect()
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pd-bridge-core-{tag}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub struct Tensors(pub BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>);

impl Tensors {
    pub fn write(&self, path: &Path) {
        let views: Vec<(String, TensorView<'_>)> =
            self.0.iter().map(|(k, (dt, shape, data))| (k.clone(), TensorView::new(*dt, shape.clone(), data).unwrap())).collect();
        safetensors::tensor::serialize_to_file(views, None, path).unwrap();
    }
}

pub const V4_HIDDEN: usize = 32;
pub const V4_HEAD: usize = 16;
pub const V4_INDEX_HEAD: usize = 16;

/// A DeepSeek-V4 model directory with layers of ratio 0, 4 and 128 and a small window.
pub fn v4_model_dir(seed: u64) -> PathBuf {
    let dir = temp_dir("v4");
    let cfg = format!(
        r#"{{"model_type":"deepseek_v4","hidden_size":{V4_HIDDEN},"num_hidden_layers":3,"head_dim":{V4_HEAD},
        "qk_rope_head_dim":8,"index_head_dim":{V4_INDEX_HEAD},"sliding_window":8,"compress_ratios":[0,4,128],
        "rope_scaling":{{"type":"yarn","factor":16,"original_max_position_embeddings":65536,"beta_fast":32,"beta_slow":1}}}}"#
    );
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let mut rng = Rng::new(seed);
    let mut t = BTreeMap::new();
    let lin = |t: &mut BTreeMap<_, _>, rng: &mut Rng, name: String, out: usize, inp: usize| {
        let scale = (inp as f32).powf(-0.5);
        t.insert(name, (Dtype::BF16, vec![out, inp], bf16_bytes((0..out * inp).map(|_| rng.normal() * scale))));
    };
    for (i, ratio) in [0usize, 4, 128].into_iter().enumerate() {
        let p = format!("model.layers.{i}.attn");
        lin(&mut t, &mut rng, format!("{p}.wkv.weight"), V4_HEAD, V4_HIDDEN);
        t.insert(format!("{p}.kv_norm.weight"), (Dtype::BF16, vec![V4_HEAD], bf16_bytes((0..V4_HEAD).map(|_| 1.0 + 0.1 * rng.normal()))));
        let comps: Vec<(String, usize)> = match ratio {
            0 => vec![],
            4 => vec![(format!("{p}.compressor"), V4_HEAD), (format!("{p}.indexer.compressor"), V4_INDEX_HEAD)],
            _ => vec![(format!("{p}.compressor"), V4_HEAD)],
        };
        for (c, hd) in comps {
            let od = if ratio == 4 { 2 * hd } else { hd };
            lin(&mut t, &mut rng, format!("{c}.wkv.weight"), od, V4_HIDDEN);
            lin(&mut t, &mut rng, format!("{c}.wgate.weight"), od, V4_HIDDEN);
            let ape: Vec<u8> = (0..ratio * od).flat_map(|_| (0.5 * rng.normal()).to_le_bytes()).collect();
            t.insert(format!("{c}.ape"), (Dtype::F32, vec![ratio, od], ape));
            t.insert(format!("{c}.norm.weight"), (Dtype::BF16, vec![hd], bf16_bytes((0..hd).map(|_| 1.0 + 0.1 * rng.normal()))));
        }
    }
    Tensors(t).write(&dir.join("model.safetensors"));
    dir
}

pub const MLA_HIDDEN: usize = 32;

pub fn mla_model_dir(seed: u64) -> PathBuf {
    let dir = temp_dir("mla");
    let cfg = format!(
        r#"{{"model_type":"deepseek_v3","hidden_size":{MLA_HIDDEN},"num_hidden_layers":2,"kv_lora_rank":16,"qk_rope_head_dim":8,
        "rope_scaling":{{"type":"yarn","factor":40,"original_max_position_embeddings":4096,"mscale":0.707,"mscale_all_dim":1.0}}}}"#
    );
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let mut rng = Rng::new(seed);
    let mut t = BTreeMap::new();
    for i in 0..2 {
        let p = format!("model.layers.{i}.self_attn");
        t.insert(format!("{p}.kv_a_proj_with_mqa.weight"), (Dtype::BF16, vec![24, MLA_HIDDEN], bf16_bytes((0..24 * MLA_HIDDEN).map(|_| rng.normal() * 0.2))));
        t.insert(format!("{p}.kv_a_layernorm.weight"), (Dtype::BF16, vec![16], bf16_bytes((0..16).map(|_| 1.0 + 0.1 * rng.normal()))));
    }
    Tensors(t).write(&dir.join("model.safetensors"));
    dir
}

/// Every file under `dir` (recursively).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Two block files hold the same tensors and metadata, `created_at` aside.
pub fn assert_same_block(a: &Path, b: &Path) {
    let strip = |p: &Path| {
        let bytes = std::fs::read(p).unwrap();
        let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let mut m: Vec<_> = meta.metadata().clone().unwrap().into_iter().filter(|(k, _)| k != "created_at").collect();
        m.sort();
        (m, bytes[8 + n..].to_vec())
    };
    assert!(strip(a) == strip(b), "{} and {} differ", a.display(), b.display());
}

/// Pull capture `id` from `server` with the token `tok` and `secret` into `writer`, as a decode
/// host does (blocks of `block` tokens, `timeout` for each wait).
#[allow(clippy::too_many_arguments)]
pub fn pull(
    server: &pd_bridge_core::segment_server::SegmentServer,
    w: &pd_bridge_core::DecoderWeights,
    id: &str,
    secret: &pd_bridge_core::wire::CaptureSecret,
    tokens: &[u32],
    writer: &pd_bridge_core::block::BlockWriter,
    block: usize,
    timeout: std::time::Duration,
    control: &pd_bridge_core::ingest::IngestControl,
    on_block: impl FnMut(&pd_bridge_core::block::Landed),
) -> pd_bridge_core::ingest::Ingested {
    let p = pd_bridge_core::ingest::Pull {
        addrs: vec![server.local_addr()],
        token: b"tok",
        secret,
        request_id: id,
        fingerprint: &w.fingerprint,
        prompt: pd_bridge_core::wire::PromptDigest::of(tokens),
        limits: pd_bridge_core::wire::FrameLimits::for_plan(&w.plan, writer.format(), block),
        timeout,
        lanes: 1,
        stages: 1,
    };
    pd_bridge_core::ingest::ingest(&p, writer, control, on_block)
}

/// `base` (a model directory written above) with every projection replaced by random quantized
/// weights in MLX's `mode` (`affine`, `mxfp4`, `mxfp8`, `nvfp4`) at `bits` and `group`, and
/// config.json's quantization block saying so: any packed bytes and scales are valid weights.
pub fn quantized_model_dir(base: &Path, mode: &str, bits: usize, group: usize, seed: u64) -> PathBuf {
    let dir = temp_dir(&format!("q-{mode}-{bits}-{group}"));
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    cfg["quantization"] = serde_json::json!({"mode": mode, "bits": bits, "group_size": group});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(base.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut rng = Rng::new(seed);
    let mut t = BTreeMap::new();
    for (name, v) in st.tensors() {
        let shape = v.shape().to_vec();
        let module = name.strip_suffix(".weight");
        match module {
            Some(m) if shape.len() == 2 && shape[1] % group == 0 => {
                let (out, inp) = (shape[0], shape[1]);
                let packed: Vec<u8> = (0..out * inp * bits / 8).map(|_| rng.next_u64() as u8).collect();
                t.insert(name.clone(), (Dtype::U32, vec![out, inp * bits / 32], packed));
                let groups = inp / group;
                if mode == "affine" {
                    let s = (inp as f32).powf(-0.5) / (1 << bits) as f32;
                    t.insert(format!("{m}.scales"), (Dtype::BF16, vec![out, groups], bf16_bytes((0..out * groups).map(|_| s * (1.0 + 0.5 * rng.normal())))));
                    t.insert(format!("{m}.biases"), (Dtype::BF16, vec![out, groups], bf16_bytes((0..out * groups).map(|_| -s * (1 << (bits - 1)) as f32 * (1.0 + 0.1 * rng.normal())))));
                } else {
                    // E8M0 exponents near 2^-6, or E4M3 scales between 2^-6 and 2^-3.
                    let scale = |rng: &mut Rng| if mode == "nvfp4" { 0x18 + rng.below(24) as u8 } else { 118 + rng.below(6) as u8 };
                    t.insert(format!("{m}.scales"), (Dtype::U8, vec![out, groups], (0..out * groups).map(|_| scale(&mut rng)).collect()));
                }
            }
            _ => {
                t.insert(name.clone(), (v.dtype(), shape, v.data().to_vec()));
            }
        }
    }
    Tensors(t).write(&dir.join("model.safetensors"));
    dir
}
