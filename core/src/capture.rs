//! The capture engine (prefill side): one request's attention inputs in, segments out.
//!
//! Each layer's input arrives chunk by chunk, layer after layer, in whatever chunks the prefill
//! engine uses. The capture feeds the pooler, cutting chunks at the decoder's block boundaries;
//! at each boundary it takes that layer's part of the block's segment — the window, the
//! remainders, and only the pooled rows produced since the previous boundary (DeepSeek-V4), or
//! the block's latent rows (MLA) — and drops what it no longer needs. When every layer has
//! delivered its part of a block, the segment is ready, in block order. Host memory per request
//! is bounded by a block and the window, whatever the prompt length.
//!
//! What a segment carries is planned once ([`SegmentPlan`]) for both paths: the CPU path copies
//! each layer's part from its pooler state into the block's body, the GPU path
//! (a [`DeviceBackend`], see [`crate::backend`]) copies it device-to-host into a page-locked body.
//! The capture names no CUDA type: CUDA tensors go to the backend [`crate::device::open`] gives
//! it, or, where there is none for this capture, to the host and the CPU path.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use half::bf16;

use crate::backend::{DeviceBackend, DeviceRequest};
use crate::error::{CoreError, Result};
use crate::format::OmlxFormat;
use crate::family;
use crate::options::CaptureOptions;
use crate::pooler::{CacheBuilder, DecoderSteps, LayerState};
use crate::segment::{BlockPlan, Segment, SegmentPlan};
use crate::weights::DecoderWeights;
use crate::wire::Seal;

/// A block whose segment is being filled on the CPU path.
struct OpenBlock {
    plan: BlockPlan,
    body: Vec<bf16>,
    /// Layers whose part is in.
    have: Vec<bool>,
    missing: usize,
}

/// Attention input for [`Capture::feed_input`]: host rows, or a CUDA tensor's descriptor.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// `[rows, hidden]` bf16 in host memory.
    Host(&'a [bf16]),
    /// `[rows, hidden]` bf16 in device memory (feature `cuda`; without it, an error).
    Cuda(DeviceInput),
}

/// A borrowed CUDA tensor as the tap passes it: pointer, byte length, device index and the
/// producer's current stream (bf16 only here): [`crate::backend::DeviceTensor`].
pub type DeviceInput = crate::backend::DeviceTensor;

/// Where a capture's CUDA tensors go, decided by its first CUDA feed.
enum DevicePath {
    /// No CUDA tensor fed yet.
    Undecided,
    /// Pooled on the device by this backend.
    Backend(Box<dyn DeviceBackend>),
    /// The backend was unavailable for this capture: CUDA rows are copied to the host and
    /// pooled on the CPU.
    Host,
}

pub struct Capture {
    format: OmlxFormat,
    request_id: String,
    block_size: usize,
    /// Full blocks of the prompt: the blocks the decoder can take as a prefix hit.
    blocks: usize,
    builder: CacheBuilder,
    /// What every block's segment carries (both paths build from it).
    segments: SegmentPlan,
    assembling: BTreeMap<usize, OpenBlock>,
    ready: VecDeque<Segment>,
    emitted: usize,
    sealed: Option<Seal>,
    /// The GPU path's settings, read by the first CUDA feed.
    options: CaptureOptions,
    device: DevicePath,
    /// The carry state a resumed capture started from: the device backend starts there too.
    carry: Option<crate::pooler::carry::CarryState>,
    /// Tokens whose rows the caller has confirmed it fed from the right place; finished
    /// segments past it wait (`None`: no gate). See [`Self::hold_until_confirmed`].
    confirmed: Option<usize>,
}

impl Capture {
    /// A capture for the fork's decoder (flyto-mlx 0.7.0); see [`Self::with_format`].
    pub fn new(weights: Arc<DecoderWeights>, request_id: &str, prompt_tokens: usize, block_size: usize) -> Result<Self> {
        Self::with_format(OmlxFormat::Fork070, weights, request_id, prompt_tokens, block_size)
    }

    /// `format`: the decoder's oMLX block format (its overlap semantics, window rows and what
    /// segments carry); `prompt_tokens`: the prompt's length; `block_size`: the decoder's block
    /// size (also its prefill step grid).
    pub fn with_format(format: OmlxFormat, weights: Arc<DecoderWeights>, request_id: &str, prompt_tokens: usize, block_size: usize) -> Result<Self> {
        let steps = DecoderSteps::for_format(format, block_size)?;
        let segments = SegmentPlan::new(family::geometry(&weights.plan, format, block_size), request_id, &weights.fingerprint);
        Ok(Capture {
            format,
            request_id: request_id.into(),
            block_size,
            blocks: prompt_tokens / block_size,
            builder: CacheBuilder::new(weights, steps),
            segments,
            assembling: BTreeMap::new(),
            ready: VecDeque::new(),
            emitted: 0,
            sealed: None,
            options: CaptureOptions::default(),
            device: DevicePath::Undecided,
            carry: None,
            confirmed: None,
        })
    }

    /// This capture for one pipeline stage, which runs only the model layers `layers`: it is
    /// fed those, and its segments carry those ([`crate::stages`]; the decode host joins the
    /// stages' segments into whole blocks). Set before the first feed. A stage's CUDA rows are
    /// pooled on the CPU path (the GPU backend plans whole blocks).
    pub fn for_stage(mut self, layers: std::ops::Range<usize>) -> Result<Self> {
        let fed = (0..self.builder.num_layers()).any(|l| self.builder.processed(l) != Some(self.builder.origin()));
        if fed || !self.assembling.is_empty() || !self.ready.is_empty() || !matches!(self.device, DevicePath::Undecided) {
            return Err(CoreError::config("layers", "a capture's pipeline stage is set before its first feed"));
        }
        self.segments = self.segments.for_stage(layers)?;
        Ok(self)
    }

    /// The model layers this capture is fed.
    pub fn stage(&self) -> std::ops::Range<usize> {
        self.segments.stage()
    }

    /// This capture with the GPU path's `options` (the defaults otherwise; the CPU path reads
    /// none): the boundary builds them once, from its keyword arguments or the `PD_BRIDGE_GPU*`
    /// environment variables. Set before the first feed.
    pub fn with_options(mut self, options: CaptureOptions) -> Self {
        self.options = options;
        self
    }

    pub fn options(&self) -> &CaptureOptions {
        &self.options
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub fn format(&self) -> OmlxFormat {
        self.format
    }

    /// Full blocks this capture will produce if it completes.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// A capture that starts at block boundary `S = carry.position` from the decoder's carry
    /// state there (the decode host read it from the block it holds): it emits segments for the
    /// blocks from `S` on, numbered in the request's chain, and its seal counts every block up to
    /// where it ended (the resumed prefix included). Rows fed from before `S` are ignored, so the
    /// prefill engine may recompute from wherever its own prefix cache ends; rows from `S` on
    /// must all be fed. Refused, naming what disagrees, unless the carry state was made from
    /// these weights, for this format and block size, and `S` is within the prompt's full blocks.
    pub fn resume(format: OmlxFormat, weights: Arc<DecoderWeights>, request_id: &str, prompt_tokens: usize, block_size: usize, carry: &crate::pooler::carry::CarryState) -> Result<Self> {
        let mut cap = Self::with_format(format, weights, request_id, prompt_tokens, block_size)?;
        cap.resume_at(carry)?;
        Ok(cap)
    }

    /// Make this capture, before anything was fed to it, one resumed from `carry` (see
    /// [`Self::resume`]): for callers that create the capture first and learn of the carry state
    /// afterwards. Refused once a row was fed or a segment produced.
    pub fn resume_at(&mut self, carry: &crate::pooler::carry::CarryState) -> Result<()> {
        let weights = self.builder.weights().clone();
        carry.check_for(&weights.fingerprint, &family::geometry(&weights.plan, self.format, self.block_size))?;
        let full = self.blocks * self.block_size;
        if carry.position > full {
            return Err(CoreError::Carry {
                what: crate::error::CarryField::Position,
                reason: format!("resume point {} is past the prompt's last full block (it ends at {full})", carry.position),
            });
        }
        let fed = (0..self.builder.num_layers()).any(|l| self.builder.processed(l) != Some(self.builder.origin()));
        let fed = fed || !matches!(self.device, DevicePath::Undecided);
        if fed || self.emitted != self.builder.origin() / self.block_size || self.sealed.is_some() || self.pending() > 0 {
            return Err(CoreError::input(0, format!("capture {} was already fed or sealed; a carry state can only seed a fresh capture", self.request_id)));
        }
        self.builder = CacheBuilder::resume(weights, carry)?;
        self.emitted = carry.position / self.block_size;
        self.carry = Some(carry.clone());
        if let Some(c) = &mut self.confirmed {
            *c = (*c).max(carry.position); // the decode host holds what precedes the resume point
        }
        tracing::debug!(request = %self.request_id, resumed_at = carry.position, blocks = self.blocks, "capture resumed from a carry state");
        Ok(())
    }

    /// The block boundary this capture resumed at (0 for a capture from the first token).
    pub fn resumed_at(&self) -> usize {
        self.builder.origin()
    }

    /// Every layer's cache state on the CPU path (what a GPU capture pools lives on the device).
    pub fn layer_states(&self) -> &[LayerState] {
        self.builder.layers()
    }

    /// Fold `x` (`[rows, hidden]`, tokens from `start`) into `layer`. Tokens past the last full
    /// block are not needed by the decoder and are skipped.
    pub fn feed(&mut self, layer: usize, start: usize, x: &[bf16]) -> Result<()> {
        if self.sealed.is_some() {
            return Err(CoreError::input(layer, format!("capture {} is already sealed", self.request_id)));
        }
        self.check_stage(layer)?;
        let hidden = self.builder.hidden_size();
        if x.is_empty() || x.len() % hidden != 0 {
            return Err(CoreError::input(layer, format!("{} values is not a positive whole number of rows of width {hidden}", x.len())));
        }
        let end = start + x.len() / hidden;
        let limit = self.blocks * self.block_size;
        // A resumed capture holds every row before its resume point already (the carry state):
        // rows the prefill engine recomputes there are skipped.
        let mut cursor = start.max(self.builder.origin());
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

    /// Fold one chunk, wherever it lives: the CPU path for host rows, the GPU path for CUDA
    /// tensors (queued on a side stream after the producer's stream; the call never waits for the
    /// device, and segments appear in [`Self::take_ready`] once the chunk's CUDA event completed).
    /// A capture is fed from one side only. Without the GPU backend (no `cuda` feature: an error
    /// saying so; a block size that is not a multiple of every compress ratio, a resume point
    /// where a block would read rows from before it, [`CaptureOptions::upstream`] off for
    /// upstream's format, or [`CaptureOptions::gpu`] off) CUDA rows are copied to the host and
    /// pooled on the CPU.
    pub fn feed_input(&mut self, layer: usize, start: usize, input: Input<'_>) -> Result<()> {
        match input {
            Input::Host(x) => {
                if matches!(self.device, DevicePath::Backend(_)) {
                    return Err(CoreError::input(layer, "this capture is fed CUDA tensors; host rows cannot be mixed in"));
                }
                self.feed(layer, start, x)
            }
            Input::Cuda(t) => self.feed_cuda(layer, start, &t),
        }
    }

    fn feed_cuda(&mut self, layer: usize, start: usize, t: &DeviceInput) -> Result<()> {
        if self.sealed.is_some() {
            return Err(CoreError::input(layer, format!("capture {} is already sealed", self.request_id)));
        }
        self.check_stage(layer)?;
        if matches!(self.device, DevicePath::Undecided) {
            let origin = self.builder.origin();
            let fed = (0..self.builder.num_layers()).any(|l| self.builder.processed(l) != Some(origin));
            // The backend (and its resume, for a resumed capture) decides which formats, block
            // sizes and resume points the GPU handles.
            let whole = self.stage() == (0..self.builder.num_layers());
            let backend = if fed || !self.options.gpu || !whole {
                None
            } else {
                crate::device::open(DeviceRequest {
                    weights: self.builder.weights().clone(),
                    device: t.device,
                    format: self.format,
                    plan: self.segments.clone(),
                    blocks: self.blocks,
                    carry: self.carry.as_ref(),
                    options: &self.options,
                })?
            };
            self.device = match backend {
                Some(b) => DevicePath::Backend(b),
                None => {
                    tracing::debug!(request = %self.request_id, resumed_at = origin, "no GPU backend for this capture: pooling its CUDA rows on the CPU");
                    DevicePath::Host
                }
            };
        }
        match &mut self.device {
            DevicePath::Backend(b) => {
                b.feed(layer, start, t)?;
                self.poll_device(false)
            }
            _ => {
                let x = crate::device::copy_to_host(t)?;
                self.feed(layer, start, &x)
            }
        }
    }

    /// A layer of another pipeline stage is refused, naming this stage's layers.
    fn check_stage(&self, layer: usize) -> Result<()> {
        let (n, stage) = (self.builder.num_layers(), self.stage());
        if !stage.contains(&layer) && stage != (0..n) {
            return Err(CoreError::input(layer, format!("this capture is the pipeline stage of layers {}..{} (of {n})", stage.start, stage.end)));
        }
        Ok(())
    }

    /// Take in the device blocks that finished (all of them if `wait`).
    fn poll_device(&mut self, wait: bool) -> Result<()> {
        let DevicePath::Backend(b) = &mut self.device else { return Ok(()) };
        // The device backend completes whole segments, in block order.
        for seg in b.poll(wait)? {
            self.ready.push_back(seg);
            self.emitted += 1;
        }
        Ok(())
    }

    /// GPU blocks with device work queued whose segments are not out yet (0 on the CPU path and
    /// after the seal).
    pub fn pending(&self) -> usize {
        match &self.device {
            DevicePath::Backend(b) => b.pending(),
            _ => 0,
        }
    }

    /// The GPU backend's side stream (as an integer `CUstream`), once a CUDA feed created it: the
    /// stream that reads the input, for the caller's allocator (`tensor.record_stream`).
    pub fn side_stream(&self) -> Option<u64> {
        match &self.device {
            DevicePath::Backend(b) => Some(b.side_stream()),
            _ => None,
        }
    }

    /// Wait for every queued GPU chunk and take its segments in (a no-op on the CPU path). Call
    /// it off the forward thread; [`Self::seal`] does it too.
    pub fn drain_device(&mut self) -> Result<()> {
        self.poll_device(true)
    }

    /// Copy `layer`'s part of block `block`'s segment from its state (the state has just reached
    /// the block's end) into the block's body, and drop what the state no longer needs.
    fn take_part(&mut self, layer: usize, block: usize) -> Result<()> {
        let stage = self.stage();
        let n = stage.len();
        // The block plan holds this stage's layers only, its first at 0.
        let local = layer - stage.start;
        let segments = &self.segments;
        let open = self.assembling.entry(block).or_insert_with(|| {
            let plan = segments.block(block);
            OpenBlock { body: vec![bf16::ZERO; plan.values], plan, have: vec![false; n], missing: n }
        });
        if open.have[local] {
            return Err(CoreError::input(layer, format!("block {block} of this layer was already taken")));
        }
        let state = self.builder.layer_mut(layer).ok_or_else(|| CoreError::input(layer, "no such layer"))?;
        state.take_part(&open.plan, local, &mut open.body)?;
        open.have[local] = true;
        open.missing -= 1;
        self.promote()
    }

    /// Move every block whose parts are all in, in order, to the ready queue.
    fn promote(&mut self) -> Result<()> {
        while self.assembling.get(&self.emitted).is_some_and(|b| b.missing == 0) {
            let open = self.assembling.remove(&self.emitted).expect("present");
            self.ready.push_back(self.segments.segment(&open.plan, Arc::new(open.body))?);
            self.emitted += 1;
        }
        Ok(())
    }

    /// Segments completed since the last call, in block order (those the gate lets out, see
    /// [`Self::hold_until_confirmed`]).
    pub fn take_ready(&mut self) -> Vec<Segment> {
        if let Err(e) = self.poll_device(false) {
            tracing::error!(request = %self.request_id, error = %e, "GPU capture failed");
        }
        let out = match self.confirmed {
            Some(c) => self.ready.iter().take_while(|s| s.header.end as usize <= c).count(),
            None => self.ready.len(),
        };
        self.ready.drain(..out).collect()
    }

    /// From now on a finished segment goes out only once the caller [`confirm`](Self::confirm)s
    /// every token it covers: the caller feeds rows whose place in the engine's batch it checks
    /// later, on the device, without waiting for it (a prefill engine's forward thread). Rows
    /// found misplaced then end the capture at the last confirmed block, so no block computed
    /// from them is ever sent.
    pub fn hold_until_confirmed(&mut self) {
        if self.confirmed.is_none() {
            self.confirmed = Some(self.emitted_tokens_before_ready());
        }
    }

    /// The rows of tokens before `upto` were fed from the right place: segments that end there
    /// may go out (with the next [`Self::take_ready`]). No effect without the gate.
    pub fn confirm(&mut self, upto: usize) {
        if let Some(c) = &mut self.confirmed {
            *c = (*c).max(upto);
        }
    }

    /// Tokens covered by segments already handed out (or held by the decode host before a resume).
    fn emitted_tokens_before_ready(&self) -> usize {
        (self.emitted - self.ready.len()) * self.block_size
    }

    /// End the capture. `failure`: why the prefill stopped early (abort, error), if it did. The
    /// seal counts only segments already produced; a valid prefix is never retracted.
    pub fn seal(&mut self, failure: Option<&str>) -> Seal {
        if let Some(s) = &self.sealed {
            return s.clone();
        }
        // Segments of GPU chunks still in flight belong to the prefix: take them in first.
        let device_failure = self.drain_device().err().map(|e| format!("GPU capture failed: {e}"));
        // Finished segments the caller never confirmed are not part of the prefix: dropped.
        let held = self.confirmed.map_or(0, |c| self.ready.iter().filter(|s| s.header.end as usize > c).count());
        let unconfirmed = (held > 0).then(|| format!("the rows of tokens from {} on were never confirmed", self.confirmed.unwrap_or(0)));
        self.ready.truncate(self.ready.len() - held);
        self.emitted -= held;
        let failure = failure.or(device_failure.as_deref()).or(unconfirmed.as_deref());
        let blocks = self.emitted as u32;
        let tokens = (self.emitted * self.block_size) as u64;
        let seal = match failure {
            Some(reason) => Seal::Aborted { blocks, reason: reason.into() },
            None if self.emitted == self.blocks => Seal::Complete { blocks, tokens },
            None => Seal::Partial { blocks, tokens, reason: format!("only {} of {} blocks were captured", self.emitted, self.blocks) },
        };
        self.assembling.clear();
        if let DevicePath::Backend(b) = &mut self.device {
            b.finish();
        }
        self.sealed = Some(seal.clone());
        seal
    }
}
