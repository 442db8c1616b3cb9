//! Building segments, for the CPU and the GPU capture alike.
//!
//! What goes into a segment is decided here once, from the decoder's plan, its oMLX format and
//! the block size: [`SegmentPlan::block`] lists, for the block ending at token `b`, every layer's
//! kind and arrays in wire order — what each array holds (window rows of which tokens, pool rows
//! of which range, remainders, the carried previous window, MLA rows), its shape, and its offset
//! in the segment's body. The body is one contiguous little-endian bf16 buffer ([`SegmentArrays`]):
//! the CPU path copies each layer's arrays from its pooler state into it, the GPU path copies them
//! device-to-host straight into a page-locked body, and framing a segment is its header plus that
//! body as it lies — no per-array buffers, no per-value conversions.
//!
//! A plan depends on the decoder (plan, format, block size) only, never on how the block files are
//! laid out (that is the decode host's business, `block::layout`).

use std::sync::Arc;

// Bodies are read and written in place as the wire's little-endian bf16.
#[cfg(not(target_endian = "little"))]
compile_error!("pd-bridge-core frames segments in place and needs a little-endian host");

use half::bf16;

use super::{ArrayShape, LayerHeader, LayerKind, Segment, SegmentHeader};
use crate::error::{CoreError, Result};
use crate::format::{OmlxFormat, Overlap, WindowRows};
use crate::plan::{ModelPlan, V4LayerKind};

/// Where a segment body's values live: a heap buffer, or page-locked memory a GPU copied into
/// (returned to its pool when the last segment sharing it is dropped).
pub trait BodyStore: Send + Sync {
    /// The values; a body uses a prefix of them.
    fn values(&self) -> &[bf16];
}

/// A body's values: owned (and mutable, copy-on-write), or shared with whoever owns them.
#[derive(Clone)]
enum Store {
    Owned(Arc<Vec<bf16>>),
    Shared(Arc<dyn BodyStore>),
}

impl Store {
    fn values(&self) -> &[bf16] {
        match self {
            Store::Owned(v) => v,
            Store::Shared(s) => s.values(),
        }
    }
}

impl BodyStore for Vec<bf16> {
    fn values(&self) -> &[bf16] {
        self
    }
}

/// A segment's arrays, in header order: spans of one contiguous bf16 body.
#[derive(Clone)]
pub struct SegmentArrays {
    store: Store,
    /// `(offset, values)` of each array; back to back from 0.
    spans: Vec<(usize, usize)>,
}

impl SegmentArrays {
    /// Arrays of `lens` values each, back to back at the start of `store`.
    pub fn from_store(store: Arc<dyn BodyStore>, lens: impl IntoIterator<Item = usize>) -> Result<Self> {
        let mut spans = Vec::new();
        let mut at = 0usize;
        for n in lens {
            spans.push((at, n));
            at = at.checked_add(n).ok_or_else(|| CoreError::wire("segment body size overflows"))?;
        }
        if at > store.values().len() {
            return Err(CoreError::wire(format!("segment body of {} values cannot hold {at}", store.values().len())));
        }
        Ok(SegmentArrays { store: Store::Shared(store), spans })
    }

    /// Arrays of `lens` values each, back to back in `body`.
    pub fn from_body(body: Vec<bf16>, lens: impl IntoIterator<Item = usize>) -> Result<Self> {
        let mut a = Self::from_store(Arc::new(Vec::new()), [])?;
        let mut at = 0usize;
        for n in lens {
            a.spans.push((at, n));
            at = at.checked_add(n).ok_or_else(|| CoreError::wire("segment body size overflows"))?;
        }
        if at > body.len() {
            return Err(CoreError::wire(format!("segment body of {} values cannot hold {at}", body.len())));
        }
        a.store = Store::Owned(Arc::new(body));
        Ok(a)
    }

    /// Array `k`, writable (tests corrupt segments this way); a shared body is copied first.
    pub fn get_mut(&mut self, k: usize) -> Option<&mut [bf16]> {
        let &(o, n) = self.spans.get(k)?;
        if let Store::Shared(s) = &self.store {
            self.store = Store::Owned(Arc::new(s.values().to_vec()));
        }
        let Store::Owned(v) = &mut self.store else { unreachable!("made owned above") };
        Some(&mut Arc::make_mut(v)[o..o + n])
    }

    /// Arrays of `lens` values read from little-endian bf16 bytes (one bulk copy); `bytes` must
    /// hold exactly their sum.
    pub fn from_le_bytes(bytes: &[u8], lens: &[usize]) -> Result<Self> {
        let total: usize = lens.iter().sum();
        if bytes.len() != total * 2 {
            return Err(CoreError::wire(format!("{} body bytes for {total} values", bytes.len())));
        }
        let mut body = vec![bf16::ZERO; total];
        as_bytes_mut(&mut body).copy_from_slice(bytes);
        Self::from_body(body, lens.iter().copied())
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    pub fn get(&self, k: usize) -> Option<&[bf16]> {
        let &(o, n) = self.spans.get(k)?;
        Some(&self.store.values()[o..o + n])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[bf16]> + '_ {
        let v = self.store.values();
        self.spans.iter().map(move |&(o, n)| &v[o..o + n])
    }

    /// Drop the last array (tests build malformed segments this way).
    pub fn pop(&mut self) -> Option<Vec<bf16>> {
        let a = self.get(self.len().checked_sub(1)?)?.to_vec();
        self.spans.pop();
        Some(a)
    }

    /// Keep the first `n` arrays.
    pub fn truncate(&mut self, n: usize) {
        self.spans.truncate(n);
    }

    /// Every array back to back: the segment's body.
    pub fn body(&self) -> &[bf16] {
        let end = self.spans.last().map_or(0, |&(o, n)| o + n);
        &self.store.values()[..end]
    }

    /// The body as the wire carries it (little-endian bf16: the host's order, see below).
    pub fn body_bytes(&self) -> &[u8] {
        as_bytes(self.body())
    }

    /// Values in all arrays.
    pub fn values(&self) -> usize {
        self.spans.last().map_or(0, |&(o, n)| o + n)
    }
}

impl From<Vec<Vec<bf16>>> for SegmentArrays {
    fn from(arrays: Vec<Vec<bf16>>) -> Self {
        let lens: Vec<usize> = arrays.iter().map(Vec::len).collect();
        Self::from_body(arrays.concat(), lens).expect("the body holds every array")
    }
}

impl PartialEq for SegmentArrays {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}

impl std::fmt::Debug for SegmentArrays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.spans.iter().map(|&(_, n)| format!("[{n} values]"))).finish()
    }
}

impl std::ops::Index<usize> for SegmentArrays {
    type Output = [bf16];
    fn index(&self, k: usize) -> &[bf16] {
        self.get(k).expect("array index in range")
    }
}

impl std::ops::IndexMut<usize> for SegmentArrays {
    fn index_mut(&mut self, k: usize) -> &mut [bf16] {
        self.get_mut(k).expect("array index in range")
    }
}

impl<'a> IntoIterator for &'a SegmentArrays {
    type Item = &'a [bf16];
    type IntoIter = Box<dyn ExactSizeIterator<Item = &'a [bf16]> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

pub(crate) fn as_bytes(v: &[bf16]) -> &[u8] {
    // SAFETY: bf16 is a plain 2-byte value with no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [bf16]) -> &mut [u8] {
    // SAFETY: as for `as_bytes`; every bit pattern is a valid bf16.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

/// What one array of a block's segment holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArraySource {
    /// DeepSeek-V4 window rows of tokens `[t0, t1)` (`kv_norm(wkv(x))`, rotated).
    Window { t0: usize, t1: usize },
    /// Raw `kv` (or `gate`) rows of pool `pool`'s incomplete window at the block's end.
    Remainder { pool: usize, gate: bool },
    /// Rows `[r0, r1)` of pool `pool` (those new in this block).
    Pooled { pool: usize, r0: usize, r1: usize },
    /// The previous ratio-4 window's raw `kv` (or `gate`) rows, where the decoder carries it.
    Prev { pool: usize, gate: bool },
    /// MLA latent rows of tokens `[t0, t1)`.
    Latent { t0: usize, t1: usize },
    /// MLA rotated-key rows of tokens `[t0, t1)`.
    RopeKey { t0: usize, t1: usize },
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedArray {
    pub source: ArraySource,
    pub shape: ArrayShape,
    /// Offset in the body, in values.
    pub offset: usize,
}

impl PlannedArray {
    pub fn values(&self) -> usize {
        self.shape.rows as usize * self.shape.width as usize
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedLayer {
    pub kind: LayerKind,
    pub arrays: Vec<PlannedArray>,
}

/// One block's segment, planned: every layer's arrays and where they go in the body.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockPlan {
    pub index: usize,
    /// The block covers tokens `[start, end)`.
    pub start: usize,
    pub end: usize,
    pub layers: Vec<PlannedLayer>,
    /// Values in the body.
    pub values: usize,
}

impl BlockPlan {
    /// The first token any array of `layer` reads, window lookback included (`ratio`: the layer's compress ratio).
    pub fn first_token(&self, layer: usize, ratio: usize) -> usize {
        self.layers[layer]
            .arrays
            .iter()
            .map(|a| match a.source {
                ArraySource::Window { t0, .. } | ArraySource::Latent { t0, .. } | ArraySource::RopeKey { t0, .. } => t0,
                ArraySource::Pooled { r0, .. } => r0 * ratio,
                ArraySource::Remainder { .. } | ArraySource::Prev { .. } => self.start,
            })
            .min()
            .unwrap_or(self.start)
    }

    /// Copy `layer`'s arrays into `body` from `source` (the CPU path): each must be exactly as
    /// long as planned.
    pub fn fill_layer<'a>(&self, layer: usize, body: &mut [bf16], source: impl Fn(&ArraySource) -> Option<&'a [bf16]>) -> Result<()> {
        for a in &self.layers[layer].arrays {
            let data = source(&a.source).unwrap_or(&[]);
            if data.len() != a.values() {
                return Err(CoreError::input(layer, format!("block {}: {:?} has {} values, the segment plan {}x{}", self.index, a.source, data.len(), a.shape.rows, a.shape.width)));
            }
            body[a.offset..a.offset + data.len()].copy_from_slice(data);
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum LayerShape {
    V4 {
        size: usize,
        head_dim: usize,
        ratio: usize,
        /// Per pool (compressor, then indexer): `(head_dim, out_dim)`.
        pools: Vec<(usize, usize)>,
    },
    Mla {
        rank: usize,
        rope_dim: usize,
    },
}

/// The segment builder of one capture: what every block's segment carries.
#[derive(Clone, Debug)]
pub struct SegmentPlan {
    format: OmlxFormat,
    block_size: usize,
    request_id: String,
    fingerprint: String,
    layers: Vec<LayerShape>,
}

impl SegmentPlan {
    pub fn new(format: OmlxFormat, plan: &ModelPlan, block_size: usize, request_id: &str, fingerprint: &str) -> Self {
        let layers = match plan {
            ModelPlan::DeepseekV4(p) => (0..p.num_layers)
                .map(|i| {
                    let ratio = p.compress_ratios[i];
                    let kind = p.layer_kind(i);
                    let od = |hd: usize| if ratio == 4 { 2 * hd } else { hd };
                    let mut pools = vec![];
                    if kind != V4LayerKind::Window {
                        pools.push((p.head_dim, od(p.head_dim)));
                    }
                    if kind == V4LayerKind::Sparse {
                        pools.push((p.index_head_dim, od(p.index_head_dim)));
                    }
                    LayerShape::V4 { size: p.sliding_window, head_dim: p.head_dim, ratio, pools }
                })
                .collect(),
            ModelPlan::Mla(p) => (0..p.num_layers).map(|_| LayerShape::Mla { rank: p.kv_lora_rank, rope_dim: p.rope_head_dim }).collect(),
        };
        SegmentPlan { format, block_size, request_id: request_id.into(), fingerprint: fingerprint.into(), layers }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `layer`'s compress ratio (0: window only, or MLA).
    pub fn ratio(&self, layer: usize) -> usize {
        match self.layers.get(layer) {
            Some(LayerShape::V4 { ratio, .. }) => *ratio,
            _ => 0,
        }
    }

    /// The first token any array of `layer` in block `index`'s segment reads, window lookback
    /// included: [`BlockPlan::first_token`] without planning the block.
    pub fn first_token(&self, index: usize, layer: usize) -> usize {
        let bs = self.block_size;
        let (start, b) = (index * bs, (index + 1) * bs);
        match self.layers.get(layer) {
            Some(LayerShape::V4 { size, ratio, .. }) => {
                let raw = self.format.window_rows() == WindowRows::Raw;
                let n = if *ratio != 0 && raw { b.min(size - 1 + (b - start)) } else { b.min(*size) };
                // A compressed layer's pool rows and remainders start at the block's start.
                if *ratio != 0 { (b - n).min(start) } else { b - n }
            }
            _ => start,
        }
    }

    /// The segment of block `index` (tokens `[index·B, (index+1)·B)`), planned.
    pub fn block(&self, index: usize) -> BlockPlan {
        let bs = self.block_size;
        let (start, b) = (index * bs, (index + 1) * bs);
        let carried = self.format.overlap() == Overlap::Carried;
        let raw = self.format.window_rows() == WindowRows::Raw;
        let mut at = 0usize;
        let mut push = |arrays: &mut Vec<PlannedArray>, source: ArraySource, rows: usize, width: usize| {
            arrays.push(PlannedArray { source, shape: ArrayShape { rows: rows as u32, width: width as u32 }, offset: at });
            at += rows * width;
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mut arrays = Vec::new();
            let kind = match l {
                LayerShape::V4 { size, head_dim, ratio, pools } => {
                    // A compressed layer's window in a fork block is MLX's raw rotating buffer:
                    // every row of the decoder's last forward call (the decoder prefills block by
                    // block, so the call started at `start`) plus up to `size - 1` before it.
                    let n = if *ratio != 0 && raw { b.min(size - 1 + (b - start)) } else { b.min(*size) };
                    push(&mut arrays, ArraySource::Window { t0: b - n, t1: b }, n, *head_dim);
                    let mut pool_starts = Vec::with_capacity(pools.len());
                    for (j, &(hd, od)) in pools.iter().enumerate() {
                        let rem = b % ratio;
                        push(&mut arrays, ArraySource::Remainder { pool: j, gate: false }, rem, od);
                        push(&mut arrays, ArraySource::Remainder { pool: j, gate: true }, rem, od);
                        let (r0, r1) = (start / ratio, b / ratio);
                        push(&mut arrays, ArraySource::Pooled { pool: j, r0, r1 }, r1 - r0, hd);
                        pool_starts.push(r0 as u64);
                        if carried {
                            // The previous ratio-4 window, once one completed (none for ratio 128).
                            let rows = if *ratio == 4 && b >= *ratio { *ratio } else { 0 };
                            push(&mut arrays, ArraySource::Prev { pool: j, gate: false }, rows, od);
                            push(&mut arrays, ArraySource::Prev { pool: j, gate: true }, rows, od);
                        }
                    }
                    LayerKind::V4 { offset: b as u64, sliding_window: *size as u32, ratio: *ratio as u32, pool_starts }
                }
                LayerShape::Mla { rank, rope_dim } => {
                    push(&mut arrays, ArraySource::Latent { t0: start, t1: b }, bs, *rank);
                    push(&mut arrays, ArraySource::RopeKey { t0: start, t1: b }, bs, *rope_dim);
                    LayerKind::Kv
                }
            };
            layers.push(PlannedLayer { kind, arrays });
        }
        BlockPlan { index, start, end: b, layers, values: at }
    }

    /// The segment of `block`, its arrays in `store` as planned.
    pub fn segment(&self, block: &BlockPlan, store: Arc<dyn BodyStore>) -> Result<Segment> {
        let lens = block.layers.iter().flat_map(|l| l.arrays.iter().map(PlannedArray::values));
        let arrays = SegmentArrays::from_store(store, lens)?;
        let header = SegmentHeader {
            request_id: self.request_id.clone(),
            fingerprint: self.fingerprint.clone(),
            omlx_format: self.format.name().to_string(),
            index: block.index as u32,
            start: block.start as u64,
            end: block.end as u64,
            layers: block
                .layers
                .iter()
                .map(|l| LayerHeader { kind: l.kind.clone(), arrays: l.arrays.iter().map(|a| a.shape.clone()).collect() })
                .collect(),
        };
        Ok(Segment { header, arrays })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_spans_of_one_body() {
        let a = SegmentArrays::from(vec![vec![bf16::ONE; 3], vec![], vec![bf16::ZERO; 2]]);
        assert_eq!((a.len(), a.values(), a.get(1).unwrap().len(), a[2].len()), (3, 5, 0, 2));
        assert_eq!(a.body_bytes().len(), 10);
        let b = SegmentArrays::from_le_bytes(a.body_bytes(), &[3, 0, 2]).unwrap();
        assert_eq!(a, b);
        assert!(SegmentArrays::from_le_bytes(a.body_bytes(), &[3, 0, 3]).is_err());
        let mut c = b.clone();
        assert_eq!(c.pop().unwrap().len(), 2);
        assert!(c != b && c.values() == 3);
        // Writes copy a shared body, never touching the other segment's.
        let shared = SegmentArrays::from_store(Arc::new(vec![bf16::ONE; 4]), [2, 2]).unwrap();
        let mut d = shared.clone();
        d[1][0] = bf16::ZERO;
        assert_eq!((shared[1][0], d[1][0], d[0][0]), (bf16::ONE, bf16::ZERO, bf16::ONE));
    }
}
