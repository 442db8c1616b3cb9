//! DeepSeek-V4's math: the rotating window, the compressor pools and the indexer pool of one
//! layer, following oMLX's MLX model (`omlx/patches/deepseek_v4`) operation by operation.

use half::bf16;

use crate::pooler::carry::{PoolCarry, V4Carry};
use crate::pooler::steps::DecoderSteps;
use crate::format::{Overlap, PoolSum};
use crate::geometry;
use crate::numerics::{linear, rms_norm_rows, round_bf16, softmax_row, Rope};
use crate::plan::{V4LayerKind, V4Plan};
use crate::view::{ArrayView, StateArray, V4BlockView};
use crate::weights::{CompressorWeights, V4LayerWeights};

/// The sliding window: `kv_norm(wkv(x))` rotated at its absolute position, in temporal order.
///
/// MLX's `RotatingKVCache`, updated by a decoder call of `L` tokens, keeps the previous
/// `size - 1` rows plus all `L` new ones; oMLX stores that raw buffer for windows inside a
/// `CacheList`. So the window retains up to `size - 1 + step` rows: enough to rebuild the raw
/// buffer at any point of the decoder's step grid, and the last `size` rows for everything else.
#[derive(Clone, Debug)]
struct Window {
    size: usize,
    retain: usize,
    steps: DecoderSteps,
    head_dim: usize,
    eps: f32,
    rope: Rope,
    rows: Vec<bf16>,
    scratch: Vec<bf16>,
}

impl Window {
    fn feed(&mut self, w: &V4LayerWeights, start: usize, n: usize, x: &[bf16], hidden: usize) {
        // Rows that fall out of the window before the chunk ends are never needed; the
        // projection is row-independent, so skipping them changes nothing.
        let skip = n.saturating_sub(self.retain);
        let keep = n - skip;
        linear(&x[skip * hidden..], keep, hidden, &w.wkv.w, &w.wkv.acc, self.head_dim, &mut self.scratch);
        rms_norm_rows(&mut self.scratch, self.head_dim, &w.kv_norm, self.eps);
        self.rope.apply(&mut self.scratch, self.head_dim, start + skip);
        self.rows.extend_from_slice(&self.scratch);
        let have = self.rows.len() / self.head_dim;
        if have > self.retain {
            self.rows.drain(..(have - self.retain) * self.head_dim);
        }
    }

    /// The last `n` rows.
    fn tail(&self, n: usize) -> &[bf16] {
        let have = self.rows.len() / self.head_dim;
        &self.rows[(have - n.min(have)) * self.head_dim..]
    }
}

/// One step of MLX's CPU sum over the window axis of bf16 products: an f32 accumulator rounded
/// once at the end (mlx 0.32.3), or a bf16 accumulator, every partial rounded (mlx 0.32.0).
#[inline]
fn pool_add(sum: PoolSum, acc: f32, product: bf16) -> f32 {
    match sum {
        PoolSum::F32 => acc + product.to_f32(),
        PoolSum::Bf16 => round_bf16(acc + product.to_f32()).to_f32(),
    }
}

/// One compressor (the layer's pooled KV, or the indexer's): raw `kv`/`gate` rows wait in a
/// remainder buffer until a window of `ratio` rows is complete, which is then pooled, normalised
/// and rotated at the pool position of its first token.
#[derive(Clone, Debug)]
struct Compressor {
    ratio: usize,
    head_dim: usize,
    out_dim: usize,
    overlap: bool,
    eps: f32,
    rope: Rope,
    steps: DecoderSteps,
    /// Raw rows of the incomplete window, `[rem, out_dim]` each.
    buf_kv: Vec<bf16>,
    buf_gate: Vec<bf16>,
    /// The last complete window (ratio 4 only): raw kv and gate, and the token it ended at.
    prev: Option<(Vec<bf16>, Vec<bf16>, usize)>,
    pooled: Vec<bf16>,
    /// Pooled rows already handed out by [`Compressor::drain`] and dropped from `pooled`.
    drained: usize,
    kv: Vec<bf16>,
    gate: Vec<bf16>,
}

impl Compressor {
    fn new(ratio: usize, head_dim: usize, eps: f32, rope: Rope, steps: DecoderSteps) -> Self {
        let overlap = ratio == 4;
        Compressor {
            ratio,
            head_dim,
            out_dim: if overlap { 2 * head_dim } else { head_dim },
            overlap,
            eps,
            rope,
            steps,
            buf_kv: Vec::new(),
            buf_gate: Vec::new(),
            prev: None,
            pooled: Vec::new(),
            drained: 0,
            kv: Vec::new(),
            gate: Vec::new(),
        }
    }

    fn feed(&mut self, w: &CompressorWeights, start: usize, n: usize, x: &[bf16], hidden: usize) {
        let od = self.out_dim;
        let mut kv = std::mem::take(&mut self.kv);
        let mut gate = std::mem::take(&mut self.gate);
        linear(x, n, hidden, &w.wkv.w, &w.wkv.acc, od, &mut kv);
        linear(x, n, hidden, &w.wgate.w, &w.wgate.acc, od, &mut gate);
        let mut pooled_new: Vec<bf16> = Vec::new();
        let mut first_base = None;
        for i in 0..n {
            self.buf_kv.extend_from_slice(&kv[i * od..(i + 1) * od]);
            self.buf_gate.extend_from_slice(&gate[i * od..(i + 1) * od]);
            if self.buf_kv.len() == self.ratio * od {
                let end = start + i + 1;
                let base = end - self.ratio;
                first_base.get_or_insert(base);
                let wkv = std::mem::take(&mut self.buf_kv);
                let wgate = std::mem::take(&mut self.buf_gate);
                let row = if self.overlap { self.overlap_pool(w, &wkv, &wgate, base) } else { self.simple_pool(w, &wkv, &wgate) };
                pooled_new.extend_from_slice(&row);
                if self.overlap {
                    self.prev = Some((wkv, wgate, end));
                }
            }
        }
        self.kv = kv;
        self.gate = gate;
        if let Some(base) = first_base {
            rms_norm_rows(&mut pooled_new, self.head_dim, &w.norm, self.eps);
            // Pool row i of this batch sits at position base/ratio + i, exactly as MLX rotates
            // the batch with `offset = pool_base`.
            self.rope.apply(&mut pooled_new, self.head_dim, base);
            self.pooled.extend_from_slice(&pooled_new);
        }
    }

    /// `_simple_compress_kv`: softmax over the window of `f32(gate) + ape`, weights rounded to
    /// bf16, bf16 products summed in row order as the decoder's MLX sums them ([`pool_add`]).
    fn simple_pool(&self, w: &CompressorWeights, kv: &[bf16], gate: &[bf16]) -> Vec<bf16> {
        let (r, d) = (self.ratio, self.out_dim);
        let mut vals = vec![0f32; r];
        let mut wts = vec![0f32; r];
        (0..d)
            .map(|c| {
                for k in 0..r {
                    vals[k] = gate[k * d + c].to_f32() + w.ape[k * d + c];
                }
                softmax_row(&vals, &mut wts);
                let mut acc = 0f32;
                for k in 0..r {
                    let wb = round_bf16(wts[k]).to_f32();
                    acc = pool_add(self.steps.pool_sum, acc, round_bf16(kv[k * d + c].to_f32() * wb));
                }
                round_bf16(acc)
            })
            .collect()
    }

    /// `_overlap_compress_kv` for one window: the gate gets `bf16(ape)` added in bf16; lane A
    /// (first half of the features) comes from the previous window — with the fork only one of
    /// the same decoder call, else zeros with a -inf gate — and lane B from this window; an
    /// 8-row precise softmax, weights in bf16, bf16 products summed as in [`pool_add`].
    fn overlap_pool(&self, w: &CompressorWeights, kv: &[bf16], gate: &[bf16], base: usize) -> Vec<bf16> {
        let (r, d, h) = (self.ratio, self.out_dim, self.head_dim);
        let prev = self.prev.as_ref().filter(|(_, _, prev_end)| *prev_end == base && self.steps.carries(base, r));
        let gated = |g: &[bf16], k: usize, c: usize| round_bf16(g[k * d + c].to_f32() + round_bf16(w.ape[k * d + c]).to_f32());
        let mut vals = vec![0f32; 2 * r];
        let mut wts = vec![0f32; 2 * r];
        (0..h)
            .map(|c| {
                for k in 0..r {
                    vals[k] = match prev {
                        Some((_, pg, _)) => gated(pg, k, c).to_f32(),
                        None => f32::NEG_INFINITY,
                    };
                    vals[r + k] = gated(gate, k, h + c).to_f32();
                }
                softmax_row(&vals, &mut wts);
                let mut acc = 0f32;
                for k in 0..2 * r {
                    let x = if k < r {
                        prev.map_or(0.0, |(pk, _, _)| pk[k * d + c].to_f32())
                    } else {
                        kv[(k - r) * d + h + c].to_f32()
                    };
                    acc = pool_add(self.steps.pool_sum, acc, round_bf16(x * round_bf16(wts[k]).to_f32()));
                }
                round_bf16(acc)
            })
            .collect()
    }

    /// Continue after `position` tokens from a carry state: its remainder rows, its previous
    /// window (which ended at the last window boundary before `position`), and the count of pooled
    /// rows before it, which the decoder holds already (the next drain starts after them).
    fn restore(&mut self, c: &PoolCarry, position: usize) {
        self.buf_kv = c.buf_kv.clone();
        self.buf_gate = c.buf_gate.clone();
        self.prev = c.prev.as_ref().map(|[k, g]| (k.clone(), g.clone(), position / self.ratio * self.ratio));
        self.pooled.clear();
        self.drained = c.pooled_rows;
    }

    /// Hand out the pooled rows produced since the last drain: `(index of the first, rows)`.
    fn drain(&mut self) -> (usize, Vec<bf16>) {
        let start = self.drained;
        let rows = std::mem::take(&mut self.pooled);
        self.drained += rows.len() / self.head_dim;
        (start, rows)
    }

    /// `(buf_kv, buf_gate, pooled)`, as `PoolingCache.state` orders them.
    fn views(&self) -> [ArrayView<'_>; 3] {
        [ArrayView::new(self.out_dim, &self.buf_kv), ArrayView::new(self.out_dim, &self.buf_gate), ArrayView::new(self.head_dim, &self.pooled)]
    }

    /// The previous window `(kv, gate)` (`[ratio, out_dim]` raw rows) an overlap compressor
    /// carries, when it carries one: upstream's `PoolingCache.prev_win_kv/gate`.
    fn prev_view(&self) -> Option<[ArrayView<'_>; 2]> {
        if !self.overlap || self.steps.overlap != Overlap::Carried {
            return None;
        }
        self.prev.as_ref().map(|(kv, g, _)| [ArrayView::new(self.out_dim, kv), ArrayView::new(self.out_dim, g)])
    }

    fn snapshot(&self, prefix: &'static str, out: &mut Vec<StateArray>) {
        let rem = self.buf_kv.len() / self.out_dim;
        let name = |n: &'static str| -> &'static str {
            match (prefix, n) {
                ("", n) => n,
                (_, "pooled") => "idx_pooled",
                (_, "buf_kv") => "idx_buf_kv",
                (_, "buf_gate") => "idx_buf_gate",
                (_, "prev_kv") => "idx_prev_kv",
                _ => "idx_prev_gate",
            }
        };
        out.push(StateArray { name: name("pooled"), shape: vec![self.pooled.len() / self.head_dim, self.head_dim], data: self.pooled.clone() });
        out.push(StateArray { name: name("buf_kv"), shape: vec![rem, self.out_dim], data: self.buf_kv.clone() });
        out.push(StateArray { name: name("buf_gate"), shape: vec![rem, self.out_dim], data: self.buf_gate.clone() });
        // Upstream's PoolingCache also holds the previous ratio-4 window (empty: None).
        if self.steps.overlap == Overlap::Carried {
            let (kv, gate) = self.prev_view().map_or((Vec::new(), Vec::new()), |[k, g]| (k.data.to_vec(), g.data.to_vec()));
            let rows = kv.len() / self.out_dim;
            out.push(StateArray { name: name("prev_kv"), shape: vec![rows, self.out_dim], data: kv });
            out.push(StateArray { name: name("prev_gate"), shape: vec![rows, self.out_dim], data: gate });
        }
    }
}

/// One DeepSeek-V4 layer's cache state.
#[derive(Clone, Debug)]
pub struct V4LayerState {
    hidden: usize,
    processed: usize,
    window: Window,
    compressor: Option<Compressor>,
    indexer: Option<Compressor>,
}

impl V4LayerState {
    pub fn new(plan: &V4Plan, layer: usize, steps: DecoderSteps) -> Self {
        let ratio = plan.compress_ratios[layer];
        let kind = plan.layer_kind(layer);
        let yarn = plan.yarn.as_ref();
        let window_rope = match kind {
            V4LayerKind::Window => Rope::deepseek_v4(plan.rope_head_dim, plan.rope_theta, None, 1),
            _ => Rope::deepseek_v4(plan.rope_head_dim, plan.compress_rope_theta, yarn, 1),
        };
        let pool_rope = || Rope::deepseek_v4(plan.rope_head_dim, plan.compress_rope_theta, yarn, ratio);
        V4LayerState {
            hidden: plan.hidden_size,
            processed: 0,
            window: Window {
                size: plan.sliding_window,
                retain: geometry::window_retain(steps.window_rows, plan.sliding_window, steps.step),
                steps,
                head_dim: plan.head_dim,
                eps: plan.rms_norm_eps,
                rope: window_rope,
                rows: Vec::new(),
                scratch: Vec::new(),
            },
            compressor: (kind != V4LayerKind::Window).then(|| Compressor::new(ratio, plan.head_dim, plan.rms_norm_eps, pool_rope(), steps)),
            indexer: (kind == V4LayerKind::Sparse).then(|| Compressor::new(ratio, plan.index_head_dim, plan.rms_norm_eps, pool_rope(), steps)),
        }
    }

    /// The state after `position` tokens (a block boundary) from the decoder's carry state there,
    /// which [`crate::pooler::carry::CarryState::check`] matched to this layer of `plan`. With the fork no
    /// previous window is carried: its overlap restarts at every forward call, and one starts at
    /// each block boundary.
    pub(super) fn resume(plan: &V4Plan, layer: usize, steps: DecoderSteps, carry: &V4Carry, position: usize) -> Self {
        let mut s = Self::new(plan, layer, steps);
        s.processed = position;
        s.window.rows = carry.window.clone();
        for (c, p) in s.compressor.iter_mut().chain(s.indexer.iter_mut()).zip(&carry.pools) {
            c.restore(p, position);
        }
        s
    }

    pub fn processed(&self) -> usize {
        self.processed
    }

    pub(super) fn feed(&mut self, w: &V4LayerWeights, start: usize, n: usize, x: &[bf16]) {
        self.window.feed(w, start, n, x, self.hidden);
        if let (Some(c), Some(cw)) = (self.compressor.as_mut(), w.compressor.as_ref()) {
            c.feed(cw, start, n, x, self.hidden);
        }
        if let (Some(c), Some(cw)) = (self.indexer.as_mut(), w.indexer.as_ref()) {
            c.feed(cw, start, n, x, self.hidden);
        }
        self.processed = start + n;
    }

    /// Whether the window sits inside a `CacheList` (compressed layers) or alone (ratio 0).
    pub fn is_cache_list(&self) -> bool {
        self.compressor.is_some()
    }

    /// Take the pooled rows produced since the last call, per pool (compressor, then indexer):
    /// `(first row index, width, rows)`. The streaming capture ships pools as these deltas so
    /// the prefill host never holds a whole prompt's pools; [`Self::block_view`] and
    /// [`Self::snapshot`] then see only rows not yet drained.
    pub fn drain_pools(&mut self) -> Vec<(usize, usize, Vec<bf16>)> {
        self.compressor
            .iter_mut()
            .chain(self.indexer.iter_mut())
            .map(|c| {
                let (start, rows) = c.drain();
                (start, c.head_dim, rows)
            })
            .collect()
    }

    /// What an oMLX block stores for this layer at the current position: a ratio-0 layer's
    /// last `sliding_window` rows; a compressed layer's raw rotating buffer (see [`Window`])
    /// and its pools.
    pub fn block_view(&self) -> V4BlockView<'_> {
        let hd = self.window.head_dim;
        let steps = self.window.steps;
        let rows = geometry::window_rows(steps.window_rows, self.ratio(), self.window.size, steps.step, self.processed);
        V4BlockView {
            offset: self.processed,
            sliding_window: self.window.size,
            ratio: self.ratio(),
            window: ArrayView::new(hd, self.window.tail(rows)),
            pools: self.compressor.iter().chain(self.indexer.iter()).map(Compressor::views).collect(),
            pool_first: self.compressor.iter().chain(self.indexer.iter()).map(|c| c.drained).collect(),
            prev: self.compressor.iter().chain(self.indexer.iter()).map(Compressor::prev_view).collect(),
        }
    }

    /// The compress ratio (0 for a window-only layer).
    pub fn ratio(&self) -> usize {
        self.compressor.as_ref().map_or(0, |c| c.ratio)
    }

    pub fn sliding_window(&self) -> usize {
        self.window.size
    }

    /// The last `sliding_window` rows of the window, then the pools: the cache's content.
    pub fn snapshot(&self) -> Vec<StateArray> {
        let hd = self.window.head_dim;
        let rows = self.processed.min(self.window.size);
        let mut out = vec![StateArray { name: "window", shape: vec![rows, hd], data: self.window.tail(rows).to_vec() }];
        if let Some(c) = &self.compressor {
            c.snapshot("", &mut out);
        }
        if let Some(c) = &self.indexer {
            c.snapshot("idx_", &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 + 2^-8 + 2^-8: an f32 accumulator keeps both halves (1 + 2^-7, exact in bf16); a bf16
    /// accumulator rounds 1 + 2^-8 back to 1 (ties to even) each time, as mlx 0.32.0's sum does.
    #[test]
    fn pool_sum_rounds_every_partial_only_in_bf16() {
        let terms = [bf16::ONE, bf16::from_f32(1.0 / 256.0), bf16::from_f32(1.0 / 256.0)];
        let sum = |s| round_bf16(terms.iter().fold(0f32, |acc, &p| pool_add(s, acc, p)));
        assert_eq!(sum(PoolSum::F32), bf16::from_f32(1.0 + 1.0 / 128.0));
        assert_eq!(sum(PoolSum::Bf16), bf16::ONE);
    }
}
