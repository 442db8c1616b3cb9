//! A compressor `ape` stored as bf16 (as a converter that casts every float leaves it) loads and
//! pools exactly as oMLX computes with it: widened to f32 for the simple pool's f32 softmax
//! input (MLX promotes bf16 + f32 to f32) and used as is by the overlap pool's bf16 add.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use half::bf16;
use pd_bridge_core::weights::LayerWeights;
use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights, StateArray};
use safetensors::tensor::Dtype;

use common::*;

/// Rewrite every `ape` of the model in `dir`: `to_bf16` stores it as bf16, otherwise as f32
/// holding the same (bf16-rounded) values.
fn rewrite_ape(dir: &Path, to_bf16: bool) {
    let path = dir.join("model.safetensors");
    let st = std::fs::read(&path).unwrap();
    let mut t = BTreeMap::new();
    for (name, view) in safetensors::SafeTensors::deserialize(&st).unwrap().tensors() {
        let entry = if name.ends_with(".ape") {
            assert_eq!(view.dtype(), Dtype::F32);
            let rounded = view.data().chunks_exact(4).map(|b| bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            let data: Vec<u8> = if to_bf16 { rounded.flat_map(|v| v.to_le_bytes()).collect() } else { rounded.flat_map(|v| v.to_f32().to_le_bytes()).collect() };
            (if to_bf16 { Dtype::BF16 } else { Dtype::F32 }, view.shape().to_vec(), data)
        } else {
            (view.dtype(), view.shape().to_vec(), view.data().to_vec())
        };
        t.insert(name, entry);
    }
    Tensors(t).write(&path);
}

fn states(w: &Arc<DecoderWeights>, x: &[Vec<bf16>]) -> Vec<Vec<StateArray>> {
    let mut b = CacheBuilder::new(w.clone(), DecoderSteps::new(64).unwrap());
    for (layer, rows) in x.iter().enumerate() {
        b.feed(layer, 0, rows).unwrap();
    }
    (0..x.len()).map(|l| b.layer(l).unwrap().snapshot()).collect()
}

#[test]
fn bf16_ape_pools_as_its_f32_widening() {
    let (a, b) = (v4_model_dir(11), v4_model_dir(11));
    rewrite_ape(&a, true);
    rewrite_ape(&b, false);
    let wa = Arc::new(DecoderWeights::load(&a).unwrap());
    let wb = Arc::new(DecoderWeights::load(&b).unwrap());
    for (la, lb) in wa.layers.iter().zip(&wb.layers) {
        let (LayerWeights::V4(la), LayerWeights::V4(lb)) = (la, lb) else { unreachable!() };
        for (ca, cb) in [(&la.compressor, &lb.compressor), (&la.indexer, &lb.indexer)] {
            if let (Some(ca), Some(cb)) = (ca, cb) {
                assert_eq!(ca.ape, cb.ape, "a bf16 ape widens exactly");
            }
        }
    }
    // The fingerprint covers the bytes as stored: same values, different dtype, different hash.
    assert_ne!(wa.fingerprint, wb.fingerprint);
    let mut rng = Rng::new(3);
    // 300 tokens: two ratio-128 windows and 75 ratio-4 windows, over several decoder steps.
    let x: Vec<Vec<bf16>> = (0..3).map(|_| random_rows(&mut rng, 300, V4_HIDDEN)).collect();
    let (sa, sb) = (states(&wa, &x), states(&wb, &x));
    assert!(sa.iter().flatten().any(|s| s.name == "pooled" && !s.data.is_empty()));
    assert_eq!(sa, sb);
}

#[test]
fn other_ape_dtypes_are_refused_by_name() {
    let dir = v4_model_dir(12);
    let path = dir.join("model.safetensors");
    let st = std::fs::read(&path).unwrap();
    let mut t = BTreeMap::new();
    for (name, view) in safetensors::SafeTensors::deserialize(&st).unwrap().tensors() {
        let dt = if name == "model.layers.2.attn.compressor.ape" { Dtype::I32 } else { view.dtype() };
        t.insert(name, (dt, view.shape().to_vec(), view.data().to_vec()));
    }
    Tensors(t).write(&path);
    let e = DecoderWeights::load(&dir).unwrap_err().to_string();
    assert_eq!(e, "weight model.layers.2.attn.compressor.ape: dtype I32 is not supported (F32 or BF16, as oMLX loads it)");
}
