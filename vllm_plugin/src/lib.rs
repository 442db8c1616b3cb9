//! `pd_bridge_vllm._native`: the prefill side's native module. Importing it touches no GPU:
//! everything CUDA-related starts lazily in the worker that first captures.

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use pd_bridge_core::capture::{Capture as CoreCapture, DeviceInput, Input};
use pd_bridge_core::segment::Segment;
use sha2::{Digest, Sha256};
use pd_bridge_core::segment_server::{Outbox, SegmentServer as CoreSegmentServer, ServerConfig};
use pd_bridge_core::wire::{CaptureSecret, PromptDigest, Seal};
use pd_bridge_bindings::buffer::{with_bf16, ByteView};
use pd_bridge_bindings::{capture_options_from_env, guard, to_py, ConfigError, InputError};
use pd_bridge_core::DecoderWeights;
use pyo3::prelude::*;


// The exception classes, the CoreError mapping, the panic guard and the logging bridge are
// pd-bridge-bindings', shared with the oMLX wheel.


/// Read the decoder's attention-cache weights from `model_dir` and return their fingerprint,
/// the value the decode host compares before it trusts a stream.
#[pyfunction]
fn weights_fingerprint(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<String> {
    guard(|| py.detach(|| DecoderWeights::load(&model_dir)).map(|w| w.fingerprint).map_err(to_py))
}

/// The identity of the checkpoint vLLM serves (`pd_bridge_core::checkpoint::model_fingerprint`):
/// one written by `pd-bridge export-checkpoint` reports the decoder model's.
#[pyfunction]
fn model_fingerprint(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<String> {
    guard(|| py.detach(|| pd_bridge_core::checkpoint::model_fingerprint(&model_dir)).map_err(to_py))
}

/// The decoder model's fingerprint as `pd-bridge export-weights` recorded it in `weights_dir`
/// (None for an older export): what the served checkpoint's must equal for "same weights".
#[pyfunction]
fn decoder_model_fingerprint(py: Python<'_>, weights_dir: std::path::PathBuf) -> PyResult<Option<String>> {
    guard(|| py.detach(|| pd_bridge_core::checkpoint::decoder_model_of(&weights_dir)).map_err(to_py))
}

/// The decoder's attention-cache weights (as exported from the decode host) and fingerprint.
#[pyclass(frozen, module = "pd_bridge_vllm._native")]
struct Weights {
    inner: Arc<DecoderWeights>,
}

#[pymethods]
impl Weights {
    #[staticmethod]
    fn load(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<Self> {
        guard(|| {
            let w = py.detach(|| DecoderWeights::load(&model_dir)).map_err(to_py)?;
            Ok(Weights { inner: Arc::new(w) })
        })
    }

    #[getter]
    fn fingerprint(&self) -> PyResult<String> {
        guard(|| Ok(self.inner.fingerprint.clone()))
    }

    /// `[(module, format)]`: each cache projection and how the decoder model stores it.
    #[getter]
    fn formats(&self) -> PyResult<Vec<(String, String)>> {
        guard(|| Ok(self.inner.formats.clone()))
    }

    #[getter]
    fn num_layers(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.plan.num_layers()))
    }

    #[getter]
    fn hidden_size(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.plan.hidden_size()))
    }
}

/// Serves captured segments to decode hosts that prove a capture's key (the shared token, the
/// capture's per-request secret, its id, weights and prompt), encrypted.
#[pyclass(frozen, module = "pd_bridge_vllm._native")]
struct SegmentServer {
    inner: CoreSegmentServer,
}

fn seconds(name: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v).map_err(|e| ConfigError::new_err(format!("{name}: {e}")))
}

#[pymethods]
impl SegmentServer {
    /// `idle_seconds`: how long a stream waits for the next segment; `queue_wait_seconds`: how
    /// long a pull waits for its capture to start (vLLM may queue the request); `keepalive_seconds`:
    /// how often a waiting pull is told the host is alive; `handshake_seconds`: a connection's deadline to finish the handshake;
    /// `max_connections`: open connections at once; `grace_seconds`: how long a sealed capture
    /// nobody pulled is kept; `pull_timeout_seconds`: how long any capture nobody pulled is kept;
    /// `memory_bytes`: segment bytes all captures may hold together before the oldest unpulled
    /// ones are dropped.
    #[new]
    #[pyo3(signature = (address, token, idle_seconds=60.0, *, queue_wait_seconds=600.0, keepalive_seconds=5.0, handshake_seconds=10.0, max_connections=64, grace_seconds=30.0, pull_timeout_seconds=120.0, memory_bytes=1u64 << 30))]
    #[allow(clippy::too_many_arguments)]
    fn new(address: &str, token: Vec<u8>, idle_seconds: f64, queue_wait_seconds: f64, keepalive_seconds: f64, handshake_seconds: f64, max_connections: usize, grace_seconds: f64, pull_timeout_seconds: f64, memory_bytes: u64) -> PyResult<Self> {
        guard(|| {
            let config = ServerConfig {
                idle: seconds("idle_seconds", idle_seconds)?,
                queue_wait: seconds("queue_wait_seconds", queue_wait_seconds)?,
                keepalive: seconds("keepalive_seconds", keepalive_seconds)?,
                handshake: seconds("handshake_seconds", handshake_seconds)?,
                max_connections,
                grace: seconds("grace_seconds", grace_seconds)?,
                pull_timeout: seconds("pull_timeout_seconds", pull_timeout_seconds)?,
                memory_bound: memory_bytes,
            };
            CoreSegmentServer::bind_with(address, token, config).map(|inner| SegmentServer { inner }).map_err(to_py)
        })
    }

    #[getter]
    fn port(&self) -> PyResult<u16> {
        guard(|| Ok(self.inner.local_addr().port()))
    }

    /// The address it listens on, `host:port`.
    #[getter]
    fn address(&self) -> PyResult<String> {
        guard(|| Ok(self.inner.local_addr().to_string()))
    }

    /// Captures held (registered, not yet sent or dropped).
    #[getter]
    fn outboxes(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.outboxes()))
    }

    /// Segment bytes all captures hold now.
    #[getter]
    fn queued_bytes(&self) -> PyResult<u64> {
        guard(|| Ok(self.inner.queued_bytes()))
    }

    /// Connections open now.
    #[getter]
    fn connections(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.connections()))
    }
}

/// SHA-256 (hex) over a prompt's token ids as the wire binds them into a capture's key; the
/// connector's scheduler computes it from the ids vLLM prefills.
#[pyfunction]
fn prompt_digest(token_ids: Vec<u32>) -> PyResult<String> {
    guard(|| Ok(PromptDigest::of(&token_ids).to_hex()))
}

/// One request's capture: attention inputs in, segments out to the server as blocks complete.
#[pyclass(module = "pd_bridge_vllm._native")]
struct Capture {
    inner: CoreCapture,
    outbox: Arc<Outbox>,
    /// SHA-256 over every segment handed to the server, in order (header JSON, then each array's
    /// little-endian bytes): lets a test compare two captures' output without a decode host.
    /// Kept only for a capture nobody can pull (no secret): hashing every segment on the forward
    /// thread would cost a served capture ~1 s per GB.
    digest: Option<Sha256>,
    segments: usize,
    /// Bytes those segments take on the wire (frame header, length prefix, header JSON, arrays).
    bytes: u64,
}

/// Hand `segs` to the server, folding each into the running digest.
fn push_all(segs: Vec<Segment>, outbox: &Outbox, digest: &mut Option<Sha256>, count: &mut usize, bytes: &mut u64) {
    for seg in segs {
        let header = serde_json::to_vec(&seg.header).expect("header serializes");
        // What `wire::send_segment` puts on the wire: the frame in its encrypted records.
        let wire = pd_bridge_core::wire::secure::frame_wire_bytes((4 + header.len() + seg.arrays.iter().map(|a| a.len() * 2).sum::<usize>()) as u64);
        if let Some(digest) = digest.as_mut() {
            digest.update(header);
            // The arrays' little-endian bytes in order are the segment's body as it lies.
            digest.update(seg.body_bytes());
        }
        // Counted only when queued: a closed stream (its reader gone, dropped) ships nothing more.
        if outbox.push(seg) {
            *count += 1;
            *bytes += wire;
        }
    }
}

#[pymethods]
impl Capture {
    /// `omlx_format`: the decoder's oMLX block format, as the decode host's capture spec names
    /// it (default the fork's); it decides the overlap semantics and what segments carry.
    ///
    /// `secret` (the 64 hex digits the decode host sent in `pd_capture.secret`) and
    /// `prompt_digest` (`prompt_digest(ids)` of the ids this engine prefills) key the capture on
    /// the wire: only a decode host holding the secret for this id, weights and prompt can pull
    /// it. `fingerprint`: the weights fingerprint the decode host asked for (`pd_capture.fingerprint`;
    /// default these weights'), bound into the same key. Without a secret the capture computes
    /// but nothing can pull its segments (digests only).
    ///
    /// `layers=(start, end)`: this process is one stage of vLLM's pipeline parallelism and runs
    /// only those model layers; the capture is fed those, and its segments carry those (the
    /// decode host joins the stages' parts into whole blocks).
    #[new]
    #[pyo3(signature = (weights, request_id, prompt_tokens, block_size, server, omlx_format=None, secret=None, prompt_digest=None, fingerprint=None, layers=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(weights: &Weights, request_id: &str, prompt_tokens: usize, block_size: usize, server: &SegmentServer, omlx_format: Option<&str>, secret: Option<&str>, prompt_digest: Option<&str>, fingerprint: Option<&str>, layers: Option<(usize, usize)>) -> PyResult<Self> {
        guard(|| {
            let format = omlx_format.map_or(Ok(pd_bridge_core::OmlxFormat::Fork070), pd_bridge_core::OmlxFormat::from_name).map_err(to_py)?;
            let keyed = secret.is_some();
            let outbox = match (secret, prompt_digest) {
                (Some(secret), Some(digest)) => {
                    let (secret, digest) = (CaptureSecret::from_hex(secret).map_err(to_py)?, PromptDigest::from_hex(digest).map_err(to_py)?);
                    // The fingerprint the decode host asked for is what both keys bind: with other
                    // weights here the stream still opens and carries the aborted seal that says so.
                    let asked = fingerprint.unwrap_or(&weights.inner.fingerprint);
                    server.inner.outbox(request_id, &secret, asked, &digest).map_err(to_py)?
                }
                (None, None) => Outbox::detached(request_id),
                _ => return Err(ConfigError::new_err("a capture's secret and prompt_digest come together")),
            };
            // The GPU path's settings, read once here at the boundary (PD_BRIDGE_GPU*).
            let mut inner = CoreCapture::with_format(format, weights.inner.clone(), request_id, prompt_tokens, block_size).map_err(to_py)?.with_options(capture_options_from_env());
            if let Some((start, end)) = layers {
                inner = inner.for_stage(start..end).map_err(to_py)?;
            }
            Ok(Capture { inner, outbox, digest: (!keyed).then(Sha256::new), segments: 0, bytes: 0 })
        })
    }

    /// Why the segment stream stopped before its seal went out (the decode host went away, it
    /// was never pulled, the prefill host's memory bound dropped it), else None: the connector
    /// stops feeding such a capture and seals it aborted with this reason.
    #[getter]
    fn stream_closed(&self) -> PyResult<Option<String>> {
        guard(|| Ok(self.outbox.closed_reason()))
    }

    /// Resume this capture, before anything is fed to it, at the block boundary the decode host's
    /// carry state names (`carry_state`: the bytes `pd_bridge_omlx._native.carry_state` read from
    /// the block it holds): segments start at that block, rows fed from before it are ignored
    /// (vLLM may recompute from wherever its prefix cache ends), rows after it must all be fed.
    /// Refused (PdBridgeError naming what: weights fingerprint, format, block size, position,
    /// layers, damaged bytes) when it does not fit this capture; the capture is then unchanged.
    /// Returns the resume point in tokens.
    fn resume(&mut self, py: Python<'_>, carry_state: &[u8]) -> PyResult<usize> {
        guard(|| {
            let inner = &mut self.inner;
            py.detach(|| {
                let carry = pd_bridge_core::pooler::carry::CarryState::decode(carry_state)?;
                inner.resume_at(&carry)?;
                Ok(carry.position)
            })
            .map_err(to_py)
        })
    }

    /// The block boundary this capture resumed at, in tokens (0: it captures from token 0).
    #[getter]
    fn resumed_at(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.resumed_at()))
    }

    /// Fold `[rows, hidden]` attention input (little-endian bf16) for tokens from `start`.
    /// `data` is any C-contiguous buffer (bytes, bytearray, memoryview, a numpy array of
    /// uint8/uint16), read in place; the caller must not modify it during the call.
    fn feed(&mut self, py: Python<'_>, layer: usize, start: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let view = ByteView::bf16(data, "data")?;
            let bytes = view.bytes();
            let (inner, outbox, digest, segments, wire) = (&mut self.inner, &self.outbox, &mut self.digest, &mut self.segments, &mut self.bytes);
            py.detach(|| {
                with_bf16(bytes, |x| {
                    inner.feed(layer, start, x)?;
                    push_all(inner.take_ready(), outbox, digest, segments, wire);
                    Ok(())
                })
            })
            .map_err(to_py)
        })
    }

    /// Fold attention input read straight from host memory: `data_ptr` points at `nbytes` of
    /// contiguous little-endian bf16, `[rows, hidden]` (a CPU torch tensor's `data_ptr()`). The
    /// caller keeps that memory alive and unmodified for the duration of the call.
    fn feed_ptr(&mut self, py: Python<'_>, layer: usize, start: usize, data_ptr: usize, nbytes: usize) -> PyResult<()> {
        guard(|| {
            if data_ptr == 0 || data_ptr % std::mem::align_of::<bf16>() != 0 || nbytes % 2 != 0 {
                return Err(InputError::new_err(format!("feed_ptr: {nbytes} bytes at {data_ptr:#x} is not an aligned bf16 buffer")));
            }
            let (inner, outbox, digest, segments, wire) = (&mut self.inner, &self.outbox, &mut self.digest, &mut self.segments, &mut self.bytes);
            // The GIL is released for the pooling math; the caller's frame still holds the tensor,
            // so its memory stays alive and unmoved for the call.
            py.detach(|| {
                // SAFETY: the caller guarantees `nbytes` readable bytes at `data_ptr` for this call;
                // bf16 is a plain 2-byte value and the host is little-endian like the wire format.
                let x: &[bf16] = unsafe { std::slice::from_raw_parts(data_ptr as *const bf16, nbytes / 2) };
                inner.feed(layer, start, x)?;
                push_all(inner.take_ready(), outbox, digest, segments, wire);
                Ok(())
            })
            .map_err(to_py)
        })
    }

    /// Fold attention input from a CUDA tensor, as the tap passes it: `data_ptr` and `nbytes` of
    /// contiguous `[rows, hidden]` rows, `dtype` (`"bfloat16"`), the device index, and the
    /// producer's current stream (`torch.cuda.current_stream().cuda_stream`). The rows are pooled
    /// on the GPU on a side stream ordered after that stream with a CUDA event; this call never
    /// waits for the device. The caller keeps the memory alive until the side stream has read
    /// it: `tensor.record_stream(torch.cuda.ExternalStream(capture.side_stream))`. Without the
    /// GPU backend (no `cuda` feature, `PD_BRIDGE_GPU=0`, an unsupported block size) the rows
    /// are copied to the host and pooled on the CPU instead.
    #[pyo3(signature = (layer, start, data_ptr, nbytes, dtype, device, stream))]
    #[allow(clippy::too_many_arguments)]
    fn feed_cuda(&mut self, py: Python<'_>, layer: usize, start: usize, data_ptr: u64, nbytes: usize, dtype: &str, device: usize, stream: u64) -> PyResult<()> {
        guard(|| {
            if dtype != "bfloat16" && dtype != "torch.bfloat16" {
                return Err(InputError::new_err(format!("feed_cuda: dtype {dtype} is not bfloat16")));
            }
            let t = DeviceInput { ptr: data_ptr, nbytes, device, stream };
            let (inner, outbox, digest, segments, wire) = (&mut self.inner, &self.outbox, &mut self.digest, &mut self.segments, &mut self.bytes);
            py.detach(|| {
                inner.feed_input(layer, start, Input::Cuda(t))?;
                push_all(inner.take_ready(), outbox, digest, segments, wire);
                Ok(())
            })
            .map_err(to_py)
        })
    }

    /// The GPU side stream (an integer `CUstream`) once a CUDA feed started it, else None.
    #[getter]
    fn side_stream(&self) -> PyResult<Option<u64>> {
        guard(|| Ok(self.inner.side_stream()))
    }

    /// GPU blocks with device work queued whose segments are not out yet (0 after the seal).
    #[getter]
    fn pending(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.pending()))
    }

    /// Take in finished GPU chunks without waiting (event queries) and send the segments they
    /// complete; returns how many segments went out.
    fn poll(&mut self, py: Python<'_>) -> PyResult<usize> {
        guard(|| {
            let before = self.segments;
            let (inner, outbox, digest, segments, wire) = (&mut self.inner, &self.outbox, &mut self.digest, &mut self.segments, &mut self.bytes);
            py.detach(|| push_all(inner.take_ready(), outbox, digest, segments, wire));
            Ok(self.segments - before)
        })
    }

    /// From now on a finished segment is sent only once `confirm` covers every token it holds:
    /// the caller feeds rows whose place in vLLM's batch it checks later, without waiting for the
    /// device. The seal drops what was never confirmed (see `confirm`).
    fn hold_until_confirmed(&mut self) -> PyResult<()> {
        guard(|| {
            self.inner.hold_until_confirmed();
            Ok(())
        })
    }

    /// The rows of tokens before `upto` were fed from the right place: send the segments that
    /// end there; returns how many went out.
    fn confirm(&mut self, py: Python<'_>, upto: usize) -> PyResult<usize> {
        guard(|| {
            let before = self.segments;
            let (inner, outbox, digest, segments, wire) = (&mut self.inner, &self.outbox, &mut self.digest, &mut self.segments, &mut self.bytes);
            py.detach(|| {
                inner.confirm(upto);
                push_all(inner.take_ready(), outbox, digest, segments, wire)
            });
            Ok(self.segments - before)
        })
    }

    /// Bytes of the segments sent so far, as they go on the wire.
    #[getter]
    fn segment_bytes(&self) -> PyResult<u64> {
        guard(|| Ok(self.bytes))
    }

    /// Segments sent so far and the SHA-256 (hex) over them, in order.
    #[getter]
    fn segments_digest(&self) -> PyResult<(usize, String)> {
        guard(|| {
            let d = self.digest.clone().ok_or_else(|| InputError::new_err("segments_digest is kept only for a capture made without a secret (tests, diagnostics)"))?.finalize();
            Ok((self.segments, d.iter().map(|b| format!("{b:02x}")).collect()))
        })
    }

    /// Seal the capture (`failure`: why it stopped early, if it did); returns the verdict JSON.
    /// GPU chunks still in flight are waited for first (call it off the forward thread).
    #[pyo3(signature = (failure=None))]
    fn seal(&mut self, py: Python<'_>, failure: Option<&str>) -> PyResult<String> {
        guard(|| {
            // A stream the server already gave up (reader gone, too far behind, dropped) did not
            // deliver this capture, whatever the capture computed: the verdict says so.
            let dropped = |o: &Outbox| o.closed_reason().map(|r| format!("segment stream closed: {r}"));
            let failure = failure.map(str::to_owned).or_else(|| dropped(&self.outbox));
            let inner = &mut self.inner;
            let mut seal = py.detach(|| inner.seal(failure.as_deref()));
            let (inner, outbox, digest, segments, wire) = (&mut self.inner, &self.outbox, &mut self.digest, &mut self.segments, &mut self.bytes);
            push_all(inner.take_ready(), outbox, digest, segments, wire);
            if let (Some(reason), false) = (dropped(&self.outbox), matches!(seal, Seal::Aborted { .. })) {
                let blocks = match &seal {
                    Seal::Complete { blocks, .. } | Seal::Partial { blocks, .. } | Seal::Aborted { blocks, .. } => *blocks,
                };
                seal = Seal::Aborted { blocks, reason };
            }
            self.outbox.seal(seal.clone());
            Ok(serde_json::to_string(&seal).expect("seal serializes"))
        })
    }
}

/// This host's CUDA stack for the doctor: driver and NVRTC versions, the architectures NVRTC can
/// compile for, each device (name, compute capability), and what could not be read. Without the
/// `cuda` feature: `{"built_with_cuda": False}`.
#[pyfunction]
fn cuda_report(py: Python<'_>) -> PyResult<Py<pyo3::types::PyDict>> {
    guard(|| {
        let d = pyo3::types::PyDict::new(py);
        #[cfg(feature = "cuda")]
        {
            let r = py.detach(pd_bridge_core::cuda::probe);
            d.set_item("built_with_cuda", true)?;
            d.set_item("driver_version", r.driver_version)?;
            d.set_item("nvrtc_version", r.nvrtc_version)?;
            d.set_item("nvrtc_archs", r.nvrtc_archs)?;
            d.set_item("devices", r.devices)?;
            d.set_item("problems", r.problems)?;
            d.set_item("target_archs", pd_bridge_core::cuda::TARGET_ARCHS.to_vec())?;
        }
        #[cfg(not(feature = "cuda"))]
        d.set_item("built_with_cuda", false)?;
        Ok(d.unbind())
    })
}

/// Compile the capture kernels for `arch` (`compute_90`, ...) with NVRTC, as a capture does at its
/// first CUDA feed: the PTX's length. DeviceError naming the fix when NVRTC is missing or broken.
#[pyfunction]
fn compile_kernels(py: Python<'_>, arch: String) -> PyResult<usize> {
    guard(|| {
        #[cfg(feature = "cuda")]
        {
            py.detach(|| pd_bridge_core::cuda::compile_kernels(&arch)).map(|p| p.len()).map_err(to_py)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (py, arch);
            Err(pd_bridge_bindings::DeviceError::new_err("device, built without CUDA: this pd-bridge-vllm was built without the cuda feature"))
        }
    })
}

/// Make CUDA device `device` ready for captures before the first request (call it once the
/// engine has its own memory): the decoder's weights uploaded, the kernels loaded, and the pools
/// of block bodies filled for `captures` captures at once of `omlx_format` blocks of `block_size`
/// tokens (default: that format's block size for these weights), with steps of up to `step_tokens` tokens, plus `held_bytes` of finished segments a
/// slow reader may leave in the segment server. Returns what it holds (bytes of device and of
/// page-locked host memory, outside the engine's budget) or, in `declined`, why captures of that
/// format and block size pool on the CPU. `layers=(start, end)`: a pipeline stage's layers.
#[pyfunction]
#[pyo3(signature = (weights, device, omlx_format, step_tokens, block_size=None, captures=1, held_bytes=0, layers=None))]
#[allow(clippy::too_many_arguments)]
fn prepare_gpu(py: Python<'_>, weights: &Weights, device: usize, omlx_format: &str, step_tokens: usize, block_size: Option<usize>, captures: usize, held_bytes: usize, layers: Option<(usize, usize)>) -> PyResult<Py<pyo3::types::PyDict>> {
    guard(|| {
        let format = pd_bridge_core::OmlxFormat::from_name(omlx_format).map_err(to_py)?;
        let prep = pd_bridge_core::backend::DevicePreparation {
            weights: weights.inner.clone(),
            device,
            format,
            block_size: block_size.unwrap_or_else(|| format.block_size(&weights.inner.plan)),
            step_tokens,
            captures,
            held_bytes,
            stage: layers.map(|(a, b)| a..b),
            options: capture_options_from_env(),
        };
        let p = py.detach(|| pd_bridge_core::device::prepare(&prep)).map_err(to_py)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("block_size", prep.block_size)?;
        d.set_item("body_bytes", p.body_bytes)?;
        d.set_item("staging_bodies", p.staging_bodies)?;
        d.set_item("pinned_bodies", p.pinned_bodies)?;
        d.set_item("staging_bytes", p.staging_bytes)?;
        d.set_item("pinned_bytes", p.pinned_bytes)?;
        d.set_item("allocated", p.allocated)?;
        d.set_item("seconds", p.seconds)?;
        d.set_item("declined", p.declined)?;
        Ok(d.unbind())
    })
}

/// Host time the GPU capture engine spent by phase, and the page-locked or staging buffers it
/// newly allocated, over every GPU capture in this process since the last reset (`reset` zeroes
/// them after reading): what the connector logs per sealed capture and benchmarks read.
#[pyfunction]
#[pyo3(signature = (reset=false))]
fn gpu_capture_times(py: Python<'_>, reset: bool) -> PyResult<Py<pyo3::types::PyDict>> {
    guard(|| {
        let d = pyo3::types::PyDict::new(py);
        #[cfg(feature = "cuda")]
        {
            let t = pd_bridge_core::cuda::capture_times(reset);
            d.set_item("kernels_s", t.kernels_s)?;
            d.set_item("gathers_s", t.gathers_s)?;
            d.set_item("copies_s", t.copies_s)?;
            d.set_item("waits_s", t.waits_s)?;
            d.set_item("new_buffers", t.new_buffers)?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = reset;
        Ok(d.unbind())
    })
}

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{compile_kernels, cuda_report, decoder_model_fingerprint, gpu_capture_times, model_fingerprint, prepare_gpu, prompt_digest, weights_fingerprint, Capture, SegmentServer, Weights};

    /// The shared exception classes (PdBridgeError, ConfigError, WeightsError, InputError,
    /// WireError, AuthError, InternalError) and the tracing -> logging bridge.
    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        pd_bridge_bindings::init_module(m)
    }

    #[pymodule_export]
    const VERSION: &str = env!("CARGO_PKG_VERSION");
}
