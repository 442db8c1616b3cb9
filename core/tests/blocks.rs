//! Blocks written from the pooler directly and from a segment that crossed the wire are the same
//! blocks; the validator accepts both.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use pd_bridge_core::block::layout::LayerView;
use pd_bridge_core::block::validate::{inspect, Expect};
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::segment::Segment;
use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights};

use common::{mla_model_dir, random_rows, temp_dir, v4_model_dir, Rng};

fn parsed(path: &std::path::Path) -> (Vec<(String, String, Vec<usize>, Vec<u8>)>, HashMap<String, String>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut m = meta.metadata().clone().unwrap();
    m.remove("created_at");
    let mut t: Vec<_> = st.tensors().into_iter().map(|(n, v)| (n, format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())).collect();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    (t, m)
}

fn check(dir: std::path::PathBuf, block: usize, blocks: usize) {
    let w = Arc::new(DecoderWeights::load(&dir).unwrap());
    let hidden = w.plan.hidden_size();
    let mut b = CacheBuilder::new(w.clone(), DecoderSteps::new(block).unwrap());
    let tokens: Vec<u32> = (0..(block * blocks + 3) as u32).collect();
    let (direct, via_wire) = (temp_dir("direct"), temp_dir("wire"));
    let wd = BlockWriter::new(&direct, "/m", block, &tokens).unwrap();
    let ws = BlockWriter::new(&via_wire, "/m", block, &tokens).unwrap();
    let mut rng = Rng::new(11);
    for k in 0..blocks {
        for layer in 0..w.plan.num_layers() {
            b.feed(layer, k * block, &random_rows(&mut rng, block, hidden)).unwrap();
        }
        let a = wd.write(k, b.layers()).unwrap();
        let views: Vec<LayerView<'_>> = b.layers().iter().map(|l| LayerView::of(l, k * block, (k + 1) * block)).collect();
        let seg = Segment::from_views(pd_bridge_core::OmlxFormat::Fork070, "r", &w.fingerprint, k as u32, (k * block) as u64, ((k + 1) * block) as u64, &views);
        let received = Segment::decode(&seg.encode()).unwrap();
        let c = ws.write_segment(&received).unwrap();
        wd.flush().unwrap();
        ws.flush().unwrap();
        assert_eq!(parsed(&a.path), parsed(&c.path), "block {k}");
        let expect = Expect { model_name: Some("/m".into()), num_layers: Some(w.plan.num_layers()), block_size: Some(block), ..Default::default() };
        assert_eq!(inspect(&a.path, &expect).unwrap().token_count, block);
        // Immutable once named: a second write leaves the file alone.
        assert!(wd.write(k, b.layers()).unwrap().existed);
    }
}

#[test]
fn v4_blocks_direct_equal_via_segments() {
    check(v4_model_dir(21), 128, 3);
}

#[test]
fn mla_blocks_direct_equal_via_segments() {
    check(mla_model_dir(22), 64, 3);
}

#[test]
fn segment_for_the_wrong_block_is_refused() {
    let dir = mla_model_dir(23);
    let w = Arc::new(DecoderWeights::load(&dir).unwrap());
    let mut b = CacheBuilder::new(w.clone(), DecoderSteps::new(64).unwrap());
    let mut rng = Rng::new(5);
    for layer in 0..2 {
        b.feed(layer, 0, &random_rows(&mut rng, 64, w.plan.hidden_size())).unwrap();
    }
    let views: Vec<LayerView<'_>> = b.layers().iter().map(|l| LayerView::of(l, 0, 64)).collect();
    let mut seg = Segment::from_views(pd_bridge_core::OmlxFormat::Fork070, "r", &w.fingerprint, 0, 0, 64, &views);
    seg.header.index = 1;
    let ws = BlockWriter::new(temp_dir("wrong"), "/m", 64, &(0..200).collect::<Vec<u32>>()).unwrap();
    assert!(ws.write_segment(&seg).unwrap_err().to_string().contains("block 1 is [64, 128)"));
}
