//! Which device backend a capture gets: the CUDA path with feature `cuda`, otherwise the no-CUDA
//! stub, which refuses with [`DeviceFailure::NotBuilt`] ("built without CUDA"). The only file
//! the capture reaches the GPU through, and the only one that names the feature.

use half::bf16;

use crate::backend::{DeviceBackend, DevicePreparation, DeviceRequest, DeviceTensor, Prepared};
#[cfg(not(feature = "cuda"))]
use crate::error::{CoreError, DeviceFailure};
use crate::error::Result;

/// Whether this build has the GPU path (feature `cuda`).
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

/// The device backend for `req`: `Ok(None)` where the GPU path does not handle this capture
/// (see [`crate::cuda`]'s capture), so its CUDA rows are pooled on the CPU.
pub fn open(req: DeviceRequest<'_>) -> Result<Option<Box<dyn DeviceBackend>>> {
    #[cfg(feature = "cuda")]
    return crate::cuda::capture::open(req);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = req;
        Err(not_built())
    }
}

/// Make device `prep.device` ready for captures before the first one (weights resident, kernels
/// loaded, body pools filled): see [`DevicePreparation`]. Blocks the caller (seconds at most).
pub fn prepare(prep: &DevicePreparation) -> Result<Prepared> {
    #[cfg(feature = "cuda")]
    return crate::cuda::prepare::prepare(prep);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = prep;
        Err(not_built())
    }
}

/// Copy a device tensor to the host (after its producer stream's queued work), blocking the
/// caller: how CUDA rows reach the CPU path.
pub fn copy_to_host(t: &DeviceTensor) -> Result<Vec<bf16>> {
    #[cfg(feature = "cuda")]
    return crate::cuda::capture::copy_to_host(t);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = t;
        Err(not_built())
    }
}

#[cfg(not(feature = "cuda"))]
fn not_built() -> CoreError {
    CoreError::device(DeviceFailure::NotBuilt, "a CUDA tensor was passed but pd-bridge-core was built without the `cuda` feature")
}
