//! What every array of a block must look like, checked: the shapes ingest checks each segment
//! against before anything is written, and (through the validator) the shapes a block file's
//! tensors must have before oMLX may index it. The shapes themselves are the block geometry's
//! ([`crate::geometry`]), from the decoder's plan, or, for a writer that knows no plan, inferred
//! from the stream's first segment. The wire carries bf16 only, the decoder's cache dtype.

use half::bf16;

use crate::error::{CoreError, Result};
use crate::family;
use crate::format::OmlxFormat;
use crate::geometry::{Geometry, LayerShape};
use crate::plan::ModelPlan;
use crate::segment::{ArrayShape, LayerKind, Segment};

/// Every layer's geometry for one oMLX block format and block size, and the checks against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSpec {
    pub geometry: Geometry,
}

const POOL_NAMES: [&str; 2] = ["compressor", "indexer"];
const POOL_ARRAYS: [&str; 5] = ["buf_kv", "buf_gate", "pooled", "prev_kv", "prev_gate"];

impl StoreSpec {
    /// The geometry the decoder of `plan` caches, as `format`'s blocks of `block_size` hold it.
    pub fn new(plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(CoreError::config("block_size", "must be positive"));
        }
        Ok(StoreSpec { geometry: family::geometry(plan, format, block_size) })
    }

    /// The geometry a segment itself states, for a writer that was given no plan: later
    /// segments must then agree with the first one. Only what is internally consistent is taken
    /// (a V4 pool's remainder widths must follow from its head width and ratio).
    pub fn infer(seg: &Segment, format: OmlxFormat, block_size: usize) -> Result<Self> {
        let block = seg.header.index as u64;
        let arity = Geometry::new(format, block_size, vec![]).arity();
        let mut layers = Vec::with_capacity(seg.header.layers.len());
        for (i, l) in seg.header.layers.iter().enumerate() {
            let bad = |reason: String| CoreError::segment(block, Some(i), None, reason);
            layers.push(match &l.kind {
                LayerKind::Kv => match l.arrays.as_slice() {
                    [k, v] => LayerShape::Kv { keys: k.width as usize, values: v.width as usize },
                    a => return Err(bad(format!("a KV layer has exactly two arrays, this one {}", a.len()))),
                },
                LayerKind::V4 { sliding_window, ratio, pool_starts, .. } => {
                    let window = l.arrays.first().ok_or_else(|| bad("a V4 layer needs a window".into()))?;
                    let (ratio, npools) = (*ratio as usize, pool_starts.len());
                    if l.arrays.len() != 1 + npools * arity {
                        return Err(bad(format!("{} arrays for {npools} pools; {} writes {arity} per pool after the window", l.arrays.len(), format)));
                    }
                    let pool_heads = (0..npools).map(|j| l.arrays[1 + j * arity + 2].width as usize).collect();
                    LayerShape::Windowed { sliding_window: *sliding_window as usize, ratio, head_dim: window.width as usize, pool_heads }
                }
            });
        }
        let spec = StoreSpec { geometry: Geometry::new(format, block_size, layers) };
        for (i, l) in spec.geometry.layers.iter().enumerate() {
            if let LayerShape::Windowed { sliding_window, ratio, pool_heads, .. } = l {
                let want = match ratio {
                    0 => 0,
                    4 => 2,
                    _ => 1,
                };
                if *sliding_window == 0 || pool_heads.len() != want {
                    return Err(CoreError::segment(block, Some(i), None, format!("ratio {ratio} with {} pools and a window of {sliding_window}", pool_heads.len())));
                }
            }
        }
        Ok(spec)
    }

    /// Arrays per pool in a segment (and states per pool in a block, the range aside).
    pub fn arity(&self) -> usize {
        self.geometry.arity()
    }

    /// Pool rows per pool received so far, before the first segment.
    pub fn no_pool_rows(&self) -> Vec<Vec<u64>> {
        self.geometry.layers
            .iter()
            .map(|l| match l {
                LayerShape::Windowed { pool_heads, .. } => vec![0; pool_heads.len()],
                LayerShape::Kv { .. } => Vec::new(),
            })
            .collect()
    }

    /// Check a received segment before anything of it is written: the block grid (`index`
    /// must be `next_index`, covering exactly its block), the layer count, every array's shape
    /// as this geometry dictates, pool deltas starting where `pool_rows` (rows received so far
    /// per layer and pool) ended, and every value finite. Returns the pool rows after it.
    pub fn check_segment(&self, seg: &Segment, next_index: u64, pool_rows: &[Vec<u64>]) -> Result<Vec<Vec<u64>>> {
        let h = &seg.header;
        let block = h.index as u64;
        let head = |reason: String| CoreError::segment(block, None, None, reason);
        if block != next_index {
            return Err(head(format!("out of order: block {next_index} is the next one this stream may carry")));
        }
        let b = self.geometry.block_size as u64;
        let (start, end) = (block * b, (block + 1) * b);
        if (h.start, h.end) != (start, end) {
            return Err(head(format!("covers tokens [{}, {}), not its block [{start}, {end}) on the {b}-token block grid", h.start, h.end)));
        }
        if h.omlx_format != self.geometry.format.name() {
            return Err(head(format!("computed for oMLX block format {:?}, this decode host writes {:?}", h.omlx_format, self.geometry.format.name())));
        }
        if h.layers.len() != self.geometry.layers.len() {
            return Err(head(format!("has {} layers, the decoder has {}", h.layers.len(), self.geometry.layers.len())));
        }
        let listed: usize = h.layers.iter().map(|l| l.arrays.len()).sum();
        if listed != seg.arrays.len() {
            return Err(head(format!("header lists {listed} arrays, the segment carries {}", seg.arrays.len())));
        }
        let end = end as usize;
        let mut after = self.no_pool_rows();
        let mut at = 0usize;
        for (i, (l, spec)) in h.layers.iter().zip(&self.geometry.layers).enumerate() {
            let arrays = &seg.arrays.iter().skip(at).take(l.arrays.len()).collect::<Vec<_>>();
            at += l.arrays.len();
            let bad = |array: Option<&str>, reason: String| CoreError::segment(block, Some(i), array, reason);
            // Every array's length must be its shape: a segment built in memory is checked too.
            for (k, (s, a)) in l.arrays.iter().zip(arrays).enumerate() {
                if a.len() as u64 != s.rows as u64 * s.width as u64 {
                    return Err(bad(Some(&format!("#{k}")), format!("{} values for a {}x{} array", a.len(), s.rows, s.width)));
                }
            }
            match (spec, &l.kind) {
                (LayerShape::Kv { keys, values }, LayerKind::Kv) => {
                    let [k, v] = l.arrays.as_slice() else {
                        return Err(bad(None, format!("a KV layer has exactly two arrays, this one {}", l.arrays.len())));
                    };
                    shape_is(k, self.geometry.block_size, *keys).map_err(|r| bad(Some("keys"), r))?;
                    shape_is(v, self.geometry.block_size, *values).map_err(|r| bad(Some("values"), r))?;
                }
                (LayerShape::Windowed { sliding_window, ratio, head_dim, pool_heads }, &LayerKind::V4 { offset, sliding_window: sw, ratio: r, ref pool_starts }) => {
                    if offset != end as u64 || sw as usize != *sliding_window || r as usize != *ratio {
                        return Err(bad(None, format!(
                            "offset {offset}, window {sw}, ratio {r}; the block ends at {end} and the layer has window {sliding_window}, ratio {ratio}"
                        )));
                    }
                    if pool_starts.len() != pool_heads.len() || l.arrays.len() != 1 + pool_heads.len() * self.arity() {
                        return Err(bad(None, format!(
                            "{} pools in {} arrays; a ratio-{ratio} layer has {} pools of {} arrays after the window",
                            pool_starts.len(), l.arrays.len(), pool_heads.len(), self.arity()
                        )));
                    }
                    let (lo, hi) = self.geometry.window_rows_range(*ratio, *sliding_window, end);
                    let w = &l.arrays[0];
                    if w.width as usize != *head_dim || (w.rows as usize) < lo || w.rows as usize > hi {
                        let rows = if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") };
                        return Err(bad(Some("window"), format!("{}x{}, expected {rows} rows of width {head_dim}", w.rows, w.width)));
                    }
                    for (j, &ph) in pool_heads.iter().enumerate() {
                        let name = |k: usize| format!("{}.{}", POOL_NAMES[j.min(1)], POOL_ARRAYS[k]);
                        let p = &l.arrays[1 + j * self.arity()..1 + (j + 1) * self.arity()];
                        let at = self.geometry.pool(*ratio, ph, end);
                        let (out, rem) = (at.out, at.rem);
                        shape_is(&p[0], rem, out).map_err(|r| bad(Some(&name(0)), r))?;
                        shape_is(&p[1], rem, out).map_err(|r| bad(Some(&name(1)), r))?;
                        let have = pool_rows.get(i).and_then(|p| p.get(j)).copied().unwrap_or(0);
                        if pool_starts[j] != have {
                            return Err(bad(Some(&name(2)), format!("delta starts at pool row {}, {have} rows were received before it", pool_starts[j])));
                        }
                        let total = at.pooled as u64;
                        if total < have {
                            return Err(bad(Some(&name(2)), format!("{have} pool rows were received, the block ends at pool row {total}")));
                        }
                        shape_is(&p[2], (total - have) as usize, ph).map_err(|r| bad(Some(&name(2)), format!("{r} (pool rows [{have}, {total}))")))?;
                        if self.arity() == 5 {
                            let prev = at.prev;
                            shape_is(&p[3], prev, out).map_err(|r| bad(Some(&name(3)), r))?;
                            shape_is(&p[4], prev, out).map_err(|r| bad(Some(&name(4)), r))?;
                        }
                        after[i][j] = total;
                    }
                }
                (spec, kind) => {
                    let want = if matches!(spec, LayerShape::Kv { .. }) { "a KV layer" } else { "a DeepSeek-V4 layer" };
                    let got = if matches!(kind, LayerKind::Kv) { "kv" } else { "v4" };
                    return Err(bad(None, format!("is a {got} layer; the decoder's layer {i} is {want}")));
                }
            }
            for (k, a) in arrays.iter().enumerate() {
                if let Some((n, v)) = first_not_finite(a) {
                    let width = l.arrays[k].width.max(1) as usize;
                    let what = if v.is_nan() { "NaN" } else { "infinite" };
                    return Err(bad(Some(&self.array_name(spec, k)), format!("value {n} (row {}, column {}) is {what}", n / width, n % width)));
                }
            }
        }
        Ok(after)
    }

    fn array_name(&self, spec: &LayerShape, k: usize) -> String {
        match spec {
            LayerShape::Kv { .. } => ["keys", "values"].get(k).copied().unwrap_or("?").to_string(),
            LayerShape::Windowed { .. } if k == 0 => "window".into(),
            LayerShape::Windowed { .. } => {
                let (j, e) = ((k - 1) / self.arity(), (k - 1) % self.arity());
                format!("{}.{}", POOL_NAMES[j.min(1)], POOL_ARRAYS[e])
            }
        }
    }
}

fn shape_is(s: &ArrayShape, rows: usize, width: usize) -> std::result::Result<(), String> {
    // An empty array's width says nothing (the capture stamps the pool's width; 0 is as empty).
    if s.rows as usize == rows && (s.width as usize == width || (rows == 0 && s.width == 0)) {
        return Ok(());
    }
    Err(format!("{}x{}, expected {rows}x{width}", s.rows, s.width))
}

/// The first value that is NaN or infinite: bf16 with every exponent bit set.
pub fn first_not_finite(a: &[bf16]) -> Option<(usize, bf16)> {
    use half::slice::HalfFloatSliceExt;
    // (bits & 0x7F80) + 0x80 reaches 0x8000 exactly when the exponent is all ones: an OR over
    // a chunk is plain 16-bit lane arithmetic the compiler vectorizes; only a hit is located.
    let bits: &[u16] = a.reinterpret_cast();
    let mut at = 0;
    for chunk in bits.chunks(1024) {
        let any = chunk.iter().fold(0u16, |acc, &b| acc | ((b & 0x7F80) + 0x0080));
        if any & 0x8000 != 0 {
            let k = chunk.iter().position(|&b| b & 0x7F80 == 0x7F80).unwrap_or(0);
            return Some((at + k, a[at + k]));
        }
        at += chunk.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_finite_is_found_where_it_is() {
        let mut a = vec![bf16::from_f32(1.5); 1000];
        assert_eq!(first_not_finite(&a), None);
        a[777] = bf16::NAN;
        a[900] = bf16::INFINITY;
        assert_eq!(first_not_finite(&a).map(|x| x.0), Some(777));
        a[777] = bf16::MAX;
        assert_eq!(first_not_finite(&a).map(|x| x.0), Some(900));
        assert!(first_not_finite(&[bf16::NEG_INFINITY]).is_some());
        assert!(first_not_finite(&[bf16::from_f32(-0.0), bf16::MIN_POSITIVE_SUBNORMAL]).is_none());
    }
}
