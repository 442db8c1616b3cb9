//! Random decoder weights of a given shape, for the GPU tests and benchmark (no model files:
//! DeepSeek-V4-Flash's attention-cache weights are 43 × up to 3072 × 4096 values).

use std::sync::Arc;

use half::bf16;

use crate::numerics::Yarn;
use crate::plan::{ModelPlan, V4Plan};
use crate::weights::{CompressorWeights, DecoderWeights, LayerWeights, Linear, V4LayerWeights};

/// xorshift64*: deterministic, dependency-free randomness.
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
    /// Roughly normal (sum of four uniforms, centred).
    pub fn normal(&mut self) -> f32 {
        let u = self.next_u64();
        let s: u32 = (0..4).map(|i| ((u >> (16 * i)) & 0xffff) as u32).sum();
        (s as f32 / 65536.0 - 2.0) * 1.7
    }
    pub fn rows(&mut self, rows: usize, width: usize) -> Vec<bf16> {
        (0..rows * width)
            .map(|_| bf16::from_f32(self.normal()))
            .collect()
    }
}

/// DeepSeek-V4-Flash's cache plan: 43 layers, hidden 4096, head 512, index head 128, window 128,
/// ratios `[0, 0] + [4, 128] × 20 + [4]`, YaRN (factor 16 over 65536) on compressed layers.
pub fn flash_plan() -> V4Plan {
    let mut ratios = vec![0, 0];
    for _ in 0..20 {
        ratios.extend([4, 128]);
    }
    ratios.push(4);
    V4Plan {
        hidden_size: 4096,
        num_layers: 43,
        head_dim: 512,
        rope_head_dim: 64,
        index_head_dim: 128,
        sliding_window: 128,
        rope_theta: 10000.0,
        compress_rope_theta: 160000.0,
        yarn: Some(Yarn {
            factor: 16.0,
            original_max_position_embeddings: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }),
        rms_norm_eps: 1e-6,
        compress_ratios: ratios,
    }
}

fn linear(rng: &mut Rng, out: usize, inp: usize) -> Linear {
    let scale = (inp as f32).powf(-0.5);
    Linear::dense(out, inp, (0..out * inp).map(|_| bf16::from_f32(rng.normal() * scale).to_f32()).collect())
}

fn norm(rng: &mut Rng, d: usize) -> Vec<bf16> {
    (0..d)
        .map(|_| bf16::from_f32(1.0 + 0.1 * rng.normal()))
        .collect()
}

/// Random weights for a V4 plan (the fingerprint names the seed; it is not a model's).
pub fn v4_weights(plan: V4Plan, seed: u64) -> Arc<DecoderWeights> {
    let mut rng = Rng::new(seed);
    let h = plan.hidden_size;
    let layers = (0..plan.num_layers)
        .map(|i| {
            let ratio = plan.compress_ratios[i];
            let mut comp = |hd: usize| {
                let od = if ratio == 4 { 2 * hd } else { hd };
                CompressorWeights {
                    wkv: linear(&mut rng, od, h),
                    wgate: linear(&mut rng, od, h),
                    ape: (0..ratio * od).map(|_| 0.5 * rng.normal()).collect(),
                    norm: norm(&mut rng, hd),
                }
            };
            let compressor = (ratio != 0).then(|| comp(plan.head_dim));
            let indexer = (ratio == 4).then(|| comp(plan.index_head_dim));
            LayerWeights::V4(V4LayerWeights {
                wkv: linear(&mut rng, plan.head_dim, h),
                kv_norm: norm(&mut rng, plan.head_dim),
                compressor,
                indexer,
            })
        })
        .collect();
    Arc::new(DecoderWeights {
        plan: ModelPlan::DeepseekV4(plan),
        layers,
        fingerprint: format!("synthetic:{seed}"),
        formats: Vec::new(),
    })
}

/// `w` with every projection stored quantized (random codes and scales of plausible size): MLX's
/// `affine` at `bits`/`group`, or `mxfp4` (`bits` 4, group 32). For benchmarks of the quantized
/// formats beside bf16.
pub fn quantized(w: &DecoderWeights, mode: &str, bits: usize, group: usize, seed: u64) -> Arc<DecoderWeights> {
    use crate::quant::Accumulate;
    use crate::quant::FP4;
    let mut rng = Rng::new(seed);
    let mut q = |l: &Linear| -> Linear {
        let groups = l.in_dim / group;
        let s = (l.in_dim as f32).powf(-0.5);
        if mode == "affine" {
            let levels = (1u64 << bits) as f32;
            let w = (0..l.out_dim * l.in_dim)
                .map(|_| {
                    let (sc, b) = (bf16::from_f32(2.0 * s / levels), bf16::from_f32(-s));
                    let code = (rng.next_u64() % (1 << bits)) as f32;
                    bf16::from_f32(bf16::from_f32(sc.to_f32() * code).to_f32() + b.to_f32()).to_f32()
                })
                .collect();
            Linear { out_dim: l.out_dim, in_dim: l.in_dim, w, acc: Accumulate::Bf16, format: format!("affine {bits}-bit g{group}") }
        } else {
            let w = (0..l.out_dim * l.in_dim).map(|_| FP4[(rng.next_u64() % 16) as usize]).collect();
            let scales = (0..l.out_dim * groups).map(|_| 2f32.powi(-((rng.next_u64() % 3) as i32) - 3)).collect();
            Linear { out_dim: l.out_dim, in_dim: l.in_dim, w, acc: Accumulate::Bf16Groups { group, scales }, format: "mxfp4".into() }
        }
    };
    let layers = w
        .layers
        .iter()
        .map(|l| match l {
            LayerWeights::V4(v) => {
                let mut comp = |c: &Option<CompressorWeights>| c.as_ref().map(|c| CompressorWeights { wkv: q(&c.wkv), wgate: q(&c.wgate), ape: c.ape.clone(), norm: c.norm.clone() });
                let (compressor, indexer) = (comp(&v.compressor), comp(&v.indexer));
                LayerWeights::V4(V4LayerWeights { wkv: q(&v.wkv), kv_norm: v.kv_norm.clone(), compressor, indexer })
            }
            LayerWeights::Mla(m) => LayerWeights::Mla(crate::weights::MlaLayerWeights { kv_a: q(&m.kv_a), kv_a_norm: m.kv_a_norm.clone() }),
        })
        .collect();
    Arc::new(DecoderWeights { plan: w.plan.clone(), layers, fingerprint: format!("{}:{mode}{bits}g{group}", w.fingerprint), formats: Vec::new() })
}
