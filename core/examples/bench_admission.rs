//! What admitting a segment costs (BlockWriter::check_segment: grid, layer count, every
//! array's shape from the plan, pool continuity, and the finite-value scan of every value), on a
//! Kimi-K2-sized MLA segment (61 layers, 256-token block, 512 + 64 wide: 18 MiB of bf16).
//!
//!     cargo run --release -p pd-bridge-core --example bench_admission
//!
//! Prints one JSON line: segment bytes, admissions per second, GB/s, the scan alone, and a plain
//! XOR pass over the same values for scale.

use std::time::Instant;

use half::bf16;
use pd_bridge_core::block::spec::first_not_finite;
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::segment::{ArrayShape, LayerHeader, LayerKind, Segment, SegmentHeader};
use pd_bridge_core::{ModelPlan, OmlxFormat};

fn main() {
    let cfg = r#"{"model_type":"kimi_k2","hidden_size":7168,"num_hidden_layers":61,"kv_lora_rank":512,"qk_rope_head_dim":64}"#;
    let plan = ModelPlan::from_config_json(cfg).unwrap();
    let (block, layers) = (256usize, 61usize);
    let mut x = 0x9E37_79B9u32;
    let mut value = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        bf16::from_f32((x % 2000) as f32 / 1000.0 - 1.0)
    };
    let mut arrays = Vec::new();
    let mut hl = Vec::new();
    for _ in 0..layers {
        arrays.push((0..block * 512).map(|_| value()).collect::<Vec<_>>());
        arrays.push((0..block * 64).map(|_| value()).collect::<Vec<_>>());
        hl.push(LayerHeader { kind: LayerKind::Kv, arrays: vec![ArrayShape { rows: block as u32, width: 512 }, ArrayShape { rows: block as u32, width: 64 }] });
    }
    let header = SegmentHeader { request_id: "bench".into(), fingerprint: "sha256:0".into(), omlx_format: OmlxFormat::Fork070.name().into(), index: 0, start: 0, end: block as u64, first_layer: 0, layers: hl };
    let seg = Segment { header, arrays: arrays.into() };
    let bytes: usize = seg.arrays.iter().map(|a| a.len() * 2).sum();
    let tokens: Vec<u32> = (0..block as u32 + 1).collect();
    let dir = std::env::temp_dir().join(format!("pd-bench-admission-{}", std::process::id()));
    let n = 200;
    let t0 = Instant::now();
    for _ in 0..n {
        let w = BlockWriter::with_format(OmlxFormat::Fork070, &dir, "m", block, &tokens).unwrap().with_plan(&plan).unwrap();
        w.check_segment(&seg).unwrap();
    }
    let dt = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..n {
        for a in &seg.arrays {
            assert!(first_not_finite(a).is_none());
        }
    }
    let scan = t1.elapsed().as_secs_f64();
    // A pass the compiler surely vectorizes (XOR of every value), for scale on a loaded machine.
    let t2 = Instant::now();
    let mut x = 0u16;
    for _ in 0..n {
        for a in &seg.arrays {
            x ^= a.iter().fold(0u16, |acc, v| acc ^ v.to_bits());
        }
    }
    let xor = t2.elapsed().as_secs_f64();
    std::hint::black_box(x);
    println!(
        "{{\"segment_bytes\": {bytes}, \"admissions_per_s\": {:.1}, \"admission_gb_per_s\": {:.2}, \"finite_scan_gb_per_s\": {:.2}, \"xor_pass_gb_per_s\": {:.2}}}",
        n as f64 / dt,
        (bytes * n) as f64 / dt / 1e9,
        (bytes * n) as f64 / scan / 1e9,
        (bytes * n) as f64 / xor / 1e9
    );
    let _ = std::fs::remove_dir_all(&dir);
}
