//! `pd-bridge export-weights`: the exported directory holds exactly the attention-cache tensors,
//! reproduces the fingerprint, and computes the same cache.

mod common;

use std::sync::Arc;

use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights};

use common::{mla_model_dir, random_rows, temp_dir, v4_model_dir, Rng};

fn same_cache(a: DecoderWeights, b: DecoderWeights) {
    let mut rng = Rng::new(9);
    let hidden = a.plan.hidden_size();
    let layers = a.plan.num_layers();
    let (a, b) = (Arc::new(a), Arc::new(b));
    let steps = DecoderSteps::new(64).unwrap();
    let (mut ca, mut cb) = (CacheBuilder::new(a, steps), CacheBuilder::new(b, steps));
    for l in 0..layers {
        let x = random_rows(&mut rng, 150, hidden);
        ca.feed(l, 0, &x).unwrap();
        cb.feed(l, 0, &x).unwrap();
        assert_eq!(
            ca.layer(l).unwrap().snapshot(),
            cb.layer(l).unwrap().snapshot()
        );
    }
}

#[test]
fn exported_weights_keep_the_fingerprint_and_the_math() {
    for src in [v4_model_dir(5), mla_model_dir(6)] {
        // Unrelated tensors in the source are left behind.
        let dst = temp_dir("export");
        let fp = DecoderWeights::export(&src, &dst).unwrap();
        let original = DecoderWeights::load(&src).unwrap();
        let exported = DecoderWeights::load(&dst).unwrap();
        assert_eq!(fp, original.fingerprint);
        assert_eq!(exported.fingerprint, original.fingerprint);
        assert_eq!(
            std::fs::read_to_string(dst.join("pd-bridge-fingerprint.txt"))
                .unwrap()
                .trim(),
            fp
        );
        same_cache(original, exported);
    }
}

#[test]
fn export_of_a_broken_model_writes_nothing_and_says_why() {
    let src = v4_model_dir(7);
    std::fs::write(src.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    let dst = temp_dir("export-bad");
    let err = DecoderWeights::export(&src, &dst).unwrap_err().to_string();
    assert!(err.contains("model_type"), "{err}");
    assert!(common::files_under(&dst).is_empty());
}
