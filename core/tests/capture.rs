//! The streaming path end to end, in process: capture (any chunking, layers fed in turn) →
//! segments over the wire → assembler → block writer gives the same blocks as writing directly
//! from a full cache; the capture holds no more than a block and the window.

mod common;

use std::sync::Arc;

use pd_bridge_core::block::assembler::Assembler;
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::capture::Capture;
use pd_bridge_core::wire::Seal;
use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights};
use proptest::prelude::*;

use common::{mla_model_dir, random_rows, temp_dir, v4_model_dir, Rng};

fn run(dir: &std::path::Path, block: usize, prompt: usize, cuts: &[usize], seed: u64) {
    let w = Arc::new(DecoderWeights::load(dir).unwrap());
    let (hidden, layers) = (w.plan.hidden_size(), w.plan.num_layers());
    let mut rng = Rng::new(seed);
    let inputs: Vec<_> = (0..layers).map(|_| random_rows(&mut rng, prompt, hidden)).collect();
    let tokens: Vec<u32> = (0..prompt as u32).collect();
    let blocks = prompt / block;

    // Direct: a full cache, written block by block.
    let direct = temp_dir("direct");
    let wd = BlockWriter::new(&direct, "/m", block, &tokens).unwrap();
    let mut full = CacheBuilder::new(w.clone(), DecoderSteps::new(block).unwrap());
    let mut direct_paths = Vec::new();
    for k in 0..blocks {
        for (l, x) in inputs.iter().enumerate() {
            full.feed(l, k * block, &x[k * block * hidden..(k + 1) * block * hidden]).unwrap();
        }
        direct_paths.push(wd.write(k, full.layers()).unwrap().path);
    }
    wd.flush().unwrap();

    // Streaming: the prefill engine's chunks, each fed to every layer in turn.
    let mut cap = Capture::new(w.clone(), "req", prompt, block).unwrap();
    let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > 0 && c < prompt).collect();
    bounds.sort();
    bounds.dedup();
    bounds.push(prompt);
    let mut wire = Vec::new();
    let mut start = 0;
    for end in bounds {
        for (l, x) in inputs.iter().enumerate() {
            cap.feed(l, start, &x[start * hidden..end * hidden]).unwrap();
        }
        for seg in cap.take_ready() {
            pd_bridge_core::wire::send_segment(&mut wire, &seg).unwrap();
        }
        start = end;
    }
    let seal = cap.seal(None);
    assert_eq!(seal, Seal::Complete { blocks: blocks as u32, tokens: (blocks * block) as u64 });
    pd_bridge_core::wire::send_seal(&mut wire, &seal).unwrap();

    let streamed = temp_dir("streamed");
    let ws = BlockWriter::new(&streamed, "/m", block, &tokens).unwrap();
    let mut reader = pd_bridge_core::wire::SegmentReader::new(&wire[..], "req", &w.fingerprint);
    let mut asm = Assembler::new();
    let mut got = 0;
    loop {
        match reader.next_event().unwrap() {
            pd_bridge_core::wire::Event::Segment(seg) => {
                asm.absorb(&seg).unwrap();
                let views = asm.views(&seg).unwrap();
                let p = ws.write_views(seg.header.index as usize, &views).unwrap().path;
                ws.flush().unwrap();
                common::assert_same_block(&p, &direct_paths[got]);
                got += 1;
            }
            pd_bridge_core::wire::Event::Seal(s) => {
                assert_eq!(s, seal);
                break;
            }
        }
    }
    assert_eq!(got, blocks);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]

    #[test]
    fn v4_streamed_blocks_equal_direct(prompt in 130usize..700, cuts in prop::collection::vec(0usize..700, 0..8), seed in 0u64..100) {
        run(&v4_model_dir(31), 128, prompt, &cuts, seed);
    }

    #[test]
    fn mla_streamed_blocks_equal_direct(prompt in 65usize..400, cuts in prop::collection::vec(0usize..400, 0..8), seed in 0u64..100) {
        run(&mla_model_dir(32), 64, prompt, &cuts, seed);
    }
}

#[test]
fn segments_stay_block_sized_however_long_the_prompt() {
    // Pools travel as deltas and the capture drops what it shipped: from the third block on,
    // every segment carries exactly the same number of values (window 2 blocks' worth at most).
    let w = Arc::new(DecoderWeights::load(v4_model_dir(33)).unwrap());
    let hidden = w.plan.hidden_size();
    let mut rng = Rng::new(1);
    let mut cap = Capture::new(w.clone(), "r", 128 * 40, 128).unwrap();
    let mut sizes = Vec::new();
    for k in 0..40 {
        for l in 0..w.plan.num_layers() {
            cap.feed(l, k * 128, &random_rows(&mut rng, 128, hidden)).unwrap();
        }
        for s in cap.take_ready() {
            sizes.push(s.arrays.values());
        }
    }
    assert_eq!(sizes.len(), 40);
    assert!(sizes[2..].iter().all(|&n| n == sizes[2]), "{sizes:?}");
}

#[test]
fn aborted_capture_keeps_its_prefix() {
    let w = Arc::new(DecoderWeights::load(mla_model_dir(34)).unwrap());
    let hidden = w.plan.hidden_size();
    let mut rng = Rng::new(2);
    let mut cap = Capture::new(w.clone(), "r", 64 * 5, 64).unwrap();
    for l in 0..2 {
        cap.feed(l, 0, &random_rows(&mut rng, 150, hidden)).unwrap();
    }
    assert_eq!(cap.take_ready().len(), 2);
    assert_eq!(cap.seal(Some("client disconnected")), Seal::Aborted { blocks: 2, reason: "client disconnected".into() });
    assert!(cap.feed(0, 150, &random_rows(&mut rng, 1, hidden)).is_err());
    let mut partial = Capture::new(w, "r2", 64 * 5, 64).unwrap();
    for l in 0..2 {
        partial.feed(l, 0, &random_rows(&mut rng, 64, hidden)).unwrap();
    }
    assert!(matches!(partial.seal(None), Seal::Partial { blocks: 1, .. }));
}

/// Rows whose place in the engine's batch is checked later (on the device, by a caller that does
/// not wait for it): finished segments wait for the confirmation, go out once confirmed, and a
/// seal drops what was never confirmed, so a block computed from unchecked rows never leaves.
#[test]
fn segments_wait_for_their_rows_to_be_confirmed() {
    let w = Arc::new(DecoderWeights::load(mla_model_dir(34)).unwrap());
    let hidden = w.plan.hidden_size();
    let mut rng = Rng::new(5);
    let rows: Vec<_> = (0..2).map(|_| random_rows(&mut rng, 64 * 4, hidden)).collect();
    let feed = |cap: &mut Capture, a: usize, b: usize| {
        for (l, x) in rows.iter().enumerate() {
            cap.feed(l, a, &x[a * hidden..b * hidden]).unwrap();
        }
    };
    let mut cap = Capture::new(w.clone(), "gated", 64 * 4, 64).unwrap();
    cap.hold_until_confirmed();
    feed(&mut cap, 0, 150); // blocks 0 and 1 finish
    assert!(cap.take_ready().is_empty(), "nothing is confirmed yet");
    cap.confirm(100); // the first step's rows: block 0 only (block 1 ends at 128)
    let out = cap.take_ready();
    assert_eq!(out.iter().map(|s| s.header.index).collect::<Vec<_>>(), vec![0]);
    cap.confirm(150);
    assert_eq!(cap.take_ready().iter().map(|s| s.header.index).collect::<Vec<_>>(), vec![1]);
    feed(&mut cap, 150, 256); // blocks 2 and 3, never confirmed
    assert!(cap.take_ready().is_empty());
    assert_eq!(cap.seal(None), Seal::Aborted { blocks: 2, reason: "the rows of tokens from 150 on were never confirmed".into() });
    assert!(cap.take_ready().is_empty(), "the unconfirmed blocks were dropped, not sent after the seal");

    // Confirmed in time, the same capture is whole; a misplaced step's reason is the verdict's.
    let mut ok = Capture::new(w.clone(), "ok", 64 * 4, 64).unwrap();
    ok.hold_until_confirmed();
    feed(&mut ok, 0, 256);
    ok.confirm(256);
    assert_eq!(ok.take_ready().len(), 4);
    assert!(matches!(ok.seal(None), Seal::Complete { blocks: 4, .. }));
    let mut bad = Capture::new(w.clone(), "bad", 64 * 4, 64).unwrap();
    bad.hold_until_confirmed();
    feed(&mut bad, 0, 256);
    bad.confirm(128);
    assert_eq!(bad.take_ready().len(), 2);
    assert_eq!(bad.seal(Some("batch positions disagree")), Seal::Aborted { blocks: 2, reason: "batch positions disagree".into() });

    // Without the gate nothing waits (the default).
    let mut open = Capture::new(w, "open", 64 * 4, 64).unwrap();
    feed(&mut open, 0, 150);
    open.confirm(0);
    assert_eq!(open.take_ready().len(), 2);
}
