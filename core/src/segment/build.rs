//! Building segments, for the CPU and the GPU capture alike.
//!
//! What goes into a segment is decided here once, from the block geometry of the decoder's
//! layers, its oMLX format and the block size ([`crate::geometry`]): [`SegmentPlan::block`]
//! lists, for the block ending at token `b`, every layer's kind and arrays in wire order — what
//! each array holds (window rows of which tokens, pool rows of which range, remainders, the
//! carried previous window, MLA rows), its shape, and its offset in the segment's body. The body
//! is one contiguous little-endian bf16 buffer ([`SegmentArrays`]): the CPU path copies each
//! layer's arrays from its pooler state into it, the GPU path copies them device-to-host straight
//! into a page-locked body, and framing a segment is its header plus that body as it lies — no
//! per-array buffers, no per-value conversions.
//!
//! A plan depends on the decoder (plan, format, block size) only, never on how the block files are
//! laid out (that is the decode host's business, `block::layout`).

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::body::{BodyStore, SegmentArrays};
use super::{ArrayShape, LayerHeader, LayerKind, Segment, SegmentHeader};
use crate::error::{CoreError, Result};
use crate::format::Overlap;
use crate::geometry::{Geometry, LayerShape};

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

/// The segment builder of one capture: what every block's segment carries.
#[derive(Clone, Debug)]
pub struct SegmentPlan {
    geometry: Geometry,
    request_id: String,
    fingerprint: String,
    /// The model layers the segments carry: all of them, or a pipeline stage's.
    stage: Range<usize>,
}

impl SegmentPlan {
    /// Segments of blocks of `geometry` (the decoder's layers, its oMLX format and block size).
    pub fn new(geometry: Geometry, request_id: &str, fingerprint: &str) -> Self {
        let stage = 0..geometry.layers.len();
        SegmentPlan { geometry, request_id: request_id.into(), fingerprint: fingerprint.into(), stage }
    }

    /// Segments that carry only the model layers `layers` (a pipeline stage's; [`crate::stages`]):
    /// a [`BlockPlan`]'s layers are then those, `layers.start` first.
    pub fn for_stage(mut self, layers: Range<usize>) -> Result<Self> {
        let n = self.geometry.layers.len();
        if layers.start >= layers.end || layers.end > n {
            return Err(CoreError::config("layers", format!("pipeline stage layers {}..{} are not a non-empty range of the model's {n} layers", layers.start, layers.end)));
        }
        self.stage = layers;
        Ok(self)
    }

    /// The model layers the segments carry.
    pub fn stage(&self) -> Range<usize> {
        self.stage.clone()
    }

    pub fn block_size(&self) -> usize {
        self.geometry.block_size
    }

    pub fn num_layers(&self) -> usize {
        self.geometry.layers.len()
    }

    /// Layer `layer`'s compress ratio (0: window only, or MLA).
    pub fn ratio(&self, layer: usize) -> usize {
        self.geometry.layers.get(layer).map_or(0, LayerShape::ratio)
    }

    /// The first token any array of `layer` in block `index`'s segment reads, window lookback
    /// included: [`BlockPlan::first_token`] without planning the block.
    pub fn first_token(&self, index: usize, layer: usize) -> usize {
        let bs = self.geometry.block_size;
        let (start, b) = (index * bs, (index + 1) * bs);
        match self.geometry.layers.get(layer) {
            Some(&LayerShape::Windowed { sliding_window, ratio, .. }) => {
                let n = self.geometry.window_rows(ratio, sliding_window, b);
                // A compressed layer's pool rows and remainders start at the block's start.
                if ratio != 0 { (b - n).min(start) } else { b - n }
            }
            _ => start,
        }
    }

/// The segment of block `index` (tokens `[index·B, (index+1)·B)`), planned.
    pub fn block(&self, index: usize) -> BlockPlan {
        let g = &self.geometry;
        let bs = g.block_size;
        let (start, b) = (index * bs, (index + 1) * bs);
        let carried = g.format.overlap() == Overlap::Carried;
        let mut at = 0usize;
        let mut push = |arrays: &mut Vec<PlannedArray>, source: ArraySource, rows: usize, width: usize| {
            arrays.push(PlannedArray { source, shape: ArrayShape { rows: rows as u32, width: width as u32 }, offset: at });
            at += rows * width;
        };
        let mut layers = Vec::with_capacity(self.stage.len());
        for l in &g.layers[self.stage.clone()] {
            let mut arrays = Vec::new();
            let kind = match *l {
                LayerShape::Windowed { sliding_window, ratio, head_dim, ref pool_heads } => {
                    // A compressed layer's window in a fork block is MLX's raw rotating buffer:
                    // every row of the decoder's last forward call (the decoder prefills block by
                    // block, so the call started at `start`) plus up to `size - 1` before it.
                    let n = g.window_rows(ratio, sliding_window, b);
                    push(&mut arrays, ArraySource::Window { t0: b - n, t1: b }, n, head_dim);
                    let mut pool_starts = Vec::with_capacity(pool_heads.len());
                    for (j, &hd) in pool_heads.iter().enumerate() {
                        let p = g.pool(ratio, hd, b);
                        push(&mut arrays, ArraySource::Remainder { pool: j, gate: false }, p.rem, p.out);
                        push(&mut arrays, ArraySource::Remainder { pool: j, gate: true }, p.rem, p.out);
                        push(&mut arrays, ArraySource::Pooled { pool: j, r0: p.first, r1: p.pooled }, p.pooled - p.first, hd);
                        pool_starts.push(p.first as u64);
                        if carried {
                            // The previous ratio-4 window, once one completed (none for ratio 128).
                            push(&mut arrays, ArraySource::Prev { pool: j, gate: false }, p.prev, p.out);
                            push(&mut arrays, ArraySource::Prev { pool: j, gate: true }, p.prev, p.out);
                        }
                    }
                    LayerKind::V4 { offset: b as u64, sliding_window: sliding_window as u32, ratio: ratio as u32, pool_starts }
                }
                LayerShape::Kv { keys, values } => {
                    push(&mut arrays, ArraySource::Latent { t0: start, t1: b }, bs, keys);
                    push(&mut arrays, ArraySource::RopeKey { t0: start, t1: b }, bs, values);
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
            omlx_format: self.geometry.format.name().to_string(),
            index: block.index as u32,
            start: block.start as u64,
            end: block.end as u64,
            first_layer: self.stage.start as u32,
            layers: block
                .layers
                .iter()
                .map(|l| LayerHeader { kind: l.kind.clone(), arrays: l.arrays.iter().map(|a| a.shape.clone()).collect() })
                .collect(),
        };
        Ok(Segment { header, arrays })
    }
}
