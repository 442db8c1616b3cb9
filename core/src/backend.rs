//! The capture's device seam: what [`crate::capture::Capture`] calls to pool CUDA tensors, with
//! no CUDA type in sight. [`DeviceBackend`] is the one interface (feed a layer's rows, hand out
//! finished blocks' segments, finish); [`crate::device::open`] picks its implementation: the CUDA
//! path ([`crate::cuda`], feature `cuda`) or the no-CUDA stub, which answers
//! [`DeviceFailure::NotBuilt`](crate::error::DeviceFailure::NotBuilt). The CPU path is the
//! capture's own ([`crate::pooler::CacheBuilder`] and the segment assembly in `capture.rs`): it
//! needs no device, and CUDA rows the device backend declines are copied to the host and pooled
//! there.

use std::sync::Arc;

use crate::error::Result;
use crate::format::OmlxFormat;
use crate::options::CaptureOptions;
use crate::pooler::carry::CarryState;
use crate::segment::{Segment, SegmentPlan};
use crate::weights::DecoderWeights;

/// A borrowed CUDA tensor as a framework describes it (torch: `data_ptr()`, `numel()`, dtype,
/// `device.index`, `torch.cuda.current_stream().cuda_stream`). Plain numbers: it exists in every
/// build, so the bindings pass it whether or not CUDA was built in.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTensor {
    /// Device pointer to contiguous row-major `[rows, hidden]` bf16.
    pub ptr: u64,
    pub nbytes: usize,
    pub device: usize,
    /// The stream that produced the tensor (0: the legacy default stream). The feed is ordered
    /// after the work queued on it so far.
    pub stream: u64,
}

/// What a device backend is opened for: one capture's request, read by the first CUDA feed.
pub struct DeviceRequest<'a> {
    pub weights: Arc<DecoderWeights>,
    /// The CUDA device the first tensor lives on.
    pub device: usize,
    pub format: OmlxFormat,
    /// What every block's segment carries (the same plan the CPU path fills).
    pub plan: SegmentPlan,
    /// Full blocks of the prompt.
    pub blocks: usize,
    /// The carry state a resumed capture starts from.
    pub carry: Option<&'a CarryState>,
    pub options: &'a CaptureOptions,
}

/// What a device is made ready for before its first capture ([`crate::device::prepare`]): the
/// engine's shape, so that the first requests find the decoder's weights resident, the kernels
/// loaded and the pools of block bodies filled, and allocate, pin and compile nothing on the
/// prefill engine's forward thread.
#[derive(Clone, Debug)]
pub struct DevicePreparation {
    pub weights: Arc<DecoderWeights>,
    pub device: usize,
    /// The oMLX format and block size the captures are expected to ask for (the bodies' size).
    pub format: OmlxFormat,
    pub block_size: usize,
    /// The engine's largest step in tokens (vLLM's `max_num_batched_tokens`): how many blocks one
    /// capture keeps in flight.
    pub step_tokens: usize,
    /// Captures that may run at once.
    pub captures: usize,
    /// Finished segments the segment server may hold for slow readers, in bytes: page-locked
    /// bodies beyond those in flight.
    pub held_bytes: usize,
    /// A pipeline stage's layers (its bodies carry only those), or every layer.
    pub stage: Option<std::ops::Range<usize>>,
    pub options: CaptureOptions,
}

/// What preparing a device did: the memory it now holds for captures, outside the engine's own
/// budget (page-locked host memory and device memory).
#[derive(Clone, Debug, Default)]
pub struct Prepared {
    /// One block's body in bytes.
    pub body_bytes: usize,
    /// Device staging bodies and page-locked host bodies kept idle for captures.
    pub staging_bodies: usize,
    pub pinned_bodies: usize,
    pub staging_bytes: usize,
    pub pinned_bytes: usize,
    /// Bodies newly allocated by this call (the rest were idle already).
    pub allocated: usize,
    pub seconds: f64,
    /// Why the GPU path would not take captures of this format and block size (nothing was
    /// prepared; they pool on the CPU).
    pub declined: Option<String>,
}

/// A capture's device backend: pools one request's CUDA tensors and produces its segments,
/// whole and in block order. Every call returns without waiting for the device unless it says
/// otherwise; an error after device work was queued fails the backend for good (later calls
/// refuse), because the device state no longer matches the rows fed.
pub trait DeviceBackend: Send + Sync {
    /// Queue `t`'s rows for `layer` (tokens from `start`); rows past the last full block, and
    /// before a resumed capture's resume point, are skipped.
    fn feed(&mut self, layer: usize, start: usize, t: &DeviceTensor) -> Result<()>;
    /// The segments completed so far, in block order (waiting for every queued block if `wait`).
    fn poll(&mut self, wait: bool) -> Result<Vec<Segment>>;
    /// Blocks with device work queued whose segments are not out yet.
    fn pending(&self) -> usize;
    /// The stream the input is read on, as an integer handle (for `tensor.record_stream`).
    fn side_stream(&self) -> u64;
    /// After the seal: give back the buffers of blocks that will never finish.
    fn finish(&mut self);
}
