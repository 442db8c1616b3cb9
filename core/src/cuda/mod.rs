//! The GPU path (feature `cuda`): the decoder's cache math as cuBLAS GEMMs and NVRTC kernels,
//! through cudarc with dynamic loading (the crate builds and loads where there is no CUDA; the
//! libraries are looked up only when a GPU pooler is created).
//!
//! * [`GpuModel`]: the decoder's projection weights, uploaded once per device and kept
//!   resident (one bf16 `[N, hidden]` matrix per layer holding every projection of the layer,
//!   so a chunk of a layer is one GEMM), plus the compiled kernels.
//! * [`GpuCache`]: one request's per-layer state on the device (rotating window, compressor
//!   remainders and pools, MLA rows). Work runs on the cache's own side stream; a feed can be
//!   ordered after another stream (torch's current stream) with a CUDA event, and nothing in a
//!   feed waits for the device. Input memory is borrowed, never freed here.
//!
//! Numerics: every kernel after the projections mirrors [`crate::numerics`] operation by
//! operation (compiled with `--fmad=false`, IEEE division and square root, no flush to zero), so
//! given identical projection outputs the state is bit-identical to the CPU reference.
//! [`GemmMode::Exact`] computes the projections as the CPU does (a sequential f32 sum per output,
//! on CUDA cores) and is bit-exact end to end; [`GemmMode::TensorCore`] uses cuBLAS bf16 tensor-core
//! GEMMs with f32 accumulation, which sum in a different order and so differ from the sequential
//! sum in the last bf16 bit of some outputs (the GPU tests state by how much).

mod dev;
mod model;
mod pooler;
pub(crate) mod capture;
pub(crate) mod prepare;
pub mod synthetic;

pub use capture::{capture_times, CaptureTimes};
pub use dev::{compile_kernels, cuda_available, probe, CudaStack, GpuDevice, TARGET_ARCHS};
pub use model::GpuModel;
pub use pooler::{GpuCache, WindowRows};

/// How the projections are computed: a plain setting, see [`crate::options`].
pub use crate::options::GemmMode;

/// A borrowed device tensor as a framework describes it: defined with the backend seam, so
/// that a build without CUDA names it too.
pub use crate::backend::DeviceTensor;

/// Device memory holding a copy of host rows (benchmarks and tests that need a device pointer).
pub struct DeviceBuffer {
    _dev: std::sync::Arc<GpuDevice>,
    buf: dev::DevBuf,
    _stream: dev::Stream,
}

impl DeviceBuffer {
    pub fn upload(data: &[half::bf16], ordinal: usize) -> crate::Result<Self> {
        let d = GpuDevice::get(ordinal)?;
        d.bind()?;
        let stream = dev::Stream::new()?;
        let buf = dev::DevBuf::upload(data, stream.0)?;
        Ok(DeviceBuffer {
            _dev: d,
            buf,
            _stream: stream,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.buf.ptr
    }
}

/// Measured cuBLAS bf16 GEMM rate (FLOP/s) for `[m, k] · [k, n]` on device `ordinal`, the mean
/// of `reps` products after warm-up, timed with CUDA events: the roofline the benchmark quotes.
pub fn gemm_flops(ordinal: usize, m: usize, n: usize, k: usize, reps: usize) -> crate::Result<f64> {
    use cudarc::cublas::sys as cb;
    use cudarc::driver::sys;
    use dev::{ck, err};
    let d = GpuDevice::get(ordinal)?;
    d.bind()?;
    let stream = dev::Stream::new()?;
    let s = stream.0;
    let mut rng = synthetic::Rng::new(3);
    let a = dev::DevBuf::upload(&rng.rows(m, k), s)?;
    let b = dev::DevBuf::upload(&rng.rows(n, k), s)?;
    let c = dev::DevBuf::alloc(m * n * 2, s)?;
    let mut h = std::ptr::null_mut();
    unsafe {
        if cb::cublasCreate_v2(&mut h) != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(err("cublasCreate", "failed"));
        }
        cb::cublasSetStream_v2(h, s as cb::cudaStream_t);
    }
    let run = || unsafe {
        let (alpha, beta) = (1.0f32, 0.0f32);
        cb::cublasGemmEx(
            h,
            cb::cublasOperation_t::CUBLAS_OP_T,
            cb::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            &alpha as *const f32 as *const std::ffi::c_void,
            b.ptr as *const std::ffi::c_void,
            cb::cudaDataType::CUDA_R_16BF,
            k as i32,
            a.ptr as *const std::ffi::c_void,
            cb::cudaDataType::CUDA_R_16BF,
            k as i32,
            &beta as *const f32 as *const std::ffi::c_void,
            c.ptr as *mut std::ffi::c_void,
            cb::cudaDataType::CUDA_R_16BF,
            n as i32,
            cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    for _ in 0..3 {
        run();
    }
    stream.sync()?;
    let t = std::time::Instant::now();
    for _ in 0..reps {
        run();
    }
    stream.sync()?;
    let secs = t.elapsed().as_secs_f64();
    unsafe { cb::cublasDestroy_v2(h) };
    let _ = ck;
    let _: Option<sys::CUevent> = None;
    Ok(2.0 * (m * n * k) as f64 * reps as f64 / secs)
}
