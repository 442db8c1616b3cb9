//! The capture engine (prefill side): one request's attention inputs in, segments out.
//!
//! Each layer's input arrives chunk by chunk, layer after layer, in whatever chunks the prefill
//! engine uses. The capture feeds the pooler, cutting chunks at the decoder's block boundaries;
//! at each boundary it takes that layer's part of the block's segment — the window, the
//! remainders, and only the pooled rows produced since the previous boundary (DeepSeek-V4), or
//! the block's latent rows (MLA) — and drops what it no longer needs. When every layer has
//! delivered its part of a block, the segment is ready, in block order. Host memory per request
//! is bounded by a block and the window, whatever the prompt length.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use half::bf16;

use crate::error::{CoreError, Result};
use crate::pooler::{CacheBuilder, DecoderSteps, LayerState};
use crate::segment::{ArrayShape, LayerHeader, LayerKind, Segment, SegmentHeader};
use crate::weights::DecoderWeights;
use crate::wire::Seal;

/// One layer's share of a block's segment.
struct Part {
    header: LayerHeader,
    arrays: Vec<Vec<bf16>>,
}

pub struct Capture {
    request_id: String,
    fingerprint: String,
    block_size: usize,
    /// Full blocks of the prompt: the blocks the decoder can take as a prefix hit.
    blocks: usize,
    builder: CacheBuilder,
    assembling: BTreeMap<usize, Vec<Option<Part>>>,
    ready: VecDeque<Segment>,
    emitted: usize,
    sealed: Option<Seal>,
}

fn shape(width: usize, data: &[bf16]) -> ArrayShape {
    ArrayShape { rows: (data.len() / width.max(1)) as u32, width: width as u32 }
}

impl Capture {
    /// `prompt_tokens`: the prompt's length; `block_size`: the decoder's block size (also its
    /// prefill step grid).
    pub fn new(weights: Arc<DecoderWeights>, request_id: &str, prompt_tokens: usize, block_size: usize) -> Result<Self> {
        let steps = DecoderSteps::new(block_size)?;
        let fingerprint = weights.fingerprint.clone();
        Ok(Capture {
            request_id: request_id.into(),
            fingerprint,
            block_size,
            blocks: prompt_tokens / block_size,
            builder: CacheBuilder::new(weights, steps),
            assembling: BTreeMap::new(),
            ready: VecDeque::new(),
            emitted: 0,
            sealed: None,
        })
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Full blocks this capture will produce if it completes.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Fold `x` (`[rows, hidden]`, tokens from `start`) into `layer`. Tokens past the last full
    /// block are not needed by the decoder and are skipped.
    pub fn feed(&mut self, layer: usize, start: usize, x: &[bf16]) -> Result<()> {
        if self.sealed.is_some() {
            return Err(CoreError::input(layer, format!("capture {} is already sealed", self.request_id)));
        }
        let hidden = self.builder.hidden_size();
        if x.is_empty() || x.len() % hidden != 0 {
            return Err(CoreError::input(layer, format!("{} values is not a positive whole number of rows of width {hidden}", x.len())));
        }
        let end = start + x.len() / hidden;
        let limit = self.blocks * self.block_size;
        let mut cursor = start;
        while cursor < end.min(limit) {
            let boundary = (cursor / self.block_size + 1) * self.block_size;
            let stop = end.min(boundary);
            self.builder.feed(layer, cursor, &x[(cursor - start) * hidden..(stop - start) * hidden])?;
            cursor = stop;
            if stop == boundary {
                self.take_part(layer, boundary / self.block_size - 1)?;
            }
        }
        Ok(())
    }

    fn take_part(&mut self, layer: usize, block: usize) -> Result<()> {
        let (start, end) = (block * self.block_size, (block + 1) * self.block_size);
        let state = self.builder.layer_mut(layer).ok_or_else(|| CoreError::input(layer, "no such layer"))?;
        let part = match state {
            LayerState::V4(s) => {
                let deltas = s.drain_pools();
                let v = s.block_view();
                let mut arrays = vec![v.window.data.to_vec()];
                let mut shapes = vec![shape(v.window.width, v.window.data)];
                let mut pool_starts = Vec::new();
                for (pool, (first, width, rows)) in v.pools.iter().zip(deltas) {
                    for a in &pool[..2] {
                        shapes.push(shape(a.width, a.data));
                        arrays.push(a.data.to_vec());
                    }
                    shapes.push(shape(width, &rows));
                    arrays.push(rows);
                    pool_starts.push(first as u64);
                }
                let kind = LayerKind::V4 { offset: v.offset as u64, sliding_window: v.sliding_window as u32, ratio: v.ratio as u32, pool_starts };
                Part { header: LayerHeader { kind, arrays: shapes }, arrays }
            }
            LayerState::Mla(s) => {
                let (k, v) = s.rows(start, end);
                let part = Part {
                    header: LayerHeader { kind: LayerKind::Kv, arrays: vec![shape(k.width, k.data), shape(v.width, v.data)] },
                    arrays: vec![k.data.to_vec(), v.data.to_vec()],
                };
                s.drop_before(end);
                part
            }
        };
        let n = self.builder.num_layers();
        let slot = self.assembling.entry(block).or_insert_with(|| (0..n).map(|_| None).collect());
        slot[layer] = Some(part);
        self.promote();
        Ok(())
    }

    /// Move every block whose parts are all in, in order, to the ready queue.
    fn promote(&mut self) {
        while let Some(parts) = self.assembling.get(&self.emitted) {
            if parts.iter().any(Option::is_none) {
                break;
            }
            let parts = self.assembling.remove(&self.emitted).expect("present");
            let (mut layers, mut arrays) = (Vec::with_capacity(parts.len()), Vec::new());
            for p in parts.into_iter().flatten() {
                layers.push(p.header);
                arrays.extend(p.arrays);
            }
            let k = self.emitted;
            let header = SegmentHeader {
                request_id: self.request_id.clone(),
                fingerprint: self.fingerprint.clone(),
                index: k as u32,
                start: (k * self.block_size) as u64,
                end: ((k + 1) * self.block_size) as u64,
                layers,
            };
            self.ready.push_back(Segment { header, arrays });
            self.emitted += 1;
        }
    }

    /// Segments completed since the last call, in block order.
    pub fn take_ready(&mut self) -> Vec<Segment> {
        self.ready.drain(..).collect()
    }

    /// End the capture. `failure`: why the prefill stopped early (abort, error), if it did. The
    /// seal counts only segments already produced; a valid prefix is never retracted.
    pub fn seal(&mut self, failure: Option<&str>) -> Seal {
        if let Some(s) = &self.sealed {
            return s.clone();
        }
        let blocks = self.emitted as u32;
        let tokens = (self.emitted * self.block_size) as u64;
        let seal = match failure {
            Some(reason) => Seal::Aborted { blocks, reason: reason.into() },
            None if self.emitted == self.blocks => Seal::Complete { blocks, tokens },
            None => Seal::Partial { blocks, tokens, reason: format!("only {} of {} blocks were captured", self.emitted, self.blocks) },
        };
        self.assembling.clear();
        self.sealed = Some(seal.clone());
        seal
    }
}
