//! The device: context, compiled kernels, stream-ordered buffers, events.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use crate::error::{CoreError, DeviceFailure, Result};

/// A failed CUDA call as a [`CoreError::Device`]: `what` the call, `e` its answer. The kind is
/// read from the answer (out of memory, no device, a cuBLAS status), else a driver failure.
pub(crate) fn err(what: &str, e: impl std::fmt::Debug) -> CoreError {
    let answer = format!("{e:?}");
    let kind = if answer.contains("OUT_OF_MEMORY") || answer.contains("ALLOC_FAILED") {
        DeviceFailure::OutOfMemory
    } else if answer.contains("NO_DEVICE") || answer.contains("INVALID_DEVICE") {
        DeviceFailure::NoDevice
    } else if answer.starts_with("CUBLAS_") || what.starts_with("cublas") || what.contains("cuBLAS") {
        DeviceFailure::Cublas
    } else {
        DeviceFailure::Driver
    };
    CoreError::device(kind, format!("{what}: {answer}"))
}

pub(crate) fn ck(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(err(what, r))
    }
}

const SRC: &str = include_str!("kernels.cu");
const KERNELS: [&str; 7] = ["gemm_exact", "gemm_exact_quant", "norm_rope", "pool_overlap", "pool_simple", "gather_rows", "copy_rows"];

/// Whether a CUDA driver with at least one device can be loaded here.
pub fn cuda_available() -> bool {
    std::panic::catch_unwind(|| CudaContext::device_count().map(|n| n > 0).unwrap_or(false))
        .unwrap_or(false)
}

/// The architectures the kernels must compile for on the GPUs users prefill with: Hopper
/// (H100/H200), datacenter Blackwell (B200), consumer Blackwell (RTX 50) and the DGX Spark's GB10.
pub const TARGET_ARCHS: [&str; 4] = ["compute_90", "compute_100", "compute_120", "compute_121"];

/// How to make NVRTC loadable, for every message that says it is not.
const NVRTC_FIX: &str = "install CUDA 13's NVRTC (the toolkit, or `pip install nvidia-cuda-nvrtc` for CUDA 13) and put the directory holding libnvrtc.so.13 and libnvrtc-builtins.so.13.* on LD_LIBRARY_PATH";

/// The kernels compiled by NVRTC for `arch` (`compute_90`, ...) with the exact-arithmetic
/// options the CPU reference needs: PTX text. At run time, so one wheel serves every GPU.
pub fn compile_kernels(arch: &str) -> Result<String> {
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        arch: Some(arch_static),
        options: vec!["-default-device".into()],
        ..Default::default()
    };
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(SRC, opts))
        .map_err(|_| CoreError::device(DeviceFailure::Library, format!("the NVRTC library (libnvrtc.so.13) could not be loaded: {NVRTC_FIX}")))?
        .map_err(|e| nvrtc_error(arch, e))?;
    Ok(ptx.to_src())
}

fn nvrtc_error(arch: &str, e: cudarc::nvrtc::CompileError) -> CoreError {
    let text = format!("{e:?}");
    // NVRTC loads its builtins library itself, by name, at the first compile: missing, it
    // fails every compile with this code and no hint of the file.
    if text.contains("BUILTIN_OPERATION_FAILURE") || text.contains("nvrtc-builtins") {
        return CoreError::device(DeviceFailure::Library, format!("NVRTC cannot load its builtins library (libnvrtc-builtins.so.13.*) while compiling the kernels for {arch}: {NVRTC_FIX}"));
    }
    if text.contains("INVALID_OPTION") {
        return CoreError::device(DeviceFailure::Nvrtc, format!("this NVRTC cannot compile for {arch} (too old for this GPU; CUDA 13 supports {}): {text}", TARGET_ARCHS.join(", ")));
    }
    CoreError::device(DeviceFailure::Nvrtc, format!("compiling the kernels for {arch}: {text}"))
}

/// This host's CUDA stack, as the prefill host's doctor reports it. Every field that could not
/// be read says why in `problems`.
#[derive(Debug, Default)]
pub struct CudaStack {
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: Option<i32>,
    /// NVRTC's (major, minor).
    pub nvrtc_version: Option<(i32, i32)>,
    /// The virtual architectures this NVRTC can compile for (`sm_90` → 90).
    pub nvrtc_archs: Vec<i32>,
    /// Each device: name and compute capability.
    pub devices: Vec<(String, (i32, i32))>,
    pub problems: Vec<String>,
}

/// Read the driver, NVRTC and the devices without opening a context's kernels.
pub fn probe() -> CudaStack {
    let mut out = CudaStack::default();
    match std::panic::catch_unwind(|| {
        let mut v = 0;
        let r = unsafe { sys::cuDriverGetVersion(&mut v) };
        (r, v)
    }) {
        Ok((sys::CUresult::CUDA_SUCCESS, v)) => out.driver_version = Some(v),
        Ok((r, _)) => out.problems.push(format!("the CUDA driver answered {r:?}")),
        Err(_) => out.problems.push("the CUDA driver library (libcuda.so.1) could not be loaded: install the NVIDIA driver (580 or newer for CUDA 13)".into()),
    }
    match std::panic::catch_unwind(|| {
        use cudarc::nvrtc::sys as nv;
        let (mut maj, mut min, mut n) = (0, 0, 0);
        let ok = unsafe { nv::nvrtcVersion(&mut maj, &mut min) } == nv::nvrtcResult::NVRTC_SUCCESS;
        let mut archs = vec![];
        if unsafe { nv::nvrtcGetNumSupportedArchs(&mut n) } == nv::nvrtcResult::NVRTC_SUCCESS && n > 0 {
            archs = vec![0; n as usize];
            if unsafe { nv::nvrtcGetSupportedArchs(archs.as_mut_ptr()) } != nv::nvrtcResult::NVRTC_SUCCESS {
                archs.clear();
            }
        }
        (ok.then_some((maj, min)), archs)
    }) {
        Ok((v, archs)) => (out.nvrtc_version, out.nvrtc_archs) = (v, archs),
        Err(_) => out.problems.push(format!("the NVRTC library (libnvrtc.so.13) could not be loaded: {NVRTC_FIX}")),
    }
    if out.driver_version.is_some() {
        match std::panic::catch_unwind(|| -> std::result::Result<Vec<(String, (i32, i32))>, String> {
            let n = CudaContext::device_count().map_err(|e| format!("{e:?}"))?;
            (0..n as usize)
                .map(|i| {
                    let ctx = CudaContext::new(i).map_err(|e| format!("device {i}: {e:?}"))?;
                    let cc = ctx.compute_capability().map_err(|e| format!("device {i}: {e:?}"))?;
                    Ok((ctx.name().unwrap_or_default(), cc))
                })
                .collect()
        }) {
            Ok(Ok(d)) => out.devices = d,
            Ok(Err(e)) => out.problems.push(format!("listing the devices: {e}")),
            Err(_) => out.problems.push("listing the devices panicked in the driver bindings".into()),
        }
    }
    out
}

/// One GPU: its primary context (the one torch uses), the compiled kernels.
pub struct GpuDevice {
    pub(crate) ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    funcs: HashMap<&'static str, sys::CUfunction>,
    pub ordinal: usize,
    pub name: String,
    /// Page-locked host buffers not leased out (see [`PinnedLease`]).
    pinned: Mutex<Vec<Pinned>>,
    /// Device staging bodies not leased out (see [`StagingLease`]).
    staging: Mutex<Vec<DevMem>>,
    /// Side streams not lent out (see [`SideStream`]); never destroyed.
    side_streams: Mutex<Vec<Stream>>,
}

// SAFETY: CUmodule/CUfunction handles are process-wide and usable from any thread once the
// context is current; every entry point binds the context first.
unsafe impl Send for GpuDevice {}
unsafe impl Sync for GpuDevice {}

impl GpuDevice {
    /// The device `ordinal`, shared by every user in the process (kernels compile once).
    pub fn get(ordinal: usize) -> Result<Arc<GpuDevice>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<GpuDevice>>>> = OnceLock::new();
        let mut map = DEVICES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(Self::open(ordinal)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<Self> {
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| CoreError::device(DeviceFailure::Library, "the CUDA driver library could not be loaded"))?
            .map_err(|e| err("opening the device", e))?;
        let name = ctx.name().unwrap_or_default();
        let (maj, min) = ctx
            .compute_capability()
            .map_err(|e| err("compute capability", e))?;
        let ptx = compile_kernels(&format!("compute_{maj}{min}"))?;
        ctx.bind_to_thread()
            .map_err(|e| err("binding the context", e))?;
        let src = CString::new(ptx).map_err(|_| CoreError::device(DeviceFailure::Nvrtc, "NVRTC returned PTX with a NUL byte"))?;
        let mut module = std::ptr::null_mut();
        ck("loading the kernels", unsafe {
            sys::cuModuleLoadData(&mut module, src.as_ptr() as *const c_void)
        })?;
        let mut funcs = HashMap::new();
        for k in KERNELS {
            let name_c = CString::new(k).unwrap();
            let mut f = std::ptr::null_mut();
            ck(k, unsafe { sys::cuModuleGetFunction(&mut f, module, name_c.as_ptr()) })?;
            funcs.insert(k, f);
        }
        Ok(GpuDevice {
            ctx,
            module,
            funcs,
            ordinal,
            name,
            pinned: Mutex::new(Vec::new()),
            staging: Mutex::new(Vec::new()),
            side_streams: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| err("binding the context", e))
    }

    /// Launch `kernel` on `stream`. `args`: pointers to each argument value.
    pub(crate) fn launch(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: u32,
        stream: sys::CUstream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch2(kernel, grid, (block, 1), stream, args)
    }

    /// [`Self::launch`] with a two-dimensional block.
    pub(crate) fn launch2(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: (u32, u32),
        stream: sys::CUstream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let f = *self
            .funcs
            .get(kernel)
            .ok_or_else(|| CoreError::device(DeviceFailure::Nvrtc, format!("kernel {kernel} missing")))?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        ck(kernel, unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for GpuDevice {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// A device allocation we own (stream-ordered: allocated and freed on `stream`).
pub(crate) struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    stream: sys::CUstream,
}

unsafe impl Send for DevBuf {}
unsafe impl Sync for DevBuf {}

impl DevBuf {
    pub fn empty(stream: sys::CUstream) -> Self {
        DevBuf {
            ptr: 0,
            bytes: 0,
            stream,
        }
    }

    pub fn alloc(bytes: usize, stream: sys::CUstream) -> Result<Self> {
        let mut b = DevBuf::empty(stream);
        b.reserve(bytes)?;
        Ok(b)
    }

    /// Make room for `bytes` (contents are not kept).
    pub fn reserve(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.bytes {
            return Ok(());
        }
        self.release();
        let bytes = bytes.next_power_of_two().max(256);
        let mut p = 0;
        ck("allocating device memory", unsafe {
            sys::cuMemAllocAsync(&mut p, bytes, self.stream)
        })?;
        self.ptr = p;
        self.bytes = bytes;
        Ok(())
    }

    /// Grow to `bytes`, keeping the first `keep` bytes (stream-ordered copy).
    pub fn grow_keep(&mut self, bytes: usize, keep: usize) -> Result<()> {
        if bytes <= self.bytes {
            return Ok(());
        }
        let mut nb = DevBuf::alloc(bytes, self.stream)?;
        if keep > 0 {
            ck("copying device memory", unsafe {
                sys::cuMemcpyDtoDAsync_v2(nb.ptr, self.ptr, keep, self.stream)
            })?;
        }
        std::mem::swap(self, &mut nb);
        Ok(())
    }

    fn release(&mut self) {
        if self.ptr != 0 {
            unsafe { sys::cuMemFreeAsync(self.ptr, self.stream) };
            self.ptr = 0;
            self.bytes = 0;
        }
    }

    pub fn upload<T: Copy>(data: &[T], stream: sys::CUstream) -> Result<Self> {
        let bytes = std::mem::size_of_val(data);
        let b = DevBuf::alloc(bytes.max(1), stream)?;
        if bytes > 0 {
            ck("uploading", unsafe {
                sys::cuMemcpyHtoDAsync_v2(b.ptr, data.as_ptr() as *const c_void, bytes, stream)
            })?;
            // The host slice may be dropped as soon as we return.
            ck("uploading", unsafe { sys::cuStreamSynchronize(stream) })?;
        }
        Ok(b)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        self.release();
    }
}

/// An owned non-blocking stream.
pub(crate) struct Stream(pub sys::CUstream);

unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new() -> Result<Self> {
        let mut s = std::ptr::null_mut();
        ck("creating a stream", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(s))
    }
    /// A non-blocking stream at the device's highest priority: its kernels are scheduled ahead
    /// of queued GEMM blocks, so they fill the gaps instead of waiting behind them.
    pub fn high_priority() -> Result<Self> {
        let (mut least, mut greatest) = (0i32, 0i32);
        ck("stream priorities", unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) })?;
        let mut s = std::ptr::null_mut();
        ck("creating a stream", unsafe {
            sys::cuStreamCreateWithPriority(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32, greatest)
        })?;
        Ok(Stream(s))
    }

    pub fn sync(&self) -> Result<()> {
        ck("synchronising the side stream", unsafe {
            sys::cuStreamSynchronize(self.0)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        unsafe {
            sys::cuStreamSynchronize(self.0);
            sys::cuStreamDestroy_v2(self.0);
        }
    }
}

/// A capture's side stream, lent from its device and given back (synchronised, never destroyed)
/// when dropped. Its handle goes to torch (`x.record_stream(ExternalStream(handle))`), and torch
/// records an event on it whenever such a tensor is freed, which may be after the capture is
/// gone: a destroyed stream there aborts the engine ("context is destroyed"), a lent one only
/// orders that free behind later work.
pub(crate) struct SideStream {
    dev: Arc<GpuDevice>,
    stream: Option<Stream>,
}

unsafe impl Send for SideStream {}
unsafe impl Sync for SideStream {}

impl SideStream {
    /// An idle side stream of `dev`, else a new one. The device's context must be bound.
    pub fn lend(dev: &Arc<GpuDevice>) -> Result<Self> {
        let idle = dev.side_streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match idle {
            Some(s) => s,
            None => Stream::new()?,
        };
        Ok(SideStream { dev: dev.clone(), stream: Some(stream) })
    }

    pub fn handle(&self) -> sys::CUstream {
        self.stream.as_ref().map_or(std::ptr::null_mut(), |s| s.0)
    }

    pub fn sync(&self) -> Result<()> {
        match &self.stream {
            Some(s) => s.sync(),
            None => Ok(()),
        }
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            // Queued work finishes before another capture's work can be ordered behind it.
            let _ = s.sync();
            self.dev.side_streams.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        }
    }
}

/// A CUDA event without timing.
pub(crate) struct Event(pub sys::CUevent);

unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new() -> Result<Self> {
        let mut e = std::ptr::null_mut();
        ck("creating an event", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Event(e))
    }
    pub fn record(&self, stream: sys::CUstream) -> Result<()> {
        ck("recording an event", unsafe {
            sys::cuEventRecord(self.0, stream)
        })
    }
    /// Non-blocking: has the work before the record finished?
    pub fn done(&self) -> Result<bool> {
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(err("querying an event", e)),
        }
    }
    pub fn wait(&self) -> Result<()> {
        ck("waiting for an event", unsafe {
            sys::cuEventSynchronize(self.0)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// Page-locked host memory (for asynchronous device-to-host copies).
pub(crate) struct Pinned {
    pub ptr: *mut u8,
    pub bytes: usize,
}

unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    pub fn new(bytes: usize) -> Result<Self> {
        let mut p = std::ptr::null_mut();
        ck("allocating pinned memory", unsafe {
            sys::cuMemHostAlloc(&mut p, bytes.max(1), 0)
        })?;
        Ok(Pinned {
            ptr: p as *mut u8,
            bytes,
        })
    }
}

/// Page-locked and staging buffers allocated because no idle one fitted (the benchmark's profile).
pub(crate) static NEW_BUFFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Idle page-locked memory a device keeps for reuse. Pinning is slow (the pages are allocated and
/// locked) and freeing it synchronises the device, so buffers go back to the pool, not the OS;
/// only what exceeds this is freed.
pub(crate) const PINNED_IDLE_MAX: usize = 4 << 30;

/// A page-locked host buffer leased from a device's pool (a segment body the device copies
/// into); it goes back to the pool when dropped.
pub(crate) struct PinnedLease {
    dev: Arc<GpuDevice>,
    buf: Option<Pinned>,
    /// bf16 values in use.
    values: usize,
}

// SAFETY: the buffer is plain host memory; writes happen only through device copies ordered
// before the completion event that precedes any read.
unsafe impl Send for PinnedLease {}
unsafe impl Sync for PinnedLease {}

impl PinnedLease {
    /// `values` bf16 values: the smallest idle buffer that holds them and is at most twice as
    /// large, else a new one (rounded up to 2 MiB).
    pub fn take(dev: &Arc<GpuDevice>, values: usize) -> Result<Self> {
        let bytes = (values * 2).max(1);
        let buf = match idle_fit(&dev.pinned, bytes, |b| b.bytes) {
            Some(b) => b,
            None => {
                dev.bind()?;
                NEW_BUFFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Pinned::new(bytes.div_ceil(1 << 21) << 21)?
            }
        };
        Ok(PinnedLease { dev: dev.clone(), buf: Some(buf), values })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.buf.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr)
    }
}

impl crate::segment::BodyStore for PinnedLease {
    fn values(&self) -> &[half::bf16] {
        // SAFETY: the buffer holds at least `values` bf16 values; see the Sync note above.
        unsafe { std::slice::from_raw_parts(self.ptr() as *const half::bf16, self.values) }
    }
}

impl Drop for PinnedLease {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            give_back(&self.dev, &self.dev.pinned, buf, PINNED_IDLE_MAX, |b| b.bytes);
        }
    }
}

/// From a device's idle buffers, the smallest that holds `bytes` and is at most twice as large
/// (2 MiB at least): reuse without holding much more than asked.
fn idle_fit<T>(idle: &Mutex<Vec<T>>, bytes: usize, size: impl Fn(&T) -> usize) -> Option<T> {
    let mut idle = idle.lock().unwrap_or_else(|p| p.into_inner());
    let best = idle.iter().enumerate().filter(|(_, b)| size(b) >= bytes && size(b) <= 2 * bytes.max(1 << 21)).min_by_key(|(_, b)| size(b)).map(|(i, _)| i);
    best.map(|i| idle.swap_remove(i))
}

/// Back to the device's idle buffers, or freed (with the context bound; leaked if it cannot be)
/// when that would hold more than `max` bytes idle.
fn give_back<T>(dev: &GpuDevice, idle: &Mutex<Vec<T>>, buf: T, max: usize, size: impl Fn(&T) -> usize) {
    let mut list = idle.lock().unwrap_or_else(|p| p.into_inner());
    let held: usize = list.iter().map(&size).sum();
    if held + size(&buf) <= max {
        list.push(buf);
    } else {
        drop(list);
        if dev.bind().is_ok() {
            drop(buf);
        } else {
            std::mem::forget(buf);
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        unsafe { sys::cuMemFreeHost(self.ptr as *mut c_void) };
    }
}

/// Kernel arguments, each stored in its own 8-byte-aligned cell (scalars, pointers, or a
/// `repr(C)` struct passed by value).
#[derive(Default)]
pub(crate) struct Args(Vec<Box<[u64]>>);

impl Args {
    pub fn new() -> Self {
        Args(Vec::with_capacity(16))
    }
    /// One parameter, by value (any `repr(C)` value; the kernel reads its declared size).
    pub fn p<T: Copy>(mut self, v: T) -> Self {
        let n = std::mem::size_of::<T>();
        let mut b = vec![0u64; n.div_ceil(8).max(1)].into_boxed_slice();
        // SAFETY: T is Copy and the cell holds at least size_of::<T>() bytes, 8-aligned.
        unsafe { std::ptr::copy_nonoverlapping(&v as *const T as *const u8, b.as_mut_ptr() as *mut u8, n) };
        self.0.push(b);
        self
    }
    pub fn ptrs(&mut self) -> Vec<*mut c_void> {
        self.0.iter_mut().map(|b| b.as_mut_ptr() as *mut c_void).collect()
    }
}

/// A plain (not stream-ordered) device allocation: a staging body is written on several streams
/// and read on a copy stream, so it must not belong to one stream's pool.
pub(crate) struct DevMem {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

unsafe impl Send for DevMem {}
unsafe impl Sync for DevMem {}

impl Drop for DevMem {
    fn drop(&mut self) {
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Idle staging memory a device keeps for reuse (allocating and freeing device memory
/// synchronises the device).
pub(crate) const STAGING_IDLE_MAX: usize = 2 << 30;

/// A device buffer leased from a device's pool: a block's segment body gathered on the device,
/// then copied to the host in one piece. Back to the pool when dropped; the holder drops it only
/// after the work that uses it completed.
pub(crate) struct StagingLease {
    dev: Arc<GpuDevice>,
    buf: Option<DevMem>,
}

unsafe impl Send for StagingLease {}
unsafe impl Sync for StagingLease {}

impl StagingLease {
    /// At least `bytes`: the smallest idle buffer that holds them and is at most twice as large,
    /// else a new one (rounded up to 2 MiB). The device's context must be bound.
    pub fn take(dev: &Arc<GpuDevice>, bytes: usize) -> Result<Self> {
        let bytes = bytes.max(1);
        let buf = match idle_fit(&dev.staging, bytes, |b| b.bytes) {
            Some(b) => b,
            None => {
                let bytes = bytes.div_ceil(1 << 21) << 21;
                NEW_BUFFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut p = 0;
                ck("allocating device staging memory", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) })?;
                DevMem { ptr: p, bytes }
            }
        };
        Ok(StagingLease { dev: dev.clone(), buf: Some(buf) })
    }

    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.buf.as_ref().map_or(0, |b| b.ptr)
    }
}

impl Drop for StagingLease {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            give_back(&self.dev, &self.dev.staging, buf, STAGING_IDLE_MAX, |b| b.bytes);
        }
    }
}
