//! Blocks written from the pooler directly and from a segment that crossed the wire are the same
//! blocks; the validator accepts both, against the plan too. Hostile segments (NaN, off the
//! block grid, out of order, wrong widths, wrong layer count) are refused before anything is
//! written, naming block, layer and array; hostile files on a block's name (garbage, a link, a
//! FIFO, a directory) are moved aside and the block written; links, FIFOs, linked directories
//! and misshapen blocks are refused by the validator without blocking; stale temp files of a
//! crashed writer are removed when a writer is created for the cache directory.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use std::path::Path;
use std::time::{Duration, Instant};

use pd_bridge_core::view::LayerView;
use pd_bridge_core::block::validate::{inspect, inspect_with, Expect, RejectKind, QUARANTINE_DIR};
use pd_bridge_core::block::{block_path, BlockWriter};
use pd_bridge_core::capture::Capture;
use pd_bridge_core::segment::Segment;
use pd_bridge_core::{CacheBuilder, CoreError, DecoderSteps, DecoderWeights, ModelPlan, OmlxFormat};

use common::{files_under, mla_model_dir, random_rows, temp_dir, v4_model_dir, Rng};

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
    let ws = BlockWriter::new(&via_wire, "/m", block, &tokens).unwrap().with_plan(&w.plan).unwrap();
    let mut cap = Capture::new(w.clone(), "r", tokens.len(), block).unwrap();
    let mut rng = Rng::new(11);
    for k in 0..blocks {
        for layer in 0..w.plan.num_layers() {
            let x = random_rows(&mut rng, block, hidden);
            b.feed(layer, k * block, &x).unwrap();
            cap.feed(layer, k * block, &x).unwrap();
        }
        let a = wd.write(k, b.layers()).unwrap();
        let [seg] = <[Segment; 1]>::try_from(cap.take_ready()).unwrap();
        let received = Segment::decode(&seg.encode()).unwrap();
        let c = ws.write_segment(&received).unwrap();
        wd.flush().unwrap();
        ws.flush().unwrap();
        assert_eq!(parsed(&a.path), parsed(&c.path), "block {k}");
        let expect = Expect { model_name: Some("/m".into()), num_layers: Some(w.plan.num_layers()), block_size: Some(block), ..Default::default() };
        assert_eq!(inspect(&a.path, &expect).unwrap().token_count, block);
        // Against the plan: every tensor's dtype and shape, the layer metadata.
        assert_eq!(inspect_with(&c.path, &expect, Some(&w.plan), None).unwrap().token_count, block);
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
    let views: Vec<LayerView<'_>> = b.layers().iter().map(|l| l.view(0, 64)).collect();
    let mut seg = Segment::from_views(pd_bridge_core::OmlxFormat::Fork070, "r", &w.fingerprint, 0, 0, 64, &views);
    seg.header.index = 1;
    let ws = BlockWriter::new(temp_dir("wrong"), "/m", 64, &(0..200).collect::<Vec<u32>>()).unwrap();
    let e = ws.write_segment(&seg).unwrap_err().to_string();
    assert!(e.contains("block 0 is the next one"), "{e}");
    seg.header.index = 0;
    seg.header.start = 10;
    let e = ws.write_segment(&seg).unwrap_err().to_string();
    assert!(e.contains("not its block [0, 64) on the 64-token block grid"), "{e}");
}

/// A capture's segments for `blocks` blocks of random input (fed in 100-token chunks).
struct Stream {
    w: Arc<DecoderWeights>,
    format: OmlxFormat,
    block: usize,
    tokens: Vec<u32>,
    segments: Vec<Segment>,
}

fn stream(model: std::path::PathBuf, format: OmlxFormat, block: usize, blocks: usize) -> Stream {
    let w = Arc::new(DecoderWeights::load(&model).unwrap());
    let prompt = block * blocks + 5;
    let tokens: Vec<u32> = (0..prompt as u32).collect();
    let hidden = w.plan.hidden_size();
    let mut rng = Rng::new(7);
    let inputs: Vec<_> = (0..w.plan.num_layers()).map(|_| random_rows(&mut rng, prompt, hidden)).collect();
    let mut cap = Capture::with_format(format, w.clone(), "r", prompt, block).unwrap();
    let mut segments = Vec::new();
    let mut start = 0;
    while start < prompt {
        let end = (start + 100).min(prompt);
        for (l, x) in inputs.iter().enumerate() {
            cap.feed(l, start, &x[start * hidden..end * hidden]).unwrap();
        }
        segments.extend(cap.take_ready());
        start = end;
    }
    assert_eq!(segments.len(), blocks);
    Stream { w, format, block, tokens, segments }
}

impl Stream {
    fn writer(&self, dir: &Path) -> BlockWriter {
        BlockWriter::with_format(self.format, dir, "m", self.block, &self.tokens).unwrap().with_plan(&self.w.plan).unwrap()
    }

    fn expect(&self) -> Expect {
        Expect { format: self.format, model_name: Some("m".into()), num_layers: Some(self.w.plan.num_layers()), block_size: Some(self.block) }
    }

    /// Index of layer `layer`'s first array in a segment's flat array list.
    fn first_array(&self, seg: &Segment, layer: usize) -> usize {
        seg.header.layers[..layer].iter().map(|l| l.arrays.len()).sum()
    }
}

/// The refusal of a segment: `(block, layer, array, reason)`.
fn refusal(e: CoreError) -> (u64, Option<usize>, Option<String>, String) {
    match e {
        CoreError::Segment { block, layer, array, reason } => (block, layer, array, reason),
        other => panic!("not a segment refusal: {other}"),
    }
}

fn all_streams() -> Vec<(&'static str, Stream)> {
    vec![
        ("v4 fork", stream(v4_model_dir(31), OmlxFormat::Fork070, 128, 3)),
        ("v4 upstream", stream(v4_model_dir(32), OmlxFormat::Upstream063, 128, 3)),
        ("mla", stream(mla_model_dir(33), OmlxFormat::Fork070, 64, 3)),
    ]
}

#[test]
fn hostile_segments_are_refused_before_anything_is_written() {
    for (what, s) in all_streams() {
        let dir = temp_dir("hostile");
        let w = s.writer(&dir);
        let v4 = matches!(s.w.plan, ModelPlan::DeepseekV4(_));
        let seg0 = &s.segments[0];

        let mut nan = seg0.clone();
        nan.arrays[0][5] = half::bf16::NAN;
        let (block, layer, array, why) = refusal(w.write_segment(&nan).unwrap_err());
        assert_eq!((block, layer, array.as_deref()), (0, Some(0), Some(if v4 { "window" } else { "keys" })), "{what}");
        assert!(why.contains("is NaN") && why.contains("value 5"), "{what}: {why}");

        let mut inf = seg0.clone();
        let at = s.first_array(&inf, 1) + if v4 { 3 } else { 1 };
        let target = inf.arrays[at].len() - 1;
        inf.arrays[at][target] = half::bf16::NEG_INFINITY;
        let (_, layer, array, why) = refusal(w.write_segment(&inf).unwrap_err());
        assert_eq!((layer, array.as_deref()), (Some(1), Some(if v4 { "compressor.pooled" } else { "values" })), "{what}");
        assert!(why.contains("infinite"), "{what}: {why}");

        let mut off = seg0.clone();
        off.header.start += 7;
        off.header.end += 7;
        let (_, layer, _, why) = refusal(w.write_segment(&off).unwrap_err());
        assert!(layer.is_none() && why.contains("block grid"), "{what}: {why}");

        let (block, _, _, why) = refusal(w.write_segment(&s.segments[1]).unwrap_err());
        assert!(block == 1 && why.contains("block 0 is the next one"), "{what}: {why}");

        // The same values, declared twice as wide: the decoder's window (or latent) is not.
        let mut wide = seg0.clone();
        let a = &mut wide.header.layers[0].arrays[0];
        (a.rows, a.width) = (a.rows / 2, a.width * 2);
        let (_, layer, array, why) = refusal(w.write_segment(&Segment::decode(&wide.encode()).unwrap()).unwrap_err());
        assert_eq!((layer, array.as_deref()), (Some(0), Some(if v4 { "window" } else { "keys" })), "{what}");
        assert!(why.contains("expected"), "{what}: {why}");

        let mut short = seg0.clone();
        let dropped = short.header.layers.pop().unwrap();
        short.arrays.truncate(short.arrays.len() - dropped.arrays.len());
        let (_, _, _, why) = refusal(w.write_segment(&short).unwrap_err());
        assert!(why.contains(&format!("has {} layers, the decoder has {}", s.w.plan.num_layers() - 1, s.w.plan.num_layers())), "{what}: {why}");

        let mut foreign = seg0.clone();
        foreign.header.omlx_format = if s.format == OmlxFormat::Fork070 { "upstream-0.6.3".into() } else { "fork-0.7.0".into() };
        assert!(refusal(w.write_segment(&foreign).unwrap_err()).3.contains("computed for oMLX block format"), "{what}");
        w.flush().unwrap();
        assert!(files_under(&dir).is_empty(), "{what}: a refused segment wrote {:?}", files_under(&dir));

        // Refusals changed nothing: the stream's real segments are admitted and written in order.
        for seg in &s.segments {
            w.write_segment(seg).unwrap();
        }
        w.flush().unwrap();
        for k in 0..s.segments.len() {
            let p = block_path(&dir, w.hash(k).unwrap());
            inspect_with(&p, &s.expect(), Some(&s.w.plan), Some(&dir)).unwrap_or_else(|e| panic!("{what} block {k}: {e}"));
        }
        // A pool delta that repeats rows already received (V4), or a gap, is refused.
        if v4 {
            let w2 = s.writer(&temp_dir("hostile-delta"));
            w2.write_segment(&s.segments[0]).unwrap();
            let mut again = s.segments[1].clone();
            let l1 = &mut again.header.layers[1];
            if let pd_bridge_core::segment::LayerKind::V4 { pool_starts, .. } = &mut l1.kind {
                pool_starts[0] = 0;
            }
            let (_, layer, array, why) = refusal(w2.write_segment(&again).unwrap_err());
            assert_eq!((layer, array.as_deref()), (Some(1), Some("compressor.pooled")), "{what}");
            assert!(why.contains("rows were received before it"), "{what}: {why}");
        }
    }
}

#[test]
fn a_writer_without_a_plan_holds_the_stream_to_its_first_segment() {
    let s = stream(v4_model_dir(34), OmlxFormat::Fork070, 128, 2);
    let dir = temp_dir("noplan");
    let w = BlockWriter::with_format(s.format, &dir, "m", s.block, &s.tokens).unwrap();
    w.write_segment(&s.segments[0]).unwrap();
    let mut narrow = s.segments[1].clone();
    let a = &mut narrow.header.layers[2].arrays[0];
    (a.rows, a.width) = (a.rows * 2, a.width / 2);
    let (block, layer, array, _) = refusal(w.write_segment(&Segment::decode(&narrow.encode()).unwrap()).unwrap_err());
    assert_eq!((block, layer, array.as_deref()), (1, Some(2), Some("window")));
    w.write_segment(&s.segments[1]).unwrap();
}

#[test]
fn bad_files_on_a_block_name_are_moved_aside_and_the_block_written() {
    let s = stream(v4_model_dir(35), OmlxFormat::Upstream063, 128, 4);
    let dir = temp_dir("squatted");
    let outside = temp_dir("outside").join("precious");
    std::fs::write(&outside, b"not a block, not ours").unwrap();
    let w = s.writer(&dir);
    let names: Vec<_> = (0..4).map(|k| block_path(&dir, w.hash(k).unwrap())).collect();
    for p in &names {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    }
    std::fs::write(&names[0], b"garbage on the name").unwrap();
    std::os::unix::fs::symlink(&outside, &names[1]).unwrap();
    let fifo = std::ffi::CString::new(names[2].to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    std::fs::create_dir(&names[3]).unwrap();
    let t0 = Instant::now();
    for seg in &s.segments {
        let got = w.write_segment(seg).unwrap();
        assert!(!got.existed);
    }
    w.flush().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "a FIFO on a block's name held the writer up");
    for p in &names {
        inspect_with(p, &s.expect(), Some(&s.w.plan), Some(&dir)).unwrap();
    }
    assert_eq!(std::fs::read(&outside).unwrap(), b"not a block, not ours", "the link's target was touched");
    let moved: Vec<_> = std::fs::read_dir(dir.join(QUARANTINE_DIR)).unwrap().flatten().collect();
    assert_eq!(moved.len(), 4, "{moved:?}");
    // A sound block already there is kept as it is.
    let w2 = s.writer(&dir);
    assert!(w2.write_segment(&s.segments[0]).unwrap().existed);
}

/// Run `f` on another thread; fail (rather than hang) if it has not returned within 5 s.
fn within_5s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5)).expect("the validator blocked")
}

#[test]
fn the_validator_refuses_links_fifos_and_other_directories_without_blocking() {
    let s = stream(mla_model_dir(36), OmlxFormat::Fork070, 64, 1);
    let good_dir = temp_dir("vgood");
    let w = s.writer(&good_dir);
    let good = w.write_segment(&s.segments[0]).unwrap().path;
    w.flush().unwrap();
    let name = good.file_name().unwrap().to_owned();
    let sub = good.parent().unwrap().file_name().unwrap().to_owned();
    let expect = s.expect();
    let check = move |p: std::path::PathBuf, cache: std::path::PathBuf, plan: ModelPlan| {
        let e = expect.clone();
        within_5s(move || inspect_with(&p, &e, Some(&plan), Some(&cache)).map(|_| ()))
    };

    let cache = temp_dir("vcache");
    std::fs::create_dir_all(cache.join(&sub)).unwrap();
    let on_name = cache.join(&sub).join(&name);
    std::os::unix::fs::symlink(&good, &on_name).unwrap();
    let e = check(on_name.clone(), cache.clone(), s.w.plan.clone()).unwrap_err();
    assert_eq!(e.kind, RejectKind::NotRegular, "{e}");
    assert!(e.reason.contains("symbolic link"), "{e}");
    std::fs::remove_file(&on_name).unwrap();

    let c = std::ffi::CString::new(on_name.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let e = check(on_name.clone(), cache.clone(), s.w.plan.clone()).unwrap_err();
    assert!(e.kind == RejectKind::NotRegular && e.reason.contains("FIFO"), "{e}");
    assert!(e.is_bad_file());
    std::fs::remove_file(&on_name).unwrap();

    std::fs::hard_link(&good, &on_name).unwrap();
    let e = check(on_name.clone(), cache.clone(), s.w.plan.clone()).unwrap_err();
    assert!(e.kind == RejectKind::NotRegular && e.reason.contains("hard links"), "{e}");
    std::fs::remove_file(&on_name).unwrap();

    std::fs::create_dir(&on_name).unwrap();
    let e = check(on_name.clone(), cache.clone(), s.w.plan.clone()).unwrap_err();
    assert!(e.kind == RejectKind::NotRegular && e.reason.contains("directory"), "{e}");
    std::fs::remove_dir(&on_name).unwrap();

    // The subdirectory itself a link to another directory holding a sound block.
    std::fs::remove_dir(cache.join(&sub)).unwrap();
    std::os::unix::fs::symlink(good.parent().unwrap(), cache.join(&sub)).unwrap();
    let e = check(on_name.clone(), cache.clone(), s.w.plan.clone()).unwrap_err();
    assert!(e.kind == RejectKind::Outside && !e.is_bad_file(), "{e}");
    // ... and the writer refuses to write through it.
    let w3 = s.writer(&cache);
    assert!(matches!(w3.write_segment(&s.segments[0]), Err(CoreError::Io { .. })));

    // The real file, in its own cache directory, passes.
    check(good.clone(), good_dir.clone(), s.w.plan.clone()).unwrap();
}

#[test]
fn the_validator_checks_dtypes_and_shapes_against_the_plan() {
    for (what, s) in all_streams() {
        let dir = temp_dir("vshape");
        let w = s.writer(&dir);
        let paths: Vec<_> = s.segments.iter().map(|g| w.write_segment(g).unwrap().path).collect();
        w.flush().unwrap();
        let cfg_path = dir.join("config.json");
        let other = |from: &str, to: &str| {
            let model = if what == "mla" { mla_model_dir(1) } else { v4_model_dir(1) };
            let text = std::fs::read_to_string(model.join("config.json")).unwrap();
            assert!(text.contains(from), "{from}");
            std::fs::write(&cfg_path, text.replace(from, to)).unwrap();
            ModelPlan::from_config_json(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap()
        };
        for p in &paths {
            inspect_with(p, &s.expect(), Some(&s.w.plan), None).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        let narrower = if what == "mla" { other("\"kv_lora_rank\":16", "\"kv_lora_rank\":8") } else { other("\"head_dim\":16", "\"head_dim\":8") };
        let e = inspect_with(&paths[1], &s.expect(), Some(&narrower), None).unwrap_err();
        assert_eq!(e.kind, RejectKind::Corrupt, "{what}: {e}");
        assert!(e.reason.contains("this model's block has BF16"), "{what}: {e}");
        if what != "mla" {
            let window = other("\"sliding_window\":8", "\"sliding_window\":16");
            let e = inspect_with(&paths[1], &s.expect(), Some(&window), None).unwrap_err();
            assert!(e.reason.contains("window holds"), "{what}: {e}");
        }
        if s.format == OmlxFormat::Upstream063 {
            // The delta's absolute pool-row range must be the block's.
            let mut bytes = std::fs::read(&paths[2]).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let (_, view) = st.tensors().into_iter().find(|(_, v)| v.dtype() == safetensors::Dtype::I64).unwrap();
            let at = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
            drop(st);
            bytes[at] ^= 1;
            std::fs::write(&paths[2], &bytes).unwrap();
            let e = inspect_with(&paths[2], &s.expect(), Some(&s.w.plan), None).unwrap_err();
            assert!(e.reason.contains("holds pool rows"), "{what}: {e}");
        }
    }
}

fn dead_pid() -> u32 {
    (100_000..4_000_000u32).rev().step_by(7919).find(|&p| unsafe { libc::kill(p as i32, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)).unwrap()
}

#[test]
fn stale_temp_files_of_a_crashed_writer_are_removed_at_start() {
    let dir = temp_dir("stale");
    let sub = dir.join("a");
    std::fs::create_dir_all(&sub).unwrap();
    let hex = "a".repeat(64);
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    let put = |name: String, aged: bool| {
        let p = sub.join(name);
        let f = std::fs::File::create(&p).unwrap();
        if aged {
            f.set_modified(old).unwrap();
        }
        p
    };
    let dead = dead_pid();
    let gone = [
        put(format!(".{hex}.{dead}.0.pd-tmp"), true),
        put(format!(".{hex}.{}.99999.pd-tmp", std::process::id()), false),
        put(format!(".{hex}.1.3.pd-tmp"), true),
    ];
    let kept = [
        put(format!(".{hex}.{dead}.1.pd-tmp"), false),
        put(format!(".{hex}.1.4.pd-tmp"), false),
        put(format!("{hex}_tmp.safetensors"), true),
        put(".x.pd-tmp".to_string(), true),
        put(format!(".{hex}.x.1.pd-tmp"), true),
    ];
    let _w = BlockWriter::new(&dir, "m", 64, &[1, 2, 3]).unwrap();
    for p in &gone {
        assert!(!p.exists(), "{} was not removed", p.display());
    }
    for p in &kept {
        assert!(p.exists(), "{} was removed", p.display());
    }
}

