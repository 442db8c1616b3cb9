//! What every array of a block must look like, from the decoder's plan and oMLX's block format:
//! the shapes ingest checks each segment against before anything is written, and the shapes
//! the validator checks a block file's tensors against before oMLX may index it.
//!
//! At a block ending at token `E` a DeepSeek-V4 layer of ratio `r` holds its window (`head_dim`
//! wide; the last `min(E, sliding_window)` rows, or with the fork's raw rotating buffer up to
//! `sliding_window - 1 + block_size`), and per pool (compressor `head_dim`, then for ratio 4 the
//! indexer `index_head_dim`) `E mod r` remainder rows `out` wide (`2·head` for ratio 4, else
//! `head`), the pooled rows up to `E / r` (`head` wide) and, where the decoder carries the
//! overlap, the previous ratio-4 window (`r` rows `out` wide once one exists). An MLA layer holds
//! the block's own `block_size` rows of latent (`kv_lora_rank`) and rotated key
//! (`qk_rope_head_dim`). The wire carries bf16 only, the decoder's cache dtype.

use half::bf16;

use crate::error::{CoreError, Result};
use crate::format::{OmlxFormat, Overlap, WindowRows};
use crate::plan::ModelPlan;
use crate::segment::{ArrayShape, LayerKind, Segment};

/// One layer's cache geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerSpec {
    V4 {
        sliding_window: usize,
        ratio: usize,
        head_dim: usize,
        /// Head width of each pool: the compressor's, then (ratio 4) the indexer's.
        pool_heads: Vec<usize>,
    },
    Kv { keys: usize, values: usize },
}

/// Every layer's geometry for one oMLX block format and block size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSpec {
    pub format: OmlxFormat,
    pub block_size: usize,
    pub layers: Vec<LayerSpec>,
}

/// A pool's raw remainder rows are `out` wide: the ratio-4 compressor keeps both overlap lanes.
pub fn pool_out_dim(ratio: usize, head: usize) -> usize {
    if ratio == 4 {
        2 * head
    } else {
        head
    }
}

const POOL_NAMES: [&str; 2] = ["compressor", "indexer"];
const POOL_ARRAYS: [&str; 5] = ["buf_kv", "buf_gate", "pooled", "prev_kv", "prev_gate"];

impl StoreSpec {
    /// The geometry the decoder of `plan` caches, as `format`'s blocks of `block_size` hold it.
    pub fn new(plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(CoreError::config("block_size", "must be positive"));
        }
        let layers = match plan {
            ModelPlan::DeepseekV4(p) => (0..p.num_layers)
                .map(|i| {
                    let ratio = p.compress_ratios[i];
                    let pool_heads = match ratio {
                        0 => vec![],
                        4 => vec![p.head_dim, p.index_head_dim],
                        _ => vec![p.head_dim],
                    };
                    LayerSpec::V4 { sliding_window: p.sliding_window, ratio, head_dim: p.head_dim, pool_heads }
                })
                .collect(),
            ModelPlan::Mla(p) => (0..p.num_layers).map(|_| LayerSpec::Kv { keys: p.kv_lora_rank, values: p.rope_head_dim }).collect(),
        };
        Ok(StoreSpec { format, block_size, layers })
    }

    /// The geometry a segment itself states, for a writer that was given no plan: later
    /// segments must then agree with the first one. Only what is internally consistent is taken
    /// (a V4 pool's remainder widths must follow from its head width and ratio).
    pub fn infer(seg: &Segment, format: OmlxFormat, block_size: usize) -> Result<Self> {
        let block = seg.header.index as u64;
        let arity = arity(format);
        let mut layers = Vec::with_capacity(seg.header.layers.len());
        for (i, l) in seg.header.layers.iter().enumerate() {
            let bad = |reason: String| CoreError::segment(block, Some(i), None, reason);
            layers.push(match &l.kind {
                LayerKind::Kv => match l.arrays.as_slice() {
                    [k, v] => LayerSpec::Kv { keys: k.width as usize, values: v.width as usize },
                    a => return Err(bad(format!("a KV layer has exactly two arrays, this one {}", a.len()))),
                },
                LayerKind::V4 { sliding_window, ratio, pool_starts, .. } => {
                    let window = l.arrays.first().ok_or_else(|| bad("a V4 layer needs a window".into()))?;
                    let (ratio, npools) = (*ratio as usize, pool_starts.len());
                    if l.arrays.len() != 1 + npools * arity {
                        return Err(bad(format!("{} arrays for {npools} pools; {} writes {arity} per pool after the window", l.arrays.len(), format)));
                    }
                    let pool_heads = (0..npools).map(|j| l.arrays[1 + j * arity + 2].width as usize).collect();
                    LayerSpec::V4 { sliding_window: *sliding_window as usize, ratio, head_dim: window.width as usize, pool_heads }
                }
            });
        }
        let spec = StoreSpec { format, block_size, layers };
        for (i, l) in spec.layers.iter().enumerate() {
            if let LayerSpec::V4 { sliding_window, ratio, pool_heads, .. } = l {
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
        arity(self.format)
    }

    /// Window rows a block ending at `end` may hold for a V4 layer: exactly the last
    /// `min(end, window)`, or with the fork's raw rotating buffer of a compressed layer up to
    /// `window - 1` rows before the decoder's last call (at most a block) plus that call's.
    pub fn window_rows(&self, ratio: usize, sliding_window: usize, end: usize) -> (usize, usize) {
        let last = end.min(sliding_window);
        if ratio == 0 || self.format.window_rows() == WindowRows::Window {
            (last, last)
        } else {
            (last, end.min(sliding_window.saturating_sub(1) + self.block_size))
        }
    }

    /// Pool rows per pool received so far, before the first segment.
    pub fn no_pool_rows(&self) -> Vec<Vec<u64>> {
        self.layers
            .iter()
            .map(|l| match l {
                LayerSpec::V4 { pool_heads, .. } => vec![0; pool_heads.len()],
                LayerSpec::Kv { .. } => Vec::new(),
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
        let b = self.block_size as u64;
        let (start, end) = (block * b, (block + 1) * b);
        if (h.start, h.end) != (start, end) {
            return Err(head(format!("covers tokens [{}, {}), not its block [{start}, {end}) on the {b}-token block grid", h.start, h.end)));
        }
        if h.omlx_format != self.format.name() {
            return Err(head(format!("computed for oMLX block format {:?}, this decode host writes {:?}", h.omlx_format, self.format.name())));
        }
        if h.layers.len() != self.layers.len() {
            return Err(head(format!("has {} layers, the decoder has {}", h.layers.len(), self.layers.len())));
        }
        let listed: usize = h.layers.iter().map(|l| l.arrays.len()).sum();
        if listed != seg.arrays.len() {
            return Err(head(format!("header lists {listed} arrays, the segment carries {}", seg.arrays.len())));
        }
        let end = end as usize;
        let mut after = self.no_pool_rows();
        let mut at = 0usize;
        for (i, (l, spec)) in h.layers.iter().zip(&self.layers).enumerate() {
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
                (LayerSpec::Kv { keys, values }, LayerKind::Kv) => {
                    let [k, v] = l.arrays.as_slice() else {
                        return Err(bad(None, format!("a KV layer has exactly two arrays, this one {}", l.arrays.len())));
                    };
                    shape_is(k, self.block_size, *keys).map_err(|r| bad(Some("keys"), r))?;
                    shape_is(v, self.block_size, *values).map_err(|r| bad(Some("values"), r))?;
                }
                (LayerSpec::V4 { sliding_window, ratio, head_dim, pool_heads }, &LayerKind::V4 { offset, sliding_window: sw, ratio: r, ref pool_starts }) => {
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
                    let (lo, hi) = self.window_rows(*ratio, *sliding_window, end);
                    let w = &l.arrays[0];
                    if w.width as usize != *head_dim || (w.rows as usize) < lo || w.rows as usize > hi {
                        let rows = if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") };
                        return Err(bad(Some("window"), format!("{}x{}, expected {rows} rows of width {head_dim}", w.rows, w.width)));
                    }
                    for (j, &ph) in pool_heads.iter().enumerate() {
                        let name = |k: usize| format!("{}.{}", POOL_NAMES[j.min(1)], POOL_ARRAYS[k]);
                        let p = &l.arrays[1 + j * self.arity()..1 + (j + 1) * self.arity()];
                        let out = pool_out_dim(*ratio, ph);
                        let rem = end.checked_rem(*ratio).unwrap_or(0);
                        shape_is(&p[0], rem, out).map_err(|r| bad(Some(&name(0)), r))?;
                        shape_is(&p[1], rem, out).map_err(|r| bad(Some(&name(1)), r))?;
                        let have = pool_rows.get(i).and_then(|p| p.get(j)).copied().unwrap_or(0);
                        if pool_starts[j] != have {
                            return Err(bad(Some(&name(2)), format!("delta starts at pool row {}, {have} rows were received before it", pool_starts[j])));
                        }
                        let total = end.checked_div(*ratio).unwrap_or(0) as u64;
                        if total < have {
                            return Err(bad(Some(&name(2)), format!("{have} pool rows were received, the block ends at pool row {total}")));
                        }
                        shape_is(&p[2], (total - have) as usize, ph).map_err(|r| bad(Some(&name(2)), format!("{r} (pool rows [{have}, {total}))")))?;
                        if self.arity() == 5 {
                            let prev = if *ratio == 4 && end >= *ratio { *ratio } else { 0 };
                            shape_is(&p[3], prev, out).map_err(|r| bad(Some(&name(3)), r))?;
                            shape_is(&p[4], prev, out).map_err(|r| bad(Some(&name(4)), r))?;
                        }
                        after[i][j] = total;
                    }
                }
                (spec, kind) => {
                    let want = if matches!(spec, LayerSpec::Kv { .. }) { "a KV layer" } else { "a DeepSeek-V4 layer" };
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

    fn array_name(&self, spec: &LayerSpec, k: usize) -> String {
        match spec {
            LayerSpec::Kv { .. } => ["keys", "values"].get(k).copied().unwrap_or("?").to_string(),
            LayerSpec::V4 { .. } if k == 0 => "window".into(),
            LayerSpec::V4 { .. } => {
                let (j, e) = ((k - 1) / self.arity(), (k - 1) % self.arity());
                format!("{}.{}", POOL_NAMES[j.min(1)], POOL_ARRAYS[e])
            }
        }
    }
}

fn arity(format: OmlxFormat) -> usize {
    if format.overlap() == Overlap::Carried {
        5
    } else {
        3
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
