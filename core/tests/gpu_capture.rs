//! The capture engine fed CUDA tensors (the GPU path) against the same capture fed host rows
//! (the CPU path): the sealed segments must be equal. Needs a CUDA device: without the `cuda`
//! feature these tests are ignored with that reason; with it but no device they print
//! `SKIPPED: …` and return.
//!
//! The projections run with the bit-exact GEMM here (`PD_BRIDGE_GPU_GEMM=exact`, read into the captures' options), so equality
//! is exact; the tensor-core GEMM's deviation is measured in tests/gpu.rs.

#![allow(dead_code, unused_imports)]

mod common;

use std::sync::Arc;

use half::bf16;
use pd_bridge_core::capture::{Capture, Input};
use pd_bridge_core::segment::Segment;
use pd_bridge_core::{CaptureOptions, DecoderWeights, OmlxFormat};
/// The GPU path's settings from the `PD_BRIDGE_GPU*` environment variables, read here at the
/// boundary (the core reads no environment), when a capture or cache is created.
fn env_options() -> CaptureOptions {
    CaptureOptions::from_vars(|k| std::env::var(k).ok())
}


#[cfg(feature = "cuda")]
use pd_bridge_core::cuda::{self, synthetic, DeviceBuffer, DeviceTensor};

fn chunks_of(tokens: usize, sizes: &[usize]) -> Vec<(usize, usize)> {
    let mut out = vec![];
    let mut t = 0;
    let mut i = 0;
    while t < tokens {
        let c = sizes[i % sizes.len()].min(tokens - t);
        out.push((t, c));
        t += c;
        i += 1;
    }
    out
}

/// Feed every chunk to every layer (chunk-major, as a prefill engine runs), collecting segments.
fn run_host(format: OmlxFormat, w: &Arc<DecoderWeights>, block: usize, x: &[Vec<bf16>], chunks: &[(usize, usize)]) -> (Vec<Segment>, String) {
    let hidden = w.plan.hidden_size();
    let tokens = x[0].len() / hidden;
    let mut c = Capture::with_format(format, w.clone(), "r", tokens, block).unwrap();
    let mut segs = vec![];
    for &(t, n) in chunks {
        for (l, xl) in x.iter().enumerate() {
            c.feed_input(l, t, Input::Host(&xl[t * hidden..(t + n) * hidden])).unwrap();
        }
        segs.extend(c.take_ready());
    }
    let seal = serde_json::to_string(&c.seal(None)).unwrap();
    segs.extend(c.take_ready());
    (segs, seal)
}

/// Feed `c` the device rows `x` in `chunks` (token offsets from `from`), collecting segments.
#[cfg(feature = "cuda")]
fn run_device(mut c: Capture, hidden: usize, x: &[DeviceBuffer], from: usize, chunks: &[(usize, usize)]) -> (Vec<Segment>, String) {
    let mut segs = vec![];
    for &(t, n) in chunks {
        let t = from + t;
        for (l, xl) in x.iter().enumerate() {
            let d = DeviceTensor { ptr: xl.ptr() + (t * hidden * 2) as u64, nbytes: n * hidden * 2, device: 0, stream: 0 };
            c.feed_input(l, t, Input::Cuda(d)).unwrap();
        }
        segs.extend(c.take_ready());
    }
    assert!(c.side_stream().is_some(), "the GPU backend was not used");
    let seal = serde_json::to_string(&c.seal(None)).unwrap();
    segs.extend(c.take_ready());
    (segs, seal)
}

#[cfg(feature = "cuda")]
fn check(name: &str, w: Arc<DecoderWeights>, tokens: usize, block: usize, sizes: &[&[usize]]) {
    check_format(OmlxFormat::Fork070, name, w, tokens, block, sizes)
}

/// Upstream oMLX's format on the GPU (carried overlap, bf16 pooling sums, 128-row windows, the
/// previous ratio-4 window in every segment), switched on as a capture would be.
#[cfg(feature = "cuda")]
fn check_upstream(name: &str, w: Arc<DecoderWeights>, tokens: usize, block: usize, sizes: &[&[usize]]) {
    std::env::set_var("PD_BRIDGE_GPU_UPSTREAM", "1");
    check_format(OmlxFormat::Upstream063, name, w, tokens, block, sizes)
}

#[cfg(feature = "cuda")]
fn check_format(format: OmlxFormat, name: &str, w: Arc<DecoderWeights>, tokens: usize, block: usize, sizes: &[&[usize]]) {
    let name = &format!("{name} ({format})");
    std::env::set_var("PD_BRIDGE_GPU_GEMM", "exact");
    let hidden = w.plan.hidden_size();
    let mut rng = common::Rng::new(41);
    let x: Vec<Vec<bf16>> = (0..w.plan.num_layers()).map(|_| common::random_rows(&mut rng, tokens, hidden)).collect();
    let dx: Vec<DeviceBuffer> = x.iter().map(|v| DeviceBuffer::upload(v, 0).unwrap()).collect();
    let t0 = std::time::Instant::now();
    let (cpu, cpu_seal) = run_host(format, &w, block, &x, &chunks_of(tokens, &[tokens]));
    eprintln!("{name}: CPU capture {} segments in {:.1}s", cpu.len(), t0.elapsed().as_secs_f64());
    assert_eq!(cpu.len(), tokens / block);
    for s in sizes {
        let c = Capture::with_format(format, w.clone(), "r", tokens, block).unwrap().with_options(env_options());
        let (gpu, gpu_seal) = run_device(c, hidden, &dx, 0, &chunks_of(tokens, s));
        assert_same(&format!("{name} chunks {s:?}"), cpu.iter(), &cpu_seal, &gpu, &gpu_seal);
        eprintln!("{name}: GPU capture, chunks {s:?}: {} segments equal to the CPU path's", gpu.len());
    }
}

/// The GPU capture's segments and seal are the expected ones, header and bytes.
#[cfg(feature = "cuda")]
fn assert_same<'a>(what: &str, want: impl ExactSizeIterator<Item = &'a Segment>, want_seal: &str, got: &[Segment], got_seal: &str) {
    assert_eq!(got_seal, want_seal, "{what}: seal");
    assert_eq!(got.len(), want.len(), "{what}: segment count");
    for (a, b) in want.zip(got) {
        assert_eq!(a.header, b.header, "{what}: segment {} header", a.header.index);
        assert!(a.arrays == b.arrays, "{what}: segment {} arrays differ", a.header.index);
    }
}

#[cfg(feature = "cuda")]
fn device() -> bool {
    if !cuda::cuda_available() {
        eprintln!("SKIPPED: no CUDA driver or device on this host");
        return false;
    }
    true
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a CUDA GPU")]
fn tiny_capture_gpu_equals_cpu() {
    #[cfg(feature = "cuda")]
    {
        if !device() {
            return;
        }
        let v4 = Arc::new(DecoderWeights::load(common::v4_model_dir(3)).unwrap());
        check("tiny v4", v4.clone(), 1100, 256, &[&[1100], &[100, 37, 300], &[256]]);
        check_upstream("tiny v4", v4, 1100, 256, &[&[1100], &[100, 37, 300], &[256]]);
        let mla = Arc::new(DecoderWeights::load(common::mla_model_dir(4)).unwrap());
        check("tiny mla", mla, 300, 16, &[&[300], &[7, 50, 13]]);
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a CUDA GPU")]
fn flash_sized_capture_gpu_equals_cpu() {
    #[cfg(feature = "cuda")]
    {
        if !device() {
            return;
        }
        let w = synthetic::v4_weights(synthetic::flash_plan(), 5);
        check("flash", w.clone(), 1100, 512, &[&[1100], &[300, 500]]);
        check_upstream("flash", w, 2100, 512, &[&[2100], &[300, 500, 1]]);
    }
}

/// A capture resumed at block boundary `s` on the GPU (multi-turn): fed from `lead` tokens before
/// `s` (rows vLLM recomputed), it must emit the one-shot CPU capture's segments from `s` on and
/// seal the same, with the carry state taken from a CPU cache fed up to `s`.
#[cfg(feature = "cuda")]
fn check_resumed(name: &str, format: OmlxFormat, w: Arc<DecoderWeights>, tokens: usize, block: usize, s: usize, lead: usize, sizes: &[&[usize]]) {
    use pd_bridge_core::pooler::carry::CarryState;
    use pd_bridge_core::{CacheBuilder, DecoderSteps};
    let name = &format!("{name} ({format}) resumed at {s}");
    std::env::set_var("PD_BRIDGE_GPU_GEMM", "exact");
    let hidden = w.plan.hidden_size();
    let mut rng = common::Rng::new(43);
    let x: Vec<Vec<bf16>> = (0..w.plan.num_layers()).map(|_| common::random_rows(&mut rng, tokens, hidden)).collect();
    let dx: Vec<DeviceBuffer> = x.iter().map(|v| DeviceBuffer::upload(v, 0).unwrap()).collect();
    let (cpu, cpu_seal) = run_host(format, &w, block, &x, &chunks_of(tokens, &[tokens]));
    let mut held = CacheBuilder::new(w.clone(), DecoderSteps::for_format(format, block).unwrap());
    for (l, xl) in x.iter().enumerate() {
        held.feed(l, 0, &xl[..s * hidden]).unwrap();
    }
    let carry = CarryState::from_layers(format, &w.fingerprint, block, None, held.layers()).unwrap();
    let tail: Vec<&Segment> = cpu.iter().filter(|g| g.header.index as usize >= s / block).collect();
    assert_eq!(tail.len(), tokens / block - s / block);
    for sz in sizes {
        let c = Capture::resume(format, w.clone(), "r", tokens, block, &carry).unwrap().with_options(env_options());
        let from = s - lead;
        let (segs, seal) = run_device(c, hidden, &dx, from, &chunks_of(tokens - from, sz));
        assert_same(&format!("{name} chunks {sz:?}"), tail.iter().copied(), &cpu_seal, &segs, &seal);
        eprintln!("{name}, fed from {from} in chunks {sz:?}: {} segments equal to the one-shot CPU capture's", segs.len());
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a CUDA GPU")]
fn resumed_capture_gpu_equals_one_shot_cpu() {
    #[cfg(feature = "cuda")]
    {
        if !device() {
            return;
        }
        std::env::set_var("PD_BRIDGE_GPU_UPSTREAM", "1");
        let v4 = Arc::new(DecoderWeights::load(common::v4_model_dir(3)).unwrap());
        check_resumed("tiny v4", OmlxFormat::Upstream063, v4.clone(), 1100, 256, 512, 100, &[&[1100], &[100, 37, 300], &[256]]);
        check_resumed("tiny v4", OmlxFormat::Upstream063, v4, 1100, 256, 256, 0, &[&[300, 1]]);
        let mla = Arc::new(DecoderWeights::load(common::mla_model_dir(4)).unwrap());
        check_resumed("tiny mla", OmlxFormat::Upstream063, mla.clone(), 300, 16, 128, 30, &[&[300], &[7, 50, 13]]);
        check_resumed("tiny mla", OmlxFormat::Fork070, mla, 300, 16, 64, 0, &[&[16]]);
        let flash = synthetic::v4_weights(synthetic::flash_plan(), 5);
        check_resumed("flash", OmlxFormat::Upstream063, flash, 2100, 512, 1024, 200, &[&[300, 500, 1]]);
    }
}
