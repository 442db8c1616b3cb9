//! The exception classes both wheels raise, and the one mapping from the core's `CoreError`.
//!
//! Every class derives from `PdBridgeError` (an `Exception`), except I/O failures, which stay
//! Python's own `OSError` so callers handle them as any other file or socket error.

use pd_bridge_core::CoreError;
use pyo3::exceptions::{PyException, PyOSError};
use pyo3::prelude::*;
use pyo3::PyErrArguments;

// `pd_bridge` is a placeholder: `register` sets each class's `__module__` to the wheel's module.
pyo3::create_exception!(pd_bridge, PdBridgeError, PyException, "Base class of every pd-bridge error.");
pyo3::create_exception!(pd_bridge, ConfigError, PdBridgeError, "The decoder's config.json or a pd-bridge setting is missing or has an unsupported value.");
pyo3::create_exception!(pd_bridge, WeightsError, PdBridgeError, "A decoder weight is missing, malformed or stored in an unsupported format.");
pyo3::create_exception!(pd_bridge, InputError, PdBridgeError, "Input that does not fit: attention rows of the wrong width or positions, a bad buffer, an unknown layer or block.");
pyo3::create_exception!(pd_bridge, WireError, PdBridgeError, "A segment stream that is malformed, out of order, foreign, or that broke.");
pyo3::create_exception!(pd_bridge, AuthError, PdBridgeError, "A peer that does not prove the shared token.");
pyo3::create_exception!(pd_bridge, DeviceError, PdBridgeError, "The GPU path failed, or was asked for where there is none: its `kind` (the message's start) names what failed (built without CUDA, CUDA library, no CUDA device, out of memory, CUDA driver, cuBLAS, NVRTC, GPU capture).");
pyo3::create_exception!(pd_bridge, InternalError, PdBridgeError, "A bug in pd-bridge (a Rust panic), caught at the boundary: the engine keeps running.");

/// `e` as the Python exception of its kind, with `args` as the exception's arguments (the
/// message, or a tuple such as `(message, blocks_written)`).
pub fn to_py_with<A: PyErrArguments + Send + Sync + 'static>(e: &CoreError, args: A) -> PyErr {
    #[allow(unreachable_patterns)] // a variant added to the core later is still a PdBridgeError
    match e {
        CoreError::Config { .. } => ConfigError::new_err(args),
        CoreError::Weights { .. } | CoreError::WeightFile { .. } => WeightsError::new_err(args),
        CoreError::Input { .. } | CoreError::Segment { .. } => InputError::new_err(args),
        CoreError::Wire(_) => WireError::new_err(args),
        CoreError::Auth(_) => AuthError::new_err(args),
        CoreError::Io { .. } => PyOSError::new_err(args),
        CoreError::Device { .. } => DeviceError::new_err(args),
        _ => PdBridgeError::new_err(args),
    }
}

/// `e` as the Python exception of its kind, its message the error's text.
pub fn to_py(e: CoreError) -> PyErr {
    let msg = e.to_string();
    to_py_with(&e, msg)
}

/// Add the classes to `m` under their names, owned by `m` (`__module__`).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let module = m.name()?;
    for (name, ty) in [
        ("PdBridgeError", py.get_type::<PdBridgeError>()),
        ("ConfigError", py.get_type::<ConfigError>()),
        ("WeightsError", py.get_type::<WeightsError>()),
        ("InputError", py.get_type::<InputError>()),
        ("WireError", py.get_type::<WireError>()),
        ("AuthError", py.get_type::<AuthError>()),
        ("DeviceError", py.get_type::<DeviceError>()),
        ("InternalError", py.get_type::<InternalError>()),
    ] {
        ty.setattr("__module__", &module)?;
        m.add(name, ty)?;
    }
    Ok(())
}
