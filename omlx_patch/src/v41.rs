//! DeepSeek-V4.1's cache math for Python (`pd_bridge_omlx._native.V41Weights`,
//! `V41CacheBuilder`): the core's `v41` family, which has no oMLX block format, so it stands beside
//! `Weights`/`CacheBuilder` rather than behind them.

use std::sync::Arc;

use pd_bridge_bindings::buffer::{with_bf16, ByteView};
use pd_bridge_bindings::{guard, to_py, InputError};
use pd_bridge_core::family::v41::{V41Carry, V41LayerCarry, V41CacheBuilder as CoreV41CacheBuilder, V41Weights as CoreV41Weights};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// DeepSeek-V4.1's cache weights, read from an MLX model directory.
#[pyclass(frozen, module = "pd_bridge_omlx._native")]
pub(crate) struct V41Weights {
    inner: Arc<CoreV41Weights>,
}

#[pymethods]
impl V41Weights {
    #[staticmethod]
    fn load(py: Python<'_>, model_dir: std::path::PathBuf) -> PyResult<Self> {
        guard(|| {
            let w = py.detach(|| CoreV41Weights::load(&model_dir)).map_err(to_py)?;
            Ok(V41Weights { inner: Arc::new(w) })
        })
    }

    /// `sha256:<hex>` over the plan and the tensors the cache math reads.
    #[getter]
    fn fingerprint(&self) -> PyResult<String> {
        guard(|| Ok(self.inner.fingerprint.clone()))
    }

    #[getter]
    fn num_layers(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.plan.num_layers))
    }

    #[getter]
    fn hidden_size(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.plan.hidden_size))
    }

    /// The carry state at token `position` from the decoder's own `LayerCache` arrays, per
    /// layer `(window, pending_kv, pending_gate)` as little-endian bytes (the window's last
    /// `min(position, sliding_window)` bf16 rows; the float32 pending rows of a ratio-2 pool, else
    /// empty): the bytes `V41CacheBuilder.resume` takes. Checked against the plan.
    fn carry_state_of<'py>(&self, py: Python<'py>, position: usize, layers: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)>) -> PyResult<Bound<'py, PyBytes>> {
        guard(|| {
            let f32s = |b: &[u8], what: &str, i: usize| -> PyResult<Vec<f32>> {
                if b.len() % 4 != 0 {
                    return Err(InputError::new_err(format!("layer {i}: {what} of {} bytes is not float32 values", b.len())));
                }
                Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            };
            let mut out = Vec::with_capacity(layers.len());
            for (i, (w, pk, pg)) in layers.iter().enumerate() {
                if w.len() % 2 != 0 {
                    return Err(InputError::new_err(format!("layer {i}: window of {} bytes is not bf16 values", w.len())));
                }
                let window = with_bf16(w, |x| x.to_vec());
                out.push(V41LayerCarry { window, pending_kv: f32s(pk, "pending_kv", i)?, pending_gate: f32s(pg, "pending_gate", i)? });
            }
            let carry = V41Carry { fingerprint: self.inner.fingerprint.clone(), position, layers: out };
            carry.check(&self.inner.fingerprint, &self.inner.plan).map_err(to_py)?;
            Ok(PyBytes::new(py, &carry.encode()))
        })
    }

    /// `(ratio, pools, index_keys)` of `layer`.
    fn layer_kind(&self, layer: usize) -> PyResult<(usize, bool, bool)> {
        guard(|| {
            if layer >= self.inner.plan.num_layers {
                return Err(InputError::new_err(format!("no layer {layer}")));
            }
            let k = self.inner.plan.layer_kind(layer);
            Ok((k.ratio, k.pools, k.index_keys))
        })
    }
}

/// `(name, dtype, shape, little-endian bytes)` of one state array.
type NamedArray<'py> = (String, &'static str, Vec<usize>, Bound<'py, PyBytes>);

/// DeepSeek-V4.1's per-layer cache state for one request, fed chunks of attention input.
#[pyclass(module = "pd_bridge_omlx._native")]
pub(crate) struct V41CacheBuilder {
    inner: CoreV41CacheBuilder,
}

#[pymethods]
impl V41CacheBuilder {
    #[new]
    fn new(weights: &V41Weights) -> PyResult<Self> {
        guard(|| Ok(V41CacheBuilder { inner: CoreV41CacheBuilder::new(weights.inner.clone()) }))
    }

    /// The state at the position a carry state (`carry_state()`'s bytes) names.
    #[staticmethod]
    fn resume(weights: &V41Weights, carry_state: &[u8]) -> PyResult<Self> {
        guard(|| {
            let carry = V41Carry::decode(carry_state).map_err(to_py)?;
            Ok(V41CacheBuilder { inner: CoreV41CacheBuilder::resume(weights.inner.clone(), &carry).map_err(to_py)? })
        })
    }

    /// The carry state after the tokens every layer has processed, as bytes.
    fn carry_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        guard(|| Ok(PyBytes::new(py, &self.inner.carry().map_err(to_py)?.encode())))
    }

    /// Where a resumed state starts (0: from the first token).
    #[getter]
    fn origin(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.origin()))
    }

    /// Fold `[rows, hidden]` attention input (little-endian bf16, any C-contiguous buffer), first
    /// token at absolute position `start`, into `layer`'s state.
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

    /// The layer's state as `[(name, dtype, shape, little-endian bytes)]`, under mlx-lm's
    /// `LayerCache` field names and dtypes (`"bfloat16"`, `"float32"`).
    fn snapshot<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<Vec<NamedArray<'py>>> {
        guard(|| {
            let state = self.inner.layer(layer).ok_or_else(|| InputError::new_err(format!("no layer {layer}")))?;
            Ok(state.snapshot().into_iter().map(|a| (a.name.to_string(), a.dtype(), a.shape.clone(), PyBytes::new(py, &a.le_bytes()))).collect())
        })
    }
}
