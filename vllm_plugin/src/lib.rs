//! `pd_bridge_vllm._native`: the prefill side's native module. Importing it touches no GPU:
//! everything CUDA-related starts lazily in the worker that first captures.

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use pd_bridge_core::capture::Capture as CoreCapture;
use pd_bridge_core::stream::{Outbox, SegmentServer as CoreSegmentServer};
use pd_bridge_core::{CoreError, DecoderWeights};
use pyo3::exceptions::{PyException, PyOSError};
use pyo3::prelude::*;

pyo3::create_exception!(pd_bridge_vllm._native, PdBridgeError, PyException, "Base class of every pd-bridge error.");
pyo3::create_exception!(pd_bridge_vllm._native, ConfigError, PdBridgeError, "The decoder's config.json is missing or has an unsupported value.");
pyo3::create_exception!(pd_bridge_vllm._native, WeightsError, PdBridgeError, "A decoder weight is missing, malformed or stored in an unsupported format.");

fn to_py(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::Config { .. } => ConfigError::new_err(msg),
        CoreError::Weights { .. } | CoreError::WeightFile { .. } => WeightsError::new_err(msg),
        CoreError::Input { .. } | CoreError::Wire(_) | CoreError::Auth(_) => PdBridgeError::new_err(msg),
        CoreError::Io { .. } => PyOSError::new_err(msg),
    }
}

/// Read the decoder's attention-cache weights from `model_dir` and return their fingerprint,
/// the value the decode host compares before it trusts a stream.
#[pyfunction]
fn weights_fingerprint(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<String> {
    py.detach(|| DecoderWeights::load(&model_dir)).map(|w| w.fingerprint).map_err(to_py)
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
        let w = py.detach(|| DecoderWeights::load(&model_dir)).map_err(to_py)?;
        Ok(Weights { inner: Arc::new(w) })
    }

    #[getter]
    fn fingerprint(&self) -> String {
        self.inner.fingerprint.clone()
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.plan.num_layers()
    }

    #[getter]
    fn hidden_size(&self) -> usize {
        self.inner.plan.hidden_size()
    }
}

/// Serves captured segments to decode hosts that prove the shared token.
#[pyclass(frozen, module = "pd_bridge_vllm._native")]
struct SegmentServer {
    inner: CoreSegmentServer,
}

#[pymethods]
impl SegmentServer {
    #[new]
    #[pyo3(signature = (address, token, idle_seconds=60.0))]
    fn new(address: &str, token: Vec<u8>, idle_seconds: f64) -> PyResult<Self> {
        let idle = Duration::try_from_secs_f64(idle_seconds).map_err(|e| ConfigError::new_err(format!("idle_seconds: {e}")))?;
        CoreSegmentServer::bind(address, token, idle).map(|inner| SegmentServer { inner }).map_err(to_py)
    }

    #[getter]
    fn port(&self) -> u16 {
        self.inner.local_addr().port()
    }
}

/// One request's capture: attention inputs in, segments out to the server as blocks complete.
#[pyclass(module = "pd_bridge_vllm._native")]
struct Capture {
    inner: CoreCapture,
    outbox: Arc<Outbox>,
}

#[pymethods]
impl Capture {
    #[new]
    fn new(weights: &Weights, request_id: &str, prompt_tokens: usize, block_size: usize, server: &SegmentServer) -> PyResult<Self> {
        let inner = CoreCapture::new(weights.inner.clone(), request_id, prompt_tokens, block_size).map_err(to_py)?;
        Ok(Capture { inner, outbox: server.inner.outbox(request_id) })
    }

    /// Fold `[rows, hidden]` attention input (little-endian bf16 bytes) for tokens from `start`.
    fn feed(&mut self, py: Python<'_>, layer: usize, start: usize, data: &[u8]) -> PyResult<()> {
        if data.len() % 2 != 0 {
            return Err(PdBridgeError::new_err(format!("{} bytes is not a whole number of bf16 values", data.len())));
        }
        let x: Vec<bf16> = data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
        let (inner, outbox) = (&mut self.inner, &self.outbox);
        py.detach(|| {
            inner.feed(layer, start, &x)?;
            for seg in inner.take_ready() {
                outbox.push(seg);
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Fold attention input read straight from host memory: `data_ptr` points at `nbytes` of
    /// contiguous little-endian bf16, `[rows, hidden]` (a CPU torch tensor's `data_ptr()`). The
    /// caller keeps that memory alive and unmodified for the duration of the call.
    fn feed_ptr(&mut self, py: Python<'_>, layer: usize, start: usize, data_ptr: usize, nbytes: usize) -> PyResult<()> {
        if data_ptr == 0 || data_ptr % std::mem::align_of::<bf16>() != 0 || nbytes % 2 != 0 {
            return Err(PdBridgeError::new_err(format!("feed_ptr: {nbytes} bytes at {data_ptr:#x} is not an aligned bf16 buffer")));
        }
        let (inner, outbox) = (&mut self.inner, &self.outbox);
        // The GIL is released for the pooling math; the caller's frame still holds the tensor,
        // so its memory stays alive and unmoved for the call.
        py.detach(|| {
            // SAFETY: the caller guarantees `nbytes` readable bytes at `data_ptr` for this call;
            // bf16 is a plain 2-byte value and the host is little-endian like the wire format.
            let x: &[bf16] = unsafe { std::slice::from_raw_parts(data_ptr as *const bf16, nbytes / 2) };
            inner.feed(layer, start, x)?;
            for seg in inner.take_ready() {
                outbox.push(seg);
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Seal the capture (`failure`: why it stopped early, if it did); returns the verdict JSON.
    #[pyo3(signature = (failure=None))]
    fn seal(&mut self, failure: Option<&str>) -> String {
        let seal = self.inner.seal(failure);
        self.outbox.seal(seal.clone());
        serde_json::to_string(&seal).expect("seal serializes")
    }
}

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{weights_fingerprint, Capture, ConfigError, PdBridgeError, SegmentServer, Weights, WeightsError};

    #[pymodule_export]
    const VERSION: &str = env!("CARGO_PKG_VERSION");
}
