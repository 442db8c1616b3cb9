//! The float32 arithmetic of DeepSeek-V4.1's cache, operation by operation as mlx-lm's
//! `deepseek_v41` runs it on MLX's CPU (mlx 0.32.3), next to the bf16 primitives it shares with
//! the other families ([`crate::numerics`]).
//!
//! V4.1 keeps its compressors in float32 (`cast_predicate`), so the compressed KV, the index keys
//! and the pending rows are float32 arrays; its window rows are bf16 but rotated in float32 and
//! fake-quantized to FP8. Every function names the MLX behaviour it reproduces.

use half::{bf16, f16};

// `dot`: strictly left to right, no fused multiply-add: MLX's CPU float32 matmul is the reference
// BLAS `sgemm` its Linux wheel ships (`libblas` 3.10), whose inner loop is `temp = temp + a*b`.
use crate::numerics::{dot_sequential as dot, mlx_sincos, round_bf16};

/// `y[L,N] = x[L,K] · w[N,K]ᵀ` in float32 (`nn.Linear` with a float32 weight, or a bf16 input
/// promoted to float32): no rounding beyond float32's own.
pub fn linear_f32(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize, out: &mut Vec<f32>) {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(w.len(), n * k);
    out.clear();
    out.resize(rows * n, 0.0);
    let run = |xs: &[f32], os: &mut [f32]| {
        for (xr, or) in xs.chunks_exact(k).zip(os.chunks_exact_mut(n)) {
            for (j, o) in or.iter_mut().enumerate() {
                *o = dot(xr, &w[j * k..(j + 1) * k]);
            }
        }
    };
    // Rows are independent, so splitting them across threads changes no rounding.
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(rows.max(1));
    if threads <= 1 || rows * n * k < (1 << 22) {
        run(x, out);
        return;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (xs, os) in x.chunks(per * k).zip(out.chunks_mut(per * n)) {
            s.spawn(move || run(xs, os));
        }
    });
}

/// `mx.fast.rms_norm(x, w, eps)` with a float32 result (a float32 input, or a float32 weight):
/// MLX's CPU runs the composite `x · rsqrt(mean(x²) + eps)` in float32 (a sequential sum times
/// `1/D`, `rsqrt` as `1/sqrt`), then multiplies by the weight in float32. `weight` is the stored
/// float32 or bf16 weight, widened exactly.
pub fn rms_norm_f32(x: &mut [f32], dim: usize, weight: &[f32], eps: f32) {
    debug_assert_eq!(weight.len(), dim);
    let inv_dim = (1.0f64 / dim as f64) as f32;
    for row in x.chunks_exact_mut(dim) {
        let mut ss = 0f32;
        for v in row.iter() {
            ss += v * v;
        }
        let n = 1.0f32 / (ss * inv_dim + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = (*v * n) * w;
        }
    }
}

/// `mx.fast.rope(traditional=True, freqs=…)` on a float32 row's trailing `2·inv_freqs.len()`
/// features at position `pos` (MLX's CPU fallback: `(arange + offset) · scale` in float32, times
/// `1/freqs`, MLX's own sin/cos kept in float32, then `x1·c − x2·s` and `x1·s + x2·c`, each
/// product rounded to float32 on its own).
pub fn rope_f32(row: &mut [f32], inv_freqs: &[f32], pos: f32) {
    let dims = 2 * inv_freqs.len();
    let width = row.len();
    let tail = &mut row[width - dims..];
    for (j, inv) in inv_freqs.iter().enumerate() {
        let (s, c) = mlx_sincos(pos * inv);
        let (x1, x2) = (tail[2 * j], tail[2 * j + 1]);
        tail[2 * j] = x1 * c - x2 * s;
        tail[2 * j + 1] = x1 * s + x2 * c;
    }
}

/// The position `mx.fast.rope` rotates row `i` of a call with `offset` and `scale` to:
/// `(f32(i) + f32(offset)) · f32(scale)`.
#[inline]
pub fn rope_position(i: usize, offset: usize, scale: usize) -> f32 {
    (i as f32 + offset as f32) * scale as f32
}

/// `mx.to_fp8`: float32 → E4M3 (round to nearest even, subnormals by a magic-number add,
/// saturating to ±448 = `0x7e`), MLX's `ToFP8` bit for bit.
pub fn to_fp8(f: f32) -> u8 {
    const FP8_MAX: u32 = 543 << 21;
    const DENORM: u32 = 141 << 23;
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let b = bits ^ sign;
    let out = if b >= FP8_MAX {
        0x7e
    } else if b < 121 << 23 {
        (f32::from_bits(b) + f32::from_bits(DENORM)).to_bits().wrapping_sub(DENORM) as u8
    } else {
        let odd = (b >> 20) & 1;
        (b.wrapping_add(((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7ffff)).wrapping_add(odd) >> 20) as u8
    };
    out | (sign >> 24) as u8
}

/// `mx.from_fp8(x, float32)`: MLX's `FromFP8` (the magnitude as an f16 bit pattern times 256,
/// the sign applied last, so `0x80` is −0).
pub fn from_fp8(x: u8) -> f32 {
    let v = f16::from_bits(((x & 127) as u16) << 7).to_f32() * 256.0;
    if x & 128 != 0 {
        -v
    } else {
        v
    }
}

/// `mx.clip(x, lo, hi)`: `minimum(maximum(x, lo), hi)` with MLX's NaN-propagating min/max.
#[inline]
fn clip(x: f32, lo: f32, hi: f32) -> f32 {
    let m = if x.is_nan() || x > lo { x } else { lo };
    if m.is_nan() || m < hi {
        m
    } else {
        hi
    }
}

/// `mx.max(mx.abs(block))` (NaN-propagating) then `mx.maximum(…, floor)`.
#[inline]
fn amax(block: &[f32], floor: f32) -> f32 {
    let mut m = f32::NEG_INFINITY;
    for v in block {
        let a = v.abs();
        if a.is_nan() || m.is_nan() {
            m = f32::NAN;
        } else if a > m {
            m = a;
        }
    }
    if m.is_nan() || m > floor {
        m
    } else {
        floor
    }
}

/// `_fake_quant_fp8(x, 32)` on bf16 rows in place: per 32-value block, a power-of-two scale
/// `2^ceil(log2(amax/448))` (amax at least 1e-4), the block divided by it, clipped, rounded
/// through E4M3 and scaled back (exact in bf16). Rows whose width is not a multiple of the block
/// pass through, as in mlx-lm.
pub fn fake_quant_fp8_bf16(x: &mut [bf16], width: usize, block: usize) {
    if width % block != 0 {
        return;
    }
    let mut vals = vec![0f32; block];
    for chunk in x.chunks_exact_mut(block) {
        for (d, s) in vals.iter_mut().zip(chunk.iter()) {
            *d = s.to_f32();
        }
        let scale = 2f32.powf((amax(&vals, 1e-4f32) / 448.0f32).log2().ceil());
        for (d, &v) in chunk.iter_mut().zip(&vals) {
            let q = clip(v / scale, -448.0, 448.0);
            *d = round_bf16(from_fp8(to_fp8(q)) * scale);
        }
    }
}

const FP4: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// `_round_fp4`: the nearest FP4 (E2M1) magnitude by mlx-lm's thresholds (ties at 0.25, 1.25,
/// 2.5 and 5 go down, at 0.75, 1.75 and 3.5 up), times `mx.sign(x)` (so a negative value that
/// rounds to 0 gives −0, and ±0 gives +0).
#[inline]
fn round_fp4(x: f32) -> f32 {
    let mag = x.abs();
    let mut idx = 0;
    for t in [0.25f32, 1.25, 2.5, 5.0] {
        idx += (mag > t) as usize;
    }
    for t in [0.75f32, 1.75, 3.5] {
        idx += (mag >= t) as usize;
    }
    let sign = if x < 0.0 {
        -1.0f32
    } else if x > 0.0 {
        1.0
    } else {
        0.0
    };
    sign * FP4[idx]
}

/// `_fake_quant_fp4(x, block_size=block, e4m3_scale=…)` on float32 rows in place. The scale is
/// `amax/6` rounded through E4M3 (floor `6·2⁻⁹`), or a power of two `2^ceil(log2(amax/6))`
/// (floor `6·2⁻¹²⁶`).
pub fn fake_quant_fp4(x: &mut [f32], width: usize, block: usize, e4m3_scale: bool) {
    if width % block != 0 {
        return;
    }
    let floor = if e4m3_scale { 6.0f32 * 2f32.powi(-9) } else { 6.0f32 * 2f32.powi(-126) };
    for chunk in x.chunks_exact_mut(block) {
        let a = amax(chunk, floor);
        let scale = if e4m3_scale { from_fp8(to_fp8(a / 6.0f32)) } else { 2f32.powf((a / 6.0f32).log2().ceil()) };
        for v in chunk.iter_mut() {
            *v = round_fp4(clip(*v / scale, -6.0, 6.0)) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trips_every_code() {
        for b in 0u8..=255 {
            if b & 0x7f == 0x7f {
                continue; // NaN codes: never produced (saturation stops at 0x7e)
            }
            assert_eq!(to_fp8(from_fp8(b)), b, "code {b:#x}");
        }
        assert_eq!(from_fp8(0x7e), 448.0);
        assert_eq!(from_fp8(0x01), 2f32.powi(-9));
        assert_eq!(to_fp8(1000.0), 0x7e);
        assert_eq!(to_fp8(-1000.0), 0xfe);
        // Ties to even: 1 + 1/16 lies between 1 (even mantissa) and 1 + 1/8.
        assert_eq!(from_fp8(to_fp8(1.0 + 1.0 / 16.0)), 1.0);
        assert_eq!(from_fp8(to_fp8(1.0 + 3.0 / 16.0)), 1.25);
        assert_eq!(from_fp8(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn fp4_thresholds_and_signed_zero() {
        assert_eq!(round_fp4(0.25), 0.0);
        assert_eq!(round_fp4(0.2501), 0.5);
        assert_eq!(round_fp4(0.75), 1.0);
        assert_eq!(round_fp4(2.5), 2.0);
        assert_eq!(round_fp4(-5.5), -6.0);
        assert_eq!(round_fp4(-0.1).to_bits(), (-0.0f32).to_bits());
        assert_eq!(round_fp4(-0.0).to_bits(), 0);
    }

    #[test]
    fn fp8_fake_quant_keeps_a_block_scale() {
        let mut row: Vec<bf16> = (0..32).map(|i| bf16::from_f32(i as f32 * 0.37 - 5.0)).collect();
        fake_quant_fp8_bf16(&mut row, 32, 32);
        // amax 6.47 -> scale 2^ceil(log2(6.47/448)) = 2^-6; every value is e4m3 * 2^-6.
        for v in &row {
            let q = v.to_f32() * 64.0;
            assert_eq!(from_fp8(to_fp8(q)), q);
        }
    }
}
