//! DeepSeek-V4.1's cache math on a tiny random model: chunked == one-shot for any chunking,
//! resuming from a carry state == never stopping, and the loader's refusals. (Bit-exactness
//! against mlx-lm itself is `tests/decode/test_parity_v41.py`.)

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use half::bf16;
use pd_bridge_core::error::CarryField;
use pd_bridge_core::family::v41::{V41Array, V41Carry, V41CacheBuilder, V41Weights};
use pd_bridge_core::CoreError;
use proptest::prelude::*;
use safetensors::tensor::Dtype;

use common::{random_rows, temp_dir, Rng, Tensors};

const HIDDEN: usize = 64;
const HEAD: usize = 128;
const INDEX_HEAD: usize = 64;
const WINDOW: usize = 16;

/// Layers: 0 window-only; 1 ratio-2 KV + index source; 2 ratio-2 consumer; 3 ratio-1 KV + index
/// source; 4 ratio-1 KV source only.
fn config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "deepseek_v41",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 5,
        "head_dim": HEAD,
        "qk_rope_head_dim": 32,
        "index_head_dim": INDEX_HEAD,
        "sliding_window": WINDOW,
        "compress_ratios": [0, 2, 2, 1, 1, 0],
        "kv_source_layer_ids": [1, 3, 4],
        "index_source_layer_ids": [1, 2, 3],
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    })
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A model directory; `tweak` may change the tensors before they are written.
fn model_dir(seed: u64, tweak: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) -> PathBuf {
    let dir = temp_dir("v41");
    let mut rng = Rng::new(seed);
    let mut t = BTreeMap::new();
    let mat = |rng: &mut Rng, out: usize, inp: usize| -> Vec<f32> { (0..out * inp).map(|_| rng.normal() * (inp as f32).powf(-0.5)).collect() };
    let norm = |rng: &mut Rng, n: usize| -> Vec<f32> { (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect() };
    let sources = [(1, 2, true), (3, 1, true), (4, 1, false)];
    for i in 0..5 {
        let pre = format!("model.layers.{i}.self_attn");
        t.insert(format!("{pre}.kv_proj.weight"), (Dtype::BF16, vec![HEAD, HIDDEN], common::bf16_bytes(mat(&mut rng, HEAD, HIDDEN))));
        t.insert(format!("{pre}.kv_norm.weight"), (Dtype::BF16, vec![HEAD], common::bf16_bytes(norm(&mut rng, HEAD))));
        if let Some(&(_, ratio, index)) = sources.iter().find(|s| s.0 == i) {
            t.insert(format!("{pre}.compressor.kv_proj.weight"), (Dtype::F32, vec![HEAD, HIDDEN], f32_bytes(mat(&mut rng, HEAD, HIDDEN))));
            if ratio == 2 {
                t.insert(format!("{pre}.compressor.gate_proj.weight"), (Dtype::F32, vec![HEAD, HIDDEN], f32_bytes(mat(&mut rng, HEAD, HIDDEN))));
            }
            t.insert(format!("{pre}.compressor.kv_norm.weight"), (Dtype::F32, vec![HEAD], f32_bytes(norm(&mut rng, HEAD))));
            if index {
                t.insert(format!("{pre}.indexer.k_proj.weight"), (Dtype::BF16, vec![INDEX_HEAD, HEAD], common::bf16_bytes(mat(&mut rng, INDEX_HEAD, HEAD))));
                t.insert(format!("{pre}.indexer.k_norm.weight"), (Dtype::BF16, vec![INDEX_HEAD], common::bf16_bytes(norm(&mut rng, INDEX_HEAD))));
            }
        }
    }
    tweak(&mut t);
    Tensors(t).write(&dir.join("model.safetensors"));
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&config()).unwrap()).unwrap();
    dir
}

fn weights() -> Arc<V41Weights> {
    static W: OnceLock<Arc<V41Weights>> = OnceLock::new();
    W.get_or_init(|| Arc::new(V41Weights::load(model_dir(5, |_| {})).unwrap())).clone()
}

fn inputs(tokens: usize, seed: u64) -> Vec<Vec<bf16>> {
    let mut rng = Rng::new(seed);
    (0..5).map(|_| random_rows(&mut rng, tokens, HIDDEN)).collect()
}

/// Feed every layer's rows `[from, to)` cut at `cuts`.
fn feed(b: &mut V41CacheBuilder, x: &[Vec<bf16>], from: usize, to: usize, cuts: &[usize]) {
    for (layer, rows) in x.iter().enumerate() {
        let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > from && c < to).collect();
        bounds.sort();
        bounds.dedup();
        bounds.push(to);
        let mut start = from;
        for end in bounds {
            b.feed(layer, start, &rows[start * HIDDEN..end * HIDDEN]).unwrap();
            start = end;
        }
        assert_eq!(b.processed(layer), Some(to));
    }
}

fn state(b: &V41CacheBuilder) -> Vec<Vec<V41Array>> {
    (0..b.num_layers()).map(|l| b.layer(l).unwrap().snapshot()).collect()
}

fn build(x: &[Vec<bf16>], tokens: usize, cuts: &[usize]) -> Vec<Vec<V41Array>> {
    let mut b = V41CacheBuilder::new(weights());
    feed(&mut b, x, 0, tokens, cuts);
    state(&b)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, .. ProptestConfig::default() })]

    #[test]
    fn chunked_equals_one_shot(tokens in 1usize..200, cuts in prop::collection::vec(0usize..200, 0..12), seed in 0u64..1000) {
        let x = inputs(tokens, seed);
        prop_assert_eq!(build(&x, tokens, &[]), build(&x, tokens, &cuts));
    }

    /// Stop anywhere, carry the state over its bytes, resume in a new builder (re-feeding rows
    /// from before the resume point, which it skips), and end where an uninterrupted build ends:
    /// the pools from the resume point's group on, everything else whole.
    #[test]
    fn resumed_equals_uninterrupted(tokens in 2usize..160, at in 1usize..160, cuts in prop::collection::vec(0usize..160, 0..6), seed in 0u64..1000) {
        let at = at.min(tokens - 1);
        let x = inputs(tokens, seed);
        let whole = build(&x, tokens, &[]);
        let mut first = V41CacheBuilder::new(weights());
        feed(&mut first, &x, 0, at, &cuts);
        let bytes = first.carry().unwrap().encode();
        let mut resumed = V41CacheBuilder::resume(weights(), &V41Carry::decode(&bytes).unwrap()).unwrap();
        prop_assert_eq!(resumed.origin(), at);
        // The prefill engine may recompute from further back: the rows before `at` are skipped.
        let back = at.saturating_sub(3);
        feed(&mut resumed, &x, back, tokens, &cuts);
        for (layer, (got, want)) in state(&resumed).iter().zip(&whole).enumerate() {
            prop_assert_eq!(got.len(), want.len());
            let ratio = weights().plan.layer_kind(layer).ratio.max(1);
            for (g, w) in got.iter().zip(want) {
                let tail = if matches!(g.name, "compress_kv" | "index_k") { at / ratio } else { 0 };
                prop_assert_eq!(g.name, w.name);
                prop_assert_eq!(&g.shape[1..], &w.shape[1..]);
                prop_assert_eq!(g.shape[0] + tail, w.shape[0], "layer {} {}", layer, g.name);
                let (pd_bridge_core::family::v41::V41Data::F32(gv), pd_bridge_core::family::v41::V41Data::F32(wv)) = (&g.data, &w.data) else {
                    prop_assert_eq!(&g.data, &w.data);
                    continue;
                };
                let width = g.shape[1];
                prop_assert!(gv.iter().map(|v| v.to_bits()).eq(wv[tail * width..].iter().map(|v| v.to_bits())), "layer {} {}", layer, g.name);
            }
        }
    }
}

#[test]
fn single_token_chunks_equal_one_shot() {
    let x = inputs(75, 3);
    let cuts: Vec<usize> = (1..75).collect();
    assert_eq!(build(&x, 75, &[]), build(&x, 75, &cuts));
}

#[test]
fn state_follows_the_layer_kinds() {
    let x = inputs(37, 4);
    let s = build(&x, 37, &[]);
    let shapes = |l: usize| s[l].iter().map(|a| (a.name, a.dtype(), a.shape.clone())).collect::<Vec<_>>();
    assert_eq!(shapes(0), vec![("window", "bfloat16", vec![WINDOW, HEAD])]);
    assert_eq!(
        shapes(1),
        vec![
            ("window", "bfloat16", vec![WINDOW, HEAD]),
            ("compress_kv", "float32", vec![18, HEAD]),
            ("index_k", "float32", vec![18, INDEX_HEAD]),
            ("pending_kv", "float32", vec![1, HEAD]),
            ("pending_gate", "float32", vec![1, HEAD]),
        ]
    );
    assert_eq!(shapes(2), vec![("window", "bfloat16", vec![WINDOW, HEAD])], "a consumer keeps only its window");
    assert_eq!(shapes(3), vec![("window", "bfloat16", vec![WINDOW, HEAD]), ("compress_kv", "float32", vec![37, HEAD]), ("index_k", "float32", vec![37, INDEX_HEAD])]);
    assert_eq!(shapes(4), vec![("window", "bfloat16", vec![WINDOW, HEAD]), ("compress_kv", "float32", vec![37, HEAD])]);
    // Fake-quantized: every compressed value is an FP4 magnitude times its block's E4M3 scale,
    // so a 16-value block holds few distinct magnitudes.
    let pd_bridge_core::family::v41::V41Data::F32(ckv) = &s[3][1].data else { panic!() };
    for block in ckv.chunks(16) {
        let mut mags: Vec<u32> = block.iter().map(|v| v.abs().to_bits()).collect();
        mags.sort();
        mags.dedup();
        assert!(mags.len() <= 8, "{mags:?}");
    }
}

#[test]
fn chunks_must_be_contiguous() {
    let x = inputs(10, 1);
    let mut b = V41CacheBuilder::new(weights());
    b.feed(0, 0, &x[0][..4 * HIDDEN]).unwrap();
    let e = b.feed(0, 5, &x[0][5 * HIDDEN..]).unwrap_err();
    assert!(e.to_string().contains("chunk starts at token 5 but 4 tokens are processed"), "{e}");
    assert!(b.feed(0, 4, &x[0][..HIDDEN - 1]).is_err());
    assert!(b.feed(9, 0, &x[0]).is_err());
}

#[test]
fn carry_states_that_do_not_fit_are_refused_by_name() {
    let x = inputs(9, 2);
    let mut b = V41CacheBuilder::new(weights());
    for (l, rows) in x.iter().enumerate().take(4) {
        b.feed(l, 0, rows).unwrap();
    }
    assert!(b.carry().is_err(), "layer 4 has processed nothing");
    b.feed(4, 0, &x[4]).unwrap();
    let c = b.carry().unwrap();
    let what = |c: &V41Carry| match V41CacheBuilder::resume(weights(), c) {
        Err(CoreError::Carry { what, .. }) => what,
        other => panic!("{:?}", other.map(|_| ())),
    };
    let mut other = c.clone();
    other.fingerprint = "sha256:00".into();
    assert_eq!(what(&other), CarryField::Fingerprint);
    let mut short = c.clone();
    short.layers[1].pending_kv.clear();
    assert_eq!(what(&short), CarryField::Position);
    let mut moved = c.clone();
    moved.position = 10;
    assert_eq!(what(&moved), CarryField::Position);
    let mut fewer = c.clone();
    fewer.layers.pop();
    assert_eq!(what(&fewer), CarryField::Plan);
    assert!(V41CacheBuilder::resume(weights(), &c).is_ok());
}

#[test]
fn the_loader_refuses_what_mlx_lm_would_compute_otherwise() {
    // A bf16 compressor: mlx-lm keeps it float32, and a ratio-1 pool would run in bf16.
    let dir = model_dir(6, |t| {
        let name = "model.layers.3.self_attn.compressor.kv_proj.weight".to_string();
        let (_, shape, data) = t.remove(&name).unwrap();
        let v: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        t.insert(name, (Dtype::BF16, shape, common::bf16_bytes(v)));
    });
    let e = V41Weights::load(&dir).unwrap_err().to_string();
    assert!(e.contains("compressor.kv_proj") && e.contains("float32"), "{e}");
    let dir = model_dir(6, |t| {
        t.remove("model.layers.1.self_attn.compressor.gate_proj.weight");
    });
    let e = V41Weights::load(&dir).unwrap_err().to_string();
    assert!(e.contains("gate_proj") && e.contains("KV source with compress ratio 2"), "{e}");
    // Another model's weights fingerprint differently.
    let a = V41Weights::load(model_dir(7, |_| {})).unwrap();
    assert_ne!(a.fingerprint, weights().fingerprint);
    assert_eq!(V41Weights::load(model_dir(5, |_| {})).unwrap().fingerprint, weights().fingerprint);
}
