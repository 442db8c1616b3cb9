//! Chunked == one-shot: however attention input is cut into chunks, each layer ends in the
//! same state, for random chunkings, prompt lengths and decoder step grids.

mod common;

use std::sync::{Arc, OnceLock};

use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights, StateArray};
use proptest::prelude::*;

use common::{random_rows, v4_model_dir, mla_model_dir, Rng as TestRng, V4_HEAD, V4_INDEX_HEAD};

fn v4() -> Arc<DecoderWeights> {
    static W: OnceLock<Arc<DecoderWeights>> = OnceLock::new();
    W.get_or_init(|| Arc::new(DecoderWeights::load(v4_model_dir(1)).unwrap())).clone()
}

fn mla() -> Arc<DecoderWeights> {
    static W: OnceLock<Arc<DecoderWeights>> = OnceLock::new();
    W.get_or_init(|| Arc::new(DecoderWeights::load(mla_model_dir(2)).unwrap())).clone()
}

/// Feed `inputs[layer]` (all tokens) cut at `cuts`, return every layer's state.
fn build(w: &Arc<DecoderWeights>, step: usize, inputs: &[Vec<half::bf16>], cuts: &[usize]) -> Vec<Vec<StateArray>> {
    let hidden = w.plan.hidden_size();
    let mut b = CacheBuilder::new(w.clone(), DecoderSteps::new(step).unwrap());
    for (layer, x) in inputs.iter().enumerate() {
        let total = x.len() / hidden;
        let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > 0 && c < total).collect();
        bounds.sort();
        bounds.dedup();
        bounds.push(total);
        let mut start = 0;
        for end in bounds {
            b.feed(layer, start, &x[start * hidden..end * hidden]).unwrap();
            start = end;
        }
        assert_eq!(b.processed(layer), Some(total));
    }
    (0..inputs.len()).map(|l| b.layer(l).unwrap().snapshot()).collect()
}

fn inputs(w: &DecoderWeights, tokens: usize, seed: u64) -> Vec<Vec<half::bf16>> {
    let mut rng = TestRng::new(seed);
    (0..w.plan.num_layers()).map(|_| random_rows(&mut rng, tokens, w.plan.hidden_size())).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn v4_chunked_equals_one_shot(tokens in 1usize..700, step in prop::sample::select(vec![4usize, 64, 100, 128, 512]),
                                  cuts in prop::collection::vec(0usize..700, 0..12), seed in 0u64..1000) {
        let w = v4();
        let x = inputs(&w, tokens, seed);
        let one = build(&w, step, &x, &[]);
        let chunked = build(&w, step, &x, &cuts);
        prop_assert_eq!(one, chunked);
    }

    #[test]
    fn mla_chunked_equals_one_shot(tokens in 1usize..400, cuts in prop::collection::vec(0usize..400, 0..8), seed in 0u64..1000) {
        let w = mla();
        let x = inputs(&w, tokens, seed);
        prop_assert_eq!(build(&w, 512, &x, &[]), build(&w, 512, &x, &cuts));
    }
}

#[test]
fn single_token_chunks_equal_one_shot() {
    let w = v4();
    let x = inputs(&w, 300, 9);
    let cuts: Vec<usize> = (1..300).collect();
    assert_eq!(build(&w, 128, &x, &[]), build(&w, 128, &x, &cuts));
}

#[test]
fn state_shapes_follow_the_prompt() {
    let w = v4();
    let tokens = 301; // 301 % 4 == 1, 301 % 128 == 45
    let s = build(&w, 128, &inputs(&w, tokens, 3), &[]);
    let shape = |l: usize, n: &str| s[l].iter().find(|a| a.name == n).unwrap().shape.clone();
    assert_eq!(shape(0, "window"), vec![8, V4_HEAD]);
    assert_eq!(shape(1, "pooled"), vec![75, V4_HEAD]);
    assert_eq!(shape(1, "buf_kv"), vec![1, 2 * V4_HEAD]);
    assert_eq!(shape(1, "idx_pooled"), vec![75, V4_INDEX_HEAD]);
    assert_eq!(shape(2, "pooled"), vec![2, V4_HEAD]);
    assert_eq!(shape(2, "buf_gate"), vec![45, V4_HEAD]);
    assert_eq!(s[0].len(), 1);
}

#[test]
fn decoder_step_grid_changes_the_overlap() {
    // The ratio-4 pool restarts its overlap at each decoder call, so the grid is part of the
    // result: a different grid must give a different pool (else the grid would be untested).
    let w = v4();
    let x = inputs(&w, 256, 4);
    let a = build(&w, 128, &x, &[]);
    let b = build(&w, 64, &x, &[]);
    let pooled = |s: &Vec<Vec<StateArray>>| s[1].iter().find(|a| a.name == "pooled").unwrap().data.clone();
    assert_ne!(pooled(&a), pooled(&b));
    assert_eq!(a[2], b[2], "ratio 128 has no overlap and ignores the grid");
}
