//! Block geometry, in one place: what every array of a layer is at the block ending at token `E`,
//! for a decoder's layers ([`LayerShape`]), an oMLX block format and a block size.
//!
//! At a block ending at token `E` a windowed layer (DeepSeek-V4's cache) of compress ratio `r`
//! holds its window (`head_dim` wide; the last `min(E, sliding_window)` rows, or with the fork's
//! raw rotating buffer of a compressed layer up to `sliding_window - 1` rows before the decoder's
//! last forward call plus that call's), and per pool (the compressor, then for ratio 4 the
//! indexer) `E mod r` remainder rows `out` wide (`2·head` for ratio 4, whose overlap keeps both
//! lanes, else `head`), the pooled rows up to `E / r` (`head` wide; a block's own are those from
//! `(E - block_size) / r`) and, where the decoder carries the overlap (upstream), the previous
//! ratio-4 window (`r` rows `out` wide once one exists). A KV layer (MLA) holds the block's own
//! `block_size` rows of keys and values.
//!
//! The segment plan (what a capture ships), the store spec (what ingest admits and the validator
//! accepts), the block layout (the delta pool's row range), the carry state (what a resumed
//! capture needs) and the pooler's window retention all read these answers; none computes them
//! itself. The layer shapes are the model family's answers ([`crate::family::Family::layer_shapes`]);
//! a format's rules come from [`OmlxFormat`].

use crate::format::{OmlxFormat, Overlap, WindowRows};

/// One layer's cache, as the decoder's model family gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerShape {
    /// A rotating window of `sliding_window` rows `head_dim` wide, alone (`ratio` 0) or in a
    /// `CacheList` with compressor pools of `ratio`: one per head width in `pool_heads` (the
    /// compressor's, then for ratio 4 the indexer's).
    Windowed { sliding_window: usize, ratio: usize, head_dim: usize, pool_heads: Vec<usize> },
    /// A plain KV cache: each block holds its own tokens' rows, `keys` and `values` wide.
    Kv { keys: usize, values: usize },
}

impl LayerShape {
    /// The compress ratio (0: a window alone, or a KV layer).
    pub fn ratio(&self) -> usize {
        match self {
            LayerShape::Windowed { ratio, .. } => *ratio,
            LayerShape::Kv { .. } => 0,
        }
    }
}

/// A pool's raw remainder rows are `out` wide: the ratio-4 compressor keeps both overlap lanes.
pub fn pool_out_dim(ratio: usize, head: usize) -> usize {
    if ratio == 4 {
        2 * head
    } else {
        head
    }
}

/// Rows MLX's rotating buffer holds after `processed` tokens when the decoder starts a forward
/// call every `step` tokens: every row of the current call plus up to `size - 1` before it.
pub fn raw_window_rows(size: usize, step: usize, processed: usize) -> usize {
    if processed == 0 || step == 0 {
        return processed.min(size);
    }
    let call_start = (processed - 1) / step * step;
    processed.min(size.saturating_sub(1) + (processed - call_start))
}

/// Window rows a layer of compress ratio `ratio` holds in a block ending at `end` (forward calls
/// every `step` tokens): the fork's raw rotating buffer for a compressed layer
/// ([`WindowRows::Raw`]), else the last `size` rows.
pub fn window_rows(rows: WindowRows, ratio: usize, size: usize, step: usize, end: usize) -> usize {
    if ratio != 0 && rows == WindowRows::Raw {
        raw_window_rows(size, step, end)
    } else {
        end.min(size)
    }
}

/// Window rows a pooler keeps to answer [`window_rows`] at any point of the decoder's grid.
pub fn window_retain(rows: WindowRows, size: usize, step: usize) -> usize {
    match rows {
        WindowRows::Raw => size - 1 + step,
        WindowRows::Window => size,
    }
}

/// The pooled rows `[first, last)` of a ratio-`ratio` pool new in the block ending at `end`.
pub fn pooled_range(ratio: usize, block_size: usize, end: usize) -> (usize, usize) {
    (end.saturating_sub(block_size).checked_div(ratio).unwrap_or(0), end.checked_div(ratio).unwrap_or(0))
}

/// One pool at a block boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolAt {
    /// Width of a raw (remainder, previous-window) row.
    pub out: usize,
    /// Width of a pooled row.
    pub head: usize,
    /// Raw rows of the incomplete window.
    pub rem: usize,
    /// Pooled rows before the boundary, and the first of them new in the block ending there.
    pub pooled: usize,
    pub first: usize,
    /// Rows of the carried previous ratio-4 window (0: none).
    pub prev: usize,
}

/// The geometry of a decoder's blocks: its layers, in one oMLX format, with one block size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub format: OmlxFormat,
    pub block_size: usize,
    pub layers: Vec<LayerShape>,
}

impl Geometry {
    pub fn new(format: OmlxFormat, block_size: usize, layers: Vec<LayerShape>) -> Self {
        Geometry { format, block_size, layers }
    }

    /// Arrays per pool in a segment (and states per pool in a block, the range aside):
    /// `[buf_kv, buf_gate, pooled]`, plus `[prev_kv, prev_gate]` where the overlap is carried.
    pub fn arity(&self) -> usize {
        if self.format.overlap() == Overlap::Carried {
            5
        } else {
            3
        }
    }

    /// Window rows a block ending at `end` holds for a windowed layer of `ratio` (the decoder
    /// prefills block by block, so its last forward call started a block before `end`).
    pub fn window_rows(&self, ratio: usize, sliding_window: usize, end: usize) -> usize {
        window_rows(self.format.window_rows(), ratio, sliding_window, self.block_size, end)
    }

    /// Window rows a block ending at `end` may hold: exactly the last `min(end, window)`, or
    /// with the fork's raw rotating buffer of a compressed layer up to `window - 1` rows before
    /// the decoder's last call (at most a block) plus that call's.
    pub fn window_rows_range(&self, ratio: usize, sliding_window: usize, end: usize) -> (usize, usize) {
        let last = end.min(sliding_window);
        if ratio == 0 || self.format.window_rows() == WindowRows::Window {
            (last, last)
        } else {
            (last, end.min(sliding_window.saturating_sub(1) + self.block_size))
        }
    }

    /// A ratio-`ratio` pool of `head`-wide pooled rows at the block boundary `end`.
    pub fn pool(&self, ratio: usize, head: usize, end: usize) -> PoolAt {
        let (first, pooled) = pooled_range(ratio, self.block_size, end);
        let carried = self.format.overlap() == Overlap::Carried;
        PoolAt {
            out: pool_out_dim(ratio, head),
            head,
            rem: end.checked_rem(ratio).unwrap_or(0),
            pooled,
            first,
            prev: if carried && ratio == 4 && end >= ratio { ratio } else { 0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_raw_window_holds_the_last_call_and_the_window_before_it() {
        // Window 8, calls every 4 tokens: after 10 tokens the call [8, 12) holds 2 rows, 7 before.
        assert_eq!(raw_window_rows(8, 4, 10), 9);
        assert_eq!(raw_window_rows(8, 4, 12), 11);
        assert_eq!(raw_window_rows(8, 4, 3), 3);
        let g = Geometry::new(OmlxFormat::Fork070, 4, vec![]);
        assert_eq!((g.window_rows(4, 8, 12), g.window_rows(0, 8, 12)), (11, 8));
        assert_eq!(g.window_rows_range(4, 8, 12), (8, 11));
        let u = Geometry::new(OmlxFormat::Upstream063, 4, vec![]);
        assert_eq!((u.window_rows(4, 8, 12), u.window_rows_range(4, 8, 12)), (8, (8, 8)));
    }

    #[test]
    fn pools_at_a_boundary() {
        let u = Geometry::new(OmlxFormat::Upstream063, 8, vec![]);
        assert_eq!(u.pool(4, 3, 24), PoolAt { out: 6, head: 3, rem: 0, pooled: 6, first: 4, prev: 4 });
        assert_eq!(u.pool(128, 3, 24), PoolAt { out: 3, head: 3, rem: 24, pooled: 0, first: 0, prev: 0 });
        let f = Geometry::new(OmlxFormat::Fork070, 8, vec![]);
        assert_eq!(f.pool(4, 3, 24).prev, 0);
    }
}
