//! `pd_bridge_vllm._native`: the prefill side's native module. Importing it touches no GPU:
//! everything CUDA-related starts lazily in the worker that first captures.

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

#[pymodule(gil_used = false)]
mod _native {
    #[pymodule_export]
    use super::{weights_fingerprint, ConfigError, PdBridgeError, WeightsError};

    #[pymodule_export]
    const VERSION: &str = env!("CARGO_PKG_VERSION");
}
