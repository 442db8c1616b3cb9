//! The capture engine's GPU backend: a [`GpuCache`] in streaming mode plus a small host mirror
//! that turns each chunk's device outputs into the same per-block parts the CPU path builds.
//!
//! Per feed (on the caller's thread, never waiting for the device): the chunk is queued on the
//! cache's side stream after the producer's stream, then its outputs (the chunk's window rows,
//! its new pool rows or MLA rows) are copied device-to-host into page-locked memory on the post
//! stream and a completion event is recorded. [`GpuCapture::poll`] queries those events (it does
//! not block unless asked to) and, for each finished chunk, cuts the parts at block boundaries.
//! Host memory is bounded by a chunk, a block and the window, whatever the prompt length; device
//! memory likewise (nothing accumulates there).

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use half::bf16;

use super::dev::{ck, Event, Pinned};
use super::{DeviceTensor, GemmMode, GpuCache, GpuModel, WindowRows};
use crate::error::{CoreError, Result};
use crate::plan::ModelPlan;
use crate::pooler::DecoderSteps;
use crate::segment::{ArrayShape, LayerHeader, LayerKind};
use crate::weights::DecoderWeights;

struct PoolMirror {
    width: usize,
    ratio: usize,
    /// Pool rows produced but not yet shipped, the first being pool row `first`.
    rows: Vec<bf16>,
    first: usize,
}

enum Mirror {
    V4 { hd: usize, size: usize, ratio: usize, retain: usize, hist: Vec<bf16>, pools: Vec<PoolMirror> },
    Mla { rank: usize, rd: usize, latent: Vec<bf16>, kpe: Vec<bf16>, base: usize },
}

struct Pending {
    layer: usize,
    start: usize,
    end: usize,
    done: Event,
    host: Pinned,
    spans: Vec<(usize, usize)>,
}

/// One layer's share of a block's segment, as the CPU path's `take_part` builds it.
pub(crate) struct GpuPart {
    pub layer: usize,
    pub block: usize,
    pub header: LayerHeader,
    pub arrays: Vec<Vec<bf16>>,
}

pub(crate) struct GpuCapture {
    cache: GpuCache,
    steps: DecoderSteps,
    block_size: usize,
    limit: usize,
    mirrors: Vec<Mirror>,
    pending: VecDeque<Pending>,
    spare: Vec<Pinned>,
}

// SAFETY: as for GpuCache; the pinned buffers are only touched through `&mut self`.
unsafe impl Send for GpuCapture {}
unsafe impl Sync for GpuCapture {}

fn shape(width: usize, data: &[bf16]) -> ArrayShape {
    ArrayShape { rows: (data.len() / width.max(1)) as u32, width: width as u32 }
}

impl GpuCapture {
    /// `None` when this model/block size is not handled on the GPU (the caller falls back to the
    /// CPU path): pool remainders at block boundaries need `block_size` to be a multiple of every
    /// compress ratio.
    pub fn new(weights: Arc<DecoderWeights>, device: usize, block_size: usize, blocks: usize) -> Result<Option<Self>> {
        let steps = DecoderSteps::new(block_size)?;
        let mirrors: Vec<Mirror> = match &weights.plan {
            ModelPlan::DeepseekV4(p) => {
                if p.compress_ratios.iter().take(p.num_layers).any(|&r| r != 0 && block_size % r != 0) {
                    return Ok(None);
                }
                (0..p.num_layers)
                    .map(|i| {
                        let ratio = p.compress_ratios[i];
                        let mut pools = vec![];
                        if ratio != 0 {
                            pools.push(PoolMirror { width: p.head_dim, ratio, rows: vec![], first: 0 });
                        }
                        if ratio == 4 {
                            pools.push(PoolMirror { width: p.index_head_dim, ratio, rows: vec![], first: 0 });
                        }
                        Mirror::V4 { hd: p.head_dim, size: p.sliding_window, ratio, retain: p.sliding_window - 1 + block_size, hist: vec![], pools }
                    })
                    .collect()
            }
            ModelPlan::Mla(p) => (0..p.num_layers)
                .map(|_| Mirror::Mla { rank: p.kv_lora_rank, rd: p.rope_head_dim, latent: vec![], kpe: vec![], base: 0 })
                .collect(),
        };
        let model = GpuModel::shared(weights, device)?;
        let mut cache = GpuCache::new(model, steps, GemmMode::from_env())?;
        cache.window_rows = WindowRows::All;
        Ok(Some(GpuCapture { cache, steps, block_size, limit: blocks * block_size, mirrors, pending: VecDeque::new(), spare: vec![] }))
    }

    /// The side stream the input is read on (torch: `x.record_stream(ExternalStream(handle))`).
    pub fn stream_handle(&self) -> u64 {
        self.cache.stream_handle()
    }

    /// Chunks queued whose results have not been taken in yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Queue `t`'s rows for `layer` (tokens from `start`; rows past the last full block are
    /// skipped). Never waits for the device.
    pub fn feed(&mut self, layer: usize, start: usize, t: &DeviceTensor) -> Result<()> {
        let hidden = self.cache.model.hidden_size();
        if t.nbytes == 0 || t.nbytes % (hidden * 2) != 0 {
            return Err(CoreError::input(layer, format!("{} bytes is not a whole number of bf16 rows of width {hidden}", t.nbytes)));
        }
        let rows = t.nbytes / (hidden * 2);
        let end = (start + rows).min(self.limit);
        if end <= start {
            return Ok(());
        }
        let t = DeviceTensor { nbytes: (end - start) * hidden * 2, ..*t };
        self.cache.feed_device(layer, start, &t)?;
        let outs = self.cache.chunk_outputs(layer);
        let total: usize = outs.iter().map(|o| o.1 * 2).sum();
        let host = match self.spare.iter().position(|p| p.bytes >= total) {
            Some(i) => self.spare.swap_remove(i),
            None => Pinned::new(total.next_power_of_two().max(4096))?,
        };
        let s = self.cache.post_stream(layer);
        let mut off = 0;
        let mut spans = vec![];
        for (ptr, elems) in outs {
            if elems > 0 {
                ck("copying results to the host", unsafe { sys::cuMemcpyDtoHAsync_v2(host.ptr.add(off * 2) as *mut c_void, ptr, elems * 2, s) })?;
            }
            spans.push((off, elems));
            off += elems;
        }
        let done = Event::new()?;
        done.record(s)?;
        self.pending.push_back(Pending { layer, start, end, done, host, spans });
        Ok(())
    }

    /// Take in every finished chunk (all of them, waiting, if `wait`) and return the block parts
    /// they complete, in order.
    pub fn poll(&mut self, wait: bool) -> Result<Vec<GpuPart>> {
        if self.pending.is_empty() {
            return Ok(vec![]);
        }
        self.cache.model.dev.bind()?;
        let mut done = vec![];
        while let Some(p) = self.pending.front() {
            if wait {
                p.done.wait()?;
            } else if !p.done.done()? {
                break;
            }
            done.push(self.pending.pop_front().expect("front exists"));
        }
        // Each layer's mirror is independent: take the finished chunks in per layer, in order,
        // on as many threads as there are layers with work (a prompt's worth of window rows is
        // copied once here, from page-locked memory into the segments).
        let mut by_layer: Vec<Vec<&Pending>> = (0..self.mirrors.len()).map(|_| vec![]).collect();
        for p in &done {
            by_layer[p.layer].push(p);
        }
        let bytes: usize = done.iter().map(|p| p.spans.iter().map(|s| s.1).sum::<usize>() * 2).sum();
        let (bs, steps) = (self.block_size, self.steps);
        let work = |m: &mut Mirror, ps: &[&Pending]| -> Vec<GpuPart> {
            let mut parts = vec![];
            for p in ps {
                // SAFETY: the copies into `host` finished (event above); `spans` lie inside it.
                let data: Vec<&[bf16]> =
                    p.spans.iter().map(|&(o, n)| unsafe { std::slice::from_raw_parts(p.host.ptr.add(o * 2) as *const bf16, n) }).collect();
                take_in(m, bs, steps, p.layer, p.start, p.end, &data, &mut parts);
            }
            parts
        };
        let mut parts = vec![];
        if bytes < (8 << 20) {
            for (m, ps) in self.mirrors.iter_mut().zip(&by_layer) {
                parts.extend(work(m, ps));
            }
        } else {
            std::thread::scope(|sc| {
                let hs: Vec<_> = self.mirrors.iter_mut().zip(&by_layer).filter(|(_, ps)| !ps.is_empty()).map(|(m, ps)| sc.spawn(|| work(m, ps))).collect();
                for h in hs {
                    parts.extend(h.join().expect("mirror thread"));
                }
            });
        }
        self.spare.extend(done.into_iter().map(|p| p.host));
        Ok(parts)
    }
}

/// Fold one finished chunk of `layer` into its host mirror; push the block parts it completes.
#[allow(clippy::too_many_arguments)]
fn take_in(m: &mut Mirror, bs: usize, steps: DecoderSteps, layer: usize, start: usize, end: usize, data: &[&[bf16]], parts: &mut Vec<GpuPart>) {
    match m {
        Mirror::V4 { hd, size, ratio, retain, hist, pools } => {
            let hd = *hd;
            // Window rows: `hist` holds tokens [start - hist_rows, start), data[0] [start, end).
            let first_tok = start - hist.len() / hd;
            let win = data[0];
            let rows_of = |hist: &[bf16], t0: usize, t1: usize| -> Vec<bf16> {
                let mut v = Vec::with_capacity((t1 - t0) * hd);
                if t0 < start {
                    v.extend_from_slice(&hist[(t0 - first_tok) * hd..(t1.min(start) - first_tok) * hd]);
                }
                if t1 > start {
                    v.extend_from_slice(&win[(t0.max(start) - start) * hd..(t1 - start) * hd]);
                }
                v
            };
            for (pm, rows) in pools.iter_mut().zip(&data[1..]) {
                pm.rows.extend_from_slice(rows);
            }
            let mut b = (start / bs + 1) * bs;
            while b <= end {
                let n = if *ratio != 0 {
                    // MLX's rotating buffer: every row of the current decoder call plus up to
                    // size - 1 before it (V4LayerState::block_view).
                    let call_start = steps.call_of(b - 1) * steps.step;
                    b.min(*size - 1 + (b - call_start))
                } else {
                    b.min(*size)
                };
                let w = rows_of(hist, b - n, b);
                let mut shapes = vec![shape(hd, &w)];
                let mut arrays = vec![w];
                let mut pool_starts = vec![];
                for pm in pools.iter_mut() {
                    let od = if pm.ratio == 4 { 2 * pm.width } else { pm.width };
                    // block_size is a multiple of the ratio: no remainder rows at a boundary.
                    shapes.push(ArrayShape { rows: 0, width: od as u32 });
                    shapes.push(ArrayShape { rows: 0, width: od as u32 });
                    arrays.push(vec![]);
                    arrays.push(vec![]);
                    let upto = b / pm.ratio;
                    let take = (upto - pm.first) * pm.width;
                    let rows: Vec<bf16> = pm.rows.drain(..take).collect();
                    shapes.push(shape(pm.width, &rows));
                    arrays.push(rows);
                    pool_starts.push(pm.first as u64);
                    pm.first = upto;
                }
                let kind = LayerKind::V4 { offset: b as u64, sliding_window: *size as u32, ratio: *ratio as u32, pool_starts };
                parts.push(GpuPart { layer, block: b / bs - 1, header: LayerHeader { kind, arrays: shapes }, arrays });
                b += bs;
            }
            // Keep the last `retain` rows.
            let new = end - start;
            if new >= *retain {
                *hist = win[(new - *retain) * hd..].to_vec();
            } else {
                let drop = (hist.len() / hd + new).saturating_sub(*retain);
                hist.drain(..drop * hd);
                hist.extend_from_slice(win);
            }
        }
        Mirror::Mla { rank, rd, latent, kpe, base } => {
            latent.extend_from_slice(data[0]);
            kpe.extend_from_slice(data[1]);
            let mut b = (start / bs + 1) * bs;
            while b <= end {
                let k: Vec<bf16> = latent.drain(..(b - *base) * *rank).collect();
                let v: Vec<bf16> = kpe.drain(..(b - *base) * *rd).collect();
                *base = b;
                let header = LayerHeader { kind: LayerKind::Kv, arrays: vec![shape(*rank, &k), shape(*rd, &v)] };
                parts.push(GpuPart { layer, block: b / bs - 1, header, arrays: vec![k, v] });
                b += bs;
            }
        }
    }
}

/// Copy a device tensor to the host (after the producer stream's queued work): the fallback
/// when a capture cannot pool on the GPU. Blocks the caller.
pub(crate) fn copy_to_host(t: &DeviceTensor) -> Result<Vec<bf16>> {
    let d = super::GpuDevice::get(t.device)?;
    d.bind()?;
    ck("waiting for the producer stream", unsafe { sys::cuStreamSynchronize(t.stream as sys::CUstream) })?;
    let mut v = vec![bf16::ZERO; t.nbytes / 2];
    ck("copying to the host", unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut c_void, t.ptr, t.nbytes) })?;
    Ok(v)
}
