//! The quantized formats MLX writes, as the decoder's projections store them, and how MLX's CPU
//! multiplies by each (`mlx/backend/cpu/quantized.cpp`, mlx 0.32).
//!
//! `config.json`'s `quantization` (or `quantization_config`) block holds a default format and,
//! per module path, an override or `false` (not quantized), exactly as mlx-lm's loader reads it.
//! A format is a [`QuantSpec`]: `affine` (bits 2, 3, 4, 5, 6, 8; groups 32, 64, 128; bf16 scales
//! and biases), `mxfp4` and `mxfp8` (group 32, E8M0 scales), `nvfp4` (group 16, E4M3 scales).
//!
//! Unpacking gives each weight element as MLX's kernel forms it, and [`Accumulate`] says how the
//! kernel sums the products; [`crate::numerics::linear`] runs that sum.

use std::collections::BTreeMap;
use std::fmt;

use half::bf16;
use serde_json::Value;

use crate::error::{CoreError, Result};

/// One quantized format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub mode: QuantMode,
    pub bits: u32,
    pub group_size: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Mxfp8,
    Nvfp4,
}

impl QuantMode {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "affine" => QuantMode::Affine,
            "mxfp4" => QuantMode::Mxfp4,
            "mxfp8" => QuantMode::Mxfp8,
            "nvfp4" => QuantMode::Nvfp4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }

    /// mlx-lm's `defaults_for_mode`: the (group, bits) a `null` field stands for.
    fn defaults(self) -> (usize, u32) {
        match self {
            QuantMode::Affine => (64, 4),
            QuantMode::Mxfp4 => (32, 4),
            QuantMode::Nvfp4 => (16, 4),
            QuantMode::Mxfp8 => (32, 8),
        }
    }
}

impl fmt::Display for QuantSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.mode {
            QuantMode::Affine => write!(f, "affine {}-bit g{}", self.bits, self.group_size),
            m => f.write_str(m.name()),
        }
    }
}

impl QuantSpec {
    /// Whether MLX quantizes this way (its `quantize` refuses every other combination).
    fn check(&self) -> std::result::Result<(), String> {
        let ok = match self.mode {
            QuantMode::Affine => matches!(self.bits, 2 | 3 | 4 | 5 | 6 | 8) && matches!(self.group_size, 32 | 64 | 128),
            QuantMode::Mxfp4 => self.bits == 4 && self.group_size == 32,
            QuantMode::Mxfp8 => self.bits == 8 && self.group_size == 32,
            QuantMode::Nvfp4 => self.bits == 4 && self.group_size == 16,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "mode {} with bits {} and group {} is not a format MLX writes (affine: bits 2-6 or 8, group 32/64/128; mxfp4: 4/32; mxfp8: 8/32; nvfp4: 4/16)",
                self.mode.name(),
                self.bits,
                self.group_size
            ))
        }
    }

    /// The packed weight's width in u32 words for `in_dim` inputs.
    pub fn packed_words(&self, in_dim: usize) -> usize {
        in_dim * self.bits as usize / 32
    }
}

/// `config.json`'s quantization table: the default, and per module an override or `None`
/// (`false`: that module is not quantized).
#[derive(Clone, Debug, Default)]
pub struct Quantization {
    default: Option<QuantSpec>,
    per_module: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    pub fn from_config(cfg: &Value) -> Result<Self> {
        let q = match cfg.get("quantization").or_else(|| cfg.get("quantization_config")) {
            None | Some(Value::Null) => return Ok(Quantization::default()),
            Some(Value::Object(m)) => m,
            Some(other) => return Err(CoreError::config("quantization", format!("expected an object, got {other}"))),
        };
        let default = spec(q, "quantization")?;
        let mut per_module = BTreeMap::new();
        for (k, v) in q {
            match v {
                Value::Object(m) => {
                    if let Some(s) = spec(m, &format!("quantization.{k}"))? {
                        per_module.insert(k.clone(), Some(s));
                    }
                }
                Value::Bool(false) => {
                    per_module.insert(k.clone(), None);
                }
                Value::Bool(true) => {
                    per_module.insert(k.clone(), default.clone());
                }
                _ => {}
            }
        }
        Ok(Quantization { default, per_module })
    }

    /// The format `module` is stored in, as mlx-lm's loader decides it: its own entry (which may
    /// say "not quantized"), else the default.
    pub fn for_module(&self, module: &str) -> Option<&QuantSpec> {
        match self.per_module.get(module) {
            Some(entry) => entry.as_ref(),
            None => self.default.as_ref(),
        }
    }
}

/// A format block (`{"group_size", "bits", "mode"}`), or `None` where the object has neither
/// `bits` nor `group_size` (a non-MLX block such as an FP8 GPU checkpoint's).
fn spec(m: &serde_json::Map<String, Value>, field: &str) -> Result<Option<QuantSpec>> {
    if !m.contains_key("bits") && !m.contains_key("group_size") {
        return Ok(None);
    }
    let mode_name = match m.get("mode") {
        None | Some(Value::Null) => "affine",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(CoreError::config(format!("{field}.mode"), format!("expected a string, got {other}"))),
    };
    let mode = QuantMode::parse(mode_name).ok_or_else(|| {
        CoreError::config(format!("{field}.mode"), format!("quantization mode {mode_name:?} is not one MLX writes (affine, mxfp4, mxfp8, nvfp4)"))
    })?;
    let (dg, db) = mode.defaults();
    // mlx-lm writes `null` for a field left to the mode's default (e.g. `--quant-predicate`
    // without `--q-group-size`); its loader then quantizes with that default.
    let num = |k: &str, d: u64| -> Result<u64> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(v) => v.as_u64().ok_or_else(|| CoreError::config(format!("{field}.{k}"), format!("expected an integer, got {v}"))),
        }
    };
    let s = QuantSpec { mode, bits: num("bits", db as u64)? as u32, group_size: num("group_size", dg as u64)? as usize };
    s.check().map_err(|why| CoreError::config(field, why))?;
    Ok(Some(s))
}

/// How MLX's CPU sums `x·Wᵀ` for a projection, with `x` bf16.
#[derive(Clone, Debug, PartialEq)]
pub enum Accumulate {
    /// A dense bf16 weight: MLX's matmul is a float32 sum in index order, rounded once to bf16.
    F32,
    /// `affine` (`_qmm_t`): every operation in bf16 — the element `bf16(bf16(scale·q) + bias)`,
    /// the product `bf16(x·w)`, the running sum `bf16(sum + product)`.
    Bf16,
    /// `mxfp4`, `mxfp8`, `nvfp4` (`fp_qmm_t`): per group a bf16 running sum of bf16 products of
    /// `x` and the unscaled element, then `sum = bf16(sum + bf16(scale·group_sum))`. `scales`:
    /// `[out, in / group]`, each exact in bf16.
    Bf16Groups { group: usize, scales: Vec<f32> },
}

/// A quantized projection unpacked: each element as MLX's kernel forms it (`w`, `[out, in]`,
/// exact in bf16) and the kernel's summation.
pub(crate) fn unpack(spec: &QuantSpec, packed: &[u8], scales: &[u8], biases: Option<&[bf16]>, out_dim: usize, in_dim: usize) -> (Vec<f32>, Accumulate) {
    let g = spec.group_size;
    let groups = in_dim / g;
    let row_bytes = spec.packed_words(in_dim) * 4;
    let bits = spec.bits as usize;
    let mut w = Vec::with_capacity(out_dim * in_dim);
    match spec.mode {
        QuantMode::Affine => {
            let scales: Vec<bf16> = scales.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
            let biases = biases.expect("affine carries biases");
            for r in 0..out_dim {
                let row = &packed[r * row_bytes..(r + 1) * row_bytes];
                for c in 0..in_dim {
                    let (s, b) = (scales[r * groups + c / g].to_f32(), biases[r * groups + c / g].to_f32());
                    let q = bits_at(row, c * bits, bits) as f32;
                    let e = bf16::from_f32(bf16::from_f32(s * q).to_f32() + b);
                    w.push(e.to_f32());
                }
            }
            (w, Accumulate::Bf16)
        }
        mode => {
            for r in 0..out_dim {
                let row = &packed[r * row_bytes..(r + 1) * row_bytes];
                for c in 0..in_dim {
                    let q = bits_at(row, c * bits, bits) as u8;
                    w.push(if mode == QuantMode::Mxfp8 { e4m3_to_f32(q) } else { FP4[q as usize] });
                }
            }
            let scales = scales.iter().map(|&s| if mode == QuantMode::Nvfp4 { e4m3_to_f32(s) } else { e8m0_bf16(s) }).collect();
            (w, Accumulate::Bf16Groups { group: g, scales })
        }
    }
}

/// The weight dequantized (`mx.dequantize`): unpacked elements `w` (`[rows, in_dim]`) with the
/// FP formats' group scales applied; exact in bf16 for every format.
pub(crate) fn dequantize(w: &[f32], acc: &Accumulate, in_dim: usize) -> Vec<f32> {
    match acc {
        Accumulate::F32 | Accumulate::Bf16 => w.to_vec(),
        Accumulate::Bf16Groups { group, scales } => {
            let groups = in_dim / group;
            w.iter().enumerate().map(|(i, &e)| e * scales[(i / in_dim) * groups + (i % in_dim) / group]).collect()
        }
    }
}

/// `width` bits starting at bit `at` of a little-endian bit stream: MLX packs every width this
/// way (2/4/8 bits within a byte from the low end; 3, 5 and 6 bits across bytes).
fn bits_at(row: &[u8], at: usize, width: usize) -> u32 {
    let (byte, shift) = (at / 8, at % 8);
    let mut v = row[byte] as u32;
    if byte + 1 < row.len() {
        v |= (row[byte + 1] as u32) << 8;
    }
    (v >> shift) & ((1 << width) - 1)
}

/// MLX's FP4 (E2M1) table, low nibble first.
pub(crate) const FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// OCP MX e4m3 element → f32 (no infinities; 0x7f/0xff are NaN).
pub(crate) fn e4m3_to_f32(b: u8) -> f32 {
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

/// An E8M0 group scale as MLX's CPU forms it: the bf16 whose bits are `s << 7` (so 0xff is
/// +inf), and 0 taken as the smallest subnormal 2^-127.
fn e8m0_bf16(s: u8) -> f32 {
    bf16::from_bits(if s == 0 { 0x40 } else { (s as u16) << 7 }).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_and_e8m0_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert_eq!(e8m0_bf16(127), 1.0);
        assert_eq!(e8m0_bf16(130), 8.0);
        assert_eq!(e8m0_bf16(0), 2f32.powi(-127));
        assert_eq!(e8m0_bf16(0xff), f32::INFINITY);
    }

    #[test]
    fn bit_stream_matches_mlx_extract_bits() {
        // mlx's extract_bits for 3 bits: w_out[2] = ((w[0] & 0xc0) >> 6) + ((w[1] & 0x1) << 2).
        let row = [0b1100_0000u8, 0b0000_0001, 0, 0];
        assert_eq!(bits_at(&row, 6, 3), 0b111);
        // 6 bits: w_out[1] = ((w[0] >> 6) & 3) + ((w[1] & 0xf) << 2).
        let row = [0b0100_0000u8, 0b0000_1010, 0, 0];
        assert_eq!(bits_at(&row, 6, 6), 0b10_1001);
        // 4 bits: low nibble first.
        assert_eq!(bits_at(&[0xab, 0, 0, 0], 0, 4), 0xb);
        assert_eq!(bits_at(&[0xab, 0, 0, 0], 4, 4), 0xa);
    }

    #[test]
    fn config_defaults_overrides_and_false() {
        let cfg: Value = serde_json::from_str(
            r#"{"quantization": {"group_size": 64, "bits": 4,
                "model.layers.0.attn.wkv": {"group_size": null, "bits": 6, "mode": "affine"},
                "model.layers.1.attn.wkv": false,
                "model.layers.2.attn.wkv": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}}"#,
        )
        .unwrap();
        let q = Quantization::from_config(&cfg).unwrap();
        assert_eq!(q.for_module("model.layers.0.attn.wkv").unwrap().to_string(), "affine 6-bit g64");
        assert!(q.for_module("model.layers.1.attn.wkv").is_none());
        assert_eq!(q.for_module("model.layers.2.attn.wkv").unwrap().mode, QuantMode::Mxfp4);
        assert_eq!(q.for_module("model.layers.9.attn.wkv").unwrap().to_string(), "affine 4-bit g64");
        let bad: Value = serde_json::from_str(r#"{"quantization": {"group_size": 48, "bits": 4}}"#).unwrap();
        let e = Quantization::from_config(&bad).unwrap_err().to_string();
        assert!(e.contains("group 48"), "{e}");
        let bad: Value = serde_json::from_str(r#"{"quantization": {"group_size": 32, "bits": 4, "mode": "int4"}}"#).unwrap();
        assert!(Quantization::from_config(&bad).unwrap_err().to_string().contains("int4"));
    }
}
