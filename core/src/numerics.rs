//! The decoder's arithmetic, operation by operation, in the order MLX performs it.
//!
//! Every function here mirrors one MLX CPU kernel as the decode venv runs it (mlx 0.32,
//! `mlx[cpu]`), down to where values are rounded to bf16. Bit-exactness against MLX depends on
//! these details, so each one says which MLX behaviour it reproduces; the parity tests in
//! `tests/` check them against real MLX.

use half::bf16;

use crate::quant::Accumulate;

/// Round an f32 to bf16 (round to nearest, ties to even), as every MLX cast does.
#[inline]
pub fn round_bf16(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// bf16 → f32, exact.
#[inline]
pub fn widen(x: bf16) -> f32 {
    x.to_f32()
}

/// `y[L,N] = x[L,K] · w[N,K]ᵀ` in bf16, summed as MLX's CPU sums it for the projection's storage
/// ([`Accumulate`]): a bf16 weight's matmul is a float32 sum in index order rounded once to bf16;
/// a quantized one's `quantized_matmul` rounds every step to bf16 (`mlx/backend/cpu/quantized.cpp`).
///
/// `w` holds the elements as MLX's kernel forms them (`[out, in]`, exact in f32).
pub fn linear(x: &[bf16], rows: usize, k: usize, w: &[f32], acc: &Accumulate, n: usize, out: &mut Vec<bf16>) {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(w.len(), n * k);
    out.clear();
    out.resize(rows * n, bf16::ZERO);
    // Rows are independent, so splitting them across threads changes no rounding.
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(rows.max(1));
    let work = rows * n * k;
    if threads <= 1 || work < (1 << 22) {
        linear_rows(x, k, w, acc, n, out);
        return;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (xs, os) in x.chunks(per * k).zip(out.chunks_mut(per * n)) {
            s.spawn(move || linear_rows(xs, k, w, acc, n, os));
        }
    });
}

fn linear_rows(x: &[bf16], k: usize, w: &[f32], acc: &Accumulate, n: usize, out: &mut [bf16]) {
    let mut xf = vec![0f32; k];
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for (dst, src) in xf.iter_mut().zip(xr) {
            *dst = src.to_f32();
        }
        for (j, o) in or.iter_mut().enumerate() {
            let wr = &w[j * k..(j + 1) * k];
            *o = match acc {
                Accumulate::F32 => round_bf16(dot_sequential(&xf, wr)),
                Accumulate::Bf16 => dot_bf16(&xf, wr),
                Accumulate::Bf16Groups { group, scales } => {
                    let groups = k / group;
                    let mut sum = bf16::ZERO;
                    for (g, (xg, wg)) in xf.chunks_exact(*group).zip(wr.chunks_exact(*group)).enumerate() {
                        let gsum = dot_bf16(xg, wg);
                        sum = round_bf16(sum.to_f32() + round_bf16(scales[j * groups + g] * gsum.to_f32()).to_f32());
                    }
                    sum
                }
            };
        }
    }
}

/// MLX's `bfloat16_t` dot product: each product rounded to bf16, then the running sum (computed in
/// f32) rounded to bf16, strictly left to right.
#[inline]
fn dot_bf16(a: &[f32], b: &[f32]) -> bf16 {
    let mut acc = bf16::ZERO;
    for (x, y) in a.iter().zip(b) {
        acc = round_bf16(acc.to_f32() + round_bf16(x * y).to_f32());
    }
    acc
}

/// Sequential f32 dot product. Written as four independent chains would change the rounding;
/// this must stay strictly left to right.
#[inline]
pub(crate) fn dot_sequential(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (x, y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

/// `mx.fast.rms_norm(x, w, eps)` on bf16 rows, in place: the normaliser is
/// `1/sqrt(Σx²/D + eps)` in f32 (sequential sum), then two roundings:
/// `bf16(x·n)` and then `bf16(that·w)`.
pub fn rms_norm_rows(x: &mut [bf16], dim: usize, weight: &[bf16], eps: f32) {
    debug_assert_eq!(weight.len(), dim);
    for row in x.chunks_exact_mut(dim) {
        let mut ss = 0f32;
        for v in row.iter() {
            let f = v.to_f32();
            ss += f * f;
        }
        let mean = ss / dim as f32;
        let n = 1.0f32 / (mean + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            let y = round_bf16(v.to_f32() * n);
            *v = round_bf16(y.to_f32() * w.to_f32());
        }
    }
}

/// MLX's CPU `exp` (Cephes-style: 2^round(x·log2e) times a degree-6 polynomial evaluated with
/// fused multiply-adds). It differs from a correctly rounded exp in the last bits, and softmax
/// weights inherit that, so the pooling must use this one.
#[inline]
// MLX's own constants, digit for digit (its log2(e) is rounded, not `f32::consts::LOG2_E`).
#[allow(clippy::approx_constant, clippy::excessive_precision)]
pub fn mlx_exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 88.0 {
        return f32::INFINITY;
    }
    if x < -88.0 {
        return 0.0;
    }
    let t = x * 1.442695f32;
    let ipart = (t + 0.5).floor();
    let fpart = t - ipart;
    let mut p = 1.535336188319500e-4f32;
    p = p.mul_add(fpart, 1.339887440266574e-3f32);
    p = p.mul_add(fpart, 9.618437357674640e-3f32);
    p = p.mul_add(fpart, 5.550332471162809e-2f32);
    p = p.mul_add(fpart, 2.402264791363012e-1f32);
    p = p.mul_add(fpart, 6.931472028550421e-1f32);
    p = p.mul_add(fpart, 1.0f32);
    let e = ((ipart as i32 + 127) << 23) as u32;
    f32::from_bits(e) * p
}

/// Softmax over one row (already f32), written to `out`: max, `exp(v - max)` with
/// [`mlx_exp`], a sequential sum, then a division.
///
/// This is MLX's composite softmax, which `mx.softmax` uses for any axis but the last (the
/// compressors pool over axis -2; `precise=True` only widens bf16 to f32 first). The fused
/// last-axis kernel multiplies by the reciprocal instead, which rounds differently.
pub fn softmax_row(vals: &[f32], out: &mut [f32]) {
    let mut m = f32::NEG_INFINITY;
    for &v in vals {
        m = m.max(v);
    }
    let mut norm = 0f32;
    for (o, &v) in out.iter_mut().zip(vals) {
        *o = mlx_exp(v - m);
        norm += *o;
    }
    for o in out.iter_mut() {
        *o /= norm;
    }
}

/// Rotary embedding tables in MLX's `mx.fast.rope(traditional=True, freqs=…)` form.
///
/// `inv_freq[j]` is `1/freqs[j]` in f32 exactly as the kernel derives it; angles are
/// `f32(pos) · inv_freq[j]`, cos/sin are the correctly rounded f32 values rounded to bf16, and
/// each rotated output is `bf16(bf16(x1·c) ∓ bf16(x2·s))`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Per rotated pair, `1/freq` as the kernel computes it.
    inv_freq: Vec<f32>,
    /// Positions are divided by this before rotation (MLX: `offset // freq_scale`).
    freq_scale: usize,
}

impl Rope {
    /// From the `freqs` array a model passes to `mx.fast.rope` (already divided by any
    /// `freq_scale`): the kernel rotates by `pos / freqs[j]`, computed as `pos · (1/freqs[j])`.
    pub fn from_freqs(freqs: &[f32], freq_scale: usize) -> Self {
        Rope { inv_freq: freqs.iter().map(|f| 1.0f32 / f).collect(), freq_scale: freq_scale.max(1) }
    }

    /// DeepSeek-V4's `DeepseekV4RoPE`: base `base`, optional YaRN blend, `freq_scale` for pooled
    /// rows. Every step is the f32 operation the MLX module performs.
    pub fn deepseek_v4(dims: usize, base: f32, yarn: Option<&Yarn>, freq_scale: usize) -> Self {
        let half = dims / 2;
        let mut inv: Vec<f32> = (0..half).map(|j| 1.0f32 / pow_f32(base, (2 * j) as f32 / dims as f32)).collect();
        if let Some(y) = yarn {
            let (low, high) = y.correction_range(dims, base);
            let factor = y.factor as f32;
            for (j, v) in inv.iter_mut().enumerate() {
                let ramp = ((j as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let smooth = 1.0f32 - ramp;
                let a = (*v / factor) * (1.0f32 - smooth);
                *v = a + *v * smooth;
            }
        }
        let mut freqs: Vec<f32> = inv.iter().map(|v| 1.0f32 / v).collect();
        if freq_scale != 1 {
            for f in freqs.iter_mut() {
                *f /= freq_scale as f32;
            }
        }
        Self::from_freqs(&freqs, freq_scale)
    }

    /// mlx-lm's `YarnRoPE` (DeepSeek-V3 style MLA): its `_freqs` formula in f32.
    pub fn mla_yarn(dims: usize, base: f32, y: &Yarn) -> Self {
        let half = dims / 2;
        let (low, high) = y.correction_range(dims, base);
        let factor = y.factor as f32;
        let freqs: Vec<f32> = (0..half)
            .map(|j| {
                let extra = pow_f32(base, (2 * j) as f32 / dims as f32);
                let inter = factor * extra;
                let ramp = ((j as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let mask = 1.0f32 - ramp;
                (inter * extra) / (inter * mask + extra * (1.0f32 - mask))
            })
            .collect();
        Self::from_freqs(&freqs, 1)
    }

    /// Plain RoPE with a base (`nn.RoPE`, `mx.fast.rope(base=…)`, scale 1). MLX's CPU rope
    /// derives the inverse frequencies itself (`fast.cpp`, the fallback the CPU runs):
    /// `exp(arange(0, -dims/2, -1) · f32(logf(base) / (dims/2)))`, an f32 multiply and MLX's own
    /// `exp` ([`mlx_exp`]), not `base ** (-2j/dims)`. (Metal's kernel computes
    /// `exp2(-j/(dims/2) · log2(base))` instead; that path is unverified here.)
    pub fn plain(dims: usize, base: f32) -> Self {
        let half = dims / 2;
        // `std::log(float)` is the platform's logf, as Rust's `f32::ln` is.
        let coef = base.ln() / half as f32;
        Rope { inv_freq: (0..half).map(|j| mlx_exp(-(j as f32) * coef)).collect(), freq_scale: 1 }
    }

    /// Per rotated pair, `1/freqs[j]` as the kernel derives it: for a caller that rotates in
    /// another precision (DeepSeek-V4.1 rotates float32 rows, `crate::family::v41`).
    pub fn inv_freqs(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Number of rotated features (the trailing ones of a row).
    pub fn dims(&self) -> usize {
        self.inv_freq.len() * 2
    }

    pub fn freq_scale(&self) -> usize {
        self.freq_scale
    }

    /// Rotate the trailing `dims()` features of each `width`-wide row in place. Row `i` sits at
    /// position `offset / freq_scale + i`; the leading features pass through untouched.
    pub fn apply(&self, rows: &mut [bf16], width: usize, offset: usize) {
        let dims = self.dims();
        debug_assert!(dims <= width);
        let nope = width - dims;
        let base_pos = offset / self.freq_scale;
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let pos = (base_pos + i) as f32;
            // MLX rotates the leading features too, by angle 0 (infinite frequency): cos 1,
            // sin 0. That is the identity except for a -0.0 paired with a negative neighbour,
            // which `x1 - x2·0` turns into +0.0; keep that bit-for-bit.
            for pair in row[..nope].chunks_exact_mut(2) {
                let (x1, x2) = (pair[0].to_f32(), pair[1].to_f32());
                pair[0] = round_bf16(x1 - x2 * 0.0);
                pair[1] = round_bf16(x1 * 0.0 + x2);
            }
            let tail = &mut row[nope..];
            for (j, inv) in self.inv_freq.iter().enumerate() {
                let theta = pos * inv;
                let (s, c) = mlx_sincos(theta);
                let c = round_bf16(c).to_f32();
                let s = round_bf16(s).to_f32();
                let x1 = tail[2 * j].to_f32();
                let x2 = tail[2 * j + 1].to_f32();
                let a = round_bf16(x1 * c).to_f32();
                let b = round_bf16(x2 * s).to_f32();
                let d = round_bf16(x1 * s).to_f32();
                let e = round_bf16(x2 * c).to_f32();
                tail[2 * j] = round_bf16(a - b);
                tail[2 * j + 1] = round_bf16(d + e);
            }
        }
    }
}

/// MLX's CPU `sin`/`cos` (`simd::sincos`, Cephes single precision: octant from `x·4/π`
/// truncated to an integer, a three-part fused reduction, two degree-3 polynomials), with its
/// hand-over to the platform's `sinf`/`cosf` past `|x| > 2^23`, one element at a time as the
/// CPU backend runs it off Accelerate. Not correctly rounded: a correctly rounded cos/sin
/// differs from it in the last f32 bits, which after the bf16 rounding changes about one
/// rotated value in 250,000.
#[allow(clippy::excessive_precision)]
pub fn mlx_sincos(v: f32) -> (f32, f32) {
    if v.abs() > 8388608.0 {
        return (v.sin(), v.cos());
    }
    let x = v.abs();
    let y = x * 1.27323954473516f32;
    let emm2 = ((y as u32).wrapping_add(1)) & !1u32;
    let y = emm2 as f32;
    let poly_sin_first = (emm2 & 2) != 0;
    let mut x = y.mul_add(-0.78515625f32, x);
    x = y.mul_add(-2.4187564849853515625e-4f32, x);
    x = y.mul_add(-3.77489497744594108e-8f32, x);
    let neg_sin = (v < 0.0) ^ ((emm2 & 4) != 0);
    let pos_cos = (emm2.wrapping_sub(2) & 4) != 0;
    let z = x * x;
    let mut y1 = z.mul_add(2.443315711809948e-5f32, -1.388731625493765e-3f32);
    let mut y2 = z.mul_add(-1.9515295891e-4f32, 8.3321608736e-3f32);
    y1 = y1.mul_add(z, 4.166664568298827e-2f32);
    y2 = y2.mul_add(z, -1.6666654611e-1f32);
    y1 *= z;
    y2 *= z;
    y1 *= z;
    y2 = x.mul_add(y2, x);
    y1 = z.mul_add(-0.5f32, y1);
    y1 += 1.0f32;
    let ys = if poly_sin_first { y1 } else { y2 };
    let yc = if poly_sin_first { y2 } else { y1 };
    (if neg_sin { -ys } else { ys }, if pos_cos { yc } else { -yc })
}

/// `base ** e` in f32 as MLX's `power` computes it (correctly rounded on the values used here).
fn pow_f32(base: f32, e: f32) -> f32 {
    (base as f64).powf(e as f64) as f32
}

/// YaRN parameters from a `rope_scaling` block.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

impl Yarn {
    /// The ramp's `(low, high)`, computed in f64 like the Python module, as the f32 scalars the
    /// ramp arithmetic then sees.
    fn correction_range(&self, dims: usize, base: f32) -> (f32, f32) {
        let d = dims as f64;
        let base = base as f64;
        let cd = |rot: f64| d * (self.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let low = cd(self.beta_fast).floor().max(0.0);
        let mut high = cd(self.beta_slow).ceil().min(d - 1.0);
        if low == high {
            high += 0.001;
        }
        (low as f32, high as f32)
    }

    /// mlx-lm's YaRN magnitude factor (`mscale / mscale_all_dim` ratio).
    pub fn magnitude(&self) -> f64 {
        let g = |m: f64| if self.factor <= 1.0 { 1.0 } else { 0.1 * m * self.factor.ln() + 1.0 };
        g(self.mscale) / g(self.mscale_all_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm_closely() {
        for i in -600..600 {
            let x = i as f32 * 0.1;
            let a = mlx_exp(x);
            let b = x.exp();
            assert!(((a - b) / b).abs() < 1e-5, "x={x} {a} {b}");
        }
        assert_eq!(mlx_exp(100.0), f32::INFINITY);
        assert_eq!(mlx_exp(-100.0), 0.0);
    }

    /// Bit patterns recorded from mlx 0.32.3 (`mx.sin`/`mx.cos` on the CPU, x86-64 Linux),
    /// including arguments where MLX's value is not the correctly rounded one. (Past 2^23 both
    /// hand over to the platform's libm, which is not pinned here.)
    #[test]
    fn sincos_is_mlx_cpu_bit_for_bit() {
        let cases: [(u32, u32, u32); 8] = [
            (0x0000_0000, 0x0000_0000, 0x3f80_0000),
            (0x3f00_0000, 0x3ef5_7744, 0x3f60_a940),
            (0xbfa0_0000, 0xbf72_f0a8, 0x3ea1_71ef),
            (0x4640_e6b6, 0xbf34_4b08, 0x3f35_be20),
            (0xc7c0_e6b3, 0xbc0c_cd2b, 0x3f7f_fd94),
            (0x4aff_fffe, 0x3f7e_0a54, 0xbdfc_eb5e),
            (0xc83c_db3d, 0, 0x3eb5_f82c), // correctly rounded cos: 0x3eb5f82d
            (0x4726_9e4f, 0, 0xbf1e_19a3), // correctly rounded cos: 0xbf1e19a2
        ];
        for (x, s, c) in cases {
            let (ms, mc) = mlx_sincos(f32::from_bits(x));
            if s != 0 || x == 0 {
                assert_eq!(ms.to_bits(), s, "sin {x:#x}");
            }
            assert_eq!(mc.to_bits(), c, "cos {x:#x}");
        }
        assert_eq!(mlx_sincos(-0.0).0.to_bits(), 0, "MLX's sin(-0) is +0");
    }

    /// `nn.RoPE(64, base=10000)`'s inverse frequencies as MLX's CPU rope derives them
    /// (`exp(-j · logf(base)/32)` with MLX's exp), recorded from mlx 0.32.3.
    #[test]
    fn plain_rope_inverse_frequencies_are_mlx_cpu() {
        let r = Rope::plain(64, 10000.0);
        for (j, bits) in [(0, 0x3f80_0000u32), (1, 0x3f3f_f911), (5, 0x3e72_d421), (17, 0x3bf5_b9af), (31, 0x390b_d46f)] {
            assert_eq!(r.inv_freq[j].to_bits(), bits, "pair {j}");
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let v = [0.5f32, -1.0, 3.0, 2.0, f32::NEG_INFINITY];
        let mut o = [0f32; 5];
        softmax_row(&v, &mut o);
        assert!((o.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(o[4], 0.0);
    }

    #[test]
    fn rope_leaves_nope_features_and_scales_offsets() {
        let r = Rope::deepseek_v4(4, 10000.0, None, 4);
        let mut a: Vec<bf16> = (0..12).map(|i| bf16::from_f32(i as f32 * 0.25 + 0.1)).collect();
        let orig = a.clone();
        r.apply(&mut a, 6, 8);
        assert_eq!(&a[..2], &orig[..2]);
        let mut z = vec![bf16::from_f32(-0.0), bf16::from_f32(-1.0), bf16::ONE, bf16::ONE];
        Rope::deepseek_v4(2, 10000.0, None, 1).apply(&mut z, 4, 0);
        assert_eq!(z[0].to_bits(), 0, "-0 - (-1·0) is +0 in MLX");
        let mut b = orig.clone();
        r.apply(&mut b, 6, 11); // 11/4 == 8/4
        assert_eq!(a, b);
    }
}
