//! One request's decoder cache on the GPU ([`GpuCache`]): its per-layer device state (rotating
//! window, compressor stashes and pools, MLA rows), the streams and the projection step (a chunk
//! of a layer is one GEMM on the side stream into a ring of output slots, handed to the layer's
//! post stream with an event); the kernels after the projections are in [`post`], the resident
//! weights in [`super::model`].

mod post;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys as cb;
use cudarc::driver::sys;
use half::bf16;

use super::dev::{ck, err, Args, DevBuf, Event, SideStream, Stream};
use super::model::{GpuModel, LayerDev};
use super::{DeviceTensor, GemmMode};
use crate::error::{CoreError, DeviceFailure, Result};
use crate::format::Overlap;
use crate::options::CaptureOptions;
use crate::pooler::carry::{CarryState, LayerCarry};
use crate::pooler::DecoderSteps;
use crate::view::StateArray;

const BF: usize = 2;

/// Rows `[first, first + rows)` (tokens, or pool rows) of `width` bf16 values at `ptr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevRows {
    pub ptr: u64,
    pub first: usize,
    pub rows: usize,
    pub width: usize,
}

/// Which window rows a feed keeps for the caller to read (see [`GpuCache::chunk_window`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowRows {
    /// Only what the state needs (the last `sliding_window - 1 + step` rows).
    Retained,
    /// Every row of the chunk (the capture ships them in segments).
    All,
}

struct CompRun {
    stash: [DevBuf; 2],
    cur: usize,
    /// Raw (kv | gate) rows of the last `stash_rows` tokens before `processed`.
    stash_rows: usize,
    pooled: DevBuf,
    pooled_rows: usize,
    /// Pool rows already handed out by `drain_pools` and dropped.
    drained: usize,
    /// Streaming with the overlap carried across calls (upstream): the raw (kv | gate) rows of
    /// the last ratio-4 window before each decoder-step boundary of the last chunk, `ratio` rows
    /// per boundary, from the boundary `prev_first` (a step index) on.
    prev: DevBuf,
    prev_first: usize,
    prev_count: usize,
}

struct LayerRun {
    processed: usize,
    win: [DevBuf; 2],
    cur: usize,
    win_rows: usize,
    comps: Vec<CompRun>,
    /// MLA rows held (tokens `[mla_base, processed)`).
    latent: DevBuf,
    kpe: DevBuf,
    mla_base: usize,
    /// This layer's window rows of the last chunk (WindowRows::All): `(first token, rows)`.
    chunk_win: DevBuf,
    chunk_win_span: (usize, usize),
}

/// One request's decoder cache on the GPU.
pub struct GpuCache {
    pub model: Arc<GpuModel>,
    steps: DecoderSteps,
    mode: GemmMode,
    pub window_rows: WindowRows,
    cublas: cb::cublasHandle_t,
    /// Projection outputs, a ring of slots: layer L's kernels (on `post`) overlap the GEMMs of
    /// the layers after it (on `stream`).
    y: Vec<DevBuf>,
    slot: usize,
    ev_gemm: Vec<Event>,
    ev_post: Vec<Event>,
    xbuf: DevBuf,
    /// Scratch for the kernels, one per post stream (layers on different streams run at once).
    wtmp: Vec<DevBuf>,
    ptmp: Vec<DevBuf>,
    layers: Vec<LayerRun>,
    order: Event,
    /// Benchmark switch: run the projections only (no window, pools or norms).
    pub gemm_only: bool,
    /// Last: every buffer above is freed on one of these (stream-ordered) before they go.
    /// `post` runs the kernels after the projections and owns the layer state: layer L on
    /// `post[L % post.len()]`. The layers' states are independent, so with several post streams
    /// the small kernels of consecutive layers run concurrently instead of one after another
    /// (`PD_BRIDGE_GPU_POST_STREAMS`); a layer's own work stays in order on its stream.
    post: Vec<Stream>,
    /// The side stream: ordered after the producer, runs the projections.
    stream: SideStream,
}

// SAFETY: the raw handles (cuBLAS, streams, events, device pointers) are usable from any thread
// once the context is bound, which every entry point does; mutation needs `&mut self`, and the
// `&self` methods only query or synchronise.
unsafe impl Send for GpuCache {}
unsafe impl Sync for GpuCache {}

impl Drop for GpuCache {
    fn drop(&mut self) {
        let _ = self.model.dev.bind();
        let _ = self.stream.sync();
        for p in &self.post {
            let _ = p.sync();
        }
        unsafe { cb::cublasDestroy_v2(self.cublas) };
    }
}

impl GpuCache {
    /// A cache on `model`'s device with `options`' GEMM mode, post streams, slots and stream
    /// priority (see [`CaptureOptions`]).
    pub fn new(model: Arc<GpuModel>, steps: DecoderSteps, options: &CaptureOptions) -> Result<Self> {
        let mode = options.gemm;
        let nposts = options.post_streams_used();
        // A slot is reused only when the kernels that read it are done: one more slot than post
        // streams lets every post stream hold a layer while the GEMMs go on.
        let slots = options.slots_used();
        model.dev.bind()?;
        let stream = SideStream::lend(&model.dev)?;
        // Post streams at high priority: measured slower with several (they crowd out the GEMMs).
        let high = options.post_priority;
        let post = (0..nposts).map(|_| if high { Stream::high_priority() } else { Stream::new() }).collect::<Result<Vec<_>>>()?;
        let mut h = std::ptr::null_mut();
        let st = unsafe { cb::cublasCreate_v2(&mut h) };
        if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(err(
                "creating a cuBLAS handle (is libcublas on the library path?)",
                st,
            ));
        }
        unsafe { cb::cublasSetStream_v2(h, stream.handle() as cb::cudaStream_t) };
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l, post[i % nposts].0))
            .map(|(l, s)| LayerRun {
                processed: 0,
                win: [DevBuf::empty(s), DevBuf::empty(s)],
                cur: 0,
                win_rows: 0,
                comps: match l {
                    LayerDev::V4 { comps, .. } => comps
                        .iter()
                        .map(|_| CompRun {
                            stash: [DevBuf::empty(s), DevBuf::empty(s)],
                            cur: 0,
                            stash_rows: 0,
                            pooled: DevBuf::empty(s),
                            pooled_rows: 0,
                            drained: 0,
                            prev: DevBuf::empty(s),
                            prev_first: 0,
                            prev_count: 0,
                        })
                        .collect(),
                    LayerDev::Mla { .. } => vec![],
                },
                latent: DevBuf::empty(s),
                kpe: DevBuf::empty(s),
                mla_base: 0,
                chunk_win: DevBuf::empty(s),
                chunk_win_span: (0, 0),
            })
            .collect();
        Ok(GpuCache {
            model,
            steps,
            mode,
            window_rows: WindowRows::Retained,
            y: (0..slots).map(|_| DevBuf::empty(stream.handle())).collect(),
            slot: 0,
            ev_gemm: (0..slots).map(|_| Event::new()).collect::<Result<_>>()?,
            ev_post: (0..slots).map(|_| Event::new()).collect::<Result<_>>()?,
            xbuf: DevBuf::empty(stream.handle()),
            wtmp: post.iter().map(|p| DevBuf::empty(p.0)).collect(),
            ptmp: post.iter().map(|p| DevBuf::empty(p.0)).collect(),
            stream,
            post,
            cublas: h,
            layers,
            order: Event::new()?,
            gemm_only: false,
        })
    }

    /// The side stream every feed runs on (as an integer handle, for `torch.cuda.ExternalStream`).
    pub fn stream_handle(&self) -> u64 {
        self.stream.handle() as u64
    }

    /// The stream `layer`'s state is updated on: work queued on it after a feed of that layer
    /// sees the feed's results (device-to-host copies of the state, completion events).
    pub(crate) fn post_stream(&self, layer: usize) -> sys::CUstream {
        self.post[self.post_of(layer)].0
    }

    /// Every post stream, in order.
    pub(crate) fn post_streams(&self) -> Vec<sys::CUstream> {
        self.post.iter().map(|p| p.0).collect()
    }

    pub(crate) fn post_of(&self, layer: usize) -> usize {
        layer % self.post.len()
    }

    pub fn processed(&self, layer: usize) -> Option<usize> {
        self.layers.get(layer).map(|l| l.processed)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Wait until every queued feed has finished (tests, benchmarks, and a capture's seal).
    pub fn synchronize(&self) -> Result<()> {
        self.model.dev.bind()?;
        self.stream.sync()?;
        for p in &self.post {
            p.sync()?;
        }
        Ok(())
    }

    /// Start every layer at block boundary `carry.position` from the decoder's carry state there,
    /// before the first feed, in streaming mode: pool rows are numbered from the carried counts
    /// and upstream's carried ratio-4 window goes into the stash the next window overlaps.
    /// `Ok(false)` (nothing changed) where the GPU path cannot start there: a compressor with an
    /// incomplete window at the boundary (a block size that is not a multiple of its ratio). The
    /// window rows are not needed: the caller resumes only where every block from `position` on
    /// reads rows from `position` on (see `GpuCapture::resume_at`).
    pub(crate) fn resume_at(&mut self, carry: &CarryState) -> Result<bool> {
        let s = carry.position;
        if carry.layers.len() != self.layers.len() || self.layers.iter().any(|l| l.processed != 0) {
            return Err(CoreError::device(DeviceFailure::Capture, format!("a carry state of {} layers cannot seed this cache of {} (or it was fed already)", carry.layers.len(), self.layers.len())));
        }
        let carried = self.steps.overlap == Overlap::Carried;
        // Check everything before changing anything.
        let mut stashes = vec![];
        for (i, (lc, ld)) in carry.layers.iter().zip(&self.model.layers).enumerate() {
            match (lc, ld) {
                (LayerCarry::Kv, LayerDev::Mla { .. }) => {}
                (LayerCarry::V4(c), LayerDev::V4 { comps, .. }) if c.pools.len() == comps.len() => {
                    for (ci, (p, cd)) in c.pools.iter().zip(comps).enumerate() {
                        if !p.buf_kv.is_empty() || !p.buf_gate.is_empty() || s % cd.ratio != 0 {
                            return Ok(false);
                        }
                        if p.width != cd.od || p.pooled_rows != s / cd.ratio {
                            return Err(CoreError::device(DeviceFailure::Capture, format!("layer {i}: the carry state's pool {ci} ({} rows of width {}) does not fit the GPU's ({} of width {})", p.pooled_rows, p.width, s / cd.ratio, cd.od)));
                        }
                        // The stash row of a token is its raw kv | gate, as the kernels read it.
                        if let (true, 4, Some([kv, gate])) = (carried, cd.ratio, &p.prev) {
                            let od = cd.od;
                            if kv.len() != 4 * od || gate.len() != 4 * od {
                                return Err(CoreError::device(DeviceFailure::Capture, format!("layer {i}: the carried previous window is not 4 rows of width {od}")));
                            }
                            let rows: Vec<bf16> = (0..4).flat_map(|r| kv[r * od..(r + 1) * od].iter().chain(&gate[r * od..(r + 1) * od]).copied()).collect();
                            stashes.push((i, ci, rows));
                        }
                    }
                }
                _ => return Err(CoreError::device(DeviceFailure::Capture, format!("layer {i}: the carry state is for another kind of layer"))),
            }
        }
        self.model.dev.bind()?;
        for (i, lr) in self.layers.iter_mut().enumerate() {
            lr.processed = s;
            lr.mla_base = s;
            if let LayerCarry::V4(c) = &carry.layers[i] {
                for (cr, p) in lr.comps.iter_mut().zip(&c.pools) {
                    cr.drained = p.pooled_rows;
                }
            }
        }
        for (i, ci, rows) in stashes {
            let s = self.post_stream(i);
            let cr = &mut self.layers[i].comps[ci];
            cr.stash[cr.cur] = DevBuf::upload(&rows, s)?;
            cr.stash_rows = 4;
        }
        Ok(true)
    }

    /// Fold host rows (uploaded first): for tests and the CPU-fed path.
    pub fn feed_host(&mut self, layer: usize, start: usize, x: &[bf16]) -> Result<()> {
        self.model.dev.bind()?;
        let bytes = std::mem::size_of_val(x);
        self.xbuf.reserve(bytes)?;
        // The host slice must stay valid until the copy ran: make it synchronous for pageable memory.
        ck("uploading input", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.xbuf.ptr,
                x.as_ptr() as *const c_void,
                bytes,
                self.stream.handle(),
            )
        })?;
        self.stream.sync()?;
        let rows = x.len() / self.model.hidden.max(1);
        let ptr = self.xbuf.ptr;
        self.feed_rows(layer, start, ptr, rows)
    }

    /// Fold `[rows, hidden]` bf16 rows in device memory (borrowed; the caller keeps it alive until
    /// the work is done, e.g. torch's `record_stream` on [`Self::stream_handle`]). The work is
    /// ordered after what `t.stream` has queued so far; nothing here waits for the device.
    pub fn feed_device(&mut self, layer: usize, start: usize, t: &DeviceTensor) -> Result<()> {
        let hidden = self.model.hidden;
        if t.device != self.model.dev.ordinal {
            return Err(CoreError::input(
                layer,
                format!(
                    "tensor on cuda:{} but the pooler runs on cuda:{}",
                    t.device, self.model.dev.ordinal
                ),
            ));
        }
        if t.ptr == 0 || t.ptr % 2 != 0 || t.nbytes == 0 || t.nbytes % (hidden * BF) != 0 {
            return Err(CoreError::input(
                layer,
                format!(
                    "{} bytes at {:#x} is not a whole number of bf16 rows of width {hidden}",
                    t.nbytes, t.ptr
                ),
            ));
        }
        self.model.dev.bind()?;
        self.order.record(t.stream as sys::CUstream)?;
        ck("ordering after the producer stream", unsafe {
            sys::cuStreamWaitEvent(self.stream.handle(), self.order.0, 0)
        })?;
        self.feed_rows(layer, start, t.ptr, t.nbytes / (hidden * BF))
    }

    fn gemm(&mut self, x: u64, y: u64, rows: usize, w: u64, n: usize, k: usize) -> Result<()> {
        match self.mode {
            GemmMode::Exact => {
                let mut a = Args::new()
                    .p(x)
                    .p(w)
                    .p(y)
                    .p(rows as i32)
                    .p(n as i32)
                    .p(k as i32)
                    .p(k as i64)
                    .p(k as i64)
                    .p(n as i64);
                self.model.dev.launch(
                    "gemm_exact",
                    (n.div_ceil(64) as u32, rows.div_ceil(64) as u32, 1),
                    256,
                    self.stream.handle(),
                    &mut a.ptrs(),
                )
            }
            GemmMode::TensorCore => {
                let (alpha, beta) = (1.0f32, 0.0f32);
                let st = unsafe {
                    cb::cublasGemmEx(
                        self.cublas,
                        cb::cublasOperation_t::CUBLAS_OP_T,
                        cb::cublasOperation_t::CUBLAS_OP_N,
                        n as i32,
                        rows as i32,
                        k as i32,
                        &alpha as *const f32 as *const c_void,
                        w as *const c_void,
                        cb::cudaDataType::CUDA_R_16BF,
                        k as i32,
                        x as *const c_void,
                        cb::cudaDataType::CUDA_R_16BF,
                        k as i32,
                        &beta as *const f32 as *const c_void,
                        y as *mut c_void,
                        cb::cudaDataType::CUDA_R_16BF,
                        n as i32,
                        cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                };
                if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(err("cublasGemmEx", st));
                }
                Ok(())
            }
        }
    }

    /// Queue one chunk of `layer` (rows at device pointer `x`, tokens from `start`).
    fn feed_rows(&mut self, layer: usize, start: usize, x: u64, rows: usize) -> Result<()> {
        let n_layers = self.layers.len();
        let processed = self
            .layers
            .get(layer)
            .ok_or_else(|| CoreError::input(layer, format!("the model has {n_layers} layers")))?
            .processed;
        if start != processed {
            return Err(CoreError::input(
                layer,
                format!("chunk starts at token {start} but {processed} tokens are processed"),
            ));
        }
        if rows == 0 {
            return Err(CoreError::input(layer, "an empty chunk"));
        }
        let model = self.model.clone();
        let hidden = model.hidden;
        let s = self.post_stream(layer);
        let (w, ntot) = model.layers[layer].w();
        // Projection outputs in a ring of slots: wait until the kernels that last read this slot
        // are done, project on the side stream, then hand the slot to the post stream. More
        // than two slots let the GEMMs run ahead of the (latency-bound) kernels.
        let slot = self.slot;
        self.slot = (self.slot + 1) % self.y.len();
        ck("ordering", unsafe { sys::cuStreamWaitEvent(self.stream.handle(), self.ev_post[slot].0, 0) })?;
        self.y[slot].reserve(rows * ntot * BF)?;
        let y = self.y[slot].ptr;
        self.gemm(x, y, rows, w.ptr, ntot, hidden)?;
        if let (GemmMode::Exact, Some(q)) = (self.mode, model.layers[layer].quant()) {
            // Quantized projections: MLX's CPU kernel sums in bf16, which the exact GEMM's f32
            // sums (over the dequantized weights) do not; those columns are computed again.
            let mut a = Args::new()
                .p(x)
                .p(q.elems.ptr)
                .p(q.rule.ptr)
                .p(q.scales.ptr)
                .p(q.soff.ptr)
                .p(y)
                .p(rows as i32)
                .p(ntot as i32)
                .p(hidden as i32)
                .p(hidden as i64)
                .p(ntot as i64);
            model.dev.launch("gemm_exact_quant", (ntot.div_ceil(256) as u32, rows.min(65535) as u32, 1), 256, self.stream.handle(), &mut a.ptrs())?;
        }
        let end = start + rows;
        if self.gemm_only {
            self.layers[layer].processed = end;
            return Ok(());
        }
        self.ev_gemm[slot].record(self.stream.handle())?;
        ck("ordering", unsafe { sys::cuStreamWaitEvent(s, self.ev_gemm[slot].0, 0) })?;
        self.feed_post(layer, start, rows, y, ntot)?;
        self.ev_post[slot].record(s)?;
        self.layers[layer].processed = end;
        Ok(())
    }

    fn read(&self, ptr: u64, elems: usize) -> Result<Vec<bf16>> {
        let mut v = vec![bf16::ZERO; elems];
        if elems > 0 {
            self.synchronize()?; // the state may have been written on any post stream
            ck("reading back", unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    v.as_mut_ptr() as *mut c_void,
                    ptr,
                    elems * BF,
                    self.post[0].0,
                )
            })?;
            self.post[0].sync()?;
        }
        Ok(v)
    }

    /// Read rows `[r0, r0+n)` of columns `[c0, c0+w)` of a row-major bf16 matrix with `stride`.
    fn read_cols(
        &self,
        ptr: u64,
        stride: usize,
        r0: usize,
        n: usize,
        c0: usize,
        w: usize,
    ) -> Result<Vec<bf16>> {
        let all = self.read(ptr + (r0 * stride * BF) as u64, n * stride)?;
        Ok(all
            .chunks_exact(stride.max(1))
            .flat_map(|r| r[c0..c0 + w].to_vec())
            .collect())
    }

    /// What the last feed of `layer` produced, in streaming mode ([`WindowRows::All`]): V4
    /// `[the chunk's window rows, each pool's new rows, each pool's previous windows at the step
    /// boundaries]`, MLA `[latent rows, k_pe rows]`.
    /// Valid on the layer's post stream until its next feed.
    pub(crate) fn chunk_outputs(&self, layer: usize) -> Vec<DevRows> {
        let lr = &self.layers[layer];
        match &self.model.layers[layer] {
            LayerDev::V4 { hd, comps, .. } => {
                let (t0, rows) = lr.chunk_win_span;
                let mut v = vec![DevRows { ptr: lr.chunk_win.ptr, first: t0, rows, width: *hd }];
                for (c, cr) in comps.iter().zip(&lr.comps) {
                    v.push(DevRows { ptr: cr.pooled.ptr, first: cr.drained, rows: cr.pooled_rows, width: c.hd });
                }
                // Then each pool's previous windows at the step boundaries (rows numbered
                // `boundary step index · ratio + i`; none unless upstream's carried overlap).
                for (c, cr) in comps.iter().zip(&lr.comps) {
                    v.push(DevRows { ptr: cr.prev.ptr, first: cr.prev_first * c.ratio, rows: cr.prev_count * c.ratio, width: 2 * c.od });
                }
                v
            }
            LayerDev::Mla { rank, rope_dim, .. } => {
                let held = lr.processed - lr.mla_base;
                vec![
                    DevRows { ptr: lr.latent.ptr, first: lr.mla_base, rows: held, width: *rank },
                    DevRows { ptr: lr.kpe.ptr, first: lr.mla_base, rows: held, width: *rope_dim },
                ]
            }
        }
    }

    /// The layer's state in [`crate::pooler::LayerState::snapshot`]'s form (synchronises).
    pub fn snapshot(&self, layer: usize) -> Result<Vec<StateArray>> {
        self.synchronize()?;
        let lr = self
            .layers
            .get(layer)
            .ok_or_else(|| CoreError::input(layer, "no such layer"))?;
        let mut out = Vec::new();
        match &self.model.layers[layer] {
            LayerDev::V4 {
                hd, size, comps, ..
            } => {
                // A resumed cache holds only the window rows fed since its resume point.
                let rows = lr.processed.min(*size).min(lr.win_rows);
                let data = self.read(
                    lr.win[lr.cur].ptr + ((lr.win_rows - rows) * hd * BF) as u64,
                    rows * hd,
                )?;
                out.push(StateArray {
                    name: "window",
                    shape: vec![rows, *hd],
                    data,
                });
                for (ci, (c, cr)) in comps.iter().zip(&lr.comps).enumerate() {
                    let names = if ci == 0 {
                        ["pooled", "buf_kv", "buf_gate"]
                    } else {
                        ["idx_pooled", "idx_buf_kv", "idx_buf_gate"]
                    };
                    let pooled = self.read(cr.pooled.ptr, cr.pooled_rows * c.hd)?;
                    out.push(StateArray {
                        name: names[0],
                        shape: vec![cr.pooled_rows, c.hd],
                        data: pooled,
                    });
                    let rem = lr.processed % c.ratio;
                    let (sw, st) = (2 * c.od, cr.stash[cr.cur].ptr);
                    let kv = self.read_cols(st, sw, cr.stash_rows - rem, rem, 0, c.od)?;
                    let gate = self.read_cols(st, sw, cr.stash_rows - rem, rem, c.od, c.od)?;
                    out.push(StateArray {
                        name: names[1],
                        shape: vec![rem, c.od],
                        data: kv,
                    });
                    out.push(StateArray {
                        name: names[2],
                        shape: vec![rem, c.od],
                        data: gate,
                    });
                }
            }
            LayerDev::Mla { rank, rope_dim, .. } => {
                let held = lr.processed - lr.mla_base;
                out.push(StateArray {
                    name: "latent",
                    shape: vec![held, *rank],
                    data: self.read(lr.latent.ptr, held * rank)?,
                });
                out.push(StateArray {
                    name: "k_pe",
                    shape: vec![held, *rope_dim],
                    data: self.read(lr.kpe.ptr, held * rope_dim)?,
                });
            }
        }
        Ok(out)
    }
}
