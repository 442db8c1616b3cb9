//! `pd_bridge_omlx._native`: the decode side's native module. Python hands it plain data
//! (paths, token positions, little-endian bf16 bytes); all cache math lives in the core.

use std::sync::Arc;

use pd_bridge_core::block::validate::{inspect_with, move_aside, Expect};
use pd_bridge_core::block::BlockWriter as CoreBlockWriter;
use pd_bridge_bindings::buffer::{with_bf16, ByteView};
use pd_bridge_bindings::errors::to_py_with;
use pd_bridge_bindings::{guard, to_py, ConfigError, InputError, PdBridgeError};
use pd_bridge_core::{CacheBuilder as CoreCacheBuilder, CoreError, DecoderSteps, DecoderWeights, OmlxFormat};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

// DeepSeek-V4.1 (its own classes: the family has no oMLX block format).
mod v41;

// The exception classes shared with the vLLM wheel (and the CoreError mapping, the panic guard
// and the logging bridge) come from pd-bridge-bindings; this one is the decode side's own.
pyo3::create_exception!(pd_bridge_omlx._native, BlockRejected, PdBridgeError, "A block file that must not be served; the message says why.");

/// The core's block-format descriptor by name (`None`: the fork's, for older callers).
fn format_of(name: Option<&str>) -> PyResult<OmlxFormat> {
    name.map_or(Ok(OmlxFormat::Fork070), |n| OmlxFormat::from_name(n).map_err(to_py))
}

/// The decoder's attention-cache weights, read from an MLX model directory.
#[pyclass(frozen, module = "pd_bridge_omlx._native")]
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

    /// `sha256:<hex>` over the plan and the tensors the cache math reads.
    #[getter]
    fn fingerprint(&self) -> PyResult<String> {
        guard(|| Ok(self.inner.fingerprint.clone()))
    }

    #[getter]
    fn family(&self) -> PyResult<&'static str> {
        guard(|| Ok(self.inner.plan.family()))
    }

    /// `[(module, format)]`: every projection the cache math reads and how the model stores it
    /// (`bf16`, `affine 4-bit g64`, `mxfp4`, `mxfp8`, `nvfp4`).
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

/// Per-layer decoder cache state for one request, fed chunks of attention input.
#[pyclass(module = "pd_bridge_omlx._native")]
struct CacheBuilder {
    inner: CoreCacheBuilder,
}

#[pymethods]
impl CacheBuilder {
    /// `decoder_step`: the decoder's prefill step grid (oMLX's block size); `omlx_format`: the
    /// decoder's block format (its ratio-4 overlap semantics and window rows).
    #[new]
    #[pyo3(signature = (weights, decoder_step, omlx_format=None))]
    fn new(weights: &Weights, decoder_step: usize, omlx_format: Option<&str>) -> PyResult<Self> {
        guard(|| {
            let steps = DecoderSteps::for_format(format_of(omlx_format)?, decoder_step).map_err(to_py)?;
            Ok(CacheBuilder { inner: CoreCacheBuilder::new(weights.inner.clone(), steps) })
        })
    }

    /// Fold `[rows, hidden]` attention input (little-endian bf16), first token at absolute
    /// position `start`, into `layer`'s state. `data` is any C-contiguous buffer (bytes,
    /// bytearray, memoryview, a numpy uint8/uint16 array), read in place.
    fn feed(&mut self, py: Python<'_>, layer: usize, start: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let view = ByteView::bf16(data, "data")?;
            let (bytes, inner) = (view.bytes(), &mut self.inner);
            py.detach(|| with_bf16(bytes, |x| inner.feed(layer, start, x))).map_err(to_py)
        })
    }

    fn processed(&self, layer: usize) -> PyResult<usize> {
        guard(|| self.inner.processed(layer).ok_or_else(|| InputError::new_err(format!("no layer {layer}"))))
    }

    /// The layer's state as `[(name, shape, little-endian bf16 bytes)]`.
    fn snapshot<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<Vec<(String, Vec<usize>, Bound<'py, PyBytes>)>> {
        guard(|| {
            let state = self.inner.layer(layer).ok_or_else(|| InputError::new_err(format!("no layer {layer}")))?;
            Ok(state
                .snapshot()
                .into_iter()
                .map(|a| {
                    let bytes: Vec<u8> = a.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                    (a.name.to_string(), a.shape, PyBytes::new(py, &bytes))
                })
                .collect())
        })
    }
}

/// Writes one request's full blocks into an oMLX cache directory, named by oMLX's chain hash.
#[pyclass(frozen, module = "pd_bridge_omlx._native")]
struct BlockWriter {
    inner: CoreBlockWriter,
}

#[pymethods]
impl BlockWriter {
    /// `model_name`: the model string oMLX hashes with (the fork: the model directory path it
    /// loaded; upstream: the model id); `token_ids`: the request's ids as oMLX tokenized them;
    /// `omlx_format`: the block format to write (`omlx_formats()`; default the fork's);
    /// `model_dir`: the decoder's model directory, whose `config.json` plan every received
    /// segment and every file found on a block's name is checked against.
    #[new]
    #[pyo3(signature = (cache_dir, model_name, block_size, token_ids, omlx_format=None, model_dir=None))]
    fn new(cache_dir: std::path::PathBuf, model_name: String, block_size: usize, token_ids: Vec<u32>, omlx_format: Option<&str>, model_dir: Option<std::path::PathBuf>) -> PyResult<Self> {
        guard(|| {
            let plan = plan_of(model_dir.as_deref())?;
            let mut inner = CoreBlockWriter::with_format(format_of(omlx_format)?, cache_dir, model_name, block_size, &token_ids).map_err(to_py)?;
            if let Some(plan) = &plan {
                inner = inner.with_plan(plan).map_err(to_py)?;
            }
            Ok(BlockWriter { inner })
        })
    }

    /// Continue this request's stream at the block boundary the carry state names (multi-turn
    /// resume; `carry_state`: the bytes `carry_state()` read from the held block ending there and
    /// sent to the prefill host): the next segment must be that block, `ingest` pulls from there.
    /// Call it before the first segment. Raises `PdBridgeError` for a carry state of another
    /// format, block size or prefix (its chain hash must be this prompt's block), past the prompt,
    /// or for the fork's full-pool blocks (not resumable). Returns the next block's index.
    fn resume(&self, py: Python<'_>, carry_state: &[u8]) -> PyResult<usize> {
        guard(|| {
            py.detach(|| {
                let carry = pd_bridge_core::pooler::carry::CarryState::decode(carry_state)?;
                self.inner.resume_at(&carry)?;
                Ok(self.inner.next_block())
            })
            .map_err(to_py)
        })
    }

    /// Whether segments are checked against the decoder's plan (a `model_dir` was given).
    #[getter]
    fn checks_plan(&self) -> PyResult<bool> {
        guard(|| Ok(self.inner.plan().is_some()))
    }

    /// Admit and write the block one received segment payload carries (the stream's next, in
    /// order from block 0): decoded, checked against the plan and the block grid (every
    /// array's shape, finite values) before anything is written; a refused segment raises
    /// `InputError` naming the block, layer, array and what was wrong, and writes nothing.
    /// Returns `(path, bytes, existed)`; the flush finishes in the background (see `flush`).
    fn write_segment(&self, py: Python<'_>, payload: &Bound<'_, PyAny>) -> PyResult<(std::path::PathBuf, u64, bool)> {
        guard(|| {
            let view = ByteView::get(payload, "payload")?;
            let bytes = view.bytes();
            let w = py
                .detach(|| pd_bridge_core::segment::Segment::decode(bytes).and_then(|seg| self.inner.write_segment(&seg)))
                .map_err(|e| match e {
                    CoreError::Wire(m) => InputError::new_err(format!("segment: {m}")),
                    e => to_py(e),
                })?;
            Ok((w.path, w.bytes, w.existed))
        })
    }

    #[getter]
    fn omlx_format(&self) -> PyResult<&'static str> {
        guard(|| Ok(self.inner.format().name()))
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.num_blocks()))
    }

    fn hash_hex(&self, index: usize) -> PyResult<String> {
        guard(|| self.inner.hash(index).map(|h| h.hex()).ok_or_else(|| InputError::new_err(format!("no block {index}"))))
    }

    /// Wait until every written block is on disk under its final name (visible to oMLX).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| py.detach(|| self.inner.flush()).map_err(to_py))
    }

    /// Write block `index` from `builder`, whose layers must have processed exactly the block's
    /// end; its flush to disk finishes in the background (see `flush`). Returns
    /// `(path, bytes, existed)`.
    fn write(&self, py: Python<'_>, builder: PyRef<'_, CacheBuilder>, index: usize) -> PyResult<(std::path::PathBuf, u64, bool)> {
        guard(|| {
            let layers = builder.inner.layers();
            let w = py.detach(|| self.inner.write(index, layers)).map_err(to_py)?;
            Ok((w.path, w.bytes, w.existed))
        })
    }
}

/// The decoder's plan from `model_dir/config.json`, when a model directory is given.
fn plan_of(model_dir: Option<&std::path::Path>) -> PyResult<Option<pd_bridge_core::ModelPlan>> {
    let Some(dir) = model_dir else { return Ok(None) };
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| PyOSError::new_err(format!("{}: {e}", path.display())))?;
    pd_bridge_core::ModelPlan::from_config_json(&text).map(Some).map_err(to_py)
}

/// Validate a block file before oMLX may index it (without following links or blocking on a
/// FIFO; `model_dir`: the decoder's, whose plan every tensor's dtype and shape must fit;
/// `cache_dir`: the directory it must lie in). Returns `(hash_hex, token_count, num_layers,
/// model_name, file_size)`; raises `BlockRejected` with the reason otherwise. `move_bad`: a file
/// that can never be a valid block (a link, FIFO, directory, or a corrupt or misshapen file) is
/// first moved into the cache's quarantine directory, which the message then names.
#[pyfunction]
#[pyo3(signature = (path, model_name=None, num_layers=None, block_size=None, omlx_format=None, model_dir=None, cache_dir=None, move_bad=false))]
#[allow(clippy::too_many_arguments)]
fn inspect_block(
    py: Python<'_>,
    path: std::path::PathBuf,
    model_name: Option<String>,
    num_layers: Option<usize>,
    block_size: Option<usize>,
    omlx_format: Option<&str>,
    model_dir: Option<std::path::PathBuf>,
    cache_dir: Option<std::path::PathBuf>,
    move_bad: bool,
) -> PyResult<(String, usize, usize, String, u64)> {
    guard(|| {
        let expect = Expect { format: format_of(omlx_format)?, model_name, num_layers, block_size };
        let plan = plan_of(model_dir.as_deref())?;
        let got = py.detach(|| {
            inspect_with(&path, &expect, plan.as_ref(), cache_dir.as_deref()).map_err(|why| {
                let cache = cache_dir.clone().or_else(|| path.parent().and_then(|p| p.parent()).map(|p| p.to_path_buf()));
                let moved = match (move_bad && why.is_bad_file(), cache) {
                    (true, Some(cache)) => match move_aside(&path, &cache, &why) {
                        Ok(to) => format!("; moved aside to {}", to.display()),
                        Err(e) => format!("; could not be moved aside: {e}"),
                    },
                    _ => String::new(),
                };
                format!("{}: {why}{moved}", path.display())
            })
        });
        let info = got.map_err(BlockRejected::new_err)?;
        Ok((info.hash.hex(), info.token_count, info.num_layers, info.model_name, info.file_size))
    })
}

/// Remove the block writer's temp files a crashed writer left in `cache_dir` (its own hidden
/// temp pattern only; never one a live writer may still be writing: its process is gone, or
/// the file is older than `max_age_seconds`). Returns the paths removed.
#[pyfunction]
#[pyo3(signature = (cache_dir, max_age_seconds=600.0))]
fn clean_stale_temps(py: Python<'_>, cache_dir: std::path::PathBuf, max_age_seconds: f64) -> PyResult<Vec<std::path::PathBuf>> {
    guard(|| {
        let age = std::time::Duration::try_from_secs_f64(max_age_seconds).map_err(|e| ConfigError::new_err(format!("max_age_seconds: {e}")))?;
        Ok(py.detach(|| pd_bridge_core::block::file::clean_stale_temps(&cache_dir, age)))
    })
}

/// The block formats this build writes and validates, by name (newest first).
#[pyfunction]
fn omlx_formats() -> PyResult<Vec<&'static str>> {
    guard(|| Ok(OmlxFormat::ALL.iter().map(|f| f.name()).collect()))
}

/// The block size `omlx_format`'s oMLX picks for the model whose weights are loaded.
#[pyfunction]
fn expected_block_size(weights: &Weights, omlx_format: &str) -> PyResult<usize> {
    guard(|| Ok(format_of(Some(omlx_format))?.block_size(&weights.inner.plan)))
}

/// The decoder's carry state at the end of a block it holds (multi-turn resume): `path` is the
/// block ending at token `position` (a multiple of `block_size`, the block's index + 1 times
/// it), `weights` the decoder's own (their fingerprint goes with the state). The file is
/// validated as oMLX loads it and every array checked against the plan and `position`. Returns
/// the carry state's bytes, which the prefill host's `Capture.resume` takes; raises
/// `PdBridgeError` naming what does not fit (the block, its position, the plan).
#[pyfunction]
#[pyo3(signature = (weights, path, block_size, position, omlx_format))]
fn carry_state<'py>(py: Python<'py>, weights: &Weights, path: std::path::PathBuf, block_size: usize, position: usize, omlx_format: &str) -> PyResult<Bound<'py, PyBytes>> {
    guard(|| {
        let format = format_of(Some(omlx_format))?;
        let w = &weights.inner;
        let bytes = py
            .detach(|| pd_bridge_core::pooler::carry::CarryState::from_block_file(&path, &w.plan, &w.fingerprint, format, block_size, position).map(|c| c.encode()))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &bytes))
    })
}

/// One block `ingest` wrote and flushed under its final name, validated once by the core
/// against the writer's format, model name, block size, cache directory and plan: what the
/// decode host needs to put it into oMLX's index without reading or checking it again.
#[pyclass(frozen, module = "pd_bridge_omlx._native")]
struct LandedBlock {
    /// The block's index in the prompt's chain.
    #[pyo3(get)]
    index: usize,
    /// Its chain hash, hex (the file's name).
    #[pyo3(get)]
    hash_hex: String,
    /// `<cache>/<hash[0]>/<hash>.safetensors`.
    #[pyo3(get)]
    path: std::path::PathBuf,
    /// Already on disk (a sound block of this prompt, left as it was) rather than written now.
    #[pyo3(get)]
    existed: bool,
    /// The file's size when it validated, else None.
    #[pyo3(get)]
    file_size: Option<u64>,
    /// Why it must not be served (`"<path>: <reason>"`, as `inspect_block` says it), else None.
    #[pyo3(get)]
    rejected: Option<String>,
}

#[pymethods]
impl LandedBlock {
    fn __repr__(&self) -> PyResult<String> {
        guard(|| Ok(format!("LandedBlock(index={}, hash_hex={:?}, existed={}, file_size={:?}, rejected={:?})", self.index, self.hash_hex, self.existed, self.file_size, self.rejected)))
    }
}

impl LandedBlock {
    fn of(b: &pd_bridge_core::block::Landed) -> Self {
        let (file_size, rejected) = match &b.check {
            Ok(info) => (Some(info.file_size), None),
            Err(why) => (None, Some(format!("{}: {why}", b.path.display()))),
        };
        LandedBlock { index: b.index, hash_hex: b.hash.hex(), path: b.path.clone(), existed: b.existed, file_size, rejected }
    }
}

/// Stops an `ingest` running on another thread (`cancel()`); blocks already written stay.
#[pyclass(frozen, module = "pd_bridge_omlx._native")]
#[derive(Default)]
struct IngestControl {
    inner: pd_bridge_core::ingest::IngestControl,
}

#[pymethods]
impl IngestControl {
    #[new]
    fn new() -> PyResult<Self> {
        guard(|| Ok(Self::default()))
    }

    fn cancel(&self) -> PyResult<()> {
        guard(|| {
            self.inner.cancel();
            Ok(())
        })
    }

    #[getter]
    fn cancelled(&self) -> PyResult<bool> {
        guard(|| Ok(self.inner.is_cancelled()))
    }
}

/// Write the attention-cache tensors of the MLX model in `model_dir` (and its config.json) into
/// `out_dir` for the prefill host; returns their fingerprint.
#[pyfunction]
fn export_weights(py: Python<'_>, model_dir: std::path::PathBuf, out_dir: std::path::PathBuf) -> PyResult<String> {
    guard(|| py.detach(|| DecoderWeights::export(&model_dir, &out_dir)).map_err(to_py))
}

/// Write the MLX model in `model_dir` as a bf16 Hugging Face checkpoint the GPU host's vLLM loads
/// (the decoder's own weights, dequantized); returns `(model_fingerprint, [(module, format)] of
/// the dequantized modules, tensors written)`.
#[pyfunction]
fn export_checkpoint(py: Python<'_>, model_dir: std::path::PathBuf, out_dir: std::path::PathBuf) -> PyResult<(String, Vec<(String, String)>, usize)> {
    guard(|| {
        py.detach(|| pd_bridge_core::checkpoint::export_checkpoint(&model_dir, &out_dir))
            .map(|e| (e.model_fingerprint, e.dequantized, e.tensors))
            .map_err(to_py)
    })
}

/// A model directory's identity (`pd_bridge_core::checkpoint::model_fingerprint`): an exported
/// checkpoint reports its source's.
#[pyfunction]
fn model_fingerprint(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<String> {
    guard(|| py.detach(|| pd_bridge_core::checkpoint::model_fingerprint(&model_dir)).map_err(to_py))
}

/// A fresh per-request capture secret (64 hex digits): sent to vLLM in `pd_capture.secret` and
/// given to `ingest`; only its holder can pull the capture.
#[pyfunction]
fn capture_secret() -> PyResult<String> {
    guard(|| pd_bridge_core::wire::CaptureSecret::generate().map(|s| s.to_hex()).map_err(to_py))
}

/// Receive `request_id`'s segments from the prefill host at `host:port`, writing each block with
/// `writer` as it arrives; `on_block(block)` gets each block's `LandedBlock` once it is on disk
/// under its final name and validated (its path, hash and the validator's verdict). The stream is
/// encrypted and both sides prove the capture's key, derived from `token`, `secret` (the one sent
/// in `pd_capture.secret`), the capture id, `fingerprint` and `token_ids` (the prompt exactly as
/// sent to vLLM): a prefill host that cannot is refused before a byte of cache is accepted.
/// Frames are capped by what one block of the writer's plan can hold. `lanes` > 1 pulls the
/// capture over that many streams at once (sealed and opened on as many cores at each end, for
/// links faster than one core encrypts; blocks are still written in chain order). `stages` > 1
/// pulls a prefill host that runs vLLM's pipeline parallelism: stage `s` serves its layers' part
/// of each block on `port + s`, and a block is written once every stage's part of it arrived,
/// joined (a stage that fails ends the capture there, naming the stage). Returns
/// `(blocks_written, verdict_json)`; a broken stream raises `PdBridgeError(message, blocks)`
/// (`AuthError` for a failed handshake) with the count written before it (each whole and valid).
#[pyfunction]
#[pyo3(signature = (host, port, token, request_id, fingerprint, writer, timeout_seconds=60.0, on_block=None, control=None, *, secret, token_ids, lanes=1, stages=1))]
#[allow(clippy::too_many_arguments)]
fn ingest(
    py: Python<'_>,
    host: &str,
    port: u16,
    token: Vec<u8>,
    request_id: &str,
    fingerprint: &str,
    writer: &BlockWriter,
    timeout_seconds: f64,
    on_block: Option<Py<PyAny>>,
    control: Option<Py<IngestControl>>,
    secret: &str,
    token_ids: Vec<u32>,
    lanes: u8,
    stages: u8,
) -> PyResult<(usize, String)> {
    guard(|| {
        use std::net::ToSocketAddrs;
        let addrs: Vec<_> = (host, port).to_socket_addrs().map_err(|e| PdBridgeError::new_err(format!("cannot resolve {host}:{port}: {e}")))?.collect();
        if addrs.is_empty() {
            return Err(PdBridgeError::new_err(format!("cannot resolve {host}:{port}: no address")));
        }
        let timeout = std::time::Duration::try_from_secs_f64(timeout_seconds).map_err(|e| ConfigError::new_err(format!("timeout_seconds: {e}")))?;
        pd_bridge_core::wire::Lane::new(0, lanes).map_err(to_py)?;
        if !(1..=pd_bridge_core::stages::MAX_STAGES).contains(&stages) {
            return Err(ConfigError::new_err(format!("stages={stages}: a capture is pulled from 1 to {} pipeline stages", pd_bridge_core::stages::MAX_STAGES)));
        }
        let own = pd_bridge_core::ingest::IngestControl::default();
        let control_ref = control.as_ref().map(|c| &c.get().inner).unwrap_or(&own);
        // The core's events during the stream carry the request id (logging::request_span).
        let span = pd_bridge_bindings::logging::request_span(request_id);
        let secret = pd_bridge_core::wire::CaptureSecret::from_hex(secret).map_err(to_py)?;
        let w = &writer.inner;
        let limits = w.plan().map(|plan| pd_bridge_core::wire::FrameLimits::for_plan(plan, w.format(), w.block_size())).unwrap_or_default();
        let pull = pd_bridge_core::ingest::Pull {
            addrs,
            token: &token,
            secret: &secret,
            request_id,
            fingerprint,
            prompt: pd_bridge_core::wire::PromptDigest::of(&token_ids),
            limits,
            timeout,
            lanes,
            stages,
        };
        let got = py.detach(|| span.in_scope(|| {
            pd_bridge_core::ingest::ingest(&pull, w, control_ref, |landed| {
                if let Some(cb) = &on_block {
                    let block = LandedBlock::of(landed);
                    Python::attach(|py| {
                        if let Err(e) = cb.call1(py, (block,)) {
                            e.print(py);
                        }
                    });
                }
            })
        }));
        match got.outcome {
            Ok(seal) => Ok((got.blocks, serde_json::to_string(&seal).expect("seal serializes"))),
            Err(e) => Err(to_py_with(&e, (format!("after {} blocks: {e}", got.blocks), got.blocks))),
        }
    })
}

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{capture_secret, carry_state, clean_stale_temps, expected_block_size, export_checkpoint, export_weights, ingest, model_fingerprint, inspect_block, omlx_formats, IngestControl, LandedBlock, BlockRejected, BlockWriter, CacheBuilder, Weights};

    #[pymodule_export]
    use super::v41::{V41CacheBuilder, V41Weights};

    /// The shared exception classes (PdBridgeError, ConfigError, WeightsError, InputError,
    /// WireError, AuthError, InternalError) and the tracing -> logging bridge.
    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        pd_bridge_bindings::init_module(m)
    }

    #[pymodule_export]
    const VERSION: &str = env!("CARGO_PKG_VERSION");
}
