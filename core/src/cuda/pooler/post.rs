//! The kernels after the projections, per layer kind, all queued on the layer's post stream:
//! the sliding window ([`GpuCache::post_window`]), each compressor's pools
//! ([`GpuCache::post_compressor`]: upstream's previous windows, the pooled rows, the new stash) and
//! MLA's rows ([`GpuCache::post_mla`]). Each step mirrors [`crate::numerics`] operation by
//! operation (see [`crate::cuda`]).

use cudarc::driver::sys;

use super::{GpuCache, WindowRows, BF};
use crate::cuda::dev::{ck, Args, DevBuf};
use crate::cuda::model::{CompDev, GpuModel, LayerDev, RopeDev};
use crate::error::{CoreError, Result};
use crate::format::{Overlap, PoolSum};

/// One chunk of a layer's projection outputs: `rows` rows of `ntot` bf16 values at device
/// address `y`, tokens from `start`.
#[derive(Clone, Copy)]
struct Proj {
    layer: usize,
    start: usize,
    rows: usize,
    y: u64,
    ntot: usize,
}

impl Proj {
    fn end(&self) -> usize {
        self.start + self.rows
    }
}

/// Where a compressor's kernels read a token's raw kv | gate row: the chunk's projection outputs
/// (column `ycol` on), or for tokens before the chunk the stash, whose first row is token `seq0`.
/// The leading arguments of `gather_rows`, `pool_overlap` and `pool_simple`.
#[derive(Clone, Copy)]
struct RawRows {
    y: u64,
    ntot: usize,
    ycol: i32,
    start: usize,
    stash: u64,
    seq0: i64,
}

impl RawRows {
    fn args(&self) -> Args {
        Args::new().p(self.y).p(self.ntot as i64).p(self.ycol).p(self.start as i64).p(self.stash).p(self.seq0)
    }
}

impl GpuCache {
    /// The kernels after the projections (on the post stream): window, pools, MLA rows, for
    /// `rows` projection outputs of `ntot` values at `y` (tokens from `start`).
    pub(super) fn feed_post(&mut self, layer: usize, start: usize, rows: usize, y: u64, ntot: usize) -> Result<()> {
        let p = Proj { layer, start, rows, y, ntot };
        let model = self.model.clone();
        match &model.layers[p.layer] {
            LayerDev::V4 { hd, size, eps, kv_norm, rope, comps, .. } => {
                self.post_window(p, *hd, *size, (kv_norm, *eps), rope)?;
                for (ci, c) in comps.iter().enumerate() {
                    self.post_compressor(&model, p, ci, c, *eps)?;
                }
            }
            LayerDev::Mla { rank, rope_dim, eps, norm, rope, mscale, .. } => {
                self.post_mla(p, (*rank, *rope_dim), (norm, *eps), rope, *mscale)?;
            }
        }
        Ok(())
    }

    /// Window rows: kv_norm(wkv(x)) rotated at their positions, into the chunk's window rows
    /// ([`WindowRows::All`]) or scratch; then the retained window, the last `retain` rows of
    /// (old ++ new).
    fn post_window(&mut self, p: Proj, hd: usize, size: usize, norm: (&DevBuf, f32), rope: &RopeDev) -> Result<()> {
        let (start, rows) = (p.start, p.rows);
        let s = self.post_stream(p.layer);
        let pi = self.post_of(p.layer);
        let retain = crate::geometry::window_retain(crate::format::WindowRows::Raw, size, self.steps.step);
        let nw = match self.window_rows {
            WindowRows::All => rows,
            WindowRows::Retained => rows.min(retain),
        };
        let first = rows - nw;
        let lr = &mut self.layers[p.layer];
        let dst = if self.window_rows == WindowRows::All {
            lr.chunk_win.reserve(nw * hd * BF)?;
            lr.chunk_win_span = (start + first, nw);
            lr.chunk_win.ptr
        } else {
            self.wtmp[pi].reserve(nw * hd * BF)?;
            self.wtmp[pi].ptr
        };
        self.norm_rope(s, p.y + (first * p.ntot * BF) as u64, p.ntot, dst, hd, nw, hd, Some((norm.0.ptr, norm.1)), None, Some((rope, start + first)))?;
        // The retained window: the last `retain` rows of (old ++ new).
        let lr = &mut self.layers[p.layer];
        let total = (lr.win_rows + nw).min(retain);
        let from_new = nw.min(total);
        let from_old = total - from_new;
        let nxt = 1 - lr.cur;
        lr.win[nxt].reserve(retain * hd * BF)?;
        let (old, newb) = (lr.win[lr.cur].ptr, lr.win[nxt].ptr);
        if from_old > 0 {
            ck("window copy", unsafe { sys::cuMemcpyDtoDAsync_v2(newb, old + ((lr.win_rows - from_old) * hd * BF) as u64, from_old * hd * BF, s) })?;
        }
        ck("window copy", unsafe { sys::cuMemcpyDtoDAsync_v2(newb + (from_old * hd * BF) as u64, dst + ((nw - from_new) * hd * BF) as u64, from_new * hd * BF, s) })?;
        lr.cur = nxt;
        lr.win_rows = total;
        Ok(())
    }

    /// Compressor `ci` of the layer: upstream's previous windows at the step boundaries, the
    /// windows this chunk completes pooled, normed and rotated, then the new stash.
    fn post_compressor(&mut self, model: &GpuModel, p: Proj, ci: usize, c: &CompDev, eps: f32) -> Result<()> {
        let (stash, seq0) = {
            let cr = &self.layers[p.layer].comps[ci];
            (cr.stash[cr.cur].ptr, (p.start - cr.stash_rows) as i64)
        };
        if self.window_rows == WindowRows::All {
            // Streaming: the previous chunk's pool rows were handed out.
            let cr = &mut self.layers[p.layer].comps[ci];
            cr.drained += cr.pooled_rows;
            cr.pooled_rows = 0;
        }
        let raw = RawRows { y: p.y, ntot: p.ntot, ycol: c.col as i32, start: p.start, stash, seq0 };
        if c.ratio == 4 && self.window_rows == WindowRows::All && self.steps.overlap == Overlap::Carried {
            self.keep_prev_windows(model, p, ci, c, raw)?;
        }
        if p.end() / c.ratio > p.start / c.ratio {
            self.pool_windows(model, p, ci, c, raw, eps)?;
        }
        self.restash(model, p, ci, c, raw)
    }

    /// Each step boundary in (start, end] ends a block: keep its previous window's raw rows (the
    /// segment carries them), before the stash moves on.
    fn keep_prev_windows(&mut self, model: &GpuModel, p: Proj, ci: usize, c: &CompDev, raw: RawRows) -> Result<()> {
        let s = self.post_stream(p.layer);
        let (r, sw) = (c.ratio, 2 * c.od);
        let step = self.steps.step;
        let (k0, k1) = (p.start / step + 1, p.end() / step);
        let cr = &mut self.layers[p.layer].comps[ci];
        cr.prev_first = k0;
        cr.prev_count = (k1 + 1).saturating_sub(k0);
        if cr.prev_count > 0 {
            cr.prev.reserve(cr.prev_count * r * sw * BF)?;
            for (i, k) in (k0..=k1).enumerate() {
                let mut a = raw.args().p(sw as i32).p((k * step - r) as i64).p(r as i32).p(cr.prev.ptr + (i * r * sw * BF) as u64);
                model.dev.launch("gather_rows", (r as u32, 1, 1), 256, s, &mut a.ptrs())?;
            }
        }
        Ok(())
    }

    /// The windows this chunk completes: pooled (`pool_overlap` for ratio 4, `pool_simple`
    /// otherwise) into scratch, then normed and rotated onto the end of the pooled rows.
    fn pool_windows(&mut self, model: &GpuModel, p: Proj, ci: usize, c: &CompDev, raw: RawRows, eps: f32) -> Result<()> {
        let s = self.post_stream(p.layer);
        let pi = self.post_of(p.layer);
        let r = c.ratio;
        let base0 = p.start / r * r;
        let windows = p.end() / r - p.start / r;
        let bf16_sum = self.steps.pool_sum == PoolSum::Bf16;
        // The fork restarts the ratio-4 overlap at every decoder call; upstream carries it (the
        // kernel sees one call spanning everything).
        let call_step = if self.steps.overlap == Overlap::Carried { i32::MAX } else { self.steps.step as i32 };
        self.ptmp[pi].reserve(windows * c.hd * BF)?;
        let out = self.ptmp[pi].ptr;
        let grid = (c.hd.div_ceil(128) as u32, windows as u32, 1);
        if r == 4 {
            let mut a = raw.args().p(base0 as i64).p(windows as i32).p(c.hd as i32).p(c.ape.ptr).p(call_step).p(bf16_sum as i32).p(out);
            model.dev.launch("pool_overlap", grid, 128, s, &mut a.ptrs())?;
        } else {
            if r > 128 {
                return Err(CoreError::config("compress_ratios", format!("the GPU path pools ratios up to 128, not {r}")));
            }
            let mut a = raw.args().p(base0 as i64).p(windows as i32).p(c.hd as i32).p(r as i32).p(c.ape.ptr).p(bf16_sum as i32).p(out);
            let g = (c.hd.div_ceil(32) as u32, windows as u32, 1);
            model.dev.launch2("pool_simple", g, (32, 8), s, &mut a.ptrs())?;
        }
        let cr = &mut self.layers[p.layer].comps[ci];
        cr.pooled.grow_keep((cr.pooled_rows + windows) * c.hd * BF, cr.pooled_rows * c.hd * BF)?;
        let dst = cr.pooled.ptr + (cr.pooled_rows * c.hd * BF) as u64;
        cr.pooled_rows += windows;
        self.norm_rope(s, out, c.hd, dst, c.hd, windows, c.hd, Some((c.norm.ptr, eps)), None, Some((&c.rope, base0 / c.rope.freq_scale)))
    }

    /// The new stash: the remainder, and for ratio 4 the last complete window too.
    fn restash(&mut self, model: &GpuModel, p: Proj, ci: usize, c: &CompDev, raw: RawRows) -> Result<()> {
        let s = self.post_stream(p.layer);
        let (r, sw, end) = (c.ratio, 2 * c.od, p.end());
        let rem = end % r;
        let keep = rem + if r == 4 { r.min(end - rem) } else { 0 };
        let cr = &mut self.layers[p.layer].comps[ci];
        let nxt = 1 - cr.cur;
        cr.stash[nxt].reserve(2 * r * sw * BF)?;
        let mut a = raw.args().p(sw as i32).p((end - keep) as i64).p(keep as i32).p(cr.stash[nxt].ptr);
        model.dev.launch("gather_rows", (keep as u32, 1, 1), 256, s, &mut a.ptrs())?;
        cr.cur = nxt;
        cr.stash_rows = keep;
        Ok(())
    }

    /// MLA: the latent rows normed, the k_pe rows scaled and rotated, appended to those held.
    fn post_mla(&mut self, p: Proj, (rank, rd): (usize, usize), norm: (&DevBuf, f32), rope: &RopeDev, mscale: Option<f32>) -> Result<()> {
        let s = self.post_stream(p.layer);
        let rows = p.rows;
        let lr = &mut self.layers[p.layer];
        if self.window_rows == WindowRows::All {
            // Streaming: the previous chunk's rows were handed out.
            lr.mla_base = lr.processed;
        }
        let held = lr.processed - lr.mla_base;
        lr.latent.grow_keep((held + rows) * rank * BF, held * rank * BF)?;
        lr.kpe.grow_keep((held + rows) * rd * BF, held * rd * BF)?;
        let (lat, kpe) = (lr.latent.ptr + (held * rank * BF) as u64, lr.kpe.ptr + (held * rd * BF) as u64);
        self.norm_rope(s, p.y, p.ntot, lat, rank, rows, rank, Some((norm.0.ptr, norm.1)), None, None)?;
        self.norm_rope(s, p.y + (rank * BF) as u64, p.ntot, kpe, rd, rows, rd, None, mscale, Some((rope, p.start)))
    }

    /// One `norm_rope` launch: `rows` rows of `dim` values from `src` to `dst`, RMS-normed with
    /// weights `norm`, scaled by `mscale`, rotated from position `rope.1` (each optional).
    #[allow(clippy::too_many_arguments)]
    fn norm_rope(&self, s: sys::CUstream, src: u64, src_stride: usize, dst: u64, dst_stride: usize, rows: usize, dim: usize, norm: Option<(u64, f32)>, mscale: Option<f32>, rope: Option<(&RopeDev, usize)>) -> Result<()> {
        let (wp, eps, dn) = norm.map_or((0u64, 0f32, 0i32), |(w, e)| (w, e, 1));
        let (ms, dm) = mscale.map_or((1f32, 0i32), |m| (m, 1));
        let (inv, pairs, pos0) = rope.map_or((0u64, 0i32, 0i64), |(r, p)| (r.inv.ptr, r.pairs as i32, p as i64));
        let mut a = Args::new().p(src).p(src_stride as i64).p(dst).p(dst_stride as i64).p(dim as i32).p(wp).p(eps).p(dn).p(ms).p(dm).p(inv).p(pairs).p(pos0);
        self.model.dev.launch("norm_rope", (rows as u32, 1, 1), 256, s, &mut a.ptrs())
    }
}
