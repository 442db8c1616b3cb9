//! The ground floor's vocabulary: a layer's cache state as arrays, owned ([`StateArray`]) or
//! borrowed ([`ArrayView`], and per layer [`LayerView`]), in the shape one oMLX block stores it.
//!
//! The pooler produces these views, segments carry them, the block writer lays them out and the
//! validator and the carry state read them back. They live here, below all of those and
//! importing nothing of the crate, so that none of their users has to import another user to
//! name them (before, they lived inside the pooler and the block layout, and tied the core's
//! files into one import circle).

use half::bf16;

/// One named array of a layer's cache state, row-major bf16.
#[derive(Clone, Debug, PartialEq)]
pub struct StateArray {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub data: Vec<bf16>,
}

/// A borrowed `[rows, width]` bf16 array inside a layer's state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArrayView<'a> {
    pub rows: usize,
    pub width: usize,
    pub data: &'a [bf16],
}

impl<'a> ArrayView<'a> {
    pub fn new(width: usize, data: &'a [bf16]) -> Self {
        ArrayView { rows: data.len().checked_div(width).unwrap_or(0), width, data }
    }
}

/// A DeepSeek-V4-style layer (a rotating window, alone or with compressor pools) as one oMLX
/// block stores it (borrowed).
#[derive(Clone, Debug)]
pub struct V4BlockView<'a> {
    /// Tokens processed (the block's end).
    pub offset: usize,
    pub sliding_window: usize,
    /// 0 for a window-only layer; then `pools` is empty.
    pub ratio: usize,
    pub window: ArrayView<'a>,
    /// Per pool (compressor, then indexer): `[buf_kv, buf_gate, pooled]`.
    pub pools: Vec<[ArrayView<'a>; 3]>,
    /// Per pool: the absolute index of `pooled`'s first row (0: the whole pool).
    pub pool_first: Vec<usize>,
    /// Per pool: the previous ratio-4 window `[kv, gate]` where the decoder carries it (upstream);
    /// `None` for ratio-128 pools, before the first window, and with the fork.
    pub prev: Vec<Option<[ArrayView<'a>; 2]>>,
}

/// One layer's state as a block stores it, borrowed from wherever it lives.
pub enum LayerView<'a> {
    /// DeepSeek-V4: a rotating window alone, or in a `CacheList` with its pools.
    V4(V4BlockView<'a>),
    /// A plain `KVCache` slice: `(keys [rows, dk], values [rows, dv])`.
    Kv(ArrayView<'a>, ArrayView<'a>),
}
