//! pd-bridge-bindings: the Python boundary both wheels share, so the prefill side
//! (`pd_bridge_vllm._native`) and the decode side (`pd_bridge_omlx._native`) raise the same
//! exceptions for the same core errors, never let a Rust panic reach the engine, and send the
//! core's `tracing` events to Python's `logging`.
//!
//! - [`errors`]: the exception classes and [`errors::to_py`] (`CoreError` -> exception);
//! - [`guard()`]: every `#[pyfunction]`/`#[pymethods]` body runs inside it; a panic becomes
//!   [`errors::InternalError`] (an `Exception`, not pyo3's `PanicException`, which derives from
//!   `BaseException` and would end vLLM's or oMLX's engine threads);
//! - [`buffer`]: zero-copy bf16 views of Python buffers (bytes, memoryview, numpy), on the
//!   3.10 stable ABI too;
//! - [`logging`]: a `tracing` layer forwarding events to loggers `pd_bridge.core...` with the
//!   request id.
//!
//! Each wheel calls [`init_module`] from its `#[pymodule_init]`.

pub mod buffer;
pub mod errors;
pub mod logging;

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;

pub use errors::{to_py, AuthError, ConfigError, DeviceError, InputError, InternalError, PdBridgeError, WeightsError, WireError};

/// The capture engine's GPU settings from the `PD_BRIDGE_GPU*` environment variables
/// ([`pd_bridge_core::CaptureOptions::VARS`]): the one place they are read, at the boundary, when
/// a capture is created (so a variable set before that, `monkeypatch.setenv` included, applies).
pub fn capture_options_from_env() -> pd_bridge_core::CaptureOptions {
    pd_bridge_core::CaptureOptions::from_vars(|k| std::env::var(k).ok())
}

/// Register the exception classes on the wheel's module `m` (their `__module__` set to its
/// name, so tracebacks say `pd_bridge_omlx._native.WireError`) and start forwarding `tracing`
/// events to Python's `logging`.
pub fn init_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    logging::install(m.py())
}

/// Run one binding entry point: a panic inside `f` (or in the core under it) comes back as
/// `InternalError` naming the panic, and is logged to `pd_bridge.bindings`. Also picks up the
/// Python logging level, so a level set since the last call applies to the next event.
pub fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    logging::refresh_level();
    // AssertUnwindSafe: after a panic nothing the closure touched is used again by this call,
    // and the core's shared state (writers, outboxes) recovers poisoned locks explicitly.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => Err(panic_to_py(payload)),
    }
}

/// The text a panic carried (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

fn panic_to_py(payload: Box<dyn Any + Send>) -> PyErr {
    let msg = panic_message(payload.as_ref());
    tracing::error!(panic = %msg, "a Rust panic was caught at the Python boundary");
    InternalError::new_err(format!("internal error in pd-bridge (a bug, please report it): {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pd_bridge_core::CoreError;

    fn with_py<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
        let _serial = logging::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        Python::initialize();
        Python::attach(f)
    }

    #[test]
    fn a_panic_becomes_internal_error_not_panic_exception() {
        with_py(|py| {
            let err = guard(|| -> PyResult<()> { panic!("index {} out of range", 7) }).unwrap_err();
            assert!(err.is_instance_of::<InternalError>(py), "{err}");
            assert!(err.is_instance_of::<PdBridgeError>(py));
            assert!(err.is_instance_of::<pyo3::exceptions::PyException>(py), "catchable by `except Exception`");
            assert!(!err.is_instance_of::<pyo3::panic::PanicException>(py));
            assert!(err.to_string().contains("index 7 out of range"), "{err}");
            // A static message too, and the Ok/Err of a normal return pass through untouched.
            let err = guard(|| -> PyResult<()> { panic!("static text") }).unwrap_err();
            assert!(err.to_string().contains("static text"));
            assert_eq!(guard(|| Ok(5)).unwrap(), 5);
            let e = guard(|| -> PyResult<()> { Err(to_py(CoreError::Wire("bad frame".into()))) }).unwrap_err();
            assert!(e.is_instance_of::<WireError>(py) && e.to_string().contains("bad frame"));
        });
    }

    #[test]
    fn a_panic_with_the_interpreter_released_is_caught_and_the_interpreter_stays_usable() {
        // The core's work runs under `py.detach`; the panic unwinds through it.
        with_py(|py| {
            let err = guard(|| -> PyResult<()> { py.detach(|| panic!("in the core, detached")) }).unwrap_err();
            assert!(err.is_instance_of::<InternalError>(py), "{err}");
            let v: i64 = py.eval(c"40 + 2", None, None).unwrap().extract().unwrap();
            assert_eq!(v, 42);
        });
    }

    #[test]
    fn a_panic_re_raised_through_python_is_caught_as_well() {
        // pyo3 turns a PanicException fetched back from Python into a Rust panic again.
        with_py(|py| {
            let err = guard(|| -> PyResult<()> {
                let e = pyo3::panic::PanicException::new_err("from a callback");
                e.restore(py);
                Err(PyErr::fetch(py))
            })
            .unwrap_err();
            assert!(err.is_instance_of::<InternalError>(py), "{err}");
        });
    }

    #[test]
    fn every_core_error_maps_to_its_class() {
        with_py(|py| {
            let cases: Vec<(CoreError, &str)> = vec![
                (CoreError::Config { field: "f".into(), reason: "r".into() }, "ConfigError"),
                (CoreError::Weights { tensor: "t".into(), reason: "r".into() }, "WeightsError"),
                (CoreError::WeightFile { path: "p".into(), reason: "r".into() }, "WeightsError"),
                (CoreError::Input { layer: 3, reason: "r".into() }, "InputError"),
                (CoreError::Segment { block: 2, layer: Some(1), array: None, reason: "r".into() }, "InputError"),
                (CoreError::Wire("w".into()), "WireError"),
                (CoreError::Auth("a".into()), "AuthError"),
                (CoreError::Io { path: "p".into(), source: std::io::Error::other("x") }, "OSError"),
                (CoreError::Device { what: pd_bridge_core::DeviceFailure::OutOfMemory, reason: "r".into() }, "DeviceError"),
                (CoreError::Device { what: pd_bridge_core::DeviceFailure::NotBuilt, reason: "r".into() }, "DeviceError"),
            ];
            for (e, class) in cases {
                let text = e.to_string();
                let err = to_py(e);
                assert_eq!(err.get_type(py).name().unwrap().to_string(), class, "{text}");
                assert_eq!(err.value(py).to_string(), text);
                if class != "OSError" {
                    assert!(err.is_instance_of::<PdBridgeError>(py), "{class} derives from PdBridgeError");
                }
            }
        });
    }
}
