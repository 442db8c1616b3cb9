//! The upstream oMLX (0.6.3) block format and decoder semantics: the ratio-4 overlap carries
//! across forward calls (so the decoder's step grid no longer matters), blocks carry pooling
//! deltas with the previous window, and the streamed path writes the same files as the direct one.

mod common;

use std::sync::Arc;

use pd_bridge_core::block::assembler::Assembler;
use pd_bridge_core::block::validate::{inspect, Expect};
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::capture::Capture;
use pd_bridge_core::format::PoolLayout;
use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights, OmlxFormat, StateArray};

use common::{random_rows, temp_dir, v4_model_dir, Rng};

const UP: OmlxFormat = OmlxFormat::Upstream063;

fn feed_all(b: &mut CacheBuilder, inputs: &[Vec<half::bf16>], hidden: usize, cuts: &[usize], prompt: usize) {
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&prompt)) {
        for (l, x) in inputs.iter().enumerate() {
            b.feed(l, start, &x[start * hidden..end * hidden]).unwrap();
        }
        start = end;
    }
}

fn state(b: &CacheBuilder) -> Vec<Vec<StateArray>> {
    b.layers().iter().map(|l| l.snapshot()).collect()
}

#[test]
fn carried_overlap_makes_the_decoder_grid_irrelevant() {
    let w = Arc::new(DecoderWeights::load(&v4_model_dir(1)).unwrap());
    let (hidden, layers, prompt) = (w.plan.hidden_size(), w.plan.num_layers(), 333);
    let mut rng = Rng::new(5);
    let inputs: Vec<_> = (0..layers).map(|_| random_rows(&mut rng, prompt, hidden)).collect();
    let mut reference = CacheBuilder::new(w.clone(), DecoderSteps::for_format(UP, 64).unwrap());
    feed_all(&mut reference, &inputs, hidden, &[], prompt);
    let want = state(&reference);
    assert!(want.iter().flatten().any(|a| a.name == "prev_kv" && !a.data.is_empty()), "a ratio-4 layer carries its previous window");
    for (step, cuts) in [(128, vec![1, 2, 3, 77, 200]), (7, vec![5, 130, 131]), (1000, vec![4, 8, 332])] {
        let mut b = CacheBuilder::new(w.clone(), DecoderSteps::for_format(UP, step).unwrap());
        feed_all(&mut b, &inputs, hidden, &cuts, prompt);
        assert_eq!(state(&b), want, "grid {step}, cuts {cuts:?}");
    }
    // The fork's restart differs once a call boundary falls inside the prompt.
    let mut fork = CacheBuilder::new(w.clone(), DecoderSteps::new(64).unwrap());
    feed_all(&mut fork, &inputs, hidden, &[], prompt);
    let pooled = |s: &[Vec<StateArray>]| s.iter().flatten().filter(|a| a.name == "pooled").map(|a| a.data.clone()).collect::<Vec<_>>();
    assert_ne!(pooled(&state(&fork)), pooled(&want));
}

#[test]
fn delta_blocks_stream_identically_and_validate_only_as_upstream() {
    let w = Arc::new(DecoderWeights::load(&v4_model_dir(1)).unwrap());
    let (hidden, layers, block, blocks) = (w.plan.hidden_size(), w.plan.num_layers(), 256, 3);
    let prompt = block * blocks + 100;
    let mut rng = Rng::new(9);
    let inputs: Vec<_> = (0..layers).map(|_| random_rows(&mut rng, prompt, hidden)).collect();
    let tokens: Vec<u32> = (0..prompt as u32).collect();

    let direct = temp_dir("up-direct");
    let wd = BlockWriter::with_format(UP, &direct, "tiny", block, &tokens).unwrap();
    let mut full = CacheBuilder::new(w.clone(), DecoderSteps::for_format(UP, block).unwrap());
    let mut paths = Vec::new();
    for k in 0..blocks {
        for (l, x) in inputs.iter().enumerate() {
            full.feed(l, k * block, &x[k * block * hidden..(k + 1) * block * hidden]).unwrap();
        }
        paths.push(wd.write(k, full.layers()).unwrap().path);
    }
    wd.flush().unwrap();

    let mut cap = Capture::with_format(UP, w.clone(), "req", prompt, block).unwrap();
    let mut wire = Vec::new();
    for (start, end) in [(0, 1), (1, 300), (300, 301), (301, prompt)] {
        for (l, x) in inputs.iter().enumerate() {
            cap.feed(l, start, &x[start * hidden..end * hidden]).unwrap();
        }
        for seg in cap.take_ready() {
            assert_eq!(seg.header.omlx_format, "upstream-0.6.3");
            pd_bridge_core::wire::send_segment(&mut wire, &seg).unwrap();
        }
    }
    let streamed = temp_dir("up-streamed");
    let ws = BlockWriter::with_format(UP, &streamed, "tiny", block, &tokens).unwrap();
    let fork_writer = BlockWriter::new(temp_dir("up-fork"), "tiny", block, &tokens).unwrap();
    let mut reader = pd_bridge_core::wire::SegmentReader::new(&wire[..], "req", &w.fingerprint);
    let mut asm = Assembler::for_layout(PoolLayout::Delta);
    for k in 0..blocks {
        let pd_bridge_core::wire::Event::Segment(seg) = reader.next_event().unwrap() else { panic!("segment expected") };
        let e = fork_writer.check_segment(&seg).unwrap_err().to_string();
        assert!(e.contains("upstream-0.6.3") && e.contains("fork-0.7.0"), "{e}");
        asm.absorb(&seg).unwrap();
        let p = ws.write_views(k, &asm.views(&seg).unwrap()).unwrap().path;
        ws.flush().unwrap();
        common::assert_same_block(&p, &paths[k]);
    }

    let up = Expect { format: UP, model_name: Some("tiny".into()), num_layers: Some(layers), block_size: Some(block) };
    for p in &paths {
        assert_eq!(inspect(p, &up).unwrap().token_count, block);
        let e = inspect(p, &Expect::default()).unwrap_err();
        assert!(e.reason.contains("format version \"5\""), "{e}");
    }
    // Each block carries only its own pooled rows and the [start, end) row range.
    let bytes = std::fs::read(&paths[2]).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().as_ref().unwrap();
    let i = (0..layers)
        .find(|&i| meta.contains_key(&format!("layer_{i}_sub_1_state_class_name")) && !meta.contains_key(&format!("layer_{i}_sub_1_state_3_none")) && w.plan.num_layers() > i)
        .expect("a ratio-4 layer with a carried window");
    assert_eq!(meta[&format!("layer_{i}_sub_1_state_class_name")], "PoolingCacheDelta");
    assert_eq!(st.tensor(&format!("layer_{i}_sub_1_state_3")).unwrap().shape()[..3], [1, 1, 4]);
    let pooled = st.tensor(&format!("layer_{i}_sub_1_state_2")).unwrap();
    assert_eq!(pooled.shape()[1], block / 4);
    let range = st.tensor(&format!("layer_{i}_sub_1_state_5")).unwrap();
    let r: Vec<i64> = range.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(r, vec![(2 * block / 4) as i64, (3 * block / 4) as i64]);
    assert_eq!(meta["payload_layout"], "split_recurrent_v1");
    assert!(meta["cache_signature"].contains("\"PoolingCache:5\""), "{}", meta["cache_signature"]);

    // A signature that disagrees with the block is refused, naming the field (same length, so
    // the file stays well-formed).
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let tampered = head.replacen("\\\"block_size\\\":256", "\\\"block_size\\\":512", 1);
    assert_ne!(tampered, head);
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(tampered.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&paths[2], out).unwrap();
    let e = inspect(&paths[2], &up).unwrap_err();
    assert!(e.reason.contains("cache_signature block_size 512"), "{e}");
}
