//! GPU path (feature `cuda`) against the CPU reference. Needs a CUDA device: without the feature
//! every test here is ignored with that reason; with it but without a device, each test prints
//! `SKIPPED: …` and returns (CI has no GPU; nothing here is faked).
//!
//! Run on a GPU host: `cargo test -p pd-bridge-core --release --features cuda --test gpu -- --nocapture`
//! (tests/gpu/run.sh sets the library path for cudarc's dynamic loading).

#![allow(dead_code, unused_imports)]

mod common;

use std::sync::Arc;

use half::bf16;
use pd_bridge_core::{CacheBuilder, CaptureOptions, DecoderSteps, DecoderWeights, StateArray};

#[cfg(feature = "cuda")]
use pd_bridge_core::cuda::{self, synthetic, GemmMode, GpuCache, GpuModel};

/// The GPU path's settings from the `PD_BRIDGE_GPU*` environment variables, read here at the
/// boundary (the core reads no environment), when a capture or cache is created.
fn env_options() -> CaptureOptions {
    CaptureOptions::from_vars(|k| std::env::var(k).ok())
}

/// Map bf16 bits to a monotonic integer line so that ulp distance is a difference.
fn ordered(b: bf16) -> i32 {
    let u = b.to_bits() as i32;
    if u & 0x8000 != 0 {
        -(u & 0x7fff)
    } else {
        u
    }
}

#[derive(Default, Debug)]
struct Diff {
    values: usize,
    identical: usize,
    worst_ulp: i32,
    /// The pair at the worst ulp distance (CPU, GPU), as f32.
    worst_pair: (f32, f32),
    /// Largest |difference| relative to the array's largest magnitude.
    worst_rel: f32,
}

impl Diff {
    fn add(&mut self, name: &str, a: &StateArray, b: &StateArray) {
        assert_eq!(a.name, b.name);
        assert_eq!(a.shape, b.shape, "{name}: shapes differ");
        let scale = a.data.iter().map(|v| v.to_f32().abs()).fold(0f32, f32::max).max(f32::MIN_POSITIVE);
        for (x, y) in a.data.iter().zip(&b.data) {
            self.values += 1;
            if x.to_bits() == y.to_bits() {
                self.identical += 1;
            } else {
                let u = (ordered(*x) - ordered(*y)).abs();
                if u > self.worst_ulp {
                    self.worst_ulp = u;
                    self.worst_pair = (x.to_f32(), y.to_f32());
                }
                self.worst_rel = self.worst_rel.max((x.to_f32() - y.to_f32()).abs() / scale);
            }
        }
    }
    fn text(&self) -> String {
        format!(
            "{:.6} identical of {} values, worst {} ulp (CPU {:e} vs GPU {:e}), worst |diff| {:.2e} of the array's max magnitude",
            self.fraction(),
            self.values,
            self.worst_ulp,
            self.worst_pair.0,
            self.worst_pair.1,
            self.worst_rel
        )
    }
    fn fraction(&self) -> f64 {
        self.identical as f64 / self.values.max(1) as f64
    }
}

fn cpu_states(
    w: &Arc<DecoderWeights>,
    step: usize,
    x: &[Vec<bf16>],
    chunks: &[usize],
) -> Vec<Vec<StateArray>> {
    let hidden = w.plan.hidden_size();
    let mut b = CacheBuilder::new(w.clone(), DecoderSteps::new(step).unwrap());
    for (l, xl) in x.iter().enumerate() {
        let mut t = 0;
        for &c in chunks {
            b.feed(l, t, &xl[t * hidden..(t + c) * hidden]).unwrap();
            t += c;
        }
    }
    b.layers().iter().map(|s| s.snapshot()).collect()
}

#[cfg(feature = "cuda")]
fn gpu_states(
    m: &Arc<GpuModel>,
    step: usize,
    mode: GemmMode,
    x: &[Vec<bf16>],
    chunks: &[usize],
) -> Vec<Vec<StateArray>>{
    let hidden = m.hidden_size();
    let mut g = GpuCache::new(m.clone(), DecoderSteps::new(step).unwrap(), &CaptureOptions { gemm: mode, ..env_options() }).unwrap();
    for (l, xl) in x.iter().enumerate() {
        let mut t = 0;
        for &c in chunks {
            g.feed_host(l, t, &xl[t * hidden..(t + c) * hidden])
                .unwrap();
            t += c;
        }
    }
    (0..x.len()).map(|l| g.snapshot(l).unwrap()).collect()
}

fn compare(a: &[Vec<StateArray>], b: &[Vec<StateArray>]) -> Diff {
    let mut d = Diff::default();
    assert_eq!(a.len(), b.len());
    for (l, (la, lb)) in a.iter().zip(b).enumerate() {
        assert_eq!(la.len(), lb.len(), "layer {l}: array count");
        for (x, y) in la.iter().zip(lb) {
            d.add(&format!("layer {l} {}", x.name), x, y);
        }
    }
    d
}

#[cfg(feature = "cuda")]
fn device() -> bool {
    if !cuda::cuda_available() {
        eprintln!("SKIPPED: no CUDA driver or device on this host");
        return false;
    }
    true
}

fn inputs(w: &DecoderWeights, tokens: usize, seed: u64) -> Vec<Vec<bf16>> {
    let mut rng = common::Rng::new(seed);
    (0..w.plan.num_layers())
        .map(|_| common::random_rows(&mut rng, tokens, w.plan.hidden_size()))
        .collect()
}

/// Tiny V4 (ratios 0, 4, 128) and MLA layer sets: the exact GEMM path is bit-exact to the CPU
/// for every chunking; the tensor-core path is reported.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a CUDA GPU")]
fn tiny_layers_match_cpu() {
    #[cfg(feature = "cuda")]
    {
        if !device() {
            return;
        }
        for (name, dir) in [
            ("v4", common::v4_model_dir(11)),
            ("mla", common::mla_model_dir(12)),
        ] {
            let w = Arc::new(DecoderWeights::load(&dir).unwrap());
            let m = Arc::new(GpuModel::new(w.clone(), 0).unwrap());
            for (step, tokens) in [(16usize, 700usize), (512, 1300)] {
                let x = inputs(&w, tokens, 5 + step as u64);
                let cpu = cpu_states(&w, step, &x, &[tokens]);
                for chunks in [
                    vec![tokens],
                    vec![1, 2, 3, 250, tokens - 256],
                    vec![127, 129, 130, 7, tokens - 393],
                ] {
                    let gpu = gpu_states(&m, step, GemmMode::Exact, &x, &chunks);
                    let d = compare(&cpu, &gpu);
                    assert_eq!(
                        d.identical, d.values,
                        "{name} step {step} chunks {chunks:?}: exact GEMM path differs: {d:?}"
                    );
                }
                let gpu = gpu_states(&m, step, GemmMode::TensorCore, &x, &[tokens]);
                let d = compare(&cpu, &gpu);
                eprintln!(
                    "tiny {name} step {step} T={tokens}: exact GEMM bit-exact; tensor-core GEMM {}",
                    d.text()
                );
            }
        }
    }
}

/// The tiny layer sets with their projections quantized in every MLX mode: the exact GEMM path
/// (`gemm_exact_quant` over the dequantized GEMM) is bit-exact to the CPU's `quantized_matmul`
/// arithmetic for every chunking; the tensor-core path (one GEMM over the weights dequantized at
/// upload) is reported.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a CUDA GPU")]
fn quantized_layers_match_cpu() {
    #[cfg(feature = "cuda")]
    {
        if !device() {
            return;
        }
        for (mode, bits, group) in [("affine", 4, 32), ("affine", 3, 32), ("affine", 6, 32), ("affine", 8, 32), ("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)] {
            for (name, base) in [("v4", common::v4_model_dir(21)), ("mla", common::mla_model_dir(22))] {
                let dir = common::quantized_model_dir(&base, mode, bits, group, 23);
                let w = Arc::new(DecoderWeights::load(&dir).unwrap());
                assert!(w.formats.iter().all(|(_, f)| f != "bf16"), "{:?}", w.formats);
                let m = Arc::new(GpuModel::new(w.clone(), 0).unwrap());
                let (step, tokens) = (16usize, 700usize);
                let x = inputs(&w, tokens, 31);
                let cpu = cpu_states(&w, step, &x, &[tokens]);
                for chunks in [vec![tokens], vec![1, 2, 3, 250, tokens - 256]] {
                    let gpu = gpu_states(&m, step, GemmMode::Exact, &x, &chunks);
                    let d = compare(&cpu, &gpu);
                    assert_eq!(d.identical, d.values, "{name} {mode} {bits}-bit g{group} chunks {chunks:?}: exact GEMM path differs: {d:?}");
                }
                let gpu = gpu_states(&m, step, GemmMode::TensorCore, &x, &[tokens]);
                eprintln!("tiny {name} {mode} {bits}-bit g{group}: exact GEMM bit-exact; tensor-core GEMM {}", compare(&cpu, &gpu).text());
            }
        }
    }
}

/// DeepSeek-V4-Flash-sized (43 layers, hidden 4096, head 512, index head 128) random weights.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and a CUDA GPU")]
fn flash_sized_layers_match_cpu() {
    #[cfg(feature = "cuda")]
    {
        if !device() {
            return;
        }
        let tokens: usize = std::env::var("PD_BRIDGE_GPU_TEST_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1024);
        let step = 256;
        let t0 = std::time::Instant::now();
        let w = synthetic::v4_weights(synthetic::flash_plan(), 7);
        let m = Arc::new(GpuModel::new(w.clone(), 0).unwrap());
        let x = inputs(&w, tokens, 99);
        eprintln!(
            "flash: weights and inputs ready in {:.1}s",
            t0.elapsed().as_secs_f64()
        );
        let t1 = std::time::Instant::now();
        let cpu = cpu_states(&w, step, &x, &[tokens]);
        eprintln!(
            "flash: CPU reference for {tokens} tokens in {:.1}s",
            t1.elapsed().as_secs_f64()
        );
        let one = gpu_states(&m, step, GemmMode::Exact, &x, &[tokens]);
        let d = compare(&cpu, &one);
        eprintln!(
            "flash exact GEMM vs CPU: {:.6} identical of {} values, worst {} ulp",
            d.fraction(),
            d.values,
            d.worst_ulp
        );
        assert_eq!(
            d.identical, d.values,
            "exact GEMM path differs from the CPU reference"
        );
        let split = [300, 212, 1, tokens - 513];
        let chunked = gpu_states(&m, step, GemmMode::Exact, &x, &split);
        let d = compare(&one, &chunked);
        assert_eq!(
            d.identical, d.values,
            "exact GEMM path: chunked != one-shot"
        );
        let tc_one = gpu_states(&m, step, GemmMode::TensorCore, &x, &[tokens]);
        let d = compare(&cpu, &tc_one);
        eprintln!("flash tensor-core GEMM vs CPU: {}", d.text());
        let tc_chunked = gpu_states(&m, step, GemmMode::TensorCore, &x, &split);
        let d2 = compare(&tc_one, &tc_chunked);
        eprintln!("flash tensor-core GEMM chunked {split:?} vs one-shot: {}", d2.text());
        // Per array kind, for the README.
        for (li, name) in [(0usize, "window-only"), (2, "ratio 4"), (3, "ratio 128")] {
            for (a, b) in cpu[li].iter().zip(&tc_one[li]) {
                let mut dd = Diff::default();
                dd.add(a.name, a, b);
                if dd.values > 0 {
                    eprintln!("  layer {li} ({name}) {}: {}", a.name, dd.text());
                }
            }
        }
    }
}

/// The kernels compile for every GPU users prefill with (NVRTC at run time, so one wheel serves
/// them all): Hopper, datacenter and consumer Blackwell, and the DGX Spark's GB10 (sm_121). Only
/// the host's own architecture can be loaded and run here (the other tests do).
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and NVRTC")]
fn kernels_compile_for_every_target_arch() {
    #[cfg(feature = "cuda")]
    {
        let stack = cuda::probe();
        eprintln!("CUDA stack: {stack:?}");
        if stack.nvrtc_version.is_none() {
            eprintln!("SKIPPED: no NVRTC on this host ({:?})", stack.problems);
            return;
        }
        for arch in cuda::TARGET_ARCHS {
            let t0 = std::time::Instant::now();
            let ptx = cuda::compile_kernels(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let sm = arch.replace("compute_", "sm_");
            assert!(ptx.contains(&format!(".target {sm}")), "{arch}: no .target {sm} in the PTX");
            for k in ["gemm_exact", "norm_rope", "pool_overlap", "pool_simple", "gather_rows", "copy_rows"] {
                assert!(ptx.contains(&format!(".entry {k}")), "{arch}: no kernel {k}");
            }
            eprintln!("{arch}: {} bytes of PTX in {:?}", ptx.len(), t0.elapsed());
        }
        if device() {
            let d = cuda::GpuDevice::get(0).unwrap();
            eprintln!("loaded on {} (the other GPU tests run them)", d.name);
        }
    }
}

/// Without NVRTC's builtins library beside libnvrtc the compile fails, and the error names the
/// library and the fix (not NVRTC's bare BUILTIN_OPERATION_FAILURE). The test runs itself with a
/// library path that holds a copy of libnvrtc alone.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs --features cuda and NVRTC")]
fn a_missing_nvrtc_builtins_library_is_named_with_its_fix() {
    #[cfg(feature = "cuda")]
    {
        if std::env::var_os("PD_BRIDGE_CHILD_NO_BUILTINS").is_some() {
            let e = cuda::compile_kernels("compute_90").expect_err("compiled without the builtins library").to_string();
            assert!(e.contains("libnvrtc-builtins") && e.contains("LD_LIBRARY_PATH") && e.contains("nvidia-cuda-nvrtc"), "{e}");
            println!("CHILD-SAW: {e}");
            return;
        }
        let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let lib = dirs.split(':').filter(|d| !d.is_empty()).find_map(|d| {
            std::fs::read_dir(d).ok()?.flatten().map(|e| e.path()).find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc.so.")))
        });
        let Some(lib) = lib else {
            eprintln!("SKIPPED: no libnvrtc.so.* on LD_LIBRARY_PATH to copy alone");
            return;
        };
        let alone = common::temp_dir("nvrtc-alone");
        for name in ["libnvrtc.so", "libnvrtc.so.13"] {
            std::fs::copy(&lib, alone.join(name)).unwrap();
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_missing_nvrtc_builtins_library_is_named_with_its_fix", "--nocapture", "--test-threads=1"])
            .env("PD_BRIDGE_CHILD_NO_BUILTINS", "1")
            .env("LD_LIBRARY_PATH", &alone)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if text.contains("compiled without the builtins library") {
            eprintln!("SKIPPED: NVRTC found its builtins library outside LD_LIBRARY_PATH (the system's loader cache), so it cannot be hidden here");
            return;
        }
        assert!(out.status.success() && text.contains("CHILD-SAW:"), "{text}");
        eprintln!("{}", text.lines().find(|l| l.starts_with("CHILD-SAW")).unwrap());
    }
}
