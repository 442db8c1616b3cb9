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

use half::bf16;

use super::body::{BodyStore, SegmentArrays};
use super::{ArrayShape, LayerHeader, LayerKind, Segment, SegmentHeader};
use crate::error::{CoreError, Result};
use crate::format::{OmlxFormat, Overlap, WindowRows};
use crate::plan::{ModelPlan, V4LayerKind};

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
