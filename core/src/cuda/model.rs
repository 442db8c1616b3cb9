//! The decoder's projection weights resident on one GPU ([`GpuModel`]): per layer one bf16
//! `[N, hidden]` matrix holding every projection of the layer (so a chunk of a layer is one
//! GEMM), and the norms, rotary frequencies and compressor parameters the kernels after it read.
//! Uploaded once per process, device and weights fingerprint.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use half::bf16;

use super::dev::{DevBuf, GpuDevice, Stream};
use crate::error::Result;
use crate::numerics::{round_bf16, Rope};
use crate::plan::{ModelPlan, V4LayerKind};
use crate::weights::{CompressorWeights, DecoderWeights, LayerWeights, Linear};

/// A [`Rope`]'s per-pair inverse frequencies, exactly. `Rope` keeps them private; its `Debug`
/// form prints every f32 in Rust's shortest round-trip notation, so parsing it back is exact.
fn rope_inv_freq(r: &Rope) -> Vec<f32> {
    let s = format!("{r:?}");
    let a = s.find("inv_freq: [").expect("Rope's Debug names inv_freq") + "inv_freq: [".len();
    let b = a + s[a..].find(']').expect("closing bracket");
    let v: Vec<f32> = s[a..b]
        .split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| t.trim().parse().expect("f32"))
        .collect();
    assert_eq!(v.len() * 2, r.dims());
    v
}

pub(crate) struct RopeDev {
    pub inv: DevBuf,
    pub pairs: usize,
    pub freq_scale: usize,
}

impl RopeDev {
    pub fn new(r: &Rope, s: sys::CUstream) -> Result<Self> {
        let inv = rope_inv_freq(r);
        Ok(RopeDev {
            pairs: inv.len(),
            inv: DevBuf::upload(&inv, s)?,
            freq_scale: r.freq_scale(),
        })
    }
}

pub(crate) struct CompDev {
    /// Column of this compressor's kv in the layer's projection output (gate follows at +od).
    pub col: usize,
    pub ratio: usize,
    pub hd: usize,
    pub od: usize,
    pub ape: DevBuf,
    pub norm: DevBuf,
    pub rope: RopeDev,
}

/// A layer's quantized projections as MLX's CPU kernel multiplies by them, for the exact GEMM
/// (`gemm_exact_quant`): every column's elements (`[ntot, hidden]` bf16), its rule (0: a bf16
/// weight, 1: affine, g > 1: an FP format's group) and group scales (f32, at `soff[column]`).
/// Uploaded only for a layer with a quantized projection: as much memory again as its weights.
pub(crate) struct QuantDev {
    pub elems: DevBuf,
    pub rule: DevBuf,
    pub scales: DevBuf,
    pub soff: DevBuf,
}

#[derive(Default)]
struct QuantCols {
    elems: Vec<bf16>,
    rule: Vec<i32>,
    scales: Vec<f32>,
    soff: Vec<i64>,
    any: bool,
}

impl QuantCols {
    fn add(&mut self, l: &Linear) {
        use crate::quant::Accumulate;
        self.elems.extend(l.w.iter().map(|&v| bf16::from_f32(v)));
        let base = self.scales.len();
        let (rule, groups) = match &l.acc {
            Accumulate::F32 => (0, 0),
            Accumulate::Bf16 => (1, 0),
            Accumulate::Bf16Groups { group, scales } => {
                self.scales.extend_from_slice(scales);
                (*group as i32, l.in_dim / group)
            }
        };
        self.any |= rule != 0;
        for r in 0..l.out_dim {
            self.rule.push(rule);
            self.soff.push((base + r * groups) as i64);
        }
    }

    fn upload(self, s: sys::CUstream) -> Result<Option<QuantDev>> {
        if !self.any {
            return Ok(None);
        }
        Ok(Some(QuantDev {
            elems: DevBuf::upload(&self.elems, s)?,
            rule: DevBuf::upload(&self.rule, s)?,
            scales: DevBuf::upload(&self.scales, s)?,
            soff: DevBuf::upload(&self.soff, s)?,
        }))
    }
}

/// One layer's resident weights: its projection matrix (every projection of the layer, `ntot`
/// outputs, dequantized) and what the kernels after it read.
pub(crate) enum LayerDev {
    V4 {
        w: DevBuf,
        quant: Option<QuantDev>,
        ntot: usize,
        hd: usize,
        size: usize,
        eps: f32,
        kv_norm: DevBuf,
        rope: RopeDev,
        comps: Vec<CompDev>,
    },
    Mla {
        w: DevBuf,
        quant: Option<QuantDev>,
        ntot: usize,
        rank: usize,
        rope_dim: usize,
        eps: f32,
        norm: DevBuf,
        rope: RopeDev,
        mscale: Option<f32>,
    },
}

impl LayerDev {
    pub fn w(&self) -> (&DevBuf, usize) {
        match self {
            LayerDev::V4 { w, ntot, .. } | LayerDev::Mla { w, ntot, .. } => (w, *ntot),
        }
    }

    pub fn quant(&self) -> Option<&QuantDev> {
        match self {
            LayerDev::V4 { quant, .. } | LayerDev::Mla { quant, .. } => quant.as_ref(),
        }
    }
}

fn bf16_of(l: &Linear, out: &mut Vec<bf16>) {
    // Dequantized once, here at upload: every format's values are exact in bf16.
    out.extend(l.dequantized().iter().map(|&v| bf16::from_f32(v)));
}

/// The decoder's projection weights and norms, resident on one GPU.
pub struct GpuModel {
    pub dev: Arc<GpuDevice>,
    pub weights: Arc<DecoderWeights>,
    pub(crate) layers: Vec<LayerDev>,
    pub(crate) hidden: usize,
    _stream: Stream,
}

impl GpuModel {
    /// Upload `weights` to device `ordinal` (once per process and fingerprint: later calls share it).
    pub fn shared(weights: Arc<DecoderWeights>, ordinal: usize) -> Result<Arc<GpuModel>> {
        /// (fingerprint, device) → the resident model.
        type Registry = Mutex<Vec<((String, usize), Arc<GpuModel>)>>;
        static MODELS: OnceLock<Registry> = OnceLock::new();
        let mut m = MODELS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let key = (weights.fingerprint.clone(), ordinal);
        if let Some((_, g)) = m.iter().find(|(k, _)| *k == key) {
            return Ok(g.clone());
        }
        let g = Arc::new(GpuModel::new(weights, ordinal)?);
        m.push((key, g.clone()));
        Ok(g)
    }

    pub fn new(weights: Arc<DecoderWeights>, ordinal: usize) -> Result<GpuModel> {
        let dev = GpuDevice::get(ordinal)?;
        dev.bind()?;
        let stream = Stream::new()?;
        let s = stream.0;
        let mut layers = Vec::new();
        match &weights.plan {
            ModelPlan::DeepseekV4(p) => {
                for (i, lw) in weights.layers.iter().enumerate() {
                    let LayerWeights::V4(lw) = lw else {
                        unreachable!("weights follow the plan")
                    };
                    let ratio = p.compress_ratios[i];
                    let kind = p.layer_kind(i);
                    let yarn = p.yarn.as_ref();
                    let wrope = match kind {
                        V4LayerKind::Window => {
                            Rope::deepseek_v4(p.rope_head_dim, p.rope_theta, None, 1)
                        }
                        _ => Rope::deepseek_v4(p.rope_head_dim, p.compress_rope_theta, yarn, 1),
                    };
                    let prope = Rope::deepseek_v4(
                        p.rope_head_dim,
                        p.compress_rope_theta,
                        yarn,
                        ratio.max(1),
                    );
                    let mut w = Vec::new();
                    let mut q = QuantCols::default();
                    bf16_of(&lw.wkv, &mut w);
                    q.add(&lw.wkv);
                    let mut col = p.head_dim;
                    let mut comps = Vec::new();
                    let add = |cw: &CompressorWeights,
                               hd: usize,
                               w: &mut Vec<bf16>,
                               q: &mut QuantCols,
                               col: &mut usize|
                     -> Result<CompDev> {
                        let od = cw.wkv.out_dim;
                        bf16_of(&cw.wkv, w);
                        bf16_of(&cw.wgate, w);
                        q.add(&cw.wkv);
                        q.add(&cw.wgate);
                        let c = CompDev {
                            col: *col,
                            ratio,
                            hd,
                            od,
                            ape: DevBuf::upload(&cw.ape, s)?,
                            norm: DevBuf::upload(&cw.norm, s)?,
                            rope: RopeDev::new(&prope, s)?,
                        };
                        *col += 2 * od;
                        Ok(c)
                    };
                    if let Some(cw) = &lw.compressor {
                        comps.push(add(cw, p.head_dim, &mut w, &mut q, &mut col)?);
                    }
                    if let Some(cw) = &lw.indexer {
                        comps.push(add(cw, p.index_head_dim, &mut w, &mut q, &mut col)?);
                    }
                    layers.push(LayerDev::V4 {
                        ntot: col,
                        w: DevBuf::upload(&w, s)?,
                        quant: q.upload(s)?,
                        hd: p.head_dim,
                        size: p.sliding_window,
                        eps: p.rms_norm_eps,
                        kv_norm: DevBuf::upload(&lw.kv_norm, s)?,
                        rope: RopeDev::new(&wrope, s)?,
                        comps,
                    });
                }
            }
            ModelPlan::Mla(p) => {
                let (rope, mscale) = match &p.yarn {
                    Some(y) => {
                        let m = y.magnitude();
                        (
                            Rope::mla_yarn(p.rope_head_dim, p.rope_theta, y),
                            (m != 1.0).then(|| round_bf16(m as f32).to_f32()),
                        )
                    }
                    None => (Rope::plain(p.rope_head_dim, p.rope_theta), None),
                };
                for lw in &weights.layers {
                    let LayerWeights::Mla(lw) = lw else {
                        unreachable!("weights follow the plan")
                    };
                    let mut w = Vec::new();
                    let mut q = QuantCols::default();
                    bf16_of(&lw.kv_a, &mut w);
                    q.add(&lw.kv_a);
                    layers.push(LayerDev::Mla {
                        ntot: p.kv_lora_rank + p.rope_head_dim,
                        w: DevBuf::upload(&w, s)?,
                        quant: q.upload(s)?,
                        rank: p.kv_lora_rank,
                        rope_dim: p.rope_head_dim,
                        eps: p.latent_norm_eps,
                        norm: DevBuf::upload(&lw.kv_a_norm, s)?,
                        rope: RopeDev::new(&rope, s)?,
                        mscale,
                    });
                }
            }
        }
        stream.sync()?;
        let hidden = weights.plan.hidden_size();
        Ok(GpuModel {
            dev,
            weights,
            layers,
            hidden,
            _stream: stream,
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Multiply-adds per token over all layers (the projections' FLOPs are twice this).
    pub fn macs_per_token(&self) -> usize {
        self.layers.iter().map(|l| l.w().1 * self.hidden).sum()
    }
}
