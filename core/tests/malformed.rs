//! Malformed configs and weight files give a clear error, never a panic.

mod common;

use std::collections::BTreeMap;

use pd_bridge_core::{CoreError, DecoderWeights};
use proptest::prelude::*;
use safetensors::tensor::Dtype;

use common::*;

fn load_err(dir: &std::path::Path) -> CoreError {
    match DecoderWeights::load(dir) {
        Err(e) => e,
        Ok(_) => panic!("{} loaded", dir.display()),
    }
}

#[test]
fn missing_tensor_is_named() {
    let dir = v4_model_dir(5);
    let st = std::fs::read(dir.join("model.safetensors")).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&st).unwrap();
    let mut t = BTreeMap::new();
    for (name, view) in parsed.tensors() {
        if name != "model.layers.1.attn.compressor.ape" {
            t.insert(name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    Tensors(t).write(&dir.join("model.safetensors"));
    let e = load_err(&dir).to_string();
    assert_eq!(e, "weight model.layers.1.attn.compressor.ape: missing from the model files (compress_ratios[1] is 4, so layer 1 pools)");
}

fn with_ratios(dir: &std::path::Path, ratios: &str) {
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), cfg.replace(r#""compress_ratios":[0,4,128]"#, &format!(r#""compress_ratios":{ratios}"#))).unwrap();
}

/// The config's compress ratios and the pools the weights hold must agree, as MLX's strict load
/// demands: a window-only layer with compressor weights, a ratio-128 layer with indexer weights
/// and a pooling layer without compressor weights are all refused, naming layer and tensor.
#[test]
fn ratios_must_match_the_pools_in_the_weights() {
    let dir = v4_model_dir(9);
    with_ratios(&dir, "[0,0,128]");
    assert_eq!(
        load_err(&dir).to_string(),
        "weight model.layers.1.attn.compressor.ape: present, but compress_ratios[1] is 0, which gives layer 1 no compressor; \
         MLX refuses weights its model does not have"
    );

    let dir = v4_model_dir(9);
    with_ratios(&dir, "[4,4,128]");
    assert_eq!(
        load_err(&dir).to_string(),
        "weight model.layers.0.attn.compressor.wkv.weight: missing from the model files (compress_ratios[0] is 4, so layer 0 pools)"
    );

    // Ratio 4 and ratio 128 pools have different shapes.
    let dir = v4_model_dir(9);
    with_ratios(&dir, "[0,4,4]");
    assert!(load_err(&dir).to_string().starts_with("weight model.layers.2.attn.compressor.wkv.weight: shape [16, 32], expected [32, 32]"));

    let dir = v4_model_dir(9);
    let path = dir.join("model.safetensors");
    let st = std::fs::read(&path).unwrap();
    let mut t = BTreeMap::new();
    for (name, view) in safetensors::SafeTensors::deserialize(&st).unwrap().tensors() {
        t.insert(name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()));
    }
    t.insert("model.layers.2.attn.indexer.weights_proj.weight".into(), (Dtype::BF16, vec![4, V4_HIDDEN], vec![0; 8 * V4_HIDDEN]));
    Tensors(t).write(&path);
    assert_eq!(
        load_err(&dir).to_string(),
        "weight model.layers.2.attn.indexer.weights_proj.weight: present, but compress_ratios[2] is 128, which gives layer 2 no indexer; \
         MLX refuses weights its model does not have"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let dir = v4_model_dir(6);
    let mut t = BTreeMap::new();
    let st = std::fs::read(dir.join("model.safetensors")).unwrap();
    for (name, view) in safetensors::SafeTensors::deserialize(&st).unwrap().tensors() {
        let entry = if name == "model.layers.0.attn.kv_norm.weight" {
            (Dtype::F16, view.shape().to_vec(), view.data().to_vec())
        } else {
            (view.dtype(), view.shape().to_vec(), view.data().to_vec())
        };
        t.insert(name, entry);
    }
    Tensors(t).write(&dir.join("model.safetensors"));
    assert!(load_err(&dir).to_string().contains("model.layers.0.attn.kv_norm.weight: dtype F16"));
}

#[test]
fn mxfp8_needs_its_quantization_block() {
    let dir = v4_model_dir(7);
    let st = std::fs::read(dir.join("model.safetensors")).unwrap();
    let mut t = BTreeMap::new();
    for (name, view) in safetensors::SafeTensors::deserialize(&st).unwrap().tensors() {
        t.insert(name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()));
    }
    // An MXFP8 wkv: [16, 32/4] u32 words and [16, 1] e8m0 scales.
    t.insert("model.layers.0.attn.wkv.weight".into(), (Dtype::U32, vec![V4_HEAD, V4_HIDDEN / 4], vec![0x38; V4_HEAD * V4_HIDDEN]));
    t.insert("model.layers.0.attn.wkv.scales".into(), (Dtype::U8, vec![V4_HEAD, V4_HIDDEN / 32], vec![127; V4_HEAD]));
    Tensors(t).write(&dir.join("model.safetensors"));
    assert!(load_err(&dir).to_string().contains("gives this module no format"));

    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let with_q = cfg.replacen('{', r#"{"quantization":{"group_size":64,"bits":4,"model.layers.0.attn.wkv":{"group_size":32,"bits":8,"mode":"mxfp8"}},"#, 1);
    std::fs::write(dir.join("config.json"), &with_q).unwrap();
    let w = DecoderWeights::load(&dir).unwrap();
    match &w.layers[0] {
        pd_bridge_core::weights::LayerWeights::V4(l) => assert!(l.wkv.dequantized().iter().all(|&v| v == 1.0), "0x38 at scale 2^0 is 1.0"),
        _ => unreachable!(),
    }
    // The same bytes said to be affine: its scales are bf16 and it has biases, so it is refused
    // naming the format and what does not fit.
    let affine = with_q.replace(r#""mode":"mxfp8""#, r#""mode":"affine""#);
    std::fs::write(dir.join("config.json"), affine).unwrap();
    let e = load_err(&dir).to_string();
    assert!(e.contains("affine 8-bit g32") && e.contains("scales dtype U8"), "{e}");
}

#[test]
fn empty_directory() {
    let dir = temp_dir("empty");
    assert!(matches!(load_err(&dir), CoreError::Io { .. }));
    std::fs::write(dir.join("config.json"), r#"{"model_type":"deepseek_v3","hidden_size":8,"num_hidden_layers":1,"kv_lora_rank":8,"qk_rope_head_dim":4}"#).unwrap();
    assert!(load_err(&dir).to_string().contains("no .safetensors files"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Any truncation or byte corruption of the weight file is an error or a clean load —
    /// never a panic.
    #[test]
    fn corrupted_weight_files_never_panic(cut in 0usize..4000, flips in prop::collection::vec((0usize..4000, any::<u8>()), 0..6)) {
        let dir = v4_model_dir(8);
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        for (at, v) in flips {
            let n = bytes.len();
            bytes[at % n] = v;
        }
        bytes.truncate(bytes.len().saturating_sub(cut));
        std::fs::write(&path, &bytes).unwrap();
        let _ = DecoderWeights::load(&dir);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Arbitrary JSON never panics the config reader.
    #[test]
    fn arbitrary_config_never_panics(text in "\\PC{0,200}") {
        let _ = pd_bridge_core::ModelPlan::from_config_json(&text);
        let json = format!(r#"{{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":2,"compress_ratios":{text}}}"#);
        let _ = pd_bridge_core::ModelPlan::from_config_json(&json);
    }
}

/// Sizes no model has are refused by name before anything is sized from them (a config of
/// 4 billion layers used to be accepted and abort the process allocating per-layer state).
#[test]
fn sizes_past_any_model_are_config_errors() {
    for (field, text) in [
        ("num_hidden_layers", r#"{"model_type":"kimi_k2","hidden_size":8,"num_hidden_layers":4294967295,"kv_lora_rank":8,"qk_rope_head_dim":4}"#),
        ("kv_lora_rank", r#"{"model_type":"deepseek_v3","hidden_size":8,"num_hidden_layers":2,"kv_lora_rank":2147483648,"qk_rope_head_dim":4}"#),
        ("hidden_size", r#"{"model_type":"deepseek_v4","hidden_size":1073741824,"num_hidden_layers":2}"#),
        ("sliding_window", r#"{"model_type":"deepseek_v4","hidden_size":8,"num_hidden_layers":2,"head_dim":8,"qk_rope_head_dim":4,"index_head_dim":8,"sliding_window":4294967295}"#),
    ] {
        match pd_bridge_core::ModelPlan::from_config_json(text) {
            Err(CoreError::Config { field: f, reason }) => {
                assert_eq!(f, field, "{reason}");
                assert!(reason.contains("larger than any model"), "{reason}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
}

/// A segment header may declare arrays of any size: decoding checks every length against the
/// bytes present before allocating, so a 4-byte body declaring 2^64 bytes is a wire error.
#[test]
fn a_segment_declaring_huge_arrays_allocates_nothing() {
    let header = r#"{"request_id":"r","fingerprint":"f","index":0,"start":0,"end":1,"layers":[{"kind":"kv","arrays":[{"rows":4294967295,"width":4294967295},{"rows":1,"width":1}]}]}"#;
    let mut payload = (header.len() as u32).to_le_bytes().to_vec();
    payload.extend_from_slice(header.as_bytes());
    payload.extend_from_slice(&[0; 4]);
    let e = pd_bridge_core::segment::Segment::decode(&payload).unwrap_err();
    assert!(matches!(e, CoreError::Wire(_)), "{e}");
    assert!(e.to_string().contains("overruns the payload") || e.to_string().contains("overflows"), "{e}");
}
