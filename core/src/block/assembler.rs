//! The assembler (decode side): rebuilds each block's full state from a request's stream of
//! segments. DeepSeek-V4 segments carry only the pool rows new since the previous block; the
//! fork's blocks carry whole pools, so the assembler accumulates them and lends them to the block
//! writer. Upstream's blocks carry the same deltas as the segments: the assembler then keeps no
//! rows. Either way it checks that every delta starts where the last one ended.

use half::bf16;

use crate::error::{CarryField, CoreError, Result};
use crate::format::PoolLayout;
use crate::segment::{LayerKind, Segment};
use crate::view::LayerView;

#[derive(Default)]
pub struct Assembler {
    /// Per layer, per pool: every pooled row received so far (kept for full-pool blocks only).
    pools: Vec<Vec<Vec<bf16>>>,
    /// Per layer, per pool: pooled rows received so far.
    rows: Vec<Vec<usize>>,
    keep: bool,
}

impl Assembler {
    /// An assembler that keeps the pools (full-pool blocks).
    pub fn new() -> Self {
        Assembler { keep: true, ..Self::default() }
    }

    pub fn for_layout(layout: PoolLayout) -> Self {
        Assembler { keep: layout == PoolLayout::Full, ..Self::default() }
    }

    /// An assembler for a stream resumed at a block boundary (multi-turn): `pool_rows[layer][pool]`
    /// pooled rows exist before it ([`crate::pooler::carry::CarryState::pool_rows`]), so the first delta
    /// must start there. A model with pools resumes only with delta-pool blocks (upstream): a
    /// full-pool block (the fork) would need every earlier pooled row, which a carry state does
    /// not hold.
    pub fn resuming(layout: PoolLayout, pool_rows: &[Vec<u64>]) -> Result<Self> {
        if layout == PoolLayout::Full && pool_rows.iter().any(|p| !p.is_empty()) {
            return Err(CoreError::Carry {
                what: CarryField::Format,
                reason: "full-pool blocks (fork-0.7.0) need every pooled row before the resume point; only delta-pool blocks resume".into(),
            });
        }
        Ok(Assembler {
            pools: pool_rows.iter().map(|p| vec![Vec::new(); p.len()]).collect(),
            rows: pool_rows.iter().map(|p| p.iter().map(|&r| r as usize).collect()).collect(),
            keep: false,
        })
    }

    /// Take in a segment's pool deltas (validated first; nothing changes on error).
    pub fn absorb(&mut self, seg: &Segment) -> Result<()> {
        let layers = &seg.header.layers;
        if self.pools.is_empty() {
            self.pools = layers.iter().map(|l| match &l.kind {
                LayerKind::V4 { pool_starts, .. } => vec![Vec::new(); pool_starts.len()],
                LayerKind::Kv => Vec::new(),
            }).collect();
            self.rows = self.pools.iter().map(|p| vec![0; p.len()]).collect();
        }
        if self.pools.len() != layers.len() {
            return Err(CoreError::wire(format!("segment has {} layers, earlier ones had {}", layers.len(), self.pools.len())));
        }
        // Locate each pool delta among the segment's arrays and check continuity.
        let mut updates = Vec::new();
        let mut at = 0usize;
        for (i, l) in layers.iter().enumerate() {
            if let LayerKind::V4 { pool_starts, .. } = &l.kind {
                if pool_starts.len() != self.pools[i].len() {
                    return Err(CoreError::wire(format!("layer {i}: {} pools, earlier segments had {}", pool_starts.len(), self.pools[i].len())));
                }
                let arity = (l.arrays.len().saturating_sub(1)).checked_div(pool_starts.len()).unwrap_or(3);
                for (j, &first) in pool_starts.iter().enumerate() {
                    let shape = l.arrays.get(1 + arity * j + 2).ok_or_else(|| CoreError::wire(format!("layer {i}: pool {j} missing")))?;
                    let have = self.rows[i][j];
                    if first as usize != have {
                        return Err(CoreError::wire(format!("layer {i} pool {j}: delta starts at row {first}, {have} rows received so far")));
                    }
                    updates.push((i, j, at + 1 + arity * j + 2, shape.rows as usize));
                }
            }
            at += l.arrays.len();
        }
        for (i, j, k, n) in updates {
            let delta = seg.arrays.get(k).ok_or_else(|| CoreError::wire("segment has fewer arrays than its header lists"))?;
            if self.keep {
                self.pools[i][j].extend_from_slice(delta);
            }
            self.rows[i][j] += n;
        }
        Ok(())
    }

    /// The block views of an absorbed segment: its own window, remainders and KV slices, with the
    /// accumulated pools.
    pub fn views<'a>(&'a self, seg: &'a Segment) -> Result<Vec<LayerView<'a>>> {
        if !self.keep {
            return seg.views();
        }
        seg.views_with(|i, j| self.pools.get(i).and_then(|p| p.get(j)).map(Vec::as_slice))
    }
}
