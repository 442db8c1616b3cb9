//! The capture engine's GPU backend: a [`GpuCache`] in streaming mode whose outputs are gathered
//! on the device into the segments they belong to, each segment then copied to the host whole.
//!
//! Each block's segment is planned by the capture's [`SegmentPlan`] (the same plan the CPU path
//! fills). Per feed (on the caller's thread, never waiting for the device unless too many blocks
//! are in flight, below): the chunk is queued on the layer's post stream after the producer's
//! stream; right behind its kernels, on that stream, one `copy_rows` launch per open block
//! gathers exactly the rows the block needs from this chunk (its window rows, window lookback
//! included; its new pool rows; its MLA rows; a previous window's columns) to their places in the
//! block's device staging body. Once every layer has been fed to a block's end, one copy stream
//! waits for the post streams and copies the whole body into a page-locked buffer, then records
//! the block's completion event. [`GpuCapture::poll`] queries those events; a completed block
//! becomes a [`Segment`] over its page-locked body as it lies: no host copy of any row.
//!
//! Why gather first: a block's rows come from ~4 arrays per layer, so copying them straight to
//! the host took ~190 small copies per block (6,048 per 65,536 tokens of Flash, 2,688 of them
//! strided), each a driver call on the feeding thread and a fixed cost on the copy engine.
//!
//! Host and device memory are a few blocks' bodies (the chunk's blocks plus those in flight),
//! both from per-device pools reused across blocks and requests, and a chunk's outputs per layer
//! on the device. Nothing accumulates with the prompt's length.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use half::bf16;

use super::dev::{ck, Args, Event, PinnedLease, StagingLease, Stream};
use super::pooler::DevRows;
use super::{DeviceTensor, GpuCache, GpuModel, WindowRows};
use crate::backend::{DeviceBackend, DeviceRequest};
use crate::error::{CoreError, DeviceFailure, Result};
use crate::format::{OmlxFormat, Overlap};
use crate::options::CaptureOptions;
use crate::pooler::DecoderSteps;
use crate::segment::{ArraySource, BlockPlan, Segment, SegmentPlan};
use crate::weights::DecoderWeights;

/// Host seconds the capture engine spent, by phase, over every GPU capture in this process since
/// the last reset: what `bench_gpu` prints beside its end-to-end figure.
#[derive(Clone, Copy, Debug, Default)]
pub struct CaptureTimes {
    /// Queueing the kernels (`GpuCache::feed_device`).
    pub kernels_s: f64,
    /// Queueing the gathers (`copy_rows`), opening blocks included (so `waits_s` spent making room
    /// is counted here too).
    pub gathers_s: f64,
    /// Queueing the host copies of finished blocks.
    pub copies_s: f64,
    /// Waiting for copies (a feed too far ahead of the device, or a waiting poll).
    pub waits_s: f64,
    /// Page-locked or staging buffers newly allocated (no idle one fitted), since the last reset.
    pub new_buffers: u64,
}

static TIMES_NS: [AtomicU64; 4] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

fn add_time(i: usize, since: Instant) {
    TIMES_NS[i].fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// See [`CaptureTimes`]; `reset` zeroes the counters after reading them.
pub fn capture_times(reset: bool) -> CaptureTimes {
    let get = |a: &AtomicU64| if reset { a.swap(0, Ordering::Relaxed) } else { a.load(Ordering::Relaxed) };
    let s = |i: usize| get(&TIMES_NS[i]) as f64 / 1e9;
    CaptureTimes { kernels_s: s(0), gathers_s: s(1), copies_s: s(2), waits_s: s(3), new_buffers: get(&super::dev::NEW_BUFFERS) }
}

/// A block whose body the post streams are gathering on the device.
struct GpuBlock {
    plan: BlockPlan,
    staging: StagingLease,
}

/// A block whose whole body is queued to the host: a segment once `done` completes.
struct Copying {
    plan: BlockPlan,
    body: PinnedLease,
    /// Held until the copy out of it completed.
    _staging: StagingLease,
    done: Event,
}

pub(crate) struct GpuCapture {
    cache: GpuCache,
    plan: SegmentPlan,
    blocks: usize,
    limit: usize,
    open: BTreeMap<usize, GpuBlock>,
    copying: VecDeque<Copying>,
    /// Per layer: tokens whose rows are queued into their blocks' staging bodies.
    fed_upto: Vec<usize>,
    /// The next block to copy to the host.
    next: usize,
    ready: Vec<Segment>,
    /// Copy finished bodies to the host (block k on `copy[k % len]`: several copy engines),
    /// after the post streams' gathers (`gathered`).
    copy: Vec<Stream>,
    gathered: Vec<Event>,
    spare_events: Vec<Event>,
    /// Blocks in flight beyond which a feed first waits for queued copies (set by the first feed).
    max_open: usize,
    /// [`CaptureOptions::open_blocks`]: `max_open` if set.
    open_blocks: Option<usize>,
    /// The block boundary the capture resumed at: rows before it are already the decoder's.
    origin: usize,
    /// A feed failed after queueing device work: some gathers may be missing, so no later block
    /// may be handed out (staging memory is reused, not zeroed) and every call refuses.
    failed: Option<String>,
}

// SAFETY: as for GpuCache; the staging and pinned bodies are only touched through `&mut self`
// until their copies completed, then the pinned one is only read.
unsafe impl Send for GpuCapture {}
unsafe impl Sync for GpuCapture {}

impl Drop for GpuCapture {
    fn drop(&mut self) {
        // Gathers and copies may still be writing into leased bodies: let them finish before the
        // bodies go back to their pools.
        let _ = self.cache.synchronize();
        for c in &self.copy {
            let _ = c.sync();
        }
    }
}

/// Row runs one `copy_rows` launch takes (its parameter struct, kernels.cu).
const COPIES_PER_LAUNCH: usize = 16;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RowCopyArg {
    src: u64,
    src_stride: i64,
    dst: i64,
    rows: i32,
    width: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RowCopiesArg {
    c: [RowCopyArg; COPIES_PER_LAUNCH],
    n: i32,
}

impl GpuCapture {
    /// `None` when this capture is not handled on the GPU (the caller falls back to the CPU path):
    /// blocks must end on pool window boundaries (`block_size` a multiple of every compress
    /// ratio: no remainder rows). Upstream's format (carried overlap, bf16 pooling sums, previous
    /// windows in the segments) is on the GPU too, equal to the CPU path on an H200 (exact GEMM,
    /// Flash shapes and tiny V4, several chunkings); [`CaptureOptions::upstream`] off sends it to
    /// the CPU.
    pub fn new(weights: Arc<DecoderWeights>, device: usize, format: OmlxFormat, plan: SegmentPlan, blocks: usize, options: &CaptureOptions) -> Result<Option<Self>> {
        if declines(format, &plan, options).is_some() {
            return Ok(None);
        }
        let bs = plan.block_size();
        let steps = DecoderSteps::for_format(format, bs)?;
        let model = GpuModel::shared(weights, device)?;
        let mut cache = GpuCache::new(model, steps, options)?;
        cache.window_rows = WindowRows::All;
        let n = plan.num_layers();
        let nposts = cache.post_streams().len();
        Ok(Some(GpuCapture {
            // The streams the finished bodies leave the device on.
            copy: (0..options.copy_streams_used()).map(|_| Stream::new()).collect::<Result<_>>()?,
            gathered: (0..nposts).map(|_| Event::new()).collect::<Result<_>>()?,
            cache,
            plan,
            blocks,
            limit: blocks * bs,
            open: BTreeMap::new(),
            copying: VecDeque::new(),
            fed_upto: vec![0; n],
            next: 0,
            ready: vec![],
            spare_events: vec![],
            max_open: 0,
            open_blocks: options.open_blocks,
            origin: 0,
            failed: None,
        }))
    }

    /// Start at block boundary `carry.position` (before the first feed): `Ok(false)`, nothing
    /// changed, where the GPU path cannot (the caller pools on the CPU then): a block from there
    /// on that reads rows from before it (a window longer than a block), or a compressor window
    /// open at the boundary.
    pub fn resume_at(&mut self, carry: &crate::pooler::carry::CarryState) -> Result<bool> {
        let s = carry.position;
        let bs = self.plan.block_size();
        if s % bs != 0 || self.next != 0 || !self.open.is_empty() {
            return Err(CoreError::device(DeviceFailure::Capture, format!("resume point {s} is not a block boundary, or the GPU capture was fed already")));
        }
        if s / bs < self.blocks && (0..self.plan.num_layers()).any(|l| self.plan.first_token(s / bs, l) < s) {
            return Ok(false);
        }
        if !self.cache.resume_at(carry)? {
            return Ok(false);
        }
        self.origin = s;
        self.next = s / bs;
        self.fed_upto.iter_mut().for_each(|u| *u = s);
        Ok(true)
    }

    /// The side stream the input is read on (torch: `x.record_stream(ExternalStream(handle))`).
    pub fn stream_handle(&self) -> u64 {
        self.cache.stream_handle()
    }

    /// Blocks with device work queued whose segments are not out yet (0 after [`Self::finish`]).
    pub fn pending(&self) -> usize {
        self.open.len() + self.copying.len()
    }

    /// Wait for every stream this capture queued work on, so that buffers can go back to their
    /// pools.
    fn sync_all(&self) -> Result<()> {
        self.cache.synchronize()?;
        for c in &self.copy {
            c.sync()?;
        }
        Ok(())
    }

    fn refuse_if_failed(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(CoreError::device(DeviceFailure::Capture, format!("an earlier feed of this GPU capture failed ({e}); nothing more is captured"))),
            None => Ok(()),
        }
    }

    /// After the seal: blocks never finished (an aborted or partial capture) give their buffers
    /// back once the device is done with them.
    pub fn finish(&mut self) {
        if !self.open.is_empty() && self.sync_all().is_ok() {
            self.open.clear();
        }
    }

    /// Queue `t`'s rows for `layer` (tokens from `start`; rows past the last full block, and on a
    /// resumed capture rows before its resume point, are skipped). An error after device work was
    /// queued fails the capture: later calls refuse.
    pub fn feed(&mut self, layer: usize, start: usize, t: &DeviceTensor) -> Result<()> {
        self.refuse_if_failed()?;
        let hidden = self.cache.model.hidden_size();
        if t.nbytes == 0 || t.nbytes % (hidden * 2) != 0 {
            return Err(CoreError::input(layer, format!("{} bytes is not a whole number of bf16 rows of width {hidden}", t.nbytes)));
        }
        if layer >= self.plan.num_layers() {
            return Err(CoreError::input(layer, format!("the model has {} layers", self.plan.num_layers())));
        }
        let rows = t.nbytes / (hidden * 2);
        let end = (start + rows).min(self.limit);
        // A resumed capture skips what the prefill engine recomputed before its resume point.
        let skip = self.origin.saturating_sub(start);
        let start = start.max(self.origin);
        if end <= start {
            return Ok(());
        }
        let t = &DeviceTensor { ptr: t.ptr + (skip * hidden * 2) as u64, ..*t };
        let bs = self.plan.block_size();
        if self.max_open == 0 {
            self.max_open = blocks_in_flight(self.open_blocks, rows, bs);
        }
        self.cache.model.dev.bind()?;
        let t = DeviceTensor { nbytes: (end - start) * hidden * 2, ..*t };
        let clock = Instant::now();
        let r = self.cache.feed_device(layer, start, &t);
        add_time(0, clock);
        let r = r.and_then(|()| self.queue_feed(layer, start, end));
        if let Err(e) = &r {
            // Part of this chunk's kernels, gathers or copies may be missing: the device state
            // no longer matches the rows fed.
            self.failed = Some(e.to_string());
            let _ = self.sync_all();
        }
        r
    }

    /// The gathers of a fed chunk into its blocks, then the host copies of blocks it finished.
    fn queue_feed(&mut self, layer: usize, start: usize, end: usize) -> Result<()> {
        let clock = Instant::now();
        let outs = self.cache.chunk_outputs(layer);
        // Behind the layer's kernels on its post stream: its next feed, which overwrites these
        // outputs, is queued on the same stream after the gathers.
        let post = self.cache.post_stream(layer);
        let touched: Vec<usize> = blocks_of_feed(&self.plan, self.blocks, layer, start, end).collect();
        for k in touched {
            if !self.open.contains_key(&k) {
                self.make_room()?;
                let bp = self.plan.block(k);
                let staging = StagingLease::take(&self.cache.model.dev, bp.values * 2)?;
                self.open.insert(k, GpuBlock { plan: bp, staging });
            }
            let b = &self.open[&k];
            let copies = row_copies(&b.plan, layer, &outs)?;
            for batch in copies.chunks(COPIES_PER_LAUNCH) {
                let mut arg = RowCopiesArg { c: [RowCopyArg::default(); COPIES_PER_LAUNCH], n: batch.len() as i32 };
                for (a, c) in arg.c.iter_mut().zip(batch) {
                    *a = RowCopyArg { src: c.src, src_stride: c.src_stride as i64, dst: c.dst as i64, rows: c.rows as i32, width: c.width as i32 };
                }
                let most = batch.iter().map(RowCopy::values).max().unwrap_or(0);
                let grid = most.div_ceil(256 * 4).clamp(1, 1024) as u32;
                let mut args = Args::new().p(arg).p(b.staging.ptr());
                self.cache.model.dev.launch("copy_rows", (grid, batch.len() as u32, 1), 256, post, &mut args.ptrs())?;
            }
        }
        let upto = &mut self.fed_upto[layer];
        *upto = (*upto).max(end);
        add_time(1, clock);
        let clock = Instant::now();
        let r = self.queue_finished();
        add_time(2, clock);
        r
    }

    /// Queue the host copy of every block whose every layer has been gathered to its end.
    fn queue_finished(&mut self) -> Result<()> {
        let upto = self.fed_upto.iter().copied().min().unwrap_or(0);
        let bs = self.plan.block_size();
        if !(self.next < self.blocks && (self.next + 1) * bs <= upto) {
            return Ok(());
        }
        for (ev, post) in self.gathered.iter().zip(self.cache.post_streams()) {
            ev.record(post)?;
            for c in &self.copy {
                ck("ordering the copy after the gathers", unsafe { sys::cuStreamWaitEvent(c.0, ev.0, 0) })?;
            }
        }
        while self.next < self.blocks && (self.next + 1) * bs <= upto {
            let cs = self.copy[self.next % self.copy.len()].0;
            let values = self.open.get(&self.next).ok_or_else(|| CoreError::device(DeviceFailure::Capture, format!("block {} was never gathered", self.next)))?.plan.values;
            // Taken before the block leaves `open`: a failure here drops nothing in use.
            let body = PinnedLease::take(&self.cache.model.dev, values)?;
            let done = match self.spare_events.pop() {
                Some(e) => e,
                None => Event::new()?,
            };
            let b = self.open.remove(&self.next).expect("checked above");
            // SAFETY: both bodies hold `values` bf16 values (the plan sized them); the pinned one
            // is read only after `done`, recorded after this copy.
            let queued = ck("copying a segment body to the host", unsafe { sys::cuMemcpyDtoHAsync_v2(body.ptr() as *mut c_void, b.staging.ptr(), values * 2, cs) }).and_then(|()| done.record(cs));
            if let Err(e) = queued {
                // The gathers (and maybe the copy) may still run: wait before the buffers go back.
                let _ = self.sync_all();
                return Err(e);
            }
            self.copying.push_back(Copying { plan: b.plan, body, _staging: b.staging, done });
            self.next += 1;
        }
        Ok(())
    }

    /// Before opening another block: while `max_open` are in flight, wait for the oldest queued
    /// copy (the engine is that far ahead of the device). Blocks still being gathered do not wait.
    fn make_room(&mut self) -> Result<()> {
        while self.open.len() + self.copying.len() >= self.max_open && !self.copying.is_empty() {
            let clock = Instant::now();
            self.copying[0].done.wait()?;
            add_time(3, clock);
            self.take_in(false)?;
        }
        Ok(())
    }

    /// Hand out the blocks whose copies completed (waiting for all queued if `wait`), in block
    /// order.
    fn take_in(&mut self, wait: bool) -> Result<()> {
        while let Some(c) = self.copying.front() {
            if wait {
                let clock = Instant::now();
                c.done.wait()?;
                add_time(3, clock);
            } else if !c.done.done()? {
                break;
            }
            let c = self.copying.pop_front().expect("front exists");
            self.spare_events.push(c.done);
            self.ready.push(self.plan.segment(&c.plan, Arc::new(c.body))?);
        }
        Ok(())
    }

    /// The segments completed so far (waiting for every queued copy if `wait`), in block order.
    pub fn poll(&mut self, wait: bool) -> Result<Vec<Segment>> {
        self.refuse_if_failed()?;
        if !self.copying.is_empty() {
            self.cache.model.dev.bind()?;
            self.take_in(wait)?;
        }
        Ok(std::mem::take(&mut self.ready))
    }
}

/// Why the GPU path does not take captures of `format` with `plan`'s block size (`None`: it
/// does): blocks must end on pool window boundaries (`block_size` a multiple of every compress
/// ratio), and upstream's format needs [`CaptureOptions::upstream`].
pub(crate) fn declines(format: OmlxFormat, plan: &SegmentPlan, options: &CaptureOptions) -> Option<String> {
    let bs = plan.block_size();
    if format.overlap() == Overlap::Carried && !options.upstream {
        return Some(format!("{} blocks are pooled on the CPU (PD_BRIDGE_GPU_UPSTREAM is off)", format.name()));
    }
    (0..plan.num_layers())
        .find(|&l| plan.ratio(l) != 0 && bs % plan.ratio(l) != 0)
        .map(|l| format!("{bs}-token blocks do not end on layer {l}'s compress windows of {} tokens: pooled on the CPU", plan.ratio(l)))
}

/// Blocks one capture keeps open or copying before a feed waits for the oldest copy: the blocks
/// one `step_rows`-token step touches (its own, the next one's window lookback), twice over, as
/// the engine may queue a step while the device works on the previous one
/// ([`CaptureOptions::open_blocks`] overrides).
pub(crate) fn blocks_in_flight(open_blocks: Option<usize>, step_rows: usize, block_size: usize) -> usize {
    open_blocks.unwrap_or(2 * (step_rows.div_ceil(block_size.max(1)) + 2)).max(2)
}

/// The GPU backend for `req`, or `None` where this capture is not handled on the GPU (the
/// capture then pools its CUDA rows on the CPU): see [`GpuCapture::new`] and
/// [`GpuCapture::resume_at`].
pub(crate) fn open(req: DeviceRequest<'_>) -> Result<Option<Box<dyn DeviceBackend>>> {
    let Some(mut g) = GpuCapture::new(req.weights, req.device, req.format, req.plan, req.blocks, req.options)? else {
        return Ok(None);
    };
    if let Some(carry) = req.carry {
        if !g.resume_at(carry)? {
            tracing::debug!(resumed_at = carry.position, "the GPU path cannot start at this resume point: pooling on the CPU");
            return Ok(None);
        }
    }
    Ok(Some(Box::new(g)))
}

impl DeviceBackend for GpuCapture {
    fn feed(&mut self, layer: usize, start: usize, t: &DeviceTensor) -> Result<()> {
        GpuCapture::feed(self, layer, start, t)
    }
    fn poll(&mut self, wait: bool) -> Result<Vec<Segment>> {
        GpuCapture::poll(self, wait)
    }
    fn pending(&self) -> usize {
        GpuCapture::pending(self)
    }
    fn side_stream(&self) -> u64 {
        self.stream_handle()
    }
    fn finish(&mut self) {
        GpuCapture::finish(self)
    }
}

/// The blocks a feed of `layer` with tokens `[start, end)` writes into, in order: from the block
/// holding `start` on, while the block reads a row before `end` (the next block's window looks
/// back into this chunk).
fn blocks_of_feed(plan: &SegmentPlan, blocks: usize, layer: usize, start: usize, end: usize) -> impl Iterator<Item = usize> + '_ {
    (start / plan.block_size()..blocks).take_while(move |&k| plan.first_token(k, layer) < end)
}

/// One run of rows into a block's body: `rows` rows of `width` bf16 values from device address
/// `src` (rows `src_stride` values apart) to offset `dst` (in values), packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowCopy {
    src: u64,
    src_stride: usize,
    dst: usize,
    rows: usize,
    width: usize,
}

impl RowCopy {
    fn values(&self) -> usize {
        self.rows * self.width
    }
}

/// The copies that put the rows of `layer`'s last outputs (`outs`, see
/// [`GpuCache::chunk_outputs`]) that block `b` holds into its body.
fn row_copies(b: &BlockPlan, layer: usize, outs: &[DevRows]) -> Result<Vec<RowCopy>> {
    let arrays = &b.layers[layer].arrays;
    let pools = arrays.iter().filter(|a| matches!(a.source, ArraySource::Pooled { .. })).count();
    let mut v = vec![];
    for a in arrays {
        if a.shape.rows == 0 {
            continue;
        }
        let width = a.shape.width as usize;
        // The output holding this array's rows, the rows wanted in its numbering (tokens, pool
        // rows, or boundary · ratio for previous windows) and the first column.
        let (out, r0, r1, col) = match a.source {
            ArraySource::Window { t0, t1 } | ArraySource::Latent { t0, t1 } => (outs.first(), t0, t1, 0),
            ArraySource::RopeKey { t0, t1 } => (outs.get(1), t0, t1, 0),
            ArraySource::Pooled { pool, r0, r1 } => (outs.get(1 + pool), r0, r1, 0),
            // The window that ended at this block's end: raw kv | gate rows.
            ArraySource::Prev { pool, gate } => {
                let r = a.shape.rows as usize;
                let k = b.end / (b.end - b.start);
                (outs.get(1 + pools + pool).filter(|o| o.width == 2 * width), k * r, (k + 1) * r, if gate { width } else { 0 })
            }
            ArraySource::Remainder { .. } => (None, 0, 0, 0),
        };
        let Some(out) = out.filter(|o| o.width == width || matches!(a.source, ArraySource::Prev { .. })) else {
            return Err(CoreError::device(DeviceFailure::Capture, format!("layer {layer}: the GPU produces no {:?} rows of width {width}", a.source)));
        };
        let (lo, hi) = (r0.max(out.first), r1.min(out.first + out.rows));
        if lo < hi {
            let w = out.width;
            v.push(RowCopy { src: out.ptr + (((lo - out.first) * w + col) * 2) as u64, src_stride: w, dst: a.offset + (lo - r0) * width, rows: hi - lo, width });
        }
    }
    Ok(v)
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

#[cfg(test)]
mod tests {
    //! The GPU path's block assembly on the host: device outputs stood in for by host rows whose
    //! values name their row, copies done with memcpy. Every block body must hold exactly what
    //! its plan lists, for any chunking (the kernels' numerics are tested on a GPU, tests/gpu.rs).
    use super::*;
    use crate::plan::{MlaPlan, ModelPlan, V4Plan};

    /// The value of output `o`'s row `r`, column `c`, of `layer`.
    fn mark(layer: usize, o: usize, r: usize, c: usize) -> bf16 {
        bf16::from_bits(((layer * 7919 + o * 104729 + r * 31 + c * 17) % 30000) as u16)
    }

    fn check(plan: &ModelPlan, bs: usize, tokens: usize, chunks: &[usize]) {
        for format in OmlxFormat::ALL {
            check_format(format, plan, bs, tokens, chunks);
        }
    }

    fn check_format(format: OmlxFormat, plan: &ModelPlan, bs: usize, tokens: usize, chunks: &[usize]) {
        let sp = SegmentPlan::new(crate::family::geometry(plan, format, bs), "r", "fp");
        let carried = format.overlap() == Overlap::Carried;
        let blocks = tokens / bs;
        let limit = blocks * bs;
        let mut bodies: BTreeMap<usize, Vec<bf16>> = BTreeMap::new();
        let mut start = 0;
        let mut i = 0;
        while start < limit {
            let end = (start + chunks[i % chunks.len()]).min(limit);
            i += 1;
            for layer in 0..sp.num_layers() {
                // What GpuCache::chunk_outputs reports for this chunk, on the host.
                let ratio = sp.ratio(layer);
                let widths: Vec<(usize, usize, usize)> = match plan {
                    ModelPlan::DeepseekV4(p) => {
                        let mut v = vec![(start, end - start, p.head_dim)];
                        let mut pools = vec![];
                        if ratio != 0 {
                            pools.push(p.head_dim);
                        }
                        if ratio == 4 {
                            pools.push(p.index_head_dim);
                        }
                        for &hd in &pools {
                            v.push((start / ratio, end / ratio - start / ratio, hd));
                        }
                        // Previous windows at the block boundaries in (start, end]: GpuCache
                        // keeps them with the carried overlap only.
                        let (k0, k1) = (start / bs + 1, end / bs);
                        for &hd in &pools {
                            let n = if carried && ratio == 4 { (k1 + 1).saturating_sub(k0) } else { 0 };
                            let od = if ratio == 4 { 2 * hd } else { hd };
                            v.push((k0 * ratio, n * ratio, 2 * od));
                        }
                        v
                    }
                    ModelPlan::Mla(p) => vec![(start, end - start, p.kv_lora_rank), (start, end - start, p.rope_head_dim)],
                };
                let host: Vec<Vec<bf16>> = widths.iter().enumerate().map(|(o, &(f, n, w))| (0..n * w).map(|e| mark(layer, o, f + e / w, e % w)).collect()).collect();
                let outs: Vec<DevRows> = widths.iter().zip(&host).map(|(&(first, rows, width), h)| DevRows { ptr: h.as_ptr() as u64, first, rows, width }).collect();
                for k in blocks_of_feed(&sp, blocks, layer, start, end) {
                    let bp = sp.block(k);
                    assert_eq!(sp.first_token(k, layer), bp.first_token(layer, ratio));
                    let body = bodies.entry(k).or_insert_with(|| vec![bf16::from_bits(0xffff); bp.values]);
                    for c in row_copies(&bp, layer, &outs).unwrap() {
                        for r in 0..c.rows {
                            // SAFETY: `src` points into one of `host`'s rows (row_copies clips to them).
                            let src = unsafe { std::slice::from_raw_parts((c.src as *const bf16).add(r * c.src_stride), c.width) };
                            body[c.dst + r * c.width..c.dst + (r + 1) * c.width].copy_from_slice(src);
                        }
                    }
                }
            }
            start = end;
        }
        assert_eq!(bodies.len(), blocks, "every block opened");
        for (k, body) in &bodies {
            let bp = sp.block(*k);
            for (layer, l) in bp.layers.iter().enumerate() {
                for a in &l.arrays {
                    let pools = l.arrays.iter().filter(|a| matches!(a.source, ArraySource::Pooled { .. })).count();
                    let w = a.shape.width as usize;
                    let (o, r0, col) = match a.source {
                        ArraySource::Window { t0, .. } | ArraySource::Latent { t0, .. } => (0, t0, 0),
                        ArraySource::RopeKey { t0, .. } => (1, t0, 0),
                        ArraySource::Pooled { pool, r0, .. } => (1 + pool, r0, 0),
                        ArraySource::Prev { pool, gate } if a.shape.rows > 0 => (1 + pools + pool, (k + 1) * a.shape.rows as usize, if gate { w } else { 0 }),
                        _ => {
                            assert_eq!(a.shape.rows, 0, "block {k} layer {layer}: {:?}", a.source);
                            continue;
                        }
                    };
                    for e in 0..a.values() {
                        assert_eq!(body[a.offset + e], mark(layer, o, r0 + e / w, col + e % w), "{format} block {k} layer {layer} {:?} value {e}, chunks {chunks:?}", a.source);
                    }
                }
            }
        }
    }

    fn tiny_v4() -> ModelPlan {
        let mut p = crate::cuda::synthetic::flash_plan();
        p.num_layers = 3;
        p.compress_ratios = vec![0, 4, 128];
        p.head_dim = 16;
        p.index_head_dim = 8;
        p.sliding_window = 8;
        ModelPlan::DeepseekV4(p)
    }

    #[test]
    fn blocks_get_exactly_their_rows_for_any_chunking() {
        let v4 = tiny_v4();
        for chunks in [&[1100][..], &[100, 37, 300], &[256], &[1, 2, 3, 250, 7], &[9]] {
            check(&v4, 256, 1100, chunks);
        }
        let flash = ModelPlan::DeepseekV4(V4Plan { num_layers: 5, ..crate::cuda::synthetic::flash_plan() });
        for chunks in [&[2048][..], &[8192], &[1000, 3000], &[300, 500]] {
            check(&flash, 2048, 9000, chunks);
        }
        check(&flash, 512, 1100, &[300, 500]);
        let mla = ModelPlan::Mla(MlaPlan { hidden_size: 32, num_layers: 2, kv_lora_rank: 16, rope_head_dim: 8, rope_theta: 1e4, yarn: None, latent_norm_eps: 1e-6 });
        for chunks in [&[300][..], &[7, 50, 13], &[16]] {
            check(&mla, 16, 300, chunks);
        }
    }
}
