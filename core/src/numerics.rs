//! The decoder's arithmetic, operation by operation, in the order MLX performs it.
//!
//! Every function here mirrors one MLX CPU kernel as the decode venv runs it (mlx 0.32,
//! `mlx[cpu]`), down to where values are rounded to bf16. Bit-exactness against MLX depends on
//! these details, so each one says which MLX behaviour it reproduces; the parity tests in
//! `tests/` check them against real MLX.

use half::bf16;

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

/// `y[L,N] = bf16(x[L,K] · w[N,K]ᵀ)`: MLX's CPU bf16 matmul is a float32 sum over the inner
/// dimension in index order, rounded once to bf16.
///
/// `w` is the weight as `nn.Linear` stores it (`[out, in]`), already widened to f32 (exactly:
/// the weights are bf16 or dequantized MX values, both exact in f32).
pub fn linear(x: &[bf16], rows: usize, k: usize, w: &[f32], n: usize, out: &mut Vec<bf16>) {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(w.len(), n * k);
    out.clear();
    out.resize(rows * n, bf16::ZERO);
    // Rows are independent, so splitting them across threads changes no rounding.
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(rows.max(1));
    let work = rows * n * k;
    if threads <= 1 || work < (1 << 22) {
        linear_rows(x, k, w, n, out);
        return;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (xs, os) in x.chunks(per * k).zip(out.chunks_mut(per * n)) {
            s.spawn(move || linear_rows(xs, k, w, n, os));
        }
    });
}

fn linear_rows(x: &[bf16], k: usize, w: &[f32], n: usize, out: &mut [bf16]) {
    let mut xf = vec![0f32; k];
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for (dst, src) in xf.iter_mut().zip(xr) {
            *dst = src.to_f32();
        }
        for (j, o) in or.iter_mut().enumerate() {
            *o = round_bf16(dot_sequential(&xf, &w[j * k..(j + 1) * k]));
        }
    }
}

/// Sequential f32 dot product. Written as four independent chains would change the rounding;
/// this must stay strictly left to right.
#[inline]
fn dot_sequential(a: &[f32], b: &[f32]) -> f32 {
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

    /// Plain RoPE with a base (`nn.RoPE`): MLX's kernel derives these frequencies internally; this
    /// is the closest f32 formula (≥99.8% identical on this CPU, see README).
    pub fn plain(dims: usize, base: f32) -> Self {
        let half = dims / 2;
        let freqs: Vec<f32> = (0..half).map(|j| pow_f32(base, (2 * j) as f32 / dims as f32)).collect();
        Self::from_freqs(&freqs, 1)
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
                let c = round_bf16((theta as f64).cos() as f32).to_f32();
                let s = round_bf16((theta as f64).sin() as f32).to_f32();
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
